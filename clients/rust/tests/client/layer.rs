//! The `Idempotency-Key` layer in an axum app over a spawned ledger: every
//! status of the draft, and one run under 20 concurrent identical requests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::{Json, Router};
use idempotency_ledger_client::layer::{codes, PROBLEM_TYPE_BASE};
use idempotency_ledger_client::{Client, IdempotencyLayer, BODY_OMITTED};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::helpers::*;

/// The permits of an open gate: all of them close it. (`acquire_many` takes
/// a `u32`: `Semaphore::MAX_PERMITS` cast to one took only a part of them,
/// and the gate stayed open.)
const GATE: u32 = 1 << 20;

/// A checkout app: `/pay` counts its runs and waits for a permit of `gate`
/// (so a test can hold the first request open); `/flaky` answers 500 on its
/// first run and 201 after; `/reject` answers 400.
struct App {
    url: String,
    runs: Arc<AtomicUsize>,
    gate: Arc<Semaphore>,
}

async fn serve_app(ledger: Client) -> App {
    serve_app_with(ledger, |layer| layer).await
}

/// [`serve_app`] with the layer configured by `configure`; also `/big`,
/// which answers 201 with a 100 KiB body and a `location`.
async fn serve_app_with(
    ledger: Client,
    configure: impl FnOnce(IdempotencyLayer) -> IdempotencyLayer,
) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let gate = Arc::new(Semaphore::new(GATE as usize));
    let (r, g) = (runs.clone(), gate.clone());
    let flaky_runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/pay",
            post(move |Json(body): Json<Value>| {
                let (runs, gate) = (r.clone(), g.clone());
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let _permit = gate.acquire().await.expect("gate open");
                    (
                        StatusCode::CREATED,
                        [("location", format!("/charges/{n}"))],
                        Json(json!({"charge": n, "cart": body["cart"]})),
                    )
                }
            }),
        )
        .route(
            "/flaky",
            post(move || {
                let runs = flaky_runs.clone();
                async move {
                    if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                        (StatusCode::INTERNAL_SERVER_ERROR, "try again")
                    } else {
                        (StatusCode::CREATED, "done")
                    }
                }
            }),
        )
        .route(
            "/reject",
            post(|| async {
                (
                    StatusCode::BAD_REQUEST,
                    Json(json!({"error": "no such cart"})),
                )
            }),
        )
        .route(
            "/big",
            post(|| async {
                (
                    StatusCode::CREATED,
                    [("location", "/charges/big")],
                    Json(json!({"pad": "x".repeat(100 * 1024)})),
                )
            }),
        )
        .layer(configure(IdempotencyLayer::new(ledger, DURABLE)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    App { url, runs, gate }
}

async fn send(
    http: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    body: Value,
) -> reqwest::Response {
    let mut req = http.post(url).json(&body);
    if let Some(key) = key {
        req = req.header("Idempotency-Key", format!("\"{key}\""));
    }
    req.send().await.expect("request")
}

fn replayed(r: &reqwest::Response) -> bool {
    r.headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true")
}

fn is_problem(r: &reqwest::Response) -> bool {
    r.headers()
        .get("content-type")
        .is_some_and(|v| v == "application/problem+json")
}

/// The `code` of a problem answer, after checking its `type` links to it.
async fn problem_code(r: reqwest::Response) -> String {
    assert!(is_problem(&r), "{:?}", r.headers());
    let status = r.status().as_u16();
    let problem: Value = r.json().await.expect("problem json");
    let code = problem["code"].as_str().expect("a code").to_owned();
    assert_eq!(
        problem["type"],
        format!("{PROBLEM_TYPE_BASE}{code}"),
        "{problem}"
    );
    assert_eq!(problem["status"], status);
    code
}

#[tokio::test]
async fn a_keyed_request_runs_once_and_its_retry_gets_the_stored_response_replayed() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client(PAYMENTS)).await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let pay = format!("{}/pay", app.url);

    let first = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    let location = first.headers()["location"].clone();
    let body: Value = first.json().await.expect("json");

    let retry = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert_eq!(retry.status(), StatusCode::CREATED, "the stored status");
    assert!(replayed(&retry));
    assert_eq!(retry.headers()["location"], location);
    assert_eq!(retry.json::<Value>().await.expect("json"), body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "the handler ran once");

    // The same key with another payload: 422, and the handler does not run.
    let other = send(&http, &pay, Some(&key), json!({"cart": "c-2"})).await;
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert!(is_problem(&other));
    assert_eq!(problem_code(other).await, codes::IDEMPOTENCY_KEY_REUSED);
    let other_path = send(
        &http,
        &format!("{}/reject", app.url),
        Some(&key),
        json!({"cart": "c-1"}),
    )
    .await;
    assert_eq!(other_path.status(), StatusCode::UNPROCESSABLE_ENTITY);

    // No key where the layer requires one: 400 problem.
    let missing = send(&http, &pay, None, json!({"cart": "c-1"})).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(missing).await, codes::IDEMPOTENCY_KEY_MISSING);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    ledger.stop().await;
}

