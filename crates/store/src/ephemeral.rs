//! Throwaway PostgreSQL clusters, started from the machine's server binaries (`initdb` and
//! `postgres`; found on `PATH` or under `/usr/lib/postgresql/*/bin`), for tests and
//! for `ttlabctl demo`. Nothing has to be installed or running beforehand. Compiled only with
//! the crate's `test-support` feature: no shipped binary carries it.
//!
//! A cluster listens only on a unix socket in its own private directory (one started with
//! [`PgCluster::start_tls`] also on `127.0.0.1`, over TLS only), is tuned for
//! throughput over durability (`fsync`, `synchronous_commit` and `full_page_writes` off), runs
//! as a child process of ours, and is stopped (immediate shutdown) and deleted when its
//! [`PgCluster`] is dropped.
//!
//! Starting is fast because `initdb` runs once per machine and server version: its result is
//! kept as a template data directory (under the system temp directory, guarded by a file lock
//! so parallel processes don't race) and copied for each cluster.
//!
//! PostgreSQL refuses to run as root. When this process is root, the server binaries run as
//! the `postgres` user (through `runuser`) in directories handed over to it.

use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::StoreError;

/// The superuser of throwaway clusters (no password: trust over a private socket).
pub const SUPERUSER: &str = "postgres";

/// Bump when the template's settings change, so older cached templates are not reused.
const TEMPLATE_FORMAT: u32 = 2;

/// The port number in the socket file name (`.s.PGSQL.<port>`); no TCP port is opened.
const SOCKET_PORT: u16 = 5432;

/// Settings appended to every throwaway cluster's `postgresql.conf`.
const TUNING: &str = "
# ttlab throwaway cluster: fast, not durable.
listen_addresses = ''
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 16MB
max_connections = 200
autovacuum = off
timezone = 'UTC'
# Dynamic shared memory inside the data directory, so a killed server leaves nothing behind
# outside it.
dynamic_shared_memory_type = mmap
log_min_messages = warning
";

fn fail(step: &'static str, detail: impl Into<String>) -> StoreError {
    StoreError::Throwaway {
        step,
        detail: detail.into(),
    }
}

fn io_fail(step: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + use<> {
    let path = path.display().to_string();
    move |e| fail(step, format!("{path}: {e}"))
}

/// Where the PostgreSQL server binaries are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PgBinaries {
    initdb: PathBuf,
    postgres: PathBuf,
}

impl PgBinaries {
    /// Finds `initdb` and `postgres` on `PATH`, else in the newest
    /// `/usr/lib/postgresql/*/bin`.
    pub fn locate() -> Result<Self, StoreError> {
        let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).collect())
            .unwrap_or_default();
        let mut versioned: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let major = e.file_name().to_str()?.parse::<u32>().ok()?;
                Some((major, e.path().join("bin")))
            })
            .collect();
        versioned.sort();
        dirs.extend(versioned.into_iter().rev().map(|(_, p)| p));
        dirs.iter()
            .find_map(|d| Self::in_dir(d).ok())
            .ok_or_else(|| {
                fail(
                    "locating the server binaries",
                    "initdb and postgres were found neither on PATH nor under \
                     /usr/lib/postgresql/*/bin; install the PostgreSQL server package \
                     (Debian: postgresql)",
                )
            })
    }

    /// Uses the binaries in `dir`.
    pub fn in_dir(dir: &Path) -> Result<Self, StoreError> {
        let initdb = dir.join("initdb");
        let postgres = dir.join("postgres");
        for p in [&initdb, &postgres] {
            if !p.is_file() {
                return Err(fail(
                    "locating the server binaries",
                    format!("{} does not exist", p.display()),
                ));
            }
        }
        Ok(Self {
            // Resolve symlinks so the binaries find their own installation.
            initdb: fs::canonicalize(&initdb).unwrap_or(initdb),
            postgres: fs::canonicalize(&postgres).unwrap_or(postgres),
        })
    }

    /// `postgres --version`, e.g. `postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)`.
    pub fn version(&self) -> Result<String, StoreError> {
        let out = Command::new(&self.postgres)
            .arg("--version")
            .output()
            .map_err(io_fail("reading the server version", &self.postgres))?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }
}

