//! The OpenAPI 3 description, generated from the handlers' annotations.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::{admin, ops, orders, tokens, ErrorBody};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idempotency-ledger",
        description = "Exactly-once tokens for payment-grade requests. Errors are always {\"error\": code, \"message\": text}. Checks apply in this order: request limits (414, 431), authentication (401), the client's request ceiling (429 rate_limited with Retry-After), request shape (413, 415, 400; JSON nested deeper than 32 is 400), token validity (400 token_invalid: a bad tag, or a token the fleet never issued), biz type known (422), biz type granted (403), then the operation. Answers that repeat an earlier one carry `Idempotent-Replayed: true`."
    ),
    paths(
        tokens::issue, tokens::generate, tokens::consume, tokens::result, tokens::release,
        orders::create, orders::get, orders::pay, orders::refund, orders::close,
        ops::healthz, ops::readyz, ops::metrics, ops::openapi,
        admin::token, admin::audit, admin::stats, admin::run_reconcile,
    ),
    components(schemas(
        ErrorBody, tokens::IssueRequest, tokens::IssueResponse, tokens::GenerateResponse,
        tokens::ConsumeRequest, tokens::ConsumeResponse, tokens::ResultRequest, tokens::ReleaseRequest,
        tokens::OutcomeResponse, ops::Readiness,
        orders::CreateOrderRequest, orders::OrderBody, orders::OrderEventBody, orders::PayRequest,
        orders::RefundRequest, orders::CloseRequest, orders::EventResponse,
        crate::admin::TokenView, crate::admin::AuditEvent, crate::admin::AuditPage,
        crate::admin::Stats, crate::admin::BizStats, admin::ReconcileRequest,
        crate::reconcile::Report, crate::reconcile::Classes, crate::reconcile::Scanned,
        crate::reconcile::InconsistentOrder,
    )),
    modifiers(&BearerAuth),
    tags(
        (name = "tokens", description = "Issue and consume one-time tokens"),
        (name = "orders", description = "The payment state machine: CREATED -> PAID -> PARTIALLY_REFUNDED -> REFUNDED, CREATED -> CLOSED"),
        (name = "operations", description = "Health, readiness, metrics"),
        (name = "admin", description = "Audit, stats and reconciliation (role admin; reconcile: admin or reconciler)"),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path parameter is a `{name}` of its path, and the query strings
    /// of API.md are query parameters (OpenAPI 3 rejects anything else).
    #[test]
    fn parameters_sit_where_the_requests_carry_them() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let mut query = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (_, op) in item.as_object().expect("operations") {
                for p in op["parameters"].as_array().into_iter().flatten() {
                    let name = p["name"].as_str().expect("name");
                    match p["in"].as_str() {
                        Some("path") => assert!(
                            path.contains(&format!("{{{name}}}")),
                            "{path}: `{name}` is not in the path"
                        ),
                        Some("query") => query.push(format!("{path}?{name}")),
                        other => panic!("{path}: `{name}` in {other:?}"),
                    }
                }
            }
        }
        for want in [
            "/api/token/generate?bizType",
            "/api/token/generate?userId",
            "/v1/admin/audit?cursor",
            "/v1/admin/audit?limit",
            "/v1/admin/stats?window",
        ] {
            assert!(
                query.iter().any(|q| q == want),
                "{want} not a query parameter"
            );
        }
        let limit = &doc["paths"]["/v1/admin/audit"]["get"]["parameters"]
            .as_array()
            .expect("parameters")
            .iter()
            .find(|p| p["name"] == "limit")
            .expect("limit")["schema"];
        assert_eq!(limit["type"], "integer", "{limit}");
    }

    /// A result is any JSON value (API.md), not only an object.
    #[test]
    fn results_are_any_json() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let schemas = &doc["components"]["schemas"];
        for (schema, field) in [("ResultRequest", "result"), ("TokenView", "result")] {
            let s = &schemas[schema]["properties"][field];
            assert!(s.is_object(), "{schema}.{field} missing");
            assert_ne!(s["type"], "object", "{schema}.{field}: {s}");
        }
    }

    /// An order event declares each status it can answer, not one 409 whose
    /// description lists the rest.
    #[test]
    fn order_events_declare_every_status() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        for event in ["pay", "refund", "close"] {
            let responses =
                &doc["paths"][format!("/v1/orders/{{order_id}}/{event}")]["post"]["responses"];
            for status in [
                "200", "400", "401", "403", "404", "409", "413", "415", "422", "429", "503",
            ] {
                assert!(
                    responses[status].is_object(),
                    "{event}: no {status} in {responses}"
                );
            }
        }
    }
}
