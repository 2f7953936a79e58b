//! Recorded reconcile runs, for auditors: each run's whole report, newest
//! first, one page at a time (`GET /v1/admin/reconcile/runs`,
//! `audit reconcile-runs`).

use serde::{Deserialize, Serialize};
use serde_json::{json, Value as Json};
use utoipa::ToSchema;

use super::{time, Admin, AdminError};
use crate::durable::reconcile::{self as sql, RecordedRun};

/// Runs in a page when the caller does not say.
pub const DEFAULT_RUNS: u32 = 20;
/// The most runs a page may ask for.
pub const MAX_RUNS: u32 = 100;

/// One page of recorded runs.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct RunsPage {
    /// Newest first: each the report of `POST /v1/admin/reconcile` with its
    /// `id`, `by` (who asked: a client's name, `cli` for the subcommand;
    /// null for a run recorded before it was kept), `inconsistent_orders`
    /// as the orders' ids and their problems in `order_problems`.
    #[schema(value_type = Vec<Object>)]
    pub runs: Vec<Json>,
    /// Pass as `cursor` for the next (older) page; null at the end.
    pub next_cursor: Option<String>,
}

impl Admin {
    /// Recorded runs, newest first; `cursor` is a page's `next_cursor`.
    pub async fn reconcile_runs(
        &self,
        limit: u32,
        cursor: Option<&str>,
    ) -> Result<RunsPage, AdminError> {
        if !(1..=MAX_RUNS).contains(&limit) {
            return Err(AdminError::InvalidRequest(format!(
                "`limit` must be between 1 and {MAX_RUNS}"
            )));
        }
        let before = cursor
            .map(|c| c.parse::<i64>().ok().filter(|id| *id > 0))
            .map(|c| c.ok_or(AdminError::InvalidCursor))
            .transpose()?;
        let mut rows = sql::runs(&self.pool, i64::from(limit) + 1, before)
            .await
            .map_err(AdminError::Postgres)?;
        let more = rows.len() > limit as usize;
        rows.truncate(limit as usize);
        let next_cursor = if more {
            rows.last().map(|r| r.id.to_string())
        } else {
            None
        };
        Ok(RunsPage {
            runs: rows.into_iter().map(run_view).collect(),
            next_cursor,
        })
    }
}

/// A recorded run as the API shows it.
fn run_view(run: RecordedRun) -> Json {
    let mut view = run.report.clone().unwrap_or_else(|| {
        // Recorded before whole reports were kept: its counts alone.
        json!({
            "by": null,
            "started_at": time(run.started_at),
            "finished_at": time(run.finished_at),
            "dry_run": run.dry_run,
            "scanned": null,
            "found": run.found,
            "repaired": run.repaired,
            "inconsistent_orders": [],
            "redis_ahead_of_postgres": [],
            "interrupted": run.interrupted,
            "errors": run.errors,
        })
    });
    if let Json::Object(map) = &mut view {
        let problems = map.remove("inconsistent_orders").unwrap_or(json!([]));
        let ids: Vec<Json> = problems
            .as_array()
            .map(|orders| {
                orders
                    .iter()
                    .filter_map(|o| o.get("order_id").cloned())
                    .collect()
            })
            .unwrap_or_default();
        map.insert("id".to_owned(), Json::from(run.id.to_string()));
        map.entry("by").or_insert(Json::Null);
        map.insert("inconsistent_orders".to_owned(), Json::from(ids));
        map.insert("order_problems".to_owned(), problems);
    }
    view
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(report: Option<Json>) -> RecordedRun {
        let at = chrono::DateTime::<chrono::Utc>::UNIX_EPOCH;
        RecordedRun {
            id: 7,
            started_at: at,
            finished_at: at,
            dry_run: false,
            interrupted: false,
            errors: json!([]),
            found: json!({}),
            repaired: json!({}),
            report,
        }
    }

    #[test]
    fn a_run_shows_who_asked_and_its_orders_ids() {
        let view = run_view(recorded(Some(json!({
            "id": "7",
            "by": "ops-alice",
            "inconsistent_orders": [{"order_id": "o-1", "problems": ["p"]}],
        }))));
        assert_eq!(view["id"], "7");
        assert_eq!(view["by"], "ops-alice");
        assert_eq!(view["inconsistent_orders"], json!(["o-1"]));
        assert_eq!(
            view["order_problems"],
            json!([{"order_id": "o-1", "problems": ["p"]}])
        );
    }

    #[test]
    fn a_run_recorded_without_by_shows_null() {
        let old_report = run_view(recorded(Some(json!({"inconsistent_orders": []}))));
        assert_eq!(old_report["by"], Json::Null);
        let counts_only = run_view(recorded(None));
        assert_eq!(counts_only["by"], Json::Null);
        assert_eq!(counts_only["id"], "7");
    }
}
