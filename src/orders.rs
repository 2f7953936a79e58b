//! Orders: [`Orders`] creates orders and applies events to them, each event
//! consuming a durable token of the order's subject in the same Postgres
//! transaction as the state change, the event row and the audit row. Which
//! event may follow which state is [`crate::domain::order::transition`]'s
//! (pure); the statements are [`crate::durable::orders`]'; the token is the
//! ledger's ([`Ledger::consume_for_order`] takes this module's transaction);
//! [`batch`] runs events alone or, on distinct orders, several in one
//! transaction, with the checks and decisions of this module for each.

mod batch;

use std::sync::Arc;

use chrono::{DateTime, Utc};

use crate::auth::Client;
use crate::config::Durability;
use crate::domain::order::{transition, Amounts, OrderEvent, OrderState, TransitionError};
use crate::domain::{BizType, Fingerprint, OrderId, RequestId, Subject};
use crate::durable::orders::{
    self as sql, Claimed, LockedOrder, NewOrder, OrderChange, OrderEventRecord, OrderRow,
    TokenUsage,
};
use crate::durable::{timed, DurableError, Pools};
use crate::ledger::{ConsumeOutcome, Ledger, LedgerError, OrderToken};
use batch::EventBatcher;

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
pub(crate) enum Decision {
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

pub(crate) fn decide(
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

/// One event call, checked as far as it can be without Postgres: what both
/// ways of running it ([`batch`]) take.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event<'a> {
    pub caller: &'a Client,
    pub order_id: &'a str,
    pub input: &'a EventInput,
    pub token: &'a OrderToken,
}

impl Event<'_> {
    fn biz(&self) -> &BizType {
        &self.token.verified().claims.biz_type
    }
}

/// An event whose order is locked and checked: the caller may act on the
/// order, the token is bound to it, and a first decision on what Postgres
/// knew of the token when it locked the order.
#[derive(Debug)]
pub(crate) struct Judged {
    pub locked: LockedOrder,
    pub subject: Subject,
    pub decision: Result<Decision, OrderError>,
}

impl Judged {
    /// Whether the decision is taken again on a fresh read of the token: in
    /// READ COMMITTED the order row is re-read after waiting for its lock,
    /// but the token columns joined to it come from the statement's
    /// snapshot, taken before the wait. So a refusal is decided again (the
    /// happy path needs no second read).
    pub fn needs_fresh_usage(&self) -> bool {
        !matches!(self.decision, Ok(Decision::Apply { .. }))
    }

    /// The decision again, on `usage` (a read after the lock).
    pub fn decide_again(&mut self, ev: &Event<'_>, usage: &TokenUsage) {
        self.decision = decide(&self.locked.order, usage, ev.order_id, ev.input);
    }

    /// What comes next: the write, when the decision is to apply the
    /// event, or how it ends without one.
    pub fn next<'a>(self, ev: &Event<'a>) -> Next<'a> {
        let (next, after) = match self.decision {
            Ok(Decision::Apply { next, after }) => (next, after),
            Ok(Decision::Repeat { replay }) => return Next::Done(Outcome::Repeat { replay }),
            Ok(Decision::Expired) => return Next::Done(Outcome::Expired),
            Err(e) => return Next::Done(Outcome::Refused(e)),
        };
        let input = ev.input;
        let change = OrderChange {
            order_id: ev.order_id,
            kind: input.event.kind(),
            next_state: next,
            refunded_minor: after.refunded_minor,
            amount_minor: match input.event {
                OrderEvent::Refund { amount_minor } => amount_minor,
                OrderEvent::Pay | OrderEvent::Close => self.locked.order.amount_minor,
            },
            fingerprint: input.fingerprint.as_ref().map(Fingerprint::as_str),
            request_id: input.request_id.as_ref().map(RequestId::as_str),
            reason: input.reason.as_deref(),
        };
        Next::Write {
            change,
            subject: self.subject,
        }
    }
}

/// An event after its decision.
#[derive(Debug)]
pub(crate) enum Next<'a> {
    /// Consume the token (bound to `subject`) and apply `change`.
    Write {
        change: OrderChange<'a>,
        subject: Subject,
    },
    /// Nothing to write.
    Done(Outcome),
}

