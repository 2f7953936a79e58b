//! The token text and its tags.
//!
//! ```text
//! <biz_type>_<key id>_<base64url(payload), no padding>
//! payload (37 bytes) = version (1, = 1)
//!                    | id       (8, snowflake, big endian)
//!                    | exp      (4, Unix seconds, big endian)
//!                    | binding  (8,  HMAC-SHA256(secret, "idl1-bind" core client 0 subject)[..8])
//!                    | tag      (16, HMAC-SHA256(secret, "idl1" core binding)[..16])
//! core = biz 0 kid 0 version id exp
//! ```
//!
//! `tag` authenticates everything before it: a bad one is a forgery
//! (`token_invalid`). `binding` ties the token to the client and subject it was
//! issued to, so a genuine token presented by someone else is told apart
//! (`token_mismatch`) from a forged one. The biz type cannot hold `_` and key ids cannot either, so the
//! first two underscores split the text; base64 is decoded strictly
//! (canonical only), so any change of a single character is rejected.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

use super::snowflake::SnowflakeId;
use crate::config::SigningKey;
use crate::domain::BizType;

pub const MAX_TOKEN_LEN: usize = 128;
const VERSION: u8 = 1;
const PAYLOAD_LEN: usize = 1 + 8 + 4 + 16 + 8;
const TAG_LEN: usize = 16;
const BIND_LEN: usize = 8;

type HmacSha256 = Hmac<Sha256>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("token is malformed")]
    Malformed,
    #[error("token signed by an unknown key")]
    UnknownKey,
    #[error("token tag does not verify")]
    BadTag,
}

/// What a token says about itself, checked by its tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    pub biz_type: BizType,
    pub id: SnowflakeId,
    /// Expiry, Unix seconds.
    pub exp: u32,
}

impl Claims {
    pub fn expires_at_ms(&self) -> i64 {
        i64::from(self.exp) * 1000
    }
    pub fn issued_at_ms(&self) -> i64 {
        self.id.timestamp_ms()
    }
}

/// A token whose tag verified; its binding is checked by
/// [`TokenCodec::is_bound_to`].
#[derive(Debug, Clone)]
pub struct VerifiedToken {
    pub text: String,
    pub claims: Claims,
    key_index: usize,
    binding: [u8; BIND_LEN],
}

impl VerifiedToken {
    /// A shortened form for logs: the biz prefix and the last 4 characters.
    pub fn redacted(&self) -> String {
        redact(&self.text)
    }
}

/// Shortens any token-like text for logs (never the whole text at info level).
pub fn redact(text: &str) -> String {
    let prefix: String = text.chars().take_while(|c| *c != '_').take(32).collect();
    let n = text.chars().count();
    let tail: String = text.chars().skip(n.saturating_sub(4)).collect();
    format!("{prefix}_…{tail}")
}

/// Signs and verifies tokens under the configured keys.
#[derive(Clone)]
pub struct TokenCodec {
    keys: Vec<SigningKey>,
    /// Each key's HMAC with the key already absorbed (its two padded key
    /// blocks hashed once, here), cloned for every tag and binding instead
    /// of keyed again: two SHA-256 blocks fewer per HMAC, two HMACs per
    /// token signed or presented.
    keyed: Vec<HmacSha256>,
}

impl std::fmt::Debug for TokenCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|k| k.id.as_str()).collect();
        f.debug_struct("TokenCodec").field("keys", &ids).finish()
    }
}

impl TokenCodec {
    /// `keys[0]` signs; every key verifies. Panics on an empty list, which
    /// configuration validation rules out.
    pub fn new(keys: Vec<SigningKey>) -> TokenCodec {
        assert!(!keys.is_empty(), "at least one signing key");
        // HMAC accepts keys of any length, so this cannot fail.
        let keyed = keys
            .iter()
            .map(|k| {
                <HmacSha256 as Mac>::new_from_slice(&k.secret).expect("HMAC takes any key length")
            })
            .collect();
        TokenCodec { keys, keyed }
    }

    fn core(mac: &mut HmacSha256, biz: &str, kid: &str, version: u8, id: u64, exp: u32) {
        mac.update(biz.as_bytes());
        mac.update(&[0]);
        mac.update(kid.as_bytes());
        mac.update(&[0, version]);
        mac.update(&id.to_be_bytes());
        mac.update(&exp.to_be_bytes());
    }

