//! Just enough HTTP/1.1 for the agent: one request per connection, read within limits and a
//! deadline, answered with a JSON body and `Connection: close`.
//!
//! Limits are enforced before the bytes are read: a head larger than
//! [`MAX_REQUEST_HEAD_BYTES`] or with more than [`MAX_REQUEST_HEADERS`] headers gets 431, a
//! `Content-Length` above the body limit gets 413 without the body being read, and bodies
//! without a `Content-Length` (chunked) get 411.

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use crate::protocol::{ErrorResponse, MAX_REQUEST_HEAD_BYTES, MAX_REQUEST_HEADERS, error_code};

/// A byte stream with a settable read timeout (a `TcpStream`, or a test double).
pub trait Conn: Read + Write {
    /// Sets how long one `read` may block.
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()>;
}

impl Conn for std::net::TcpStream {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        std::net::TcpStream::set_read_timeout(self, timeout)
    }
}

/// The parts of a request head the agent uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// Request method, as sent.
    pub method: String,
    /// Request target, as sent (query strings are not used by the agent).
    pub path: String,
    /// The `Authorization` header value, when exactly one was sent.
    pub authorization: Option<Vec<u8>>,
    /// The `Content-Length`, if any.
    pub content_length: Option<u64>,
    /// Whether a `Transfer-Encoding` header was sent.
    pub transfer_encoding: bool,
    /// Whether the client waits for `100 Continue` before sending the body.
    pub expect_continue: bool,
    /// Body bytes that arrived together with the head.
    pub early_body: Vec<u8>,
}

/// Why a request could not be read; every variant but the last two has an HTTP answer.
#[derive(Debug)]
pub enum ReadError {
    /// Malformed HTTP (400).
    Malformed(String),
    /// Head too large or too many headers (431).
    HeadTooLarge,
    /// The request did not arrive before the deadline (408).
    TimedOut,
    /// The peer closed the connection before sending a whole request (no answer).
    Closed,
    /// The connection failed (no answer).
    Io(io::Error),
}

impl ReadError {
    /// The answer to send, if any.
    pub fn response(&self) -> Option<Response> {
        match self {
            Self::Malformed(why) => Some(Response::error(
                400,
                error_code::BAD_REQUEST,
                format!("malformed request: {why}"),
            )),
            Self::HeadTooLarge => Some(Response::error(
                431,
                error_code::HEADERS_TOO_LARGE,
                format!(
                    "request head over {MAX_REQUEST_HEAD_BYTES} bytes or {MAX_REQUEST_HEADERS} headers"
                ),
            )),
            Self::TimedOut => Some(Response::error(
                408,
                error_code::TIMEOUT,
                "request not received in time".into(),
            )),
            Self::Closed | Self::Io(_) => None,
        }
    }
}

/// Reads one request head before `deadline`.
pub fn read_head(conn: &mut impl Conn, deadline: Instant) -> Result<Head, ReadError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        let room = MAX_REQUEST_HEAD_BYTES - buf.len();
        let want = room.min(chunk.len());
        if want == 0 {
            return Err(ReadError::HeadTooLarge);
        }
        let n = read_some(conn, &mut chunk[..want], deadline)?;
        if n == 0 {
            return Err(if buf.is_empty() {
                ReadError::Closed
            } else {
                ReadError::Malformed("connection closed mid-request".into())
            });
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(head) = parse_head(&buf)? {
            return Ok(head);
        }
    }
}

/// Parses a complete head at the start of `buf`, or `None` if more bytes are needed.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, ReadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_REQUEST_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => return Err(ReadError::HeadTooLarge),
        Err(e) => return Err(ReadError::Malformed(e.to_string())),
    };
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Err(ReadError::Malformed("incomplete request line".into()));
    };
    let mut authorization = None;
    let mut auth_count = 0;
    let mut content_length = None;
    let mut transfer_encoding = false;
    let mut expect_continue = false;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("authorization") {
            auth_count += 1;
            authorization = Some(h.value.to_vec());
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let value = std::str::from_utf8(h.value)
                .ok()
                .map(str::trim)
                .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|v| v.parse::<u64>().ok())
                .ok_or_else(|| ReadError::Malformed("invalid Content-Length".into()))?;
            if content_length.is_some_and(|prev| prev != value) {
                return Err(ReadError::Malformed(
                    "conflicting Content-Length headers".into(),
                ));
            }
            content_length = Some(value);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            transfer_encoding = true;
        } else if h.name.eq_ignore_ascii_case("expect") {
            expect_continue = h.value.trim_ascii().eq_ignore_ascii_case(b"100-continue");
        }
    }
    Ok(Some(Head {
        method: method.to_owned(),
        path: path.to_owned(),
        authorization: if auth_count == 1 { authorization } else { None },
        content_length,
        transfer_encoding,
        expect_continue,
        early_body: buf[len..].to_vec(),
    }))
}

