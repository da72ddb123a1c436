//! A client of the ttlab API for operator commands: the server's URL and an admin's bearer
//! token (`--url`, `--token` or `TTLAB_TOKEN`), JSON in and out over HTTP/1 (hyper), and an
//! API refusal reported as the API's own sentence.

use anyhow::{Context as _, bail};
use bytes::Bytes;
use clap::Args;
use http::{Method, Request, header};
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// Where the API is, and whose token calls it.
#[derive(Debug, Clone, Args)]
pub struct ApiArgs {
    /// The server's base URL.
    #[arg(long, env = "TTLAB_URL", default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// An admin's bearer token (`ttlabctl token --role admin --user <you>`).
    #[arg(long, env = "TTLAB_TOKEN", hide_env_values = true)]
    pub token: String,
}

/// Calls the API.
pub struct Api {
    base: String,
    token: String,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl Api {
    /// A client of the server at `args.url`.
    pub fn new(args: &ApiArgs) -> anyhow::Result<Self> {
        let base = args.url.trim_end_matches('/').to_owned();
        if !base.starts_with("http://") {
            bail!("--url must be an http:// URL (got {base:?}); put a TLS proxy's plain side here");
        }
        Ok(Self {
            base,
            token: args.token.clone(),
            http: Client::builder(TokioExecutor::new()).build_http(),
        })
    }

    /// `method path` with `body` as JSON: the answer's JSON on success; otherwise an error
    /// whose text is the API's message, with its status, code and field.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        let mut req = Request::builder()
            .method(method)
            .uri(&url)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.token))
            .header(header::ACCEPT, "application/json");
        let body = match body {
            Some(v) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                Full::new(Bytes::from(serde_json::to_vec(v)?))
            }
            None => Full::new(Bytes::new()),
        };
        let res = self
            .http
            .request(req.body(body).context("building the request")?)
            .await
            .with_context(|| format!("cannot reach the server at {}", self.base))?;
        let status = res.status();
        let bytes = res
            .into_body()
            .collect()
            .await
            .with_context(|| format!("reading the answer of {url}"))?
            .to_bytes();
        let json: Option<Value> = serde_json::from_slice(&bytes).ok();
        if status.is_success() {
            return json.with_context(|| format!("{url} answered {status} without JSON"));
        }
        match json {
            Some(v) if v["message"].is_string() => {
                let mut detail = format!(
                    "{} {}",
                    status.as_u16(),
                    v["error"].as_str().unwrap_or("error")
                );
                if let Some(field) = v["field"].as_str() {
                    detail.push_str(&format!(", field {field}"));
                }
                bail!("{} ({detail})", v["message"].as_str().unwrap_or_default())
            }
            _ => bail!(
                "{url} answered {status}: {}",
                String::from_utf8_lossy(&bytes)
                    .chars()
                    .take(200)
                    .collect::<String>()
            ),
        }
    }
}
