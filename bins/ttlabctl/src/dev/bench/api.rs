//! `ttlabctl bench api`: the server's own latencies, measured against kube-sim (no injected
//! latency), a throwaway PostgreSQL and the real `ttlab-server` binary as a child process,
//! all on this machine and over loopback.
//!
//! Three figures, each against its target:
//! - `POST /api/sessions` → 202, many users opening a session each, sent open-loop at a fixed
//!   rate (target p99 ≤ 50 ms);
//! - the backend's own delay on readiness: `ready_at` (database clock) minus the later of the
//!   VMI turning Running (seen through a watch on kube-sim) and the guest's readiness marker
//!   being written (its modification time), for every session of the POST phase
//!   (target p99 ≤ 250 ms);
//! - `GET /api/sessions/{id}` by the session's owner, open-loop at a fixed rate (default
//!   1,000/s) over all those sessions (target p99 ≤ 5 ms);
//! - the same GETs while every list of the Kubernetes API takes 10 s (`--slow-kube`), with
//!   ten starts at once and `/readyz` polled meanwhile: GET p99 (target ≤ 5 ms), how long the
//!   starts took to be answered, and whether readiness ever failed (it must not).
//!
//! Open-loop: each request has a scheduled instant and its latency is measured from that
//! instant, so a slow answer cannot hold back the next requests and hide its own cost
//! (coordinated omission). The client's lateness in sending is printed too, and so is what
//! the machine's CPUs did during each GET phase (busy, idle, and stolen by the hypervisor:
//! on a virtual machine, stolen time shows up as latency of whatever was ready to run).
//! kube-sim and the simulated guests run at a lower priority ([`SIM_NICE`]): they stand for
//! other machines.

use std::collections::HashMap;
use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use bytes::{Buf as _, BytesMut};
use chrono::{DateTime, Utc};
use clap::Args;
use http_body_util::BodyExt as _;
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_kube_sim::{KubeSim, Timings};
use ttlab_lesson::LessonSet;
use ttlab_model::{SessionId, SessionStatus, UserId};
use ttlab_store::{Store, StoreOptions};

use super::machine;
use crate::dev::demo::client::{self, HttpClient, Method};
use crate::dev::demo::stack::{self, Database};
use crate::dev::demo::{ChildProcess, checkout_dir, locate_binaries, random_secret, wait_ready};

/// The nice value of kube-sim's threads and of the simulated guests' processes. The simulated
/// cluster stands for other machines (the API server, KubeVirt, the nodes and their VMs);
/// sharing this machine's CPUs with the server at the same priority, its bursts (a VM created,
/// a guest agent started) would be measured as the server's latency. At nice 10 they still
/// held up the GETs while ten guests started; 19, the lowest priority, gives them the CPU
/// only when nothing else of the benchmark wants it.
pub(crate) const SIM_NICE: i32 = 19;

