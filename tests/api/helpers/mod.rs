//! `spawn_app()`: the service in-process on a random port, with its own fresh
//! database and its own Redis key prefix, so tests run in parallel; the
//! helpers every test file shares (the CLI binary, polling, clocks), and in
//! [`procs`] private servers for the tests that stop, kill or stall one.
//! Whatever more than one test file uses lives here, once, by what it
//! serves: [`tiers`] (a test's own fast tier and reconciler), [`calls`]
//! (one-line route calls), [`scrape`] (`/metrics` samples), [`cluster`] (a
//! private cluster's masters and slot moves), [`fleet_answers`] (the fleet
//! tests' consumes), [`journal_entries`] (fast consumes' journal entries),
//! [`bounded`] (the fault tests' bounded calls), [`link`] (a proxy to stall
//! or cut). Test files never import each other.

use std::process::Output;
use std::sync::Arc;

use idempotency_ledger::clock::{Clock, SystemClock};
use idempotency_ledger::config::Settings;
use idempotency_ledger::issuance::filter::IssuedFilter;
use idempotency_ledger::ledger::Ledger;
use idempotency_ledger::startup::{Application, BuildOptions};
use idempotency_ledger::token::{Claims, SnowflakeId, TokenCodec};
use reqwest::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::task::JoinHandle;

pub mod bounded;
pub mod calls;
pub mod cluster;
pub mod fleet_answers;
pub mod journal_entries;
pub mod link;
pub mod procs;
pub mod schema;
pub mod scrape;
pub mod suite_pg;
pub mod tiers;

pub use procs::free_port;

/// Tests use Redis database 2 of the shared server (isolated further by a key
/// prefix per test), so whatever else lives in database 0 cannot slow a scan.
pub const REDIS_URL: &str = "redis://127.0.0.1:6379/2";
pub const PAYMENTS: &str = "dev-payments-key";
pub const REFUNDS: &str = "dev-refunds-key";
pub const ADMIN: &str = "dev-admin-key";
pub const AUDITOR: &str = "dev-auditor-key";

/// Tests that load the machine for their whole run (storms of concurrent
/// requests, a thousand waiters, the chaos run) hold this, so no two of them
/// run at once: the suite runs more tests than there are cores, and two
/// storms together can starve a third test's connection acquire past its
/// timeout. Tests that mostly wait run beside them.
pub async fn heavy() -> tokio::sync::MutexGuard<'static, ()> {
    static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    HEAVY.lock().await
}

/// Where one test's state lives; two apps given the same `Stores` share it.
#[derive(Debug, Clone)]
pub struct Stores {
    pub db_name: String,
    pub prefix: String,
    pub redis_url: String,
    /// `postgres://user@host:port` of the server holding `db_name`.
    pub pg_base: String,
    /// Extra TOML merged over the test defaults.
    pub extra: String,
}

impl Stores {
    pub fn fresh() -> Stores {
        let id = uuid::Uuid::new_v4().simple().to_string();
        Stores {
            db_name: format!("ledger_t_{id}"),
            prefix: format!("ledger-t-{id}:"),
            redis_url: REDIS_URL.to_owned(),
            pg_base: suite_pg::base(),
            extra: String::new(),
        }
    }
    pub fn with(mut self, extra: &str) -> Stores {
        self.extra.push('\n');
        self.extra.push_str(extra);
        self
    }
    pub fn redis(mut self, url: &str) -> Stores {
        self.redis_url = url.to_owned();
        self
    }
    /// Another Postgres server (a private one in the fault tests).
    pub fn postgres(mut self, base: &str) -> Stores {
        self.pg_base = base.to_owned();
        self
    }
    pub fn db_url(&self) -> String {
        format!("{}/{}", self.pg_base, self.db_name)
    }
    pub fn settings(&self) -> Settings {
        // Top-level keys must come before any table in TOML, and `extra` may
        // hold tables of its own: so the tables below are written as dotted
        // keys. `extra` is merged over them (it may override any of them).
        let base = format!(
            r#"
server.listen = "127.0.0.1:0"
server.workers = 2
server.shutdown_timeout = "2s"
postgres.url = "{db}"
postgres.pool_size = 8
postgres.admin_pool_size = 2
redis.url = "{redis}"
redis.key_prefix = "{prefix}"
redis.timeout = "2s"
tokens.provisional_ttl = "1s"
"#,
            db = self.db_url(),
            prefix = self.prefix,
            redis = self.redis_url,
        );
        let mut table: toml::Table = base.parse().expect("base test config");
        let extra: toml::Table = self.extra.parse().expect("extra test config is TOML");
        merge(&mut table, extra);
        let toml = toml::to_string(&table).expect("serializable");
        Settings::from_toml_over_defaults(&toml).expect("test settings are valid")
    }
}

