//! The relay: browser WebSocket frames ⇄ the VM's console bytes.
//!
//! Rules, in the order a connection lives them:
//!
//! 1. **Opening.** [`Upstream::connect`] is tried at once. While it answers
//!    [`ConsoleError::NotReady`] (KubeVirt's 400 while the VMI boots) it is tried again every
//!    [`RelayConfig::retry_interval`] for at most [`RelayConfig::boot_wait`], and the terminal
//!    says what it is waiting for. Keystrokes typed meanwhile are dropped (nothing could read
//!    them). Once it is open, the page is told ([`ConsoleStatus::Connected`], with
//!    [`RelayConfig::status`]): until then it says it is still connecting. [`ConsoleError::Stopped`] closes with [`CloseReason::VmStopped`], any other
//!    error with [`CloseReason::Unavailable`].
//! 2. **Relaying.** Browser → VM: binary frames are forwarded as they are; a text frame is
//!    forwarded as its UTF-8 bytes in a binary frame, because KubeVirt silently drops text
//!    frames — so a client sending text (a debugging tool, an older page) still types instead
//!    of typing into the void. VM → browser: always binary frames (raw serial bytes; the page
//!    decodes UTF-8 across frame boundaries); the relay's own status messages
//!    ([`ConsoleStatus`]) are the only text frames. Output that is already waiting is coalesced into
//!    frames of at most [`RelayConfig::max_frame`] bytes.
//!    A text frame that is a control message ([`BrowserControl`]: the page's terminal size) is
//!    not typed: the relay gives the newest size to [`Upstream::resize`] (one call at a time;
//!    sizes arriving meanwhile are coalesced into the latest), including one sent while the
//!    console was still opening.
//! 3. **Redraw on connecting.** Once the console is open and the page's size applied (or
//!    after [`RelayConfig::redraw_wait`] without one), [`RelayConfig::redraw`] is typed once
//!    if the console has printed nothing yet, so a (re)connected student sees a prompt at once
//!    instead of an empty screen until a key is pressed. A console that already printed
//!    something (a first connection's boot lines, a new shell's prompt) is left alone: nothing
//!    on the screen is wiped for nothing.
//! 4. **Warnings.** At each of [`RelayConfig::warnings`] before the deadline (5 minutes and
//!    1 minute by default) a line saying how long is left is written into the terminal, only
//!    at a [`Boundary`](crate::safe::Boundary) of the console's output (never inside an escape
//!    sequence or a UTF-8 character: it waits for the sequence to end). A console opened
//!    past a warning's instant shows it once the redraw is done (which would wipe it), unless
//!    the page was already shown it ([`RelayConfig::warnings_given`]: a reconnect or a reload
//!    does not repeat it); an extension re-arms the warnings it moved past. With
//!    [`RelayConfig::status`] the page is told which warnings were written
//!    ([`ConsoleStatus::Warned`]).
//! 5. **Backpressure.** Nothing is queued without bound: the relay holds at most one frame in
//!    each direction and reads the next only when the previous one was accepted, so a slow
//!    browser slows the reading of the console (TCP pushes back to KubeVirt) and a slow console
//!    slows the reading of the browser. A browser that takes no frame for
//!    [`RelayConfig::write_timeout`] is dropped ([`CloseReason::BrowserUnresponsive`]): it
//!    cannot hold a connection, a task or memory for longer.
//! 6. **Keepalive.** The browser gets a ping every [`RelayConfig::ping_interval`]; a browser
//!    from which nothing (frame or pong) arrived for [`RelayConfig::browser_timeout`] is
//!    dropped, unless the relay itself was the one waiting (on the console). Keepalive towards
//!    KubeVirt is the console connection's own job (the upstream's WebSocket).
//! 7. **Closing.** On the deadline (the session's expiry, movable by an extension) or an order
//!    from the [`Controller`](crate::Controller), or when the console ends, the student gets
//!    the reason as the terminal's last line and as the Close frame's code and reason
//!    ([`CloseReason`]), and the console connection is closed. When the console ends by itself
//!    the relay first looks for a close order already given (the console was opened in another
//!    tab), then asks [`Upstream::ended`] why (the VM stopped, or the connection was lost); a
//!    close order arriving meanwhile, or within [`RelayConfig::takeover_grace`] of a connection
//!    that looks lost, still wins (another replica's takeover announcement may arrive after
//!    KubeVirt has already dropped this connection).

