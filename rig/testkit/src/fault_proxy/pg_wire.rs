//! Just enough of PostgreSQL's wire protocol (version 3) for the fault proxy to lose the
//! answer to one chosen statement ([`FaultProxy::lose_answer_to`](super::FaultProxy::lose_answer_to)).
//!
//! Every request a client makes ends at a point the server answers with exactly one
//! `ReadyForQuery`: the startup message (answered once authentication is done), a `Sync`
//! (which ends an extended-protocol request: `Parse`/`Bind`/`Describe`/`Execute`…), a simple
//! `Query` and a `FunctionCall`. Counting those points on the client's side and the
//! `ReadyForQuery` messages on the server's, the answer to the client's n-th request is
//! everything the server sends after its (n-1)-th `ReadyForQuery`, up to and including its
//! n-th — whether or not the client pipelines requests.
//!
//! A statement is recognised by its text: the text of a simple `Query`, or for the extended
//! protocol the text its `Parse` gave the prepared statement a `Bind` names (a statement
//! prepared once and executed many times is matched at each execution, never at its
//! preparation, which changes nothing).
//!
//! A connection that negotiates TLS or GSS encryption (the server answered `S` or `G` to the
//! client's request) cannot be read any further and is left alone, as is one whose bytes a
//! fault mode dropped or whose messages do not parse.

use std::collections::HashMap;
use std::ops::Range;

/// The startup-phase request codes (in place of a protocol version).
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;
/// The major protocol version a startup message asks for.
const PROTOCOL_MAJOR: u32 = 3;
/// The longest startup-phase message PostgreSQL accepts: a longer length means the stream is
/// something else (an HTTP request's first bytes read as a length, say).
const MAX_STARTUP: usize = 10_000;

/// One complete unit of a byte stream: a message, or the single byte a server answers an
/// encryption request with.
#[derive(Debug, PartialEq, Eq)]
enum Event {
    /// A message: its type byte (0 for the client's untyped startup-phase messages), its body
    /// when its kind was asked to be kept, and the offset just past it in the chunk fed.
    Message {
        kind: u8,
        body: Option<Vec<u8>>,
        end: usize,
    },
    /// The server's one-byte answer to an encryption request (`S`, `G` or `N`).
    Answer { byte: u8, end: usize },
}

/// A message whose length field is impossible: the stream is not PostgreSQL's (or is
/// encrypted).
#[derive(Debug, PartialEq, Eq)]
struct Malformed;

/// Splits one direction of a connection into messages as its bytes come, in chunks of any
/// size.
#[derive(Debug, Default)]
struct Framer {
    /// The next message has no type byte (the client's startup phase).
    untyped: bool,
    /// One-byte answers expected before the next message (the server's, to encryption
    /// requests).
    answers_due: u32,
    /// The header read so far (type byte and length, or length alone).
    head: Vec<u8>,
    /// Inside a message: its kind, the body bytes still to come, and the body kept so far.
    current: Option<(u8, usize, Option<Vec<u8>>)>,
}

impl Framer {
    fn client() -> Self {
        Self {
            untyped: true,
            ..Self::default()
        }
    }

    fn server() -> Self {
        Self::default()
    }

    /// The complete messages in `chunk` (with what came before it), keeping the bodies of
    /// the kinds `keep` says (and of every untyped message: its code says whether typed
    /// messages follow).
    fn feed(&mut self, chunk: &[u8], keep: impl Fn(u8) -> bool) -> Result<Vec<Event>, Malformed> {
        let mut events = Vec::new();
        let mut i = 0;
        while i < chunk.len() {
            if let Some((kind, left, body)) = &mut self.current {
                let n = (*left).min(chunk.len() - i);
                if let Some(body) = body {
                    body.extend_from_slice(&chunk[i..i + n]);
                }
                *left -= n;
                i += n;
                if *left == 0 {
                    let (kind, body) = (*kind, body.take());
                    self.current = None;
                    events.push(self.complete(kind, body, i));
                }
                continue;
            }
            if self.head.is_empty() && self.answers_due > 0 {
                self.answers_due -= 1;
                events.push(Event::Answer {
                    byte: chunk[i],
                    end: i + 1,
                });
                i += 1;
                continue;
            }
            let head_len = if self.untyped { 4 } else { 5 };
            let n = (head_len - self.head.len()).min(chunk.len() - i);
            self.head.extend_from_slice(&chunk[i..i + n]);
            i += n;
            if self.head.len() < head_len {
                continue;
            }
            let kind = if self.untyped { 0 } else { self.head[0] };
            let len = &self.head[head_len - 4..];
            let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
            self.head.clear();
            let Some(left) = len
                .checked_sub(4)
                .filter(|_| kind != 0 || len <= MAX_STARTUP)
            else {
                return Err(Malformed);
            };
            let body = (kind == 0 || keep(kind)).then(Vec::new);
            if left == 0 {
                events.push(self.complete(kind, body, i));
            } else {
                self.current = Some((kind, left, body));
            }
        }
        Ok(events)
    }

