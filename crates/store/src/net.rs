//! Opening connections: the socket (TCP keepalives and `TCP_USER_TIMEOUT` on every one), TLS
//! from `sslmode` (rustls), the session settings sent after connecting (timeouts and the plan
//! cache mode, as `SET` statements, which a pooler in session mode passes through — unlike
//! startup options), and a watchdog that bounds how long any request waits for its answer.
//!
//! The watchdog sits between the driver and the socket (above TLS, so it sees the protocol in
//! the clear). When the client writes, it arms a timer; every byte the server sends resets the
//! timer, and a reply ending with `ReadyForQuery` (the server has answered everything asked)
//! disarms it. A request that gets no byte back for [`Timeouts::call`] fails the connection
//! with a timeout, whatever the sockets do: a half-open connection, a blackholing proxy or a
//! stalled server all end there instead of waiting for the kernel (about 2 h by default). An
//! idle connection (a pooled one, a `LISTEN`ing one) has no request outstanding and is never
//! timed out.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::Host;
use tokio_postgres::tls::{ChannelBinding, TlsConnect};

use crate::StoreError;

/// Every bound on waiting for PostgreSQL. The defaults suit a server replica and the reaper;
/// see docs/postgres.md.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timeouts {
    /// Longest a request may wait for the first byte of its answer (and between bytes) before
    /// the connection is given up (client side; default 40 s, above `statement` and `lock`).
    pub call: Duration,
    /// `statement_timeout`: the server cancels a statement running longer (default 30 s).
    pub statement: Duration,
    /// `lock_timeout`: the server gives up waiting for a row or advisory lock (default 10 s).
    pub lock: Duration,
    /// `idle_in_transaction_session_timeout`: the server ends a session that sits in an open
    /// transaction this long, releasing its locks (default 60 s).
    pub idle_in_transaction: Duration,
    /// `lock_timeout` of the capacity transaction: a "Start lab" waits this long behind
    /// another one before it is told to try again (default 5 s).
    pub capacity_lock: Duration,
    /// TCP keepalive idle time, interval (both 10 s by default unless the URL sets
    /// `keepalives_idle` / `keepalives_interval`) and `TCP_USER_TIMEOUT` (30 s unless the URL
    /// sets `tcp_user_timeout`).
    pub keepalive_idle: Duration,
    /// See [`Timeouts::keepalive_idle`].
    pub keepalive_interval: Duration,
    /// See [`Timeouts::keepalive_idle`].
    pub tcp_user_timeout: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            call: Duration::from_secs(40),
            statement: Duration::from_secs(30),
            lock: Duration::from_secs(10),
            idle_in_transaction: Duration::from_secs(60),
            capacity_lock: Duration::from_secs(5),
            keepalive_idle: Duration::from_secs(10),
            keepalive_interval: Duration::from_secs(10),
            tcp_user_timeout: Duration::from_secs(30),
        }
    }
}

impl Timeouts {
    /// Checks every bound is usable (none zero: zero means "no limit" to PostgreSQL).
    pub fn validate(&self) -> Result<(), StoreError> {
        for (d, what) in [
            (self.call, "the call timeout must be at least 1 ms"),
            (
                self.statement,
                "the statement timeout must be at least 1 ms",
            ),
            (self.lock, "the lock timeout must be at least 1 ms"),
            (
                self.idle_in_transaction,
                "the idle-in-transaction timeout must be at least 1 ms",
            ),
            (
                self.capacity_lock,
                "the capacity lock timeout must be at least 1 ms",
            ),
            (
                self.keepalive_idle,
                "the keepalive idle time must be at least 1 s",
            ),
            (
                self.keepalive_interval,
                "the keepalive interval must be at least 1 s",
            ),
            (
                self.tcp_user_timeout,
                "the TCP user timeout must be at least 1 ms",
            ),
        ] {
            if d.is_zero() {
                return Err(StoreError::InvalidArgument(what));
            }
        }
        Ok(())
    }

