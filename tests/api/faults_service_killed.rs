//! The service itself SIGKILLed mid-load (the built binary, `procs`): no
//! token is consumed twice across the restart, no `consumed` answer is lost,
//! and none is burnt (a token whose consume never committed is consumable
//! again, exactly once).
//! These are among the slow tests of the suite (each a few seconds); they run
//! in CI with the rest (filter: `cargo test --test api faults`). Every
//! request carries a client timeout (`helpers::bounded`): a hung request
//! fails the test instead of hanging it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::bounded::*;
use crate::helpers::procs::*;
use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn service_killed_mid_load_never_double_consumes_nor_burns_tokens() {
    let stores = Stores::fresh();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = format!(
        "[postgres]\nurl = \"{}\"\n[redis]\nurl = \"{REDIS_URL}\"\nkey_prefix = \"{}\"\n",
        stores.db_url(),
        stores.prefix
    );
    let mut first = LedgerProc::start(dir.path(), "first", &config);
    first.wait_ready().await;
    let http = bounded_client();
    let base = first.address();
    const N: usize = 150;
    let mut tokens = Vec::new();
    for i in 0..N {
        let subject = format!("s{i}");
        let r = http
            .post(format!("{base}/v1/tokens"))
            .bearer_auth(PAYMENTS)
            .json(&json!({"biz_type": "order", "subject": subject}))
            .send()
            .await
            .expect("issue");
        let body: Value = r.json().await.expect("json");
        tokens.push((body["token"].as_str().expect("token").to_owned(), subject));
    }

    // Three attempts per token (each its own request_id); SIGKILL as soon
    // as a quarter has answered (told by the answer that makes the quarter,
    // not by polling: batched consumes answer many at once, and the rest
    // could all answer within one polling interval).
    let answered = Arc::new(AtomicUsize::new(0));
    let quarter = Arc::new(tokio::sync::Notify::new());
    let mut handles = Vec::new();
    for (i, (token, subject)) in tokens.iter().enumerate() {
        for c in 0..3 {
            let (http, base, answered, quarter) = (
                http.clone(),
                base.clone(),
                answered.clone(),
                quarter.clone(),
            );
            let rid = format!("first-{i}-{c}");
            let (token, body) = (
                token.clone(),
                json!({"subject": subject, "request_id": rid}),
            );
            handles.push(tokio::spawn(async move {
                let out = try_consume(&http, &base, &token, &body).await;
                if out.is_some() && answered.fetch_add(1, Ordering::Relaxed) + 1 == N * 3 / 4 {
                    quarter.notify_one();
                }
                (i, rid, out)
            }));
        }
    }
    tokio::time::timeout(Duration::from_secs(30), quarter.notified())
        .await
        .expect("a quarter of the consumes answered within 30 s");
    first.kill();
    let mut consumed_first = vec![0; N];
    let mut unanswered = vec![Vec::new(); N];
    for h in handles {
        let (i, rid, out) = h.await.expect("task");
        match out {
            Some((s, _, body)) => {
                assert_eq!(s, StatusCode::OK, "{body}");
                if body["outcome"] == "consumed" {
                    consumed_first[i] += 1;
                }
            }
            None => unanswered[i].push(rid),
        }
    }
    let lost: usize = unanswered.iter().map(Vec::len).sum();
    assert!(lost > 0, "the kill came mid-load");
    assert!(consumed_first.iter().all(|&n| n <= 1), "{consumed_first:?}");

    // Postgres finishes what the dead process had sent, then we look.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&stores.db_url())
        .await
        .expect("pool");
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let busy: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
                    AND pid <> pg_backend_pid() AND state = 'active'",
            )
            .fetch_one(&pool)
            .await
            .ok()?;
            (busy == 0).then_some(())
        }
    })
    .await;
    let mut committed: HashMap<String, Option<String>> = HashMap::new();
    for (token, _) in &tokens {
        let row: Option<(String, Option<String>)> =
            sqlx::query_as("SELECT state::text, request_id FROM tokens WHERE token = $1")
                .bind(token)
                .fetch_optional(&pool)
                .await
                .expect("row");
        if let Some((state, rid)) = row {
            if state == "consumed" {
                committed.insert(token.clone(), rid);
            }
        }
    }
    // No lost acknowledgement: every `consumed` answer is committed.
    for (i, (token, _)) in tokens.iter().enumerate() {
        if consumed_first[i] == 1 {
            assert!(
                committed.contains_key(token),
                "token {i} answered consumed but not committed"
            );
        }
    }

    let mut second = LedgerProc::start(dir.path(), "second", &config);
    second.wait_ready().await;
    let base = second.address();
    // Committed tokens: duplicates for everyone, `consumed` again only for
    // the attempt that won (whose answer may have been lost).
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let Some(rid) = committed.get(token) else {
            continue;
        };
        let (s, _, body) = try_consume(
            &http,
            &base,
            token,
            &json!({"subject": subject, "request_id": "second"}),
        )
        .await
        .expect("answered");
        assert_eq!(
            (s, body["outcome"].as_str()),
            (StatusCode::OK, Some("duplicate")),
            "token {i}"
        );
        if let Some(rid) = rid {
            let (_, replayed, body) = try_consume(
                &http,
                &base,
                token,
                &json!({"subject": subject, "request_id": rid}),
            )
            .await
            .expect("answered");
            assert_eq!(
                (body["outcome"].as_str(), replayed),
                (Some("consumed"), true),
                "token {i}"
            );
        }
    }
    // Tokens whose consume never committed are consumable again within 10 s
    // (their provisional markers expire), exactly once.
    let open: Vec<usize> = (0..N)
        .filter(|i| !committed.contains_key(&tokens[*i].0))
        .collect();
    assert!(
        open.iter().all(|i| consumed_first[*i] == 0),
        "an uncommitted token answered consumed"
    );
    let lost_but_committed = (0..N)
        .filter(|i| {
            !unanswered[*i].is_empty()
                && consumed_first[*i] == 0
                && committed.contains_key(&tokens[*i].0)
        })
        .count();
    eprintln!(
        "service kill: {lost} consumes unanswered; {} tokens committed ({lost_but_committed} of them with the winner's answer lost); {} open",
        committed.len(),
        open.len()
    );
    let remaining = Arc::new(std::sync::Mutex::new(open.clone()));
    let freeing = std::time::Instant::now();
    eventually(10, || {
        let (http, base, remaining, tokens) = (
            http.clone(),
            base.clone(),
            remaining.clone(),
            tokens.clone(),
        );
        async move {
            let todo: Vec<usize> = remaining.lock().expect("lock").clone();
            let mut left = Vec::new();
            for i in todo {
                let (token, subject) = &tokens[i];
                let out = try_consume(
                    &http,
                    &base,
                    token,
                    &json!({"subject": subject, "request_id": "second"}),
                )
                .await
                .expect("answered");
                match out.2["outcome"].as_str() {
                    Some("consumed") => {}
                    Some("duplicate") => {
                        assert_eq!(
                            out.2["status"], "processing",
                            "token {i} is only held by a dead attempt"
                        );
                        left.push(i);
                    }
                    _ => panic!("token {i}: {:?}", out),
                }
            }
            let done = left.is_empty();
            *remaining.lock().expect("lock") = left;
            done.then_some(())
        }
    })
    .await;
    eprintln!(
        "service kill: open tokens consumable again after {:?}",
        freeing.elapsed()
    );
    // And now every token is spent exactly once.
    for (i, (token, subject)) in tokens.iter().enumerate() {
        let (_, _, body) = try_consume(&http, &base, token, &json!({"subject": subject}))
            .await
            .expect("answered");
        assert_eq!(body["outcome"], "duplicate", "token {i}");
    }
    second.kill();
}
