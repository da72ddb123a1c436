//! A TCP proxy that misbehaves on command, for tests of what a process does when the network
//! under one of its connections goes bad the dirty way.
//!
//! [`FaultProxy`] listens on a loopback port and forwards every connection to an upstream (a
//! TCP address or a unix socket, such as a throwaway PostgreSQL's). [`FaultProxy::set_mode`]
//! switches every connection, open or future, between:
//!
//! - [`FaultMode::Pass`]: bytes flow both ways;
//! - [`FaultMode::Blackhole`]: bytes are read and dropped in both directions, and neither
//!   socket is closed — what a peer sees of a half-open connection (its node vanished, a
//!   firewall dropped the flow): no reply, no RST, no FIN, and its kernel still acknowledges;
//! - [`FaultMode::Stall`]: bytes are held (not read any further) until the mode changes; back
//!   to `Pass` they flow on, nothing lost;
//! - [`FaultMode::LoseReplies`]: what the client sends still reaches the upstream (the
//!   change is applied), but the upstream's replies are read and dropped: the client learns
//!   nothing of the outcome. End it with [`FaultMode::Close`] (or [`FaultProxy::cut_open`]):
//!   the connection's byte stream is no longer whole;
//! - [`FaultMode::Close`]: every connection is shut down at once, and new ones are closed on
//!   arrival (a peer that is gone and says so).
//!
//! [`FaultProxy::cut_open`] shuts down the connections open now and leaves the mode as it is:
//! after a blackhole, the stale connections end (the peer's RST once the path is back) while
//! new ones pass.
//!
//! In front of PostgreSQL, one statement can be aimed at: [`FaultProxy::lose_answer_to`]
//! loses the answer to the next execution of a statement whose text contains a given string,
//! on whichever connection runs it, while everything else passes. The statement reaches
//! PostgreSQL and runs; the proxy holds back PostgreSQL's whole answer to that request
//! (through the `ReadyForQuery` that ends it, so the change is committed), drops it, and
//! closes that connection. The client learns nothing of the outcome and sees its connection
//! break, as when the network fails after a request went through: what a retry of a
//! non-idempotent step meets (the row already changed). Closing, rather than leaving the
//! connection silent, spares the test the client's call timeout; the client's view is the
//! same (no answer, a connection to give up). The proxy follows the protocol of plain-text
//! connections only (see `pg_wire`); one that negotiates TLS is passed untouched.
//!
//! Threads, not a runtime: it works the same under any test, async or not, and never competes
//! with the code under test for its executor.
//!
//! ```
//! use std::io::{Read, Write};
//! use ttlab_testkit::fault_proxy::{FaultMode, FaultProxy, Upstream};
//!
//! let echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
//! let upstream = Upstream::Tcp(echo.local_addr().unwrap());
//! std::thread::spawn(move || {
//!     for mut c in echo.incoming().flatten() {
//!         std::thread::spawn(move || {
//!             let mut b = [0u8; 64];
//!             while let Ok(n @ 1..) = c.read(&mut b) {
//!                 let _ = c.write_all(&b[..n]);
//!             }
//!         });
//!     }
//! });
//! let proxy = FaultProxy::start(upstream).unwrap();
//! let mut c = std::net::TcpStream::connect(proxy.addr()).unwrap();
//! c.write_all(b"ping").unwrap();
//! let mut b = [0u8; 4];
//! c.read_exact(&mut b).unwrap();
//! assert_eq!(&b, b"ping");
//!
//! proxy.set_mode(FaultMode::Blackhole);
//! c.write_all(b"lost").unwrap(); // accepted, never answered, never closed
//! c.set_read_timeout(Some(std::time::Duration::from_millis(200))).unwrap();
//! assert!(c.read(&mut b).is_err(), "a blackhole answers nothing");
//! ```

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

mod pg_wire;

use pg_wire::Follower;

/// Where the proxy forwards to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A unix socket path (for PostgreSQL: `<dir>/.s.PGSQL.<port>`).
    Unix(PathBuf),
}

/// What the proxy does with the bytes of every connection (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultMode {
    /// Forward both ways.
    Pass,
    /// Read and drop both ways; close nothing.
    Blackhole,
    /// Hold everything until the mode changes.
    Stall,
    /// Forward what the client sends; read and drop what the upstream answers.
    LoseReplies,
    /// Shut every connection down; close new ones on arrival.
    Close,
}

