//! `ttlabctl soak`: the whole system under load, faults and chaos on this machine, checked
//! against the invariants that make reclamation "unfailing", with a printed table and a
//! non-zero exit status when any is violated.
//!
//! One throwaway PostgreSQL database and one kube-sim namespace are shared by two
//! environments, `dev` and `prod`, each with its own `ttlab-server` and `ttlab-reaper` child
//! processes (the store separates environments by the rows' `env` column; the capacity lock
//! and the one-live-session-per-user index are shared). Each process talks to kube-sim as its
//! own user (`ttlab-<env>-server`, `ttlab-<env>-reaper`, a kubeconfig `as:`), so the call
//! record says who deleted what. Simulated students (tasks with a seeded generator) start labs,
//! double-click, extend (also past the limits), grade, reconnect consoles, finish and abandon,
//! with lifespans of seconds so that sessions expire all the time. Faults (failed calls, a
//! fraction of every verb) and latency are injected into the Kubernetes API, and the chaos
//! options SIGKILL and restart the reapers and servers, stop and start PostgreSQL, roll the
//! servers (SIGTERM with a successor already serving), and misbehave on the network: every
//! process reaches PostgreSQL and the Kubernetes API through a fault proxy of its own
//! (`ttlab_testkit::FaultProxy`) that the chaos blackholes (half-open), stalls or makes lose
//! the replies of, one process's connection at a time. Some VMs' deletion hangs on a
//! finalizer for a while, and some students open pod labs.
//!
//! With `--sites N` (kube-sim only) there are N kube-sim clusters, each a site with its own
//! namespace quota, and every server and reaper reads a sites file whose kubeconfigs lead
//! through that process's own fault proxy to each site; `--lose-site-every` takes one site
//! away at a time (every process's connections to it blackholed) and brings it back. The
//! invariants then hold per site and over all.
//!
//! After the run, students stop, the chaos and faults stop, and the system drains: every row
//! must reach a final status and the namespace must empty. Then the invariants are checked
//! ([`checks`]) and printed.

mod chaos;
mod checks;
mod kube;
mod linger;
mod rig;
pub(crate) mod students;

use std::time::Duration;

use clap::{Args, ValueEnum};

pub use kube::Backend;

/// The two environments sharing the namespace and the database.
pub(crate) const ENVS: [&str; 2] = ["dev", "prod"];

