//! Property test: random sequences of pay/refund/close with fresh and repeated
//! tokens, run against the service and compared with a simple model after
//! every step.

use std::sync::atomic::{AtomicUsize, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use reqwest::StatusCode;
use serde_json::json;

use crate::helpers::*;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Pay,
    Refund(i64),
    Close,
}

#[derive(Debug, Clone, Copy)]
enum Tok {
    Fresh,
    /// One of the tokens used earlier in this case (index modulo their count).
    Again(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Created,
    Paid,
    Partial,
    Refunded,
    Closed,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Created => "CREATED",
            State::Paid => "PAID",
            State::Partial => "PARTIALLY_REFUNDED",
            State::Refunded => "REFUNDED",
            State::Closed => "CLOSED",
        }
    }
}

fn ops() -> impl Strategy<Value = (i64, Vec<(Kind, Tok)>)> {
    let kind = prop_oneof![
        2 => Just(Kind::Pay),
        3 => (1i64..800).prop_map(Kind::Refund),
        1 => Just(Kind::Close),
    ];
    let tok = prop_oneof![3 => Just(Tok::Fresh), 1 => (0usize..8).prop_map(Tok::Again)];
    (1i64..1500, proptest::collection::vec((kind, tok), 1..10))
}

/// The model's expectation for one event.
enum Expect {
    Applied(State, i64),
    Duplicate,
    /// The same token for the same event with another amount: 422, nothing changed.
    Mismatch,
    Error(&'static str),
}

fn model(state: State, amount: i64, refunded: i64, kind: Kind) -> Expect {
    match (state, kind) {
        (State::Created, Kind::Pay) => Expect::Applied(State::Paid, refunded),
        (State::Created, Kind::Close) => Expect::Applied(State::Closed, refunded),
        (State::Paid | State::Partial, Kind::Refund(n)) if refunded + n > amount => {
            Expect::Error("refund_exceeds_paid")
        }
        (State::Paid | State::Partial, Kind::Refund(n)) if refunded + n == amount => {
            Expect::Applied(State::Refunded, amount)
        }
        (State::Paid | State::Partial, Kind::Refund(n)) => {
            Expect::Applied(State::Partial, refunded + n)
        }
        _ => Expect::Error("illegal_transition"),
    }
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Pay => "pay",
        Kind::Refund(_) => "refund",
        Kind::Close => "close",
    }
}

async fn run_case(
    app: &TestApp,
    case: usize,
    amount: i64,
    steps: Vec<(Kind, Tok)>,
) -> Result<(), TestCaseError> {
    let id = format!("m-{case}");
    let subject = format!("model-{case}");
    let r = app
        .post(
            PAYMENTS,
            "/v1/orders",
            &json!({"order_id": id, "subject": subject, "amount_minor": amount, "currency": "EUR"}),
        )
        .await;
    prop_assert_eq!(r.status(), StatusCode::CREATED);
    let (mut state, mut refunded) = (State::Created, 0i64);
    // Tokens seen in this case, with the event each applied (if any).
    let mut seen: Vec<(String, Option<Kind>)> = Vec::new();
    for (kind, tok) in steps {
        let (token, applied_as) = match tok {
            Tok::Again(i) if !seen.is_empty() => seen[i % seen.len()].clone(),
            _ => {
                let t = app.issue(PAYMENTS, "order", &subject).await;
                seen.push((t.clone(), None));
                (t, None)
            }
        };
        let mut body = json!({"token": token});
        if let Kind::Refund(n) = kind {
            body["amount_minor"] = json!(n);
        }
        let (status, replayed, b) = answer(
            app.post(
                PAYMENTS,
                &format!("/v1/orders/{id}/{}", kind_name(kind)),
                &body,
            )
            .await,
        )
        .await;
        let expect = match applied_as {
            Some(Kind::Refund(a)) if matches!(kind, Kind::Refund(b) if a != b) => Expect::Mismatch,
            Some(k) if kind_name(k) == kind_name(kind) => Expect::Duplicate,
            Some(_) => Expect::Error("token_already_used"),
            None => model(state, amount, refunded, kind),
        };
        match expect {
            Expect::Applied(next, r) => {
                prop_assert_eq!(status, StatusCode::OK, "{:?}: {}", kind, b);
                prop_assert_eq!(b["outcome"].as_str(), Some("applied"));
                prop_assert!(!replayed);
                state = next;
                refunded = r;
                for s in seen.iter_mut() {
                    if s.0 == token {
                        s.1 = Some(kind);
                    }
                }
            }
            Expect::Duplicate => {
                prop_assert_eq!(status, StatusCode::OK, "{:?}: {}", kind, b);
                prop_assert_eq!(b["outcome"].as_str(), Some("duplicate"));
                prop_assert!(replayed);
            }
            Expect::Mismatch => {
                prop_assert_eq!(
                    status,
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "{:?}: {}",
                    kind,
                    b
                );
                prop_assert_eq!(b["error"].as_str(), Some("fingerprint_mismatch"));
            }
            Expect::Error(code) => {
                prop_assert_eq!(status, StatusCode::CONFLICT, "{:?}: {}", kind, b);
                prop_assert_eq!(b["error"].as_str(), Some(code));
            }
        }
        // The service agrees with the model after every step.
        let (_, _, order) = answer(app.get(PAYMENTS, &format!("/v1/orders/{id}")).await).await;
        prop_assert_eq!(order["state"].as_str(), Some(state.as_str()));
        prop_assert_eq!(order["refunded_minor"].as_i64(), Some(refunded));
        prop_assert!(refunded <= amount);
        let paid_events = order["events"]
            .as_array()
            .map(|e| e.iter().filter(|e| e["kind"] == "order.paid").count());
        let want_paid = usize::from(matches!(
            state,
            State::Paid | State::Partial | State::Refunded
        ));
        prop_assert_eq!(paid_events, Some(want_paid));
    }
    Ok(())
}

#[test]
fn random_event_sequences_match_the_model() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let app = rt.block_on(spawn_app());
    let cases = AtomicUsize::new(0);
    let mut runner = TestRunner::new(Config {
        cases: 24,
        failure_persistence: None,
        ..Config::default()
    });
    let outcome = runner.run(&ops(), |(amount, steps)| {
        let case = cases.fetch_add(1, Ordering::SeqCst);
        rt.block_on(run_case(&app, case, amount, steps))
    });
    rt.block_on(app.stop());
    if let Err(e) = outcome {
        panic!("{e}");
    }
}
