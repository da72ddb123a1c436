//! The agent's HTTP server: std threads, one request per connection, a small concurrency
//! limit.
//!
//! Each accepted connection takes one of [`MAX_CONCURRENT_REQUESTS`] slots and gets its own
//! thread. Past the limit the connection gets 503 `busy` at once from a short-lived thread
//! (itself bounded; past that bound the connection is simply closed). The request must arrive
//! within [`REQUEST_TIMEOUT`]; that deadline covers the whole head and body, so a client
//! trickling bytes cannot hold a slot longer.
//!
//! The token file is re-read for every request: the agent may start before cloud-init wrote
//! the token (requests then get 503 `token_unavailable`, which a polling client retries), and
//! a replaced token takes effect without a restart. Reading a 64-byte file per request costs
//! nothing next to running a command.
//!
//! The file is also the only copy of the token the agent has: `POST /v1/token` writes the new
//! token to a temporary file in the same directory (mode 0600, fsynced) and renames it over
//! the token file, which is the swap. Every request read after the rename is checked against
//! the new token, a request already authenticated with the old one completes, and a
//! restarted agent reads the new one. Rotations and deadline writes hold one mutex, so two of
//! them never interleave; under it a rotation checks again that the token it was
//! authenticated with is still the current one.

use std::ffi::OsString;
use std::fs;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::http::{self, Conn, Head, ReadError, Response};
use crate::paths::AgentPaths;
use crate::protocol::{
    AgentToken, ConsoleSize, ExecRequest, MAX_CONCURRENT_REQUESTS, MAX_CONSOLE_DIMENSION,
    MAX_EXEC_TIMEOUT_MS, MAX_OUTPUT_BYTES, MAX_REQUEST_BODY_BYTES, PORT, PowerOffAt, ReadyResponse,
    RotateTokenRequest, TokenRotated, error_code,
};
use crate::{Error, runner, token};

/// Time allowed for a whole request (head and body) to arrive.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Time allowed for writing a response.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// After refusing a request that was not read in full, how long unread bytes are still
/// drained (so the client sees the answer rather than a reset) and how many at most.
const LINGER_TIME: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1024 * 1024;
/// Threads answering `busy` at once; connections beyond are closed unanswered.
const MAX_REFUSING: usize = 16;
/// Answered connections still draining unread bytes (they no longer hold a request slot);
/// beyond this they are closed at once.
const MAX_LINGERING: usize = 16;
/// Stack of a connection thread.
const CONNECTION_STACK: usize = 1024 * 1024;
/// Largest failure-marker text returned by `/v1/ready`.
const MAX_MARKER_BYTES: u64 = 4096;
/// Mode of the token file (only root reads it).
const TOKEN_MODE: u32 = 0o600;
/// Mode of the moved-deadline file.
const POWER_OFF_AT_MODE: u32 = 0o644;

/// How the agent is started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentConfig {
    /// Address to listen on (default `0.0.0.0:8899`).
    pub listen: SocketAddr,
    /// Token, markers and working directory.
    pub paths: AgentPaths,
}

impl AgentConfig {
    /// Parses the command line (without the program name):
    /// `[--root DIR] [--listen ADDR:PORT]`, also as `--root=DIR`, `--listen=ADDR:PORT`.
    /// `--help` is reported as [`Error::Usage`] too, with the usage text.
    pub fn from_args(args: impl IntoIterator<Item = OsString>) -> Result<Self, Error> {
        let usage =
            |why: String| Error::Usage(format!("{why}\nusage: {}", crate::protocol::CLI_USAGE));
        let mut root: Option<PathBuf> = None;
        let mut listen = SocketAddr::from(([0, 0, 0, 0], PORT));
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let text = arg.to_string_lossy().into_owned();
            let (flag, inline) = match text.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f.to_owned(), Some(OsString::from(v))),
                _ => (text.clone(), None),
            };
            let mut value = |name: &str| {
                inline
                    .clone()
                    .or_else(|| args.next())
                    .ok_or_else(|| usage(format!("{name} needs a value")))
            };
            match flag.as_str() {
                "--root" => {
                    let dir = PathBuf::from(value("--root")?);
                    if !dir.is_absolute() {
                        return Err(usage(format!(
                            "--root must be an absolute path, got {}",
                            dir.display()
                        )));
                    }
                    root = Some(dir);
                }
                "--listen" => {
                    let v = value("--listen")?;
                    let v = v.to_string_lossy();
                    listen = v
                        .parse()
                        .map_err(|_| usage(format!("--listen wants ADDR:PORT, got {v:?}")))?;
                }
                "-h" | "--help" => {
                    return Err(usage("ttlab-agent: the ttlab grading agent".into()));
                }
                other => return Err(usage(format!("unknown argument {other:?}"))),
            }
        }
        Ok(Self {
            listen,
            paths: AgentPaths::under(root.as_deref()),
        })
    }
}

