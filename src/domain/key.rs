//! Client-supplied keys (`/v1/keys`): the key's text, and the identity it has
//! in both tiers (its row id and the hash tag of its Redis key), derived only
//! from (client, biz type, key), so that another client's equal key is
//! another key.

use sha2::{Digest, Sha256};

use super::{BizType, Invalid};

/// What a key's handle starts with. A token never contains a `.`, so a
/// handle is never mistaken for a token text (nor the other way round).
pub const HANDLE_PREFIX: &str = "k.";

/// A key chosen by the client: 1 to 255 printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ClientKey(String);

impl ClientKey {
    pub fn parse(s: &str) -> Result<ClientKey, Invalid> {
        if s.is_empty() || s.len() > 255 || !s.bytes().all(|b| (0x20..=0x7e).contains(&b)) {
            return Err(Invalid(
                "`key` must be 1 to 255 printable ASCII characters".into(),
            ));
        }
        Ok(ClientKey(s.to_owned()))
    }
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A key's identity in the tiers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyIdentity {
    /// Its row id: negative, so never a snowflake id (see [`id_of_handle`]).
    pub id: i64,
    /// `k.<sha256 hex>`: the hash tag of its Redis key, and its row's `token`.
    pub handle: String,
}

/// The identity of `key` of `client` under `biz`. Each part is length
/// prefixed, so no two triples hash the same input.
pub fn identity(client: &str, biz: &BizType, key: &ClientKey) -> KeyIdentity {
    let mut h = Sha256::new();
    for part in [client, biz.as_str(), key.as_str()] {
        h.update(u64::try_from(part.len()).unwrap_or(u64::MAX).to_be_bytes());
        h.update(part.as_bytes());
    }
    let digest = h.finalize();
    let handle = format!("{HANDLE_PREFIX}{}", hex::encode(digest));
    KeyIdentity {
        id: id_of_digest(&digest),
        handle,
    }
}

/// The first 63 bits of the digest, negated: -2^63 to -1.
fn id_of_digest(digest: &[u8]) -> i64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let n = i64::try_from(u64::from_be_bytes(first) >> 1).unwrap_or(i64::MAX);
    -n - 1
}

/// The row id of a handle (`None`: not a key's handle).
pub fn id_of_handle(handle: &str) -> Option<i64> {
    let digest = hex::decode(handle.strip_prefix(HANDLE_PREFIX)?).ok()?;
    (digest.len() == 32).then(|| id_of_digest(&digest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_1_to_255_printable_ascii() {
        for ok in ["a", " ", "~", &"k".repeat(255), "\"quoted\" key: 7"] {
            assert!(ClientKey::parse(ok).is_ok(), "{ok:?}");
        }
        for bad in ["", &"k".repeat(256), "tab\there", "nl\n", "é", "\u{7f}"] {
            assert!(ClientKey::parse(bad).is_err(), "{bad:?}");
        }
    }

    /// A key's identity is stored: its row id in Postgres (one row per key
    /// rests on it, with the primary key) and its handle in Redis (the
    /// marker's name and hash tag). A derivation that changed would give
    /// every existing key a second, fresh row and marker: consumable again.
    #[test]
    fn identity_is_the_one_every_stored_key_was_given() {
        let biz = BizType::parse("order").expect("biz");
        let k = ClientKey::parse("k-1").expect("key");
        let id = identity("payments", &biz, &k);
        assert_eq!(id.id, -4_018_462_649_941_974_968);
        assert_eq!(
            id.handle,
            "k.6f88e4fa91eebf6f0f62fb86a13523ffd6fc8ce84cffd8179dc77f6ee0199961"
        );
    }

    #[test]
    fn identity_depends_on_client_biz_and_key_only() {
        let biz = BizType::parse("order").expect("biz");
        let refund = BizType::parse("refund").expect("biz");
        let k = ClientKey::parse("k-1").expect("key");
        let a = identity("payments", &biz, &k);
        assert_eq!(a, identity("payments", &biz, &k));
        assert_ne!(a.id, identity("refunds", &biz, &k).id);
        assert_ne!(a.id, identity("payments", &refund, &k).id);
        assert_ne!(
            a.id,
            identity("payments", &biz, &ClientKey::parse("k-2").expect("key")).id
        );
        // Length prefixes: moving a boundary changes the identity.
        let ab = identity("ab", &biz, &ClientKey::parse("c").expect("key"));
        let a_bc = identity("a", &biz, &ClientKey::parse("bc").expect("key"));
        assert_ne!(ab.id, a_bc.id);
        assert!(a.id < 0);
        assert_eq!(id_of_handle(&a.handle), Some(a.id));
        assert_eq!(id_of_handle("order_abc"), None);
        assert!(!a.handle.contains('{') && !a.handle.contains('}'));
    }
}
