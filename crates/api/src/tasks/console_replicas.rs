//! `console_replicas`: every [`SWEEP_EVERY`], closes the console rows (`console_connections`)
//! left open by a server replica that is gone — it crashed or was killed and could not record
//! the close: its rows have not been marked seen for [`UNSEEN`] (a replica marks the consoles
//! it relays every 10 s, with `console_sessions`). They close with the reason `replica_gone`,
//! so the admin's session view no longer shows a console held by a server that does not
//! exist. Every replica runs one; the close is one conditional statement, so two replicas
//! never close a row twice.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};
use ttlab_store::ConsoleClosedWhy;

use crate::AppState;

/// How often each replica looks for console rows of a replica that is gone.
pub const SWEEP_EVERY: Duration = Duration::from_secs(10);

/// An open row not marked seen for this long belongs to a replica that is gone: three marks
/// missed (a replica marks its consoles every 10 s).
pub const UNSEEN: Duration = Duration::from_secs(30);

/// The task's name.
pub const NAME: TaskName = TaskName::new("console_replicas");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Every 10 s, closes the console rows of a server replica that is gone (crashed or \
         killed: its consoles not marked seen for 30 s), with the reason replica_gone",
        Schedule::after(SWEEP_EVERY),
    )
}

pub(super) struct ConsoleReplicas {
    pub(super) state: AppState,
}

impl BackgroundTask for ConsoleReplicas {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let closed = self
            .state
            .store()
            .console_connections()
            .close_unseen(UNSEEN)
            .await
            .map_err(|e| {
                Failure::new(format!("cannot close the consoles of gone replicas: {e}"))
            })?;
        for c in &closed {
            self.state
                .metrics()
                .console_closed(ConsoleClosedWhy::ReplicaGone);
            tracing::info!(
                session = %c.session,
                node = %c.node,
                replica = %c.replica,
                "closed the console record of a server replica that is gone"
            );
        }
        Ok(())
    }
}
