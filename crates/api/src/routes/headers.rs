//! The security headers of every answer: pages, static files, API answers and errors alike.
//!
//! The pages load scripts and styles from their own origin only and run no inline script, so
//! the Content-Security-Policy can refuse everything else: an injected `<script>` (in a
//! lesson's instructions, say) does not run, nothing is loaded from or sent to a foreign
//! origin, and no other site may frame the pages (clickjacking the "Finish lab" button).
//!
//! Two allowances, each for what the pages really need:
//! - `style-src 'unsafe-inline'`: the terminal (xterm.js) writes its theme and cell sizes into
//!   `<style>` elements it creates (without the allowance Chromium refuses every one of them:
//!   `style-src-elem` violations in the browser tests), and may colour cells through `style`
//!   attributes. Styles are not script; stylesheets stay same-origin.
//! - `img-src https:`: a lesson's instructions may show images from elsewhere. The
//!   `Referrer-Policy: no-referrer` keeps the page's address (which may hold a login link's
//!   token for a moment) from travelling with such a request.
//!
//! `connect-src 'self'` covers the terminal's WebSocket (`ws:`/`wss:` to the same host), as
//! CSP Level 3 and current Chromium read `'self'`.

use axum::http::header::{self, HeaderName, HeaderValue};
use axum::response::Response;

/// The policy of every answer.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' https:; connect-src 'self'; \
     font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

/// Every security header and its value.
pub const SECURITY_HEADERS: [(HeaderName, &str); 5] = [
    (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::REFERRER_POLICY, "no-referrer"),
    // frame-ancestors for browsers that predate it.
    (header::X_FRAME_OPTIONS, "DENY"),
    // The pages open no window that should keep a handle on them, nor are opened by one.
    (
        HeaderName::from_static("cross-origin-opener-policy"),
        "same-origin",
    ),
];

/// Sets [`SECURITY_HEADERS`] on `response` (replacing any a handler set).
pub(crate) async fn set_security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    for (name, value) in SECURITY_HEADERS {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_policy_allows_no_inline_script_and_no_foreign_origin_but_https_images() {
        let directives: Vec<(&str, Vec<&str>)> = CONTENT_SECURITY_POLICY
            .split(';')
            .map(|d| {
                let mut words = d.split_whitespace();
                (words.next().unwrap(), words.collect())
            })
            .collect();
        let get = |name: &str| {
            directives
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.clone())
                .unwrap_or_else(|| panic!("no {name} in {CONTENT_SECURITY_POLICY}"))
        };
        assert_eq!(get("default-src"), ["'self'"]);
        assert_eq!(get("script-src"), ["'self'"]);
        assert_eq!(get("connect-src"), ["'self'"]);
        assert_eq!(get("frame-ancestors"), ["'none'"]);
        assert_eq!(get("object-src"), ["'none'"]);
        assert_eq!(get("base-uri"), ["'none'"]);
        assert_eq!(get("img-src"), ["'self'", "https:"]);
        // Only styles may be inline; no directive allows eval or a wildcard.
        for (name, values) in &directives {
            assert!(
                !values.contains(&"'unsafe-eval'") && !values.contains(&"*"),
                "{name}: {values:?}"
            );
            if values.contains(&"'unsafe-inline'") {
                assert_eq!(*name, "style-src");
            }
        }
    }

    #[tokio::test]
    async fn every_header_is_set_and_replaces_a_handlers_own() {
        let mut response = Response::new(axum::body::Body::empty());
        response
            .headers_mut()
            .insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("ALLOW"));
        let response = set_security_headers(response).await;
        for (name, value) in SECURITY_HEADERS {
            let got: Vec<_> = response.headers().get_all(&name).iter().collect();
            assert_eq!(got, [value], "{name}");
        }
    }
}
