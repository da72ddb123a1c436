//! ttlab-server: the student-facing HTTP service. Parses the settings (flags or `TTLAB_*`
//! variables), opens the database and the cluster clients (one per site of the sites file,
//! `TTLAB_SITES`; without it the one cluster), and runs `ttlab_api::Server`. A site whose
//! client cannot be built is kept, unreachable, with the reason; an invalid sites file is a
//! start-up error naming the file, the site and the field.
//! Neither has to answer at start: the server serves at once, is not ready (`/readyz` says
//! why) and keeps trying; it migrates the schema once the database answers. It exits only
//! for a wrong setting (a database that refuses its certificate, credentials or database name
//! included) or a port it cannot bind.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Parser;
use ttlab_api::auth::{AuthConfig, AuthSecret};
use ttlab_api::{ApiConfig, Server};
use ttlab_cli::{ClusterArgs, DatabaseArgs, SitesArgs};
use ttlab_lesson::LessonSet;
use ttlab_lifespan::Policy;
use ttlab_model::EnvName;

/// ttlab-server: lab sessions on KubeVirt VMs.
#[derive(Debug, Parser)]
#[command(name = "ttlab-server", version, about)]
struct Args {
    #[command(flatten)]
    db: DatabaseArgs,
    #[command(flatten)]
    cluster: ClusterArgs,
    #[command(flatten)]
    sites: SitesArgs,
    /// Environment label stamped on every object (dev, prod, …).
    #[arg(long, env = "TTLAB_ENV", default_value = "dev")]
    env: EnvName,
    /// Address to listen on (students, admins, the web pages).
    #[arg(long, env = "TTLAB_LISTEN", default_value = "0.0.0.0:8080")]
    listen: SocketAddr,
    /// Address of the ops port: /healthz, /readyz, /healthz/cluster and /metrics are served
    /// there only, not on --listen. Unset: they are served on --listen.
    #[arg(long, env = "TTLAB_OPS_LISTEN")]
    ops_listen: Option<SocketAddr>,
    /// Longest a request may take before it is answered 503 (e.g. 60s).
    #[arg(long, env = "TTLAB_REQUEST_TIMEOUT", default_value = "60s", value_parser = humantime::parse_duration)]
    request_timeout: std::time::Duration,
    /// How long a freed place is held for the first student on the waitlist (e.g. 2m).
    #[arg(long, env = "TTLAB_WAITLIST_HOLD", default_value = "2m", value_parser = humantime::parse_duration)]
    waitlist_hold: std::time::Duration,
    /// How long a student waits without a place held for them before they are taken off the
    /// waitlist (e.g. 1h; their page says why and offers to join again).
    #[arg(long, env = "TTLAB_WAITLIST_MAX_WAIT", default_value = "1h", value_parser = humantime::parse_duration)]
    waitlist_max_wait: std::time::Duration,
    /// Most requests answered at once; beyond, 503 `overloaded` at once.
    #[arg(long, env = "TTLAB_MAX_CONCURRENT_REQUESTS", default_value_t = ttlab_api::DEFAULT_MAX_CONCURRENT_REQUESTS)]
    max_concurrent_requests: usize,
    /// Starts, extends and grades one user may send back to back (each counted apart).
    #[arg(long, env = "TTLAB_USER_RATE_BURST", default_value_t = ttlab_api::limits::RateLimit::DEFAULT.burst)]
    user_rate_burst: u32,
    /// Then one per this long (e.g. 1s); 0s turns the per-user limit off.
    #[arg(long, env = "TTLAB_USER_RATE_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    user_rate_interval: std::time::Duration,
    /// HMAC secret of the bearer tokens (at least 32 bytes).
    #[arg(long, env = "TTLAB_AUTH_SECRET", hide_env_values = true)]
    auth_secret: String,
    /// Trust this header, set by an authenticating proxy, as the student's user id (only on
    /// connections from --auth-proxies).
    #[arg(long, env = "TTLAB_AUTH_HEADER")]
    auth_header: Option<String>,
    /// The authenticating proxy's addresses or CIDR blocks, comma-separated: the only peers
    /// whose --auth-header is believed. Required with --auth-header.
    #[arg(long, env = "TTLAB_AUTH_PROXIES")]
    auth_proxies: Option<String>,
    /// Lesson file or directory.
    #[arg(long, env = "TTLAB_LESSONS")]
    lessons: PathBuf,
    /// Most VMs in the namespace at once.
    #[arg(long, env = "TTLAB_VM_LIMIT", default_value_t = ttlab_api::DEFAULT_VM_LIMIT)]
    vm_limit: usize,
    /// Session length (e.g. 60m).
    #[arg(long, env = "TTLAB_SESSION_TTL")]
    session_ttl: Option<String>,
    /// Longest a session can be extended to (e.g. 180m).
    #[arg(long, env = "TTLAB_SESSION_MAX")]
    session_max: Option<String>,
    /// How many extensions a session may have.
    #[arg(long, env = "TTLAB_MAX_EXTENSIONS")]
    max_extensions: Option<String>,
    /// How long before the expiry a student may extend (e.g. 15m).
    #[arg(long, env = "TTLAB_EXTEND_WINDOW")]
    extend_window: Option<String>,
    /// How long after the maximum lifetime VM guests power themselves off and pod labs are
    /// stopped, should nothing reclaim them first (e.g. 15m).
    #[arg(long, env = "TTLAB_HARD_DEADLINE_GRACE")]
    hard_deadline_grace: Option<String>,
    /// The guest agent binary to deliver (default: `ttlab-agent` beside this executable): its
    /// gzip becomes the shared ConfigMap `ttlab-agent-<digest prefix>` every VM mounts.
    #[arg(long, env = "TTLAB_AGENT_BINARY")]
    agent_binary: Option<PathBuf>,
    /// Directory of the static web pages.
    #[arg(long, env = "TTLAB_WEB_DIR")]
    web_dir: Option<PathBuf>,
    /// How long a session's provisioning lease lasts unless renewed: another server adopts
    /// the session this long after its provisioner vanished.
    #[arg(long, env = "TTLAB_PROVISIONING_LEASE", default_value = "10s", value_parser = humantime::parse_duration)]
    provisioning_lease: std::time::Duration,
    /// How long a "Start lab" waits behind another one counting capacity before it is told
    /// to try again (503).
    #[arg(long, env = "TTLAB_CAPACITY_LOCK_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    capacity_lock_timeout: std::time::Duration,
    /// How long provisioning keeps retrying one cluster call that fails transiently (a 5xx,
    /// 429, a timeout, a lost connection) before the session fails (e.g. 60s; more than zero).
    #[arg(long, env = "TTLAB_CLUSTER_RETRY_BUDGET", default_value = "60s", value_parser = positive_duration)]
    cluster_retry_budget: std::time::Duration,
    /// How the server reaches the agents in the guests: `pod-ip` (a TCP connection to the
    /// VMI's address, from inside the cluster) or `portforward` (through the API server,
    /// KubeVirt's `portforward` subresource).
    #[arg(long, env = "TTLAB_AGENT_PATH", default_value = "pod-ip", value_parser = agent_path)]
    agent_path: ttlab_api::AgentPath,
}

