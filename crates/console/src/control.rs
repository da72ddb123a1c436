//! Telling a running relay when to stop: a deadline that can move (an extension) and a close
//! order with its reason (session finished, console opened elsewhere, server shutdown). And
//! the control messages on the console WebSocket: the page's own ([`BrowserControl`]: its
//! terminal's size) and the relay's to the page ([`ConsoleStatus`]: the console is open, a
//! warning was written).

use tokio::sync::watch;
use tokio::time::Instant;

use crate::CloseReason;

/// A terminal's size in character cells.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TermSize {
    /// Columns.
    pub cols: u16,
    /// Rows.
    pub rows: u16,
}

impl TermSize {
    /// The most rows or columns a page may ask for.
    pub const MAX: u16 = 1000;

    /// Whether both are within 1..=[`TermSize::MAX`].
    pub fn is_valid(&self) -> bool {
        (1..=Self::MAX).contains(&self.cols) && (1..=Self::MAX).contains(&self.rows)
    }
}

/// A message from the page that is not keystrokes.
///
/// The page types with binary frames. A text frame holding a JSON object whose `"type"` is a
/// known control is a control message: `{"type":"resize","cols":120,"rows":40}` (the page
/// sends it on connecting and on every resize of its terminal). Any other text frame is
/// typed, as before (see [`crate::relay`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum BrowserControl {
    /// The terminal's size changed (or is told on connecting).
    Resize {
        /// Columns.
        cols: u16,
        /// Rows.
        rows: u16,
    },
}

impl BrowserControl {
    /// The prefix every control message starts with.
    pub const PREFIX: &'static str = r#"{"type":"#;

    /// `None` when `text` is not a control message (it is keystrokes); `Some(Err(why))` when
    /// it is one but invalid (a size of 0 or over [`TermSize::MAX`], an unknown type): it is
    /// then dropped, never typed.
    pub fn parse(text: &str) -> Option<Result<Self, String>> {
        if !text.starts_with(Self::PREFIX) {
            return None;
        }
        Some(match serde_json::from_str::<Self>(text) {
            Ok(Self::Resize { cols, rows }) if !(TermSize { cols, rows }).is_valid() => {
                Err(format!(
                    "a terminal of {cols}x{rows}: each must be 1 to {}",
                    TermSize::MAX
                ))
            }
            Ok(control) => Ok(control),
            Err(e) => Err(e.to_string()),
        })
    }
}

/// A message from the relay to the page that is not console output, sent as a text frame
/// holding a JSON object (console output always travels in binary frames) when
/// [`RelayConfig::status`](crate::RelayConfig::status) is on:
///
/// - `{"type":"connected"}`: the console itself is open (KubeVirt's serial console, or the
///   pod's shell), not merely the page's WebSocket to the server: from now on what the page
///   types reaches the lab. Until then the page says it is still connecting.
/// - `{"type":"warned","leads":[300]}`: a warning line for these lead times before the
///   deadline (seconds) is written into the terminal right after it (so a page that shows the
///   line has already taken note of it). A page that reconnects names them (the
///   server's `warned` query parameter, see [`RelayConfig::warnings_given`](crate::RelayConfig::warnings_given)),
///   so the same warning is not written again into the same student's terminal.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ConsoleStatus {
    /// The console is open: keystrokes reach the lab from now on.
    Connected,
    /// A warning line was written, for these lead times before the deadline (seconds).
    Warned {
        /// The lead times (seconds before the deadline) the line stands for.
        leads: Vec<u64>,
    },
}

impl ConsoleStatus {
    /// The message as the text frame the page receives.
    pub fn frame(&self) -> crate::Frame {
        // A fieldless variant or a list of integers: serialising cannot fail.
        crate::Frame::Text(serde_json::to_string(self).unwrap_or_default())
    }
}

#[derive(Debug, Clone)]
struct State {
    deadline: Option<Instant>,
    close: Option<CloseReason>,
}

/// The owner's end: moves the deadline and orders a close. Cheap to clone; dropping every
/// clone leaves the relay running until its last deadline (never closes it by itself).
#[derive(Debug, Clone)]
pub struct Controller {
    tx: watch::Sender<State>,
}

/// The relay's end, given to [`relay`](crate::relay).
#[derive(Debug)]
pub struct Controls {
    rx: watch::Receiver<State>,
}

/// A connected pair; `deadline` is the instant the session expires (`None`: no deadline).
pub fn controls(deadline: Option<Instant>) -> (Controller, Controls) {
    let (tx, rx) = watch::channel(State {
        deadline,
        close: None,
    });
    (Controller { tx }, Controls { rx })
}

impl Controller {
    /// Moves the expiry (after an extension). A deadline already in the past closes the
    /// console with [`CloseReason::Expired`] at once.
    pub fn set_deadline(&self, deadline: Option<Instant>) {
        self.tx.send_modify(|s| s.deadline = deadline);
    }

