//! An open console's relaying (rules 2 to 6 of the [module docs](super)), in three parts run
//! side by side until one of them ends it: guest → browser ([`guest_to_browser`]: output,
//! warnings, keepalive), browser → guest ([`browser_to_guest`]: keystrokes, the page's size)
//! and the resizer ([`resize_and_redraw`]: the size to the console, the redraw on
//! connecting). A close order or the deadline ends all three.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::{FutureExt as _, SinkExt as _, StreamExt as _};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::warnings::{Warnings, warning_text};
use super::{
    Browser, Console, FromBrowser, FromConsole, Gone, RelayConfig, Resize, ToBrowser, ToConsole,
    notice, send,
};
use crate::control::Deadlines;
use crate::safe::Inserter;
use crate::{BrowserControl, CloseReason, ConsoleStatus, Controls, Frame, TermSize};

/// What the parts of a relay share: the bytes each way, and when the browser was last heard
/// from.
pub(super) struct Counters {
    pub(super) to_browser: AtomicU64,
    pub(super) to_console: AtomicU64,
    /// When the relay started: [`Counters::last_heard_ms`] counts from it.
    epoch: Instant,
    /// Milliseconds since `epoch` when the browser was last heard from.
    last_heard_ms: AtomicU64,
    /// The relay is waiting for the console to take keystrokes (so the browser's frames are
    /// not being read, and its silence proves nothing).
    console_busy: AtomicBool,
}

impl Counters {
    /// Nothing relayed yet; the browser counts as heard from now.
    pub(super) fn new() -> Self {
        Self {
            to_browser: AtomicU64::new(0),
            to_console: AtomicU64::new(0),
            epoch: Instant::now(),
            last_heard_ms: AtomicU64::new(0),
            console_busy: AtomicBool::new(false),
        }
    }