    fn binding(
        &self,
        key: usize,
        biz: &str,
        id: u64,
        exp: u32,
        client: &str,
        subject: &str,
    ) -> HmacSha256 {
        let mut mac = self.keyed[key].clone();
        mac.update(b"idl1-bind");
        Self::core(&mut mac, biz, &self.keys[key].id, VERSION, id, exp);
        mac.update(client.as_bytes());
        mac.update(&[0]);
        mac.update(subject.as_bytes());
        mac
    }

    fn tag(
        &self,
        key: usize,
        biz: &str,
        version: u8,
        id: u64,
        exp: u32,
        binding: &[u8],
    ) -> HmacSha256 {
        let mut mac = self.keyed[key].clone();
        mac.update(b"idl1");
        Self::core(&mut mac, biz, &self.keys[key].id, version, id, exp);
        mac.update(binding);
        mac
    }

    /// Makes the token text for these claims, bound to `client` and `subject`.
    pub fn sign(&self, claims: &Claims, client: &str, subject: &str) -> String {
        let key = &self.keys[0];
        let biz = claims.biz_type.as_str();
        let (id, exp) = (claims.id.0, claims.exp);
        let binding = self
            .binding(0, biz, id, exp, client, subject)
            .finalize()
            .into_bytes();
        let tag = self
            .tag(0, biz, VERSION, id, exp, &binding[..BIND_LEN])
            .finalize()
            .into_bytes();
        let mut payload = [0u8; PAYLOAD_LEN];
        payload[0] = VERSION;
        payload[1..9].copy_from_slice(&id.to_be_bytes());
        payload[9..13].copy_from_slice(&exp.to_be_bytes());
        payload[13..21].copy_from_slice(&binding[..BIND_LEN]);
        payload[21..37].copy_from_slice(&tag[..TAG_LEN]);
        format!("{biz}_{}_{}", key.id, URL_SAFE_NO_PAD.encode(payload))
    }

