//! The VMI serial console: a WebSocket upgrade made by hand.
//!
//! kube-rs' `Client::connect` cannot open it: it overwrites `Sec-WebSocket-Protocol` with the
//! Kubernetes channel protocols and refuses any other answer, while KubeVirt's console speaks
//! `plain.kubevirt.io` (raw bytes in binary frames, no channel byte). So the upgrade request
//! is sent through `Client::send` (which still applies the client's base URL, TLS and
//! authentication), the `101 Switching Protocols` answer is checked here, and the upgraded
//! connection is wrapped as a client-side WebSocket.

use bytes::Bytes;
use futures::{SinkExt, StreamExt, future, stream};
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
) -> Result<Terminal, ClusterError> {
    let key = generate_key();
    let request = Request::get(console_path(namespace, name))
        .header(CONNECTION, "Upgrade")
        .header(UPGRADE, "websocket")
        .header(SEC_WEBSOCKET_VERSION, "13")
        .header(SEC_WEBSOCKET_KEY, &key)
        .header(SEC_WEBSOCKET_PROTOCOL, PLAIN_KUBEVIRT)
        .body(Body::from(Vec::new()))
        .map_err(|e| ClusterError::Invalid {
            message: format!("console request: {e}"),
        })?;
    let response = client
        .send(request)
        .await
        .map_err(ClusterError::from_kube)?;

    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(refusal(name, response).await);
    }
    let headers = response.headers();
    let accept_ok = headers
        .get(SEC_WEBSOCKET_ACCEPT)
        .is_some_and(|v| v.as_bytes() == derive_accept_key(key.as_bytes()).as_bytes());
    if !accept_ok {
        return Err(ClusterError::Unexpected {
            message: format!("console of {name}: wrong or missing Sec-WebSocket-Accept"),
        });
    }
    let protocol_ok = headers
        .get(SEC_WEBSOCKET_PROTOCOL)
        .is_some_and(|v| v.as_bytes() == PLAIN_KUBEVIRT.as_bytes());
    if !protocol_ok {
        return Err(ClusterError::Unexpected {
            message: format!(
                "console of {name}: the server did not agree to {PLAIN_KUBEVIRT} (got {:?})",
                headers.get(SEC_WEBSOCKET_PROTOCOL)
            ),
        });
    }

    let upgraded = hyper::upgrade::on(response)
        .await
        .map_err(|e| ClusterError::Transient {
            message: format!("console of {name}: upgrade failed: {e}"),
        })?;
    let socket =
        WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, Some(config()))
            .await;
    Ok(terminal(socket))
}

/// The console connection's WebSocket settings. The read buffer is filled (zeroed) to its
/// full size on every read, so its size is resident memory per open console: 16 KiB instead
/// of the default 128 KiB keeps a thousand idle consoles small, and still reads a serial
/// console's output in few calls.
fn config() -> WebSocketConfig {
    WebSocketConfig::default().read_buffer_size(16 * 1024)
}

/// Turns a non-101 answer into an error: 400 means "not running yet" on this subresource.
async fn refusal(name: &str, response: http::Response<Body>) -> ClusterError {
    let code = response.status();
    let body = response
        .into_body()
        .collect_bytes()
        .await
        .unwrap_or_default();
    let status: Option<kube::core::Status> = serde_json::from_slice(&body).ok();
    let (reason, message) = match status {
        Some(s) => (s.reason, s.message),
        None => (
            String::new(),
            String::from_utf8_lossy(&body).trim().to_owned(),
        ),
    };
    if code == StatusCode::BAD_REQUEST {
        return ClusterError::ConsoleNotReady {
            name: name.to_owned(),
            message,
        };
    }
    if code.is_success() || code.is_redirection() || code.is_informational() {
        return ClusterError::Unexpected {
            message: format!("console of {name}: expected 101 Switching Protocols, got {code}"),
        };
    }
    ClusterError::from_status(code.as_u16(), &reason, &message)
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
/// output. Pings are answered by the WebSocket layer.
pub(crate) fn terminal<S>(socket: WebSocketStream<S>) -> Terminal
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (sink, source) = socket.split();
    let output = stream::unfold(Some(source), |source| async move {
        let mut source = source?;
        loop {
            match source.next().await {
                Some(Ok(Message::Binary(bytes))) => return Some((Ok(bytes), Some(source))),
                Some(Ok(Message::Text(text))) => {
                    return Some((Ok(Bytes::from(text.as_str().to_owned())), Some(source)));
                }
                Some(Ok(Message::Close(_))) | None => return None,
                Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed)) => return None,
                Some(Err(e)) => return Some((Err(ws_error(e)), None)),
            }
        }
    });
    let input = sink
        .sink_map_err(ws_error)
        .with(|bytes: Bytes| future::ready(Ok::<_, ClusterError>(Message::Binary(bytes))));
    Terminal {
        output: output.boxed(),
        input: Box::pin(input),
    }
}
