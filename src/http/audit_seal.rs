//! `GET /v1/admin/audit/seal`: the newest sealed audit checkpoint (role
//! admin), for the console's "last seal" (see [`crate::audit_seal`]).

use actix_web::{web, HttpResponse};

use super::admin::ReaderCaller;
use super::error::ApiError;
use super::AppState;
use crate::audit_seal::CheckpointView;

/// The newest sealed audit checkpoint, or `null` before the first seal.
/// `audit verify` recomputes every checkpoint; this only shows the last one.
#[utoipa::path(get, path = "/v1/admin/audit/seal", operation_id = "adminLastAuditSeal", tag = "admin",
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The newest checkpoint, or null when nothing is sealed yet", body = Option<CheckpointView>, example = json!({"id": "17", "sealed_at": "2026-12-02T07:30:00.000Z", "first_event_id": "1001", "last_event_id": "1342", "events": 342, "digest": "3f1a9c0e5b7d2468ac13579bdf02468ace13579bdf02468ace13579bdf024681"})),
        (status = 401, description = "unauthorized", body = super::ErrorBody),
        (status = 403, description = "forbidden: not an admin or auditor", body = super::ErrorBody),
        (status = 503, description = "unavailable: Postgres cannot be reached", body = super::ErrorBody),
    ))]
pub async fn last(
    state: web::Data<AppState>,
    ReaderCaller(_): ReaderCaller,
) -> Result<HttpResponse, ApiError> {
    // Postgres errors answer as on every admin route (`From<DurableError>`):
    // 503 `unavailable` with Retry-After when it cannot be reached, 500 otherwise.
    let last = state.seals.last().await?;
    Ok(HttpResponse::Ok().json(last))
}