/// Who runs the server binaries.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RunAs {
    /// This process's own user.
    Me,
    /// Another user, through `runuser` (this process is root).
    User {
        name: String,
        uid: u32,
        gid: u32,
        runuser: PathBuf,
    },
}

impl RunAs {
    fn detect() -> Result<Self, StoreError> {
        // The owner of /proc/self is this process's effective user.
        let euid = fs::metadata("/proc/self")
            .map_err(io_fail("finding the current user", Path::new("/proc/self")))?
            .uid();
        if euid != 0 {
            return Ok(Self::Me);
        }
        let id = |flag: &str| -> Result<u32, StoreError> {
            let out = Command::new("id")
                .args([flag, SUPERUSER])
                .output()
                .map_err(|e| fail("finding the postgres user", e.to_string()))?;
            if !out.status.success() {
                return Err(fail(
                    "finding the postgres user",
                    "PostgreSQL refuses to run as root, and there is no `postgres` user to run \
                     it as",
                ));
            }
            String::from_utf8_lossy(&out.stdout)
                .trim()
                .parse()
                .map_err(|e| fail("finding the postgres user", format!("id {flag}: {e}")))
        };
        let runuser = ["/usr/sbin/runuser", "/sbin/runuser", "/usr/bin/runuser"]
            .into_iter()
            .map(PathBuf::from)
            .find(|p| p.is_file())
            .ok_or_else(|| {
                fail(
                    "finding runuser",
                    "running as root needs runuser (util-linux) to start PostgreSQL as `postgres`",
                )
            })?;
        Ok(Self::User {
            name: SUPERUSER.to_owned(),
            uid: id("-u")?,
            gid: id("-g")?,
            runuser,
        })
    }

    fn label(&self) -> &str {
        match self {
            Self::Me => "self",
            Self::User { name, .. } => name,
        }
    }

    fn command(&self, program: &Path, cwd: &Path) -> Command {
        let mut cmd = match self {
            Self::Me => Command::new(program),
            Self::User { name, runuser, .. } => {
                let mut c = Command::new(runuser);
                c.args(["-u", name, "--"]).arg(program);
                c
            }
        };
        cmd.current_dir(cwd)
            .stdin(Stdio::null())
            .env("LC_ALL", "C")
            .env_remove("PGDATA");
        cmd
    }

    /// Hands `path` (one directory or file) over to the user that runs the server.
    fn hand_over(&self, path: &Path) -> Result<(), StoreError> {
        match self {
            Self::Me => Ok(()),
            Self::User { uid, gid, .. } => std::os::unix::fs::chown(path, Some(*uid), Some(*gid))
                .map_err(io_fail("handing a directory to the postgres user", path)),
        }
    }
}

/// `name` as a quoted SQL identifier.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

fn run(step: &'static str, mut cmd: Command) -> Result<Output, StoreError> {
    let out = cmd
        .output()
        .map_err(|e| fail(step, format!("{:?}: {e}", cmd.get_program())))?;
    if out.status.success() {
        Ok(out)
    } else {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        Err(fail(
            step,
            crate::error::one_line(&format!("{} {}", stderr.trim(), stdout.trim())),
        ))
    }
}

/// Where clusters and the cached template live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterOptions {
    /// The directory each cluster's private directory is created in.
    pub base_dir: PathBuf,
    /// The directory holding the cached, initdb'd template data directories.
    pub cache_dir: PathBuf,
}

impl Default for ClusterOptions {
    /// Clusters in `/dev/shm` where it exists (memory: copying the template there is several
    /// times faster than to disk), else in the system temp directory; the template cache in
    /// the system temp directory (`$TMPDIR` or `/tmp`, one per user), so it survives between
    /// runs.
    fn default() -> Self {
        let tmp = std::env::temp_dir();
        let shm = Path::new("/dev/shm");
        let uid = fs::metadata("/proc/self")
            .map(|m| m.uid())
            .unwrap_or(u32::MAX);
        Self {
            cache_dir: tmp.join(format!("ttlab-pg-cache-{uid}")),
            base_dir: if shm.is_dir() { shm.to_path_buf() } else { tmp },
        }
    }
}

