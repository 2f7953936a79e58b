//! Retention by partition (migration V16, `durable::partitions`): a database
//! migrated from V15 keeps every row, constraint and decision; ids land in
//! the partition of their day, and `tokens_default` catches the rest;
//! reconcile drops a day partition whose rows are all past retention (an
//! order's token too: the order keeps its events) and keeps one with a row
//! still within it.

use chrono::{Duration, Utc};
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use idempotency_ledger::domain::key::identity;
use idempotency_ledger::domain::{key::ClientKey, BizType};
use idempotency_ledger::token::{Claims, SnowflakeId, TokenCodec};

use crate::helpers::calls::{consume, reconcile};
use crate::helpers::schema::{database_at, id_at_noon};
use crate::helpers::*;

/// `stores`' database created and migrated up to V15 (before partitions).
async fn database_at_v15(stores: &Stores) {
    database_at(stores, 15).await;
}

fn sign(stores: &Stores, id: i64, exp_unix: i64, subject: &str) -> String {
    let codec = TokenCodec::new(stores.settings().tokens.signing_keys.clone());
    codec.sign(
        &Claims {
            biz_type: BizType::parse("order").expect("biz"),
            id: SnowflakeId(u64::try_from(id).expect("a snowflake id")),
            exp: u32::try_from(exp_unix).expect("exp"),
        },
        PAYMENTS_CLIENT,
        subject,
    )
}

const PAYMENTS_CLIENT: &str = "payments";

/// An `order` token row; `state` 'issued' or 'consumed' (at generation 1,
/// `consumed_at` now, by request `r-old`).
async fn insert_token(pg: &PgPool, id: i64, token: &str, subject: &str, state: &str) {
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, gen, consumed_at, request_id)
         VALUES ($1, $2, 'order', 'durable', $3, 'payments', now(), now() + interval '1 hour',
                 $4::token_state, CASE WHEN $4 = 'consumed' THEN 1 ELSE 0 END,
                 CASE WHEN $4 = 'consumed' THEN now() END,
                 CASE WHEN $4 = 'consumed' THEN 'r-old' END)",
    )
    .bind(id)
    .bind(token)
    .bind(subject)
    .bind(state)
    .execute(pg)
    .await
    .expect("token row");
}

/// Every row of `tokens`, in id order, as JSON text.
async fn every_row(pg: &PgPool) -> String {
    sqlx::query_scalar(
        "SELECT coalesce(jsonb_agg(to_jsonb(t) ORDER BY t.id), '[]')::text FROM tokens t",
    )
    .fetch_one(pg)
    .await
    .expect("rows")
}

/// The names of `tokens`' constraints, indexes and triggers, sorted.
async fn schema_names(pg: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT n FROM (
             SELECT 'constraint ' || conname AS n FROM pg_constraint WHERE conrelid = 'tokens'::regclass
             UNION ALL
             SELECT 'index ' || indexrelid::regclass::text FROM pg_index WHERE indrelid = 'tokens'::regclass
             UNION ALL
             SELECT 'trigger ' || tgname FROM pg_trigger
              WHERE tgrelid = 'tokens'::regclass AND NOT tgisinternal
         ) s ORDER BY n",
    )
    .fetch_all(pg)
    .await
    .expect("schema names")
}

async fn partition_of(pg: &PgPool, id: i64) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM tokens WHERE id = $1")
        .bind(id)
        .fetch_one(pg)
        .await
        .expect("row")
}

