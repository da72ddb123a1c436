//! Where ttlab may write its own lines into a terminal's output stream: only between whole
//! characters and outside every escape sequence.
//!
//! A console's output is a byte stream a terminal parses: UTF-8 characters, C0 controls and
//! escape sequences (`ESC [ … final` CSI, `ESC ] … BEL|ST` OSC, DCS, SOS/PM/APC strings, and
//! two- or three-byte `ESC` sequences), split anywhere across reads. A line inserted inside
//! one of them would be eaten as a parameter or string byte, or turn half a sequence into
//! garbage on the screen. [`Boundary`] follows the terminal's parser state (the VT500 parser's
//! ground, escape, CSI and string states, simplified to what matters for insertion: it never
//! needs to know what a sequence means), and [`Inserter`] holds a line back until the stream
//! is at such a boundary, then puts it exactly there.

use bytes::{Bytes, BytesMut};

/// The parser state of the terminal reading the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum State {
    /// Between characters and sequences: safe.
    #[default]
    Ground,
    /// Inside a UTF-8 character, this many continuation bytes still to come.
    Utf8(u8),
    /// After `ESC`.
    Escape,
    /// After `ESC` and intermediate bytes (`ESC ( B`).
    EscapeIntermediate,
    /// In a control sequence (`ESC [`), until its final byte.
    Csi,
    /// In a string (OSC, DCS, SOS, PM, APC), until BEL or ST.
    String,
    /// In a string, after `ESC` (the start of ST, `ESC \`).
    StringEscape,
}

/// Follows a terminal output stream and says whether it is at a boundary where a line may be
/// inserted.
#[derive(Debug, Clone, Default)]
pub struct Boundary {
    state: State,
}

const ESC: u8 = 0x1b;
const BEL: u8 = 0x07;
const CAN: u8 = 0x18;
const SUB: u8 = 0x1a;

impl Boundary {
    /// A stream at its start (a boundary).
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether the bytes seen so far end at a boundary: outside every escape sequence and
    /// string, and not inside a UTF-8 character.
    pub fn is_safe(&self) -> bool {
        self.state == State::Ground
    }

    /// Follows `bytes`.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.step(b);
        }
    }

    /// Follows `bytes` up to the first boundary within them and returns its offset `k`
    /// (`1..=bytes.len()`: after `bytes[..k]` the stream is at a boundary), having followed
    /// only `bytes[..k]`. `None` (having followed all of `bytes`) if there is none. A stream
    /// already at a boundary answers `Some(0)`.
    pub fn first_safe(&mut self, bytes: &[u8]) -> Option<usize> {
        if self.is_safe() {
            return Some(0);
        }
        for (i, &b) in bytes.iter().enumerate() {
            self.step(b);
            if self.is_safe() {
                return Some(i + 1);
            }
        }
        None
    }

    fn step(&mut self, b: u8) {
        use State::*;
        self.state = match (self.state, b) {
            // CAN and SUB abort any sequence; ESC starts a new one anywhere but in a string.
            (String, ESC) => StringEscape,
            (_, CAN | SUB) => Ground,
            (_, ESC) => Escape,
            (Ground, 0xc0..=0xdf) => Utf8(1),
            (Ground, 0xe0..=0xef) => Utf8(2),
            (Ground, 0xf0..=0xf7) => Utf8(3),
            (Ground, _) => Ground,
            (Utf8(n), 0x80..=0xbf) => {
                if n > 1 {
                    Utf8(n - 1)
                } else {
                    Ground
                }
            }
            // A broken character: the terminal shows a replacement and reads `b` afresh.
            (Utf8(_), _) => {
                self.state = Ground;
                return self.step(b);
            }
            (Escape, b'[') => Csi,
            (Escape, b']' | b'P' | b'X' | b'^' | b'_') => String,
            (Escape, 0x20..=0x2f) => EscapeIntermediate,
            (Escape, 0x30..=0x7e) => Ground,
            // C0 controls are executed inside sequences without ending them.
            (Escape, _) => Escape,
            (EscapeIntermediate, 0x20..=0x2f) => EscapeIntermediate,
            (EscapeIntermediate, 0x30..=0x7e) => Ground,
            (EscapeIntermediate, _) => EscapeIntermediate,
            (Csi, 0x40..=0x7e) => Ground,
            (Csi, _) => Csi,
            (String, BEL) => Ground,
            (String, _) => String,
            (StringEscape, b'\\') => Ground,
            // ESC inside a string ends it and starts a new sequence with this byte.
            (StringEscape, _) => {
                self.state = Escape;
                return self.step(b);
            }
        };
    }
}

