//! Token routes through the client: every consume outcome as its typed
//! answer, results and releases, and each error answer as its variant.

use idempotency_ledger_client::{
    Client, ConsumeOutcome, ConsumeRequest, Error, IssueRequest, Recorded, State,
};
use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn every_consume_outcome_is_its_typed_answer_durable_and_fast() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    for biz in [DURABLE, FAST] {
        let issued = client
            .issue(&IssueRequest::new(biz, "user-1"))
            .await
            .expect("issue");
        assert_eq!(
            (issued.biz_type.as_str(), issued.subject.as_str()),
            (biz, "user-1")
        );
        assert!(issued.token.starts_with(&format!("{biz}_")));
        let token = issued.token;

        let first = ConsumeRequest::new("user-1").with_fingerprint("sha256:cart-1");
        let won = client.consume(&token, &first).await.expect("consume");
        assert!(
            matches!(
                won,
                ConsumeOutcome::Won {
                    replayed: false,
                    ..
                }
            ),
            "{biz}: {won:?}"
        );

        // The same attempt again: still the winner, marked as a replay.
        let again = client.consume(&token, &first).await.expect("consume again");
        assert!(
            matches!(again, ConsumeOutcome::Won { replayed: true, .. }),
            "{biz}: {again:?}"
        );

        // Another attempt while no result is recorded: in progress.
        let other = ConsumeRequest::new("user-1").with_fingerprint("sha256:cart-1");
        let busy = client.consume(&token, &other).await.expect("duplicate");
        assert!(
            matches!(busy, ConsumeOutcome::InProgress { .. }),
            "{biz}: {busy:?}"
        );

        let result = json!({"charge": "ch_1", "amount_minor": 1000});
        assert_eq!(
            client
                .record_result(&token, "user-1", &result)
                .await
                .expect("result"),
            Recorded { replayed: false }
        );
        assert_eq!(
            client
                .record_result(&token, "user-1", &result)
                .await
                .expect("same result"),
            Recorded { replayed: true }
        );
        let done = client
            .consume(&token, &ConsumeRequest::new("user-1"))
            .await
            .expect("completed");
        match done {
            ConsumeOutcome::Completed {
                result: r,
                consumed_at,
            } => {
                assert_eq!(r, result, "{biz}");
                assert!(consumed_at.is_some());
            }
            other => panic!("{biz}: expected Completed, got {other:?}"),
        }
        // The fingerprint rule holds against the winner's.
        let mismatch = client
            .consume(
                &token,
                &ConsumeRequest::new("user-1").with_fingerprint("sha256:cart-2"),
            )
            .await;
        assert!(
            matches!(mismatch, Err(Error::FingerprintMismatch(_))),
            "{biz}: {mismatch:?}"
        );
    }
    ledger.stop().await;
}

#[tokio::test]
async fn release_gives_the_token_back_and_result_rules_are_typed_errors() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect("issue")
        .token;
    assert!(matches!(
        client.record_result(&token, "u", &json!(1)).await,
        Err(Error::NotConsumed(_))
    ));
    assert!(matches!(
        client.release(&token, "u").await,
        Err(Error::NotReleasable(_))
    ));

    let won = client
        .consume(&token, &ConsumeRequest::new("u"))
        .await
        .expect("consume");
    assert!(won.is_won());
    client.release(&token, "u").await.expect("release");
    let again = client
        .consume(&token, &ConsumeRequest::new("u"))
        .await
        .expect("consume again");
    assert!(
        matches!(
            again,
            ConsumeOutcome::Won {
                replayed: false,
                ..
            }
        ),
        "{again:?}"
    );

    client
        .record_result(&token, "u", &json!("a"))
        .await
        .expect("result");
    assert!(matches!(
        client.record_result(&token, "u", &json!("b")).await,
        Err(Error::ResultAlreadySet(_))
    ));
    assert!(matches!(
        client.release(&token, "u").await,
        Err(Error::NotReleasable(_))
    ));
    ledger.stop().await;
}

