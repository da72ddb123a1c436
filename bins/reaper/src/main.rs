//! ttlab-reaper: reclaims expired sessions, orphaned cluster objects and ghost rows of one
//! environment (`ttlab-reaper` crate), on a timer, at each deadline and on "collect now", on
//! every site of the sites file (`--sites`), each on its own schedule with its own client; or,
//! without that file, on the one cluster and namespace (the site `default`) as before.
//!
//! This file only parses the configuration and wires the parts together. As a service it
//! never exits for want of its database or cluster: it starts without them, is not ready
//! (`/readyz` says why) and keeps trying until they answer (a database that refuses it — its
//! certificate, credentials or database name — is a wrong setting: exit status 1). Exit status: 0 after a clean
//! shutdown or a `--once` cycle that ran (per-item failures are in its report); 1 when the
//! configuration is wrong, or the `--once` cycle could not run (its database unreachable
//! included: a one-shot does not wait; with a sites file, any site's cycle, after every
//! other site's ran); 3 when `--once` found another reaper of the
//! environment acting (it keeps the leader lease renewed).

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use tokio_util::sync::CancellationToken;
use ttlab_cli::{ClusterArgs, DatabaseArgs, SitesArgs};
use ttlab_model::EnvName;
use ttlab_reaper::{Metrics, OnceError, Reaper, ReaperContext, ReaperSettings, SiteWork};
use ttlab_store::StoreOptions;

/// Reclaims every VM, Secret and pod ttlab no longer needs, in one environment.
#[derive(Debug, Parser)]
#[command(name = "ttlab-reaper", version, about)]
struct Args {
    #[command(flatten)]
    db: DatabaseArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    sites: SitesArgs,
    /// This reaper's environment: it only ever touches sessions and objects labelled with it.
    #[arg(long, env = "TTLAB_ENV", default_value = "dev")]
    env: EnvName,
    /// The backstop sweep interval (cycles also run at each deadline and on collect requests).
    #[arg(long, env = "TTLAB_REAP_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Sessions (or orphan groups) handled at once.
    #[arg(long, env = "TTLAB_REAP_CONCURRENCY", default_value_t = ttlab_reaper::DEFAULT_CONCURRENCY)]
    concurrency: usize,
    /// Objects younger than this are never judged orphans.
    #[arg(long, env = "TTLAB_ORPHAN_MIN_AGE", default_value = "2m", value_parser = humantime::parse_duration)]
    orphan_min_age: Duration,
    /// An agent version no VM uses is removed only once its ConfigMap is this old and no
    /// server has recorded it as seen for this long.
    #[arg(long, env = "TTLAB_AGENT_MIN_AGE", default_value = "1h", value_parser = humantime::parse_duration)]
    agent_min_age: Duration,
    /// Where to serve /metrics, /healthz and /readyz.
    #[arg(long, env = "TTLAB_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    metrics_listen: SocketAddr,
    /// /healthz fails (503) after the loop made no progress (a cycle as the leader, an
    /// answered lock attempt as a standby) for this long. Default: three sweep intervals,
    /// at least 30 s.
    #[arg(long, env = "TTLAB_REAP_STALL_AFTER", value_parser = humantime::parse_duration)]
    stall_after: Option<Duration>,
    /// How long the leader lease lasts unless renewed: a standby takes over this long (plus
    /// a second) after the leader vanished. Keep it well under the sweep interval.
    #[arg(long, env = "TTLAB_LEADER_LEASE", default_value = "10s", value_parser = humantime::parse_duration)]
    leader_lease: Duration,
    /// The environment's VMs and Secrets are read from watch-fed listings, each rebuilt from
    /// a full list at least this often (a cycle lists them itself while a listing is being
    /// rebuilt or after its watch failed). 0 lists them every cycle. Not used with --once.
    #[arg(long, env = "TTLAB_REAP_RELIST_EVERY", default_value = "5m", value_parser = humantime::parse_duration)]
    relist_every: Duration,
    /// Run one cycle and exit (for a CronJob). Unlike the service, a one-shot does not wait
    /// for its database: it exits 1 when the database cannot be reached.
    #[arg(long, env = "TTLAB_REAP_ONCE")]
    once: bool,
    /// Report what would be deleted and marked; change nothing. With --once, prints every
    /// session it would reclaim (id, lesson, why, its objects), every orphan object
    /// (Kind/name, environment, session) and every ghost (id, lesson, what is gone).
    #[arg(long, env = "TTLAB_REAP_DRY_RUN")]
    dry_run: bool,
}

const EXIT_NOT_LEADER: u8 = 3;