/// Deep-merges `over` into `base` (tables key by key, anything else replaced).
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

pub struct TestApp {
    pub address: String,
    pub stores: Stores,
    pub http: reqwest::Client,
    pub ledger: Arc<Ledger>,
    /// The fleet-wide filter of issued token ids.
    pub filter: Arc<IssuedFilter>,
    handle: actix_web::dev::ServerHandle,
    join: Option<JoinHandle<anyhow::Result<()>>>,
}

/// A client ceiling no test's load reaches, for the tests that send more
/// than the default ceiling's burst (`limits.client_rate`, 2,000/s) as fast
/// as the service answers and are not about rate limits.
pub const UNLIMITED_CLIENTS: &str = "limits.client_rate = \"1000000/s\"";

pub async fn spawn_app() -> TestApp {
    spawn_app_on(Stores::fresh()).await
}

/// An app whose Postgres runs one consume, result or release statement at
/// a time (`consume_batches_in_flight = 1`), so that requests sent together
/// queue into batches; for the batching tests, which hold [`heavy`].
pub async fn spawn_app_batching() -> Arc<TestApp> {
    Arc::new(
        spawn_app_on(
            Stores::fresh()
                .with("postgres.consume_batches_in_flight = 1\npostgres.acquire_timeout = \"10s\""),
        )
        .await,
    )
}

pub async fn spawn_app_on(stores: Stores) -> TestApp {
    spawn_app_with_clock(stores, Arc::new(SystemClock)).await
}

/// The service on `stores` with its own notion of time: a test that waits
/// for the service's time to pass (token expiry, say) drives a
/// [`ManualClock`] instead of sleeping. Postgres `now()` and Redis's clock
/// still run in real time.
pub async fn spawn_app_with_clock(stores: Stores, clock: Arc<dyn Clock>) -> TestApp {
    let app = Application::build(stores.settings(), BuildOptions { migrate: true }, clock)
        .await
        .expect("the app builds");
    let address = format!("http://127.0.0.1:{}", app.port());
    let ledger = app.ledger().clone();
    let filter = app.filter().clone();
    let handle = app.handle();
    let join = tokio::spawn(app.run_until_stopped());
    TestApp {
        address,
        stores,
        http: reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .expect("client"),
        ledger,
        filter,
        handle,
        join: Some(join),
    }
}

/// A test that ends without [`TestApp::stop`] (or panics) still stops its
/// server: actix's workers run on threads of their own, outside the test's
/// runtime, and would otherwise keep the app, and every pooled Postgres
/// connection it holds, for the rest of the test process.
impl Drop for TestApp {
    fn drop(&mut self) {
        // Sends the command at once; nothing waits for it.
        drop(self.handle.stop(false));
    }
}

