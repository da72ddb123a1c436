//! The relay: browser WebSocket frames ⇄ the VM's console bytes.
//!
//! Rules, in the order a connection lives them:
//!
//! 1. **Opening.** [`Upstream::connect`] is tried at once. While it answers
//!    [`ConsoleError::NotReady`] (KubeVirt's 400 while the VMI boots) it is tried again every
//!    [`RelayConfig::retry_interval`] for at most [`RelayConfig::boot_wait`], and the terminal
//!    says what it is waiting for. Keystrokes typed meanwhile are dropped (nothing could read
//!    them). [`ConsoleError::Stopped`] closes with [`CloseReason::VmStopped`], any other
//!    error with [`CloseReason::Unavailable`].
//! 2. **Relaying.** Browser → VM: binary frames are forwarded as they are; a text frame is
//!    forwarded as its UTF-8 bytes in a binary frame, because KubeVirt silently drops text
//!    frames — so a client sending text (a debugging tool, an older page) still types instead
//!    of typing into the void. VM → browser: always binary frames (raw serial bytes; the page
//!    decodes UTF-8 across frame boundaries). Output that is already waiting is coalesced into
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
//!    past a warning's instant shows it once the redraw is done (which would wipe it); an
//!    extension re-arms the warnings it moved past.
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

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::{FutureExt as _, Sink, SinkExt as _, Stream, StreamExt as _};
use tokio::time::Instant;

use tokio::sync::watch;

use crate::safe::Inserter;
use crate::{
    BrowserControl, CloseFrame, CloseReason, ConsoleError, Controls, Frame, LabKind, TermSize,
};

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

