//! A byte stream to and from a serial console or an exec'd process.

use std::fmt;
use std::pin::Pin;

use bytes::Bytes;
use futures::Sink;
use futures::stream::BoxStream;

use crate::ClusterError;

/// The bytes that come out of the guest's serial console or the pod's process, in order.
/// The stream ends when the remote side closes.
pub type ByteStream = BoxStream<'static, Result<Bytes, ClusterError>>;

/// Where bytes for the guest or process go (keystrokes). Closing it closes the connection.
pub type ByteSink = Pin<Box<dyn Sink<Bytes, Error = ClusterError> + Send>>;

/// The size of a TTY in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtySize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

/// Where new sizes of an exec'd process's TTY go (the exec protocol's resize channel, 4:
/// `{"Width":…,"Height":…}`); the kubelet sets them on the TTY, which sends `SIGWINCH`.
pub type ResizeSink = Pin<Box<dyn Sink<TtySize, Error = ClusterError> + Send>>;

/// An open interactive connection: a serial console (raw bytes in binary WebSocket frames,
/// `plain.kubevirt.io`) or a pod exec with a TTY (stdout and stderr merged by the TTY).
///
/// Both halves are independent, so a relay can pump them in two tasks. Dropping both closes
/// the connection.
pub struct Terminal {
    /// Bytes from the remote side.
    pub output: ByteStream,
    /// Bytes to the remote side.
    pub input: ByteSink,
    /// The TTY's resize channel: a pod exec's. A serial console has none (`None`): its size
    /// is set inside the guest (the agent's `POST /v1/console-size`).
    pub resize: Option<ResizeSink>,
}

impl fmt::Debug for Terminal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Terminal").finish_non_exhaustive()
    }
}

/// A byte stream to a port of a VMI's guest, opened through the API server
/// ([`ConsoleCluster::open_portforward`](crate::ConsoleCluster::open_portforward)): one TCP
/// connection's bytes both ways. Reading returns what the guest's program sent, and ends
/// (`Ok(0)`) when it closes; shutting the stream down closes the connection.
pub struct PortStream {
    io: Pin<Box<dyn PortIo>>,
}

/// What a [`PortStream`] wraps.
trait PortIo: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send {}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send> PortIo for T {}

impl PortStream {
    /// Wraps a connection.
    pub(crate) fn new(
        io: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
    ) -> Self {
        Self { io: Box::pin(io) }
    }
}

impl fmt::Debug for PortStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PortStream").finish_non_exhaustive()
    }
}

impl tokio::io::AsyncRead for PortStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().io.as_mut().poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for PortStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.get_mut().io.as_mut().poll_write(cx, buf)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().io.as_mut().poll_flush(cx)
    }

    fn poll_shutdown(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        self.get_mut().io.as_mut().poll_shutdown(cx)
    }
}
