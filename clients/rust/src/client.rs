//! The client: one `reqwest` connection pool, the API key, the retry policy,
//! and the one place where a request is sent, retried and its answer read.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Problem};
use crate::retry::{self, RetryPolicy};

/// The header the ledger sets on every answer that repeats an earlier one.
pub const REPLAYED: &str = "idempotent-replayed";

/// A handle on one ledger. Cheap to clone (the pool is shared); make one per
/// process and pass clones around.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    base: Url,
    auth: HeaderValue,
    retry: RetryPolicy,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the API key.
        f.debug_struct("Client")
            .field("base", &self.inner.base.as_str())
            .field("retry", &self.inner.retry)
            .finish_non_exhaustive()
    }
}

/// Builds a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    base: String,
    api_key: String,
    retry: RetryPolicy,
    connect_timeout: Duration,
    http: Option<reqwest::Client>,
}

impl ClientBuilder {
    /// The retry policy for every call (default: [`RetryPolicy::default`]).
    pub fn retry(mut self, policy: RetryPolicy) -> ClientBuilder {
        self.retry = policy;
        self
    }

    /// How long a try may take to connect (default 2 s).
    pub fn connect_timeout(mut self, t: Duration) -> ClientBuilder {
        self.connect_timeout = t;
        self
    }

    /// Use this `reqwest::Client` (its pool, TLS roots, proxy settings)
    /// instead of building one. It should not follow redirects.
    pub fn http_client(mut self, http: reqwest::Client) -> ClientBuilder {
        self.http = Some(http);
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        let base = Url::parse(&self.base)
            .map_err(|e| Error::Config(format!("base URL {:?}: {e}", self.base)))?;
        if base.cannot_be_a_base() || !matches!(base.scheme(), "http" | "https") {
            return Err(Error::Config(format!(
                "base URL {:?} must be http:// or https://",
                self.base
            )));
        }
        let mut auth = HeaderValue::from_str(&format!("Bearer {}", self.api_key))
            .map_err(|_| Error::Config("the API key holds characters a header cannot".into()))?;
        auth.set_sensitive(true);
        let http = match self.http {
            Some(http) => http,
            None => reqwest::Client::builder()
                .connect_timeout(self.connect_timeout)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .map_err(|e| Error::Config(format!("HTTP client: {e}")))?,
        };
        Ok(Client {
            inner: Arc::new(Inner {
                http,
                base,
                auth,
                retry: self.retry,
            }),
        })
    }
}

/// A success answer: its status, whether it repeats an earlier one, its body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub replayed: bool,
    pub body: Bytes,
}

impl Answer {
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_slice(&self.body).map_err(|source| Error::Decode {
            status: self.status,
            source,
        })
    }
}

impl Client {
    /// A client of the ledger at `base_url` (e.g. `http://127.0.0.1:8080`),
    /// calling with `api_key`. See [`Client::builder`] for the options.
    pub fn new(base_url: &str, api_key: &str) -> Result<Client, Error> {
        Client::builder(base_url, api_key).build()
    }

    pub fn builder(base_url: &str, api_key: &str) -> ClientBuilder {
        ClientBuilder {
            base: base_url.to_owned(),
            api_key: api_key.to_owned(),
            retry: RetryPolicy::default(),
            connect_timeout: Duration::from_secs(2),
            http: None,
        }
    }

    /// The URL of `segments` under the base (each segment percent-encoded).
    /// The retry policy every call follows.
    pub(crate) fn retry_policy(&self) -> &RetryPolicy {
        &self.inner.retry
    }

    pub(crate) fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.inner.base.clone();
        // The builder refused URLs that cannot be a base, so this always has
        // path segments to extend.
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// Sends one logical request, retried by the policy, and reads the answer.
    /// The body is serialized once, so every try sends the same bytes (the
    /// same `request_id`).
    pub(crate) async fn call<B: Serialize + ?Sized>(
        &self,
        method: Method,
        url: Url,
        body: Option<&B>,
    ) -> Result<Answer, Error> {
        self.call_with(&self.inner.retry, method, url, body).await
    }

    /// [`Client::call`] under another policy.
    pub(crate) async fn call_with<B: Serialize + ?Sized>(
        &self,
        policy: &RetryPolicy,
        method: Method,
        url: Url,
        body: Option<&B>,
    ) -> Result<Answer, Error> {
        let body = body
            .map(|b| serde_json::to_vec(b).map(Bytes::from))
            .transpose()
            .map_err(Error::Encode)?;
        let started = tokio::time::Instant::now();
        let mut waits = policy.backoff();
        loop {
            let left = policy.deadline.saturating_sub(started.elapsed());
            let err = match self
                .try_once(
                    &method,
                    &url,
                    body.as_ref(),
                    policy.attempt_timeout.min(left),
                )
                .await
            {
                Ok(answer) => return Ok(answer),
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => e,
            };
            let Some(backoff) = waits.next() else {
                return Err(err);
            };
            let wait = backoff.max(err.retry_after().unwrap_or_default());
            if started.elapsed() + wait >= policy.deadline {
                return Err(err);
            }
            tracing::debug!(error = %err, wait_ms = wait.as_millis() as u64, "retrying ledger call");
            tokio::time::sleep(wait).await;
        }
    }

    async fn try_once(
        &self,
        method: &Method,
        url: &Url,
        body: Option<&Bytes>,
        timeout: Duration,
    ) -> Result<Answer, Error> {
        let mut req = self
            .inner
            .http
            .request(method.clone(), url.clone())
            .header(AUTHORIZATION, self.inner.auth.clone())
            .timeout(timeout);
        if let Some(body) = body {
            req = req
                .header(CONTENT_TYPE, "application/json")
                .body(body.clone());
        }
        let resp = req.send().await.map_err(Error::Transport)?;
        let status = resp.status();
        let replayed = resp
            .headers()
            .get(REPLAYED)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let retry_after = retry::retry_after(resp.headers());
        let body = resp.bytes().await.map_err(Error::Transport)?;
        if status.is_success() {
            Ok(Answer {
                status,
                replayed,
                body,
            })
        } else {
            Err(Error::from_problem(Problem::from_answer(
                status,
                retry_after,
                &body,
            )))
        }
    }

    pub(crate) async fn get<T: DeserializeOwned>(&self, url: Url) -> Result<T, Error> {
        self.call::<()>(Method::GET, url, None).await?.json()
    }

    pub(crate) async fn post<B: Serialize + ?Sized>(
        &self,
        url: Url,
        body: &B,
    ) -> Result<Answer, Error> {
        self.call(Method::POST, url, Some(body)).await
    }
}
