//! The one error type of the HTTP layer. Every refusal is
//! `{"error": code, "message": text}` (plus optional keys such as `state`);
//! 500s are logged with their cause chain and answered opaquely. The codes
//! are a closed set ([`Code`]) whose status is decided once, here, and every
//! domain error reaches the wire through one `From` below.

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde_json::{json, Map, Value};

use crate::admin::AdminError;
use crate::domain::order::TransitionError;
use crate::domain::Invalid;
use crate::durable::DurableError;
use crate::ledger::LedgerError;
use crate::orders::OrderError;
use crate::reconcile::ReconcileError;

/// Every code an answer can carry: the codes of API.md and docs/api.md's
/// error tables, each with its status ([`Code::status`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    /// 400: the body, the query or a value in them is refused.
    InvalidRequest,
    /// 401: no `Authorization: Bearer` key, or an unknown one.
    Unauthorized,
    /// 403: the role or the biz type is not granted.
    Forbidden,
    /// 404: no such route.
    NotFound,
    /// 405: the route exists, not with this method (with `Allow`).
    MethodNotAllowed,
    /// 413
    PayloadTooLarge,
    /// 415
    UnsupportedMediaType,
    /// 414
    UriTooLong,
    /// 431
    HeadersTooLarge,
    /// 429 (with `Retry-After`).
    RateLimited,
    /// 400: malformed, bad tag, unknown key id, never issued.
    TokenInvalid,
    /// 400: never consumed and past its expiry.
    TokenExpired,
    /// 403: another subject, client or biz type.
    TokenMismatch,
    /// 422
    UnknownBizType,
    /// 422
    FingerprintMismatch,
    /// 409
    ResultAlreadySet,
    /// 409
    NotConsumed,
    /// 409
    NotReleasable,
    /// 404
    OrderNotFound,
    /// 409
    OrderConflict,
    /// 409 (the body has `state`).
    IllegalTransition,
    /// 409 (the body has `refundable_minor`).
    RefundExceedsPaid,
    /// 422
    DurableTokenRequired,
    /// 409
    TokenAlreadyUsed,
    /// 404
    TokenNotFound,
    /// 404
    KeyNotFound,
    /// 400
    InvalidCursor,
    /// 409
    ReconcileRunning,
    /// 503 (with `Retry-After`): nothing changed.
    Unavailable,
    /// 500: the cause is logged, not sent.
    Internal,
}

impl Code {
    /// Every code, in the order of `ErrorBody.error`'s enum in openapi.json.
    pub const ALL: [Code; 30] = [
        Code::InvalidRequest,
        Code::Unauthorized,
        Code::Forbidden,
        Code::NotFound,
        Code::MethodNotAllowed,
        Code::PayloadTooLarge,
        Code::UnsupportedMediaType,
        Code::UriTooLong,
        Code::HeadersTooLarge,
        Code::RateLimited,
        Code::TokenInvalid,
        Code::TokenExpired,
        Code::TokenMismatch,
        Code::UnknownBizType,
        Code::FingerprintMismatch,
        Code::ResultAlreadySet,
        Code::NotConsumed,
        Code::NotReleasable,
        Code::OrderNotFound,
        Code::OrderConflict,
        Code::IllegalTransition,
        Code::RefundExceedsPaid,
        Code::DurableTokenRequired,
        Code::TokenAlreadyUsed,
        Code::TokenNotFound,
        Code::KeyNotFound,
        Code::InvalidCursor,
        Code::ReconcileRunning,
        Code::Unavailable,
        Code::Internal,
    ];

