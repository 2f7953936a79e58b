//! A tower [`Layer`] implementing the `Idempotency-Key` header
//! (draft-ietf-httpapi-idempotency-key-header) on top of the ledger's
//! client-supplied keys (`/v1/keys`), usable from axum or any tower stack.
//!
//! # Scope keys by your end user
//! Keys belong to the API key the layer's [`Client`] uses: without a scope,
//! **every end user of your service shares one key space**, and two users
//! sending the same key and body get one stored response (the second user is
//! served the first user's answer). Tell the layer who the user is:
//!
//! ```no_run
//! # use idempotency_ledger_client::{Client, IdempotencyLayer};
//! # fn user_of(_: &http::Request<()>) -> Option<String> { None }
//! # let ledger = Client::new("http://127.0.0.1:8080", "dev-payments-key").unwrap();
//! let layer = IdempotencyLayer::new(ledger, "order")
//!     // The authenticated account (from a header your auth proxy sets, or
//!     // an extension your auth middleware inserted); `None`: unscoped.
//!     .scope_by(|req: &http::Request<()>| user_of(req));
//! ```
//!
//! The hook sees the request head (method, URI, headers, extensions; the
//! body is `()`). Its answer is hashed into the key in the ledger
//! (`<32 hex digits of SHA-256 of the scope>:<key>`, or
//! `<scope digest>#<SHA-256 of the key>` when that would pass the ledger's
//! 255 characters), so users' keys never meet and every key of 1 to 255
//! characters works whatever the scope. [`IdempotencyLayer::scope`] is the
//! same hook over [`http::request::Parts`]. A layer with no scope hook logs a
//! warning (`tracing::warn!`) once, when it wraps its first service; when one
//! key space is what you want (one end user, or keys that are unguessable
//! secrets checked elsewhere), say so with [`IdempotencyLayer::unscoped`].
//!
//! # What the layer answers
//! For a request with an unsafe method (anything but GET, HEAD, OPTIONS and
//! TRACE, which pass through untouched):
//!
//! | situation | answer | problem `code` |
//! |---|---|---|
//! | first request with a key | the handler runs; its response is stored (see below) and returned | |
//! | a retry with the same key and payload, after the first finished | the stored response, with `Idempotent-Replayed: true`; the handler does not run | |
//! | a retry while the first is still running | it waits for the first (up to [`IdempotencyLayer::in_progress_wait`], default 3 s) and gets its stored response, replayed; if the first is still running then, 409 with `Retry-After`; the handler does not run | `idempotency_key_in_use` |
//! | a retry after the first ran past its biz type's processing lease with no stored response | 409; the handler does not run; an operator resolves it | `idempotency_key_uncertain` |
//! | the same key with another payload (method, path with query, or body) | 422 | `idempotency_key_reused` |
//! | no key, where the layer requires one (the default) | 400 | `idempotency_key_missing` |
//! | a key that is not 1 to 255 printable ASCII characters (or a repeated header) | 400 | `idempotency_key_invalid` |
//! | a body over the limit (default 1 MiB) | 413 | `payload_too_large` |
//! | the ledger cannot be reached | 503 with `Retry-After`; the handler does not run | `ledger_unavailable` |
//! | a request body that cannot be read | 400 | `request_body_unreadable` |
//! | the ledger refuses the layer's own calls (API key, grants, biz type) | 500; the handler does not run | `ledger_error` |
//! | the handler answered but its response body failed | 500; the key stays consumed | `response_failed` |
//! | a stored result that is not a response of this layer | 500 | `stored_response_unreadable` |
//! | the runtime shuts down while the handler runs | 503 | `shutting_down` |
//!
//! # Problem details
//! Errors of the layer itself are `application/problem+json` (RFC 9457):
//!
//! ```json
//! {"type": "https://github.com/idempotency-ledger/idempotency-ledger/blob/main/docs/integration.md#idempotency_key_in_use",
//!  "code": "idempotency_key_in_use", "title": "...", "status": 409, "detail": "..."}
//! ```
//!
//! `code` is stable across versions (the constants of [`codes`]); match on
//! it, never on `title` or `detail`. `type` is [`PROBLEM_TYPE_BASE`] followed
//! by the code: the section of the integration guide that explains it.
//!
//! # Which responses are stored
//! By default every response below 500 (2xx, 3xx, 4xx) except 408 and 429 is
//! stored as the key's result ([`IdempotencyLayer::store_status`] chooses
//! otherwise), and replayed to every later retry: its status, the headers
//! named by [`IdempotencyLayer::store_header`] (by default `content-type`,
//! `content-language`, `location`, `etag`, `last-modified`), and its body (as
//! text, or base64 when it is not UTF-8).
//!
//! A response whose body does not fit the ledger's 64 KiB results (about
//! 60 KiB of body; less when it must be escaped or base64-encoded) is stored
//! without its body: the first caller gets the whole response; its retries
//! get the stored status and headers, an empty body, and the header
//! `Idempotent-Body-Omitted: true` (as well as `Idempotent-Replayed: true`).
//! A client that sees it knows the request ran and must fetch the resource
//! another way (its `Location`, say). A warning is logged when it happens.
//!
//! A response whose status is not stored (by default a 5xx, a 408 or 429), an
//! error of the inner service, or a handler that panics releases the key:
//! the next retry runs the handler again. Return such a status only when the
//! handler did nothing that must not happen twice.
//!
//! The handler runs in its own task: a client that disconnects does not
//! cancel it halfway, and its response is still stored for the retry. A
//! process that dies while a handler runs leaves its key answering 409: once
//! you know what happened, release it ([`Client::release_key`]) or record a
//! response for it.

