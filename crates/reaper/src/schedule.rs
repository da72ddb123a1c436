//! When cycles run, per site (each site of the environment has its own schedule, side by
//! side under one leader lease: [`run_sites`]): a full sweep at start, every interval as the backstop and on "collect
//! now" requests (answered with the cycle's report row); and, side by side with the sweeps, a
//! database-only cycle at the next deadline (re-read whenever the server notifies a session
//! change), so an expiry never waits for a sweep of a large cluster. Deadline cycles run side
//! by side (up to [`MAX_DEADLINE_CYCLES`]): one waiting for a reclaimed VM to be gone never
//! holds back the next expiry. Only the holder of the
//! environment's leader lease acts (a row renewed on a heartbeat: `ttlab_store::leases`); it
//! stops as soon as it cannot renew, and other replicas take over once the lease expired on
//! the database clock — whatever the old leader's sockets do.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use tokio::time::Instant;
use ttlab_background::{Backoff, Reason, TaskRecord};
use ttlab_store::{
    Channel, CollectRequestId, CycleTrigger, LeaderLock, LeaseHolder, LeaseKind, Listener,
    ReaperCycle,
};

use tokio_util::sync::CancellationToken;

use crate::{CycleReport, Metrics, ReaperContext, ReaperError, reap_once, reap_sessions};

/// How often a waiting replica tries to take the leader lease.
pub const LEADER_RETRY: Duration = Duration::from_secs(1);
/// The shortest pause between cycles when a deadline is already past (a row that could not
/// even be moved to `finishing`), so a failing database is not hammered.
pub const MIN_PAUSE: Duration = Duration::from_secs(1);
/// How often a loop without a notification connection tries to open one again.
const LISTEN_RETRY: Duration = Duration::from_secs(5);
/// The pace of a standby's attempts to take the leader lease.
const LEADER_PACE: Backoff = Backoff::constant(LEADER_RETRY);
/// The pace of the deadline loop's attempts to open its notification connection again.
const LISTEN_PACE: Backoff = Backoff::constant(LISTEN_RETRY);
/// Slack added after a deadline, so the database clock has surely passed it on waking.
const DEADLINE_SLACK: Duration = Duration::from_millis(2);
/// At most this many deadline cycles run at once. A cycle can wait a few seconds for the
/// objects of a session it reclaimed to be gone; a deadline that comes due meanwhile starts a
/// cycle of its own instead of waiting for that one.
pub const MAX_DEADLINE_CYCLES: usize = 8;

/// The outcome of one cycle run by the scheduler: its report and, unless the database was
/// unreachable, the row recorded for it.
#[derive(Debug)]
pub struct RecordedCycle {
    /// The report.
    pub report: CycleReport,
    /// The recorded row (`None` if it could not be written; the failure is logged).
    pub row: Option<ReaperCycle>,
}

/// Runs one cycle, records its report (answering `answers`) and counts it in `metrics`. A
/// [`CycleTrigger::Wakeup`] (a deadline came due) runs the expired and stuck directions only
/// ([`reap_sessions`]); every other trigger runs the full cycle ([`reap_once`]).
pub async fn run_cycle(
    ctx: &ReaperContext,
    metrics: &Metrics,
    trigger: CycleTrigger,
    answers: &[CollectRequestId],
) -> RecordedCycle {
    let report = if trigger == CycleTrigger::Wakeup {
        reap_sessions(ctx).await
    } else {
        reap_once(ctx).await
    };
    metrics.observe(&report, trigger);
    if !report.ran() {
        let fatal = report.fatal.as_deref().unwrap_or("");
        tracing::error!(error = fatal, "the cycle could not run");
        // A cycle cannot run only when the database does not answer.
        metrics.database_failed(&format!("the cycle could not run: {fatal}"));
        return RecordedCycle { report, row: None };
    }
    tracing::info!(site = %ctx.site, trigger = trigger.as_str(), "{}", report.summary());
    log_dry_run(&report);
    let row = match ctx
        .store
        .reaper_cycles()
        .record_on_site(
            &report.to_new_cycle(trigger, answers.first().copied()),
            Some(&ctx.site),
            answers,
        )
        .await
    {
        Ok(row) => {
            metrics.database_answered();
            Some(row)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot record the cycle report");
            metrics.database_failed(&format!("cannot record the cycle report: {e}"));
            None
        }
    };
    RecordedCycle { report, row }
}

