//! `pool_refill`: keeps this replica's warm pools filled (see [`crate::pool`]). Every
//! [`POOL_TICK`] and on change hints, at least [`MIN_ROUND_PAUSE`] apart, it tends every VM
//! lesson's pool ([`crate::pool::refill`]: those with a pool, in their file or an operator's,
//! and those whose pool was taken away, whose members are retired); while the server hands
//! over it takes no turn. Hourly it also drops claim and miss events past their retention.
//! A lesson whose pool could not be tended is named in the task's last error; the others are
//! tended all the same.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};
use ttlab_lesson::Lesson;
use ttlab_model::Runtime;

use crate::AppState;

/// How often each replica looks at its pools (change hints wake it sooner).
pub const POOL_TICK: Duration = Duration::from_secs(2);

/// The shortest pause between two rounds, however many change hints arrive.
const MIN_ROUND_PAUSE: Duration = Duration::from_millis(250);

/// How often a replica drops claim and miss events past their retention.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// The task's name.
pub const NAME: TaskName = TaskName::new("pool_refill");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Keeps each lesson's warm pool at its target within the free capacity, and retires \
         old or surplus members (every 2 s and whenever a session changes)",
        Schedule::after(POOL_TICK).with_min_pause(MIN_ROUND_PAUSE),
    )
}

pub(super) struct PoolRefill {
    pub(super) state: AppState,
    /// When old pool events were last dropped.
    pub(super) pruned: Option<tokio::time::Instant>,
}

impl BackgroundTask for PoolRefill {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let state = &self.state;
        if self.pruned.is_none_or(|at| at.elapsed() >= PRUNE_EVERY) {
            match state.store().pools().prune_events().await {
                Ok(n) => {
                    self.pruned = Some(tokio::time::Instant::now());
                    if n > 0 {
                        tracing::debug!(events = n, "pruned old pool events");
                    }
                }
                Err(e) => tracing::debug!(error = %e, "cannot prune pool events now"),
            }
        }
        if state.is_draining() {
            return Ok(());
        }
        // Every VM lesson: those with a pool (in their file, or an operator's), and those
        // whose pool was taken away, whose members are retired.
        let overrides = state
            .store()
            .pools()
            .list(&state.config().env)
            .await
            .map_err(|e| Failure::new(format!("cannot read the pool settings: {e}")))?;
        let lessons: Vec<Lesson> = state
            .config()
            .lessons
            .iter()
            .filter(|l| l.runtime == Runtime::Vm)
            .cloned()
            .collect();
        let mut failed = Vec::new();
        for lesson in &lessons {
            let overridden = overrides.iter().find(|o| o.lesson == lesson.id);
            if let Err(e) =
                crate::pool::refill(state, lesson, overridden.map(|o| &o.settings)).await
            {
                tracing::debug!(lesson = %lesson.id, error = %e, "cannot tend the pool now");
                failed.push(format!("the pool of {}: {e}", lesson.id));
            }
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(Failure::new(failed.join("; ")))
        }
    }
}
