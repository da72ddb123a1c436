//! Why provisioning failed, in the words the student reads: every way a step can fail, and
//! the one place each is worded. A [`Failure`] becomes [`Stop::Failed`] with its sentence,
//! which the session keeps as its failure reason.

use std::fmt;
use std::time::Duration;

use ttlab_cluster::ClusterError;
use ttlab_model::LessonId;
use ttlab_store::StoreError;

use super::Stop;

/// Every way provisioning fails (other than being superseded).
#[derive(Debug)]
pub(crate) enum Failure {
    /// The session's lesson is not offered any more.
    LessonGone(LessonId),
    /// The lesson cannot be rendered into VirtualMachines.
    Unrenderable(String),
    /// A rendered VM could not be encoded as JSON.
    VmEncoding(String),
    /// The lesson has no node (no VM was created).
    NoNode,
    /// A node's cloud-init could not be rendered.
    CloudInit(String),
    /// A node's cloud-init Secret could not be built.
    CloudInitSecret(String),
    /// No fresh agent token could be drawn.
    Tokens(String),
    /// The cluster refused to create an object, for good.
    Create {
        /// What was being created ("VM", "cloud-init Secret", …).
        what: String,
        /// The refusal.
        error: ClusterError,
    },
    /// A call kept failing transiently until the retry budget was spent.
    ClusterKeptFailing {
        /// What was being done ("create the VM").
        what: String,
        /// How many attempts failed.
        attempts: u32,
        /// How long it was tried.
        took: Duration,
        /// The last failure.
        last: ClusterError,
    },
    /// The namespace's quota was still not counted when the wait for it ran out.
    QuotaUncounted {
        /// What was being created.
        what: String,
        /// How many times the quota refused it.
        refusals: u32,
        /// How long it was tried.
        took: Duration,
    },
    /// The quota kept refusing a create as exceeded although VM places were free, for longer
    /// than the wait for it to recount.
    QuotaPersists {
        /// What was being created.
        what: String,
        /// How many times the quota refused it.
        refusals: u32,
        /// How long it was refused.
        took: Duration,
        /// VM places free by the server's count.
        free: usize,
        /// The quota's last refusal.
        message: String,
    },
    /// A VMI was not running within the lesson's readiness timeout; `why` is what held it, or
    /// why it could not be watched (with its leading space and brackets), or empty.
    VmiTimedOut {
        /// The readiness timeout.
        within: Duration,
        /// What held it.
        why: String,
    },
    /// A VMI ended before it was ready (its state, described).
    VmiEnded(String),
    /// A VMI's start could not be watched.
    VmiUnwatchable(ClusterError),
    /// A running VMI reported no address within the setup timeout.
    NoAddress(Duration),
    /// The lab's setup script failed (its reason, possibly empty).
    SetupFailed(String),
    /// An agent refused the server (a wrong token, a protocol mismatch).
    AgentRefused(String),
    /// An agent answered but the setup had not finished within the setup timeout.
    SetupTimedOut(Duration),
    /// No agent answered within the setup timeout.
    AgentSilent(Duration),
    /// The lab pod's start could not be watched.
    PodUnwatchable(ClusterError),
    /// The lab pod ended before it was ready (its state, described).
    PodEnded(String),
    /// The lab pod was not running and ready within the readiness timeout.
    PodTimedOut {
        /// The readiness timeout.
        within: Duration,
        /// The last state seen, described.
        seen: Option<String>,
    },
    /// The database failed (beyond the retries of [`super::with_db`]).
    Database(StoreError),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LessonGone(lesson) => write!(f, "the lesson {lesson} is no longer offered"),
            Self::Unrenderable(e) => write!(f, "the lesson cannot be turned into a VM: {e}"),
            Self::VmEncoding(e) => write!(f, "cannot encode the VM: {e}"),
            Self::NoNode => f.write_str("the lesson has no node"),
            Self::CloudInit(e) => write!(f, "cannot render cloud-init: {e}"),
            Self::CloudInitSecret(e) => write!(f, "cannot build the cloud-init Secret: {e}"),
            Self::Tokens(e) => f.write_str(e),
            Self::Create {
                what,
                error: ClusterError::QuotaExceeded { .. },
            } => write!(
                f,
                "the lab namespace is full (its quota refused the {what}); try again later"
            ),
            Self::Create { what, error } => write!(f, "could not create the {what}: {error}"),
            Self::ClusterKeptFailing {
                what,
                attempts,
                took,
                last,
            } => write!(
                f,
                "could not {what}: the cluster failed {attempts} times in {} s (last: {last}); \
                 try again in a few minutes",
                took.as_secs().max(1)
            ),
            Self::QuotaUncounted {
                what,
                refusals,
                took,
            } => write!(
                f,
                "the cluster had still not counted the lab namespace's quota after {} s (it \
                 refused the {what} {refusals} times); try again in a minute",
                took.as_secs().max(1)
            ),
            Self::QuotaPersists {
                what,
                refusals,
                took,
                free,
                message,
            } => write!(
                f,
                "the lab namespace's quota refused the {what} {refusals} times in {} s although \
                 {free} VM place{} free ({message}); ask the staff to check the namespace's quota",
                took.as_secs().max(1),
                if *free == 1 { " is" } else { "s are" }
            ),
            Self::VmiTimedOut { within, why } => {
                write!(f, "VM did not start within {} s{why}", within.as_secs())
            }
            Self::VmiEnded(state) => write!(f, "the VM stopped before it was ready ({state})"),
            Self::VmiUnwatchable(e) => write!(f, "could not watch the VM start: {e}"),
            Self::NoAddress(within) => write!(
                f,
                "the VM got no network address within {} s",
                within.as_secs()
            ),
            Self::SetupFailed(reason) if reason.is_empty() => f.write_str("setup script failed"),
            Self::SetupFailed(reason) => write!(f, "setup script failed: {reason}"),
            Self::AgentRefused(e) => write!(f, "the VM's agent refused the server: {e}"),
            Self::SetupTimedOut(within) => write!(
                f,
                "setup script did not finish within {} s",
                within.as_secs()
            ),
            Self::AgentSilent(within) => write!(
                f,
                "the VM's agent did not answer within {} s",
                within.as_secs()
            ),
            Self::PodUnwatchable(e) => write!(f, "could not watch the lab pod start: {e}"),
            Self::PodEnded(state) => {
                write!(f, "the lab pod stopped before it was ready ({state})")
            }
            Self::PodTimedOut { within, seen } => {
                write!(f, "lab pod did not start within {} s", within.as_secs())?;
                match seen {
                    Some(seen) => write!(f, " (last seen: {seen})"),
                    None => Ok(()),
                }
            }
            Self::Database(e) => write!(f, "the database failed during provisioning: {e}"),
        }
    }
}

impl From<Failure> for Stop {
    fn from(failure: Failure) -> Self {
        Stop::Failed(failure.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setup_reason_is_quoted_only_when_there_is_one() {
        assert_eq!(
            Failure::SetupFailed(String::new()).to_string(),
            "setup script failed"
        );
        assert_eq!(
            Failure::SetupFailed("apt-get failed".into()).to_string(),
            "setup script failed: apt-get failed"
        );
    }

    #[test]
    fn a_full_quota_is_worded_apart_from_other_refusals() {
        let full = Failure::Create {
            what: "VM".into(),
            error: ClusterError::QuotaExceeded {
                message: "exceeded quota".into(),
            },
        };
        assert_eq!(
            full.to_string(),
            "the lab namespace is full (its quota refused the VM); try again later"
        );
        let foreign = Failure::Create {
            what: "VM".into(),
            error: ClusterError::Conflict {
                message: "lab-1 belongs to another session".into(),
            },
        };
        assert!(
            foreign.to_string().starts_with("could not create the VM: "),
            "{foreign}"
        );
    }
}
