//! Sealed audit checkpoints against a real Postgres: events sealed after
//! some consumes verify (`audit verify` exits 0); an audit row edited,
//! deleted or inserted into a sealed range makes it exit 5 naming that
//! checkpoint; a checkpoint sealed under a retired (verify-only) key still
//! verifies, one under an unknown key or with a forged MAC does not; the
//! settle rule waits for a transaction still writing audit events; one
//! instance seals at a time; the background job, the admin route and the
//! gauge show the last seal. Passes are driven by calling the sealer
//! directly; the apps' own job is set to an hour so that it stays out of
//! the way.

use std::process::Output;
use std::time::Duration;

use idempotency_ledger::audit_seal::{SealPass, Seals};
use idempotency_ledger::config::{AuditSettings, SealKey};
use reqwest::StatusCode;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::helpers::*;

const KEY_A1: (&str, &str) = ("a1", "development-only-audit-seal-secret-0123456789");
const KEY_A2: (&str, &str) = ("a2", "a-rotated-audit-seal-secret-of-32-bytes-or-more");

fn audit_settings(keys: &[(&str, &str)]) -> AuditSettings {
    AuditSettings {
        seal_every: Duration::from_millis(200),
        seal_keys: keys
            .iter()
            .map(|(id, secret)| SealKey {
                id: (*id).to_owned(),
                secret: secret.as_bytes().to_vec(),
            })
            .collect(),
        retention: None,
    }
}

async fn quiet_app() -> TestApp {
    spawn_app_on(Stores::fresh().with("[audit]\nseal_every = \"1h\"")).await
}

/// A CLI config for this test's stores whose `audit.seal_keys` are `keys`.
fn config_with_keys(stores: &Stores, keys: &[(&str, &str)]) -> tempfile::NamedTempFile {
    let file = cli_config(stores);
    let mut text = std::fs::read_to_string(file.path()).expect("config read");
    let list: Vec<String> = keys
        .iter()
        .map(|(id, secret)| format!("{{ id = \"{id}\", secret = \"{secret}\" }}"))
        .collect();
    text.push_str(&format!("\n[audit]\nseal_keys = [{}]\n", list.join(", ")));
    std::fs::write(file.path(), text).expect("config written");
    file
}

/// `audit verify [args]`: exit code, the JSON summary, stderr.
async fn verify(config: &tempfile::NamedTempFile, args: &[&str]) -> (Option<i32>, Value, String) {
    let mut all = vec!["audit", "verify"];
    all.extend_from_slice(args);
    let out: Output = cli(config, &all).await;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.code(), json, stderr)
}

/// Issues and consumes `n` durable tokens: each leaves `token.issued` (in a
/// batch, shortly after) and `token.consumed`.
async fn consume_some(app: &TestApp, n: usize, subject: &str) {
    for _ in 0..n {
        let token = app.issue(PAYMENTS, "order", subject).await;
        let r = app
            .consume(PAYMENTS, &token, &json!({"subject": subject}))
            .await;
        assert_eq!(r.status(), StatusCode::OK);
    }
    // The issuance records (and their audit rows) are written in batches.
    let pg = app.pg().await;
    eventually(10, || {
        let pg = pg.clone();
        async move {
            let issued: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM audit_events WHERE kind = 'token.issued' AND subject = $1",
            )
            .bind(subject)
            .fetch_one(&pg)
            .await
            .ok()?;
            (issued == n as i64).then_some(())
        }
    })
    .await;
}

async fn seal(seals: &Seals) -> (u32, i64) {
    match seals.seal_once().await.expect("a sealing pass") {
        SealPass::Sealed {
            checkpoints,
            events,
        } => (checkpoints, events),
        other => panic!("not sealed: {other:?}"),
    }
}

/// (id, first_event_id, last_event_id, events, key_id) of every checkpoint.
async fn checkpoints(pg: &PgPool) -> Vec<(i64, i64, i64, i64, String)> {
    sqlx::query_as(
        "SELECT id, first_event_id, last_event_id, events, key_id FROM audit_checkpoints ORDER BY id",
    )
    .fetch_all(pg)
    .await
    .expect("checkpoints")
}