/// `--once`: takes the leader lease, runs one cycle and records it.
/// [`OnceError::NotLeader`] when another reaper of the environment holds the lease. A lease
/// held by a reaper that vanished runs out within its duration, so a held lease is tried
/// again for that long: only one a live reaper keeps renewing means "another is acting".
pub async fn run_once(ctx: &ReaperContext, metrics: &Metrics) -> Result<RecordedCycle, OnceError> {
    let lock = lock_once(&ctx.store, &ctx.env).await?;
    let done = once_on(ctx, metrics).await;
    let _ = lock.release().await;
    match &done.report.fatal {
        Some(reason) => Err(OnceError::Failed(ReaperError::Setting(reason.clone()))),
        None => Ok(done),
    }
}

/// `--once` over every site of `reaper`: takes the leader lease once, then runs one cycle per
/// site, side by side, each recorded. Each site's outcome is its own: its recorded cycle, or
/// why it could not run (its context could not be built, or its cycle could not run).
pub async fn run_once_sites(
    reaper: &Reaper,
    metrics: &Metrics,
) -> Result<Vec<(ttlab_model::SiteName, Result<RecordedCycle, ReaperError>)>, OnceError> {
    let lock = lock_once(&reaper.store, &reaper.env).await?;
    let runs = reaper.sites.iter().map(|work| async move {
        let ctx = match work.built() {
            Some(ctx) => Ok(ctx),
            None => match work.connect.as_ref() {
                Some(connect) => connect().await,
                None => Err(ReaperError::Setting("the site has no context".into())),
            },
        };
        let outcome = match ctx {
            Ok(ctx) => {
                let done = once_on(&ctx, metrics).await;
                match &done.report.fatal {
                    Some(reason) => Err(ReaperError::Setting(reason.clone())),
                    None => Ok(done),
                }
            }
            Err(e) => {
                metrics.site_connect_failed(work.site.as_str(), &e.to_string());
                Err(e)
            }
        };
        (work.site.clone(), outcome)
    });
    let outcomes = futures::future::join_all(runs).await;
    let _ = lock.release().await;
    Ok(outcomes)
}

/// Takes the leader lease for a one-shot; see [`run_once`].
async fn lock_once(
    store: &ttlab_store::Store,
    env: &ttlab_model::EnvName,
) -> Result<LeaderLock, OnceError> {
    let patience = store.lease_ttls().leader + LEADER_RETRY;
    let asked = Instant::now();
    loop {
        match store
            .try_leader_lock(env)
            .await
            .map_err(|e| OnceError::Failed(e.into()))?
        {
            Some(lock) => return Ok(lock),
            None if asked.elapsed() < patience => {
                tokio::time::sleep(LEADER_RETRY.min(patience / 4)).await;
            }
            None => return Err(OnceError::NotLeader),
        }
    }
}

/// One cycle of a one-shot on `ctx`'s site, answering the pending collect requests.
async fn once_on(ctx: &ReaperContext, metrics: &Metrics) -> RecordedCycle {
    let pending: Vec<CollectRequestId> = ctx
        .store
        .collect_requests()
        .pending(&ctx.env)
        .await
        .map(|p| p.into_iter().map(|r| r.id).collect())
        .unwrap_or_default();
    let trigger = if pending.is_empty() {
        CycleTrigger::Startup
    } else {
        CycleTrigger::Collect
    };
    run_cycle(ctx, metrics, trigger, &pending).await
}

