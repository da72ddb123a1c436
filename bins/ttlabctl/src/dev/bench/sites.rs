//! `ttlabctl bench sites`: ttlab over several sites, each site a kube-sim of its own spoken to
//! over HTTP (the real `KubeCluster`), with a throwaway PostgreSQL, on this machine.
//!
//! - `placement`: "Start lab" answered by the real `ttlab-server`, one start after another,
//!   with a sites file of one site and then of every site (each with room); the p99 of click →
//!   `202` of each and the difference, the start's added placement latency (target ≤ 5 ms).
//! - `noop`: `--vms-per-site` live sessions on every site (1,000 over 10 sites by default, each
//!   with its VM and Secret); the reaper's cycle with nothing to do over every site, the
//!   sites' cycles side by side as the binary runs them (target median ≤ 1 s, worst printed),
//!   and the peak resident memory of the real `ttlab-reaper` over the same state once every
//!   site's first cycle is recorded (target < 150 MB).
//! - `slow`: one site answers every API call only after `--slow` (30 s); sessions expire on
//!   every site while the real `ttlab-reaper` runs; expiry → VM delete accepted on the healthy
//!   sites (target p99 ≤ 1 s), and what became of the slow site's.
//!
//! KubeVirt is paused in the simulations (VMs are objects only: no VMIs, no guests), so the
//! figures are ttlab's and the API's, not the simulated guests'.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use chrono::{DateTime, TimeDelta, Utc};
use clap::Args;
use futures::StreamExt as _;
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_cluster::{ClusterSettings, KubeCluster};
use ttlab_kube_sim::{FaultAction, FaultRule, KubeSim, SimConfig, Verb};
use ttlab_model::{EnvName, SessionId, SiteName, UserId};
use ttlab_reaper::{ReaperContext, reap_once};
use ttlab_store::Store;
use ttlab_store::testing::TestDb;

use super::reaper::{median_and_worst, open_session};
use super::{percentile, verdict};
use crate::dev::demo::client::{self, Method};
use crate::dev::demo::{ChildProcess, checkout_dir, random_secret, wait_ready};

/// The namespace of every site's VMs.
const NS: &str = "ttlab-vms";
/// The environment of the reaper's phases.
const ENV: &str = "bench";
/// The lesson started in the placement phase.
const LESSON: &str = "systemd-basics";

/// Arguments of `ttlabctl bench sites`.
#[derive(Debug, Clone, Args)]
pub struct SitesBenchArgs {
    /// Sites, each a kube-sim of its own (2 to 26).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u8).range(2..=26))]
    pub sites: u8,
    /// Live sessions (a VM and a Secret each) on every site in the noop and slow phases.
    #[arg(long, default_value_t = 100)]
    pub vms_per_site: usize,
    /// Starts measured with each sites file in the placement phase.
    #[arg(long, default_value_t = 200)]
    pub starts: usize,
    /// Sessions expiring on every site in the slow phase.
    #[arg(long, default_value_t = 20)]
    pub expiring_per_site: usize,
    /// How long the slow site takes to answer every call.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub slow: Duration,
    /// No-op cycles over every site measured in process.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Phases to skip (placement, noop, slow), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
    /// The `ttlab-server` binary (default: next to ttlabctl).
    #[arg(long)]
    pub server_binary: Option<PathBuf>,
    /// The `ttlab-reaper` binary (default: next to ttlabctl).
    #[arg(long)]
    pub reaper_binary: Option<PathBuf>,
}

/// One site: its name, its kube-sim, a kubeconfig and a client of it.
struct BenchSite {
    name: SiteName,
    sim: KubeSim,
    kubeconfig: PathBuf,
    cluster: Arc<KubeCluster>,
}

/// Everything the phases share.
struct Bench {
    db: TestDb,
    store: Store,
    sites: Vec<BenchSite>,
    dir: tempfile::TempDir,
    env: EnvName,
}

