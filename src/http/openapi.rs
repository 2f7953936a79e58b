//! The OpenAPI 3 description, generated from the handlers' annotations, and
//! the route that serves it.

use actix_web::HttpResponse;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ObjectBuilder, RefOr, ResponseBuilder, Type};
use utoipa::{Modify, OpenApi};

use super::error::Code;
use super::{admin, audit_seal, keys, ops, orders, tokens, uncertain, ErrorBody};

/// This document.
#[utoipa::path(get, path = "/openapi.json", operation_id = "openapiSpec", tag = "operations", responses((status = 200, description = "OpenAPI 3 description", body = Object, example = json!({"openapi": "3.1.0", "info": {"title": "idempotency-ledger", "version": "0.1.0"}, "paths": {}}))))]
pub async fn serve() -> HttpResponse {
    HttpResponse::Ok().json(ApiDoc::openapi())
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "idempotency-ledger",
        description = "Exactly-once tokens for payment-grade requests. Errors are always {\"error\": code, \"message\": text}. Checks apply in this order: request limits (414, 431), authentication (401), the client's request ceiling (429 rate_limited with Retry-After), request shape (413, 415, 400; JSON nested deeper than 32 is 400), token validity (400 token_invalid: a bad tag, or a token the fleet never issued), biz type known (422), biz type granted (403), then the operation. Answers that repeat an earlier one carry `Idempotent-Replayed: true`."
    ),
    paths(
        audit_seal::last,
        tokens::issue, tokens::generate, tokens::consume, tokens::result, tokens::release,
        keys::consume, keys::result, keys::release, keys::get,
        tokens::state,
        orders::create, orders::get, orders::pay, orders::refund, orders::close,
        ops::healthz, ops::readyz, ops::metrics, serve,
        admin::token, admin::key, admin::release, admin::release_key, admin::audit, admin::stats, admin::run_reconcile, admin::reconcile_runs,
        uncertain::list, uncertain::token_result, uncertain::key_result,
    ),
    components(schemas(
        crate::audit_seal::CheckpointView,
        ErrorBody, crate::domain::TokenStatus, crate::domain::AuditKind,
        crate::domain::order::OrderState, crate::fast::breaker::Mode, crate::ledger::AnswerOutcome,
        crate::ledger::DuplicateStatus, tokens::IssueRequest, tokens::IssueResponse, tokens::GenerateResponse,
        tokens::ConsumeRequest, tokens::ConsumeResponse, tokens::ResultRequest, tokens::ReleaseRequest,
        tokens::OutcomeResponse, tokens::TokenStateResponse, admin::AdminReleaseRequest, admin::AdminKeyReleaseRequest,
        ops::Readiness, ops::FleetReadiness, crate::fleet::FleetState,
        keys::KeyConsumeRequest, keys::KeyConsumeResponse, keys::KeyResultRequest,
        keys::KeyReleaseRequest, keys::KeyStateResponse,
        orders::NewOrderRequest, orders::OrderBody, orders::OrderEventBody, orders::PayRequest,
        orders::RefundRequest, orders::CloseRequest, orders::EventResponse,
        crate::admin::TokenView, crate::admin::KeyView, crate::admin::AuditEvent, crate::admin::AuditPage,
        crate::admin::Stats, crate::admin::BizStats, admin::ReconcileRequest,
        crate::reconcile::Report, crate::reconcile::Classes, crate::reconcile::Scanned,
        crate::reconcile::InconsistentOrder, crate::admin::runs::RunsPage,
        uncertain::UncertainItem, uncertain::UncertainPage, uncertain::AdminResultRequest,
        uncertain::AdminKeyResultRequest,
    )),
    modifiers(&BearerAuth, &Common),
    tags(
        (name = "tokens", description = "Issue and consume one-time tokens"),
        (name = "keys", description = "Client-supplied keys (the Idempotency-Key model): the same ledger for a key the caller already holds; a key belongs to (client, biz type)"),
        (name = "orders", description = "The payment state machine: CREATED -> PAID -> PARTIALLY_REFUNDED -> REFUNDED, CREATED -> CLOSED"),
        (name = "operations", description = "Health, readiness, metrics"),
        (name = "admin", description = "Audit, stats and reconciliation (role admin; reads: admin or auditor; reconcile: admin or reconciler)"),
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

/// Routes whose 200/201 may repeat an earlier answer (`Idempotent-Replayed`).
const REPLAYING: &[&str] = &[
    "/v1/tokens/{token}/consume",
    "/v1/tokens/{token}/result",
    "/v1/keys/consume",
    "/v1/keys/result",
    "/v1/orders",
    "/v1/orders/{order_id}/pay",
    "/v1/orders/{order_id}/refund",
    "/v1/orders/{order_id}/close",
];

/// What every route shares, added to each operation so that none can
/// forget it: the request limits (414, 431) and 405 everywhere; 401, 429
/// (the client's ceiling) and 500 on every route that needs a key; 400, 413
/// and 415 on every route with a body; the `X-Request-Id` header on every
/// answer, `Retry-After` on every 429 and 503, `Idempotent-Replayed` on the
/// answers that can repeat an earlier one; the error codes as an enum.
struct Common;

fn error_response(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                "application/json",
                utoipa::openapi::ContentBuilder::new()
                    .schema(Some(utoipa::openapi::Ref::from_schema_name("ErrorBody")))
                    .build(),
            )
            .build(),
    )
}

