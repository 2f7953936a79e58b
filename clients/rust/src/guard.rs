//! The guard: the whole exactly-once pattern in one call. Consume; when this
//! attempt won, run the caller's step; record its output as the result, or
//! release the token (key) when the step failed before any side effect.
//!
//! The step says how it failed through [`StepError`], and the safe answer is
//! the default: an error turned into a `StepError` by `?` counts as *after*
//! side effects, so the token stays consumed and nothing runs twice. Only an
//! error the step marks explicitly as [`StepError::BeforeSideEffects`] gives
//! the token back. A step that panics leaves the token consumed too.

use std::fmt;
use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::client::Client;
use crate::error::Error;
use crate::keys::KeyConsumeRequest;
use crate::outcome::{ConsumeOutcome, Released, Timestamp};
use crate::tokens::ConsumeRequest;

/// How a step failed.
#[derive(Debug)]
pub enum StepError<E> {
    /// Nothing happened outside this process yet (validation failed, a
    /// precondition did not hold, a call was refused before it did anything):
    /// the guard releases the token so the same token can be retried.
    BeforeSideEffects(E),
    /// Something may have happened (a charge sent, a row written, a message
    /// published, or you cannot tell): the token stays consumed.
    AfterSideEffects(E),
}

/// `?` on a step's own error type counts it as after side effects: the safe
/// default when you do not say otherwise.
impl<E> From<E> for StepError<E> {
    fn from(e: E) -> StepError<E> {
        StepError::AfterSideEffects(e)
    }
}

impl<E> StepError<E> {
    /// A failure before any side effect (`map_err(StepError::before)`).
    pub fn before(e: impl Into<E>) -> StepError<E> {
        StepError::BeforeSideEffects(e.into())
    }

    /// A failure after side effects may have happened.
    pub fn after(e: impl Into<E>) -> StepError<E> {
        StepError::AfterSideEffects(e.into())
    }

    pub fn into_inner(self) -> E {
        match self {
            StepError::BeforeSideEffects(e) | StepError::AfterSideEffects(e) => e,
        }
    }
}

/// Marks a `Result`'s error for the guard: `validate(&req).before_side_effects()?`.
pub trait SideEffects<T, E> {
    /// The error happened before any side effect: the token is given back.
    fn before_side_effects(self) -> Result<T, StepError<E>>;
    /// The error may have happened after side effects: the token stays consumed.
    fn after_side_effects(self) -> Result<T, StepError<E>>;
}

impl<T, E> SideEffects<T, E> for Result<T, E> {
    fn before_side_effects(self) -> Result<T, StepError<E>> {
        self.map_err(StepError::BeforeSideEffects)
    }
    fn after_side_effects(self) -> Result<T, StepError<E>> {
        self.map_err(StepError::AfterSideEffects)
    }
}

/// What a guarded run did, when nothing failed.
#[must_use = "`InProgress` means the step did not run and has no output yet"]
#[derive(Debug, Clone, PartialEq)]
pub enum Guarded<R> {
    /// This attempt won, ran the step, and recorded its output.
    Ran(R),
    /// An earlier attempt ran it: this is the output it recorded. The step
    /// did not run now.
    Completed(R),
    /// Another attempt holds the token and has recorded nothing yet (it is
    /// running, or it died and an operator must release it). The step did
    /// not run; ask again later.
    InProgress { consumed_at: Option<Timestamp> },
    /// Another attempt holds it past its biz type's processing lease with
    /// neither result nor release: its outcome is unknown until its consumer
    /// or an operator resolves it. The step did not run; do not start over.
    Uncertain { consumed_at: Option<Timestamp> },
}

/// What went wrong in a guarded run.
#[derive(Debug)]
pub enum GuardError<E, R> {
    /// The consume failed and the step did not run. `TokenExpired`: issue a
    /// new token; `FingerprintMismatch`: this token belongs to another
    /// request; `Unavailable` or `Transport`: run the same guard request
    /// again later.
    Consume(Error),
    /// The step failed before any side effect. `released` is `Ok` when the
    /// token was given back (consume it again to retry), else why not (then
    /// it stays consumed, as after side effects).
    BeforeSideEffects {
        error: E,
        released: Result<Released, Error>,
    },
    /// The step failed and side effects may have happened: the token stays
    /// consumed (duplicates answer `InProgress`) until you record a result or
    /// an operator releases it.
    AfterSideEffects(E),
    /// The step succeeded (its side effects happened) but its output could
    /// not be recorded: record it yourself ([`Client::record_result`] /
    /// [`Client::record_key_result`]) when the ledger is back. Until then
    /// duplicates answer `InProgress`.
    Record { output: R, error: Error },
    /// An earlier attempt recorded a result that does not read as `R`.
    StoredResult {
        result: Value,
        error: serde_json::Error,
    },
}

impl<E: fmt::Display, R> fmt::Display for GuardError<E, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GuardError::Consume(e) => write!(f, "consume failed: {e}"),
            GuardError::BeforeSideEffects {
                error,
                released: Ok(_),
            } => write!(
                f,
                "step failed before side effects (token released): {error}"
            ),
            GuardError::BeforeSideEffects {
                error,
                released: Err(r),
            } => write!(
                f,
                "step failed before side effects, and the release failed ({r}): {error}"
            ),
            GuardError::AfterSideEffects(e) => {
                write!(f, "step failed after side effects (token kept): {e}")
            }
            GuardError::Record { error, .. } => {
                write!(f, "step succeeded, recording its result failed: {error}")
            }
            GuardError::StoredResult { error, .. } => {
                write!(
                    f,
                    "the recorded result does not read as the output type: {error}"
                )
            }
        }
    }
}

