//! What the soak starts and stops: PostgreSQL, kube-sim (faults, latency, the namespace quota,
//! the finalizer that holds some VMs' deletion), the lessons, and per environment a server and
//! a reaper as child processes, each reaching PostgreSQL and the Kubernetes API through fault
//! proxies of its own; the run itself (students, chaos, continuous checks), the drain, and the
//! final analysis.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use tokio::sync::watch;
use ttlab_api::auth::{AuthConfig, AuthSecret};
use ttlab_lesson::LessonSet;
use ttlab_model::{EnvName, NodeName};
use ttlab_store::{Session, Store, StoreOptions};
use ttlab_testkit::{FaultProxy, Upstream};

use super::checks::{self, Table};
use super::kube::{Backend, Kube};
use super::linger::Linger;
use super::{ENVS, Settings, chaos, students};
use crate::dev::demo::client::{self, HttpClient};
use crate::dev::demo::stack::{self, Database};
use crate::dev::demo::{
    AGENT, ChildProcess, REAPER, SERVER, locate_binaries, random_secret, wait_ready,
};
use crate::dev::sites::sites_yaml;

/// The namespace both environments share.
pub(crate) const NAMESPACE: &str = "ttlab-vms";
/// How long a stopped child gets after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);
/// Process names, by environment and role (server, reaper).
const NAMES: [[&str; 2]; 2] = [["dev-server", "dev-reaper"], ["prod-server", "prod-reaper"]];
/// The lesson with one VM and the one with two (a Service and a NetworkPolicy too).
pub(crate) const LESSON_SINGLE: &str = "soak-single";
/// See [`LESSON_SINGLE`].
pub(crate) const LESSON_MULTI: &str = "soak-multi";
/// A pod lab (`runtime: pod`, as `lessons/shell-basics.yaml`): one unprivileged Pod, no VM.
pub(crate) const LESSON_POD: &str = "soak-pod";

/// The reapers' leader lease (`TTLAB_LEADER_LEASE`), kept well under the soak's reap interval
/// as the operator guide asks: a SIGKILLed leader's lease must run out before a standby (or
/// the restarted reaper) takes over, so reclamation after a reaper kill waits up to this long.
pub(crate) const LEADER_LEASE: Duration = Duration::from_secs(3);

/// The kube-sim user of a process (`ttlab-dev-reaper`).
pub(crate) fn kube_user(env: usize, reaper: bool) -> String {
    format!(
        "ttlab-{}-{}",
        ENVS[env],
        if reaper { "reaper" } else { "server" }
    )
}

/// One child process and how to start it again.
pub(crate) struct Proc {
    pub name: &'static str,
    pub env: usize,
    pub reaper: bool,
    program: PathBuf,
    vars: Vec<(&'static str, OsString)>,
    pub child: Option<ChildProcess>,
}

impl Proc {
    /// Sets (or adds) one variable of the next start.
    pub(crate) fn set_var(&mut self, name: &'static str, value: OsString) {
        match self.vars.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => *v = value,
            None => self.vars.push((name, value)),
        }
    }

    /// One variable of the next start.
    pub(crate) fn var(&self, name: &str) -> Option<OsString> {
        self.vars
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    }

    pub(crate) fn spawn(&mut self) -> anyhow::Result<()> {
        self.child = Some(ChildProcess::spawn(
            self.name,
            &self.program,
            &[],
            &self.vars,
        )?);
        Ok(())
    }
}

/// A disturbance injected by the chaos: a process down, or PostgreSQL down.
#[derive(Debug, Clone)]
pub(crate) struct Disturbance {
    pub what: Disrupted,
    pub start: DateTime<Utc>,
    /// When it was over (the process started again, PostgreSQL accepting connections).
    pub end: DateTime<Utc>,
}

/// What a [`Disturbance`] took down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Disrupted {
    Reaper(usize),
    Server(usize),
    Postgres,
    /// A server rolled: SIGTERM (the start) with a successor already serving, until the old
    /// process exited (the end).
    Rolling(usize),
    /// One process's connections to PostgreSQL or the Kubernetes API misbehaving.
    Link(LinkId, NetFault),
    /// A site (its index in [`Settings::sites`]) taken away: every process's connections to
    /// its API server blackholed, from the start until they were cut and passed again.
    Site(usize),
}

