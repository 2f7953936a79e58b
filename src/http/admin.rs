//! Admin routes: one token's or client key's story, an operator's release of
//! a token stuck in `processing`, audit event pages, fleet stats (role admin)
//! and reconciliation (role admin or reconciler). The role is checked
//! right after authentication, before the request is read: any other role
//! gets 403 `forbidden` on every admin route. A read served by
//! `postgres.read_url`'s replica says how old its data may be
//! ([`DATA_LAG`]).

use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::{web, FromRequest, HttpRequest, HttpResponse};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{BodyLimit, Caller, JsonBody, OptionalJsonBody};
use super::tokens::path_token;
use super::AppState;
use crate::admin::{self, AuditQuery, Window};
use crate::auth::{Client, Role};
use crate::domain::Reason;
use crate::reconcile;

fn authorize(req: &HttpRequest, allowed: &[Role]) -> Result<Arc<Client>, ApiError> {
    let Caller(client) = Caller::from_request(req, &mut Payload::None).into_inner()?;
    if allowed.contains(&client.role) {
        Ok(client)
    } else {
        Err(ApiError::forbidden(
            "this route needs the admin role (reads: admin or auditor; reconcile: admin or reconciler)",
        ))
    }
}

/// The header of an admin read served by `postgres.read_url`'s replica: how
/// old its data may be, in whole milliseconds (see
/// [`crate::admin::Admin::data_lag`]). Absent when the read went to the
/// primary.
pub const DATA_LAG: &str = "Ledger-Data-Lag";

/// 200 with `body` as JSON, and [`DATA_LAG`] when `lag` is a replica's.
pub(super) fn read_answer<T: serde::Serialize>(
    lag: Option<std::time::Duration>,
    body: &T,
) -> HttpResponse {
    let mut res = HttpResponse::Ok();
    if let Some(lag) = lag {
        res.insert_header((DATA_LAG, lag.as_millis().to_string()));
    }
    res.json(body)
}

/// A caller with the admin or auditor role, for the admin reads (401, then
/// 403). Each read is logged with the client and what it read.
#[derive(Debug)]
pub struct ReaderCaller(pub Arc<Client>);

impl FromRequest for ReaderCaller {
    type Error = ApiError;
    type Future = std::future::Ready<Result<ReaderCaller, ApiError>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let caller = authorize(req, &[Role::Admin, Role::Auditor]);
        if let Ok(client) = &caller {
            log_read(client, req);
        }
        std::future::ready(caller.map(ReaderCaller))
    }
}

/// The "admin read" line: the client, the route, what its path names
/// ([`path_args`]) and the query (a client key's and an order's reads name
/// them there).
fn log_read(client: &Client, req: &HttpRequest) {
    tracing::info!(
        client = %client.name,
        role = ?client.role,
        route = req.match_pattern().as_deref().unwrap_or(""),
        args = %path_args(req.match_info().iter()),
        query = req.query_string(),
        "admin read"
    );
}

/// A route's path arguments as `name="value"` pairs (quoted and escaped),
/// with a token shortened as everywhere in the logs (its biz prefix and last
/// 4 characters): a whole token is never logged at info level.
fn path_args<'a>(args: impl Iterator<Item = (&'a str, &'a str)>) -> String {
    args.map(|(name, value)| {
        if name == "token" {
            format!("{name}={:?}", crate::token::codec::redact(value))
        } else {
            format!("{name}={value:?}")
        }
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// A caller with the admin role (401, then 403).
#[derive(Debug)]
pub struct AdminCaller(pub Arc<Client>);

impl FromRequest for AdminCaller {
    type Error = ApiError;
    type Future = std::future::Ready<Result<AdminCaller, ApiError>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(authorize(req, &[Role::Admin]).map(AdminCaller))
    }
}

/// A caller with the admin or reconciler role (401, then 403).
#[derive(Debug)]
pub struct ReconcilerCaller(pub Arc<Client>);

impl FromRequest for ReconcilerCaller {
    type Error = ApiError;
    type Future = std::future::Ready<Result<ReconcilerCaller, ApiError>>;
    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(authorize(req, &[Role::Admin, Role::Reconciler]).map(ReconcilerCaller))
    }
}

