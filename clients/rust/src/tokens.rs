//! Token routes: issue, consume, result, release, and reading a token's state.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use std::time::Duration;

use crate::client::Client;
use crate::error::Error;
use crate::outcome::{expect_outcome, ConsumeOutcome, Recorded, Released, State, Timestamp};
use crate::retry::RetryPolicy;

/// A new logical attempt's `request_id`: a random UUID.
pub(crate) fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// `POST /v1/tokens`.
#[derive(Debug, Clone, Serialize)]
pub struct IssueRequest {
    biz_type: String,
    subject: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl_seconds: Option<u64>,
}

impl IssueRequest {
    /// A token of `biz_type` bound to `subject` (your user), living the biz
    /// type's ttl.
    pub fn new(biz_type: impl Into<String>, subject: impl Into<String>) -> IssueRequest {
        IssueRequest {
            biz_type: biz_type.into(),
            subject: subject.into(),
            ttl_seconds: None,
        }
    }

    /// A shorter life: 1 to the biz type's ttl.
    pub fn with_ttl_seconds(mut self, seconds: u64) -> IssueRequest {
        self.ttl_seconds = Some(seconds);
        self
    }
}

/// A token the ledger issued.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Issued {
    pub token: String,
    pub biz_type: String,
    pub subject: String,
    pub expires_at: Timestamp,
    /// Seconds the token lives.
    pub expire_time: u64,
}

/// The body of `POST /v1/tokens/{token}/consume`: one logical attempt.
///
/// Building one draws its `request_id`; every try of [`Client::consume`] with
/// this value sends that same id, so a retry after a lost answer learns that
/// it won ([`ConsumeOutcome::Won`] with `replayed: true`). Keep the value (or
/// [`ConsumeRequest::request_id`]) to ask again later; build a new one only
/// for a new attempt.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumeRequest {
    subject: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    biz_type: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
}

/// The longest wait the ledger accepts (`wait_ms` 0 to 10,000).
pub const MAX_WAIT: Duration = Duration::from_secs(10);

/// `wait` in whole milliseconds, at most [`MAX_WAIT`].
pub(crate) fn wait_ms(wait: Duration) -> u64 {
    u64::try_from(wait.min(MAX_WAIT).as_millis()).unwrap_or(10_000)
}

/// The policy of a consume that may wait `wait_ms` on the ledger: each try
/// may last that long beyond the usual per-try timeout.
pub(crate) fn waiting_policy(base: &RetryPolicy, wait_ms: Option<u64>) -> Option<RetryPolicy> {
    let wait = Duration::from_millis(wait_ms.filter(|w| *w > 0)?);
    let per_try = base.attempt_timeout + wait;
    Some(
        base.clone()
            .attempt_timeout(per_try)
            .deadline(base.deadline.max(per_try + wait)),
    )
}

impl ConsumeRequest {
    pub fn new(subject: impl Into<String>) -> ConsumeRequest {
        ConsumeRequest {
            subject: subject.into(),
            biz_type: None,
            fingerprint: None,
            request_id: new_request_id(),
            wait_ms: None,
        }
    }

    /// Waits for the winner (`wait_ms`, at most [`MAX_WAIT`]): when another
    /// attempt holds the token without a result, the ledger holds this
    /// consume until that attempt records its result (then
    /// [`ConsumeOutcome::Completed`]), releases it (then this attempt may
    /// win), its lease runs out ([`ConsumeOutcome::Uncertain`]) or the wait
    /// ends ([`ConsumeOutcome::InProgress`]).
    pub fn with_wait(mut self, wait: Duration) -> ConsumeRequest {
        self.wait_ms = Some(wait_ms(wait));
        self
    }

    /// Checked against the token's own biz type (another: `token_mismatch`).
    pub fn with_biz_type(mut self, biz_type: impl Into<String>) -> ConsumeRequest {
        self.biz_type = Some(biz_type.into());
        self
    }

    /// A hash of the business request (see [`crate::fingerprint`]): a later
    /// consume with another one is refused with `fingerprint_mismatch`.
    pub fn with_fingerprint(mut self, fingerprint: impl Into<String>) -> ConsumeRequest {
        self.fingerprint = Some(fingerprint.into());
        self
    }

