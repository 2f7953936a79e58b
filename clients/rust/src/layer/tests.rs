//! The key header's parsing and a stored response's replay.

use std::io::Write;
use std::sync::Mutex;

use super::key::{idempotency_key, ledger_key};
use super::stored::{replay, Stored};
use super::*;
use crate::fingerprint::short_digest;

fn key_of(v: &str) -> Result<Option<String>, String> {
    let mut h = HeaderMap::new();
    h.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(v).unwrap());
    idempotency_key(&h)
}

#[test]
fn keys_are_read_quoted_or_bare_and_bad_ones_refused() {
    assert_eq!(
        key_of(r#""8e03978e-40d5""#),
        Ok(Some("8e03978e-40d5".into()))
    );
    assert_eq!(key_of(r#""a\"b\\c""#), Ok(Some(r#"a"b\c"#.into())));
    assert_eq!(key_of("  bare-key "), Ok(Some("bare-key".into())));
    assert!(key_of(r#""open"#).is_err());
    assert!(key_of(r#""a"b""#).is_err());
    assert!(key_of(r#""""#).is_err());
    assert!(key_of("tab\there").is_err());
    assert_eq!(idempotency_key(&HeaderMap::new()), Ok(None));
    let mut two = HeaderMap::new();
    two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
    two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("b"));
    assert!(idempotency_key(&two).is_err());
}

#[test]
fn stored_responses_replay_status_kept_headers_and_body() {
    let mut h = HeaderMap::new();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    h.insert("set-cookie", HeaderValue::from_static("secret=1"));
    let keep = [HeaderName::from_static("content-type")];
    for body in [&b"{\"ok\":true}"[..], &[0xff, 0x00, 0x01][..]] {
        let stored = Stored::of(StatusCode::CREATED, &h, &keep, body);
        let resp = replay(serde_json::to_value(&stored).unwrap());
        assert_eq!(resp.status(), StatusCode::CREATED);
        assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
        assert!(resp.headers().get("set-cookie").is_none());
        assert_eq!(resp.headers()[REPLAYED], "true");
    }
    let small = Stored::of(StatusCode::CREATED, &h, &keep, b"{}");
    assert!(!small.body_omitted);
    let resp = replay(serde_json::to_value(&small).unwrap());
    assert!(resp.headers().get(BODY_OMITTED).is_none());
    // An empty body is a stored body, not an omitted one.
    let empty = Stored::of(StatusCode::NO_CONTENT, &h, &keep, b"");
    let resp = replay(serde_json::to_value(&empty).unwrap());
    assert!(resp.headers().get(BODY_OMITTED).is_none());
}

async fn body_of(resp: Response<BoxBody>) -> Bytes {
    resp.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn a_body_too_large_to_store_replays_status_and_headers_and_says_so() {
    let mut h = HeaderMap::new();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let keep = [HeaderName::from_static("content-type")];
    let big = vec![b'x'; MAX_STORED + 1];
    let stored = Stored::of(StatusCode::CREATED, &h, &keep, &big);
    assert!(stored.body.is_none() && stored.body_base64.is_none());
    assert!(stored.body_omitted);
    let json = serde_json::to_value(&stored).unwrap();
    assert_eq!(json["body_omitted"], true);
    assert!(serde_json::to_vec(&json).unwrap().len() < 1024);
    let resp = replay(json);
    assert_eq!(resp.status(), StatusCode::CREATED);
    assert_eq!(resp.headers()[CONTENT_TYPE], "application/json");
    assert_eq!(resp.headers()[REPLAYED], "true");
    assert_eq!(resp.headers()[BODY_OMITTED], "true");
    assert!(body_of(resp).await.is_empty());
    // A result stored before the flag existed: no body of either kind.
    let old = serde_json::json!({"status": 200, "headers": []});
    let resp = replay(old);
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[BODY_OMITTED], "true");
    // A just-fitting body is stored whole.
    let fits = Stored::of(StatusCode::OK, &h, &keep, &vec![b'x'; 50 * 1024]);
    assert!(!fits.body_omitted && fits.body.is_some());
}

#[tokio::test]
async fn an_unreadable_stored_result_is_a_500_problem_with_its_code() {
    for bad in [
        serde_json::json!({"unexpected": true}),
        serde_json::json!({"status": 200, "headers": [], "body_base64": "***"}),
    ] {
        let resp = replay(bad);
        assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body: serde_json::Value = serde_json::from_slice(&body_of(resp).await).unwrap();
        assert_eq!(body["code"], codes::STORED_RESPONSE_UNREADABLE);
    }
}

#[tokio::test]
async fn problems_carry_a_stable_code_and_a_type_into_the_docs() {
    let resp = problem(
        StatusCode::CONFLICT,
        codes::IDEMPOTENCY_KEY_IN_USE,
        "title",
        "detail",
    );
    assert_eq!(resp.status(), StatusCode::CONFLICT);
    assert_eq!(resp.headers()[CONTENT_TYPE], "application/problem+json");
    let body: serde_json::Value = serde_json::from_slice(&body_of(resp).await).unwrap();
    assert_eq!(body["code"], "idempotency_key_in_use");
    assert_eq!(
        body["type"],
        "https://github.com/idempotency-ledger/idempotency-ledger/blob/main/docs/integration.md#idempotency_key_in_use"
    );
    assert_eq!(body["status"], 409);
    assert_eq!(body["title"], "title");
    assert_eq!(body["detail"], "detail");
    // Codes are distinct snake_case anchors.
    let mut all = codes::ALL.to_vec();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), codes::ALL.len());
    assert!(codes::ALL
        .iter()
        .all(|c| c.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')));
}

#[test]
fn scoped_keys_hash_the_scope_in_and_keep_every_key_length_working() {
    let digest = short_digest("user-1");
    assert_eq!(ledger_key(None, "k-1"), Ok("k-1".into()));
    assert_eq!(
        ledger_key(Some("user-1"), "k-1"),
        Ok(format!("{digest}:k-1"))
    );
    assert_ne!(
        ledger_key(Some("user-1"), "k-1"),
        ledger_key(Some("user-2"), "k-1")
    );
    // The longest key, scoped: hashed, within the ledger's 255.
    let long = "k".repeat(MAX_KEY);
    let scoped = ledger_key(Some("user-1"), &long).unwrap();
    assert!(scoped.len() <= MAX_KEY, "{scoped}");
    assert!(scoped.starts_with(&format!("{digest}#")));
    let other = ledger_key(Some("user-1"), &"k".repeat(MAX_KEY - 1)).unwrap();
    assert_ne!(scoped, other);
    // Over 255 is refused, scoped or not.
    assert!(ledger_key(None, &"k".repeat(MAX_KEY + 1)).is_err());
    assert!(ledger_key(Some("user-1"), &"k".repeat(MAX_KEY + 1)).is_err());
    assert_eq!(ledger_key(None, &long), Ok(long.clone()));
    // An unscoped key may not take the shape of a scoped one.
    assert!(ledger_key(None, &format!("{digest}:k-1")).is_err());
    assert!(ledger_key(None, &format!("{digest}#abc")).is_err());
    assert!(ledger_key(None, &format!("{digest}-k-1")).is_ok());
    assert!(ledger_key(None, &digest).is_ok());
    // Scoped, such a key is just a key.
    assert!(ledger_key(Some("user-1"), &format!("{digest}:k-1")).is_ok());
}

#[test]
fn the_scope_hooks_see_the_request_head() {
    let req = Request::builder()
        .method(Method::POST)
        .uri("/pay")
        .header("x-user", "alice")
        .body(())
        .unwrap();
    let (parts, ()) = req.into_parts();
    let by_request = Scoping::Request(Arc::new(|r: &Request<()>| {
        r.headers()
            .get("x-user")
            .map(|v| format!("{}:{}", r.uri().path(), v.to_str().unwrap()))
    }));
    let (parts, scope) = by_request.of(parts);
    assert_eq!(scope.as_deref(), Some("/pay:alice"));
    let by_parts = Scoping::Parts(Arc::new(|p: &http::request::Parts| {
        Some(p.method.to_string())
    }));
    let (parts, scope) = by_parts.of(parts);
    assert_eq!(scope.as_deref(), Some("POST"));
    assert_eq!(Scoping::Shared.of(parts).1, None);
}

#[test]
fn stored_statuses_default_to_below_500_except_408_and_429() {
    for (status, stored) in [
        (200, true),
        (201, true),
        (302, true),
        (400, true),
        (404, true),
        (409, true),
        (422, true),
        (408, false),
        (429, false),
        (500, false),
        (503, false),
    ] {
        assert_eq!(
            stored_by_default(StatusCode::from_u16(status).unwrap()),
            stored,
            "{status}"
        );
    }
}

/// Log lines written by a `tracing` subscriber.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Lines {
    fn count(&self, needle: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .matches(needle)
            .count()
    }
}

fn warnings_while(f: impl FnOnce()) -> Lines {
    let lines = Lines::default();
    let writer = lines.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    lines
}

#[test]
fn a_layer_without_a_scope_warns_once_that_keys_are_shared() {
    const SHARED: &str = "shared across all end users";
    let client = Client::new("http://127.0.0.1:9", "k").unwrap();
    let lines = warnings_while(|| {
        let layer = IdempotencyLayer::new(client.clone(), "order");
        let _a = layer.layer(());
        let _b = layer.clone().layer(());
        let _c = layer.layer(());
    });
    assert_eq!(lines.count(SHARED), 1);
    assert_eq!(lines.count("WARN"), 1);
    for chosen in [
        IdempotencyLayer::new(client.clone(), "order").unscoped(),
        IdempotencyLayer::new(client.clone(), "order").scope_by(|_| None),
        IdempotencyLayer::new(client.clone(), "order").scope(|_| None),
    ] {
        let lines = warnings_while(|| {
            let _ = chosen.layer(());
        });
        assert_eq!(lines.count(SHARED), 0);
    }
}