use std::any::Any;
use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

pub mod codes;
mod key;
mod stored;

use key::{idempotency_key, is_safe, ledger_key};
use stored::{replay, Stored};

use base64::Engine as _;
use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use serde::{Deserialize, Serialize};
use tower::{Layer, Service};

use crate::client::{Client, REPLAYED};
use crate::error::Error;
use crate::fingerprint::{request_fingerprint, short_digest};
use crate::keys::KeyConsumeRequest;
use crate::outcome::ConsumeOutcome;

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// The header on a replay whose stored response had a body too large to
/// store: the replay has the status and headers, and an empty body.
pub const BODY_OMITTED: &str = "idempotent-body-omitted";
/// The start of every problem `type` of the layer: the code follows, as the
/// anchor of its section in the integration guide.
pub const PROBLEM_TYPE_BASE: &str =
    "https://github.com/idempotency-ledger/idempotency-ledger/blob/main/docs/integration.md#";
/// The ledger's limit on a key.
const MAX_KEY: usize = 255;
/// A stored response larger than this (as JSON) is stored without its body:
/// the ledger takes results of at most 64 KiB with the request around them.
const MAX_STORED: usize = 60 * 1024;

/// The error of a [`BoxBody`].
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The request and response body of [`Idempotency`]: any body, boxed.
///
/// A struct rather than an alias of `UnsyncBoxBody<Bytes, BoxError>`: a
/// trait object's lifetime inside the service's request type defeats rustc's
/// `Send` inference for the futures that hold it.
pub struct BoxBody(UnsyncBoxBody<Bytes, BoxError>);

impl Body for BoxBody {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.get_mut().0).poll_frame(cx)
    }
    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }
    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

impl std::fmt::Debug for BoxBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BoxBody")
    }
}

type PartsScope = Arc<dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync>;
type RequestScope = Arc<dyn Fn(&Request<()>) -> Option<String> + Send + Sync>;
type StoreStatus = Arc<dyn Fn(StatusCode) -> bool + Send + Sync>;

