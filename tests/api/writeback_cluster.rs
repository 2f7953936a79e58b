//! Write-backs of a batch on a private Redis Cluster of 3 masters: one
//! pipeline per master (counted by `ledger_redis_pipeline_keys{op="writeback"}`
//! and by each master's own `INFO commandstats`), each item with its own
//! outcome; a slot handed to another master (`MOVED`) and a slot being
//! migrated (`ASK`) under a batch still leave every key as its generation
//! says (the items of those slots sent again alone, following the redirect);
//! a master that lost its scripts has the script loaded and its items sent
//! again.

use idempotency_ledger::fast::{ConsumedWrite, FastError, FastTier, Marker};
use idempotency_ledger::metrics::Metrics;
use redis::AsyncCommands;

use crate::helpers::cluster::{
    calls, cluster_conn, finish_move, masters, move_slot, owner, slot, socket_reads,
    state_while_importing,
};
use crate::helpers::procs::{redis_cli, Cluster};
use crate::helpers::tiers::fast_tier;
use crate::helpers::*;

fn key(stores: &Stores, token: &str) -> String {
    format!("{}tok:{{{token}}}", stores.prefix)
}

fn write(token: String, gen: i64, i: usize, result: Option<String>) -> ConsumedWrite {
    ConsumedWrite {
        token,
        gen,
        marker: Marker {
            at_ms: now_ms(),
            request_id: Some(format!("r-{i}")),
            fingerprint: Some(format!("f-{i}")),
            result,
        },
    }
}

/// Pipelines the tier sent for write-backs, and the items in them.
fn pipelines(metrics: &Metrics) -> (u64, f64) {
    let h = metrics
        .redis_pipeline_keys
        .with_label_values(&["writeback"]);
    (h.get_sample_count(), h.get_sample_sum())
}

/// Calls the tier made of `op`.
fn tier_calls(metrics: &Metrics, op: &str) -> u64 {
    metrics
        .tier_duration
        .with_label_values(&["redis", op])
        .get_sample_count()
}

fn resends(metrics: &Metrics) -> Vec<(&'static str, u64)> {
    ["moved", "ask", "try_again", "no_route"]
        .into_iter()
        .map(|r| {
            let n = metrics
                .redis_key_rereads
                .with_label_values(&["writeback", r])
                .get();
            (r, n)
        })
        .collect()
}

async fn fields(
    r: &mut redis::cluster_async::ClusterConnection,
    key: &str,
) -> (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
) {
    let (s, g, rid, res): (
        Option<String>,
        Option<String>,
        Option<String>,
        Option<String>,
    ) = redis::cmd("HMGET")
        .arg(key)
        .arg("s")
        .arg("g")
        .arg("rid")
        .arg("res")
        .query_async(r)
        .await
        .expect("hmget");
    (s, g, rid, res)
}

/// Warms a tier up (connects, reads the slot map, loads the script on every
/// master: a fresh cluster answers `NOSCRIPT` first) with a batch of its own.
async fn warm_up(fast: &FastTier, name: &str) {
    let items: Vec<ConsumedWrite> = (0..30)
        .map(|i| write(format!("{name}-warm-{i}"), 1, i, None))
        .collect();
    let out = fast.write_consumed_many(&items).await.expect("a reply");
    assert!(out.iter().all(|o| matches!(o, Ok(true))), "{out:?}");
}