/// One process slot's connection to one service: which environment, server or reaper, and
/// where to (the site's index in [`Settings::sites`] for the Kubernetes API; 0 for
/// PostgreSQL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LinkId {
    pub env: usize,
    pub reaper: bool,
    pub target: Target,
    pub site: usize,
}

impl std::fmt::Display for LinkId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} -> {}",
            NAMES[self.env][usize::from(self.reaper)],
            match self.target {
                Target::Postgres => "PostgreSQL".to_owned(),
                Target::Kube => format!("the Kubernetes API of site #{}", self.site),
            }
        )
    }
}

/// What a process's connection leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    Postgres,
    Kube,
}

/// A dirty network fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NetFault {
    /// Half-open: nothing answered, nothing closed; cut at the end.
    Blackhole,
    /// Bytes held, then delivered.
    Stall,
    /// Requests delivered, replies dropped; cut at the end.
    LoseReplies,
}

/// The fault proxy in front of one process slot's service (a restarted or rolled process of
/// that slot goes through the same one).
pub(crate) struct Link {
    pub id: LinkId,
    pub proxy: FaultProxy,
}

/// One answer the students got (or did not get).
#[derive(Debug, Clone)]
pub(crate) struct ApiCall {
    pub env: usize,
    pub route: &'static str,
    /// HTTP status; 0 when no answer came (connection refused or reset, timeout).
    pub status: u16,
    /// The `error` code of an error body.
    pub code: String,
    /// The session the request named, if any.
    pub session: Option<String>,
    pub started: DateTime<Utc>,
    pub ended: DateTime<Utc>,
}

/// A child that exited without being killed.
#[derive(Debug, Clone)]
pub(crate) struct Crash {
    pub name: String,
    pub status: String,
    /// Its last output lines.
    pub tail: String,
    /// When it was found exited.
    pub seen: DateTime<Utc>,
}

/// What happened during the run, for the final checks.
#[derive(Default)]
pub(crate) struct Journal {
    pub calls: Mutex<Vec<ApiCall>>,
    pub disturbances: Mutex<Vec<Disturbance>>,
    /// Children that exited without being killed.
    pub crashes: Mutex<Vec<Crash>>,
    pub activity: Mutex<BTreeMap<&'static str, u64>>,
}