    /// The code on the wire (`"error"`).
    pub fn as_str(self) -> &'static str {
        match self {
            Code::InvalidRequest => "invalid_request",
            Code::Unauthorized => "unauthorized",
            Code::Forbidden => "forbidden",
            Code::NotFound => "not_found",
            Code::MethodNotAllowed => "method_not_allowed",
            Code::PayloadTooLarge => "payload_too_large",
            Code::UnsupportedMediaType => "unsupported_media_type",
            Code::UriTooLong => "uri_too_long",
            Code::HeadersTooLarge => "headers_too_large",
            Code::RateLimited => "rate_limited",
            Code::TokenInvalid => "token_invalid",
            Code::TokenExpired => "token_expired",
            Code::TokenMismatch => "token_mismatch",
            Code::UnknownBizType => "unknown_biz_type",
            Code::FingerprintMismatch => "fingerprint_mismatch",
            Code::ResultAlreadySet => "result_already_set",
            Code::NotConsumed => "not_consumed",
            Code::NotReleasable => "not_releasable",
            Code::OrderNotFound => "order_not_found",
            Code::OrderConflict => "order_conflict",
            Code::IllegalTransition => "illegal_transition",
            Code::RefundExceedsPaid => "refund_exceeds_paid",
            Code::DurableTokenRequired => "durable_token_required",
            Code::TokenAlreadyUsed => "token_already_used",
            Code::TokenNotFound => "token_not_found",
            Code::KeyNotFound => "key_not_found",
            Code::InvalidCursor => "invalid_cursor",
            Code::ReconcileRunning => "reconcile_running",
            Code::Unavailable => "unavailable",
            Code::Internal => "internal",
        }
    }

    /// The one mapping from code to status.
    pub fn status(self) -> StatusCode {
        use StatusCode as S;
        match self {
            Code::InvalidRequest
            | Code::TokenInvalid
            | Code::TokenExpired
            | Code::InvalidCursor => S::BAD_REQUEST,
            Code::Unauthorized => S::UNAUTHORIZED,
            Code::Forbidden | Code::TokenMismatch => S::FORBIDDEN,
            Code::NotFound | Code::OrderNotFound | Code::TokenNotFound | Code::KeyNotFound => {
                S::NOT_FOUND
            }
            Code::MethodNotAllowed => S::METHOD_NOT_ALLOWED,
            Code::PayloadTooLarge => S::PAYLOAD_TOO_LARGE,
            Code::UnsupportedMediaType => S::UNSUPPORTED_MEDIA_TYPE,
            Code::UriTooLong => S::URI_TOO_LONG,
            Code::HeadersTooLarge => S::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Code::RateLimited => S::TOO_MANY_REQUESTS,
            Code::UnknownBizType | Code::FingerprintMismatch | Code::DurableTokenRequired => {
                S::UNPROCESSABLE_ENTITY
            }
            Code::ResultAlreadySet
            | Code::NotConsumed
            | Code::NotReleasable
            | Code::OrderConflict
            | Code::IllegalTransition
            | Code::RefundExceedsPaid
            | Code::TokenAlreadyUsed
            | Code::ReconcileRunning => S::CONFLICT,
            Code::Unavailable => S::SERVICE_UNAVAILABLE,
            Code::Internal => S::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A refusal: its code (which decides the status), the message for humans,
/// and what some codes add (body keys, `Retry-After`, `Allow`).
#[derive(Debug)]
pub struct ApiError {
    code: Code,
    message: String,
    /// Body keys beside `error` and `message` (`state`, `refundable_minor`).
    extra: Map<String, Value>,
    /// `Retry-After` in whole seconds (429, 503), at least 1 on the wire.
    retry_after: Option<u64>,
    /// `Allow` of a 405: the one method of the route (RFC 9110 requires it).
    allow: Option<&'static str>,
    /// Kept for the log line of a 500/503; never sent.
    source: Option<anyhow::Error>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.code.status().as_u16(),
            self.code.as_str(),
            self.message
        )
    }
}

