//! Admin routes of processing leases: the uncertain queue
//! (`GET /v1/admin/uncertain`, admins and auditors) and an operator's result
//! for a consumed token or key (`POST /v1/admin/tokens/{token}/result`,
//! `POST /v1/admin/keys/result`, admins), which resolves an uncertain item
//! once the payment provider says what happened.

use actix_web::{web, HttpResponse};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use utoipa::ToSchema;

use super::admin::{AdminCaller, ReaderCaller};
use super::error::ApiError;
use super::extract::{BodyLimit, JsonBody};
use super::tokens::{path_token, OutcomeResponse};
use super::AppState;
use crate::admin::{time, AdminError};
use crate::domain::key::ClientKey;
use crate::domain::{BizType, Reason};
use crate::durable::leases::UncertainRow;
use crate::ledger::ResultAnswer;

const DEFAULT_LIMIT: i64 = 100;
const MAX_LIMIT: i64 = 1000;

fn encode_cursor(at: DateTime<Utc>, id: i64) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}:{id}", at.timestamp_micros()))
}

/// A cursor [`encode_cursor`] made; anything else is 400 `invalid_cursor`.
fn decode_cursor(text: &str) -> Result<(DateTime<Utc>, i64), AdminError> {
    let decoded = || {
        let raw = String::from_utf8(URL_SAFE_NO_PAD.decode(text).ok()?).ok()?;
        let (micros, id) = raw.split_once(':')?;
        let at = DateTime::from_timestamp_micros(micros.parse().ok()?)?;
        Some((at, id.parse().ok()?))
    };
    decoded().ok_or(AdminError::InvalidCursor)
}

/// Query of `GET /v1/admin/uncertain`; empty values count as absent.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UncertainParams {
    /// Only this biz type.
    pub biz_type: Option<String>,
    /// 1 to 1000; default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    pub limit: Option<String>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// One uncertain token or client key.
#[derive(Debug, Serialize, ToSchema)]
pub struct UncertainItem {
    /// The token (absent for a client key).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// The client key (absent for a token).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// The client it belongs to.
    pub client: String,
    pub biz_type: String,
    pub subject: Option<String>,
    #[schema(value_type = Option<String>, format = DateTime)]
    pub consumed_at: Option<String>,
    /// The winning consume's request id, when it sent one.
    pub request_id: Option<String>,
    /// When its processing lease ran out (Postgres's clock).
    #[schema(value_type = String, format = DateTime)]
    pub uncertain_since: String,
}

impl From<UncertainRow> for UncertainItem {
    fn from(r: UncertainRow) -> UncertainItem {
        UncertainItem {
            token: r.token,
            key: r.key,
            client: r.client,
            biz_type: r.biz_type,
            subject: r.subject,
            consumed_at: r.consumed_at.map(time),
            request_id: r.request_id,
            uncertain_since: time(r.uncertain_since),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UncertainPage {
    pub items: Vec<UncertainItem>,
    /// Pass as `cursor` for the next page; null at the end.
    pub next_cursor: Option<String>,
}

fn present(v: &Option<String>) -> Option<&str> {
    v.as_deref().filter(|s| !s.is_empty())
}

/// The uncertain queue, oldest first: consumed tokens and keys whose
/// processing lease ran out with neither result nor release
/// (`on_lease_expiry = "uncertain"`). An item leaves it when its consumer
/// or an operator records a result or releases it.
#[utoipa::path(get, path = "/v1/admin/uncertain", operation_id = "adminUncertain", tag = "admin", params(UncertainParams),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "One page; `next_cursor` is null at the end", body = UncertainPage, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"items": [{"token": "v1.order.AAAB...", "client": "payments", "biz_type": "refund", "subject": "user-42", "consumed_at": "2026-12-02T07:30:05.120Z", "request_id": "req-881", "uncertain_since": "2026-12-02T07:32:05.900Z"}], "next_cursor": null})),
        (status = 400, description = "invalid_request (bad biz_type, limit beyond 1000), invalid_cursor", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin or auditor", body = super::ErrorBody),
        (status = 503, description = "unavailable: Postgres cannot be reached (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn list(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    query: Result<web::Query<UncertainParams>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let biz = present(&query.biz_type).map(BizType::parse).transpose()?;
    let limit = match present(&query.limit) {
        None => DEFAULT_LIMIT,
        Some(s) => s
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(format!("`limit` must be between 1 and {MAX_LIMIT}"))
            })?,
    };
    let after = present(&query.cursor).map(decode_cursor).transpose()?;
    let lag = state.admin.data_lag().await?;
    let mut rows = state
        .ledger
        .uncertain_page(biz.as_ref().map(BizType::as_str), after, limit + 1)
        .await?;
    let more = rows.len() > usize::try_from(limit).unwrap_or(usize::MAX);
    rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    let next_cursor = if more {
        rows.last().map(|r| encode_cursor(r.uncertain_since, r.id))
    } else {
        None
    };
    Ok(super::admin::read_answer(
        lag,
        &UncertainPage {
            items: rows.into_iter().map(UncertainItem::from).collect(),
            next_cursor,
        },
    ))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminResultRequest {
    /// The outcome (any JSON value), as the payment provider reports it;
    /// replayed to later duplicates.
    pub result: Json,
    /// Why (1 to 500 characters, not only white space): kept in the audit
    /// event's `detail.reason`.
    #[schema(
        example = "provider says captured (PSP ref 7781); INC-2041",
        min_length = 1,
        max_length = 500
    )]
    pub reason: String,
}
impl BodyLimit for AdminResultRequest {
    const LIMIT: usize = 64 * 1024;
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminKeyResultRequest {
    /// The client the key belongs to (its `[[clients]]` name).
    #[schema(example = "payments")]
    pub client: String,
    #[schema(example = "order")]
    pub biz_type: String,
    #[schema(example = "checkout-7f3a")]
    pub key: String,
    /// The outcome (any JSON value); replayed to later duplicates.
    pub result: Json,
    /// Why (1 to 500 characters, not only white space).
    #[schema(
        example = "provider says captured (PSP ref 7781); INC-2041",
        min_length = 1,
        max_length = 500
    )]
    pub reason: String,
}
impl BodyLimit for AdminKeyResultRequest {
    const LIMIT: usize = 64 * 1024;
}

