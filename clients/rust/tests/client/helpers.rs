//! A ledger spawned in-process for each test (its own database
//! `ledger_t_<uuid>` and its own key prefix in Redis database 2), clients of
//! it, and a small HTTP proxy that can lose or replace answers.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_ledger::clock::SystemClock;
use idempotency_ledger::config::Settings;
use idempotency_ledger::startup::{Application, BuildOptions};
use idempotency_ledger_client::{Client, RetryPolicy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

pub const PAYMENTS: &str = "dev-payments-key";
pub const REFUNDS: &str = "dev-refunds-key";
pub const ADMIN: &str = "dev-admin-key";
/// Biz types of the embedded configuration: one durable, one fast.
pub const DURABLE: &str = "order";
pub const FAST: &str = "like";

type Stop = Box<dyn FnOnce() -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

pub struct Ledger {
    pub url: String,
    stop: Option<Stop>,
    /// Stops the server at once (see `Drop`).
    stop_now: Box<dyn Fn() + Send + Sync>,
}

/// A test that ends without [`Ledger::stop`] (or panics) still stops its
/// server: actix's workers run on threads of their own and would otherwise
/// keep the ledger, and its pooled Postgres connections, for the rest of the
/// test process (the machine's Postgres allows 100 connections).
impl Drop for Ledger {
    fn drop(&mut self) {
        (self.stop_now)();
    }
}

/// The service on a random port, with a fresh database and Redis prefix.
pub async fn spawn_ledger() -> Ledger {
    spawn_ledger_with("").await
}

/// [`spawn_ledger`] with `extra` TOML tables over its settings (biz types'
/// processing leases, say).
pub async fn spawn_ledger_with(extra: &str) -> Ledger {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let toml = format!(
        r#"
server.listen = "127.0.0.1:0"
server.workers = 2
server.shutdown_timeout = "2s"
postgres.url = "postgres://postgres@127.0.0.1:5432/ledger_t_{id}"
postgres.pool_size = 4
postgres.admin_pool_size = 2
redis.url = "redis://127.0.0.1:6379/2"
redis.key_prefix = "ledger-t-{id}:"
redis.timeout = "2s"
tokens.provisional_ttl = "1s"
{extra}
"#
    );
    let settings = Settings::from_toml_over_defaults(&toml).expect("test settings are valid");
    let app = Application::build(
        settings,
        BuildOptions { migrate: true },
        Arc::new(SystemClock),
    )
    .await
    .expect("the ledger builds");
    let url = format!("http://127.0.0.1:{}", app.port());
    let handle = app.handle();
    let join = tokio::spawn(app.run_until_stopped());
    let now = handle.clone();
    Ledger {
        url,
        stop_now: Box::new(move || {
            // Sends the command at once; nothing waits for it.
            drop(now.stop(false));
        }),
        stop: Some(Box::new(move || {
            Box::pin(async move {
                handle.stop(true).await;
                let _ = join.await;
            })
        })),
    }
}

impl Ledger {
    /// A client of this ledger with the default retry policy.
    pub fn client(&self, api_key: &str) -> Client {
        Client::new(&self.url, api_key).expect("client")
    }

    /// Stops the service gracefully and waits for it.
    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            stop().await;
        }
    }
}

/// A retry policy for tests: quick waits, a short deadline.
pub fn quick_retries(max_attempts: usize) -> RetryPolicy {
    RetryPolicy::default()
        .max_attempts(max_attempts)
        .delays(Duration::from_millis(10), Duration::from_millis(50))
        .deadline(Duration::from_secs(10))
}

/// A payments client that calls through `proxy`.
pub fn client_via(proxy: &Proxy, policy: RetryPolicy) -> Client {
    Client::builder(&proxy.url, PAYMENTS)
        .retry(policy)
        .build()
        .expect("client")
}

