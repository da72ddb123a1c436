use std::error::Error as _;
use std::time::Duration;

use ttlab_model::{LessonId, SessionId, SessionStatus, UserId};

/// Everything that can go wrong in the store. Every message is one line, and none of them ever
/// contains a database password.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database URL could not be understood (the password, if any, is masked).
    #[error("invalid database URL {url}: {reason}")]
    InvalidUrl {
        /// The URL with its password replaced by `***`.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No connection could be opened to the server.
    #[error("cannot connect to PostgreSQL at {target}: {reason}")]
    Connect {
        /// `host:port/database` of the server.
        target: String,
        /// Why, in a few words (e.g. `connection refused`).
        reason: String,
        /// The server answered and refused this client — its certificate did not verify, or
        /// it refused the credentials or the database name: a setting to fix, which trying
        /// again will not (as opposed to a server that is down or unreachable).
        rejected: bool,
    },
    /// A statement failed on an open connection.
    #[error("{what}: {}", pg_reason(cause))]
    Query {
        /// What was being done.
        what: &'static str,
        /// The driver's error (kept out of the `source` chain so the message stays one line).
        cause: tokio_postgres::Error,
    },
    /// A row holds a value the model rejects (written by something other than this crate).
    #[error("unexpected value in column {column}: {reason}")]
    Corrupt {
        /// The column.
        column: &'static str,
        /// Why the value was rejected.
        reason: String,
    },
    /// The user already has a live session, so a new one cannot be opened.
    #[error("{user} already has a live session of lesson {lesson} ({session}, {status})")]
    SessionExists {
        /// Whose session.
        user: UserId,
        /// The lesson already open.
        lesson: LessonId,
        /// The open session.
        session: SessionId,
        /// Its status (starting, running or finishing).
        status: SessionStatus,
    },
    /// The state machine forbids this change; nothing was sent to the database.
    #[error("a session cannot go from {from} to {to}")]
    InvalidTransition {
        /// The status the change would start from.
        from: SessionStatus,
        /// The status it would reach.
        to: SessionStatus,
    },
    /// A concurrent change got in the way; trying again is safe.
    #[error("concurrent change: {what}; try again")]
    Conflict {
        /// What changed.
        what: &'static str,
    },
    /// An argument was out of range; nothing was sent to the database.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// The database refused values its schema's CHECK constraints forbid (the values are not
    /// repeated; the rule is).
    #[error("{what} refused: {rule}")]
    Refused {
        /// What was being saved.
        what: &'static str,
        /// The rule the values broke.
        rule: &'static str,
    },
    /// Applying the schema migrations failed.
    #[error("schema migration failed on {target}: {reason}")]
    Migration {
        /// `host:port/database` of the server.
        target: String,
        /// Why.
        reason: String,
    },
    /// A LISTEN connection ended.
    #[error("notification connection to {target} closed: {reason}")]
    ListenerClosed {
        /// `host:port/database` of the server.
        target: String,
        /// Why.
        reason: String,
    },
    /// An advisory lock this process held is no longer held (its connection was lost).
    #[error("lost the {what} lock on {target}")]
    LockLost {
        /// Which lock.
        what: &'static str,
        /// `host:port/database` of the server.
        target: String,
    },
    /// A lock others take in turn stayed held by someone else for the whole allowed wait
    /// (the capacity lock behind another "Start lab"); trying again shortly is safe.
    #[error("{what} stayed busy for {:.1}s; try again", waited.as_secs_f64())]
    Busy {
        /// What was busy.
        what: &'static str,
        /// How long it was waited for.
        waited: Duration,
    },
    /// Waited longer than allowed.
    #[error("timed out after {:.1}s waiting for {what}", elapsed.as_secs_f64())]
    Timeout {
        /// What was awaited.
        what: &'static str,
        /// How long.
        elapsed: Duration,
    },
    /// A throwaway PostgreSQL server could not be prepared, started or used (with the
    /// `test-support` feature only).
    #[cfg(feature = "test-support")]
    #[error("throwaway PostgreSQL: {step}: {detail}")]
    Throwaway {
        /// The step that failed (`initdb`, `pg_ctl start`, …).
        step: &'static str,
        /// What happened (the server's log tail where there is one).
        detail: String,
    },
}

