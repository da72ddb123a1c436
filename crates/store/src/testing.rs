//! Test support: a fresh database per test, on a throwaway cluster or on the server named by
//! `DATABASE_URL`. Other crates' tests use it too: it is compiled only with the crate's
//! `test-support` feature, which their `[dev-dependencies]` enable.
//!
//! [`TestDb::new`] is the entry point, and the only place in this crate that reads the
//! environment. Without `DATABASE_URL`, the test process starts one throwaway cluster
//! ([`PgCluster`]) shared by its concurrently running tests and stopped after the last of them;
//! the schema is migrated once into a template database, and each test gets a copy
//! (`CREATE DATABASE … TEMPLATE`), dropped when the [`TestDb`] is.

use std::sync::{Arc, Mutex, Weak};

use crate::ephemeral::{PgCluster, quote_ident};
use crate::{DbUrl, Store, StoreError, StoreOptions};

/// The migrated template database on throwaway clusters.
const TEMPLATE_DB: &str = "ttlab_template";

struct SharedCluster {
    cluster: PgCluster,
    template: tokio::sync::OnceCell<()>,
}

static SHARED: Mutex<Weak<SharedCluster>> = Mutex::new(Weak::new());

fn shared_cluster() -> Result<Arc<SharedCluster>, StoreError> {
    let mut slot = SHARED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(shared) = slot.upgrade() {
        return Ok(shared);
    }
    let shared = Arc::new(SharedCluster {
        cluster: PgCluster::start()?,
        template: tokio::sync::OnceCell::new(),
    });
    *slot = Arc::downgrade(&shared);
    Ok(shared)
}

/// A database of its own for one test, dropped with this value.
pub struct TestDb {
    url: String,
    db_url: DbUrl,
    admin: DbUrl,
    name: String,
    cluster: Option<Arc<SharedCluster>>,
}

impl std::fmt::Debug for TestDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestDb")
            .field("target", &self.db_url.target())
            .finish()
    }
}

impl TestDb {
    /// A fresh database with the schema applied: on the server of `DATABASE_URL` when that is
    /// set and not empty, else on a throwaway cluster.
    pub async fn new() -> Result<Self, StoreError> {
        match database_url_from_env() {
            Some(url) => Self::on_server(&url, true).await,
            None => Self::throwaway(true).await,
        }
    }

    /// Like [`TestDb::new`], without the schema (for migration tests).
    pub async fn new_empty() -> Result<Self, StoreError> {
        match database_url_from_env() {
            Some(url) => Self::on_server(&url, false).await,
            None => Self::throwaway(false).await,
        }
    }

    /// A fresh database on the server `admin_url` points at (the URL's database is only used
    /// to connect and issue `CREATE DATABASE`).
    pub async fn on_server(admin_url: &str, migrated: bool) -> Result<Self, StoreError> {
        let admin = DbUrl::parse(admin_url)?;
        let name = fresh_name();
        create_database(&admin, &name, None).await?;
        let url = replace_database(admin_url, &name);
        let db = Self {
            db_url: DbUrl::parse(&url)?,
            url,
            admin,
            name,
            cluster: None,
        };
        if migrated {
            crate::migrate::migrate_url(&db.db_url).await?;
        }
        Ok(db)
    }

    /// A fresh database on this process's throwaway cluster.
    pub async fn throwaway(migrated: bool) -> Result<Self, StoreError> {
        let shared = tokio::task::spawn_blocking(shared_cluster)
            .await
            .map_err(|e| StoreError::Throwaway {
                step: "starting",
                detail: e.to_string(),
            })??;
        let admin = DbUrl::parse(&shared.cluster.url("postgres"))?;
        let template = if migrated {
            shared
                .template
                .get_or_try_init(|| async {
                    create_database(&admin, TEMPLATE_DB, None).await?;
                    let url = DbUrl::parse(&shared.cluster.url(TEMPLATE_DB))?;
                    crate::migrate::migrate_url(&url).await.map(|_| ())
                })
                .await?;
            Some(TEMPLATE_DB)
        } else {
            None
        };
        let name = fresh_name();
        create_database(&admin, &name, template).await?;
        let url = shared.cluster.url(&name);
        Ok(Self {
            db_url: DbUrl::parse(&url)?,
            url,
            admin,
            name,
            cluster: Some(shared),
        })
    }

