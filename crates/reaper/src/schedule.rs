//! When cycles run: a sweep every interval as the backstop, a wake-up at the next deadline
//! (re-read whenever the server notifies a session change), and "collect now" requests,
//! answered with the cycle's report row. Only the holder of the environment's leader lock
//! acts; other replicas wait and take over when its connection drops.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use tokio::time::Instant;
use ttlab_store::{Channel, CollectRequestId, CycleTrigger, LeaderLock, Listener, ReaperCycle};

use crate::{CycleReport, Metrics, ReaperContext, ReaperError, reap_once};

/// How often a waiting replica tries to take the leader lock.
pub const LEADER_RETRY: Duration = Duration::from_secs(1);
/// The shortest pause between cycles when a deadline is already past (a row that could not
/// even be moved to `finishing`), so a failing database is not hammered.
pub const MIN_PAUSE: Duration = Duration::from_secs(1);
/// Slack added after a deadline, so the database clock has surely passed it on waking.
const DEADLINE_SLACK: Duration = Duration::from_millis(2);

/// The outcome of one cycle run by the scheduler: its report and, unless the database was
/// unreachable, the row recorded for it.
#[derive(Debug)]
pub struct RecordedCycle {
    /// The report.
    pub report: CycleReport,
    /// The recorded row (`None` if it could not be written; the failure is logged).
    pub row: Option<ReaperCycle>,
}

/// Runs one cycle, records its report (answering `answers`) and counts it in `metrics`.
pub async fn run_cycle(
    ctx: &ReaperContext,
    metrics: &Metrics,
    trigger: CycleTrigger,
    answers: &[CollectRequestId],
) -> RecordedCycle {
    let report = reap_once(ctx).await;
    metrics.observe(&report, trigger);
    if !report.ran() {
        tracing::error!(
            error = report.fatal.as_deref().unwrap_or(""),
            "the cycle could not run"
        );
        return RecordedCycle { report, row: None };
    }
    tracing::info!(trigger = trigger.as_str(), "{}", report.summary());
    let row = match ctx
        .store
        .reaper_cycles()
        .record(
            &report.to_new_cycle(trigger, answers.first().copied()),
            answers,
        )
        .await
    {
        Ok(row) => Some(row),
        Err(e) => {
            tracing::warn!(error = %e, "cannot record the cycle report");
            None
        }
    };
    RecordedCycle { report, row }
}

/// `--once`: takes the leader lock without waiting, runs one cycle and records it.
/// [`OnceError::NotLeader`] when another reaper of the environment holds the lock.
pub async fn run_once(ctx: &ReaperContext, metrics: &Metrics) -> Result<RecordedCycle, OnceError> {
    let lock = ctx
        .store
        .try_leader_lock(&ctx.env)
        .await
        .map_err(|e| OnceError::Failed(e.into()))?
        .ok_or(OnceError::NotLeader)?;
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
    let done = run_cycle(ctx, metrics, trigger, &pending).await;
    let _ = lock.release().await;
    match &done.report.fatal {
        Some(reason) => Err(OnceError::Failed(ReaperError::Setting(reason.clone()))),
        None => Ok(done),
    }
}

/// Why `--once` did not run a cycle.
#[derive(Debug, thiserror::Error)]
pub enum OnceError {
    /// Another reaper of this environment holds the leader lock.
    #[error("another reaper of this environment is acting (it holds the leader lock)")]
    NotLeader,
    /// The cycle could not run at all.
    #[error("{0}")]
    Failed(ReaperError),
}

/// Runs the reaper until `ctx.shutdown` is cancelled: waits for the leader lock, then acts
/// (cycles on the timer, at deadlines and on collect requests) until the lock is lost or
/// shutdown; then waits for the lock again. Returns after the cycle in flight (if any)
/// finished.
pub async fn run(ctx: ReaperContext, interval: Duration, metrics: Arc<Metrics>) {
    let interval = interval.max(Duration::from_millis(10));
    loop {
        let Some(lock) = wait_for_lock(&ctx).await else {
            return;
        };
        tracing::info!(env = %ctx.env, "acting as the reaper of this environment");
        metrics.leader.set(1);
        act(&ctx, &lock, interval, &metrics).await;
        metrics.leader.set(0);
        let _ = lock.release().await;
        if ctx.shutdown.is_cancelled() {
            return;
        }
        tracing::warn!(env = %ctx.env, "lost the leader lock; waiting to take it again");
    }
}

