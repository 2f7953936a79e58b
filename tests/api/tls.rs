//! TLS to both tiers, against private servers that speak only TLS: a
//! Postgres with `ssl = on` and a `hostssl`-only `pg_hba.conf`, and a
//! `redis-server --port 0 --tls-port`, and a 3-master Redis Cluster with TLS
//! only (`--tls-cluster`), all with certificates from a CA made here (rcgen).
//! `verify-full` serves and consumes end to end, on the cluster too; a
//! certificate from another CA stops the start naming the setting;
//! `verify-ca` checks the chain but not the name; plaintext is refused by the
//! servers.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idempotency_ledger::startup::{Application, BuildOptions};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use reqwest::StatusCode;
use serde_json::json;
use tempfile::TempDir;

use crate::helpers::calls::consumed_in_postgres;
use crate::helpers::procs::PgProc;
use crate::helpers::*;

/// A CA, a second unrelated CA, and server certificates signed by the first.
struct Pki {
    dir: TempDir,
    ca: PathBuf,
    other_ca: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
}

fn ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("ca")
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("tempdir");
        let issuer = ca("ledger test ca");
        let other = ca("another ca");
        let ca = dir.path().join("ca.pem");
        let other_ca = dir.path().join("other-ca.pem");
        std::fs::write(&ca, issuer.pem()).expect("ca written");
        std::fs::write(&other_ca, other.pem()).expect("ca written");
        Pki {
            dir,
            ca,
            other_ca,
            issuer,
        }
    }

    /// A server certificate and key for `names` (host names or IPs), as
    /// `<stem>.crt` and `<stem>.key` in `dir`.
    fn server_cert(&self, dir: &Path, stem: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("params");
        params.distinguished_name.push(DnType::CommonName, "server");
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let (c, k) = (
            dir.join(format!("{stem}.crt")),
            dir.join(format!("{stem}.key")),
        );
        std::fs::write(&c, cert.pem()).expect("cert written");
        std::fs::write(&k, key.serialize_pem()).expect("key written");
        (c, k)
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// A private Postgres that accepts only TLS connections over TCP (the
/// socket stays open for `pg_ctl`), with a certificate for `names`.
async fn tls_postgres(pki: &Pki, names: &[&str]) -> PgProc {
    let pg = PgProc::start();
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!("{}/postgres?sslmode=disable", pg.base()))
        .await
        .expect("plaintext before the switch");
    let data: String = sqlx::query_scalar("SHOW data_directory")
        .fetch_one(&admin)
        .await
        .expect("data directory");
    let data = PathBuf::from(data);
    install_server_cert(pki, &data, names);
    for statement in [
        "ALTER SYSTEM SET ssl = on",
        "ALTER SYSTEM SET ssl_cert_file = 'server.crt'",
        "ALTER SYSTEM SET ssl_key_file = 'server.key'",
    ] {
        sqlx::raw_sql(statement)
            .execute(&admin)
            .await
            .expect(statement);
    }
    std::fs::write(
        data.join("pg_hba.conf"),
        "local all all trust\nhostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
    )
    .expect("pg_hba.conf");
    reload(&admin).await;
    admin.close().await;
    pg
}

/// Writes `server.crt` / `server.key` for `names` into the data directory,
/// owned by the server's user, the key private (Postgres insists).
fn install_server_cert(pki: &Pki, data: &Path, names: &[&str]) {
    let (cert, key) = pki.server_cert(pki.dir.path(), "pg", names);
    std::fs::copy(cert, data.join("server.crt")).expect("cert copied");
    std::fs::copy(key, data.join("server.key")).expect("key copied");
    if running_as_root() {
        let ok = Command::new("chown")
            .arg("postgres:postgres")
            .arg(data.join("server.crt"))
            .arg(data.join("server.key"))
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(ok, "chown");
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        data.join("server.key"),
        std::fs::Permissions::from_mode(0o600),
    )
    .expect("chmod");
}

/// `pg_reload_conf()`, then waits until a new TLS connection is accepted
/// (the postmaster rereads the files asynchronously).
async fn reload(admin: &sqlx::PgPool) {
    let port = admin.connect_options().get_port();
    let _: bool = sqlx::query_scalar("SELECT pg_reload_conf()")
        .fetch_one(admin)
        .await
        .expect("reload");
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres?sslmode=require");
    eventually(20, || {
        let url = url.clone();
        async move {
            let opts: sqlx::postgres::PgConnectOptions = url.parse().ok()?;
            let mut conn = sqlx::ConnectOptions::connect(&opts).await.ok()?;
            let ssl: bool =
                sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
                    .fetch_one(&mut conn)
                    .await
                    .ok()?;
            ssl.then_some(())
        }
    })
    .await;
}