#[tokio::test]
async fn a_retry_while_the_first_runs_waits_for_it_and_gets_its_stored_response() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client(PAYMENTS)).await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let pay = format!("{}/pay", app.url);
    let held = app.gate.acquire_many(GATE).await.expect("close the gate");
    let first = tokio::spawn({
        let (http, pay, key) = (http.clone(), pay.clone(), key.clone());
        async move { send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await }
    });
    let runs = app.runs.clone();
    eventually(10, || {
        let runs = runs.clone();
        async move { (runs.load(Ordering::SeqCst) == 1).then_some(()) }
    })
    .await;
    // The retry arrives while the first runs: it waits (the default 3 s).
    let retry = tokio::spawn({
        let (http, pay, key) = (http.clone(), pay.clone(), key.clone());
        async move { send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(!retry.is_finished(), "the retry waits for the first");
    drop(held);
    let first = first.await.expect("first request");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));
    let first_body: Value = first.json().await.expect("json");
    let retry = retry.await.expect("retry");
    assert_eq!(retry.status(), StatusCode::CREATED, "the stored status");
    assert!(replayed(&retry));
    assert_eq!(retry.json::<Value>().await.expect("json"), first_body);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    ledger.stop().await;
}

#[tokio::test]
async fn a_retry_while_the_first_is_running_gets_409_with_retry_after() {
    let ledger = spawn_ledger().await;
    let app = serve_app_with(ledger.client(PAYMENTS), |layer| {
        layer.in_progress_wait(std::time::Duration::from_millis(300))
    })
    .await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let pay = format!("{}/pay", app.url);
    // Close the gate: the first request runs and waits inside the handler.
    let held = app.gate.acquire_many(GATE).await.expect("close the gate");
    let first = tokio::spawn({
        let (http, pay, key) = (http.clone(), pay.clone(), key.clone());
        async move { send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await }
    });
    let runs = app.runs.clone();
    eventually(10, || {
        let runs = runs.clone();
        async move { (runs.load(Ordering::SeqCst) == 1).then_some(()) }
    })
    .await;
    let busy = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert_eq!(busy.status(), StatusCode::CONFLICT);
    assert!(is_problem(&busy));
    assert!(busy.headers().contains_key("retry-after"));
    assert_eq!(problem_code(busy).await, codes::IDEMPOTENCY_KEY_IN_USE);
    drop(held);
    let first = first.await.expect("first request");
    assert_eq!(first.status(), StatusCode::CREATED);
    let after = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert!(replayed(&after));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
    ledger.stop().await;
}

#[tokio::test]
async fn twenty_concurrent_identical_requests_run_the_handler_once() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client(PAYMENTS)).await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(32)
        .build()
        .expect("http");
    let key = uuid::Uuid::new_v4().to_string();
    let pay = format!("{}/pay", app.url);
    let barrier = Arc::new(tokio::sync::Barrier::new(20));
    let tasks: Vec<_> = (0..20)
        .map(|_| {
            let (http, pay, key, barrier) =
                (http.clone(), pay.clone(), key.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let r = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
                (r.status(), replayed(&r))
            })
        })
        .collect();
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("task"));
    }
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "one run: {answers:?}");
    let originals = answers
        .iter()
        .filter(|(s, r)| *s == StatusCode::CREATED && !r)
        .count();
    assert_eq!(originals, 1, "{answers:?}");
    assert!(
        answers
            .iter()
            .all(|(s, r)| (*s == StatusCode::CREATED) || (*s == StatusCode::CONFLICT && !r)),
        "every other answer is the replay or 409: {answers:?}"
    );
    ledger.stop().await;
}

#[tokio::test]
async fn a_5xx_releases_the_key_and_a_4xx_is_stored() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client(PAYMENTS)).await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let flaky = format!("{}/flaky", app.url);
    let first = send(&http, &flaky, Some(&key), json!({})).await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    // Released: the retry runs the handler again, and that answer is stored.
    let second = send(&http, &flaky, Some(&key), json!({})).await;
    assert_eq!(
        (second.status(), replayed(&second)),
        (StatusCode::CREATED, false)
    );
    let third = send(&http, &flaky, Some(&key), json!({})).await;
    assert_eq!(
        (third.status(), replayed(&third)),
        (StatusCode::CREATED, true)
    );

    let key = uuid::Uuid::new_v4().to_string();
    let reject = format!("{}/reject", app.url);
    let first = send(&http, &reject, Some(&key), json!({})).await;
    assert_eq!(
        (first.status(), replayed(&first)),
        (StatusCode::BAD_REQUEST, false)
    );
    let again = send(&http, &reject, Some(&key), json!({})).await;
    assert_eq!(
        (again.status(), replayed(&again)),
        (StatusCode::BAD_REQUEST, true)
    );
    assert_eq!(
        again.json::<Value>().await.expect("json"),
        json!({"error": "no such cart"})
    );
    ledger.stop().await;
}