impl<E: fmt::Debug + fmt::Display, R: fmt::Debug> std::error::Error for GuardError<E, R> {}

#[derive(Debug, Clone)]
enum Target {
    Token {
        token: String,
        request: ConsumeRequest,
    },
    Key(KeyConsumeRequest),
}

/// One guarded attempt; see [`Client::guard_token`] and [`Client::guard_key`].
#[derive(Debug, Clone)]
pub struct Guard {
    client: Client,
    target: Target,
}

impl Client {
    /// Guards a step with a token: see [`Guard::run`].
    pub fn guard_token(&self, token: impl Into<String>, request: ConsumeRequest) -> Guard {
        Guard {
            client: self.clone(),
            target: Target::Token {
                token: token.into(),
                request,
            },
        }
    }

    /// Guards a step with a client-supplied key: see [`Guard::run`].
    pub fn guard_key(&self, request: KeyConsumeRequest) -> Guard {
        Guard {
            client: self.clone(),
            target: Target::Key(request),
        }
    }
}

impl Guard {
    /// Waits up to `wait` (at most 10 s) for another attempt that holds the
    /// token or key to finish, instead of answering `InProgress` at once:
    /// see [`crate::ConsumeRequest::with_wait`].
    pub fn wait(mut self, wait: std::time::Duration) -> Guard {
        self.target = match self.target {
            Target::Token { token, request } => Target::Token {
                token,
                request: request.with_wait(wait),
            },
            Target::Key(request) => Target::Key(request.with_wait(wait)),
        };
        self
    }

    /// Consumes, and when this attempt won runs `step` once:
    ///
    /// | step returns | the guard | you get |
    /// |---|---|---|
    /// | `Ok(output)` | records `output` as the result | `Ok(Guarded::Ran(output))` |
    /// | `Err(StepError::BeforeSideEffects(e))` | releases the token | `Err(GuardError::BeforeSideEffects { error: e, released })` |
    /// | `Err(StepError::AfterSideEffects(e))`, or any error `?` converted | keeps it consumed | `Err(GuardError::AfterSideEffects(e))` |
    /// | panics | keeps it consumed | the panic |
    ///
    /// When another attempt consumed it: `Guarded::Completed(output)` with the
    /// output it recorded, or `Guarded::InProgress`; the step does not run.
    pub async fn run<R, E, F, Fut>(self, step: F) -> Result<Guarded<R>, GuardError<E, R>>
    where
        R: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<R, StepError<E>>>,
    {
        let outcome = match &self.target {
            Target::Token { token, request } => self.client.consume(token, request).await,
            Target::Key(request) => self.client.consume_key(request).await,
        }
        .map_err(GuardError::Consume)?;
        match outcome {
            ConsumeOutcome::InProgress { consumed_at } => Ok(Guarded::InProgress { consumed_at }),
            ConsumeOutcome::Uncertain { consumed_at } => Ok(Guarded::Uncertain { consumed_at }),
            ConsumeOutcome::Completed { result, .. } => {
                match serde_json::from_value(result.clone()) {
                    Ok(output) => Ok(Guarded::Completed(output)),
                    Err(error) => Err(GuardError::StoredResult { result, error }),
                }
            }
            ConsumeOutcome::Won { .. } => match step().await {
                Ok(output) => match self.record(&output).await {
                    Ok(()) => Ok(Guarded::Ran(output)),
                    Err(error) => Err(GuardError::Record { output, error }),
                },
                Err(StepError::BeforeSideEffects(error)) => Err(GuardError::BeforeSideEffects {
                    error,
                    released: self.release().await,
                }),
                Err(StepError::AfterSideEffects(error)) => Err(GuardError::AfterSideEffects(error)),
            },
        }
    }

    async fn record<R: Serialize>(&self, output: &R) -> Result<(), Error> {
        let result = serde_json::to_value(output).map_err(Error::Encode)?;
        match &self.target {
            Target::Token { token, request } => {
                self.client
                    .record_result_of(
                        token,
                        request.subject(),
                        Some(request.request_id()),
                        &result,
                    )
                    .await
            }
            Target::Key(request) => {
                self.client
                    .record_key_result_of(
                        request.biz_type(),
                        request.key(),
                        Some(request.request_id()),
                        &result,
                    )
                    .await
            }
        }
        .map(|_| ())
    }

    async fn release(&self) -> Result<Released, Error> {
        match &self.target {
            Target::Token { token, request } => {
                self.client
                    .release_of(token, request.subject(), Some(request.request_id()))
                    .await
            }
            Target::Key(request) => {
                self.client
                    .release_key_of(
                        request.biz_type(),
                        request.key(),
                        Some(request.request_id()),
                    )
                    .await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Invalid;

    fn validate(ok: bool) -> Result<u32, Invalid> {
        if ok {
            Ok(1)
        } else {
            Err(Invalid)
        }
    }

    fn step(ok: bool, marked: bool) -> Result<u32, StepError<Invalid>> {
        if marked {
            let n = validate(ok).before_side_effects()?;
            Ok(n)
        } else {
            // A bare `?`: counted as after side effects.
            let n = validate(ok)?;
            Ok(n)
        }
    }

    #[test]
    fn question_mark_defaults_to_after_side_effects_and_marking_says_before() {
        assert!(matches!(
            step(false, false),
            Err(StepError::AfterSideEffects(Invalid))
        ));
        assert!(matches!(
            step(false, true),
            Err(StepError::BeforeSideEffects(Invalid))
        ));
        assert_eq!(step(true, true).ok(), Some(1));
        let e: StepError<String> = StepError::before("no stock");
        assert_eq!(e.into_inner(), "no stock");
    }
}
