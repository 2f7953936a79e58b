//! Callers and what they may do: clients from `[[clients]]`, identified by the
//! SHA-256 of their API key, compared in constant time. Keys are never stored
//! or logged.

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::BizType;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Payment and refund APIs: issue and consume tokens of their biz types.
    Service,
    /// The reconciliation cron.
    Reconciler,
    /// Auditors and operators: every `/v1/admin` route, every biz type.
    Admin,
}

/// SHA-256 (hex) of the development keys shipped in the default config.
pub const DEV_KEY_HASHES: &[&str] = &[
    "47270087500f39d054d1f059a00fc29ab03f97ad73583a0248d04c601ab22d9d",
    "ebfda70bbc453aff89524a3e9f56912ccd62717d44ec24b7f789f8615b1af98f",
    "4c5f5c594a86506b77d7ca70e3f03b99f0a5a50b06a5422cb57d0be719e60a0f",
    "df76ff796f70d2c9cb055ea6280553caa27eda26b70e01082c160de75a05a4a9",
];

#[derive(Clone)]
pub struct Client {
    pub name: String,
    pub role: Role,
    pub key_sha256: [u8; 32],
    pub biz_types: Vec<BizType>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("biz_types", &self.biz_types)
            .finish_non_exhaustive()
    }
}

impl Client {
    pub fn key_sha256_hex(&self) -> String {
        hex::encode(self.key_sha256)
    }

    /// May this client issue and consume tokens of `biz`? Admins may use all.
    pub fn may_use(&self, biz: &BizType) -> bool {
        self.role == Role::Admin || self.biz_types.iter().any(|b| b == biz)
    }

    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }
}

/// The configured clients, looked up by API key.
#[derive(Debug, Clone)]
pub struct Clients {
    clients: Vec<Client>,
}

impl Clients {
    pub fn new(clients: Vec<Client>) -> Clients {
        Clients { clients }
    }

    /// Finds the client whose key hashes to the presented one. Every client is
    /// compared (constant time per comparison, no early exit), so timing does
    /// not reveal which prefix matched or how many clients there are before it.
    pub fn authenticate(&self, api_key: &[u8]) -> Option<&Client> {
        let presented: [u8; 32] = Sha256::digest(api_key).into();
        let mut found = None;
        for client in &self.clients {
            if bool::from(client.key_sha256.ct_eq(&presented)) {
                found = Some(client);
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authenticates_by_hash() {
        let clients = Clients::new(vec![Client {
            name: "p".into(),
            role: Role::Service,
            key_sha256: Sha256::digest(b"secret").into(),
            biz_types: vec![BizType::parse("order").unwrap()],
        }]);
        assert_eq!(
            clients.authenticate(b"secret").map(|c| c.name.as_str()),
            Some("p")
        );
        assert!(clients.authenticate(b"secreT").is_none());
        assert!(clients.authenticate(b"").is_none());
    }
}