/// What happened to one token: its record and its audit events.
#[utoipa::path(get, path = "/v1/admin/tokens/{token}", operation_id = "adminGetToken", tag = "admin",
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The token", body = admin::TokenView, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "biz_type": "order", "subject": "user-42", "client": "payments", "state": "consumed", "issued_at": "2026-12-02T07:30:00Z", "expires_at": "2026-12-02T07:31:00Z", "consumed_at": "2026-12-02T07:30:05Z", "fingerprint": "sha256:9f2c", "request_id": "req-7f3a", "result": null, "duplicate_attempts": 1, "events": [{"id": "1042", "at": "2026-12-02T07:30:05Z", "kind": "token.consumed", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "subject": "user-42", "biz_type": "order", "order_id": null, "client": "payments", "detail": {"request_id": "req-7f3a"}}]})),
        (status = 400, description = "token_invalid", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (reads: admin or auditor)", body = super::ErrorBody),
        (status = 404, description = "token_not_found: a valid token this fleet has no record of", body = super::ErrorBody),
    ))]
pub async fn token(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    token: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let text = path_token(&token)?;
    let lag = state.admin.data_lag().await?;
    let view = state.admin.token(text).await?;
    Ok(read_answer(lag, &view))
}

/// Query of `GET /v1/admin/keys`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct KeyParams {
    /// The client the key belongs to (its `[[clients]]` name; required).
    #[param(required = true, value_type = String, example = "payments")]
    pub client: Option<String>,
    /// The biz type (required).
    #[param(required = true, value_type = String, example = "order")]
    pub biz_type: Option<String>,
    /// The key (URL-encoded; required).
    #[param(required = true, value_type = String, example = "checkout-7f3a")]
    pub key: Option<String>,
}

/// What happened to one client key: its record and its audit events.
#[utoipa::path(get, path = "/v1/admin/keys", operation_id = "adminGetKey", tag = "admin", params(KeyParams),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The key", body = admin::KeyView, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"key": "checkout-7f3a", "client": "payments", "biz_type": "order", "subject": "user-42", "state": "consumed", "issued_at": "2026-12-02T07:30:05Z", "consumed_at": "2026-12-02T07:30:05Z", "fingerprint": "sha256:9f2c", "request_id": "req-7f3a", "result": {"payment_id": "pay-881"}, "duplicate_attempts": 0, "events": []})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (reads: admin or auditor)", body = super::ErrorBody),
        (status = 404, description = "key_not_found: no record nor audit event of this key", body = super::ErrorBody),
    ))]
pub async fn key(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    query: Result<web::Query<KeyParams>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|_| {
        ApiError::invalid("query must be ?client=...&biz_type=...&key=... and nothing else")
    })?;
    let required = |name: &str, v: &Option<String>| {
        present(v).ok_or_else(|| ApiError::invalid(format!("`{name}` is required")))
    };
    let client = required("client", &query.client)?;
    let biz = crate::domain::BizType::parse(&required("biz_type", &query.biz_type)?)?;
    let key = crate::domain::key::ClientKey::parse(&required("key", &query.key)?)?;
    let lag = state.admin.data_lag().await?;
    let view = state.admin.key(&client, &biz, &key).await?;
    Ok(read_answer(lag, &view))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminReleaseRequest {
    /// Why (1 to 500 characters, not only white space): kept in the audit
    /// event's `detail.reason`.
    #[schema(
        example = "consumer crashed before recording a result; INC-1042",
        min_length = 1,
        max_length = 500
    )]
    pub reason: String,
}
impl BodyLimit for AdminReleaseRequest {}

