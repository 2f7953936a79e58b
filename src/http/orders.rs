//! Order routes: create, get, and the token-carrying events pay, refund and close.

use actix_web::{web, HttpResponse};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::error::ApiError;
use super::extract::{BodyLimit, Caller, JsonBody};
use super::tokens::{rfc3339, REPLAYED};
use super::AppState;
use crate::domain::order::OrderEvent;
use crate::domain::{Fingerprint, OrderId, RequestId, Subject};
use crate::orders::{Applied, CreateOrder, Created, EventInput, Order};

const MAX_AMOUNT: i64 = 1_000_000_000_000_000;

#[derive(Debug, Serialize, ToSchema)]
pub struct OrderEventBody {
    /// `order.created`, `order.paid`, `order.refunded` or `order.closed`.
    #[schema(value_type = crate::domain::AuditKind)]
    pub kind: String,
    /// The token the event consumed (null for `order.created`).
    pub token: Option<String>,
    pub amount_minor: i64,
    #[schema(value_type = String, format = DateTime)]
    pub at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OrderBody {
    pub order_id: String,
    pub subject: String,
    /// `CREATED`, `PAID`, `PARTIALLY_REFUNDED`, `REFUNDED` or `CLOSED`.
    #[schema(value_type = crate::domain::order::OrderState)]
    pub state: String,
    pub amount_minor: i64,
    pub refunded_minor: i64,
    pub currency: String,
    #[schema(value_type = String, format = DateTime)]
    pub created_at: String,
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: String,
    /// Oldest first, starting with `order.created`.
    pub events: Vec<OrderEventBody>,
}

impl From<Order> for OrderBody {
    fn from(o: Order) -> OrderBody {
        OrderBody {
            order_id: o.order_id,
            subject: o.subject,
            state: o.state.as_str().to_owned(),
            amount_minor: o.amounts.amount_minor,
            refunded_minor: o.amounts.refunded_minor,
            currency: o.currency,
            created_at: rfc3339(o.created_at),
            updated_at: rfc3339(o.updated_at),
            events: o
                .events
                .into_iter()
                .map(|e| OrderEventBody {
                    kind: e.kind.as_str().to_owned(),
                    token: e.token,
                    amount_minor: e.amount_minor,
                    at: rfc3339(e.at),
                })
                .collect(),
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewOrderRequest {
    /// 1 to 64 characters of `[A-Za-z0-9_-]`, unique across all clients.
    #[schema(example = "ord-1001")]
    pub order_id: String,
    #[schema(example = "user-42")]
    pub subject: String,
    /// 1 to 10^15, in minor units (cents, fen).
    #[schema(example = 1000)]
    pub amount_minor: i64,
    /// ISO 4217, `[A-Z]{3}`.
    #[schema(example = "CNY")]
    pub currency: String,
}
impl BodyLimit for NewOrderRequest {}

fn amount(n: i64, field: &str) -> Result<i64, ApiError> {
    if (1..=MAX_AMOUNT).contains(&n) {
        Ok(n)
    } else {
        Err(ApiError::invalid(format!(
            "`{field}` must be between 1 and 10^15"
        )))
    }
}

/// Create an order (idempotent: the same body again answers 200 with `Idempotent-Replayed: true`).
#[utoipa::path(post, path = "/v1/orders", operation_id = "createOrder", tag = "orders", request_body(content = NewOrderRequest, example = json!({"order_id": "ord-1001", "subject": "user-42", "amount_minor": 1000, "currency": "CNY"})),
    security(("api_key" = [])),
    responses(
        (status = 201, description = "Created", body = OrderBody, example = json!({"order_id": "ord-1001", "subject": "user-42", "state": "CREATED", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:00Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}]})),
        (status = 200, description = "The same body again (Idempotent-Replayed: true)", body = OrderBody, example = json!({"order_id": "ord-1001", "subject": "user-42", "state": "CREATED", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:00Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}]})),
        (status = 400, description = "invalid_request", body = super::ErrorBody),
        (status = 409, description = "order_conflict: the id is taken with another body or by another client", body = super::ErrorBody),
    ))]
