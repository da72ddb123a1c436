//! The console relay: a student's browser WebSocket ⇄ the serial console of their VM
//! (KubeVirt's `plain.kubevirt.io`: raw bytes in binary frames) or the TTY of their pod.
//!
//! It owns the relaying rules — which frames go where (text from the browser becomes binary:
//! KubeVirt drops text frames), bounded buffers with backpressure, keepalive pings and the
//! silence timeout towards the browser, the retry every second while a booting VM's console
//! answers "not ready", and closing with a reason the student can read (session expired at
//! the lifespan's deadline, session finished, console opened in another tab, VM stopped), the
//! page's terminal size passed on to the console, a redraw on connecting, and the warnings
//! written into the terminal before the deadline at a safe point of the stream, and telling
//! the page when the console itself is open and which warnings it was shown
//! ([`ConsoleStatus`]). See
//! [`relay`](mod@relay) for the rules in detail and [`CloseReason`] for the close codes.
//!
//! It refuses to own the I/O on either side: the browser side is any `Sink`/`Stream` of
//! [`Frame`]s (the server adapts its WebSocket; tests use channels) and the VM side is an
//! [`Upstream`] (the server's opens `ConsoleCluster::open_console` or `ConsoleCluster::exec_pod`). Who may
//! open a console, which node, and when a session expires are the server's decisions, passed in
//! as an [`Upstream`] and [`Controls`].
//!
//! ```
//! use bytes::Bytes;
//! use futures::channel::mpsc;
//! use futures::future::BoxFuture;
//! use futures::{SinkExt as _, StreamExt as _};
//! use ttlab_console::{controls, relay, CloseReason, Connected, Frame, RelayConfig, Upstream};
//!
//! /// A "VM" that answers every line with its hostname.
//! struct Echo;
//! impl Upstream for Echo {
//!     type Input = mpsc::Sender<Bytes>;
//!     type Output = mpsc::Receiver<Result<Bytes, mpsc::SendError>>;
//!     type Error = mpsc::SendError;
//!     fn connect(&mut self) -> Connected<'_, Self> {
//!         let (keys_tx, mut keys_rx) = mpsc::channel::<Bytes>(1);
//!         let (mut out_tx, out_rx) = mpsc::channel(1);
//!         tokio::spawn(async move {
//!             while let Some(_line) = keys_rx.next().await {
//!                 let _ = out_tx.send(Ok(Bytes::from_static(b"lab-1\r\n"))).await;
//!             }
//!         });
//!         Box::pin(async move { Ok((keys_tx, out_rx)) })
//!     }
//! }
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let (to_browser, mut browser_sees) = mpsc::channel::<Frame>(4);
//! let (mut browser_types, from_browser) = mpsc::channel::<Frame>(4);
//! let (controller, controls) = controls(None);
//! let relay = tokio::spawn(relay(
//!     to_browser,
//!     from_browser.map(Ok::<_, std::convert::Infallible>),
//!     Echo,
//!     controls,
//!     RelayConfig::default(),
//! ));
//! // Text from the browser reaches the VM as bytes.
//! browser_types.send(Frame::Text("hostname\r".into())).await.unwrap();
//! // (Keepalive pings may come first on a slow machine.)
//! let first = loop {
//!     match browser_sees.next().await {
//!         Some(Frame::Ping(_)) => continue,
//!         other => break other,
//!     }
//! };
//! assert_eq!(first, Some(Frame::Binary(Bytes::from_static(b"lab-1\r\n"))));
//! controller.close(CloseReason::Finished);
//! let end = relay.await.unwrap();
//! assert_eq!(end.reason, CloseReason::Finished);
//! # });
//! ```

mod control;
mod error;
mod frame;
mod reason;
pub mod relay;
pub mod safe;

pub use control::{BrowserControl, ConsoleStatus, Controller, Controls, TermSize, controls};
pub use error::ConsoleError;
pub use frame::{CloseFrame, Frame, MAX_CLOSE_REASON};
pub use reason::{CloseReason, LabKind};
pub use relay::{Connected, RelayConfig, RelayEnd, Upstream, notice, relay};
