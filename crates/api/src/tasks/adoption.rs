//! `adoption`: every [`ADOPT_EVERY`] (the first one period after the start-up's own pass,
//! [`crate::saga::recover`]), the `starting` sessions of this environment nobody holds the
//! provisioning lease of are adopted and their provisioning resumed
//! ([`crate::saga::adopt_abandoned`]). It stops once the server hands over.

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};

use crate::AppState;
use crate::saga::ADOPT_EVERY;

/// The task's name.
pub const NAME: TaskName = TaskName::new("adoption");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Every 5 s, resumes the provisioning of starting sessions nobody provisions any more \
         (their server stopped or vanished); stops when this server hands over",
        Schedule::after(ADOPT_EVERY).first_after_period(),
    )
}

pub(super) struct Adoption {
    pub(super) state: AppState,
}

impl BackgroundTask for Adoption {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        if self.state.is_draining() {
            cx.finish();
            return Ok(());
        }
        crate::saga::adopt_abandoned(&self.state)
            .await
            .map_err(|e| Failure::new(format!("cannot look for sessions to adopt: {e}")))?;
        Ok(())
    }
}
