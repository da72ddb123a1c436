//! How ttlab's processes do work in the background: the one retry policy every retry loop
//! takes its pauses from ([`Backoff`], over backon: doubling with jitter between a first and a
//! longest pause, started over after a success), and the driver that runs a process's
//! long-lived loops as tasks ([`Driver`]).
//!
//! A task is a type with one method, [`BackgroundTask::activate`]: one pass of its work. The
//! driver starts each on its own tokio task and activates it on its [`Schedule`] — every
//! period, whenever a [`Trigger`] it follows fires (a change hint), or, for a listener, one
//! activation after another — times each activation, and records it in the task's
//! [`TaskStatus`] (last start, duration, last success, last error, activations, failures,
//! failures in a row, running now) and its metrics ([`TaskMetrics`], labelled by the typed
//! [`TaskName`]). A task that fails or panics is activated again only after the shared
//! backoff (a panic never reaches the driver or the process), and [`Driver::shutdown`] stops
//! them all, giving an activation in progress a moment to finish. A loop that keeps its own
//! shape (the reaper's scheduler) records itself with a [`TaskRecord`] all the same.
//!
//! It owns when and how often; it refuses to own what the tasks do (the server's tasks live
//! in `ttlab-api`, the reaper's loops in `ttlab-reaper`) and where their statuses are shown.
//! Without its `driver` feature it is the retry policy alone (std and backon), for the
//! agent's client and the cluster crate.
//!
//! ```
//! # #[cfg(feature = "driver")]
//! # tokio_test();
//! # #[cfg(feature = "driver")]
//! # fn tokio_test() {
//! # let rt = tokio::runtime::Builder::new_current_thread().enable_all().start_paused(true).build().unwrap();
//! # rt.block_on(async {
//! use std::time::Duration;
//! use ttlab_background::{
//!     Activation, Backoff, BackgroundTask, Driver, Failure, Schedule, TaskMetrics, TaskName,
//!     TaskSpec,
//! };
//!
//! struct Probe {
//!     answers: bool,
//! }
//!
//! impl BackgroundTask for Probe {
//!     async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
//!         if self.answers { Ok(()) } else { Err(Failure::new("no answer within 5 s")) }
//!     }
//! }
//!
//! const PROBE: TaskName = TaskName::new("probe");
//! let metrics = TaskMetrics::new();
//! let backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(2));
//! let driver = Driver::new(backoff, Duration::from_secs(1), &metrics);
//! let spec = TaskSpec::new(PROBE, "probes the API", Schedule::every(Duration::from_secs(10)));
//! driver.register(spec, Probe { answers: false }).unwrap();
//! tokio::time::sleep(Duration::from_secs(25)).await;
//! let status = driver.status(PROBE).unwrap();
//! assert_eq!(status.activations, 3); // at 0, 10 and 20 s
//! assert_eq!(status.consecutive_failures, 3);
//! assert_eq!(status.last_error.as_deref(), Some("no answer within 5 s"));
//! driver.shutdown().await;
//! # });
//! # }
//! ```

mod backoff;
#[cfg(feature = "driver")]
mod driver;
#[cfg(feature = "driver")]
mod error;
#[cfg(feature = "driver")]
mod metrics;
#[cfg(feature = "driver")]
mod status;

pub use backoff::{Backoff, Pauses};
#[cfg(feature = "driver")]
pub use driver::{
    Activation, BackgroundTask, DEFAULT_GRACE, Driver, Failure, Schedule, TaskSpec, Trigger,
};
#[cfg(feature = "driver")]
pub use error::BackgroundError;
#[cfg(feature = "driver")]
pub use metrics::{TaskLabels, TaskMetrics};
#[cfg(feature = "driver")]
pub use status::{Began, Reason, TaskName, TaskRecord, TaskStatus};
