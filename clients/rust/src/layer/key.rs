//! The `Idempotency-Key` header read from a request, the key it becomes in
//! the ledger (scoped), and which methods pass through untouched.

use super::*;
use crate::fingerprint::fingerprint;

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

/// The key in the ledger. Unscoped: the header's key. Scoped:
/// `<scope digest>:<key>`, or `<scope digest>#<SHA-256 of the key>` when that
/// would pass the ledger's 255 characters (the separator's fixed place tells
/// the two apart). The scope digest is 32 hex digits.
///
/// An unscoped key that has the shape of a scoped one is refused: it could
/// name a scoped user's key.
pub(super) fn ledger_key(scope: Option<&str>, key: &str) -> Result<String, String> {
    if key.len() > MAX_KEY {
        return Err(format!(
            "the Idempotency-Key is too long (at most {MAX_KEY} characters)"
        ));
    }
    let Some(scope) = scope else {
        if looks_scoped(key) {
            return Err(
                "an Idempotency-Key may not start with 32 hex digits and ':' or '#' (reserved)"
                    .into(),
            );
        }
        return Ok(key.to_owned());
    };
    let digest = short_digest(scope);
    let scoped = format!("{digest}:{key}");
    if scoped.len() <= MAX_KEY {
        return Ok(scoped);
    }
    Ok(format!(
        "{digest}#{}",
        &fingerprint(key.as_bytes())["sha256:".len()..]
    ))
}

/// `<32 lowercase hex digits>` then `:` or `#`: the shape of a scoped key.
fn looks_scoped(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() > SCOPE_DIGEST
        && b[..SCOPE_DIGEST]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        && matches!(b[SCOPE_DIGEST], b':' | b'#')
}

/// The length of a scope's digest in a key.
const SCOPE_DIGEST: usize = 32;

pub(super) fn is_safe(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}
