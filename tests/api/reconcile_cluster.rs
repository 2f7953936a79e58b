//! Reconcile on a private Redis Cluster of 3 masters: a page of keys is read
//! with one pipeline per primary (counted by `ledger_redis_pipeline_keys`
//! and by each master's own `INFO commandstats`), every divergence it
//! repairs on a standalone Redis is found and repaired on every master, and
//! a slot resharded or being migrated under a page still reads every key
//! right (the keys of that slot read again alone, following the redirect).

use std::sync::Arc;

use idempotency_ledger::fast::{FastTier, KeyRead, KeyState};
use idempotency_ledger::metrics::Metrics;
use idempotency_ledger::reconcile::{Class, Classes, Report};
use redis::AsyncCommands;
use serde_json::json;

use crate::helpers::cluster::{
    calls, cluster_conn, finish_move, masters, move_slot, owner, slot, socket_reads,
    state_while_importing,
};
use crate::helpers::procs::{redis_cli, Cluster};
use crate::helpers::tiers::{fast_tier, reconciler_on, run_on};
use crate::helpers::*;

async fn run(stores: &Stores, fast: &Arc<FastTier>, dry_run: bool) -> Report {
    run_on(reconciler_on(stores, fast.clone()), dry_run).await
}

fn classes(of: &[(Class, u64)]) -> Classes {
    of.iter().copied().collect()
}

fn rereads(metrics: &Metrics) -> Vec<(&'static str, u64)> {
    ["moved", "ask", "try_again", "no_route"]
        .into_iter()
        .map(|r| (r, reread(metrics, r)))
        .collect()
}

/// Keys of reconcile pages read again alone, for `reason`.
fn reread(metrics: &Metrics, reason: &str) -> u64 {
    let op = ["reconcile", reason];
    metrics.redis_key_rereads.with_label_values(&op).get()
}

/// Keys reconcile read per pipeline (`ledger_redis_pipeline_keys`).
fn pipeline_keys(metrics: &Metrics) -> prometheus::Histogram {
    metrics
        .redis_pipeline_keys
        .with_label_values(&["reconcile"])
}

/// The states a test writes, and what a read must find.
fn state_of(i: usize) -> KeyState {
    match i % 4 {
        0 => KeyState::Issued,
        1 => KeyState::Consumed,
        2 => KeyState::Provisional {
            deadline_ms: 4_000_000_000_000 + i as i64,
        },
        _ => KeyState::Missing,
    }
}

async fn write_state<C: redis::aio::ConnectionLike + Send>(r: &mut C, key: &str, i: usize) {
    let fields: Vec<(&str, String)> = match state_of(i) {
        KeyState::Issued => vec![("s", "i".into()), ("g", "0".into())],
        KeyState::Consumed => vec![("s", "c".into()), ("g", "1".into())],
        KeyState::Provisional { deadline_ms } => vec![
            ("s", "p".into()),
            ("d", deadline_ms.to_string()),
            ("g", "0".into()),
        ],
        _ => return,
    };
    redis::cmd("HSET")
        .arg(key)
        .arg(&fields)
        .query_async::<()>(r)
        .await
        .expect("hset");
}

fn check_reads(reads: &[KeyRead], case: &str) {
    assert_eq!(reads.len(), 500, "{case}");
    for (i, k) in reads.iter().enumerate() {
        assert_eq!(k.state, state_of(i), "{case}: key {i}");
        let want_gen = match state_of(i) {
            KeyState::Missing => None,
            KeyState::Consumed => Some(1),
            _ => Some(0),
        };
        assert_eq!(k.stored_gen, want_gen, "{case}: key {i}");
        assert!(
            (k.now_ms - now_ms()).abs() < 60_000,
            "{case}: key {i}'s clock"
        );
    }
}