/// The certificate (PEM, with any intermediates) and private key (PEM) a TLS cluster serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// The certificate chain file.
    pub cert: PathBuf,
    /// The private key file.
    pub key: PathBuf,
}

fn free_tcp_port() -> Result<u16, StoreError> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| fail("choosing a TCP port", e.to_string()))
}

/// A running throwaway PostgreSQL cluster. Dropping it stops the server and deletes its
/// directory.
#[derive(Debug)]
pub struct PgCluster {
    /// The port (of the socket file name, and of TCP when `tcp`).
    port: u16,
    /// Whether it also listens on `127.0.0.1` (with TLS).
    tcp: bool,
    root: Option<tempfile::TempDir>,
    data: PathBuf,
    socket_dir: PathBuf,
    server: Option<Child>,
    /// The `postgres` binary and who runs it, to start the same data directory again.
    postgres: PathBuf,
    run_as: RunAs,
}

impl PgCluster {
    /// Starts a cluster with the default options and the binaries [`PgBinaries::locate`]
    /// finds. Blocks for the time it takes (a fraction of a second once the template exists).
    pub fn start() -> Result<Self, StoreError> {
        Self::start_with(&PgBinaries::locate()?, &ClusterOptions::default())
    }

    /// Starts a cluster from `binaries`.
    pub fn start_with(binaries: &PgBinaries, options: &ClusterOptions) -> Result<Self, StoreError> {
        Self::start_inner(binaries, options, None)
    }

    /// Starts a cluster that also listens on `127.0.0.1` (a free port, [`PgCluster::tcp_port`])
    /// and accepts TCP connections over TLS only, with `tls`'s certificate and key (the unix
    /// socket stays open, without TLS, for setting up).
    pub fn start_tls(
        binaries: &PgBinaries,
        options: &ClusterOptions,
        tls: &ServerTls,
    ) -> Result<Self, StoreError> {
        Self::start_inner(binaries, options, Some(tls))
    }

    fn start_inner(
        binaries: &PgBinaries,
        options: &ClusterOptions,
        tls: Option<&ServerTls>,
    ) -> Result<Self, StoreError> {
        let run_as = RunAs::detect()?;
        let template = ensure_template(binaries, &run_as, &options.cache_dir)?;

        fs::create_dir_all(&options.base_dir)
            .map_err(io_fail("creating the cluster directory", &options.base_dir))?;
        sweep_abandoned(&options.base_dir);
        let root = tempfile::Builder::new()
            .prefix(CLUSTER_DIR_PREFIX)
            .tempdir_in(&options.base_dir)
            .map_err(io_fail("creating the cluster directory", &options.base_dir))?;
        // Private: only the server's user (and root) may reach the socket.
        fs::set_permissions(root.path(), fs::Permissions::from_mode(0o700))
            .map_err(io_fail("creating the cluster directory", root.path()))?;
        let owner = root.path().join(OWNER_FILE);
        fs::write(&owner, std::process::id().to_string())
            .map_err(io_fail("creating the cluster directory", &owner))?;
        run_as.hand_over(root.path())?;
        let data = root.path().join("data");
        let mut cp = Command::new("cp");
        cp.arg("-a").arg(&template).arg(&data);
        run("copying the template data directory", cp)?;

        let socket_dir = root.path().to_path_buf();
        let conf = data.join("postgresql.conf");
        let port = match tls {
            Some(_) => free_tcp_port()?,
            None => SOCKET_PORT,
        };
        let mut f = OpenOptions::new()
            .append(true)
            .open(&conf)
            .map_err(io_fail("configuring the cluster", &conf))?;
        writeln!(
            f,
            "unix_socket_directories = '{}'\nport = {port}",
            socket_dir.display().to_string().replace('\'', "''")
        )
        .map_err(io_fail("configuring the cluster", &conf))?;
        if let Some(tls) = tls {
            for (from, name, mode) in [
                (&tls.cert, "server.crt", 0o644),
                (&tls.key, "server.key", 0o600),
            ] {
                let to = data.join(name);
                fs::copy(from, &to).map_err(io_fail("installing the TLS files", from))?;
                fs::set_permissions(&to, fs::Permissions::from_mode(mode))
                    .map_err(io_fail("installing the TLS files", &to))?;
                run_as.hand_over(&to)?;
            }
            writeln!(
                f,
                "listen_addresses = '127.0.0.1'\nssl = on\nssl_cert_file = 'server.crt'\n\
                 ssl_key_file = 'server.key'"
            )
            .map_err(io_fail("configuring the cluster", &conf))?;
            // TCP over TLS only; the private socket as before.
            let hba = data.join("pg_hba.conf");
            fs::write(
                &hba,
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )
            .map_err(io_fail("configuring the cluster", &hba))?;
            run_as.hand_over(&hba)?;
        }
        drop(f);

        let mut cluster = Self {
            port,
            tcp: tls.is_some(),
            data,
            socket_dir,
            server: None,
            root: Some(root),
            postgres: binaries.postgres.clone(),
            run_as,
        };
        if let Err(e) = cluster.launch() {
            cluster.stop_quietly();
            return Err(e);
        }
        Ok(cluster)
    }