fn header(description: &str, kind: Type) -> utoipa::openapi::header::Header {
    HeaderBuilder::new()
        .schema(ObjectBuilder::new().schema_type(kind))
        .description(Some(description))
        .build()
}

impl Modify for Common {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for (path, item) in openapi.paths.paths.iter_mut() {
            let keyed = path.starts_with("/v1/") || path.starts_with("/api/");
            let replaying = REPLAYING.contains(&path.as_str());
            for op in [
                item.get.as_mut(),
                item.post.as_mut(),
                item.put.as_mut(),
                item.delete.as_mut(),
                item.patch.as_mut(),
            ]
            .into_iter()
            .flatten()
            {
                let mut add = vec![
                    ("405", "method_not_allowed: another method on this path"),
                    (
                        "414",
                        "uri_too_long: path and query over limits.max_uri_bytes",
                    ),
                    (
                        "431",
                        "headers_too_large: headers over limits.max_header_bytes",
                    ),
                ];
                if keyed {
                    add.push(("401", "unauthorized: missing or unknown API key"));
                    add.push((
                        "429",
                        "rate_limited: over the client's request ceiling (with Retry-After)",
                    ));
                    add.push(("500", "internal"));
                    add.push((
                        "503",
                        "unavailable: Postgres or Redis cannot be reached (with Retry-After); nothing changed",
                    ));
                }
                if op.request_body.is_some() {
                    add.push(("400", "invalid_request: a body that does not parse, unknown fields, bad types or values"));
                    add.push(("413", "payload_too_large"));
                    add.push((
                        "415",
                        "unsupported_media_type: the body must be application/json",
                    ));
                }
                for (status, description) in add {
                    op.responses
                        .responses
                        .entry(status.to_owned())
                        .or_insert_with(|| error_response(description));
                }
                for (status, response) in op.responses.responses.iter_mut() {
                    let RefOr::T(response) = response else {
                        continue;
                    };
                    response.headers.insert(
                        "X-Request-Id".to_owned(),
                        header("The request's id (the caller's X-Request-Id when it sent a valid one), also in the logs", Type::String),
                    );
                    if status == "405" {
                        response.headers.insert(
                            "Allow".to_owned(),
                            header("The one method this path answers", Type::String),
                        );
                    }
                    if status == "429" || status == "503" {
                        response.headers.insert(
                            "Retry-After".to_owned(),
                            header(
                                "Whole seconds to wait before retrying (at least 1)",
                                Type::Integer,
                            ),
                        );
                    }
                    if replaying && (status == "200" || status == "201") {
                        response.headers.insert(
                            "Idempotent-Replayed".to_owned(),
                            header("`true` on an answer that repeats an earlier one (a duplicate, a retry with the winning request_id, the same result or order again); absent otherwise", Type::String),
                        );
                    }
                }
            }
        }
        // The reconcile body may be left out (no body is `{}`), but when
        // sent it is an object: `null` is 400.
        if let Some(body) = openapi
            .paths
            .paths
            .get_mut("/v1/admin/reconcile")
            .and_then(|item| item.post.as_mut())
            .and_then(|op| op.request_body.as_mut())
        {
            body.required = Some(utoipa::openapi::Required::False);
        }
        // The audit filters take any text (a value no event has finds
        // nothing): no syntax there.
        for (path, item) in openapi.paths.paths.iter_mut() {
            if path == "/v1/admin/audit" {
                continue;
            }
            for op in [item.get.as_mut(), item.post.as_mut()]
                .into_iter()
                .flatten()
            {
                for p in op.parameters.iter_mut().flatten() {
                    if let Some(RefOr::T(utoipa::openapi::Schema::Object(o))) = p.schema.as_mut() {
                        constrain(&p.name, o);
                    }
                }
            }
        }
        // On these reads an empty query value counts as absent (`?until=`):
        // a typed parameter also takes the empty string.
        for path in [
            "/v1/admin/audit",
            "/v1/admin/reconcile/runs",
            "/v1/admin/uncertain",
        ] {
            let Some(op) = openapi
                .paths
                .paths
                .get_mut(path)
                .and_then(|i| i.get.as_mut())
            else {
                continue;
            };
            for p in op.parameters.iter_mut().flatten() {
                let plain = matches!(
                    p.schema.as_ref(),
                    Some(RefOr::T(utoipa::openapi::Schema::Object(o)))
                        if o.format.is_none()
                            && o.pattern.is_none()
                            && o.enum_values.is_none()
                            && matches!(&o.schema_type, utoipa::openapi::schema::SchemaType::Type(Type::String))
                );
                if plain {
                    continue;
                }
                if let Some(typed) = p.schema.take() {
                    let empty = ObjectBuilder::new()
                        .schema_type(Type::String)
                        .max_length(Some(0))
                        .description(Some("empty: as if absent"));
                    p.schema = Some(
                        utoipa::openapi::schema::AnyOfBuilder::new()
                            .item(typed)
                            .item(empty)
                            .into(),
                    );
                }
            }
        }
        if let Some(components) = openapi.components.as_mut() {
            for (name, schema) in components.schemas.iter_mut() {
                if !name.ends_with("Request") {
                    continue;
                }
                if let RefOr::T(utoipa::openapi::Schema::Object(o)) = schema {
                    for (field, prop) in o.properties.iter_mut() {
                        if let RefOr::T(utoipa::openapi::Schema::Object(p)) = prop {
                            constrain(field, p);
                        }
                    }
                }
            }
            if let Some(RefOr::T(utoipa::openapi::Schema::Object(body))) =
                components.schemas.get_mut("ErrorBody")
            {
                body.properties.insert(
                    "error".to_owned(),
                    ObjectBuilder::new()
                        .schema_type(Type::String)
                        .description(Some("A stable code"))
                        .enum_values(Some(Code::ALL.iter().map(|c| c.as_str())))
                        .into(),
                );
            }
        }
    }
}

