//! Client-supplied keys (`/v1/keys`): the same ledger for callers that
//! already hold a unique key per operation (an `Idempotency-Key` header, a
//! queue's message id). A key belongs to (this client, biz type).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::client::Client;
use crate::error::Error;
use crate::outcome::{expect_outcome, ConsumeOutcome, Recorded, Released, State, Timestamp};
use crate::tokens::{new_request_id, wait_ms, waiting_policy};

/// The body of `POST /v1/keys/consume`: one logical attempt on one key.
///
/// As for [`crate::ConsumeRequest`], building one draws its `request_id`,
/// and every try sends the same one.
#[derive(Debug, Clone, Serialize)]
pub struct KeyConsumeRequest {
    biz_type: String,
    key: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    subject: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    fingerprint: Option<String>,
    request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    wait_ms: Option<u64>,
}

impl KeyConsumeRequest {
    /// `key`: 1 to 255 printable ASCII characters.
    pub fn new(biz_type: impl Into<String>, key: impl Into<String>) -> KeyConsumeRequest {
        KeyConsumeRequest {
            biz_type: biz_type.into(),
            key: key.into(),
            subject: None,
            fingerprint: None,
            request_id: new_request_id(),
            wait_ms: None,
        }
    }

    /// Waits for the winner, as [`crate::ConsumeRequest::with_wait`].
    pub fn with_wait(mut self, wait: Duration) -> KeyConsumeRequest {
        self.wait_ms = Some(wait_ms(wait));
        self
    }

    /// Recorded for audit; every call for this key must then name the same
    /// subject (another: `token_mismatch`).
    pub fn with_subject(mut self, subject: impl Into<String>) -> KeyConsumeRequest {
        self.subject = Some(subject.into());
        self
    }

    /// A hash of the business request: a later consume of the key with
    /// another one is refused with `fingerprint_mismatch`.
    pub fn with_fingerprint(mut self, fingerprint: impl Into<String>) -> KeyConsumeRequest {
        self.fingerprint = Some(fingerprint.into());
        self
    }

    /// Continue an attempt whose id you kept.
    pub fn with_request_id(mut self, request_id: impl Into<String>) -> KeyConsumeRequest {
        self.request_id = request_id.into();
        self
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    pub fn biz_type(&self) -> &str {
        &self.biz_type
    }

    pub fn key(&self) -> &str {
        &self.key
    }
}

#[derive(Serialize)]
struct KeyBody<'a> {
    biz_type: &'a str,
    key: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

#[derive(Serialize)]
struct KeyResultBody<'a, R: ?Sized> {
    biz_type: &'a str,
    key: &'a str,
    result: &'a R,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
}

/// `GET /v1/keys?biz_type=&key=`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct KeyState {
    pub key: String,
    pub biz_type: String,
    pub state: State,
    #[serde(default)]
    pub consumed_at: Option<Timestamp>,
    #[serde(default)]
    pub result: Option<Value>,
}

impl Client {
    /// Consumes a key (`POST /v1/keys/consume`); the first consume creates it.
    /// Match the outcome: only `Won` lets you run the business step.
    pub async fn consume_key(&self, request: &KeyConsumeRequest) -> Result<ConsumeOutcome, Error> {
        let url = self.url(&["v1", "keys", "consume"]);
        let answer = match waiting_policy(self.retry_policy(), request.wait_ms) {
            Some(policy) => {
                self.call_with(&policy, reqwest::Method::POST, url, Some(request))
                    .await?
            }
            None => self.post(url, request).await?,
        };
        ConsumeOutcome::from_answer(&answer)
    }

    /// Records the result of a key this client consumed (`POST /v1/keys/result`).
    pub async fn record_key_result<R: Serialize + ?Sized>(
        &self,
        biz_type: &str,
        key: &str,
        result: &R,
    ) -> Result<Recorded, Error> {
        self.record_key_result_of(biz_type, key, None, result).await
    }

    /// [`Client::record_key_result`] for the consume of `request_id` (when
    /// given), as [`Client::record_result_of`].
    pub async fn record_key_result_of<R: Serialize + ?Sized>(
        &self,
        biz_type: &str,
        key: &str,
        request_id: Option<&str>,
        result: &R,
    ) -> Result<Recorded, Error> {
        let answer = self
            .post(
                self.url(&["v1", "keys", "result"]),
                &KeyResultBody {
                    biz_type,
                    key,
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

    /// Gives a consumed key back (`POST /v1/keys/release`): the step failed
    /// before any side effect, and the key can be consumed again.
    pub async fn release_key(&self, biz_type: &str, key: &str) -> Result<Released, Error> {
        self.release_key_of(biz_type, key, None).await
    }

    /// [`Client::release_key`] of the consume of `request_id` (when given),
    /// as [`Client::release_of`].
    pub async fn release_key_of(
        &self,
        biz_type: &str,
        key: &str,
        request_id: Option<&str>,
    ) -> Result<Released, Error> {
        let answer = self
            .post(
                self.url(&["v1", "keys", "release"]),
                &KeyBody {
                    biz_type,
                    key,
                    request_id,
                },
            )
            .await?;
        expect_outcome(&answer, "released")?;
        Ok(Released)
    }

    /// Reads a key's state (`GET /v1/keys`); a key nobody consumed is
    /// [`Error::KeyNotFound`].
    pub async fn key_state(&self, biz_type: &str, key: &str) -> Result<KeyState, Error> {
        let mut url = self.url(&["v1", "keys"]);
        url.query_pairs_mut()
            .append_pair("biz_type", biz_type)
            .append_pair("key", key);
        self.get(url).await
    }
}
