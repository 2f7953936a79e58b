//! The one error type of the HTTP layer. Every refusal is
//! `{"error": code, "message": text}` (plus optional keys such as `state`);
//! 500s are logged with their cause chain and answered opaquely.

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde_json::{json, Map, Value};

use crate::ledger::LedgerError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub extra: Map<String, Value>,
    pub retry_after: Option<u64>,
    /// Kept for the log line of a 500/503; never sent.
    pub source: Option<anyhow::Error>,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
            extra: Map::new(),
            retry_after: None,
            source: None,
        }
    }
    /// 400 `invalid_request`
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    /// 401 `unauthorized`
    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or unknown API key (Authorization: Bearer <key>)",
        )
    }
    /// 403 `forbidden`
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
    /// 404 `not_found`
    pub fn not_found() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route")
    }
    /// 405 `method_not_allowed`
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "method not allowed on this route",
        )
    }
    /// 413 `payload_too_large`
    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!("request body larger than {limit} bytes"),
        )
    }
    /// 415 `unsupported_media_type`
    pub fn media_type() -> ApiError {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "request bodies must be application/json",
        )
    }
    /// 429 `rate_limited`, with `Retry-After` in whole seconds (at least 1).
    pub fn rate_limited(wait: std::time::Duration, message: impl Into<String>) -> ApiError {
        let mut err = ApiError::new(StatusCode::TOO_MANY_REQUESTS, "rate_limited", message);
        err.retry_after = Some(wait.as_secs_f64().ceil().max(1.0) as u64);
        err
    }
    /// 414 `uri_too_long`
    pub fn uri_too_long(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            format!("path and query longer than {limit} bytes"),
        )
    }
    /// 431 `headers_too_large`
    pub fn headers_too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            format!("request headers larger than {limit} bytes"),
        )
    }
    /// 400 `token_invalid`
    pub fn token_invalid() -> ApiError {
        LedgerError::TokenInvalid.into()
    }
    /// 500 `internal`
    pub fn internal(e: anyhow::Error) -> ApiError {
        let mut err = ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "internal error",
        );
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
        use StatusCode as S;
        let message = e.to_string();
        let (status, code) = match &e {
            LedgerError::InvalidRequest(_) => (S::BAD_REQUEST, "invalid_request"),
            LedgerError::TokenInvalid => (S::BAD_REQUEST, "token_invalid"),
            LedgerError::TokenExpired => (S::BAD_REQUEST, "token_expired"),
            LedgerError::TokenMismatch => (S::FORBIDDEN, "token_mismatch"),
            LedgerError::UnknownBizType(_) => (S::UNPROCESSABLE_ENTITY, "unknown_biz_type"),
            LedgerError::Forbidden(_) => (S::FORBIDDEN, "forbidden"),
            LedgerError::FingerprintMismatch => (S::UNPROCESSABLE_ENTITY, "fingerprint_mismatch"),
            LedgerError::ResultAlreadySet => (S::CONFLICT, "result_already_set"),
            LedgerError::NotConsumed => (S::CONFLICT, "not_consumed"),
            LedgerError::NotReleasable => (S::CONFLICT, "not_releasable"),
            LedgerError::RateLimited { .. } => (S::TOO_MANY_REQUESTS, "rate_limited"),
            LedgerError::Unavailable { .. } => (S::SERVICE_UNAVAILABLE, "unavailable"),
            LedgerError::Internal(_) => (S::INTERNAL_SERVER_ERROR, "internal"),
        };
        let mut api = ApiError::new(status, code, message);
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

impl ApiError {
    /// Logs the cause of a server error (by the request's middleware, which
    /// knows the request id; see `http::observe`).
    pub fn log_cause(&self, request_id: &str, method: &str, route: &str) {
        if let Some(source) = &self.source {
            if self.status.is_server_error() {
                tracing::error!(code = self.code, error = ?source, request_id, method, route, "request failed");
            }
        }
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.status
    }

    fn error_response(&self) -> HttpResponse {
        let mut body = Map::new();
        body.insert("error".into(), json!(self.code));
        body.insert("message".into(), json!(self.message));
        for (k, v) in &self.extra {
            body.insert(k.clone(), v.clone());
        }
        let mut resp = HttpResponse::build(self.status);
        if let Some(secs) = self.retry_after {
            resp.insert_header((header::RETRY_AFTER, secs.max(1).to_string()));
        }
        resp.json(Value::Object(body))
    }
}