/// Arguments of `ttlabctl soak`.
#[derive(Debug, Clone, Args)]
pub struct SoakArgs {
    /// The Kubernetes to run on: `kube-sim` (in process, with injected faults and latency; the
    /// default) or `real` (kube-apiserver, kube-controller-manager and etcd from
    /// `KUBEBUILDER_ASSETS` with the shipped `deploy/` objects and Roles, KubeVirt simulated as
    /// a controller; no API faults can be injected there, so the fault rate and latency are 0).
    #[arg(long, value_enum, default_value_t = Backend::KubeSim)]
    pub backend: Backend,
    /// Preset: `full` (10 minutes, 300 students; the default) or `short` (about a minute with
    /// every chaos option, for CI). Flags given explicitly override the preset.
    #[arg(long, value_enum, default_value_t = Profile::Full)]
    pub profile: Profile,
    /// How long students keep opening labs (the drain comes after).
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Simulated students (half on `dev`, half on `prod`).
    #[arg(long)]
    pub students: Option<u32>,
    /// Fraction (0–1) of Kubernetes API calls (get, list, create, delete) failed on purpose.
    #[arg(long)]
    pub fault_rate: Option<f64>,
    /// Latency added to every Kubernetes API call.
    #[arg(long, value_parser = parse_duration)]
    pub latency: Option<Duration>,
    /// Seed of the students' choices and of the injected faults.
    #[arg(long)]
    pub seed: Option<u64>,
    /// SIGKILL one reaper (alternating environments) this often, and start it again.
    #[arg(long, value_parser = parse_duration)]
    pub kill_reaper_every: Option<Duration>,
    /// SIGKILL one server (alternating environments) this often, and start it again.
    #[arg(long, value_parser = parse_duration)]
    pub kill_server_every: Option<Duration>,
    /// Stop PostgreSQL (as a crash would) this often, for a couple of seconds.
    #[arg(long, value_parser = parse_duration)]
    pub restart_postgres_every: Option<Duration>,
    /// Blackhole one process's connections to PostgreSQL or the Kubernetes API this often
    /// (half-open: nothing answered, nothing closed), alternating processes and targets.
    #[arg(long, value_parser = parse_duration)]
    pub blackhole_every: Option<Duration>,
    /// How long a blackhole lasts; then its connections are cut and new ones pass.
    #[arg(long, value_parser = parse_duration)]
    pub blackhole_for: Option<Duration>,
    /// Stall one process's connections (bytes held, then delivered) this often.
    #[arg(long, value_parser = parse_duration)]
    pub stall_every: Option<Duration>,
    /// How long a stall lasts.
    #[arg(long, value_parser = parse_duration)]
    pub stall_for: Option<Duration>,
    /// Lose the replies on one process's connections this often: its requests still reach
    /// PostgreSQL or the API server and take effect, the answers never come back.
    #[arg(long, value_parser = parse_duration)]
    pub lose_replies_every: Option<Duration>,
    /// How long replies are lost; then those connections are cut.
    #[arg(long, value_parser = parse_duration)]
    pub lose_replies_for: Option<Duration>,
    /// Roll one server (alternating environments) this often: a successor is started and
    /// ready, students are sent to it, and the old one gets SIGTERM and hands over.
    #[arg(long, value_parser = parse_duration)]
    pub rolling_restart_every: Option<Duration>,
    /// Fraction (0–1) of VMs whose deletion hangs on a finalizer (kube-sim only).
    #[arg(long)]
    pub linger_fraction: Option<f64>,
    /// How long such a VM stays terminating before the finalizer is released.
    #[arg(long, value_parser = parse_duration)]
    pub linger_for: Option<Duration>,
    /// Fraction (0–1) of the labs students open that are pod labs (no VM).
    #[arg(long)]
    pub pod_labs: Option<f64>,
    /// VM limit of both servers (`TTLAB_VM_LIMIT`) and the namespace quota: the VMs of both
    /// environments count against it. With several sites, the total that `--site-vm-limit`
    /// splits by default.
    #[arg(long)]
    pub vm_limit: Option<usize>,
    /// How many sites (kube-sim only): 1 (the default) runs one cluster without a sites
    /// file, as before sites existed; N (2 to 16) runs N kube-sim clusters, `site-a`,
    /// `site-b`, …, and gives every server and reaper a sites file naming them all.
    #[arg(long, default_value_t = 1)]
    pub sites: u8,
    /// Each site's VM limit (its `vm_limit` and its namespace quota) with several sites; by
    /// default `--vm-limit` split evenly between them.
    #[arg(long)]
    pub site_vm_limit: Option<usize>,
    /// Take one site away this often (its API server stops answering every server and
    /// reaper: each process's connections to it are blackholed), the sites in turn.
    #[arg(long, value_parser = parse_duration)]
    pub lose_site_every: Option<Duration>,
    /// How long a site stays away; then the connections to it are cut and new ones pass.
    #[arg(long, value_parser = parse_duration)]
    pub lose_site_for: Option<Duration>,
    /// Reaper interval (`TTLAB_REAP_INTERVAL`): the "one cycle" of the expiry invariant.
    #[arg(long, value_parser = parse_duration)]
    pub reap_interval: Option<Duration>,
    /// How soon after its expiry a session's VM must be deleted when nothing disturbed its
    /// reclamation (the expiry invariant). 2 s on kube-sim; on a real API server sharing a
    /// small machine with everything else, give it what that machine's latency needs.
    #[arg(long, value_parser = parse_duration, default_value = "2s")]
    pub expiry_bound: Duration,
    /// Longest wait, after the run, for every row to be final and the namespace empty.
    #[arg(long, value_parser = parse_duration, default_value = "3m")]
    pub drain_timeout: Duration,
}