    /// The `SET` statements every new connection runs.
    pub(crate) fn session_sql(&self) -> String {
        // Statements are prepared once per connection (`prepare_cached`); each execution is
        // still planned with its parameters, because the partial indexes on `status` serve
        // only plans that know the statuses asked for (a generic plan, which PostgreSQL
        // switches to after five executions, walks the whole table instead).
        format!(
            "SET plan_cache_mode = force_custom_plan; SET statement_timeout = {}; \
             SET lock_timeout = {}; SET idle_in_transaction_session_timeout = {}",
            millis(self.statement),
            millis(self.lock),
            millis(self.idle_in_transaction)
        )
    }
}

pub(crate) fn millis(d: Duration) -> u128 {
    d.as_millis().clamp(1, i32::MAX as u128)
}

/// How a connection uses TLS: libpq's `sslmode` values.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    strum::Display,
    strum::EnumString,
    strum::IntoStaticStr,
)]
#[strum(
    serialize_all = "kebab-case",
    parse_err_ty = String,
    parse_err_fn = unknown_ssl_mode
)]
pub enum SslMode {
    /// Never.
    Disable,
    /// If the server offers it, without checking its certificate (libpq's default).
    #[default]
    Prefer,
    /// Always, without checking the certificate — unless `sslrootcert` is given, which makes
    /// it `verify-ca` (as libpq does).
    Require,
    /// Always, with a certificate signed by the `sslrootcert` authority.
    VerifyCa,
    /// Always, with a certificate signed by the `sslrootcert` authority and naming the host.
    VerifyFull,
}

fn unknown_ssl_mode(s: &str) -> String {
    format!("sslmode must be disable, prefer, require, verify-ca or verify-full, not {s:?}")
}

impl SslMode {
    /// The libpq name.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    pub(crate) fn driver(self) -> tokio_postgres::config::SslMode {
        match self {
            Self::Disable => tokio_postgres::config::SslMode::Disable,
            Self::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        }
    }
}

/// TLS settings from the URL.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct TlsSettings {
    pub(crate) mode: SslMode,
    pub(crate) root_cert: Option<PathBuf>,
}

impl TlsSettings {
    /// Checks the combination and builds the rustls configuration (reading `sslrootcert`).
    pub(crate) fn client_config(&self) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
        if self.mode == SslMode::Disable {
            return Ok(None);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verify = match (self.mode, &self.root_cert) {
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(format!(
                    "sslmode={} needs sslrootcert=<file of the CA certificates>",
                    self.mode.as_str()
                ));
            }
            (SslMode::VerifyFull, Some(path)) => Some((path, true)),
            (_, Some(path)) => Some((path, false)),
            (_, None) => None,
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let config = match verify {
            None => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
                .with_no_client_auth(),
            Some((path, full)) => {
                let roots = read_roots(path)?;
                let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| e.to_string())?;
                if full {
                    builder.with_webpki_verifier(webpki).with_no_client_auth()
                } else {
                    builder
                        .dangerous()
                        .with_custom_certificate_verifier(Arc::new(CaOnly(webpki)))
                        .with_no_client_auth()
                }
            }
        };
        Ok(Some(Arc::new(config)))
    }
}

fn read_roots(path: &std::path::Path) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::pem::PemObject as _;
    let unreadable = |e: &dyn std::fmt::Display| format!("sslrootcert {}: {e}", path.display());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| unreadable(&e))?
        .collect::<Result<_, _>>()
        .map_err(|e| unreadable(&e))?;
    if certs.is_empty() {
        return Err(unreadable(&"no PEM certificate in it"));
    }
    let mut roots = rustls::RootCertStore::empty();
    for cert in certs {
        roots.add(cert).map_err(|e| unreadable(&e))?;
    }
    Ok(roots)
}