/// Whose keys a request's key is among.
#[derive(Clone)]
enum Scoping {
    /// Nobody chose: one key space, and a warning.
    Unset,
    /// [`IdempotencyLayer::unscoped`]: one key space, on purpose.
    Shared,
    Parts(PartsScope),
    Request(RequestScope),
}

impl Scoping {
    /// The request's scope; the head goes in and comes back out (the
    /// request hook sees it as a `Request<()>` without a copy).
    fn of(&self, parts: http::request::Parts) -> (http::request::Parts, Option<String>) {
        match self {
            Scoping::Unset | Scoping::Shared => (parts, None),
            Scoping::Parts(f) => {
                let scope = f(&parts);
                (parts, scope)
            }
            Scoping::Request(f) => {
                let head = Request::from_parts(parts, ());
                let scope = f(&head);
                (head.into_parts().0, scope)
            }
        }
    }
}

/// The default of [`IdempotencyLayer::store_status`]: below 500, except 408
/// and 429.
pub fn stored_by_default(status: StatusCode) -> bool {
    !(status.is_server_error()
        || status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS)
}

#[derive(Clone)]
struct Config {
    client: Client,
    biz_type: String,
    required: bool,
    stored_headers: Vec<HeaderName>,
    in_progress_retry_after: Duration,
    in_progress_wait: Duration,
    max_request_body: usize,
    scoping: Scoping,
    store_status: StoreStatus,
}

/// The `Idempotency-Key` layer; see the [module docs](self).
#[derive(Clone)]
pub struct IdempotencyLayer {
    config: Arc<Config>,
    /// Set once the missing-scope warning is logged (shared by clones).
    warned: Arc<AtomicBool>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("biz_type", &self.config.biz_type)
            .field("required", &self.config.required)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// Keys of `biz_type` (a biz type granted to the client's API key;
    /// durable ones decide in Postgres). A key is required by default.
    pub fn new(client: Client, biz_type: impl Into<String>) -> IdempotencyLayer {
        IdempotencyLayer {
            config: Arc::new(Config {
                client,
                biz_type: biz_type.into(),
                required: true,
                stored_headers: [
                    "content-type",
                    "content-language",
                    "location",
                    "etag",
                    "last-modified",
                ]
                .into_iter()
                .map(HeaderName::from_static)
                .collect(),
                in_progress_retry_after: Duration::from_secs(1),
                in_progress_wait: Duration::from_secs(3),
                max_request_body: 1024 * 1024,
                scoping: Scoping::Unset,
                store_status: Arc::new(stored_by_default),
            }),
            warned: Arc::new(AtomicBool::new(false)),
        }
    }

    fn with(mut self, f: impl FnOnce(&mut Config)) -> IdempotencyLayer {
        f(Arc::make_mut(&mut self.config));
        self
    }

    /// Requests without a key pass through to the handler unguarded
    /// (instead of 400).
    pub fn optional(self) -> IdempotencyLayer {
        self.with(|c| c.required = false)
    }

    /// Also store and replay this response header.
    pub fn store_header(self, name: HeaderName) -> IdempotencyLayer {
        self.with(|c| c.stored_headers.push(name))
    }

    /// The `Retry-After` of a 409 (default 1 s; whole seconds, at least 1).
    pub fn in_progress_retry_after(self, after: Duration) -> IdempotencyLayer {
        self.with(|c| c.in_progress_retry_after = after)
    }

    /// How long a retry that arrives while the first request with its key
    /// runs waits for it (default 3 s, at most 10 s; zero: not at all). The
    /// wait is held on the ledger (`wait_ms`): it ends with the first
    /// request's stored response (replayed), its release (this retry then
    /// runs the handler), or, when the time is up, 409
    /// `idempotency_key_in_use`.
    pub fn in_progress_wait(self, wait: Duration) -> IdempotencyLayer {
        self.with(|c| c.in_progress_wait = wait.min(crate::tokens::MAX_WAIT))
    }

    /// The largest request body read (default 1 MiB); larger is 413.
    pub fn max_request_body(self, bytes: usize) -> IdempotencyLayer {
        self.with(|c| c.max_request_body = bytes)
    }

