//! Audit events by token day (migration V22) and audit retention: a database
//! migrated from V21 keeps every event, its ids and its seals; events land
//! in the partition of their token's day, events without a token in the
//! default one; a day partition past `audit.retention` whose tokens are gone
//! is verified against its seals, recorded and dropped by reconcile, and
//! `audit verify` still passes after the drop, but not once the retirement
//! record is removed or forged; a day whose events were edited, or are not
//! sealed yet, is kept.

use std::time::Duration;

use chrono::{Duration as Days, Utc};
use futures_util::TryStreamExt;
use serde_json::{json, Value};
use sqlx::PgPool;

use idempotency_ledger::audit_seal::chain::{Chain, MacFields, RetirementFields, Version, GENESIS};
use idempotency_ledger::audit_seal::{SealPass, Seals};
use idempotency_ledger::config::{AuditSettings, SealKey};
use idempotency_ledger::durable::seal as seal_sql;

use crate::helpers::calls::reconcile;
use crate::helpers::schema::{database_at, id_at_noon};
use crate::helpers::*;

/// The default config's (development) seal key: the CLI's `audit verify`
/// checks with it.
const KEY_A1: (&str, &str) = ("a1", "development-only-audit-seal-secret-0123456789");

fn seals(pool: PgPool) -> Seals {
    let settings = AuditSettings {
        seal_every: Duration::from_millis(200),
        seal_keys: vec![SealKey {
            id: KEY_A1.0.to_owned(),
            secret: KEY_A1.1.as_bytes().to_vec(),
        }],
        retention: None,
    };
    Seals::new(&settings, pool)
}

async fn seal(seals: &Seals) -> i64 {
    match seals.seal_once().await.expect("a sealing pass") {
        SealPass::Sealed { events, .. } => events,
        other => panic!("not sealed: {other:?}"),
    }
}

/// `audit verify`: exit code and its JSON summary.
async fn verify(stores: &Stores) -> (Option<i32>, Value) {
    let out = cli(&cli_config(stores), &["audit", "verify"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    (
        out.status.code(),
        serde_json::from_str(&stdout).unwrap_or_else(
            |_| json!({"stdout": stdout, "stderr": String::from_utf8_lossy(&out.stderr)}),
        ),
    )
}

fn audit_day(days: i64) -> String {
    let day = Utc::now().date_naive() + Days::days(days);
    format!("audit_events_p{}", day.format("%Y%m%d"))
}

/// One audit event for `token_id` (NULL for `None`), written `age` ago.
async fn event(pg: &PgPool, kind: &str, token_id: Option<i64>, age: &str, note: &str) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO audit_events (at, kind, token_id, subject, biz_type, client, detail)
         VALUES (now() - $3::interval, $1::audit_kind, $2, 'u-1', 'order', 'payments',
                 jsonb_build_object('note', $4::text))
         RETURNING id",
    )
    .bind(kind)
    .bind(token_id)
    .bind(age)
    .bind(note)
    .fetch_one(pg)
    .await
    .expect("an audit event")
}

async fn partition_of_event(pg: &PgPool, id: i64) -> String {
    sqlx::query_scalar("SELECT tableoid::regclass::text FROM audit_events WHERE id = $1")
        .bind(id)
        .fetch_one(pg)
        .await
        .expect("event")
}

async fn exists(pg: &PgPool, table: &str) -> bool {
    sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(table)
        .fetch_one(pg)
        .await
        .expect("to_regclass")
}

