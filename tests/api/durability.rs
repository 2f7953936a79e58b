//! Nothing answered is lost (DESIGN.md invariant 8): a token answered 201 is
//! consumable on every peer however late its issuance record, and after its
//! issuer is SIGKILLed (issuance marks, `crate::issuance::marks`); an answered fast
//! consume reaches Postgres after a SIGKILL; a SIGTERM writes every owed
//! issuance record.

use std::process::Command;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::link::Link;
use crate::helpers::procs::LedgerProc;
use crate::helpers::*;

/// A fast biz type whose tokens outlive the test (the default `like` lives
/// 3 s): as a dotted key for [`Stores::with`], as a table for a config file.
const LONG_LIKES: &str = "biz.like.ttl = \"10m\"";
const LONG_LIKES_TABLE: &str = "[biz.like]\nttl = \"10m\"";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .expect("client")
}

/// Issues `n` tokens of `biz` at `base` (subjects `s0..`); each answered 201.
async fn issue_at(
    http: &reqwest::Client,
    base: &str,
    biz: &str,
    n: usize,
) -> Vec<(String, String)> {
    let mut tokens = Vec::new();
    for i in 0..n {
        let subject = format!("s{i}");
        let r = http
            .post(format!("{base}/v1/tokens"))
            .bearer_auth(PAYMENTS)
            .json(&json!({"biz_type": biz, "subject": subject}))
            .send()
            .await
            .expect("issue");
        assert_eq!(r.status(), StatusCode::CREATED);
        let body: Value = r.json().await.expect("json");
        tokens.push((body["token"].as_str().expect("token").to_owned(), subject));
    }
    tokens
}

/// Consumes each token on `app`; returns how many were refused as
/// `token_invalid`, and panics on anything but `consumed` otherwise.
async fn refused_as_forged(app: &TestApp, tokens: &[(String, String)]) -> usize {
    let mut refused = 0;
    for (token, subject) in tokens {
        let (status, _, body) = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await;
        if body["error"] == "token_invalid" {
            refused += 1;
            continue;
        }
        assert_eq!(
            (status, body["outcome"].as_str()),
            (StatusCode::OK, Some("consumed")),
            "{body}"
        );
    }
    refused
}

fn service_config(stores: &Stores, pg_url: &str, extra: &str) -> String {
    format!(
        "[postgres]\nurl = \"{pg_url}\"\n[redis]\nurl = \"{}\"\nkey_prefix = \"{}\"\n{extra}\n",
        stores.redis_url, stores.prefix
    )
}

// ---- a slow issuer ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_of_an_issuer_with_a_slow_postgres_link_are_consumable_on_its_peers() {
    let stores = Stores::fresh().with(LONG_LIKES);
    let link = Link::to(suite_pg::port()).await;
    let a = spawn_app_on(
        stores
            .clone()
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", link.port())),
    )
    .await;
    let b = spawn_app_on(stores).await;
    let pool = b.pg().await;
    // A's mark moves with its clock while it is idle: wait until it is
    // past a millisecond of A's lease, for a forged id below it.
    let below_mark = now_ms();
    eventually(10, || {
        let pool = pool.clone();
        let worker = i32::from(a.ledger.worker_id());
        async move {
            let above: Option<bool> = sqlx::query_scalar(
                "SELECT bool_or(from_ms < $2 AND mark_ms > $2) FROM issuance_marks WHERE worker_id = $1",
            )
            .bind(worker)
            .bind(below_mark)
            .fetch_one(&pool)
            .await
            .ok()?;
            let above = above?;
            above.then_some(())
        }
    })
    .await;
    // A's records (and marks) now reach Postgres 3 s late each way.
    link.slow(Duration::from_secs(3));
    let http = client();
    let mut tokens = issue_at(&http, &a.address, "order", 20).await;
    tokens.extend(issue_at(&http, &a.address, "like", 20).await);
    // Past the filter's grace (2 s), before any record committed.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.issued'")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(recorded, 0, "the records are still on their way");
    let refused = refused_as_forged(&b, &tokens).await;
    assert_eq!(refused, 0, "{refused} of 40 real tokens refused as forged");
    // A token the fleet never issued (a valid tag, an id of A's lease below
    // its mark) is still refused.
    let forged_id =
        idempotency_ledger::token::SnowflakeId::from_parts(below_mark, a.ledger.worker_id(), 4000);
    let forged = b.sign(
        "order",
        forged_id.0,
        (now_ms() / 1000 + 600) as u32,
        "payments",
        "u",
    );
    let (status, _, body) =
        answer(b.consume(PAYMENTS, &forged, &json!({"subject": "u"})).await).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_invalid")),
        "{body}"
    );
    link.open();
}

