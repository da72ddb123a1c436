use std::fmt;
use std::path::PathBuf;

use ttlab_model::LessonId;

/// A place in a lesson file: the file, and the 1-based line and column where known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceLocation {
    /// The file (as given to the loader, or `<inline>` for text parsed directly).
    pub file: PathBuf,
    /// 1-based line, where known.
    pub line: Option<usize>,
    /// 1-based column, where known.
    pub column: Option<usize>,
}

impl fmt::Display for SourceLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(column) = self.column {
                write!(f, ":{column}")?;
            }
        }
        Ok(())
    }
}

/// Why lessons could not be loaded. Every variant names the file.
#[derive(Debug, thiserror::Error)]
pub enum LessonError {
    /// A file or directory could not be read.
    #[error("cannot read lessons from {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A lesson file is not valid YAML or breaks a rule of the lesson format.
    #[error("{at}: {message}")]
    Invalid {
        /// Where the problem is.
        at: SourceLocation,
        /// What is wrong.
        message: String,
    },
    /// Two lessons have the same id.
    #[error("{at}: duplicate lesson id `{id}` (first defined at {first})")]
    DuplicateId {
        /// The repeated id.
        id: LessonId,
        /// The second definition.
        at: Box<SourceLocation>,
        /// The first definition.
        first: Box<SourceLocation>,
    },
    /// The path holds no lesson at all (an empty file, or a directory with no `*.yaml`/`*.yml`).
    #[error("no lessons found in {}", path.display())]
    Empty {
        /// The file or directory.
        path: PathBuf,
    },
}
