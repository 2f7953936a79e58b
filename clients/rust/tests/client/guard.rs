//! The guard's three paths with tokens: success records the result; a failure
//! before side effects releases the token (it can be consumed again); a
//! failure after side effects leaves it consumed.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_ledger_client::{
    ConsumeOutcome, ConsumeRequest, GuardError, Guarded, IssueRequest, SideEffects, StepError,
};
use serde::{Deserialize, Serialize};

use crate::helpers::*;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
    amount_minor: i64,
}

#[derive(Debug, PartialEq)]
enum PayError {
    CartEmpty,
    GatewayTimedOut,
}

impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

fn validate(cart_items: usize) -> Result<(), PayError> {
    if cart_items == 0 {
        Err(PayError::CartEmpty)
    } else {
        Ok(())
    }
}

#[tokio::test]
async fn a_step_that_succeeds_runs_once_and_its_result_is_recorded_and_replayed() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    for biz in [DURABLE, FAST] {
        let token = client
            .issue(&IssueRequest::new(biz, "u"))
            .await
            .expect("issue")
            .token;
        let runs = AtomicUsize::new(0);
        let step = || async {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, StepError<PayError>>(Receipt {
                charge_id: "ch_1".into(),
                amount_minor: 1000,
            })
        };
        let first = client
            .guard_token(&token, ConsumeRequest::new("u"))
            .run(step)
            .await
            .expect("ran");
        let receipt = Receipt {
            charge_id: "ch_1".into(),
            amount_minor: 1000,
        };
        assert_eq!(first, Guarded::Ran(receipt.clone()), "{biz}");
        // A second request with the same token: the recorded receipt, no run.
        let second = client
            .guard_token(&token, ConsumeRequest::new("u"))
            .run(step)
            .await
            .expect("replayed");
        assert_eq!(second, Guarded::Completed(receipt.clone()), "{biz}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{biz}: the step ran once");
        let raw = client
            .consume(&token, &ConsumeRequest::new("u"))
            .await
            .expect("consume");
        assert!(
            matches!(&raw, ConsumeOutcome::Completed { result, .. }
                if *result == serde_json::to_value(&receipt).expect("json")),
            "{biz}: {raw:?}"
        );
    }
    ledger.stop().await;
}

#[tokio::test]
async fn a_step_failing_before_side_effects_releases_the_token_for_a_retry() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect("issue")
        .token;
    let err = client
        .guard_token(&token, ConsumeRequest::new("u"))
        .run(|| async {
            validate(0).before_side_effects()?;
            Ok::<_, StepError<PayError>>(Receipt {
                charge_id: "never".into(),
                amount_minor: 0,
            })
        })
        .await
        .expect_err("validation failed");
    match err {
        GuardError::BeforeSideEffects { error, released } => {
            assert_eq!(error, PayError::CartEmpty);
            assert!(released.is_ok(), "{released:?}");
        }
        other => panic!("expected BeforeSideEffects, got {other}"),
    }
    // The same token works again: a fresh attempt wins it.
    let retry = client
        .guard_token(&token, ConsumeRequest::new("u"))
        .run(|| async {
            validate(1).before_side_effects()?;
            Ok::<_, StepError<PayError>>(Receipt {
                charge_id: "ch_2".into(),
                amount_minor: 500,
            })
        })
        .await
        .expect("second try ran");
    assert!(
        matches!(retry, Guarded::Ran(ref r) if r.charge_id == "ch_2"),
        "{retry:?}"
    );
    ledger.stop().await;
}

#[tokio::test]
async fn a_step_failing_after_side_effects_leaves_the_token_consumed() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect("issue")
        .token;
    let charge = || async { Err::<Receipt, _>(PayError::GatewayTimedOut) };
    let err = client
        .guard_token(&token, ConsumeRequest::new("u"))
        .run(|| async {
            validate(1).before_side_effects()?;
            // A bare `?`: the charge may have gone through, the safe default.
            let receipt = charge().await?;
            Ok::<_, StepError<PayError>>(receipt)
        })
        .await
        .expect_err("the gateway failed");
    assert!(
        matches!(err, GuardError::AfterSideEffects(PayError::GatewayTimedOut)),
        "{err}"
    );
    // Kept consumed: another attempt does not get to run it again.
    let other = client
        .guard_token(&token, ConsumeRequest::new("u"))
        .run(|| async {
            Ok::<_, StepError<PayError>>(Receipt {
                charge_id: "twice".into(),
                amount_minor: 1,
            })
        })
        .await
        .expect("in progress");
    assert!(matches!(other, Guarded::InProgress { .. }), "{other:?}");
    ledger.stop().await;
}
