//! The token of an order event. [`crate::orders`] checks it in two steps
//! around the order's lock (the binding needs the order's subject), and hands
//! its transaction to [`Ledger::consume_for_order`]: one statement consumes
//! the token and moves the order, the commit decides, and Redis learns of it
//! afterwards like of any durable consume.

use sqlx::{Postgres, Transaction};

use super::{ConsumeOutcome, Ledger, LedgerError};
use crate::auth::Client;
use crate::config::Durability;
use crate::domain::Subject;
use crate::durable::orders::{self as sql, OrderChange};
use crate::durable::{timed, DurableError};
use crate::fast::Marker;
use crate::token::VerifiedToken;

/// A token presented for an order event, checked as far as it can be
/// without the order.
#[derive(Debug, Clone)]
pub struct OrderToken {
    token: VerifiedToken,
    durability: Durability,
}

impl OrderToken {
    pub fn verified(&self) -> &VerifiedToken {
        &self.token
    }
    /// Order events take durable tokens only; the caller refuses the others.
    pub fn durability(&self) -> Durability {
        self.durability
    }
}

impl Ledger {
    /// Tag, issued by the fleet, biz type known and granted. No I/O.
    pub fn check_order_token(
        &self,
        caller: &Client,
        text: &str,
    ) -> Result<OrderToken, LedgerError> {
        let (token, settings) = self.authorize_unbound(caller, text)?;
        let durability = settings.durability;
        Ok(OrderToken { token, durability })
    }

    /// The binding to the caller and the order's subject.
    pub fn check_binding(
        &self,
        token: &OrderToken,
        caller: &Client,
        subject: &Subject,
    ) -> Result<(), LedgerError> {
        if self.is_bound(&token.token, caller, subject) {
            Ok(())
        } else {
            Err(LedgerError::TokenMismatch)
        }
    }

    /// Consumes the token and applies `change` in the order's transaction,
    /// then commits. `false`: the token could not be claimed (consumed
    /// elsewhere since the order was locked, or expired); nothing was written
    /// and the transaction is rolled back.
    pub async fn consume_for_order(
        &self,
        mut tx: Transaction<'_, Postgres>,
        token: &OrderToken,
        caller: &Client,
        subject: &Subject,
        change: &OrderChange<'_>,
    ) -> Result<bool, DurableError> {
        let record = self.record_for(&token.token, token.durability, caller, subject);
        let claimed = timed(
            &self.metrics,
            "order_event",
            sql::write_event(&mut tx, &record, change),
        )
        .await?;
        let Some(claimed) = claimed else {
            drop(tx);
            return Ok(false);
        };
        tx.commit().await.map_err(DurableError::from)?;
        self.count_consume(&token.token.claims.biz_type, ConsumeOutcome::Consumed);
        self.settle_consumed_in_background(
            &token.token.text,
            claimed.gen,
            Marker {
                at_ms: claimed.consumed_at.timestamp_millis(),
                request_id: change.request_id.map(str::to_owned),
                fingerprint: change.fingerprint.map(str::to_owned),
                result: None,
            },
        );
        Ok(true)
    }
}