mod pump;
mod warnings;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::{Sink, SinkExt as _, Stream, StreamExt as _};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::{
    BrowserControl, CloseFrame, CloseReason, ConsoleError, ConsoleStatus, Controls, Frame, LabKind,
    TermSize,
};
use pump::{Counters, Ended, pump};

/// What [`Upstream::connect`] returns: the console's input and output halves.
pub type Connected<'a, U> =
    BoxFuture<'a, Result<(<U as Upstream>::Input, <U as Upstream>::Output), ConsoleError>>;

/// The VM side of a relay: how to open the console, and how to tell why it ended.
///
/// The server implements it over `ConsoleCluster::open_console` (VMs) or `ConsoleCluster::exec_pod` (pod
/// labs); tests implement it over in-memory channels.
pub trait Upstream: Send {
    /// Bytes to the console (keystrokes). Closing it closes the console connection.
    type Input: Sink<Bytes, Error = Self::Error> + Unpin + Send;
    /// Bytes from the console; the stream ends when the console connection ends.
    type Output: Stream<Item = Result<Bytes, Self::Error>> + Unpin + Send;
    /// What can go wrong on an open connection.
    type Error: fmt::Display + Send;

    /// Opens the console once.
    fn connect(&mut self) -> Connected<'_, Self>;

    /// The console connection ended (`detail` says how) and nobody had ordered a close: says
    /// why, typically [`CloseReason::VmStopped`] or [`CloseReason::ConsoleLost`] after looking
    /// at the VM. The default assumes the connection was lost.
    fn ended(&mut self, detail: String) -> BoxFuture<'_, CloseReason> {
        Box::pin(std::future::ready(CloseReason::ConsoleLost(detail)))
    }

    /// The page's terminal is `size` now: make the console's programs see it (a VM's serial
    /// console through its agent, a pod's TTY through the exec's resize channel). Failures
    /// are the upstream's to log; the relay goes on. The default does nothing.
    fn resize(&mut self, size: TermSize) -> BoxFuture<'_, ()> {
        let _ = size;
        Box::pin(std::future::ready(()))
    }
}

/// Timing and size limits of a relay. [`RelayConfig::default`] holds the production values.
#[derive(Debug, Clone)]
pub struct RelayConfig {
    /// How often the browser is pinged.
    pub ping_interval: Duration,
    /// A browser from which nothing arrived for this long is dropped.
    pub browser_timeout: Duration,
    /// A browser that does not take one frame within this time is dropped.
    pub write_timeout: Duration,
    /// The largest frame sent to the browser (waiting output is coalesced up to this).
    pub max_frame: usize,
    /// Time between two attempts to open a console that is not ready.
    pub retry_interval: Duration,
    /// How long a console that is not ready is waited for, in all.
    pub boot_wait: Duration,
    /// How long the closing messages may take (to the browser, and to the console).
    pub close_timeout: Duration,
    /// Written to the terminal once the console is open (`None`: nothing).
    pub connected_message: Option<String>,
    /// What the lab runs in: the words of the waiting line and of the closing reason (a pod
    /// lab's student reads of a container and a shell, never of a VM). Default a VM.
    pub lab: LabKind,
    /// How long a console connection that ended for no known reason waits for a close order
    /// (a takeover announced by another server replica) before it is reported as lost.
    pub takeover_grace: Duration,
    /// Typed once after connecting, to make the console redraw (`None`: nothing). The server
    /// types Ctrl-L into a VM's serial console: the shell clears and shows its prompt with
    /// the line being edited, `vim`, `less` and `top` repaint; nothing is run.
    pub redraw: Option<Bytes>,
    /// How long the redraw waits for the page's terminal size, so it draws for that size.
    pub redraw_wait: Duration,
    /// How long after a redraw the console's answer (a cleared screen) is waited for before a
    /// warning may be written.
    pub redraw_settle: Duration,
    /// How long before the deadline a warning line is written into the terminal.
    pub warnings: Vec<Duration>,
    /// Warnings (of [`RelayConfig::warnings`]) the page was already shown for the current
    /// deadline, by an earlier connection: not written again unless an extension moves the
    /// deadline back past them.
    pub warnings_given: Vec<Duration>,
    /// Whether the page gets the relay's status messages ([`ConsoleStatus`], text frames):
    /// the console is open, a warning was written. Default off (binary frames only).
    pub status: bool,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            ping_interval: Duration::from_secs(20),
            browser_timeout: Duration::from_secs(60),
            write_timeout: Duration::from_secs(30),
            max_frame: 64 * 1024,
            retry_interval: Duration::from_secs(1),
            boot_wait: Duration::from_secs(300),
            close_timeout: Duration::from_secs(2),
            connected_message: None,
            lab: LabKind::Vm,
            takeover_grace: Duration::from_secs(1),
            redraw: None,
            redraw_wait: Duration::from_secs(1),
            redraw_settle: Duration::from_millis(500),
            warnings: vec![Duration::from_secs(5 * 60), Duration::from_secs(60)],
            warnings_given: Vec::new(),
            status: false,
        }
    }
}