/// Why `--once` did not run a cycle.
#[derive(Debug, thiserror::Error)]
pub enum OnceError {
    /// Another reaper of this environment holds the leader lease (and keeps renewing it).
    #[error("another reaper of this environment is acting (it holds the leader lease)")]
    NotLeader,
    /// The cycle could not run at all.
    #[error("{0}")]
    Failed(ReaperError),
}

/// Runs the reaper until `ctx.shutdown` is cancelled: waits for the leader lock, then acts
/// (cycles on the timer, at deadlines and on collect requests) until the lock is lost or
/// shutdown; then waits for the lock again. Returns after the cycle in flight (if any)
/// finished. One site, `ctx`'s: [`run_sites`] with that site alone.
pub async fn run(ctx: ReaperContext, interval: Duration, metrics: Arc<Metrics>) {
    let reaper = Reaper {
        store: ctx.store.clone(),
        env: ctx.env.clone(),
        shutdown: ctx.shutdown.clone(),
        sites: vec![SiteWork::ready(ctx)],
    };
    run_sites(reaper, interval, metrics).await;
}

/// Builds a site's context (its cluster client, and its watch-fed listings if wanted), again
/// after each failure. The context's shutdown token must be the reaper's.
pub type Connector = Arc<
    dyn Fn() -> futures::future::BoxFuture<'static, Result<ReaperContext, ReaperError>>
        + Send
        + Sync,
>;

/// One site the reaper works on: its context, or how to build it.
pub struct SiteWork {
    site: ttlab_model::SiteName,
    ctx: std::sync::Mutex<Option<ReaperContext>>,
    connect: Option<Connector>,
}

impl std::fmt::Debug for SiteWork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SiteWork")
            .field("site", &self.site)
            .finish_non_exhaustive()
    }
}

impl SiteWork {
    /// A site whose context is built already.
    pub fn ready(ctx: ReaperContext) -> Self {
        Self {
            site: ctx.site.clone(),
            ctx: std::sync::Mutex::new(Some(ctx)),
            connect: None,
        }
    }

    /// A site whose context `connect` builds when the reaper first acts, and again every
    /// [`CONNECT_RETRY`] while it fails (the site is `down` meanwhile; the others work).
    pub fn connect_with(site: ttlab_model::SiteName, connect: Connector) -> Self {
        Self {
            site,
            ctx: std::sync::Mutex::new(None),
            connect: Some(connect),
        }
    }

    /// The site.
    pub fn site(&self) -> &ttlab_model::SiteName {
        &self.site
    }