/// Free a token stuck in `processing` (its consumer died before recording a
/// result or releasing it): a consumed token with no result and no order
/// event returns to unconsumed, whichever client it belongs to. Audited as
/// `token.released` with `detail.by` = the acting client's name and the
/// reason.
#[utoipa::path(post, path = "/v1/admin/tokens/{token}/release", operation_id = "adminReleaseToken", tag = "admin",
    request_body(content = AdminReleaseRequest, example = json!({"reason": "consumer crashed before recording a result (INC-2041)"})),
    params(("token" = String, Path, description = "The token text")),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "released", body = super::tokens::OutcomeResponse, example = json!({"outcome": "released"})),
        (status = 400, description = "invalid_request (no reason, or one beyond 500 characters), token_invalid", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (an auditor only reads)", body = super::ErrorBody),
        (status = 409, description = "not_releasable: not consumed, or it has a result or an order event", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 503, description = "unavailable: the deciding tier cannot be reached, nothing changed (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn release(
    state: web::Data<AppState>,
    AdminCaller(caller): AdminCaller,
    token: web::Path<String>,
    JsonBody(body): JsonBody<AdminReleaseRequest>,
) -> Result<HttpResponse, ApiError> {
    let reason = Reason::parse(&body.reason)?;
    let text = path_token(&token)?;
    state
        .ledger
        .release_by_admin(&caller, text, &reason)
        .await?;
    tracing::info!(client = %caller.name, reason = reason.as_str(), "token released by an operator");
    Ok(HttpResponse::Ok().json(super::tokens::OutcomeResponse {
        outcome: "released",
    }))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdminKeyReleaseRequest {
    /// The client the key belongs to (its `[[clients]]` name).
    #[schema(example = "payments")]
    pub client: String,
    #[schema(example = "order")]
    pub biz_type: String,
    #[schema(example = "checkout-7f3a")]
    pub key: String,
    /// Why (1 to 500 characters, not only white space): kept in the audit
    /// event's `detail.reason`.
    #[schema(
        example = "consumer crashed before recording a result; INC-1042",
        min_length = 1,
        max_length = 500
    )]
    pub reason: String,
}
impl BodyLimit for AdminKeyReleaseRequest {}

