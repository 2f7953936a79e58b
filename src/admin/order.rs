//! One order's story for auditors (`audit order ORDER_ID`): the order as
//! Postgres holds it and every audit event that names it, oldest first.

use serde::{Deserialize, Serialize};

use super::{time, Admin, AdminError, AuditEvent, AuditQuery, MAX_LIMIT};
use crate::durable::orders as sql;

/// An order and its audit events.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OrderView {
    pub order_id: String,
    pub client: String,
    pub subject: String,
    #[serde(deserialize_with = "super::de_order_state")]
    pub state: super::FixedText,
    pub amount_minor: i64,
    pub refunded_minor: i64,
    pub currency: String,
    pub created_at: String,
    pub updated_at: String,
    /// Oldest first (at most 1,000).
    pub events: Vec<AuditEvent>,
}

impl Admin {
    /// The order `order_id` with its audit events; `None` when there is no
    /// such order.
    pub async fn order(&self, order_id: &str) -> Result<Option<OrderView>, AdminError> {
        let Some((o, _)) = sql::get(&self.pool, order_id).await? else {
            return Ok(None);
        };
        let page = self
            .audit(&AuditQuery {
                order_id: Some(order_id.to_owned()),
                limit: MAX_LIMIT,
                ..AuditQuery::default()
            })
            .await?;
        let mut events = page.events;
        events.reverse();
        Ok(Some(OrderView {
            order_id: o.order_id,
            client: o.client,
            subject: o.subject,
            state: o.state.as_str(),
            amount_minor: o.amount_minor,
            refunded_minor: o.refunded_minor,
            currency: o.currency,
            created_at: time(o.created_at),
            updated_at: time(o.updated_at),
            events,
        }))
    }
}
