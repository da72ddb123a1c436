//! `ttlabctl bench console`: the console relay's cost, measured against kube-sim's serial
//! console, a throwaway PostgreSQL and the real `ttlab-server` binary as a child process, all
//! on this machine and over loopback.
//!
//! Three figures, each against its target:
//! - keystroke echo round trip (one byte typed, its echo back) straight to kube-sim's console
//!   of one VM and through the relay to another's (a VM has one console), interleaved
//!   keystroke by keystroke: the p99 of each keystroke's relayed echo minus the straight echo
//!   beside it is ≤ 1 ms;
//! - bulk output (`yes` in the guest) through the relay: ≥ 50 MB/s, with the server's resident
//!   memory sampled throughout (flat);
//! - many idle consoles open at once through the relay (default 1,000): the server's resident
//!   memory grows by ≤ 64 MiB in all.
//!
//! The sessions are written to the database as running and their VMs created in kube-sim
//! directly (without cloud-init, so no guest agent runs): the benchmark measures the console,
//! not provisioning.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use bytes::Bytes;
use chrono::Utc;
use clap::Args;
use futures::{SinkExt as _, StreamExt as _};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_kube_sim::{KubeSim, Timings};
use ttlab_model::{Runtime, SessionId, UserId};
use ttlab_store::{NewSession, SessionTimes, SessionVm, Store, StoreOptions};

use crate::dev::demo::client::{self, HttpClient, Method};
use crate::dev::demo::stack::{self, Database};
use crate::dev::demo::{ChildProcess, checkout_dir, random_secret, wait_ready};

/// Target: what the relay may add to the keystroke round trip at p99.
const ECHO_TARGET: Duration = Duration::from_millis(1);
/// Target: bulk output through the relay, bytes per second.
const BULK_TARGET: f64 = 50e6;
/// Target: server memory growth for all idle consoles together.
const IDLE_TARGET_MIB: f64 = 64.0;
/// The environment label of the benchmark's sessions.
const ENV: &str = "bench";
/// The namespace of its VMs.
const NAMESPACE: &str = "ttlab-vms";

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// Arguments of `ttlabctl bench console`.
#[derive(Debug, Clone, Args)]
pub struct ConsoleBenchArgs {
    /// Keystrokes timed on each path (straight and through the relay).
    #[arg(long, default_value_t = 2000)]
    pub keystrokes: u32,
    /// How long bulk output is read through the relay.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub bulk_duration: Duration,
    /// Idle consoles held open at once through the relay.
    #[arg(long, default_value_t = 1000)]
    pub idle: u32,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e}"))
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: ConsoleBenchArgs) -> anyhow::Result<()> {
    if args.keystrokes == 0 || args.idle == 0 || args.bulk_duration.is_zero() {
        anyhow::bail!("--keystrokes, --idle and --bulk-duration must be positive");
    }
    let (server_bin, agent_bin) = super::api::server_and_agent().await?;
    let mut rig = Rig::default();
    let result = async {
        rig.start(&server_bin, &agent_bin).await?;
        rig.measure(&args).await
    }
    .await;
    rig.stop().await;
    result
}

#[derive(Default)]
struct Rig {
    data: Option<tempfile::TempDir>,
    database: Option<Database>,
    store: Option<Store>,
    sim: Option<KubeSim>,
    server: Option<ChildProcess>,
    url: String,
    secret: String,
    lesson: String,
}

