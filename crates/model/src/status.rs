use serde::{Deserialize, Serialize};
use strum::EnumCount as _;

use crate::ModelError;

/// Where a session is in its life. Stored as lowercase text in the database.
///
/// Live statuses hold cluster resources and count for one-session-per-user and capacity;
/// final statuses never change again. A row reaches a final status only after every cluster
/// object of the session was confirmed deleted; until then it waits in [`Finishing`]
/// (recording the [`FinalStatus`] it is heading for).
///
/// [`Finishing`]: SessionStatus::Finishing
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = ModelError,
    parse_err_fn = unknown_status
)]
pub enum SessionStatus {
    /// Accepted; provisioning is under way.
    Starting,
    /// The VM is up and the agent reported the readiness marker.
    Running,
    /// Its objects are being deleted; the target final status is recorded beside it.
    Finishing,
    /// Reclaimed by the reaper after its lifespan ran out.
    Expired,
    /// Finished by the student.
    Finished,
    /// Provisioning failed; its objects were deleted.
    Failed,
    /// Marked `running` but its VM was gone from the cluster.
    Ghost,
    /// Its start was refused by the namespace's quota at capacity: its objects were deleted
    /// and the student was put back in the line, at the front. Not a failure.
    Requeued,
}

impl SessionStatus {
    /// Every status, in lifecycle order (its length is the derived count of variants, so a
    /// new status cannot be left out).
    pub const ALL: [SessionStatus; SessionStatus::COUNT] = [
        Self::Starting,
        Self::Running,
        Self::Finishing,
        Self::Expired,
        Self::Finished,
        Self::Failed,
        Self::Ghost,
        Self::Requeued,
    ];

    /// The statuses that hold resources.
    pub const LIVE: [SessionStatus; 3] = [Self::Starting, Self::Running, Self::Finishing];

    /// Lowercase name, as stored and as shown in the API.
    pub fn as_str(self) -> &'static str {
        self.into()
    }

    /// Holds cluster resources (starting, running, finishing).
    pub const fn is_live(self) -> bool {
        matches!(self, Self::Starting | Self::Running | Self::Finishing)
    }

    /// Never changes again (expired, finished, failed, ghost, requeued).
    pub const fn is_final(self) -> bool {
        !self.is_live()
    }

    /// Whether a row in `self` may be moved to `to`. This is the whole state machine:
    ///
    /// | from | to |
    /// |---|---|
    /// | starting | running, finishing |
    /// | running | finishing, ghost |
    /// | finishing | expired, finished, failed, requeued |
    ///
    /// Nothing leaves a final status, and no status moves to itself.
    pub const fn can_become(self, to: SessionStatus) -> bool {
        matches!(
            (self, to),
            (Self::Starting, Self::Running)
                | (Self::Starting, Self::Finishing)
                | (Self::Running, Self::Finishing)
                | (Self::Running, Self::Ghost)
                | (Self::Finishing, Self::Expired)
                | (Self::Finishing, Self::Finished)
                | (Self::Finishing, Self::Failed)
                | (Self::Finishing, Self::Requeued)
        )
    }
}

fn unknown_status(s: &str) -> ModelError {
    ModelError::UnknownStatus(s.to_owned())
}

/// The final status a `finishing` session is heading for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = ModelError,
    parse_err_fn = unknown_status
)]
pub enum FinalStatus {
    /// The lifespan ran out.
    Expired,
    /// The student finished.
    Finished,
    /// Provisioning failed.
    Failed,
    /// The start was refused at capacity; the student is back in the line.
    Requeued,
}

impl FinalStatus {
    /// Every final target.
    pub const ALL: [FinalStatus; FinalStatus::COUNT] =
        [Self::Expired, Self::Finished, Self::Failed, Self::Requeued];

    /// The session status this target lands on.
    pub const fn status(self) -> SessionStatus {
        match self {
            Self::Expired => SessionStatus::Expired,
            Self::Finished => SessionStatus::Finished,
            Self::Failed => SessionStatus::Failed,
            Self::Requeued => SessionStatus::Requeued,
        }
    }

    /// Lowercase name, as stored: the name of the status it lands on.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// What a lesson runs on. Recorded on the session row at creation, because the reaper decides
/// what to delete from this one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "lowercase",
    parse_err_ty = ModelError,
    parse_err_fn = unknown_runtime
)]
pub enum Runtime {
    /// One or more KubeVirt VirtualMachines.
    Vm,
    /// A single unprivileged Pod.
    Pod,
}

impl Runtime {
    /// Every runtime.
    pub const ALL: [Runtime; Runtime::COUNT] = [Self::Vm, Self::Pod];

    /// Lowercase name, as stored.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_runtime(s: &str) -> ModelError {
    ModelError::UnknownRuntime(s.to_owned())
}

#[cfg(test)]
mod tests {
    use super::SessionStatus::*;
    use super::*;

    /// Every (from, to) pair, spelled out: any change to the state machine shows up here.
    #[test]
    fn transitions_exhaustive() {
        let allowed = [
            (Starting, Running),
            (Starting, Finishing),
            (Running, Finishing),
            (Running, Ghost),
            (Finishing, Expired),
            (Finishing, Finished),
            (Finishing, Failed),
            (Finishing, Requeued),
        ];
        for from in SessionStatus::ALL {
            for to in SessionStatus::ALL {
                assert_eq!(
                    from.can_become(to),
                    allowed.contains(&(from, to)),
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn final_statuses_are_absorbing_and_live_ones_lead_somewhere() {
        for from in SessionStatus::ALL {
            let exits = SessionStatus::ALL
                .iter()
                .filter(|to| from.can_become(**to))
                .count();
            assert_eq!(from.is_final(), exits == 0, "{from}");
        }
        assert_eq!(
            SessionStatus::ALL.iter().filter(|s| s.is_live()).count(),
            SessionStatus::LIVE.len()
        );
    }

    #[test]
    fn finishing_reaches_every_final_target() {
        for t in FinalStatus::ALL {
            assert!(Finishing.can_become(t.status()));
            assert_eq!(t.as_str().parse::<FinalStatus>().unwrap(), t);
            assert_eq!(t.as_str(), t.status().as_str());
        }
    }

    #[test]
    fn names_round_trip() {
        for s in SessionStatus::ALL {
            assert_eq!(s.as_str().parse::<SessionStatus>().unwrap(), s);
            assert_eq!(serde_json::to_string(&s).unwrap(), format!("\"{s}\""));
        }
        assert!("Running".parse::<SessionStatus>().is_err());
        assert_eq!("pod".parse::<Runtime>().unwrap(), Runtime::Pod);
        assert!("container".parse::<Runtime>().is_err());
        for r in Runtime::ALL {
            assert_eq!(r.as_str().parse::<Runtime>().unwrap(), r);
            assert_eq!(serde_json::to_string(&r).unwrap(), format!("\"{r}\""));
        }
        // A bad value is named, with the allowed ones where the message gives them.
        assert_eq!(
            "Running".parse::<SessionStatus>().unwrap_err().to_string(),
            "unknown session status \"Running\""
        );
        assert_eq!(
            "ghost".parse::<FinalStatus>().unwrap_err().to_string(),
            "unknown session status \"ghost\""
        );
        assert_eq!(
            "container".parse::<Runtime>().unwrap_err().to_string(),
            "unknown runtime \"container\": expected `vm` or `pod`"
        );
    }
}