/// A preset of the soak's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Profile {
    /// About a minute, every chaos option, for CI.
    Short,
    /// Ten minutes, 300 students.
    Full,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{s:?}: {e} (use e.g. 500ms, 3s, 2m)"))
}

/// The lifespan policy of one environment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EnvPolicy {
    /// `TTLAB_SESSION_TTL`.
    pub ttl: Duration,
    /// `TTLAB_SESSION_MAX`.
    pub max: Duration,
    /// `TTLAB_MAX_EXTENSIONS`.
    pub max_extensions: u32,
}

/// The settings of one run, the profile resolved.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub profile: Profile,
    pub backend: Backend,
    pub duration: Duration,
    pub students: u32,
    pub fault_rate: f64,
    pub latency: Duration,
    pub seed: u64,
    pub kill_reaper_every: Option<Duration>,
    pub kill_server_every: Option<Duration>,
    pub restart_postgres_every: Option<Duration>,
    /// The network faults: (how often, how long) each.
    pub blackhole: Option<(Duration, Duration)>,
    pub stall: Option<(Duration, Duration)>,
    pub lose_replies: Option<(Duration, Duration)>,
    pub rolling_restart_every: Option<Duration>,
    pub linger_fraction: f64,
    pub linger_for: Duration,
    pub pod_labs: f64,
    /// The VM limit over all sites (each site's limit times the number of sites).
    pub vm_limit: usize,
    /// The sites' names (`default` alone without a sites file).
    pub sites: Vec<String>,
    /// Each site's VM limit.
    pub site_vm_limit: usize,
    /// Losing a site: (how often, how long).
    pub lose_site: Option<(Duration, Duration)>,
    pub reap_interval: Duration,
    pub expiry_bound: Duration,
    pub drain_timeout: Duration,
    /// By environment, in [`ENVS`] order.
    pub policies: [EnvPolicy; 2],
}