/// One side of a proxied connection.
enum Conn {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Conn {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(match self {
            Self::Tcp(s) => Self::Tcp(s.try_clone()?),
            Self::Unix(s) => Self::Unix(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        let _ = match self {
            Self::Tcp(s) => s.shutdown(how),
            Self::Unix(s) => s.shutdown(how),
        };
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.read(buf),
            Self::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Tcp(s) => s.write(buf),
            Self::Unix(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Tcp(s) => s.flush(),
            Self::Unix(s) => s.flush(),
        }
    }
}

struct Shared {
    mode: Mutex<FaultMode>,
    changed: Condvar,
    /// Both sides of every open connection (by connection number), to shut them down on
    /// `Close`, [`FaultProxy::cut_open`] and drop; removed when both directions ended.
    open: Mutex<Vec<(u64, Conn)>>,
    stopped: AtomicBool,
    accepted: AtomicU64,
    /// The text of the statement whose next answer is to be lost, until a connection takes it.
    lose_answer: Mutex<Option<String>>,
    /// Answers lost by [`FaultProxy::lose_answer_to`] so far.
    answers_lost: AtomicU64,
}

impl Shared {
    fn mode(&self) -> FaultMode {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the statement rule if `text` is the statement it aims at.
    fn claim(&self, text: &[u8]) -> bool {
        let mut rule = self.lose_answer.lock().unwrap_or_else(|p| p.into_inner());
        let hit = rule.as_deref().is_some_and(|needle| {
            let needle = needle.as_bytes();
            needle.is_empty() || text.windows(needle.len()).any(|w| w == needle)
        });
        if hit {
            *rule = None;
        }
        hit
    }

    fn close_all(&self) {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        for (_, c) in open.drain(..) {
            c.shutdown(Shutdown::Both);
        }
    }
}

/// A misbehaving-on-command TCP proxy on a loopback port (see the module doc). Dropping it
/// closes every connection and stops it.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("mode", &self.shared.mode())
            .finish()
    }
}

impl FaultProxy {
    /// Listens on `127.0.0.1` (a free port) and forwards to `upstream`, in [`FaultMode::Pass`].
    pub fn start(upstream: Upstream) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            mode: Mutex::new(FaultMode::Pass),
            changed: Condvar::new(),
            open: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
            accepted: AtomicU64::new(0),
            lose_answer: Mutex::new(None),
            answers_lost: AtomicU64::new(0),
        });
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("fault-proxy".into())
            .spawn(move || accept_loop(&listener, &upstream, &sh))?;
        Ok(Self { addr, shared })
    }

    /// The loopback address to connect to instead of the upstream.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many connections the proxy has accepted so far.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// The current mode.
    pub fn mode(&self) -> FaultMode {
        self.shared.mode()
    }

    /// Shuts down every connection open now (both sides); the mode stays, and connections
    /// made from now on follow it.
    pub fn cut_open(&self) {
        self.shared.close_all();
    }

    /// Loses the answer to the next execution of a PostgreSQL statement whose text contains
    /// `statement` (any statement if it is empty), on whichever connection runs it first; a
    /// second call before that replaces the aim. The statement runs and its whole answer is
    /// dropped, then that connection is closed (see the module doc). Only connections in
    /// [`FaultMode::Pass`], in plain text, are followed.
    pub fn lose_answer_to(&self, statement: &str) {
        *self
            .shared
            .lose_answer
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(statement.to_owned());
    }

    /// How many answers [`FaultProxy::lose_answer_to`] has lost so far (an answer counts
    /// once it was dropped whole and its connection closed).
    pub fn answers_lost(&self) -> u64 {
        self.shared.answers_lost.load(Ordering::SeqCst)
    }

    /// Switches every connection, open and future, to `mode`.
    pub fn set_mode(&self, mode: FaultMode) {
        *self.shared.mode.lock().unwrap_or_else(|p| p.into_inner()) = mode;
        self.shared.changed.notify_all();
        if mode == FaultMode::Close {
            self.shared.close_all();
        }
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.set_mode(FaultMode::Close);
        // Wakes the accept loop so it sees `stopped`.
        let _ = TcpStream::connect(self.addr);
    }
}

