//! `ttlabctl bench reaper`: the reaper's figures, measured against kube-sim over HTTP (the
//! real `KubeCluster`) and a throwaway PostgreSQL (or `DATABASE_URL`), on this machine.
//!
//! - Detection: sessions with expiries spread over a window, the reaper's real scheduler
//!   running and the KubeVirt simulation running (VMIs, their finalizers, the guest's shutdown
//!   grace); for each, the delay from `expires_at` to its VM's delete request reaching
//!   kube-sim (target p99 ≤ 1 s) and to the VM being gone (target p99 ≤ 1 s plus the grace).
//! - Throughput: expired sessions reclaimed with latency injected into every API call, at the
//!   configured concurrency and at concurrency 1 in the same run (target ≤ 4 s, ≥ 10×).
//! - Scale: live VMs plus finished rows; a cycle with nothing to do, every run printed, its
//!   median and worst (target median ≤ 1 s), and the resident memory of the real
//!   `ttlab-reaper` binary running that cycle (target < 150 MB).
//!
//! In the throughput and scale phases KubeVirt is paused in the simulation (VMs are objects
//! only: no VMIs, no guests), so those figures are the reaper's and the API's, not the
//! simulated guests'. The Secrets of this benchmark are small placeholders: `bench real`
//! measures with the rendered ones on a real API server.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use chrono::{DateTime, TimeDelta, Utc};
use clap::Args;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ttlab_cluster::{ClusterSettings, KubeCluster, ProvisionCluster as _};
use ttlab_kube_sim::{KubeSim, SimConfig, Verb};
use ttlab_model::labels::ObjectLabels;
use ttlab_model::{
    EnvName, FinalStatus, NodeName, Runtime, SessionId, SessionStatus, SiteName, UserId,
};
use ttlab_reaper::{Metrics, ReaperContext, ReaperSettings, reap_once};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, SessionTimes, SessionVm, Store};

use super::{percentile, verdict};

const NS: &str = "ttlab";
const ENV: &str = "bench";

/// Arguments of `ttlabctl bench reaper`.
#[derive(Debug, Clone, Args)]
pub struct ReaperBenchArgs {
    /// Sessions of the detection phase.
    #[arg(long, default_value_t = 200)]
    pub sessions: usize,
    /// The window their expiries are spread over.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub spread: Duration,
    /// Expired sessions of the throughput phase (each run).
    #[arg(long, default_value_t = 1000)]
    pub expired: usize,
    /// Latency injected into every API call in the throughput phase.
    #[arg(long, default_value = "20ms", value_parser = humantime::parse_duration)]
    pub latency: Duration,
    /// The reaper's concurrency in the throughput phase (compared with 1).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Live VMs of the scale phase.
    #[arg(long, default_value_t = 10_000)]
    pub live_vms: usize,
    /// Finished rows of the scale phase.
    #[arg(long, default_value_t = 100_000)]
    pub finished: usize,
    /// The `ttlab-reaper` binary measured in the scale phase (default: next to ttlabctl).
    #[arg(long, value_name = "PATH")]
    pub reaper_binary: Option<PathBuf>,
    /// The simulated guest's shutdown grace in the detection phase (deleted VMI → gone).
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub shutdown_grace: Duration,
    /// No-op cycles of the scale phase (each printed).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Phases to skip (detection, throughput, scale), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
}