#[tokio::test]
async fn without_a_reachable_ledger_keyed_requests_are_503_and_bad_keys_400() {
    // No ledger listens here: none of these needs the server's keys routes.
    let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let nobody = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let nobody = Client::builder(&nobody, PAYMENTS)
        .retry(quick_retries(2))
        .build()
        .expect("client");
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let app = Router::new()
        .route(
            "/pay",
            post(move || {
                r.fetch_add(1, Ordering::SeqCst);
                async { "ran" }
            })
            .get(|| async { "read" }),
        )
        .layer(IdempotencyLayer::new(nobody, DURABLE));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}/pay", listener.local_addr().expect("addr"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = reqwest::Client::new();
    let get = http.get(&url).send().await.expect("get");
    assert_eq!(get.text().await.expect("text"), "read");
    let missing = send(&http, &url, None, json!({})).await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    assert!(is_problem(&missing));
    let problem: Value = missing.json().await.expect("problem json");
    assert_eq!(problem["status"], 400);
    assert_eq!(problem["title"], "Idempotency-Key is missing");
    let bad = http
        .post(&url)
        .header("Idempotency-Key", "\"unterminated")
        .json(&json!({}))
        .send()
        .await
        .expect("bad key");
    assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(bad).await, codes::IDEMPOTENCY_KEY_INVALID);
    let long = send(&http, &url, Some(&"k".repeat(256)), json!({})).await;
    assert_eq!(long.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_code(long).await, codes::IDEMPOTENCY_KEY_INVALID);
    // An unscoped key in the shape of a scoped one is refused.
    let reserved = send(
        &http,
        &url,
        Some(&format!("{}:k-1", "ab".repeat(16))),
        json!({}),
    )
    .await;
    assert_eq!(problem_code(reserved).await, codes::IDEMPOTENCY_KEY_INVALID);
    // A good key, but the ledger cannot decide: 503, and the handler never runs.
    let down = send(&http, &url, Some("k-1"), json!({})).await;
    assert_eq!(down.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(is_problem(&down));
    assert!(down.headers().contains_key("retry-after"));
    assert_eq!(problem_code(down).await, codes::LEDGER_UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

async fn send_as(
    http: &reqwest::Client,
    url: &str,
    user: &str,
    key: &str,
    body: Value,
) -> reqwest::Response {
    http.post(url)
        .header("Idempotency-Key", key)
        .header("x-user", user)
        .json(&body)
        .send()
        .await
        .expect("request")
}

#[tokio::test]
async fn with_scope_by_two_users_sending_the_same_key_are_two_keys() {
    let ledger = spawn_ledger().await;
    let app = serve_app_with(ledger.client(PAYMENTS), |layer| {
        layer.scope_by(|req| {
            req.headers()
                .get("x-user")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        })
    })
    .await;
    let http = reqwest::Client::new();
    let pay = format!("{}/pay", app.url);
    // The longest key works scoped too (hashed into the ledger's 255).
    for key in [uuid::Uuid::new_v4().to_string(), "k".repeat(255)] {
        let before = app.runs.load(Ordering::SeqCst);
        let cart = json!({"cart": "c-1"});
        let alice = send_as(&http, &pay, "alice", &key, cart.clone()).await;
        assert_eq!(
            (alice.status(), replayed(&alice)),
            (StatusCode::CREATED, false)
        );
        let alice: Value = alice.json().await.expect("json");
        let bob = send_as(&http, &pay, "bob", &key, cart.clone()).await;
        assert_eq!(
            (bob.status(), replayed(&bob)),
            (StatusCode::CREATED, false),
            "bob's key is not alice's"
        );
        let bob: Value = bob.json().await.expect("json");
        assert_ne!(alice, bob);
        assert_eq!(app.runs.load(Ordering::SeqCst), before + 2);
        for (user, first) in [("alice", &alice), ("bob", &bob)] {
            let again = send_as(&http, &pay, user, &key, cart.clone()).await;
            assert!(replayed(&again), "{user}");
            assert_eq!(&again.json::<Value>().await.expect("json"), first, "{user}");
        }
        // Anonymous (the hook answers None): a third key space.
        let anonymous = send(&http, &pay, Some(&key), cart.clone()).await;
        assert_eq!(
            (anonymous.status(), replayed(&anonymous)),
            (StatusCode::CREATED, false)
        );
        assert_eq!(app.runs.load(Ordering::SeqCst), before + 3);
    }
    ledger.stop().await;
}

#[tokio::test]
async fn a_response_too_large_to_store_replays_without_its_body_and_says_so() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client(PAYMENTS)).await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let big = format!("{}/big", app.url);
    let first = send(&http, &big, Some(&key), json!({})).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(first.headers().get(BODY_OMITTED).is_none());
    let body: Value = first.json().await.expect("the whole body");
    assert_eq!(body["pad"].as_str().map(str::len), Some(100 * 1024));
    let retry = send(&http, &big, Some(&key), json!({})).await;
    assert_eq!(retry.status(), StatusCode::CREATED);
    assert!(replayed(&retry));
    assert_eq!(retry.headers()[BODY_OMITTED], "true");
    assert_eq!(retry.headers()["location"], "/charges/big");
    assert_eq!(retry.headers()["content-type"], "application/json");
    assert!(retry.bytes().await.expect("body").is_empty());
    // A small response's replay does not carry the header.
    let key = uuid::Uuid::new_v4().to_string();
    let pay = format!("{}/pay", app.url);
    send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    let again = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert!(replayed(&again));
    assert!(again.headers().get(BODY_OMITTED).is_none());
    ledger.stop().await;
}