    fn built(&self) -> Option<ReaperContext> {
        self.ctx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// How often a site whose context could not be built is tried again.
pub const CONNECT_RETRY: Duration = Duration::from_secs(2);

/// The reaper of an environment over its sites: one leader lease for all of them, and under
/// it a schedule per site (sweeps and deadline cycles, its own cluster client and watch-fed
/// listings), each independent of the others: a site that is down, hangs or whose client
/// cannot be built holds back no other site's reclamation.
#[derive(Debug)]
pub struct Reaper {
    /// The database.
    pub store: ttlab_store::Store,
    /// The environment.
    pub env: ttlab_model::EnvName,
    /// Cancelled on shutdown (the sites' contexts share it).
    pub shutdown: CancellationToken,
    /// The sites.
    pub sites: Vec<SiteWork>,
}

/// Runs the reaper of every site in `reaper` until shutdown, as [`run`] does for one.
pub async fn run_sites(reaper: Reaper, interval: Duration, metrics: Arc<Metrics>) {
    let interval = interval.max(Duration::from_millis(10));
    // The holder of a lease this process lost and could not release (its database was away):
    // released first when the database answers again, so that the lease is taken again at
    // once rather than after it expires.
    let mut unreleased: Option<LeaseHolder> = None;
    loop {
        let Some(lock) = wait_for_lock(&reaper, &metrics, &mut unreleased).await else {
            return;
        };
        tracing::info!(env = %reaper.env, "acting as the reaper of this environment");
        metrics.leader.set(1);
        act(&reaper, &lock, interval, metrics.clone()).await;
        metrics.leader.set(0);
        let holder = lock.holder().clone();
        if let Err(e) = lock.release().await {
            tracing::debug!(error = %e, "cannot release the leader lease now; later");
            unreleased = Some(holder);
        }
        if reaper.shutdown.is_cancelled() {
            return;
        }
        tracing::warn!(env = %reaper.env, "lost the leader lock; waiting to take it again");
    }
}

/// Takes the leader lease, trying every [`LEADER_RETRY`] until it is free (or released by
/// its holder, or expired) — and, while the database does not answer, until it does: a
/// reaper never exits for want of its database. Each attempt that ends, answered or failed,
/// is progress of the loop (`/healthz`); whether it was answered is its readiness
/// (`/readyz`).
async fn wait_for_lock(
    ctx: &Reaper,
    metrics: &Metrics,
    unreleased: &mut Option<LeaseHolder>,
) -> Option<LeaderLock> {
    let mut announced = false;
    let mut pauses = LEADER_PACE.pauses();
    let mut reason = Reason::Start;
    loop {
        let began = metrics.leader_lease.began(reason);
        reason = Reason::Period;
        let tried = async {
            if let Some(holder) = unreleased.as_ref() {
                ctx.store
                    .leases()
                    .release(LeaseKind::ReaperLeader, ctx.env.as_str(), holder)
                    .await?;
                *unreleased = None;
            }
            ctx.store.try_leader_lock(&ctx.env).await
        }
        .await;
        // The attempt ended: the loop is alive (`/healthz`), whether or not it was answered.
        metrics.beat();
        match &tried {
            Ok(_) => {
                metrics.database_answered();
                metrics.leader_lease.ended(began, Ok(()));
            }
            Err(e) => {
                let error = format!("cannot try the leader lock: {e}");
                metrics.database_failed(&error);
                metrics.leader_lease.ended(began, Err(&error));
            }
        }
        match tried {
            Ok(Some(lock)) => return Some(lock),
            Ok(None) => {
                if !announced {
                    tracing::info!(env = %ctx.env, "another reaper is acting; waiting for its lock");
                    announced = true;
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot try the leader lock"),
        }
        tokio::select! {
            () = ctx.shutdown.cancelled() => return None,
            () = tokio::time::sleep(pauses.next_pause()) => {}
        }
    }
}

/// Opens a listener on `channel`, recording the attempt in `record`.
async fn open_listener(
    ctx: &ReaperContext,
    channel: Channel,
    record: &TaskRecord,
) -> Option<Listener> {
    let began = record.began(Reason::Trigger);
    match ctx.store.listen(&[channel]).await {
        Ok(l) => {
            record.ended(began, Ok(()));
            Some(l)
        }
        Err(e) => {
            tracing::warn!(error = %e, channel = channel.as_str(), "cannot listen for notifications; polling on the timer");
            record.ended(
                began,
                Err(&format!("cannot listen on {}: {e}", channel.as_str())),
            );
            None
        }
    }
}

/// Records that the listener of `channel` lost its connection.
fn listener_lost(record: &TaskRecord, channel: Channel, error: &str) {
    tracing::warn!(error = %error, "notification connection lost; reopening");
    record.failed(&format!(
        "the connection listening on {} was lost: {error}",
        channel.as_str()
    ));
}

/// The next notification of `listener` for this environment (`Err`: the connection was lost);
/// never, without a listener.
async fn notified(ctx: &ReaperContext, listener: &mut Option<Listener>) -> Result<(), String> {
    loop {
        match listener.as_mut() {
            Some(l) => match l.recv().await {
                Ok(n) if n.payload == ctx.env.as_str() => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            },
            None => std::future::pending::<()>().await,
        }
    }
}

/// Drains what else is queued on `listener` already.
fn drain(listener: &mut Option<Listener>) {
    if let Some(l) = listener.as_mut() {
        while let Some(Ok(_)) = l.recv().now_or_never() {}
    }
}

/// The deadline a deadline cycle last ran for, and when it ran.
type LastRun = Option<(chrono::DateTime<chrono::Utc>, Instant)>;

/// When the next deadline (expiry or readiness) of the environment comes due, as an instant
/// of the local monotonic clock computed from the database clock, with the deadline itself.
/// A deadline already past (it came due while the last cycle ran, or just now) wakes at once;
/// but if a cycle already ran for that very deadline (a row the cycle could not even move to
/// `finishing`), not before [`MIN_PAUSE`] after that run, so a failing database is not
/// hammered.
async fn next_wakeup(
    ctx: &ReaperContext,
    last_run: LastRun,
) -> Option<(Instant, chrono::DateTime<chrono::Utc>)> {
    let sessions = ctx.store.sessions();
    let deadline = sessions
        .next_deadline_on(&ctx.env, &ctx.site)
        .await
        .ok()??;
    let now = ctx.store.db_now().await.ok()?;
    let at = match deadline.signed_duration_since(now).to_std() {
        Ok(ahead) => Instant::now() + ahead + DEADLINE_SLACK,
        Err(_) => match last_run {
            Some((ran_for, ran_at)) if ran_for == deadline => ran_at + MIN_PAUSE,
            _ => Instant::now(),
        },
    };
    Some((at, deadline))
}

/// Acts as the environment's reaper until shutdown or the lock is lost. Two loops run side by
/// side: full sweeps (at start, on the timer, on "collect now") and deadline cycles (the
/// expired and stuck directions only, at the next expiry or readiness deadline). A deadline
/// that comes due during a long sweep is therefore handled at once, not after it. Both are
/// idempotent and every transition is conditional, so overlapping is safe.
async fn act(reaper: &Reaper, lock: &LeaderLock, interval: Duration, metrics: Arc<Metrics>) {
    let stop = reaper.shutdown.child_token();
    // The lease is lost (a renewal refused, or none got through in time): stop at once, not
    // at the next cycle's check, so a standby that takes over never acts beside us.
    let watch_lease = async {
        tokio::select! {
            () = stop.cancelled() => {}
            () = lock.lost() => {
                tracing::warn!(env = %reaper.env, "the leader lease could not be renewed; stopping");
                stop.cancel();
            }
        }
    };
    let sites = futures::future::join_all(
        reaper
            .sites
            .iter()
            .map(|site| act_on_site(site, lock, interval, metrics.clone(), &stop)),
    );
    tokio::join!(sites, watch_lease);
}

/// Acts on one site until `stop`: builds its context if need be (again every
/// [`CONNECT_RETRY`] while that fails), then runs its sweeps and deadline cycles.
async fn act_on_site(
    work: &SiteWork,
    lock: &LeaderLock,
    interval: Duration,
    metrics: Arc<Metrics>,
    stop: &CancellationToken,
) {
    let site = work.site.as_str();
    let ctx = loop {
        if let Some(ctx) = work.built() {
            break ctx;
        }
        let Some(connect) = work.connect.as_ref() else {
            return;
        };
        metrics.site_connecting(site);
        let built = tokio::select! {
            () = stop.cancelled() => return,
            built = connect() => built,
        };
        // An attempt that ended is progress of the loop, as a lock attempt is.
        metrics.beat();
        match built {
            Ok(ctx) => {
                *work
                    .ctx
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(ctx.clone());
                break ctx;
            }
            Err(e) => {
                tracing::warn!(site, error = %e, "cannot build the site's cluster client; the other sites go on, this one is tried again");
                metrics.site_connect_failed(site, &format!("cannot build its client: {e}"));
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(CONNECT_RETRY) => {}
                }
            }
        }
    };
    metrics.site_connecting(site);
    tracing::info!(site, namespace = %ctx.cluster.namespace(), "acting on the site");
    let work = async {
        tokio::join!(
            sweeps(&ctx, lock, interval, &metrics, stop),
            deadlines(&ctx, lock, metrics.clone(), stop),
        )
    };
    // Told to stop (the lease lost, or shutting down), a site whose cluster call hangs is not
    // waited out: the reaper takes its lease again, and the other sites act again, only once
    // every site's work has ended. Its cycle is dropped mid-way, as a killed reaper's is.
    let stopped = async {
        stop.cancelled().await;
        tokio::time::sleep(STOP_GRACE).await;
    };
    tokio::select! {
        _ = work => {}
        () = stopped => {
            tracing::warn!(site, "the site's cycle did not end within {} s of the stop; dropped", STOP_GRACE.as_secs());
        }
    }
}

/// How long a site's cycle may go on after the site was told to stop (see `act_on_site`).
const STOP_GRACE: Duration = Duration::from_secs(2);

/// Confirms the leader lock before a cycle; on losing it, stops both loops.
async fn still_leader(lock: &LeaderLock, stop: &CancellationToken) -> bool {
    if stop.is_cancelled() {
        return false;
    }
    if let Err(e) = lock.check().await {
        tracing::warn!(error = %e, "the leader lock is gone");
        stop.cancel();
        return false;
    }
    true
}

async fn sweeps(
    ctx: &ReaperContext,
    lock: &LeaderLock,
    interval: Duration,
    metrics: &Metrics,
    stop: &CancellationToken,
) {
    let record = &metrics.notifications;
    let mut listener = open_listener(ctx, Channel::CollectRequested, record).await;
    let mut trigger = CycleTrigger::Startup;
    loop {
        if !still_leader(lock, stop).await {
            return;
        }
        if listener.is_none() {
            listener = open_listener(ctx, Channel::CollectRequested, record).await;
        }
        let answers: Vec<CollectRequestId> =
            match ctx.store.collect_requests().pending(&ctx.env).await {
                Ok(p) => p.into_iter().map(|r| r.id).collect(),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read collect requests");
                    Vec::new()
                }
            };
        if !answers.is_empty() {
            trigger = CycleTrigger::Collect;
        }
        run_cycle(ctx, metrics, trigger, &answers).await;

        let sweep_at = Instant::now() + interval;
        trigger = tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(sweep_at) => CycleTrigger::Timer,
            n = notified(ctx, &mut listener) => {
                if let Err(e) = n {
                    listener_lost(record, Channel::CollectRequested, &e);
                    listener = None;
                }
                drain(&mut listener);
                CycleTrigger::Collect
            }
        };
    }
}

/// The deadline cycles in flight. Each runs on its own task, so one that waits for a
/// reclaimed session's objects to be gone does not hold back the next deadline; the loop
/// waits for all of them before it returns, so no cycle outlives the leadership it ran under.
struct InFlight {
    ctx: ReaperContext,
    metrics: Arc<Metrics>,
    cycles: tokio::task::JoinSet<()>,
}

impl InFlight {
    /// Starts a deadline cycle, after one in flight has finished if [`MAX_DEADLINE_CYCLES`]
    /// already run.
    async fn start(&mut self) {
        while self.cycles.len() >= MAX_DEADLINE_CYCLES {
            self.finished().await;
        }
        let ctx = self.ctx.clone();
        let metrics = self.metrics.clone();
        self.cycles.spawn(async move {
            run_cycle(&ctx, &metrics, CycleTrigger::Wakeup, &[]).await;
        });
    }

