//! `hub`: listens on the sessions channel (PostgreSQL `LISTEN`) and turns this environment's
//! notifications into the in-process broadcast of change hints ([`HubEvent`]) that the event
//! streams, the waitlist, the pools and the consoles follow. Each activation is one
//! connection: it succeeds once listening (and hints `Resync`: anything may have changed
//! meanwhile), and fails when the connection is lost, to be reconnected after the backoff.

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};
use ttlab_store::Channel;

use crate::{AppState, HubEvent};

/// The task's name.
pub const NAME: TaskName = TaskName::new("hub");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Listens for session changes made on any replica (PostgreSQL LISTEN) and wakes the \
         event streams, the waitlist, the pools and the consoles; reconnects with backoff",
        Schedule::continuous(),
    )
}

pub(super) struct Hub {
    pub(super) state: AppState,
}

impl BackgroundTask for Hub {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        let state = &self.state;
        let env = state.config().env.as_str();
        let mut listener = state
            .store()
            .listen(&[Channel::SessionsChanged])
            .await
            .map_err(|e| Failure::new(format!("cannot listen for session changes: {e}")))?;
        cx.succeeded();
        state.hint(HubEvent::Resync);
        loop {
            let notification = tokio::select! {
                n = listener.recv() => n,
                () = cx.stopping() => return Ok(()),
            };
            match notification {
                Ok(n) if n.payload == env => state.hint(HubEvent::Changed),
                Ok(_) => {}
                Err(e) => {
                    return Err(Failure::new(format!(
                        "the notification connection was lost: {e}"
                    )));
                }
            }
        }
    }
}
