//! The student and admin pages: static files from `TTLAB_WEB_DIR` (default: the repository's
//! `web/` directory, when the server runs from a checkout), and the terminal component from
//! that directory's `node_modules` (installed by `npm ci` in it).
//!
//! | path | file |
//! |---|---|
//! | `/` | `index.html` (student) |
//! | `/admin` | `admin.html` |
//! | `/static/…` | `static/…` |
//! | `/vendor/xterm/…` | `node_modules/@xterm/xterm/…` |
//! | `/vendor/addon-fit/…` | `node_modules/@xterm/addon-fit/…` |

use std::path::{Path, PathBuf};

use axum::Router;
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse};
use axum::routing::get;
use tower_http::services::{ServeDir, ServeFile};

use crate::AppState;

/// Where the pages are when no directory is configured: the checkout's `web/`.
const BUILT_IN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../web");

/// The directory pages are served from: `configured`, else the checkout's `web/` if present.
pub fn web_dir(configured: Option<&Path>) -> Option<PathBuf> {
    match configured {
        Some(dir) => Some(dir.to_path_buf()),
        None => {
            let built_in = Path::new(BUILT_IN);
            built_in
                .join("index.html")
                .is_file()
                .then(|| built_in.to_path_buf())
        }
    }
}

/// The page routes for `dir` (see [`web_dir`]); without a directory, `/` says how to get one.
pub fn routes(dir: Option<PathBuf>) -> Router<AppState> {
    let Some(dir) = dir else {
        return Router::new().route(
            "/",
            get(|| async {
                (
                    StatusCode::NOT_FOUND,
                    Html(
                        "<!doctype html><title>ttlab</title><p>The ttlab web pages are not \
                         installed on this server: set <code>TTLAB_WEB_DIR</code> to the \
                         <code>web/</code> directory (after <code>npm ci</code> in it).</p>",
                    ),
                )
                    .into_response()
            }),
        );
    };
    let xterm = dir.join("node_modules/@xterm/xterm");
    if !xterm.join("lib/xterm.js").is_file() {
        tracing::warn!(
            dir = %dir.display(),
            "the terminal component is missing: run `npm ci` in the web directory"
        );
    }
    Router::new()
        .route_service("/", ServeFile::new(dir.join("index.html")))
        .route_service("/admin", ServeFile::new(dir.join("admin.html")))
        .nest_service("/static", ServeDir::new(dir.join("static")))
        .nest_service("/vendor/xterm", ServeDir::new(xterm))
        .nest_service(
            "/vendor/addon-fit",
            ServeDir::new(dir.join("node_modules/@xterm/addon-fit")),
        )
        .layer(axum::middleware::map_response(not_found_not_500))
}

/// The file services answer 500 to a file-system error other than "not found", which a client
/// can cause at will (a name longer than the file system allows, a path through a file): for
/// static files any such request is a 404, never a server error.
async fn not_found_not_500(response: axum::response::Response) -> axum::response::Response {
    if response.status() == StatusCode::INTERNAL_SERVER_ERROR {
        tracing::debug!("a static file could not be read; answered 404");
        return StatusCode::NOT_FOUND.into_response();
    }
    response
}
