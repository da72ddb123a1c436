//! Prometheus metrics of the reaper (counters per site, direction and outcome, cycles per site
//! and trigger, cycle durations, leadership, each site's state `ttlab_reaper_site_up{site}`,
//! the live sessions on sites not configured `ttlab_reaper_sessions_unknown_site{site}`, and
//! the status records of its loops: taking the leader lease and opening the notification
//! listeners, `ttlab_reaper_task_*{task}`) and the small HTTP endpoint serving them with
//! `/healthz`.
//!
//! `/healthz` is the loop's heartbeat, not just "the process answers": it fails (503) when
//! the reaper's loop has not made progress for the configured stall time
//! ([`Metrics::with_stall_after`]) — as the leader, a cycle that ran; as a standby or while
//! its database is away, a leader lock attempt that ended, answered or failed. A reaper stuck
//! on a hung call is then restarted by its liveness probe instead of silently reclaiming
//! nothing; one whose database is down stays alive and keeps trying (a restart would not
//! bring the database back, and its back-off would keep the reaper away after the database
//! returned). Every site's cycles count as progress: a site that is down, hung or whose
//! client cannot be built does not fail `/healthz` while another site works. Its body names
//! each site's state (`up`, `down`, `connecting`, and `stalled` when no cycle of the site
//! ended within the stall time) and last error; `/healthz/sites` says the same as JSON.
//!
//! `/readyz` says whether the database answered the loop's last call, and if not, since when
//! it has not and the last error ([`Metrics::readiness`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use ttlab_background::{TaskMetrics, TaskName, TaskRecord};
use ttlab_store::{CycleTrigger, Direction};

use crate::{CycleReport, ReaperError};

/// A direction, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum DirectionLabel {
    Expired,
    Orphans,
    Ghosts,
    Stuck,
}

impl From<Direction> for DirectionLabel {
    fn from(d: Direction) -> Self {
        match d {
            Direction::Expired => Self::Expired,
            Direction::Orphans => Self::Orphans,
            Direction::Ghosts => Self::Ghosts,
            Direction::Stuck => Self::Stuck,
        }
    }
}

/// An item's outcome, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum OutcomeLabel {
    Done,
    Failed,
}

/// Labels of [`Metrics::items`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct ItemLabels {
    /// The site.
    pub site: String,
    /// The direction.
    pub direction: DirectionLabel,
    /// Done or failed.
    pub outcome: OutcomeLabel,
}

/// A trigger, as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, EncodeLabelValue)]
#[allow(missing_docs)]
pub enum TriggerLabel {
    Startup,
    Timer,
    Wakeup,
    Collect,
}

impl From<CycleTrigger> for TriggerLabel {
    fn from(t: CycleTrigger) -> Self {
        match t {
            CycleTrigger::Startup => Self::Startup,
            CycleTrigger::Timer => Self::Timer,
            CycleTrigger::Wakeup => Self::Wakeup,
            CycleTrigger::Collect => Self::Collect,
        }
    }
}

/// Labels of the objects still terminating: their site and kind (`VirtualMachine`, `Secret`, …).
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct KindLabels {
    /// The object's kind.
    pub kind: String,
    /// The site.
    pub site: String,
}

/// Labels of the per-site gauges: the site.
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct SiteLabels {
    /// The site.
    pub site: String,
}

/// Labels of [`Metrics::cycles`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
pub struct CycleLabels {
    /// The site.
    pub site: String,
    /// What started the cycle.
    pub trigger: TriggerLabel,
}

