//! The VMI serial console: a WebSocket upgrade made by hand.
//!
//! kube-rs' `Client::connect` cannot open it: it overwrites `Sec-WebSocket-Protocol` with the
//! Kubernetes channel protocols and refuses any other answer, while KubeVirt's console speaks
//! `plain.kubevirt.io` (raw bytes in binary frames, no channel byte). So the upgrade request
//! is sent through `Client::send` (which still applies the client's base URL, TLS and
//! authentication), the `101 Switching Protocols` answer is checked here, and the upgraded
//! connection is wrapped as a client-side WebSocket.
//!
//! KubeVirt's console connections are known to be dropped silently (idle or busy), so the
//! client pings: a ping goes out every `ping_interval` (a setting, 25 s by default), and when
//! a whole interval after a ping passes with no frame at all from the server (no pong, no
//! output), the connection is taken for dead: the output stream ends with a
//! [`ClusterError::Transient`] saying so, which the console relay reports as a lost
//! connection. A dead connection is noticed within two intervals.

use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::{Sink, SinkExt as _, Stream, StreamExt as _};
use http::header::{
    CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
    SEC_WEBSOCKET_VERSION, UPGRADE,
};
use http::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use kube::Client;
use kube::client::Body;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use crate::{ClusterError, Terminal};

/// The console subprotocol.
pub(crate) const PLAIN_KUBEVIRT: &str = "plain.kubevirt.io";

/// The console URL path of a VMI.
pub(crate) fn console_path(namespace: &str, name: &str) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}/console"
    )
}

pub(super) async fn open(
    client: &Client,
    namespace: &str,
    name: &str,
    ping_interval: Option<Duration>,
) -> Result<Terminal, ClusterError> {
    let what = format!("console of {name}");
    match upgrade(client, console_path(namespace, name), &what, config()).await? {
        Upgrade::Open(socket) => Ok(terminal(*socket, ping_interval)),
        Upgrade::Refused {
            code,
            reason,
            message,
        } => Err(refusal(name, code, &reason, message)),
    }
}

/// A KubeVirt streaming subresource's upgrade, and what came of it.
pub(super) enum Upgrade {
    /// `101 Switching Protocols` to `plain.kubevirt.io`: the WebSocket.
    Open(Box<WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>>),
    /// Any other answer: its code and its `Status` (or its body as the message).
    Refused {
        /// The HTTP status.
        code: StatusCode,
        /// The `Status`'s reason (empty without one).
        reason: String,
        /// The `Status`'s message, or the body's text.
        message: String,
    },
}

/// Sends the WebSocket upgrade of `path` (subprotocol `plain.kubevirt.io`) through
/// `Client::send`, checks a `101` answer (its accept key and subprotocol) and wraps the
/// upgraded connection as a client-side WebSocket with `config`. `what` names the connection
/// in errors (`console of lab-1`).
pub(super) async fn upgrade(
    client: &Client,
    path: String,
    what: &str,
    config: WebSocketConfig,
) -> Result<Upgrade, ClusterError> {
    let key = generate_key();
    let request = Request::get(path)
        .header(CONNECTION, "Upgrade")
        .header(UPGRADE, "websocket")
        .header(SEC_WEBSOCKET_VERSION, "13")
        .header(SEC_WEBSOCKET_KEY, &key)
        .header(SEC_WEBSOCKET_PROTOCOL, PLAIN_KUBEVIRT)
        .body(Body::from(Vec::new()))
        .map_err(|e| ClusterError::Invalid {
            message: format!("{what}: request: {e}"),
        })?;
    let response = client
        .send(request)
        .await
        .map_err(ClusterError::from_kube)?;

    let code = response.status();
    if code != StatusCode::SWITCHING_PROTOCOLS {
        if code.is_success() || code.is_redirection() || code.is_informational() {
            return Err(ClusterError::Unexpected {
                message: format!("{what}: expected 101 Switching Protocols, got {code}"),
            });
        }
        let (reason, message) = status_of(response).await;
        return Ok(Upgrade::Refused {
            code,
            reason,
            message,
        });
    }
    let headers = response.headers();
    let accept_ok = headers
        .get(SEC_WEBSOCKET_ACCEPT)
        .is_some_and(|v| v.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes());
    if !accept_ok {
        return Err(ClusterError::Unexpected {
            message: format!("{what}: wrong or missing Sec-WebSocket-Accept"),
        });
    }
    let protocol_ok = headers
        .get(SEC_WEBSOCKET_PROTOCOL)
        .is_some_and(|v| v.as_bytes() == PLAIN_KUBEVIRT.as_bytes());
    if !protocol_ok {
        return Err(ClusterError::Unexpected {
            message: format!(
                "{what}: the server did not agree to {PLAIN_KUBEVIRT} (got {:?})",
                headers.get(SEC_WEBSOCKET_PROTOCOL)
            ),
        });
    }

    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(|e| ClusterError::Transient {
            message: format!("{what}: upgrade failed: {e}"),
        })?;
    let socket =
        WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, Some(config)).await;
    Ok(Upgrade::Open(Box::new(socket)))
}

