//! Request limits that actix does not make configurable, checked before
//! routing and before any I/O: the length of the path and query (414
//! `uri_too_long`) and the total size of the headers (431
//! `headers_too_large`). Body size and JSON depth are checked by
//! [`super::extract::JsonBody`]; actix itself closes a request head above
//! 128 KiB or with more than 96 headers, and slow heads after
//! `limits.request_head_timeout`.

use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::middleware::Next;
use actix_web::{web, ResponseError};

use super::error::ApiError;
use super::AppState;

pub async fn guard(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let limits = req.app_data::<web::Data<AppState>>().map(|s| {
        let l = &s.limits;
        (l.max_uri_bytes, l.max_header_bytes)
    });
    if let Some((max_uri, max_headers)) = limits {
        let uri = req
            .uri()
            .path_and_query()
            .map(|pq| pq.as_str().len())
            .unwrap_or(0);
        let refusal = if uri > max_uri {
            Some(ApiError::uri_too_long(max_uri))
        } else {
            let headers: usize = req
                .headers()
                .iter()
                .map(|(k, v)| k.as_str().len() + v.len())
                .sum();
            (headers > max_headers).then(|| ApiError::headers_too_large(max_headers))
        };
        if let Some(err) = refusal {
            let resp = err.error_response();
            return Ok(req.into_response(resp).map_into_right_body());
        }
    }
    next.call(req)
        .await
        .map(ServiceResponse::map_into_left_body)
}
