//! A small HTTP/1 client over loopback for the demo's readiness wait and the API benchmark.

use anyhow::Context as _;
use bytes::Bytes;
pub(crate) use http::Method;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// A pooled keep-alive client.
pub(crate) type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A client keeping up to `idle` idle connections per host.
pub(crate) fn client(idle: usize) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(idle)
        .build(connector)
}

/// Sends one request (`body` as JSON when given, `token` as a bearer token) and reads the whole
/// answer.
pub(crate) async fn send(
    client: &HttpClient,
    method: Method,
    url: &str,
    token: Option<&str>,
    body: Option<&serde_json::Value>,
) -> anyhow::Result<(StatusCode, Bytes)> {
    let mut req = Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
    }
    let body = match body {
        Some(v) => {
            req = req.header(header::CONTENT_TYPE, "application/json");
            Full::new(Bytes::from(serde_json::to_vec(v)?))
        }
        None => Full::new(Bytes::new()),
    };
    let req = req.body(body).context("building a request")?;
    let res = client
        .request(req)
        .await
        .with_context(|| format!("requesting {url}"))?;
    let status = res.status();
    let bytes = res
        .into_body()
        .collect()
        .await
        .with_context(|| format!("reading the answer of {url}"))?
        .to_bytes();
    Ok((status, bytes))
}
