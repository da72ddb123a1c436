//! The errors of the driver.

use crate::TaskName;

/// Why a task could not be started.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BackgroundError {
    /// A task of this name is already registered with the driver.
    #[error("a background task named {0} is already running")]
    Duplicate(TaskName),
    /// The driver was stopped (the process is shutting down): it starts nothing any more.
    #[error("the background tasks were stopped; {0} was not started")]
    Stopped(TaskName),
}