    /// A message read whole: a startup message ends the untyped phase.
    fn complete(&mut self, kind: u8, body: Option<Vec<u8>>, end: usize) -> Event {
        if kind == 0 && startup_code(body.as_deref().unwrap_or_default()) >> 16 == PROTOCOL_MAJOR {
            self.untyped = false;
        }
        Event::Message { kind, body, end }
    }
}

/// The code of an untyped message: a protocol version, or a request's code.
fn startup_code(body: &[u8]) -> u32 {
    body.get(..4)
        .map_or(0, |c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]))
}

/// The NUL-terminated strings at the start of a message body.
fn strings(body: &[u8]) -> impl Iterator<Item = &[u8]> {
    body.split(|b| *b == 0)
}

/// What to do with a chunk the server sent.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Verdict {
    /// The parts of the chunk to forward to the client, in order.
    pub(super) forward: Vec<Range<usize>>,
    /// The answer to the chosen statement has been dropped whole: close the connection.
    pub(super) close: bool,
}

/// What the proxy follows of one connection.
#[derive(Debug)]
pub(super) struct Follower {
    client: Framer,
    server: Framer,
    /// Prepared statements' texts by name (the unnamed statement under the empty name).
    statements: HashMap<Vec<u8>, Vec<u8>>,
    /// Requests the client has ended (points the server answers with `ReadyForQuery`).
    requests: u64,
    /// `ReadyForQuery` messages the server has sent.
    answered: u64,
    /// The request whose answer is being lost.
    losing: Option<u64>,
    /// The connection is no longer followed; everything passes.
    off: bool,
}

impl Default for Follower {
    fn default() -> Self {
        Self {
            client: Framer::client(),
            server: Framer::server(),
            statements: HashMap::new(),
            requests: 0,
            answered: 0,
            losing: None,
            off: false,
        }
    }
}

impl Follower {
    /// Stops following the connection (bytes were dropped, or cannot be read): everything
    /// passes from now on.
    pub(super) fn give_up(&mut self) {
        self.off = true;
        self.losing = None;
    }

    /// Whether the connection is still followed.
    #[cfg(test)]
    pub(super) fn followed(&self) -> bool {
        !self.off
    }

    /// Reads what the client sends (before it is forwarded). `claim` is asked about the text
    /// of each statement executed; it answers true (once, for the one statement whose answer
    /// is to be lost) to make this connection lose that request's answer.
    pub(super) fn client_sent(&mut self, chunk: &[u8], claim: &mut dyn FnMut(&[u8]) -> bool) {
        if self.off {
            return;
        }
        let events = match self
            .client
            .feed(chunk, |kind| matches!(kind, b'P' | b'B' | b'Q'))
        {
            Ok(events) => events,
            Err(Malformed) => return self.give_up(),
        };
        for event in events {
            let Event::Message { kind, body, .. } = event else {
                continue;
            };
            let body = body.unwrap_or_default();
            match kind {
                0 => match startup_code(&body) {
                    SSL_REQUEST | GSSENC_REQUEST => self.server.answers_due += 1,
                    // The startup message: answered by a ReadyForQuery once the client is
                    // authenticated.
                    code if code >> 16 == PROTOCOL_MAJOR => self.requests += 1,
                    // A cancel request: the connection ends.
                    _ => {}
                },
                b'P' => {
                    let mut parts = strings(&body);
                    let name = parts.next().unwrap_or_default().to_vec();
                    let text = parts.next().unwrap_or_default().to_vec();
                    self.statements.insert(name, text);
                }
                b'B' => {
                    let statement = strings(&body).nth(1).unwrap_or_default();
                    if self.losing.is_none()
                        && let Some(text) = self.statements.get(statement)
                        && claim(text)
                    {
                        // Executed within the request the next Sync ends.
                        self.losing = Some(self.requests + 1);
                    }
                }
                b'Q' => {
                    let text = strings(&body).next().unwrap_or_default();
                    if self.losing.is_none() && claim(text) {
                        self.losing = Some(self.requests + 1);
                    }
                    self.requests += 1;
                }
                b'S' | b'F' => self.requests += 1,
                _ => {}
            }
        }
    }