impl Settings {
    fn resolve(args: &SoakArgs) -> anyhow::Result<Self> {
        let short = args.profile == Profile::Short;
        let secs = Duration::from_secs;
        let real = args.backend == Backend::Real;
        if real
            && (args.fault_rate.is_some_and(|f| f > 0.0)
                || args.latency.is_some_and(|l| !l.is_zero()))
        {
            anyhow::bail!(
                "--fault-rate and --latency need kube-sim: no faults can be injected into a real API server"
            );
        }
        if args.sites == 0 || args.sites > 16 {
            anyhow::bail!("--sites must be between 1 and 16, not {}", args.sites);
        }
        if real && args.sites > 1 {
            anyhow::bail!(
                "--sites {} needs kube-sim: the soak on the real control plane runs one site",
                args.sites
            );
        }
        if args.sites == 1 && args.site_vm_limit.is_some() {
            anyhow::bail!(
                "--site-vm-limit needs --sites 2 or more (with one site, --vm-limit is its limit)"
            );
        }
        if args.sites == 1 && (args.lose_site_every.is_some() || args.lose_site_for.is_some()) {
            anyhow::bail!(
                "--lose-site-every and --lose-site-for need --sites 2 or more (one site lost \
                 leaves nowhere to start labs)"
            );
        }
        if args.lose_site_for.is_some() && args.lose_site_every.is_none() {
            anyhow::bail!("--lose-site-for needs --lose-site-every");
        }
        let total = args.vm_limit.unwrap_or(if short { 24 } else { 120 });
        if total == 0 {
            anyhow::bail!("--vm-limit must be at least 1");
        }
        let n_sites = usize::from(args.sites);
        let site_vm_limit = if n_sites == 1 {
            total
        } else {
            args.site_vm_limit.unwrap_or(total / n_sites)
        };
        if site_vm_limit == 0 {
            anyhow::bail!(
                "each of the {n_sites} sites needs a VM limit of at least 1: give --site-vm-limit, \
                 or a --vm-limit of at least {n_sites}"
            );
        }
        let s = Self {
            profile: args.profile,
            backend: args.backend,
            duration: args
                .duration
                .unwrap_or(if short { secs(30) } else { secs(600) }),
            students: args.students.unwrap_or(if short { 40 } else { 300 }),
            fault_rate: args
                .fault_rate
                .unwrap_or(if short && !real { 0.1 } else { 0.0 }),
            latency: args.latency.unwrap_or(if short && !real {
                Duration::from_millis(5)
            } else {
                Duration::ZERO
            }),
            seed: args.seed.unwrap_or(1),
            kill_reaper_every: args
                .kill_reaper_every
                .or(if short { Some(secs(10)) } else { None }),
            kill_server_every: args
                .kill_server_every
                .or(if short { Some(secs(13)) } else { None }),
            restart_postgres_every: args.restart_postgres_every.or(if short {
                Some(secs(17))
            } else {
                None
            }),
            blackhole: args
                .blackhole_every
                .or(if short { Some(secs(11)) } else { None })
                .map(|e| (e, args.blackhole_for.unwrap_or(secs(3)))),
            stall: args
                .stall_every
                .or(if short { Some(secs(9)) } else { None })
                .map(|e| (e, args.stall_for.unwrap_or(secs(2)))),
            lose_replies: args
                .lose_replies_every
                .or(if short { Some(secs(7)) } else { None })
                .map(|e| {
                    (
                        e,
                        args.lose_replies_for.unwrap_or(Duration::from_millis(1500)),
                    )
                }),
            rolling_restart_every: args.rolling_restart_every.or(if short {
                Some(secs(8))
            } else {
                None
            }),
            linger_fraction: args.linger_fraction.unwrap_or(if short && !real {
                0.15
            } else {
                0.0
            }),
            linger_for: args.linger_for.unwrap_or(secs(4)),
            pod_labs: args.pod_labs.unwrap_or(0.1),
            vm_limit: site_vm_limit * n_sites,
            sites: crate::dev::sites::site_names(args.sites),
            site_vm_limit,
            lose_site: args
                .lose_site_every
                .map(|e| (e, args.lose_site_for.unwrap_or(secs(20)))),
            reap_interval: args.reap_interval.unwrap_or(secs(5)),
            expiry_bound: args.expiry_bound,
            drain_timeout: args.drain_timeout,
            policies: if short {
                [
                    EnvPolicy {
                        ttl: secs(8),
                        max: secs(16),
                        max_extensions: 2,
                    },
                    EnvPolicy {
                        ttl: secs(12),
                        max: secs(24),
                        max_extensions: 2,
                    },
                ]
            } else {
                [
                    EnvPolicy {
                        ttl: secs(20),
                        max: secs(40),
                        max_extensions: 2,
                    },
                    EnvPolicy {
                        ttl: secs(30),
                        max: secs(60),
                        max_extensions: 2,
                    },
                ]
            },
        };
        if s.students == 0 {
            anyhow::bail!("--students must be at least 1");
        }
        if !(0.0..=1.0).contains(&s.fault_rate) {
            anyhow::bail!("--fault-rate must be between 0 and 1, not {}", s.fault_rate);
        }
        for (name, f) in [
            ("--linger-fraction", s.linger_fraction),
            ("--pod-labs", s.pod_labs),
        ] {
            if !(0.0..=1.0).contains(&f) {
                anyhow::bail!("{name} must be between 0 and 1, not {f}");
            }
        }
        if real && s.linger_fraction > 0.0 {
            anyhow::bail!("--linger-fraction needs kube-sim (the soak holds the finalizers there)");
        }
        for (name, fault) in [
            ("--blackhole", s.blackhole),
            ("--stall", s.stall),
            ("--lose-replies", s.lose_replies),
            ("--lose-site", s.lose_site),
        ] {
            if let Some((every, lasts)) = fault
                && (lasts < Duration::from_millis(100) || lasts >= every)
            {
                anyhow::bail!("{name}-for must be at least 100ms and shorter than {name}-every");
            }
        }
        if s.linger_for < Duration::from_millis(100) {
            anyhow::bail!("--linger-for must be at least 100ms");
        }
        if s.vm_limit == 0 {
            anyhow::bail!("--vm-limit must be at least 1");
        }
        if s.duration.is_zero() {
            anyhow::bail!("--duration must be longer than zero");
        }
        if s.expiry_bound < Duration::from_secs(1) || s.expiry_bound.subsec_nanos() != 0 {
            anyhow::bail!("--expiry-bound must be whole seconds, at least 1s");
        }
        if s.reap_interval < Duration::from_secs(1) || s.reap_interval.subsec_nanos() != 0 {
            anyhow::bail!("--reap-interval must be whole seconds, at least 1s");
        }
        for (name, every) in [
            ("--kill-reaper-every", s.kill_reaper_every),
            ("--kill-server-every", s.kill_server_every),
            ("--restart-postgres-every", s.restart_postgres_every),
            ("--blackhole-every", s.blackhole.map(|f| f.0)),
            ("--stall-every", s.stall.map(|f| f.0)),
            ("--lose-replies-every", s.lose_replies.map(|f| f.0)),
            ("--rolling-restart-every", s.rolling_restart_every),
            ("--lose-site-every", s.lose_site.map(|f| f.0)),
        ] {
            if every.is_some_and(|d| d < Duration::from_secs(3)) {
                anyhow::bail!("{name} must be at least 3s");
            }
        }
        Ok(s)
    }