    /// Continue an attempt whose id you kept (1 to 128 printable ASCII
    /// characters), e.g. across a restart of your process.
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> ConsumeRequest {
        self.request_id = request_id.into();
        self
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn subject(&self) -> &str {
        &self.subject
    }
}

#[derive(Serialize)]
struct SubjectBody<'a> {
    subject: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

#[derive(Serialize)]
struct ResultBody<'a, R: ?Sized> {
    subject: &'a str,
    result: &'a R,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

/// `GET /v1/tokens/{token}?subject=`: what a token's own client may read.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TokenState {
    pub token: String,
    pub biz_type: String,
    pub state: State,
    pub expires_at: Timestamp,
    #[serde(default)]
    pub consumed_at: Option<Timestamp>,
    /// The recorded result, once there is one.
    #[serde(default)]
    pub result: Option<Value>,
}

impl Client {
    /// Issues a token (`POST /v1/tokens`). Retried on 429 `rate_limited`
    /// after its `Retry-After`; a try whose answer was lost costs an unused
    /// token that simply expires.
    pub async fn issue(&self, request: &IssueRequest) -> Result<Issued, Error> {
        self.post(self.url(&["v1", "tokens"]), request)
            .await?
            .json()
    }

    /// Consumes `token` for one attempt (`POST /v1/tokens/{token}/consume`).
    /// Match the outcome: only `Won` lets you run the business step.
    pub async fn consume(
        &self,
        token: &str,
        request: &ConsumeRequest,
    ) -> Result<ConsumeOutcome, Error> {
        let url = self.url(&["v1", "tokens", token, "consume"]);
        let answer = match waiting_policy(self.retry_policy(), request.wait_ms) {
            Some(policy) => {
                self.call_with(&policy, reqwest::Method::POST, url, Some(request))
                    .await?
            }
            None => self.post(url, request).await?,
        };
        ConsumeOutcome::from_answer(&answer)
    }

    /// Records the business result of a token this client consumed
    /// (`POST /v1/tokens/{token}/result`); later duplicates replay it.
    /// `result` is any JSON value, at most 64 KiB with the request.
    pub async fn record_result<R: Serialize + ?Sized>(
        &self,
        token: &str,
        subject: &str,
        result: &R,
    ) -> Result<Recorded, Error> {
        self.record_result_of(token, subject, None, result).await
    }

    /// [`Client::record_result`] for the consume of `request_id` (when
    /// given): recorded only while that consume holds the token, never on
    /// another attempt's consume after a release (then `NotConsumed`).
    pub async fn record_result_of<R: Serialize + ?Sized>(
        &self,
        token: &str,
        subject: &str,
        request_id: Option<&str>,
        result: &R,
    ) -> Result<Recorded, Error> {
        let answer = self
            .post(
                self.url(&["v1", "tokens", token, "result"]),
                &ResultBody {
                    subject,
                    result,
                    request_id,
                },
            )
            .await?;
        expect_outcome(&answer, "recorded")?;
        Ok(Recorded {
            replayed: answer.replayed,
        })
    }

    /// Gives a consumed token back (`POST /v1/tokens/{token}/release`), for a
    /// business step that failed before any side effect: the same token can
    /// be consumed again. `not_releasable` when it has a result or an order
    /// event, or is not consumed (which is also what a retry hears after an
    /// earlier try released it and the answer was lost: read
    /// [`Client::token_state`] when you need to know).
    pub async fn release(&self, token: &str, subject: &str) -> Result<Released, Error> {
        self.release_of(token, subject, None).await
    }

    /// [`Client::release`] of the consume of `request_id` (when given):
    /// released only while that consume holds the token (else
    /// `NotReleasable`).
    pub async fn release_of(
        &self,
        token: &str,
        subject: &str,
        request_id: Option<&str>,
    ) -> Result<Released, Error> {
        let answer = self
            .post(
                self.url(&["v1", "tokens", token, "release"]),
                &SubjectBody {
                    subject,
                    request_id,
                },
            )
            .await?;
        expect_outcome(&answer, "released")?;
        Ok(Released)
    }

    /// Reads a token's state without consuming it (`GET /v1/tokens/{token}`):
    /// "did my payment go through?".
    pub async fn token_state(&self, token: &str, subject: &str) -> Result<TokenState, Error> {
        let mut url = self.url(&["v1", "tokens", token]);
        url.query_pairs_mut().append_pair("subject", subject);
        self.get(url).await
    }
}