/// How a relay ended, for the caller's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelayEnd {
    /// Why it ended (what the student was shown).
    pub reason: CloseReason,
    /// Whether the console was ever open.
    pub connected: bool,
    /// Console bytes delivered to the browser.
    pub bytes_to_browser: u64,
    /// Keystroke bytes delivered to the console.
    pub bytes_to_console: u64,
}

/// A line for the terminal from ttlab itself (not from the VM), set apart in colour.
pub fn notice(text: &str) -> Bytes {
    Bytes::from(format!("\r\n\x1b[1;33m[ttlab] {text}\x1b[0m\r\n"))
}

/// The browser's sending half, as the relay holds it (boxed: whatever the server's WebSocket
/// is); a failure to send means the browser is gone.
type ToBrowser<'a> = Pin<Box<dyn Sink<Frame, Error = Gone> + Send + 'a>>;
/// The browser's receiving half; an error, like the end of the stream, means it is gone.
type FromBrowser<'a> = Pin<Box<dyn Stream<Item = Result<Frame, Gone>> + Send + 'a>>;
/// Keystrokes to the console (the [`Upstream::Input`] of an open console, boxed); an error
/// says, in words, how the connection ended.
type ToConsole<'a> = Pin<Box<dyn Sink<Bytes, Error = String> + Send + 'a>>;
/// The console's output (the [`Upstream::Output`] of an open console, boxed); an error says,
/// in words, how the connection ended.
type FromConsole<'a> = Pin<Box<dyn Stream<Item = Result<Bytes, String>> + Send + 'a>>;

/// The browser's socket failed or closed.
#[derive(Debug)]
struct Gone;

/// The browser's two halves.
struct Browser<'a> {
    to: ToBrowser<'a>,
    from: FromBrowser<'a>,
}

/// A sink whose every error is put through `map`. (`SinkExt::sink_map_err` maps only the
/// first and panics on a second, and a close after a failed send is a second error.)
struct MapErrEach<S, F> {
    sink: Pin<Box<S>>,
    map: F,
}

impl<S, F> MapErrEach<S, F> {
    fn new(sink: S, map: F) -> Self {
        Self {
            sink: Box::pin(sink),
            map,
        }
    }
}

impl<S, F, T, E> Sink<T> for MapErrEach<S, F>
where
    S: Sink<T>,
    F: FnMut(S::Error) -> E + Unpin,
{
    type Error = E;

    fn poll_ready(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), E>> {
        let this = self.get_mut();
        this.sink.as_mut().poll_ready(cx).map_err(&mut this.map)
    }

    fn start_send(self: Pin<&mut Self>, item: T) -> Result<(), E> {
        let this = self.get_mut();
        this.sink.as_mut().start_send(item).map_err(&mut this.map)
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), E>> {
        let this = self.get_mut();
        this.sink.as_mut().poll_flush(cx).map_err(&mut this.map)
    }

    fn poll_close(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), E>> {
        let this = self.get_mut();
        this.sink.as_mut().poll_close(cx).map_err(&mut this.map)
    }
}

/// An open console's two halves.
struct Console<'a> {
    to: ToConsole<'a>,
    from: FromConsole<'a>,
}

impl<'a> Console<'a> {
    /// The halves [`Upstream::connect`] returned, boxed, their errors put in words.
    fn new<I, O, E>(input: I, output: O) -> Self
    where
        I: Sink<Bytes, Error = E> + Send + 'a,
        O: Stream<Item = Result<Bytes, E>> + Send + 'a,
        E: fmt::Display,
    {
        Self {
            to: Box::pin(MapErrEach::new(input, |e: E| e.to_string())),
            from: Box::pin(output.map(|r| r.map_err(|e| e.to_string()))),
        }
    }
}

