//! A VMI's port through the API server: KubeVirt's `portforward` subresource
//! (`…/virtualmachineinstances/{name}/portforward/{port}`), a WebSocket with subprotocol
//! `plain.kubevirt.io` that carries one TCP connection to the guest's port, its bytes in
//! binary frames both ways (virt-api: `pkg/virt-api/rest/portforward.go`; the frames:
//! `staging/src/kubevirt.io/client-go/kubevirt/typed/core/v1/websocket.go`). Opened like the
//! console (the upgrade made by hand through `Client::send`), and given to the caller as a
//! plain byte stream ([`PortStream`]).
//!
//! virt-api refuses before the upgrade: no such VMI `404`; a paused VMI `409`; no address in
//! the VMI's `status.interfaces` (it is not running yet) `400`; nothing answering on the port
//! (the guest stopped, or its program has not started) `500` with `dialing VM: …`. It does not
//! look at the VMI's phase. The last three are [`ClusterError::PortUnreachable`].
//!
//! virt-api pings the client every second and gives up on it after a minute without a pong;
//! reading the stream answers those pings, so a connection that is read keeps itself alive.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf as _, Bytes};
use futures::{SinkExt as _, StreamExt as _};
use http::StatusCode;
use kube::Client;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

use super::console::{Upgrade, upgrade};
use crate::{ClusterError, PortStream};

/// The port forward URL path of a VMI's `port` (TCP).
pub(crate) fn portforward_path(namespace: &str, name: &str, port: u16) -> String {
    format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances/{name}/portforward/{port}"
    )
}

pub(super) async fn open(
    client: &Client,
    namespace: &str,
    name: &str,
    port: u16,
) -> Result<PortStream, ClusterError> {
    let what = format!("port {port} of {name}");
    let config = WebSocketConfig::default().read_buffer_size(16 * 1024);
    match upgrade(
        client,
        portforward_path(namespace, name, port),
        &what,
        config,
    )
    .await?
    {
        Upgrade::Open(socket) => Ok(PortStream::new(WsBytes::new(*socket))),
        Upgrade::Refused {
            code,
            reason,
            message,
        } => Err(refusal(name, port, code, &reason, message)),
    }
}

/// Turns a port forward's refusal into an error (see the module docs).
fn refusal(name: &str, port: u16, code: StatusCode, reason: &str, message: String) -> ClusterError {
    let unreachable = code == StatusCode::BAD_REQUEST
        || code == StatusCode::CONFLICT
        || (code == StatusCode::INTERNAL_SERVER_ERROR && message.contains("dialing VM"));
    if unreachable {
        return ClusterError::PortUnreachable {
            name: name.to_owned(),
            port,
            message,
        };
    }
    ClusterError::from_status(code.as_u16(), reason, &message)
}

fn io_error(e: WsError) -> io::Error {
    match e {
        WsError::Io(e) => e,
        WsError::ConnectionClosed | WsError::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the port forward is closed")
        }
        other => io::Error::other(other),
    }
}

/// A WebSocket of binary frames read and written as a byte stream: each write goes out as one
/// binary frame; reads return the frames' bytes in order (text frames are dropped, as
/// KubeVirt's reader drops them); a Close frame, or the connection's end, is the end of the
/// stream.
pub(crate) struct WsBytes<S> {
    socket: WebSocketStream<S>,
    /// What is left of the last frame read.
    pending: Bytes,
    /// The remote side closed.
    eof: bool,
}

impl<S> WsBytes<S> {
    pub(crate) fn new(socket: WebSocketStream<S>) -> Self {
        Self {
            socket,
            pending: Bytes::new(),
            eof: false,
        }
    }
}

impl<S> AsyncRead for WsBytes<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending[..n]);
                this.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            match ready!(this.socket.poll_next_unpin(cx)) {
                Some(Ok(Message::Binary(bytes))) => this.pending = bytes,
                Some(Ok(Message::Close(_))) | None => this.eof = true,
                Some(Ok(
                    Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_),
                )) => {}
                Some(Err(WsError::ConnectionClosed | WsError::AlreadyClosed)) => this.eof = true,
                Some(Err(e)) => return Poll::Ready(Err(io_error(e))),
            }
        }
    }
}

impl<S> AsyncWrite for WsBytes<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        ready!(this.socket.poll_ready_unpin(cx)).map_err(io_error)?;
        this.socket
            .start_send_unpin(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(io_error)?;
        // Started on its way; `poll_flush` finishes it.
        if let Poll::Ready(Err(e)) = this.socket.poll_flush_unpin(cx) {
            return Poll::Ready(Err(io_error(e)));
        }
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.get_mut().socket.poll_flush_unpin(cx).map_err(io_error)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match ready!(self.get_mut().socket.poll_close_unpin(cx)) {
            Ok(()) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => Poll::Ready(Ok(())),
            Err(e) => Poll::Ready(Err(io_error(e))),
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _, DuplexStream};
    use tokio_tungstenite::tungstenite::protocol::Role;

    use super::*;

    async fn pair() -> (PortStream, WebSocketStream<DuplexStream>) {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let server = WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        (PortStream::new(WsBytes::new(client)), server)
    }

    #[tokio::test]
    async fn writes_are_binary_frames_and_binary_frames_are_read_text_dropped_close_is_eof() {
        let (mut stream, mut server) = pair().await;
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        stream.flush().await.unwrap();
        let got = server.next().await.unwrap().unwrap();
        assert_eq!(got, Message::binary(b"GET / HTTP/1.1\r\n\r\n".to_vec()));

        server
            .send(Message::binary(b"HTTP/1.1 ".to_vec()))
            .await
            .unwrap();
        server.send(Message::text("dropped")).await.unwrap();
        server
            .send(Message::binary(b"200 OK".to_vec()))
            .await
            .unwrap();
        server.close(None).await.unwrap();
        let mut all = Vec::new();
        stream.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"HTTP/1.1 200 OK");
    }

    #[test]
    fn refusals_map_to_typed_errors() {
        let not_running = refusal(
            "lab",
            8899,
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "no network interfaces are present".into(),
        );
        assert!(matches!(
            not_running,
            ClusterError::PortUnreachable { port: 8899, .. }
        ));
        assert!(not_running.is_retryable());
        let closed = refusal(
            "lab",
            8899,
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "dialing VM: dial tcp 10.0.0.1:8899: connect: connection refused".into(),
        );
        assert!(matches!(closed, ClusterError::PortUnreachable { .. }));
        let forbidden = refusal("lab", 8899, StatusCode::FORBIDDEN, "Forbidden", "no".into());
        assert!(matches!(forbidden, ClusterError::Forbidden { .. }));
        assert!(!forbidden.is_retryable());
        let gone = refusal(
            "lab",
            8899,
            StatusCode::NOT_FOUND,
            "NotFound",
            "gone".into(),
        );
        assert!(gone.is_not_found());
        let down = refusal(
            "lab",
            8899,
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            "etcd".into(),
        );
        assert!(matches!(down, ClusterError::Transient { .. }));
    }
}