/// A bound agent, ready to [`run`](Agent::run).
#[derive(Debug)]
pub struct Agent {
    listener: TcpListener,
    shared: Arc<Shared>,
}

/// What every connection thread shares.
#[derive(Debug)]
struct Shared {
    paths: AgentPaths,
    /// Held while the token or the deadline file is replaced, so two such writes never
    /// interleave.
    writes: Mutex<()>,
}

impl Agent {
    /// Binds the listening socket.
    pub fn bind(config: AgentConfig) -> Result<Self, Error> {
        let listener = TcpListener::bind(config.listen).map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
        Ok(Self {
            listener,
            shared: Arc::new(Shared {
                paths: config.paths,
                writes: Mutex::new(()),
            }),
        })
    }

    /// The address actually bound (with the real port when 0 was asked for).
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Serves for ever. Connection errors are logged to stderr and never stop the loop.
    pub fn run(self) -> ! {
        let active = Arc::new(AtomicUsize::new(0));
        let refusing = Arc::new(AtomicUsize::new(0));
        let lingering = Arc::new(AtomicUsize::new(0));
        loop {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Typically out of file descriptors: back off instead of spinning.
                    eprintln!("ttlab-agent: accept failed: {e}");
                    thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            match Slot::take(&active, MAX_CONCURRENT_REQUESTS) {
                Some(slot) => {
                    let shared = Arc::clone(&self.shared);
                    let lingering = Arc::clone(&lingering);
                    let spawned = thread::Builder::new()
                        .name("ttlab-agent-conn".into())
                        .stack_size(CONNECTION_STACK)
                        .spawn(move || serve_connection(stream, &shared, slot, &lingering));
                    if let Err(e) = spawned {
                        eprintln!("ttlab-agent: cannot start a connection thread: {e}");
                    }
                }
                None => {
                    let Some(slot) = Slot::take(&refusing, MAX_REFUSING) else {
                        continue; // dropping the stream closes it
                    };
                    let _ = thread::Builder::new()
                        .name("ttlab-agent-busy".into())
                        .stack_size(CONNECTION_STACK)
                        .spawn(move || {
                            let _slot = slot;
                            refuse_busy(stream);
                        });
                }
            }
        }
    }
}

/// One unit of a counted limit, released on drop.
struct Slot(Arc<AtomicUsize>);

impl Slot {
    fn take(counter: &Arc<AtomicUsize>, limit: usize) -> Option<Self> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < limit).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(Arc::clone(counter)))
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Answers 503 `busy` without reading the request.
fn refuse_busy(mut stream: TcpStream) {
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let response = Response::error(
        503,
        error_code::BUSY,
        format!("already serving {MAX_CONCURRENT_REQUESTS} requests; retry later"),
    );
    if response.write_to(&mut stream).is_ok() {
        linger(&mut stream);
    }
    eprintln!("ttlab-agent: {} refused: busy", peer(&stream));
}