    /// Scopes keys by what `scope` returns for a request's head (the
    /// authenticated end user, say): the same key of two scopes are two keys,
    /// and one user's key never replays another user's response. `None`
    /// leaves that request's key unscoped (shared by every request whose
    /// scope is `None`, anonymous callers say). The scope is hashed into the
    /// ledger's key: keys keep their 1 to 255 characters whatever the scope.
    ///
    /// ```no_run
    /// # use idempotency_ledger_client::{Client, IdempotencyLayer};
    /// # let ledger = Client::new("http://127.0.0.1:8080", "dev-payments-key").unwrap();
    /// // Behind an auth proxy that sets `X-User` (and strips it from callers):
    /// let layer = IdempotencyLayer::new(ledger, "order").scope_by(|req| {
    ///     req.headers().get("x-user")?.to_str().ok().map(str::to_owned)
    /// });
    /// ```
    pub fn scope_by<F>(self, scope: F) -> IdempotencyLayer
    where
        F: Fn(&Request<()>) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.scoping = Scoping::Request(Arc::new(scope)))
    }

    /// [`scope_by`](Self::scope_by) over the request's [`http::request::Parts`].
    pub fn scope<F>(self, scope: F) -> IdempotencyLayer
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        self.with(|c| c.scoping = Scoping::Parts(Arc::new(scope)))
    }

    /// One key space for every end user, on purpose: no scope, and no
    /// warning. Two users sending the same key and payload share one stored
    /// response; choose it only when that cannot happen or does not matter.
    pub fn unscoped(self) -> IdempotencyLayer {
        self.with(|c| c.scoping = Scoping::Shared)
    }

    /// Which statuses are stored as the key's result (and replayed to every
    /// retry); the key of any other status is released, and its retry runs
    /// the handler again. Default: [`stored_by_default`] (below 500, except
    /// 408 and 429). Storing a 5xx means a retry never runs the handler
    /// again after a failure; not storing a 4xx means the handler runs again
    /// for each retry of a refused request.
    pub fn store_status<F>(self, stored: F) -> IdempotencyLayer
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.with(|c| c.store_status = Arc::new(stored))
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = Idempotency<S>;
    fn layer(&self, inner: S) -> Idempotency<S> {
        if matches!(self.config.scoping, Scoping::Unset)
            && !self.warned.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                biz_type = %self.config.biz_type,
                "IdempotencyLayer has no scope: Idempotency-Key values are shared across all \
                 end users of this service, and one user's key can replay another user's stored \
                 response. Call .scope_by(..) with the authenticated user, or .unscoped() to \
                 make the shared key space explicit."
            );
        }
        Idempotency {
            inner,
            config: self.config.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around a handler.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for Idempotency<S>
where
    S: Service<Request<BoxBody>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<BoxBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The clone that was polled ready is the one that serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(handle(self.config.clone(), inner, req))
    }
}

fn boxed<B>(body: B) -> BoxBody
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    BoxBody(body.map_err(Into::into).boxed_unsync())
}

fn full(bytes: Bytes) -> BoxBody {
    BoxBody(
        Full::new(bytes)
            .map_err(|never: Infallible| match never {})
            .boxed_unsync(),
    )
}

