//! Orders: the payment state machine. [`transition`] is the one place that
//! says which event may follow which state (pure, exhaustively tested);
//! [`Orders`] applies events, each consuming a durable token of the order's
//! subject in the same Postgres transaction as the state change, the event row
//! and the audit row (see `durable::orders`).

use std::fmt;

use chrono::{DateTime, Utc};

use crate::auth::Client;
use crate::config::Durability;
use crate::domain::{AuditKind, Fingerprint, OrderId, RequestId, Subject};
use crate::durable::orders::{
    self as sql, EventWrite, LockedOrder, NewOrder, OrderRow, TokenUsage,
};
use crate::durable::{timed, DurableError};
use crate::fast::Marker;
use crate::ledger::{ConsumeOutcome, Ledger, LedgerError};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, sqlx::Type)]
#[sqlx(type_name = "order_state", rename_all = "SCREAMING_SNAKE_CASE")]
pub enum OrderState {
    Created,
    Paid,
    PartiallyRefunded,
    Refunded,
    Closed,
}

impl OrderState {
    pub const ALL: [OrderState; 5] = [
        OrderState::Created,
        OrderState::Paid,
        OrderState::PartiallyRefunded,
        OrderState::Refunded,
        OrderState::Closed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OrderState::Created => "CREATED",
            OrderState::Paid => "PAID",
            OrderState::PartiallyRefunded => "PARTIALLY_REFUNDED",
            OrderState::Refunded => "REFUNDED",
            OrderState::Closed => "CLOSED",
        }
    }
}

impl fmt::Display for OrderState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a token-carrying call asks of an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderEvent {
    Pay,
    Refund { amount_minor: i64 },
    Close,
}

impl OrderEvent {
    /// The event kind as stored (`order_event_kind`, `audit_kind`).
    pub fn kind(self) -> AuditKind {
        match self {
            OrderEvent::Pay => AuditKind::OrderPaid,
            OrderEvent::Refund { .. } => AuditKind::OrderRefunded,
            OrderEvent::Close => AuditKind::OrderClosed,
        }
    }
}

/// The money side of an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Amounts {
    pub amount_minor: i64,
    pub refunded_minor: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("{event} is not allowed in state {state}")]
    Illegal {
        state: OrderState,
        event: &'static str,
    },
    #[error("refund of {requested} exceeds the {refundable} still refundable")]
    RefundExceedsPaid { requested: i64, refundable: i64 },
}

/// The state machine:
///
/// | state \ event        | pay  | refund (partial / rest)            | close  |
/// |----------------------|------|------------------------------------|--------|
/// | CREATED              | PAID | illegal                            | CLOSED |
/// | PAID                 | illegal | PARTIALLY_REFUNDED / REFUNDED   | illegal |
/// | PARTIALLY_REFUNDED   | illegal | PARTIALLY_REFUNDED / REFUNDED   | illegal |
/// | REFUNDED, CLOSED     | illegal | illegal                         | illegal |
///
/// A refund beyond what remains is `RefundExceedsPaid`; a refund amount must
/// be positive (the caller validates it).
pub fn transition(
    state: OrderState,
    amounts: Amounts,
    event: OrderEvent,
) -> Result<(OrderState, Amounts), TransitionError> {
    use OrderState::*;
    let illegal = Err(TransitionError::Illegal {
        state,
        event: event.kind().as_str(),
    });
    match (state, event) {
        (Created, OrderEvent::Pay) => Ok((Paid, amounts)),
        (Created, OrderEvent::Close) => Ok((Closed, amounts)),
        (Paid | PartiallyRefunded, OrderEvent::Refund { amount_minor }) => {
            if amount_minor <= 0 {
                return illegal;
            }
            let refundable = amounts.amount_minor - amounts.refunded_minor;
            if amount_minor > refundable {
                return Err(TransitionError::RefundExceedsPaid {
                    requested: amount_minor,
                    refundable,
                });
            }
            let refunded = amounts.refunded_minor + amount_minor;
            let next = if refunded == amounts.amount_minor {
                Refunded
            } else {
                PartiallyRefunded
            };
            Ok((
                next,
                Amounts {
                    refunded_minor: refunded,
                    ..amounts
                },
            ))
        }
        (Created, OrderEvent::Refund { .. })
        | (Paid | PartiallyRefunded, OrderEvent::Pay | OrderEvent::Close)
        | (Refunded | Closed, _) => illegal,
    }
}

