//! Client-supplied key routes (`/v1/keys`): consume, result, release and
//! read. Handlers parse, call the ledger, and shape the answer; nothing else.

use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use utoipa::ToSchema;

use super::error::{ApiError, Code};
use super::extract::{BodyLimit, Caller, JsonBody};
use super::tokens::{rfc3339, OutcomeResponse, REPLAYED};
use super::AppState;
use crate::domain::key::ClientKey;
use crate::domain::{BizType, Fingerprint, RequestId, Subject};
use crate::ledger::{ConsumeAnswer, KeyInput, ResultAnswer};

fn key_not_found() -> ApiError {
    ApiError::new(
        Code::KeyNotFound,
        "no consume of this key is known (never consumed, or forgotten after retention)",
    )
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyConsumeRequest {
    /// `[a-z][a-z0-9-]{0,31}`, configured under `[biz.<name>]`.
    #[schema(example = "order")]
    pub biz_type: String,
    /// The client's key: 1 to 255 printable ASCII characters. It belongs to
    /// (this client, biz type): another client's equal key is another key.
    #[schema(example = "8e03978e-40d5-43e8-bc93-6894a57f9324")]
    pub key: String,
    /// Recorded for audit; every consume of the key that names a subject
    /// must name the one it was created with (else 403 token_mismatch).
    #[schema(example = "user-42")]
    pub subject: Option<String>,
    /// A hash of the business request: a consume with another fingerprint than the winner's is 422.
    #[schema(example = "sha256:9f2c")]
    pub fingerprint: Option<String>,
    /// This attempt's id: a retry with the winner's id answers `consumed` again.
    #[schema(example = "req-7f3a")]
    pub request_id: Option<String>,
    /// 0 to 10000 (default 0): a consume that would answer `duplicate` /
    /// `processing` waits this long for the winner's result or release.
    #[schema(example = 2000, minimum = 0, maximum = 10000)]
    pub wait_ms: Option<u64>,
}
impl BodyLimit for KeyConsumeRequest {}

impl KeyConsumeRequest {
    fn parse(&self) -> Result<KeyInput, ApiError> {
        Ok(KeyInput {
            biz_type: BizType::parse(&self.biz_type)?,
            key: ClientKey::parse(&self.key)?,
            subject: self.subject.as_deref().map(Subject::parse).transpose()?,
            fingerprint: self
                .fingerprint
                .as_deref()
                .map(Fingerprint::parse)
                .transpose()?,
            request_id: self
                .request_id
                .as_deref()
                .map(RequestId::parse)
                .transpose()?,
        })
    }
}

/// `consumed` (first use, or a retry of the winning request) or `duplicate`.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum KeyConsumeResponse {
    Consumed {
        /// `consumed`
        #[schema(example = "consumed")]
        outcome: &'static str,
        key: String,
        #[schema(value_type = String, format = DateTime)]
        consumed_at: String,
    },
    Duplicate {
        /// `duplicate`
        #[schema(example = "duplicate")]
        outcome: &'static str,
        /// `processing` (no result yet), `completed` or `uncertain` (no
        /// result past the biz type's processing lease).
        #[schema(value_type = crate::ledger::DuplicateStatus)]
        status: &'static str,
        #[schema(value_type = Option<String>, format = DateTime)]
        consumed_at: Option<String>,
        /// Any JSON value (object, array, string, number, boolean).
        #[schema(schema_with = crate::http::schema::any_json_or_null)]
        result: Option<Json>,
    },
}

fn consume_response(key: &str, answer: ConsumeAnswer) -> HttpResponse {
    match answer {
        ConsumeAnswer::Consumed {
            consumed_at,
            replayed,
        } => {
            let mut resp = HttpResponse::Ok();
            if replayed {
                resp.insert_header((REPLAYED, "true"));
            }
            resp.json(KeyConsumeResponse::Consumed {
                outcome: "consumed",
                key: key.to_owned(),
                consumed_at: rfc3339(consumed_at),
            })
        }
        ConsumeAnswer::Duplicate {
            status,
            consumed_at,
            result,
        } => HttpResponse::Ok().insert_header((REPLAYED, "true")).json(
            KeyConsumeResponse::Duplicate {
                outcome: "duplicate",
                status: status.as_str(),
                consumed_at: consumed_at.map(rfc3339),
                result,
            },
        ),
    }
}