/// An `application/problem+json` answer of the layer itself, with its
/// stable `code` and a `type` linking to the code's documentation.
fn problem(status: StatusCode, code: &str, title: &str, detail: &str) -> Response<BoxBody> {
    let body = serde_json::json!({
        "type": format!("{PROBLEM_TYPE_BASE}{code}"),
        "code": code,
        "title": title,
        "status": status.as_u16(),
        "detail": detail,
    });
    let mut resp = Response::new(full(Bytes::from(body.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    resp
}

fn with_retry_after(mut resp: Response<BoxBody>, after: Duration) -> Response<BoxBody> {
    resp.headers_mut()
        .insert(RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
    resp
}

async fn handle<S, ReqB, ResB>(
    config: Arc<Config>,
    inner: S,
    req: Request<ReqB>,
) -> Result<Response<BoxBody>, S::Error>
where
    S: Service<Request<BoxBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqB: Body<Data = Bytes> + Send + 'static,
    ReqB::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let passthrough = |mut inner: S, req: Request<ReqB>| async move {
        inner.call(req.map(boxed)).await.map(|r| r.map(boxed))
    };
    if is_safe(req.method()) {
        return passthrough(inner, req).await;
    }
    let key = match idempotency_key(req.headers()) {
        Ok(Some(key)) => key,
        Ok(None) if !config.required => return passthrough(inner, req).await,
        Ok(None) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                codes::IDEMPOTENCY_KEY_MISSING,
                "Idempotency-Key is missing",
                "This operation requires an Idempotency-Key header.",
            ))
        }
        Err(why) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                codes::IDEMPOTENCY_KEY_INVALID,
                "Idempotency-Key is invalid",
                &why,
            ))
        }
    };
    let (parts, body) = req.into_parts();
    let (parts, scope) = config.scoping.of(parts);
    let body = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            return Ok(problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                "Request body too large",
                &format!("At most {} bytes.", config.max_request_body),
            ))
        }
        Err(_) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                codes::REQUEST_BODY_UNREADABLE,
                "Request body unreadable",
                "The request body could not be read.",
            ))
        }
    };
    let key = match ledger_key(scope.as_deref(), &key) {
        Ok(key) => key,
        Err(why) => {
            return Ok(problem(
                StatusCode::BAD_REQUEST,
                codes::IDEMPOTENCY_KEY_INVALID,
                "Idempotency-Key is invalid",
                &why,
            ))
        }
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut consume = KeyConsumeRequest::new(&config.biz_type, &key)
        .with_fingerprint(request_fingerprint(parts.method.as_str(), path, &body));
    if !config.in_progress_wait.is_zero() {
        consume = consume.with_wait(config.in_progress_wait);
    }
    match config.client.consume_key(&consume).await {
        Ok(ConsumeOutcome::Won { .. }) => {
            let won = Won {
                request_id: consume.request_id().to_owned(),
                key,
            };
            run_once(config, inner, Request::from_parts(parts, full(body)), won).await
        }
        Ok(ConsumeOutcome::InProgress { .. }) => Ok(with_retry_after(
            problem(
                StatusCode::CONFLICT,
                codes::IDEMPOTENCY_KEY_IN_USE,
                "A request is outstanding for this Idempotency-Key",
                "The first request with this key has not finished yet; retry later.",
            ),
            config.in_progress_retry_after,
        )),
        Ok(ConsumeOutcome::Uncertain { .. }) => Ok(problem(
            StatusCode::CONFLICT,
            codes::IDEMPOTENCY_KEY_UNCERTAIN,
            "The outcome of the first request with this Idempotency-Key is unknown",
            "The first request ran past its processing lease without a stored response; it is being checked. Do not retry with a new key until you know.",
        )),
        Ok(ConsumeOutcome::Completed { result, .. }) => Ok(replay(result)),
        Err(Error::FingerprintMismatch(_)) => Ok(problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            codes::IDEMPOTENCY_KEY_REUSED,
            "Idempotency-Key is already used",
            "This key was used for a request with another method, path or body.",
        )),
        Err(e) if e.is_retryable() => {
            tracing::warn!(error = %e, "idempotency ledger unreachable: request refused");
            Ok(with_retry_after(
                problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    codes::LEDGER_UNAVAILABLE,
                    "Idempotency ledger unavailable",
                    "The request was not run; retry it with the same Idempotency-Key.",
                ),
                e.retry_after().unwrap_or(Duration::from_secs(1)),
            ))
        }
        Err(e) => {
            tracing::error!(error = %e, "the idempotency ledger refused the key");
            Ok(problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::LEDGER_ERROR,
                "Idempotency check failed",
                "The request was not run.",
            ))
        }
    }
}