/// The checks that need the locked order (`None`: no such order): the
/// caller may see it, the token is bound to the caller and the order's
/// subject; then the first decision.
pub(crate) fn judge(
    ledger: &Ledger,
    ev: &Event<'_>,
    locked: Option<LockedOrder>,
) -> Result<Judged, OrderError> {
    let locked = match locked {
        Some(l) if Orders::visible(ev.caller, &l.order) => l,
        _ => return Err(OrderError::NotFound),
    };
    let subject =
        Subject::parse(&locked.order.subject).map_err(|e| LedgerError::InvalidRequest(e.0))?;
    ledger.check_binding(ev.token, ev.caller, &subject)?;
    let decision = decide(&locked.order, &locked.usage, ev.order_id, ev.input);
    Ok(Judged {
        locked,
        subject,
        decision,
    })
}

/// How an event's transaction ended for it.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Refused: the answer, nothing written.
    Refused(OrderError),
    /// The token's expiry has passed (Postgres's clock); nothing written.
    Expired,
    /// This token already applied this event to this order.
    Repeat { replay: bool },
    /// The write ran and its transaction committed: the token's claim, or
    /// `None` when it could not be claimed (nothing of it written).
    Written(Option<Claimed>),
}

/// After the transaction: the counters and Redis's write-back. `Ok`: the
/// answer's outcome, to be sent with the order as it is now.
pub(crate) fn settle(
    ledger: &Ledger,
    ev: &Event<'_>,
    outcome: Outcome,
) -> Result<Applied, OrderError> {
    match outcome {
        Outcome::Refused(e) => Err(e),
        Outcome::Expired => {
            ledger.count_consume(ev.biz(), ConsumeOutcome::Expired);
            Err(LedgerError::TokenExpired.into())
        }
        Outcome::Repeat { replay } => {
            let (outcome, applied) = if replay {
                (ConsumeOutcome::Replayed, Applied::Replayed)
            } else {
                (ConsumeOutcome::Duplicate, Applied::Duplicate)
            };
            ledger.count_consume(ev.biz(), outcome);
            Ok(applied)
        }
        // The token was consumed (or expired) between our read and write.
        Outcome::Written(None) => Err(OrderError::TokenAlreadyUsed),
        Outcome::Written(Some(claimed)) => {
            ledger.order_event_committed(
                ev.token,
                claimed,
                ev.input.request_id.as_ref().map(RequestId::as_str),
                ev.input.fingerprint.as_ref().map(Fingerprint::as_str),
            );
            Ok(Applied::Applied)
        }
    }
}

/// The answer to an event that was applied or repeated: the order as read
/// after its transaction (`None`: not found).
pub(crate) fn answer(
    caller: &Client,
    applied: Applied,
    read: Option<(OrderRow, Vec<OrderEventRecord>)>,
) -> Result<(Applied, Order), OrderError> {
    match read {
        Some((row, events)) if Orders::visible(caller, &row) => {
            Ok((applied, order_of(row, events)))
        }
        _ => Err(OrderError::NotFound),
    }
}

/// Order operations: the order's statements on the payment pool, its token
/// through the ledger, its events through [`batch::EventBatcher`]. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct Orders {
    ledger: Arc<Ledger>,
    pools: Pools,
    events: Arc<EventBatcher>,
}

impl Orders {
    /// `clock` and `off_path`: the event batches' (see [`EventBatcher::new`]).
    pub fn new(
        ledger: Arc<Ledger>,
        pools: Pools,
        clock: Arc<dyn crate::clock::Clock>,
        off_path: crate::tasks::OffPath,
    ) -> Orders {
        let events = Arc::new(EventBatcher::new(
            ledger.clone(),
            pools.clone(),
            clock,
            off_path,
        ));
        Orders {
            ledger,
            pools,
            events,
        }
    }

    fn visible(caller: &Client, row: &OrderRow) -> bool {
        caller.reads_all() || row.client == caller.name
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
    /// order and writes the event and audit rows. Refusals write nothing,
    /// leaving the token unconsumed. Events on distinct orders that arrive
    /// while `postgres.order_batches_in_flight` such transactions run share
    /// the next one ([`batch`]), each with the answer it would have alone.
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
        // No I/O: tag, issued by the fleet, biz type known and granted, durable.
        let token = self.ledger.check_order_token(caller, &input.token)?;
        if token.durability() != Durability::Durable {
            return Err(OrderError::DurableTokenRequired);
        }
        if OrderId::parse(order_id).is_err() {
            return Err(OrderError::NotFound);
        }
        let ev = Event {
            caller,
            order_id,
            input,
            token: &token,
        };
        self.events.apply(&ev).await
    }
}
