//! Fingerprints: `sha256:<hex>` of a business request, so that a token or key
//! consumed for one request is refused (`fingerprint_mismatch`) for another.

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::Error;

fn hex(digest: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(digest.len() * 2);
    for b in digest {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// `sha256:<hex>` of `bytes`.
pub fn fingerprint(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

/// The fingerprint of a value's JSON. Equal values give equal fingerprints
/// when they serialize the same way (struct fields in declaration order;
/// `serde_json` maps sorted by key, as without its `preserve_order` feature).
pub fn fingerprint_json<T: Serialize + ?Sized>(value: &T) -> Result<String, Error> {
    serde_json::to_vec(value)
        .map(|bytes| fingerprint(&bytes))
        .map_err(Error::Encode)
}

/// An HTTP request's fingerprint: method, path with query, and body, each
/// length-prefixed so that no two different requests hash the same input.
pub fn request_fingerprint(method: &str, path_and_query: &str, body: &[u8]) -> String {
    let mut h = Sha256::new();
    for part in [method.as_bytes(), path_and_query.as_bytes(), body] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part);
    }
    format!("sha256:{}", hex(&h.finalize()))
}

/// A short stable hex digest (first 16 bytes of SHA-256): scopes in keys.
pub(crate) fn short_digest(s: &str) -> String {
    hex(&Sha256::digest(s.as_bytes())[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_are_sha256_hex() {
        assert_eq!(
            fingerprint(b"abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(fingerprint_json(&[1, 2]).unwrap(), fingerprint(b"[1,2]"));
        assert_ne!(
            request_fingerprint("POST", "/a", b"b"),
            request_fingerprint("POST", "/ab", b"")
        );
        assert_eq!(short_digest("user-1").len(), 32);
    }
}