fn checked_result(result: &Json) -> Result<(), ApiError> {
    if crate::domain::json_holds_nul(result) {
        return Err(ApiError::invalid(
            "`result` may not hold U+0000 in any string or key (Postgres cannot store it)",
        ));
    }
    Ok(())
}

fn recorded(answer: ResultAnswer) -> HttpResponse {
    let mut resp = HttpResponse::Ok();
    if answer == ResultAnswer::AlreadyRecorded {
        resp.insert_header((super::tokens::REPLAYED, "true"));
    }
    resp.json(OutcomeResponse {
        outcome: "recorded",
    })
}

/// Record the outcome of a consumed token that has none (typically an
/// uncertain one, after checking the payment provider), whichever client it
/// belongs to. The same result again: 200 with `Idempotent-Replayed: true`.
/// Audited as `token.result` with `detail.by` = the acting client's name and
/// the reason.
#[utoipa::path(post, path = "/v1/admin/tokens/{token}/result", operation_id = "adminRecordTokenResult", tag = "admin",
    request_body(content = AdminResultRequest, example = json!({"result": {"status": "captured", "psp_ref": "7781"}, "reason": "provider says captured; INC-2041"})),
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "recorded", body = OutcomeResponse, example = json!({"outcome": "recorded"})),
        (status = 400, description = "invalid_request (no reason, a result holding U+0000), token_invalid", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (an auditor only reads)", body = super::ErrorBody),
        (status = 409, description = "result_already_set (another result), not_consumed", body = super::ErrorBody),
        (status = 413, description = "payload_too_large (64 KiB)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 503, description = "unavailable: the deciding tier cannot be reached, nothing changed (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn token_result(
    state: web::Data<AppState>,
    AdminCaller(caller): AdminCaller,
    token: web::Path<String>,
    JsonBody(body): JsonBody<AdminResultRequest>,
) -> Result<HttpResponse, ApiError> {
    let reason = Reason::parse(&body.reason)?;
    checked_result(&body.result)?;
    let text = path_token(&token)?;
    let answer = state
        .ledger
        .record_result_by_admin(&caller, text, &body.result, &reason)
        .await?;
    tracing::info!(client = %caller.name, reason = reason.as_str(), "token result recorded by an operator");
    Ok(recorded(answer))
}

/// Record the outcome of a consumed client key that has none (see
/// `adminRecordTokenResult`). Audited as `key.result` with `detail.by` and
/// the reason.
#[utoipa::path(post, path = "/v1/admin/keys/result", operation_id = "adminRecordKeyResult", tag = "admin",
    request_body(content = AdminKeyResultRequest, example = json!({"client": "payments", "biz_type": "order", "key": "checkout-7f3a", "result": {"status": "captured"}, "reason": "provider says captured; INC-2041"})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "recorded", body = OutcomeResponse, example = json!({"outcome": "recorded"})),
        (status = 400, description = "invalid_request (a field missing or out of range, no reason)", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (an auditor only reads)", body = super::ErrorBody),
        (status = 409, description = "result_already_set (another result), not_consumed", body = super::ErrorBody),
        (status = 413, description = "payload_too_large (64 KiB)", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 503, description = "unavailable: the deciding tier cannot be reached, nothing changed (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn key_result(
    state: web::Data<AppState>,
    AdminCaller(caller): AdminCaller,
    JsonBody(body): JsonBody<AdminKeyResultRequest>,
) -> Result<HttpResponse, ApiError> {
    let reason = Reason::parse(&body.reason)?;
    checked_result(&body.result)?;
    let owner = body.client.trim();
    if owner.is_empty() || owner.len() > 64 {
        return Err(ApiError::invalid(
            "`client` must be a client's name (1 to 64 characters)",
        ));
    }
    let biz = BizType::parse(&body.biz_type)?;
    let key = ClientKey::parse(&body.key)?;
    let answer = state
        .ledger
        .record_key_result_by_admin(&caller, owner, &biz, &key, &body.result, &reason)
        .await?;
    tracing::info!(client = %caller.name, owner, reason = reason.as_str(), "client key result recorded by an operator");
    Ok(recorded(answer))
}