impl ApiError {
    pub fn new(code: Code, message: impl Into<String>) -> ApiError {
        ApiError {
            code,
            message: message.into(),
            extra: Map::new(),
            retry_after: None,
            allow: None,
            source: None,
        }
    }
    /// 400 `invalid_request`
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(Code::InvalidRequest, message)
    }
    /// 401 `unauthorized`
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            Code::Unauthorized,
            "missing or unknown API key (Authorization: Bearer <key>)",
        )
    }
    /// 403 `forbidden`
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(Code::Forbidden, message)
    }
    /// 404 `not_found`
    pub fn not_found() -> ApiError {
        ApiError::new(Code::NotFound, "no such route")
    }
    /// 405 `method_not_allowed`, with `Allow: {allow}`.
    pub fn method_not_allowed(allow: &'static str) -> ApiError {
        let mut err = ApiError::new(Code::MethodNotAllowed, "method not allowed on this route");
        err.allow = Some(allow);
        err
    }
    /// 413 `payload_too_large`
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            Code::PayloadTooLarge,
            format!("request body larger than {limit} bytes"),
        )
    }
    /// 415 `unsupported_media_type`
    pub fn media_type() -> ApiError {
        ApiError::new(
            Code::UnsupportedMediaType,
            "request bodies must be application/json",
        )
    }
    /// 429 `rate_limited`, with `Retry-After` in whole seconds (at least 1).
    pub fn rate_limited(wait: std::time::Duration, message: impl Into<String>) -> ApiError {
        let mut err = ApiError::new(Code::RateLimited, message);
        err.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
        err
    }
    /// 414 `uri_too_long`
    pub fn uri_too_long(limit: usize) -> ApiError {
        ApiError::new(
            Code::UriTooLong,
            format!("path and query longer than {limit} bytes"),
        )
    }
    /// 431 `headers_too_large`
    pub fn headers_too_large(limit: usize) -> ApiError {
        ApiError::new(
            Code::HeadersTooLarge,
            format!("request headers larger than {limit} bytes"),
        )
    }
    /// 400 `token_invalid`
    pub fn token_invalid() -> ApiError {
        LedgerError::TokenInvalid.into()
    }
    /// 500 `internal`
    pub fn internal(e: anyhow::Error) -> ApiError {
        let mut err = ApiError::new(Code::Internal, "internal error");
        err.source = Some(e);
        err
    }
    pub fn with(mut self, key: &str, value: Value) -> ApiError {
        self.extra.insert(key.to_owned(), value);
        self
    }
}

impl From<LedgerError> for ApiError {
    fn from(e: LedgerError) -> ApiError {
        let code = match &e {
            LedgerError::InvalidRequest(_) => Code::InvalidRequest,
            LedgerError::TokenInvalid => Code::TokenInvalid,
            LedgerError::TokenExpired => Code::TokenExpired,
            LedgerError::TokenMismatch => Code::TokenMismatch,
            LedgerError::UnknownBizType(_) => Code::UnknownBizType,
            LedgerError::Forbidden(_) => Code::Forbidden,
            LedgerError::FingerprintMismatch => Code::FingerprintMismatch,
            LedgerError::ResultAlreadySet => Code::ResultAlreadySet,
            LedgerError::NotConsumed => Code::NotConsumed,
            LedgerError::NotReleasable => Code::NotReleasable,
            LedgerError::RateLimited { .. } => Code::RateLimited,
            LedgerError::Unavailable { .. } => Code::Unavailable,
            LedgerError::Internal(_) => Code::Internal,
        };
        let mut api = ApiError::new(code, e.to_string());
        match e {
            LedgerError::RateLimited { retry_after_secs } => {
                api.retry_after = Some(retry_after_secs)
            }
            LedgerError::Unavailable {
                retry_after_secs,
                source,
                ..
            } => {
                api.retry_after = Some(retry_after_secs);
                api.source = source;
            }
            LedgerError::Internal(source) => {
                api.message = "internal error".into();
                api.source = Some(source);
            }
            _ => {}
        }
        api
    }
}

/// A request value the domain refused (`BizType::parse` and the like): 400
/// `invalid_request`, its message naming the field.
impl From<Invalid> for ApiError {
    fn from(e: Invalid) -> ApiError {
        ApiError::invalid(e.0)
    }
}

/// Postgres errors answer as everywhere else: 503 `unavailable` with
/// `Retry-After` when it cannot be reached, 500 otherwise.
impl From<DurableError> for ApiError {
    fn from(e: DurableError) -> ApiError {
        LedgerError::postgres(e).into()
    }
}