impl StoreError {
    /// Whether the server answered a connection attempt and refused it (see
    /// [`StoreError::Connect`]'s `rejected`): a setting is wrong, and waiting will not help.
    pub fn is_rejection(&self) -> bool {
        matches!(self, Self::Connect { rejected: true, .. })
    }

    /// The SQLSTATE code of a failed statement, if the server sent one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Self::Query { cause, .. } => cause.code().map(|c| c.code()),
            _ => None,
        }
    }

    pub(crate) fn query(what: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Self {
        move |cause| Self::Query { what, cause }
    }

    pub(crate) fn corrupt(column: &'static str, reason: impl ToString) -> Self {
        Self::Corrupt {
            column,
            reason: reason.to_string(),
        }
    }
}

/// A one-line account of a driver error: the server's message (with its detail), or the
/// innermost cause of a client-side error.
pub(crate) fn pg_reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut s = db.message().to_owned();
        if let Some(detail) = db.detail() {
            s.push_str(" (");
            s.push_str(detail);
            s.push(')');
        }
        return one_line(&s);
    }
    let mut parts = vec![e.to_string()];
    let mut cur = e.source();
    while let Some(inner) = cur {
        parts.push(inner.to_string());
        cur = inner.source();
    }
    one_line(&parts.join(": "))
}

/// Why a connection attempt failed, in a few words: `connection refused`,
/// `database "x" does not exist`, `timed out`.
/// Whether a failed connection attempt was answered by a server that refused this client:
/// its TLS certificate did not verify, or it refused the credentials (SQLSTATE class 28) or
/// the database name (3D000). A server starting up, shutting down or full is not a refusal.
pub(crate) fn connect_rejected(e: &tokio_postgres::Error) -> bool {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        return code.starts_with("28") || code == "3D000";
    }
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = current {
        let tls = err.downcast_ref::<rustls::Error>().is_some()
            || err.downcast_ref::<std::io::Error>().is_some_and(|io| {
                io.get_ref()
                    .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
            });
        if tls {
            return true;
        }
        current = err.source();
    }
    false
}

pub(crate) fn connect_reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return one_line(db.message());
    }
    let mut innermost: &dyn std::error::Error = e;
    while let Some(inner) = innermost.source() {
        innermost = inner;
    }
    let text = if std::ptr::addr_eq(innermost, e as &dyn std::error::Error) {
        e.to_string()
    } else {
        innermost.to_string()
    };
    let text = match text.find(" (os error") {
        Some(i) => text[..i].to_owned(),
        None => text,
    };
    lowercase_first(&one_line(&text))
}

/// Why a socket could not be opened, in a few words.
pub(crate) fn io_reason(e: &std::io::Error) -> String {
    let text = e.to_string();
    let text = match text.find(" (os error") {
        Some(i) => text[..i].to_owned(),
        None => text,
    };
    lowercase_first(&one_line(&text))
}

fn lowercase_first(s: &str) -> String {
    let mut chars = s.chars();
    match (chars.next(), chars.clone().next()) {
        (Some(first), Some(second)) if first.is_uppercase() && second.is_lowercase() => {
            first.to_lowercase().chain(chars).collect()
        }
        _ => s.to_owned(),
    }
}

pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_short_and_single_line() {
        assert_eq!(lowercase_first("Connection refused"), "connection refused");
        assert_eq!(lowercase_first("SQL error"), "SQL error");
        assert_eq!(one_line("a\nDETAIL:  b"), "a DETAIL: b");
    }
}
