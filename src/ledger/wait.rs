//! Waiting for the winner (`wait_ms`): a consume that would answer
//! `duplicate` / `processing` waits, at most its `wait_ms`, for the token's
//! (or key's) next change ([`crate::changes`]): a result then answers
//! `duplicate` / `completed` with it, a release lets this call consume (and
//! possibly win). At the end of the wait it answers `processing`, as
//! without one. A waiting call holds no connection and polls nothing.

use std::future::Future;
use std::time::Duration;

use super::api::{ConsumeAnswer, ConsumeInput, DuplicateStatus, LedgerError};
use super::consume::Look;
use super::core::Ledger;
use super::keys::KeyInput;
use crate::auth::Client;
use crate::domain::key::identity;

/// The longest `wait_ms` a consume may ask for.
pub const MAX_WAIT: Duration = Duration::from_secs(10);

fn in_progress(answer: &ConsumeAnswer) -> bool {
    matches!(
        answer,
        ConsumeAnswer::Duplicate {
            status: DuplicateStatus::Processing,
            ..
        }
    )
}

impl Ledger {
    /// How many consumes wait for a winner on this instance now.
    pub fn waiting_consumes(&self) -> usize {
        self.changes.waiting()
    }

    /// [`Ledger::consume`], waiting up to `wait` for the winner.
    pub async fn consume_waiting(
        &self,
        caller: &Client,
        text: &str,
        input: &ConsumeInput,
        wait: Duration,
    ) -> Result<ConsumeAnswer, LedgerError> {
        // A token that does not verify is refused by the consume itself.
        let id = match self.verifier.tag_only(text) {
            Some(token) if !wait.is_zero() => token.claims.id.as_i64(),
            _ => return self.consume(caller, text, input).await,
        };
        self.waiting(id, wait, || self.look_consume(caller, text, input))
            .await
    }

    /// [`Ledger::consume_key`], waiting up to `wait` for the winner.
    pub async fn consume_key_waiting(
        &self,
        caller: &Client,
        input: &KeyInput,
        wait: Duration,
    ) -> Result<ConsumeAnswer, LedgerError> {
        if wait.is_zero() {
            return self.consume_key(caller, input).await;
        }
        let id = identity(&caller.name, &input.biz_type, &input.key).id;
        self.waiting(id, wait, || self.look_consume_key(caller, input))
            .await
    }

    /// Consumes, and while the answer is `processing` and `wait` lasts,
    /// consumes again after each change of `id`. The wake-up is armed before
    /// each consume looks, so a change between the look and the wait is
    /// not missed. Only the answer given is counted (one consume attempt,
    /// one duplicate at most, however often it looked).
    async fn waiting<F, Fut>(
        &self,
        id: i64,
        wait: Duration,
        mut consume: F,
    ) -> Result<ConsumeAnswer, LedgerError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<Look, LedgerError>>,
    {
        let deadline = tokio::time::Instant::now() + wait.min(MAX_WAIT);
        let watch = self.changes.watch(id);
        loop {
            let changed = watch.notify().notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let look = consume().await?;
            if !look.answer.as_ref().is_ok_and(in_progress) {
                return self.tally(look);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.tally(look);
            }
        }
    }
}
