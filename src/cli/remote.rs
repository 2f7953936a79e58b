//! `audit --url URL`: the `audit` subcommands' questions asked of a running
//! ledger's admin API (with the API key in `LEDGER_API_KEY`, never a flag)
//! instead of Postgres, answered with the same view types the database mode
//! prints, and the API's errors mapped to the same exit codes.

use std::time::Duration;

use serde::de::DeserializeOwned;
use url::Url;

use crate::admin::order::OrderView;
use crate::admin::runs::RunsPage;
use crate::admin::{AuditEvent, AuditPage, AuditQuery, KeyView, TokenView, MAX_LIMIT};

/// The environment variable holding the API key (role auditor or admin).
pub const API_KEY_ENV: &str = "LEDGER_API_KEY";

/// Why a question over HTTP got no answer; each maps to an exit code.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// 404: exit 1.
    #[error("{0}")]
    NotFound(String),
    /// No key, a bad URL, 400, 401, 403 and other 4xx: exit 2.
    #[error("{0}")]
    Usage(String),
    /// Could not connect, timed out, 5xx, an answer that is not the API's:
    /// exit 5.
    #[error("{0}")]
    Unavailable(String),
}

/// A client of one ledger's admin API.
#[derive(Debug, Clone)]
pub struct Remote {
    http: reqwest::Client,
    base: Url,
    key: String,
}