#[tokio::test]
async fn a_database_migrated_to_day_partitions_keeps_every_row_and_decision() {
    let stores = Stores::fresh();
    database_at_v15(&stores).await;
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    let now = now_ms();
    let exp = now / 1000 + 3600;
    let issued_id = SnowflakeId::from_parts(now - 2_000, 1023, 1).as_i64();
    let consumed_id = SnowflakeId::from_parts(now - 1_000, 1023, 2).as_i64();
    let issued = sign(&stores, issued_id, exp, "u-1");
    let consumed = sign(&stores, consumed_id, exp, "u-1");
    insert_token(&pg, issued_id, &issued, "u-1", "issued").await;
    insert_token(&pg, consumed_id, &consumed, "u-1", "consumed").await;
    sqlx::query("UPDATE tokens SET result = '{\"paid\": true}', result_at = now() WHERE id = $1")
        .bind(consumed_id)
        .execute(&pg)
        .await
        .expect("a result");
    let before = every_row(&pg).await;
    let names_before = schema_names(&pg).await;
    pg.close().await;

    idempotency_ledger::durable::setup::migrate(&stores.db_url())
        .await
        .expect("V16 on a populated database");
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    assert_eq!(every_row(&pg).await, before, "every row, every column");
    // V19 (after V16) replaces the purge's index.
    let mut names_after: Vec<String> = names_before
        .iter()
        .map(|n| n.replace("tokens_purgeable_idx", "tokens_consumed_purge_idx"))
        .collect();
    names_after.sort();
    let mut names_now = schema_names(&pg).await;
    names_now.sort();
    assert_eq!(
        names_now, names_after,
        "the same constraints, indexes and triggers, by name"
    );
    let kind: String =
        sqlx::query_scalar("SELECT relkind::text FROM pg_class WHERE oid = 'tokens'::regclass")
            .fetch_one(&pg)
            .await
            .expect("relkind");
    assert_eq!(kind, "p", "tokens is partitioned");
    assert_eq!(partition_of(&pg, consumed_id).await, "tokens_base");
    let days: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
          WHERE i.inhparent = 'tokens'::regclass AND c.relname ~ '^tokens_p[0-9]{8}$'",
    )
    .fetch_one(&pg)
    .await
    .expect("day partitions");
    assert!(days >= 7, "the days ahead are made: {days}");
    pg.close().await;

    // The service answers the old tokens as before: the issued one is
    // consumed once, the consumed one is a duplicate with its result.
    let app = spawn_app_on(stores).await;
    let (status, _, body) = consume(&app, &issued, json!({"subject": "u-1"})).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("consumed")),
        "{body}"
    );
    let (status, _, body) = consume(&app, &consumed, json!({"subject": "u-1"})).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    assert_eq!(body["result"], json!({"paid": true}), "{body}");
    app.stop().await;
}

#[tokio::test]
async fn a_duplicate_consume_across_the_migration_still_loses() {
    let stores = Stores::fresh();
    database_at_v15(&stores).await;
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    let now = now_ms();
    let id = SnowflakeId::from_parts(now - 1_000, 1023, 7).as_i64();
    let token = sign(&stores, id, now / 1000 + 3600, "u-2");
    insert_token(&pg, id, &token, "u-2", "consumed").await;
    // A client key consumed before the migration (V6's row of a key).
    let key = format!("k-{}", uuid::Uuid::new_v4());
    let ident = identity(
        PAYMENTS_CLIENT,
        &BizType::parse("order").expect("biz"),
        &ClientKey::parse(&key).expect("key"),
    );
    sqlx::query(
        "INSERT INTO tokens (id, token, key, biz_type, durability, subject, client, issued_at,
                             expires_at, state, gen, consumed_at, request_id)
         VALUES ($1, $2, $3, 'order', 'durable', '', 'payments', now(), now(), 'consumed', 1,
                 now(), 'r-old')",
    )
    .bind(ident.id)
    .bind(&ident.handle)
    .bind(&key)
    .execute(&pg)
    .await
    .expect("key row");
    pg.close().await;
    idempotency_ledger::durable::setup::migrate(&stores.db_url())
        .await
        .expect("V16");

    let app = spawn_app_on(stores).await;
    let (status, _, body) = consume(
        &app,
        &token,
        json!({"subject": "u-2", "request_id": "r-new"}),
    )
    .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    let (status, _, body) = answer(
        app.post(
            PAYMENTS,
            "/v1/keys/consume",
            &json!({"biz_type": "order", "key": key, "request_id": "r-new"}),
        )
        .await,
    )
    .await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("duplicate")),
        "{body}"
    );
    // A key first consumed after the migration: one winner among racers
    // (the arbiter is now (client, biz_type, key, id)).
    let fresh = format!("k-{}", uuid::Uuid::new_v4());
    let racers = (0..8).map(|i| {
        let app = &app;
        let fresh = fresh.clone();
        async move {
            answer(
                app.post(
                    PAYMENTS,
                    "/v1/keys/consume",
                    &json!({"biz_type": "order", "key": fresh, "request_id": format!("r-{i}")}),
                )
                .await,
            )
            .await
        }
    });
    let answers: Vec<(StatusCode, bool, Value)> = futures_util::future::join_all(racers).await;
    let won = answers
        .iter()
        .filter(|(s, _, b)| *s == StatusCode::OK && b["outcome"] == "consumed")
        .count();
    let lost = answers
        .iter()
        .filter(|(s, _, b)| *s == StatusCode::OK && b["outcome"] == "duplicate")
        .count();
    assert_eq!((won, lost), (1, 7), "{answers:?}");
    app.stop().await;
}

fn day_name(days: i64) -> String {
    let day = Utc::now().date_naive() + Duration::days(days);
    format!("tokens_p{}", day.format("%Y%m%d"))
}