/// How this program names itself to the Kubernetes API server.
const USER_AGENT: &str = concat!("ttlab-reaper/", env!("CARGO_PKG_VERSION"));

/// Caps the PostgreSQL client's query log (which prints parameters) below debug.
const QUIET_QUERIES: &str = "tokio_postgres::query=info";

/// One thread runs every task: the cycle, the watch-fed listings, the leader's lease and the
/// metrics endpoint. A reaper waits on the API server and the database and computes little,
/// and with a thread per core glibc gives each thread its own heap (arena), whose freed space
/// the others cannot reuse: at 10,000 live sessions the peak resident memory was 65.5 MB with
/// a worker per core (2) and 55.1 MB on one thread; a class's reclaim was no slower with one
/// worker (docs/benchmarks.md).
fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("ttlab-reaper: error: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
                // The PostgreSQL client logs query parameters at debug, and those include the
                // per-VM agent tokens: never let them into the log, whatever RUST_LOG says.
                .add_directive(QUIET_QUERIES.parse().expect("a valid log directive")),
        )
        .init();
    match run(args).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ttlab-reaper: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<ExitCode> {
    let settings = ReaperSettings {
        concurrency: args.concurrency,
        orphan_min_age: args.orphan_min_age,
        agent_min_age: args.agent_min_age,
        dry_run: args.dry_run,
        ..ReaperSettings::default()
    };
    settings.validate()?;
    let mut options = StoreOptions {
        // A session holds a connection only for a statement at a time: 16 are enough for any
        // concurrency, and keep two environments' reapers well inside PostgreSQL's default
        // of 100 connections.
        max_connections: args.concurrency.min(16) + 4,
        ..args.db.store_options()
    };
    options.leases.leader = args.leader_lease;
    // A one-shot checks its database at once; the service opens its connections as it goes,
    // and waits for a database that does not answer yet instead of exiting.
    let store = if args.once {
        args.db.connect(options).await?
    } else {
        let store = args.db.open(options)?;
        // A database that refuses this reaper (a wrong CA, password or database name) is a
        // setting to fix, which waiting would not; one that is away is waited for.
        match store.ping().await {
            Ok(()) => {}
            Err(e) if e.is_rejection() => return Err(e.into()),
            Err(e) => {
                tracing::warn!(error = %e, "the database does not answer yet; waiting for it")
            }
        }
        store
    };
    // As many API calls in flight as sessions handled at once, at least: a reaper whose
    // deletions queue behind its own client's limit reclaims a class more slowly than the API
    // server allows.
    let mut cluster_args = args.cluster.clone();
    cluster_args.kube_concurrency = cluster_args.kube_concurrency.max(args.concurrency);
    let stall_after = args
        .stall_after
        .unwrap_or_else(|| (args.interval * 3).max(Duration::from_secs(30)));
    let metrics = Arc::new(Metrics::new().with_stall_after(stall_after));
    if args.sites.sites.is_some() {
        // The reaper places no VM: the limit passed is not used.
        let config = args.sites.load(&args.cluster, 1)?;
        return with_sites(args, store, settings, cluster_args, config, metrics).await;
    }
    let cluster = cluster_args
        .connect(USER_AGENT)
        .await
        .context("building the Kubernetes client")?;
    let ctx =
        ReaperContext::new(store, Arc::new(cluster), args.env.clone()).with_settings(settings);

    if args.once {
        return Ok(match ttlab_reaper::run_once(&ctx, &metrics).await {
            Ok(done) => {
                // The summary, then every item by name (in a dry run: what would be done).
                println!("{}", done.report.summary());
                print!("{}", done.report.details());
                ExitCode::SUCCESS
            }
            Err(OnceError::NotLeader) => {
                eprintln!("ttlab-reaper: {}", OnceError::NotLeader);
                ExitCode::from(EXIT_NOT_LEADER)
            }
            Err(e) => {
                eprintln!("ttlab-reaper: the cycle could not run: {e}");
                ExitCode::FAILURE
            }
        });
    }

    let ctx = if args.relist_every.is_zero() {
        ctx
    } else {
        ctx.with_cached_listings(args.relist_every)
    };
    let shutdown = ctx.shutdown.clone();
    let (bound, server) =
        ttlab_reaper::serve_metrics(args.metrics_listen, metrics.clone(), shutdown.clone()).await?;
    tracing::info!(env = %args.env, namespace = %args.cluster.namespace, metrics = %bound, dry_run = args.dry_run, "ttlab-reaper started");
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    within_grace(ttlab_reaper::run(ctx, args.interval, metrics), &shutdown).await;
    shutdown.cancel();
    let _ = server.await;
    tracing::info!("ttlab-reaper stopped");
    Ok(ExitCode::SUCCESS)
}