/// Reads, answers and logs one request. The request slot is given back as soon as the answer
/// is written, so a client sending its next request at once does not find it still taken.
fn serve_connection(
    mut stream: TcpStream,
    shared: &Shared,
    slot: Slot,
    lingering: &Arc<AtomicUsize>,
) {
    let paths = &shared.paths;
    let started = Instant::now();
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let deadline = started + REQUEST_TIMEOUT;
    let (response, read_all, what) = match http::read_head(&mut stream, deadline) {
        Ok(head) => {
            let what = format!("{} {}", head.method, head.path);
            let (response, read_all) =
                handle(
                    &mut stream,
                    &head,
                    paths,
                    deadline,
                    |accepted| match accepted {
                        Accepted::Exec(request) => run_exec(request, paths),
                        Accepted::ConsoleSize(size) => set_console_size(size, paths),
                        Accepted::RotateToken { current, new } => {
                            rotate_token(current, new, paths, &shared.writes)
                        }
                        Accepted::Deadline(at) => set_deadline(at, paths, &shared.writes),
                    },
                );
            (Some(response), read_all, what)
        }
        Err(e) => (e.response(), false, describe_read_error(&e)),
    };
    let Some(response) = response else {
        return;
    };
    let written = response.write_to(&mut stream);
    drop(slot);
    eprintln!(
        "ttlab-agent: {} {what} -> {} ({} ms){}",
        peer(&stream),
        response.status,
        started.elapsed().as_millis(),
        written
            .as_ref()
            .err()
            .map(|e| format!(", answer not delivered: {e}"))
            .unwrap_or_default()
    );
    if written.is_ok()
        && !read_all
        && let Some(_linger_slot) = Slot::take(lingering, MAX_LINGERING)
    {
        linger(&mut stream);
    }
}

fn describe_read_error(e: &ReadError) -> String {
    match e {
        ReadError::Malformed(why) => format!("malformed request ({why})"),
        ReadError::HeadTooLarge => "oversized request head".into(),
        ReadError::TimedOut => "request timed out".into(),
        ReadError::Closed => "closed".into(),
        ReadError::Io(e) => format!("connection error ({e})"),
    }
}