    /// Starts the server on the data directory and waits until it accepts connections.
    fn launch(&mut self) -> Result<(), StoreError> {
        let log_path = self.socket_dir.join("server.log");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_fail("creating the server log", &log_path))?;
        let log_err = log
            .try_clone()
            .map_err(io_fail("creating the server log", &log_path))?;
        // The server runs in the foreground as our child (through runuser when we are root),
        // so it is reaped by us and ends with our process group.
        let mut cmd = self.run_as.command(&self.postgres, &self.socket_dir);
        cmd.arg("-D")
            .arg(&self.data)
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log_err));
        let server = cmd
            .spawn()
            .map_err(io_fail("starting postgres", &self.postgres))?;
        self.server = Some(server);
        if let Err(e) = self.wait_ready(Duration::from_secs(60)) {
            let log = fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            let detail = format!(
                "{e}; server log: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
            return Err(fail("starting postgres", detail));
        }
        Ok(())
    }

    /// Stops the server (fast shutdown, as `pg_ctl stop` does: every connection is cut, and
    /// every committed transaction is flushed first — this cluster runs with
    /// `synchronous_commit = off`, so an immediate shutdown could lose the last ones) but
    /// keeps its data directory and socket directory, so [`PgCluster::resume`] can start it
    /// again at the same [`PgCluster::url`]. Stopping a stopped cluster does nothing.
    pub fn pause(&mut self) -> Result<(), StoreError> {
        if let Some(server) = self.server.as_mut()
            && matches!(server.try_wait(), Ok(None))
            && let Some(pid) = fs::read_to_string(self.data.join("postmaster.pid"))
                .ok()
                .and_then(|t| t.lines().next().map(|l| l.trim().to_owned()))
        {
            // SIGINT to the postmaster is PostgreSQL's fast shutdown.
            let signalled = Command::new("kill")
                .args(["-INT", &pid])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            let deadline = Instant::now() + Duration::from_secs(30);
            while signalled && Instant::now() < deadline {
                if let Ok(Some(_)) = server.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        // Already stopped by now, or stopped at once if the fast shutdown did not finish.
        self.stop_server()?;
        // An immediate shutdown removes the pid file; a killed server leaves it behind, and
        // its `ready` line must not be mistaken for the next server's.
        let pid_file = self.data.join("postmaster.pid");
        if pid_file.exists() {
            fs::remove_file(&pid_file).map_err(io_fail("removing a stale pid file", &pid_file))?;
        }
        Ok(())
    }

    /// Starts a paused cluster again on the same data directory, at the same URL, and waits
    /// until it accepts connections. Every database and row written before the pause is
    /// there. Resuming a running cluster does nothing.
    pub fn resume(&mut self) -> Result<(), StoreError> {
        if self.is_running() {
            return Ok(());
        }
        self.launch()
    }

    /// Whether the server process is running (not paused, not exited).
    pub fn is_running(&mut self) -> bool {
        self.server
            .as_mut()
            .is_some_and(|s| matches!(s.try_wait(), Ok(None)))
    }

    /// Waits until the postmaster reports `ready` in its pid file (as `pg_ctl -w` does, but
    /// polling every few milliseconds instead of every 100).
    fn wait_ready(&mut self, limit: Duration) -> Result<(), String> {
        let started = Instant::now();
        let pid_file = self.data.join("postmaster.pid");
        loop {
            if let Some(server) = self.server.as_mut()
                && let Ok(Some(status)) = server.try_wait()
            {
                return Err(format!("the server exited ({status})"));
            }
            if let Ok(text) = fs::read_to_string(&pid_file)
                && text.lines().nth(7).map(str::trim) == Some("ready")
            {
                return Ok(());
            }
            if started.elapsed() > limit {
                return Err(format!("not ready after {}s", limit.as_secs()));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A URL for `database` on this cluster, as the superuser over the unix socket, e.g.
    /// `postgres://postgres@%2Fdev%2Fshm%2Fttlab-pg-Ab12Cd:5432/ttlab`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}@{}:{}/{database}",
            encode_host_path(&self.socket_dir.display().to_string()),
            self.port
        )
    }

    /// The TCP port on `127.0.0.1` of a cluster started with [`PgCluster::start_tls`].
    pub fn tcp_port(&self) -> Option<u16> {
        self.tcp.then_some(self.port)
    }

    /// Creates database `name` (owned by the superuser) and returns its [`PgCluster::url`].
    pub async fn create_database(&self, name: &str) -> Result<String, StoreError> {
        let admin = crate::DbUrl::parse(&self.url("postgres"))?;
        let client = admin.connect().await?;
        client
            .batch_execute(&format!("CREATE DATABASE {}", quote_ident(name)))
            .await
            .map_err(StoreError::query("creating a database"))?;
        Ok(self.url(name))
    }

    /// The directory holding the server's socket (and its data directory and log).
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// Stops the server now (immediate shutdown) and deletes its directory.
    pub fn stop(mut self) -> Result<(), StoreError> {
        let result = self.stop_server();
        if let Some(root) = self.root.take() {
            root.close()
                .map_err(|e| fail("deleting the cluster directory", e.to_string()))?;
        }
        result
    }

    fn stop_server(&mut self) -> Result<(), StoreError> {
        let Some(mut server) = self.server.take() else {
            return Ok(());
        };
        if let Ok(Some(_)) = server.try_wait() {
            return Ok(());
        }
        // SIGQUIT to the postmaster is PostgreSQL's immediate shutdown (pg_ctl -m immediate).
        let pid = fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next().map(str::to_owned));
        let signalled = pid.is_some_and(|pid| {
            Command::new("kill")
                .args(["-QUIT", pid.trim()])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
        let deadline = Instant::now() + Duration::from_secs(10);
        while signalled && Instant::now() < deadline {
            if let Ok(Some(_)) = server.try_wait() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = server.kill();
        let _ = server.wait();
        Err(fail(
            "stopping postgres",
            "the server did not shut down on SIGQUIT and was killed",
        ))
    }

    fn stop_quietly(&mut self) {
        if let Err(e) = self.stop_server() {
            tracing::warn!(error = %e, dir = %self.socket_dir.display(), "could not stop a throwaway PostgreSQL");
        }
        drop(self.root.take());
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if self.root.is_some() {
            self.stop_quietly();
        }
    }
}

/// Prefix of every cluster directory.
const CLUSTER_DIR_PREFIX: &str = "ttlab-pg-";
/// File in a cluster directory holding the pid of the process that owns the cluster.
const OWNER_FILE: &str = "owner.pid";

/// Whether process `pid` exists and is not a zombie.
fn pid_alive(pid: &str) -> bool {
    let pid = pid.trim();
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    // /proc/<pid>/stat: `pid (comm) state …`; the command may contain spaces and parentheses.
    fs::read_to_string(Path::new("/proc").join(pid).join("stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|state| !matches!(state, 'Z' | 'X' | 'x'))
    })
}

/// Removes cluster directories whose owning process is gone (it was killed before it could
/// clean up), stopping their server first if it still runs. Best effort: errors are ignored.
fn sweep_abandoned(base_dir: &Path) {
    let Ok(entries) = fs::read_dir(base_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let is_cluster_dir = entry
            .file_name()
            .to_str()
            .is_some_and(|n| n.starts_with(CLUSTER_DIR_PREFIX) && !n.contains("cache"));
        if !is_cluster_dir {
            continue;
        }
        let dir = entry.path();
        // A directory without an owner file is being created right now, or is not ours.
        let Ok(owner) = fs::read_to_string(dir.join(OWNER_FILE)) else {
            continue;
        };
        if pid_alive(&owner) {
            continue;
        }
        if let Ok(pid_file) = fs::read_to_string(dir.join("data").join("postmaster.pid"))
            && let Some(postmaster) = pid_file.lines().next()
            && pid_alive(postmaster)
            && fs::read_to_string(Path::new("/proc").join(postmaster.trim()).join("comm"))
                .is_ok_and(|comm| comm.trim() == "postgres")
        {
            let _ = Command::new("kill")
                .args(["-QUIT", postmaster.trim()])
                .stderr(Stdio::null())
                .status();
        }
        if fs::remove_dir_all(&dir).is_ok() {
            tracing::info!(dir = %dir.display(), "removed an abandoned throwaway PostgreSQL");
        }
    }
}

/// Returns the cached template data directory for these binaries, creating it (once per
/// machine, under a file lock) if needed.
fn ensure_template(
    binaries: &PgBinaries,
    run_as: &RunAs,
    cache_dir: &Path,
) -> Result<PathBuf, StoreError> {
    let version = binaries.version()?;
    let key: String = format!("{version}-{}-v{TEMPLATE_FORMAT}", run_as.label())
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let dir = cache_dir.join(&key);
    let data = dir.join("data");
    let ready = dir.join("ready");
    if ready.exists() {
        return Ok(data);
    }

    fs::create_dir_all(cache_dir).map_err(io_fail("creating the template cache", cache_dir))?;
    let lock_path = cache_dir.join(format!("{key}.lock"));
    let lock =
        File::create(&lock_path).map_err(io_fail("locking the template cache", &lock_path))?;
    lock.lock()
        .map_err(io_fail("locking the template cache", &lock_path))?;
    if ready.exists() {
        return Ok(data);
    }
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(io_fail("clearing a half-made template", &dir))?;
    }
    fs::create_dir_all(&dir).map_err(io_fail("creating the template", &dir))?;
    run_as.hand_over(&dir)?;
    let mut initdb = run_as.command(&binaries.initdb, &dir);
    initdb.arg("-D").arg(&data).args([
        "-U",
        SUPERUSER,
        "--auth=trust",
        "--encoding=UTF8",
        "--locale=C",
        "--no-sync",
        "--no-instructions",
        "--wal-segsize=1",
    ]);
    run("initdb", initdb)?;
    let conf = data.join("postgresql.conf");
    let mut f = OpenOptions::new()
        .append(true)
        .open(&conf)
        .map_err(io_fail("configuring the template", &conf))?;
    f.write_all(TUNING.as_bytes())
        .map_err(io_fail("configuring the template", &conf))?;
    File::create(&ready).map_err(io_fail("marking the template ready", &ready))?;
    Ok(data)
}

/// Percent-encodes a unix socket directory for the host part of a URL.
fn encode_host_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len() * 3);
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