/// The reaper over the sites of a sites file: each site's client is built when the reaper
/// first acts (a site whose client cannot be built is reported, and tried again, while the
/// others work), and each site runs on its own schedule under the one leader lease.
async fn with_sites(
    args: Args,
    store: ttlab_store::Store,
    settings: ReaperSettings,
    cluster_args: ClusterArgs,
    config: ttlab_site::SitesConfig,
    metrics: Arc<Metrics>,
) -> anyhow::Result<ExitCode> {
    let shutdown = CancellationToken::new();
    let known: Arc<[ttlab_model::SiteName]> =
        config.sites().iter().map(|s| s.name.clone()).collect();
    let relist = (!args.once && !args.relist_every.is_zero()).then_some(args.relist_every);
    let sites = config
        .sites()
        .iter()
        .map(|site| {
            let name = site.name.clone();
            let site = Arc::new(site.clone());
            let (store, env, settings) = (store.clone(), args.env.clone(), settings.clone());
            let (cluster_args, shutdown, known) =
                (cluster_args.clone(), shutdown.clone(), known.clone());
            let connect: ttlab_reaper::Connector = Arc::new(move || {
                let site = site.clone();
                let (store, env, settings) = (store.clone(), env.clone(), settings.clone());
                let (cluster_args, shutdown, known) =
                    (cluster_args.clone(), shutdown.clone(), known.clone());
                Box::pin(async move {
                    let cluster = ttlab_cli::connect_site(&site, &cluster_args, USER_AGENT).await?;
                    let mut ctx = ReaperContext::new(store, Arc::new(cluster), env)
                        .with_settings(settings)
                        .with_site(site.name.clone(), &known);
                    ctx.shutdown = shutdown;
                    Ok(match relist {
                        Some(every) => ctx.with_cached_listings(every),
                        None => ctx,
                    })
                })
            });
            SiteWork::connect_with(name, connect)
        })
        .collect();
    let reaper = Reaper {
        store,
        env: args.env.clone(),
        shutdown: shutdown.clone(),
        sites,
    };

    if args.once {
        return Ok(
            match ttlab_reaper::run_once_sites(&reaper, &metrics).await {
                Ok(outcomes) => {
                    let mut code = ExitCode::SUCCESS;
                    for (site, outcome) in outcomes {
                        match outcome {
                            Ok(done) => {
                                println!("site {site}: {}", done.report.summary());
                                print!("{}", done.report.details());
                            }
                            Err(e) => {
                                eprintln!(
                                    "ttlab-reaper: site {site}: the cycle could not run: {e}"
                                );
                                code = ExitCode::FAILURE;
                            }
                        }
                    }
                    code
                }
                Err(OnceError::NotLeader) => {
                    eprintln!("ttlab-reaper: {}", OnceError::NotLeader);
                    ExitCode::from(EXIT_NOT_LEADER)
                }
                Err(e) => {
                    eprintln!("ttlab-reaper: the cycle could not run: {e}");
                    ExitCode::FAILURE
                }
            },
        );
    }

    let (bound, server) =
        ttlab_reaper::serve_metrics(args.metrics_listen, metrics.clone(), shutdown.clone()).await?;
    let names: Vec<&str> = known.iter().map(|s| s.as_str()).collect();
    tracing::info!(env = %args.env, sites = %names.join(","), metrics = %bound, dry_run = args.dry_run, "ttlab-reaper started");
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    within_grace(
        ttlab_reaper::run_sites(reaper, args.interval, metrics),
        &shutdown,
    )
    .await;
    shutdown.cancel();
    let _ = server.await;
    tracing::info!("ttlab-reaper stopped");
    Ok(ExitCode::SUCCESS)
}

/// Runs the reaper until it ends, or until [`SHUTDOWN_GRACE`] after `shutdown` is cancelled:
/// a cluster that answers late (or never) must not keep the process past its pod's grace
/// period. What is abandoned is done again by the next cycle (deletes are idempotent).
async fn within_grace(reaper: impl std::future::Future<Output = ()>, shutdown: &CancellationToken) {
    tokio::select! {
        () = reaper => {}
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "calls were still in flight after the shutdown grace; leaving them to the next cycle");
        }
    }
}

/// How long the items in flight get after SIGTERM or SIGINT before the reaper exits anyway.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Cancels `token` on SIGTERM or SIGINT: the cycle in flight finishes its items, then the
/// reaper releases its lock and exits.
async fn cancel_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        tracing::warn!("cannot install the SIGTERM handler");
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("shutting down after the item in flight");
    token.cancel();
}
