//! Callers and what they may do: clients from `[[clients]]`, identified by the
//! SHA-256 of their API key, compared in constant time, each held to its own
//! request ceiling (governor). Keys are never stored or logged.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
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
    /// Auditors: every `/v1/admin` read (and any token or order read), no
    /// call that changes state.
    Auditor,
    /// Operators: every `/v1/admin` route, every biz type.
    Admin,
}

/// SHA-256 (hex) of the development keys shipped in the default config.
pub const DEV_KEY_HASHES: &[&str] = &[
    "47270087500f39d054d1f059a00fc29ab03f97ad73583a0248d04c601ab22d9d",
    "ebfda70bbc453aff89524a3e9f56912ccd62717d44ec24b7f789f8615b1af98f",
    "4c5f5c594a86506b77d7ca70e3f03b99f0a5a50b06a5422cb57d0be719e60a0f",
    "df76ff796f70d2c9cb055ea6280553caa27eda26b70e01082c160de75a05a4a9",
    "46151c35c1c09bca0b049ce55099e4f67fd04efe91716eec70fd1fa8ce898163",
];

#[derive(Clone)]
pub struct Client {
    pub name: String,
    pub role: Role,
    pub key_sha256: [u8; 32],
    pub biz_types: Vec<BizType>,
    /// Requests per second on every `/v1` route (burst: one second's worth).
    pub rate: NonZeroU32,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("name", &self.name)
            .field("role", &self.role)
            .field("biz_types", &self.biz_types)
            .field("rate", &self.rate)
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

    /// May this client read every client's tokens, keys and orders (admins
    /// and auditors)? Reading never changes state.
    pub fn reads_all(&self) -> bool {
        matches!(self.role, Role::Admin | Role::Auditor)
    }
}

/// The configured clients, looked up by API key, with their rate limiters.
#[derive(Clone)]
pub struct Clients {
    /// Shared with each request that authenticates as one (no copy per request).
    clients: Vec<Arc<Client>>,
    limiters: Arc<HashMap<String, DefaultDirectRateLimiter>>,
}

impl std::fmt::Debug for Clients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clients")
            .field("clients", &self.clients)
            .finish_non_exhaustive()
    }
}

impl Clients {
    pub fn new(clients: Vec<Client>) -> Clients {
        let limiters = clients
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    RateLimiter::direct(Quota::per_second(c.rate).allow_burst(c.rate)),
                )
            })
            .collect();
        Clients {
            clients: clients.into_iter().map(Arc::new).collect(),
            limiters: Arc::new(limiters),
        }
    }

    /// Counts one request against `client`'s ceiling: `Err(wait)` when over
    /// it, with the time until the next request would be admitted.
    pub fn admit(&self, client: &Client) -> Result<(), Duration> {
        match self.limiters.get(&client.name) {
            Some(limiter) => limiter
                .check()
                .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now())),
            None => Ok(()),
        }
    }

    /// Finds the client whose key hashes to the presented one. Every client is
    /// compared (constant time per comparison, no early exit), so timing does
    /// not reveal which prefix matched or how many clients there are before it.
    pub fn authenticate(&self, api_key: &[u8]) -> Option<&Arc<Client>> {
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
            rate: NonZeroU32::new(2).unwrap(),
        }]);
        assert_eq!(
            clients.authenticate(b"secret").map(|c| c.name.as_str()),
            Some("p")
        );
        assert!(clients.authenticate(b"secreT").is_none());
        assert!(clients.authenticate(b"").is_none());
        let p = clients.authenticate(b"secret").unwrap().clone();
        assert!(clients.admit(&p).is_ok());
        assert!(clients.admit(&p).is_ok());
        let wait = clients.admit(&p).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(500));
    }
}