/// What the relay asks of an [`Upstream`] once its console is open: to pass on the terminal's
/// size.
trait Resize: Send {
    fn resize(&mut self, size: TermSize) -> BoxFuture<'_, ()>;
}

impl<U: Upstream> Resize for U {
    fn resize(&mut self, size: TermSize) -> BoxFuture<'_, ()> {
        Upstream::resize(self, size)
    }
}

/// Runs one console connection until it closes; see the [module docs](self) for the rules.
///
/// `to_browser` and `from_browser` are the two halves of the browser's WebSocket, `upstream`
/// opens the VM's console, and `controls` carry the deadline and close orders.
pub async fn relay<BS, BR, BE, U>(
    to_browser: BS,
    from_browser: BR,
    mut upstream: U,
    mut controls: Controls,
    config: RelayConfig,
) -> RelayEnd
where
    BS: Sink<Frame> + Unpin + Send,
    BR: Stream<Item = Result<Frame, BE>> + Unpin + Send,
    U: Upstream,
{
    let config = &config;
    let mut browser = Browser {
        to: Box::pin(MapErrEach::new(to_browser, |_| Gone)),
        from: Box::pin(from_browser.map(|frame| frame.map_err(|_| Gone))),
    };
    let (sizes, _) = watch::channel(None);
    let opened = open(&mut browser, &mut upstream, &mut controls, &sizes, config).await;
    let mut console = match opened {
        Ok((input, output)) => Console::new(input, output),
        Err(reason) => {
            say_goodbye(&mut browser.to, &reason, config).await;
            return RelayEnd {
                reason,
                connected: false,
                bytes_to_browser: 0,
                bytes_to_console: 0,
            };
        }
    };

    let counters = Counters::new();
    let ended = pump(
        &mut browser,
        &mut console,
        &mut upstream,
        &mut controls,
        &sizes,
        config,
        &counters,
    )
    .await;
    let reason = match ended {
        Ended::Reason(reason) => reason,
        Ended::ConsoleEnded(detail) => match controls.pending() {
            Some(reason) => reason,
            None => why_ended(&mut upstream, &mut controls, detail, config).await,
        },
    };
    tracing::debug!(%reason, "console relay closing");
    say_goodbye(&mut browser.to, &reason, config).await;
    let _ = tokio::time::timeout(config.close_timeout, console.to.close()).await;
    RelayEnd {
        reason,
        connected: true,
        bytes_to_browser: counters.to_browser.load(Ordering::Relaxed),
        bytes_to_console: counters.to_console.load(Ordering::Relaxed),
    }
}

/// Why the console connection ended by itself. A close order given meanwhile wins over the
/// upstream's own account: when the console is opened on another server replica, KubeVirt
/// drops this connection, and the replica's announcement of the takeover may arrive a moment
/// later. So a connection that looks merely lost waits [`RelayConfig::takeover_grace`] for
/// such an order before it is reported lost (which makes the page reconnect).
async fn why_ended<U: Upstream>(
    upstream: &mut U,
    controls: &mut Controls,
    detail: String,
    config: &RelayConfig,
) -> CloseReason {
    let asked = tokio::time::timeout(config.close_timeout, upstream.ended(detail.clone()));
    let reason = tokio::select! {
        biased;
        reason = controls.until_close() => return reason,
        why = asked => why.unwrap_or(CloseReason::ConsoleLost(detail)),
    };
    if !matches!(reason, CloseReason::ConsoleLost(_)) || config.takeover_grace.is_zero() {
        return reason;
    }
    tokio::time::timeout(config.takeover_grace, controls.until_close())
        .await
        .unwrap_or(reason)
}

