//! A response as the key's result in the ledger (status, kept headers,
//! body as text or base64), and its replay to a retry.

use super::*;

/// A response as the key's result.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Stored {
    pub(super) status: u16,
    pub(super) headers: Vec<(String, String)>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) body: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) body_base64: Option<String>,
    /// The body was too large to store. (Results stored before this flag
    /// existed say so by having neither `body` nor `body_base64`: an empty
    /// body is stored as `""`.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(super) body_omitted: bool,
}

impl Stored {
    pub(super) fn of(
        status: StatusCode,
        headers: &HeaderMap,
        keep: &[HeaderName],
        body: &[u8],
    ) -> Stored {
        let headers = keep
            .iter()
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .filter_map(|v| v.to_str().ok())
                    .map(|v| (name.as_str().to_owned(), v.to_owned()))
            })
            .collect();
        let mut stored = Stored {
            status: status.as_u16(),
            headers,
            body: None,
            body_base64: None,
            body_omitted: false,
        };
        match std::str::from_utf8(body) {
            // Postgres cannot hold U+0000 in JSON text: such bodies go as base64.
            Ok(text) if !text.contains('\0') => stored.body = Some(text.to_owned()),
            _ => stored.body_base64 = Some(base64::engine::general_purpose::STANDARD.encode(body)),
        }
        let size = serde_json::to_vec(&stored).map_or(usize::MAX, |v| v.len());
        if size > MAX_STORED {
            stored.body = None;
            stored.body_base64 = None;
            stored.body_omitted = true;
        }
        stored
    }
}

/// The stored response again, with `Idempotent-Replayed: true` (and
/// `Idempotent-Body-Omitted: true` when its body was not stored).
pub(super) fn replay(result: serde_json::Value) -> Response<BoxBody> {
    let stored: Stored = match serde_json::from_value(result) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "the key's result is not a stored response");
            return problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::STORED_RESPONSE_UNREADABLE,
                "Stored response unreadable",
                "This Idempotency-Key was completed, but its response cannot be replayed.",
            );
        }
    };
    let omitted = stored.body_omitted || (stored.body.is_none() && stored.body_base64.is_none());
    let body = match (stored.body, stored.body_base64) {
        (Some(text), _) => Bytes::from(text),
        (None, Some(b64)) => match base64::engine::general_purpose::STANDARD.decode(b64) {
            Ok(bytes) => Bytes::from(bytes),
            Err(e) => {
                tracing::error!(error = %e, "the key's stored body is not base64");
                return problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    codes::STORED_RESPONSE_UNREADABLE,
                    "Stored response unreadable",
                    "This Idempotency-Key was completed, but its response cannot be replayed.",
                );
            }
        },
        (None, None) => Bytes::new(),
    };
    let mut resp = Response::new(full(body));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    for (name, value) in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            resp.headers_mut().append(name, value);
        }
    }
    resp.headers_mut().insert(
        HeaderName::from_static(REPLAYED),
        HeaderValue::from_static("true"),
    );
    if omitted {
        resp.headers_mut().insert(
            HeaderName::from_static(BODY_OMITTED),
            HeaderValue::from_static("true"),
        );
    }
    resp
}
