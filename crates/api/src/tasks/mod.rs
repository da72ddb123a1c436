//! The server's background tasks: every long-lived loop of the server, one file each, run by
//! one [`Driver`] (`ttlab-background`) that starts them, activates each on its schedule, times
//! and records each activation (last run, duration, last success, last error: the admin
//! page's "Background tasks", `GET /api/admin/tasks`, and the `ttlab_task_*` metrics), waits
//! out [`RESTART_BACKOFF`] after a failure or a panic, and stops them all when the server
//! stops ([`SHUTDOWN_GRACE`]).
//!
//! | task | runs | does |
//! |---|---|---|
//! | [`database`] | every 1 s | pings the database: `/readyz`; at its first answer, the schema, the start-up's clean-up and [`adoption`] |
//! | [`cluster_probe`] | every 10 s | lists one page of ttlab's VMs: `/healthz/cluster` |
//! | [`golden_disks`] | every 30 s (several sites only) | where each lesson's golden disk is ready: placement |
//! | [`hub`] | continuously (a listener) | session changes on any replica → the in-process hints |
//! | [`waitlist`] | every 1 s and on hints | holds freed places for the first in line |
//! | [`pool_refill`] | every 2 s and on hints | keeps the warm pools filled |
//! | [`adoption`] | every 5 s, from 5 s after the database first answered | resumes abandoned provisioning |
//! | [`console_sessions`] | every 10 s and on hints, from the first console ticket | closes and re-times open consoles |
//! | [`console_takeovers`] | continuously, from the first console ticket | closes consoles opened elsewhere |
//! | [`console_replicas`] | every 10 s | closes the console records of a replica that is gone |
//! | [`agent_keeper`] | at start and every 5 min (`ttlab-server` starts it) | the agent version's sighting |
//!
//! Each file is the loop and its status; the work it does stays where it lives (the saga's
//! `grant_waitlist` and `adopt_abandoned`, the pools' `refill`, the consoles' `apply_changes`).
//! A session's provisioning is not a background task: it runs on
//! [`crate::AppState`]'s own task set, one per session.

pub mod adoption;
pub mod agent_keeper;
pub mod cluster_probe;
pub mod console_replicas;
pub mod console_sessions;
pub mod console_takeovers;
pub mod database;
pub mod golden_disks;
pub mod hub;
pub mod pool_refill;
pub mod waitlist;

use std::sync::Arc;
use std::time::Duration;

use ttlab_background::{BackgroundError, Backoff, Driver};

use crate::console::Consoles;
use crate::metrics::Metrics;
use crate::{ApiError, AppState};

/// What a task that failed (or panicked, or whose connection was lost) waits before it is
/// activated again: 100 ms doubling to 2 s, each drawn between half and all of it; back to
/// 100 ms after a success.
pub const RESTART_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(100), Duration::from_secs(2));

/// How long, when the server stops, an activation in progress may take to finish before it
/// is cut off (listeners stop at once).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// The driver of a server's tasks, none started yet.
pub(crate) fn driver(metrics: &Metrics) -> Driver {
    Driver::new(RESTART_BACKOFF, SHUTDOWN_GRACE, &metrics.tasks)
}

fn started(registered: Result<(), BackgroundError>) -> Result<(), ApiError> {
    registered.map_err(|e| ApiError::Internal(e.to_string()))
}

/// Starts the tasks every server runs from the start: the database check, the cluster
/// probe, the golden disks' observation (with several sites), the hub, the waitlist, the
/// pool refiller and the console records' sweep. None needs the database to answer now: each fails and is retried
/// with [`RESTART_BACKOFF`] until it does.
pub(crate) fn start(state: &AppState) -> Result<(), ApiError> {
    // Subscribed before the hub connects, so they see its first hint.
    let waitlist_hints = state.subscribe();
    let pool_hints = state.subscribe();
    let driver = state.background();
    started(driver.register(
        database::spec(),
        database::Database {
            state: state.clone(),
        },
    ))?;
    started(driver.register(
        cluster_probe::spec(),
        cluster_probe::ClusterProbe {
            state: state.clone(),
        },
    ))?;
    if state.sites().len() > 1 {
        started(driver.register(
            golden_disks::spec(),
            golden_disks::GoldenDisks {
                state: state.clone(),
            },
        ))?;
    }
    started(driver.register(
        hub::spec(),
        hub::Hub {
            state: state.clone(),
        },
    ))?;
    started(driver.register(
        waitlist::spec().triggered_by(waitlist_hints),
        waitlist::Waitlist {
            state: state.clone(),
        },
    ))?;
    started(driver.register(
        console_replicas::spec(),
        console_replicas::ConsoleReplicas {
            state: state.clone(),
        },
    ))?;
    started(driver.register(
        pool_refill::spec().triggered_by(pool_hints),
        pool_refill::PoolRefill {
            state: state.clone(),
            pruned: None,
        },
    ))
}

/// Starts the adoption of abandoned sessions (after the start-up's own pass,
/// [`crate::saga::recover`], which [`database`] runs at the database's first answer).
pub(crate) fn start_adoption(state: &AppState) -> Result<(), ApiError> {
    started(state.background().register(
        adoption::spec(),
        adoption::Adoption {
            state: state.clone(),
        },
    ))
}

/// Starts the agent keeper: this version's agent made sure of now, its sighting recorded
/// while the server runs (`ttlab-server` starts it once it is bound).
pub fn start_agent_keeper(state: &AppState) -> Result<(), ApiError> {
    started(state.background().register(
        agent_keeper::spec(),
        agent_keeper::AgentKeeper {
            state: state.clone(),
        },
    ))
}

/// Starts the two tasks that follow the open consoles of `consoles` (with its first console
/// ticket).
pub(crate) fn start_console_watchers(state: &AppState, consoles: &Arc<Consoles>) {
    let driver = state.background();
    let sessions = driver.register(
        console_sessions::spec().triggered_by(state.subscribe()),
        console_sessions::ConsoleSessions::new(state.clone(), consoles),
    );
    let takeovers = driver.register(
        console_takeovers::spec(),
        console_takeovers::ConsoleTakeovers::new(state.clone(), consoles),
    );
    for registered in [sessions, takeovers] {
        if let Err(e) = registered {
            tracing::warn!(error = %e, "the consoles are not followed");
        }
    }
}