/// Polls `f` until it returns `Some`, at most `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "condition not reached in {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the proxy does with one request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Forward it and return the answer.
    Forward,
    /// Forward it, read the whole answer (the ledger acted on it), then close
    /// the caller's connection without a byte: a lost answer.
    DropAnswer,
    /// Answer this status (503, 429) with `Retry-After` and the ledger's
    /// error body, without forwarding.
    Refuse { status: u16, retry_after: u64 },
}

/// One request as the proxy saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: Instant,
    /// `POST /v1/tokens/.../consume`
    pub line: String,
    pub body: Vec<u8>,
}

/// An HTTP/1.1 proxy in front of the ledger, one request per connection,
/// following a script of actions (then forwarding).
#[derive(Clone)]
pub struct Proxy {
    pub url: String,
    script: Arc<Mutex<VecDeque<Action>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Proxy {
    pub async fn start(upstream: &str, script: Vec<Action>) -> Proxy {
        let upstream = upstream
            .strip_prefix("http://")
            .expect("http upstream")
            .to_owned();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let proxy = Proxy {
            url,
            script: Arc::new(Mutex::new(script.into())),
            seen: Arc::new(Mutex::new(Vec::new())),
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let (p, upstream) = (p.clone(), upstream.clone());
                tokio::spawn(async move { p.serve(conn, &upstream).await });
            }
        });
        proxy
    }

    /// The requests seen so far.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("lock").clone()
    }

    async fn serve(&self, mut conn: TcpStream, upstream: &str) {
        let Some((head, body)) = read_request(&mut conn).await else {
            return;
        };
        let line = head.lines().next().unwrap_or_default().to_owned();
        self.seen.lock().expect("lock").push(Seen {
            at: Instant::now(),
            line: line
                .rsplit_once(' ')
                .map_or(line.clone(), |(l, _)| l.to_owned()),
            body: body.clone(),
        });
        let action = self
            .script
            .lock()
            .expect("lock")
            .pop_front()
            .unwrap_or(Action::Forward);
        match action {
            Action::Refuse {
                status,
                retry_after,
            } => {
                let body = format!(
                    r#"{{"error":"{}","message":"refused by the test proxy"}}"#,
                    if status == 429 {
                        "rate_limited"
                    } else {
                        "unavailable"
                    }
                );
                let answer = format!(
                    "HTTP/1.1 {status} Refused\r\ncontent-type: application/json\r\nretry-after: {retry_after}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(answer.as_bytes()).await;
            }
            Action::Forward | Action::DropAnswer => {
                let answer = forward(upstream, &head, &body).await;
                if matches!(action, Action::Forward) {
                    let _ = conn.write_all(&answer).await;
                }
            }
        }
        let _ = conn.shutdown().await;
    }
}

/// Reads one request: the head up to the blank line, then Content-Length bytes.
async fn read_request(conn: &mut TcpStream) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[end..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some((head, body))
}

/// Sends the request upstream on a fresh connection with `connection:
/// close`, and returns the whole answer (read to the end), marked `close`
/// for the caller too.
async fn forward(upstream: &str, head: &str, body: &[u8]) -> Vec<u8> {
    let mut lines = head.trim_end().lines();
    let mut out = String::new();
    out.push_str(lines.next().unwrap_or_default());
    out.push_str("\r\n");
    for l in lines.filter(|l| !l.to_ascii_lowercase().starts_with("connection:")) {
        out.push_str(l);
        out.push_str("\r\n");
    }
    out.push_str("connection: close\r\n\r\n");
    let mut up = TcpStream::connect(upstream)
        .await
        .expect("connect upstream");
    up.write_all(out.as_bytes()).await.expect("write upstream");
    up.write_all(body).await.expect("write upstream body");
    let mut answer = Vec::new();
    up.read_to_end(&mut answer).await.expect("read upstream");
    // The caller must not reuse this connection: say so after the status line.
    match answer.windows(2).position(|w| w == b"\r\n") {
        Some(i) => {
            let mut marked = answer[..i + 2].to_vec();
            marked.extend_from_slice(b"connection: close\r\n");
            marked.extend_from_slice(&answer[i + 2..]);
            marked
        }
        None => answer,
    }
}
