//! The HTTP surface of API.md: routes ([`tokens`], [`keys`], [`orders`], [`admin`],
//! [`audit_seal`], [`ops`], the web [`console`]),
//! extractors ([`extract`]), request limits ([`limits`]), the error body
//! ([`error`]) and the generated OpenAPI description ([`openapi`]). Handlers
//! receive the services of [`AppState`] (the ledger, orders, the audit
//! queries, the reconciler), never a pool or a Redis connection.

pub mod admin;
pub mod audit_seal;
pub mod console;
pub mod error;
pub mod extract;
pub mod keys;
pub mod limits;
pub mod openapi;
pub mod ops;
pub mod orders;
pub mod schema;
pub mod tokens;
pub mod uncertain;

use std::sync::Arc;
use std::time::Instant;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage, HttpResponse};
use serde::Serialize;
use tracing::Instrument;
use utoipa::ToSchema;

use crate::admin::Admin;
use crate::audit_seal::Seals;
use crate::auth::Clients;
use crate::config::LimitSettings;
use crate::fleet::Fleet;
use crate::ledger::Ledger;
use crate::orders::Orders;
use crate::reconcile::Reconciler;
use error::ApiError;

/// What every handler can reach.
#[derive(Debug, Clone)]
pub struct AppState {
    pub ledger: Arc<Ledger>,
    /// The fleet's agreement on Redis (`/readyz` reports it).
    pub fleet: Arc<Fleet>,
    pub orders: Orders,
    pub admin: Admin,
    pub reconciler: Reconciler,
    pub clients: Clients,
    /// Request limits checked before any I/O.
    pub limits: LimitSettings,
    /// Sealed audit checkpoints (the last one, for the console).
    pub seals: Seals,
}

/// The error body of every refusal.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// A stable code, e.g. `token_invalid`.
    pub error: String,
    /// For humans.
    pub message: String,
}

async fn not_found() -> Result<HttpResponse, ApiError> {
    Err(ApiError::not_found())
}

/// 405 in our error shape, with the `Allow` header RFC 9110 requires.
fn method_not_allowed(allow: &'static str) -> HttpResponse {
    actix_web::ResponseError::error_response(&ApiError::method_not_allowed(allow))
}

/// One resource with its one method (`allow`); other methods answer 405.
fn resource(path: &str, allow: &'static str) -> actix_web::Resource {
    web::resource(path).default_service(web::to(move || async move { method_not_allowed(allow) }))
}

/// Registers every route. The router tries them in this order, and each
/// pattern with a `{segment}` it tries costs a regex run (with its captures)
/// whether it matches or not: so the payment path's routes come first, the
/// most frequent first, and the operators' and the console's after them.
/// No two patterns match one path, so the order changes no answer.
pub fn routes(cfg: &mut web::ServiceConfig) {
    cfg.service(resource("/v1/tokens", "POST").route(web::post().to(tokens::issue)))
        .service(
            resource("/v1/tokens/{token}/consume", "POST").route(web::post().to(tokens::consume)),
        )
        .service(
            resource("/v1/tokens/{token}/result", "POST").route(web::post().to(tokens::result)),
        )
        .service(resource("/v1/keys/consume", "POST").route(web::post().to(keys::consume)))
        .service(resource("/v1/keys/result", "POST").route(web::post().to(keys::result)))
        .service(resource("/v1/keys/release", "POST").route(web::post().to(keys::release)))
        .service(resource("/v1/orders/{order_id}/pay", "POST").route(web::post().to(orders::pay)))
        .service(
            resource("/v1/tokens/{token}/release", "POST").route(web::post().to(tokens::release)),
        )
        .service(
            resource("/v1/orders/{order_id}/refund", "POST").route(web::post().to(orders::refund)),
        )
        .service(resource("/v1/orders", "POST").route(web::post().to(orders::create)))
        .service(resource("/v1/tokens/{token}", "GET").route(web::get().to(tokens::state)))
        .service(resource("/v1/keys", "GET").route(web::get().to(keys::get)))
        .service(
            resource("/v1/orders/{order_id}/close", "POST").route(web::post().to(orders::close)),
        )
        .service(resource("/v1/orders/{order_id}", "GET").route(web::get().to(orders::get)))
        .service(resource("/api/token/generate", "GET").route(web::get().to(tokens::generate)))
        .service(resource("/healthz", "GET").route(web::get().to(ops::healthz)))
        .service(resource("/readyz", "GET").route(web::get().to(ops::readyz)))
        .service(resource("/metrics", "GET").route(web::get().to(ops::metrics)))
        .service(resource("/openapi.json", "GET").route(web::get().to(openapi::serve)))
        .service(resource("/v1/admin/tokens/{token}", "GET").route(web::get().to(admin::token)))
        .service(resource("/v1/admin/keys", "GET").route(web::get().to(admin::key)))
        .service(
            resource("/v1/admin/tokens/{token}/release", "POST")
                .route(web::post().to(admin::release)),
        )
        .service(
            resource("/v1/admin/tokens/{token}/result", "POST")
                .route(web::post().to(uncertain::token_result)),
        )
        .service(
            resource("/v1/admin/keys/result", "POST").route(web::post().to(uncertain::key_result)),
        )
        .service(resource("/v1/admin/uncertain", "GET").route(web::get().to(uncertain::list)))
        .service(
            resource("/v1/admin/keys/release", "POST").route(web::post().to(admin::release_key)),
        )
        .service(resource("/v1/admin/audit", "GET").route(web::get().to(admin::audit)))
        .service(resource("/v1/admin/audit/seal", "GET").route(web::get().to(audit_seal::last)))
        .service(resource("/v1/admin/stats", "GET").route(web::get().to(admin::stats)))
        .service(
            resource("/v1/admin/reconcile", "POST").route(web::post().to(admin::run_reconcile)),
        )
        .service(
            resource("/v1/admin/reconcile/runs", "GET").route(web::get().to(admin::reconcile_runs)),
        )
        .service(resource("/console", "GET").route(web::get().to(console::index)))
        .service(resource("/console/", "GET").route(web::get().to(console::index)))
        .service(resource("/console/{asset}", "GET").route(web::get().to(console::file)))
        .default_service(web::to(not_found));
}