/// `sslmode=prefer`/`require` without a CA: encrypts, and checks only that the server holds
/// the key of the certificate it shows (as libpq does in those modes).
#[derive(Debug)]
struct NoVerify(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must lead to the given CA; the name is not checked.
#[derive(Debug)]
struct CaOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for CaOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::{CertificateError, Error};
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The socket under a connection.
pub(crate) enum Socket {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// A stream with the answer watchdog (see the module doc).
pub(crate) struct Watched<S> {
    inner: S,
    limit: Duration,
    enabled: bool,
    timer: Option<Pin<Box<tokio::time::Sleep>>>,
    /// The last bytes received, to recognise a reply ending with `ReadyForQuery`.
    tail: [u8; 6],
}

impl<S> Watched<S> {
    fn new(inner: S, limit: Duration) -> Self {
        Self {
            inner,
            limit,
            enabled: true,
            timer: None,
            tail: [0; 6],
        }
    }

    fn arm(&mut self) {
        if self.enabled {
            let deadline = tokio::time::Instant::now() + self.limit;
            match self.timer.as_mut() {
                Some(t) => t.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
    }

    fn received(&mut self, bytes: &[u8]) {
        if !self.enabled || bytes.is_empty() {
            return;
        }
        let n = bytes.len().min(6);
        self.tail.copy_within(n.., 0);
        self.tail[6 - n..].copy_from_slice(&bytes[bytes.len() - n..]);
        // ReadyForQuery: 'Z', length 5, transaction status (idle, in transaction, failed).
        let ready =
            self.tail[..5] == [b'Z', 0, 0, 0, 5] && matches!(self.tail[5], b'I' | b'T' | b'E');
        if ready {
            self.timer = None;
        } else if self.timer.is_some() {
            self.arm();
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let filled = buf.filled();
                let new = filled[before..].to_vec();
                this.received(&new);
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => match this.timer.as_mut() {
                Some(t) => {
                    ready!(t.as_mut().poll(cx));
                    this.timer = None;
                    Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "no answer from PostgreSQL within {:.1}s",
                            this.limit.as_secs_f64()
                        ),
                    )))
                }
                None => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let n = ready!(Pin::new(&mut this.inner).poll_write(cx, buf))?;
        if n > 0 && this.timer.is_none() {
            this.arm();
            // The driver may have polled the read side already in this turn (and found no
            // timer): register the new one with this task now, or nothing would wake it.
            if let Some(t) = this.timer.as_mut() {
                let _ = t.as_mut().poll(cx);
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Self::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_flush(cx),
            Self::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Self::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The raw stream of a connection: the socket with the watchdog (turned off once TLS is
/// negotiated, as the watchdog then watches the clear text above TLS).
pub(crate) type RawStream = Watched<Socket>;
/// The TLS stream of a connection.
pub(crate) struct TlsStream(Watched<tokio_rustls::client::TlsStream<RawStream>>);

impl AsyncRead for TlsStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }
}

impl tokio_postgres::tls::TlsStream for TlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

/// A connection as the store drives it.
pub(crate) type PgConnection = tokio_postgres::Connection<RawStream, TlsStream>;

/// The TLS handshake of one connection.
pub(crate) struct Handshake {
    config: Option<Arc<rustls::ClientConfig>>,
    server_name: ServerName<'static>,
    limit: Duration,
}

impl TlsConnect<RawStream> for Handshake {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TlsStream>> + Send>>;

    fn connect(self, mut stream: RawStream) -> Self::Future {
        Box::pin(async move {
            let Some(config) = self.config else {
                return Err(io::Error::other("TLS is disabled (sslmode=disable)"));
            };
            stream.enabled = false;
            stream.timer = None;
            let connector = tokio_rustls::TlsConnector::from(config);
            let tls = tokio::time::timeout(self.limit, connector.connect(self.server_name, stream))
                .await
                .map_err(|_| {
                    io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out")
                })??;
            Ok(TlsStream(Watched::new(tls, self.limit)))
        })
    }
}

/// Connection parameters beyond the driver's own configuration.
pub(crate) struct Dial<'a> {
    pub(crate) config: &'a tokio_postgres::Config,
    pub(crate) tls: Option<&'a Arc<rustls::ClientConfig>>,
    pub(crate) timeouts: &'a Timeouts,
}

impl Dial<'_> {
    /// Opens a connection (trying each host in turn), sets the session up, and returns the
    /// client with its connection (which the caller drives).
    pub(crate) async fn connect(
        &self,
    ) -> Result<(tokio_postgres::Client, PgConnection), Result<tokio_postgres::Error, String>> {
        let connect_timeout = self
            .config
            .get_connect_timeout()
            .copied()
            .unwrap_or(crate::DEFAULT_CONNECT_TIMEOUT);
        let ports = self.config.get_ports();
        let mut last = String::from("no host to connect to");
        for (i, host) in self.config.get_hosts().iter().enumerate() {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            let (socket, name) =
                match tokio::time::timeout(connect_timeout, self.socket(host, port)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        last = crate::error::io_reason(&e);
                        continue;
                    }
                    Err(_) => {
                        last = "timed out".into();
                        continue;
                    }
                };
            let handshake = Handshake {
                config: self.tls.cloned(),
                server_name: name,
                limit: self.timeouts.call,
            };
            let stream = Watched::new(socket, self.timeouts.call);
            let (client, mut connection) = match tokio::time::timeout(
                connect_timeout,
                self.config.connect_raw(stream, handshake),
            )
            .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => return Err(Ok(e)),
                Err(_) => {
                    last = "timed out".into();
                    continue;
                }
            };
            // Drive the connection while the session is set up, then hand it over.
            let session_sql = self.timeouts.session_sql();
            let setup = client.batch_execute(&session_sql);
            let outcome = {
                let mut setup = std::pin::pin!(setup);
                loop {
                    tokio::select! {
                        r = &mut setup => break r.map_err(Some),
                        m = std::future::poll_fn(|cx| connection.poll_message(cx)) => match m {
                            Some(Ok(_)) => {}
                            Some(Err(e)) => return Err(Ok(e)),
                            None => break Err(None),
                        },
                    }
                }
            };
            match outcome {
                Ok(()) => return Ok((client, connection)),
                Err(Some(e)) => return Err(Ok(e)),
                Err(None) => return Err(Err("the server closed the connection".into())),
            }
        }
        Err(Err(last))
    }

    async fn socket(&self, host: &Host, port: u16) -> io::Result<(Socket, ServerName<'static>)> {
        match host {
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok((
                    Socket::Unix(s),
                    ServerName::try_from("localhost").expect("valid name"),
                ))
            }
            Host::Tcp(name) => {
                let server_name = ServerName::try_from(name.clone())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address for the host");
                for addr in tokio::net::lookup_host((name.as_str(), port)).await? {
                    match tokio::net::TcpStream::connect(addr).await {
                        Ok(s) => {
                            self.tune(&s)?;
                            return Ok((Socket::Tcp(s), server_name));
                        }
                        Err(e) => last = e,
                    }
                }
                Err(last)
            }
        }
    }

    /// Keepalives and `TCP_USER_TIMEOUT`: the kernel gives up a connection whose peer
    /// vanished within about a minute instead of hours.
    fn tune(&self, s: &tokio::net::TcpStream) -> io::Result<()> {
        let sock = socket2::SockRef::from(s);
        s.set_nodelay(true)?;
        if self.config.get_keepalives() {
            let idle = match self.config.get_keepalives_idle() {
                // The driver's default (2 h) means the URL did not say.
                d if d == Duration::from_secs(2 * 60 * 60) => self.timeouts.keepalive_idle,
                d => d,
            };
            let interval = self
                .config
                .get_keepalives_interval()
                .unwrap_or(self.timeouts.keepalive_interval);
            let mut ka = socket2::TcpKeepalive::new()
                .with_time(idle)
                .with_interval(interval);
            #[cfg(target_os = "linux")]
            {
                ka = ka.with_retries(self.config.get_keepalives_retries().unwrap_or(3));
            }
            sock.set_tcp_keepalive(&ka)?;
        }
        #[cfg(target_os = "linux")]
        sock.set_tcp_user_timeout(Some(
            self.config
                .get_tcp_user_timeout()
                .copied()
                .filter(|d| !d.is_zero())
                .unwrap_or(self.timeouts.tcp_user_timeout),
        ))?;
        Ok(())
    }
}

