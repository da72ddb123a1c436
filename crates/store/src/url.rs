//! Reading a database URL: parse it, describe where it points, and never show its password.

use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::config::Host;

use crate::StoreError;
use crate::net::{Dial, PgConnection, SslMode, Timeouts, TlsSettings};

/// How long a connection attempt may take unless the URL says otherwise (`connect_timeout`).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A parsed database URL: the driver's configuration plus a printable description of the
/// server (`host:port/database`), which never holds the password.
#[derive(Clone)]
pub struct DbUrl {
    config: tokio_postgres::Config,
    target: String,
    tls: TlsSettings,
    tls_config: Option<Arc<rustls::ClientConfig>>,
    timeouts: Timeouts,
}

impl std::fmt::Debug for DbUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DbUrl")
            .field("target", &self.target)
            .finish()
    }
}

impl DbUrl {
    /// Parses `postgres://user:password@host:port/database?…` (or libpq `key=value` pairs).
    ///
    /// A unix socket directory is given as a percent-encoded host
    /// (`postgres://postgres@%2Ftmp%2Fpg:5432/ttlab`) or `?host=/tmp/pg`.
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        let invalid = |reason: String| StoreError::InvalidUrl {
            url: redact(url),
            reason,
        };
        let trimmed = url.trim();
        if trimmed.is_empty() {
            return Err(invalid("it is empty".into()));
        }
        let is_url = trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://");
        if !is_url && (trimmed.contains("://") || !trimmed.contains('=')) {
            return Err(invalid(
                "expected postgres://user:password@host:port/database".into(),
            ));
        }
        // `sslmode` (with libpq's verify-ca and verify-full, which the driver does not know)
        // and `sslrootcert` are this crate's to read; the rest is the driver's.
        let (rest, ssl) = take_ssl_params(trimmed, is_url);
        let mut tls = TlsSettings::default();
        for (key, value) in ssl {
            if key == "sslmode" {
                tls.mode = value.parse().map_err(invalid)?;
            } else {
                tls.root_cert = Some(PathBuf::from(value));
            }
        }
        if tls.mode == SslMode::Require && tls.root_cert.is_some() {
            tls.mode = SslMode::VerifyCa;
        }
        let tls_config = tls.client_config().map_err(invalid)?;
        let mut config = tokio_postgres::Config::from_str(&rest)
            .map_err(|e| invalid(crate::error::pg_reason(&e)))?;
        config.ssl_mode(tls.mode.driver());
        if config.get_hosts().is_empty() {
            return Err(invalid("no host given".into()));
        }
        if config.get_user().is_none_or(str::is_empty) {
            return Err(invalid("no user given".into()));
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(DEFAULT_CONNECT_TIMEOUT);
        }
        if config.get_application_name().is_none() {
            config.application_name("ttlab");
        }
        let target = describe(&config);
        Ok(Self {
            config,
            target,
            tls,
            tls_config,
            timeouts: Timeouts::default(),
        })
    }

    /// The same URL with other bounds on waiting (see [`Timeouts`]).
    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    /// The bounds every connection of this URL waits within.
    pub fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    /// The TLS mode (`sslmode`, libpq's default `prefer` when the URL names none).
    pub fn ssl_mode(&self) -> SslMode {
        self.tls.mode
    }

    /// `host:port/database`, for messages.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// The database name (the user name when the URL names none, as PostgreSQL does).
    pub fn database(&self) -> &str {
        self.config
            .get_dbname()
            .or(self.config.get_user())
            .unwrap_or_default()
    }

    /// The same server, another database.
    pub fn with_database(&self, database: &str) -> Self {
        let mut config = self.config.clone();
        config.dbname(database);
        let target = describe(&config);
        Self {
            config,
            target,
            ..self.clone()
        }
    }

    /// The driver's configuration.
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// Opens one connection (TLS, keepalives, session timeouts, the answer watchdog: see
    /// [`crate::net`]) and returns it undriven.
    pub(crate) async fn open_connection(
        &self,
    ) -> Result<(tokio_postgres::Client, PgConnection), StoreError> {
        self.dial().connect().await.map_err(|e| match e {
            Ok(e) => self.connect_error(&e),
            Err(reason) => StoreError::Connect {
                target: self.target.clone(),
                reason,
                rejected: false,
            },
        })
    }

    pub(crate) fn dial(&self) -> Dial<'_> {
        Dial {
            config: &self.config,
            tls: self.tls_config.as_ref(),
            timeouts: &self.timeouts,
        }
    }

    /// Opens one connection outside any pool and drives it on a spawned task.
    pub(crate) async fn connect(&self) -> Result<tokio_postgres::Client, StoreError> {
        let (client, connection) = self.open_connection().await?;
        tokio::spawn(crate::net::drive(connection));
        Ok(client)
    }

    pub(crate) fn connect_error(&self, e: &tokio_postgres::Error) -> StoreError {
        StoreError::Connect {
            target: self.target.clone(),
            reason: crate::error::connect_reason(e),
            rejected: crate::error::connect_rejected(e),
        }
    }
}

impl FromStr for DbUrl {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

fn describe(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                Host::Tcp(h) if h.contains(':') => format!("[{h}]:{port}"),
                Host::Tcp(h) => format!("{h}:{port}"),
                Host::Unix(dir) => format!("{}:{port}", dir.display()),
            }
        })
        .collect();
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or_default();
    format!("{}/{db}", hosts.join(","))
}