struct Bench {
    _db: TestDb,
    db_url: String,
    store: Store,
    sim: KubeSim,
    cluster: Arc<KubeCluster>,
    dir: tempfile::TempDir,
    env: EnvName,
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: ReaperBenchArgs) -> anyhow::Result<()> {
    let db = TestDb::new().await.context("starting PostgreSQL")?;
    let store = db.store().await?;
    let mut config = SimConfig::for_tests();
    config.namespaces.push(NS.into());
    config.namespaces.dedup();
    config.timings.stop = args.shutdown_grace;
    let sim = KubeSim::start(config).await?;
    let dir = tempfile::tempdir()?;
    sim.write_kubeconfig(&dir.path().join("kubeconfig"), NS)?;
    let cluster = Arc::new(
        KubeCluster::from_kubeconfig(
            &dir.path().join("kubeconfig"),
            ClusterSettings::in_namespace(NS),
        )
        .await?,
    );
    let b = Bench {
        db_url: db.url().to_owned(),
        _db: db,
        store,
        sim,
        cluster,
        dir,
        env: ENV.parse()?,
    };
    println!(
        "ttlabctl bench reaper ({} build, kube-sim over HTTP; PostgreSQL {})",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        b.store.target()
    );
    let skip = |p: &str| args.skip.iter().any(|s| s == p);
    if !skip("detection") {
        detection(&b, &args).await?;
    }
    // From here on VMs are objects only.
    b.sim.pause_kubevirt(true);
    if !skip("throughput") {
        throughput(&b, &args).await?;
    }
    if !skip("scale") {
        scale(&b, &args).await?;
    }
    b.store.close();
    b.sim.shutdown().await;
    Ok(())
}

impl Bench {
    fn ctx(&self, concurrency: usize) -> ReaperContext {
        ReaperContext::new(self.store.clone(), self.cluster.clone(), self.env.clone())
            .with_settings(ReaperSettings {
                concurrency,
                ..ReaperSettings::default()
            })
    }

    /// Opens a running single-VM session expiring at `expires_at`, and creates its VM and
    /// cloud-init Secret (unless `objects` is false).
    async fn session(&self, expires_at: DateTime<Utc>, objects: bool) -> anyhow::Result<SessionId> {
        let cluster = objects.then_some(self.cluster.as_ref());
        open_session(
            &self.store,
            cluster,
            &self.env,
            &"default".parse()?,
            expires_at,
        )
        .await
    }

    async fn sessions(
        &self,
        expiries: Vec<DateTime<Utc>>,
        objects: bool,
    ) -> anyhow::Result<Vec<SessionId>> {
        let results: Vec<anyhow::Result<SessionId>> = futures::stream::iter(expiries)
            .map(|e| self.session(e, objects))
            .buffer_unordered(32)
            .collect()
            .await;
        results.into_iter().collect()
    }
}