#[tokio::test]
async fn store_status_chooses_which_statuses_are_stored() {
    let ledger = spawn_ledger().await;
    // Only successes stored: a refused request runs again on its retry.
    let app = serve_app_with(ledger.client(PAYMENTS), |layer| {
        layer.store_status(|s| s.is_success())
    })
    .await;
    let http = reqwest::Client::new();
    let key = uuid::Uuid::new_v4().to_string();
    let reject = format!("{}/reject", app.url);
    for _ in 0..2 {
        let r = send(&http, &reject, Some(&key), json!({})).await;
        assert_eq!((r.status(), replayed(&r)), (StatusCode::BAD_REQUEST, false));
    }
    let pay = format!("{}/pay", app.url);
    send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    let again = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert_eq!(
        (again.status(), replayed(&again)),
        (StatusCode::CREATED, true)
    );
    // Everything stored, a 500 too: its retry replays the 500.
    let app = serve_app_with(ledger.client(PAYMENTS), |layer| {
        layer.store_status(|_| true)
    })
    .await;
    let key = uuid::Uuid::new_v4().to_string();
    let flaky = format!("{}/flaky", app.url);
    let first = send(&http, &flaky, Some(&key), json!({})).await;
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let again = send(&http, &flaky, Some(&key), json!({})).await;
    assert_eq!(
        (again.status(), replayed(&again)),
        (StatusCode::INTERNAL_SERVER_ERROR, true)
    );
    ledger.stop().await;
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_with_its_code() {
    let ledger = spawn_ledger().await;
    let app = serve_app_with(ledger.client(PAYMENTS), |layer| {
        layer.max_request_body(1024)
    })
    .await;
    let http = reqwest::Client::new();
    let pay = format!("{}/pay", app.url);
    let key = uuid::Uuid::new_v4().to_string();
    let big = send(&http, &pay, Some(&key), json!({"cart": "x".repeat(2048)})).await;
    assert_eq!(big.status(), StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(problem_code(big).await, codes::PAYLOAD_TOO_LARGE);
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
    // The key was not consumed: a fitting body with it runs.
    let fits = send(&http, &pay, Some(&key), json!({"cart": "c-1"})).await;
    assert_eq!(fits.status(), StatusCode::CREATED);
    ledger.stop().await;
}

/// The ledger refusing the layer's own call (here its API key) is a
/// misconfiguration, not the request's fault: 500 `ledger_error`, the code
/// the Python and Express middlewares answer too, and the handler never runs.
#[tokio::test]
async fn a_refused_api_key_is_500_ledger_error_and_the_handler_does_not_run() {
    let ledger = spawn_ledger().await;
    let app = serve_app(ledger.client("not-a-granted-key")).await;
    let http = reqwest::Client::new();
    let pay = format!("{}/pay", app.url);
    let refused = send(&http, &pay, Some("k-1"), json!({"cart": "c-1"})).await;
    assert_eq!(refused.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(problem_code(refused).await, codes::LEDGER_ERROR);
    assert_eq!(app.runs.load(Ordering::SeqCst), 0);
    ledger.stop().await;
}