/// The value of an unlabelled gauge in Prometheus text.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

fn assert_mismatch(
    (code, json, stderr): &(Option<i32>, Value, String),
    checkpoint: i64,
    problem: &str,
) {
    assert_eq!(*code, Some(5), "{json} {stderr}");
    assert_eq!(json["ok"], false, "{json}");
    let first = &json["mismatches"][0];
    assert_eq!(first["checkpoint"], checkpoint.to_string(), "{json}");
    assert_eq!(first["problem"], problem, "{json}");
    assert!(
        stderr.contains(&format!("audit checkpoint {checkpoint} ")),
        "stderr names the checkpoint: {stderr}"
    );
}

#[tokio::test]
async fn an_audit_row_edited_deleted_or_inserted_into_a_sealed_range_fails_verify_naming_its_checkpoint(
) {
    let app = quiet_app().await;
    let pg = app.pg().await;
    let seals = Seals::new(&audit_settings(&[KEY_A1]), pg.clone());
    let config = config_with_keys(&app.stores, &[KEY_A1]);

    let (code, json, stderr) = verify(&config, &[]).await;
    assert_eq!(
        code,
        Some(0),
        "nothing sealed yet verifies: {json} {stderr}"
    );
    assert_eq!(json["checkpoints"], 0);
    assert_eq!(json["last_checkpoint"], Value::Null);

    consume_some(&app, 3, "seal-user-1").await;
    let (n, events) = seal(&seals).await;
    assert_eq!(n, 1);
    assert!(events >= 6, "3 issued and 3 consumed at least: {events}");
    // An id taken and never used (a rolled-back insert) between two sealed
    // events of the second checkpoint: the gap an insertion will use.
    let gap: i64 =
        sqlx::query_scalar("SELECT nextval(pg_get_serial_sequence('audit_events', 'id'))")
            .fetch_one(&pg)
            .await
            .expect("an id burned");
    consume_some(&app, 2, "seal-user-2").await;
    assert_eq!(seal(&seals).await.0, 1);
    assert_eq!(
        seal(&seals).await,
        (0, 0),
        "nothing new: no empty checkpoint"
    );
    let cps = checkpoints(&pg).await;
    assert_eq!(cps.len(), 2, "{cps:?}");
    let (cp1, cp2) = (cps[0].clone(), cps[1].clone());
    assert!(
        cp2.1 > cp1.2 && gap > cp1.2 && gap < cp2.2,
        "{cps:?} gap {gap}"
    );
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events")
        .fetch_one(&pg)
        .await
        .expect("count");
    assert_eq!(cp1.3 + cp2.3, total, "every event sealed once");

    let (code, json, stderr) = verify(&config, &[]).await;
    assert_eq!(code, Some(0), "{json} {stderr}");
    assert_eq!(json["ok"], true);
    assert_eq!(json["checkpoints"], 2);
    assert_eq!(json["events"], total);
    assert_eq!(json["last_checkpoint"]["id"], cp2.0.to_string());
    assert_eq!(json["last_checkpoint"]["last_event_id"], cp2.2.to_string());
    assert_eq!(json["unsealed_events"], 0);
    assert_eq!(json["mismatches"], json!([]));

    // Edited: one detail in the first checkpoint's range.
    let (victim, detail): (i64, String) = sqlx::query_as(
        "SELECT id, detail::text FROM audit_events WHERE id BETWEEN $1 AND $2 AND kind = 'token.consumed' ORDER BY id LIMIT 1",
    )
    .bind(cp1.1)
    .bind(cp1.2)
    .fetch_one(&pg)
    .await
    .expect("a consumed event");
    sqlx::query(
        "UPDATE audit_events SET detail = detail || '{\"request_id\": \"forged\"}' WHERE id = $1",
    )
    .bind(victim)
    .execute(&pg)
    .await
    .expect("edited");
    let out = verify(&config, &[]).await;
    assert_mismatch(&out, cp1.0, "events");
    assert!(out.1["mismatches"][0]["message"]
        .as_str()
        .is_some_and(|m| m.contains("edited")));
    assert_eq!(
        out.1["mismatches"].as_array().map(Vec::len),
        Some(1),
        "the second still chains: {}",
        out.1
    );

    // --since the second checkpoint checks only it (the first is its
    // anchor: MAC checked, events not recomputed).
    let since: String = sqlx::query_scalar(
        "SELECT to_char(sealed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM audit_checkpoints WHERE id = $1",
    )
    .bind(cp2.0)
    .fetch_one(&pg)
    .await
    .expect("sealed_at");
    let (code, json, stderr) = verify(&config, &["--since", &since]).await;
    assert_eq!(code, Some(0), "{json} {stderr}");
    assert_eq!(json["checkpoints"], 1, "{json}");

    // Put back exactly as it was: the seal is exact, it verifies again.
    sqlx::query("UPDATE audit_events SET detail = $2::jsonb WHERE id = $1")
        .bind(victim)
        .bind(&detail)
        .execute(&pg)
        .await
        .expect("restored");
    assert_eq!(verify(&config, &[]).await.0, Some(0));

    // Deleted: one event of the second checkpoint.
    let row: (i64, String, String) = sqlx::query_as(
        "SELECT id, kind::text, detail::text FROM audit_events WHERE id BETWEEN $1 AND $2 ORDER BY id LIMIT 1",
    )
    .bind(cp2.1)
    .bind(cp2.2)
    .fetch_one(&pg)
    .await
    .expect("an event");
    let saved: Value = sqlx::query_scalar("SELECT to_jsonb(e) FROM audit_events e WHERE id = $1")
        .bind(row.0)
        .fetch_one(&pg)
        .await
        .expect("saved");
    sqlx::query("DELETE FROM audit_events WHERE id = $1")
        .bind(row.0)
        .execute(&pg)
        .await
        .expect("deleted");
    let out = verify(&config, &[]).await;
    assert_mismatch(&out, cp2.0, "events");
    assert!(
        out.1["mismatches"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("deleted")),
        "{}",
        out.1
    );
    sqlx::query(
        "INSERT INTO audit_events OVERRIDING SYSTEM VALUE
         SELECT * FROM jsonb_populate_record(NULL::audit_events, $1)",
    )
    .bind(&saved)
    .execute(&pg)
    .await
    .expect("put back");
    assert_eq!(
        verify(&config, &[]).await.0,
        Some(0),
        "put back, it verifies"
    );

    // Inserted: an event with the unused id inside the second checkpoint's range.
    sqlx::query(
        "INSERT INTO audit_events (id, at, kind, subject, detail) OVERRIDING SYSTEM VALUE
         VALUES ($1, now() - interval '1 hour', 'token.released', 'seal-user-2', '{\"by\": \"admin\"}')",
    )
    .bind(gap)
    .execute(&pg)
    .await
    .expect("inserted");
    let out = verify(&config, &[]).await;
    assert_mismatch(&out, cp2.0, "events");
    assert!(
        out.1["mismatches"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("inserted")),
        "{}",
        out.1
    );
    // An insert below every sealed id lands in the first checkpoint's range.
    sqlx::query(
        "INSERT INTO audit_events (id, kind, subject) OVERRIDING SYSTEM VALUE VALUES (-1, 'token.issued', 'x')",
    )
    .execute(&pg)
    .await
    .expect("inserted below");
    let out = verify(&config, &[]).await;
    assert_mismatch(&out, cp1.0, "events");
    assert_eq!(
        out.1["mismatches"].as_array().map(Vec::len),
        Some(2),
        "{}",
        out.1
    );

    // A checkpoint removed: the next one no longer chains.
    sqlx::query("DELETE FROM audit_events WHERE id IN ($1, -1)")
        .bind(gap)
        .execute(&pg)
        .await
        .expect("inserts undone");
    assert_eq!(verify(&config, &[]).await.0, Some(0));
    sqlx::query("DELETE FROM audit_checkpoints WHERE id = $1")
        .bind(cp1.0)
        .execute(&pg)
        .await
        .expect("checkpoint removed");
    let out = verify(&config, &[]).await;
    assert_mismatch(&out, cp2.0, "chain");
    app.stop().await;
}