/// Request id, the latency histogram and the answer counter by route
/// pattern (never by raw path, which holds tokens and would make the label
/// set unbounded), and the log lines of server errors. The pattern is read
/// after routing, from the resource the router matched: asking before would
/// match the path against every route a second time.
///
/// The request's span is at debug: at info (the default) it would be made,
/// its fields formatted, and entered and left on every poll of the request,
/// for log lines that at info only server errors write; those carry the
/// request id, method and route themselves.
pub async fn observe(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let request_id = req
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
        .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
    let method = req.method().clone();
    let state = req.app_data::<web::Data<AppState>>().cloned();
    let span = tracing::debug_span!(
        "request",
        %request_id,
        %method,
        route = tracing::field::Empty
    );
    let start = Instant::now();
    let res = next.call(req).instrument(span.clone()).await;
    let elapsed = start.elapsed();
    let endpoint = res
        .as_ref()
        .ok()
        .and_then(|r| r.request().match_pattern())
        .unwrap_or_else(|| "unmatched".to_owned());
    span.record("route", endpoint.as_str());
    // An error a middleware returned still becomes an answer: its status.
    let status = match &res {
        Ok(r) => r.status().as_u16(),
        Err(e) => e.as_response_error().status_code().as_u16(),
    };
    if let Some(state) = state {
        let metrics = state.ledger.metrics();
        metrics
            .request_duration
            .with_label_values(&[endpoint.as_str()])
            .observe(elapsed.as_secs_f64());
        metrics.http_request(&endpoint, method.as_str(), status);
    }
    let mut res = res?;
    let latency_us = elapsed.as_micros() as u64;
    let client = || {
        res.request()
            .extensions()
            .get::<extract::Caller>()
            .map(|c| c.0.name.clone())
            .unwrap_or_default()
    };
    if status >= 500 {
        // The cause of a server error we answered (never sent to the client).
        if let Some(e) = res
            .response()
            .error()
            .and_then(|e| e.as_error::<ApiError>())
        {
            e.log_cause(&request_id, method.as_str(), &endpoint);
        }
        tracing::info!(
            status,
            client = %client(),
            latency_us,
            %request_id,
            %method,
            route = endpoint.as_str(),
            "handled"
        );
    } else if tracing::enabled!(tracing::Level::DEBUG) {
        // One line per request costs as much CPU as a forged request's
        // whole refusal: at debug only
        // (`RUST_LOG=info,idempotency_ledger::http=debug` for an access log).
        span.in_scope(|| tracing::debug!(status, client = %client(), latency_us, "handled"));
    }
    if let Ok(v) = HeaderValue::from_str(&request_id) {
        res.headers_mut()
            .insert(HeaderName::from_static("x-request-id"), v);
    }
    Ok(res)
}

#[cfg(test)]
mod tests {
    use actix_web::dev::ResourceDef;

    /// Every pattern `routes` registers, read from this file's source.
    fn patterns() -> Vec<String> {
        include_str!("http.rs")
            .split("resource(\"")
            .skip(1)
            .filter_map(|rest| rest.split_once('"').map(|(p, _)| p.to_owned()))
            .collect()
    }

    #[test]
    fn no_two_routes_match_one_path() {
        let patterns = patterns();
        assert!(patterns.len() >= 30, "{patterns:?}");
        for p in &patterns {
            // A path of the pattern: each `{segment}` filled in, once with a
            // word that is also a static segment of another route.
            for fill in ["t0k3n", "consume", "keys"] {
                let path = p
                    .split('/')
                    .map(|seg| if seg.starts_with('{') { fill } else { seg })
                    .collect::<Vec<_>>()
                    .join("/");
                let matching: Vec<&String> = patterns
                    .iter()
                    .filter(|q| ResourceDef::new(q.as_str()).is_match(&path))
                    .collect();
                assert_eq!(matching, vec![p], "{path}");
            }
        }
    }
}