/// A valid, authorized request that changes something in the guest.
enum Accepted<'a> {
    /// `POST /v1/exec`.
    Exec(&'a ExecRequest),
    /// `POST /v1/console-size`.
    ConsoleSize(&'a ConsoleSize),
    /// `POST /v1/token`: replace `current` (the token the request was authenticated with) by
    /// `new`.
    RotateToken {
        current: &'a AgentToken,
        new: &'a AgentToken,
    },
    /// `POST /v1/deadline`, within its bounds.
    Deadline(&'a PowerOffAt),
}

/// Answers one parsed request; also says whether the whole request was read. `run` answers a
/// valid, authorized request that changes something (the real agent runs the command, sets
/// the size, rotates the token or stores the deadline; the fuzz hook does none of these).
fn handle(
    conn: &mut impl Conn,
    head: &Head,
    paths: &AgentPaths,
    deadline: Instant,
    run: impl FnOnce(Accepted<'_>) -> Response,
) -> (Response, bool) {
    let no_body = head.content_length.unwrap_or(0) == 0
        && !head.transfer_encoding
        && head.early_body.is_empty();
    let Some(expected) = load_token(&paths.token) else {
        let message = "the agent token is not configured yet".to_owned();
        return (
            Response::error(503, error_code::TOKEN_UNAVAILABLE, message),
            no_body,
        );
    };
    let presented = head.authorization.as_deref().and_then(token::bearer);
    if !presented.is_some_and(|p| token::matches(&expected, p)) {
        let message = "missing or wrong bearer token".to_owned();
        return (
            Response::error(401, error_code::UNAUTHORIZED, message),
            no_body,
        );
    }
    let path = head
        .path
        .split_once('?')
        .map_or(head.path.as_str(), |(p, _)| p);
    match (path, head.method.as_str()) {
        ("/v1/ready", "GET") => (Response::ok(&ready(paths)), no_body),
        ("/v1/exec", "POST") => exec(conn, head, deadline, |r| run(Accepted::Exec(r))),
        ("/v1/console-size", "POST") => match read_json::<ConsoleSize>(conn, head, deadline) {
            Err(answer) => answer,
            Ok(size) if !size.is_valid() => {
                let message = format!(
                    "rows and cols must each be between 1 and {MAX_CONSOLE_DIMENSION}, got {} rows and {} cols",
                    size.rows, size.cols
                );
                (Response::error(400, error_code::BAD_REQUEST, message), true)
            }
            Ok(size) => (run(Accepted::ConsoleSize(&size)), true),
        },
        ("/v1/token", "POST") => match read_new_token(conn, head, deadline) {
            Err(answer) => answer,
            Ok(new) => (
                run(Accepted::RotateToken {
                    current: &expected,
                    new: &new,
                }),
                true,
            ),
        },
        ("/v1/deadline", "POST") => match read_json::<PowerOffAt>(conn, head, deadline) {
            Err(answer) => answer,
            Ok(at) => match at.check(unix_now()) {
                Err(message) => (Response::error(400, error_code::BAD_REQUEST, message), true),
                Ok(()) => (run(Accepted::Deadline(&at)), true),
            },
        },
        ("/v1/ready" | "/v1/exec" | "/v1/console-size" | "/v1/token" | "/v1/deadline", _) => {
            let message = format!("{} is not allowed on {path}", head.method);
            (
                Response::error(405, error_code::METHOD_NOT_ALLOWED, message),
                no_body,
            )
        }
        _ => (
            Response::error(404, error_code::NOT_FOUND, format!("no such path: {path}")),
            no_body,
        ),
    }
}

/// The agent's clock in Unix seconds (0 if it is before 1970).
fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Reads a `POST /v1/token` body and parses its token exactly as the token file is parsed.
/// Neither the answer nor the log ever repeats what was sent: a body that is not the
/// expected JSON is described by its position only.
fn read_new_token(
    conn: &mut impl Conn,
    head: &Head,
    deadline: Instant,
) -> Result<AgentToken, (Response, bool)> {
    let bad = |message: String| (Response::error(400, error_code::BAD_REQUEST, message), true);
    const EXPECTED: &str = r#"expected {"token": "<64 lowercase hex digits>"} and nothing else"#;
    let body = read_body_bytes(conn, head, deadline)?;
    // Only the object form (serde would also read a struct from a JSON array).
    if body.trim_ascii_start().first() != Some(&b'{') {
        return Err(bad(format!(
            "invalid token request: {EXPECTED} (the body is not a JSON object)"
        )));
    }
    let request: RotateTokenRequest = serde_json::from_slice(&body).map_err(|e| {
        bad(format!(
            "invalid token request: {EXPECTED} (JSON {} at line {} column {})",
            match e.classify() {
                serde_json::error::Category::Io | serde_json::error::Category::Eof => "cut short",
                serde_json::error::Category::Syntax => "syntax error",
                serde_json::error::Category::Data => "of the wrong shape",
            },
            e.line(),
            e.column()
        ))
    })?;
    AgentToken::parse(&request.token).ok_or_else(|| {
        bad(format!(
            "invalid token request: the token must be {} lowercase hex digits",
            AgentToken::BYTES * 2
        ))
    })
}

/// `POST /v1/token`: replaces the token file by one holding `new`, if the token is still
/// `current` (what the request was authenticated with). Answers 200 without writing when the
/// token already is `new`, 409 when a concurrent rotation replaced `current` by another
/// token, and 500 when the new file cannot be written (the old token stays valid and its file
/// untouched).
fn rotate_token(
    current: &AgentToken,
    new: &AgentToken,
    paths: &AgentPaths,
    writes: &Mutex<()>,
) -> Response {
    let _held = writes.lock().unwrap_or_else(PoisonError::into_inner);
    match load_token(&paths.token) {
        Some(stored) if token::matches(&stored, new.reveal().as_bytes()) => {
            return Response::ok(&TokenRotated { changed: false });
        }
        Some(stored) if token::matches(&stored, current.reveal().as_bytes()) => {}
        Some(_) => {
            return Response::error(
                409,
                error_code::CONFLICT,
                "another request rotated the token while this one waited; the token this request \
                 presented is no longer valid"
                    .into(),
            );
        }
        None => {
            return Response::error(
                503,
                error_code::TOKEN_UNAVAILABLE,
                "the token file became unreadable; nothing was changed".into(),
            );
        }
    }
    let content = format!("{}\n", new.reveal());
    match replace_file(&paths.token, content.as_bytes(), TOKEN_MODE) {
        Ok(()) => Response::ok(&TokenRotated { changed: true }),
        Err(e) => Response::error(
            500,
            error_code::INTERNAL,
            format!(
                "cannot store the new token in {}: {e}; the current token stays valid",
                paths.token.display()
            ),
        ),
    }
}

/// `POST /v1/deadline` (bounds already checked): stores the deadline for the power-off check.
fn set_deadline(at: &PowerOffAt, paths: &AgentPaths, writes: &Mutex<()>) -> Response {
    let _held = writes.lock().unwrap_or_else(PoisonError::into_inner);
    let content = format!("{}\n", at.power_off_at);
    match replace_file(&paths.power_off_at, content.as_bytes(), POWER_OFF_AT_MODE) {
        Ok(()) => Response::ok(at),
        Err(e) => Response::error(
            500,
            error_code::INTERNAL,
            format!(
                "cannot store the deadline in {}: {e}; the previous deadline stays in force",
                paths.power_off_at.display()
            ),
        ),
    }
}

/// Replaces `path` atomically by a file holding `content` with `mode`: written to
/// `.NAME.new` in the same directory (created exclusively, so never through a link left
/// there), fsynced, then renamed over `path`, and the directory fsynced. On any error before
/// the rename `path` is untouched and the temporary file removed. Callers hold the write
/// mutex, so the temporary name is theirs alone.
fn replace_file(path: &Path, content: &[u8], mode: u32) -> io::Result<()> {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::other("not a file path"));
    };
    let partial = dir.join(format!(".{}.new", name.to_string_lossy()));
    match fs::remove_file(&partial) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let written = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&partial)?;
        // The umask may have narrowed the mode given at creation.
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.write_all(content)?;
        file.sync_all()?;
        drop(file);
        fs::rename(&partial, path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&partial);
        return Err(e);
    }
    // The rename is done (and in force); only its durability across a power cut is at stake.
    if let Err(e) = fs::File::open(dir).and_then(|d| d.sync_all()) {
        eprintln!(
            "ttlab-agent: cannot fsync {} after replacing {}: {e}",
            dir.display(),
            path.display()
        );
    }
    Ok(())
}

