//! The server's configuration, as values (the binary fills it from flags and `TTLAB_*`
//! variables; tests and `ttlabctl` fill it directly).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ttlab_cloudinit::AgentPayload;
use ttlab_lesson::LessonSet;
use ttlab_lifespan::Policy;
use ttlab_model::{EnvName, SiteName};

use crate::auth::AuthConfig;

/// Default VM limit (`TTLAB_VM_LIMIT`).
pub const DEFAULT_VM_LIMIT: usize = 8;
/// Default largest request body accepted, in bytes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 * 1024;
/// Default time "collect now" waits for the reaper's answer before 504.
pub const DEFAULT_COLLECT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time a create refused by a quota the cluster has not counted yet is retried.
pub const DEFAULT_QUOTA_SETTLE_WAIT: Duration = Duration::from_secs(30);

/// Default of [`ApiConfig::quota_recount_wait`]: a quota controller recounts within about a
/// second of a deletion on a quiet cluster, but several seconds later on a busy one (seen on
/// the real control plane under `ttlabctl soak --backend real`: refusals 1.4 s apart for more
/// than 4 s after a deletion).
pub const DEFAULT_QUOTA_RECOUNT_WAIT: Duration = Duration::from_secs(15);

/// Default of [`ApiConfig::cluster_retry_budget`].
pub const DEFAULT_CLUSTER_RETRY_BUDGET: Duration = Duration::from_secs(60);

/// Default of [`ApiConfig::request_timeout`]: above "collect now"'s 30 s wait.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// Default of [`ApiConfig::waitlist_hold`].
pub const DEFAULT_WAITLIST_HOLD: Duration = Duration::from_secs(120);
/// Default of [`ApiConfig::waitlist_max_wait`]: an hour.
pub const DEFAULT_WAITLIST_MAX_WAIT: Duration = Duration::from_secs(60 * 60);

/// Default of [`ApiConfig::max_concurrent_requests`].
pub const DEFAULT_MAX_CONCURRENT_REQUESTS: usize = 512;