/// A page of 500 keys spread over the 3 masters is read with one pipeline
/// per master: each master answers one `TIME` (the pipeline's first
/// command) and exactly the `HMGET`s of the keys it serves, reading them
/// off its socket in a few reads, and the tier counts 3 pipelines of 500
/// keys in all. (Read one `HMGET` at a time, as the cluster connection
/// routes single commands, the page counted no pipeline, asked one node
/// only for `TIME`, and took each master 11 to 22 socket reads.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_page_of_500_keys_goes_as_one_pipeline_per_master() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let (fast, metrics) = fast_tier(&stores);
    let mut r = cluster_conn(&cluster).await;
    let tokens: Vec<String> = (0..500).map(|i| format!("like_page-{i}")).collect();
    let keys: Vec<String> = tokens
        .iter()
        .map(|t| format!("{}tok:{{{t}}}", stores.prefix))
        .collect();
    for (i, k) in keys.iter().enumerate() {
        write_state(&mut r, k, i).await;
    }
    let masters = masters(&cluster);
    assert_eq!(masters.len(), 3);
    let mut owners = Vec::new();
    for k in &keys {
        owners.push(owner(&cluster, &masters, k).await);
    }
    let per_master: Vec<u64> = masters
        .iter()
        .map(|m| owners.iter().filter(|p| **p == m.port).count() as u64)
        .collect();
    assert!(per_master.iter().all(|n| *n > 100), "{per_master:?}");

    // The first read also connects and reads the slot map; the second is
    // the steady state, with the map kept.
    check_reads(&fast.key_states(&tokens).await.expect("read"), "first");
    let pipelines = pipeline_keys(&metrics).get_sample_count();
    let before: Vec<(u64, u64, u64)> = masters
        .iter()
        .map(|m| {
            let stats = (calls(m.port, "time"), calls(m.port, "hmget"));
            (stats.0, stats.1, socket_reads(m.port))
        })
        .collect();
    check_reads(&fast.key_states(&tokens).await.expect("read"), "again");
    for ((m, (time, hmget, reads)), keys) in masters.iter().zip(before).zip(&per_master) {
        // The `INFO` that reads the count is one of them; a replica's
        // `REPLCONF ACK` (every second) may be another.
        let socket = socket_reads(m.port) - reads - 1;
        assert!(
            socket <= 5,
            "master {}: {socket} socket reads for {keys} keys",
            m.port
        );
        assert_eq!(
            calls(m.port, "time") - time,
            1,
            "master {}: one TIME",
            m.port
        );
        assert_eq!(
            calls(m.port, "hmget") - hmget,
            *keys,
            "master {}: its own keys only",
            m.port
        );
    }
    assert_eq!(pipelines, 3, "one pipeline per master");
    assert_eq!(pipeline_keys(&metrics).get_sample_count(), pipelines + 3);
    assert_eq!(pipeline_keys(&metrics).get_sample_sum(), 1000.0);
    assert!(
        rereads(&metrics).iter().all(|(_, n)| *n == 0),
        "{:?}",
        rereads(&metrics)
    );
}

/// On a standalone Redis a page is one pipeline.
#[tokio::test]
async fn a_standalone_page_is_one_pipeline() {
    let stores = Stores::fresh();
    let (fast, metrics) = fast_tier(&stores);
    let mut r = redis_conn().await;
    let tokens: Vec<String> = (0..500).map(|i| format!("like_page-{i}")).collect();
    for (i, t) in tokens.iter().enumerate() {
        write_state(&mut r, &format!("{}tok:{{{t}}}", stores.prefix), i).await;
    }
    check_reads(&fast.key_states(&tokens).await.expect("read"), "standalone");
    assert_eq!(pipeline_keys(&metrics).get_sample_count(), 1);
    assert_eq!(pipeline_keys(&metrics).get_sample_sum(), 500.0);
}

