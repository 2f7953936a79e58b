//! Phase 4: keyset pages of orders whose events, tokens and amounts
//! disagree (`order_inconsistent`: reported, never repaired).

use super::report::{Class, InconsistentOrder, Phase};
use super::run::{PhaseError, Run};
use crate::durable::reconcile as sql;

impl Run<'_> {
    /// Phase 4: orders whose events, tokens and amounts disagree.
    pub(super) async fn orders(&mut self) -> Result<(), PhaseError> {
        self.progress.phase(Phase::Orders, None);
        let mut after = String::new();
        loop {
            if self.cancel.is_cancelled() {
                return Ok(());
            }
            let page = sql::orders_page(
                self.pool(),
                &after,
                self.since,
                self.r.batch as i64,
                self.r.retention.as_secs_f64(),
            )
            .await?;
            let Some(last) = page.last() else {
                return Ok(());
            };
            after = last.order_id.clone();
            self.scanned.orders += page.len() as u64;
            for o in &page {
                let problems = order_problems(o);
                if !problems.is_empty() {
                    self.found.add(Class::OrderInconsistent, 1);
                    self.orders.push(InconsistentOrder {
                        order_id: o.order_id.clone(),
                        problems,
                    });
                }
            }
            self.progress.advance(page.len() as u64);
        }
    }
}

/// What is wrong with one order, in words (empty: consistent).
fn order_problems(o: &sql::OrderFacts) -> Vec<String> {
    let mut p = Vec::new();
    if o.refunded_minor != o.refund_events_sum {
        p.push(format!(
            "refunded_minor is {} but its order.refunded events sum to {}",
            o.refunded_minor, o.refund_events_sum
        ));
    }
    let paid_state = matches!(o.state.as_str(), "PAID" | "PARTIALLY_REFUNDED" | "REFUNDED");
    if paid_state && o.paid_events == 0 {
        p.push(format!("state {} without an order.paid event", o.state));
    }
    if o.paid_events > 1 {
        p.push(format!("{} order.paid events", o.paid_events));
    }
    if o.state == "CLOSED" && o.closed_events == 0 {
        p.push("state CLOSED without an order.closed event".to_owned());
    }
    if o.state == "CREATED" && (o.paid_events > 0 || o.closed_events > 0) {
        p.push("state CREATED but it has an order.paid or order.closed event".to_owned());
    }
    if o.unbacked_events > 0 {
        p.push(format!(
            "{} event(s) whose token has no consumed tokens row bound to this order (within retention)",
            o.unbacked_events
        ));
    }
    p
}