/// A batch of 60 write-backs spread over the 3 masters goes as one pipeline
/// per master: each master runs exactly the `EVALSHA`s of the keys it
/// serves, reading them off its socket in a few reads, the tier makes 3
/// `writeback_pipeline` calls and no call per item, and every item has its
/// own outcome: written over an issued or a missing key, the result added
/// to the same generation's marker, nothing over a newer generation, and a
/// key of another type fails its item only. (Sent one write-back at a
/// time, concurrently, as the cluster path did before, the batch counted no
/// pipeline and made 60 `writeback` calls.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_write_backs_goes_as_one_pipeline_per_master() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let (fast, metrics) = fast_tier(&stores);
    let mut r = cluster_conn(&cluster).await;
    let masters = masters(&cluster);
    assert_eq!(masters.len(), 3);
    warm_up(&fast, "wb").await;

    const BROKEN: usize = 10;
    let tokens: Vec<String> = (0..60).map(|i| format!("wb_batch-{i}")).collect();
    let mut items = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let k = key(&stores, t);
        let result = (i % 4 == 3).then(|| format!("res-{i}"));
        match i % 4 {
            0 => {
                let _: () = r
                    .hset_multiple(&k, &[("s", "i"), ("g", "0")])
                    .await
                    .expect("hset");
            }
            1 => {}
            2 => {
                let _: () = r
                    .hset_multiple(&k, &[("s", "c"), ("g", "3"), ("rid", "newer")])
                    .await
                    .expect("hset");
            }
            _ => {
                let _: () = r
                    .hset_multiple(&k, &[("s", "c"), ("g", "1"), ("rid", "same")])
                    .await
                    .expect("hset");
            }
        }
        items.push(write(t.clone(), 1, i, result));
    }
    let broken = key(&stores, &tokens[BROKEN]);
    let _: () = r.set(&broken, "not a hash").await.expect("set");
    let mut owners = Vec::new();
    for t in &tokens {
        owners.push(owner(&cluster, &masters, &key(&stores, t)).await);
    }
    let per_master: Vec<u64> = masters
        .iter()
        .map(|m| owners.iter().filter(|p| **p == m.port).count() as u64)
        .collect();
    assert!(per_master.iter().all(|n| *n > 5), "{per_master:?}");

    let (sent, sum) = pipelines(&metrics);
    let (pipe_calls, item_calls) = (
        tier_calls(&metrics, "writeback_pipeline"),
        tier_calls(&metrics, "writeback"),
    );
    let before: Vec<(u64, u64)> = masters
        .iter()
        .map(|m| (calls(m.port, "evalsha"), socket_reads(m.port)))
        .collect();
    let out = fast.write_consumed_many(&items).await.expect("a reply");
    // Each master's own count, read before any other command reaches it.
    for ((m, (evalsha, reads)), keys) in masters.iter().zip(before).zip(&per_master) {
        // The `INFO` that reads the count is one of them; a replica's
        // `REPLCONF ACK` (every second) may be another.
        let socket = socket_reads(m.port) - reads - 1;
        assert!(
            socket <= 5,
            "master {}: {socket} socket reads for {keys} write-backs",
            m.port
        );
        assert_eq!(
            calls(m.port, "evalsha") - evalsha,
            *keys,
            "master {}: its own write-backs only, once each",
            m.port
        );
    }

    assert_eq!(out.len(), 60);
    for (i, o) in out.iter().enumerate() {
        let k = key(&stores, &tokens[i]);
        if i == BROKEN {
            assert!(
                matches!(o, Err(FastError::Redis(_))),
                "the string key fails its item: {o:?}"
            );
            continue;
        }
        let got = fields(&mut r, &k).await;
        let rid = Some(format!("r-{i}"));
        match i % 4 {
            0 | 1 => {
                assert!(matches!(o, Ok(true)), "item {i}: {o:?}");
                assert_eq!(
                    got,
                    (Some("c".into()), Some("1".into()), rid, None),
                    "item {i}"
                );
            }
            2 => {
                assert!(matches!(o, Ok(false)), "item {i}: {o:?}");
                assert_eq!(
                    got,
                    (
                        Some("c".into()),
                        Some("3".into()),
                        Some("newer".into()),
                        None
                    ),
                    "item {i}"
                );
            }
            _ => {
                assert!(matches!(o, Ok(true)), "item {i}: {o:?}");
                assert_eq!(
                    got,
                    (
                        Some("c".into()),
                        Some("1".into()),
                        Some("same".into()),
                        Some(format!("res-{i}"))
                    ),
                    "item {i}: the result added"
                );
            }
        }
    }
    let s: String = r.get(&broken).await.expect("get");
    assert_eq!(s, "not a hash");

    assert_eq!(
        pipelines(&metrics),
        (sent + 3, sum + 60.0),
        "one pipeline per master, every item in one"
    );
    assert_eq!(
        (
            tier_calls(&metrics, "writeback_pipeline") - pipe_calls,
            tier_calls(&metrics, "writeback") - item_calls
        ),
        (3, 0),
        "three calls for sixty"
    );
    assert!(
        resends(&metrics).iter().all(|(_, n)| *n == 0),
        "{:?}",
        resends(&metrics)
    );
}