/// Set when a kube-sim thread could not be niced (the headers say so instead of the nice
/// value).
static NICE_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lowers the calling thread's priority to [`SIM_NICE`] (on Linux a nice value is a thread's,
/// and the processes it starts inherit it). A refusal leaves it as it was, and is recorded.
fn lower_priority() {
    if rustix::process::setpriority_process(Some(rustix::thread::gettid()), SIM_NICE).is_err() {
        NICE_REFUSED.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How kube-sim and its guests ran, for a benchmark's first line.
pub(crate) fn sim_priority() -> String {
    if NICE_REFUSED.load(std::sync::atomic::Ordering::Relaxed) {
        "it and its guests at the server's priority: lowering it was refused".to_owned()
    } else {
        format!("it and its guests at nice {SIM_NICE}")
    }
}

/// Target of `GET /api/sessions/{id}` p99.
const GET_TARGET: Duration = Duration::from_millis(5);
/// Share of the CPU time taken by the hypervisor from which a phase's figures are flagged as
/// partly the host's.
const STEAL_NOTED: f64 = 5.0;
/// Target of `POST /api/sessions` p99.
const POST_TARGET: Duration = Duration::from_millis(50);
/// Target of the backend's readiness delay p99.
const READY_TARGET: Duration = Duration::from_millis(250);

/// Arguments of `ttlabctl bench api`.
#[derive(Debug, Clone, Args)]
pub struct ApiBenchArgs {
    /// Requests per second of the `GET /api/sessions/{id}` phase.
    #[arg(long, default_value_t = 1000)]
    pub get_rate: u32,
    /// How long the GET phase measures (after a one-second warm-up at the same rate).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub get_duration: Duration,
    /// Users opening one session each in the POST phase.
    #[arg(long, default_value_t = 100)]
    pub users: u32,
    /// POSTs per second.
    #[arg(long, default_value_t = 20)]
    pub post_rate: u32,
    /// Lesson the sessions open (default: the first single-node VM lesson).
    #[arg(long)]
    pub lesson: Option<String>,
    /// Lesson file or directory (default: the checkout's `lessons/`).
    #[arg(long, env = "TTLAB_LESSONS", value_name = "PATH")]
    pub lessons: Option<PathBuf>,
    /// Simulated guest boot time (VMI Scheduled → its agent listening; the VMI reports Running
    /// halfway, as KubeVirt reports it while the guest still boots).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub sim_boot: Duration,
    /// Simulated lab setup time inside the guest (Running → readiness marker).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub sim_setup: Duration,
    /// Longest wait for every session to be running.
    #[arg(long, default_value = "180s", value_parser = parse_duration)]
    pub ready_timeout: Duration,
    /// How long every list of the Kubernetes API is delayed in the last phase (the same GETs,
    /// with ten starts and readiness probes meanwhile); `0s` skips that phase.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub slow_kube: Duration,
}

pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 3s, 2m)"))
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: ApiBenchArgs) -> anyhow::Result<()> {
    if args.get_rate == 0 || args.post_rate == 0 || args.users == 0 {
        anyhow::bail!("--get-rate, --post-rate and --users must be at least 1");
    }
    let (lessons, lessons_path, lesson) =
        single_node_vm_lesson(args.lessons.as_deref(), args.lesson.as_deref())?;
    let (server_bin, agent_bin) = server_and_agent().await?;

    let mut rig = Rig::default();
    let result = async {
        let settings = RigSettings {
            boot: args.sim_boot,
            setup: args.sim_setup,
            vm_limit: u64::from(args.users) * 2,
        };
        rig.start(&settings, &lessons, &lessons_path, &server_bin, &agent_bin)
            .await?;
        rig.measure(&args, &lesson).await
    }
    .await;
    rig.stop().await;
    result
}

/// The lessons (from `lessons`, default the checkout's `lessons/`), where they were read from,
/// and the lesson a benchmark uses: `wanted`, or the first single-node VM lesson by id.
pub(crate) fn single_node_vm_lesson(
    lessons: Option<&std::path::Path>,
    wanted: Option<&str>,
) -> anyhow::Result<(LessonSet, PathBuf, String)> {
    let lessons_path = lessons.map_or_else(|| checkout_dir().join("lessons"), PathBuf::from);
    let lessons = LessonSet::load(&lessons_path)
        .with_context(|| format!("loading the lessons from {}", lessons_path.display()))?;
    let lesson = match wanted {
        Some(l) => lessons
            .iter()
            .find(|x| x.id.as_str() == l)
            .with_context(|| format!("no lesson {l:?} in {}", lessons_path.display()))?,
        None => lessons
            .iter()
            .filter(|l| l.runtime == ttlab_model::Runtime::Vm && l.nodes.iter().count() == 1)
            .min_by(|a, b| a.id.as_str().cmp(b.id.as_str()))
            .context("no single-node VM lesson to use; name one with --lesson")?,
    }
    .id
    .as_str()
    .to_owned();
    Ok((lessons, lessons_path, lesson))
}

/// `ttlab-server` and `ttlab-agent` next to `ttlabctl`, which a benchmark's rig runs.
pub(crate) async fn server_and_agent() -> anyhow::Result<(PathBuf, PathBuf)> {
    let bins = locate_binaries(&[crate::dev::demo::SERVER, crate::dev::demo::AGENT]).await?;
    let server = bins
        .server
        .clone()
        .context("ttlab-server is not available next to ttlabctl; the benchmark needs it")?;
    let agent = bins
        .agent
        .clone()
        .context("ttlab-agent is missing next to ttlabctl (the server embeds it in every VM)")?;
    Ok((server, agent))
}

/// What a benchmark's rig is started with.
pub(crate) struct RigSettings {
    /// Simulated guest boot time.
    pub boot: Duration,
    /// Simulated lab setup time.
    pub setup: Duration,
    /// The server's VM limit.
    pub vm_limit: u64,
}

