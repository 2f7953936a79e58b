//! Order routes: the payment state machine, each event consuming a token in
//! the same Postgres transaction as the state change.

use serde::{Deserialize, Serialize};

use crate::client::Client;
use crate::error::Error;
use crate::outcome::Timestamp;
use crate::tokens::new_request_id;

/// `POST /v1/orders`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreateOrder {
    /// 1 to 64 characters of `[A-Za-z0-9_-]`, unique across all clients.
    pub order_id: String,
    pub subject: String,
    /// 1 to 10^15, in minor units (cents, fen).
    pub amount_minor: i64,
    /// ISO 4217, `[A-Z]{3}`.
    pub currency: String,
}

/// An order's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[non_exhaustive]
pub enum OrderState {
    Created,
    Paid,
    PartiallyRefunded,
    Refunded,
    Closed,
}

/// One event of an order's history, oldest first.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct OrderEvent {
    /// `order.created`, `order.paid`, `order.refunded` or `order.closed`.
    pub kind: String,
    /// The token the event consumed (none for `order.created`).
    #[serde(default)]
    pub token: Option<String>,
    pub amount_minor: i64,
    pub at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Order {
    pub order_id: String,
    pub subject: String,
    pub state: OrderState,
    pub amount_minor: i64,
    pub refunded_minor: i64,
    pub currency: String,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    pub events: Vec<OrderEvent>,
}

/// The answer of [`Client::create_order`].
#[derive(Debug, Clone, PartialEq)]
pub struct OrderCreated {
    pub order: Order,
    /// False when this identical order already existed (a retry).
    pub created: bool,
}

/// What an order event answered.
#[must_use = "`Duplicate` means this event was applied by an earlier request"]
#[derive(Debug, Clone, PartialEq)]
pub enum EventOutcome {
    /// This request applied the event. `replayed`: an earlier try of it (same
    /// `request_id`) did, and its answer was lost.
    Applied { order: Order, replayed: bool },
    /// The same token already applied this same event earlier (another
    /// request): nothing changed now.
    Duplicate { order: Order },
}

impl EventOutcome {
    pub fn order(&self) -> &Order {
        match self {
            EventOutcome::Applied { order, .. } | EventOutcome::Duplicate { order } => order,
        }
    }
}

/// `POST /v1/orders/{id}/pay`; building one draws its `request_id`.
#[derive(Debug, Clone, Serialize)]
pub struct Pay {
    token: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    request_id: String,
}

impl Pay {
    pub fn new(token: impl Into<String>) -> Pay {
        Pay {
            token: token.into(),
            fingerprint: None,
            request_id: new_request_id(),
        }
    }
    pub fn with_fingerprint(mut self, fingerprint: impl Into<String>) -> Pay {
        self.fingerprint = Some(fingerprint.into());
        self
    }
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Pay {
        self.request_id = request_id.into();
        self
    }
    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

/// `POST /v1/orders/{id}/refund`; building one draws its `request_id`.
#[derive(Debug, Clone, Serialize)]
pub struct Refund {
    token: String,
    amount_minor: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    request_id: String,
}

impl Refund {
    pub fn new(token: impl Into<String>, amount_minor: i64) -> Refund {
        Refund {
            token: token.into(),
            amount_minor,
            reason: None,
            request_id: new_request_id(),
        }
    }
    /// Up to 256 characters.
    pub fn with_reason(mut self, reason: impl Into<String>) -> Refund {
        self.reason = Some(reason.into());
        self
    }
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Refund {
        self.request_id = request_id.into();
        self
    }
    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

/// `POST /v1/orders/{id}/close`; building one draws its `request_id`.
#[derive(Debug, Clone, Serialize)]
pub struct Close {
    token: String,
    request_id: String,
}

impl Close {
    pub fn new(token: impl Into<String>) -> Close {
        Close {
            token: token.into(),
            request_id: new_request_id(),
        }
    }
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> Close {
        self.request_id = request_id.into();
        self
    }
    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

#[derive(Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
enum EventWire {
    Applied { order: Order },
    Duplicate { order: Order },
}

impl Client {
    /// Creates an order; the identical order again answers it with
    /// `created: false`, another body under the same id is `order_conflict`.
    pub async fn create_order(&self, order: &CreateOrder) -> Result<OrderCreated, Error> {
        let answer = self.post(self.url(&["v1", "orders"]), order).await?;
        Ok(OrderCreated {
            order: answer.json()?,
            created: answer.status == reqwest::StatusCode::CREATED,
        })
    }

    /// The order with its events.
    pub async fn order(&self, order_id: &str) -> Result<Order, Error> {
        self.get(self.url(&["v1", "orders", order_id])).await
    }

    /// CREATED -> PAID.
    pub async fn pay(&self, order_id: &str, pay: &Pay) -> Result<EventOutcome, Error> {
        self.event(order_id, "pay", pay).await
    }

    /// PAID / PARTIALLY_REFUNDED -> PARTIALLY_REFUNDED / REFUNDED.
    pub async fn refund(&self, order_id: &str, refund: &Refund) -> Result<EventOutcome, Error> {
        self.event(order_id, "refund", refund).await
    }

    /// CREATED -> CLOSED.
    pub async fn close(&self, order_id: &str, close: &Close) -> Result<EventOutcome, Error> {
        self.event(order_id, "close", close).await
    }

    async fn event<B: Serialize>(
        &self,
        order_id: &str,
        event: &str,
        body: &B,
    ) -> Result<EventOutcome, Error> {
        let answer = self
            .post(self.url(&["v1", "orders", order_id, event]), body)
            .await?;
        Ok(match answer.json::<EventWire>()? {
            EventWire::Applied { order } => EventOutcome::Applied {
                order,
                replayed: answer.replayed,
            },
            EventWire::Duplicate { order } => EventOutcome::Duplicate { order },
        })
    }
}
