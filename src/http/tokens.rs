//! Token routes: issue (and the seed's alias), consume, result, release, and
//! reading a token's state.
//! Handlers parse, call the ledger, and shape the answer; nothing else.

use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{BodyLimit, Caller, JsonBody};
use super::AppState;
use crate::domain::{BizType, Fingerprint, RequestId, Subject};
use crate::ledger::{ConsumeAnswer, ConsumeInput, ResultAnswer, TokenReading};
use crate::token::MAX_TOKEN_LEN;

pub const REPLAYED: &str = "Idempotent-Replayed";

pub use crate::admin::time as rfc3339;

/// A token in a path: too long or ill-formed is `token_invalid` before anything else.
pub fn path_token(raw: &str) -> Result<&str, ApiError> {
    if raw.is_empty() || raw.len() > MAX_TOKEN_LEN {
        return Err(ApiError::token_invalid());
    }
    Ok(raw)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IssueRequest {
    /// `[a-z][a-z0-9-]{0,31}`, configured under `[biz.<name>]`.
    #[schema(example = "order")]
    pub biz_type: String,
    /// The user the token is bound to: 1 to 128 characters, no control characters.
    #[schema(example = "user-42")]
    pub subject: String,
    /// 1 to the biz type's ttl; default: the biz type's ttl.
    #[schema(example = 60, minimum = 1)]
    pub ttl_seconds: Option<u64>,
}
impl BodyLimit for IssueRequest {}

#[derive(Debug, Serialize, ToSchema)]
pub struct IssueResponse {
    pub token: String,
    pub biz_type: String,
    pub subject: String,
    /// RFC 3339 UTC.
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: String,
    /// Seconds the token lives.
    pub expire_time: u64,
}

/// Issue a one-time token.
#[utoipa::path(post, path = "/v1/tokens", operation_id = "issueToken", tag = "tokens", request_body(content = IssueRequest, example = json!({"biz_type": "order", "subject": "user-42", "ttl_seconds": 60})),
    security(("api_key" = [])),
    responses(
        (status = 201, description = "Issued", body = IssueResponse, example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "biz_type": "order", "subject": "user-42", "expires_at": "2026-12-02T07:31:00Z", "expire_time": 60})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: biz type not granted", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited (with Retry-After): per (client, subject) and biz type, or over the client's ceiling", body = super::ErrorBody),
        (status = 503, description = "unavailable (durable types while Postgres is down)", body = super::ErrorBody),
    ))]
pub async fn issue(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<IssueRequest>,
) -> Result<HttpResponse, ApiError> {
    let biz = BizType::parse(&body.biz_type)?;
    let subject = Subject::parse(&body.subject)?;
    let issued = state
        .ledger
        .issue(&caller, &biz, &subject, body.ttl_seconds)
        .await?;
    Ok(HttpResponse::Created().json(IssueResponse {
        token: issued.token,
        biz_type: issued.biz_type.to_string(),
        subject: issued.subject.as_str().to_owned(),
        expires_at: rfc3339(issued.expires_at),
        expire_time: issued.ttl_seconds,
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query, rename_all = "camelCase")]
#[serde(rename_all = "camelCase")]
pub struct GenerateQuery {
    /// The biz type (required: 400 without it).
    #[param(required = true, value_type = String, example = "order")]
    pub biz_type: Option<String>,
    /// The subject (user id; required: 400 without it).
    #[param(required = true, value_type = String, example = "user-42")]
    pub user_id: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GenerateResponse {
    pub token: String,
    pub expire_time: u64,
}

/// The seed article's issue call, kept for compatibility (same auth and rate limit).
#[utoipa::path(get, path = "/api/token/generate", operation_id = "generateTokenAlias", tag = "tokens", params(GenerateQuery),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "Issued", body = GenerateResponse, example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "expireTime": 60})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited", body = super::ErrorBody),
    ))]
