//! Orders and admin routes through the client: typed answers and refusals.

use idempotency_ledger_client::{
    AuditQuery, Close, ConsumeOutcome, ConsumeRequest, CreateOrder, Error, EventOutcome,
    IssueRequest, OrderState, Pay, ReconcileRequest, Refund, State,
};
use serde_json::json;

use crate::helpers::*;

#[tokio::test]
async fn an_order_is_created_paid_refunded_with_typed_answers() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let order = CreateOrder {
        order_id: format!("ord-{}", uuid::Uuid::new_v4().simple()),
        subject: "buyer".into(),
        amount_minor: 1000,
        currency: "CNY".into(),
    };
    let created = client.create_order(&order).await.expect("create");
    assert!(created.created);
    assert_eq!(created.order.state, OrderState::Created);
    assert_eq!(created.order.events[0].kind, "order.created");
    let again = client.create_order(&order).await.expect("create again");
    assert!(!again.created);
    let other = CreateOrder {
        amount_minor: 2000,
        ..order.clone()
    };
    assert!(matches!(
        client.create_order(&other).await,
        Err(Error::OrderConflict(_))
    ));

    let issue = || async { client.issue(&IssueRequest::new(DURABLE, "buyer")).await };
    let pay_token = issue().await.expect("issue").token;
    let pay = Pay::new(&pay_token);
    let paid = client.pay(&order.order_id, &pay).await.expect("pay");
    assert!(
        matches!(
            &paid,
            EventOutcome::Applied {
                replayed: false,
                ..
            }
        ),
        "{paid:?}"
    );
    assert_eq!(paid.order().state, OrderState::Paid);
    // The same request again (its request_id): the applied answer, replayed.
    let replay = client.pay(&order.order_id, &pay).await.expect("pay replay");
    assert!(
        matches!(&replay, EventOutcome::Applied { replayed: true, .. }),
        "{replay:?}"
    );
    // The same token for the same event, another request: a duplicate.
    let dup = client
        .pay(&order.order_id, &Pay::new(&pay_token))
        .await
        .expect("dup");
    assert!(matches!(&dup, EventOutcome::Duplicate { .. }), "{dup:?}");

    let second = issue().await.expect("issue").token;
    let e = client
        .pay(&order.order_id, &Pay::new(&second))
        .await
        .expect_err("paid twice");
    assert!(matches!(e, Error::IllegalTransition(_)), "{e:?}");
    assert_eq!(
        e.problem().and_then(|p| p.body.get("state")),
        Some(&json!("PAID"))
    );
    let e = client
        .refund(&order.order_id, &Refund::new(&second, 5000))
        .await
        .expect_err("too much");
    assert!(matches!(e, Error::RefundExceedsPaid(_)), "{e:?}");
    let refunded = client
        .refund(
            &order.order_id,
            &Refund::new(&second, 400).with_reason("damaged"),
        )
        .await
        .expect("refund");
    assert_eq!(refunded.order().state, OrderState::PartiallyRefunded);
    assert_eq!(refunded.order().refunded_minor, 400);
    let e = client
        .close(
            &order.order_id,
            &Close::new(issue().await.expect("issue").token),
        )
        .await
        .expect_err("close a paid order");
    assert!(matches!(e, Error::IllegalTransition(_)), "{e:?}");

    let fetched = client.order(&order.order_id).await.expect("get");
    assert_eq!(fetched.events.len(), 3);
    assert!(matches!(
        ledger.client(REFUNDS).order(&order.order_id).await,
        Err(Error::OrderNotFound(_))
    ));
    let fast = client
        .issue(&IssueRequest::new(FAST, "buyer"))
        .await
        .expect("fast")
        .token;
    assert!(matches!(
        client.close(&order.order_id, &Close::new(fast)).await,
        Err(Error::DurableTokenRequired(_))
    ));
    ledger.stop().await;
}

#[tokio::test]
async fn admin_views_audit_stats_and_reconcile_are_typed() {
    let ledger = spawn_ledger().await;
    let client = ledger.client(PAYMENTS);
    let admin = ledger.client(ADMIN);
    let token = client
        .issue(&IssueRequest::new(DURABLE, "audited"))
        .await
        .expect("issue")
        .token;
    let req = ConsumeRequest::new("audited").with_fingerprint("sha256:x");
    assert!(client
        .consume(&token, &req)
        .await
        .expect("consume")
        .is_won());
    let dup = client
        .consume(&token, &ConsumeRequest::new("audited"))
        .await
        .expect("dup");
    assert!(matches!(dup, ConsumeOutcome::InProgress { .. }));

    let view = eventually(10, || {
        let (admin, token) = (admin.clone(), token.clone());
        async move { admin.admin_token(&token).await.ok() }
    })
    .await;
    assert_eq!(view.state, State::Consumed);
    assert_eq!(view.client.as_deref(), Some("payments"));
    assert_eq!(view.request_id.as_deref(), Some(req.request_id()));
    assert_eq!(view.fingerprint.as_deref(), Some("sha256:x"));
    assert!(view.events.iter().any(|e| e.kind == "token.consumed"));

    // The issuance record reaches Postgres in a batch a few milliseconds
    // after the answer: wait for it rather than assume it is there.
    let page = eventually(10, || {
        let admin = admin.clone();
        async move {
            let page = admin
                .audit(&AuditQuery {
                    subject: Some("audited".into()),
                    limit: Some(10),
                    ..AuditQuery::default()
                })
                .await
                .expect("audit");
            page.events
                .iter()
                .any(|e| e.kind == "token.issued")
                .then_some(page)
        }
    })
    .await;
    assert!(page
        .events
        .iter()
        .all(|e| e.subject.as_deref() == Some("audited")));
    assert!(page.events.iter().any(|e| e.kind == "token.issued"));
    assert!(matches!(
        admin
            .audit(&AuditQuery {
                cursor: Some("garbage".into()),
                ..AuditQuery::default()
            })
            .await,
        Err(Error::InvalidCursor(_))
    ));

    let stats = admin.stats(Some("1h")).await.expect("stats");
    assert_eq!(stats.window, "1h");
    assert!(stats.biz_types.contains_key(DURABLE));

    let report = admin
        .reconcile(&ReconcileRequest {
            dry_run: true,
            ..ReconcileRequest::default()
        })
        .await
        .expect("reconcile");
    assert!(report.dry_run);
    assert!(report.found.contains_key("order_inconsistent"));
    assert!(matches!(
        admin.admin_token("order_forged").await,
        Err(Error::TokenInvalid(_))
    ));
    ledger.stop().await;
}