fn accept_loop(listener: &TcpListener, upstream: &Upstream, shared: &Arc<Shared>) {
    for client in listener.incoming() {
        if shared.stopped.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = client else { continue };
        let id = shared.accepted.fetch_add(1, Ordering::SeqCst);
        if shared.mode() == FaultMode::Close {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        let server = match upstream {
            Upstream::Tcp(a) => TcpStream::connect(a).map(Conn::Tcp),
            Upstream::Unix(p) => UnixStream::connect(p).map(Conn::Unix),
        };
        let Ok(server) = server else {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        };
        let _ = client.set_nodelay(true);
        let client = Conn::Tcp(client);
        let clones = (|| {
            Ok::<_, io::Error>((
                client.try_clone()?,
                client.try_clone()?,
                server.try_clone()?,
                server.try_clone()?,
            ))
        })();
        let Ok((client_w, client_keep, server_w, server_keep)) = clones else {
            continue;
        };
        shared
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend([(id, client_keep), (id, server_keep)]);
        // The second direction to end forgets the connection (its sockets close with it).
        let ended = Arc::new(AtomicU64::new(0));
        let follower = Arc::new(Mutex::new(Follower::default()));
        for (from, to, upstream_bound) in [(client, server_w, true), (server, client_w, false)] {
            let sh = shared.clone();
            let ended = ended.clone();
            let follower = follower.clone();
            let _ = std::thread::Builder::new()
                .name("fault-proxy-pump".into())
                .spawn(move || {
                    pump(from, to, upstream_bound, &sh, &follower);
                    if ended.fetch_add(1, Ordering::SeqCst) == 1 {
                        sh.open
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .retain(|(c, _)| *c != id);
                    }
                });
        }
    }
}

/// Moves bytes from `from` to `to` as the mode says, until either side ends. `upstream_bound`:
/// `from` is the client (the direction [`FaultMode::LoseReplies`] still forwards). In
/// [`FaultMode::Pass`], `follower` reads the connection's protocol for the statement rule.
fn pump(
    mut from: Conn,
    mut to: Conn,
    upstream_bound: bool,
    shared: &Shared,
    follower: &Mutex<Follower>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // Stalled: read nothing more until the mode changes.
        {
            let mut mode = shared.mode.lock().unwrap_or_else(|p| p.into_inner());
            while *mode == FaultMode::Stall {
                mode = shared.changed.wait(mode).unwrap_or_else(|p| p.into_inner());
            }
            if *mode == FaultMode::Close {
                return;
            }
        }
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => {
                to.shutdown(Shutdown::Write);
                return;
            }
            Ok(n) => n,
        };
        // What was read while stalled waits for the mode to change too.
        let mode = {
            let mut mode = shared.mode.lock().unwrap_or_else(|p| p.into_inner());
            while *mode == FaultMode::Stall {
                mode = shared.changed.wait(mode).unwrap_or_else(|p| p.into_inner());
            }
            *mode
        };
        let forward = match mode {
            FaultMode::Pass => true,
            FaultMode::LoseReplies => upstream_bound,
            // (Stall was waited out above.)
            FaultMode::Blackhole | FaultMode::Stall => false,
            FaultMode::Close => return,
        };
        // What the protocol says, decided before anything is written (and without holding
        // the follower while writing: the other direction needs it to make progress).
        let (parts, close) = {
            let mut follower = follower.lock().unwrap_or_else(|p| p.into_inner());
            if mode != FaultMode::Pass {
                // Bytes may be dropped: the protocol cannot be followed any more.
                follower.give_up();
            }
            if !forward {
                continue;
            }
            if upstream_bound {
                // Read before forwarding, so the answer to lose is known before it can come.
                follower.client_sent(&buf[..n], &mut |text| shared.claim(text));
                (std::iter::once(0..n).collect(), false)
            } else {
                let verdict = follower.server_sent(&buf[..n]);
                (verdict.forward, verdict.close)
            }
        };
        let written = parts
            .iter()
            .try_for_each(|part| to.write_all(&buf[part.clone()]));
        if close {
            // The answer was dropped whole: the connection breaks.
            shared.answers_lost.fetch_add(1, Ordering::SeqCst);
            to.shutdown(Shutdown::Both);
            from.shutdown(Shutdown::Both);
            return;
        }
        if written.is_err() {
            from.shutdown(Shutdown::Read);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// An echo server on a loopback port.
    fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut b = [0u8; 64];
                    while let Ok(n @ 1..) = c.read(&mut b) {
                        if c.write_all(&b[..n]).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        addr
    }

    fn client(proxy: &FaultProxy) -> TcpStream {
        let c = TcpStream::connect(proxy.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        c
    }

    #[test]
    fn a_stall_holds_the_bytes_and_passing_again_delivers_them_all() {
        let proxy = FaultProxy::start(Upstream::Tcp(echo())).unwrap();
        let mut c = client(&proxy);
        proxy.set_mode(FaultMode::Stall);
        c.write_all(b"held").unwrap();
        let mut b = [0u8; 4];
        assert!(c.read(&mut b).is_err(), "nothing passes while stalled");
        proxy.set_mode(FaultMode::Pass);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"held");
        assert_eq!(proxy.accepted(), 1);
    }

    /// An upstream that counts the bytes it received and answers each read with `ok`.
    fn counting() -> (SocketAddr, Arc<AtomicU64>) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let got = Arc::new(AtomicU64::new(0));
        let g = got.clone();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                let g = g.clone();
                std::thread::spawn(move || {
                    let mut b = [0u8; 64];
                    while let Ok(n @ 1..) = c.read(&mut b) {
                        g.fetch_add(n as u64, Ordering::SeqCst);
                        if c.write_all(b"ok").is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, got)
    }

    #[test]
    fn lost_replies_reach_the_upstream_but_never_come_back() {
        let (addr, got) = counting();
        let proxy = FaultProxy::start(Upstream::Tcp(addr)).unwrap();
        let mut c = client(&proxy);
        proxy.set_mode(FaultMode::LoseReplies);
        c.write_all(b"applied").unwrap();
        let mut b = [0u8; 2];
        assert!(c.read(&mut b).is_err(), "the reply is lost");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while got.load(Ordering::SeqCst) < 7 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(got.load(Ordering::SeqCst), 7, "the request was delivered");
        // Ended by cutting the connection; a new one passes.
        proxy.cut_open();
        proxy.set_mode(FaultMode::Pass);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "cut");
        let mut again = client(&proxy);
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        again.write_all(b"x").unwrap();
        again.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"ok");
    }

    #[test]
    fn cut_open_ends_a_blackholed_connection_and_new_ones_follow_the_mode() {
        let proxy = FaultProxy::start(Upstream::Tcp(echo())).unwrap();
        let mut c = client(&proxy);
        proxy.set_mode(FaultMode::Blackhole);
        c.write_all(b"lost").unwrap();
        let mut b = [0u8; 4];
        assert!(c.read(&mut b).is_err(), "a blackhole answers nothing");
        proxy.cut_open();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "cut");
        assert_eq!(proxy.mode(), FaultMode::Blackhole, "the mode stays");
        let mut again = client(&proxy);
        again.write_all(b"ping").unwrap();
        assert!(
            again.read(&mut b).is_err(),
            "a new connection is blackholed too"
        );
    }

    #[test]
    fn close_ends_open_connections_and_refuses_new_ones() {
        let proxy = FaultProxy::start(Upstream::Tcp(echo())).unwrap();
        let mut c = client(&proxy);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        proxy.set_mode(FaultMode::Close);
        let mut b = [0u8; 4];
        assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "closed");
        let mut again = client(&proxy);
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = again.write_all(b"x");
        assert!(
            matches!(again.read(&mut b), Ok(0) | Err(_)),
            "closed on arrival"
        );
        assert_eq!(proxy.mode(), FaultMode::Close);
    }

    /// A PostgreSQL stand-in on a loopback port: it authenticates anyone, answers every
    /// request (a Sync or a Query) with `CommandComplete` and `ReadyForQuery`, and counts the
    /// `Execute` messages and queries it received.
    fn fake_postgres() -> (SocketAddr, Arc<AtomicU64>) {
        use pg_wire::wire;
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let executed = Arc::new(AtomicU64::new(0));
        let ex = executed.clone();
        std::thread::spawn(move || {
            for mut c in l.incoming().flatten() {
                let ex = ex.clone();
                std::thread::spawn(move || {
                    let mut len = [0u8; 4];
                    if c.read_exact(&mut len).is_err() {
                        return;
                    }
                    let mut startup = vec![0u8; u32::from_be_bytes(len) as usize - 4];
                    c.read_exact(&mut startup).unwrap();
                    c.write_all(&[wire::auth_ok(), wire::ready()].concat())
                        .unwrap();
                    let mut head = [0u8; 5];
                    while c.read_exact(&mut head).is_ok() {
                        let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
                        let mut body = vec![0u8; len as usize - 4];
                        if c.read_exact(&mut body).is_err() {
                            return;
                        }
                        match head[0] {
                            b'E' | b'Q' => {
                                ex.fetch_add(1, Ordering::SeqCst);
                            }
                            _ => {}
                        }
                        if matches!(head[0], b'S' | b'Q') {
                            let answer = [wire::complete("UPDATE 1"), wire::ready()].concat();
                            if c.write_all(&answer).is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, executed)
    }

    /// Reads messages until a `ReadyForQuery`; `None` if the connection ended first.
    fn until_ready(c: &mut TcpStream) -> Option<Vec<u8>> {
        let mut kinds = Vec::new();
        let mut head = [0u8; 5];
        loop {
            c.read_exact(&mut head).ok()?;
            let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
            let mut body = vec![0u8; len as usize - 4];
            c.read_exact(&mut body).ok()?;
            kinds.push(head[0]);
            if head[0] == b'Z' {
                return Some(kinds);
            }
        }
    }

    #[test]
    fn the_answer_to_one_statement_is_lost_after_it_ran_and_its_connection_breaks() {
        use pg_wire::wire;
        let (addr, executed) = fake_postgres();
        let proxy = FaultProxy::start(Upstream::Tcp(addr)).unwrap();
        let mut c = client(&proxy);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&wire::startup("ttlab")).unwrap();
        assert_eq!(until_ready(&mut c), Some(vec![b'R', b'Z']));
        // Armed after the connection opened: it is followed from its start all the same.
        proxy.lose_answer_to("ready_at = now()");
        let target = "UPDATE sessions SET status = $2, ready_at = now() WHERE id = $1";
        // Another statement, and the target's preparation, are answered.
        c.write_all(&wire::query("SELECT 1")).unwrap();
        assert_eq!(until_ready(&mut c), Some(vec![b'C', b'Z']));
        c.write_all(
            &[
                wire::parse("s0", target),
                wire::describe("s0"),
                wire::sync(),
            ]
            .concat(),
        )
        .unwrap();
        assert_eq!(until_ready(&mut c), Some(vec![b'C', b'Z']));
        assert_eq!(proxy.answers_lost(), 0);
        // Its execution runs upstream; its answer never comes, the connection breaks.
        c.write_all(&[wire::bind("s0"), wire::execute(), wire::sync()].concat())
            .unwrap();
        assert_eq!(until_ready(&mut c), None, "the answer was lost");
        let mut b = [0u8; 1];
        assert!(matches!(c.read(&mut b), Ok(0) | Err(_)), "closed");
        assert_eq!(
            executed.load(Ordering::SeqCst),
            2,
            "SELECT 1 and the UPDATE ran"
        );
        assert_eq!(proxy.answers_lost(), 1);

        // Spent: the retry, on a new connection, gets its answer.
        let mut again = client(&proxy);
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        again.write_all(&wire::startup("ttlab")).unwrap();
        assert!(until_ready(&mut again).is_some());
        again
            .write_all(
                &[
                    wire::parse("", target),
                    wire::bind(""),
                    wire::execute(),
                    wire::sync(),
                ]
                .concat(),
            )
            .unwrap();
        assert_eq!(until_ready(&mut again), Some(vec![b'C', b'Z']));
        assert_eq!(executed.load(Ordering::SeqCst), 3);
        assert_eq!(proxy.answers_lost(), 1);
    }

    #[test]
    fn a_statement_run_while_replies_are_lost_does_not_spend_the_aim() {
        use pg_wire::wire;
        let (addr, _) = fake_postgres();
        let proxy = FaultProxy::start(Upstream::Tcp(addr)).unwrap();
        proxy.lose_answer_to("ready_at");
        let mut c = client(&proxy);
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&wire::startup("ttlab")).unwrap();
        assert!(until_ready(&mut c).is_some());
        proxy.set_mode(FaultMode::LoseReplies);
        c.write_all(&wire::query("UPDATE t SET ready_at = now()"))
            .unwrap();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert_eq!(until_ready(&mut c), None);
        proxy.cut_open();
        proxy.set_mode(FaultMode::Pass);
        assert_eq!(proxy.answers_lost(), 0);
        // Still aimed: the next execution, on a healthy connection, loses its answer.
        let mut again = client(&proxy);
        again
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        again.write_all(&wire::startup("ttlab")).unwrap();
        assert!(until_ready(&mut again).is_some());
        again
            .write_all(&wire::query("UPDATE t SET ready_at = now()"))
            .unwrap();
        assert_eq!(until_ready(&mut again), None);
        assert_eq!(proxy.answers_lost(), 1);
    }
}