async fn wait_for_lock(ctx: &ReaperContext) -> Option<LeaderLock> {
    let mut announced = false;
    loop {
        match ctx.store.try_leader_lock(&ctx.env).await {
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
            () = tokio::time::sleep(LEADER_RETRY) => {}
        }
    }
}

async fn open_listener(ctx: &ReaperContext) -> Option<Listener> {
    match ctx
        .store
        .listen(&[Channel::SessionsChanged, Channel::CollectRequested])
        .await
    {
        Ok(l) => Some(l),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for notifications; polling on the timer");
            None
        }
    }
}

/// When the next deadline (expiry or readiness) of the environment comes due, as an instant
/// of the local monotonic clock computed from the database clock. A deadline already past
/// (it came due while the last cycle ran) wakes at once, but the same past deadline seen
/// again (a row the last cycle could not even move to `finishing`) waits [`MIN_PAUSE`], so a
/// failing database is not hammered.
async fn next_wakeup(
    ctx: &ReaperContext,
    last_past: &mut Option<chrono::DateTime<chrono::Utc>>,
) -> Option<Instant> {
    let sessions = ctx.store.sessions();
    let deadline = sessions.next_deadline(&ctx.env).await.ok()??;
    let now = ctx.store.db_now().await.ok()?;
    let wait = match deadline.signed_duration_since(now).to_std() {
        Ok(ahead) => {
            *last_past = None;
            ahead + DEADLINE_SLACK
        }
        Err(_) if *last_past == Some(deadline) => MIN_PAUSE,
        Err(_) => {
            *last_past = Some(deadline);
            DEADLINE_SLACK
        }
    };
    Some(Instant::now() + wait)
}

async fn act(ctx: &ReaperContext, lock: &LeaderLock, interval: Duration, metrics: &Metrics) {
    let mut listener = open_listener(ctx).await;
    let mut trigger = CycleTrigger::Startup;
    let mut last_past = None;
    loop {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        if listener.is_none() {
            listener = open_listener(ctx).await;
        }
        if let Err(e) = lock.check().await {
            tracing::warn!(error = %e, "the leader lock is gone");
            return;
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

        // Wait for the next reason to run.
        let sweep_at = Instant::now() + interval;
        let mut deadline = next_wakeup(ctx, &mut last_past).await;
        trigger = loop {
            let wake_at = deadline.map_or(sweep_at, |d| d.min(sweep_at));
            let by_deadline = deadline.is_some_and(|d| d < sweep_at);
            let notified = async {
                match listener.as_mut() {
                    Some(l) => l.recv().await.map_err(|e| e.to_string()),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = ctx.shutdown.cancelled() => return,
                () = tokio::time::sleep_until(wake_at) => {
                    break if by_deadline { CycleTrigger::Wakeup } else { CycleTrigger::Timer };
                }
                n = notified => match n {
                    Ok(n) if n.payload != ctx.env.as_str() => {}
                    Ok(n) if n.channel == Channel::CollectRequested => break CycleTrigger::Collect,
                    Ok(_) => {
                        // A session changed: drain what else is queued, then re-read the deadline.
                        let mut collect = false;
                        if let Some(l) = listener.as_mut() {
                            while let Some(Ok(n)) = l.recv().now_or_never() {
                                collect |= n.channel == Channel::CollectRequested
                                    && n.payload == ctx.env.as_str();
                            }
                        }
                        if collect {
                            break CycleTrigger::Collect;
                        }
                        deadline = next_wakeup(ctx, &mut last_past).await;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "notification connection lost; reopening");
                        listener = open_listener(ctx).await;
                        // Something may have been missed: run a cycle.
                        break CycleTrigger::Wakeup;
                    }
                },
            }
        };
    }
}