#[tokio::test]
async fn a_checkpoint_sealed_under_a_retired_key_still_verifies_an_unknown_key_or_a_forged_mac_does_not(
) {
    let app = quiet_app().await;
    let pg = app.pg().await;
    consume_some(&app, 1, "rotate-1").await;
    assert_eq!(
        seal(&Seals::new(&audit_settings(&[KEY_A1]), pg.clone()))
            .await
            .0,
        1
    );
    // Rotation: a2 seals from now on, a1 only verifies.
    consume_some(&app, 1, "rotate-2").await;
    assert_eq!(
        seal(&Seals::new(&audit_settings(&[KEY_A2, KEY_A1]), pg.clone()))
            .await
            .0,
        1
    );
    let cps = checkpoints(&pg).await;
    let keys: Vec<&str> = cps.iter().map(|c| c.4.as_str()).collect();
    assert_eq!(keys, ["a1", "a2"]);

    let rotated = config_with_keys(&app.stores, &[KEY_A2, KEY_A1]);
    let (code, json, stderr) = verify(&rotated, &[]).await;
    assert_eq!(code, Some(0), "{json} {stderr}");
    assert_eq!(json["checkpoints"], 2);

    // a1 dropped from the list: its checkpoint cannot be verified.
    let only_new = config_with_keys(&app.stores, &[KEY_A2]);
    assert_mismatch(&verify(&only_new, &[]).await, cps[0].0, "unknown_key");
    // The same id with another secret: the MAC does not verify.
    let wrong = config_with_keys(
        &app.stores,
        &[KEY_A2, ("a1", "not-the-secret-that-sealed-checkpoint-one")],
    );
    assert_mismatch(&verify(&wrong, &[]).await, cps[0].0, "mac");

    // A checkpoint row rewritten without the key (its count changed): MAC.
    sqlx::query("UPDATE audit_checkpoints SET events = events + 1 WHERE id = $1")
        .bind(cps[1].0)
        .execute(&pg)
        .await
        .expect("forged");
    assert_mismatch(&verify(&rotated, &[]).await, cps[1].0, "mac");
    app.stop().await;
}