    /// Orders the relay to close with `reason`. The first order wins; later ones are ignored.
    pub fn close(&self, reason: CloseReason) {
        self.tx.send_modify(|s| {
            if s.close.is_none() {
                s.close = Some(reason);
            }
        });
    }

    /// The current deadline.
    pub fn deadline(&self) -> Option<Instant> {
        self.tx.borrow().deadline
    }

    /// Whether the relay has ended (its [`Controls`] were dropped).
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

impl Controls {
    /// A follower of the deadline alone, for tasks that act before it (the warnings).
    pub(crate) fn deadlines(&self) -> Deadlines {
        Deadlines {
            rx: self.rx.clone(),
        }
    }

    /// A close order already given, or the deadline if it has passed, without waiting.
    pub fn pending(&self) -> Option<CloseReason> {
        let state = self.rx.borrow();
        if let Some(reason) = &state.close {
            return Some(reason.clone());
        }
        match state.deadline {
            Some(d) if d <= Instant::now() => Some(CloseReason::Expired),
            _ => None,
        }
    }

    /// Waits for a close order or the deadline, whichever comes first, following deadline
    /// changes. Cancel-safe: it may be dropped and called again.
    pub async fn until_close(&mut self) -> CloseReason {
        loop {
            let state = self.rx.borrow_and_update().clone();
            if let Some(reason) = state.close {
                return reason;
            }
            let expiry = async {
                match state.deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = expiry => return CloseReason::Expired,
                changed = self.rx.changed() => {
                    if changed.is_err() {
                        // Every controller is gone: only the last deadline remains.
                        match state.deadline {
                            Some(d) => {
                                tokio::time::sleep_until(d).await;
                                return CloseReason::Expired;
                            }
                            None => std::future::pending().await,
                        }
                    }
                }
            }
        }
    }
}

/// Follows the deadline of a [`Controls`].
#[derive(Debug)]
pub(crate) struct Deadlines {
    rx: watch::Receiver<State>,
}

impl Deadlines {
    /// The deadline now.
    pub(crate) fn current(&mut self) -> Option<Instant> {
        self.rx.borrow_and_update().deadline
    }

    /// Waits until the deadline may have changed (never returns once every controller is
    /// gone: the deadline can no longer move).
    pub(crate) async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_deadline_fires_at_its_instant_and_follows_an_extension() {
        let start = Instant::now();
        let (controller, mut controls) = controls(Some(start + Duration::from_secs(60)));
        let waiter = tokio::spawn(async move {
            let reason = controls.until_close().await;
            (reason, Instant::now())
        });
        tokio::time::sleep(Duration::from_secs(30)).await;
        controller.set_deadline(Some(start + Duration::from_secs(90)));
        let (reason, at) = waiter.await.unwrap();
        assert_eq!(reason, CloseReason::Expired);
        assert_eq!(at - start, Duration::from_secs(90));
    }

    #[test]
    fn resize_messages_are_controls_and_other_text_is_keystrokes() {
        assert_eq!(
            BrowserControl::parse(r#"{"type":"resize","cols":120,"rows":40}"#),
            Some(Ok(BrowserControl::Resize {
                cols: 120,
                rows: 40
            }))
        );
        for text in ["ls -l\r", "{\"resize\":1}", "", " {\"type\":\"resize\"}"] {
            assert_eq!(BrowserControl::parse(text), None, "{text:?}");
        }
        for text in [
            r#"{"type":"resize","cols":0,"rows":40}"#,
            r#"{"type":"resize","cols":80,"rows":1001}"#,
            r#"{"type":"resize","cols":80}"#,
            r#"{"type":"resize","cols":80,"rows":24,"x":1}"#,
            r#"{"type":"beep"}"#,
            r#"{"type":"#,
        ] {
            assert!(
                matches!(BrowserControl::parse(text), Some(Err(_))),
                "{text:?}"
            );
        }
    }

    #[test]
    fn status_messages_are_json_objects_of_a_type() {
        assert_eq!(
            ConsoleStatus::Connected.frame(),
            crate::Frame::Text(r#"{"type":"connected"}"#.to_owned())
        );
        assert_eq!(
            ConsoleStatus::Warned {
                leads: vec![300, 60]
            }
            .frame(),
            crate::Frame::Text(r#"{"type":"warned","leads":[300,60]}"#.to_owned())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_close_order_wins() {
        let (controller, mut controls) = controls(None);
        controller.close(CloseReason::Replaced);
        controller.close(CloseReason::Finished);
        assert_eq!(controls.pending(), Some(CloseReason::Replaced));
        assert_eq!(controls.until_close().await, CloseReason::Replaced);
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_controller_leaves_the_last_deadline_in_force() {
        let start = Instant::now();
        let (controller, mut controls) = controls(Some(start + Duration::from_secs(5)));
        drop(controller);
        assert_eq!(controls.until_close().await, CloseReason::Expired);
        assert_eq!(Instant::now() - start, Duration::from_secs(5));
    }
}
