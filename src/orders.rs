//! Orders: [`Orders`] creates orders and applies events to them, each event
//! consuming a durable token of the order's subject in the same Postgres
//! transaction as the state change, the event row and the audit row. Which
//! event may follow which state is [`crate::domain::order::transition`]'s
//! (pure); the statements are [`crate::durable::orders`]'; the token is the
//! ledger's ([`Ledger::consume_for_order`] takes this module's transaction).

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::auth::Client;
use crate::config::Durability;
use crate::domain::order::{transition, Amounts, OrderEvent, OrderState, TransitionError};
use crate::domain::{Fingerprint, OrderId, RequestId, Subject};
use crate::durable::orders::{
    self as sql, LockedOrder, NewOrder, OrderChange, OrderEventRecord, OrderRow, TokenUsage,
};
use crate::durable::{timed, DurableError, Pools};
use crate::ledger::{ConsumeOutcome, Ledger, LedgerError};

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
        if used.order_id != order_id || used.kind != Some(input.event.kind()) {
            return Err(OrderError::TokenAlreadyUsed);
        }
        // Only an identical event is a duplicate: the same token on the same
        // order with another refund amount, or another fingerprint (both
        // present), changes nothing.
        let other_fingerprint = matches!((&usage.fingerprint, &input.fingerprint), (Some(a), Some(b)) if a != b.as_str());
        let other_amount = match input.event {
            OrderEvent::Refund { amount_minor } => amount_minor != used.amount_minor,
            OrderEvent::Pay | OrderEvent::Close => false,
        };
        if other_fingerprint || other_amount {
            return Err(LedgerError::FingerprintMismatch.into());
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

/// Order operations: the order's statements on the payment pool, its token
/// through the ledger. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Orders {
    ledger: Arc<Ledger>,
    pools: Pools,
}

impl Orders {
    pub fn new(ledger: Arc<Ledger>, pools: Pools) -> Orders {
        Orders { ledger, pools }
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
        let pools = &self.pools;
        let metrics = self.ledger.metrics();
        let new = NewOrder {
            order_id: req.order_id.as_str(),
            client: &caller.name,
            subject: req.subject.as_str(),
            amount_minor: req.amount_minor,
            currency: &req.currency,
        };
        let inserted = timed(
            metrics,
            "order_create",
            pools.bounded(sql::create(&pools.hot, &new)),
        )
        .await?;
        let (row, events) = timed(
            metrics,
            "order_get",
            pools.bounded(sql::get(&pools.hot, req.order_id.as_str())),
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
            self.pools.bounded(sql::get(&self.pools.hot, order_id)),
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
        let deadline = self.pools.deadline * 2;
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
        let ledger = &self.ledger;
        // No I/O: tag, issued by the fleet, biz type known and granted, durable.
        let token = ledger.check_order_token(caller, &input.token)?;
        if token.durability() != Durability::Durable {
            return Err(OrderError::DurableTokenRequired);
        }
        if OrderId::parse(order_id).is_err() {
            return Err(OrderError::NotFound);
        }
        let biz = token.verified().claims.biz_type.clone();
        let metrics = ledger.metrics();
        let mut tx = crate::durable::begin(&self.pools.hot)
            .await
            .map_err(DurableError::from)?;
        let locked: LockedOrder = match timed(
            metrics,
            "order_lock",
            sql::lock(&mut tx, order_id, token.verified()),
        )
        .await?
        {
            Some(l) if Self::visible(caller, &l.order) => l,
            _ => return Err(OrderError::NotFound),
        };
        let subject =
            Subject::parse(&locked.order.subject).map_err(|e| LedgerError::InvalidRequest(e.0))?;
        ledger.check_binding(&token, caller, &subject)?;
        // In READ COMMITTED the order row is re-read after waiting for its
        // lock, but the token columns joined to it come from the statement's
        // snapshot, taken before the wait. A refusal is therefore decided again
        // on a fresh read of the token (the happy path needs no second read).
        let mut usage = locked.usage.clone();
        let mut decision = decide(&locked.order, &usage, order_id, input);
        if !matches!(decision, Ok(Decision::Apply { .. })) {
            usage = timed(
                metrics,
                "order_token",
                sql::token_usage(&mut tx, token.verified()),
            )
            .await?;
            decision = decide(&locked.order, &usage, order_id, input);
        }
        let (next, after) = match decision? {
            Decision::Apply { next, after } => (next, after),
            Decision::Repeat { replay } => {
                drop(tx);
                let (outcome, applied) = if replay {
                    (ConsumeOutcome::Replayed, Applied::Replayed)
                } else {
                    (ConsumeOutcome::Duplicate, Applied::Duplicate)
                };
                ledger.count_consume(&biz, outcome);
                let order = self.get(caller, order_id).await?;
                return Ok((applied, order));
            }
            Decision::Expired => {
                ledger.count_consume(&biz, ConsumeOutcome::Expired);
                return Err(LedgerError::TokenExpired.into());
            }
        };
        let change = OrderChange {
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
        if !ledger
            .consume_for_order(tx, &token, caller, &subject, &change)
            .await?
        {
            // The token was consumed (or expired) between our read and write.
            return Err(OrderError::TokenAlreadyUsed);
        }
        let order = self.get(caller, order_id).await?;
        Ok((Applied::Applied, order))
    }
}
