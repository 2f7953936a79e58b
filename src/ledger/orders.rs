//! The token of an order event. [`crate::orders`] checks it in two steps
//! around the order's lock (the binding needs the order's subject), and hands
//! its transaction to [`Ledger::consume_for_order`] (or, for a batch of events
//! on distinct orders, [`Ledger::consume_for_orders`]): one statement consumes
//! the token and moves the order, the commit decides, and Redis learns of it
//! afterwards ([`Ledger::order_event_committed`]) like of any durable consume.

use sqlx::{Postgres, Transaction};

use super::api::{ConsumeOutcome, LedgerError};
use super::core::Ledger;
use crate::auth::Client;
use crate::config::{Durability, PostgresSettings};
use crate::domain::Subject;
use crate::durable::orders::{self as sql, Claimed, OrderChange};
use crate::durable::tokens::TokenRecord;
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
        let (token, settings) = self.verifier.authorize_unbound(caller, text)?;
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
        if self.verifier.is_bound(&token.token, caller, subject) {
            Ok(())
        } else {
            Err(LedgerError::TokenMismatch)
        }
    }

    /// The row an order event consumes its token as.
    pub fn order_record(
        &self,
        token: &OrderToken,
        caller: &Client,
        subject: &Subject,
    ) -> TokenRecord {
        self.verifier
            .record_for(&token.token, token.durability, caller, subject)
    }

    /// Consumes the token and applies `change` in the order's transaction,
    /// then commits: the claim. `None`: the token could not be claimed
    /// (consumed elsewhere since the order was locked, or expired); nothing
    /// was written and the transaction is rolled back. The caller then
    /// calls [`Ledger::order_event_committed`].
    pub async fn consume_for_order(
        &self,
        mut tx: Transaction<'_, Postgres>,
        record: &TokenRecord,
        change: &OrderChange<'_>,
    ) -> Result<Option<Claimed>, DurableError> {
        let claimed = timed(
            &self.metrics,
            "order_event",
            sql::write_event(&mut tx, record, change),
        )
        .await?;
        let Some(claimed) = claimed else {
            drop(tx);
            return Ok(None);
        };
        tx.commit().await.map_err(DurableError::from)?;
        Ok(Some(claimed))
    }

    /// [`Ledger::consume_for_order`] for events on distinct orders, all
    /// locked by `tx`, in one statement; the caller commits. Per item, in
    /// order: its claim, or `None` (nothing of it written).
    pub async fn consume_for_orders(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        items: &[(&TokenRecord, &OrderChange<'_>)],
    ) -> Result<Vec<Option<Claimed>>, DurableError> {
        timed(
            &self.metrics,
            "order_event_batch",
            sql::write_events(tx, items),
        )
        .await
    }

    /// After the commit of an event that consumed `token`: counts the
    /// consume and tells Redis, off the answer's path, like any durable
    /// consume.
    pub fn order_event_committed(
        &self,
        token: &OrderToken,
        claimed: Claimed,
        request_id: Option<&str>,
        fingerprint: Option<&str>,
    ) {
        self.count_consume(&token.token.claims.biz_type, ConsumeOutcome::Consumed);
        self.settle_consumed_in_background(
            &token.token.text,
            claimed.gen,
            Marker {
                at_ms: claimed.consumed_at.timestamp_millis(),
                request_id: request_id.map(str::to_owned),
                fingerprint: fingerprint.map(str::to_owned),
                result: None,
            },
        );
    }

    /// The settings that bound the batches of order events.
    pub fn postgres_settings(&self) -> &PostgresSettings {
        &self.settings.postgres
    }
}