pub async fn create(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    JsonBody(body): JsonBody<NewOrderRequest>,
) -> Result<HttpResponse, ApiError> {
    let req = CreateOrder {
        order_id: OrderId::parse(&body.order_id)?,
        subject: Subject::parse(&body.subject)?,
        amount_minor: amount(body.amount_minor, "amount_minor")?,
        currency: {
            let c = &body.currency;
            if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) {
                c.clone()
            } else {
                return Err(ApiError::invalid(
                    "`currency` must be three letters A-Z (ISO 4217)",
                ));
            }
        },
    };
    let (created, order) = state.orders.create(&caller, &req).await?;
    Ok(match created {
        Created::New => HttpResponse::Created().json(OrderBody::from(order)),
        Created::Replayed => HttpResponse::Ok()
            .insert_header((REPLAYED, "true"))
            .json(OrderBody::from(order)),
    })
}

/// An order with its events (other service clients: 404; admins see all).
#[utoipa::path(get, path = "/v1/orders/{order_id}", operation_id = "getOrder", tag = "orders",
    params(("order_id" = String, Path)),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "The order", body = OrderBody, example = json!({"order_id": "ord-1001", "subject": "user-42", "state": "PAID", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:05Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}, {"kind": "order.paid", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "amount_minor": 1000, "at": "2026-12-02T07:30:05Z"}]})),
        (status = 404, description = "order_not_found", body = super::ErrorBody),
    ))]
pub async fn get(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    order_id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let order = state.orders.get(&caller, &order_id).await?;
    Ok(HttpResponse::Ok().json(OrderBody::from(order)))
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PayRequest {
    /// A token of a durable biz type, bound to the order's subject.
    pub token: String,
    pub fingerprint: Option<String>,
    pub request_id: Option<String>,
}
impl BodyLimit for PayRequest {}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RefundRequest {
    pub token: String,
    /// 1 to 10^15; at most what is still refundable.
    pub amount_minor: i64,
    /// Up to 256 characters.
    pub reason: Option<String>,
    pub request_id: Option<String>,
}
impl BodyLimit for RefundRequest {}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CloseRequest {
    pub token: String,
    pub request_id: Option<String>,
}
impl BodyLimit for CloseRequest {}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventResponse {
    /// `applied` or `duplicate`.
    pub outcome: &'static str,
    pub order: OrderBody,
}

fn request_id(r: Option<&str>) -> Result<Option<RequestId>, ApiError> {
    Ok(r.map(RequestId::parse).transpose()?)
}

async fn apply(
    state: &AppState,
    caller: &crate::auth::Client,
    order_id: &str,
    input: EventInput,
) -> Result<HttpResponse, ApiError> {
    let (applied, order) = state.orders.apply(caller, order_id, &input).await?;
    let body = |outcome| EventResponse {
        outcome,
        order: OrderBody::from(order),
    };
    Ok(match applied {
        Applied::Applied => HttpResponse::Ok().json(body("applied")),
        Applied::Replayed => HttpResponse::Ok()
            .insert_header((REPLAYED, "true"))
            .json(body("applied")),
        Applied::Duplicate => HttpResponse::Ok()
            .insert_header((REPLAYED, "true"))
            .json(body("duplicate")),
    })
}

/// The refusals of an order event, one response per status (OpenAPI).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
enum EventErrors {
    #[response(
        status = 400,
        description = "invalid_request, token_invalid, token_expired"
    )]
    BadRequest(super::ErrorBody),
    #[response(status = 401, description = "unauthorized")]
    Unauthorized(super::ErrorBody),
    #[response(
        status = 403,
        description = "token_mismatch (the token is not bound to the order's subject and this client), forbidden (biz type not granted)"
    )]
    Forbidden(super::ErrorBody),
    #[response(
        status = 404,
        description = "order_not_found (also another client's order, or a malformed order id)"
    )]
    NotFound(super::ErrorBody),
    #[response(
        status = 409,
        description = "illegal_transition (with `state`), refund_exceeds_paid (with `refundable_minor`), token_already_used"
    )]
    Conflict(super::ErrorBody),
    #[response(status = 413, description = "payload_too_large")]
    TooLarge(super::ErrorBody),
    #[response(status = 415, description = "unsupported_media_type")]
    MediaType(super::ErrorBody),
    #[response(
        status = 422,
        description = "durable_token_required, unknown_biz_type, fingerprint_mismatch"
    )]
    Unprocessable(super::ErrorBody),
    #[response(
        status = 429,
        description = "rate_limited (the client's request ceiling), with Retry-After"
    )]
    RateLimited(super::ErrorBody),
    #[response(
        status = 503,
        description = "unavailable (Postgres), with Retry-After; nothing changed"
    )]
    Unavailable(super::ErrorBody),
}

