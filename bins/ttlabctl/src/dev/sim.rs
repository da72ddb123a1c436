//! `ttlabctl sim`: run kube-sim standalone on loopback and write a kubeconfig that kube-rs and
//! kubectl accept. Runs until Ctrl-C / SIGTERM; faults and counters are reachable under
//! `/sim/…` on the same address.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use ttlab_kube_sim::{KubeSim, SetupOutcome, SimConfig, Timings};

/// Arguments of `ttlabctl sim`.
#[derive(Debug, clap::Args)]
pub struct SimArgs {
    /// Loopback address to listen on (port 0 picks a free port).
    #[arg(long, env = "TTLAB_SIM_LISTEN", default_value = "127.0.0.1:8001")]
    pub listen: SocketAddr,
    /// Where to write the kubeconfig.
    #[arg(long, env = "TTLAB_SIM_KUBECONFIG_OUT")]
    pub kubeconfig_out: Option<PathBuf>,
    /// Namespaces that exist from the start (repeatable); the first is the kubeconfig's
    /// default namespace.
    #[arg(
        long = "namespace",
        env = "TTLAB_SIM_NAMESPACES",
        value_delimiter = ',',
        default_value = "default"
    )]
    pub namespaces: Vec<String>,
    /// Use short test delays instead of realistic ones.
    #[arg(long, env = "TTLAB_SIM_FAST")]
    pub fast: bool,
    /// Guest boot time (Scheduled → the agent listening; Running halfway), overriding the preset.
    #[arg(long, env = "TTLAB_SIM_BOOT", value_parser = humantime_duration)]
    pub boot: Option<Duration>,
    /// Guest setup time (Running → readiness marker), overriding the preset.
    #[arg(long, env = "TTLAB_SIM_SETUP", value_parser = humantime_duration)]
    pub setup: Option<Duration>,
    /// Lessons whose setup fails (repeatable): the failure marker is written instead.
    #[arg(
        long = "fail-lesson",
        env = "TTLAB_SIM_FAIL_LESSONS",
        value_delimiter = ','
    )]
    pub fail_lessons: Vec<String>,
    /// Lessons whose setup never finishes (repeatable): no marker is ever written.
    #[arg(
        long = "hang-lesson",
        env = "TTLAB_SIM_HANG_LESSONS",
        value_delimiter = ','
    )]
    pub hang_lessons: Vec<String>,
    /// Directory for the guests' files (a temporary directory if absent).
    #[arg(long, env = "TTLAB_SIM_GUEST_ROOT")]
    pub guest_root: Option<PathBuf>,
}

fn humantime_duration(s: &str) -> Result<Duration, String> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = num
        .parse()
        .map_err(|_| format!("not a duration: {s:?} (use e.g. 500ms, 5s, 2m)"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("not a duration: {s:?} (use e.g. 500ms, 5s, 2m)")),
    }
}

/// Runs the sim until interrupted.
pub async fn run(args: SimArgs) -> anyhow::Result<()> {
    let mut config = SimConfig::new(args.listen);
    config.timings = if args.fast {
        Timings::fast()
    } else {
        Timings::realistic()
    };
    if let Some(b) = args.boot {
        config.timings.boot = b;
    }
    if let Some(s) = args.setup {
        config.timings.setup = s;
    }
    if args.namespaces.is_empty() {
        anyhow::bail!("at least one --namespace is needed");
    }
    config.namespaces = args.namespaces.clone();
    config.guest_root = args.guest_root;
    let mut setup = BTreeMap::new();
    for l in args.fail_lessons {
        setup.insert(
            l,
            SetupOutcome::Fail {
                reason: "setup script failed (simulated)".into(),
            },
        );
    }
    for l in args.hang_lessons {
        setup.insert(l, SetupOutcome::Never);
    }
    config.lesson_setup = setup;
    let sim = KubeSim::start(config).await.context("starting kube-sim")?;
    let ns = &args.namespaces[0];
    if let Some(path) = &args.kubeconfig_out {
        sim.write_kubeconfig(path, ns)
            .with_context(|| format!("writing the kubeconfig to {}", path.display()))?;
        eprintln!("kube-sim: kubeconfig written to {}", path.display());
    }
    eprintln!(
        "kube-sim: serving {} (namespace {ns}); controls under {}/sim/; Ctrl-C stops",
        sim.url(),
        sim.url()
    );
    shutdown_signal().await;
    eprintln!("kube-sim: stopping");
    sim.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