    /// The database's URL, usable by `tokio-postgres` and `ttlabctl --database-url`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The database's URL, parsed.
    pub fn db_url(&self) -> &DbUrl {
        &self.db_url
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A store on this database.
    pub async fn store(&self) -> Result<Store, StoreError> {
        Store::connect(&self.url, StoreOptions::default()).await
    }

    /// A store on this database with other options (short timeouts or leases, say).
    pub async fn store_with(&self, options: StoreOptions) -> Result<Store, StoreError> {
        Store::connect(&self.url, options).await
    }

    /// Where the server listens, for a proxy to forward to: the unix socket of a throwaway
    /// cluster, or the (first) host and port of `DATABASE_URL`.
    pub fn server_socket(&self) -> ServerSocket {
        let config = self.db_url.config();
        let port = config.get_ports().first().copied().unwrap_or(5432);
        match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Unix(dir)) => {
                ServerSocket::Unix(dir.join(format!(".s.PGSQL.{port}")))
            }
            Some(tokio_postgres::config::Host::Tcp(host)) => ServerSocket::Tcp(host.clone(), port),
            None => ServerSocket::Tcp("127.0.0.1".into(), port),
        }
    }

    /// This database's URL with its host and port replaced by `addr` (a proxy in front of the
    /// server), everything else kept.
    pub fn url_at(&self, addr: std::net::SocketAddr) -> String {
        replace_host(&self.url, &addr.to_string())
    }
}

/// A throwaway PostgreSQL that requires TLS on `127.0.0.1`, with a certificate for
/// `localhost` signed by a certificate authority made for it at start (with the `openssl`
/// command), and a second, unrelated authority to show what a wrong CA does. Dropping it
/// stops the server and deletes the files.
pub struct TlsServer {
    cluster: PgCluster,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsServer")
            .field("port", &self.cluster.tcp_port())
            .finish()
    }
}

impl TlsServer {
    /// Makes the authorities and the server certificate, and starts the server. Fails with
    /// [`StoreError::Throwaway`] (step `openssl`) when the `openssl` command is missing: a
    /// test then calls `ttlab_testkit::skip_or_fail`.
    pub fn start() -> Result<Self, StoreError> {
        let dir = tempfile::tempdir().map_err(|e| StoreError::Throwaway {
            step: "openssl",
            detail: e.to_string(),
        })?;
        let d = dir.path();
        let ext = d.join("server.ext");
        std::fs::write(
            &ext,
            "subjectAltName=DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
        )
        .map_err(|e| StoreError::Throwaway {
            step: "openssl",
            detail: e.to_string(),
        })?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        for (name, subject) in [
            ("ca", "/CN=ttlab test CA"),
            ("wrong-ca", "/CN=some other CA"),
        ] {
            openssl(
                d,
                &[
                    &["req", "-x509"][..],
                    &ec,
                    &[
                        "-keyout",
                        &format!("{name}.key"),
                        "-out",
                        &format!("{name}.crt"),
                        "-days",
                        "2",
                        "-subj",
                        subject,
                    ],
                ]
                .concat(),
            )?;
        }
        openssl(
            d,
            &[
                &["req"][..],
                &ec,
                &[
                    "-keyout",
                    "server.key",
                    "-out",
                    "server.csr",
                    "-subj",
                    "/CN=localhost",
                ],
            ]
            .concat(),
        )?;
        openssl(
            d,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.crt",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                "server.crt",
                "-days",
                "2",
                "-extfile",
                "server.ext",
            ],
        )?;
        let tls = crate::ephemeral::ServerTls {
            cert: d.join("server.crt"),
            key: d.join("server.key"),
        };
        let cluster = PgCluster::start_tls(
            &crate::ephemeral::PgBinaries::locate()?,
            &crate::ephemeral::ClusterOptions::default(),
            &tls,
        )?;
        Ok(Self { cluster, dir })
    }

    /// The authority that signed the server's certificate (a PEM file).
    pub fn ca(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// An authority that signed nothing here.
    pub fn wrong_ca(&self) -> std::path::PathBuf {
        self.dir.path().join("wrong-ca.crt")
    }

    /// Creates database `name`, migrated when `migrated`, over the private socket.
    pub async fn create_database(&self, name: &str, migrated: bool) -> Result<(), StoreError> {
        let url = self.cluster.create_database(name).await?;
        if migrated {
            crate::migrate::migrate_url(&DbUrl::parse(&url)?).await?;
        }
        Ok(())
    }

    /// A URL of database `database` over TCP to `host` (`localhost`, `127.0.0.1`) with
    /// `params` (e.g. `sslmode=verify-full&sslrootcert=/path/ca.crt`).
    pub fn url(&self, host: &str, database: &str, params: &str) -> String {
        let port = self.cluster.tcp_port().unwrap_or(5432);
        format!(
            "postgres://{}@{host}:{port}/{database}?{params}",
            crate::ephemeral::SUPERUSER
        )
    }
}