/// Pay: CREATED -> PAID, consuming the token in the same transaction.
#[utoipa::path(post, path = "/v1/orders/{order_id}/pay", operation_id = "payOrder", tag = "orders", request_body(content = PayRequest, example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "fingerprint": "sha256:9f2c", "request_id": "req-pay-1"})),
    params(("order_id" = String, Path)),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "applied; or duplicate / a retry of the winning request_id (Idempotent-Replayed: true)", body = EventResponse, example = json!({"outcome": "applied", "order": {"order_id": "ord-1001", "subject": "user-42", "state": "PAID", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:05Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}, {"kind": "order.paid", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "amount_minor": 1000, "at": "2026-12-02T07:30:05Z"}]}})),
        EventErrors,
    ))]
pub async fn pay(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    order_id: web::Path<String>,
    JsonBody(body): JsonBody<PayRequest>,
) -> Result<HttpResponse, ApiError> {
    let input = EventInput {
        event: OrderEvent::Pay,
        fingerprint: body
            .fingerprint
            .as_deref()
            .map(Fingerprint::parse)
            .transpose()?,
        request_id: request_id(body.request_id.as_deref())?,
        reason: None,
        token: body.token,
    };
    apply(&state, &caller, &order_id, input).await
}

/// Refund: PAID/PARTIALLY_REFUNDED -> PARTIALLY_REFUNDED/REFUNDED; never beyond the paid amount.
#[utoipa::path(post, path = "/v1/orders/{order_id}/refund", operation_id = "refundOrder", tag = "orders", request_body(content = RefundRequest, example = json!({"token": "refund_AZJxkq9mQ0uW1c2f8a9b_k1_Pq2Lx7Yh", "amount_minor": 400, "reason": "damaged item", "request_id": "req-refund-1"})),
    params(("order_id" = String, Path)),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "applied; or duplicate (Idempotent-Replayed: true)", body = EventResponse, example = json!({"outcome": "applied", "order": {"order_id": "ord-1001", "subject": "user-42", "state": "PAID", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:05Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}, {"kind": "order.paid", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "amount_minor": 1000, "at": "2026-12-02T07:30:05Z"}]}})),
        EventErrors,
    ))]
pub async fn refund(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    order_id: web::Path<String>,
    JsonBody(body): JsonBody<RefundRequest>,
) -> Result<HttpResponse, ApiError> {
    if body
        .reason
        .as_ref()
        .is_some_and(|r| r.chars().count() > 256 || r.chars().any(char::is_control))
    {
        return Err(ApiError::invalid(
            "`reason` must be at most 256 characters without control characters",
        ));
    }
    let input = EventInput {
        event: OrderEvent::Refund {
            amount_minor: amount(body.amount_minor, "amount_minor")?,
        },
        fingerprint: None,
        request_id: request_id(body.request_id.as_deref())?,
        reason: body.reason,
        token: body.token,
    };
    apply(&state, &caller, &order_id, input).await
}

/// Close: CREATED -> CLOSED.
#[utoipa::path(post, path = "/v1/orders/{order_id}/close", operation_id = "closeOrder", tag = "orders", request_body(content = CloseRequest, example = json!({"token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "request_id": "req-close-1"})),
    params(("order_id" = String, Path)),
    security(("api_key" = [])),
    responses(
        (status = 200, description = "applied; or duplicate (Idempotent-Replayed: true)", body = EventResponse, example = json!({"outcome": "applied", "order": {"order_id": "ord-1001", "subject": "user-42", "state": "PAID", "amount_minor": 1000, "refunded_minor": 0, "currency": "CNY", "created_at": "2026-12-02T07:30:00Z", "updated_at": "2026-12-02T07:30:05Z", "events": [{"kind": "order.created", "token": null, "amount_minor": 1000, "at": "2026-12-02T07:30:00Z"}, {"kind": "order.paid", "token": "order_AZJxkq3mQ0uW1c2f8a9b_k1_3q9Yh2Lx", "amount_minor": 1000, "at": "2026-12-02T07:30:05Z"}]}})),
        EventErrors,
    ))]
pub async fn close(
    state: web::Data<AppState>,
    Caller(caller): Caller,
    order_id: web::Path<String>,
    JsonBody(body): JsonBody<CloseRequest>,
) -> Result<HttpResponse, ApiError> {
    let input = EventInput {
        event: OrderEvent::Close,
        fingerprint: None,
        request_id: request_id(body.request_id.as_deref())?,
        reason: None,
        token: body.token,
    };
    apply(&state, &caller, &order_id, input).await
}