/// The syntax the handlers check (src/domain.rs, src/domain/key.rs,
/// src/http/tokens.rs), as JSON Schema, by field or parameter name: a value
/// the pattern refuses is refused by the service (400), and the other way
/// round. Applied to every `*Request` body and every query and path
/// parameter. Refusals JSON Schema cannot express (a token's tag, a cursor
/// this service did not hand out, a `ttl_seconds` beyond the biz type's)
/// stay in the descriptions.
const SYNTAX: &[(&str, &str)] = &[
    ("biz_type", "^[a-z][a-z0-9-]{0,31}$"),
    ("bizType", "^[a-z][a-z0-9-]{0,31}$"),
    ("fingerprint", "^[ -~]{1,128}$"),
    ("request_id", "^[ -~]{1,128}$"),
    ("key", "^[ -~]{1,255}$"),
    ("order_id", "^[A-Za-z0-9_-]{1,64}$"),
    ("currency", "^[A-Z]{3}$"),
    ("token", "^[A-Za-z0-9_-]{1,128}$"),
    ("subject", "^[^\\x00-\\x1f\\x7f-\\x9f]{1,128}$"),
    ("userId", "^[^\\x00-\\x1f\\x7f-\\x9f]{1,128}$"),
];

fn constrain(name: &str, o: &mut utoipa::openapi::schema::Object) {
    if let Some((_, pattern)) = SYNTAX.iter().find(|(n, _)| *n == name) {
        o.pattern = Some((*pattern).to_owned());
    }
    if name == "amount_minor" {
        o.minimum = Some(1f64.into());
        o.maximum = Some(1e15f64.into());
    }
}