/// The reaper's metrics.
pub struct Metrics {
    registry: Registry,
    /// `ttlab_reaper_items_total{site, direction, outcome}`.
    pub items: Family<ItemLabels, Counter>,
    /// `ttlab_reaper_cycles_total{site, trigger}`.
    pub cycles: Family<CycleLabels, Counter>,
    /// `ttlab_reaper_cycles_not_run_total`: cycles that could not run at all.
    pub cycles_not_run: Counter,
    /// `ttlab_reaper_cycle_duration_seconds`.
    pub cycle_duration: Histogram,
    /// `ttlab_reaper_leader`: 1 while this process is the acting reaper.
    pub leader: Gauge<i64, AtomicI64>,
    /// `ttlab_reaper_last_cycle_timestamp_seconds`.
    pub last_cycle: Gauge<f64, AtomicU64>,
    /// Objects whose deletion was accepted but that were still there at the last cycle's look,
    /// by site and kind (their sessions stay finishing).
    pub objects_terminating: Family<KindLabels, Gauge>,
    /// `ttlab_reaper_site_up{site}`: 1 while the site's last full cycle listed its cluster
    /// and a cycle of it ended within the stall time, else 0.
    pub site_up: Family<SiteLabels, Gauge>,
    /// `ttlab_reaper_sessions_unknown_site{site}`: live sessions on a site not configured, as
    /// the last full cycle counted them (0 once none is left or the site is configured).
    pub sessions_unknown_site: Family<SiteLabels, Gauge>,
    /// What is known of each site, for `/healthz`.
    sites: Mutex<std::collections::BTreeMap<String, SiteSeen>>,
    /// The sites not configured that the last full cycle found live sessions on.
    unknown_seen: Mutex<std::collections::BTreeSet<String>>,
    /// The attempts to take the environment's leader lease (`leader_lease`): each attempt the
    /// database answered is a success, whether or not another reaper holds the lease.
    pub leader_lease: TaskRecord,
    /// The notification listeners (`notifications`): each attempt to open one, and each lost
    /// connection.
    pub notifications: TaskRecord,
    /// When the loop last made progress (start-up counts as progress).
    heartbeat: Mutex<Instant>,
    /// How long without progress `/healthz` tolerates; `None`: it always says ok.
    stall_after: Option<Duration>,
    /// What the last call to the database found, for `/readyz`.
    database: Mutex<DatabaseSeen>,
}

/// A site's state, as `/healthz` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SiteState {
    /// Its client is being built (or could not be built yet: see the last error).
    Connecting,
    /// Its last full cycle listed its cluster.
    Up,
    /// Its client could not be built, or its last full cycle could not list its cluster.
    Down,
    /// No cycle of it ended within the stall time (a call that hangs, a cycle that waits).
    Stalled,
}

impl SiteState {
    /// The state as written in `/healthz`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Connecting => "connecting",
            Self::Up => "up",
            Self::Down => "down",
            Self::Stalled => "stalled",
        }
    }
}

/// One site as `/healthz` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SiteHealth {
    /// The site.
    pub site: String,
    /// Its state.
    pub state: SiteState,
    /// Since when it has been in that state (up, down or connecting).
    pub since: chrono::DateTime<chrono::Utc>,
    /// Seconds since a cycle of it last ended (`None`: none yet).
    pub last_cycle_seconds_ago: Option<u64>,
    /// Its last error (`None` while it works).
    pub last_error: Option<String>,
}

/// What is known of one site.
#[derive(Debug, Clone)]
struct SiteSeen {
    state: SiteState,
    since: chrono::DateTime<chrono::Utc>,
    last_cycle: Option<Instant>,
    last_error: Option<String>,
    /// When it was first seen: a site with no cycle yet is stalled after the stall time.
    first_seen: Instant,
}