    fn describe(&self) -> String {
        let every = |d: Option<Duration>| {
            d.map_or_else(
                || "never".to_owned(),
                |d| humantime::format_duration(d).to_string(),
            )
        };
        let fault = |f: Option<(Duration, Duration)>| {
            f.map_or_else(
                || "never".to_owned(),
                |(e, l)| {
                    format!(
                        "every {} for {}",
                        humantime::format_duration(e),
                        humantime::format_duration(l)
                    )
                },
            )
        };
        let policy = |p: &EnvPolicy| {
            format!(
                "ttl {}s max {}s ext {}",
                p.ttl.as_secs(),
                p.max.as_secs(),
                p.max_extensions
            )
        };
        format!(
            "soak ({:?} profile, on {:?}): {} students for {}, fault rate {}, latency {}, seed {}, \
             VM limit {}, reap interval {}s; dev {}; prod {}; kill reaper every {}, kill server \
             every {}, restart PostgreSQL every {}; blackhole {}, stall {}, lose replies {}; \
             rolling restart every {}; VM deletions held by a finalizer {} for {}; pod labs {}; \
             sites {} (VM limit {} each); lose a site {}",
            self.profile,
            self.backend,
            self.students,
            humantime::format_duration(self.duration),
            self.fault_rate,
            humantime::format_duration(self.latency),
            self.seed,
            self.vm_limit,
            self.reap_interval.as_secs(),
            policy(&self.policies[0]),
            policy(&self.policies[1]),
            every(self.kill_reaper_every),
            every(self.kill_server_every),
            every(self.restart_postgres_every),
            fault(self.blackhole),
            fault(self.stall),
            fault(self.lose_replies),
            every(self.rolling_restart_every),
            self.linger_fraction,
            humantime::format_duration(self.linger_for),
            self.pod_labs,
            self.sites.join(", "),
            self.site_vm_limit,
            fault(self.lose_site),
        )
    }
}

/// Runs the soak and prints its invariant table; an error when any invariant was violated.
pub async fn run(args: SoakArgs) -> anyhow::Result<()> {
    let settings = Settings::resolve(&args)?;
    eprintln!("ttlabctl: {}", settings.describe());
    let mut rig = rig::Rig::default();
    let result = rig.soak(&settings).await;
    let stopped = rig.stop().await;
    let table = result?;
    println!("{}", table.render());
    if let Err(e) = stopped {
        eprintln!("ttlabctl: error while stopping: {e:#}");
    }
    let failed = table.failed();
    if failed > 0 {
        anyhow::bail!("{failed} invariant(s) violated");
    }
    Ok(())
}
