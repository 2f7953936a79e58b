//! The order state machine, pure and without I/O: the states Postgres
//! stores (`order_state`), the events a token may carry, and [`transition`],
//! the one place that says which event may follow which state. A leaf:
//! [`crate::orders`] applies it and [`crate::durable::orders`] stores it.

use std::fmt;

use super::AuditKind;

/// Stored as the Postgres enum `order_state` (see `durable::pg_enum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
