//! Errors: one variant per API error code (the ledger's `{"error", "message"}`
//! bodies), plus what can go wrong on the way (transport, decoding).

use std::fmt;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Map, Value};

/// One error answer of the ledger: its status, its `error` code, its
/// `message`, and the whole body (some codes carry more keys, e.g. `state`
/// for `illegal_transition`, `refundable_minor` for `refund_exceeds_paid`).
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    pub status: StatusCode,
    /// The API error code, e.g. `token_expired`.
    pub code: String,
    /// For humans; never match on it.
    pub message: String,
    /// The whole JSON body of the answer.
    pub body: Map<String, Value>,
    /// `Retry-After` of the answer, when it had one (429, 503).
    pub retry_after: Option<Duration>,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.code,
            self.status.as_u16(),
            self.message
        )
    }
}

impl Problem {
    /// Reads an error answer. A body that is not the ledger's error shape
    /// (say, a proxy's HTML page) still becomes a problem: its code is derived
    /// from the status, so a 503 from a load balancer is `unavailable` and is
    /// retried like the ledger's own.
    pub(crate) fn from_answer(
        status: StatusCode,
        retry_after: Option<Duration>,
        body: &[u8],
    ) -> Problem {
        let parsed: Option<Map<String, Value>> = serde_json::from_slice(body).ok();
        let code = parsed
            .as_ref()
            .and_then(|m| m.get("error"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        match (code, parsed) {
            (Some(code), Some(body)) => Problem {
                status,
                message: body
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                code,
                body,
                retry_after,
            },
            _ => Problem {
                status,
                code: match status {
                    StatusCode::SERVICE_UNAVAILABLE => "unavailable".to_owned(),
                    StatusCode::TOO_MANY_REQUESTS => "rate_limited".to_owned(),
                    other => format!("http_{}", other.as_u16()),
                },
                message: String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned(),
                body: Map::new(),
                retry_after,
            },
        }
    }
}

macro_rules! api_errors {
    ($( $(#[doc = $doc:literal])* $variant:ident => $code:literal, )*) => {
        /// Everything a call can answer besides success.
        ///
        /// One variant per API error code (each holds the whole [`Problem`]),
        /// [`Error::Other`] for a code this version does not know, and the
        /// failures on the way: [`Error::Transport`], [`Error::Decode`],
        /// [`Error::Encode`], [`Error::Config`]. The crate's documentation has
        /// the decision table: what your code must do on each.
        #[derive(Debug, thiserror::Error)]
        #[non_exhaustive]
        pub enum Error {
            $(
                $(#[doc = $doc])*
                #[error("{0}")]
                $variant(Problem),
            )*
            /// An error code this version of the client does not know.
            #[error("{0}")]
            Other(Problem),
            /// No answer: connecting failed, the connection broke, or a try
            /// timed out, on every try the retry policy allowed. The ledger may
            /// or may not have acted on it: retry the same request value (it
            /// carries the same `request_id`) to learn what happened.
            #[error("transport: {0}")]
            Transport(#[source] reqwest::Error),
            /// A success answer this client could not read.
            #[error("undecodable {status} answer: {source}")]
            Decode {
                status: StatusCode,
                #[source]
                source: serde_json::Error,
            },
            /// A value of yours could not be serialized to JSON (e.g. a map
            /// with non-string keys).
            #[error("cannot encode the request: {0}")]
            Encode(#[source] serde_json::Error),
            /// A bad base URL or API key given to the builder.
            #[error("client configuration: {0}")]
            Config(String),
        }

        impl Error {
            pub(crate) fn from_problem(p: Problem) -> Error {
                match p.code.as_str() {
                    $( $code => Error::$variant(p), )*
                    _ => Error::Other(p),
                }
            }

            /// The ledger's answer, for every API error code.
            pub fn problem(&self) -> Option<&Problem> {
                match self {
                    $( Error::$variant(p) => Some(p), )*
                    Error::Other(p) => Some(p),
                    Error::Transport(_) | Error::Decode { .. } | Error::Encode(_) | Error::Config(_) => None,
                }
            }
        }
    };
}

api_errors! {
    /// 400: the body or query does not fit the API (a bug in the caller, or a
    /// value out of range).
    InvalidRequest => "invalid_request",
    /// 400: malformed token, bad tag, unknown signing key, or a token this
    /// fleet never issued. Never retry; a bug or tampering.
    TokenInvalid => "token_invalid",
    /// 400: never consumed and past its expiry (or purged after retention).
    /// Issue a new token and start over with it.
    TokenExpired => "token_expired",
    /// 403: issued to another subject or client, the `biz_type` differs, or a
    /// result/release by another client than the consumer (keys: another
    /// `subject` than the first call's).
    TokenMismatch => "token_mismatch",
    /// 422: consumed earlier for a request with another fingerprint: this
    /// token (key) belongs to a different request. Do not run the step.
    FingerprintMismatch => "fingerprint_mismatch",
    /// 409: a different result is already recorded.
    ResultAlreadySet => "result_already_set",
    /// 409: a result for a token (key) that is not consumed.
    NotConsumed => "not_consumed",
    /// 409: a release of a token (key) that has a result or an order event,
    /// or is not consumed.
    NotReleasable => "not_releasable",
    /// 503: the tier that decides could not be reached; nothing changed.
    /// Retried by the client until its policy gives up.
    Unavailable => "unavailable",
    /// 429: over a rate limit. Retried by the client (honouring
    /// `Retry-After`) until its policy gives up.
    RateLimited => "rate_limited",
    /// 401: missing or wrong API key.
    Unauthorized => "unauthorized",
    /// 403: a biz type not granted to this client, or an admin route without
    /// the admin role.
    Forbidden => "forbidden",
    /// 422: the biz type is not configured on the ledger.
    UnknownBizType => "unknown_biz_type",
    /// 404: no such route.
    NotFound => "not_found",
    /// 405: the route exists with another method.
    MethodNotAllowed => "method_not_allowed",
    /// 413: the body is over 8 KiB (64 KiB for results).
    PayloadTooLarge => "payload_too_large",
    /// 415: the body is not `application/json`.
    UnsupportedMediaType => "unsupported_media_type",
    /// 414: path and query too long.
    UriTooLong => "uri_too_long",
    /// 431: headers too large.
    HeadersTooLarge => "headers_too_large",
    /// 404: reading a client-supplied key nobody consumed (or one forgotten
    /// after retention).
    KeyNotFound => "key_not_found",
    /// 404 (admin): a valid token the fleet has no record of.
    TokenNotFound => "token_not_found",
    /// 400 (admin): a bad audit cursor.
    InvalidCursor => "invalid_cursor",
    /// 409 (admin): another reconcile run holds the lock.
    ReconcileRunning => "reconcile_running",
    /// 404: no such order (or another client's).
    OrderNotFound => "order_not_found",
    /// 409: the order id is taken with another body or by another client.
    OrderConflict => "order_conflict",
    /// 409: the order's state forbids the event; the body's `state` says which.
    IllegalTransition => "illegal_transition",
    /// 409: a refund beyond what is still refundable (`refundable_minor`).
    RefundExceedsPaid => "refund_exceeds_paid",
    /// 422: order events need a token of a durable biz type.
    DurableTokenRequired => "durable_token_required",
    /// 409: the token was consumed for something else.
    TokenAlreadyUsed => "token_already_used",
    /// 500: the ledger failed; it logged the cause.
    Internal => "internal",
}

impl Error {
    /// The API error code (`token_expired`, ...), when the ledger answered one.
    pub fn code(&self) -> Option<&str> {
        self.problem().map(|p| p.code.as_str())
    }

    /// The HTTP status of the ledger's answer, when there was one.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Error::Decode { status, .. } => Some(*status),
            other => other.problem().map(|p| p.status),
        }
    }

    /// The answer's `Retry-After`, when it had one.
    pub fn retry_after(&self) -> Option<Duration> {
        self.problem().and_then(|p| p.retry_after)
    }

    /// Whether the client retries it: no answer (connection error, timeout),
    /// 429 and 503. Every other answer is final: repeating it would change
    /// nothing.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Transport(e) => !e.is_builder(),
            Error::Unavailable(_) | Error::RateLimited(_) => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_map_to_their_variants_and_unknown_ones_to_other() {
        let p = |code: &str| {
            Problem::from_answer(
                StatusCode::BAD_REQUEST,
                None,
                format!(r#"{{"error":"{code}","message":"m","state":"PAID"}}"#).as_bytes(),
            )
        };
        assert!(matches!(
            Error::from_problem(p("token_expired")),
            Error::TokenExpired(_)
        ));
        assert!(matches!(
            Error::from_problem(p("key_not_found")),
            Error::KeyNotFound(_)
        ));
        let other = Error::from_problem(p("brand_new_code"));
        assert!(matches!(other, Error::Other(_)));
        assert_eq!(other.code(), Some("brand_new_code"));
        let ill = Error::from_problem(p("illegal_transition"));
        assert_eq!(
            ill.problem().and_then(|p| p.body.get("state")),
            Some(&Value::from("PAID"))
        );
    }

    #[test]
    fn a_non_json_503_is_unavailable_and_retryable() {
        let p = Problem::from_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(Duration::from_secs(2)),
            b"<html>busy</html>",
        );
        let e = Error::from_problem(p);
        assert!(matches!(e, Error::Unavailable(_)));
        assert!(e.is_retryable());
        assert_eq!(e.retry_after(), Some(Duration::from_secs(2)));
        let teapot = Error::from_problem(Problem::from_answer(StatusCode::IM_A_TEAPOT, None, b""));
        assert_eq!(teapot.code(), Some("http_418"));
        assert!(!teapot.is_retryable());
    }
}