/// The token in `path`, if the file exists and holds a valid token.
fn load_token(path: &Path) -> Option<AgentToken> {
    let mut text = String::new();
    fs::File::open(path)
        .ok()?
        .take(1024)
        .read_to_string(&mut text)
        .ok()?;
    AgentToken::parse(&text)
}

/// `GET /v1/ready`.
fn ready(paths: &AgentPaths) -> ReadyResponse {
    let failed = match fs::File::open(&paths.failed_marker) {
        Ok(f) => {
            let mut bytes = Vec::new();
            Some(match f.take(MAX_MARKER_BYTES).read_to_end(&mut bytes) {
                Ok(_) => String::from_utf8_lossy(&bytes).trim().to_owned(),
                Err(e) => format!("(failure marker unreadable: {e})"),
            })
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("(failure marker unreadable: {e})")),
    };
    ReadyResponse {
        ready: matches!(fs::exists(&paths.ready_marker), Ok(true)),
        failed,
    }
}

/// `POST /v1/exec`: reads and checks the body, then lets `run` answer it.
fn exec(
    conn: &mut impl Conn,
    head: &Head,
    deadline: Instant,
    run: impl FnOnce(&ExecRequest) -> Response,
) -> (Response, bool) {
    let request: ExecRequest = match read_json(conn, head, deadline) {
        Ok(r) => r,
        Err(answer) => return answer,
    };
    if request.timeout_ms == 0 || request.timeout_ms > MAX_EXEC_TIMEOUT_MS {
        let message = format!(
            "timeout_ms must be between 1 and {MAX_EXEC_TIMEOUT_MS}, got {}",
            request.timeout_ms
        );
        return (Response::error(400, error_code::BAD_REQUEST, message), true);
    }
    (run(&request), true)
}

/// Reads a JSON body with a `Content-Length` within the limit; otherwise the answer to give
/// (and whether the whole request was read).
fn read_json<T: serde::de::DeserializeOwned>(
    conn: &mut impl Conn,
    head: &Head,
    deadline: Instant,
) -> Result<T, (Response, bool)> {
    let body = read_body_bytes(conn, head, deadline)?;
    serde_json::from_slice(&body).map_err(|e| {
        let what = head.path.trim_start_matches("/v1/");
        (
            Response::error(
                400,
                error_code::BAD_REQUEST,
                format!("invalid {what} request: {e}"),
            ),
            true,
        )
    })
}