/// A slot handed to another master after the tier kept its slot map (the
/// old owner answers `MOVED`) and a slot being migrated with its keys on the
/// target already (the old owner answers `ASK`), under the same batch:
/// every item still ends as its generation says, on the node that holds its
/// key (the items of those slots sent again alone, following the redirect,
/// the others of their pipelines sent again in their master's), the items of
/// the third master answered by its one pipeline; the same batch again
/// writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn write_backs_in_a_moved_and_a_migrating_slot_all_end_at_their_generations() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let (fast, metrics) = fast_tier(&stores);
    let mut r = cluster_conn(&cluster).await;
    let all = masters(&cluster);
    warm_up(&fast, "mv").await;

    // Every key issued at generation 2, but every fifth consumed at 5.
    let tokens: Vec<String> = (0..60).map(|i| format!("wb_move-{i}")).collect();
    let newer = |i: usize| i % 5 == 4;
    for (i, t) in tokens.iter().enumerate() {
        let k = key(&stores, t);
        let state: &[(&str, &str)] = if newer(i) {
            &[("s", "c"), ("g", "5"), ("rid", "newer")]
        } else {
            &[("s", "i"), ("g", "2")]
        };
        let _: () = r.hset_multiple(&k, state).await.expect("hset");
    }
    let mut owners = Vec::new();
    for t in &tokens {
        owners.push(owner(&cluster, &all, &key(&stores, t)).await);
    }
    // Keys 0 and 1 are in two different slots.
    let (k0, k1) = (key(&stores, &tokens[0]), key(&stores, &tokens[1]));
    assert_ne!(slot(&cluster, &k0).await, slot(&cluster, &k1).await);
    let (_, moved_from, moved_to) = move_slot(&cluster, &k0, true);
    let (migrating, src, dst) = move_slot(&cluster, &k1, false);
    assert!(
        redis_cli(src.port, &["hget", &k1, "s"]).starts_with("ASK "),
        "the old owner sends the key on"
    );
    assert!(
        redis_cli(moved_from.port, &["hget", &k0, "s"]).starts_with("MOVED "),
        "the old owner names the new"
    );
    let third: Vec<u16> = all
        .iter()
        .map(|m| m.port)
        .filter(|p| *p != moved_from.port && *p != src.port)
        .collect();

    let items: Vec<ConsumedWrite> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| write(t.clone(), 3, i, None))
        .collect();
    let out = fast.write_consumed_many(&items).await.expect("a reply");
    assert_eq!(out.len(), 60);
    for (i, o) in out.iter().enumerate() {
        if newer(i) {
            assert!(matches!(o, Ok(false)), "item {i}: {o:?}");
        } else if third.contains(&owners[i]) {
            assert!(matches!(o, Ok(true)), "item {i}: {o:?}");
        } else {
            // Sent again after its pipeline met a redirect: written by
            // the first send or the second.
            assert!(o.is_ok(), "item {i}: {o:?}");
        }
    }
    for o in [&out[0], &out[1]] {
        assert!(
            matches!(o, Ok(true)),
            "the redirected key is written: {o:?}"
        );
    }
    for (i, t) in tokens.iter().enumerate() {
        let got = fields(&mut r, &key(&stores, t)).await;
        let want = if newer(i) {
            (
                Some("c".into()),
                Some("5".into()),
                Some("newer".into()),
                None,
            )
        } else {
            (
                Some("c".into()),
                Some("3".into()),
                Some(format!("r-{i}")),
                None,
            )
        };
        assert_eq!(got, want, "item {i}");
    }
    assert_eq!(
        redis_cli(moved_to.port, &["hget", &k0, "g"]).trim(),
        "3",
        "written on the slot's new owner"
    );
    assert_eq!(
        state_while_importing(dst.port, &k1).await.as_deref(),
        Some("c"),
        "written on the node importing the slot"
    );
    let resent = resends(&metrics);
    assert!(resent[0].1 >= 1 && resent[1].1 >= 1, "{resent:?}");

    // Versioned: the same batch again writes nothing, still mid-migration.
    let again = fast.write_consumed_many(&items).await.expect("a reply");
    assert!(again.iter().all(|o| matches!(o, Ok(false))), "{again:?}");
    finish_move(&masters(&cluster), &migrating, &src, &dst);
    for (i, t) in tokens.iter().enumerate() {
        let (_, g, _, _) = fields(&mut r, &key(&stores, t)).await;
        let want = if newer(i) { "5" } else { "3" };
        assert_eq!(g.as_deref(), Some(want), "item {i}");
    }
}