/// Runs the benchmark's phases and prints their figures.
pub async fn run(args: SitesBenchArgs) -> anyhow::Result<()> {
    let db = TestDb::new().await.context("starting PostgreSQL")?;
    let store = db.store().await?;
    let dir = tempfile::tempdir()?;
    let mut sites = Vec::new();
    for i in 0..args.sites {
        let name: SiteName = format!("site-{}", char::from(b'a' + i)).parse()?;
        let mut config = SimConfig::for_tests();
        config.namespaces.push(NS.into());
        config.namespaces.dedup();
        let sim = KubeSim::start(config)
            .await
            .with_context(|| format!("starting the kube-sim of {name}"))?;
        sim.pause_kubevirt(true);
        let kubeconfig = dir.path().join(format!("{name}.kubeconfig"));
        sim.write_kubeconfig(&kubeconfig, NS)?;
        let cluster = Arc::new(
            KubeCluster::from_kubeconfig(&kubeconfig, ClusterSettings::in_namespace(NS)).await?,
        );
        sites.push(BenchSite {
            name,
            sim,
            kubeconfig,
            cluster,
        });
    }
    let b = Bench {
        db,
        store,
        sites,
        dir,
        env: ENV.parse()?,
    };
    println!(
        "ttlabctl bench sites ({} build; {} sites, each a kube-sim over HTTP; PostgreSQL {})",
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        b.sites.len(),
        b.store.target()
    );
    let skip = |p: &str| args.skip.iter().any(|s| s == p);
    let result = async {
        if !skip("placement") {
            b.placement(&args).await?;
        }
        if !skip("noop") || !skip("slow") {
            b.live_sessions(&args).await?;
        }
        if !skip("noop") {
            b.noop(&args).await?;
        }
        if !skip("slow") {
            b.slow_site(&args).await?;
        }
        anyhow::Ok(())
    }
    .await;
    b.store.close();
    for site in b.sites {
        site.sim.shutdown().await;
    }
    result
}