/// Every divergence reconcile repairs on a standalone Redis, 40 tokens of
/// each, in pages of 500 keys over the 3 masters (each class on every
/// master): found by a dry run, repaired by a real run, nothing left for a
/// third; every key read in a pipeline (none alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_cluster_pages_of_hundreds_of_keys_are_repaired_on_every_master() {
    const N: usize = 40;
    let cluster = Cluster::start();
    let stores = Stores::fresh()
        .redis("")
        .with(&cluster.config_line())
        .with("reconcile.batch_size = 500");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = cluster_conn(&cluster).await;
    let masters = masters(&cluster);

    let issue = |class: &'static str| {
        let app = &app;
        async move {
            let mut out = Vec::new();
            for i in 0..N {
                let subject = format!("{class}-{i}");
                out.push((app.issue(PAYMENTS, "order", &subject).await, subject));
            }
            out
        }
    };
    // Consumed in Postgres; Redis says issued again.
    let spent = issue("spent").await;
    for (token, subject) in &spent {
        let (_, _, body) = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed", "{body}");
    }
    // Live; Redis lost the key.
    let lost = issue("lost").await;
    // Live; a provisional marker whose owner died 10 s ago.
    let stale = issue("stale").await;
    // Live in Postgres (durable, released: generation 2); Redis holds the
    // consumed marker of the consume before (generation 1): the release
    // was lost.
    let marked = issue("marked").await;
    // Live and fine (seeded here, whatever the issue's seed did).
    let fine = issue("fine").await;
    eventually(10, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens")
            .fetch_one(&pg)
            .await
            .ok()?;
        (n == 5 * N as i64).then_some(())
    })
    .await;

    let key = |t: &str| app.token_key(t);
    for (token, _) in &spent {
        wait_redis_state(&r, &key(token), "c", 5).await;
        let _: () = r.hset(key(token), "s", "i").await.expect("hset");
    }
    for (token, _) in &lost {
        let _: () = r.del(key(token)).await.expect("del");
    }
    for (token, _) in &stale {
        let _: () = r
            .hset_multiple(
                key(token),
                &[
                    ("s", "p".to_owned()),
                    ("o", "dead-owner".to_owned()),
                    ("d", (now_ms() - 10_000).to_string()),
                    ("at", (now_ms() - 11_000).to_string()),
                ],
            )
            .await
            .expect("hset");
    }
    for (token, _) in &marked {
        let _: () = r
            .hset_multiple(key(token), &[("s", "c"), ("g", "1")])
            .await
            .expect("hset");
        sqlx::query("UPDATE tokens SET gen = 2 WHERE token = $1")
            .bind(token)
            .execute(&pg)
            .await
            .expect("released in postgres");
    }
    for (token, _) in &fine {
        let _: () = r
            .hset_multiple(key(token), &[("s", "i"), ("g", "0")])
            .await
            .expect("hset");
        let _: () = r.pexpire(key(token), 600_000).await.expect("pexpire");
    }
    for (name, class) in [
        ("spent", &spent),
        ("lost", &lost),
        ("stale", &stale),
        ("marked", &marked),
    ] {
        let mut on = std::collections::HashSet::new();
        for (t, _) in class {
            on.insert(owner(&cluster, &masters, &key(t)).await);
        }
        assert_eq!(on.len(), masters.len(), "{name}: tokens on every master");
    }

    let want = classes(&[
        (Class::RedisLiveButConsumed, N as u64),
        (Class::RedisMissingButLive, N as u64),
        (Class::StaleProvisional, N as u64),
        (Class::RedisConsumedButLive, N as u64),
    ]);
    let (fast, metrics) = fast_tier(&stores);
    let dry = run(&stores, &fast, true).await;
    assert_eq!(dry.found, want, "{dry:#?}");
    assert_eq!(dry.repaired, Classes::default());
    let real = run(&stores, &fast, false).await;
    assert_eq!(real.found, want, "{real:#?}");
    assert_eq!(real.repaired, want, "{real:#?}");
    for (token, _) in &spent {
        let s: Option<String> = r.hget(key(token), "s").await.expect("hget");
        assert_eq!(s, None, "Postgres answers now");
    }
    for (token, _) in lost.iter().chain(&stale).chain(&marked).chain(&fine) {
        let s: Option<String> = r.hget(key(token), "s").await.expect("hget");
        assert_eq!(s.as_deref(), Some("i"), "{token}");
    }
    let again = run(&stores, &fast, false).await;
    assert_eq!(again.found, Classes::default(), "{again:#?}");
    // Every key of the three runs read in a pipeline, none alone.
    let read = dry.scanned.tokens + real.scanned.tokens + again.scanned.tokens;
    assert_eq!(pipeline_keys(&metrics).get_sample_sum(), read as f64);
    assert!(
        rereads(&metrics).iter().all(|(_, n)| *n == 0),
        "{:?}",
        rereads(&metrics)
    );

    // The service agrees: spent stays spent, the others consume once.
    for (token, subject) in &spent {
        let (_, _, body) = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(body["outcome"], "duplicate", "{body}");
    }
    for (token, subject) in lost.iter().chain(&stale).chain(&marked) {
        let (_, _, body) = answer(
            app.consume(PAYMENTS, token, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed", "{body}");
    }
    pg.close().await;
    app.stop().await;
}

/// A slot handed to another master after the tier kept its slot map (the
/// old owner answers `MOVED`) and a slot being migrated with its keys on
/// the target already (the old owner answers `ASK`), under the same page:
/// every key still reads what it holds (the keys of those slots read again
/// alone, the others in their master's pipeline), and a reconcile run in the
/// middle of the migration finds and repairs every divergent key, the moved
/// ones included.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_moved_or_migrating_under_a_page_still_reads_every_key() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let (fast, metrics) = fast_tier(&stores);
    let mut r = cluster_conn(&cluster).await;
    let tokens: Vec<String> = (0..500).map(|i| format!("like_move-{i}")).collect();
    let key = |t: &str| format!("{}tok:{{{t}}}", stores.prefix);
    for (i, t) in tokens.iter().enumerate() {
        write_state(&mut r, &key(t), i).await;
    }
    check_reads(&fast.key_states(&tokens).await.expect("read"), "before");
    assert!(rereads(&metrics).iter().all(|(_, n)| *n == 0));

    // Keys 0 (issued) and 5 (consumed) are in two different slots.
    assert_ne!(
        slot(&cluster, &key(&tokens[0])).await,
        slot(&cluster, &key(&tokens[5])).await
    );
    let (_, _, moved_to) = move_slot(&cluster, &key(&tokens[0]), true);
    let (migrating, src, dst) = move_slot(&cluster, &key(&tokens[5]), false);
    assert!(
        redis_cli(src.port, &["hget", &key(&tokens[5]), "s"]).starts_with("ASK "),
        "the old owner sends the key on"
    );
    assert_eq!(
        state_while_importing(dst.port, &key(&tokens[5]))
            .await
            .as_deref(),
        Some("c")
    );
    assert_eq!(
        redis_cli(moved_to.port, &["hget", &key(&tokens[0]), "s"]).trim(),
        "i"
    );
    check_reads(&fast.key_states(&tokens).await.expect("read"), "moved");
    let again = rereads(&metrics);
    assert!(again[0].1 >= 1 && again[1].1 >= 1, "{again:?}");
    check_reads(
        &fast.key_states(&tokens).await.expect("read"),
        "still migrating",
    );
    finish_move(&masters(&cluster), &migrating, &src, &dst);
    check_reads(&fast.key_states(&tokens).await.expect("read"), "after");
}

