//! The typed async client the server uses to ask an agent whether its guest is ready, to run
//! grading commands, to size the console, to rotate the agent's token and to move the guest's
//! hard deadline. One HTTP/1.1 connection per request (the agent closes after each): a TCP
//! connection to the agent's address ([`AgentRoute::Direct`]), or a byte stream a
//! [`Connector`] opens for each request ([`AgentRoute::Tunnel`]: a port forward through the
//! cluster's API server, for a server outside the VMs' network).

use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use tokio::net::TcpStream;
use ttlab_background::Backoff;

use crate::protocol::{
    AgentToken, ConsoleSize, ErrorResponse, ExecRequest, ExecResponse, MAX_EXEC_TIMEOUT_MS,
    MAX_OUTPUT_BYTES, PowerOffAt, ReadyResponse, RotateTokenRequest, TokenRotated,
};

/// Largest answer accepted: two capped output streams, JSON-escaped (at most 6 bytes per
/// byte), plus room for the rest.
const MAX_RESPONSE_BYTES: usize = 2 * 6 * MAX_OUTPUT_BYTES + 64 * 1024;
/// Added to a command's own timeout for the HTTP exchange of an exec (the agent's kill and
/// output grace, and the transfer).
const EXEC_MARGIN: Duration = Duration::from_secs(15);
/// The pauses between readiness polls: 200 ms, doubling up to 2 s.
const READY_POLL: Backoff =
    Backoff::doubling(Duration::from_millis(200), Duration::from_secs(2)).without_jitter();

use crate::{AgentAddr, Error};

/// A connection to an agent that a [`Connector`] opened: any byte stream.
pub trait AgentIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> AgentIo for T {}

/// A boxed [`AgentIo`].
pub type AgentConnection = Box<dyn AgentIo>;

/// Opens a fresh connection to one agent for each request, some other way than a TCP
/// connection to its address (a port forward through the cluster's API server, say).
///
/// Its failures are `io::Error`s whose kind says whether to retry: `PermissionDenied`,
/// `NotFound` and `InvalidInput` mean the way is refused for good ([`Error::NoRoute`]); any
/// other kind is taken as a refused TCP connection is ([`Error::Unreachable`], retried while
/// the guest boots).
pub trait Connector: Send + Sync {
    /// The agent as errors name it (`port 8899 of VMI lab-1 through the API server`).
    fn describe(&self) -> String;

    /// Opens one connection.
    fn connect(&self) -> Pin<Box<dyn Future<Output = io::Result<AgentConnection>> + Send + '_>>;
}

/// How a client reaches its agent.
#[derive(Clone)]
pub enum AgentRoute {
    /// A TCP connection to the agent's address (the VMI's IP and [`crate::protocol::PORT`]).
    Direct(SocketAddr),
    /// A connection from the connector, for each request.
    Tunnel(Arc<dyn Connector>),
}

impl fmt::Debug for AgentRoute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Direct(addr) => f.debug_tuple("Direct").field(addr).finish(),
            Self::Tunnel(c) => f.debug_tuple("Tunnel").field(&c.describe()).finish(),
        }
    }
}

impl AgentRoute {
    /// The agent as errors name it.
    pub fn addr(&self) -> AgentAddr {
        match self {
            Self::Direct(addr) => AgentAddr::Direct(*addr),
            Self::Tunnel(c) => AgentAddr::Tunnel(c.describe()),
        }
    }

    /// One connection (not bounded in time here: the caller's connect timeout is).
    async fn connect(&self) -> Result<AgentConnection, Error> {
        match self {
            Self::Direct(addr) => match TcpStream::connect(addr).await {
                Ok(stream) => {
                    let _ = stream.set_nodelay(true);
                    Ok(Box::new(stream))
                }
                Err(source) => Err(Error::Unreachable {
                    addr: self.addr(),
                    source,
                }),
            },
            Self::Tunnel(c) => c.connect().await.map_err(|source| {
                let addr = self.addr();
                match source.kind() {
                    io::ErrorKind::PermissionDenied
                    | io::ErrorKind::NotFound
                    | io::ErrorKind::InvalidInput => Error::NoRoute { addr, source },
                    _ => Error::Unreachable { addr, source },
                }
            }),
        }
    }

    /// The `Host` header's value.
    fn host(&self) -> String {
        match self {
            Self::Direct(addr) => addr.to_string(),
            Self::Tunnel(_) => format!("localhost:{}", crate::protocol::PORT),
        }
    }
}

