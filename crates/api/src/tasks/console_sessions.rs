//! `console_sessions`: applies session changes to this server's open consoles
//! ([`crate::console::apply_changes`]: one query for all of them), on every change hint after
//! [`DEBOUNCE`] (hints arriving together are applied once) and at least every [`FALLBACK`].
//! Started with the first console ticket this server issues (its first pass, before the
//! console opens, has nothing to do); when the server stops, every console is told so. Each
//! pass also marks this replica's open consoles seen in their records, so that no other
//! replica takes them for a gone replica's (`console_replicas`).

use std::sync::{Arc, Weak};
use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};

use crate::AppState;
use crate::console::{CloseAllOnDrop, Consoles};

/// Re-read the sessions of open consoles at least this often.
const FALLBACK: Duration = Duration::from_secs(10);
/// Changes arriving together are applied once.
const DEBOUNCE: Duration = Duration::from_millis(100);

/// The task's name.
pub const NAME: TaskName = TaskName::new("console_sessions");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Closes open consoles whose session ended and moves their expiry when it is extended \
         (on every session change, and every 10 s); runs from the first console ticket \
         issued here",
        Schedule::after(FALLBACK).with_debounce(DEBOUNCE),
    )
}

pub(super) struct ConsoleSessions {
    state: AppState,
    consoles: Weak<Consoles>,
    /// Stopped with the server: every console is told so.
    _close_on_stop: CloseAllOnDrop,
}

impl ConsoleSessions {
    pub(super) fn new(state: AppState, consoles: &Arc<Consoles>) -> Self {
        Self {
            state,
            consoles: Arc::downgrade(consoles),
            _close_on_stop: CloseAllOnDrop(Arc::downgrade(consoles)),
        }
    }
}

impl BackgroundTask for ConsoleSessions {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        let Some(consoles) = self.consoles.upgrade() else {
            cx.finish();
            return Ok(());
        };
        crate::console::apply_changes(&self.state, &consoles)
            .await
            .map_err(|e| {
                Failure::new(format!("cannot re-read the sessions of open consoles: {e}"))
            })?;
        // This replica is alive: its consoles' records stay open (see `console_replicas`).
        crate::console::mark_seen(&self.state, &consoles)
            .await
            .map_err(|e| Failure::new(format!("cannot mark the open consoles seen: {e}")))
    }
}