impl Bench {
    /// A sites file naming `sites`, each with `vm_limit` places, its agents reached through
    /// its API server.
    fn sites_file(
        &self,
        file: &str,
        sites: &[&BenchSite],
        vm_limit: usize,
    ) -> anyhow::Result<PathBuf> {
        let mut text = String::from("sites:\n");
        for s in sites {
            text.push_str(&format!(
                "  - name: {}\n    kubeconfig: {}\n    namespace: {NS}\n    vm_limit: {vm_limit}\n",
                s.name,
                serde_json::to_string(&s.kubeconfig.display().to_string())?
            ));
        }
        let path = self.dir.path().join(file);
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// "Start lab" one after another through the real server, with one site and with every
    /// site; prints the p99 of each and their difference.
    async fn placement(&self, args: &SitesBenchArgs) -> anyhow::Result<()> {
        let limit = args.starts + args.vms_per_site + 100;
        let one = self.sites_file("one-site.yaml", &[&self.sites[0]], limit)?;
        let all: Vec<&BenchSite> = self.sites.iter().collect();
        let every = self.sites_file("every-site.yaml", &all, limit)?;
        let single = self.starts_with(args, &one, "place-one").await?;
        let many = self.starts_with(args, &every, "place-all").await?;
        let (p99_one, p99_all) = (percentile(&single, 99.0), percentile(&many, 99.0));
        println!(
            "placement: {} starts one after another through ttlab-server, click -> 202 (the row written, the site chosen):",
            args.starts
        );
        println!(
            "  1 site:   p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
            percentile(&single, 50.0),
            p99_one,
            single.last().copied().unwrap_or(f64::NAN)
        );
        println!(
            "  {} sites: p50 {:.1} ms  p99 {:.1} ms  max {:.1} ms",
            self.sites.len(),
            percentile(&many, 50.0),
            p99_all,
            many.last().copied().unwrap_or(f64::NAN)
        );
        let added = p99_all - p99_one;
        println!(
            "  added by placement over {} sites: p99 {added:+.1} ms; target <= 5 ms: {}",
            self.sites.len(),
            verdict(added <= 5.0)
        );
        Ok(())
    }

    /// Runs a server with `sites_file` in environment `env`, sends `args.starts` starts (after
    /// ten not counted) one after another, and returns their latencies in ms, sorted.
    async fn starts_with(
        &self,
        args: &SitesBenchArgs,
        sites_file: &Path,
        env: &str,
    ) -> anyhow::Result<Vec<f64>> {
        let server_bin = match &args.server_binary {
            Some(p) => p.clone(),
            None => super::real::beside_me("ttlab-server")?,
        };
        let agent_bin = super::real::beside_me("ttlab-agent")?;
        let secret = random_secret()?;
        let listen = SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            crate::dev::demo::stack::free_loopback_port()?,
        ));
        let url = format!("http://{listen}");
        let mut vars: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", self.db.url().into()),
            ("TTLAB_SITES", sites_file.into()),
            ("TTLAB_ENV", env.into()),
            ("TTLAB_LISTEN", listen.to_string().into()),
            ("TTLAB_AUTH_SECRET", secret.clone().into()),
            ("TTLAB_LESSONS", checkout_dir().join("lessons").into()),
            ("TTLAB_AGENT_BINARY", agent_bin.into()),
            ("TTLAB_SESSION_TTL", "60m".into()),
            // One start after another: the per-user limits never apply (a user each).
            ("NO_COLOR", "1".into()),
        ];
        if std::env::var_os("RUST_LOG").is_none() {
            vars.push(("RUST_LOG", "error".into()));
        }
        let mut server = ChildProcess::spawn("server", &server_bin, &[], &vars)?;
        let result = async {
            wait_ready(&mut server, &url).await?;
            let auth = AuthConfig::new(AuthSecret::new(secret.as_bytes())?);
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs();
            let http = client::client(4);
            let post = format!("{url}/api/sessions");
            let body = serde_json::json!({ "lesson": LESSON });
            let mut took = Vec::new();
            for i in 0..args.starts + 10 {
                let user =
                    UserId::new(format!("{env}-{i:05}")).map_err(|e| anyhow::anyhow!("{e}"))?;
                let token = auth.mint(&user, Role::Student, now, Duration::from_secs(3600))?;
                let t0 = Instant::now();
                let (status, answer) =
                    client::send(&http, Method::POST, &post, Some(&token), Some(&body)).await?;
                let ms = t0.elapsed().as_secs_f64() * 1000.0;
                anyhow::ensure!(
                    status == http::StatusCode::ACCEPTED,
                    "start {i} with {}: {status} {}",
                    sites_file.display(),
                    String::from_utf8_lossy(&answer)
                );
                if i >= 10 {
                    took.push(ms);
                }
            }
            took.sort_by(f64::total_cmp);
            anyhow::Ok(took)
        }
        .await;
        if let Err(e) = server.stop(Duration::from_secs(15)).await {
            eprintln!("ttlabctl: stopping the server: {e:#}");
        }
        result
    }

    /// Opens a running single-VM session on `site` expiring at `expires_at`, with its VM and
    /// cloud-init Secret in that site's cluster.
    async fn session(
        &self,
        site: &BenchSite,
        expires_at: DateTime<Utc>,
    ) -> anyhow::Result<SessionId> {
        open_session(
            &self.store,
            Some(&site.cluster),
            &self.env,
            &site.name,
            expires_at,
        )
        .await
    }

    /// `n` sessions on `site`, expiring at the times of `expiries`.
    async fn sessions_on(
        &self,
        site: &BenchSite,
        expiries: Vec<DateTime<Utc>>,
    ) -> anyhow::Result<Vec<SessionId>> {
        let results: Vec<anyhow::Result<SessionId>> = futures::stream::iter(expiries)
            .map(|e| self.session(site, e))
            .buffer_unordered(16)
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// `--vms-per-site` live sessions on every site, expiring in an hour.
    async fn live_sessions(&self, args: &SitesBenchArgs) -> anyhow::Result<()> {
        let setup = Instant::now();
        let now = self.store.db_now().await?;
        for site in &self.sites {
            self.sessions_on(site, vec![now + TimeDelta::minutes(60); args.vms_per_site])
                .await
                .with_context(|| format!("the live sessions of {}", site.name))?;
        }
        println!(
            "live: {} sessions on each of {} sites ({} in all, a VM and a Secret each), set up in {:.0}s",
            args.vms_per_site,
            self.sites.len(),
            args.vms_per_site * self.sites.len(),
            setup.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// One reaper context per site, as the binary builds them.
    fn contexts(&self) -> Vec<ReaperContext> {
        let known: Vec<SiteName> = self.sites.iter().map(|s| s.name.clone()).collect();
        self.sites
            .iter()
            .map(|s| {
                ReaperContext::new(self.store.clone(), s.cluster.clone(), self.env.clone())
                    .with_site(s.name.clone(), &known)
            })
            .collect()
    }

    /// The no-op cycle over every site, in process; then the binary's memory.
    async fn noop(&self, args: &SitesBenchArgs) -> anyhow::Result<()> {
        let contexts = self.contexts();
        let mut took = Vec::new();
        for _ in 0..args.runs.max(1) {
            let t0 = Instant::now();
            let reports = futures::future::join_all(contexts.iter().map(reap_once)).await;
            took.push(t0.elapsed().as_secs_f64());
            for (site, report) in self.sites.iter().zip(&reports) {
                anyhow::ensure!(
                    report.ran() && report.cluster_listed,
                    "the cycle of {} did not run: {report:?}",
                    site.name
                );
                let acted = report.expired.done
                    + report.orphans.done
                    + report.ghosts.done
                    + report.stuck.done;
                anyhow::ensure!(
                    acted == 0,
                    "a no-op cycle of {} acted: {}",
                    site.name,
                    report.summary()
                );
            }
        }
        println!(
            "noop: the reaper's cycle over all {} sites side by side (in process, {} runs): {}",
            self.sites.len(),
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
        let Some(mut reaper) = self.reaper(args, "1h")? else {
            return Ok(());
        };
        let since = self.store.db_now().await?;
        let firsts = self.first_cycles(since, Duration::from_secs(120)).await?;
        let hwm = peak_resident_mb(reaper.pid());
        if let Err(e) = reaper.stop(Duration::from_secs(15)).await {
            eprintln!("ttlabctl: stopping the reaper: {e:#}");
        }
        match (firsts, hwm) {
            (Some(all), Some(mb)) => {
                println!(
                    "  ttlab-reaper binary: every site's first cycle recorded {:.3}s after its start (the slowest site's cycle {:.3}s), peak resident {mb:.1} MB; target < 150 MB: {}",
                    all.0,
                    all.1,
                    verdict(mb < 150.0)
                );
            }
            _ => println!(
                "  ttlab-reaper binary: not every site's first cycle was recorded within 120 s; memory not measured"
            ),
        }
        Ok(())
    }

    /// Starts the real reaper over every site with `interval` between full cycles; `None`
    /// (said) when the binary is not there.
    fn reaper(
        &self,
        args: &SitesBenchArgs,
        interval: &str,
    ) -> anyhow::Result<Option<ChildProcess>> {
        let binary = match &args.reaper_binary {
            Some(p) => p.clone(),
            None => match super::real::beside_me("ttlab-reaper") {
                Ok(p) => p,
                Err(e) => {
                    println!("  ttlab-reaper binary: {e:#}; not measured");
                    return Ok(None);
                }
            },
        };
        let all: Vec<&BenchSite> = self.sites.iter().collect();
        let file = self.sites_file("reaper-sites.yaml", &all, args.vms_per_site + 100)?;
        let mut vars: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", self.db.url().into()),
            ("TTLAB_SITES", file.into()),
            ("TTLAB_ENV", ENV.into()),
            ("TTLAB_METRICS_LISTEN", "127.0.0.1:0".into()),
            ("TTLAB_REAP_INTERVAL", interval.into()),
            ("NO_COLOR", "1".into()),
        ];
        if std::env::var_os("RUST_LOG").is_none() {
            vars.push(("RUST_LOG", "error".into()));
        }
        Ok(Some(ChildProcess::spawn("reaper", &binary, &[], &vars)?))
    }

    /// Waits until every site has a full cycle recorded after `since`; returns when the last
    /// of them was recorded (seconds after `since`) and the longest of their durations.
    async fn first_cycles(
        &self,
        since: DateTime<Utc>,
        within: Duration,
    ) -> anyhow::Result<Option<(f64, f64)>> {
        let give_up = Instant::now() + within;
        loop {
            let recent = self
                .store
                .reaper_cycles()
                .recent(Some(&self.env), 10 * self.sites.len() as u32)
                .await?;
            let mut last = None::<(f64, f64)>;
            let mut all = true;
            for site in &self.sites {
                let first = recent
                    .iter()
                    .filter(|c| c.site.as_ref() == Some(&site.name) && c.cycle.started_at > since)
                    .min_by_key(|c| c.cycle.started_at);
                match first {
                    Some(c) => {
                        let finished = c.cycle.started_at
                            + TimeDelta::from_std(c.cycle.duration).unwrap_or_default();
                        let at = (finished - since).num_milliseconds() as f64 / 1000.0;
                        let took = c.cycle.duration.as_secs_f64();
                        let (a, t) = last.unwrap_or((0.0, 0.0));
                        last = Some((a.max(at), t.max(took)));
                    }
                    None => all = false,
                }
            }
            if all {
                return Ok(last);
            }
            if Instant::now() > give_up {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Sessions expire on every site while the last site answers every call after
    /// `args.slow`; prints expiry → VM delete accepted on the healthy sites.
    async fn slow_site(&self, args: &SitesBenchArgs) -> anyhow::Result<()> {
        let n = args.expiring_per_site.max(1);
        let lead = Duration::from_secs(15);
        let spread = Duration::from_secs(10);
        let now = self.store.db_now().await?;
        let first = now + TimeDelta::from_std(lead)?;
        let step = spread.as_secs_f64() / n as f64;
        let expiries: Vec<DateTime<Utc>> = (0..n)
            .map(|i| first + TimeDelta::microseconds((step * i as f64 * 1e6) as i64))
            .collect();
        let mut ids = Vec::new();
        for site in &self.sites {
            let made = self.sessions_on(site, expiries.clone()).await?;
            ids.push(made);
            site.sim.faults().clear_calls();
        }
        let (slow, healthy) = self.sites.split_last().context("no site")?;
        slow.sim.faults().add(FaultRule {
            action: FaultAction::Delay {
                millis: u64::try_from(args.slow.as_millis()).unwrap_or(u64::MAX),
            },
            ..FaultRule::fail(None, None, 500)
        });
        let Some(mut reaper) = self.reaper(args, "5s")? else {
            return Ok(());
        };
        let give_up = Instant::now() + lead + spread + Duration::from_secs(60);
        let result = async {
            loop {
                let mut left = 0;
                for site_ids in ids.iter().take(healthy.len()) {
                    for id in site_ids {
                        let s = self.store.sessions().get(*id).await?.context("a session row")?;
                        if !s.status.is_final() {
                            left += 1;
                        }
                    }
                }
                if left == 0 || Instant::now() > give_up {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            let mut delays = Vec::new();
            let mut missing = 0;
            for (site, site_ids) in healthy.iter().zip(&ids) {
                let deletes = first_deletes(&site.sim);
                for id in site_ids {
                    let s = self.store.sessions().get(*id).await?.context("a session row")?;
                    let vm = ttlab_vm_manifest::vm_name(*id, &"vm".parse()?);
                    match deletes.get(&vm) {
                        Some(at) => delays.push(
                            (*at - s.expires_at).num_microseconds().unwrap_or(0) as f64 / 1e6,
                        ),
                        None => missing += 1,
                    }
                }
            }
            delays.sort_by(f64::total_cmp);
            let slow_ids = ids.last().map(Vec::as_slice).unwrap_or_default();
            let mut slow_final = 0;
            for id in slow_ids {
                let s = self.store.sessions().get(*id).await?.context("a session row")?;
                if s.status.is_final() {
                    slow_final += 1;
                }
            }
            let p99 = percentile(&delays, 99.0);
            println!(
                "slow site: {} answers every call after {:?}; {n} sessions expiring on each site over {spread:?}, the ttlab-reaper binary running (interval 5s)",
                slow.name, args.slow
            );
            println!(
                "  healthy sites ({}): expires_at -> VM delete accepted p50 {:.3}s  p99 {:.3}s  max {:.3}s  (not deleted: {missing}); target p99 <= 1s: {}",
                healthy.len(),
                percentile(&delays, 50.0),
                p99,
                delays.last().copied().unwrap_or(f64::NAN),
                verdict(p99 <= 1.0 && missing == 0)
            );
            println!(
                "  {}: {slow_final} of its {} expired sessions final by then (its calls take {:?} each)",
                slow.name,
                slow_ids.len(),
                args.slow
            );
            anyhow::Ok(())
        }
        .await;
        if let Err(e) = reaper.stop(Duration::from_secs(15)).await {
            eprintln!("ttlabctl: stopping the reaper: {e:#}");
        }
        slow.sim.faults().clear();
        result
    }
}

/// The first delete of each VM the sim recorded, by name.
fn first_deletes(sim: &KubeSim) -> std::collections::BTreeMap<String, DateTime<Utc>> {
    let mut deletes = std::collections::BTreeMap::new();
    for c in sim.calls() {
        if c.verb != Verb::Delete || c.resource != "virtualmachines" {
            continue;
        }
        let (Some(name), Ok(at)) = (c.name, DateTime::parse_from_rfc3339(&c.at)) else {
            continue;
        };
        let at = at.with_timezone(&Utc);
        deletes
            .entry(name)
            .and_modify(|first: &mut DateTime<Utc>| *first = (*first).min(at))
            .or_insert(at);
    }
    deletes
}

/// The peak resident memory of process `pid` in MB (`VmHWM`), if it can be read.
fn peak_resident_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb as f64 / 1024.0)
}