/// Opens the pool's connections through [`Dial`].
pub(crate) struct PoolConnect(pub(crate) crate::DbUrl);

impl deadpool_postgres::Connect for PoolConnect {
    fn connect(
        &self,
        _pg_config: &tokio_postgres::Config,
    ) -> Pin<
        Box<
            dyn Future<
                    Output = Result<
                        (tokio_postgres::Client, tokio::task::JoinHandle<()>),
                        tokio_postgres::Error,
                    >,
                > + Send
                + '_,
        >,
    > {
        Box::pin(async move {
            match self.0.dial().connect().await {
                Ok((client, connection)) => {
                    let handle = tokio::spawn(drive(connection));
                    Ok((client, handle))
                }
                Err(Ok(e)) => Err(e),
                Err(Err(reason)) => Err(driver_error(reason).await),
            }
        })
    }
}

/// A driver error carrying `reason` (the driver offers no constructor: it is made by letting
/// the driver fail on a stream that fails).
async fn driver_error(reason: String) -> tokio_postgres::Error {
    struct Failing(Option<String>);
    impl Failing {
        fn error(&mut self) -> io::Error {
            io::Error::other(self.0.take().unwrap_or_else(|| "connection failed".into()))
        }
    }
    impl AsyncRead for Failing {
        fn poll_read(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            _buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Poll::Ready(Err(self.get_mut().error()))
        }
    }
    impl AsyncWrite for Failing {
        fn poll_write(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            _buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Err(self.get_mut().error()))
        }
        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Err(self.get_mut().error()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
    let mut config = tokio_postgres::Config::new();
    config
        .user("ttlab")
        .ssl_mode(tokio_postgres::config::SslMode::Disable);
    loop {
        if let Err(e) = config
            .connect_raw(Failing(Some(reason.clone())), tokio_postgres::NoTls)
            .await
        {
            return e;
        }
    }
}

/// Drives a connection to its end, saying why it ended: a watchdog timeout is worth a warning
/// (the server or the network stopped answering), any other end is routine.
pub(crate) async fn drive(connection: PgConnection) {
    if let Err(e) = connection.await {
        let reason = crate::error::pg_reason(&e);
        if std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<io::Error>())
            .is_some_and(|io| io.kind() == io::ErrorKind::TimedOut)
        {
            tracing::warn!(error = %reason, "database connection given up");
        } else {
            tracing::debug!(error = %reason, "database connection ended");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watched() -> Watched<()> {
        Watched::new((), Duration::from_secs(1))
    }

    #[tokio::test]
    async fn a_reply_ending_with_ready_for_query_disarms_the_watchdog_however_it_is_split() {
        let reply: Vec<u8> = [&b"T\0\0\0\x06ab"[..], b"Z\0\0\0\x05I"].concat();
        for split in 0..reply.len() {
            let mut w = watched();
            w.arm();
            w.received(&reply[..split]);
            w.received(&reply[split..]);
            assert!(w.timer.is_none(), "split at {split}");
        }
        // A partial reply keeps it armed (and pushed back); so does a `Z` that is data.
        let mut w = watched();
        w.arm();
        w.received(b"T\0\0\0\x06abZ\0\0\0\x05");
        assert!(w.timer.is_some());
        w.received(b"X");
        assert!(w.timer.is_some());
        // Unsolicited bytes on an idle connection (a notification) arm nothing.
        let mut w = watched();
        w.received(b"A\0\0\0\x10payload");
        assert!(w.timer.is_none());
    }

    #[test]
    fn ssl_modes_read_as_libpq_names_them() {
        for mode in [
            SslMode::Disable,
            SslMode::Prefer,
            SslMode::Require,
            SslMode::VerifyCa,
            SslMode::VerifyFull,
        ] {
            assert_eq!(mode.as_str().parse::<SslMode>(), Ok(mode));
        }
        assert_eq!(
            "allow".parse::<SslMode>(),
            Err(
                "sslmode must be disable, prefer, require, verify-ca or verify-full, not \"allow\""
                    .to_owned()
            )
        );
        assert_eq!(SslMode::default(), SslMode::Prefer);
    }

    #[test]
    fn zero_bounds_are_refused() {
        assert!(Timeouts::default().validate().is_ok());
        let t = Timeouts {
            call: Duration::ZERO,
            ..Timeouts::default()
        };
        assert!(matches!(t.validate(), Err(StoreError::InvalidArgument(_))));
        assert!(
            Timeouts::default()
                .session_sql()
                .contains("statement_timeout = 30000")
        );
    }
}