/// Reads a body with a `Content-Length` within the limit; otherwise the answer to give (and
/// whether the whole request was read).
fn read_body_bytes(
    conn: &mut impl Conn,
    head: &Head,
    deadline: Instant,
) -> Result<Vec<u8>, (Response, bool)> {
    let len = match (head.content_length, head.transfer_encoding) {
        (Some(len), false) => len,
        _ => {
            let message =
                "send the body with a Content-Length (chunked bodies are not accepted)".to_owned();
            return Err((
                Response::error(411, error_code::LENGTH_REQUIRED, message),
                false,
            ));
        }
    };
    let len = match usize::try_from(len) {
        Ok(len) if len <= MAX_REQUEST_BODY_BYTES => len,
        _ => {
            let message =
                format!("body of {len} bytes is over the {MAX_REQUEST_BODY_BYTES}-byte limit");
            return Err((Response::error(413, error_code::TOO_LARGE, message), false));
        }
    };
    let body = match http::read_body(conn, head, len, deadline) {
        Ok(body) => body,
        Err(e) => {
            let response = e.response().unwrap_or_else(|| {
                Response::error(
                    400,
                    error_code::BAD_REQUEST,
                    "the request body could not be read".into(),
                )
            });
            return Err((response, false));
        }
    };
    Ok(body)
}

/// Sets the serial console's window size: `TIOCSWINSZ` on the terminal device, which makes
/// the kernel send `SIGWINCH` to the programs in its foreground (the shell, `vim`, `top`).
/// Under `--root` (a simulated guest, no device) the size is written as `ROWS COLS` to the
/// console's path instead, where the simulated console reads it.
fn set_console_size(size: &ConsoleSize, paths: &AgentPaths) -> Response {
    match apply_console_size(size, paths) {
        Ok(()) => Response::ok(size),
        Err(e) => Response::error(
            500,
            error_code::INTERNAL,
            format!(
                "cannot set the size of the console {}: {e}",
                paths.console.display()
            ),
        ),
    }
}

