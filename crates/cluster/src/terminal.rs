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