    /// Reads what the server sends: which parts to forward, and whether the chosen answer is
    /// now lost whole (the connection is then to be closed; nothing after it is forwarded).
    pub(super) fn server_sent(&mut self, chunk: &[u8]) -> Verdict {
        let everything = Verdict {
            forward: std::iter::once(0..chunk.len()).collect(),
            close: false,
        };
        if self.off {
            return everything;
        }
        let events = match self.server.feed(chunk, |_| false) {
            Ok(events) => events,
            Err(Malformed) => {
                self.give_up();
                return everything;
            }
        };
        let mut forward = Vec::new();
        let mut start = 0;
        for event in events {
            match event {
                Event::Answer {
                    byte: b'S' | b'G', ..
                } => {
                    // Encrypted from here on: nothing more can be read.
                    self.give_up();
                    forward.push(start..chunk.len());
                    return Verdict {
                        forward,
                        close: false,
                    };
                }
                Event::Message {
                    kind: b'Z', end, ..
                } => {
                    let request = self.answered + 1;
                    self.answered = request;
                    if self.losing == Some(request) {
                        return Verdict {
                            forward,
                            close: true,
                        };
                    }
                    forward.push(start..end);
                    start = end;
                }
                Event::Answer { .. } | Event::Message { .. } => {}
            }
        }
        if self.losing != Some(self.answered + 1) && start < chunk.len() {
            forward.push(start..chunk.len());
        }
        Verdict {
            forward,
            close: false,
        }
    }
}

#[cfg(test)]
pub(super) mod wire {
    //! Protocol messages as a client and a server write them, for tests.

    /// A typed message.
    pub(crate) fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![kind];
        m.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    /// The client's startup message (protocol 3.0, `user`).
    pub(crate) fn startup(user: &str) -> Vec<u8> {
        let mut body = 196_608u32.to_be_bytes().to_vec();
        body.extend_from_slice(b"user\0");
        body.extend_from_slice(user.as_bytes());
        body.extend_from_slice(b"\0\0");
        let mut m = (body.len() as u32 + 4).to_be_bytes().to_vec();
        m.extend_from_slice(&body);
        m
    }

    /// The client's request for TLS.
    pub(crate) fn ssl_request() -> Vec<u8> {
        let mut m = 8u32.to_be_bytes().to_vec();
        m.extend_from_slice(&super::SSL_REQUEST.to_be_bytes());
        m
    }

    fn cstr(s: &str) -> Vec<u8> {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        b
    }

    /// `Parse` of `text` as statement `name`, with no parameter types.
    pub(crate) fn parse(name: &str, text: &str) -> Vec<u8> {
        let mut body = cstr(name);
        body.extend(cstr(text));
        body.extend_from_slice(&0u16.to_be_bytes());
        message(b'P', &body)
    }

    /// `Bind` of statement `name` to the unnamed portal, no parameters.
    pub(crate) fn bind(name: &str) -> Vec<u8> {
        let mut body = cstr("");
        body.extend(cstr(name));
        body.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        message(b'B', &body)
    }

    /// `Execute` of the unnamed portal.
    pub(crate) fn execute() -> Vec<u8> {
        let mut body = cstr("");
        body.extend_from_slice(&0u32.to_be_bytes());
        message(b'E', &body)
    }

    /// `Describe` of statement `name`.
    pub(crate) fn describe(name: &str) -> Vec<u8> {
        let mut body = vec![b'S'];
        body.extend(cstr(name));
        message(b'D', &body)
    }