impl TestApp {
    /// Stops gracefully (flushing buffers) and waits for it.
    pub async fn stop(mut self) {
        self.handle.stop(true).await;
        if let Some(join) = self.join.take() {
            let _ = join.await;
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    /// The Prometheus text of `/metrics`.
    pub async fn metrics_text(&self) -> String {
        self.http
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics body")
    }

    pub async fn post(&self, key: &str, path: &str, body: &Value) -> Response {
        self.http
            .post(self.url(path))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .expect("request sent")
    }

    pub async fn get(&self, key: &str, path: &str) -> Response {
        self.http
            .get(self.url(path))
            .bearer_auth(key)
            .send()
            .await
            .expect("request sent")
    }

    /// Issues a token as `key`; panics unless 201.
    pub async fn issue(&self, key: &str, biz: &str, subject: &str) -> String {
        let r = self
            .post(
                key,
                "/v1/tokens",
                &json!({"biz_type": biz, "subject": subject}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::CREATED, "issue {biz}/{subject}");
        let body: Value = r.json().await.expect("json");
        body["token"].as_str().expect("token").to_owned()
    }

    pub async fn consume(&self, key: &str, token: &str, body: &Value) -> Response {
        self.post(key, &format!("/v1/tokens/{token}/consume"), body)
            .await
    }

    pub async fn pg(&self) -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.stores.db_url())
            .await
            .expect("test pool")
    }

    pub async fn redis(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.stores.redis_url.as_str())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("redis connection")
    }

    pub fn token_key(&self, token: &str) -> String {
        format!("{}tok:{{{}}}", self.stores.prefix, token)
    }

    /// Signs arbitrary claims with the development key (expired tokens etc.).
    pub fn sign(&self, biz: &str, id: u64, exp_unix: u32, client: &str, subject: &str) -> String {
        let codec = TokenCodec::new(self.stores.settings().tokens.signing_keys.clone());
        codec.sign(
            &Claims {
                biz_type: idempotency_ledger::domain::BizType::parse(biz).expect("biz"),
                id: SnowflakeId(id),
                exp: exp_unix,
            },
            client,
            subject,
        )
    }
}

/// Reads a JSON body and the replay header.
pub async fn answer(r: Response) -> (StatusCode, bool, Value) {
    let status = r.status();
    let replayed = r
        .headers()
        .get("idempotent-replayed")
        .map(|v| v == "true")
        .unwrap_or(false);
    let body = r.json::<Value>().await.unwrap_or(Value::Null);
    (status, replayed, body)
}

/// Polls `f` until it returns `Some`, at most `secs` seconds.
pub async fn eventually<T, F, Fut>(secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "condition not reached in {secs} s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Waits (at most `secs`) until the token hash at `key` holds state `want`
/// (`c` consumed, `i` issued, `p` provisional): Redis learns a durable
/// consume off the answer's path. Works on a standalone or cluster connection.
pub async fn wait_redis_state<C>(conn: &C, key: &str, want: &str, secs: u64)
where
    C: redis::aio::ConnectionLike + Clone + Send,
{
    eventually(secs, || {
        let mut conn = conn.clone();
        async move {
            let s: Option<String> = redis::cmd("HGET")
                .arg(key)
                .arg("s")
                .query_async(&mut conn)
                .await
                .ok()?;
            (s.as_deref() == Some(want)).then_some(())
        }
    })
    .await;
}

/// Writes a config file for the CLI binary pointing at this test's stores.
pub fn cli_config(stores: &Stores) -> tempfile::NamedTempFile {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(
        file.path(),
        format!(
            "[postgres]\nurl = \"{}\"\nadmin_pool_size = 2\n\n[redis]\nurl = \"{}\"\nkey_prefix = \"{}\"\ntimeout = \"2s\"\n",
            stores.db_url(),
            stores.redis_url,
            stores.prefix
        ),
    )
    .expect("config written");
    file
}

/// Runs the binary with `--config` and `args`; stdout is a pipe (not a terminal).
pub async fn cli(config: &tempfile::NamedTempFile, args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"))
        .arg("--config")
        .arg(config.path())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .expect("the binary runs")
}

/// A connection to the shared test Redis (`REDIS_URL`); keys are the test's
/// to prefix.
pub async fn redis_conn() -> redis::aio::MultiplexedConnection {
    redis::Client::open(REDIS_URL)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection")
}

/// Wall-clock milliseconds, for tokens and records a test builds by hand.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A fixed instant `ms` milliseconds after a base in the future, for records
/// and journal entries a test builds by hand.
pub fn at(ms: i64) -> chrono::DateTime<chrono::Utc> {
    use chrono::TimeZone;
    chrono::Utc
        .timestamp_millis_opt(1_795_000_000_000 + ms)
        .unwrap()
}