impl Journal {
    pub(crate) fn count(&self, what: &'static str) {
        *lock(&self.activity).entry(what).or_default() += 1;
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Everything the run's tasks share.
pub(crate) struct Shared {
    pub settings: Settings,
    /// Where each environment's students go (the server now serving them).
    pub urls: [RwLock<String>; 2],
    /// The fault proxies, one per process slot and service.
    pub links: Vec<Link>,
    pub procs: tokio::sync::Mutex<Vec<Proc>>,
    /// The site taken away now, if any (the other network faults leave its links alone).
    pub lost_site: Mutex<Option<usize>>,
    pub database: tokio::sync::Mutex<Option<Database>>,
    pub journal: Journal,
    pub http: HttpClient,
    pub auth: AuthConfig,
    pub lessons: LessonSet,
}

impl Shared {
    /// The URL of environment `env`'s server now.
    pub(crate) fn url(&self, env: usize) -> String {
        self.urls[env]
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sends environment `env`'s students to `url` from now on.
    pub(crate) fn set_url(&self, env: usize, url: String) {
        *self.urls[env]
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = url;
    }

    /// Starts again, after a pause of the database or a kill, every child that is not
    /// running; records an unexpected exit as a crash.
    pub(crate) async fn revive(&self) {
        let mut procs = self.procs.lock().await;
        for p in procs.iter_mut() {
            let Some(child) = p.child.as_mut() else {
                continue;
            };
            if let Some(status) = child.has_exited() {
                let tail = child.tail();
                eprintln!(
                    "ttlabctl: soak: {} exited by itself ({status}); starting it again",
                    p.name
                );
                lock(&self.journal.crashes).push(Crash {
                    name: p.name.to_owned(),
                    status: status.to_string(),
                    tail,
                    seen: Utc::now(),
                });
                if let Err(e) = p.spawn() {
                    eprintln!("ttlabctl: soak: cannot start {} again: {e:#}", p.name);
                }
            }
        }
    }
}

/// What the soak started.
#[derive(Default)]
pub(crate) struct Rig {
    data: Option<tempfile::TempDir>,
    kube: Option<Kube>,
    shared: Option<Arc<Shared>>,
    store: Option<Store>,
    /// One per site.
    linger: Vec<Linger>,
}

impl Rig {
    /// Starts everything, runs, drains and checks. Returns the invariant table.
    pub(crate) async fn soak(&mut self, settings: &Settings) -> anyhow::Result<Table> {
        self.start(settings).await?;
        let shared = self.shared.clone().context("started")?;
        let store = self.store.clone().context("started")?;
        let kube = self.kube.as_ref().context("started")?;
        let t0 = Instant::now();
        let run_started = Utc::now();

        // The run: students, chaos and continuous checks until the duration is over.
        let (stop_students, students_stop) = watch::channel(false);
        let (stop_chaos, chaos_stop) = watch::channel(false);
        let (stop_watch, watch_stop) = watch::channel(false);
        let students = students::spawn_all(&shared, students_stop);
        let chaos = chaos::spawn_all(&shared, chaos_stop);
        let watching = checks::watch(&shared, &store, kube, watch_stop);
        let run = async {
            tokio::time::sleep(settings.duration).await;
            eprintln!(
                "ttlabctl: soak: {}s done; stopping the students and the chaos",
                t0.elapsed().as_secs()
            );
            stop_students.send_replace(true);
            stop_chaos.send_replace(true);
            for c in chaos {
                let _ = c.await;
            }
            for s in students {
                let _ = s.await;
            }
            // Drain: no more faults; everyone up.
            kube.clear_faults();
            let drain_started = Utc::now();
            {
                let mut db = shared.database.lock().await;
                if let Some(db) = db.as_mut() {
                    db.resume().await?;
                }
            }
            shared.revive().await;
            eprintln!("ttlabctl: soak: draining (faults off, every process up)");
            let drained = drain(&shared, &store, kube, settings.drain_timeout).await;
            stop_watch.send_replace(true);
            eprintln!(
                "ttlabctl: soak: drained in {}s ({})",
                (Utc::now() - drain_started).num_seconds(),
                match &drained {
                    Ok(()) => "complete".to_owned(),
                    Err(e) => format!("INCOMPLETE: {e}"),
                }
            );
            anyhow::Ok(drain_started)
        };
        let (live, drain_started) = tokio::join!(watching, run);
        let drain_started = drain_started?;

        let mut held = BTreeMap::new();
        for l in &self.linger {
            l.stop();
            held.extend(lock(&l.held).clone());
        }
        let sessions = all_sessions(&store).await?;
        let leftovers = kube.leftovers(&shared.http).await?;
        let calls = kube.calls()?;
        let peak_vms: Vec<usize> = kube.vms().into_iter().map(|(_, peak)| peak).collect();
        let input = checks::Input {
            settings,
            sessions: &sessions,
            calls: &calls,
            journal: &shared.journal,
            lessons: &shared.lessons,
            leftovers: &leftovers,
            live: &live,
            peak_vms: &peak_vms,
            run_started,
            drain_started,
            held: &held,
        };
        Ok(checks::analyse(&input))
    }

    async fn start(&mut self, settings: &Settings) -> anyhow::Result<()> {
        let bins = locate_binaries(&[SERVER, REAPER, AGENT]).await?;
        let server_bin = bins
            .server
            .clone()
            .context("ttlab-server is not available next to ttlabctl; the soak needs it")?;
        let reaper_bin = bins
            .reaper
            .clone()
            .context("ttlab-reaper is not available next to ttlabctl; the soak needs it")?;
        let agent_bin = bins
            .agent
            .clone()
            .context("ttlab-agent is missing next to ttlabctl (the server embeds it in VMs)")?;

        let data = tempfile::Builder::new()
            .prefix("ttlab-soak-")
            .tempdir()
            .context("creating a data directory")?;
        let data_dir = data.path().to_path_buf();
        self.data = Some(data);
        let lessons_dir = data_dir.join("lessons");
        write_lessons(&lessons_dir)?;
        let lessons = LessonSet::load(&lessons_dir).context("loading the soak's lessons")?;

        let db = Database::start().await?;
        let database_url = db.url().to_owned();
        self.store = Some(
            Store::connect(
                &database_url,
                StoreOptions {
                    max_connections: 4,
                    acquire_timeout: Duration::from_secs(5),
                    ..StoreOptions::default()
                },
            )
            .await?,
        );

        let guests = data_dir.join("guests");
        let kube = match settings.backend {
            Backend::KubeSim => Kube::start_sim(settings, &guests).await?,
            Backend::Real => Kube::start_real(settings, &guests, &agent_bin).await?,
        };
        let namespace = kube.namespace();

        let secret = random_secret()?;
        let auth = AuthConfig::new(AuthSecret::new(secret.as_bytes())?);
        let mut procs = Vec::new();
        let mut urls = [String::new(), String::new()];
        let mut links = Vec::new();
        let pg_socket = postgres_socket(&db)?;
        let log = std::env::var_os("RUST_LOG").unwrap_or_else(|| "error".into());
        for (e, env) in ENVS.iter().enumerate() {
            let _: EnvName = env.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
            let policy = settings.policies[e];
            let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, stack::free_loopback_port()?));
            urls[e] = format!("http://{listen}");
            for reaper in [false, true] {
                // Every process reaches PostgreSQL and the Kubernetes API (kube-sim or the
                // real kube-apiserver, whose TLS passes through) through fault proxies of its
                // own slot.
                let pg = FaultProxy::start(Upstream::Unix(pg_socket.clone()))
                    .context("starting a fault proxy to PostgreSQL")?;
                let process_db_url = format!("postgres://postgres@{}/ttlab", pg.addr());
                links.push(Link {
                    id: LinkId {
                        env: e,
                        reaper,
                        target: Target::Postgres,
                        site: 0,
                    },
                    proxy: pg,
                });
                // A kubeconfig per site, each through this slot's own proxy to that site.
                let mut kubeconfigs = Vec::new();
                for (site, name) in settings.sites.iter().enumerate() {
                    let p = FaultProxy::start(Upstream::Tcp(kube.api_addr(site)?)).with_context(
                        || format!("starting a fault proxy to the Kubernetes API of {name}"),
                    )?;
                    let at = p.addr();
                    links.push(Link {
                        id: LinkId {
                            env: e,
                            reaper,
                            target: Target::Kube,
                            site,
                        },
                        proxy: p,
                    });
                    kubeconfigs.push((
                        name.clone(),
                        kube.kubeconfig(e, reaper, site, &data_dir, Some(at))?,
                    ));
                }
                let kubeconfig = kubeconfigs
                    .first()
                    .map(|(_, k)| k.clone())
                    .context("no site")?;
                let mut vars: Vec<(&'static str, OsString)> = vec![
                    ("DATABASE_URL", process_db_url.into()),
                    ("KUBECONFIG", kubeconfig.into()),
                    ("TTLAB_ENV", (*env).into()),
                    ("TTLAB_NAMESPACE", namespace.clone().into()),
                    (
                        "TTLAB_SESSION_TTL",
                        format!("{}s", policy.ttl.as_secs()).into(),
                    ),
                    (
                        "TTLAB_SESSION_MAX",
                        format!("{}s", policy.max.as_secs()).into(),
                    ),
                    (
                        "TTLAB_MAX_EXTENSIONS",
                        policy.max_extensions.to_string().into(),
                    ),
                    ("RUST_LOG", log.clone()),
                    ("NO_COLOR", "1".into()),
                ];
                if kubeconfigs.len() > 1 {
                    // The same sites for every process; each reaches them through its own
                    // proxies.
                    let path = data_dir.join(format!("sites-{}.yaml", kube_user(e, reaper)));
                    let text = sites_yaml(
                        "ttlabctl soak --sites",
                        &kubeconfigs,
                        &namespace,
                        settings.site_vm_limit,
                    );
                    std::fs::write(&path, text)
                        .with_context(|| format!("writing the sites file {}", path.display()))?;
                    vars.push(("TTLAB_SITES", path.into()));
                }
                if reaper {
                    let metrics =
                        SocketAddr::from((Ipv4Addr::LOCALHOST, stack::free_loopback_port()?));
                    vars.extend([
                        (
                            "TTLAB_REAP_INTERVAL",
                            format!("{}s", settings.reap_interval.as_secs()).into(),
                        ),
                        ("TTLAB_ORPHAN_MIN_AGE", "15s".into()),
                        (
                            "TTLAB_LEADER_LEASE",
                            format!("{}ms", LEADER_LEASE.as_millis()).into(),
                        ),
                        ("TTLAB_METRICS_LISTEN", metrics.to_string().into()),
                    ]);
                } else {
                    vars.extend([
                        ("TTLAB_LISTEN", listen.to_string().into()),
                        ("TTLAB_AUTH_SECRET", secret.clone().into()),
                        ("TTLAB_LESSONS", lessons_dir.clone().into()),
                        ("TTLAB_AGENT_BINARY", agent_bin.clone().into()),
                        ("TTLAB_VM_LIMIT", settings.site_vm_limit.to_string().into()),
                    ]);
                }
                let mut p = Proc {
                    name: NAMES[e][usize::from(reaper)],
                    env: e,
                    reaper,
                    program: if reaper {
                        reaper_bin.clone()
                    } else {
                        server_bin.clone()
                    },
                    vars,
                    child: None,
                };
                p.spawn()?;
                procs.push(p);
            }
        }
        if settings.linger_fraction > 0.0 {
            for addr in kube.sim_addrs() {
                self.linger
                    .push(Linger::start(&format!("http://{addr}"), settings));
            }
        }
        self.kube = Some(kube);
        let shared = Arc::new(Shared {
            settings: settings.clone(),
            urls: urls.map(RwLock::new),
            links,
            procs: tokio::sync::Mutex::new(procs),
            lost_site: Mutex::new(None),
            database: tokio::sync::Mutex::new(Some(db)),
            journal: Journal::default(),
            http: client::client(64),
            auth,
            lessons,
        });
        self.shared = Some(shared.clone());
        {
            let mut procs = shared.procs.lock().await;
            for p in procs.iter_mut().filter(|p| !p.reaper) {
                if let Some(child) = p.child.as_mut() {
                    wait_ready(child, &shared.url(p.env)).await?;
                }
            }
        }
        // Faults and latency only once everything is up.
        let kube = self.kube.as_ref().context("started")?;
        kube.inject(settings);
        eprintln!(
            "ttlabctl: soak: dev at {}, prod at {}, {}",
            shared.url(0),
            shared.url(1),
            kube.describe()
        );
        Ok(())
    }

    /// Stops the children, the simulation and PostgreSQL, and deletes the data.
    pub(crate) async fn stop(&mut self) -> anyhow::Result<()> {
        let mut errors = Vec::new();
        self.linger.clear();
        if let Some(store) = self.store.take() {
            store.close();
        }
        if let Some(shared) = self.shared.take() {
            let mut procs = shared.procs.lock().await;
            for p in procs.iter_mut().rev() {
                if let Some(child) = p.child.as_mut()
                    && let Err(e) = child.stop(STOP_GRACE).await
                {
                    errors.push(format!("{e:#}"));
                }
            }
            drop(procs);
            if let Some(db) = shared.database.lock().await.take()
                && let Err(e) = db.stop().await
            {
                errors.push(format!("{e:#}"));
            }
        }
        if let Some(kube) = self.kube.take() {
            kube.stop().await;
        }
        if let Some(data) = self.data.take() {
            let dir = data.path().display().to_string();
            if let Err(e) = data.close() {
                errors.push(format!("removing {dir}: {e}"));
            }
        }
        if errors.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("{}", errors.join("; "))
        }
    }
}

