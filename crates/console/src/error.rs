//! The one error type of this crate: why the VM's console could not be opened.

/// Why an [`Upstream`](crate::Upstream) could not open the VM's console.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConsoleError {
    /// The VM is not running yet (KubeVirt answers 400 while it boots): the relay tries again
    /// every [`RelayConfig::retry_interval`](crate::RelayConfig::retry_interval), showing this
    /// message, for at most [`RelayConfig::boot_wait`](crate::RelayConfig::boot_wait).
    #[error("not ready yet: {message}")]
    NotReady {
        /// What the console is waiting for, in words for the student ("the VM is starting").
        message: String,
    },
    /// The VM has stopped, failed or is gone: there is nothing to wait for.
    #[error("the VM is not running: {message}")]
    Stopped {
        /// Details.
        message: String,
    },
    /// Any other failure (refused, unreachable, unexpected answer).
    #[error("{message}")]
    Unavailable {
        /// What went wrong.
        message: String,
    },
}
