//! A private 3-master Redis Cluster with replicas (`procs`): consumes are
//! exactly once before and after a master fails over; a fast consume whose
//! journal append fails still wins; a journal entry that neither Redis nor
//! Postgres takes waits in memory, then arrives.
//! These are among the slow tests of the suite (each a few seconds); they run
//! in CI with the rest (filter: `cargo test --test api faults`). Every
//! request carries a client timeout (`helpers::bounded`): a hung request
//! fails the test instead of hanging it.

use std::sync::Arc;

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::bounded::*;
use crate::helpers::calls::consumed_in_postgres;
use crate::helpers::procs::*;
use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_cluster_exactly_once_and_after_a_master_fails_over() {
    let mut cluster = Cluster::start();
    let app = Arc::new(
        spawn_app_on(
            Stores::fresh()
                .redis("")
                .with(&cluster.config_line())
                .with(QUICK_BREAKER),
        )
        .await,
    );
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    for biz in ["order", "like"] {
        let tokens = issue_many(&app, biz, 30).await;
        let (consumed, answers) = storm(&app, &tokens, 6, biz).await;
        assert_all_ok(&answers);
        assert!(consumed.iter().all(|&n| n == 1), "{biz}: {consumed:?}");
    }
    // The keys really are in the cluster, spread over the masters.
    let probe = app.issue(PAYMENTS, "order", "probe").await;
    let key = app.token_key(&probe);
    let exists = redis_cli(cluster.nodes[0].port, &["-c", "exists", &key]);
    assert_eq!(exists.trim(), "1", "{exists}");
    // The fast journal (its stream in another slot) reaches Postgres.
    let pool = app.pg().await;
    consumed_in_postgres(&pool, "like", 30, 10).await;

    // Issued before the failover, consumed during and after it.
    let before_orders = issue_many(&app, "order", 30).await;
    let before_likes = issue_many(&app, "like", 30).await;
    let victim = (0..cluster.nodes.len())
        .find(|i| cluster.is_master(*i))
        .expect("a master");
    let heir = cluster.replica_of(victim);
    cluster.nodes[victim].kill();
    let killed = std::time::Instant::now();
    let (during, answers) = storm(&app, &before_orders, 4, "during").await;
    assert_all_ok(&answers);
    assert!(during.iter().all(|&n| n == 1), "{during:?}");

    cluster.wait_promoted(heir);
    cluster.wait_healthy(&[victim]);
    // The service finds the promoted replica: fast consumes through Redis
    // again, on every master (ten fresh tokens in a row spread over the
    // slots; one call failing on a stale route answers 503, and the mode
    // alone does not show a route the client has not refreshed yet).
    eventually(30, || {
        let app = app.clone();
        async move {
            let (_, body) = readyz(&bounded_client(), &app.address).await?;
            if body["mode"] != "normal" {
                return None;
            }
            for _ in 0..10 {
                let token = app.issue(PAYMENTS, "like", "after").await;
                let (s, _, out) = try_consume(
                    &bounded_client(),
                    &app.address,
                    &token,
                    &json!({"subject": "after"}),
                )
                .await?;
                if s != StatusCode::OK || out["outcome"] != "consumed" {
                    return None;
                }
            }
            Some(())
        }
    })
    .await;
    eprintln!(
        "cluster: master {victim} killed; replica {heir} promoted and serving the service after {:?}; redis errors seen: {:?}",
        killed.elapsed(),
        metric(&app, "ledger_fast_tier_total{result=\"error\"}").await
    );
    let (after, answers) = storm(&app, &before_likes, 6, "after").await;
    assert_all_ok(&answers);
    assert!(after.iter().all(|&n| n == 1), "{after:?}");
    let (again, answers) = storm(&app, &before_orders, 3, "again").await;
    assert_all_ok(&answers);
    assert!(again.iter().all(|&n| n == 0), "{again:?}");
    for biz in ["order", "like"] {
        let tokens = issue_many(&app, biz, 20).await;
        let (consumed, answers) = storm(&app, &tokens, 6, &format!("{biz}-after")).await;
        assert_all_ok(&answers);
        assert!(consumed.iter().all(|&n| n == 1), "{biz}: {consumed:?}");
    }
}