/// A client for one agent.
#[derive(Debug, Clone)]
pub struct AgentClient {
    route: AgentRoute,
    token: AgentToken,
    connect_timeout: Duration,
    request_timeout: Duration,
    user_agent: String,
}

impl AgentClient {
    /// Default time to establish the TCP connection.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
    /// Default time for a whole `ready` exchange.
    pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
    /// The `User-Agent` of a client whose program did not name itself: `ttlab/<version>`.
    pub const DEFAULT_USER_AGENT: &str = concat!("ttlab/", env!("CARGO_PKG_VERSION"));

    /// A client for the agent at `addr` (the VMI's IP and [`crate::protocol::PORT`]).
    pub fn new(addr: SocketAddr, token: AgentToken) -> Self {
        Self::via(AgentRoute::Direct(addr), token)
    }

    /// A client for the agent that `route` reaches.
    pub fn via(route: AgentRoute, token: AgentToken) -> Self {
        Self {
            route,
            token,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            request_timeout: Self::DEFAULT_REQUEST_TIMEOUT,
            user_agent: Self::DEFAULT_USER_AGENT.to_owned(),
        }
    }

    /// The same client sending `agent` as its `User-Agent` (`ttlab-server/0.1.0`; default
    /// [`Self::DEFAULT_USER_AGENT`]). A value that cannot be a header makes every call fail with
    /// [`Error::InvalidRequest`].
    pub fn with_user_agent(mut self, agent: impl Into<String>) -> Self {
        self.user_agent = agent.into();
        self
    }

    /// The same client with other timeouts: `connect` for the connection (a TCP connection,
    /// or the whole opening of a tunnel), `request` for a whole `ready` exchange. `exec` waits for the command's own timeout plus a margin.
    pub fn with_timeouts(mut self, connect: Duration, request: Duration) -> Self {
        self.connect_timeout = connect;
        self.request_timeout = request;
        self
    }

    /// The same client presenting `token` (for example the one [`rotate_token`] installed).
    ///
    /// [`rotate_token`]: Self::rotate_token
    pub fn with_token(mut self, token: AgentToken) -> Self {
        self.token = token;
        self
    }

    /// The agent as errors name it: its address, or the tunnel's description.
    pub fn addr(&self) -> AgentAddr {
        self.route.addr()
    }

    /// How the agent is reached.
    pub fn route(&self) -> &AgentRoute {
        &self.route
    }

    /// `GET /v1/ready`: whether the setup finished (or failed).
    pub async fn ready(&self) -> Result<ReadyResponse, Error> {
        self.call(Method::GET, "/v1/ready", None, self.request_timeout)
            .await
    }