/// Opens the console, retrying while it is not ready; returns the reason to close otherwise.
async fn open<U: Upstream>(
    browser: &mut Browser<'_>,
    upstream: &mut U,
    controls: &mut Controls,
    sizes: &watch::Sender<Option<TermSize>>,
    config: &RelayConfig,
) -> Result<(U::Input, U::Output), CloseReason> {
    let started = Instant::now();
    let mut shown: Option<String> = None;
    loop {
        let attempt = interruptible(upstream.connect(), controls, &mut browser.from, sizes).await?;
        let message = match attempt {
            Ok(io) => {
                if shown.is_some() {
                    send_quietly(
                        &mut browser.to,
                        Frame::Binary(Bytes::from_static(b"\r\n")),
                        config,
                    )
                    .await;
                }
                if config.status {
                    send_quietly(&mut browser.to, ConsoleStatus::Connected.frame(), config).await;
                }
                if let Some(text) = &config.connected_message {
                    send_quietly(&mut browser.to, Frame::Binary(notice(text)), config).await;
                }
                return Ok(io);
            }
            Err(ConsoleError::NotReady { message }) => message,
            Err(ConsoleError::Stopped { .. }) => return Err(CloseReason::VmStopped),
            Err(ConsoleError::Unavailable { message }) => {
                return Err(CloseReason::Unavailable(message));
            }
        };
        let waited = started.elapsed();
        if waited + config.retry_interval > config.boot_wait {
            return Err(CloseReason::Unavailable(format!(
                "it was still not ready after {} s ({message})",
                waited.as_secs()
            )));
        }
        // A new line for each new state, a dot for each further second in the same one.
        let text = if shown.as_deref() == Some(message.as_str()) {
            Bytes::from_static(b".")
        } else {
            let lead = if shown.is_some() { "\r\n" } else { "" };
            Bytes::from(format!(
                "{lead}\x1b[2m[ttlab] Waiting for {}: {message}\x1b[0m ",
                config.lab.console()
            ))
        };
        shown = Some(message);
        send_quietly(&mut browser.to, Frame::Binary(text), config).await;
        interruptible(
            tokio::time::sleep(config.retry_interval),
            controls,
            &mut browser.from,
            sizes,
        )
        .await?;
    }
}

/// Awaits `work` unless a close order, the deadline or the browser leaving comes first.
/// Keystrokes read meanwhile are dropped; the terminal's size is kept (in `sizes`).
async fn interruptible<T>(
    work: impl Future<Output = T>,
    controls: &mut Controls,
    from_browser: &mut FromBrowser<'_>,
    sizes: &watch::Sender<Option<TermSize>>,
) -> Result<T, CloseReason> {
    let mut work = std::pin::pin!(work);
    loop {
        // Biased: work that is already done wins over a browser frame waiting to be read, so
        // a console that opens at once loses none of the keystrokes typed before it opened.
        tokio::select! {
            biased;
            done = &mut work => return Ok(done),
            reason = controls.until_close() => return Err(reason),
            frame = from_browser.next() => {
                match frame {
                    None | Some(Err(Gone) | Ok(Frame::Close(_))) => {
                        return Err(CloseReason::BrowserClosed);
                    }
                    Some(Ok(Frame::Text(text))) => {
                        if let Some(Ok(BrowserControl::Resize { cols, rows })) =
                            BrowserControl::parse(&text)
                        {
                            sizes.send_replace(Some(TermSize { cols, rows }));
                        }
                    }
                    Some(Ok(_)) => {}
                }
            }
        }
    }
}

/// Sends one frame to the browser within `limit`.
async fn send(
    to_browser: &mut ToBrowser<'_>,
    frame: Frame,
    limit: Duration,
) -> Result<(), CloseReason> {
    match tokio::time::timeout(limit, to_browser.send(frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Gone)) => Err(CloseReason::BrowserClosed),
        Err(_) => Err(CloseReason::BrowserUnresponsive),
    }
}

/// Sends a status frame; a browser that is gone is noticed by the reading side.
async fn send_quietly(to_browser: &mut ToBrowser<'_>, frame: Frame, config: &RelayConfig) {
    let _ = send(to_browser, frame, config.write_timeout).await;
}

/// The reason as the terminal's last line and as the Close frame.
async fn say_goodbye(to_browser: &mut ToBrowser<'_>, reason: &CloseReason, config: &RelayConfig) {
    if matches!(
        reason,
        CloseReason::BrowserClosed | CloseReason::BrowserUnresponsive
    ) {
        let _ = tokio::time::timeout(config.close_timeout, to_browser.close()).await;
        return;
    }
    let message = reason.message_for(config.lab);
    let goodbye = async {
        to_browser.feed(Frame::Binary(notice(&message))).await?;
        to_browser
            .feed(Frame::Close(Some(CloseFrame::new(reason.code(), &message))))
            .await?;
        to_browser.close().await
    };
    let _ = tokio::time::timeout(config.close_timeout, goodbye).await;
}
