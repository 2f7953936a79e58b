//! Every row of API.md's consume table, as [`classify`] and
//! [`answer_from_row`] decide it from what an earlier consume left behind
//! (a Redis marker or a Postgres row).

use chrono::{DateTime, TimeZone, Utc};
use serde_json::json;

use super::{answer_from_row, classify, Prior};
use crate::domain::{Fingerprint, RequestId, Subject};
use crate::durable::tokens::{ConsumeRow, Existing, TokenState};
use crate::fast::Marker;
use crate::ledger::{ConsumeAnswer, ConsumeInput, DuplicateStatus, LedgerError};

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().expect("valid time")
}

const WON_AT: i64 = 1_790_000_000_000;

/// The ledger's clock, later than any consume here.
fn now() -> DateTime<Utc> {
    at(WON_AT + 5_000)
}

fn input(request_id: Option<&str>, fingerprint: Option<&str>) -> ConsumeInput {
    ConsumeInput {
        subject: Subject::parse("u").expect("subject"),
        biz_type: None,
        fingerprint: fingerprint.map(|f| Fingerprint::parse(f).expect("fingerprint")),
        request_id: request_id.map(|r| RequestId::parse(r).expect("request id")),
    }
}

/// The Postgres row of a token consumed by request `r1` with fingerprint `f1`.
fn consumed_row(result: Option<serde_json::Value>) -> Existing {
    Existing {
        state: TokenState::Consumed,
        consumed_at: Some(at(WON_AT)),
        fingerprint: Some("f1".into()),
        request_id: Some("r1".into()),
        result,
        order_id: None,
        expires_at: at(WON_AT + 60_000),
        gen: 1,
        uncertain_since: None,
    }
}

/// The same consume as a Redis marker (`result` as JSON text).
fn consumed_marker(result: Option<&str>) -> Marker {
    Marker {
        at_ms: WON_AT,
        request_id: Some("r1".into()),
        fingerprint: Some("f1".into()),
        result: result.map(str::to_owned),
    }
}

fn duplicate(status: DuplicateStatus, result: Option<serde_json::Value>) -> ConsumeAnswer {
    ConsumeAnswer::Duplicate {
        status,
        consumed_at: Some(at(WON_AT)),
        result,
    }
}

// Row 1: first use.

#[test]
fn first_use_is_consumed() {
    let row = ConsumeRow::Won {
        consumed_at: at(WON_AT),
    };
    for i in [input(None, None), input(Some("r1"), Some("f1"))] {
        assert_eq!(
            answer_from_row(&row, &i, now()).unwrap(),
            ConsumeAnswer::Consumed {
                consumed_at: at(WON_AT),
                replayed: false
            }
        );
    }
}

// Row 2: the same attempt again (same request_id as the winner).

#[test]
fn the_winners_request_id_replays_consumed() {
    let replay = ConsumeAnswer::Consumed {
        consumed_at: at(WON_AT),
        replayed: true,
    };
    let row = ConsumeRow::Existing(consumed_row(None));
    assert_eq!(
        answer_from_row(&row, &input(Some("r1"), None), now()).unwrap(),
        replay
    );
    assert_eq!(
        answer_from_row(&row, &input(Some("r1"), Some("f1")), now()).unwrap(),
        replay
    );
    // Also once a result is recorded, and from Redis's marker.
    let row = ConsumeRow::Existing(consumed_row(Some(json!({"ok": 1}))));
    assert_eq!(
        answer_from_row(&row, &input(Some("r1"), None), now()).unwrap(),
        replay
    );
    let prior = Prior::from_marker(&consumed_marker(None));
    assert_eq!(
        classify(&prior, &input(Some("r1"), None), false, now()).unwrap(),
        Some(replay)
    );
}

// Row 3: consumed by another attempt: duplicate, processing until a result
// is recorded, then completed with it.

#[test]
fn another_attempt_is_a_duplicate_processing_without_a_result() {
    let row = ConsumeRow::Existing(consumed_row(None));
    for i in [
        input(None, None),
        input(Some("r2"), None),
        input(None, Some("f1")),
        input(Some("r2"), Some("f1")),
    ] {
        assert_eq!(
            answer_from_row(&row, &i, now()).unwrap(),
            duplicate(DuplicateStatus::Processing, None),
            "{i:?}"
        );
    }
}

#[test]
fn another_attempt_is_a_duplicate_completed_with_the_result() {
    let result = json!({"order": "o-1", "paid": true});
    let row = ConsumeRow::Existing(consumed_row(Some(result.clone())));
    assert_eq!(
        answer_from_row(&row, &input(Some("r2"), None), now()).unwrap(),
        duplicate(DuplicateStatus::Completed, Some(result.clone()))
    );
    let text = result.to_string();
    let prior = Prior::from_marker(&consumed_marker(Some(&text)));
    assert_eq!(
        classify(&prior, &input(None, None), false, now()).unwrap(),
        Some(duplicate(DuplicateStatus::Completed, Some(result)))
    );
}

// Row 4: consumed earlier with another fingerprint (both present).