/// A version 1 checkpoint over every event, as the sealer wrote them
/// before V22 (one chain over the range, the v1 MAC).
async fn seal_flat_v21(pg: &PgPool) {
    let events: Vec<_> = seal_sql::events(pg, None, i64::MAX, i64::MAX)
        .try_collect()
        .await
        .expect("events");
    let mut chain = Chain::new(&GENESIS);
    for e in &events {
        chain.push(e);
    }
    let sealed = chain.finish();
    let (id, sealed_at): (i64, chrono::DateTime<Utc>) = sqlx::query_as(
        "SELECT nextval(pg_get_serial_sequence('audit_checkpoints', 'id')), clock_timestamp()",
    )
    .fetch_one(pg)
    .await
    .expect("checkpoint id");
    let (first, last) = (
        sealed.first_event_id.expect("events"),
        sealed.last_event_id.expect("events"),
    );
    let mac = MacFields {
        version: Version::Flat,
        id,
        sealed_at,
        first_event_id: first,
        last_event_id: last,
        events: sealed.events,
        prev_digest: &GENESIS,
        digest: &sealed.digest,
        key_id: KEY_A1.0,
    }
    .mac(KEY_A1.1.as_bytes());
    sqlx::query(
        "INSERT INTO audit_checkpoints
                (id, sealed_at, first_event_id, last_event_id, events, prev_digest, digest, key_id, mac)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
    )
    .bind(id)
    .bind(sealed_at)
    .bind(first)
    .bind(last)
    .bind(sealed.events)
    .bind(hex::encode(GENESIS))
    .bind(hex::encode(sealed.digest))
    .bind(KEY_A1.0)
    .bind(hex::encode(mac))
    .execute(pg)
    .await
    .expect("a v1 checkpoint");
}

#[tokio::test]
async fn a_database_migrated_to_audit_partitions_keeps_every_event_its_ids_and_its_seals() {
    let stores = Stores::fresh().with("[audit]\nseal_every = \"1h\"");
    database_at(&stores, 21).await;
    let pg = PgPool::connect(&stores.db_url()).await.expect("pool");
    let token = id_at_noon(0);
    let before = [
        event(&pg, "token.issued", Some(token), "1 minute", "issued").await,
        event(&pg, "reconcile.repaired", None, "1 minute", "no token").await,
        event(&pg, "key.consumed", Some(-77), "1 minute", "a key").await,
    ];
    // An id lost to a rolled-back insert is never handed out again.
    let mut tx = pg.begin().await.expect("tx");
    sqlx::query("INSERT INTO audit_events (kind, detail) VALUES ('reconcile.repaired', '{}')")
        .execute(&mut *tx)
        .await
        .expect("insert");
    tx.rollback().await.expect("rollback");
    seal_flat_v21(&pg).await;
    let rows_before: String =
        sqlx::query_scalar("SELECT jsonb_agg(to_jsonb(e) ORDER BY e.id)::text FROM audit_events e")
            .fetch_one(&pg)
            .await
            .expect("rows");
    pg.close().await;

    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    let rows_after: String =
        sqlx::query_scalar("SELECT jsonb_agg(to_jsonb(e) ORDER BY e.id)::text FROM audit_events e")
            .fetch_one(&pg)
            .await
            .expect("rows");
    assert_eq!(rows_after, rows_before, "every event kept as it was");
    assert_eq!(
        partition_of_event(&pg, before[0]).await,
        "audit_events_base"
    );
    assert_eq!(
        partition_of_event(&pg, before[1]).await,
        "audit_events_default"
    );
    assert_eq!(
        partition_of_event(&pg, before[2]).await,
        "audit_events_base"
    );
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(0), "the v1 checkpoint verifies: {report}");

    // New events: ids go on after the lost one; each lands in its day.
    let tomorrow = id_at_noon(1);
    let after = [
        event(&pg, "token.issued", Some(tomorrow), "0", "tomorrow's").await,
        event(&pg, "fleet.forgotten", None, "0", "no token").await,
    ];
    assert!(after[0] > before[2] + 1, "one id was lost, none reused");
    assert_eq!(partition_of_event(&pg, after[0]).await, audit_day(1));
    assert_eq!(
        partition_of_event(&pg, after[1]).await,
        "audit_events_default"
    );
    // One `token.issued` per token still holds across partitions.
    let again = sqlx::query(
        "INSERT INTO audit_events (kind, token_id) VALUES ('token.issued', $1)
         ON CONFLICT (token_id) WHERE kind = 'token.issued' DO NOTHING",
    )
    .bind(tomorrow)
    .execute(&pg)
    .await
    .expect("insert");
    assert_eq!(
        again.rows_affected(),
        0,
        "a second token.issued is not written"
    );
    let cache: i64 = sqlx::query_scalar(
        "SELECT seqcache FROM pg_sequence
          WHERE seqrelid = pg_get_serial_sequence('audit_events', 'id')::regclass",
    )
    .fetch_one(&pg)
    .await
    .expect("cache");
    assert_eq!(cache, 1, "the settle rule needs ids in time order");

    // Sealed from now on by partition; both checkpoints verify.
    assert_eq!(seal(&seals(pg.clone())).await, 2);
    let versions: Vec<i16> =
        sqlx::query_scalar("SELECT version FROM audit_checkpoints ORDER BY id")
            .fetch_all(&pg)
            .await
            .expect("versions");
    assert_eq!(versions, [1, 2]);
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["checkpoints"], json!(2), "{report}");

    // An edit in either checkpoint's range is still found.
    sqlx::query("UPDATE audit_events SET subject = 'u-2' WHERE id = $1")
        .bind(after[0])
        .execute(&pg)
        .await
        .expect("edit");
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(5), "{report}");
    assert_eq!(
        report["mismatches"][0]["problem"],
        json!("events"),
        "{report}"
    );
    let message = report["mismatches"][0]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&audit_day(1)),
        "names the partition: {report}"
    );
    app.stop().await;
}