/// An order as the API shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct Order {
    pub order_id: String,
    pub client: String,
    pub subject: String,
    pub state: OrderState,
    pub amounts: Amounts,
    pub currency: String,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub events: Vec<OrderEventRecord>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OrderEventRecord {
    pub kind: String,
    pub token: Option<String>,
    pub amount_minor: i64,
    pub at: DateTime<Utc>,
}

/// A validated create request.
#[derive(Debug, Clone)]
pub struct CreateOrder {
    pub order_id: OrderId,
    pub subject: Subject,
    pub amount_minor: i64,
    pub currency: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Created {
    New,
    /// The same body again.
    Replayed,
}

/// An event call, validated.
#[derive(Debug, Clone)]
pub struct EventInput {
    pub token: String,
    pub event: OrderEvent,
    pub fingerprint: Option<Fingerprint>,
    pub request_id: Option<RequestId>,
    pub reason: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// This call applied it.
    Applied,
    /// A retry of the call that applied it (same request_id).
    Replayed,
    /// The same token already applied this event to this order.
    Duplicate,
}

/// Why an order call was refused.
#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("no such order")]
    NotFound,
    #[error("order id taken with another body, or by another client")]
    Conflict,
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("order events need a token of a durable biz type")]
    DurableTokenRequired,
    #[error("the token was already consumed for something else")]
    TokenAlreadyUsed,
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

impl From<DurableError> for OrderError {
    fn from(e: DurableError) -> Self {
        OrderError::Ledger(LedgerError::postgres(e))
    }
}

fn order_of(row: OrderRow, events: Vec<OrderEventRecord>) -> Order {
    Order {
        order_id: row.order_id,
        client: row.client,
        subject: row.subject,
        state: row.state,
        amounts: Amounts {
            amount_minor: row.amount_minor,
            refunded_minor: row.refunded_minor,
        },
        currency: row.currency,
        created_at: row.created_at,
        updated_at: row.updated_at,
        events,
    }
}

/// What to do with an event, given the locked order and the token's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decision {
    Apply {
        next: OrderState,
        after: Amounts,
    },
    /// This token already applied this event to this order.
    Repeat {
        replay: bool,
    },
    Expired,
}

fn decide(
    order: &OrderRow,
    usage: &TokenUsage,
    order_id: &str,
    input: &EventInput,
) -> Result<Decision, OrderError> {
    if let Some(used) = &usage.used_by {
        if used.order_id != order_id || used.kind != input.event.kind().as_str() {
            return Err(OrderError::TokenAlreadyUsed);
        }
        if let (Some(a), Some(b)) = (&usage.fingerprint, &input.fingerprint) {
            if a != b.as_str() {
                return Err(LedgerError::FingerprintMismatch.into());
            }
        }
        let replay =
            matches!((&used.request_id, &input.request_id), (Some(a), Some(b)) if a == b.as_str());
        return Ok(Decision::Repeat { replay });
    }
    if usage.consumed {
        return Err(OrderError::TokenAlreadyUsed);
    }
    if !usage.live {
        return Ok(Decision::Expired);
    }
    let amounts = Amounts {
        amount_minor: order.amount_minor,
        refunded_minor: order.refunded_minor,
    };
    let (next, after) = transition(order.state, amounts, input.event)?;
    Ok(Decision::Apply { next, after })
}

/// Order operations over the ledger's pools and codec.
#[derive(Debug, Clone, Copy)]
pub struct Orders<'a> {
    ledger: &'a Ledger,
}