impl Rig {
    async fn start(
        &mut self,
        server_bin: &std::path::Path,
        agent_bin: &std::path::Path,
    ) -> anyhow::Result<()> {
        self.secret = random_secret()?;
        let lessons_path = checkout_dir().join("lessons");
        let lessons = ttlab_lesson::LessonSet::load(&lessons_path)
            .with_context(|| format!("loading the lessons from {}", lessons_path.display()))?;
        self.lesson = lessons
            .iter()
            .next()
            .context("no lesson in the checkout's lessons/")?
            .id
            .to_string();
        let data = tempfile::Builder::new()
            .prefix("ttlab-bench-console-")
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
            scheduling: Duration::from_millis(10),
            boot: Duration::from_millis(50),
            setup: Duration::from_millis(50),
            stop: Duration::from_millis(50),
            gc: Duration::from_millis(1),
            pod_start: Duration::from_millis(10),
            bookmark: Duration::from_secs(60),
        };
        let sim = stack::start_sim(NAMESPACE, timings, &data_dir.join("guests")).await?;
        let kubeconfig = data_dir.join("kubeconfig");
        sim.write_kubeconfig(&kubeconfig, NAMESPACE)?;
        self.sim = Some(sim);

        let listen = SocketAddr::from((Ipv4Addr::LOCALHOST, stack::free_loopback_port()?));
        self.url = format!("http://{listen}");
        let mut env: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", database_url.into()),
            ("KUBECONFIG", kubeconfig.into()),
            ("TTLAB_ENV", ENV.into()),
            ("TTLAB_NAMESPACE", NAMESPACE.into()),
            ("TTLAB_LISTEN", listen.to_string().into()),
            ("TTLAB_AUTH_SECRET", self.secret.clone().into()),
            ("TTLAB_LESSONS", lessons_path.into_os_string()),
            ("TTLAB_AGENT_BINARY", agent_bin.as_os_str().to_owned()),
            ("TTLAB_SESSION_TTL", "60m".into()),
        ];
        if std::env::var_os("RUST_LOG").is_none() {
            env.push(("RUST_LOG", "warn".into()));
        }
        let mut server = ChildProcess::spawn("server", server_bin, &[], &env)?;
        let ready = wait_ready(&mut server, &self.url).await;
        self.server = Some(server);
        ready
    }

    async fn stop(&mut self) {
        if let Some(s) = self.server.as_mut()
            && let Err(e) = s.stop(Duration::from_secs(15)).await
        {
            eprintln!("ttlabctl: stopping the server: {e:#}");
        }
        if let Some(store) = self.store.take() {
            store.close();
        }
        if let Some(sim) = self.sim.take() {
            sim.shutdown().await;
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

    fn sim(&self) -> anyhow::Result<&KubeSim> {
        self.sim.as_ref().context("kube-sim is not running")
    }

    fn server_pid(&self) -> anyhow::Result<u32> {
        Ok(self.server.as_ref().context("no server")?.pid())
    }

    fn token(&self, user: &UserId) -> anyhow::Result<String> {
        let auth = AuthConfig::new(AuthSecret::new(self.secret.as_bytes())?);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        Ok(auth.mint(user, Role::Student, now, Duration::from_secs(3 * 3600))?)
    }

    /// A running session of user `bench-{n}` whose VM `bench-console-{n}` runs in kube-sim.
    async fn session(&self, n: u32) -> anyhow::Result<Lab> {
        let store = self.store.as_ref().context("no database")?;
        let vm = format!("bench-console-{n}");
        self.sim()?
            .create(serde_json::json!({
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachine",
                "metadata": {"name": vm, "namespace": NAMESPACE},
                "spec": {
                    "runStrategy": "Always",
                    "template": {
                        "metadata": {"labels": {"app": "bench"}},
                        "spec": {
                            "domain": {"devices": {}, "resources": {"requests": {"memory": "64Mi"}}},
                            "volumes": [{"name": "rootdisk", "containerDisk": {"image": "bench"}}]
                        }
                    }
                }
            }))
            .with_context(|| format!("creating VM {vm}"))?;
        let user: UserId = format!("bench-{n}").parse()?;
        let now = Utc::now();
        let id = SessionId::new_random();
        store
            .sessions()
            .insert(&NewSession {
                id,
                user: user.clone(),
                lesson: self.lesson.parse()?,
                runtime: Runtime::Vm,
                env: ENV.parse()?,
                site: "default".parse()?,
                times: SessionTimes {
                    started_at: now,
                    expires_at: now + chrono::TimeDelta::hours(1),
                    max_expires_at: now + chrono::TimeDelta::hours(3),
                },
                readiness_deadline: now + chrono::TimeDelta::minutes(10),
            })
            .await?;
        store
            .sessions()
            .record_vms(
                id,
                &[SessionVm {
                    node: "vm".parse()?,
                    name: vm.clone(),
                }],
            )
            .await?;
        store
            .sessions()
            .mark_running(id, None)
            .await?
            .context("the session did not become running")?;
        Ok(Lab {
            id,
            vm,
            token: self.token(&user)?,
        })
    }

    async fn wait_running(&self, labs: &[Lab]) -> anyhow::Result<()> {
        let sim = self.sim()?;
        let until = Instant::now() + Duration::from_secs(120);
        for lab in labs {
            loop {
                let phase = sim
                    .get("virtualmachineinstances", NAMESPACE, &lab.vm)
                    .and_then(|v| v["status"]["phase"].as_str().map(str::to_owned));
                if phase.as_deref() == Some("Running") {
                    break;
                }
                if Instant::now() > until {
                    anyhow::bail!("VMI {} not Running after 120 s ({phase:?})", lab.vm);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        // The console slot is registered as the VMI turns Running; give it a moment.
        tokio::time::sleep(Duration::from_millis(200)).await;
        Ok(())
    }

    /// The console straight from kube-sim (`plain.kubevirt.io`).
    async fn direct(&self, lab: &Lab) -> anyhow::Result<Ws> {
        let url = format!(
            "{}/apis/subresources.kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachineinstances/{}/console",
            self.sim()?.url().replacen("http://", "ws://", 1),
            lab.vm
        );
        let mut request = url.into_client_request()?;
        request
            .headers_mut()
            .insert("Sec-WebSocket-Protocol", "plain.kubevirt.io".parse()?);
        let (ws, _) = tokio_tungstenite::connect_async(request)
            .await
            .context("opening kube-sim's console")?;
        Ok(ws)
    }

    /// The console through the server's relay (ticket, then WebSocket).
    async fn relayed(&self, http: &HttpClient, lab: &Lab) -> anyhow::Result<Ws> {
        let (status, body) = client::send(
            http,
            Method::POST,
            &format!("{}/api/sessions/{}/console-ticket", self.url, lab.id),
            Some(&lab.token),
            None,
        )
        .await?;
        if !status.is_success() {
            anyhow::bail!(
                "console ticket: {status}: {}",
                String::from_utf8_lossy(&body)
            );
        }
        let ticket: serde_json::Value = serde_json::from_slice(&body)?;
        let path = ticket["url"].as_str().context("no url in the ticket")?;
        let url = format!("{}{path}", self.url.replacen("http://", "ws://", 1));
        let (ws, _) = tokio_tungstenite::connect_async(url)
            .await
            .context("opening the relayed console")?;
        Ok(ws)
    }

    async fn measure(&mut self, args: &ConsoleBenchArgs) -> anyhow::Result<()> {
        let http = client::client(64);
        let lab = self.session(0).await?;
        self.wait_running(std::slice::from_ref(&lab)).await?;
        let pid = self.server_pid()?;

        // 1. Keystroke echo round trip, straight and relayed, interleaved: one keystroke on
        // the straight console of one VM, then one through the relay to another (a VM has
        // one console), alternately, so both see the machine in the same state; each
        // keystroke's added delay is its relayed echo minus the straight one next to it.
        let other = self.session(args.idle + 1).await?;
        self.wait_running(std::slice::from_ref(&other)).await?;
        let mut direct = self.direct(&lab).await?;
        read_until(&mut direct, b":~# ", Duration::from_secs(10)).await?;
        let mut ws = self.relayed(&http, &other).await?;
        read_until(&mut ws, b"Press Enter", Duration::from_secs(10)).await?;
        send(&mut ws, b"\r").await?;
        read_until(&mut ws, b":~# ", Duration::from_secs(10)).await?;
        let mut straight = Vec::with_capacity(args.keystrokes as usize);
        let mut relayed = Vec::with_capacity(args.keystrokes as usize);
        let mut added: Vec<f64> = Vec::with_capacity(args.keystrokes as usize);
        for i in 0..args.keystrokes {
            if i > 0 && i % 100 == 0 {
                for c in [&mut direct, &mut ws] {
                    send(c, b"\x03").await?;
                    read_until(c, b":~# ", Duration::from_secs(5)).await?;
                }
            }
            // Alternate which path goes first, so neither always follows the other.
            let (s, r) = if i % 2 == 0 {
                let s = keystroke(&mut direct).await?;
                (s, keystroke(&mut ws).await?)
            } else {
                let r = keystroke(&mut ws).await?;
                (keystroke(&mut direct).await?, r)
            };
            straight.push(s);
            relayed.push(r);
            added.push(r.as_secs_f64() - s.as_secs_f64());
        }
        for c in [&mut direct, &mut ws] {
            send(c, b"\x03").await?;
            read_until(c, b":~# ", Duration::from_secs(5)).await?;
        }
        let _ = direct.close(None).await;
        drop(direct);
        let s = Dist::of(&mut straight);
        let r = Dist::of(&mut relayed);
        added.sort_by(f64::total_cmp);
        let pick = |p: f64| {
            let rank = ((p * added.len() as f64).ceil() as usize).clamp(1, added.len().max(1));
            added.get(rank - 1).copied().unwrap_or(f64::NAN)
        };
        let added_p99 = pick(0.99);
        println!(
            "keystroke echo round trip ({} keystrokes each, one at a time, interleaved):",
            args.keystrokes
        );
        println!("  straight to kube-sim's console:  {s}");
        println!("  through the relay (ttlab-server): {r}");
        println!(
            "  added by the relay per keystroke (relayed minus the straight one beside it): p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
            pick(0.5) * 1000.0,
            added_p99 * 1000.0,
            added.last().copied().unwrap_or(f64::NAN) * 1000.0
        );
        println!(
            "  added by the relay, p99 of the per-keystroke differences: {:.3} ms (target ≤ {}) {}",
            added_p99 * 1000.0,
            ms(ECHO_TARGET),
            if added_p99 <= ECHO_TARGET.as_secs_f64() {
                "met"
            } else {
                "MISSED"
            }
        );

        // 2. Bulk output through the relay, memory sampled throughout.
        let rss_before = rss_kib(pid)?;
        send(&mut ws, b"yes\r").await?;
        let started = Instant::now();
        let mut bytes: u64 = 0;
        let mut samples = vec![rss_before];
        let mut next_sample = started + Duration::from_millis(250);
        while started.elapsed() < args.bulk_duration {
            match tokio::time::timeout(Duration::from_secs(5), ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => bytes += b.len() as u64,
                Ok(Some(Ok(_))) => {}
                other => anyhow::bail!("bulk output stopped: {other:?}"),
            }
            if Instant::now() >= next_sample {
                samples.push(rss_kib(pid)?);
                next_sample += Duration::from_millis(250);
            }
        }
        let took = started.elapsed();
        send(&mut ws, b"\x03").await?;
        read_until(&mut ws, b"^C\r\n", Duration::from_secs(30)).await?;
        let rate = bytes as f64 / took.as_secs_f64();
        let (low, high) = (
            samples.iter().min().copied().unwrap_or(0),
            samples.iter().max().copied().unwrap_or(0),
        );
        println!(
            "bulk output through the relay (`yes` for {:.1} s):",
            took.as_secs_f64()
        );
        println!(
            "  {:.1} MB/s ({} MB) (target ≥ {:.0} MB/s) {}",
            rate / 1e6,
            bytes / 1_000_000,
            BULK_TARGET / 1e6,
            if rate >= BULK_TARGET { "met" } else { "MISSED" }
        );
        println!(
            "  server resident memory: {:.1} MiB before, {:.1}–{:.1} MiB during ({} samples), spread {:.1} MiB",
            mib(rss_before),
            mib(low),
            mib(high),
            samples.len(),
            mib(high - low)
        );
        let _ = ws.close(None).await;
        drop(ws);

        // 3. Many idle consoles.
        let mut labs = Vec::with_capacity(args.idle as usize);
        for n in 1..=args.idle {
            labs.push(self.session(n).await?);
        }
        self.wait_running(&labs).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = rss_kib(pid)?;
        let opened = Instant::now();
        let mut consoles = Vec::with_capacity(labs.len());
        for chunk in labs.chunks(50) {
            let opening = chunk.iter().map(|lab| async {
                let mut ws = self.relayed(&http, lab).await?;
                read_until(
                    &mut ws,
                    b"Connected to the console",
                    Duration::from_secs(30),
                )
                .await?;
                anyhow::Ok(ws)
            });
            for ws in futures::future::join_all(opening).await {
                consoles.push(ws?);
            }
        }
        let opening_took = opened.elapsed();
        tokio::time::sleep(Duration::from_secs(2)).await;
        let after = rss_kib(pid)?;
        let growth = mib(after.saturating_sub(before));
        println!(
            "{} idle consoles through the relay (opened in {:.1} s):",
            consoles.len(),
            opening_took.as_secs_f64()
        );
        println!(
            "  server resident memory {:.1} → {:.1} MiB: +{growth:.1} MiB, {:.1} KiB per console (target ≤ {IDLE_TARGET_MIB:.0} MiB in all) {}",
            mib(before),
            mib(after),
            after.saturating_sub(before) as f64 / consoles.len() as f64,
            if growth <= IDLE_TARGET_MIB {
                "met"
            } else {
                "MISSED"
            }
        );
        for mut ws in consoles {
            let _ = ws.close(None).await;
        }
        Ok(())
    }
}

struct Lab {
    id: SessionId,
    vm: String,
    token: String,
}

async fn send(ws: &mut Ws, bytes: &'static [u8]) -> anyhow::Result<()> {
    ws.send(Message::Binary(Bytes::from_static(bytes)))
        .await
        .context("sending to the console")
}

/// Reads until `needle` has been seen (in the bytes received since the call).
async fn read_until(ws: &mut Ws, needle: &[u8], within: Duration) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    let mut seen: Vec<u8> = Vec::new();
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .with_context(|| {
                format!("no {:?} within {within:?}", String::from_utf8_lossy(needle))
            })?;
        match msg {
            Some(Ok(Message::Binary(b))) => {
                seen.extend_from_slice(&b);
                if seen.windows(needle.len()).any(|w| w == needle) {
                    return Ok(());
                }
                if seen.len() > 1 << 20 {
                    let keep = seen.len() - needle.len();
                    seen.drain(..keep);
                }
            }
            Some(Ok(Message::Close(c))) => anyhow::bail!("the console closed: {c:?}"),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e).context("reading the console"),
            None => anyhow::bail!("the console closed"),
        }
    }
}

/// Types `x` `count` times, one at a time, timing each echo; clears the line every 100.
/// One keystroke typed and its echo read back: the round trip.
async fn keystroke(ws: &mut Ws) -> anyhow::Result<Duration> {
    let started = Instant::now();
    send(ws, b"x").await?;
    read_until(ws, b"x", Duration::from_secs(5)).await?;
    Ok(started.elapsed())
}

/// Resident memory of `pid`, KiB.
fn rss_kib(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .context("no VmRSS in /proc/<pid>/status")
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1000.0)
}

struct Dist {
    p50: Duration,
    p99: Duration,
    max: Duration,
}

impl Dist {
    fn of(v: &mut [Duration]) -> Self {
        v.sort_unstable();
        let pick = |p: f64| {
            let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
            v.get(rank - 1).copied().unwrap_or_default()
        };
        Self {
            p50: pick(0.5),
            p99: pick(0.99),
            max: v.last().copied().unwrap_or_default(),
        }
    }
}

impl std::fmt::Display for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "p50 {}  p99 {}  max {}",
            ms(self.p50),
            ms(self.p99),
            ms(self.max)
        )
    }
}