    /// Polls [`ready`](Self::ready) with backoff (200 ms doubling to 2 s) until the agent
    /// reports ready or a setup failure, for at most `within`. Retryable errors (guest still
    /// booting, token not written yet, busy) are retried; others are returned at once. After
    /// `within`, [`Error::NotReady`] names the last answer or error.
    pub async fn wait_ready(&self, within: Duration) -> Result<ReadyResponse, Error> {
        let start = Instant::now();
        let mut pauses = READY_POLL.pauses();
        loop {
            let last = match self.ready().await {
                Ok(r) if r.ready || r.failed.is_some() => return Ok(r),
                Ok(_) => "not ready yet".to_owned(),
                Err(e) if e.is_retryable() => e.to_string(),
                Err(e) => return Err(e),
            };
            let elapsed = start.elapsed();
            let pause = pauses.next_pause();
            if elapsed + pause > within {
                return Err(Error::NotReady {
                    addr: self.addr(),
                    after: elapsed,
                    last,
                });
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// `POST /v1/exec`: runs `command` with `/bin/sh -c` in the guest; its process group is
    /// killed after `timeout` (1 ms to one hour, else [`Error::InvalidRequest`]).
    pub async fn exec(&self, command: &str, timeout: Duration) -> Result<ExecResponse, Error> {
        let timeout_ms = u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX);
        if timeout_ms == 0 || timeout_ms > MAX_EXEC_TIMEOUT_MS {
            return Err(Error::InvalidRequest(format!(
                "exec timeout must be between 1 ms and {MAX_EXEC_TIMEOUT_MS} ms, got {timeout:?}"
            )));
        }
        let body = serde_json::to_vec(&ExecRequest {
            command: command.to_owned(),
            timeout_ms,
        })
        .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        self.call(Method::POST, "/v1/exec", Some(body), timeout + EXEC_MARGIN)
            .await
    }

    /// `POST /v1/console-size`: sets the window size of the guest's serial console (its
    /// foreground programs get `SIGWINCH`). Sizes outside 1..=[`MAX_CONSOLE_DIMENSION`]
    /// are refused before anything is sent ([`Error::InvalidRequest`]).
    ///
    /// [`MAX_CONSOLE_DIMENSION`]: crate::protocol::MAX_CONSOLE_DIMENSION
    pub async fn set_console_size(&self, size: ConsoleSize) -> Result<ConsoleSize, Error> {
        if !size.is_valid() {
            return Err(Error::InvalidRequest(format!(
                "a console size needs 1 to {} rows and columns, got {} rows and {} cols",
                crate::protocol::MAX_CONSOLE_DIMENSION,
                size.rows,
                size.cols
            )));
        }
        let body = serde_json::to_vec(&size).map_err(|e| Error::InvalidRequest(e.to_string()))?;
        self.call(
            Method::POST,
            "/v1/console-size",
            Some(body),
            self.request_timeout,
        )
        .await
    }

    /// `POST /v1/token`: makes `new` the agent's only valid token, authenticated with this
    /// client's (current) token; the agent stores it before answering, so from the answer on
    /// only `new` is accepted, also after a restart of the agent. Rotating to the token already
    /// in use answers `changed: false`. Within the request timeout.
    ///
    /// After a retryable error the rotation may or may not have happened: retry with this
    /// client; [`Error::Unauthorized`] then means it did (or the old token was wrong), which
    /// the same call on [`with_token(new)`](Self::with_token) confirms with `changed: false`.
    /// [`Error::Rejected`] with status 409 (`conflict`): another rotation to another token won
    /// the race. Status 500: the agent could not store the new token; the old one still works.
    pub async fn rotate_token(&self, new: &AgentToken) -> Result<TokenRotated, Error> {
        let body = serde_json::to_vec(&RotateTokenRequest::new(new))
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        self.call(Method::POST, "/v1/token", Some(body), self.request_timeout)
            .await
    }

    /// `POST /v1/deadline`: re-arms the guest's hard deadline at `power_off_at` (whole
    /// seconds; earlier or later than the one it booted with), which the guest's power-off
    /// check, run every minute, honours within a minute. Returns the value stored. A time
    /// before 2020 or more than 400 days after this machine's clock is refused before anything
    /// is sent ([`Error::InvalidRequest`]); the agent checks the same bounds against its own
    /// clock. Within the request timeout.
    pub async fn set_deadline(&self, power_off_at: SystemTime) -> Result<PowerOffAt, Error> {
        let unix = |t: SystemTime| {
            t.duration_since(UNIX_EPOCH)
                .ok()
                .and_then(|d| i64::try_from(d.as_secs()).ok())
        };
        let request = PowerOffAt {
            power_off_at: unix(power_off_at).ok_or_else(|| {
                Error::InvalidRequest(format!(
                    "a deadline must be after 2020, got {power_off_at:?}"
                ))
            })?,
        };
        request
            .check(unix(SystemTime::now()).unwrap_or(0))
            .map_err(Error::InvalidRequest)?;
        let body =
            serde_json::to_vec(&request).map_err(|e| Error::InvalidRequest(e.to_string()))?;
        self.call(
            Method::POST,
            "/v1/deadline",
            Some(body),
            self.request_timeout,
        )
        .await
    }

    /// One request on a fresh connection, decoded as `T` on 200.
    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<T, Error> {
        let addr = self.addr();
        let stream = match tokio::time::timeout(self.connect_timeout, self.route.connect()).await {
            Err(_) => {
                return Err(Error::Timeout {
                    addr,
                    after: self.connect_timeout,
                });
            }
            Ok(result) => result?,
        };
        let exchange = self.exchange(stream, method, path, body);
        let (status, bytes) = match tokio::time::timeout(timeout, exchange).await {
            Err(_) => {
                return Err(Error::Timeout {
                    addr,
                    after: timeout,
                });
            }
            Ok(result) => result?,
        };
        decode(&addr, status, &bytes)
    }

    async fn exchange(
        &self,
        stream: AgentConnection,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Bytes), Error> {
        let addr = self.addr();
        let transport = |e: hyper::Error| Error::Transport {
            addr: addr.clone(),
            reason: e.to_string(),
        };
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(transport)?;
        let driver = AbortOnDrop(tokio::spawn(connection));
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, self.route.host())
            .header(header::USER_AGENT, self.user_agent.as_str())
            .header(
                header::AUTHORIZATION,
                format!("Bearer {}", self.token.reveal()),
            );
        if body.is_some() {
            request = request.header(header::CONTENT_TYPE, "application/json");
        }
        let request = request
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        let response = sender.send_request(request).await.map_err(transport)?;
        let status = response.status();
        let bytes = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|e| match e.downcast::<hyper::Error>() {
                Ok(e) => transport(*e),
                Err(e) => Error::BadResponse {
                    addr: addr.clone(),
                    reason: e.to_string(),
                },
            })?
            .to_bytes();
        drop(driver);
        Ok((status, bytes))
    }
}