/// Free a client key stuck in `processing`: the rule of a client's release
/// (a consumed key with no result returns to unconsumed), for any client's
/// key. Audited as `key.released` with `detail.by` = the acting client's
/// name and the reason.
#[utoipa::path(post, path = "/v1/admin/keys/release", operation_id = "adminReleaseKey", tag = "admin",
    request_body(content = AdminKeyReleaseRequest, example = json!({"client": "payments", "biz_type": "order", "key": "checkout-7f3a", "reason": "consumer crashed before recording a result (INC-2041)"})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "released", body = super::tokens::OutcomeResponse, example = json!({"outcome": "released"})),
        (status = 400, description = "invalid_request (a field missing or out of range, no reason)", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (an auditor only reads)", body = super::ErrorBody),
        (status = 409, description = "not_releasable: not consumed, or it has a result", body = super::ErrorBody),
        (status = 422, description = "unknown_biz_type", body = super::ErrorBody),
        (status = 503, description = "unavailable: the deciding tier cannot be reached, nothing changed (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn release_key(
    state: web::Data<AppState>,
    AdminCaller(caller): AdminCaller,
    JsonBody(body): JsonBody<AdminKeyReleaseRequest>,
) -> Result<HttpResponse, ApiError> {
    let reason = Reason::parse(&body.reason)?;
    let owner = body.client.trim();
    if owner.is_empty() || owner.len() > 64 {
        return Err(ApiError::invalid(
            "`client` must be a client's name (1 to 64 characters)",
        ));
    }
    let biz = crate::domain::BizType::parse(&body.biz_type)?;
    let key = crate::domain::key::ClientKey::parse(&body.key)?;
    state
        .ledger
        .release_key_by_admin(&caller, owner, &biz, &key, &reason)
        .await?;
    tracing::info!(client = %caller.name, owner, reason = reason.as_str(), "client key released by an operator");
    Ok(HttpResponse::Ok().json(super::tokens::OutcomeResponse {
        outcome: "released",
    }))
}

/// Query of `GET /v1/admin/audit`; empty values count as absent. `kind`
/// may repeat (any of them); every other parameter at most once. Read from
/// the query string by [`AuditParams::from_query`] (`web::Query` cannot
/// collect a repeated key); the derive documents it.
#[derive(Debug, Default, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct AuditParams {
    /// No control characters (400).
    #[param(pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub subject: Option<String>,
    /// No control characters (400).
    #[param(pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub biz_type: Option<String>,
    /// No control characters (400).
    #[param(pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub order_id: Option<String>,
    /// The acting or owning client's name (the events' `client`); no
    /// control characters (400).
    #[param(pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub client: Option<String>,
    /// An audit kind, e.g. `token.consumed`; repeat it for any of several
    /// (`kind=token.consumed&kind=token.released`).
    #[param(value_type = Option<Vec<crate::domain::AuditKind>>, explode = true, style = Form)]
    pub kind: Vec<String>,
    /// RFC 3339; inclusive.
    #[param(value_type = Option<String>, format = DateTime)]
    pub since: Option<String>,
    /// RFC 3339; exclusive.
    #[param(value_type = Option<String>, format = DateTime)]
    pub until: Option<String>,
    /// 1 to 1000; default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    pub limit: Option<String>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

fn present(v: &Option<String>) -> Option<String> {
    v.as_ref().filter(|s| !s.is_empty()).cloned()
}

fn rfc3339(key: &str, v: &Option<String>) -> Result<Option<DateTime<Utc>>, ApiError> {
    present(v)
        .map(|s| {
            DateTime::parse_from_rfc3339(&s)
                .map(|t| t.with_timezone(&Utc))
                .map_err(|_| ApiError::invalid(format!("`{key}` must be an RFC 3339 time")))
        })
        .transpose()
}

impl AuditParams {
    /// The parameters of a query string: 400 for an unknown one or one
    /// given twice (but `kind`).
    pub fn from_query(query: &str) -> Result<AuditParams, ApiError> {
        let mut p = AuditParams::default();
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let slot = match key.as_ref() {
                "kind" => {
                    p.kind.push(value.into_owned());
                    continue;
                }
                "subject" => &mut p.subject,
                "biz_type" => &mut p.biz_type,
                "order_id" => &mut p.order_id,
                "client" => &mut p.client,
                "since" => &mut p.since,
                "until" => &mut p.until,
                "limit" => &mut p.limit,
                "cursor" => &mut p.cursor,
                other => {
                    return Err(ApiError::invalid(format!(
                        "bad query: unknown parameter `{other}`, expected one of subject, biz_type, order_id, client, kind, since, until, limit, cursor"
                    )))
                }
            };
            if slot.is_some() {
                return Err(ApiError::invalid(format!(
                    "bad query: `{key}` given more than once"
                )));
            }
            *slot = Some(value.into_owned());
        }
        Ok(p)
    }

    fn parse(&self) -> Result<AuditQuery, ApiError> {
        let limit = match present(&self.limit) {
            None => admin::DEFAULT_LIMIT,
            Some(s) => s.parse().map_err(|_| {
                ApiError::invalid(format!(
                    "`limit` must be between 1 and {}",
                    admin::MAX_LIMIT
                ))
            })?,
        };
        let query = AuditQuery {
            subject: present(&self.subject),
            biz_type: present(&self.biz_type),
            order_id: present(&self.order_id),
            client: present(&self.client),
            kinds: {
                let mut kinds = Vec::new();
                for k in self.kind.iter().filter(|k| !k.is_empty()) {
                    let k = admin::parse_kind(k)?;
                    if !kinds.contains(&k) {
                        kinds.push(k);
                    }
                }
                kinds
            },
            since: rfc3339("since", &self.since)?,
            until: rfc3339("until", &self.until)?,
            limit,
            cursor: present(&self.cursor),
        };
        query.validate()?;
        Ok(query)
    }
}

/// Audit events, newest first by (`at`, `id`), one page at a time.
#[utoipa::path(get, path = "/v1/admin/audit", operation_id = "adminAuditEvents", tag = "admin", params(AuditParams),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "One page; `next_cursor` is null at the end", body = admin::AuditPage, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"events": [{"id": "1042", "at": "2026-12-02T07:30:05Z", "kind": "token.consumed", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "subject": "user-42", "biz_type": "order", "order_id": null, "client": "payments", "detail": {"request_id": "req-7f3a"}}], "next_cursor": null})),
        (status = 400, description = "invalid_request (bad filter, limit beyond 1000), invalid_cursor", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (reads: admin or auditor)", body = super::ErrorBody),
    ))]
