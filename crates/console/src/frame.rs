//! WebSocket messages on the browser side, independent of any WebSocket library.

use bytes::Bytes;

/// One WebSocket message between the relay and the browser.
///
/// The server maps its WebSocket library's message type onto this one and back, so the relay
/// can be driven by in-memory channels in tests exactly as by a real socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// Terminal bytes: keystrokes from the browser, console output to it.
    Binary(Bytes),
    /// Text. From the browser it is taken as its UTF-8 bytes (see [`crate::relay`]); the relay
    /// sends text only for its status messages ([`crate::ConsoleStatus`]).
    Text(String),
    /// A ping (the relay's keepalive towards the browser).
    Ping(Bytes),
    /// A pong (the browser's answer to a ping).
    Pong(Bytes),
    /// The closing handshake, with a code and a reason when there is one.
    Close(Option<CloseFrame>),
}

/// The code and reason of a WebSocket Close frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseFrame {
    /// The close code (RFC 6455 section 7.4; 4000-4999 are ttlab's, see
    /// [`CloseReason::code`](crate::CloseReason::code)).
    pub code: u16,
    /// A short reason, at most [`MAX_CLOSE_REASON`] bytes of UTF-8.
    pub reason: String,
}

/// The longest reason a Close frame may carry (125 bytes of payload minus the 2-byte code).
pub const MAX_CLOSE_REASON: usize = 123;

impl CloseFrame {
    /// A close frame whose reason is cut (at a character boundary, with an ellipsis) to fit
    /// [`MAX_CLOSE_REASON`].
    pub fn new(code: u16, reason: &str) -> Self {
        Self {
            code,
            reason: truncate(reason, MAX_CLOSE_REASON),
        }
    }
}

fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let ellipsis = "…";
    let mut end = max - ellipsis.len();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_reasons_are_cut_to_fit_a_close_frame_at_a_character_boundary() {
        let long = "é".repeat(100);
        let frame = CloseFrame::new(4001, &long);
        assert!(
            frame.reason.len() <= MAX_CLOSE_REASON,
            "{}",
            frame.reason.len()
        );
        assert!(frame.reason.ends_with('…'));
        assert_eq!(CloseFrame::new(1000, "short").reason, "short");
    }
}