/// Splits `sslmode` and `sslrootcert` off a URL (`?a=b&…`) or `key=value` string.
fn take_ssl_params(s: &str, is_url: bool) -> (String, Vec<(String, String)>) {
    let is_ssl = |k: &str| k == "sslmode" || k == "sslrootcert";
    let mut taken = Vec::new();
    if is_url {
        let Some((base, query)) = s.split_once('?') else {
            return (s.to_owned(), taken);
        };
        let mut kept = Vec::new();
        for part in query.split('&') {
            match part.split_once('=') {
                Some((k, v)) if is_ssl(k) => taken.push((k.to_owned(), percent_decode(v))),
                _ => kept.push(part),
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        (rest, taken)
    } else {
        let mut kept = Vec::new();
        for part in s.split_whitespace() {
            match part.split_once('=') {
                Some((k, v)) if is_ssl(k) => {
                    taken.push((k.to_owned(), v.trim_matches('\'').to_owned()));
                }
                _ => kept.push(part),
            }
        }
        (kept.join(" "), taken)
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Some(b) = std::str::from_utf8(&bytes[i + 1..i + 3])
                .ok()
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The URL with any password replaced by `***`, for messages. Works on malformed input too.
pub fn redact(url: &str) -> String {
    let url = url.trim();
    if let Some(scheme_end) = url.find("://") {
        let rest_start = scheme_end + 3;
        let rest = &url[rest_start..];
        let mut out = String::with_capacity(url.len());
        out.push_str(&url[..rest_start]);
        // The user info ends at the last '@' anywhere: an unencoded '@', '/', '?' or '#' in a
        // password must not let any of it through (masking too much is harmless).
        let after_userinfo = match rest.rfind('@') {
            Some(at) => {
                let userinfo = &rest[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":***");
                    }
                    None => out.push_str(userinfo),
                }
                at
            }
            None => 0,
        };
        let tail = &rest[after_userinfo..];
        let query = tail.find('?').unwrap_or(tail.len());
        out.push_str(&tail[..query]);
        out.push_str(&redact_params(&tail[query..], '&'));
        out
    } else {
        redact_params(url, ' ')
    }
}

/// Masks `password=…` in `a=b c=d` or `?a=b&c=d` text.
fn redact_params(s: &str, sep: char) -> String {
    s.split(sep)
        .map(|part| {
            let (prefix, kv) = match part.strip_prefix('?') {
                Some(kv) => ("?", kv),
                None => ("", part),
            };
            match kv.split_once('=') {
                Some((k, _)) if k.trim().eq_ignore_ascii_case("password") => {
                    format!("{prefix}{k}=***")
                }
                _ => part.to_owned(),
            }
        })
        .collect::<Vec<_>>()
        .join(&sep.to_string())
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn describes_host_port_and_database() {
        let u = DbUrl::parse("postgres://ttlab:s3cret@127.0.0.1:5433/ttlab").unwrap();
        assert_eq!(u.target(), "127.0.0.1:5433/ttlab");
        let u = DbUrl::parse("postgres://alice@db.example.org").unwrap();
        assert_eq!(u.target(), "db.example.org:5432/alice");
        let u = DbUrl::parse("postgres://postgres@%2Ftmp%2Fpg-x:5432/t").unwrap();
        assert_eq!(u.target(), "/tmp/pg-x:5432/t");
        let u = DbUrl::parse("host=127.0.0.1 user=u password=p dbname=d").unwrap();
        assert_eq!(u.target(), "127.0.0.1:5432/d");
        assert_eq!(u.with_database("other").target(), "127.0.0.1:5432/other");
        assert!(!format!("{u:?}").contains("password"));
    }

    #[test]
    fn malformed_urls_say_why_without_the_password() {
        for (url, why) in [
            ("", "it is empty"),
            ("localhost:5432/ttlab", "expected postgres://"),
            ("mysql://u:hunter2@h/db", "expected postgres://"),
            ("postgres://u:hunter2@127.0.0.1:notaport/db", "port"),
            ("postgres://:hunter2@127.0.0.1/db", "no user"),
            ("postgres:///db", "no host"),
        ] {
            let err = DbUrl::parse(url).unwrap_err().to_string();
            assert!(err.starts_with("invalid database URL"), "{err}");
            assert!(err.contains(why), "{url}: {err}");
            assert!(!err.contains("hunter2"), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn redaction_masks_every_password_form() {
        assert_eq!(
            redact("postgres://u:p%40ss@h:1/d?password=x&sslmode=disable"),
            "postgres://u:***@h:1/d?password=***&sslmode=disable"
        );
        assert_eq!(
            redact("host=h password=x dbname=d"),
            "host=h password=*** dbname=d"
        );
        assert_eq!(redact("postgres://u@h/d"), "postgres://u@h/d");
        assert_eq!(redact("postgres://u:a@b@h/d"), "postgres://u:***@h/d");
    }

    proptest! {
        #[test]
        fn redacted_urls_never_hold_the_password(
            user in "[a-z]{1,8}",
            password in "P[A-Za-z0-9@:!#/?]{5,19}",
            host in "[a-z]{1,10}",
            tail in "[a-z0-9/:?=&]{0,20}",
        ) {
            let url = format!("postgres://{user}:{password}@{host}{tail}");
            let r = redact(&url);
            prop_assert!(!r.contains(&password), "{} -> {}", url, r);
        }
    }
}
