//! `database`: every [`DATABASE_CHECK_INTERVAL`] the database is pinged within
//! [`DATABASE_CHECK_TIMEOUT`], and what it found is recorded for `/readyz`. Until the first
//! answer the server is not ready: the requests that need the database are answered 503
//! `database_unavailable` with `Retry-After`, and a server that started before its database
//! answers keeps running and trying (a process that exited would become a restart with a
//! growing back-off, and so stay away long after the database returned). At the first
//! answer it migrates the schema (when the server migrates, [`crate::ApiConfig::migrate`]),
//! cleans up what a previous run left half-provisioned ([`crate::saga::recover`], within
//! [`RECOVER_BUDGET`]) and starts
//! the adoption of abandoned sessions; from then on the server is ready. A failed check is
//! the task's failure, so it is retried after the driver's [`super::RESTART_BACKOFF`] (at
//! most 2 s): the server works again within seconds of its database answering.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};

use crate::AppState;

/// How often the database is checked.
pub const DATABASE_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How long a check may take before the database counts as unreachable.
pub const DATABASE_CHECK_TIMEOUT: Duration = Duration::from_secs(3);

/// How long the start-up's clean-up ([`crate::saga::recover`]) may hold the server's
/// readiness.
pub const RECOVER_BUDGET: Duration = Duration::from_secs(10);

/// The task's name.
pub const NAME: TaskName = TaskName::new("database");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Pings the database every second (3 s budget) for /readyz; at its first answer migrates \
         the schema (when this server migrates), cleans up what a previous run left and starts \
         the adoption of abandoned sessions",
        Schedule::every(DATABASE_CHECK_INTERVAL),
    )
}

pub(super) struct Database {
    pub(super) state: AppState,
}

impl Database {
    /// Pings, and the first time it answers, prepares the server: the schema, the clean-up,
    /// the adoption.
    async fn check(&self) -> Result<(), String> {
        let state = &self.state;
        match tokio::time::timeout(DATABASE_CHECK_TIMEOUT, state.store().ping()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => {
                return Err(format!(
                    "no answer within {} s",
                    DATABASE_CHECK_TIMEOUT.as_secs()
                ));
            }
        }
        if state.database_health().prepared {
            return Ok(());
        }
        if state.config().migrate {
            let report = state
                .store()
                .migrate()
                .await
                .map_err(|e| format!("migrating the schema: {e}"))?;
            if !report.applied.is_empty() {
                tracing::info!(applied = ?report.applied, version = report.version, "migrated the schema");
            }
        }
        // Bounded: a site that does not answer (lost, or this server's link to it hanging)
        // would hold every call on its sessions for the client's timeout, one after another,
        // and the server would stay not ready meanwhile. What is left is the adoption task's
        // and the reaper's.
        match tokio::time::timeout(RECOVER_BUDGET, crate::saga::recover(state)).await {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::info!(sessions = n, "cleaned up sessions left by a previous run"),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not look for abandoned sessions"),
            Err(_) => tracing::warn!(
                budget_s = RECOVER_BUDGET.as_secs(),
                "the clean-up of what a previous run left did not end within its budget; \
                 the adoption and the reaper take over the rest"
            ),
        }
        if let Err(e) = super::start_adoption(state) {
            tracing::warn!(error = %e, "the adoption of abandoned sessions did not start");
        }
        Ok(())
    }
}

impl BackgroundTask for Database {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let checked = self.check().await;
        let now = chrono::Utc::now();
        let state = &self.state;
        let was_prepared = state.database_health().prepared;
        state.update_database_health(|health| {
            health.record(now, checked.as_ref().map(|_| ()).map_err(String::as_str));
            health.prepared |= checked.is_ok();
        });
        match checked {
            Ok(()) => {
                if !was_prepared {
                    tracing::info!("the database answers: ready");
                }
                Ok(())
            }
            Err(e) => Err(Failure::new(format!("the database does not answer: {e}"))),
        }
    }
}