/// A string schema holding exactly `values`, taken from a Rust enum's `ALL`
/// and `as_str`: the description cannot drift from the code.
fn closed_set(
    description: &str,
    values: impl IntoIterator<Item = &'static str>,
) -> RefOr<utoipa::openapi::schema::Schema> {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .description(Some(description))
        .enum_values(Some(values))
        .into()
}

/// The OpenAPI schema of a closed set, named `$name`, from its enum's `ALL`
/// and `as_str`.
macro_rules! closed_set_schema {
    ($ty:ty, $name:literal, $description:literal) => {
        impl utoipa::PartialSchema for $ty {
            fn schema() -> RefOr<utoipa::openapi::schema::Schema> {
                closed_set($description, <$ty>::ALL.iter().map(|v| v.as_str()))
            }
        }
        impl utoipa::ToSchema for $ty {
            fn name() -> std::borrow::Cow<'static, str> {
                std::borrow::Cow::Borrowed($name)
            }
        }
    };
}

closed_set_schema!(
    crate::domain::AuditKind,
    "AuditKind",
    "What an audit event records"
);
closed_set_schema!(
    crate::domain::order::OrderState,
    "OrderState",
    "An order's state: CREATED -> PAID -> PARTIALLY_REFUNDED -> REFUNDED, CREATED -> CLOSED"
);
closed_set_schema!(
    crate::fast::breaker::Mode,
    "Mode",
    "How the service uses Redis right now: normal; degraded (Redis is slow, a sample of durable consumes bypasses it); redis_down (Redis is skipped)"
);
closed_set_schema!(
    crate::fleet::FleetState,
    "FleetState",
    "The fleet's agreement on Redis: normal (Redis decides fast types); redis_down (every member reported Redis down: Postgres decides them)"
);
closed_set_schema!(
    crate::ledger::AnswerOutcome,
    "ConsumeOutcome",
    "A consume answer: consumed (this attempt, or a retry of it with the winning request_id, won) or duplicate (another attempt won)"
);
closed_set_schema!(
    crate::ledger::DuplicateStatus,
    "DuplicateStatus",
    "What a duplicate learns of the winner: processing (no result yet), completed (its result is in `result`) or uncertain (no result or release within the biz type's processing_lease: the step's outcome is unknown until the consumer or an operator records it or releases the token)"
);
closed_set_schema!(
    crate::domain::TokenStatus,
    "TokenState",
    "A token's state: issued (unconsumed and live, also after a release), consumed, uncertain (consumed, with neither result nor release within the biz type's processing_lease), or expired (never consumed and past its expiry, or purged after the retention)"
);