/// A `TTLAB_AGENT_PATH` value.
fn agent_path(s: &str) -> Result<ttlab_api::AgentPath, String> {
    ttlab_api::agent_path_setting(s).map_err(|e| e.to_string())
}

/// A humantime duration (`90s`, `2m`) that is more than zero.
fn positive_duration(s: &str) -> Result<std::time::Duration, String> {
    match humantime::parse_duration(s) {
        Ok(d) if d.is_zero() => Err(format!("{s:?}: must be more than zero (e.g. 60s)")),
        Ok(d) => Ok(d),
        Err(e) => Err(format!("{s:?}: {e} (write a duration such as 60s or 2m)")),
    }
}

/// How this program names itself to the Kubernetes API server and to guest agents.
const USER_AGENT: &str = concat!("ttlab-server/", env!("CARGO_PKG_VERSION"));

/// Caps the PostgreSQL client's query log (which prints parameters) below debug.
const QUIET_QUERIES: &str = "tokio_postgres::query=info";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
                // The PostgreSQL client logs query parameters at debug, and those include the
                // per-VM agent tokens: never let them into the log, whatever RUST_LOG says.
                .add_directive(QUIET_QUERIES.parse().expect("a valid log directive")),
        )
        .init();
    match run(Args::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ttlab-server: error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let secret =
        AuthSecret::new(args.auth_secret.into_bytes()).map_err(ttlab_api::ApiError::from)?;
    let mut auth = AuthConfig::new(secret);
    if let Some(header) = args.auth_header.as_deref().filter(|h| !h.trim().is_empty()) {
        let proxies = args
            .auth_proxies
            .as_deref()
            .filter(|p| !p.trim().is_empty())
            .context(
                "TTLAB_AUTH_HEADER needs TTLAB_AUTH_PROXIES: the authenticating proxy's \
                 addresses (the header is ignored from any other peer, the Ingress included)",
            )?
            .parse()?;
        auth = auth.with_trusted_header(header, proxies)?;
    }
    let policy = Policy::from_settings(
        args.session_ttl.as_deref(),
        args.session_max.as_deref(),
        args.max_extensions.as_deref(),
    )?
    .with_extend_window_setting(args.extend_window.as_deref())?
    .with_hard_deadline_grace_setting(args.hard_deadline_grace.as_deref())?;
    let lessons = LessonSet::load(&args.lessons)?;
    let agent_path = match args.agent_binary {
        Some(p) => p,
        None => std::env::current_exe()
            .context("locating the server executable")?
            .with_file_name("ttlab-agent"),
    };
    let agent_bytes = std::fs::read(&agent_path).with_context(|| {
        format!(
            "reading the guest agent {} (set TTLAB_AGENT_BINARY)",
            agent_path.display()
        )
    })?;
    let agent = ttlab_cloudinit::AgentPayload::new(&agent_bytes)?;

    let mut options = args.db.store_options();
    options.timeouts.capacity_lock = args.capacity_lock_timeout;
    options.leases.provisioning = args.provisioning_lease;
    // The server's `database` task connects, migrates and retries; one attempt now tells a
    // database that is away (the server waits for it) from one that refuses this server (a
    // wrong CA, password or database name: a setting to fix, which waiting would not).
    let store = args.db.open(options)?;
    match store.ping().await {
        Ok(()) => {}
        Err(e) if e.is_rejection() => return Err(e.into()),
        Err(e) => tracing::warn!(error = %e, "the database does not answer yet; waiting for it"),
    }
    // Validated before anything is served: a bad file names the file, the site and the field.
    let sites = args
        .sites
        .load(
            &args.cluster,
            u32::try_from(args.vm_limit).unwrap_or(u32::MAX),
        )
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    // Only reads the kubeconfigs (or the service account): the API servers are first called
    // by the tasks, which retry. Without a sites file, the one cluster is the site `default`.
    let clusters = match &args.sites.sites {
        None => Clusters::One(Arc::new(args.cluster.connect(USER_AGENT).await?)),
        Some(_) => Clusters::Sites(connect_sites(&sites, &args.cluster).await),
    };

    let mut config = ApiConfig::new(args.env, auth, lessons, agent);
    config.listen = args.listen;
    config.ops_listen = args.ops_listen;
    config.request_timeout = args.request_timeout;
    config.waitlist_hold = args.waitlist_hold;
    config.waitlist_max_wait = args.waitlist_max_wait;
    config.cluster_retry_budget = args.cluster_retry_budget;
    config.agent_path = args.agent_path;
    config.max_concurrent_requests = args.max_concurrent_requests;
    config.user_rate_limit = ttlab_api::limits::RateLimit {
        burst: args.user_rate_burst.max(1),
        interval: args.user_rate_interval,
    };
    config.vm_limit = args.vm_limit;
    config.policy = policy;
    config.web_dir = args.web_dir;
    config.user_agent = USER_AGENT.to_owned();
    config.migrate = true;
    let server = match clusters {
        Clusters::One(cluster) => Server::bind(config, store, cluster).await?,
        Clusters::Sites(runtimes) => Server::bind_sites(config, store, runtimes).await?,
    };
    // The agent of this version: its ConfigMap made sure of now, its sighting recorded while
    // the server runs (the reaper keeps versions a server saw recently).
    ttlab_api::tasks::start_agent_keeper(server.state())?;
    tracing::info!(
        addr = %server.local_addr(),
        ops_addr = ?server.ops_addr(),
        "ttlab-server listening"
    );
    // SIGTERM (a deploy) hands over first: new starts are refused, and the sessions being
    // prepared are released to another replica; then open requests finish and it stops.
    let state = server.state().clone();
    server
        .run(async move {
            shutdown_signal().await;
            tracing::info!("shutting down: handing over the sessions being prepared");
            ttlab_api::saga::hand_over(&state).await;
        })
        .await?;
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// The server's clusters: the one of `--kubeconfig`/`--namespace`, or a sites file's.
enum Clusters {
    One(Arc<ttlab_cluster::KubeCluster>),
    Sites(Vec<ttlab_api::sites::SiteRuntime>),
}

/// A client for each site of the file; a site whose client cannot be built is kept,
/// unreachable, with the reason (its sessions are reported, never forgotten).
async fn connect_sites(
    sites: &ttlab_site::SitesConfig,
    cluster: &ttlab_cli::ClusterArgs,
) -> Vec<ttlab_api::sites::SiteRuntime> {
    let mut runtimes = Vec::new();
    for site in sites.sites() {
        runtimes.push(
            match ttlab_cli::connect_site(site, cluster, USER_AGENT).await {
                Ok(client) => ttlab_api::sites::SiteRuntime::connected(site.clone(), Arc::new(client)),
                Err(e) => {
                    tracing::warn!(site = %site.name, error = %e, "no client for this site: it is kept unreachable");
                    ttlab_api::sites::SiteRuntime::unconnected(
                        site.clone(),
                        format!("no client could be built: {e}"),
                    )
                }
            },
        );
    }
    runtimes
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let required = [
            "ttlab-server",
            "--database-url",
            "postgres://127.0.0.1/ttlab",
            "--auth-secret",
            "a test secret that is long enough, 40+ b",
            "--lessons",
            "/nonexistent",
        ];
        Args::try_parse_from(required.iter().chain(extra))
    }

    #[test]
    fn the_cluster_retry_budget_is_a_duration_above_zero() {
        assert_eq!(
            parse(&[]).unwrap().cluster_retry_budget,
            std::time::Duration::from_secs(60)
        );
        assert_eq!(
            parse(&["--cluster-retry-budget", "90s"])
                .unwrap()
                .cluster_retry_budget,
            std::time::Duration::from_secs(90)
        );
        let zero = parse(&["--cluster-retry-budget", "0s"])
            .unwrap_err()
            .to_string();
        assert!(zero.contains("must be more than zero"), "{zero}");
        let garbage = parse(&["--cluster-retry-budget", "soon"])
            .unwrap_err()
            .to_string();
        assert!(
            garbage.contains("\"soon\"") && garbage.contains("duration"),
            "{garbage}"
        );
    }

    #[test]
    fn the_agent_path_is_pod_ip_unless_set_and_a_bad_one_is_refused() {
        assert_eq!(parse(&[]).unwrap().agent_path, ttlab_api::AgentPath::PodIp);
        assert_eq!(
            parse(&["--agent-path", "portforward"]).unwrap().agent_path,
            ttlab_api::AgentPath::Portforward
        );
        let bad = parse(&["--agent-path", "tunnel"]).unwrap_err().to_string();
        assert!(
            bad.contains("TTLAB_AGENT_PATH") && bad.contains("expected pod-ip"),
            "{bad}"
        );
    }
}
