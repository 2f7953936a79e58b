//! Client-supplied keys (`/v1/keys/*`) against a spawned ledger, and the
//! token-state read (`GET /v1/tokens/{token}`) and the admin release.

use idempotency_ledger_client::{
    Client, ConsumeOutcome, ConsumeRequest, Error, GuardError, Guarded, IssueRequest,
    KeyConsumeRequest, SideEffects, State, StepError,
};
use serde_json::json;

use crate::helpers::*;

fn fresh_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}

#[tokio::test]
async fn every_key_consume_outcome_is_typed_durable_and_fast() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    for biz in [DURABLE, FAST] {
        let key = fresh_key();
        let first = KeyConsumeRequest::new(biz, &key).with_fingerprint("sha256:a");
        let won = client.consume_key(&first).await.expect("consume");
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
        let again = client.consume_key(&first).await.expect("same attempt");
        assert!(
            matches!(again, ConsumeOutcome::Won { replayed: true, .. }),
            "{biz}: {again:?}"
        );
        let busy = client
            .consume_key(&KeyConsumeRequest::new(biz, &key).with_fingerprint("sha256:a"))
            .await
            .expect("duplicate");
        assert!(
            matches!(busy, ConsumeOutcome::InProgress { .. }),
            "{biz}: {busy:?}"
        );
        let mismatch = client
            .consume_key(&KeyConsumeRequest::new(biz, &key).with_fingerprint("sha256:b"))
            .await;
        assert!(
            matches!(mismatch, Err(Error::FingerprintMismatch(_))),
            "{biz}: {mismatch:?}"
        );

        let state = client.key_state(biz, &key).await.expect("state");
        assert_eq!((state.state, state.result.clone()), (State::Consumed, None));
        client
            .record_key_result(biz, &key, &json!({"ok": 1}))
            .await
            .expect("result");
        let done = client
            .consume_key(&KeyConsumeRequest::new(biz, &key))
            .await
            .expect("completed");
        assert!(
            matches!(&done, ConsumeOutcome::Completed { result, .. } if *result == json!({"ok": 1})),
            "{biz}: {done:?}"
        );
        assert!(matches!(
            client.release_key(biz, &key).await,
            Err(Error::NotReleasable(_))
        ));
        assert!(matches!(
            client.key_state(biz, &fresh_key()).await,
            Err(Error::KeyNotFound(_))
        ));

        // Released keys can be consumed again.
        let other = fresh_key();
        assert!(client
            .consume_key(&KeyConsumeRequest::new(biz, &other))
            .await
            .expect("consume")
            .is_won());
        client.release_key(biz, &other).await.expect("release");
        assert!(client
            .consume_key(&KeyConsumeRequest::new(biz, &other))
            .await
            .expect("consume again")
            .is_won());
    }
    ledger.stop().await;
}

#[tokio::test]
async fn two_clients_equal_keys_never_collide_and_subjects_bind() {
    let ledger = spawn_ledger().await;
    let key = fresh_key();
    for api_key in [PAYMENTS, REFUNDS] {
        let won = ledger
            .client(api_key)
            .consume_key(&KeyConsumeRequest::new("refund", &key).with_subject("alice"))
            .await
            .expect("consume");
        assert!(
            won.is_won(),
            "{api_key}: another client's key is another key"
        );
    }
    let e = ledger
        .client(PAYMENTS)
        .consume_key(&KeyConsumeRequest::new("refund", &key).with_subject("mallory"))
        .await
        .expect_err("another subject");
    assert!(matches!(e, Error::TokenMismatch(_)), "{e:?}");
    let view = ledger
        .client(ADMIN)
        .admin_key("payments", "refund", &key)
        .await
        .expect("admin view");
    assert_eq!(
        (view.client.as_str(), view.state),
        ("payments", State::Consumed)
    );
    assert!(view.events.iter().any(|e| e.kind == "key.consumed"));
    ledger.stop().await;
}