/// The `Status` of a refusal: its reason and message, or no reason and the body's text.
async fn status_of(response: http::Response<Body>) -> (String, String) {
    let body = response
        .into_body()
        .collect_bytes()
        .await
        .unwrap_or_default();
    let status: Option<kube::core::Status> = serde_json::from_slice(&body).ok();
    match status {
        Some(s) => (s.reason, s.message),
        None => (
            String::new(),
            String::from_utf8_lossy(&body).trim().to_owned(),
        ),
    }
}

/// The console connection's WebSocket settings. The read buffer is filled (zeroed) to its
/// full size on every read, so its size is resident memory per open console: 16 KiB instead
/// of the default 128 KiB keeps a thousand idle consoles small, and still reads a serial
/// console's output in few calls.
fn config() -> WebSocketConfig {
    WebSocketConfig::default().read_buffer_size(16 * 1024)
}

/// Turns a console's refusal into an error: 400 means "not running yet" on this subresource.
fn refusal(name: &str, code: StatusCode, reason: &str, message: String) -> ClusterError {
    if code == StatusCode::BAD_REQUEST {
        return ClusterError::ConsoleNotReady {
            name: name.to_owned(),
            message,
        };
    }
    ClusterError::from_status(code.as_u16(), reason, &message)
}

fn ws_error(e: WsError) -> ClusterError {
    match e {
        WsError::Io(e) => ClusterError::Transient {
            message: format!("console connection: {e}"),
        },
        other => ClusterError::Unexpected {
            message: format!("console connection: {other}"),
        },
    }
}

/// Binary frames carry the serial bytes; a Close frame (or the connection closing) ends the
/// output. Pings from the server are answered by the WebSocket layer; with `ping_interval`,
/// the output side also pings the server and ends with an error when it stops answering (see
/// the module docs).
///
/// Both halves share the one WebSocket (each poll locks it briefly). They are meant to be
/// polled from one task, as the console relay does: a ping whose write is blocked is retried
/// on the output's next poll.
pub(crate) fn terminal<S>(socket: WebSocketStream<S>, ping_interval: Option<Duration>) -> Terminal
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let socket = Arc::new(Mutex::new(socket));
    let pinger = ping_interval.filter(|d| !d.is_zero()).map(|every| {
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Pinger {
            interval,
            every,
            waiting: false,
            flushing: false,
        }
    });
    let output = Output {
        socket: Arc::clone(&socket),
        pinger,
        done: false,
    };
    Terminal {
        output: output.boxed(),
        input: Box::pin(Input { socket }),
        resize: None,
    }
}

type Shared<S> = Arc<Mutex<WebSocketStream<S>>>;

fn lock<S>(socket: &Shared<S>) -> std::sync::MutexGuard<'_, WebSocketStream<S>> {
    socket.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The keepalive state of the output side.
struct Pinger {
    interval: tokio::time::Interval,
    every: Duration,
    /// A ping went out and no frame has arrived since.
    waiting: bool,
    /// A ping was queued and is not flushed yet.
    flushing: bool,
}

/// The console's output: the serial bytes, with the keepalive driven from its polls.
struct Output<S> {
    socket: Shared<S>,
    pinger: Option<Pinger>,
    done: bool,
}

/// Ends the output with `item` (an error, or nothing).
fn end(
    done: &mut bool,
    item: Option<Result<Bytes, ClusterError>>,
) -> Poll<Option<Result<Bytes, ClusterError>>> {
    *done = true;
    Poll::Ready(item)
}

