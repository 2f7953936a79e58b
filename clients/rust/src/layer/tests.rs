//! The key header's parsing and a stored response's replay.

use super::key::idempotency_key;
use super::stored::{replay, Stored};
use super::*;

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
    let big = vec![b'x'; MAX_STORED + 1];
    let stored = Stored::of(StatusCode::OK, &h, &keep, &big);
    assert!(stored.body.is_none() && stored.body_base64.is_none());
}