/// Reconcile itself during a migration: durable tokens live in Postgres
/// whose Redis keys hold consumed markers, one of them in a slot being
/// migrated (its keys on the target already: the old owner answers `ASK`),
/// one in a slot handed to another master since the tier first read the
/// map: all found and repaired, on the node that holds each key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reconcile_during_a_slot_migration_repairs_every_key() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let mut r = cluster_conn(&cluster).await;
    let mut tokens = Vec::new();
    for i in 0..150 {
        tokens.push(app.issue(PAYMENTS, "order", &format!("mig-{i}")).await);
    }
    eventually(10, || async {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens")
            .fetch_one(&pg)
            .await
            .ok()?;
        (n == 150).then_some(())
    })
    .await;
    // Every third holds the consumed marker of a consume whose release
    // Redis lost (generation 1; Postgres holds it issued at 2); the others
    // are seeded as issued.
    for (i, t) in tokens.iter().enumerate() {
        let k = app.token_key(t);
        if i % 3 == 0 {
            let _: () = r
                .hset_multiple(&k, &[("s", "c"), ("g", "1")])
                .await
                .expect("hset");
            sqlx::query("UPDATE tokens SET gen = 2 WHERE token = $1")
                .bind(t)
                .execute(&pg)
                .await
                .expect("released in postgres");
        } else {
            let _: () = r.hset_multiple(&k, &[("s", "i")]).await.expect("hset");
        }
        let _: () = r.pexpire(&k, 600_000).await.expect("pexpire");
    }
    let (fast, metrics) = fast_tier(&stores);
    // The tier keeps its slot map, then a slot moves under it and another
    // starts migrating.
    let before = fast.key_states(&tokens).await.expect("read");
    assert_eq!(before.len(), 150);
    let (_, _, _) = move_slot(&cluster, &app.token_key(&tokens[0]), true);
    let (migrating, src, dst) = move_slot(&cluster, &app.token_key(&tokens[3]), false);

    let want = classes(&[(Class::RedisConsumedButLive, 50)]);
    let dry = run(&stores, &fast, true).await;
    assert_eq!(dry.found, want, "{dry:#?}");
    let real = run(&stores, &fast, false).await;
    assert_eq!(real.found, want, "{real:#?}");
    assert_eq!(real.repaired, want, "{real:#?}");
    for t in &tokens {
        let s: Option<String> = r.hget(app.token_key(t), "s").await.expect("hget");
        assert_eq!(s.as_deref(), Some("i"), "{t}");
    }
    assert_eq!(
        state_while_importing(dst.port, &app.token_key(&tokens[3]))
            .await
            .as_deref(),
        Some("i"),
        "repaired on the node it migrated to"
    );
    let ask = reread(&metrics, "ask");
    assert!(ask >= 1, "{:?}", rereads(&metrics));
    let again = run(&stores, &fast, false).await;
    assert_eq!(again.found, Classes::default(), "{again:#?}");
    finish_move(&masters(&cluster), &migrating, &src, &dst);
    pg.close().await;
    app.stop().await;
}