pub async fn audit(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let query = AuditParams::from_query(req.query_string())?.parse()?;
    let lag = state.admin.data_lag().await?;
    let page = state.admin.audit(&query).await?;
    Ok(read_answer(lag, &page))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct StatsParams {
    /// `<n>s|m|h|d`, default `1h`.
    pub window: Option<String>,
}

/// Fleet-wide counters per biz type over a window.
#[utoipa::path(get, path = "/v1/admin/stats", operation_id = "adminStats", tag = "admin", params(StatsParams),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "Counters per biz type", body = admin::Stats, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"window": "1h", "mode": "normal", "biz_types": {"order": {"issued": 120, "consumed": 100, "duplicates": 4, "duplicate_rate": 0.0385, "expired": 2, "invalid": 0}}})),
        (status = 400, description = "invalid_request: bad window", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin (reads: admin or auditor)", body = super::ErrorBody),
    ))]
pub async fn stats(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    query: Result<web::Query<StatsParams>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let window = Window::parse(query.window.as_deref().unwrap_or("1h"))?;
    let lag = state.admin.data_lag().await?;
    let stats = state.admin.stats(&window, state.ledger.mode()).await?;
    Ok(read_answer(lag, &stats))
}

/// Query of `GET /v1/admin/reconcile/runs`; empty values count as absent.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct RunsParams {
    /// 1 to 100; default 20.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 100)]
    pub limit: Option<String>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// Past reconcile runs, newest first: each run's whole report with its `id`
/// and the ids of the orders it found inconsistent.
#[utoipa::path(get, path = "/v1/admin/reconcile/runs", operation_id = "adminReconcileRuns", tag = "admin", params(RunsParams),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "One page; `next_cursor` is null at the end", body = crate::admin::runs::RunsPage, headers(("Ledger-Data-Lag" = u64, description = "Only when `postgres.read_url` sends admin reads to a replica: how old this answer's data may be, in milliseconds (0: the replica had replayed all it received). Absent: read from the primary.")), example = json!({"runs": [{"id": "12", "by": "reconciler", "started_at": "2026-12-02T07:30:00Z", "finished_at": "2026-12-02T07:30:05Z", "dry_run": true, "scanned": {"tokens": 120, "orders": 3}, "found": {"redis_live_but_consumed": 0, "redis_missing_but_live": 0, "stale_provisional": 0, "journal_not_durable": 0, "order_inconsistent": 0, "expired_purgeable": 0, "redis_consumed_but_live": 0, "redis_ahead_of_postgres": 0}, "repaired": {"redis_live_but_consumed": 0, "redis_missing_but_live": 0, "stale_provisional": 0, "journal_not_durable": 0, "order_inconsistent": 0, "expired_purgeable": 0, "redis_consumed_but_live": 0, "redis_ahead_of_postgres": 0}, "inconsistent_orders": [], "redis_ahead_of_postgres": [], "interrupted": false, "errors": []}], "next_cursor": null})),
        (status = 400, description = "invalid_request (limit beyond 100), invalid_cursor", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin or auditor", body = super::ErrorBody),
        (status = 503, description = "unavailable: Postgres cannot be reached (with Retry-After)", body = super::ErrorBody),
    ))]
pub async fn reconcile_runs(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
    query: Result<web::Query<RunsParams>, actix_web::Error>,
) -> Result<HttpResponse, ApiError> {
    let query = query.map_err(|e| ApiError::invalid(format!("bad query: {e}")))?;
    let limit = match present(&query.limit) {
        None => crate::admin::runs::DEFAULT_RUNS,
        Some(s) => s.parse().map_err(|_| {
            ApiError::invalid(format!(
                "`limit` must be between 1 and {}",
                crate::admin::runs::MAX_RUNS
            ))
        })?,
    };
    let lag = state.admin.data_lag().await?;
    let page = state
        .admin
        .reconcile_runs(limit, present(&query.cursor).as_deref())
        .await?;
    Ok(read_answer(lag, &page))
}

#[derive(Debug, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconcileRequest {
    /// Find and report only. Default false.
    #[serde(default)]
    pub dry_run: bool,
    /// Limit the token and order scans to this window back from now, e.g. `24h`.
    #[schema(example = "24h")]
    pub since: Option<String>,
}
impl BodyLimit for ReconcileRequest {}