impl Remote {
    /// `url`: the ledger's base URL (`http` or `https`, a path prefix is
    /// kept); the key is read from [`API_KEY_ENV`].
    pub fn new(url: &str) -> Result<Remote, RemoteError> {
        let base = Url::parse(url)
            .map_err(|e| RemoteError::Usage(format!("--url `{url}` is not a URL: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(RemoteError::Usage(format!(
                "--url `{url}` must be an http:// or https:// URL"
            )));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(RemoteError::Usage(format!(
                "--url `{url}` must have no query or fragment"
            )));
        }
        let key = std::env::var(API_KEY_ENV)
            .ok()
            .filter(|k| !k.trim().is_empty())
            .ok_or_else(|| {
                RemoteError::Usage(format!(
                    "audit --url needs an API key (role auditor or admin) in the environment variable {API_KEY_ENV}"
                ))
            })?;
        let loopback = match base.host() {
            Some(url::Host::Domain(d)) => d.eq_ignore_ascii_case("localhost"),
            Some(url::Host::Ipv4(ip)) => ip.is_loopback(),
            Some(url::Host::Ipv6(ip)) => ip.is_loopback(),
            None => false,
        };
        if base.scheme() == "http" && !loopback {
            eprintln!(
                "idempotency-ledger: warning: --url is plain http: the API key crosses the network unencrypted"
            );
        }
        // No redirects: the key goes to the URL given, nowhere else.
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .user_agent(concat!(
                "idempotency-ledger-audit/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()
            .map_err(|e| RemoteError::Usage(format!("cannot build the HTTP client: {e}")))?;
        Ok(Remote { http, base, key })
    }

    fn url(&self, segments: &[&str], query: &[(&str, &str)]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        url
    }

    async fn get<T: DeserializeOwned>(&self, url: Url) -> Result<T, RemoteError> {
        let shown = format!("{}{}", url.origin().ascii_serialization(), url.path());
        let response = self
            .http
            .get(url)
            .bearer_auth(&self.key)
            .send()
            .await
            .map_err(|e| {
                RemoteError::Unavailable(format!("could not ask {shown}: {}", error_chain(&e)))
            })?;
        let status = response.status();
        let location = response
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|l| l.to_str().ok())
            .map(str::to_owned);
        let body = response.bytes().await.map_err(|e| {
            RemoteError::Unavailable(format!("{shown}: reading the answer: {}", error_chain(&e)))
        })?;
        if status.is_success() {
            return serde_json::from_slice(&body).map_err(|e| {
                RemoteError::Unavailable(format!("{shown}: an answer that is not the API's: {e}"))
            });
        }
        // The API's `{"error", "message"}`, or the start of whatever came.
        let said = match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(v) => format!(
                "{}: {}",
                v["error"].as_str().unwrap_or("error"),
                v["message"].as_str().unwrap_or_default()
            ),
            Err(_) => String::from_utf8_lossy(&body).chars().take(200).collect(),
        };
        let message = format!("{shown} answered {status}: {said}");
        Err(match status.as_u16() {
            404 => RemoteError::NotFound(message),
            300..=399 => RemoteError::Usage(format!(
                "{message} (redirected to {}; redirects are not followed: give that URL)",
                location.as_deref().unwrap_or("-")
            )),
            400..=499 => RemoteError::Usage(message),
            _ => RemoteError::Unavailable(message),
        })
    }

    /// `GET /v1/admin/tokens/{token}`.
    pub async fn token(&self, token: &str) -> Result<TokenView, RemoteError> {
        self.get(self.url(&["v1", "admin", "tokens", token], &[]))
            .await
    }

    /// `GET /v1/admin/keys?client=&biz_type=&key=`.
    pub async fn key(
        &self,
        client: &str,
        biz_type: &str,
        key: &str,
    ) -> Result<KeyView, RemoteError> {
        self.get(self.url(
            &["v1", "admin", "keys"],
            &[("client", client), ("biz_type", biz_type), ("key", key)],
        ))
        .await
    }

    /// `GET /v1/admin/audit?...`: one page.
    pub async fn audit(&self, q: &AuditQuery) -> Result<AuditPage, RemoteError> {
        let since = q.since.map(crate::admin::time);
        let until = q.until.map(crate::admin::time);
        let limit = q.limit.to_string();
        let mut pairs: Vec<(&str, &str)> = Vec::new();
        for (k, v) in [
            ("subject", &q.subject),
            ("biz_type", &q.biz_type),
            ("order_id", &q.order_id),
            ("client", &q.client),
            ("since", &since),
            ("until", &until),
            ("cursor", &q.cursor),
        ] {
            if let Some(v) = v {
                pairs.push((k, v));
            }
        }
        for k in &q.kinds {
            pairs.push(("kind", k.as_str()));
        }
        pairs.push(("limit", &limit));
        self.get(self.url(&["v1", "admin", "audit"], &pairs)).await
    }

    /// `GET /v1/admin/reconcile/runs?limit=&cursor=`.
    pub async fn reconcile_runs(
        &self,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<RunsPage, RemoteError> {
        let limit = limit.to_string();
        let mut pairs = vec![("limit", limit.as_str())];
        if let Some(c) = cursor {
            pairs.push(("cursor", c));
        }
        self.get(self.url(&["v1", "admin", "reconcile", "runs"], &pairs))
            .await
    }

    /// `GET /v1/orders/{id}` and the audit events naming it (oldest first,
    /// at most 1,000, as the database mode); `None` when there is no such
    /// order. The owning client is the one of its `order.created` event.
    pub async fn order(&self, order_id: &str) -> Result<Option<OrderView>, RemoteError> {
        #[derive(serde::Deserialize)]
        struct OrderBody {
            order_id: String,
            subject: String,
            #[serde(deserialize_with = "crate::admin::de_order_state")]
            state: crate::admin::FixedText,
            amount_minor: i64,
            refunded_minor: i64,
            currency: String,
            created_at: String,
            updated_at: String,
        }
        let order: OrderBody = match self.get(self.url(&["v1", "orders", order_id], &[])).await {
            Ok(o) => o,
            Err(RemoteError::NotFound(_)) => return Ok(None),
            Err(e) => return Err(e),
        };
        let page = self
            .audit(&AuditQuery {
                order_id: Some(order_id.to_owned()),
                limit: MAX_LIMIT,
                ..AuditQuery::default()
            })
            .await?;
        let mut events: Vec<AuditEvent> = page.events;
        events.reverse();
        let client = events
            .iter()
            .find(|e| e.kind == "order.created")
            .or_else(|| events.first())
            .and_then(|e| e.client.clone())
            .unwrap_or_default();
        Ok(Some(OrderView {
            order_id: order.order_id,
            client,
            subject: order.subject,
            state: order.state,
            amount_minor: order.amount_minor,
            refunded_minor: order.refunded_minor,
            currency: order.currency,
            created_at: order.created_at,
            updated_at: order.updated_at,
            events,
        }))
    }
}

/// reqwest's error with its sources (`connection refused` is two levels down).
fn error_chain(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