/// Aborts the connection task when the exchange ends or is abandoned.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Maps a status and body to the typed answer or error.
fn decode<T: DeserializeOwned>(
    addr: &AgentAddr,
    status: StatusCode,
    bytes: &[u8],
) -> Result<T, Error> {
    let addr = addr.clone();
    if status == StatusCode::OK {
        return serde_json::from_slice(bytes).map_err(|e| Error::BadResponse {
            addr,
            reason: format!("undecodable answer: {e}"),
        });
    }
    let (code, message) = match serde_json::from_slice::<ErrorResponse>(bytes) {
        Ok(e) => (e.error, e.message),
        Err(_) => (
            String::new(),
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned(),
        ),
    };
    match status.as_u16() {
        401 => Err(Error::Unauthorized { addr }),
        503 => Err(Error::Unavailable {
            addr,
            code,
            message,
        }),
        s @ 400..=500 => Err(Error::Rejected {
            addr,
            status: s,
            code,
            message,
        }),
        s => Err(Error::BadResponse {
            addr,
            reason: format!("unexpected status {s}: {message}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> SocketAddr {
        "127.0.0.1:8899".parse().unwrap()
    }

    fn agent_addr() -> AgentAddr {
        AgentAddr::Direct(addr())
    }

    #[test]
    fn statuses_map_to_typed_errors() {
        let body = br#"{"error":"busy","message":"later"}"#;
        assert!(matches!(
            decode::<ReadyResponse>(&agent_addr(), StatusCode::UNAUTHORIZED, b""),
            Err(Error::Unauthorized { .. })
        ));
        let busy = decode::<ReadyResponse>(&agent_addr(), StatusCode::SERVICE_UNAVAILABLE, body)
            .unwrap_err();
        assert!(matches!(&busy, Error::Unavailable { code, .. } if code == "busy"));
        assert!(busy.is_retryable());
        let big = decode::<ReadyResponse>(&agent_addr(), StatusCode::PAYLOAD_TOO_LARGE, body)
            .unwrap_err();
        assert!(matches!(big, Error::Rejected { status: 413, .. }));
        assert!(!big.is_retryable());
        let odd = decode::<ReadyResponse>(&agent_addr(), StatusCode::OK, b"<html>").unwrap_err();
        assert!(matches!(odd, Error::BadResponse { .. }));
        let ok =
            decode::<ReadyResponse>(&agent_addr(), StatusCode::OK, br#"{"ready":true}"#).unwrap();
        assert_eq!(
            ok,
            ReadyResponse {
                ready: true,
                failed: None
            }
        );
    }

    #[tokio::test]
    async fn invalid_timeouts_are_refused_before_connecting() {
        let client = AgentClient::new(addr(), AgentToken::from_random_bytes([1; 32]));
        for t in [
            Duration::ZERO,
            Duration::from_millis(MAX_EXEC_TIMEOUT_MS + 1),
        ] {
            assert!(matches!(
                client.exec("true", t).await,
                Err(Error::InvalidRequest(_))
            ));
        }
    }

    /// Accepts one connection, reads one request head, answers `{"ready":true}`, and returns
    /// the head in lower case.
    async fn answer_ready(listener: tokio::net::TcpListener) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut chunk = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            head.extend_from_slice(&chunk[..n]);
        }
        let body = br#"{"ready":true}"#;
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        socket.write_all(answer.as_bytes()).await.unwrap();
        socket.write_all(body).await.unwrap();
        String::from_utf8_lossy(&head).to_lowercase()
    }

    async fn user_agent_sent(client: impl FnOnce(SocketAddr) -> AgentClient) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = client(listener.local_addr().unwrap());
        let (head, ready) = tokio::join!(answer_ready(listener), client.ready());
        assert!(ready.unwrap().ready);
        head.lines()
            .find_map(|l| l.strip_prefix("user-agent:"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no User-Agent in {head}"))
    }

    #[tokio::test]
    async fn requests_name_the_program_in_their_user_agent() {
        let token = || AgentToken::from_random_bytes([1; 32]);
        let named = user_agent_sent(|addr| {
            AgentClient::new(addr, token()).with_user_agent("ttlab-server/0.1.0")
        })
        .await;
        assert_eq!(named, "ttlab-server/0.1.0");
        let unnamed = user_agent_sent(|addr| AgentClient::new(addr, token())).await;
        assert_eq!(unnamed, AgentClient::DEFAULT_USER_AGENT);
    }

    #[tokio::test]
    async fn deadlines_out_of_bounds_are_refused_before_connecting() {
        // Nothing listens on this address: a request sent would be Unreachable.
        let client = AgentClient::new(addr(), AgentToken::from_random_bytes([1; 32]));
        let day = Duration::from_secs(24 * 60 * 60);
        for t in [
            UNIX_EPOCH,
            UNIX_EPOCH + Duration::from_secs(1_577_836_799),
            SystemTime::now() + 401 * day,
        ] {
            let err = client.set_deadline(t).await.unwrap_err();
            assert!(matches!(err, Error::InvalidRequest(_)), "{t:?}: {err}");
        }
    }

    #[tokio::test]
    async fn a_closed_port_is_unreachable_and_retryable() {
        // Bind then drop a listener so the port is (very likely) closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let client = AgentClient::new(port, AgentToken::from_random_bytes([1; 32]));
        let err = client.ready().await.unwrap_err();
        assert!(matches!(err, Error::Unreachable { .. }), "{err}");
        assert!(err.is_retryable());
    }

    /// A tunnel in memory: each connection is one end of a pipe whose other end is handed to
    /// the test; or, with `refuse`, an error of that kind.
    struct Pipes {
        ends: tokio::sync::mpsc::UnboundedSender<tokio::io::DuplexStream>,
        refuse: Option<io::ErrorKind>,
    }

    impl Connector for Pipes {
        fn describe(&self) -> String {
            "port 8899 of VMI lab through a pipe".to_owned()
        }

        fn connect(
            &self,
        ) -> Pin<Box<dyn Future<Output = io::Result<AgentConnection>> + Send + '_>> {
            Box::pin(async move {
                if let Some(kind) = self.refuse {
                    return Err(io::Error::new(kind, "refused"));
                }
                let (ours, theirs) = tokio::io::duplex(64 * 1024);
                let _ = self.ends.send(theirs);
                Ok(Box::new(ours) as AgentConnection)
            })
        }
    }

    #[tokio::test]
    async fn a_tunnel_carries_the_request_and_its_refusals_say_whether_to_retry() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let token = || AgentToken::from_random_bytes([1; 32]);
        let route = AgentRoute::Tunnel(Arc::new(Pipes {
            ends: tx.clone(),
            refuse: None,
        }));
        let client = AgentClient::via(route, token());
        let agent = tokio::spawn(async move {
            let mut end = rx.recv().await.unwrap();
            let mut head = Vec::new();
            let mut chunk = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = end.read(&mut chunk).await.unwrap();
                head.extend_from_slice(&chunk[..n]);
            }
            let body = br#"{"ready":true}"#;
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            end.write_all(answer.as_bytes()).await.unwrap();
            end.write_all(body).await.unwrap();
            String::from_utf8_lossy(&head).into_owned()
        });
        assert!(client.ready().await.unwrap().ready);
        let head = agent.await.unwrap();
        assert!(head.starts_with("GET /v1/ready HTTP/1.1"), "{head}");
        assert_eq!(
            client.addr(),
            AgentAddr::Tunnel("port 8899 of VMI lab through a pipe".into())
        );

        let refused = |kind| {
            AgentClient::via(
                AgentRoute::Tunnel(Arc::new(Pipes {
                    ends: tx.clone(),
                    refuse: Some(kind),
                })),
                token(),
            )
        };
        let forbidden = refused(io::ErrorKind::PermissionDenied)
            .ready()
            .await
            .unwrap_err();
        assert!(matches!(forbidden, Error::NoRoute { .. }), "{forbidden}");
        assert!(!forbidden.is_retryable());
        let booting = refused(io::ErrorKind::ConnectionRefused)
            .ready()
            .await
            .unwrap_err();
        assert!(matches!(booting, Error::Unreachable { .. }), "{booting}");
        assert!(booting.is_retryable());
        assert!(booting.to_string().contains("through a pipe"), "{booting}");
    }
}