// ---- an issuer SIGKILLed right after answering --------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokens_of_an_issuer_killed_right_after_answering_stay_consumable_on_its_peers() {
    let stores = Stores::fresh().with(LONG_LIKES);
    let peer = spawn_app_on(stores.clone()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    // A short lease, so that its worker id is free again soon after the kill.
    let config = service_config(
        &stores,
        &stores.db_url(),
        &format!("{LONG_LIKES_TABLE}\n[tokens]\nworker_lease_ttl = \"3s\""),
    );
    let mut issuer = LedgerProc::start(dir.path(), "issuer", &config);
    issuer.wait_ready().await;
    let http = client();
    let mut tokens = issue_at(&http, &issuer.address(), "order", 30).await;
    tokens.extend(issue_at(&http, &issuer.address(), "like", 30).await);
    issuer.kill();
    let pool = peer.pg().await;
    let recorded: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.issued'")
            .fetch_one(&pool)
            .await
            .expect("count");
    let codec = idempotency_ledger::token::TokenCodec::new(
        peer.stores.settings().tokens.signing_keys.clone(),
    );
    let worker = codec
        .verify(&tokens[0].0)
        .expect("valid")
        .claims
        .id
        .worker();

    // The killed issuer's worker id leased again: every other id is taken
    // (by holders that never issue), so the next instance gets this one.
    sqlx::query(
        "INSERT INTO worker_leases (worker_id, holder, expires_at)
         SELECT g, gen_random_uuid(), now() + interval '1 hour'
           FROM generate_series(0, 1023) g
          WHERE g <> $1 AND NOT EXISTS (SELECT 1 FROM worker_leases l
                                         WHERE l.worker_id = g AND l.expires_at > now())
         ON CONFLICT (worker_id) DO UPDATE
            SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at",
    )
    .bind(i32::from(worker))
    .execute(&pool)
    .await
    .expect("other worker ids held");
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let free: bool = sqlx::query_scalar(
                "SELECT expires_at <= now() FROM worker_leases WHERE worker_id = $1",
            )
            .bind(i32::from(worker))
            .fetch_one(&pool)
            .await
            .ok()?;
            free.then_some(())
        }
    })
    .await;
    let successor = spawn_app_on(stores.clone()).await;
    assert_eq!(successor.ledger.worker_id(), worker, "the same worker id");
    // The successor issues and its records (and marks) commit.
    let theirs = issue_at(&http, &successor.address, "order", 5).await;
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.issued'")
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (n >= recorded + 5).then_some(())
        }
    })
    .await;
    // Past the grace, and past a re-read of the marks.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let (on_peer, on_successor) = tokens.split_at(tokens.len() / 2);
    let refused = refused_as_forged(&peer, on_peer).await;
    let refused_too = refused_as_forged(&successor, on_successor).await;
    assert_eq!(
        (refused, refused_too),
        (0, 0),
        "{} of {} tokens recorded before the kill",
        recorded,
        tokens.len()
    );
    assert_eq!(refused_as_forged(&peer, &theirs).await, 0);
}

// ---- fast consumes answered, then SIGKILL --------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fast_consumes_answered_before_a_sigkill_reach_postgres_through_a_peer() {
    let stores = Stores::fresh().with(LONG_LIKES);
    let dir = tempfile::tempdir().expect("tempdir");
    let config = service_config(&stores, &stores.db_url(), LONG_LIKES_TABLE);
    let mut doomed = LedgerProc::start(dir.path(), "doomed", &config);
    doomed.wait_ready().await;
    let http = client();
    let base = doomed.address();
    let tokens = issue_at(&http, &base, "like", 40).await;
    let mut answered = Vec::new();
    for (token, subject) in &tokens {
        let r = http
            .post(format!("{base}/v1/tokens/{token}/consume"))
            .bearer_auth(PAYMENTS)
            .json(&json!({"subject": subject}))
            .send()
            .await
            .expect("consume");
        let body: Value = r.json().await.expect("json");
        assert_eq!(body["outcome"], "consumed", "{body}");
        answered.push(token.clone());
    }
    doomed.kill();
    // A peer's drainer takes over the journal (entries the dead one had
    // read are claimed once idle).
    let peer = spawn_app_on(stores).await;
    let pool = peer.pg().await;
    eventually(60, || {
        let (pool, answered) = (pool.clone(), answered.clone());
        async move {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM tokens WHERE token = ANY($1) AND state = 'consumed'",
            )
            .bind(&answered)
            .fetch_one(&pool)
            .await
            .ok()?;
            (n == answered.len() as i64).then_some(())
        }
    })
    .await;
}

// ---- SIGTERM with issuance records owed ----------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_sigterm_writes_every_owed_issuance_record() {
    let stores = Stores::fresh();
    // The database and its migrations first (the service's link is slow).
    let setup = spawn_app_on(stores.clone()).await;
    let pool = setup.pg().await;
    let link = Link::to(suite_pg::port()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let via_link = format!(
        "postgres://postgres@127.0.0.1:{}/{}",
        link.port(),
        stores.db_name
    );
    let config = service_config(&stores, &via_link, "");
    let mut svc = LedgerProc::start(dir.path(), "svc", &config);
    svc.wait_ready().await;
    // Postgres unreachable for the service: every record is owed.
    link.stall();
    let http = client();
    let tokens = issue_at(&http, &svc.address(), "order", 50).await;
    let owed: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = ANY($1)")
        .bind(tokens.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>())
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(owed, 0, "records owed at the SIGTERM");
    let ok = Command::new("kill")
        .args(["-s", "TERM", &svc.pid().to_string()])
        .status()
        .expect("kill")
        .success();
    assert!(ok);
    // Postgres comes back while the service stops.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    link.open();
    let status = svc.wait_exit(Duration::from_secs(30));
    assert!(status.is_some(), "the service stopped after SIGTERM");
    let written: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE token = ANY($1)")
        .bind(tokens.iter().map(|(t, _)| t.clone()).collect::<Vec<_>>())
        .fetch_one(&pool)
        .await
        .expect("count");
    assert_eq!(
        written,
        50,
        "{owed} were written before the SIGTERM; log: {}",
        std::fs::read_to_string(&svc.log).unwrap_or_default()
    );
    // Every lease of the stopped instance ended: its marks say all is recorded.
    let open: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM issuance_marks m
          WHERE mark_ms < 9223372036854775807
            AND NOT EXISTS (SELECT 1 FROM worker_leases l
                             WHERE l.worker_id = m.worker_id AND l.holder = m.holder
                               AND l.expires_at > now())",
    )
    .fetch_one(&pool)
    .await
    .expect("marks");
    assert_eq!(open, 0, "a stopped lease's mark is ended");
    setup.stop().await;
}