/// One master lost its scripts (`SCRIPT FLUSH` there): its pipeline's items
/// answer `NOSCRIPT`, so the script is loaded on it and those items sent
/// again, in one more pipeline; every item is written once, and the other
/// masters see one pipeline each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_that_lost_its_scripts_gets_them_again_and_its_items_written() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let (fast, metrics) = fast_tier(&stores);
    let mut r = cluster_conn(&cluster).await;
    let masters = masters(&cluster);
    warm_up(&fast, "ns").await;

    let tokens: Vec<String> = (0..45).map(|i| format!("wb_noscript-{i}")).collect();
    let mut owners = Vec::new();
    for t in &tokens {
        owners.push(owner(&cluster, &masters, &key(&stores, t)).await);
    }
    let flushed = masters[1].port;
    let on_flushed = owners.iter().filter(|p| **p == flushed).count() as u64;
    assert!(on_flushed > 5, "{on_flushed}");
    assert_eq!(redis_cli(flushed, &["script", "flush"]).trim(), "OK");

    let before: Vec<u64> = masters.iter().map(|m| calls(m.port, "evalsha")).collect();
    let (sent, keys) = pipelines(&metrics);
    let item_calls = tier_calls(&metrics, "writeback");
    let items: Vec<ConsumedWrite> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| write(t.clone(), 1, i, None))
        .collect();
    let out = fast.write_consumed_many(&items).await.expect("a reply");
    for (i, o) in out.iter().enumerate() {
        assert!(matches!(o, Ok(true)), "item {i}: {o:?}");
        let got = fields(&mut r, &key(&stores, &tokens[i])).await;
        assert_eq!(
            got,
            (
                Some("c".into()),
                Some("1".into()),
                Some(format!("r-{i}")),
                None
            ),
            "item {i}"
        );
    }
    for (m, evalsha) in masters.iter().zip(before) {
        let own = owners.iter().filter(|p| **p == m.port).count() as u64;
        let want = if m.port == flushed { 2 * own } else { own };
        assert_eq!(
            calls(m.port, "evalsha") - evalsha,
            want,
            "master {}: refused once, then run",
            m.port
        );
    }
    assert_eq!(
        pipelines(&metrics),
        (sent + 4, keys + 45.0 + on_flushed as f64),
        "one pipeline per master, and one more for the items refused"
    );
    assert_eq!(tier_calls(&metrics, "writeback") - item_calls, 0);
    assert!(resends(&metrics).iter().all(|(_, n)| *n == 0));
}
