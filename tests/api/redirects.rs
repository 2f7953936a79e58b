//! Redirects that the service's slot map did not see coming, on a private
//! plain Redis Cluster: a token's slot handed to another master (the old
//! owner answers `MOVED`), and a slot being migrated with the token's key
//! already on the target (the old owner answers `ASK`). A redirect proves the
//! command did not run, so the service follows it (to the named node, after
//! `ASKING` for an `ASK`): the consume answers 200 once and `duplicate`
//! after, never 503.

use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::calls::consumed_in_postgres;
use crate::helpers::cluster::{finish_move, masters, move_slot, move_slot_to};
use crate::helpers::procs::{redis_cli, Cluster, RedisProc};
use crate::helpers::*;

/// Waits until the node on `port` holds `key` as consumed (a durable
/// consume reaches Redis off the answer's path).
async fn consumed_on(port: u16, key: &str) {
    eventually(10, || async move {
        (redis_cli(port, &["hget", key, "s"]).trim() == "c").then_some(())
    })
    .await;
}

async fn consume_twice(app: &TestApp, token: &str, subject: &str, case: &str) {
    let body = json!({"subject": subject});
    let (status, _, first) = answer(app.consume(PAYMENTS, token, &body).await).await;
    assert_eq!(
        (status, first["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{case}: {first}"
    );
    let (status, _, again) = answer(app.consume(PAYMENTS, token, &body).await).await;
    assert_eq!(
        (status, again["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{case}: {again}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moved_and_ask_during_a_resharding_are_followed_and_consume_once() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let app = spawn_app_on(stores.clone()).await;
    // The connection made and the slot map read.
    let warm = app.issue(PAYMENTS, "like", "warm").await;
    consume_twice(&app, &warm, "warm", "before any move").await;

    for biz in ["like", "order"] {
        // MOVED: the slot is another master's now; the service's map says
        // the old one.
        let subject = format!("moved-{biz}");
        let token = app.issue(PAYMENTS, biz, &subject).await;
        let key = app.token_key(&token);
        let (_, _, dst) = move_slot(&cluster, &key, true);
        consume_twice(&app, &token, &subject, &format!("{biz} after MOVED")).await;
        consumed_on(dst.port, &key).await;

        // ASK: the key is on the target already, the slot still migrating
        // (the map is never refreshed by an ASK).
        let subject = format!("ask-{biz}");
        let token = app.issue(PAYMENTS, biz, &subject).await;
        let key = app.token_key(&token);
        let (slot, src, dst) = move_slot(&cluster, &key, false);
        consume_twice(&app, &token, &subject, &format!("{biz} during ASK")).await;
        // The migration finished: the key consumed on its new master, and
        // still consumed once.
        finish_move(&masters(&cluster), &slot, &src, &dst);
        consumed_on(dst.port, &key).await;
        let body = json!({"subject": subject});
        let (status, _, again) = answer(app.consume(PAYMENTS, &token, &body).await).await;
        assert_eq!(
            (status, again["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "{biz} after the migration: {again}"
        );
    }

    // The fast consumes reach Postgres, once each.
    let pool = app.pg().await;
    consumed_in_postgres(&pool, "like", 3, 15).await;
    pool.close().await;
    app.stop().await;
}

/// An `ASK` to a master added after the service read the slot map (it
/// served no slot then, so the cluster client holds no connection to it):
/// the first slot moved to it, with the token's key already there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ask_to_a_master_added_later_is_followed() {
    let cluster = Cluster::start();
    let stores = Stores::fresh().redis("").with(&cluster.config_line());
    let app = spawn_app_on(stores.clone()).await;
    let warm = app.issue(PAYMENTS, "like", "warm").await;
    consume_twice(&app, &warm, "warm", "before any move").await;

    let new = RedisProc::start_cluster_node();
    let seed = format!("127.0.0.1:{}", cluster.nodes[0].port);
    let added = format!("127.0.0.1:{}", new.port);
    let out = std::process::Command::new("redis-cli")
        .args(["--cluster", "add-node", &added, &seed])
        .output()
        .expect("redis-cli runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(text.contains("[OK] New node added correctly"), "{text}");
    eventually(20, || async {
        let known = redis_cli(cluster.nodes[0].port, &["cluster", "nodes"]);
        let masters = known
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .count();
        let info = new.cli(&["cluster", "info"]);
        (masters == 4 && info.contains("cluster_state:ok")).then_some(())
    })
    .await;

    for biz in ["like", "order"] {
        let subject = format!("ask-new-{biz}");
        let token = app.issue(PAYMENTS, biz, &subject).await;
        let key = app.token_key(&token);
        let (slot, src, dst) = move_slot_to(&cluster, &key, Some(new.port), false);
        assert_eq!(dst.port, new.port);
        consume_twice(
            &app,
            &token,
            &subject,
            &format!("{biz}: ASK to the new master"),
        )
        .await;
        finish_move(&masters(&cluster), &slot, &src, &dst);
        consumed_on(new.port, &key).await;
        let body = json!({"subject": subject});
        let (status, _, again) = answer(app.consume(PAYMENTS, &token, &body).await).await;
        assert_eq!(
            (status, again["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "{biz} after the migration: {again}"
        );
    }
    app.stop().await;
}