pub async fn generate(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    query: Result<web::Query<GenerateQuery>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|_| ApiError::invalid("query must be ?bizType=...&userId=..."))?;
    let biz = BizType::parse(
        query
            .biz_type
            .as_deref()
            .ok_or_else(|| ApiError::invalid("`bizType` is required"))?,
    )?;
    let subject = Subject::parse(
        query
            .user_id
            .as_deref()
            .ok_or_else(|| ApiError::invalid("`userId` is required"))?,
    )?;
    let issued = state.ledger.issue(&caller, &biz, &subject, None).await?;
    Ok(HttpResponse::Ok().json(GenerateResponse {
        token: issued.token,
        expire_time: issued.ttl_seconds,
    }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsumeRequest {
    #[schema(example = "user-42")]
    pub subject: String,
    /// When given, must match the token's biz type (else 403 token_mismatch).
    pub biz_type: Option<String>,
    /// A hash of the business request: a consume with another fingerprint than the winner's is 422.
    #[schema(example = "sha256:9f2c")]
    pub fingerprint: Option<String>,
    /// This attempt's id: a retry with the winner's id answers `consumed` again.
    #[schema(example = "req-7f3a")]
    pub request_id: Option<String>,
    /// 0 to 10000 (default 0): a consume that would answer `duplicate` /
    /// `processing` waits this long for the winner's result (then
    /// `completed`) or release (then it may consume).
    #[schema(example = 2000, minimum = 0, maximum = 10000)]
    pub wait_ms: Option<u64>,
}
impl BodyLimit for ConsumeRequest {}

/// `wait_ms` of a consume, checked (0 to 10000).
pub fn wait_of(wait_ms: Option<u64>) -> Result<std::time::Duration, ApiError> {
    let max = crate::ledger::MAX_WAIT.as_millis() as u64;
    match wait_ms {
        None => Ok(std::time::Duration::ZERO),
        Some(ms) if ms <= max => Ok(std::time::Duration::from_millis(ms)),
        Some(_) => Err(ApiError::invalid(format!(
            "`wait_ms` must be between 0 and {max}"
        ))),
    }
}

impl ConsumeRequest {
    pub fn parse(&self) -> Result<ConsumeInput, ApiError> {
        Ok(ConsumeInput {
            subject: Subject::parse(&self.subject)?,
            biz_type: self.biz_type.as_deref().map(BizType::parse).transpose()?,
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
pub enum ConsumeResponse {
    Consumed {
        /// `consumed`
        #[schema(value_type = crate::ledger::AnswerOutcome, example = "consumed")]
        outcome: &'static str,
        token: String,
        #[schema(value_type = String, format = DateTime)]
        consumed_at: String,
    },
    Duplicate {
        /// `duplicate`
        #[schema(value_type = crate::ledger::AnswerOutcome, example = "duplicate")]
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

pub fn consume_response(token: &str, answer: ConsumeAnswer) -> HttpResponse {
    let outcome = answer.outcome().as_str();
    match answer {
        ConsumeAnswer::Consumed {
            consumed_at,
            replayed,
        } => {
            let mut resp = HttpResponse::Ok();
            if replayed {
                resp.insert_header((REPLAYED, "true"));
            }
            resp.json(ConsumeResponse::Consumed {
                outcome,
                token: token.to_owned(),
                consumed_at: rfc3339(consumed_at),
            })
        }
        ConsumeAnswer::Duplicate {
            status,
            consumed_at,
            result,
        } => {
            HttpResponse::Ok()
                .insert_header((REPLAYED, "true"))
                .json(ConsumeResponse::Duplicate {
                    outcome,
                    status: status.as_str(),
                    consumed_at: consumed_at.map(rfc3339),
                    result,
                })
        }
    }
}

/// Consume a token: exactly one attempt ever answers `consumed`.
#[utoipa::path(post, path = "/v1/tokens/{token}/consume", operation_id = "consumeToken", tag = "tokens", request_body(content = ConsumeRequest, example = json!({"subject": "user-42", "biz_type": "order", "fingerprint": "sha256:9f2c", "request_id": "req-7f3a"})),
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "consumed, or duplicate (with Idempotent-Replayed: true); a retry with the winning request_id answers consumed with the header", body = ConsumeResponse, example = json!({"outcome": "consumed", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "consumed_at": "2026-12-02T07:30:05Z"})),
        (status = 400, description = "invalid_request, token_invalid, token_expired", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden, token_mismatch", body = super::ErrorBody),
        (status = 422, description = "fingerprint_mismatch, unknown_biz_type", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
        (status = 503, description = "unavailable (with Retry-After); nothing changed", body = super::ErrorBody),
    ))]
pub async fn consume(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    token: web::Path<String>,
    JsonBody(body): JsonBody<ConsumeRequest>,
) -> Result<HttpResponse, ApiError> {
    let input = body.parse()?;
    let wait = wait_of(body.wait_ms)?;
    let token = path_token(&token)?;
    let answer = state
        .ledger
        .consume_waiting(&caller, token, &input, wait)
        .await?;
    Ok(consume_response(token, answer))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResultRequest {
    pub subject: String,
    /// Any JSON; replayed to later duplicates.
    /// Any JSON value (object, array, string, number, boolean, null).
    pub result: Json,
    /// The `request_id` of the consume this call belongs to (optional):
    /// when given, it applies only while that consume holds the token; after
    /// a release and another consume, 409 (`not_consumed` / `not_releasable`)
    /// instead of acting on the other attempt's consume.
    #[schema(example = "req-881", min_length = 1, max_length = 128)]
    #[serde(default)]
    pub request_id: Option<String>,
}
impl BodyLimit for ResultRequest {
    const LIMIT: usize = 64 * 1024;
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OutcomeResponse {
    #[schema(example = "recorded")]
    pub outcome: &'static str,
}

/// Record the business result of a consumed token.
#[utoipa::path(post, path = "/v1/tokens/{token}/result", operation_id = "recordTokenResult", tag = "tokens", request_body(content = ResultRequest, example = json!({"subject": "user-42", "result": {"payment_id": "pay-881", "status": "succeeded"}})),
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "recorded (the same result again: recorded, with Idempotent-Replayed: true)", body = OutcomeResponse, example = json!({"outcome": "recorded"})),
        (status = 400, description = "invalid_request, token_invalid", body = super::ErrorBody),
        (status = 403, description = "token_mismatch, forbidden", body = super::ErrorBody),
        (status = 409, description = "result_already_set, not_consumed", body = super::ErrorBody),
        (status = 413, description = "payload_too_large (64 KiB)", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn result(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    token: web::Path<String>,
    JsonBody(body): JsonBody<ResultRequest>,
) -> Result<HttpResponse, ApiError> {
    let subject = Subject::parse(&body.subject)?;
    if crate::domain::json_holds_nul(&body.result) {
        return Err(ApiError::invalid(
            "`result` may not hold U+0000 in any string or key (Postgres cannot store it)",
        ));
    }
    let token = path_token(&token)?;
    let of_request = body
        .request_id
        .as_deref()
        .map(RequestId::parse)
        .transpose()?;
    let answer = state
        .ledger
        .record_result(&caller, token, &subject, &body.result, of_request.as_ref())
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
pub struct ReleaseRequest {
    pub subject: String,
    /// The `request_id` of the consume this call belongs to (optional):
    /// when given, it applies only while that consume holds the token; after
    /// a release and another consume, 409 (`not_consumed` / `not_releasable`)
    /// instead of acting on the other attempt's consume.
    #[schema(example = "req-881", min_length = 1, max_length = 128)]
    #[serde(default)]
    pub request_id: Option<String>,
}
impl BodyLimit for ReleaseRequest {}

/// Give a consumed token back (the business step failed before any side effect).
#[utoipa::path(post, path = "/v1/tokens/{token}/release", operation_id = "releaseToken", tag = "tokens", request_body(content = ReleaseRequest, example = json!({"subject": "user-42"})),
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "released", body = OutcomeResponse, example = json!({"outcome": "released"})),
        (status = 400, description = "invalid_request, token_invalid", body = super::ErrorBody),
        (status = 403, description = "token_mismatch, forbidden", body = super::ErrorBody),
        (status = 409, description = "not_releasable", body = super::ErrorBody),
        (status = 429, description = "rate_limited: over the client's ceiling (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn release(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    token: web::Path<String>,
    JsonBody(body): JsonBody<ReleaseRequest>,
) -> Result<HttpResponse, ApiError> {
    let subject = Subject::parse(&body.subject)?;
    let token = path_token(&token)?;
    let of_request = body
        .request_id
        .as_deref()
        .map(RequestId::parse)
        .transpose()?;
    state
        .ledger
        .release(&caller, token, &subject, of_request.as_ref())
        .await?;
    Ok(HttpResponse::Ok().json(OutcomeResponse {
        outcome: "released",
    }))
}

/// Query of `GET /v1/tokens/{token}`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StateQuery {
    /// The user the token was issued to (required, except for admins, whose
    /// read is not bound to a subject).
    pub subject: Option<String>,
}

/// A token's state, as its own client reads it.
#[derive(Debug, Serialize, ToSchema)]
pub struct TokenStateResponse {
    pub token: String,
    pub biz_type: String,
    /// `issued` (unconsumed and live; also after a release), `consumed`, or
    /// `expired` (never consumed and past its expiry, or purged after the
    /// retention).
    #[schema(value_type = crate::domain::TokenStatus)]
    pub state: &'static str,
    /// RFC 3339 UTC.
    #[schema(value_type = String, format = DateTime)]
    pub expires_at: String,
    /// Set while consumed.
    #[schema(value_type = Option<String>, format = DateTime)]
    pub consumed_at: Option<String>,
    /// The recorded result (any JSON value), once there is one: `consumed`
    /// with a result is `completed`, without one `processing`.
    #[schema(schema_with = crate::http::schema::any_json_or_null)]
    pub result: Option<Json>,
}

impl TokenStateResponse {
    fn new(token: &str, r: TokenReading) -> TokenStateResponse {
        TokenStateResponse {
            token: token.to_owned(),
            biz_type: r.biz_type.to_string(),
            state: r.state.as_str(),
            expires_at: rfc3339(r.expires_at),
            consumed_at: r.consumed_at.map(rfc3339),
            result: r.result,
        }
    }
}

/// Read a token's state without consuming it ("did my payment go
/// through?"). Never counts as a consume or a duplicate. Durable biz types
/// answer from Postgres; fast ones from Redis (Postgres when Redis does not
/// hold the token or is unreachable). A token past its expiry is 200
/// `expired`, not `token_expired`.
#[utoipa::path(get, path = "/v1/tokens/{token}", operation_id = "getTokenState", tag = "tokens", params(
        ("token" = String, Path, description = "The token text"),
        StateQuery,
    ),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The token's state", body = TokenStateResponse, example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "biz_type": "order", "state": "consumed", "expires_at": "2026-12-02T07:31:00Z", "consumed_at": "2026-12-02T07:30:05Z", "result": {"payment_id": "pay-881", "status": "succeeded"}})),
        (status = 400, description = "invalid_request (no subject, unknown query parameters), token_invalid", body = super::ErrorBody),
        (status = 403, description = "token_mismatch (another subject or client), forbidden (biz type not granted)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 503, description = "unavailable: Postgres cannot be asked (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn state(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    token: web::Path<String>,
    query: Result<web::Query<StateQuery>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|_| ApiError::invalid("the query takes only `subject`"))?;
    let subject = match query.subject.as_deref() {
        Some(s) => Some(Subject::parse(s)?),
        None if caller.reads_all() => None,
        None => return Err(ApiError::invalid("`subject` is required")),
    };
    let token = path_token(&token)?;
    let reading = state.ledger.read(&caller, token, subject.as_ref()).await?;
    Ok(HttpResponse::Ok().json(TokenStateResponse::new(token, reading)))
}