impl<'a> Orders<'a> {
    pub fn new(ledger: &'a Ledger) -> Orders<'a> {
        Orders { ledger }
    }

    fn visible(caller: &Client, row: &OrderRow) -> bool {
        caller.is_admin() || row.client == caller.name
    }

    /// Idempotent create: the same body again is `Replayed`; another body, or
    /// another client, is `Conflict`.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name))]
    pub async fn create(
        &self,
        caller: &Client,
        req: &CreateOrder,
    ) -> Result<(Created, Order), OrderError> {
        let pool = &self.ledger.pools().hot;
        let metrics = self.ledger.metrics();
        let new = NewOrder {
            order_id: req.order_id.as_str(),
            client: &caller.name,
            subject: req.subject.as_str(),
            amount_minor: req.amount_minor,
            currency: &req.currency,
        };
        let pools = self.ledger.pools();
        let inserted = timed(
            metrics,
            "order_create",
            pools.bounded(sql::create(pool, &new)),
        )
        .await?;
        let (row, events) = timed(
            metrics,
            "order_get",
            pools.bounded(sql::get(pool, req.order_id.as_str())),
        )
        .await?
        .ok_or(OrderError::NotFound)?;
        if inserted {
            return Ok((Created::New, order_of(row, events)));
        }
        let same = row.client == caller.name
            && row.subject == req.subject.as_str()
            && row.amount_minor == req.amount_minor
            && row.currency == req.currency;
        if same {
            Ok((Created::Replayed, order_of(row, events)))
        } else {
            Err(OrderError::Conflict)
        }
    }

    pub async fn get(&self, caller: &Client, order_id: &str) -> Result<Order, OrderError> {
        let (row, events) = timed(
            self.ledger.metrics(),
            "order_get",
            self.ledger
                .pools()
                .bounded(sql::get(&self.ledger.pools().hot, order_id)),
        )
        .await?
        .ok_or(OrderError::NotFound)?;
        if !Self::visible(caller, &row) {
            return Err(OrderError::NotFound);
        }
        Ok(order_of(row, events))
    }

    /// Applies pay, refund or close. One transaction: lock the order, decide
    /// with [`transition`], then one statement consumes the token, changes the
    /// order and writes the event and audit rows. Refusals roll back, leaving
    /// the token unconsumed.
    ///
    /// Bounded in time like every payment-path call: a Postgres that stopped
    /// answering costs at most a few statement deadlines and answers 503;
    /// dropping the transaction rolls it back.
    #[tracing::instrument(level = "debug", skip_all, fields(client = %caller.name, event = input.event.kind().as_str()))]
    pub async fn apply(
        &self,
        caller: &Client,
        order_id: &str,
        input: &EventInput,
    ) -> Result<(Applied, Order), OrderError> {
        let deadline = self.ledger.pools().deadline * 2;
        match tokio::time::timeout(deadline, self.apply_unbounded(caller, order_id, input)).await {
            Ok(out) => out,
            Err(_) => Err(DurableError::TimedOut(deadline).into()),
        }
    }

    async fn apply_unbounded(
        &self,
        caller: &Client,
        order_id: &str,
        input: &EventInput,
    ) -> Result<(Applied, Order), OrderError> {
        let ledger = self.ledger;
        // No I/O: tag, biz type known and granted, durable.
        let token = ledger.verify(&input.token)?;
        ledger.issued_by_fleet(&token)?;
        let biz = token.claims.biz_type.clone();
        let settings = ledger.biz_settings_for(caller, &biz)?;
        if settings.durability != Durability::Durable {
            return Err(OrderError::DurableTokenRequired);
        }
        if OrderId::parse(order_id).is_err() {
            return Err(OrderError::NotFound);
        }
        let pool = &ledger.pools().hot;
        let metrics = ledger.metrics();
        let mut tx = pool.begin().await.map_err(DurableError::from)?;
        let locked: LockedOrder =
            match timed(metrics, "order_lock", sql::lock(&mut tx, order_id, &token)).await? {
                Some(l) if Self::visible(caller, &l.order) => l,
                _ => return Err(OrderError::NotFound),
            };
        let subject =
            Subject::parse(&locked.order.subject).map_err(|e| LedgerError::InvalidRequest(e.0))?;
        if !ledger
            .codec()
            .is_bound_to(&token, &caller.name, subject.as_str())
        {
            return Err(LedgerError::TokenMismatch.into());
        }
        // In READ COMMITTED the order row is re-read after waiting for its
        // lock, but the token columns joined to it come from the statement's
        // snapshot, taken before the wait. A refusal is therefore decided again
        // on a fresh read of the token (the happy path needs no second read).
        let mut usage = locked.usage.clone();
        let mut decision = decide(&locked.order, &usage, order_id, input);
        if !matches!(decision, Ok(Decision::Apply { .. })) {
            usage = timed(metrics, "order_token", sql::token_usage(&mut tx, &token)).await?;
            decision = decide(&locked.order, &usage, order_id, input);
        }
        let (next, after) = match decision? {
            Decision::Apply { next, after } => (next, after),
            Decision::Repeat { replay } => {
                drop(tx);
                let outcome = if replay {
                    ConsumeOutcome::Replayed
                } else {
                    ConsumeOutcome::Duplicate
                };
                ledger.count_consume(&biz, outcome);
                let order = self.get(caller, order_id).await?;
                return Ok((
                    if replay {
                        Applied::Replayed
                    } else {
                        Applied::Duplicate
                    },
                    order,
                ));
            }
            Decision::Expired => {
                ledger.count_consume(&biz, ConsumeOutcome::Expired);
                return Err(LedgerError::TokenExpired.into());
            }
        };
        let record = ledger.record_for(&token, settings, caller, &subject);
        let write = EventWrite {
            record: &record,
            order_id,
            kind: input.event.kind(),
            next_state: next,
            refunded_minor: after.refunded_minor,
            amount_minor: match input.event {
                OrderEvent::Refund { amount_minor } => amount_minor,
                OrderEvent::Pay | OrderEvent::Close => locked.order.amount_minor,
            },
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            reason: input.reason.as_deref(),
        };
        let applied = timed(metrics, "order_event", sql::write_event(&mut tx, &write)).await?;
        if !applied {
            // The token was consumed (or expired) between our read and write.
            drop(tx);
            return Err(OrderError::TokenAlreadyUsed);
        }
        tx.commit().await.map_err(DurableError::from)?;
        ledger.count_consume(&biz, ConsumeOutcome::Consumed);
        ledger.settle_consumed_in_background(
            &token.text,
            None,
            Marker {
                at_ms: Utc::now().timestamp_millis(),
                request_id: write.request_id.map(str::to_owned),
                fingerprint: write.fingerprint.map(str::to_owned),
                result: None,
            },
        );
        let order = self.get(caller, order_id).await?;
        Ok((Applied::Applied, order))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const A: Amounts = Amounts {
        amount_minor: 1000,
        refunded_minor: 0,
    };

    #[test]
    fn exhaustive_table() {
        use OrderState::*;
        let events = [
            OrderEvent::Pay,
            OrderEvent::Close,
            OrderEvent::Refund { amount_minor: 400 },
            OrderEvent::Refund { amount_minor: 1000 },
        ];
        for state in OrderState::ALL {
            for event in events {
                let amounts = if state == PartiallyRefunded {
                    Amounts {
                        refunded_minor: 400,
                        ..A
                    }
                } else {
                    A
                };
                let got = transition(state, amounts, event).map(|(s, a)| (s, a.refunded_minor));
                let want = match (state, event) {
                    (Created, OrderEvent::Pay) => Ok((Paid, 0)),
                    (Created, OrderEvent::Close) => Ok((Closed, 0)),
                    (Paid, OrderEvent::Refund { amount_minor: 400 }) => {
                        Ok((PartiallyRefunded, 400))
                    }
                    (Paid, OrderEvent::Refund { .. }) => Ok((Refunded, 1000)),
                    (PartiallyRefunded, OrderEvent::Refund { amount_minor: 400 }) => {
                        Ok((PartiallyRefunded, 800))
                    }
                    (PartiallyRefunded, OrderEvent::Refund { .. }) => Err("exceeds"),
                    _ => Err("illegal"),
                };
                match (got, want) {
                    (Ok(g), Ok(w)) => assert_eq!(g, w, "{state} {event:?}"),
                    (Err(TransitionError::RefundExceedsPaid { .. }), Err("exceeds")) => {}
                    (Err(TransitionError::Illegal { state: s, .. }), Err("illegal")) => {
                        assert_eq!(s, state)
                    }
                    (g, w) => panic!("{state} {event:?}: got {g:?}, want {w:?}"),
                }
            }
        }
    }

    #[test]
    fn refunds_must_be_positive() {
        assert!(transition(OrderState::Paid, A, OrderEvent::Refund { amount_minor: 0 }).is_err());
        assert!(transition(OrderState::Paid, A, OrderEvent::Refund { amount_minor: -5 }).is_err());
    }

    proptest! {
        /// Whatever the sequence, refunds never exceed the amount and the
        /// state agrees with the amounts.
        #[test]
        fn invariants_hold(amount in 1i64..10_000, events in proptest::collection::vec((0u8..3, 1i64..5_000), 0..30)) {
            let mut state = OrderState::Created;
            let mut amounts = Amounts { amount_minor: amount, refunded_minor: 0 };
            for (k, n) in events {
                let event = match k { 0 => OrderEvent::Pay, 1 => OrderEvent::Close, _ => OrderEvent::Refund { amount_minor: n } };
                if let Ok((s, a)) = transition(state, amounts, event) {
                    state = s;
                    amounts = a;
                }
                prop_assert!(amounts.refunded_minor >= 0 && amounts.refunded_minor <= amounts.amount_minor);
                match state {
                    OrderState::Refunded => prop_assert_eq!(amounts.refunded_minor, amounts.amount_minor),
                    OrderState::PartiallyRefunded => prop_assert!(amounts.refunded_minor > 0 && amounts.refunded_minor < amounts.amount_minor),
                    _ => prop_assert_eq!(amounts.refunded_minor, 0),
                }
            }
        }
    }
}