#[test]
fn another_fingerprint_is_refused_even_with_the_winners_request_id() {
    let row = ConsumeRow::Existing(consumed_row(None));
    for i in [input(None, Some("f2")), input(Some("r1"), Some("f2"))] {
        assert!(
            matches!(
                answer_from_row(&row, &i, now()),
                Err(LedgerError::FingerprintMismatch)
            ),
            "{i:?}"
        );
    }
    // Only one side has a fingerprint: nothing to compare.
    let mut unfingerprinted = consumed_row(None);
    unfingerprinted.fingerprint = None;
    assert_eq!(
        answer_from_row(
            &ConsumeRow::Existing(unfingerprinted),
            &input(None, Some("f2")),
            now()
        )
        .unwrap(),
        duplicate(DuplicateStatus::Processing, None)
    );
}

// Row 5: never consumed and past its expiry (Postgres's now() says so).

#[test]
fn never_consumed_and_expired_is_token_expired() {
    let mut issued = consumed_row(None);
    issued.state = TokenState::Issued;
    issued.consumed_at = None;
    for row in [ConsumeRow::Existing(issued), ConsumeRow::Expired] {
        assert!(matches!(
            answer_from_row(&row, &input(Some("r1"), None), now()),
            Err(LedgerError::TokenExpired)
        ));
    }
}

// Another attempt still in flight (a live provisional marker in Redis).

#[test]
fn an_attempt_in_flight_answers_only_plain_duplicates() {
    let provisional = Prior::from_marker(&Marker {
        at_ms: WON_AT,
        request_id: Some("r1".into()),
        fingerprint: Some("f1".into()),
        result: None,
    });
    // A plain duplicate is answered at once: processing, no result.
    assert_eq!(
        classify(&provisional, &input(None, None), true, now()).unwrap(),
        Some(duplicate(DuplicateStatus::Processing, None))
    );
    // Anything that needs the winner's identity (request id, fingerprint)
    // is left to Postgres, even the in-flight request's own retry.
    for i in [
        input(Some("r1"), None),
        input(Some("r2"), None),
        input(None, Some("f2")),
    ] {
        assert_eq!(
            classify(&provisional, &i, true, now()).unwrap(),
            None,
            "{i:?}"
        );
    }
}

// The same rows answered from a Redis marker instead of a Postgres row.

#[test]
fn another_fingerprint_is_refused_from_a_redis_marker_too() {
    let prior = Prior::from_marker(&consumed_marker(Some("{\"ok\":1}")));
    for i in [input(None, Some("f2")), input(Some("r1"), Some("f2"))] {
        assert!(
            matches!(
                classify(&prior, &i, false, now()),
                Err(LedgerError::FingerprintMismatch)
            ),
            "{i:?}"
        );
    }
}

#[test]
fn a_marker_without_a_request_id_never_replays_consumed() {
    let mut marker = consumed_marker(None);
    marker.request_id = None;
    let prior = Prior::from_marker(&marker);
    assert_eq!(
        classify(&prior, &input(Some("r1"), None), false, now()).unwrap(),
        Some(duplicate(DuplicateStatus::Processing, None))
    );
}

#[test]
fn a_replay_from_a_marker_without_its_consume_time_answers_the_clock() {
    let mut marker = consumed_marker(None);
    marker.at_ms = 0;
    let prior = Prior::from_marker(&marker);
    assert_eq!(
        classify(&prior, &input(Some("r1"), None), false, now()).unwrap(),
        Some(ConsumeAnswer::Consumed {
            consumed_at: now(),
            replayed: true
        })
    );
}

#[test]
fn an_attempt_in_flight_never_shows_a_result() {
    let prior = Prior::from_marker(&consumed_marker(Some("{\"ok\":1}")));
    assert_eq!(
        classify(&prior, &input(None, None), true, now()).unwrap(),
        Some(duplicate(DuplicateStatus::Processing, None))
    );
}

/// Past a processing lease (`uncertain_since` set by the sweep): a plain
/// duplicate hears `uncertain`; a result still answers `completed`, and the
/// winner's retry still replays `consumed`.
#[test]
fn an_uncertain_row_answers_uncertain_until_it_has_a_result() {
    let mut row = consumed_row(None);
    row.uncertain_since = Some(at(WON_AT + 120_000));
    let answer = answer_from_row(
        &ConsumeRow::Existing(row.clone()),
        &input(Some("r2"), None),
        now(),
    );
    assert!(
        matches!(
            answer,
            Ok(ConsumeAnswer::Duplicate {
                status: DuplicateStatus::Uncertain,
                result: None,
                ..
            })
        ),
        "{answer:?}"
    );
    let replay = answer_from_row(
        &ConsumeRow::Existing(row.clone()),
        &input(Some("r1"), None),
        now(),
    );
    assert!(
        matches!(replay, Ok(ConsumeAnswer::Consumed { replayed: true, .. })),
        "{replay:?}"
    );
    let mut done = row;
    done.result = Some(serde_json::json!({"ok": 1}));
    let answer = answer_from_row(&ConsumeRow::Existing(done), &input(Some("r2"), None), now());
    assert!(
        matches!(
            answer,
            Ok(ConsumeAnswer::Duplicate {
                status: DuplicateStatus::Completed,
                ..
            })
        ),
        "{answer:?}"
    );
    // A fast marker past its lease by Redis's clock.
    let prior = Prior::from_marker(&consumed_marker(None)).lease_ran_out(true);
    let answer = classify(&prior, &input(None, None), false, now());
    assert!(
        matches!(
            answer,
            Ok(Some(ConsumeAnswer::Duplicate {
                status: DuplicateStatus::Uncertain,
                ..
            }))
        ),
        "{answer:?}"
    );
}
