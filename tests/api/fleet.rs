//! Two instances on the same stores, and restarts.

use std::collections::HashSet;
use std::sync::Arc;

use idempotency_ledger::token::TokenCodec;
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::calls::consume_race;
use crate::helpers::*;

fn worker_of(app: &TestApp, token: &str) -> u16 {
    let codec = TokenCodec::new(app.stores.settings().tokens.signing_keys.clone());
    codec.verify(token).expect("valid").claims.id.worker()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_instances_share_the_ledger() {
    let stores = Stores::fresh();
    let a = Arc::new(spawn_app_on(stores.clone()).await);
    let b = Arc::new(spawn_app_on(stores).await);
    assert_ne!(
        a.ledger.worker_id(),
        b.ledger.worker_id(),
        "leased worker ids differ"
    );

    // Issued by A, consumed on B at once.
    let token = a.issue(PAYMENTS, "order", "u").await;
    assert_eq!(worker_of(&a, &token), a.ledger.worker_id());
    let (_, _, body) = answer(b.consume(PAYMENTS, &token, &json!({"subject": "u"})).await).await;
    assert_eq!(body["outcome"], "consumed");
    let (_, _, body) = answer(a.consume(PAYMENTS, &token, &json!({"subject": "u"})).await).await;
    assert_eq!(body["outcome"], "duplicate");

    // Ids from both are unique.
    let mut ids = HashSet::new();
    for i in 0..50 {
        let app = if i % 2 == 0 { &a } else { &b };
        assert!(ids.insert(app.issue(PAYMENTS, "like", &format!("s{i}")).await));
    }

    // Concurrent consumes across both stay exactly once.
    for biz in ["order", "like"] {
        let mut tokens = Vec::new();
        for i in 0..30 {
            let issuer = if i % 2 == 0 { &a } else { &b };
            tokens.push(issuer.issue(PAYMENTS, biz, &format!("x{i}")).await);
        }
        let both = [a.clone(), b.clone()];
        let consumed = consume_race(&both, &tokens, 6, |i| format!("x{i}")).await;
        assert!(consumed.iter().all(|&n| n == 1), "{biz}: {consumed:?}");
    }
}

#[tokio::test]
async fn consumed_tokens_stay_duplicate_across_a_restart() {
    let stores = Stores::fresh();
    let app = spawn_app_on(stores.clone()).await;
    let mut tokens = Vec::new();
    for biz in ["order", "like", "refund"] {
        let token = app.issue(PAYMENTS, biz, "u").await;
        let (_, _, body) = answer(
            app.consume(
                PAYMENTS,
                &token,
                &json!({"subject": "u", "request_id": "r"}),
            )
            .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed");
        tokens.push(token);
    }
    let fresh = app.issue(PAYMENTS, "order", "u").await;
    app.stop().await;

    // Redis restarts empty too, for good measure.
    let app = spawn_app_on(stores).await;
    let mut redis = app.redis().await;
    for token in tokens.iter().chain([&fresh]) {
        let _: () = redis::cmd("DEL")
            .arg(app.token_key(token))
            .query_async(&mut redis)
            .await
            .unwrap();
    }
    // The fast journal must have reached Postgres before the stop; wait for it.
    let pool = app.pg().await;
    eventually(10, || {
        let pool = pool.clone();
        async move {
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE state = 'consumed'")
                .fetch_one(&pool)
                .await
                .ok()?;
            (n == 3).then_some(())
        }
    })
    .await;
    for token in &tokens {
        let (_, replayed, body) =
            answer(app.consume(PAYMENTS, token, &json!({"subject": "u"})).await).await;
        assert_eq!(
            (body["outcome"].as_str(), replayed),
            (Some("duplicate"), true),
            "{body}"
        );
        let (_, _, body) = answer(
            app.consume(PAYMENTS, token, &json!({"subject": "u", "request_id": "r"}))
                .await,
        )
        .await;
        assert_eq!(body["outcome"], "consumed");
    }
    let (_, _, body) = answer(
        app.consume(PAYMENTS, &fresh, &json!({"subject": "u"}))
            .await,
    )
    .await;
    assert_eq!(body["outcome"], "consumed");
}

#[tokio::test]
async fn a_lost_worker_id_lease_is_replaced_and_ids_stay_unique() {
    let app = spawn_app_on(Stores::fresh().with("tokens.worker_lease_ttl = \"3s\"")).await;
    let before = app.ledger.worker_id();
    let first = app.issue(PAYMENTS, "order", "u").await;
    // Another holder takes the worker id (as if our lease had expired).
    let pool = app.pg().await;
    sqlx::query("UPDATE worker_leases SET holder = '00000000-0000-0000-0000-000000000001' WHERE worker_id = $1")
        .bind(i32::from(before))
        .execute(&pool)
        .await
        .unwrap();
    // The next renewal (every second here) notices and leases another id.
    let after = eventually(10, || async {
        let w = app.ledger.worker_id();
        (w != before).then_some(w)
    })
    .await;
    let token = eventually(5, || async {
        let r = app
            .post(
                PAYMENTS,
                "/v1/tokens",
                &json!({"biz_type": "order", "subject": "u"}),
            )
            .await;
        if r.status() != StatusCode::CREATED {
            return None;
        }
        r.json::<serde_json::Value>().await.ok()?["token"]
            .as_str()
            .map(str::to_owned)
    })
    .await;
    assert_eq!(worker_of(&app, &token), after);
    assert_ne!(worker_of(&app, &first), after);
    let holders: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM worker_leases WHERE worker_id = $1 AND expires_at > now()",
    )
    .bind(i32::from(after))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(holders, 1);
}

#[tokio::test]
async fn graceful_stop_flushes_issuance_records() {
    let stores = Stores::fresh();
    let app = spawn_app_on(stores.clone()).await;
    let mut tokens = Vec::new();
    for i in 0..200 {
        tokens.push(app.issue(PAYMENTS, "order", &format!("s{i}")).await);
    }
    let pool = app.pg().await;
    app.stop().await;
    // Every record is in Postgres once the stop returns, with its audit row.
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tokens WHERE state = 'issued'")
        .fetch_one(&pool)
        .await
        .unwrap();
    let audits: i64 =
        sqlx::query_scalar("SELECT count(*) FROM audit_events WHERE kind = 'token.issued'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((n, audits), (200, 200));
    // And the worker id is free again.
    let live: i64 =
        sqlx::query_scalar("SELECT count(*) FROM worker_leases WHERE expires_at > now()")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(live, 0);
}
