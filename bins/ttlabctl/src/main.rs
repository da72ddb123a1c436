//! ttlabctl: the operator CLI. Each subcommand lives in its own module (`mod x;` with
//! `pub async fn run(args) -> anyhow::Result<()>`, or a plain `fn run` for work that does no
//! I/O); this file only parses the command line and reports errors: exit status 1 and one line
//! on stderr. Subcommands that need the database flatten `ttlab_cli::DatabaseArgs`
//! (`--database-url`, or `DATABASE_URL`, and the database timeouts), as the server and the
//! reaper do.
//!
//! Subcommands: `migrate` (apply the database schema), `render` (review what a session of a
//! lesson would create), `token` (mint an API token), `class` (scheduled classes, through the
//! admin API with a hyper client: no HTTP server framework); with the `dev-tools` feature (the
//! default) also `sim`, `demo`, `bench`, `soak` and `guest-image` (the module `dev`), which bring
//! the test rig (kube-sim, kubevirt-sim, qemu guests) along. The production image builds
//! without it.

mod api;
mod class;
#[cfg(feature = "dev-tools")]
mod dev;
mod migrate;
mod render;
mod token;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
#[cfg(feature = "dev-tools")]
use dev::{bench, demo, guest_image, sim, soak};

/// ttlab operator CLI.
#[derive(Debug, Parser)]
#[command(name = "ttlabctl", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Apply the database schema (idempotent; safe to run while servers start).
    Migrate(migrate::MigrateArgs),
    /// Print, as a YAML stream, every object the server would create for one session.
    Render(render::RenderArgs),
    /// Run kube-sim (a local Kubernetes API with a simulated KubeVirt) and write a kubeconfig.
    #[cfg(feature = "dev-tools")]
    Sim(sim::SimArgs),
    /// Benchmarks that print measured figures against their targets (`bench reaper`).
    #[cfg(feature = "dev-tools")]
    Bench(bench::BenchArgs),
    /// Mint a bearer token for the ttlab API (`--user U --role student|admin --ttl 8h`).
    Token(token::TokenArgs),
    /// Scheduled classes through the admin API: `add`, `list`, `cancel` (`--url`, and an
    /// admin's `--token` or `TTLAB_TOKEN`).
    Class(class::ClassArgs),
    /// Run the whole system on this machine: PostgreSQL, kube-sim, the server and the reaper.
    #[cfg(feature = "dev-tools")]
    Demo(demo::DemoArgs),
    /// Build (or take with `--from`) the Debian 12 image real qemu guests boot, cached under
    /// the user's cache directory; prints its directory.
    #[cfg(feature = "dev-tools")]
    GuestImage(guest_image::GuestImageArgs),
    /// Prove reclamation holds: two environments under simulated students, injected faults
    /// and chaos, checked against the invariants (`--profile short` for about a minute).
    #[cfg(feature = "dev-tools")]
    Soak(soak::SoakArgs),
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                // kube-rs logs every 5xx answer at error level; ttlabctl reports the failures
                // that matter itself, and a control plane that is still starting answers its
                // readiness checks with 500 many times over.
                .unwrap_or_else(|_| {
                    tracing_subscriber::EnvFilter::new("warn,kube_client::client::builder=off")
                }),
        )
        .init();
    let result = match cli.command {
        Command::Migrate(args) => migrate::run(args).await,
        Command::Render(args) => render::run(&args),
        #[cfg(feature = "dev-tools")]
        Command::Sim(args) => sim::run(args).await,
        #[cfg(feature = "dev-tools")]
        Command::Bench(args) => bench::run(args).await,
        Command::Token(args) => token::run(args),
        Command::Class(args) => class::run(args).await,
        #[cfg(feature = "dev-tools")]
        Command::Demo(args) => demo::run(args).await,
        #[cfg(feature = "dev-tools")]
        Command::Soak(args) => soak::run(args).await,
        #[cfg(feature = "dev-tools")]
        Command::GuestImage(args) => guest_image::run(args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ttlabctl: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