/// Inserts whole lines into a terminal output stream, each at the first [`Boundary`] at or
/// after the moment it was asked for.
#[derive(Debug, Default)]
pub struct Inserter {
    boundary: Boundary,
    pending: Vec<Bytes>,
}

impl Inserter {
    /// An inserter for a stream at its start.
    pub fn new() -> Self {
        Self::default()
    }

    /// Asks for `line` (a complete piece of terminal output that itself ends at a boundary,
    /// such as [`notice`](crate::notice)) to be inserted. Returns it when the stream is at a
    /// boundary now (send it at once); otherwise it waits for [`Inserter::output`].
    pub fn insert(&mut self, line: Bytes) -> Option<Bytes> {
        if self.pending.is_empty() && self.boundary.is_safe() {
            Some(line)
        } else {
            self.pending.push(line);
            None
        }
    }

    /// Whether a line is waiting for a boundary.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The next piece of the console's output, with any waiting lines inserted at its first
    /// boundary: what to send in its place.
    pub fn output(&mut self, chunk: Bytes) -> Bytes {
        if self.pending.is_empty() {
            self.boundary.feed(&chunk);
            return chunk;
        }
        let Some(at) = self.boundary.first_safe(&chunk) else {
            return chunk;
        };
        let lines: usize = self.pending.iter().map(Bytes::len).sum();
        let mut out = BytesMut::with_capacity(chunk.len() + lines);
        out.extend_from_slice(&chunk[..at]);
        for line in self.pending.drain(..) {
            out.extend_from_slice(&line);
        }
        out.extend_from_slice(&chunk[at..]);
        self.boundary.feed(&chunk[at..]);
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn safe_after(bytes: &[u8]) -> bool {
        let mut b = Boundary::new();
        b.feed(bytes);
        b.is_safe()
    }

    #[test]
    fn sequences_and_characters_are_not_boundaries_until_they_end() {
        for (bytes, safe) in [
            (&b"plain text"[..], true),
            (b"\x1b", false),
            (b"\x1b[", false),
            (b"\x1b[1;3", false),
            (b"\x1b[1;33m", true),
            (b"\x1b[?1049h", true),
            (b"\x1b]0;title", false),
            (b"\x1b]0;title\x07", true),
            (b"\x1b]0;title\x1b", false),
            (b"\x1b]0;title\x1b\\", true),
            (b"\x1bP1$r", false),
            (b"\x1bP1$r\x1b\\", true),
            (b"\x1b(", false),
            (b"\x1b(B", true),
            (b"\x1b7", true),
            (b"\x1b[1;2\x18", true),
            ("é".as_bytes(), true),
            (&"é".as_bytes()[..1], false),
            (&"€".as_bytes()[..2], false),
            (&"🙂".as_bytes()[..3], false),
            (b"\xc3x", true),
            (b"\r\n", true),
        ] {
            assert_eq!(safe_after(bytes), safe, "{bytes:?}");
        }
    }

    #[test]
    fn a_line_waits_for_the_end_of_a_split_sequence() {
        let mut ins = Inserter::new();
        assert_eq!(
            ins.output(Bytes::from_static(b"ab\x1b[3")),
            &b"ab\x1b[3"[..]
        );
        assert_eq!(ins.insert(Bytes::from_static(b"<L>")), None);
        assert!(ins.has_pending());
        assert_eq!(ins.output(Bytes::from_static(b"1")), &b"1"[..]);
        assert_eq!(ins.output(Bytes::from_static(b"mcd")), &b"m<L>cd"[..]);
        assert!(!ins.has_pending());
        assert_eq!(
            ins.insert(Bytes::from_static(b"<M>")),
            Some(Bytes::from_static(b"<M>"))
        );
    }
}