/// As if migrated 40 days ago (`tokens_base` ends then), with a partition
/// of its own for each of `days` (relative to today, UTC).
async fn migrated_40_days_ago_with(pg: &PgPool, days: &[i64]) {
    sqlx::raw_sql(
        "ALTER TABLE tokens DETACH PARTITION tokens_base;
         ALTER TABLE tokens ATTACH PARTITION tokens_base FOR VALUES FROM (MINVALUE)
             TO (tokens_day_first_id((now() AT TIME ZONE 'UTC')::date - 40));",
    )
    .execute(pg)
    .await
    .expect("tokens_base ends 40 days ago");
    for day in days {
        sqlx::query("SELECT tokens_add_day_partition((now() AT TIME ZONE 'UTC')::date + $1::int)")
            .bind(i32::try_from(*day).expect("a day"))
            .execute(pg)
            .await
            .expect("an old day partition");
    }
}

/// A bare row: `state` issued or consumed, `consumed_at` and `expires_at` as
/// intervals from now, bound to `order_id`.
async fn insert_row(
    pg: &PgPool,
    id: i64,
    state: &str,
    consumed_at: Option<&str>,
    expires_at: &str,
    order_id: Option<&str>,
) {
    sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, gen, consumed_at, order_id)
         VALUES ($1, 't' || $1, 'order', 'durable', 'u', 'payments', now() - interval '40 days',
                 now() + $3::interval, $2::token_state, CASE WHEN $2 = 'consumed' THEN 1 ELSE 0 END,
                 now() + $4::interval, $5)",
    )
    .bind(id)
    .bind(state)
    .bind(expires_at)
    .bind(consumed_at)
    .bind(order_id)
    .execute(pg)
    .await
    .expect("row");
}

#[tokio::test]
async fn ids_land_in_the_partition_of_their_day_and_the_default_catches_the_rest() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    let (tomorrow, after) = (id_at_noon(1), id_at_noon(2));
    let far = id_at_noon(60);
    for id in [tomorrow, after, far] {
        insert_row(&pg, id, "issued", None, "1 hour", None).await;
    }
    assert_eq!(partition_of(&pg, tomorrow).await, day_name(1));
    assert_eq!(partition_of(&pg, after).await, day_name(2));
    assert_eq!(
        partition_of(&pg, far).await,
        "tokens_default",
        "no partition is made 60 days ahead"
    );
    // The primary key holds across partitions.
    let again = sqlx::query(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at)
         VALUES ($1, 'x', 'order', 'durable', 'u', 'payments', now(), now())",
    )
    .bind(tomorrow)
    .execute(&pg)
    .await
    .expect_err("one row per id");
    assert!(format!("{again:?}").contains("23505"), "{again:?}");
    app.stop().await;
}

#[tokio::test]
async fn reconcile_drops_a_day_partition_past_retention_and_keeps_one_with_a_row_within_it() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    // Three old days have partitions of their own.
    migrated_40_days_ago_with(&pg, &[-35, -34, -33]).await;
    let (d35, d34, d33) = (id_at_noon(-35), id_at_noon(-34), id_at_noon(-33));
    // Day -35: every row past retention (7 d): dropped whole.
    insert_row(&pg, d35, "consumed", Some("-30 days"), "-30 days", None).await;
    insert_row(&pg, d35 + 1, "issued", None, "-30 days", None).await;
    // Day -34: one row past retention, one consumed a day ago: kept, and its
    // purgeable row deleted on its own.
    insert_row(&pg, d34, "consumed", Some("-30 days"), "-30 days", None).await;
    insert_row(&pg, d34 + 1, "consumed", Some("-1 day"), "-1 day", None).await;
    // Day -33: a token bound to an order, past retention like the rest:
    // dropped whole (the order keeps its events; see
    // a_paid_orders_token_goes_with_its_day_and_the_order_still_answers_a_repeat).
    insert_row(
        &pg,
        d33,
        "consumed",
        Some("-30 days"),
        "-30 days",
        Some("o-1"),
    )
    .await;
    insert_row(&pg, d33 + 1, "issued", None, "-30 days", None).await;
    // Tomorrow's partition is within its bound: its rows wait for its drop,
    // even one the row-by-row purge would take.
    let tomorrow = id_at_noon(1);
    insert_row(
        &pg,
        tomorrow,
        "consumed",
        Some("-30 days"),
        "-30 days",
        None,
    )
    .await;

    let report = reconcile(&app).await;
    assert_eq!(report["errors"], json!([]), "{report}");
    assert_eq!(report["found"]["expired_purgeable"], json!(5), "{report}");
    assert_eq!(
        report["repaired"]["expired_purgeable"],
        json!(5),
        "{report}"
    );
    let exists = |name: String| {
        let pg = pg.clone();
        async move {
            sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
                .bind(name)
                .fetch_one(&pg)
                .await
                .expect("to_regclass")
        }
    };
    assert!(!exists(day_name(-35)).await, "day -35 dropped");
    assert!(exists(day_name(-34)).await, "day -34 kept");
    assert!(!exists(day_name(-33)).await, "day -33 dropped");
    let left: Vec<i64> = sqlx::query_scalar("SELECT id FROM tokens WHERE id = ANY($1) ORDER BY id")
        .bind(vec![d35, d35 + 1, d34, d34 + 1, d33, d33 + 1, tomorrow])
        .fetch_all(&pg)
        .await
        .expect("rows left");
    assert_eq!(left, [d34 + 1, tomorrow]);
    let audit: Value = sqlx::query_scalar(
        "SELECT detail FROM audit_events
          WHERE kind = 'reconcile.repaired' AND detail->>'action' = 'partition_dropped'
            AND detail->>'partition' = $1",
    )
    .bind(day_name(-35))
    .fetch_one(&pg)
    .await
    .expect("one audit row for the dropped partition");
    assert_eq!(audit["partition"], json!(day_name(-35)), "{audit}");
    assert_eq!(audit["entries"], json!(2), "{audit}");
    assert_eq!(audit["class"], json!("expired_purgeable"), "{audit}");

    // A second run finds nothing more.
    let report = reconcile(&app).await;
    assert_eq!(report["found"]["expired_purgeable"], json!(0), "{report}");
    app.stop().await;
}