type Panic = Box<dyn Any + Send>;

/// The key this request's consume won, and that consume's `request_id`:
/// its response is stored (or the key released) only while that consume
/// holds the key, never onto a later attempt's after a release.
struct Won {
    key: String,
    request_id: String,
}

/// Runs the handler in its own task (a dropped connection does not cancel it
/// halfway), then stores its response or releases the key.
async fn run_once<S, ResB>(
    config: Arc<Config>,
    mut inner: S,
    req: Request<BoxBody>,
    key: Won,
) -> Result<Response<BoxBody>, S::Error>
where
    S: Service<Request<BoxBody>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    spawn_settled(config, inner.call(req), key).await
}

/// [`run_once`] over plain type parameters: naming the service's associated
/// types inside the spawned block trips rustc's `Send` inference.
async fn spawn_settled<Fut, ResB, E>(
    config: Arc<Config>,
    handler: Fut,
    key: Won,
) -> Result<Response<BoxBody>, E>
where
    Fut: Future<Output = Result<Response<ResB>, E>> + Send + 'static,
    E: Send + 'static,
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let task = tokio::spawn(async move {
        match CatchUnwind(Box::pin(handler)).await {
            Ok(Ok(resp)) => Ok(Ok(settle(&config, &key, resp).await)),
            Ok(Err(e)) => {
                release(&config, &key, "the inner service failed").await;
                Ok(Err(e))
            }
            Err(panic) => {
                release(&config, &key, "the handler panicked").await;
                Err::<Result<_, E>, Panic>(panic)
            }
        }
    });
    match task.await {
        Ok(Ok(answer)) => answer,
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        // The runtime is shutting down.
        Err(_) => Ok(problem(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::SHUTTING_DOWN,
            "Shutting down",
            "The request was interrupted.",
        )),
    }
}

async fn release(config: &Config, key: &Won, why: &str) {
    if let Err(e) = config
        .client
        .release_key_of(&config.biz_type, &key.key, Some(&key.request_id))
        .await
    {
        tracing::warn!(error = %e, why, "could not release an idempotency key; retries answer 409 until it is released");
    }
}

/// Stores a response whose status is stored (by default below 500, not
/// 408 or 429) as the key's result; releases the key for the others.
async fn settle<ResB>(config: &Config, key: &Won, resp: Response<ResB>) -> Response<BoxBody>
where
    ResB: Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let status = resp.status();
    if !(config.store_status)(status) {
        release(
            config,
            key,
            "the handler answered a status that is not stored",
        )
        .await;
        return resp.map(boxed);
    }
    let (parts, body) = resp.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => {
            // The handler ran (it answered below 500) but its body broke: the
            // key stays consumed, since its side effects may have happened.
            let e: BoxError = e.into();
            tracing::error!(error = %e, "the handler's response body failed; the key stays consumed");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::RESPONSE_FAILED,
                "Response failed",
                "The request ran but its response could not be produced.",
            );
        }
    };
    let stored = Stored::of(status, &parts.headers, &config.stored_headers, &body);
    if stored.body_omitted {
        tracing::warn!(
            body_bytes = body.len(),
            "a response body is too large for the ledger: its retries replay the status and \
             headers with Idempotent-Body-Omitted: true and an empty body"
        );
    }
    if let Err(e) = config
        .client
        .record_key_result_of(&config.biz_type, &key.key, Some(&key.request_id), &stored)
        .await
    {
        tracing::warn!(error = %e, "could not store the response; retries answer 409 until it is stored");
    }
    Response::from_parts(parts, full(body))
}

/// Turns a panic while polling the handler into a value, so the key can be
/// released before the panic goes on.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = Result<F::Output, Panic>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let fut = self.get_mut().0.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| fut.poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}

#[cfg(test)]
mod tests;
