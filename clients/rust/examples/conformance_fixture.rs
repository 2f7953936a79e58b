//! The conformance fixture of the Rust `Idempotency-Key` layer: the small
//! app `conformance/run.py` drives every vector against (the contract is the
//! fixture contract of the conformance suite, shared with the Python and
//! Express middlewares).
//!
//! ```sh
//! LEDGER_URL=http://127.0.0.1:8080 PORT=3100 \
//!     cargo run -p idempotency-ledger-client --example conformance_fixture
//! ```
//!
//! Environment: `LEDGER_URL` and `PORT` (listens on 127.0.0.1:PORT) are
//! required; `LEDGER_API_KEY` (default `dev-payments-key`) and
//! `LEDGER_BIZ_TYPE` (default `order`) name the ledger's caller and the biz
//! type of the keys.
//!
//! Routes:
//! - `POST /charge`, `PATCH /charge` (behind the layer): count the run, then
//!   answer from the JSON body (absent or empty: `{}`): `delay_ms` sleeps
//!   first, `status` (default 201) is the status, `size` makes the body
//!   `{"n": N, "pad": "xxx…"}` of `size` x's, otherwise it is
//!   `{"n": N, "echo": <request body>}`; `X-Fixture: yes`, JSON. A body that
//!   is not JSON, or a field of the wrong type, answers 400 (counted too).
//! - `GET /charge` (the layer passes GET through): counts, `{"n": N}`.
//! - `GET /__health`, `GET /__invocations` (`{"count": N}`): outside the layer.
//!
//! The layer as configured here: a key is required (400 without), the
//! stored statuses are the default (below 500, except 408 and 429), a retry
//! while the first request runs answers 409 with `Retry-After: 1` at once
//! (the layer never waits), and the end user is the `X-User` header
//! (`scope_by`; absent: anonymous, unscoped).

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use idempotency_ledger_client::{Client, IdempotencyLayer};
use serde_json::{json, Value};

/// The largest `size` served (a vector asks for ~100 KiB at most).
const MAX_PAD: u64 = 8 * 1024 * 1024;
/// The longest `delay_ms` served.
const MAX_DELAY_MS: u64 = 60_000;

/// Handler invocations, behind the layer or not.
#[derive(Clone, Default)]
struct Invocations(Arc<AtomicU64>);

impl Invocations {
    fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn count(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

fn answer(status: StatusCode, body: Value) -> Response {
    let mut resp = (status, Json(body)).into_response();
    resp.headers_mut()
        .insert("x-fixture", HeaderValue::from_static("yes"));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn refuse(why: String) -> Response {
    answer(StatusCode::BAD_REQUEST, json!({ "fixture_error": why }))
}

/// A field of the request body: absent (or null), or a non-negative integer.
fn uint(req: &Value, name: &str) -> Result<Option<u64>, String> {
    match req.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("`{name}` must be a non-negative integer, not {v}")),
    }
}

async fn charge(State(runs): State<Invocations>, body: Bytes) -> Response {
    let n = runs.next();
    let req: Value = if body.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        match serde_json::from_slice(&body) {
            Ok(v) => v,
            Err(e) => return refuse(format!("the body is not JSON: {e}")),
        }
    };
    let (delay, status, size) = match (
        uint(&req, "delay_ms"),
        uint(&req, "status"),
        uint(&req, "size"),
    ) {
        (Ok(d), Ok(s), Ok(z)) => (d, s, z),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => return refuse(e),
    };
    let status = match status {
        None => StatusCode::CREATED,
        Some(s) => match u16::try_from(s).ok().filter(|s| (200..=599).contains(s)) {
            Some(s) => StatusCode::from_u16(s).expect("200..=599 is a status"),
            None => return refuse(format!("`status` must be 200 to 599, not {s}")),
        },
    };
    if let Some(ms) = delay {
        if ms > MAX_DELAY_MS {
            return refuse(format!("`delay_ms` must be at most {MAX_DELAY_MS}"));
        }
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    match size {
        Some(size) if size > MAX_PAD => refuse(format!("`size` must be at most {MAX_PAD}")),
        Some(size) => answer(status, json!({"n": n, "pad": "x".repeat(size as usize)})),
        None => answer(status, json!({"n": n, "echo": req})),
    }
}

async fn read_charge(State(runs): State<Invocations>) -> Response {
    answer(StatusCode::OK, json!({"n": runs.next()}))
}

async fn invocations(State(runs): State<Invocations>) -> Json<Value> {
    Json(json!({"count": runs.count()}))
}

fn required(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("the environment variable {name} is required"))
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// The fixture's layer: key required, default stored statuses, 409 at once,
/// scoped by `X-User`.
fn layer(ledger: Client, biz_type: String) -> IdempotencyLayer {
    IdempotencyLayer::new(ledger, biz_type)
        // The vectors check the draft's answer to a concurrent retry (409 at
        // once), as the Python and Express fixtures answer by default.
        .in_progress_wait(std::time::Duration::ZERO)
        .scope_by(|req| {
            req.headers()
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let ledger_url = required("LEDGER_URL")?;
    let port: u16 = required("PORT")?
        .parse()
        .context("PORT must be a port number")?;
    let ledger = Client::new(&ledger_url, &env_or("LEDGER_API_KEY", "dev-payments-key"))
        .context("LEDGER_URL")?;
    let runs = Invocations::default();
    let app = Router::new()
        .route("/charge", post(charge).patch(charge).get(read_charge))
        .layer(layer(ledger, env_or("LEDGER_BIZ_TYPE", "order")))
        .route("/__health", get(|| async { "ok" }))
        .route("/__invocations", get(invocations))
        .with_state(runs);
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    eprintln!("conformance fixture (Rust layer) on http://{addr}");
    axum::serve(listener, app).await?;
    Ok(())
}