impl<S> Stream for Output<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    type Item = Result<Bytes, ClusterError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        let socket = Arc::clone(&this.socket);
        let mut ws = lock(&socket);
        // Everything already received comes first (it also proves the server alive).
        loop {
            let message = match ws.poll_next_unpin(cx) {
                Poll::Ready(Some(Ok(message))) => message,
                Poll::Ready(Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed)))
                | Poll::Ready(None) => return end(&mut this.done, None),
                Poll::Ready(Some(Err(e))) => return end(&mut this.done, Some(Err(ws_error(e)))),
                Poll::Pending => break,
            };
            if let Some(p) = &mut this.pinger {
                p.waiting = false;
            }
            match message {
                Message::Binary(bytes) => return Poll::Ready(Some(Ok(bytes))),
                Message::Text(text) => {
                    return Poll::Ready(Some(Ok(Bytes::from(text.as_str().to_owned()))));
                }
                Message::Close(_) => return end(&mut this.done, None),
                Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
            }
        }
        let Some(p) = &mut this.pinger else {
            return Poll::Pending;
        };
        if p.flushing {
            match ws.poll_flush_unpin(cx) {
                Poll::Ready(Ok(())) => p.flushing = false,
                Poll::Ready(Err(e)) => return end(&mut this.done, Some(Err(ws_error(e)))),
                Poll::Pending => {}
            }
        }
        while p.interval.poll_tick(cx).is_ready() {
            if p.waiting {
                let message = format!(
                    "console connection: no answer from the console for {:?} (keepalive ping unanswered)",
                    p.every
                );
                return end(
                    &mut this.done,
                    Some(Err(ClusterError::Transient { message })),
                );
            }
            p.waiting = true;
            // A write side that is blocked counts as silence: the ping goes out when it can.
            match ws.poll_ready_unpin(cx) {
                Poll::Ready(Ok(())) => {
                    if let Err(e) = ws.start_send_unpin(Message::Ping(Bytes::new())) {
                        return end(&mut this.done, Some(Err(ws_error(e))));
                    }
                    p.flushing = true;
                    match ws.poll_flush_unpin(cx) {
                        Poll::Ready(Ok(())) => p.flushing = false,
                        Poll::Ready(Err(e)) => return end(&mut this.done, Some(Err(ws_error(e)))),
                        Poll::Pending => {}
                    }
                }
                Poll::Ready(Err(e)) => return end(&mut this.done, Some(Err(ws_error(e)))),
                Poll::Pending => {}
            }
        }
        Poll::Pending
    }
}

/// The console's input: keystrokes as binary frames. Closing it sends a Close frame.
struct Input<S> {
    socket: Shared<S>,
}

impl<S> Sink<Bytes> for Input<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    type Error = ClusterError;

    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        lock(&self.socket).poll_ready_unpin(cx).map_err(ws_error)
    }

    fn start_send(self: Pin<&mut Self>, item: Bytes) -> Result<(), Self::Error> {
        lock(&self.socket)
            .start_send_unpin(Message::Binary(item))
            .map_err(ws_error)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        lock(&self.socket).poll_flush_unpin(cx).map_err(ws_error)
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        lock(&self.socket).poll_close_unpin(cx).map_err(ws_error)
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::DuplexStream;
    use tokio::time::Instant;

    use super::*;

    const EVERY: Duration = Duration::from_secs(25);

    /// A console client over an in-memory pipe, and the server's end of the pipe.
    async fn pair() -> (Terminal, WebSocketStream<DuplexStream>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let server = WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        (terminal(client, Some(EVERY)), server)
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_stops_answering_is_taken_for_dead_within_two_intervals() {
        // The server end is never read: the first ping is never answered.
        let (mut term, _server) = pair().await;
        let started = Instant::now();
        let end = term.output.next().await;
        let Some(Err(ClusterError::Transient { message })) = end else {
            panic!("expected a transient error, got {end:?}");
        };
        assert!(
            message.contains("no answer from the console for 25s"),
            "{message}"
        );
        assert_eq!(started.elapsed(), 2 * EVERY);
        assert!(term.output.next().await.is_none(), "the output ended");
    }

    #[tokio::test(start_paused = true)]
    async fn a_server_that_answers_pings_keeps_the_console_open() {
        let (mut term, mut server) = pair().await;
        // A plain WebSocket server: reading answers pings (the library queues the pongs).
        let pings = tokio::spawn(async move {
            let mut pings = 0;
            while let Some(Ok(message)) = server.next().await {
                match message {
                    Message::Ping(_) => pings += 1,
                    Message::Binary(b) if b.as_ref() == b"bye" => break,
                    _ => {}
                }
            }
            pings
        });
        let idle = tokio::time::timeout(10 * EVERY + EVERY / 2, term.output.next()).await;
        assert!(idle.is_err(), "the idle console ended: {idle:?}");
        term.input.send(Bytes::from_static(b"bye")).await.unwrap();
        assert_eq!(pings.await.unwrap(), 10, "one ping per interval");
    }

    #[tokio::test(start_paused = true)]
    async fn output_counts_as_an_answer() {
        let (mut term, mut server) = pair().await;
        // The server never answers pings (it never reads) but prints every 10 s.
        let started = Instant::now();
        let printer = tokio::spawn(async move {
            for _ in 0..12 {
                tokio::time::sleep(Duration::from_secs(10)).await;
                if server
                    .send(Message::Binary(Bytes::from_static(b".")))
                    .await
                    .is_err()
                {
                    return;
                }
            }
            // Then silence.
            std::future::pending::<()>().await;
        });
        for _ in 0..12 {
            assert_eq!(
                term.output.next().await.unwrap().unwrap(),
                Bytes::from_static(b".")
            );
        }
        let end = term.output.next().await;
        assert!(
            matches!(end, Some(Err(ClusterError::Transient { .. }))),
            "{end:?}"
        );
        // The last output came at 120 s; a ping went out at 125 s, unanswered by 150 s.
        assert_eq!(started.elapsed(), Duration::from_secs(150));
        printer.abort();
    }
}