/// An order's token follows retention like every other token, so a day
/// partition holding one is dropped whole once past its bound (before V19
/// such a day was kept, and with orders in use nearly every day was). The
/// order's record is its events: a repeat of the event is still answered
/// from them (a duplicate, the winner's replay, 422 for another
/// fingerprint, 409 on another order), and the consistency check does not
/// count a token row gone with retention against its order, while a row
/// missing within retention still is.
#[tokio::test]
async fn a_paid_orders_token_goes_with_its_day_and_the_order_still_answers_a_repeat() {
    let app = spawn_app().await;
    let pg = app.pg().await;
    migrated_40_days_ago_with(&pg, &[-33]).await;
    let exp = Utc::now().timestamp() + 3_600;
    let (kept_id, lost_id) = (id_at_noon(-33), id_at_noon(-33) + 1);
    let paid = sign(&app.stores, kept_id, exp, "alice");
    let lost = sign(&app.stores, lost_id, exp, "alice");
    for (order, token) in [("o-kept", &paid), ("o-lost", &lost)] {
        let r = app
            .post(
                PAYMENTS,
                "/v1/orders",
                &json!({"order_id": order, "subject": "alice", "amount_minor": 1000, "currency": "CNY"}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::CREATED, "create {order}");
        let r = app
            .post(
                PAYMENTS,
                &format!("/v1/orders/{order}/pay"),
                &json!({"token": token, "request_id": "pay-1", "fingerprint": "fp"}),
            )
            .await;
        assert_eq!(r.status(), StatusCode::OK, "pay {order}");
    }
    assert_eq!(partition_of(&pg, kept_id).await, day_name(-33));
    // o-kept: paid 30 days ago, its token long expired. o-lost: paid now,
    // and its token's row lost by hand (no purge takes it within retention).
    sqlx::raw_sql(&format!(
        "UPDATE tokens SET consumed_at = now() - interval '30 days',
                           expires_at = now() - interval '30 days' WHERE id = {kept_id};
         UPDATE order_events SET at = now() - interval '30 days' WHERE order_id = 'o-kept';
         DELETE FROM tokens WHERE id = {lost_id};"
    ))
    .execute(&pg)
    .await
    .expect("aged");

    let report = reconcile(&app).await;
    assert_eq!(report["errors"], json!([]), "{report}");
    assert_eq!(
        report["repaired"]["expired_purgeable"],
        json!(1),
        "{report}"
    );
    let day_left: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(day_name(-33))
        .fetch_one(&pg)
        .await
        .expect("to_regclass");
    assert!(
        !day_left,
        "the day of a paid order's token is dropped: {report}"
    );
    assert_eq!(report["found"]["order_inconsistent"], json!(1), "{report}");
    let inconsistent = &report["inconsistent_orders"];
    assert_eq!(inconsistent[0]["order_id"], json!("o-lost"), "{report}");

    let repeat = |body: Value, order: &'static str| {
        let app = &app;
        async move {
            let r = app
                .post(PAYMENTS, &format!("/v1/orders/{order}/pay"), &body)
                .await;
            let status = r.status();
            let replayed = r.headers().contains_key("idempotent-replayed");
            (status, replayed, r.json::<Value>().await.expect("json"))
        }
    };
    let (s, replayed, b) = repeat(json!({"token": paid}), "o-kept").await;
    assert_eq!(
        (s, replayed, b["outcome"].as_str()),
        (StatusCode::OK, true, Some("duplicate")),
        "{b}"
    );
    assert_eq!(b["order"]["state"], "PAID", "{b}");
    let (s, _, b) = repeat(json!({"token": paid, "request_id": "pay-1"}), "o-kept").await;
    assert_eq!(
        (s, b["outcome"].as_str()),
        (StatusCode::OK, Some("applied")),
        "{b}"
    );
    let (s, _, b) = repeat(json!({"token": paid, "fingerprint": "other"}), "o-kept").await;
    assert_eq!(
        (s, b["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "the event keeps its fingerprint: {b}"
    );
    let (s, _, b) = repeat(json!({"token": paid}), "o-lost").await;
    assert_eq!(
        (s, b["error"].as_str()),
        (StatusCode::CONFLICT, Some("token_already_used")),
        "{b}"
    );
    let events: i64 = sqlx::query_scalar("SELECT count(*) FROM order_events WHERE token_id = $1")
        .bind(kept_id)
        .fetch_one(&pg)
        .await
        .expect("events");
    assert_eq!(events, 1, "one event per token");
    app.stop().await;
}

/// An order event written before V19 (no fingerprint of its own) gets its
/// token's at the upgrade (V21), so that once retention takes the token's
/// row a repeat with another fingerprint is still 422.
#[tokio::test]
async fn an_order_event_from_before_the_upgrade_keeps_its_fingerprint_past_its_tokens_row() {
    let stores = Stores::fresh();
    database_at(&stores, 18).await;
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    // Paid 30 days ago, as a repeat past retention finds it: issued, paid
    // and expired long ago (older than the issued-token filter's horizon).
    let id = id_at_noon(-30);
    let paid = sign(&stores, id, Utc::now().timestamp() - 29 * 86_400, "alice");
    sqlx::raw_sql(&format!(
        "INSERT INTO tokens (id, token, biz_type, durability, subject, client, issued_at, expires_at,
                             state, gen, consumed_at, fingerprint, request_id, order_id)
         VALUES ({id}, '{paid}', 'order', 'durable', 'alice', '{PAYMENTS_CLIENT}',
                 now() - interval '30 days', now() - interval '29 days', 'consumed', 1,
                 now() - interval '30 days', 'fp', 'pay-1', 'o-old');
         INSERT INTO orders (order_id, client, subject, state, amount_minor, currency)
         VALUES ('o-old', '{PAYMENTS_CLIENT}', 'alice', 'PAID', 1000, 'CNY');
         INSERT INTO order_events (order_id, kind, token_id, token, amount_minor, request_id)
         VALUES ('o-old', 'order.created', NULL, NULL, 1000, NULL),
                ('o-old', 'order.paid', {id}, '{paid}', 1000, 'pay-1');"
    ))
    .execute(&pg)
    .await
    .expect("an order paid before V19");
    pg.close().await;

    idempotency_ledger::durable::setup::migrate(&stores.db_url())
        .await
        .expect("V19..");
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    let fingerprint: Option<String> =
        sqlx::query_scalar("SELECT fingerprint FROM order_events WHERE token_id = $1")
            .bind(id)
            .fetch_one(&pg)
            .await
            .expect("event");
    assert_eq!(fingerprint.as_deref(), Some("fp"));
    // Retention takes the token's row: the event still answers.
    sqlx::query("DELETE FROM tokens WHERE id = $1")
        .bind(id)
        .execute(&pg)
        .await
        .expect("purged");
    let app = spawn_app_on(stores).await;
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders/o-old/pay",
            &json!({"token": paid, "fingerprint": "other"}),
        )
        .await;
    let status = r.status();
    let body: Value = r.json().await.expect("json");
    assert_eq!(
        (status, body["error"].as_str()),
        (
            StatusCode::UNPROCESSABLE_ENTITY,
            Some("fingerprint_mismatch")
        ),
        "{body}"
    );
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders/o-old/pay",
            &json!({"token": paid, "fingerprint": "fp", "request_id": "pay-1"}),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    app.stop().await;
}