/// The spec as committed in `openapi.json` at the repository's root.
pub fn pretty() -> String {
    let mut text = ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `openapi.json` is what the code generates. After a change to the
    /// routes or their types: `UPDATE_OPENAPI=1 cargo test --lib openapi`
    /// rewrites it; commit the result.
    #[test]
    fn the_committed_openapi_json_is_what_the_code_generates() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
        let generated = pretty();
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(path, &generated).expect("openapi.json written");
            return;
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == generated,
            "openapi.json differs from the generated spec: run UPDATE_OPENAPI=1 cargo test --lib openapi and commit it"
        );
    }

    /// Every operation declares the shared statuses and the X-Request-Id
    /// header; 429 and 503 carry Retry-After; the consume's 200 carries
    /// Idempotent-Replayed; error codes are an enum.
    #[test]
    fn shared_statuses_and_headers_are_declared() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("operations") {
                let responses = op["responses"].as_object().expect("responses");
                for s in ["405", "414", "431"] {
                    assert!(responses.contains_key(s), "{method} {path}: {s}");
                }
                if path.starts_with("/v1/") {
                    for s in ["401", "429", "500"] {
                        assert!(responses.contains_key(s), "{method} {path}: {s}");
                    }
                }
                for (status, r) in responses {
                    assert!(
                        r["headers"]["X-Request-Id"].is_object(),
                        "{method} {path} {status}"
                    );
                    if status == "429" || status == "503" {
                        assert!(
                            r["headers"]["Retry-After"].is_object(),
                            "{method} {path} {status}"
                        );
                    }
                }
            }
        }
        let consume = &doc["paths"]["/v1/tokens/{token}/consume"]["post"]["responses"]["200"];
        assert!(consume["headers"]["Idempotent-Replayed"].is_object());
        let codes = doc["components"]["schemas"]["ErrorBody"]["properties"]["error"]["enum"]
            .as_array()
            .expect("enum");
        assert!(codes.iter().any(|c| c == "fingerprint_mismatch"));
    }

    /// A response's description names only codes that answer with its
    /// status (`error::Code::status`, the one mapping).
    #[test]
    fn each_response_names_only_codes_of_its_status() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("operations") {
                for (status, r) in op["responses"].as_object().into_iter().flatten() {
                    let text = r["description"].as_str().unwrap_or("");
                    for word in text.split(|c: char| !(c.is_ascii_lowercase() || c == '_')) {
                        if let Some(code) = Code::ALL.iter().find(|c| c.as_str() == word) {
                            assert_eq!(
                                code.status().as_str(),
                                status.as_str(),
                                "{method} {path}: {word}"
                            );
                        }
                    }
                }
            }
        }
    }

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
        // An empty `limit=` counts as absent: the integer or the empty string.
        assert_eq!(limit["anyOf"][0]["type"], "integer", "{limit}");
        assert_eq!(limit["anyOf"][1]["maxLength"], 0, "{limit}");
    }

    /// The closed sets are enums holding exactly the Rust enums' values, and
    /// the fields that carry them refer to them.
    #[test]
    fn closed_sets_are_the_rust_enums() {
        use crate::domain::{order::OrderState, AuditKind, TokenStatus};
        use crate::fast::breaker::Mode;
        use crate::ledger::{AnswerOutcome, DuplicateStatus};
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let schemas = &doc["components"]["schemas"];
        let values = |name: &str| -> Vec<String> {
            schemas[name]["enum"]
                .as_array()
                .unwrap_or_else(|| panic!("{name} is not an enum: {}", schemas[name]))
                .iter()
                .map(|v| v.as_str().expect("a string").to_owned())
                .collect()
        };
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let sets = [
            (
                "TokenState",
                strings(&TokenStatus::ALL.map(TokenStatus::as_str)),
            ),
            (
                "OrderState",
                strings(&OrderState::ALL.map(OrderState::as_str)),
            ),
            ("AuditKind", strings(&AuditKind::ALL.map(AuditKind::as_str))),
            ("Mode", strings(&Mode::ALL.map(Mode::as_str))),
            (
                "FleetState",
                strings(&crate::fleet::FleetState::ALL.map(crate::fleet::FleetState::as_str)),
            ),
            (
                "ConsumeOutcome",
                strings(&AnswerOutcome::ALL.map(AnswerOutcome::as_str)),
            ),
            (
                "DuplicateStatus",
                strings(&DuplicateStatus::ALL.map(DuplicateStatus::as_str)),
            ),
        ];
        for (name, want) in &sets {
            assert_eq!(&values(name), want, "{name}");
        }
        let refers = |schema: &str, field: &str, to: &str| {
            let text = schemas[schema]["properties"][field].to_string();
            assert!(
                text.contains(&format!("#/components/schemas/{to}")),
                "{schema}.{field} does not refer to {to}: {text}"
            );
        };
        refers("TokenStateResponse", "state", "TokenState");
        refers("TokenView", "state", "TokenState");
        refers("OrderBody", "state", "OrderState");
        refers("AuditEvent", "kind", "AuditKind");
        refers("OrderEventBody", "kind", "AuditKind");
        refers("Readiness", "mode", "Mode");
        refers("FleetReadiness", "state", "FleetState");
        refers("Stats", "mode", "Mode");
        let consume = schemas["ConsumeResponse"].to_string();
        for to in ["ConsumeOutcome", "DuplicateStatus"] {
            assert!(
                consume.contains(&format!("#/components/schemas/{to}")),
                "ConsumeResponse does not refer to {to}: {consume}"
            );
        }
        let kind = doc["paths"]["/v1/admin/audit"]["get"]["parameters"]
            .as_array()
            .expect("parameters")
            .iter()
            .find(|p| p["name"] == "kind")
            .expect("kind")["schema"]
            .to_string();
        assert!(kind.contains("#/components/schemas/AuditKind"), "{kind}");
    }

    /// Both routes for a token stuck in processing, with every status.
    #[test]
    fn token_state_and_admin_release_declare_their_statuses() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let read = &doc["paths"]["/v1/tokens/{token}"]["get"]["responses"];
        for s in [
            "200", "400", "401", "403", "405", "422", "429", "500", "503",
        ] {
            assert!(read[s].is_object(), "GET /v1/tokens/{{token}}: no {s}");
        }
        let release = &doc["paths"]["/v1/admin/tokens/{token}/release"]["post"]["responses"];
        for s in [
            "200", "400", "401", "403", "409", "413", "415", "422", "429", "500", "503",
        ] {
            assert!(release[s].is_object(), "admin release: no {s}");
        }
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

    fn operations(doc: &serde_json::Value) -> Vec<(String, String, serde_json::Value)> {
        let mut ops = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("operations") {
                ops.push((path.clone(), method.clone(), op.clone()));
            }
        }
        ops
    }

    /// Generators (openapi-generator, openapi-python-client) name a method
    /// per operationId and a type per schema: ids are present, unique, and
    /// none equals a schema name, ignoring case. openapi-generator also
    /// names a type `<OperationId>Request` (the operation's parameters) and
    /// may name one `<OperationId>Response`: no schema takes either name.
    #[test]
    fn operation_ids_are_unique_and_clash_with_no_schema() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let schemas: Vec<String> = doc["components"]["schemas"]
            .as_object()
            .expect("schemas")
            .keys()
            .map(|k| k.to_lowercase())
            .collect();
        let mut seen = std::collections::HashSet::new();
        for (path, method, op) in operations(&doc) {
            let id = op["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{method} {path}: no operationId"));
            assert!(seen.insert(id.to_lowercase()), "{id} used twice");
            assert!(
                !schemas.contains(&id.to_lowercase()),
                "{method} {path}: operationId {id} is also a schema name"
            );
            for suffix in ["Request", "Response"] {
                let derived = format!("{}{}{suffix}", id[..1].to_uppercase(), &id[1..]);
                assert!(
                    !schemas.contains(&derived.to_lowercase()),
                    "{method} {path}: a schema is named {derived} (ignoring case), the type \
                     generators derive from operationId {id}: rename the schema"
                );
            }
        }
        assert_eq!(seen.len(), 31, "{seen:?}");
        for id in [
            "consumetoken",
            "consumekey",
            "createorder",
            "adminreleasekey",
        ] {
            assert!(seen.contains(id), "no {id}");
        }
    }

    /// Every /v1 route needs a key (401), counts against the client's
    /// ceiling (429) and reads or writes Postgres or Redis (503). There is
    /// no /v1 route for which one of these is impossible; the seed's alias
    /// under /api shares all three.
    #[test]
    fn every_keyed_route_declares_401_429_503() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let mut keyed = 0;
        for (path, method, op) in operations(&doc) {
            if !(path.starts_with("/v1/") || path.starts_with("/api/")) {
                continue;
            }
            keyed += 1;
            for s in ["401", "429", "503"] {
                assert!(op["responses"][s].is_object(), "{method} {path}: no {s}");
            }
        }
        assert!(keyed >= 24, "{keyed}");
    }

    /// Every time in a body is `format: date-time`: each property named
    /// `at` or `*_at`, in every schema, nested ones included.
    #[test]
    fn times_are_date_time() {
        fn walk(v: &serde_json::Value, at: &str, found: &mut usize) {
            match v {
                serde_json::Value::Object(map) => {
                    if let Some(serde_json::Value::Object(props)) = map.get("properties") {
                        for (name, prop) in props {
                            if name == "at" || name.ends_with("_at") {
                                *found += 1;
                                assert_eq!(prop["format"], "date-time", "{at}.{name}: {prop}");
                            }
                        }
                    }
                    for (k, child) in map {
                        walk(child, &format!("{at}/{k}"), found);
                    }
                }
                serde_json::Value::Array(items) => {
                    for child in items {
                        walk(child, at, found);
                    }
                }
                _ => {}
            }
        }
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let mut found = 0;
        walk(&doc["components"], "components", &mut found);
        assert!(found >= 20, "only {found} times");
        let audit = doc["paths"]["/v1/admin/audit"]["get"]["parameters"]
            .as_array()
            .expect("parameters");
        for name in ["since", "until"] {
            let p = audit.iter().find(|p| p["name"] == name).expect(name);
            assert_eq!(p["schema"]["anyOf"][0]["format"], "date-time", "{p}");
        }
    }

    /// Each operation shows an example of its request body and of its main
    /// success answer.
    #[test]
    fn every_operation_has_examples() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        for (path, method, op) in operations(&doc) {
            if let Some(content) = op["requestBody"]["content"].as_object() {
                for (media, c) in content {
                    assert!(
                        !c["example"].is_null(),
                        "{method} {path}: no request example ({media})"
                    );
                }
            }
            let ok = ["200", "201"]
                .iter()
                .map(|s| &op["responses"][*s])
                .find(|r| r.is_object())
                .unwrap_or_else(|| panic!("{method} {path}: no 200 or 201"));
            let content = ok["content"]
                .as_object()
                .unwrap_or_else(|| panic!("{method} {path}: success without content"));
            assert!(
                content.values().any(|c| !c["example"].is_null()),
                "{method} {path}: no response example"
            );
        }
    }

    /// The key reads answer 400 without their query parameters: the spec
    /// says they are required.
    #[test]
    fn key_reads_require_their_query() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        for (path, names) in [
            ("/v1/keys", &["biz_type", "key"][..]),
            ("/v1/admin/keys", &["client", "biz_type", "key"][..]),
        ] {
            let params = doc["paths"][path]["get"]["parameters"]
                .as_array()
                .expect("parameters");
            for name in names {
                let p = params.iter().find(|p| p["name"] == *name).expect(name);
                assert_eq!(p["required"], true, "{path}?{name}: {p}");
            }
        }
    }

    /// A duplicate with `"result": null` matches exactly one branch of the
    /// consume answers' `oneOf`: `result` is typeless (null included), not
    /// a `oneOf` of null and any value (which null would match twice).
    #[test]
    fn a_null_result_matches_one_branch() {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("serializes");
        let schemas = &doc["components"]["schemas"];
        for (schema, branch) in [
            ("ConsumeResponse", Some(1)),
            ("KeyConsumeResponse", Some(1)),
            ("TokenStateResponse", None),
            ("KeyStateResponse", None),
            ("TokenView", None),
            ("KeyView", None),
        ] {
            let s = match branch {
                Some(i) => &schemas[schema]["oneOf"][i],
                None => &schemas[schema],
            };
            let result = &s["properties"]["result"];
            assert!(result.is_object(), "{schema}: no result");
            for k in ["oneOf", "anyOf", "type", "$ref"] {
                assert!(result.get(k).is_none(), "{schema}.result has {k}: {result}");
            }
        }
    }
}
