//! Operations routes: liveness, readiness (with the mode) and Prometheus
//! metrics (the OpenAPI description is served by [`super::openapi`]).

use std::time::Duration;

use actix_web::{web, HttpResponse};
use serde::Serialize;
use utoipa::ToSchema;

use super::AppState;
use crate::fast::breaker::Mode;

/// Liveness: 200 while the process runs.
#[utoipa::path(get, path = "/healthz", operation_id = "healthz", tag = "operations", responses((status = 200, description = "alive", body = Object, example = json!({"status": "ok"}))))]
pub async fn healthz() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"status": "ok"}))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Readiness {
    /// `up` or `down`.
    pub postgres: &'static str,
    /// `up`, `down` or `slow`.
    pub redis: &'static str,
    /// `normal`, `degraded` or `redis_down`.
    #[schema(value_type = crate::fast::breaker::Mode)]
    pub mode: &'static str,
    /// This instance's snowflake worker id.
    pub worker_id: u16,
    /// The fleet, as this instance last reported to it.
    pub fleet: FleetReadiness,
}

/// The fleet's agreement on Redis (docs/operations.md, "Fleet").
#[derive(Debug, Serialize, ToSchema)]
pub struct FleetReadiness {
    /// `normal` (Redis decides fast types) or `redis_down` (every member
    /// reported Redis down: Postgres decides them).
    #[schema(value_type = crate::fleet::FleetState)]
    pub state: &'static str,
    /// Bumped by every change of `state`.
    pub epoch: i64,
    /// Instances counted at the last report, and how many of them report
    /// Redis down.
    pub members: i64,
    pub redis_down_members: i64,
    /// Whether Redis may decide fast consumes on this instance now
    /// (otherwise they are decided by Postgres while the fleet is
    /// `redis_down`, or answered 503).
    pub redis_decides_here: bool,
}

/// What `/readyz` says of Redis in each mode.
fn redis_state(mode: Mode) -> &'static str {
    match mode {
        Mode::Normal => "up",
        Mode::Degraded => "slow",
        Mode::RedisDown => "down",
    }
}

/// Readiness: 200 while durable consumes can be decided, else 503, same body.
#[utoipa::path(get, path = "/readyz", operation_id = "readyz", tag = "operations", responses(
    (status = 200, description = "ready", body = Readiness, example = json!({"postgres": "up", "redis": "up", "mode": "normal", "worker_id": 3, "fleet": {"state": "normal", "epoch": 1, "members": 2, "redis_down_members": 0, "redis_decides_here": true}})),
    (status = 503, description = "cannot decide durable consumes (Postgres down)", body = Readiness)))]
pub async fn readyz(state: web::Data<AppState>) -> HttpResponse {
    let ledger = &state.ledger;
    let pg_up = ledger.postgres_reachable(Duration::from_secs(1)).await;
    let mode = ledger.mode();
    let body = Readiness {
        postgres: if pg_up { "up" } else { "down" },
        redis: redis_state(mode),
        mode: mode.as_str(),
        worker_id: ledger.worker_id(),
        fleet: {
            let fleet = &state.fleet;
            let v = fleet.view();
            FleetReadiness {
                state: v.state.as_str(),
                epoch: v.epoch,
                members: v.members,
                redis_down_members: v.redis_down_members,
                redis_decides_here: fleet.redis_may_decide().is_some(),
            }
        },
    };
    if pg_up {
        HttpResponse::Ok().json(body)
    } else {
        HttpResponse::ServiceUnavailable().json(body)
    }
}

/// Prometheus text exposition.
#[utoipa::path(get, path = "/metrics", operation_id = "metrics", tag = "operations", responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain", example = "# TYPE ledger_tokens_issued_total counter\nledger_tokens_issued_total{biz_type=\"order\"} 120\n")))]
pub async fn metrics(state: web::Data<AppState>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(state.ledger.metrics().render())
}