impl From<OrderError> for ApiError {
    fn from(e: OrderError) -> ApiError {
        let message = e.to_string();
        match e {
            OrderError::NotFound => ApiError::new(Code::OrderNotFound, message),
            OrderError::Conflict => ApiError::new(Code::OrderConflict, message),
            OrderError::Transition(TransitionError::Illegal { state, .. }) => {
                ApiError::new(Code::IllegalTransition, message).with("state", json!(state.as_str()))
            }
            OrderError::Transition(TransitionError::RefundExceedsPaid { refundable, .. }) => {
                ApiError::new(Code::RefundExceedsPaid, message)
                    .with("refundable_minor", json!(refundable))
            }
            OrderError::DurableTokenRequired => ApiError::new(Code::DurableTokenRequired, message),
            OrderError::TokenAlreadyUsed => ApiError::new(Code::TokenAlreadyUsed, message),
            OrderError::Ledger(e) => e.into(),
        }
    }
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> ApiError {
        let message = e.to_string();
        match e {
            AdminError::TokenInvalid => ApiError::token_invalid(),
            AdminError::TokenNotFound => ApiError::new(Code::TokenNotFound, message),
            AdminError::KeyNotFound => ApiError::new(Code::KeyNotFound, message),
            AdminError::InvalidCursor => ApiError::new(Code::InvalidCursor, message),
            AdminError::InvalidRequest(m) => ApiError::invalid(m),
            AdminError::Postgres(d) => d.into(),
        }
    }
}

impl From<ReconcileError> for ApiError {
    fn from(e: ReconcileError) -> ApiError {
        match e {
            ReconcileError::Running => ApiError::new(
                Code::ReconcileRunning,
                "another reconcile run holds the lock; try again when it has finished",
            ),
            ReconcileError::Postgres(d) => d.into(),
        }
    }
}

impl ApiError {
    /// Logs the cause of a server error (by the request's middleware, which
    /// knows the request id; see `http::observe`).
    pub fn log_cause(&self, request_id: &str, method: &str, route: &str) {
        if let Some(source) = &self.source {
            if self.code.status().is_server_error() {
                tracing::error!(code = self.code.as_str(), error = ?source, request_id, method, route, "request failed");
            }
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.code.status()
    }

    fn error_response(&self) -> HttpResponse {
        let mut body = Map::new();
        body.insert("error".into(), json!(self.code.as_str()));
        body.insert("message".into(), json!(self.message));
        for (k, v) in &self.extra {
            body.insert(k.clone(), v.clone());
        }
        let mut resp = HttpResponse::build(self.code.status());
        if let Some(secs) = self.retry_after {
            resp.insert_header((header::RETRY_AFTER, secs.max(1).to_string()));
        }
        if let Some(allow) = self.allow {
            resp.insert_header((header::ALLOW, allow));
        }
        resp.json(Value::Object(body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_is_listed_once_with_its_own_text() {
        for (i, a) in Code::ALL.iter().enumerate() {
            for b in &Code::ALL[i + 1..] {
                assert_ne!(a, b);
                assert_ne!(a.as_str(), b.as_str());
            }
        }
    }

    /// Wherever docs/api.md writes a status right before a code (`409
    /// \`not_releasable\``, or a table's `| 409 | \`not_releasable\``), it is
    /// the status the code answers with; and every code is documented so.
    #[test]
    fn each_code_answers_with_the_status_docs_api_md_gives_it() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/api.md");
        let doc = std::fs::read_to_string(path).expect("docs/api.md");
        for code in Code::ALL {
            let quoted = format!("`{}`", code.as_str());
            let mut documented = 0;
            for (at, _) in doc.match_indices(&quoted) {
                let before = doc[..at].trim_end();
                let before = before.strip_suffix('|').unwrap_or(before).trim_end();
                let Some(digits) = before.get(before.len().saturating_sub(3)..) else {
                    continue;
                };
                let standalone = before[..before.len() - digits.len()]
                    .chars()
                    .next_back()
                    .is_none_or(|c| c.is_whitespace() || c == '|');
                if let (Ok(status), true) = (digits.parse::<u16>(), standalone) {
                    assert_eq!(
                        status,
                        code.status().as_u16(),
                        "docs/api.md: {status} {quoted}"
                    );
                    documented += 1;
                }
            }
            assert!(documented > 0, "docs/api.md never gives {quoted} a status");
        }
    }

    #[test]
    fn retry_after_and_allow_go_out_as_headers() {
        let limited = ApiError::rate_limited(std::time::Duration::from_millis(1500), "slow down")
            .error_response();
        assert_eq!(limited.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(limited.headers().get(header::RETRY_AFTER).unwrap(), "2");
        let refused = ApiError::method_not_allowed("POST").error_response();
        assert_eq!(refused.status(), StatusCode::METHOD_NOT_ALLOWED);
        assert_eq!(refused.headers().get(header::ALLOW).unwrap(), "POST");
        assert!(refused.headers().get(header::RETRY_AFTER).is_none());
    }
}