/// On a cluster the journal stream is in another slot, so a fast consume's
/// journal entry is a second command after the script. When that command
/// fails (here: the journal key is not a stream), the script's decision still
/// stands: the caller hears `consumed` (not a 503 that would make its
/// retry a `duplicate`), and the entry is in Postgres before the answer
/// (applied directly, not kept in the process's memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_fast_consume_whose_journal_append_fails_still_wins() {
    let cluster = Cluster::start();
    let app = Arc::new(
        spawn_app_on(
            Stores::fresh()
                .redis("")
                .with(&cluster.config_line())
                .with(QUICK_BREAKER),
        )
        .await,
    );
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    // The journal's key made unusable for XADD (a string, not a stream): the
    // append after the script fails with an error reply.
    let journal = format!("{}journal", app.stores.prefix);
    let port = cluster.nodes[0].port;
    assert_eq!(
        redis_cli(port, &["-c", "set", &journal, "not-a-stream"]).trim(),
        "OK"
    );
    let subject = "fan".to_owned();
    let token = app.issue(PAYMENTS, "like", &subject).await;
    let body = json!({"subject": subject});
    let answered = consume(&app, &token, &body).await;
    // Before Redis takes journal entries again: the entry is in Postgres
    // already, and nothing waits in memory.
    let pool = app.pg().await;
    let state: Option<String> =
        sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
            .bind(&token)
            .fetch_optional(&pool)
            .await
            .expect("read");
    let metrics = app.metrics_text().await;
    let fallback = |to: &str| {
        metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "ledger_journal_append_fallback_total{{to=\"{to}\"}} "
                ))
            })
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    assert_eq!(redis_cli(port, &["-c", "del", &journal]).trim(), "1");
    let (s, _, answer) = answered;
    assert_eq!(
        (s, answer["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{answer}"
    );
    assert_eq!(
        state.as_deref(),
        Some("consumed"),
        "in postgres before the answer"
    );
    assert_eq!(
        (fallback("postgres"), fallback("memory")),
        (Some(1), Some(0)),
        "applied directly, not kept in memory"
    );
    eventually(20, || {
        let pool = pool.clone();
        let token = token.clone();
        async move {
            let state: String =
                sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (state == "consumed").then_some(())
        }
    })
    .await;
    eventually(10, || {
        let app = app.clone();
        let (token, body) = (token.clone(), body.clone());
        async move {
            let (s, _, again) = consume(&app, &token, &body).await;
            (s == StatusCode::OK && again["outcome"] == "duplicate").then_some(())
        }
    })
    .await;
}

/// The same append failure while this instance cannot reach Postgres either:
/// the decision still stands, the entry waits in the process's memory
/// (counted), and reaches Postgres once both answer again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cluster_journal_entry_neither_redis_nor_postgres_takes_waits_in_memory_then_arrives() {
    let cluster = Cluster::start();
    let link = crate::helpers::link::Link::to(crate::helpers::suite_pg::port()).await;
    let app = spawn_app_on(
        Stores::fresh()
            .postgres(&format!("postgres://postgres@127.0.0.1:{}", link.port()))
            .redis("")
            .with(&cluster.config_line())
            .with(QUICK_BREAKER),
    )
    .await;
    assert_eq!(wait_mode(&app, 5, "normal").await["redis"], "up");
    let journal = format!("{}journal", app.stores.prefix);
    let port = cluster.nodes[0].port;
    let subject = "fan".to_owned();
    let token = app.issue(PAYMENTS, "like", &subject).await;
    let body = json!({"subject": subject});
    assert_eq!(
        redis_cli(port, &["-c", "set", &journal, "not-a-stream"]).trim(),
        "OK"
    );
    // Within the fleet's lease of the last report, Redis still decides.
    link.cut();
    let (s, _, answer) = consume(&app, &token, &body).await;
    assert_eq!(
        (s, answer["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{answer}"
    );
    let metrics = app.metrics_text().await;
    let kept = metrics.lines().find_map(|l| {
        l.strip_prefix("ledger_journal_append_fallback_total{to=\"memory\"} ")
            .and_then(|v| v.trim().parse::<u64>().ok())
    });
    assert_eq!(kept, Some(1), "kept in memory, counted");
    link.open();
    assert_eq!(redis_cli(port, &["-c", "del", &journal]).trim(), "1");
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&format!(
            "{}/{}",
            crate::helpers::suite_pg::base(),
            app.stores.db_name
        ))
        .await
        .expect("test pool");
    eventually(30, || {
        let (pool, token) = (pool.clone(), token.clone());
        async move {
            let state: String =
                sqlx::query_scalar("SELECT state::text FROM tokens WHERE token = $1")
                    .bind(&token)
                    .fetch_one(&pool)
                    .await
                    .ok()?;
            (state == "consumed").then_some(())
        }
    })
    .await;
}