#[tokio::test]
async fn a_key_consume_whose_answer_was_lost_learns_it_won() {
    let ledger = spawn_ledger().await;
    let proxy = Proxy::start(&ledger.url, vec![Action::DropAnswer]).await;
    let client = client_via(&proxy, quick_retries(3));
    let key = fresh_key();
    let outcome = client
        .consume_key(&KeyConsumeRequest::new(DURABLE, &key))
        .await
        .expect("retried");
    assert!(
        matches!(outcome, ConsumeOutcome::Won { replayed: true, .. }),
        "{outcome:?}"
    );
    assert_eq!(proxy.seen().len(), 2);
    ledger.stop().await;
}

#[tokio::test]
async fn the_guard_over_keys_takes_its_three_paths() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let guard = |key: &str| client.guard_key(KeyConsumeRequest::new(DURABLE, key));

    let ok = fresh_key();
    let ran = guard(&ok)
        .run(|| async { Ok::<_, StepError<String>>(7u32) })
        .await
        .expect("ran");
    assert_eq!(ran, Guarded::Ran(7));
    let replayed = guard(&ok)
        .run(|| async { Ok::<_, StepError<String>>(8u32) })
        .await
        .expect("replayed");
    assert_eq!(replayed, Guarded::Completed(7));

    let before = fresh_key();
    let e = guard(&before)
        .run(|| async { Err::<u32, _>("invalid".to_owned()).before_side_effects() })
        .await
        .expect_err("before");
    assert!(
        matches!(
            e,
            GuardError::BeforeSideEffects {
                released: Ok(_),
                ..
            }
        ),
        "{e}"
    );
    assert!(client
        .consume_key(&KeyConsumeRequest::new(DURABLE, &before))
        .await
        .expect("consume again")
        .is_won());

    let after = fresh_key();
    let e = guard(&after)
        .run(|| async { Err::<u32, _>(StepError::<String>::after("gateway")) })
        .await
        .expect_err("after");
    assert!(matches!(e, GuardError::AfterSideEffects(_)), "{e}");
    let busy = client
        .consume_key(&KeyConsumeRequest::new(DURABLE, &after))
        .await
        .expect("duplicate");
    assert!(
        matches!(busy, ConsumeOutcome::InProgress { .. }),
        "{busy:?}"
    );
    ledger.stop().await;
}

#[tokio::test]
async fn a_token_s_state_is_read_without_consuming_and_an_admin_frees_a_stuck_one() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect("issue")
        .token;
    let state = client.token_state(&token, "u").await.expect("state");
    assert_eq!((state.state, state.consumed_at), (State::Issued, None));
    // Reading twice consumes nothing.
    assert_eq!(
        client.token_state(&token, "u").await.expect("state").state,
        State::Issued
    );
    assert!(client
        .consume(&token, &ConsumeRequest::new("u"))
        .await
        .expect("consume")
        .is_won());
    assert_eq!(
        client.token_state(&token, "u").await.expect("state").state,
        State::Consumed
    );
    assert!(matches!(
        client.token_state(&token, "somebody").await,
        Err(Error::TokenMismatch(_))
    ));

    // Its consumer "died": an operator frees it, and it is consumable again.
    let admin: Client = ledger.client(ADMIN);
    assert!(matches!(
        admin.admin_release_token(&token, "").await,
        Err(Error::InvalidRequest(_))
    ));
    admin
        .admin_release_token(&token, "consumer crashed, ticket OPS-1")
        .await
        .expect("admin release");
    assert!(client
        .consume(&token, &ConsumeRequest::new("u"))
        .await
        .expect("consume again")
        .is_won());
    client.record_result(&token, "u", &1).await.expect("result");
    assert!(matches!(
        admin.admin_release_token(&token, "too late").await,
        Err(Error::NotReleasable(_))
    ));
    ledger.stop().await;
}
