//! Request extractors, in the order API.md checks things: [`Caller`] (401,
//! then the client's request ceiling, 429) first, then [`JsonBody`] (413, 415,
//! 400, including nesting deeper than `limits.max_json_depth`). Both run
//! before any I/O.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use actix_web::dev::Payload;
use actix_web::http::header;
use actix_web::{web, FromRequest, HttpMessage, HttpRequest};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;

use super::error::ApiError;
use super::AppState;
use crate::auth::Client;

/// The authenticated client.
#[derive(Debug, Clone)]
pub struct Caller(pub Arc<Client>);

impl FromRequest for Caller {
    type Error = ApiError;
    type Future = std::future::Ready<Result<Caller, ApiError>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        std::future::ready(authenticate(req))
    }
}

fn authenticate(req: &HttpRequest) -> Result<Caller, ApiError> {
    let state = req
        .app_data::<web::Data<AppState>>()
        .ok_or_else(|| ApiError::internal(anyhow::anyhow!("app state missing")))?;
    let value = req
        .headers()
        .get(header::AUTHORIZATION)
        .ok_or_else(ApiError::unauthorized)?;
    let value = value.as_bytes();
    let key = value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))
        .ok_or_else(ApiError::unauthorized)?;
    let client = state
        .clients
        .authenticate(key)
        .ok_or_else(ApiError::unauthorized)?;
    // For the request's log line (`crate::http`).
    req.extensions_mut().insert(Caller(client.clone()));
    if let Err(wait) = state.clients.admit(client) {
        state
            .ledger
            .metrics()
            .rate_limited
            .with_label_values(&["client"])
            .inc();
        return Err(ApiError::rate_limited(
            wait,
            format!(
                "client `{}` is over its ceiling of {} requests per second",
                client.name, client.rate
            ),
        ));
    }
    // An auditor reads and never writes: every call that could change state
    // (anything but GET and HEAD) is refused here, whatever its route.
    if client.role == crate::auth::Role::Auditor
        && !matches!(
            *req.method(),
            actix_web::http::Method::GET | actix_web::http::Method::HEAD
        )
    {
        return Err(ApiError::forbidden(
            "the auditor role reads only: this call changes state",
        ));
    }
    Ok(Caller(client.clone()))
}

/// A body's size limit, chosen per request type.
pub trait BodyLimit {
    /// Bytes; larger bodies are refused with 413 before they are read whole.
    const LIMIT: usize = 8 * 1024;
}

/// A JSON body: `application/json` only (415), at most `T::LIMIT` bytes
/// (413), parsed strictly into `T` (400: syntax, unknown fields, types).
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned + BodyLimit + 'static> FromRequest for JsonBody<T> {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<JsonBody<T>, ApiError>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let limit = T::LIMIT;
        let content_type_ok = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| {
                let essence = v.split(';').next().unwrap_or("").trim();
                essence.eq_ignore_ascii_case("application/json")
            })
            .unwrap_or(false);
        let declared = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        let max_depth = req
            .app_data::<web::Data<AppState>>()
            .map(|s| s.limits.max_json_depth)
            .unwrap_or(32);
        let mut payload = payload.take();
        Box::pin(async move {
            if declared.is_some_and(|n| n > limit) {
                return Err(ApiError::too_large(limit));
            }
            if !content_type_ok {
                return Err(ApiError::media_type());
            }
            let mut body = web::BytesMut::new();
            while let Some(chunk) = payload.next().await {
                let chunk =
                    chunk.map_err(|_| ApiError::invalid("could not read the request body"))?;
                if body.len() + chunk.len() > limit {
                    return Err(ApiError::too_large(limit));
                }
                body.extend_from_slice(&chunk);
            }
            if nesting_exceeds(&body, max_depth) {
                return Err(ApiError::invalid(format!(
                    "invalid JSON body: nested deeper than {max_depth} levels"
                )));
            }
            serde_json::from_slice::<T>(&body)
                .map(JsonBody)
                .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}")))
        })
    }
}

/// A JSON body that may be left out altogether (every field of `T` is
/// optional): a request with no `Content-Type` and no body is `T::default()`;
/// anything else is read exactly like [`JsonBody`] (API.md: 415 only "where a
/// body is required").
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub T);

impl<T: DeserializeOwned + BodyLimit + Default + 'static> FromRequest for OptionalJsonBody<T> {
    type Error = ApiError;
    type Future = Pin<Box<dyn Future<Output = Result<OptionalJsonBody<T>, ApiError>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        let headers = req.headers();
        let no_body = !headers.contains_key(header::CONTENT_TYPE)
            && headers
                .get(header::CONTENT_LENGTH)
                .is_none_or(|v| v.as_bytes() == b"0")
            && !headers.contains_key(header::TRANSFER_ENCODING);
        if no_body {
            return Box::pin(std::future::ready(Ok(OptionalJsonBody(T::default()))));
        }
        let body = JsonBody::<T>::from_request(req, payload);
        Box::pin(async move { body.await.map(|JsonBody(t)| OptionalJsonBody(t)) })
    }
}

/// Whether arrays and objects in `body` nest deeper than `max`. A linear scan
/// that skips strings; it runs before the parser, so a deeply nested body
/// costs one pass over at most the body limit, never a deep recursion.
pub fn nesting_exceeds(body: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in body {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::nesting_exceeds;
    use proptest::prelude::*;
    use serde_json::Value;

    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[\\[\\]{}\"\\\\a-z]{0,8}".prop_map(Value::from),
        ];
        leaf.prop_recursive(40, 200, 3, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..3).prop_map(Value::from),
                prop::collection::btree_map("[\\[{\"a-z]{0,4}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_scan_agrees_with_the_parsed_depth(v in json(), max in 1usize..40) {
            let text = serde_json::to_vec(&v).unwrap();
            prop_assert_eq!(nesting_exceeds(&text, max), depth(&v) > max);
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = nesting_exceeds(&b, 32);
        }
    }

    #[test]
    fn nesting() {
        assert!(!nesting_exceeds(br#"{"a":[1,{"b":2}]}"#, 3));
        assert!(nesting_exceeds(br#"{"a":[1,{"b":2}]}"#, 2));
        // Brackets inside strings do not count, escaped quotes do not end them.
        assert!(!nesting_exceeds(br#"{"a":"[[[[\"[[[["}"#, 1));
        assert!(nesting_exceeds(br#"{"a":"\\",[[1]]}"#, 2));
        let deep = format!("{}{}", "[".repeat(33), "]".repeat(33));
        assert!(nesting_exceeds(deep.as_bytes(), 32));
        let ok = format!("{}{}", "[".repeat(32), "]".repeat(32));
        assert!(!nesting_exceeds(ok.as_bytes(), 32));
    }
}