/// The settle rule: an event whose transaction is still open when a pass
/// begins holds the pass back (however many later events are visible), and
/// is sealed once it commits; a pass meanwhile seals nothing, so the event
/// never lands in a sealed range after the fact.
#[tokio::test]
async fn sealing_waits_for_a_transaction_still_writing_audit_events_and_one_instance_seals_at_a_time(
) {
    let app = quiet_app().await;
    let writer = app.pg().await;
    let pg = app.pg().await;
    let seals = Seals::new(&audit_settings(&[KEY_A1]), pg.clone());

    let mut open = writer.begin().await.expect("begin");
    let held: i64 = sqlx::query_scalar(
        "INSERT INTO audit_events (kind, subject) VALUES ('token.issued', 'slow') RETURNING id",
    )
    .fetch_one(&mut *open)
    .await
    .expect("an insert left open");
    let later: i64 = sqlx::query_scalar(
        "INSERT INTO audit_events (kind, subject) VALUES ('token.issued', 'fast') RETURNING id",
    )
    .fetch_one(&pg)
    .await
    .expect("a later insert, committed");
    assert!(later > held);
    match seals.seal_once().await.expect("a pass") {
        SealPass::Unsettled { waiting } => assert_eq!(waiting, 1),
        other => panic!("sealed past an open transaction: {other:?}"),
    }
    assert!(checkpoints(&pg).await.is_empty());
    open.commit().await.expect("commit");

    // Another instance's sealing transaction holds the lock: this one leaves it.
    let mut other = writer.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(idempotency_ledger::durable::seal::SEAL_LOCK_KEY)
        .execute(&mut *other)
        .await
        .expect("lock");
    assert_eq!(
        seals.seal_once().await.expect("a pass"),
        SealPass::Busy { checkpoints: 0 }
    );
    other.rollback().await.expect("rollback");

    let (n, events) = seal(&seals).await;
    assert_eq!(n, 1);
    let cps = checkpoints(&pg).await;
    assert!(cps[0].1 <= held && cps[0].2 >= later, "{cps:?}");
    assert!(events >= 2);
    let config = config_with_keys(&app.stores, &[KEY_A1]);
    let (code, json, stderr) = verify(&config, &[]).await;
    assert_eq!(code, Some(0), "{json} {stderr}");
    app.stop().await;
}