    /// Parses the text and checks its tag. No I/O; constant-time comparison.
    pub fn verify(&self, text: &str) -> Result<VerifiedToken, TokenError> {
        if text.is_empty()
            || text.len() > MAX_TOKEN_LEN
            || !text
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(TokenError::Malformed);
        }
        let (biz, rest) = text.split_once('_').ok_or(TokenError::Malformed)?;
        let (kid, body) = rest.split_once('_').ok_or(TokenError::Malformed)?;
        let biz_type = BizType::parse(biz).map_err(|_| TokenError::Malformed)?;
        if body.len() != (PAYLOAD_LEN * 4).div_ceil(3) {
            return Err(TokenError::Malformed);
        }
        // Decoded on the stack: the length check above bounds it (the
        // decoder asks for room for a whole last quantum).
        let mut decoded = [0u8; PAYLOAD_LEN.div_ceil(3) * 3];
        let len = URL_SAFE_NO_PAD
            .decode_slice(body, &mut decoded)
            .map_err(|_| TokenError::Malformed)?;
        let payload = &decoded[..len];
        if payload.len() != PAYLOAD_LEN || payload[0] != VERSION {
            return Err(TokenError::Malformed);
        }
        let key_index = self
            .keys
            .iter()
            .position(|k| k.id == kid)
            .ok_or(TokenError::UnknownKey)?;
        let mut id = [0u8; 8];
        id.copy_from_slice(&payload[1..9]);
        let id = u64::from_be_bytes(id);
        let mut exp = [0u8; 4];
        exp.copy_from_slice(&payload[9..13]);
        let exp = u32::from_be_bytes(exp);
        let mut binding = [0u8; BIND_LEN];
        binding.copy_from_slice(&payload[13..21]);
        self.tag(key_index, biz, payload[0], id, exp, &binding)
            .verify_truncated_left(&payload[21..37])
            .map_err(|_| TokenError::BadTag)?;
        if id >> 63 != 0 {
            return Err(TokenError::Malformed);
        }
        Ok(VerifiedToken {
            text: text.to_owned(),
            claims: Claims {
                biz_type,
                id: SnowflakeId(id),
                exp,
            },
            key_index,
            binding,
        })
    }

    /// Was this (verified) token issued to `client` for `subject`?
    pub fn is_bound_to(&self, token: &VerifiedToken, client: &str, subject: &str) -> bool {
        let c = &token.claims;
        self.binding(
            token.key_index,
            c.biz_type.as_str(),
            c.id.0,
            c.exp,
            client,
            subject,
        )
        .verify_truncated_left(&token.binding)
        .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(id: &str, secret: &str) -> SigningKey {
        SigningKey {
            id: id.into(),
            secret: secret.as_bytes().to_vec(),
        }
    }

    fn codec() -> TokenCodec {
        TokenCodec::new(vec![
            key("k2", "second-secret-second-secret-second-secret"),
            key("k1", "first-secret-first-secret-first-secret-xx"),
        ])
    }

    fn claims(biz: &str, id: u64, exp: u32) -> Claims {
        Claims {
            biz_type: BizType::parse(biz).unwrap(),
            id: SnowflakeId(id),
            exp,
        }
    }

    #[test]
    fn layout() {
        let c = codec();
        let t = c.sign(&claims("order", 42, 1_900_000_000), "payments", "user-42");
        assert!(t.starts_with("order_k2_"), "{t}");
        assert_eq!(t.len(), "order_k2_".len() + 50);
        let v = c.verify(&t).unwrap();
        assert_eq!(v.claims, claims("order", 42, 1_900_000_000));
        assert!(c.is_bound_to(&v, "payments", "user-42"));
        assert!(!c.is_bound_to(&v, "payments", "user-43"));
        assert!(!c.is_bound_to(&v, "refunds", "user-42"));
        assert_eq!(v.redacted(), format!("order_…{}", &t[t.len() - 4..]));
    }

    #[test]
    fn rotation_old_key_verifies_removed_key_does_not() {
        let old = TokenCodec::new(vec![key("k1", "first-secret-first-secret-first-secret-xx")]);
        let t = old.sign(&claims("order", 7, 1_900_000_000), "p", "s");
        assert!(
            codec().verify(&t).is_ok(),
            "retired-but-listed key verifies"
        );
        let removed = TokenCodec::new(vec![key("k2", "second-secret-second-secret-second-secret")]);
        assert_eq!(removed.verify(&t).unwrap_err(), TokenError::UnknownKey);
        let same_id_other_secret =
            TokenCodec::new(vec![key("k1", "another-secret-another-secret-another-s")]);
        assert_eq!(
            same_id_other_secret.verify(&t).unwrap_err(),
            TokenError::BadTag
        );
    }

    #[test]
    fn rejects_junk() {
        let c = codec();
        for bad in [
            "",
            "order",
            "order_k2",
            "order_k2_",
            "Order_k2_AAAA",
            &"a".repeat(129),
            "order_k2_%2F",
            "order_k2_ü",
        ] {
            assert!(c.verify(bad).is_err(), "{bad}");
        }
    }

    proptest! {
        #[test]
        fn round_trip(id in 0u64..(1u64 << 63), exp: u32, biz in "[a-z][a-z0-9-]{0,31}",
                      client in "[a-z]{1,10}", subject in "\\PC{1,40}") {
            let c = codec();
            let cl = claims(&biz, id, exp);
            let t = c.sign(&cl, &client, &subject);
            prop_assert!(t.len() <= MAX_TOKEN_LEN);
            let v = c.verify(&t).unwrap();
            prop_assert_eq!(&v.claims, &cl);
            prop_assert!(c.is_bound_to(&v, &client, &subject));
        }

        #[test]
        fn any_single_character_change_is_rejected(id in 0u64..(1u64 << 63), exp: u32,
                                                   pos in 0usize..200, replacement in "[A-Za-z0-9_-]") {
            let c = codec();
            let t = c.sign(&claims("order", id, exp), "p", "s");
            let pos = pos % t.len();
            let r = replacement.chars().next().unwrap();
            prop_assume!(t.as_bytes()[pos] as char != r);
            let mut changed: Vec<char> = t.chars().collect();
            changed[pos] = r;
            let changed: String = changed.into_iter().collect();
            prop_assert!(c.verify(&changed).is_err(), "{} accepted", changed);
        }

        #[test]
        fn arbitrary_text_never_panics(s in "\\PC{0,200}") {
            let _ = codec().verify(&s);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..300)) {
            let s = String::from_utf8_lossy(&b);
            let _ = codec().verify(&s);
        }
    }
}