/// As if migrated 40 days ago (both `tokens_base` and `audit_events_base`
/// end then), with an audit partition of its own for each of `days`
/// (relative to today, UTC); no token partition for them (dropped).
async fn migrated_40_days_ago_with_audit_days(pg: &PgPool, days: &[i64]) {
    sqlx::raw_sql(
        "ALTER TABLE tokens DETACH PARTITION tokens_base;
         ALTER TABLE tokens ATTACH PARTITION tokens_base FOR VALUES FROM (MINVALUE)
             TO (tokens_day_first_id((now() AT TIME ZONE 'UTC')::date - 40));
         ALTER TABLE audit_events DETACH PARTITION audit_events_base;
         ALTER TABLE audit_events ATTACH PARTITION audit_events_base FOR VALUES FROM (MINVALUE)
             TO (tokens_day_first_id((now() AT TIME ZONE 'UTC')::date - 40));",
    )
    .execute(pg)
    .await
    .expect("the base partitions end 40 days ago");
    for day in days {
        let made: bool = sqlx::query_scalar(
            "SELECT audit_events_add_day_partition((now() AT TIME ZONE 'UTC')::date + $1::int)",
        )
        .bind(i32::try_from(*day).expect("a day"))
        .fetch_one(pg)
        .await
        .expect("an old audit day partition");
        assert!(made, "day {day}");
    }
}

async fn retirements(pg: &PgPool) -> Vec<(String, i64, i64)> {
    sqlx::query_as(
        "SELECT partition, events, checkpoints FROM audit_retirements ORDER BY partition",
    )
    .fetch_all(pg)
    .await
    .expect("retirements")
}