/// Everything [`crate::Server::bind`] needs besides the database and the cluster.
///
/// | field | setting | default |
/// |---|---|---|
/// | `listen` | `TTLAB_LISTEN` | `0.0.0.0:8080` |
/// | `env` | `TTLAB_ENV` | `dev` |
/// | `auth` | `TTLAB_AUTH_SECRET` (≥ 32 bytes), `TTLAB_AUTH_HEADER` | required, off |
/// | `vm_limit` | `TTLAB_VM_LIMIT` | 8 |
/// | `policy` | `TTLAB_SESSION_TTL`, `TTLAB_SESSION_MAX`, `TTLAB_MAX_EXTENSIONS`, `TTLAB_EXTEND_WINDOW`, `TTLAB_HARD_DEADLINE_GRACE` | 60m, 180m, 3, 15m, 15m |
/// | `lessons` | `TTLAB_LESSONS` (file or directory) | required |
/// | `agent` | `TTLAB_AGENT_BINARY` | `ttlab-agent` beside the server |
/// | `web_dir` | `TTLAB_WEB_DIR` | none |
/// | `user_agent` | — (the binary names itself) | `ttlab/<version>` |
/// | `quota_settle_wait` | — | 30 s |
/// | `quota_recount_wait` | — | 15 s |
/// | `ops_listen` | `TTLAB_OPS_LISTEN` | none (health and metrics on `listen`) |
/// | `request_timeout` | `TTLAB_REQUEST_TIMEOUT` | 60 s |
/// | `max_concurrent_requests` | `TTLAB_MAX_CONCURRENT_REQUESTS` | 512 |
/// | `user_rate_limit` | `TTLAB_USER_RATE_BURST`, `TTLAB_USER_RATE_INTERVAL` | 10, 1 s |
/// | `trusted_proxies` | `TTLAB_TRUSTED_PROXIES` | none |
/// | `cluster_retry_budget` | `TTLAB_CLUSTER_RETRY_BUDGET` (more than zero) | 60 s |
/// | `agent_path` | `TTLAB_AGENT_PATH` (`pod-ip` or `portforward`) | `pod-ip` |
/// | `site` | — (the one site of a server without a sites file) | `default` |
/// | `migrate` | — (`ttlab-server` migrates) | false |
#[derive(Clone)]
pub struct ApiConfig {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The environment label stamped on every object, and the sessions this server resumes.
    pub env: EnvName,
    /// How requests are authenticated.
    pub auth: AuthConfig,
    /// Most VMs in the namespace at once (counted from the cluster), for a server without a
    /// sites file ([`crate::Server::bind`]); with one, each site has its own.
    pub vm_limit: usize,
    /// Session lifespan rules, the hard deadline's grace among them (what the saga renders
    /// into each guest's power-off and each pod's `activeDeadlineSeconds`).
    pub policy: Policy,
    /// The lessons offered.
    pub lessons: LessonSet,
    /// The guest agent, ready to embed in cloud-init.
    pub agent: AgentPayload,
    /// The port the guest agent listens on (the protocol's 8899 unless a test says otherwise).
    pub agent_port: u16,
    /// Largest request body accepted.
    pub max_body_bytes: usize,
    /// How long "collect now" waits for the reaper.
    pub collect_timeout: Duration,
    /// Static pages to serve (used by the web module, if mounted).
    pub web_dir: Option<PathBuf>,
    /// Extra time, beyond the lesson's readiness and setup timeouts, before the reaper may
    /// fail a session still `starting` (this server is then presumed dead).
    pub readiness_margin: Duration,
    /// How long a console ticket can be used (default 30 s, database clock).
    pub console_ticket_ttl: Duration,
    /// The `User-Agent` the server's requests to guest agents carry (`ttlab-server/0.1.0`).
    pub user_agent: String,
    /// How long the provisioning of a session retries a create that a ResourceQuota refused
    /// only because the cluster has not counted the quota yet (a quota or resource type that
    /// appeared moments ago), before the session fails. Default [`DEFAULT_QUOTA_SETTLE_WAIT`].
    pub quota_settle_wait: Duration,
    /// How long a create that the quota refused as exceeded is retried. The server admitted the
    /// session by its own count of the VMs in the cluster, and the quota controller recounts
    /// what a deletion freed only moments later (about a second on a real cluster): a
    /// refusal in that window is the quota lagging, not the namespace being full. Default
    /// [`DEFAULT_QUOTA_RECOUNT_WAIT`]; zero fails at the first refusal.
    pub quota_recount_wait: Duration,
    /// Where `/healthz`, `/readyz`, `/healthz/cluster` and `/metrics` are served, apart from
    /// the student-facing port (which then does not serve them): a port the Ingress does not
    /// route. `None` serves them on `listen` (tests, the demo).
    pub ops_listen: Option<SocketAddr>,
    /// The longest a request on the public port may take before it is answered 503
    /// `request_timeout` (WebSocket consoles and event streams are not cut: only the wait for
    /// their first answer counts).
    pub request_timeout: Duration,
    /// Most requests the public port works on at once; beyond, 503 `overloaded` with
    /// `Retry-After` at once rather than a queue.
    pub max_concurrent_requests: usize,
    /// How often one user may start, extend and grade (each counted apart); beyond, 429
    /// `rate_limited` with `Retry-After`.
    pub user_rate_limit: crate::limits::RateLimit,
    /// How long the provisioning of a session keeps retrying one cluster call that failed
    /// transiently (a 5xx, 429 Too Many Requests, a timeout, a lost connection), with jittered
    /// backoff, before the session fails with a reason naming the call and how often it
    /// failed. Creates are safe to repeat: an object this session already created under the
    /// same name is adopted. Default [`DEFAULT_CLUSTER_RETRY_BUDGET`]; zero fails at the first
    /// transient failure (the binary's `TTLAB_CLUSTER_RETRY_BUDGET` refuses zero).
    pub cluster_retry_budget: Duration,
    /// How long a freed place is held for the first student on the waitlist; only they can
    /// take it meanwhile, and when it lapses the place passes to the next in line. Default
    /// [`DEFAULT_WAITLIST_HOLD`].
    pub waitlist_hold: Duration,
    /// Whether the server applies the schema migrations itself once its database answers
    /// (`ttlab-server` does, retried until they apply, beside the `ttlabctl migrate`
    /// initContainer: whichever comes first applies them, the other finds nothing to do).
    /// False: the database must be migrated already (tests, the demo).
    pub migrate: bool,
    /// How long a student waits on the waitlist without a place being held for them before
    /// they are taken off it (their page says why and offers to join again). Default
    /// [`DEFAULT_WAITLIST_MAX_WAIT`].
    pub waitlist_max_wait: Duration,
    /// How the server reaches the agents in the guests, for a server without a sites file;
    /// with one, each site names its own. Default [`AgentPath::PodIp`].
    pub agent_path: AgentPath,
    /// The name of the one site of a server without a sites file (its cluster and
    /// namespace): every session it opens (and every warm-pool member) records it, and the
    /// admin's capacity view reports under it. Default [`ttlab_site::DEFAULT_SITE`]. With a
    /// sites file ([`crate::Server::bind_sites`]) the sites' own names are used.
    pub site: SiteName,
}

