//! `console_takeovers`: listens for consoles opened on any replica (`ttlab_console_taken`)
//! and closes this replica's other connections to them. Each activation is one connection:
//! it succeeds once listening, and fails when the connection is lost, to be reconnected
//! after the backoff; while it is not listening, a takeover from another replica is noticed
//! only when KubeVirt drops the connection (reported as lost, after the relay's takeover
//! grace). Started with the first console ticket this server issues.

use std::sync::{Arc, Weak};

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};
use ttlab_store::{Channel, ConsoleTaken};

use crate::AppState;
use crate::console::Consoles;

/// The task's name.
pub const NAME: TaskName = TaskName::new("console_takeovers");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Listens for consoles opened on other replicas (PostgreSQL LISTEN) and closes this \
         replica's older connection to them; runs from the first console ticket issued here",
        Schedule::continuous(),
    )
}

pub(super) struct ConsoleTakeovers {
    state: AppState,
    consoles: Weak<Consoles>,
}

impl ConsoleTakeovers {
    pub(super) fn new(state: AppState, consoles: &Arc<Consoles>) -> Self {
        Self {
            state,
            consoles: Arc::downgrade(consoles),
        }
    }
}

impl BackgroundTask for ConsoleTakeovers {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        if self.consoles.strong_count() == 0 {
            cx.finish();
            return Ok(());
        }
        let mut listener = self
            .state
            .store()
            .listen(&[Channel::ConsoleTaken])
            .await
            .map_err(|e| Failure::new(format!("cannot listen for console takeovers: {e}")))?;
        let Some(consoles) = self.consoles.upgrade() else {
            cx.finish();
            return Ok(());
        };
        cx.succeeded();
        consoles.set_listening(true);
        drop(consoles);
        let end = loop {
            let notification = tokio::select! {
                n = listener.recv() => n,
                () = cx.stopping() => break Ok(()),
            };
            let n = match notification {
                Ok(n) => n,
                Err(e) => {
                    break Err(Failure::new(format!(
                        "console takeover notifications lost: {e}"
                    )));
                }
            };
            let Some(consoles) = self.consoles.upgrade() else {
                cx.finish();
                break Ok(());
            };
            match ConsoleTaken::parse(&n.payload) {
                Some(taken) => consoles.taken_over(&taken),
                None => tracing::debug!(payload = %n.payload, "unreadable console takeover"),
            }
        };
        if let Some(consoles) = self.consoles.upgrade() {
            consoles.set_listening(false);
        }
        end
    }
}
