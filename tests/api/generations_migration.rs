//! The generations migration (V4) on a populated database: rows issued and
//! consumed before it get generations 0 and 1; instances built before V4,
//! still running during a rollover, keep the parity through the triggers;
//! the database refuses a state its generation contradicts; and the service
//! runs on the migrated database.

use reqwest::StatusCode;
use serde_json::json;
use sqlx::Row;

use crate::helpers::calls::consume;
use crate::helpers::*;

mod embedded {
    refinery::embed_migrations!("migrations");
}

#[tokio::test]
async fn the_generations_migration_runs_on_a_populated_database() {
    let stores = Stores::fresh();
    let url = stores.db_url();
    idempotency_ledger::durable::setup::create_database_if_missing(&url)
        .await
        .expect("database");
    // The schema as it was before generations, with rows in every state.
    let (mut client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    let task = tokio::spawn(conn);
    embedded::migrations::runner()
        .set_target(refinery::Target::Version(3))
        .run_async(&mut client)
        .await
        .expect("V1..V3");
    client
        .batch_execute(
            "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                                 state, consumed_at, result)
             VALUES (1, 'order_a', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                     'issued', NULL, NULL),
                    (2, 'order_b', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                     'consumed', now(), NULL),
                    (3, 'like_c', 'like', 'fast', 'u', 'payments', now(), now() + interval '1h',
                     'consumed', now(), '{\"ok\": true}');
             INSERT INTO audit_events (kind, token_id, token) VALUES ('token.consumed', 2, 'order_b'),
                                                                     ('token.consumed', 3, 'like_c');",
        )
        .await
        .expect("rows of the old schema");
    drop(client);
    let _ = task.await;

    let applied = idempotency_ledger::durable::setup::migrate(&url)
        .await
        .expect("V4 on a populated database");
    assert!(applied >= 1, "V4 applied");
    let pg = sqlx::PgPool::connect(&url).await.expect("pool");
    let gens: Vec<(i64, i64)> = sqlx::query_as("SELECT id, gen FROM tokens ORDER BY id")
        .fetch_all(&pg)
        .await
        .expect("gens");
    assert_eq!(gens, [(1, 0), (2, 1), (3, 1)], "issued 0, consumed 1");

    // Instances built before V4, still running while a deploy rolls over,
    // change states without writing `gen`: the parity holds for them too.
    sqlx::raw_sql(
        "UPDATE tokens SET state = 'issued', consumed_at = NULL WHERE id = 2;
         UPDATE tokens SET state = 'consumed', consumed_at = now() WHERE id = 1;",
    )
    .execute(&pg)
    .await
    .expect("old-style state changes");
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, consumed_at)
         VALUES (4, 'order_d', 'order', 'durable', 'u', 'payments', now(), now() + interval '1h',
                 'consumed', now())",
    )
    .execute(&pg)
    .await
    .expect("an old-style consuming insert");
    let gens: Vec<(i64, i64)> = sqlx::query_as("SELECT id, gen FROM tokens ORDER BY id")
        .fetch_all(&pg)
        .await
        .expect("gens");
    assert_eq!(gens, [(1, 1), (2, 2), (3, 1), (4, 1)]);
    // And the database refuses a state its generation contradicts.
    let refused = sqlx::query("UPDATE tokens SET gen = 2 WHERE id = 3")
        .execute(&pg)
        .await
        .expect_err("consumed at an even generation");
    assert!(
        format!("{refused:?}").contains("tokens_gen_parity"),
        "{refused:?}"
    );
    pg.close().await;

    // The service runs on the migrated database: the token released by the
    // old-style statement is consumable again, at generation 3.
    let app = spawn_app_on(stores).await;
    let token = app.issue(PAYMENTS, "order", "u-1").await;
    let (status, _, body) = consume(&app, &token, json!({"subject": "u-1"})).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed"))
    );
    let pg = app.pg().await;
    let row = sqlx::query("SELECT gen, state::text AS state FROM tokens WHERE token = $1")
        .bind(&token)
        .fetch_one(&pg)
        .await
        .expect("row");
    assert_eq!(row.get::<i64, _>("gen"), 1);
    app.stop().await;
}
