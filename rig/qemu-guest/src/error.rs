//! The one error type of the crate.

use std::path::PathBuf;

/// What can go wrong running a qemu guest.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The image directory has no usable manifest.
    #[error("guest image {dir}: {reason}")]
    Image {
        /// The image directory.
        dir: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tool this crate needs is not installed.
    #[error("{tool} is not installed ({hint})")]
    Missing {
        /// The program.
        tool: &'static str,
        /// How to get it.
        hint: &'static str,
    },
    /// A tool ran and failed.
    #[error("{tool} failed: {detail}")]
    Tool {
        /// The program.
        tool: String,
        /// Its exit status and last output.
        detail: String,
    },
    /// The guest does not exist any more.
    #[error("the guest has ended")]
    Ended,
}

impl QemuError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}
