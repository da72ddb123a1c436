//! `ttlabctl bench …`: benchmarks that print measured figures against their targets. Each
//! benchmark is a sub-subcommand in its own module.

pub mod api;
pub mod console;
mod machine;
mod objects;
pub mod pool;
pub mod real;
pub mod reaper;
pub mod sites;

use clap::{Args, Subcommand};

/// Arguments of `ttlabctl bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// The reaper: detection delay after expiry, throughput under API latency, a no-op cycle at
    /// scale and its resident memory.
    Reaper(reaper::ReaperBenchArgs),
    /// The server: `GET /api/sessions/{id}` at 1,000/s, `POST /api/sessions` to 202, and the
    /// backend's own delay on readiness.
    Api(api::ApiBenchArgs),
    /// The console relay: keystroke echo straight and relayed, bulk output, many idle consoles.
    Console(console::ConsoleBenchArgs),
    /// On a real API server (the real control plane, or any cluster's namespace): reclaiming
    /// expired sessions against the raw delete limit, "Start lab" clicks at once, the no-op
    /// cycle at scale, etcd's size per 1,000 live sessions.
    Real(real::RealBenchArgs),
    /// Warm pools: "Start lab" → running for clicks served by a lesson's pool, against the
    /// cold path's in the same run, with the hit rate.
    Pool(pool::PoolBenchArgs),
    /// Several sites, each a kube-sim: the start's added placement latency, the reaper's
    /// no-op cycle over every site and its memory, expiry on the healthy sites while one site
    /// answers every call late.
    Sites(sites::SitesBenchArgs),
}

/// Runs the chosen benchmark. Ctrl-C or SIGTERM (`timeout`'s) stops it: the benchmark is
/// dropped, and with it everything it started (the control plane, PostgreSQL, the servers and
/// reapers, the simulated guests), each stopped by its owner before ttlabctl exits.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let stop = interrupted()?;
    let bench = async move {
        match args.command {
            BenchCommand::Reaper(args) => reaper::run(args).await,
            BenchCommand::Api(args) => api::run(args).await,
            BenchCommand::Console(args) => console::run(args).await,
            BenchCommand::Real(args) => real::run(args).await,
            BenchCommand::Pool(args) => pool::run(args).await,
            BenchCommand::Sites(args) => sites::run(args).await,
        }
    };
    tokio::select! {
        result = bench => result,
        signal = stop => {
            anyhow::bail!("stopped by {signal}; everything the benchmark started was stopped")
        }
    }
}

/// Catches SIGINT and SIGTERM from now on (so that neither kills ttlabctl before it has
/// stopped its children) and resolves to the name of the first that comes.
fn interrupted() -> anyhow::Result<impl std::future::Future<Output = &'static str>> {
    use anyhow::Context as _;
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt()).context("catching SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("catching SIGTERM")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        }
    })
}

/// The `p`th percentile (0–100) of `sorted` by the nearest-rank method; NaN when empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// How a figure is marked against its target.
pub(crate) fn verdict(ok: bool) -> &'static str {
    if ok { "met" } else { "MISSED" }
}