/// The soak's lessons: quick to set up, graded by commands that touch nothing.
fn write_lessons(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let common = "runtime: vm\nimage: quay.io/containerdisks/debian:12\nmemory: 1Gi\ncores: 1\n\
         readiness_timeout_seconds: 20\nsetup_timeout_seconds: 20\n\
         files:\n  - path: /opt/lab/README.md\n    mode: \"0644\"\n    content: |\n      soak\n\
         setup: |\n  #!/bin/sh\n  true\n";
    let single = format!(
        "id: {LESSON_SINGLE}\ntitle: \"Soak: one VM\"\n{common}grading:\n  - name: the shell answers\n    command: \"true\"\n  - name: a check that fails\n    command: \"false\"\n"
    );
    let multi = format!(
        "id: {LESSON_MULTI}\ntitle: \"Soak: two VMs\"\n{common}nodes:\n  - control-plane\n  - worker-1\ngrading:\n  - name: the control plane answers\n    node: control-plane\n    command: \"true\"\n  - name: the worker answers\n    node: worker-1\n    command: \"true\"\n"
    );
    let pod = format!(
        "id: {LESSON_POD}\ntitle: \"Soak: a pod lab\"\nruntime: pod\nimage: docker.io/library/debian:12\n\
         memory: 256Mi\nreadiness_timeout_seconds: 20\ngrading:\n  - name: the shell answers\n    command: \"true\"\n"
    );
    for (name, text) in [
        (LESSON_SINGLE, single),
        (LESSON_MULTI, multi),
        (LESSON_POD, pod),
    ] {
        let path = dir.join(format!("{name}.yaml"));
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The unix socket of the throwaway PostgreSQL (`<dir>/.s.PGSQL.<port>`, the port from its
/// URL), for the fault proxies to forward to.
fn postgres_socket(db: &Database) -> anyhow::Result<PathBuf> {
    let port = db
        .url()
        .rsplit_once('/')
        .and_then(|(host, _)| host.rsplit_once(':'))
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .with_context(|| format!("no port in the database URL {}", db.url()))?;
    Ok(db.dir().join(format!(".s.PGSQL.{port}")))
}

/// Every session of both environments.
async fn all_sessions(store: &Store) -> anyhow::Result<Vec<Session>> {
    let mut out = Vec::new();
    for env in ENVS {
        let env: EnvName = env.parse().map_err(|e| anyhow::anyhow!("{e}"))?;
        out.extend(
            store
                .sessions()
                .list_recent(&env, 10_000_000)
                .await
                .context("reading the sessions")?,
        );
    }
    Ok(out)
}

/// Waits until every row is final and the namespace is empty (or the timeout).
async fn drain(
    shared: &Shared,
    store: &Store,
    kube: &Kube,
    timeout: Duration,
) -> Result<(), String> {
    let started = Instant::now();
    let mut last = String::new();
    loop {
        shared.revive().await;
        let live = match all_sessions(store).await {
            Ok(s) => s.iter().filter(|s| s.status.is_live()).count(),
            Err(e) => {
                last = format!("{e:#}");
                usize::MAX
            }
        };
        let objects = match kube.leftovers(&shared.http).await {
            Ok(l) => l.iter().flatten().map(|(_, n)| n.len()).sum(),
            Err(e) => {
                last = format!("{e:#}");
                usize::MAX
            }
        };
        if live == 0 && objects == 0 {
            return Ok(());
        }
        if live != usize::MAX && objects != usize::MAX {
            last = format!("{live} live rows, {objects} objects");
        }
        if started.elapsed() > timeout {
            return Err(last);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// The node names of a lesson (empty for an unknown one).
pub(crate) fn nodes_of(lessons: &LessonSet, lesson: &str) -> Vec<NodeName> {
    lessons
        .iter()
        .find(|l| l.id.as_str() == lesson)
        .map(|l| l.nodes.iter().cloned().collect())
        .unwrap_or_default()
}