#[tokio::test]
async fn the_background_job_seals_and_the_admin_route_and_the_gauge_show_the_last_seal() {
    let app = spawn_app_on(Stores::fresh().with("[audit]\nseal_every = \"200ms\"")).await;
    let r = app.get(ADMIN, "/v1/admin/audit/seal").await;
    let (status, _, body) = answer(r).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, Value::Null, "nothing sealed yet");
    let (status, _, body) = answer(app.get(PAYMENTS, "/v1/admin/audit/seal").await).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(body["error"], "forbidden");

    consume_some(&app, 2, "job-user").await;
    let pg = app.pg().await;
    let max: i64 = sqlx::query_scalar("SELECT max(id) FROM audit_events")
        .fetch_one(&pg)
        .await
        .expect("max id");
    let last = eventually(20, || async {
        let (status, _, body) = answer(app.get(ADMIN, "/v1/admin/audit/seal").await).await;
        let sealed_to: i64 = body["last_event_id"].as_str()?.parse().ok()?;
        (status == StatusCode::OK && sealed_to >= max).then_some(body)
    })
    .await;
    for field in [
        "id",
        "sealed_at",
        "first_event_id",
        "last_event_id",
        "digest",
    ] {
        assert!(last[field].is_string(), "{field}: {last}");
    }
    // The job may have sealed some of the test's events before the others
    // were written: the last seal holds at least one, and the seals
    // together hold every event up to it, each once.
    assert!(last["events"].as_i64().is_some_and(|n| n >= 1), "{last}");
    let sealed_to: i64 = last["last_event_id"]
        .as_str()
        .and_then(|id| id.parse().ok())
        .expect("last_event_id");
    let (sealed, written): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT sum(events)::bigint FROM audit_checkpoints), \
                (SELECT count(*) FROM audit_events WHERE id <= $1)",
    )
    .bind(sealed_to)
    .fetch_one(&pg)
    .await
    .expect("seal counts");
    assert_eq!(sealed, written, "{last}");
    assert!(written >= 4, "{last}");
    assert_eq!(last["digest"].as_str().map(str::len), Some(64));

    let seconds = eventually(20, || async {
        let text = app.metrics_text().await;
        gauge(&text, "ledger_audit_last_seal_timestamp_seconds").filter(|v| *v > 0.0)
    })
    .await;
    let now = chrono::Utc::now().timestamp() as f64;
    assert!((now - seconds).abs() < 120.0, "{seconds} vs {now}");

    let config = config_with_keys(&app.stores, &[KEY_A1]);
    let (code, json, stderr) = verify(&config, &[]).await;
    assert_eq!(code, Some(0), "{json} {stderr}");
    app.stop().await;
}

#[tokio::test]
async fn audit_verify_exits_1_when_postgres_cannot_be_reached() {
    let mut stores = Stores::fresh();
    stores.pg_base = format!("postgres://postgres@127.0.0.1:{}", free_port());
    let config = config_with_keys(&stores, &[KEY_A1]);
    let (code, json, stderr) = verify(&config, &[]).await;
    assert_eq!(code, Some(1), "{json} {stderr}");
    assert!(stderr.contains("could not run"), "{stderr}");
}