/// Run a reconciliation now and answer its report.
#[utoipa::path(post, path = "/v1/admin/reconcile", operation_id = "adminRunReconcile", tag = "admin",
    request_body(content = ReconcileRequest, description = "Optional (not required): no body (and no Content-Type) is `{}`, a real run over everything", example = json!({"dry_run": true, "since": "24h"})),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The report", body = reconcile::Report, example = json!({"id": "12", "by": "reconciler", "started_at": "2026-12-02T07:30:00Z", "finished_at": "2026-12-02T07:30:05Z", "dry_run": true, "scanned": {"tokens": 120, "orders": 3}, "found": {"redis_live_but_consumed": 0, "redis_missing_but_live": 0, "stale_provisional": 0, "journal_not_durable": 0, "order_inconsistent": 0, "expired_purgeable": 0, "redis_consumed_but_live": 0, "redis_ahead_of_postgres": 0}, "repaired": {"redis_live_but_consumed": 0, "redis_missing_but_live": 0, "stale_provisional": 0, "journal_not_durable": 0, "order_inconsistent": 0, "expired_purgeable": 0, "redis_consumed_but_live": 0, "redis_ahead_of_postgres": 0}, "inconsistent_orders": [], "redis_ahead_of_postgres": [], "interrupted": false, "errors": []})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: needs admin or reconciler", body = super::ErrorBody),
        (status = 409, description = "reconcile_running: another run holds the lock", body = super::ErrorBody),
    ))]
pub async fn run_reconcile(
    state: web::Data<AppState>,
    ReconcilerCaller(caller): ReconcilerCaller,
    OptionalJsonBody(body): OptionalJsonBody<ReconcileRequest>,
) -> Result<HttpResponse, ApiError> {
    let since = body
        .since
        .as_deref()
        .map(|s| {
            humantime::parse_duration(s)
                .map_err(|_| ApiError::invalid("`since` must be a duration such as 24h, 30m, 7d"))
        })
        .transpose()?;
    tracing::info!(client = %caller.name, dry_run = body.dry_run, "reconcile requested over HTTP");
    let progress = reconcile::LogProgress::new(std::time::Duration::from_secs(10));
    let report = state
        .reconciler
        .run(
            &reconcile::Options {
                dry_run: body.dry_run,
                since,
                by: caller.name.clone(),
            },
            &progress,
            &CancellationToken::new(),
        )
        .await?;
    Ok(HttpResponse::Ok().json(report))
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::num::NonZeroU32;
    use std::sync::{Arc, Mutex};

    use actix_web::test::TestRequest;

    use super::*;

    const TOKEN: &str = "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx";

    #[test]
    fn path_arguments_name_what_was_read_with_a_token_shortened() {
        assert_eq!(path_args(std::iter::empty()), "");
        assert_eq!(
            path_args([("token", TOKEN)].into_iter()),
            r#"token="order_…h2Lx""#
        );
        assert_eq!(
            path_args([("order_id", "o-1\n\"x")].into_iter()),
            r#"order_id="o-1\n\"x""#
        );
    }

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| std::io::ErrorKind::Other)?
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn the_admin_read_line_names_the_client_and_the_token_shortened() {
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        let client = Client {
            name: "audit-team".to_owned(),
            role: Role::Auditor,
            key_sha256: [0; 32],
            biz_types: Vec::new(),
            rate: NonZeroU32::MIN,
        };
        let req = TestRequest::with_uri(&format!("/v1/admin/tokens/{TOKEN}"))
            .param("token", TOKEN)
            .to_http_request();
        tracing::subscriber::with_default(subscriber, || log_read(&client, &req));
        let line = String::from_utf8(out.0.lock().expect("log").clone()).expect("utf-8");
        assert!(line.contains("admin read"), "{line}");
        assert!(line.contains("client=audit-team"), "{line}");
        assert!(line.contains(r#"args=token="order_…h2Lx""#), "{line}");
        assert!(!line.contains(TOKEN), "a whole token at info level: {line}");
    }
}