/// A private redis-server listening only with TLS.
struct TlsRedis {
    port: u16,
    child: Child,
    _dir: TempDir,
}

impl TlsRedis {
    async fn start(pki: &Pki) -> TlsRedis {
        let dir = tempfile::tempdir().expect("tempdir");
        let (cert, key) = pki.server_cert(dir.path(), "redis", &["localhost", "127.0.0.1"]);
        let port = free_port();
        let child = Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .arg("--tls-cert-file")
            .arg(&cert)
            .arg("--tls-key-file")
            .arg(&key)
            .arg("--tls-ca-cert-file")
            .arg(&pki.ca)
            .args(["--tls-auth-clients", "no", "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let r = TlsRedis {
            port,
            child,
            _dir: dir,
        };
        let url = r.url();
        let ca = std::fs::read(&pki.ca).expect("ca");
        eventually(10, || {
            let (url, ca) = (url.clone(), ca.clone());
            async move { tls_ping(&url, ca).await.ok() }
        })
        .await;
        r
    }

    fn url(&self) -> String {
        format!("rediss://127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A private Redis Cluster of 3 masters that speaks only TLS, to clients
/// and on its bus (`--tls-cluster`), each node with a certificate for
/// `localhost` and `127.0.0.1` (the nodes announce themselves by IP, so the
/// client verifies an IP SAN).
struct TlsCluster {
    ports: Vec<u16>,
    ca: PathBuf,
    children: Vec<Child>,
    _dirs: Vec<TempDir>,
}

impl TlsCluster {
    fn start(pki: &Pki) -> TlsCluster {
        let mut c = TlsCluster {
            ports: Vec::new(),
            ca: pki.ca.clone(),
            children: Vec::new(),
            _dirs: Vec::new(),
        };
        for _ in 0..3 {
            let dir = tempfile::tempdir().expect("tempdir");
            let (cert, key) = pki.server_cert(dir.path(), "node", &["localhost", "127.0.0.1"]);
            let port = free_port();
            let child = Command::new("redis-server")
                .args(["--port", "0", "--tls-port", &port.to_string()])
                .args(["--tls-cluster", "yes", "--tls-replication", "yes"])
                .arg("--tls-cert-file")
                .arg(&cert)
                .arg("--tls-key-file")
                .arg(&key)
                .arg("--tls-ca-cert-file")
                .arg(&pki.ca)
                .args(["--tls-auth-clients", "no", "--bind", "127.0.0.1"])
                .args([
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                ])
                .args(["--cluster-node-timeout", "1000"])
                .args(["--save", "", "--appendonly", "no", "--daemonize", "no"])
                .arg("--dir")
                .arg(dir.path())
                .arg("--logfile")
                .arg(dir.path().join("redis.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server starts");
            c.ports.push(port);
            c.children.push(child);
            c._dirs.push(dir);
        }
        for &port in &c.ports {
            c.wait(port, "PING", |out| out.contains("PONG"), &["ping"]);
        }
        let addrs: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        let out = c.cli_output(
            Command::new("redis-cli")
                .arg("--tls")
                .arg("--cacert")
                .arg(&c.ca)
                .args(["--cluster", "create"])
                .args(&addrs)
                .args(["--cluster-replicas", "0", "--cluster-yes"]),
        );
        assert!(out.contains("All 16384 slots covered"), "{out}");
        for &port in &c.ports {
            c.wait(
                port,
                "cluster state ok",
                |out| out.contains("cluster_state:ok") && out.contains("cluster_slots_ok:16384"),
                &["cluster", "info"],
            );
        }
        c
    }

    fn cli_output(&self, cmd: &mut Command) -> String {
        let out = cmd.stdin(Stdio::null()).output().expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    }

    /// `redis-cli --tls --cacert CA -p PORT args...`.
    fn cli(&self, port: u16, args: &[&str]) -> String {
        self.cli_output(
            Command::new("redis-cli")
                .arg("--tls")
                .arg("--cacert")
                .arg(&self.ca)
                .arg("-p")
                .arg(port.to_string())
                .args(args),
        )
    }

    fn wait(&self, port: u16, what: &str, ok: impl Fn(&str) -> bool, args: &[&str]) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !ok(&self.cli(port, args)) {
            assert!(
                std::time::Instant::now() < deadline,
                "TLS cluster node {port}: {what} not reached in 30 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis.cluster_nodes` with `rediss://` seeds.
    fn config_line(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("\"rediss://127.0.0.1:{p}\""))
            .collect();
        format!("redis.cluster_nodes = [{}]", nodes.join(", "))
    }
}

impl Drop for TlsCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn tls_client(
    url: &str,
    ca: Vec<u8>,
) -> redis::RedisResult<redis::aio::MultiplexedConnection> {
    let client = redis::Client::build_with_tls(
        url,
        redis::TlsCertificates {
            client_tls: None,
            root_cert: Some(ca),
        },
    )?;
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(2)));
    client
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

async fn tls_ping(url: &str, ca: Vec<u8>) -> redis::RedisResult<()> {
    let mut c = tls_client(url, ca).await?;
    redis::cmd("PING").query_async::<()>(&mut c).await
}

/// Test settings for a database on `pg` reached with `pg_query`, and Redis
/// at `redis_url` with `ca_file`.
fn stores(pg: &PgProc, pg_query: &str, redis_url: &str, ca_file: Option<&Path>) -> Stores {
    let stores = Stores::fresh().postgres(&pg.base()).redis(redis_url);
    let mut extra = format!("postgres.url = \"{}?{pg_query}\"\n", stores.db_url());
    if let Some(ca) = ca_file {
        extra.push_str(&format!("redis.ca_file = \"{}\"\n", ca.display()));
    }
    stores.with(&extra)
}

fn plain_redis() -> String {
    REDIS_URL.to_owned()
}

async fn build(stores: &Stores, migrate: bool) -> anyhow::Result<Application> {
    Application::build(
        stores.settings(),
        BuildOptions { migrate },
        std::sync::Arc::new(idempotency_ledger::clock::SystemClock),
    )
    .await
}

#[tokio::test]
async fn verify_full_serves_and_consumes_over_tls_to_postgres_and_redis() {
    idempotency_ledger::tls::install_provider();
    let pki = Pki::new();
    let pg = tls_postgres(&pki, &["localhost", "127.0.0.1"]).await;
    let redis = TlsRedis::start(&pki).await;
    let query = format!("sslmode=verify-full&sslrootcert={}", pki.ca.display());
    let stores = stores(&pg, &query, &redis.url(), Some(&pki.ca));
    let app = spawn_app_on(stores.clone()).await;

    // A durable consume (Postgres decides) and a fast one (Redis decides).
    for (biz, subject) in [("order", "u-tls"), ("like", "u-tls")] {
        let token = app.issue(PAYMENTS, biz, subject).await;
        let (status, _, body) = answer(
            app.consume(PAYMENTS, &token, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(
            (status, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{biz}: {body}"
        );
        let mut r = tls_client(&redis.url(), std::fs::read(&pki.ca).expect("ca"))
            .await
            .expect("tls client");
        let state: Option<String> = redis::cmd("HGET")
            .arg(app.token_key(&token))
            .arg("s")
            .query_async(&mut r)
            .await
            .expect("hget over TLS");
        assert!(
            state.is_some(),
            "{biz}: the token's key is in the TLS Redis"
        );
    }

    // Every connection of the service is encrypted (the server allows no other).
    let pg_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!(
            "{}?sslmode=verify-full&sslrootcert={}",
            stores.db_url(),
            pki.ca.display()
        ))
        .await
        .expect("verify-full from the test too");
    let (tls, plain): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl)
           FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
          WHERE a.application_name = 'idempotency-ledger'",
    )
    .fetch_one(&pg_pool)
    .await
    .expect("pg_stat_ssl");
    assert!(tls >= 1 && plain == 0, "tls {tls}, plain {plain}");
    let migrated: i64 = sqlx::query_scalar("SELECT count(*) FROM refinery_schema_history")
        .fetch_one(&pg_pool)
        .await
        .expect("migrations ran over TLS");
    assert!(migrated >= 4);
    pg_pool.close().await;
    app.stop().await;

    // The same by host name.
    let by_name = Stores {
        extra: String::new(),
        ..stores.clone()
    }
    .with(&format!(
        "postgres.url = \"postgres://postgres@localhost:{}/{}?{query}\"\nredis.url = \"rediss://localhost:{}\"\nredis.ca_file = \"{}\"",
        pg.port,
        stores.db_name,
        redis.port,
        pki.ca.display()
    ));
    let app = build(&by_name, true)
        .await
        .expect("verify-full by host name");
    drop(app);
}

#[tokio::test]
async fn a_certificate_from_another_ca_stops_the_start_naming_the_setting() {
    idempotency_ledger::tls::install_provider();
    let pki = Pki::new();
    let pg = tls_postgres(&pki, &["localhost", "127.0.0.1"]).await;
    let redis = TlsRedis::start(&pki).await;

    let wrong = format!("sslmode=verify-full&sslrootcert={}", pki.other_ca.display());
    for migrate in [true, false] {
        // Without migrations, the first connection is sqlx's (the pools).
        let err = build(&stores(&pg, &wrong, &plain_redis(), None), migrate)
            .await
            .err()
            .expect("refused");
        let text = format!("{err:#}");
        assert!(
            text.contains("postgres.url")
                && text.contains("TLS")
                && text.contains("sslrootcert")
                && text.contains("other-ca.pem"),
            "migrate {migrate}: {text}"
        );
    }

    let right = format!("sslmode=verify-full&sslrootcert={}", pki.ca.display());
    let err = build(
        &stores(&pg, &right, &redis.url(), Some(&pki.other_ca)),
        true,
    )
    .await
    .err()
    .expect("refused");
    let text = format!("{err:#}");
    assert!(
        text.contains("redis.url") && text.contains("TLS") && text.contains("redis.ca_file"),
        "{text}"
    );
    // Without a CA file: the system roots do not know the test CA either.
    let err = build(&stores(&pg, &right, &redis.url(), None), true)
        .await
        .err()
        .expect("refused");
    let text = format!("{err:#}");
    assert!(
        text.contains("redis.url") && text.contains("TLS") && text.contains("system"),
        "{text}"
    );
    // A rediss:// URL to a server that speaks plaintext.
    let plain_as_tls = plain_redis().replace("redis://", "rediss://");
    let err = build(&stores(&pg, &right, &plain_as_tls, Some(&pki.ca)), true)
        .await
        .err()
        .expect("refused");
    assert!(format!("{err:#}").contains("redis.url"), "{err:#}");
}

/// `verify-ca` checks the chain and not the name on the migrations'
/// connection (as libpq); sqlx's own check (0.8 with this rustls) also
/// insists on the name, so the service's queries need a matching name even
/// with `verify-ca` (stricter, never weaker; docs/operations.md says so).
/// `require` and `prefer` without a root certificate encrypt only.
#[tokio::test]
async fn verify_ca_checks_the_chain_and_require_only_encrypts() {
    idempotency_ledger::tls::install_provider();
    let pki = Pki::new();
    // A certificate for another name than the one the URL connects to.
    let pg = tls_postgres(&pki, &["db.internal"]).await;
    let ca = pki.ca.display().to_string();
    let full = format!("sslmode=verify-full&sslrootcert={ca}");
    let err = build(&stores(&pg, &full, &plain_redis(), None), true)
        .await
        .err()
        .expect("the name does not match");
    assert!(format!("{err:#}").contains("TLS"), "{err:#}");

    let db = |s: &Stores| s.settings().postgres.url.clone();
    let ca_only = stores(
        &pg,
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
        &plain_redis(),
        None,
    );
    idempotency_ledger::durable::setup::create_database_if_missing(&db(&ca_only))
        .await
        .expect("verify-ca: the chain verifies, the name is not asked");
    idempotency_ledger::durable::setup::migrate(&db(&ca_only))
        .await
        .expect("migrations under verify-ca");
    let other = stores(
        &pg,
        &format!("sslmode=verify-ca&sslrootcert={}", pki.other_ca.display()),
        &plain_redis(),
        None,
    );
    let err = idempotency_ledger::durable::setup::migrate(&db(&other))
        .await
        .expect_err("verify-ca with another CA");
    assert!(format!("{err:#}").contains("TLS"), "{err:#}");
    // libpq: require with a root certificate verifies the chain.
    let require_other = stores(
        &pg,
        &format!("sslmode=require&sslrootcert={}", pki.other_ca.display()),
        &plain_redis(),
        None,
    );
    let err = build(&require_other, true)
        .await
        .err()
        .expect("require with a root certificate verifies it");
    assert!(format!("{err:#}").contains("TLS"), "{err:#}");

    for query in ["sslmode=require", "sslmode=prefer"] {
        let app = spawn_app_on(stores(&pg, query, &plain_redis(), None)).await;
        let token = app.issue(PAYMENTS, "order", "u-ca").await;
        let r = app
            .consume(PAYMENTS, &token, &json!({"subject": "u-ca"}))
            .await;
        assert_eq!(r.status(), StatusCode::OK, "{query}");
        app.stop().await;
    }
}

#[tokio::test]
async fn plaintext_is_refused_by_the_servers() {
    idempotency_ledger::tls::install_provider();
    let pki = Pki::new();
    let pg = tls_postgres(&pki, &["localhost", "127.0.0.1"]).await;
    let redis = TlsRedis::start(&pki).await;

    let err = build(&stores(&pg, "sslmode=disable", &plain_redis(), None), true)
        .await
        .err()
        .expect("hostssl only");
    let text = format!("{err:#}");
    assert!(
        text.contains("postgres.url") && text.contains("no encryption"),
        "{text}"
    );

    let plain = format!("redis://127.0.0.1:{}", redis.port);
    let client = redis::Client::open(plain.as_str()).expect("url");
    let config = redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(2)))
        .set_response_timeout(Some(Duration::from_secs(2)));
    let answered = match client
        .get_multiplexed_async_connection_with_config(&config)
        .await
    {
        Ok(mut c) => redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .is_ok(),
        Err(_) => false,
    };
    assert!(!answered, "a plaintext PING to the TLS port");
    // The TLS port answers TLS.
    tls_ping(&redis.url(), std::fs::read(&pki.ca).expect("ca"))
        .await
        .expect("TLS PING");
}

/// `rediss://` cluster nodes verified against `redis.ca_file`: durable and
/// fast tokens are issued and consumed exactly once through a cluster that
/// speaks only TLS, the keys land on its masters, and the journal of fast
/// consumes (its stream in its own slot) reaches Postgres. A CA that did not
/// sign the nodes' certificates stops the start naming the settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tls_only_cluster_serves_fast_and_durable_tokens_exactly_once() {
    idempotency_ledger::tls::install_provider();
    let pki = Pki::new();
    let cluster = TlsCluster::start(&pki);
    let on_cluster = |ca: &Path| {
        Stores::fresh()
            .redis("")
            .with(&cluster.config_line())
            .with(&format!("redis.ca_file = \"{}\"", ca.display()))
    };
    let stores = on_cluster(&pki.ca);
    let app = spawn_app_on(stores.clone()).await;

    const N: usize = 12;
    for biz in ["order", "like"] {
        let mut tokens = Vec::new();
        for i in 0..N {
            let subject = format!("u-{biz}-{i}");
            tokens.push((app.issue(PAYMENTS, biz, &subject).await, subject));
        }
        for (token, subject) in &tokens {
            let body = json!({"subject": subject});
            let (status, _, first) = answer(app.consume(PAYMENTS, token, &body).await).await;
            assert_eq!(
                (status, first["outcome"].as_str()),
                (StatusCode::OK, Some("consumed")),
                "{biz}: {first}"
            );
            let (status, _, again) = answer(app.consume(PAYMENTS, token, &body).await).await;
            assert_eq!(
                (status, again["outcome"].as_str()),
                (StatusCode::OK, Some("duplicate")),
                "{biz}: {again}"
            );
        }
        // The keys are in the TLS cluster, marked consumed.
        for (token, _) in &tokens {
            let key = app.token_key(token);
            let state = cluster.cli(cluster.ports[0], &["-c", "hget", &key, "s"]);
            assert_eq!(state.trim(), "c", "{biz}: {key}: {state}");
        }
    }
    // Spread over the masters (24 tokens in random slots).
    let holding = cluster
        .ports
        .iter()
        .filter(|p| {
            let pattern = format!("{}tok:*", stores.prefix);
            !cluster
                .cli(**p, &["--scan", "--pattern", &pattern])
                .trim()
                .is_empty()
        })
        .count();
    assert!(holding >= 2, "token keys on {holding} of 3 masters");
    // The fast consumes reach Postgres through the journal.
    let pool = app.pg().await;
    consumed_in_postgres(&pool, "like", N as i64, 15).await;
    pool.close().await;
    app.stop().await;

    // Another CA: the start stops, naming the settings.
    let err = build(&on_cluster(&pki.other_ca), true)
        .await
        .err()
        .expect("refused");
    let text = format!("{err:#}");
    assert!(
        text.contains("redis.cluster_nodes")
            && text.contains("TLS")
            && text.contains("redis.ca_file")
            && text.contains("other-ca.pem"),
        "{text}"
    );
}