fn apply_console_size(size: &ConsoleSize, paths: &AgentPaths) -> io::Result<()> {
    use rustix::fs::{Mode, OFlags};
    let opened = rustix::fs::open(
        &paths.console,
        OFlags::WRONLY | OFlags::NOCTTY | OFlags::NONBLOCK | OFlags::CLOEXEC,
        Mode::empty(),
    );
    match opened {
        Ok(fd) if rustix::termios::isatty(&fd) => {
            let winsize = rustix::termios::Winsize {
                ws_row: size.rows,
                ws_col: size.cols,
                ws_xpixel: 0,
                ws_ypixel: 0,
            };
            rustix::termios::tcsetwinsize(&fd, winsize).map_err(io::Error::from)
        }
        Ok(_) | Err(rustix::io::Errno::NOENT) if paths.simulated => {
            if let Some(dir) = paths.console.parent() {
                fs::create_dir_all(dir)?;
            }
            // Written whole and renamed, so a reader never sees half a size.
            let partial = paths.console.with_extension("size-partial");
            fs::write(&partial, format!("{} {}\n", size.rows, size.cols))?;
            fs::rename(&partial, &paths.console)
        }
        Ok(_) => Err(io::Error::other("it is not a terminal")),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// Runs a checked exec request's command.
fn run_exec(request: &ExecRequest, paths: &AgentPaths) -> Response {
    let timeout = Duration::from_millis(request.timeout_ms);
    match runner::run(&request.command, timeout, &paths.workdir, MAX_OUTPUT_BYTES) {
        Ok(result) => Response::ok(&result),
        Err(e) => Response::error(
            500,
            error_code::INTERNAL,
            format!("cannot run the command: {e}"),
        ),
    }
}

/// What [`answer_bytes`] made of one request.
#[doc(hidden)]
#[derive(Debug)]
pub struct Answered {
    /// The status and JSON body sent back (`None`: the connection is closed unanswered).
    pub response: Option<(u16, Vec<u8>)>,
    /// Whether the whole request was read (otherwise the agent lingers before closing).
    pub read_all: bool,
    /// How many bytes of the input the agent read.
    pub consumed: usize,
    /// The exec request that would have been run, if one was accepted.
    pub exec: Option<ExecRequest>,
    /// The console size that would have been set, if one was accepted.
    pub console_size: Option<ConsoleSize>,
    /// Whether a token rotation was accepted (it is not carried out).
    pub token_rotation: bool,
    /// The deadline that would have been stored, if one was accepted.
    pub power_off_at: Option<PowerOffAt>,
}

/// Reads one request from `input` (delivered in reads of at most `read_size` bytes) and answers
/// it exactly as a connection is answered, except that an accepted exec, console-size, token or
/// deadline request is not carried out (it is recorded, and answered 200 with an empty body).
/// For the fuzz targets and tests; not part of the agent's interface.
#[doc(hidden)]
pub fn answer_bytes(input: &[u8], read_size: usize, paths: &AgentPaths) -> Answered {
    let mut conn = Bytes {
        input,
        pos: 0,
        step: read_size.max(1),
    };
    let deadline = Instant::now() + REQUEST_TIMEOUT;
    let mut accepted = None;
    let mut console_size = None;
    let mut token_rotation = false;
    let mut power_off_at = None;
    let (response, read_all) = match http::read_head(&mut conn, deadline) {
        Ok(head) => {
            let (response, read_all) = handle(&mut conn, &head, paths, deadline, |request| {
                match request {
                    Accepted::Exec(r) => accepted = Some(r.clone()),
                    Accepted::ConsoleSize(s) => console_size = Some(*s),
                    Accepted::RotateToken { .. } => token_rotation = true,
                    Accepted::Deadline(at) => power_off_at = Some(*at),
                }
                Response {
                    status: 200,
                    body: b"{}".to_vec(),
                }
            });
            (Some(response), read_all)
        }
        Err(e) => (e.response(), false),
    };
    Answered {
        response: response.map(|r| (r.status, r.body)),
        read_all,
        consumed: conn.pos,
        exec: accepted,
        console_size,
        token_rotation,
        power_off_at,
    }
}

/// An in-memory connection over a byte slice (for [`answer_bytes`]).
struct Bytes<'a> {
    input: &'a [u8],
    pos: usize,
    step: usize,
}

impl Read for Bytes<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.step).min(self.input.len() - self.pos);
        buf[..n].copy_from_slice(&self.input[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

impl Write for Bytes<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Conn for Bytes<'_> {
    fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

/// After an answer to a request that was not read in full: stop writing, then read and drop
/// what the client still sends for a short while, so it sees the answer and not a reset.
fn linger(stream: &mut TcpStream) {
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Write);
    let end = Instant::now() + LINGER_TIME;
    let mut drained = 0;
    let mut sink = [0u8; 4096];
    while drained < LINGER_BYTES {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            break;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

fn peer(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(list: &[&str]) -> Result<AgentConfig, Error> {
        AgentConfig::from_args(list.iter().map(OsString::from))
    }

    #[test]
    fn defaults_to_all_interfaces_on_8899_with_real_paths() {
        let c = args(&[]).unwrap();
        assert_eq!(c.listen, "0.0.0.0:8899".parse().unwrap());
        assert_eq!(c.paths, AgentPaths::under(None));
    }

    #[test]
    fn root_and_listen_are_parsed_in_both_spellings() {
        let c = args(&["--root", "/tmp/r", "--listen=127.0.0.1:0"]).unwrap();
        assert_eq!(c.listen, "127.0.0.1:0".parse().unwrap());
        assert_eq!(c.paths, AgentPaths::under(Some(Path::new("/tmp/r"))));
        let c = args(&["--root=/tmp/r", "--listen", "[::1]:9"]).unwrap();
        assert_eq!(c.listen, "[::1]:9".parse().unwrap());
    }

    #[test]
    fn bad_arguments_are_usage_errors_naming_the_problem() {
        for (list, needle) in [
            (&["--root"][..], "--root needs a value"),
            (&["--root", "rel/dir"], "absolute"),
            (&["--listen", "localhost"], "ADDR:PORT"),
            (&["--verbose"], "unknown argument"),
        ] {
            match args(list) {
                Err(Error::Usage(text)) => {
                    assert!(text.contains(needle), "{text}");
                    assert!(text.contains(crate::protocol::CLI_USAGE), "{text}");
                }
                other => panic!("{list:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn ready_reports_markers() {
        let dir = tempfile::tempdir().unwrap();
        let paths = AgentPaths::under(Some(dir.path()));
        assert_eq!(
            ready(&paths),
            ReadyResponse {
                ready: false,
                failed: None
            }
        );
        fs::create_dir_all(paths.failed_marker.parent().unwrap()).unwrap();
        fs::write(&paths.failed_marker, "setup.sh exited 1\n").unwrap();
        assert_eq!(ready(&paths).failed.as_deref(), Some("setup.sh exited 1"));
        fs::write(&paths.ready_marker, "").unwrap();
        assert!(ready(&paths).ready);
    }
}