#[tokio::test]
async fn reconcile_retires_an_audit_day_past_retention_once_sealed_and_verify_still_passes() {
    let stores = Stores::fresh().with("[audit]\nseal_every = \"1h\"\nretention = \"30d\"");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    migrated_40_days_ago_with_audit_days(&pg, &[-35, -34]).await;
    let (d35, d34) = (id_at_noon(-35), id_at_noon(-34));
    // Day -35: every event older than 30 days.
    event(&pg, "token.issued", Some(d35), "35 days", "a").await;
    event(&pg, "token.consumed", Some(d35), "34 days", "b").await;
    event(&pg, "token.issued", Some(d35 + 1), "35 days", "c").await;
    // Day -34: one event of yesterday: kept whole.
    event(&pg, "token.issued", Some(d34), "34 days", "d").await;
    event(&pg, "token.result", Some(d34), "1 day", "e").await;
    // Events of other days and without token, around them in id order.
    event(&pg, "reconcile.repaired", None, "0", "f").await;
    event(&pg, "key.consumed", Some(-5), "0", "g").await;

    // Not sealed yet: kept.
    let report = reconcile(&app).await;
    assert_eq!(report["errors"], json!([]), "{report}");
    assert!(exists(&pg, &audit_day(-35)).await, "unsealed: kept");

    let sealer = seals(pg.clone());
    seal(&sealer).await;
    let report = reconcile(&app).await;
    assert_eq!(report["errors"], json!([]), "{report}");
    assert!(!exists(&pg, &audit_day(-35)).await, "day -35 dropped");
    assert!(exists(&pg, &audit_day(-34)).await, "day -34 kept");
    assert_eq!(retirements(&pg).await, [(audit_day(-35), 3, 1)]);
    // A late event of one of the day's tokens is not lost: it lands in the
    // default partition (and is sealed and verified below with the rest).
    let late = event(&pg, "token.released", Some(d35), "0", "late").await;
    assert_eq!(partition_of_event(&pg, late).await, "audit_events_default");
    let retired: Value = sqlx::query_scalar(
        "SELECT detail FROM audit_events WHERE kind = 'audit.retired' AND detail->>'partition' = $1",
    )
    .bind(audit_day(-35))
    .fetch_one(&pg)
    .await
    .expect("one audit.retired event");
    assert_eq!(retired["events"], json!(3), "{retired}");
    assert_eq!(
        partition_of_event(
            &pg,
            sqlx::query_scalar("SELECT id FROM audit_events WHERE kind = 'audit.retired'")
                .fetch_one(&pg)
                .await
                .expect("id")
        )
        .await,
        "audit_events_default"
    );

    // The checkpoint that sealed the dropped events still verifies, and so
    // does the one sealing the retirement's own event.
    seal(&sealer).await;
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(0), "{report}");
    assert_eq!(report["checkpoints"], json!(2), "{report}");
    assert_eq!(report["retired_events"], json!(3), "{report}");

    // A second run finds nothing more to drop.
    let report = reconcile(&app).await;
    assert_eq!(report["errors"], json!([]), "{report}");
    assert_eq!(retirements(&pg).await.len(), 1);

    // A retirement with a forged MAC, or none, is no excuse for gone events.
    sqlx::query("UPDATE audit_retirements SET mac = repeat('0', 64)")
        .execute(&pg)
        .await
        .expect("forge");
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(5), "{report}");
    assert_eq!(
        report["mismatches"][0]["checkpoint"],
        json!("1"),
        "{report}"
    );
    assert_eq!(
        report["mismatches"][0]["problem"],
        json!("events"),
        "{report}"
    );
    sqlx::query("DELETE FROM audit_retirements")
        .execute(&pg)
        .await
        .expect("delete");
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(5), "{report}");
    let message = report["mismatches"][0]["message"].as_str().unwrap_or("");
    assert!(
        message.contains(&audit_day(-35)) && message.contains("gone"),
        "{report}"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_audit_day_whose_sealed_events_were_changed_is_kept_and_named_in_the_run_s_errors() {
    let stores = Stores::fresh().with("[audit]\nseal_every = \"1h\"\nretention = \"30d\"");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    migrated_40_days_ago_with_audit_days(&pg, &[-35, -33]).await;
    let (d35, d33) = (id_at_noon(-35), id_at_noon(-33));
    let edited = event(&pg, "token.issued", Some(d35), "35 days", "a").await;
    event(&pg, "token.consumed", Some(d35), "34 days", "b").await;
    event(&pg, "token.issued", Some(d33), "33 days", "c").await;
    let deleted = event(&pg, "token.consumed", Some(d33), "32 days", "d").await;
    seal(&seals(pg.clone())).await;
    sqlx::query("UPDATE audit_events SET detail = '{\"note\": \"z\"}' WHERE id = $1")
        .bind(edited)
        .execute(&pg)
        .await
        .expect("edit");
    sqlx::query("DELETE FROM audit_events WHERE id = $1")
        .bind(deleted)
        .execute(&pg)
        .await
        .expect("delete");

    let report = reconcile(&app).await;
    let errors = report["errors"].to_string();
    for day in [audit_day(-35), audit_day(-33)] {
        assert!(
            errors.contains(&format!("audit retention: {day} kept")),
            "{day}: {report}"
        );
        assert!(exists(&pg, &day).await, "{day} kept");
    }
    assert_eq!(retirements(&pg).await, []);
    let (code, report) = verify(&stores).await;
    assert_eq!(code, Some(5), "the change is still there to find: {report}");
    app.stop().await;
}

/// A partition retired while `audit verify` runs: the verifier read the
/// retirements before the drop committed and the checkpoint's events after
/// it. Before the fix it reported the partition's events as gone with no
/// retirement; now it reads the retirements again when a part is missing
/// (the retirement commits with the drop, so that read sees it).
#[tokio::test]
async fn a_partition_retired_while_verify_runs_is_not_reported_gone() {
    let stores = Stores::fresh().with("[audit]\nseal_every = \"1h\"");
    let app = spawn_app_on(stores.clone()).await;
    let pg = app.pg().await;
    migrated_40_days_ago_with_audit_days(&pg, &[-35]).await;
    let d35 = id_at_noon(-35);
    event(&pg, "token.issued", Some(d35), "35 days", "a").await;
    event(&pg, "token.consumed", Some(d35), "34 days", "b").await;
    // Pools of their own: the verifier's, and one for this test's lock.
    let sealer = seals(PgPool::connect(&stores.db_url()).await.expect("pool"));
    seal(&sealer).await;
    let locker = PgPool::connect(&stores.db_url()).await.expect("pool");

    // Hold the checkpoints: the verifier reads the retirements (none yet),
    // then waits for its first page of checkpoints.
    let mut tx = locker.begin().await.expect("tx");
    sqlx::query("LOCK TABLE audit_checkpoints IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *tx)
        .await
        .expect("lock");
    let verifying = tokio::spawn({
        let sealer = sealer.clone();
        async move { sealer.verify(None).await.expect("verify runs") }
    });
    eventually(10, || {
        let pg = pg.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_locks
                  WHERE NOT granted AND relation = 'audit_checkpoints'::regclass",
            )
            .fetch_one(&pg)
            .await
            .ok()?;
            (waiting > 0).then_some(())
        }
    })
    .await;
    // Meanwhile the partition is retired, as reconcile does it.
    let name = audit_day(-35);
    let retired_at: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(&mut *tx)
        .await
        .expect("now");
    let mac = RetirementFields {
        partition: &name,
        retired_at,
        events: 2,
        checkpoints: 1,
        key_id: KEY_A1.0,
    }
    .mac(KEY_A1.1.as_bytes());
    sqlx::query(
        "INSERT INTO audit_retirements (partition, retired_at, events, checkpoints, key_id, mac)
         VALUES ($1, $2, 2, 1, $3, $4)",
    )
    .bind(&name)
    .bind(retired_at)
    .bind(KEY_A1.0)
    .bind(hex::encode(mac))
    .execute(&mut *tx)
    .await
    .expect("retirement");
    sqlx::query(&format!("DROP TABLE {name}"))
        .execute(&mut *tx)
        .await
        .expect("drop");
    tx.commit().await.expect("commit");

    let report = verifying.await.expect("verify");
    assert!(report.ok, "{:?}", report.mismatches);
    assert_eq!(report.retired_events, 2);
    app.stop().await;
}
