//! Admin routes (role admin; reconcile also role reconciler): one token's or
//! key's story, audit pages, fleet stats, reconciliation, and freeing a token
//! stuck in `processing`.

use std::collections::BTreeMap;

use std::time::Duration;

use reqwest::Method;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::client::Client;
use crate::error::Error;
use crate::outcome::{expect_outcome, Released, State, Timestamp};
use crate::retry::RetryPolicy;

/// One audit event.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AuditEvent {
    pub id: String,
    pub at: Timestamp,
    /// `token.issued`, `token.consumed`, `key.consumed`, `order.paid`, ...
    pub kind: String,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub biz_type: Option<String>,
    #[serde(default)]
    pub order_id: Option<String>,
    #[serde(default)]
    pub client: Option<String>,
    #[serde(default)]
    pub detail: Value,
}

/// `GET /v1/admin/tokens/{token}`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TokenView {
    pub token: String,
    pub biz_type: String,
    #[serde(default)]
    pub subject: Option<String>,
    #[serde(default)]
    pub client: Option<String>,
    pub state: State,
    pub issued_at: Timestamp,
    pub expires_at: Timestamp,
    #[serde(default)]
    pub consumed_at: Option<Timestamp>,
    #[serde(default)]
    pub fingerprint: Option<String>,
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub result: Option<Value>,
    pub duplicate_attempts: i64,
    pub events: Vec<AuditEvent>,
}

/// `GET /v1/admin/keys?client=&biz_type=&key=`: the token view's shape with
/// `key` and `client` instead of `token`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct KeyView {
    pub key: String,
    pub client: String,
    pub biz_type: String,
    #[serde(default)]
    pub subject: Option<String>,
    pub state: State,
    #[serde(default)]
    pub consumed_at: Option<Timestamp>,
    #[serde(default)]
    pub fingerprint: Option<String>,
    #[serde(default)]
    pub request_id: Option<String>,
    #[serde(default)]
    pub result: Option<Value>,
    #[serde(default)]
    pub duplicate_attempts: i64,
    #[serde(default)]
    pub events: Vec<AuditEvent>,
}

/// The filters of `GET /v1/admin/audit`; all optional.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    pub subject: Option<String>,
    pub biz_type: Option<String>,
    pub order_id: Option<String>,
    pub kind: Option<String>,
    /// Inclusive.
    pub since: Option<Timestamp>,
    /// Exclusive.
    pub until: Option<Timestamp>,
    /// 1 to 1000; the ledger's default is 100.
    pub limit: Option<u32>,
    /// `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

/// One page of audit events, newest first.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct AuditPage {
    pub events: Vec<AuditEvent>,
    /// Pass it as [`AuditQuery::cursor`] for the next page; none on the last.
    #[serde(default)]
    pub next_cursor: Option<String>,
}

/// Counters of one biz type over the window.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct BizStats {
    pub issued: u64,
    pub consumed: u64,
    pub duplicates: u64,
    /// `duplicates / (consumed + duplicates)`.
    pub duplicate_rate: f64,
    pub expired: u64,
    pub invalid: u64,
}

/// `GET /v1/admin/stats`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Stats {
    pub window: String,
    /// `normal`, `degraded` or `redis_down`.
    pub mode: String,
    pub biz_types: BTreeMap<String, BizStats>,
}

/// `POST /v1/admin/reconcile`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReconcileRequest {
    /// Find and report only.
    pub dry_run: bool,
    /// Limit the scans to this window back from now, e.g. `24h`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    /// How long to wait for the report (default 30 minutes). A run is never
    /// retried: a try that timed out may still be running on the ledger.
    #[serde(skip)]
    pub timeout: Option<std::time::Duration>,
}

/// The reconciliation report (the CLI's JSON). Classes are keyed by name
/// (`redis_live_but_consumed`, `order_inconsistent`, ...).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ReconcileReport {
    pub started_at: Timestamp,
    pub finished_at: Timestamp,
    pub dry_run: bool,
    pub scanned: BTreeMap<String, u64>,
    pub found: BTreeMap<String, u64>,
    pub repaired: BTreeMap<String, u64>,
    /// The orders counted in `found.order_inconsistent`.
    #[serde(default)]
    pub inconsistent_orders: Vec<Value>,
    /// Stopped early; rerun to finish.
    #[serde(default)]
    pub interrupted: bool,
    /// Phases that could not finish; the others ran.
    #[serde(default)]
    pub errors: Vec<String>,
}

#[derive(Serialize)]
struct ReasonBody<'a> {
    reason: &'a str,
}

impl Client {
    /// What happened to one token: its record and its audit events.
    pub async fn admin_token(&self, token: &str) -> Result<TokenView, Error> {
        self.get(self.url(&["v1", "admin", "tokens", token])).await
    }

    /// What happened to one client key.
    pub async fn admin_key(
        &self,
        client: &str,
        biz_type: &str,
        key: &str,
    ) -> Result<KeyView, Error> {
        let mut url = self.url(&["v1", "admin", "keys"]);
        url.query_pairs_mut()
            .append_pair("client", client)
            .append_pair("biz_type", biz_type)
            .append_pair("key", key);
        self.get(url).await
    }

    /// One page of audit events.
    pub async fn audit(&self, query: &AuditQuery) -> Result<AuditPage, Error> {
        let mut url = self.url(&["v1", "admin", "audit"]);
        {
            let mut q = url.query_pairs_mut();
            let time = |t: &Timestamp| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
            for (name, value) in [
                ("subject", query.subject.clone()),
                ("biz_type", query.biz_type.clone()),
                ("order_id", query.order_id.clone()),
                ("kind", query.kind.clone()),
                ("since", query.since.as_ref().map(time)),
                ("until", query.until.as_ref().map(time)),
                ("limit", query.limit.map(|n| n.to_string())),
                ("cursor", query.cursor.clone()),
            ] {
                if let Some(v) = value {
                    q.append_pair(name, &v);
                }
            }
        }
        self.get(url).await
    }

    /// Fleet-wide counters over `window` (`<n>s|m|h|d`; none: `1h`).
    pub async fn stats(&self, window: Option<&str>) -> Result<Stats, Error> {
        let mut url = self.url(&["v1", "admin", "stats"]);
        if let Some(w) = window {
            url.query_pairs_mut().append_pair("window", w);
        }
        self.get(url).await
    }

    /// Runs a reconciliation now; `reconcile_running` while another holds the lock.
    pub async fn reconcile(&self, request: &ReconcileRequest) -> Result<ReconcileReport, Error> {
        let wait = request.timeout.unwrap_or(Duration::from_secs(30 * 60));
        let once = RetryPolicy::none().deadline(wait).attempt_timeout(wait);
        self.call_with(
            &once,
            Method::POST,
            self.url(&["v1", "admin", "reconcile"]),
            Some(request),
        )
        .await?
        .json()
    }

    /// Frees a token stuck in `processing` (its consumer died before
    /// recording a result or releasing it): `reason` (1 to 500 characters)
    /// goes into the audit event. `not_releasable` when it has a result or an
    /// order event.
    pub async fn admin_release_token(&self, token: &str, reason: &str) -> Result<Released, Error> {
        let answer = self
            .post(
                self.url(&["v1", "admin", "tokens", token, "release"]),
                &ReasonBody { reason },
            )
            .await?;
        expect_outcome(&answer, "released")?;
        Ok(Released)
    }
}
