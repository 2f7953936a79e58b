//! The `Idempotency-Key` header read from a request, the key it becomes in
//! the ledger (scoped), and which methods pass through untouched.

use super::*;

/// The key of a request: absent, or its value (an RFC 8941 string such as
/// `"8e03978e"` as the draft writes it, or the bare text as many clients
/// send it), or why it is unusable.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("send one Idempotency-Key header, not several".into());
    }
    let text = value
        .to_str()
        .map_err(|_| "the Idempotency-Key must be printable ASCII".to_owned())?
        .trim_matches([' ', '\t']);
    let key = match text.strip_prefix('"') {
        Some(rest) => {
            let inner = rest
                .strip_suffix('"')
                .ok_or_else(|| "the quoted Idempotency-Key has no closing quote".to_owned())?;
            let mut key = String::with_capacity(inner.len());
            let mut chars = inner.chars();
            while let Some(c) = chars.next() {
                match c {
                    '\\' => match chars.next() {
                        Some(e @ ('"' | '\\')) => key.push(e),
                        _ => return Err("a bad escape in the quoted Idempotency-Key".into()),
                    },
                    '"' => return Err("a bare quote inside the quoted Idempotency-Key".into()),
                    c => key.push(c),
                }
            }
            key
        }
        None => text.to_owned(),
    };
    if key.is_empty() || !key.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
        return Err("the Idempotency-Key must be 1 to 255 printable ASCII characters".into());
    }
    Ok(Some(key))
}

/// The key in the ledger: the header's key, prefixed by its scope's digest.
pub(super) fn ledger_key(
    config: &Config,
    parts: &http::request::Parts,
    key: &str,
) -> Result<String, String> {
    let scoped = match config.scope.as_ref().and_then(|scope| scope(parts)) {
        Some(scope) => format!("{}:{key}", short_digest(&scope)),
        None => key.to_owned(),
    };
    if scoped.len() > MAX_KEY {
        return Err(format!(
            "the Idempotency-Key is too long (at most {} characters)",
            MAX_KEY - (scoped.len() - key.len())
        ));
    }
    Ok(scoped)
}

pub(super) fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}