/// Runs one console connection until it closes; see the [module docs](self) for the rules.
///
/// `to_browser` and `from_browser` are the two halves of the browser's WebSocket, `upstream`
/// opens the VM's console, and `controls` carry the deadline and close orders.
pub async fn relay<BS, BR, BE, U>(
    mut to_browser: BS,
    mut from_browser: BR,
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
    let (sizes, _) = watch::channel(None);
    let opened = open(
        &mut to_browser,
        &mut from_browser,
        &mut upstream,
        &mut controls,
        &sizes,
        config,
    )
    .await;
    let (mut input, output) = match opened {
        Ok(io) => io,
        Err(reason) => {
            say_goodbye(&mut to_browser, &reason, config).await;
            return RelayEnd {
                reason,
                connected: false,
                bytes_to_browser: 0,
                bytes_to_console: 0,
            };
        }
    };

    let counters = Counters::default();
    let ended = pump(
        Browser {
            to: &mut to_browser,
            from: &mut from_browser,
        },
        &mut upstream,
        &mut input,
        output,
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
    say_goodbye(&mut to_browser, &reason, config).await;
    let _ = tokio::time::timeout(config.close_timeout, input.close()).await;
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
async fn open<BS, BR, BE, U>(
    to_browser: &mut BS,
    from_browser: &mut BR,
    upstream: &mut U,
    controls: &mut Controls,
    sizes: &watch::Sender<Option<TermSize>>,
    config: &RelayConfig,
) -> Result<(U::Input, U::Output), CloseReason>
where
    BS: Sink<Frame> + Unpin + Send,
    BR: Stream<Item = Result<Frame, BE>> + Unpin + Send,
    U: Upstream,
{
    let started = Instant::now();
    let mut shown: Option<String> = None;
    loop {
        let attempt = interruptible(upstream.connect(), controls, from_browser, sizes).await?;
        let message = match attempt {
            Ok(io) => {
                if shown.is_some() {
                    send_quietly(
                        to_browser,
                        Frame::Binary(Bytes::from_static(b"\r\n")),
                        config,
                    )
                    .await;
                }
                if let Some(text) = &config.connected_message {
                    send_quietly(to_browser, Frame::Binary(notice(text)), config).await;
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
        send_quietly(to_browser, Frame::Binary(text), config).await;
        interruptible(
            tokio::time::sleep(config.retry_interval),
            controls,
            from_browser,
            sizes,
        )
        .await?;
    }
}

/// Awaits `work` unless a close order, the deadline or the browser leaving comes first.
/// Keystrokes read meanwhile are dropped; the terminal's size is kept (in `sizes`).
async fn interruptible<T, BR, BE>(
    work: impl Future<Output = T>,
    controls: &mut Controls,
    from_browser: &mut BR,
    sizes: &watch::Sender<Option<TermSize>>,
) -> Result<T, CloseReason>
where
    BR: Stream<Item = Result<Frame, BE>> + Unpin,
{
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
                    None | Some(Err(_) | Ok(Frame::Close(_))) => {
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

#[derive(Default)]
struct Counters {
    to_browser: AtomicU64,
    to_console: AtomicU64,
    /// Milliseconds since `epoch` when the browser was last heard from.
    last_heard_ms: AtomicU64,
    /// The relay is waiting for the console to take keystrokes (so the browser's frames are
    /// not being read, and its silence proves nothing).
    console_busy: AtomicBool,
}

enum Ended {
    Reason(CloseReason),
    /// The console connection ended by itself (how, in words).
    ConsoleEnded(String),
}

/// The browser's two halves.
struct Browser<'a, BS, BR> {
    to: &'a mut BS,
    from: &'a mut BR,
}

#[allow(clippy::too_many_arguments)]
async fn pump<BS, BR, BE, U, I, O, E>(
    browser: Browser<'_, BS, BR>,
    upstream: &mut U,
    input: &mut I,
    mut output: O,
    controls: &mut Controls,
    sizes: &watch::Sender<Option<TermSize>>,
    config: &RelayConfig,
    counters: &Counters,
) -> Ended
where
    BS: Sink<Frame> + Unpin + Send,
    BR: Stream<Item = Result<Frame, BE>> + Unpin + Send,
    U: Upstream,
    I: Sink<Bytes, Error = E> + Unpin + Send,
    O: Stream<Item = Result<Bytes, E>> + Unpin + Send,
    E: fmt::Display,
{
    let Browser {
        to: to_browser,
        from: from_browser,
    } = browser;
    let epoch = Instant::now();
    let since_epoch = move || u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
    let mut deadlines = controls.deadlines();
    // Bytes the relay itself types (the redraw), merged with the keystrokes.
    let (inject, mut injected) = tokio::sync::mpsc::channel::<Bytes>(1);
    // The console printed something since it opened.
    let spoke = AtomicBool::new(false);
    // The redraw is done (or was not needed): warnings may be written.
    let (settled_tx, settled) = watch::channel(config.redraw.is_none());

    let down = async {
        let mut ping = tokio::time::interval_at(epoch + config.ping_interval, config.ping_interval);
        ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut warnings = Warnings::new(&config.warnings);
        let mut inserter = Inserter::new();
        let mut settled = settled;
        loop {
            let deadline = deadlines.current();
            let now = Instant::now();
            let mut next_warning = None;
            let ready = *settled.borrow_and_update();
            if let Some(deadline) = deadline.filter(|_| ready) {
                let remaining = deadline.saturating_duration_since(now);
                if warnings.due(remaining) && !remaining.is_zero() {
                    let line = notice(&warning_text(remaining));
                    if let Some(line) = inserter.insert(line) {
                        let len = line.len() as u64;
                        if let Err(reason) =
                            send(to_browser, Frame::Binary(line), config.write_timeout).await
                        {
                            return Ended::Reason(reason);
                        }
                        counters.to_browser.fetch_add(len, Ordering::Relaxed);
                    }
                }
                next_warning = warnings.next_in(remaining).map(|wait| now + wait);
            }
            let warning_due = async {
                match next_warning {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                chunk = output.next() => {
                    let (data, then) = match chunk {
                        Some(Ok(first)) => coalesce(first, &mut output, config.max_frame),
                        Some(Err(e)) => return Ended::ConsoleEnded(e.to_string()),
                        None => return Ended::ConsoleEnded("the console connection closed".to_owned()),
                    };
                    spoke.store(true, Ordering::Relaxed);
                    let data = inserter.output(data);
                    let len = data.len() as u64;
                    if let Err(reason) = send(to_browser, Frame::Binary(data), config.write_timeout).await {
                        return Ended::Reason(reason);
                    }
                    counters.to_browser.fetch_add(len, Ordering::Relaxed);
                    if let Some(end) = then {
                        return end;
                    }
                }
                _ = ping.tick() => {
                    let silent = since_epoch()
                        .saturating_sub(counters.last_heard_ms.load(Ordering::Relaxed));
                    let busy = counters.console_busy.load(Ordering::Relaxed);
                    if !busy && Duration::from_millis(silent) >= config.browser_timeout {
                        return Ended::Reason(CloseReason::BrowserUnresponsive);
                    }
                    if let Err(reason) = send(to_browser, Frame::Ping(Bytes::new()), config.write_timeout).await {
                        return Ended::Reason(reason);
                    }
                }
                () = deadlines.changed() => {}
                () = warning_due => {}
                Ok(()) = settled.changed(), if !ready => {}
            }
        }
    };

    let resizer = async {
        let mut newest = sizes.subscribe();
        if newest.borrow().is_none() {
            let _ = tokio::time::timeout(config.redraw_wait, newest.changed()).await;
        }
        let first = *newest.borrow_and_update();
        if let Some(size) = first {
            upstream.resize(size).await;
        }
        let mut settle_at = None;
        if let Some(redraw) = &config.redraw {
            if spoke.load(Ordering::Relaxed) {
                settled_tx.send_replace(true);
            } else {
                let _ = inject.send(redraw.clone()).await;
                settle_at = Some(Instant::now() + config.redraw_settle);
            }
        }
        loop {
            tokio::select! {
                changed = newest.changed() => {
                    if changed.is_err() {
                        std::future::pending::<()>().await;
                    }
                    let size = *newest.borrow_and_update();
                    if let Some(size) = size {
                        upstream.resize(size).await;
                    }
                }
                () = tokio::time::sleep_until(settle_at.unwrap_or_else(Instant::now)), if settle_at.is_some() => {
                    settle_at = None;
                    settled_tx.send_replace(true);
                }
            }
        }
    };

    let up = async {
        loop {
            let frame = tokio::select! {
                biased;
                Some(bytes) = injected.recv() => Some(Ok(Frame::Binary(bytes))),
                frame = from_browser.next() => {
                    counters
                        .last_heard_ms
                        .store(since_epoch(), Ordering::Relaxed);
                    frame
                }
            };
            let data = match frame {
                Some(Ok(Frame::Binary(bytes))) => bytes,
                Some(Ok(Frame::Text(text))) => match BrowserControl::parse(&text) {
                    None => Bytes::from(text),
                    Some(Ok(BrowserControl::Resize { cols, rows })) => {
                        sizes.send_replace(Some(TermSize { cols, rows }));
                        continue;
                    }
                    Some(Err(why)) => {
                        tracing::debug!(%why, "control message from the page ignored");
                        continue;
                    }
                },
                Some(Ok(Frame::Ping(_) | Frame::Pong(_))) => continue,
                Some(Ok(Frame::Close(_)) | Err(_)) | None => {
                    return Ended::Reason(CloseReason::BrowserClosed);
                }
            };
            if data.is_empty() {
                continue;
            }
            let len = data.len() as u64;
            counters.console_busy.store(true, Ordering::Relaxed);
            let sent = input.send(data).await;
            counters.console_busy.store(false, Ordering::Relaxed);
            counters
                .last_heard_ms
                .store(since_epoch(), Ordering::Relaxed);
            if let Err(e) = sent {
                return Ended::ConsoleEnded(e.to_string());
            }
            counters.to_console.fetch_add(len, Ordering::Relaxed);
        }
    };

    tokio::select! {
        end = down => end,
        end = up => end,
        () = resizer => unreachable!("the resizer never ends"),
        reason = controls.until_close() => Ended::Reason(reason),
    }
}

/// The warnings before a deadline: which were given, re-armed when an extension moves the
/// deadline back past them.
struct Warnings {
    /// Lead time before the deadline, and whether its warning was given.
    leads: Vec<(Duration, bool)>,
}

impl Warnings {
    fn new(leads: &[Duration]) -> Self {
        Self {
            leads: leads
                .iter()
                .filter(|l| !l.is_zero())
                .map(|&l| (l, false))
                .collect(),
        }
    }

    /// With `remaining` before the deadline: whether a warning is due now (one line for all
    /// that fell due together). Marks them given.
    fn due(&mut self, remaining: Duration) -> bool {
        let mut due = false;
        for (lead, given) in &mut self.leads {
            if remaining > *lead {
                *given = false;
            } else if !*given {
                *given = true;
                due = true;
            }
        }
        due
    }

    /// How long until the next warning falls due, with `remaining` before the deadline.
    fn next_in(&self, remaining: Duration) -> Option<Duration> {
        self.leads
            .iter()
            .filter(|(lead, given)| !given && remaining > *lead)
            .map(|(lead, _)| remaining - *lead)
            .min()
    }
}

/// The warning line for `remaining` time left (whole minutes, rounded up).
fn warning_text(remaining: Duration) -> String {
    let minutes = remaining.as_secs().div_ceil(60).max(1);
    if minutes == 1 {
        "1 minute left in this lab. Save your work now: the lab closes when the time is up."
            .to_owned()
    } else {
        format!(
            "{minutes} minutes left in this lab. Save your work, or extend the lab on the page."
        )
    }
}

/// Appends output that is already waiting to `first`, up to `max` bytes. Returns the frame and,
/// if the stream ended or failed while coalescing, how (to act on after sending the frame).
fn coalesce<O, E>(first: Bytes, output: &mut O, max: usize) -> (Bytes, Option<Ended>)
where
    O: Stream<Item = Result<Bytes, E>> + Unpin,
    E: fmt::Display,
{
    if first.len() >= max {
        return (first, None);
    }
    let mut buf: Option<BytesMut> = None;
    let mut len = first.len();
    let mut then = None;
    while len < max {
        match output.next().now_or_never() {
            Some(Some(Ok(more))) => {
                let b = buf.get_or_insert_with(|| {
                    let mut b = BytesMut::with_capacity(max.max(first.len() + more.len()));
                    b.extend_from_slice(&first);
                    b
                });
                b.extend_from_slice(&more);
                len = b.len();
            }
            Some(Some(Err(e))) => {
                then = Some(Ended::ConsoleEnded(e.to_string()));
                break;
            }
            Some(None) => {
                then = Some(Ended::ConsoleEnded(
                    "the console connection closed".to_owned(),
                ));
                break;
            }
            None => break,
        }
    }
    match buf {
        Some(b) => (b.freeze(), then),
        None => (first, then),
    }
}

/// Sends one frame to the browser within `limit`.
async fn send<BS>(to_browser: &mut BS, frame: Frame, limit: Duration) -> Result<(), CloseReason>
where
    BS: Sink<Frame> + Unpin,
{
    match tokio::time::timeout(limit, to_browser.send(frame)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(_)) => Err(CloseReason::BrowserClosed),
        Err(_) => Err(CloseReason::BrowserUnresponsive),
    }
}

/// Sends a status frame; a browser that is gone is noticed by the reading side.
async fn send_quietly<BS>(to_browser: &mut BS, frame: Frame, config: &RelayConfig)
where
    BS: Sink<Frame> + Unpin,
{
    let _ = send(to_browser, frame, config.write_timeout).await;
}

/// The reason as the terminal's last line and as the Close frame.
async fn say_goodbye<BS>(to_browser: &mut BS, reason: &CloseReason, config: &RelayConfig)
where
    BS: Sink<Frame> + Unpin,
{
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

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn warnings_fall_due_once_each_and_an_extension_re_arms_them() {
        let mut w = Warnings::new(&[5 * MIN, MIN]);
        assert!(!w.due(10 * MIN));
        assert_eq!(w.next_in(10 * MIN), Some(5 * MIN));
        assert!(w.due(5 * MIN));
        assert!(!w.due(5 * MIN - Duration::from_secs(1)));
        assert_eq!(w.next_in(4 * MIN), Some(3 * MIN));
        assert!(w.due(MIN));
        assert_eq!(w.next_in(MIN / 2), None);
        // Extended by ten minutes: both come again.
        assert!(!w.due(10 * MIN));
        assert_eq!(w.next_in(10 * MIN), Some(5 * MIN));
        // Opened with 3 minutes left: the 5-minute warning at once, then the last one.
        let mut w = Warnings::new(&[5 * MIN, MIN]);
        assert!(w.due(3 * MIN));
        assert_eq!(w.next_in(3 * MIN), Some(2 * MIN));
    }

    #[test]
    fn warning_lines_say_whole_minutes_rounded_up() {
        assert!(warning_text(5 * MIN).starts_with("5 minutes left"));
        assert!(warning_text(4 * MIN + Duration::from_secs(1)).starts_with("5 minutes left"));
        assert!(warning_text(MIN).starts_with("1 minute left"));
        assert!(warning_text(Duration::from_secs(3)).starts_with("1 minute left"));
    }
}
