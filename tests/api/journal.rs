//! The journal's apply (`journal::apply_entries`, the statements the
//! drainer and the going-down flush share): a second consume decision for
//! one generation of a token is kept as evidence, never dropped.

use chrono::{Duration, Utc};
use idempotency_ledger::config::Durability;
use idempotency_ledger::durable::tokens::TokenRecord;
use idempotency_ledger::fast::JournalEntry;
use idempotency_ledger::journal::{apply_entries, GEN};

use crate::helpers::*;

/// A fast consume's journal entry, as the consume script completes it.
fn consume_entry(rec: &TokenRecord, rid: &str, at_ms: i64) -> JournalEntry {
    journal_entries::consume_entry(&format!("test-{rid}"), rec, rid, at_ms)
}

/// A fast `like` token of `payments`, issued five seconds ago.
fn like_token(id: i64) -> TokenRecord {
    let now = Utc::now();
    TokenRecord {
        id,
        token: format!("like_test_{id}"),
        biz_type: "like".into(),
        durability: Durability::Fast,
        subject: "fan".into(),
        client: "payments".into(),
        issued_at: now - Duration::seconds(5),
        expires_at: now + Duration::minutes(10),
        key: None,
    }
}

/// Issue 24, item 10: when two deciders collided, the second decision of a
/// generation reached Postgres and was ignored as the same generation, its
/// audit row dropped (`ON CONFLICT ... DO NOTHING`): Postgres, Redis, the
/// audit trail and reconcile then agreed on one winner, and the double
/// consume left no trace. It is now recorded as a `token.conflict` event
/// (once, however often the entry is applied) and counted by
/// `ledger_token_conflicts`, while the row keeps the first decision.
#[tokio::test]
async fn a_second_decision_for_one_generation_is_kept_as_a_conflict() {
    let app = spawn_app().await;
    let pool = app.pg().await;
    let now = Utc::now();
    let rec = like_token(77_001);
    let at = now.timestamp_millis();
    apply_entries(&pool, &[consume_entry(&rec, "first", at)])
        .await
        .expect("first decision");
    let second = consume_entry(&rec, "second", at + 5);
    for _ in 0..2 {
        apply_entries(&pool, std::slice::from_ref(&second))
            .await
            .expect("second decision");
    }

    let kept: Option<String> = sqlx::query_scalar("SELECT request_id FROM tokens WHERE id = $1")
        .bind(rec.id)
        .fetch_one(&pool)
        .await
        .expect("row");
    assert_eq!(kept.as_deref(), Some("first"));
    let conflicts: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT detail FROM audit_events WHERE token_id = $1 AND kind = 'token.conflict'",
    )
    .bind(rec.id)
    .fetch_all(&pool)
    .await
    .expect("audit");
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert_eq!(conflicts[0]["request_id"], "second");
    assert_eq!(conflicts[0]["kept_request_id"], "first");
    let metrics = eventually(10, || async {
        let text = app.metrics_text().await;
        text.contains("ledger_token_conflicts 1").then_some(text)
    })
    .await;
    assert!(metrics.contains("ledger_token_conflicts 1"));
}

/// One batch may hold a second decider's consume of the generation Postgres
/// holds and a later generation's consume of the same token: the later one
/// moves the row, and the earlier one is still a conflict with what
/// Postgres held (the apply reads rows only for entries that did not move
/// theirs themselves; the entry that moved it is the later one).
#[tokio::test]
async fn a_conflict_in_the_batch_that_also_moves_its_token_forward_is_kept() {
    let app = spawn_app().await;
    let pool = app.pg().await;
    let now = Utc::now();
    let rec = like_token(77_002);
    let at = now.timestamp_millis();
    apply_entries(&pool, &[consume_entry(&rec, "first", at)])
        .await
        .expect("first decision");
    let second = consume_entry(&rec, "second", at + 5);
    let mut later = consume_entry(&rec, "later", at + 9);
    later.fields.insert(GEN.to_owned(), b"3".to_vec());
    apply_entries(&pool, &[later, second])
        .await
        .expect("one batch");

    let (gen, kept): (i64, Option<String>) =
        sqlx::query_as("SELECT gen, request_id FROM tokens WHERE id = $1")
            .bind(rec.id)
            .fetch_one(&pool)
            .await
            .expect("row");
    assert_eq!((gen, kept.as_deref()), (3, Some("later")));
    let conflicts: Vec<serde_json::Value> = sqlx::query_scalar(
        "SELECT detail FROM audit_events WHERE token_id = $1 AND kind = 'token.conflict'",
    )
    .bind(rec.id)
    .fetch_all(&pool)
    .await
    .expect("audit");
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert_eq!(conflicts[0]["request_id"], "second");
    assert_eq!(conflicts[0]["kept_request_id"], "first");
}
