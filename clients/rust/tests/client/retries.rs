//! Retries, proven at a proxy between the client and the ledger: a lost
//! answer is retried with the same `request_id` and learns that it won; 4xx
//! answers are never retried; 503 and 429 are retried after `Retry-After`;
//! the policy's tries and deadline bound it all.

use std::time::Duration;

use idempotency_ledger_client::{Client, ConsumeOutcome, ConsumeRequest, Error, IssueRequest};

use crate::helpers::*;

#[tokio::test]
async fn a_consume_whose_answer_was_lost_is_retried_and_learns_it_won() {
    let ledger = spawn_ledger().await;
    let direct = ledger.client(PAYMENTS);
    for biz in [DURABLE, FAST] {
        let token = direct
            .issue(&IssueRequest::new(biz, "u"))
            .await
            .expect("issue")
            .token;
        let proxy = Proxy::start(&ledger.url, vec![Action::DropAnswer]).await;
        let client = client_via(&proxy, quick_retries(3));
        let outcome = client
            .consume(&token, &ConsumeRequest::new("u"))
            .await
            .expect("the retry answers");
        assert!(
            matches!(outcome, ConsumeOutcome::Won { replayed: true, .. }),
            "{biz}: the first try consumed it, the retry learns it won: {outcome:?}"
        );
        let seen = proxy.seen();
        assert_eq!(seen.len(), 2, "{biz}: one lost answer, one retry");
        assert_eq!(
            seen[0].body, seen[1].body,
            "{biz}: the retry sends the same request_id"
        );
        // Consumed exactly once: any other attempt is a duplicate.
        let other = direct
            .consume(&token, &ConsumeRequest::new("u"))
            .await
            .expect("other attempt");
        assert!(
            matches!(other, ConsumeOutcome::InProgress { .. }),
            "{biz}: {other:?}"
        );
    }
    ledger.stop().await;
}

#[tokio::test]
async fn four_xx_answers_are_never_retried() {
    let ledger = spawn_ledger().await;
    let proxy = Proxy::start(&ledger.url, vec![]).await;
    let client = client_via(&proxy, quick_retries(5));
    let e = client
        .consume("order_garbage", &ConsumeRequest::new("u"))
        .await
        .expect_err("invalid");
    assert!(matches!(e, Error::TokenInvalid(_)), "{e:?}");
    let token = client
        .issue(&IssueRequest::new(DURABLE, "owner"))
        .await
        .expect("issue")
        .token;
    let e = client
        .consume(&token, &ConsumeRequest::new("thief"))
        .await
        .expect_err("mismatch");
    assert!(matches!(e, Error::TokenMismatch(_)), "{e:?}");
    let e = client
        .record_result(&token, "owner", &1)
        .await
        .expect_err("not consumed");
    assert!(matches!(e, Error::NotConsumed(_)), "{e:?}");
    // Four calls, four requests: none was tried twice.
    let lines: Vec<_> = proxy.seen().into_iter().map(|s| s.line).collect();
    assert_eq!(
        lines,
        [
            "POST /v1/tokens/order_garbage/consume".to_owned(),
            "POST /v1/tokens".to_owned(),
            format!("POST /v1/tokens/{token}/consume"),
            format!("POST /v1/tokens/{token}/result"),
        ]
    );
    ledger.stop().await;
}

#[tokio::test]
async fn unavailable_and_rate_limited_are_retried_after_their_retry_after() {
    let ledger = spawn_ledger().await;
    let direct = ledger.client(PAYMENTS);
    for status in [503, 429] {
        let token = direct
            .issue(&IssueRequest::new(DURABLE, "u"))
            .await
            .expect("issue")
            .token;
        let proxy = Proxy::start(
            &ledger.url,
            vec![Action::Refuse {
                status,
                retry_after: 1,
            }],
        )
        .await;
        let client = client_via(&proxy, quick_retries(3));
        let outcome = client
            .consume(&token, &ConsumeRequest::new("u"))
            .await
            .expect("retried");
        // The refusal never reached the ledger: the retry is the first consume.
        assert!(
            matches!(
                outcome,
                ConsumeOutcome::Won {
                    replayed: false,
                    ..
                }
            ),
            "{status}: {outcome:?}"
        );
        let seen = proxy.seen();
        assert_eq!(seen.len(), 2, "{status}: one refusal, one retry");
        assert_eq!(seen[0].body, seen[1].body);
        let gap = seen[1].at - seen[0].at;
        assert!(
            gap >= Duration::from_secs(1),
            "{status}: the retry waited for Retry-After (waited {gap:?})"
        );
    }
    ledger.stop().await;
}

#[tokio::test]
async fn retries_end_at_the_policy_s_tries_and_deadline() {
    let ledger = spawn_ledger().await;
    let refuse = |n| {
        (0..n)
            .map(|_| Action::Refuse {
                status: 503,
                retry_after: 0,
            })
            .collect::<Vec<_>>()
    };
    // Three tries allowed, all refused: the third refusal is the answer.
    let proxy = Proxy::start(&ledger.url, refuse(10)).await;
    let e = client_via(&proxy, quick_retries(3))
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect_err("gave up");
    assert!(matches!(e, Error::Unavailable(_)), "{e:?}");
    assert_eq!(proxy.seen().len(), 3);

    // A Retry-After beyond the deadline is not waited for.
    let proxy = Proxy::start(
        &ledger.url,
        vec![Action::Refuse {
            status: 503,
            retry_after: 60,
        }],
    )
    .await;
    let e = client_via(&proxy, quick_retries(5).deadline(Duration::from_secs(2)))
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect_err("deadline");
    assert_eq!(e.retry_after(), Some(Duration::from_secs(60)));
    assert_eq!(proxy.seen().len(), 1);

    // Nobody listening: connection errors are retried, then reported.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let e = Client::builder(&url, PAYMENTS)
        .retry(quick_retries(2))
        .build()
        .expect("client")
        .issue(&IssueRequest::new(DURABLE, "u"))
        .await
        .expect_err("refused");
    assert!(matches!(e, Error::Transport(_)), "{e:?}");
    ledger.stop().await;
}