#[tokio::test]
async fn error_answers_map_to_their_variants_with_status_and_code() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let admin = ledger.client(ADMIN);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "owner"))
        .await
        .expect("issue")
        .token;

    let e = client
        .consume("order_not-a-token", &ConsumeRequest::new("owner"))
        .await
        .expect_err("garbage");
    assert!(matches!(e, Error::TokenInvalid(_)), "{e:?}");
    assert_eq!(
        (e.status().map(|s| s.as_u16()), e.code()),
        (Some(400), Some("token_invalid"))
    );

    let e = client
        .consume(&token, &ConsumeRequest::new("somebody-else"))
        .await
        .expect_err("other subject");
    assert!(matches!(e, Error::TokenMismatch(_)), "{e:?}");
    let e = client
        .consume(
            &token,
            &ConsumeRequest::new("owner").with_biz_type("refund"),
        )
        .await
        .expect_err("other biz type");
    assert!(matches!(e, Error::TokenMismatch(_)), "{e:?}");

    let e = client
        .issue(&IssueRequest::new("no-such-type", "u"))
        .await
        .expect_err("unknown");
    assert!(matches!(e, Error::UnknownBizType(_)), "{e:?}");
    let e = client
        .issue(&IssueRequest::new(DURABLE, "u").with_ttl_seconds(0))
        .await
        .expect_err("ttl 0");
    assert!(matches!(e, Error::InvalidRequest(_)), "{e:?}");
    let e = ledger
        .client(REFUNDS)
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect_err("not granted");
    assert!(matches!(e, Error::Forbidden(_)), "{e:?}");
    let e = Client::new(&ledger.url, "wrong-key")
        .expect("client")
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect_err("bad key");
    assert!(matches!(e, Error::Unauthorized(_)), "{e:?}");
    let e = client.admin_token(&token).await.expect_err("not admin");
    assert!(matches!(e, Error::Forbidden(_)), "{e:?}");

    // A token that lives one second, never consumed: once the ledger itself
    // holds it as expired, a consume is token_expired.
    let short = client
        .issue(&IssueRequest::new(DURABLE, "late").with_ttl_seconds(1))
        .await
        .expect("issue short")
        .token;
    eventually(10, || {
        let (admin, short) = (admin.clone(), short.clone());
        async move {
            let view = admin.admin_token(&short).await.ok()?;
            (view.state == State::Expired).then_some(())
        }
    })
    .await;
    let e = client
        .consume(&short, &ConsumeRequest::new("late"))
        .await
        .expect_err("expired");
    assert!(matches!(e, Error::TokenExpired(_)), "{e:?}");
    ledger.stop().await;
}

/// A consume that waits (`with_wait`) is answered by the winner's result,
/// as soon as it is recorded; one past the processing lease is `Uncertain`,
/// and so is the token's state and a guard's run.
#[tokio::test]
async fn a_waiting_consume_gets_the_winner_s_result_and_a_lease_s_end_reads_uncertain() {
    let ledger = spawn_ledger_with("[biz.refund]\nprocessing_lease = \"1s\"\n").await;
    let client = ledger.client(PAYMENTS);
    for biz in [DURABLE, FAST] {
        let token = client
            .issue(&IssueRequest::new(biz, "user-1"))
            .await
            .expect("issue")
            .token;
        let won = client
            .consume(&token, &ConsumeRequest::new("user-1"))
            .await
            .expect("consume");
        assert!(won.is_won(), "{won:?}");
        let waiter = tokio::spawn({
            let (client, token) = (client.clone(), token.clone());
            async move {
                let started = std::time::Instant::now();
                let answer = client
                    .consume(
                        &token,
                        &ConsumeRequest::new("user-1").with_wait(std::time::Duration::from_secs(8)),
                    )
                    .await;
                (answer, started.elapsed())
            }
        });
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        client
            .record_result(&token, "user-1", &json!({"paid": biz}))
            .await
            .expect("result");
        let (answer, took) = waiter.await.expect("waiter");
        assert_eq!(
            answer.expect("answered"),
            ConsumeOutcome::Completed {
                result: json!({"paid": biz}),
                consumed_at: match won {
                    ConsumeOutcome::Won { consumed_at, .. } => Some(consumed_at),
                    _ => None,
                },
            },
            "{biz}"
        );
        assert!(
            took < std::time::Duration::from_secs(5),
            "{biz}: woken by the result, {took:?}"
        );
    }

    let token = client
        .issue(&IssueRequest::new("refund", "user-1"))
        .await
        .expect("issue")
        .token;
    let won = client
        .consume(&token, &ConsumeRequest::new("user-1"))
        .await
        .expect("consume");
    assert!(won.is_won());
    let dup = eventually(10, || {
        let (client, token) = (client.clone(), token.clone());
        async move {
            let dup = client
                .consume(&token, &ConsumeRequest::new("user-1"))
                .await
                .expect("consume");
            matches!(dup, ConsumeOutcome::Uncertain { .. }).then_some(dup)
        }
    })
    .await;
    assert!(matches!(
        dup,
        ConsumeOutcome::Uncertain {
            consumed_at: Some(_)
        }
    ));
    let state = client.token_state(&token, "user-1").await.expect("state");
    assert_eq!(state.state, State::Uncertain);
    let guarded = client
        .guard_token(&token, ConsumeRequest::new("user-1"))
        .wait(std::time::Duration::from_millis(200))
        .run(|| async { Ok::<_, idempotency_ledger_client::StepError<String>>(json!(1)) })
        .await
        .expect("guarded");
    assert!(
        matches!(
            guarded,
            idempotency_ledger_client::Guarded::Uncertain { .. }
        ),
        "{guarded:?}"
    );
    ledger.stop().await;
}
