//! The journal's apply (`journal::apply_entries`, the statements the
//! drainer and the going-down flush share): a second consume decision for
//! one generation of a token is kept as evidence, never dropped.

use chrono::{Duration, Utc};
use idempotency_ledger::config::Durability;
use idempotency_ledger::durable::tokens::TokenRecord;
use idempotency_ledger::fast::JournalEntry;
use idempotency_ledger::journal::apply_entries;

use crate::helpers::*;

/// A fast consume's journal entry, as the consume script completes it.
fn consume_entry(rec: &TokenRecord, rid: &str, at_ms: i64) -> JournalEntry {
    journal_entries::consume_entry(&format!("test-{rid}"), rec, rid, at_ms)
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
    let rec = TokenRecord {
        id: 77_001,
        token: "like_test_77001".into(),
        biz_type: "like".into(),
        durability: Durability::Fast,
        subject: "fan".into(),
        client: "payments".into(),
        issued_at: now - Duration::seconds(5),
        expires_at: now + Duration::minutes(10),
        key: None,
    };
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