fn openssl(dir: &std::path::Path, args: &[&str]) -> Result<(), StoreError> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| StoreError::Throwaway {
            step: "openssl",
            detail: format!("cannot run openssl: {e}"),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(StoreError::Throwaway {
            step: "openssl",
            detail: crate::error::one_line(&String::from_utf8_lossy(&out.stderr)),
        })
    }
}

/// Where a database server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerSocket {
    /// A unix socket (its full path).
    Unix(std::path::PathBuf),
    /// A TCP host and port.
    Tcp(String, u16),
}

/// `url` with its `host:port` replaced (URL or `key=value` form).
fn replace_host(url: &str, host_port: &str) -> String {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else {
        let (host, port) = host_port.rsplit_once(':').unwrap_or((host_port, "5432"));
        return format!("{url} host={host} port={port}");
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let after_userinfo = rest.rfind('@').map_or(0, |at| at + 1);
    let tail = &rest[after_userinfo..];
    let host_end = tail.find(['/', '?']).unwrap_or(tail.len());
    format!(
        "{}{host_port}{}",
        &url[..rest_start + after_userinfo],
        &tail[host_end..]
    )
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // The last user of a throwaway cluster stops and deletes it whole, so there is
        // nothing to drop one by one.
        if let Some(cluster) = &self.cluster
            && Arc::strong_count(cluster) == 1
        {
            return;
        }
        let admin = self.admin.clone();
        let name = self.name.clone();
        // Drop is synchronous and may run inside a runtime: drop the database from a thread of
        // its own, with a runtime of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let client = admin.connect().await.map_err(|e| e.to_string())?;
                client
                    .batch_execute(&format!(
                        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                        quote_ident(&name)
                    ))
                    .await
                    .map_err(|e| crate::error::pg_reason(&e))
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(database = %self.name, error = %e, "could not drop a test database")
            }
            Err(_) => tracing::warn!(database = %self.name, "dropping a test database panicked"),
        }
    }
}

/// The only environment read of this crate: the test server's URL, if one is given.
fn database_url_from_env() -> Option<String> {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| !u.trim().is_empty())
}

fn fresh_name() -> String {
    format!("ttlab_test_{}", uuid::Uuid::new_v4().simple())
}

async fn create_database(
    admin: &DbUrl,
    name: &str,
    template: Option<&str>,
) -> Result<(), StoreError> {
    let client = admin.connect().await?;
    let sql = match template {
        Some(t) => format!(
            "CREATE DATABASE {} TEMPLATE {}",
            quote_ident(name),
            quote_ident(t)
        ),
        None => format!("CREATE DATABASE {}", quote_ident(name)),
    };
    client
        .batch_execute(&sql)
        .await
        .map_err(StoreError::query("creating a test database"))
}

/// `url` with its database replaced by `name` (URL or `key=value` form).
fn replace_database(url: &str, name: &str) -> String {
    let url = url.trim();
    let Some(scheme_end) = url.find("://") else {
        // In key=value form a later key wins.
        return format!("{url} dbname={name}");
    };
    let rest_start = scheme_end + 3;
    let rest = &url[rest_start..];
    let after_userinfo = rest.rfind('@').map_or(0, |at| at + 1);
    let tail = &rest[after_userinfo..];
    let host_end = tail.find(['/', '?']).unwrap_or(tail.len());
    let query = tail[host_end..]
        .find('?')
        .map_or("", |q| &tail[host_end + q..]);
    format!(
        "{}{}/{name}{query}",
        &url[..rest_start + after_userinfo],
        &tail[..host_end]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_is_replaced_in_every_url_form() {
        assert_eq!(
            replace_database("postgres://u:p@h:5432/old?sslmode=disable", "new"),
            "postgres://u:p@h:5432/new?sslmode=disable"
        );
        assert_eq!(
            replace_database("postgres://u@h", "new"),
            "postgres://u@h/new"
        );
        assert_eq!(
            replace_database("postgres://u:a/b@h/old", "new"),
            "postgres://u:a/b@h/new"
        );
        assert_eq!(
            replace_database("host=h user=u dbname=old", "new"),
            "host=h user=u dbname=old dbname=new"
        );
    }

    #[test]
    fn host_is_replaced_in_every_url_form() {
        assert_eq!(
            replace_host(
                "postgres://u:p@%2Ftmp%2Fpg:5432/db?sslmode=disable",
                "127.0.0.1:6000"
            ),
            "postgres://u:p@127.0.0.1:6000/db?sslmode=disable"
        );
        assert_eq!(
            replace_host("postgres://u@h", "127.0.0.1:1"),
            "postgres://u@127.0.0.1:1"
        );
        assert_eq!(
            replace_host("host=h user=u", "127.0.0.1:7"),
            "host=h user=u host=127.0.0.1 port=7"
        );
    }
}
