//! The `code` member of the layer's problem details: stable across
//! versions, one per situation. Each problem's `type` is
//! [`PROBLEM_TYPE_BASE`](super::PROBLEM_TYPE_BASE) followed by its code.

/// 400: the request has no `Idempotency-Key` and the layer requires one.
pub const IDEMPOTENCY_KEY_MISSING: &str = "idempotency_key_missing";
/// 400: the key is not 1 to 255 printable ASCII characters, the header is
/// repeated, or a quoted key is malformed.
pub const IDEMPOTENCY_KEY_INVALID: &str = "idempotency_key_invalid";
/// 409 with `Retry-After`: the first request with this key is still running.
pub const IDEMPOTENCY_KEY_IN_USE: &str = "idempotency_key_in_use";
/// 409: the first request with this key ran past its processing lease
/// without a stored response; whether its step happened is unknown until an
/// operator resolves it.
pub const IDEMPOTENCY_KEY_UNCERTAIN: &str = "idempotency_key_uncertain";
/// 422: the key was used for a request with another method, path or body.
pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency_key_reused";
/// 503 with `Retry-After`: the ledger could not be reached; nothing ran.
pub const LEDGER_UNAVAILABLE: &str = "ledger_unavailable";
/// 413: the request body is over the layer's limit.
pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
/// 400: the request body could not be read.
pub const REQUEST_BODY_UNREADABLE: &str = "request_body_unreadable";
/// 500: the ledger refused the layer's call (its API key, grants or biz
/// type are misconfigured); nothing ran. The same code as the Python and
/// Express middlewares'.
pub const LEDGER_ERROR: &str = "ledger_error";
/// 500: the handler answered, but its response body failed; the key stays
/// consumed.
pub const RESPONSE_FAILED: &str = "response_failed";
/// 500: the key's stored result is not a response this layer stored.
pub const STORED_RESPONSE_UNREADABLE: &str = "stored_response_unreadable";
/// 503: the runtime shut down while the handler ran.
pub const SHUTTING_DOWN: &str = "shutting_down";

/// Every code, for documentation checks.
pub const ALL: [&str; 12] = [
    IDEMPOTENCY_KEY_MISSING,
    IDEMPOTENCY_KEY_INVALID,
    IDEMPOTENCY_KEY_IN_USE,
    IDEMPOTENCY_KEY_UNCERTAIN,
    IDEMPOTENCY_KEY_REUSED,
    LEDGER_UNAVAILABLE,
    PAYLOAD_TOO_LARGE,
    REQUEST_BODY_UNREADABLE,
    LEDGER_ERROR,
    RESPONSE_FAILED,
    STORED_RESPONSE_UNREADABLE,
    SHUTTING_DOWN,
];