/// How the server reaches the agent in a guest (`TTLAB_AGENT_PATH`): `pod-ip`, a TCP
/// connection to the VMI's address (the server must be inside the VMs' cluster network, and
/// the NetworkPolicy must let it in), or `portforward`, through the cluster's API server,
/// KubeVirt's `portforward` subresource of the VMI (a WebSocket per request; the server's
/// identity needs `get` on `virtualmachineinstances/portforward` in
/// `subresources.kubevirt.io`), for a server the pod network does not reach. The sites file
/// names the same paths.
pub use ttlab_site::AgentPath;

/// A `TTLAB_AGENT_PATH` value, or an error saying what is expected.
pub fn agent_path_setting(value: &str) -> Result<AgentPath, crate::ApiError> {
    AgentPath::from_name(value.trim()).ok_or_else(|| {
        crate::ApiError::Config(format!(
            "TTLAB_AGENT_PATH: {value:?} is not a way to reach the agents; expected pod-ip (the \
             VMI's address, from inside the cluster) or portforward (through the API server)"
        ))
    })
}

impl std::fmt::Debug for ApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiConfig")
            .field("listen", &self.listen)
            .field("env", &self.env)
            .field("auth", &self.auth)
            .field("vm_limit", &self.vm_limit)
            .field("policy", &self.policy)
            .field("lessons", &self.lessons.len())
            .field("agent_bytes", &self.agent.binary_len())
            .field("agent_port", &self.agent_port)
            .field("site", &self.site)
            .finish_non_exhaustive()
    }
}

impl ApiConfig {
    /// A configuration with the defaults above for everything but the required values.
    pub fn new(env: EnvName, auth: AuthConfig, lessons: LessonSet, agent: AgentPayload) -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            env,
            auth,
            vm_limit: DEFAULT_VM_LIMIT,
            policy: Policy::default(),
            lessons,
            agent,
            agent_port: ttlab_agent::protocol::PORT,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            collect_timeout: DEFAULT_COLLECT_TIMEOUT,
            web_dir: None,
            readiness_margin: Duration::from_secs(60),
            console_ticket_ttl: crate::console::TICKET_TTL,
            user_agent: ttlab_agent::AgentClient::DEFAULT_USER_AGENT.to_owned(),
            quota_settle_wait: DEFAULT_QUOTA_SETTLE_WAIT,
            quota_recount_wait: DEFAULT_QUOTA_RECOUNT_WAIT,
            ops_listen: None,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            max_concurrent_requests: DEFAULT_MAX_CONCURRENT_REQUESTS,
            user_rate_limit: crate::limits::RateLimit::DEFAULT,
            cluster_retry_budget: DEFAULT_CLUSTER_RETRY_BUDGET,
            waitlist_hold: DEFAULT_WAITLIST_HOLD,
            migrate: false,
            waitlist_max_wait: DEFAULT_WAITLIST_MAX_WAIT,
            agent_path: AgentPath::PodIp,
            site: ttlab_site::default_site_name(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{AgentPath, agent_path_setting};

    #[test]
    fn agent_paths_parse_from_their_names_and_nothing_else() {
        for path in [AgentPath::PodIp, AgentPath::Portforward] {
            assert_eq!(agent_path_setting(path.as_str()).unwrap(), path);
        }
        for bad in ["", "podip", "port-forward", "PortForward", "tcp"] {
            let err = agent_path_setting(bad).unwrap_err().to_string();
            assert!(
                err.contains("TTLAB_AGENT_PATH") && err.contains("expected pod-ip"),
                "{bad:?}: {err}"
            );
        }
    }
}
