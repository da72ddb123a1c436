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
}

impl Shared {
    fn mode(&self) -> FaultMode {
        *self.mode.lock().unwrap_or_else(|p| p.into_inner())
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
        for (from, to, upstream_bound) in [(client, server_w, true), (server, client_w, false)] {
            let sh = shared.clone();
            let ended = ended.clone();
            let _ = std::thread::Builder::new()
                .name("fault-proxy-pump".into())
                .spawn(move || {
                    pump(from, to, upstream_bound, &sh);
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
/// `from` is the client (the direction [`FaultMode::LoseReplies`] still forwards).
fn pump(mut from: Conn, mut to: Conn, upstream_bound: bool, shared: &Shared) {
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
        if forward && to.write_all(&buf[..n]).is_err() {
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
}
