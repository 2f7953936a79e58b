//! The read-only web console (`GET /console`): one HTML page, its script,
//! its stylesheet and its icon, embedded in the binary (no CDN, no build
//! step: plain HTML, CSS and an ES module). The assets need no key; the page
//! asks for an API key (kept in the tab's `sessionStorage`) and reads the
//! admin API with it, so the console can do exactly what that key can.
//!
//! Every asset is sent with a Content-Security-Policy that allows only this
//! origin (no inline script or style, no other host), `nosniff`, no referrer
//! and no framing.

use actix_web::http::header::{self, HeaderValue};
use actix_web::{web, HttpResponse};

use super::error::ApiError;

const INDEX_HTML: &str = include_str!("console/index.html");
const APP_JS: &str = include_str!("console/app.js");
const APP_CSS: &str = include_str!("console/app.css");
const ICON_SVG: &str = include_str!("console/icon.svg");

/// Only this origin: scripts, styles, images and API calls; nothing else.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
    style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; \
    form-action 'none'; frame-ancestors 'none'";

/// The embedded asset named `name` (the last path segment under
/// `/console/`) and its content type.
fn asset(name: &str) -> Option<(&'static str, &'static str)> {
    match name {
        "index.html" => Some((INDEX_HTML, "text/html; charset=utf-8")),
        "app.js" => Some((APP_JS, "text/javascript; charset=utf-8")),
        "app.css" => Some((APP_CSS, "text/css; charset=utf-8")),
        "icon.svg" => Some((ICON_SVG, "image/svg+xml")),
        _ => None,
    }
}

fn respond(body: &'static str, content_type: &'static str) -> HttpResponse {
    let mut res = HttpResponse::Ok();
    res.insert_header((header::CONTENT_TYPE, HeaderValue::from_static(content_type)))
        .insert_header((
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CONTENT_SECURITY_POLICY),
        ))
        .insert_header((
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ))
        .insert_header((
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ))
        .insert_header((header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")))
        // The assets change with the binary: revalidate rather than cache.
        .insert_header((header::CACHE_CONTROL, HeaderValue::from_static("no-cache")));
    res.body(body)
}

/// `GET /console` (and `/console/`): the page.
pub async fn index() -> HttpResponse {
    respond(INDEX_HTML, "text/html; charset=utf-8")
}

/// `GET /console/{asset}`: the script, the stylesheet, the icon; anything
/// else is 404 `not_found` like every unknown path.
pub async fn file(name: web::Path<String>) -> Result<HttpResponse, ApiError> {
    asset(&name)
        .map(|(body, content_type)| respond(body, content_type))
        .ok_or_else(ApiError::not_found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_asset_the_page_names_is_served() {
        for name in ["app.js", "app.css", "icon.svg"] {
            assert!(
                INDEX_HTML.contains(&format!("/console/{name}")),
                "index.html does not load {name}"
            );
            assert!(asset(name).is_some(), "{name} is not served");
        }
        assert!(asset("../Cargo.toml").is_none());
        assert!(asset("app.js.map").is_none());
    }

    /// Whether `html` has an attribute such as ` onclick=`.
    fn has_inline_handler(html: &str) -> bool {
        html.match_indices(" on").any(|(i, _)| {
            let rest = &html[i + 3..];
            let name = rest.bytes().take_while(u8::is_ascii_lowercase).count();
            name > 0 && rest[name..].starts_with('=')
        })
    }

    #[test]
    fn the_page_has_no_inline_script_or_style() {
        // The CSP forbids them: they would silently not run.
        assert!(!INDEX_HTML.contains("<script>"));
        assert!(!INDEX_HTML.contains("<style"));
        assert!(!INDEX_HTML.contains(" style="));
        assert!(
            !has_inline_handler(INDEX_HTML),
            "inline event handler in index.html"
        );
        assert!(has_inline_handler(r#"<a onclick="x()">"#));
        assert!(!has_inline_handler("<p>It only reads.</p>"));
    }
}