    pub(crate) fn sync() -> Vec<u8> {
        message(b'S', &[])
    }

    /// A simple `Query`.
    pub(crate) fn query(text: &str) -> Vec<u8> {
        message(b'Q', &cstr(text))
    }

    /// `CommandComplete` with `tag`.
    pub(crate) fn complete(tag: &str) -> Vec<u8> {
        message(b'C', &cstr(tag))
    }

    /// `ReadyForQuery`, idle.
    pub(crate) fn ready() -> Vec<u8> {
        message(b'Z', b"I")
    }

    /// `AuthenticationOk`.
    pub(crate) fn auth_ok() -> Vec<u8> {
        message(b'R', &0u32.to_be_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::wire::*;
    use super::*;

    const TARGET: &str = "UPDATE sessions SET status = $2, ready_at = now()";

    /// A claim that takes the first text containing `ready_at`, once.
    fn once() -> impl FnMut(&[u8]) -> bool {
        let mut armed = true;
        move |text: &[u8]| {
            let hit = armed && text.windows(8).any(|w| w == b"ready_at");
            armed &= !hit;
            hit
        }
    }

    /// The bytes of `chunk` a verdict forwards.
    fn forwarded(chunk: &[u8], v: &Verdict) -> Vec<u8> {
        v.forward
            .iter()
            .flat_map(|r| chunk[r.clone()].iter().copied())
            .collect()
    }

    fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
        parts.concat()
    }

    /// A connection past its startup (authenticated, one ReadyForQuery seen).
    fn started(claim: &mut dyn FnMut(&[u8]) -> bool) -> Follower {
        let mut f = Follower::default();
        f.client_sent(&startup("ttlab"), claim);
        let hello = cat(&[auth_ok(), ready()]);
        let v = f.server_sent(&hello);
        assert_eq!(forwarded(&hello, &v), hello);
        assert!(!v.close);
        f
    }

    #[test]
    fn the_execution_of_a_prepared_statement_loses_its_answer_not_its_preparation() {
        let mut claim = once();
        let mut f = started(&mut claim);
        // Prepared (its own request): the answer passes.
        f.client_sent(
            &cat(&[parse("s0", TARGET), describe("s0"), sync()]),
            &mut claim,
        );
        let prepared = cat(&[message(b'1', &[]), message(b't', &[0, 0]), ready()]);
        let v = f.server_sent(&prepared);
        assert_eq!(forwarded(&prepared, &v), prepared);
        // Executed: the answer is dropped whole, then the connection is to close.
        f.client_sent(&cat(&[bind("s0"), execute(), sync()]), &mut claim);
        let answer = cat(&[message(b'2', &[]), complete("UPDATE 1"), ready()]);
        // Split anywhere: nothing of it passes until the end, then the close.
        let (a, b) = answer.split_at(7);
        let v = f.server_sent(a);
        assert!(forwarded(a, &v).is_empty() && !v.close, "{v:?}");
        let v = f.server_sent(b);
        assert!(forwarded(b, &v).is_empty(), "{v:?}");
        assert!(v.close);
    }

    #[test]
    fn answers_before_the_lost_one_pass_even_when_pipelined_in_one_chunk() {
        let mut claim = once();
        let mut f = started(&mut claim);
        f.client_sent(
            &cat(&[
                query("SELECT 1"),
                parse("", TARGET),
                bind(""),
                execute(),
                sync(),
            ]),
            &mut claim,
        );
        let first = cat(&[complete("SELECT 1"), ready()]);
        let lost = cat(&[message(b'1', &[]), message(b'2', &[]), complete("UPDATE 1")]);
        let chunk = cat(&[first.clone(), lost, ready()]);
        let v = f.server_sent(&chunk);
        assert_eq!(forwarded(&chunk, &v), first);
        assert!(v.close);
    }

    #[test]
    fn a_simple_query_matches_by_its_text_and_other_statements_pass() {
        let mut claim = once();
        let mut f = started(&mut claim);
        f.client_sent(&query("SELECT status FROM sessions"), &mut claim);
        let other = cat(&[complete("SELECT 0"), ready()]);
        let v = f.server_sent(&other);
        assert_eq!((forwarded(&other, &v), v.close), (other, false));
        f.client_sent(&query(TARGET), &mut claim);
        let answer = cat(&[complete("UPDATE 1"), ready()]);
        let v = f.server_sent(&answer);
        assert!(forwarded(&answer, &v).is_empty());
        assert!(v.close);
    }

    #[test]
    fn the_rule_is_taken_once_and_a_second_execution_passes() {
        let mut claim = once();
        assert!(claim(TARGET.as_bytes()));
        // Already taken (by another connection, say): this one loses nothing.
        let mut f = started(&mut claim);
        f.client_sent(
            &cat(&[parse("", TARGET), bind(""), execute(), sync()]),
            &mut claim,
        );
        let answer = cat(&[complete("UPDATE 1"), ready()]);
        let v = f.server_sent(&answer);
        assert_eq!((forwarded(&answer, &v), v.close), (answer, false));
    }

    #[test]
    fn a_refused_tls_request_is_followed_and_an_accepted_one_is_left_alone() {
        let mut claim = once();
        let mut f = Follower::default();
        f.client_sent(&ssl_request(), &mut claim);
        let v = f.server_sent(b"N");
        assert_eq!(v.forward, vec![0..1]);
        f.client_sent(&startup("ttlab"), &mut claim);
        let hello = cat(&[auth_ok(), ready()]);
        f.server_sent(&hello);
        f.client_sent(&query(TARGET), &mut claim);
        let answer = cat(&[complete("UPDATE 1"), ready()]);
        assert!(f.server_sent(&answer).close, "followed after the N");

        let mut claim = once();
        let mut f = Follower::default();
        f.client_sent(&ssl_request(), &mut claim);
        let tls = b"S\x16\x03\x01 encrypted bytes".to_vec();
        let v = f.server_sent(&tls);
        assert_eq!((forwarded(&tls, &v), v.close), (tls, false));
        assert!(!f.followed());
        f.client_sent(b"\x16\x03\x01 encrypted ready_at", &mut claim);
        let v = f.server_sent(b"anything");
        assert_eq!(v.forward, vec![0..8]);
    }

    #[test]
    fn an_impossible_length_stops_the_following_and_everything_passes() {
        let mut claim = once();
        let mut f = started(&mut claim);
        f.client_sent(&[b'Q', 0, 0, 0, 2], &mut claim);
        assert!(!f.followed());
        f.client_sent(&query(TARGET), &mut claim);
        let answer = cat(&[complete("UPDATE 1"), ready()]);
        let v = f.server_sent(&answer);
        assert_eq!((forwarded(&answer, &v), v.close), (answer, false));
    }

    #[test]
    fn a_stream_that_is_not_postgresql_passes_untouched() {
        let mut claim = once();
        let mut f = Follower::default();
        f.client_sent(
            b"GET /api/v1/namespaces HTTP/1.1\r\nHost: x\r\n\r\n",
            &mut claim,
        );
        assert!(!f.followed(), "an HTTP request is no startup message");
        let reply = b"HTTP/1.1 200 OK\r\n\r\nready_at".to_vec();
        let v = f.server_sent(&reply);
        assert_eq!((forwarded(&reply, &v), v.close), (reply, false));
    }

    #[test]
    fn messages_split_byte_by_byte_frame_as_whole_ones() {
        let mut framer = Framer::client();
        let bytes = cat(&[startup("u"), parse("s", "SELECT 1"), sync()]);
        let mut events = Vec::new();
        for b in &bytes {
            events.extend(framer.feed(std::slice::from_ref(b), |k| k == b'P').unwrap());
        }
        let kinds: Vec<_> = events
            .iter()
            .map(|e| match e {
                Event::Message { kind, body, .. } => (*kind, body.clone()),
                Event::Answer { .. } => panic!("no answers on this side"),
            })
            .collect();
        assert_eq!(kinds.len(), 3, "{kinds:?}");
        assert_eq!(kinds[0].0, 0);
        assert_eq!(kinds[1].0, b'P');
        assert_eq!(kinds[1].1.as_deref(), Some(&b"s\0SELECT 1\0\0\0"[..]));
        assert_eq!(kinds[2], (b'S', None));
    }
}