/// Consume a client-supplied key: its first consume creates it, and exactly one attempt ever answers `consumed`.
#[utoipa::path(post, path = "/v1/keys/consume", operation_id = "consumeKey", tag = "keys", request_body(content = KeyConsumeRequest, example = json!({"biz_type": "order", "key": "checkout-7f3a", "subject": "user-42", "fingerprint": "sha256:9f2c", "request_id": "req-7f3a"})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "consumed, or duplicate (with Idempotent-Replayed: true); a retry with the winning request_id answers consumed with the header", body = KeyConsumeResponse, example = json!({"outcome": "duplicate", "status": "processing", "consumed_at": "2026-12-02T07:30:05Z", "result": null})),
        (status = 400, description = "invalid_request (a key that is not 1 to 255 printable ASCII characters, among others)", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden, token_mismatch (another subject than the key's)", body = super::ErrorBody),
        (status = 422, description = "fingerprint_mismatch, unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
        (status = 503, description = "unavailable (with Retry-After); nothing changed. Fast biz types need Redis", body = super::ErrorBody),
    ))]
pub async fn consume(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<KeyConsumeRequest>,
) -> Result<HttpResponse, ApiError> {
    let input = body.parse()?;
    let wait = super::tokens::wait_of(body.wait_ms)?;
    let answer = state
        .ledger
        .consume_key_waiting(&caller, &input, wait)
        .await?;
    Ok(consume_response(input.key.as_str(), answer))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyResultRequest {
    #[schema(example = "order")]
    pub biz_type: String,
    pub key: String,
    /// Any JSON value (object, array, string, number, boolean, null);
    /// replayed to later duplicates.
    pub result: Json,
    /// The `request_id` of the consume this call belongs to (optional):
    /// when given, it applies only while that consume holds the key; after
    /// a release and another consume, 409 (`not_consumed` / `not_releasable`)
    /// instead of acting on the other attempt's consume.
    #[schema(example = "req-881", min_length = 1, max_length = 128)]
    #[serde(default)]
    pub request_id: Option<String>,
}
impl BodyLimit for KeyResultRequest {
    const LIMIT: usize = 64 * 1024;
}

/// Record the business result of a consumed key.
#[utoipa::path(post, path = "/v1/keys/result", operation_id = "recordKeyResult", tag = "keys", request_body(content = KeyResultRequest, example = json!({"biz_type": "order", "key": "checkout-7f3a", "result": {"payment_id": "pay-881", "status": "succeeded"}})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "recorded (the same result again: recorded, with Idempotent-Replayed: true)", body = OutcomeResponse, example = json!({"outcome": "recorded"})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden", body = super::ErrorBody),
        (status = 409, description = "result_already_set, not_consumed", body = super::ErrorBody),
        (status = 413, description = "payload_too_large (64 KiB)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
        (status = 503, description = "unavailable (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn result(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<KeyResultRequest>,
) -> Result<HttpResponse, ApiError> {
    let biz = BizType::parse(&body.biz_type)?;
    let key = ClientKey::parse(&body.key)?;
    let of_request = body
        .request_id
        .as_deref()
        .map(RequestId::parse)
        .transpose()?;
    if crate::domain::json_holds_nul(&body.result) {
        return Err(ApiError::invalid(
            "`result` may not hold U+0000 in any string or key (Postgres cannot store it)",
        ));
    }
    let answer = state
        .ledger
        .record_key_result(&caller, &biz, &key, &body.result, of_request.as_ref())
        .await?;
    let mut resp = HttpResponse::Ok();
    if answer == ResultAnswer::AlreadyRecorded {
        resp.insert_header((REPLAYED, "true"));
    }
    Ok(resp.json(OutcomeResponse {
        outcome: "recorded",
    }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct KeyReleaseRequest {
    #[schema(example = "order")]
    pub biz_type: String,
    pub key: String,
    /// The `request_id` of the consume this call belongs to (optional):
    /// when given, it applies only while that consume holds the key; after
    /// a release and another consume, 409 (`not_consumed` / `not_releasable`)
    /// instead of acting on the other attempt's consume.
    #[schema(example = "req-881", min_length = 1, max_length = 128)]
    #[serde(default)]
    pub request_id: Option<String>,
}
impl BodyLimit for KeyReleaseRequest {}

/// Give a consumed key back (the business step failed before any side effect): it can be consumed again.
#[utoipa::path(post, path = "/v1/keys/release", operation_id = "releaseKey", tag = "keys", request_body(content = KeyReleaseRequest, example = json!({"biz_type": "order", "key": "checkout-7f3a"})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "released", body = OutcomeResponse, example = json!({"outcome": "released"})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden", body = super::ErrorBody),
        (status = 409, description = "not_releasable (not consumed, or it has a result)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
        (status = 503, description = "unavailable (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn release(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<KeyReleaseRequest>,
) -> Result<HttpResponse, ApiError> {
    let biz = BizType::parse(&body.biz_type)?;
    let key = ClientKey::parse(&body.key)?;
    let of_request = body
        .request_id
        .as_deref()
        .map(RequestId::parse)
        .transpose()?;
    state
        .ledger
        .release_key(&caller, &biz, &key, of_request.as_ref())
        .await?;
    Ok(HttpResponse::Ok().json(OutcomeResponse {
        outcome: "released",
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct KeyQuery {
    /// The biz type (required: 400 without it).
    #[param(required = true, value_type = String, example = "order")]
    pub biz_type: Option<String>,
    /// The key (URL-encoded; required: 400 without it).
    #[param(required = true, value_type = String, example = "checkout-7f3a")]
    pub key: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct KeyStateResponse {
    pub key: String,
    pub biz_type: String,
    /// `issued` (released, consumable again) or `consumed`.
    #[schema(example = "consumed")]
    pub state: &'static str,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub consumed_at: Option<String>,
    /// Any JSON value, as recorded.
    #[schema(schema_with = crate::http::schema::any_json_or_null)]
    pub result: Option<Json>,
}

/// Read a key's state (this client's key): never consumes, never counts as a duplicate.
#[utoipa::path(get, path = "/v1/keys", operation_id = "getKeyState", tag = "keys", params(KeyQuery),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The key's state", body = KeyStateResponse, example = json!({"key": "checkout-7f3a", "biz_type": "order", "state": "consumed", "consumed_at": "2026-12-02T07:30:05Z", "result": null})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden", body = super::ErrorBody),
        (status = 404, description = "key_not_found (never consumed, or forgotten after retention)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
        (status = 503, description = "unavailable (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn get(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    query: Result<web::Query<KeyQuery>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|_| ApiError::invalid("query must be ?biz_type=...&key=..."))?;
    let biz = BizType::parse(
        query
            .biz_type
            .as_deref()
            .ok_or_else(|| ApiError::invalid("`biz_type` is required"))?,
    )?;
    let key = ClientKey::parse(
        query
            .key
            .as_deref()
            .ok_or_else(|| ApiError::invalid("`key` is required"))?,
    )?;
    let found = state
        .ledger
        .key_state(&caller, &biz, &key)
        .await?
        .ok_or_else(key_not_found)?;
    Ok(HttpResponse::Ok().json(KeyStateResponse {
        key: key.as_str().to_owned(),
        biz_type: biz.to_string(),
        state: found.label(),
        consumed_at: found.consumed_at.map(rfc3339),
        result: found.result,
    }))
}