async fn detection(b: &Bench, args: &ReaperBenchArgs) -> anyhow::Result<()> {
    let n = args.sessions.max(1);
    let lead = Duration::from_secs(5) + Duration::from_millis(20 * n as u64);
    let now = b.store.db_now().await?;
    let first = now + TimeDelta::from_std(lead)?;
    let step = args.spread.as_secs_f64() / n as f64;
    let expiries: Vec<DateTime<Utc>> = (0..n)
        .map(|i| first + TimeDelta::microseconds((step * i as f64 * 1e6) as i64))
        .collect();
    let ids = b.sessions(expiries, true).await?;
    wait_vmis(b, &ids).await?;
    b.sim.faults().clear_calls();
    // When each VM is gone: polled in process every 10 ms.
    let names: Vec<String> = ids
        .iter()
        .map(|id| ttlab_vm_manifest::vm_name(*id, &"vm".parse().expect("a node name")))
        .collect();
    let watching = std::sync::atomic::AtomicBool::new(true);
    let ctx = b.ctx(16);
    let metrics = Arc::new(Metrics::new());
    let shutdown = ctx.shutdown.clone();
    let reaper = tokio::spawn(ttlab_reaper::run(ctx, Duration::from_secs(60), metrics));
    let give_up = Instant::now() + lead + args.spread + Duration::from_secs(70);
    let wait = async {
        loop {
            let live = b.store.sessions().count_live(&b.env).await?;
            let gone = b.sim.stats().vms == 0;
            if (live == 0 && gone) || Instant::now() > give_up {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        watching.store(false, std::sync::atomic::Ordering::Relaxed);
        anyhow::Ok(())
    };
    let (waited, gone_at) = tokio::join!(wait, watch_gone(&b.sim, &names, &watching));
    shutdown.cancel();
    let _ = reaper.await;
    waited?;
    // The first delete of each VM (a VM still terminating is deleted again by later cycles).
    let mut deletes: std::collections::BTreeMap<String, DateTime<Utc>> =
        std::collections::BTreeMap::new();
    for c in b.sim.calls() {
        if c.verb != Verb::Delete || c.resource != "virtualmachines" {
            continue;
        }
        let (Some(name), Ok(at)) = (c.name, DateTime::parse_from_rfc3339(&c.at)) else {
            continue;
        };
        let at = at.with_timezone(&Utc);
        deletes
            .entry(name)
            .and_modify(|first| *first = (*first).min(at))
            .or_insert(at);
    }
    let mut delays = Vec::new();
    let mut gone_delays = Vec::new();
    let (mut missing, mut not_gone) = (0, 0);
    for id in &ids {
        let s = b.store.sessions().get(*id).await?.context("session row")?;
        let vm = ttlab_vm_manifest::vm_name(*id, &"vm".parse()?);
        let since =
            |at: &DateTime<Utc>| (*at - s.expires_at).num_microseconds().unwrap_or(0) as f64 / 1e6;
        match deletes.get(&vm) {
            Some(at) => delays.push(since(at)),
            None => missing += 1,
        }
        match gone_at.get(&vm) {
            Some(at) => gone_delays.push(since(at)),
            None => not_gone += 1,
        }
    }
    delays.sort_by(f64::total_cmp);
    gone_delays.sort_by(f64::total_cmp);
    let p99 = percentile(&delays, 99.0);
    let gone_p99 = percentile(&gone_delays, 99.0);
    let grace = args.shutdown_grace.as_secs_f64();
    println!(
        "detection: {n} sessions, expiries spread over {:?}, scheduler running (interval 60s), \
         KubeVirt simulated (VMIs Running, finalizers, shutdown grace {grace:.1}s)",
        args.spread
    );
    println!(
        "  expires_at -> VM delete accepted by kube-sim: p50 {:.3}s  p99 {:.3}s  max {:.3}s  min {:.3}s  (not deleted: {missing})",
        percentile(&delays, 50.0),
        p99,
        delays.last().copied().unwrap_or(f64::NAN),
        delays.first().copied().unwrap_or(f64::NAN),
    );
    println!(
        "  expires_at -> VM gone (VMI shut down, finalizers released): p50 {:.3}s  p99 {:.3}s  max {:.3}s  min {:.3}s  (not gone: {not_gone})",
        percentile(&gone_delays, 50.0),
        gone_p99,
        gone_delays.last().copied().unwrap_or(f64::NAN),
        gone_delays.first().copied().unwrap_or(f64::NAN),
    );
    println!(
        "  target delete accepted p99 <= 1s: {}; target gone p99 <= 1s + grace ({:.1}s): {}",
        verdict(p99 <= 1.0 && missing == 0),
        1.0 + grace,
        verdict(gone_p99 <= 1.0 + grace && not_gone == 0)
    );
    Ok(())
}

async fn throughput(b: &Bench, args: &ReaperBenchArgs) -> anyhow::Result<()> {
    let mut timings = Vec::new();
    for concurrency in [args.concurrency, 1] {
        b.sim.faults().set_latency(Duration::ZERO);
        let now = b.store.db_now().await?;
        let expiries = vec![now - TimeDelta::seconds(1); args.expired];
        b.sessions(expiries, true).await?;
        b.sim.faults().set_latency(args.latency);
        let ctx = b.ctx(concurrency);
        let started = Instant::now();
        let report = reap_once(&ctx).await;
        let took = started.elapsed();
        b.sim.faults().set_latency(Duration::ZERO);
        let left = b.store.sessions().count_live(&b.env).await?;
        println!(
            "throughput: {} expired sessions, {:?} per API call, concurrency {concurrency}: {:.2}s ({} reclaimed, {} failed, {left} left live)",
            args.expired,
            args.latency,
            took.as_secs_f64(),
            report.expired.done,
            report.expired.failed
        );
        timings.push(took);
    }
    let fast = timings[0].as_secs_f64();
    let ratio = timings[1].as_secs_f64() / fast;
    println!(
        "  concurrency {} vs 1: {ratio:.1}x faster",
        args.concurrency
    );
    println!(
        "  target <= 4s: {}; target >= 10x: {}",
        verdict(fast <= 4.0),
        verdict(ratio >= 10.0)
    );
    Ok(())
}

async fn scale(b: &Bench, args: &ReaperBenchArgs) -> anyhow::Result<()> {
    let setup = Instant::now();
    let now = b.store.db_now().await?;
    // Finished rows: opened and finished by the student, objects never created.
    let finished: Vec<anyhow::Result<()>> = futures::stream::iter(0..args.finished)
        .map(|_| async {
            let id = b.session(now + TimeDelta::minutes(30), false).await?;
            let sessions = b.store.sessions();
            sessions
                .begin_finishing(id, &[SessionStatus::Running], FinalStatus::Finished, None)
                .await?;
            sessions.complete_finishing(id).await?;
            Ok(())
        })
        .buffer_unordered(32)
        .collect()
        .await;
    finished.into_iter().collect::<anyhow::Result<()>>()?;
    let live: Vec<DateTime<Utc>> = vec![now + TimeDelta::minutes(50); args.live_vms];
    b.sessions(live, true).await?;
    println!(
        "scale: {} live VMs (+ their Secrets) and {} finished rows, set up in {:.0}s",
        args.live_vms,
        args.finished,
        setup.elapsed().as_secs_f64()
    );
    let ctx = b.ctx(16);
    let mut took = Vec::new();
    for _ in 0..args.runs.max(1) {
        let report = reap_once(&ctx).await;
        anyhow::ensure!(
            report.ran() && report.cluster_listed,
            "the cycle did not run: {report:?}"
        );
        let acted =
            report.expired.done + report.orphans.done + report.ghosts.done + report.stuck.done;
        anyhow::ensure!(acted == 0, "a no-op cycle acted: {}", report.summary());
        took.push(report.duration.as_secs_f64());
    }
    println!(
        "  no-op cycle (in process, {} runs): {}",
        took.len(),
        took.iter()
            .map(|t| format!("{t:.3}s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let (median, worst) = median_and_worst(&took);
    println!(
        "  median {median:.3}s, worst {worst:.3}s; target median <= 1s: {}",
        verdict(median <= 1.0)
    );
    measure_binary(b, args).await
}

/// Runs the real `ttlab-reaper` over the same state until its first cycle is recorded, then
/// reads its peak resident memory and stops it.
async fn measure_binary(b: &Bench, args: &ReaperBenchArgs) -> anyhow::Result<()> {
    let binary = match &args.reaper_binary {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the directory of ttlabctl")?
            .join("ttlab-reaper"),
    };
    if !binary.exists() {
        println!(
            "  reaper binary: not found at {} (build it with cargo build -p ttlab-reaper-bin); memory not measured",
            binary.display()
        );
        return Ok(());
    }
    let before = b
        .store
        .reaper_cycles()
        .recent(Some(&b.env), 1)
        .await?
        .first()
        .map(|c| c.id);
    let mut child = tokio::process::Command::new(&binary)
        .env("DATABASE_URL", &b.db_url)
        .env("KUBECONFIG", b.dir.path().join("kubeconfig"))
        .env("TTLAB_ENV", ENV)
        .env("TTLAB_NAMESPACE", NS)
        .env("TTLAB_METRICS_LISTEN", "127.0.0.1:0")
        .env("TTLAB_REAP_INTERVAL", "1h")
        .env("RUST_LOG", "warn")
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", binary.display()))?;
    let pid = child.id().context("reaper pid")?;
    let give_up = Instant::now() + Duration::from_secs(120);
    let cycle = loop {
        let latest = b.store.reaper_cycles().recent(Some(&b.env), 1).await?;
        if let Some(c) = latest.into_iter().next()
            && Some(c.id) != before
        {
            break Some(c);
        }
        if Instant::now() > give_up {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
    };
    let _ = child.start_kill();
    let _ = child.wait().await;
    match (cycle, field("VmHWM:"), field("VmRSS:")) {
        (Some(c), Some(hwm), Some(rss)) => {
            println!(
                "  ttlab-reaper binary ({}): first cycle {} ms, peak resident {:.1} MB (now {:.1} MB)",
                binary.display(),
                c.cycle.duration.as_millis(),
                hwm as f64 / 1024.0,
                rss as f64 / 1024.0
            );
            println!(
                "  target < 150 MB: {}",
                verdict((hwm as f64 / 1024.0) < 150.0)
            );
        }
        _ => println!("  ttlab-reaper binary: no cycle recorded within 120 s; memory not measured"),
    }
    Ok(())
}

/// The median and the largest of `runs` (NaN for none).
pub(crate) fn median_and_worst(runs: &[f64]) -> (f64, f64) {
    let mut sorted = runs.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    };
    (median, sorted.last().copied().unwrap_or(f64::NAN))
}

/// Waits until the VMI of each session's VM is Running in kube-sim.
async fn wait_vmis(b: &Bench, ids: &[SessionId]) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(120);
    for id in ids {
        let vm = ttlab_vm_manifest::vm_name(*id, &"vm".parse()?);
        loop {
            let phase = b
                .sim
                .get("virtualmachineinstances", NS, &vm)
                .and_then(|v| v["status"]["phase"].as_str().map(str::to_owned));
            if phase.as_deref() == Some("Running") {
                break;
            }
            anyhow::ensure!(
                Instant::now() < until,
                "VMI {vm} not Running after 120 s ({phase:?})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(())
}

/// Polls `names` every 10 ms while `running`, recording when each VM was first seen absent.
async fn watch_gone(
    sim: &KubeSim,
    names: &[String],
    running: &std::sync::atomic::AtomicBool,
) -> std::collections::BTreeMap<String, DateTime<Utc>> {
    let mut gone = std::collections::BTreeMap::new();
    while running.load(std::sync::atomic::Ordering::Relaxed) && gone.len() < names.len() {
        for name in names {
            if !gone.contains_key(name) && sim.get("virtualmachines", NS, name).is_none() {
                gone.insert(name.clone(), Utc::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    gone
}

/// Opens a running single-VM session of `env` on `site` expiring at `expires_at`, and creates
/// its VM and cloud-init Secret through `cluster` (none without one): what the reaper's
/// benchmarks reclaim.
pub(crate) async fn open_session(
    store: &Store,
    cluster: Option<&KubeCluster>,
    env: &EnvName,
    site: &SiteName,
    expires_at: DateTime<Utc>,
) -> anyhow::Result<SessionId> {
    let id = SessionId::new_random();
    let node: NodeName = "vm".parse()?;
    let started_at = expires_at - TimeDelta::minutes(60);
    let sessions = store.sessions();
    sessions
        .insert(&NewSession {
            id,
            user: UserId::new(format!("u-{}", id.simple()))?,
            lesson: "bench".parse()?,
            runtime: Runtime::Vm,
            env: env.clone(),
            site: site.clone(),
            times: SessionTimes {
                started_at,
                expires_at,
                max_expires_at: started_at + TimeDelta::minutes(180),
            },
            readiness_deadline: started_at + TimeDelta::minutes(5),
        })
        .await?;
    let vm = ttlab_vm_manifest::vm_name(id, &node);
    sessions
        .record_vms(
            id,
            &[SessionVm {
                node: node.clone(),
                name: vm.clone(),
            }],
        )
        .await?;
    sessions.mark_running(id, None).await?;
    if let Some(cluster) = cluster {
        let labels = ObjectLabels::new(id, env.clone(), "bench".parse()?, Some(node.clone()));
        let map = serde_json::to_value(labels.to_map())?;
        let created = cluster
            .create_vm(serde_json::json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"name": vm, "labels": map},
                "spec": {"runStrategy": "RerunOnFailure", "template": {"metadata": {"labels": map}, "spec": {
                    "domain": {"devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}]},
                               "resources": {"requests": {"memory": "128Mi"}}},
                    "volumes": [{"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/debian:12"}}]}}}
            }))
            .await?;
        cluster
            .create_secret(Secret {
                metadata: ObjectMeta {
                    name: Some(ttlab_vm_manifest::secret_name(id, &node)),
                    labels: Some(labels.to_map()),
                    owner_references: Some(vec![created.owner_reference()]),
                    ..ObjectMeta::default()
                },
                string_data: Some(
                    [("userdata".to_owned(), "#cloud-config\n{}\n".to_owned())].into(),
                ),
                ..Secret::default()
            })
            .await?;
    }
    Ok(id)
}