/// What the benchmark started: a throwaway PostgreSQL, kube-sim and one `ttlab-server`.
#[derive(Default)]
pub(crate) struct Rig {
    data: Option<tempfile::TempDir>,
    database: Option<Database>,
    pub(crate) store: Option<Store>,
    pub(crate) sim: Option<KubeSim>,
    /// kube-sim's own runtime: the simulated cluster's bursts (a batch of VMs created, their
    /// guests started) run on threads the OS preempts, instead of holding up the load
    /// generator's timers on shared workers, which showed as client lag in the figures. Its
    /// threads (and the guest agents they start) run at [`SIM_NICE`].
    sim_runtime: Option<tokio::runtime::Runtime>,
    server: Option<ChildProcess>,
    pub(crate) url: String,
    pub(crate) namespace: String,
    secret: String,
}

impl Rig {
    pub(crate) async fn start(
        &mut self,
        args: &RigSettings,
        lessons: &LessonSet,
        lessons_path: &std::path::Path,
        server_bin: &std::path::Path,
        agent_bin: &std::path::Path,
    ) -> anyhow::Result<()> {
        self.namespace = "ttlab-vms".into();
        self.secret = random_secret()?;
        let data = tempfile::Builder::new()
            .prefix("ttlab-bench-")
            .tempdir()
            .context("creating a data directory")?;
        let data_dir = data.path().to_path_buf();
        self.data = Some(data);
        let db = Database::start().await?;
        let database_url = db.url().to_owned();
        self.store = Some(Store::connect(&database_url, StoreOptions::default()).await?);
        self.database = Some(db);

        let timings = Timings {
            pending: Duration::from_millis(10),
            scheduling: Duration::from_millis(50),
            boot: args.boot,
            setup: args.setup,
            stop: Duration::from_millis(100),
            gc: Duration::from_millis(1),
            pod_start: Duration::from_millis(10),
            bookmark: Duration::from_secs(60),
        };
        let sim_runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kube-sim")
            .on_thread_start(lower_priority)
            .enable_all()
            .build()
            .context("starting kube-sim's runtime")?;
        let (namespace, guests) = (self.namespace.clone(), data_dir.join("guests"));
        let sim = sim_runtime
            .spawn(async move { stack::start_sim(&namespace, timings, &guests).await })
            .await
            .context("kube-sim's runtime")??;
        self.sim_runtime = Some(sim_runtime);
        stack::create_golden_disks(&sim, &self.namespace, lessons)?;
        let kubeconfig = data_dir.join("kubeconfig");
        sim.write_kubeconfig(&kubeconfig, &self.namespace)?;
        self.sim = Some(sim);

        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, stack::free_loopback_port()?));
        self.url = format!("http://{listen}");
        let limit = args.vm_limit.to_string();
        let mut env: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", database_url.into()),
            ("KUBECONFIG", kubeconfig.into()),
            ("TTLAB_ENV", "bench".into()),
            ("TTLAB_NAMESPACE", self.namespace.clone().into()),
            ("TTLAB_LISTEN", listen.to_string().into()),
            ("TTLAB_AUTH_SECRET", self.secret.clone().into()),
            ("TTLAB_LESSONS", lessons_path.as_os_str().to_owned()),
            ("TTLAB_AGENT_BINARY", agent_bin.as_os_str().to_owned()),
            ("TTLAB_VM_LIMIT", limit.into()),
            ("TTLAB_SESSION_TTL", "60m".into()),
        ];
        // Errors only: a line per refused request would disturb the measurement.
        if std::env::var_os("RUST_LOG").is_none() {
            env.push(("RUST_LOG", "error".into()));
        }
        if std::env::var_os("NO_COLOR").is_none() {
            env.push(("NO_COLOR", "1".into()));
        }
        let mut server = ChildProcess::spawn("server", server_bin, &[], &env)?;
        let ready = wait_ready(&mut server, &self.url).await;
        self.server = Some(server);
        ready
    }

    pub(crate) async fn stop(&mut self) {
        if let Some(s) = self.server.as_mut()
            && let Err(e) = s.stop(Duration::from_secs(15)).await
        {
            eprintln!("ttlabctl: stopping the server: {e:#}");
        }
        if let Some(store) = self.store.take() {
            store.close();
        }
        if let Some(sim) = self.sim.take() {
            match &self.sim_runtime {
                Some(rt) => {
                    let _ = rt.spawn(sim.shutdown()).await;
                }
                None => sim.shutdown().await,
            }
        }
        if let Some(rt) = self.sim_runtime.take() {
            rt.shutdown_background();
        }
        if let Some(db) = self.database.take()
            && let Err(e) = db.stop().await
        {
            eprintln!("ttlabctl: {e:#}");
        }
        if let Some(d) = self.data.take() {
            let _ = d.close();
        }
    }

    pub(crate) fn token(&self, user: &UserId) -> anyhow::Result<String> {
        self.token_as(user, Role::Student)
    }

    /// A bearer token of `user` with `role`, valid for three hours.
    pub(crate) fn token_as(&self, user: &UserId, role: Role) -> anyhow::Result<String> {
        let auth = AuthConfig::new(AuthSecret::new(self.secret.as_bytes())?);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        Ok(auth.mint(user, role, now, Duration::from_secs(3 * 3600))?)
    }

    async fn measure(&mut self, args: &ApiBenchArgs, lesson: &str) -> anyhow::Result<()> {
        let sim = self.sim.as_ref().context("kube-sim is not running")?;
        let store = self.store.clone().context("no database")?;
        let http = client::client(256);
        let server_pid = self.server.as_ref().map_or(0, ChildProcess::pid);
        println!(
            "ttlab bench api: {} build, {} CPUs, kube-sim without injected latency \
             (guest boot {} ms, setup {} ms; {}), ttlab-server pid {server_pid}, lesson {lesson}",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            std::thread::available_parallelism().map_or(0, usize::from),
            args.sim_boot.as_millis(),
            args.sim_setup.as_millis(),
            sim_priority(),
        );

        let running_seen = watch_vmis_running(sim.url(), &self.namespace).await?;

        // POST phase.
        let users: Vec<(UserId, String)> = (0..args.users)
            .map(|i| {
                let user = UserId::new(format!("bench-user-{i:05}"))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let token = self.token(&user)?;
                Ok((user, token))
            })
            .collect::<anyhow::Result<_>>()?;
        let post_url = format!("{}/api/sessions", self.url);
        let body = serde_json::json!({ "lesson": lesson });
        let period = Duration::from_secs_f64(1.0 / f64::from(args.post_rate));
        let tokens: Arc<Vec<String>> = Arc::new(users.iter().map(|(_, t)| t.clone()).collect());
        let answers = {
            let (http, tokens) = (http.clone(), tokens.clone());
            paced(tokens.len(), period, move |i| {
                let (http, url, tokens, body) =
                    (http.clone(), post_url.clone(), tokens.clone(), body.clone());
                async move {
                    let sent = Instant::now();
                    let r = client::send(&http, Method::POST, &url, Some(&tokens[i]), Some(&body))
                        .await;
                    (sent, Instant::now(), r)
                }
            })
            .await?
        };
        let mut post = Sample::default();
        let mut sessions: Vec<(SessionId, String)> = Vec::new();
        for ((at, t), token) in answers.into_iter().zip(tokens.iter()) {
            let (sent, done, r) = t.context("a request task failed")?;
            post.add(at, sent, done);
            match r {
                Ok((status, body)) if status == http::StatusCode::ACCEPTED => {
                    post.ok += 1;
                    let v: serde_json::Value =
                        serde_json::from_slice(&body).context("the 202 answer is not JSON")?;
                    let id: SessionId = v["id"]
                        .as_str()
                        .and_then(|s| s.parse().ok())
                        .context("the 202 answer has no session id")?;
                    sessions.push((id, token.clone()));
                }
                Ok((status, body)) => {
                    post.note_error(format!("{status}: {}", String::from_utf8_lossy(&body)))
                }
                Err(e) => post.note_error(format!("{e:#}")),
            }
        }
        post.print(
            &format!(
                "POST /api/sessions → 202 ({} users, one session each, {}/s)",
                args.users, args.post_rate
            ),
            POST_TARGET,
        );

        // Readiness.
        let deadline = Instant::now() + args.ready_timeout;
        let mut rows = Vec::new();
        for (id, _) in &sessions {
            loop {
                let s = store
                    .sessions()
                    .get(*id)
                    .await?
                    .with_context(|| format!("session {id} vanished"))?;
                if s.status != SessionStatus::Starting || Instant::now() > deadline {
                    rows.push(s);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        let seen = running_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let mut delays = Vec::new();
        let mut not_running = Vec::new();
        let mut unmeasured = 0usize;
        for s in &rows {
            if s.status != SessionStatus::Running {
                not_running.push(format!(
                    "{} {}{}",
                    s.id,
                    s.status.as_str(),
                    s.failure_reason
                        .as_deref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default()
                ));
                continue;
            }
            let Some(vm) = s.vms.first() else {
                unmeasured += 1;
                continue;
            };
            let running = seen.get(&vm.name).copied();
            let marker = sim
                .guest_dir(&self.namespace, &vm.name)
                .map(|d| d.join(ttlab_agent::protocol::READY_MARKER_PATH.trim_start_matches('/')))
                .and_then(|p| std::fs::metadata(p).ok())
                .and_then(|m| m.modified().ok())
                .map(DateTime::<Utc>::from);
            match (s.ready_at, running, marker) {
                (Some(ready), Some(running), Some(marker)) => {
                    let base = running.max(marker);
                    delays.push((ready - base).to_std().unwrap_or(Duration::ZERO));
                }
                _ => unmeasured += 1,
            }
        }
        print_delays(&delays, unmeasured, &not_running);

        // GET phase.
        if sessions.is_empty() {
            anyhow::bail!("no session was created, so the GET phase cannot run");
        }
        let targets: Arc<Vec<(String, String)>> = Arc::new(
            sessions
                .iter()
                .map(|(id, token)| (format!("{}/api/sessions/{id}", self.url), token.clone()))
                .collect(),
        );
        let warmup = Duration::from_secs(1);
        let _ = open_loop(&http, &targets, args.get_rate, warmup).await;
        let (mut get, load) =
            machine::during(open_loop(&http, &targets, args.get_rate, args.get_duration)).await;
        get.print(
            &format!(
                "GET /api/sessions/{{id}} ({}/s offered for {} s over {} sessions)",
                args.get_rate,
                args.get_duration.as_secs_f64(),
                sessions.len()
            ),
            GET_TARGET,
        );
        print_load(load);
        if !args.slow_kube.is_zero() {
            self.slow_phase(args, lesson, &http, &targets).await?;
        }
        Ok(())
    }

    /// The GET phase again while every list of the cluster takes `--slow-kube`, with ten
    /// students starting at once and readiness probed every 100 ms meanwhile.
    async fn slow_phase(
        &self,
        args: &ApiBenchArgs,
        lesson: &str,
        http: &HttpClient,
        targets: &Arc<Vec<(String, String)>>,
    ) -> anyhow::Result<()> {
        const STARTS: u32 = 10;
        let sim = self.sim.as_ref().context("kube-sim is not running")?;
        let millis = u64::try_from(args.slow_kube.as_millis()).unwrap_or(u64::MAX);
        let rule = sim.faults().add(ttlab_kube_sim::FaultRule {
            action: ttlab_kube_sim::FaultAction::Delay { millis },
            ..ttlab_kube_sim::FaultRule::fail(Some(ttlab_kube_sim::Verb::List), None, 500)
        });
        let began = Instant::now();
        let starts: Vec<_> = (0..STARTS)
            .map(|i| {
                let user = UserId::new(format!("bench-slow-{i:03}"))
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                let token = self.token(&user)?;
                let (http, url) = (http.clone(), format!("{}/api/sessions", self.url));
                let body = serde_json::json!({ "lesson": lesson });
                Ok(tokio::spawn(async move {
                    let at = Instant::now();
                    let r =
                        client::send(&http, Method::POST, &url, Some(&token), Some(&body)).await;
                    (r.map(|(status, _)| status.as_u16()), at.elapsed())
                }))
            })
            .collect::<anyhow::Result<_>>()?;
        let probes = {
            let (http, url, until) = (
                http.clone(),
                format!("{}/readyz", self.url),
                began + args.slow_kube,
            );
            tokio::spawn(async move {
                let (mut ok, mut failed) = (0u32, Vec::new());
                while Instant::now() < until {
                    match client::send(&http, Method::GET, &url, None, None).await {
                        Ok((s, _)) if s == http::StatusCode::OK => ok += 1,
                        Ok((s, body)) => {
                            failed.push(format!("{s}: {}", String::from_utf8_lossy(&body)));
                        }
                        Err(e) => failed.push(format!("{e:#}")),
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                (ok, failed)
            })
        };
        let (mut get, load) =
            machine::during(open_loop(http, targets, args.get_rate, args.slow_kube)).await;
        let (ready_ok, ready_failed) = probes.await.context("the readiness probes failed")?;
        let mut answers: std::collections::BTreeMap<String, u32> = Default::default();
        let mut slowest = Duration::ZERO;
        for s in starts {
            let (r, took) = s.await.context("a start task failed")?;
            slowest = slowest.max(took);
            let key = match r {
                Ok(status) => status.to_string(),
                Err(e) => format!("no answer ({e:#})"),
            };
            *answers.entry(key).or_default() += 1;
        }
        sim.faults().remove(rule);
        get.print(
            &format!(
                "GET /api/sessions/{{id}} while every cluster list takes {} s ({}/s offered)",
                args.slow_kube.as_secs_f64(),
                args.get_rate
            ),
            GET_TARGET,
        );
        print_load(load);
        let answers: Vec<String> = answers.iter().map(|(k, n)| format!("{n}× {k}")).collect();
        println!(
            "  {STARTS} starts at once meanwhile: answered {}; the slowest in {} ms",
            answers.join(", "),
            slowest.as_millis()
        );
        println!(
            "  /readyz every 100 ms meanwhile: {ready_ok} ok, {} not ok{}",
            ready_failed.len(),
            ready_failed
                .first()
                .map(|f| format!(" (first: {f})"))
                .unwrap_or_default()
        );
        if !ready_failed.is_empty() {
            println!("  readiness: FAIL (a slow cluster took the replica out of service)");
        }
        Ok(())
    }
}

/// The machine's load over a phase, under its figures (nothing where it cannot be read).
fn print_load(load: Option<machine::Load>) {
    if let Some(load) = load {
        println!("  {load}");
        if load.steal_percent() >= STEAL_NOTED {
            println!(
                "  (CPU time was stolen: a thread ready to run waited for the host, so the tail \
                 above is partly the host's)"
            );
        }
    }
}

/// Sends GETs at `rate` per second for `duration`, cycling through `targets`.
async fn open_loop(
    http: &HttpClient,
    targets: &Arc<Vec<(String, String)>>,
    rate: u32,
    duration: Duration,
) -> Sample {
    let period = Duration::from_secs_f64(1.0 / f64::from(rate));
    let total = (duration.as_secs_f64() * f64::from(rate)).round() as usize;
    let (http, targets) = (http.clone(), targets.clone());
    let answers = paced(total, period, move |i| {
        let (http, targets) = (http.clone(), targets.clone());
        async move {
            let (url, token) = &targets[i % targets.len()];
            let sent = Instant::now();
            let r = client::send(&http, Method::GET, url, Some(token), None).await;
            (sent, Instant::now(), r)
        }
    })
    .await;
    let mut sample = Sample::default();
    let answers = match answers {
        Ok(answers) => answers,
        Err(e) => {
            sample.note_error(format!("{e:#}"));
            return sample;
        }
    };
    for (at, t) in answers {
        match t {
            Ok((sent, done, r)) => {
                sample.add(at, sent, done);
                match r {
                    Ok((s, _)) if s == http::StatusCode::OK => sample.ok += 1,
                    Ok((s, body)) => {
                        sample.note_error(format!("{s}: {}", String::from_utf8_lossy(&body)))
                    }
                    Err(e) => sample.note_error(format!("{e:#}")),
                }
            }
            Err(e) => sample.note_error(format!("request task: {e}")),
        }
    }
    sample
}

/// Starts `send(i)` for each `i` in `0..total` on a task of its own at `i × period` from
/// now (plus a short lead), and returns each one's scheduled instant and outcome, in order.
///
/// The instants are kept by a thread of its own, sleeping on the OS's high-resolution timer
/// (Linux lets a sleep end up to its timer slack late, 50 µs by default), not by tokio's
/// timer: its wheel turns in whole milliseconds, so a
/// request scheduled between two ticks went out up to a millisecond late, and that lateness
/// was measured as the server's latency (answers are timed from the scheduled instant).
async fn paced<T, F, Fut>(
    total: usize,
    period: Duration,
    send: F,
) -> anyhow::Result<Vec<(Instant, Result<T, tokio::task::JoinError>)>>
where
    F: Fn(usize) -> Fut + Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let runtime = tokio::runtime::Handle::current();
    let start = Instant::now() + Duration::from_millis(20);
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("bench-pacer".into())
        .spawn(move || {
            let mut tasks = Vec::with_capacity(total);
            for i in 0..total {
                if tx.is_closed() {
                    // The phase was given up: send nothing more.
                    return;
                }
                let at = start + period.mul_f64(i as f64);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                }
                tasks.push((at, runtime.spawn(send(i))));
            }
            let _ = tx.send(tasks);
        })
        .context("starting the pacing thread")?;
    let tasks = rx.await.context("the pacing thread stopped")?;
    let mut answers = Vec::with_capacity(tasks.len());
    for (at, task) in tasks {
        answers.push((at, task.await));
    }
    Ok(answers)
}

/// Latencies of one phase.
#[derive(Default)]
struct Sample {
    /// From the scheduled instant to the whole answer read.
    latencies: Vec<Duration>,
    /// From the scheduled instant to the moment the client task started sending.
    lag: Vec<Duration>,
    /// Each request's scheduled instant and latency, in sending order (where in the phase
    /// the slow answers fell).
    points: Vec<(Instant, Duration)>,
    first: Option<Instant>,
    last: Option<Instant>,
    ok: usize,
    errors: usize,
    first_error: Option<String>,
}

impl Sample {
    fn add(&mut self, at: Instant, sent: Instant, done: Instant) {
        self.latencies.push(done.saturating_duration_since(at));
        self.points.push((at, done.saturating_duration_since(at)));
        self.lag.push(sent.saturating_duration_since(at));
        self.first = Some(self.first.map_or(at, |f| f.min(at)));
        self.last = Some(self.last.map_or(done, |l| l.max(done)));
    }

    /// How many answers took longer than `target`, counted by the second of the phase they
    /// were scheduled in (none: every answer was within it).
    fn over_by_second(&self, target: Duration) -> Option<String> {
        let first = self.first?;
        let mut by_second: std::collections::BTreeMap<u64, usize> = Default::default();
        for (at, latency) in &self.points {
            if *latency > target {
                *by_second
                    .entry(at.saturating_duration_since(first).as_secs())
                    .or_default() += 1;
            }
        }
        let over: usize = by_second.values().sum();
        (over > 0).then(|| {
            let seconds: Vec<String> = by_second
                .iter()
                .map(|(s, n)| format!("{s}s: {n}"))
                .collect();
            format!(
                "answers over {}: {over}, by second of the phase: {}",
                ms(target),
                seconds.join(", ")
            )
        })
    }

    fn note_error(&mut self, e: String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(e);
        }
    }

    fn print(&mut self, title: &str, target: Duration) {
        let n = self.latencies.len();
        let span = match (self.first, self.last) {
            (Some(f), Some(l)) => l.saturating_duration_since(f).as_secs_f64(),
            _ => 0.0,
        };
        println!("{title}");
        println!(
            "  requests {n}, ok {}, errors {}, achieved {:.1}/s",
            self.ok,
            self.errors,
            if span > 0.0 { n as f64 / span } else { 0.0 }
        );
        if let Some(e) = &self.first_error {
            println!("  first error: {}", one_line(e));
        }
        let d = Dist::of(&mut self.latencies);
        let lag = Dist::of(&mut self.lag);
        println!("  latency {d}");
        println!("  client send lag p99 {}", ms(lag.p99));
        if let Some(line) = self.over_by_second(target) {
            println!("  {line}");
        }
        println!("  {}", verdict("p99", d.p99, target, self.errors));
    }
}

fn print_delays(delays: &[Duration], unmeasured: usize, not_running: &[String]) {
    let mut d = delays.to_vec();
    println!(
        "readiness: backend delay = ready_at − later of (VMI Running, readiness marker written)"
    );
    println!(
        "  sessions running {}, not running {}, unmeasured {unmeasured}",
        delays.len() + unmeasured,
        not_running.len()
    );
    for s in not_running.iter().take(3) {
        println!("  not running: {}", one_line(s));
    }
    let dist = Dist::of(&mut d);
    println!("  delay {dist}");
    println!(
        "  {}",
        verdict(
            "p99",
            dist.p99,
            READY_TARGET,
            not_running.len() + unmeasured
        )
    );
}

pub(crate) fn verdict(what: &str, got: Duration, target: Duration, errors: usize) -> String {
    let ok = got <= target && errors == 0;
    format!(
        "{what} {} vs target ≤ {}: {}",
        ms(got),
        ms(target),
        if ok {
            "met".to_owned()
        } else if errors > 0 {
            format!("MISSED ({errors} failed)")
        } else {
            "MISSED".to_owned()
        }
    )
}

fn one_line(s: &str) -> String {
    let s: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.len() > 200 {
        format!("{}…", &s[..s.floor_char_boundary(200)])
    } else {
        s
    }
}

/// p50, p90, p99 and max of a sample (nearest rank).
pub(crate) struct Dist {
    n: usize,
    pub(crate) p50: Duration,
    p90: Duration,
    pub(crate) p99: Duration,
    max: Duration,
}

impl Dist {
    pub(crate) fn of(v: &mut [Duration]) -> Self {
        v.sort_unstable();
        let rank = |p: f64| -> Duration {
            if v.is_empty() {
                return Duration::ZERO;
            }
            let i = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
            v[i]
        };
        Self {
            n: v.len(),
            p50: rank(0.50),
            p90: rank(0.90),
            p99: rank(0.99),
            max: v.last().copied().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "n={} p50 {} p90 {} p99 {} max {}",
            self.n,
            ms(self.p50),
            ms(self.p90),
            ms(self.p99),
            ms(self.max)
        )
    }
}

pub(crate) fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Watches the VMIs of `namespace` on kube-sim and records, by name, when each was first seen
/// Running (the wall clock, comparable with the database's timestamps on this machine).
async fn watch_vmis_running(
    sim_url: &str,
    namespace: &str,
) -> anyhow::Result<Arc<Mutex<HashMap<String, DateTime<Utc>>>>> {
    let seen: Arc<Mutex<HashMap<String, DateTime<Utc>>>> = Arc::default();
    let url = format!(
        "{sim_url}/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances?watch=true"
    );
    let http = client::client(1);
    let req = http::Request::get(&url)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .context("building the watch request")?;
    let res = http
        .request(req)
        .await
        .with_context(|| format!("watching {url}"))?;
    if !res.status().is_success() {
        anyhow::bail!("watching {url}: {}", res.status());
    }
    let mut body = res.into_body();
    let out = seen.clone();
    tokio::spawn(async move {
        let mut buf = BytesMut::new();
        while let Some(Ok(frame)) = body.frame().await {
            let now = Utc::now();
            let Ok(data) = frame.into_data() else {
                continue;
            };
            buf.extend_from_slice(&data);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line = buf.split_to(nl + 1);
                let Ok(ev) = serde_json::from_slice::<serde_json::Value>(line.chunk()) else {
                    continue;
                };
                let obj = &ev["object"];
                if obj["status"]["phase"] == "Running"
                    && let Some(name) = obj["metadata"]["name"].as_str()
                {
                    out.lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .entry(name.to_owned())
                        .or_insert(now);
                }
            }
        }
    });
    Ok(seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn paced_starts_each_request_at_its_own_instant_never_before_and_in_order() {
        let period = Duration::from_millis(3);
        let called = Instant::now();
        let out = paced(20, period, |i| async move { (i, Instant::now()) })
            .await
            .unwrap();
        assert_eq!(out.len(), 20);
        for (i, (at, started)) in out.iter().enumerate() {
            let (index, started_at) = started.as_ref().unwrap();
            assert_eq!(*index, i, "outcomes come back in sending order");
            assert!(
                *started_at >= *at,
                "request {i} was sent before its instant"
            );
            assert!(*at > called);
        }
        for pair in out.windows(2) {
            let gap = pair[1].0 - pair[0].0;
            assert!(
                gap.abs_diff(period) < Duration::from_micros(1),
                "scheduled {gap:?} apart, not {period:?}"
            );
        }
    }

    #[tokio::test]
    async fn paced_sends_nothing_more_once_the_phase_is_given_up() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let sent = Arc::new(AtomicUsize::new(0));
        let counter = sent.clone();
        let phase = paced(1000, Duration::from_millis(5), move |_| {
            let counter = counter.clone();
            async move {
                counter.fetch_add(1, Ordering::SeqCst);
            }
        });
        assert!(
            tokio::time::timeout(Duration::from_millis(50), phase)
                .await
                .is_err()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let given_up = sent.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let later = sent.load(Ordering::SeqCst);
        // At most the one the thread was sleeping towards; sixty more had it gone on.
        assert!(
            later <= given_up + 1,
            "{} requests sent after the phase was given up",
            later - given_up
        );
    }
}
