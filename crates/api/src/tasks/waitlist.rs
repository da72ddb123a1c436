//! `waitlist`: hands freed places to the waitlist. Every [`WAITLIST_TICK`] and on every change
//! hint (a session ended on any replica), while anybody waits, it grants holds
//! ([`crate::saga::grant_waitlist`]). Every replica runs one; the capacity lock makes their
//! grants take turns.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};

use crate::AppState;

/// How often each replica looks for freed places while anybody waits.
pub const WAITLIST_TICK: Duration = Duration::from_secs(1);

/// The task's name.
pub const NAME: TaskName = TaskName::new("waitlist");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "While anybody waits, holds each freed VM place for the first student in line \
         (every second and whenever a session changes)",
        Schedule::after(WAITLIST_TICK),
    )
}

pub(super) struct Waitlist {
    pub(super) state: AppState,
}

impl BackgroundTask for Waitlist {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let state = &self.state;
        let waiting = state
            .store()
            .waitlist()
            .any()
            .await
            .map_err(|e| Failure::new(format!("cannot read the waitlist: {e}")))?;
        if !waiting {
            return Ok(());
        }
        let report = crate::saga::grant_waitlist(state)
            .await
            .map_err(|e| Failure::new(format!("cannot grant waitlist holds now: {e}")))?;
        let metrics = state.metrics();
        metrics.waitlist_granted.inc_by(report.granted.len() as u64);
        metrics.waitlist_lapsed.inc_by(report.lapsed.len() as u64);
        for user in &report.granted {
            tracing::info!(%user, "a place is held for the first on the waitlist");
        }
        for user in &report.lapsed {
            tracing::info!(%user, "a waitlist hold lapsed");
        }
        Ok(())
    }
}