    fn since_epoch(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The browser was heard from (or the relay was busy on its behalf) just now.
    fn heard_now(&self) {
        self.last_heard_ms
            .store(self.since_epoch(), Ordering::Relaxed);
    }

    /// Whether the browser has been silent for `limit`, not counting time the relay spent
    /// waiting on the console.
    fn browser_silent_for(&self, limit: Duration) -> bool {
        let silent = self
            .since_epoch()
            .saturating_sub(self.last_heard_ms.load(Ordering::Relaxed));
        !self.console_busy.load(Ordering::Relaxed) && Duration::from_millis(silent) >= limit
    }
}

/// How relaying ended.
pub(super) enum Ended {
    Reason(CloseReason),
    /// The console connection ended by itself (how, in words).
    ConsoleEnded(String),
}

/// Relays between the open `console` and the `browser` until one side ends, a close order
/// comes or the deadline passes.
pub(super) async fn pump(
    browser: &mut Browser<'_>,
    console: &mut Console<'_>,
    resize: &mut dyn Resize,
    controls: &mut Controls,
    sizes: &watch::Sender<Option<TermSize>>,
    config: &RelayConfig,
    counters: &Counters,
) -> Ended {
    // Bytes the relay itself types (the redraw), merged with the keystrokes.
    let (inject, mut injected) = mpsc::channel::<Bytes>(1);
    // The console printed something since it opened.
    let spoke = AtomicBool::new(false);
    // The redraw is done (or was not needed): warnings may be written.
    let (settled_tx, settled) = watch::channel(config.redraw.is_none());
    let redraw = Redraw {
        inject,
        settled: settled_tx,
        spoke: &spoke,
    };
    let to_guest = &mut console.to;
    let from_guest = &mut console.from;
    let deadlines = controls.deadlines();
    tokio::select! {
        end = guest_to_browser(&mut browser.to, from_guest, deadlines, settled, &spoke, config, counters) => end,
        end = browser_to_guest(&mut browser.from, to_guest, &mut injected, sizes, counters) => end,
        () = resize_and_redraw(resize, sizes, redraw, config) => unreachable!("the resizer never ends"),
        reason = controls.until_close() => Ended::Reason(reason),
    }
}

/// Guest → browser: the console's output (coalesced, with the warnings inserted at safe
/// points once the redraw settled), the keepalive pings, and dropping a silent browser.
async fn guest_to_browser(
    to_browser: &mut ToBrowser<'_>,
    output: &mut FromConsole<'_>,
    mut deadlines: Deadlines,
    mut settled: watch::Receiver<bool>,
    spoke: &AtomicBool,
    config: &RelayConfig,
    counters: &Counters,
) -> Ended {
    let mut ping =
        tokio::time::interval_at(counters.epoch + config.ping_interval, config.ping_interval);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warnings = Warnings::new(&config.warnings, &config.warnings_given);
    let mut inserter = Inserter::new();
    loop {
        let deadline = deadlines.current();
        let ready = *settled.borrow_and_update();
        let next_warning = match deadline.filter(|_| ready) {
            Some(deadline) => {
                match warn_if_due(
                    to_browser,
                    &mut warnings,
                    &mut inserter,
                    deadline,
                    config,
                    counters,
                )
                .await
                {
                    Ok(next) => next,
                    Err(reason) => return Ended::Reason(reason),
                }
            }
            None => None,
        };
        let warning_due = async {
            match next_warning {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            chunk = output.next() => {
                let forwarded =
                    forward_output(chunk, output, to_browser, &mut inserter, spoke, config, counters);
                if let Some(end) = forwarded.await {
                    return end;
                }
            }
            _ = ping.tick() => {
                if let Err(reason) = keepalive(to_browser, config, counters).await {
                    return Ended::Reason(reason);
                }
            }
            () = deadlines.changed() => {}
            () = warning_due => {}
            Ok(()) = settled.changed(), if !ready => {}
        }
    }
}

/// Writes the warning that fell due before `deadline`, if one did (once the inserter finds a
/// safe point). Returns when the next one falls due.
async fn warn_if_due(
    to_browser: &mut ToBrowser<'_>,
    warnings: &mut Warnings,
    inserter: &mut Inserter,
    deadline: Instant,
    config: &RelayConfig,
    counters: &Counters,
) -> Result<Option<Instant>, CloseReason> {
    let now = Instant::now();
    let remaining = deadline.saturating_duration_since(now);
    let due = warnings.due(remaining);
    if !due.is_empty() && !remaining.is_zero() {
        // The page hears of the warning before it shows: a page that shows it has taken note
        // of it, whenever it reloads.
        if config.status {
            let leads = due.iter().map(Duration::as_secs).collect();
            send(
                to_browser,
                ConsoleStatus::Warned { leads }.frame(),
                config.write_timeout,
            )
            .await?;
        }
        if let Some(line) = inserter.insert(notice(&warning_text(remaining))) {
            let len = line.len() as u64;
            send(to_browser, Frame::Binary(line), config.write_timeout).await?;
            counters.to_browser.fetch_add(len, Ordering::Relaxed);
        }
    }
    Ok(warnings.next_in(remaining).map(|wait| now + wait))
}

/// Sends the console's output `chunk` (with whatever else is already waiting) to the browser.
/// Returns how relaying ends, if it does: the console ended (after what it sent last is
/// delivered) or the browser did not take the frame.
async fn forward_output(
    chunk: Option<Result<Bytes, String>>,
    output: &mut FromConsole<'_>,
    to_browser: &mut ToBrowser<'_>,
    inserter: &mut Inserter,
    spoke: &AtomicBool,
    config: &RelayConfig,
    counters: &Counters,
) -> Option<Ended> {
    let (data, then) = match chunk {
        Some(Ok(first)) => coalesce(first, output, config.max_frame),
        Some(Err(e)) => return Some(Ended::ConsoleEnded(e)),
        None => {
            return Some(Ended::ConsoleEnded(
                "the console connection closed".to_owned(),
            ));
        }
    };
    spoke.store(true, Ordering::Relaxed);
    let data = inserter.output(data);
    let len = data.len() as u64;
    if let Err(reason) = send(to_browser, Frame::Binary(data), config.write_timeout).await {
        return Some(Ended::Reason(reason));
    }
    counters.to_browser.fetch_add(len, Ordering::Relaxed);
    then
}

/// A ping to the browser, unless it has been silent for [`RelayConfig::browser_timeout`].
async fn keepalive(
    to_browser: &mut ToBrowser<'_>,
    config: &RelayConfig,
    counters: &Counters,
) -> Result<(), CloseReason> {
    if counters.browser_silent_for(config.browser_timeout) {
        return Err(CloseReason::BrowserUnresponsive);
    }
    send(to_browser, Frame::Ping(Bytes::new()), config.write_timeout).await
}

/// Appends output that is already waiting to `first`, up to `max` bytes. Returns the frame and,
/// if the stream ended or failed while coalescing, how (to act on after sending the frame).
fn coalesce(first: Bytes, output: &mut FromConsole<'_>, max: usize) -> (Bytes, Option<Ended>) {
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
                then = Some(Ended::ConsoleEnded(e));
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

/// Browser → guest: keystrokes (binary as they are, text as its UTF-8 bytes) and the bytes
/// the relay types itself (the redraw), one at a time as the console takes them; the page's
/// terminal size goes to the resizer instead.
async fn browser_to_guest(
    from_browser: &mut FromBrowser<'_>,
    input: &mut ToConsole<'_>,
    injected: &mut mpsc::Receiver<Bytes>,
    sizes: &watch::Sender<Option<TermSize>>,
    counters: &Counters,
) -> Ended {
    loop {
        let frame = tokio::select! {
            biased;
            Some(bytes) = injected.recv() => Some(Ok(Frame::Binary(bytes))),
            frame = from_browser.next() => {
                counters.heard_now();
                frame
            }
        };
        let data = match keystrokes(frame, sizes) {
            Keys::Typed(data) => data,
            Keys::Nothing => continue,
            Keys::Closed => return Ended::Reason(CloseReason::BrowserClosed),
        };
        let len = data.len() as u64;
        counters.console_busy.store(true, Ordering::Relaxed);
        let sent = input.send(data).await;
        counters.console_busy.store(false, Ordering::Relaxed);
        counters.heard_now();
        if let Err(e) = sent {
            return Ended::ConsoleEnded(e);
        }
        counters.to_console.fetch_add(len, Ordering::Relaxed);
    }
}

/// What a browser frame means to the console.
enum Keys {
    /// Bytes to type (never empty).
    Typed(Bytes),
    /// Nothing to type (a ping, a pong, a control message, an empty frame).
    Nothing,
    /// The browser closed or its socket failed.
    Closed,
}

/// The bytes a browser frame types; a resize message goes to `sizes` instead.
fn keystrokes(frame: Option<Result<Frame, Gone>>, sizes: &watch::Sender<Option<TermSize>>) -> Keys {
    let data = match frame {
        Some(Ok(Frame::Binary(bytes))) => bytes,
        Some(Ok(Frame::Text(text))) => match BrowserControl::parse(&text) {
            None => Bytes::from(text),
            Some(Ok(BrowserControl::Resize { cols, rows })) => {
                sizes.send_replace(Some(TermSize { cols, rows }));
                return Keys::Nothing;
            }
            Some(Err(why)) => {
                tracing::debug!(%why, "control message from the page ignored");
                return Keys::Nothing;
            }
        },
        Some(Ok(Frame::Ping(_) | Frame::Pong(_))) => return Keys::Nothing,
        Some(Ok(Frame::Close(_)) | Err(Gone)) | None => return Keys::Closed,
    };
    if data.is_empty() {
        Keys::Nothing
    } else {
        Keys::Typed(data)
    }
}

/// What the resizer needs to redraw the console once.
struct Redraw<'a> {
    /// Where it types the redraw (merged with the keystrokes).
    inject: mpsc::Sender<Bytes>,
    /// Set once the redraw is done or was not needed: warnings may be written.
    settled: watch::Sender<bool>,
    /// Whether the console printed something since it opened.
    spoke: &'a AtomicBool,
}

/// The resizer: the page's size (the first, waited for up to [`RelayConfig::redraw_wait`],
/// then each newer one) to the console, one call at a time; then, after the first, the
/// redraw if the console has printed nothing yet. Never ends.
async fn resize_and_redraw(
    resize: &mut dyn Resize,
    sizes: &watch::Sender<Option<TermSize>>,
    redraw: Redraw<'_>,
    config: &RelayConfig,
) {
    let mut newest = sizes.subscribe();
    if newest.borrow().is_none() {
        let _ = tokio::time::timeout(config.redraw_wait, newest.changed()).await;
    }
    let first = *newest.borrow_and_update();
    if let Some(size) = first {
        resize.resize(size).await;
    }
    let mut settle_at = None;
    if let Some(bytes) = &config.redraw {
        if redraw.spoke.load(Ordering::Relaxed) {
            redraw.settled.send_replace(true);
        } else {
            let _ = redraw.inject.send(bytes.clone()).await;
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
                    resize.resize(size).await;
                }
            }
            () = tokio::time::sleep_until(settle_at.unwrap_or_else(Instant::now)), if settle_at.is_some() => {
                settle_at = None;
                redraw.settled.send_replace(true);
            }
        }
    }
}
