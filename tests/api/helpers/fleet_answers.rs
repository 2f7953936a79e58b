//! Fast consumes on the instances of one fleet, for the tests of its
//! agreement on Redis: fast tokens issued, each answer's status and outcome
//! (counted as `consumed` or not), a pair of instances on one private Redis,
//! consumes sent into a paused Redis, and the fleet's state waited for.

use futures_util::stream::{self, StreamExt};
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::procs::*;
use crate::helpers::*;

/// Fast tokens of subject `fan` on `app`.
pub async fn issue_likes(app: &TestApp, n: usize) -> Vec<String> {
    stream::iter(0..n)
        .map(|_| app.issue(PAYMENTS, "like", "fan"))
        .buffer_unordered(16)
        .collect()
        .await
}

/// A consume's status and outcome (or error code).
pub type Said = (StatusCode, Option<String>);

pub async fn consume_on(app: &TestApp, token: &str) -> Said {
    let r = app
        .consume(PAYMENTS, token, &json!({"subject": "fan"}))
        .await;
    let (s, _, body) = answer(r).await;
    let said = body["outcome"].as_str().or(body["error"].as_str());
    (s, said.map(str::to_owned))
}

pub fn consumed(a: &Said) -> bool {
    a.0 == StatusCode::OK && a.1.as_deref() == Some("consumed")
}

/// Every answer is 200 or 503, never another error.
pub fn assert_200_or_503(answers: &[Said]) {
    for a in answers {
        assert!(
            a.0 == StatusCode::OK || a.0 == StatusCode::SERVICE_UNAVAILABLE,
            "{a:?}"
        );
    }
}

pub async fn readyz(app: &TestApp) -> Value {
    let r = app
        .http
        .get(format!("{}/readyz", app.address))
        .send()
        .await
        .expect("readyz");
    r.json().await.expect("json")
}

pub async fn wait_fleet(app: &TestApp, secs: u64, state: &'static str) -> Value {
    eventually(secs, || async move {
        let body = readyz(app).await;
        (body["fleet"]["state"] == state).then_some(body)
    })
    .await
}

/// The production timeout, so that a 400 ms stall times a call out.
pub const FAST_TIMEOUT: &str =
    "redis.timeout = \"250ms\"\nbiz.like.issue_rate = \"100000/s\"\nbiz.like.ttl = \"60s\"";

/// Two instances on one Postgres and `redis`, quick to see it down.
pub async fn pair_on(redis: &RedisProc) -> (TestApp, TestApp) {
    let stores = Stores::fresh()
        .redis(&redis.url())
        .with(FAST_TIMEOUT)
        .with("redis.down_after = \"1s\"");
    (
        spawn_app_on(stores.clone()).await,
        spawn_app_on(stores).await,
    )
}

/// With Redis paused: a consume of each token on `app` with request id
/// `late-<i>`, whose script waits in Redis's socket; each answers 503.
pub async fn consume_into_a_paused_redis(app: &TestApp, tokens: &[String]) {
    let late: Vec<Said> = stream::iter(tokens.iter().enumerate())
        .map(|(i, t)| async move { consume_as(app, t, &format!("late-{i}")).await })
        .buffer_unordered(tokens.len().max(1))
        .collect()
        .await;
    for x in &late {
        assert_eq!(x.0, StatusCode::SERVICE_UNAVAILABLE, "{x:?}");
    }
}

/// A consume with a `request_id`: its status, outcome (or error code) and
/// whether the answer was a replay.
pub async fn consume_as(app: &TestApp, token: &str, request_id: &str) -> Said {
    let r = app
        .consume(
            PAYMENTS,
            token,
            &json!({"subject": "fan", "request_id": request_id}),
        )
        .await;
    let (s, _, body) = answer(r).await;
    let said = body["outcome"].as_str().or(body["error"].as_str());
    (s, said.map(str::to_owned))
}