/// Reads exactly `len` body bytes (some may have arrived with the head) before `deadline`,
/// first answering `100 Continue` if the client waits for it.
pub fn read_body(
    conn: &mut impl Conn,
    head: &Head,
    len: usize,
    deadline: Instant,
) -> Result<Vec<u8>, ReadError> {
    if head.expect_continue && head.early_body.is_empty() && len > 0 {
        conn.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .map_err(ReadError::Io)?;
    }
    let mut body = head.early_body.clone();
    if body.len() > len {
        // Bytes after the body: one request per connection, so a pipelined request is refused.
        return Err(ReadError::Malformed("data after the request body".into()));
    }
    body.resize(len, 0);
    let mut filled = head.early_body.len();
    while filled < len {
        let n = read_some(conn, &mut body[filled..], deadline)?;
        if n == 0 {
            return Err(ReadError::Malformed(
                "connection closed inside the body".into(),
            ));
        }
        filled += n;
    }
    Ok(body)
}

/// One `read`, bounded by the time left before `deadline`.
fn read_some(conn: &mut impl Conn, buf: &mut [u8], deadline: Instant) -> Result<usize, ReadError> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ReadError::TimedOut);
        }
        conn.set_read_timeout(Some(left)).map_err(ReadError::Io)?;
        match conn.read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(ReadError::TimedOut);
            }
            Err(e) => return Err(ReadError::Io(e)),
        }
    }
}

/// A response: a status and a JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// HTTP status code.
    pub status: u16,
    /// JSON body.
    pub body: Vec<u8>,
}

impl Response {
    /// 200 with `value` as JSON.
    pub fn ok(value: &impl serde::Serialize) -> Self {
        match serde_json::to_vec(value) {
            Ok(body) => Self { status: 200, body },
            Err(e) => Self::error(
                500,
                error_code::INTERNAL,
                format!("cannot encode the answer: {e}"),
            ),
        }
    }

    /// An error status with an [`ErrorResponse`] body.
    pub fn error(status: u16, code: &str, message: String) -> Self {
        let body = serde_json::to_vec(&ErrorResponse {
            error: code.to_owned(),
            message,
        })
        .unwrap_or_else(|_| b"{}".to_vec());
        Self { status, body }
    }

    /// Writes the response with `Connection: close`.
    pub fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        let head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            self.status,
            reason(self.status),
            self.body.len()
        );
        out.write_all(head.as_bytes())?;
        out.write_all(&self.body)?;
        out.flush()
    }
}

/// The reason phrase of the statuses the agent sends.
fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Internal Server Error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection that yields `input` in reads of at most `step` bytes.
    struct Script {
        input: Vec<u8>,
        pos: usize,
        step: usize,
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.step).min(self.input.len() - self.pos);
            buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
            self.pos += n;
            Ok(n)
        }
    }
    impl Write for Script {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    impl Conn for Script {
        fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
            Ok(())
        }
    }

    fn head_of(input: &[u8], step: usize) -> Result<Head, ReadError> {
        let mut conn = Script {
            input: input.to_vec(),
            pos: 0,
            step,
        };
        read_head(&mut conn, Instant::now() + Duration::from_secs(10))
    }

    #[test]
    fn a_request_split_into_single_bytes_parses() {
        let req =
            b"POST /v1/exec HTTP/1.1\r\nAuthorization: Bearer x\r\nContent-Length: 4\r\n\r\nbody";
        let mut conn = Script {
            input: req.to_vec(),
            pos: 0,
            step: 1,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        let head = read_head(&mut conn, deadline).unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/v1/exec");
        assert_eq!(head.authorization.as_deref(), Some(&b"Bearer x"[..]));
        assert_eq!(head.content_length, Some(4));
        let body = read_body(&mut conn, &head, 4, deadline).unwrap();
        assert_eq!(body, b"body");
    }

    #[test]
    fn garbage_is_malformed_and_silence_is_closed() {
        assert!(matches!(
            head_of(b"\x00\x01\x02garbage\r\n\r\n", 64),
            Err(ReadError::Malformed(_))
        ));
        assert!(matches!(head_of(b"", 64), Err(ReadError::Closed)));
        assert!(matches!(
            head_of(b"GET / HTTP/1.1\r\n", 64),
            Err(ReadError::Malformed(_))
        ));
    }

    #[test]
    fn oversized_heads_and_too_many_headers_are_refused() {
        let mut big = b"GET / HTTP/1.1\r\nX: ".to_vec();
        big.extend(std::iter::repeat_n(b'a', MAX_REQUEST_HEAD_BYTES * 4));
        assert!(matches!(head_of(&big, 4096), Err(ReadError::HeadTooLarge)));
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for i in 0..=MAX_REQUEST_HEADERS {
            many.extend(format!("X-{i}: 1\r\n").bytes());
        }
        many.extend(b"\r\n");
        assert!(matches!(head_of(&many, 4096), Err(ReadError::HeadTooLarge)));
    }

    #[test]
    fn bad_or_conflicting_content_length_is_malformed() {
        for req in [
            &b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n"[..],
            b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        ] {
            assert!(
                matches!(head_of(req, 64), Err(ReadError::Malformed(_))),
                "{}",
                String::from_utf8_lossy(req)
            );
        }
    }

    #[test]
    fn two_authorization_headers_count_as_none() {
        let head = head_of(
            b"GET / HTTP/1.1\r\nAuthorization: a\r\nAuthorization: b\r\n\r\n",
            64,
        )
        .unwrap();
        assert_eq!(head.authorization, None);
    }
}