/// What the reaper's last calls to its database found (`/readyz`).
#[derive(Debug, Clone, Default)]
struct DatabaseSeen {
    /// Whether the last attempt was answered.
    answered: bool,
    /// Since when the attempts have failed (`None` while it answers, or before the first).
    unreachable_since: Option<chrono::DateTime<chrono::Utc>>,
    /// The last failure.
    last_error: Option<String>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Fresh metrics in their own registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("ttlab_reaper");
        let items = Family::<ItemLabels, Counter>::default();
        let cycles = Family::<CycleLabels, Counter>::default();
        let cycles_not_run = Counter::default();
        let cycle_duration = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let leader = Gauge::<i64, AtomicI64>::default();
        let last_cycle = Gauge::<f64, AtomicU64>::default();
        let objects_terminating = Family::<KindLabels, Gauge>::default();
        let site_up = Family::<SiteLabels, Gauge>::default();
        let sessions_unknown_site = Family::<SiteLabels, Gauge>::default();
        registry.register(
            "site_up",
            "1 while the site's last full cycle listed its cluster and a cycle of it ended \
             within the stall time, else 0, by site",
            site_up.clone(),
        );
        registry.register(
            "sessions_unknown_site",
            "Live sessions on a site the reaper is not configured with (left alone until it is), \
             by site",
            sessions_unknown_site.clone(),
        );
        registry.register(
            "items",
            "Items handled by the reaper, by site, direction and outcome",
            items.clone(),
        );
        registry.register(
            "cycles",
            "Reaper cycles run, by site and trigger",
            cycles.clone(),
        );
        registry.register(
            "cycles_not_run",
            "Reaper cycles that could not run at all (database unreachable)",
            cycles_not_run.clone(),
        );
        registry.register(
            "cycle_duration_seconds",
            "Duration of reaper cycles",
            cycle_duration.clone(),
        );
        registry.register(
            "leader",
            "1 while this process is the acting reaper of its environment",
            leader.clone(),
        );
        registry.register(
            "last_cycle_timestamp_seconds",
            "Unix time at which the last cycle ended",
            last_cycle.clone(),
        );
        registry.register(
            "objects_terminating",
            "Objects whose deletion was accepted but that were still there at the last cycle's \
             look (their sessions stay finishing), by site and kind",
            objects_terminating.clone(),
        );
        let tasks = TaskMetrics::new();
        tasks.register(&mut registry);
        let leader_lease = TaskRecord::new(
            TaskName::new("leader_lease"),
            "Tries to take the environment's leader lease, every second while another reaper \
             holds it",
            Some(crate::LEADER_RETRY),
            &tasks,
        );
        let notifications = TaskRecord::new(
            TaskName::new("notifications"),
            "Opens the LISTEN connections for collect requests and session changes, again \
             while one is down",
            None,
            &tasks,
        );
        Self {
            registry,
            leader_lease,
            notifications,
            items,
            cycles,
            cycles_not_run,
            cycle_duration,
            leader,
            last_cycle,
            objects_terminating,
            site_up,
            sessions_unknown_site,
            sites: Mutex::new(std::collections::BTreeMap::new()),
            unknown_seen: Mutex::new(std::collections::BTreeSet::new()),
            heartbeat: Mutex::new(Instant::now()),
            stall_after: None,
            database: Mutex::new(DatabaseSeen::default()),
        }
    }

    /// Makes `/healthz` fail once the loop has made no progress for `stall_after`.
    pub fn with_stall_after(mut self, stall_after: Duration) -> Self {
        self.stall_after = Some(stall_after);
        self
    }

    /// Records that the loop made progress (a cycle ran, or the database answered a standby's
    /// lock attempt).
    pub fn beat(&self) {
        *self
            .heartbeat
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Instant::now();
    }

    /// Records that the database answered (a lock attempt, a cycle): ready again.
    pub fn database_answered(&self) {
        let mut seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *seen = DatabaseSeen {
            answered: true,
            ..DatabaseSeen::default()
        };
    }

    /// Records that a call to the database failed with `error`: not ready until one is
    /// answered again.
    pub fn database_failed(&self, error: &str) {
        let mut seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.answered || seen.unreachable_since.is_none() {
            seen.unreachable_since = Some(chrono::Utc::now());
        }
        seen.answered = false;
        seen.last_error = Some(error.to_owned());
    }

    /// Ok once the database answered the loop's last call; otherwise why not, in one line
    /// (`/readyz`).
    pub fn readiness(&self) -> Result<(), String> {
        let seen = self
            .database
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if seen.answered {
            return Ok(());
        }
        Err(match (seen.unreachable_since, seen.last_error) {
            (Some(since), Some(error)) => format!(
                "the database has been unreachable since {} ({} s; the reaper keeps trying): {error}",
                since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                (chrono::Utc::now() - since).num_seconds().max(0)
            ),
            _ => "the database has not answered yet".to_owned(),
        })
    }

    /// Ok while the loop made progress within the stall time; otherwise how long it has not.
    pub fn health(&self) -> Result<(), Duration> {
        let since = self
            .heartbeat
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .elapsed();
        match self.stall_after {
            Some(limit) if since > limit => Err(since),
            _ => Ok(()),
        }
    }

    /// Counts one cycle's report.
    pub fn observe(&self, report: &CycleReport, trigger: CycleTrigger) {
        if !report.ran() {
            self.cycles_not_run.inc();
            return;
        }
        self.beat();
        let site = report.site.as_str().to_owned();
        self.site_cycle_ended(report);
        self.cycles
            .get_or_create(&CycleLabels {
                site: site.clone(),
                trigger: trigger.into(),
            })
            .inc();
        self.cycle_duration.observe(report.duration.as_secs_f64());
        for d in [
            Direction::Expired,
            Direction::Orphans,
            Direction::Ghosts,
            Direction::Stuck,
        ] {
            let c = report.count(d);
            for (outcome, n) in [
                (OutcomeLabel::Done, c.done),
                (OutcomeLabel::Failed, c.failed),
            ] {
                self.items
                    .get_or_create(&ItemLabels {
                        site: site.clone(),
                        direction: d.into(),
                        outcome,
                    })
                    .inc_by(u64::from(n));
            }
        }
        // A gauge per kind ttlab creates, so a kind whose last object went reads 0 again.
        // A sessions-only cycle looks at fewer sessions: it only raises the gauges.
        let mut by_kind = std::collections::BTreeMap::<String, i64>::new();
        for t in &report.terminating {
            *by_kind.entry(t.kind.name().to_owned()).or_default() += 1;
        }
        for kind in crate::ORPHAN_KINDS {
            let n = by_kind.get(kind.name()).copied().unwrap_or(0);
            let gauge = self.objects_terminating.get_or_create(&KindLabels {
                kind: kind.name().to_owned(),
                site: site.clone(),
            });
            if !report.sessions_only || n > gauge.get() {
                gauge.set(n);
            }
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.last_cycle.set(now);
    }

    /// Records that `site`'s client is being built.
    pub fn site_connecting(&self, site: &str) {
        self.set_site(site, SiteState::Connecting, None);
    }

    /// Records that `site`'s client could not be built, with why.
    pub fn site_connect_failed(&self, site: &str, error: &str) {
        self.set_site(site, SiteState::Down, Some(error.to_owned()));
    }

    fn set_site(&self, site: &str, state: SiteState, error: Option<String>) {
        let mut sites = self
            .sites
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let seen = sites.entry(site.to_owned()).or_insert_with(|| SiteSeen {
            state,
            since: chrono::Utc::now(),
            last_cycle: None,
            last_error: None,
            first_seen: Instant::now(),
        });
        if seen.state != state {
            seen.state = state;
            seen.since = chrono::Utc::now();
        }
        if error.is_some() || state == SiteState::Up {
            seen.last_error = error;
        }
        drop(sites);
        self.site_up
            .get_or_create(&SiteLabels {
                site: site.to_owned(),
            })
            .set(i64::from(state == SiteState::Up));
    }

    /// A cycle of the report's site ended: a full cycle says whether its cluster could be
    /// listed (up or down, with the error); a deadline cycle only that the site's loop moves.
    /// Also the live sessions on sites not configured, from a full cycle.
    fn site_cycle_ended(&self, report: &CycleReport) {
        let site = report.site.as_str();
        if report.sessions_only {
            let mut sites = self
                .sites
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(seen) = sites.get_mut(site) {
                seen.last_cycle = Some(Instant::now());
                return;
            }
        } else if report.cluster_listed {
            self.set_site(site, SiteState::Up, None);
        } else {
            let error = report
                .errors
                .iter()
                .find(|e| e.subject == "cluster")
                .or_else(|| report.errors.first())
                .map_or_else(
                    || "the cluster could not be listed".to_owned(),
                    |e| e.message.clone(),
                );
            self.set_site(site, SiteState::Down, Some(error));
        }
        if let Some(seen) = self
            .sites
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get_mut(site)
        {
            seen.last_cycle = Some(Instant::now());
        }
        if !report.sessions_only {
            self.unknown_sites(report);
        }
    }

    fn unknown_sites(&self, report: &CycleReport) {
        let mut seen = self
            .unknown_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let now: std::collections::BTreeSet<String> = report
            .unknown_sites
            .iter()
            .map(|(s, _)| s.as_str().to_owned())
            .collect();
        for gone in seen.difference(&now) {
            self.sessions_unknown_site
                .get_or_create(&SiteLabels { site: gone.clone() })
                .set(0);
        }
        for (site, n) in &report.unknown_sites {
            self.sessions_unknown_site
                .get_or_create(&SiteLabels {
                    site: site.as_str().to_owned(),
                })
                .set(i64::try_from(*n).unwrap_or(i64::MAX));
        }
        *seen = now;
    }

    /// Every site's state, by name. A site none of whose cycles ended within the stall time
    /// (since its last one, or since it was first seen) is [`SiteState::Stalled`].
    pub fn sites(&self) -> Vec<SiteHealth> {
        let sites = self
            .sites
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        sites
            .iter()
            .map(|(name, seen)| {
                let quiet = seen.last_cycle.unwrap_or(seen.first_seen).elapsed();
                let stalled = self.stall_after.is_some_and(|limit| quiet > limit)
                    && seen.state != SiteState::Down;
                SiteHealth {
                    site: name.clone(),
                    state: if stalled {
                        SiteState::Stalled
                    } else {
                        seen.state
                    },
                    since: seen.since,
                    last_cycle_seconds_ago: seen.last_cycle.map(|t| t.elapsed().as_secs()),
                    last_error: seen.last_error.clone(),
                }
            })
            .collect()
    }

    /// The sites, one line each, for the body of `/healthz`.
    fn sites_text(&self) -> String {
        let mut out = String::new();
        for s in self.sites() {
            out.push_str(&format!(
                "site {}: {} since {}",
                s.site,
                s.state.as_str(),
                s.since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
            ));
            if let Some(ago) = s.last_cycle_seconds_ago {
                out.push_str(&format!(", last cycle {ago} s ago"));
            }
            if let Some(e) = &s.last_error {
                out.push_str(&format!(", last error: {e}"));
            }
            out.push('\n');
        }
        out
    }

    /// The metrics in the Prometheus text format.
    pub fn render(&self) -> String {
        // A stalled site reads 0, though no cycle of it ended to say so.
        for s in self.sites() {
            if s.state == SiteState::Stalled {
                self.site_up
                    .get_or_create(&SiteLabels { site: s.site })
                    .set(0);
            }
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Serves `GET /metrics`, `GET /healthz` ([`Metrics::health`]: 200 `ok`, or 503 when the
/// loop stalled; then a line per site, [`Metrics::sites`]), `GET /healthz/sites` (the sites as
/// JSON: `{"sites": [{"site", "state", "since", "last_cycle_seconds_ago", "last_error"}]}`) and `GET /readyz` ([`Metrics::readiness`]: 200 `ready`, or 503 `not ready:`
/// and why) on `addr` until `shutdown` is cancelled. Binds before returning, so a taken
/// port fails at once.
pub async fn serve_metrics(
    addr: SocketAddr,
    metrics: Arc<Metrics>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<(SocketAddr, tokio::task::JoinHandle<()>), ReaperError> {
    use axum::routing::get;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ReaperError::Metrics { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| ReaperError::Metrics { addr, source })?;
    let health = metrics.clone();
    let ready = metrics.clone();
    let sites = metrics.clone();
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                let metrics = metrics.clone();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        metrics.render(),
                    )
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let health = health.clone();
                async move {
                    match health.health() {
                        Ok(()) => (
                            axum::http::StatusCode::OK,
                            format!("ok\n{}", health.sites_text()),
                        ),
                        Err(since) => (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            format!(
                                "stalled: the reaper loop has made no progress for {} s\n{}",
                                since.as_secs(),
                                health.sites_text()
                            ),
                        ),
                    }
                }
            }),
        )
        .route(
            "/healthz/sites",
            get(move || {
                let sites = sites.clone();
                async move {
                    let body = serde_json::json!({ "sites": sites.sites() });
                    (
                        [(axum::http::header::CONTENT_TYPE, "application/json")],
                        body.to_string(),
                    )
                }
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready.readiness() {
                        Ok(()) => (axum::http::StatusCode::OK, "ready\n".to_owned()),
                        Err(why) => (
                            axum::http::StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            }),
        );
    let task = tokio::spawn(async move {
        let serve = axum::serve(listener, app).with_graceful_shutdown(shutdown.cancelled_owned());
        if let Err(e) = serve.await {
            tracing::warn!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok((bound, task))
}