    /// Waits for one cycle in flight to finish; never, with none in flight.
    async fn finished(&mut self) {
        match self.cycles.join_next().await {
            Some(Err(e)) => tracing::error!(error = %e, "a deadline cycle ended abnormally"),
            Some(Ok(())) => {}
            None => std::future::pending().await,
        }
    }

    /// Waits for every cycle in flight.
    async fn drain(&mut self) {
        while !self.cycles.is_empty() {
            self.finished().await;
        }
    }
}

async fn deadlines(
    ctx: &ReaperContext,
    lock: &LeaderLock,
    metrics: Arc<Metrics>,
    stop: &CancellationToken,
) {
    let mut in_flight = InFlight {
        ctx: ctx.clone(),
        metrics,
        cycles: tokio::task::JoinSet::new(),
    };
    deadline_loop(ctx, lock, stop, &mut in_flight).await;
    in_flight.drain().await;
}

async fn deadline_loop(
    ctx: &ReaperContext,
    lock: &LeaderLock,
    stop: &CancellationToken,
    in_flight: &mut InFlight,
) {
    let metrics = in_flight.metrics.clone();
    let record = &metrics.notifications;
    let mut listener = open_listener(ctx, Channel::SessionsChanged, record).await;
    let mut listen_pauses = LISTEN_PACE.pauses();
    let mut last_run: LastRun = None;
    loop {
        if stop.is_cancelled() {
            return;
        }
        if listener.is_none() {
            listener = open_listener(ctx, Channel::SessionsChanged, record).await;
        }
        // Without a deadline (or a database to read it from), wait for a session change;
        // the sweeps' timer is the backstop.
        let next = next_wakeup(ctx, last_run).await;
        // Without a listener, look again every few seconds (and try to listen again).
        let retry = match listener {
            Some(_) => {
                listen_pauses.reset();
                None
            }
            None => Some(Instant::now() + listen_pauses.next_pause()),
        };
        let wake = match (next, retry) {
            (Some((d, _)), Some(r)) if r < d => Some((r, None)),
            (Some((d, deadline)), _) => Some((d, Some(deadline))),
            (None, Some(r)) => Some((r, None)),
            (None, None) => None,
        };
        // A deadline already due runs now: a timer set in the past may still wait for the
        // timer's next tick, and a steady stream of notifications would win every time.
        let due_now = match wake {
            Some((at, Some(d))) if at <= Instant::now() => Some(d),
            _ => None,
        };
        if let Some(d) = due_now {
            last_run = Some((d, Instant::now()));
            if still_leader(lock, stop).await {
                in_flight.start().await;
            }
            continue;
        }
        let due = async {
            match wake {
                Some((at, deadline)) => {
                    tokio::time::sleep_until(at).await;
                    deadline
                }
                None => std::future::pending().await,
            }
        };
        // Biased: a deadline that is due wins over the stream of session changes (each of
        // which would only re-read the deadline).
        let run = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            deadline = due => match deadline {
                Some(d) => {
                    last_run = Some((d, Instant::now()));
                    true
                }
                None => false,
            },
            n = notified(ctx, &mut listener) => {
                // A session changed: re-read the deadline (after what else is queued).
                if let Err(e) = n {
                    listener_lost(record, Channel::SessionsChanged, &e);
                    listener = None;
                }
                drain(&mut listener);
                // Something may have been missed while the connection was down: run.
                listener.is_none()
            }
            // A cycle finished: what it could not reclaim is due again (after `MIN_PAUSE`).
            () = in_flight.finished() => false,
        };
        if run && still_leader(lock, stop).await {
            in_flight.start().await;
        }
    }
}

/// A dry run changes nothing, so what it would do is its whole output: every item by name.
fn log_dry_run(report: &CycleReport) {
    if !report.dry_run {
        return;
    }
    for a in &report.actions {
        tracing::info!(direction = ?a.direction, subject = %a.subject, "dry run: {}", a.what);
    }
}
