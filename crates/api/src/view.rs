//! The JSON shape of a session, as the API shows it.

use chrono::{DateTime, Utc};
use serde::Serialize;
use ttlab_lifespan::{Lifespan, Policy};
use ttlab_model::{SessionStatus, UserId};
use ttlab_store::Session;

use crate::auth::CurrentUser;

/// A session as the API shows it (`GET /api/sessions/{id}`, event streams, admin lists).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionView {
    /// Session id.
    pub id: String,
    /// Whose session.
    pub user: UserId,
    /// Lesson id.
    pub lesson: String,
    /// `vm` or `pod`.
    pub runtime: String,
    /// `starting`, `running`, `finishing`, `expired`, `finished`, `failed` or `ghost`.
    pub status: SessionStatus,
    /// Where provisioning is: `requested`, `vm_created`, `vmi_running`, `agent_up`, `ready`,
    /// then `finishing` or the final status.
    pub stage: &'static str,
    /// While finishing: the final status it is heading for.
    pub finishing_to: Option<String>,
    /// When the lifespan started.
    pub started_at: DateTime<Utc>,
    /// When it expires unless extended.
    pub expires_at: DateTime<Utc>,
    /// The latest it can ever expire.
    pub max_expires_at: DateTime<Utc>,
    /// Seconds left, by the server's (database) clock; 0 once it is not live.
    pub remaining_seconds: u64,
    /// Extensions used.
    pub extensions_used: u32,
    /// Extensions left under the current policy.
    pub extensions_left: u32,
    /// The database clock when this view was made (for client-side countdowns).
    pub server_time: DateTime<Utc>,
    /// The root disk decision, once made.
    pub disk: Option<DiskView>,
    /// The lab's nodes and their VM (or pod) names, once known.
    pub nodes: Vec<NodeView>,
    /// When each provisioning stage was reached.
    pub stages: StagesView,
    /// When it stopped being usable.
    pub finished_at: Option<DateTime<Utc>>,
    /// Why provisioning failed.
    pub failure_reason: Option<String>,
}

/// The disk decision.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiskView {
    /// `golden` or `container`.
    pub kind: String,
    /// `ready` (golden) or why the golden disk was not used.
    pub reason: String,
}

/// One node of the lab.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// Node name.
    pub node: String,
    /// VM (or pod) object name.
    pub vm: String,
}

/// Stage timestamps (database clock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StagesView {
    /// The request was accepted.
    pub requested: DateTime<Utc>,
    /// The VM (or pod) object was created.
    pub vm_created: Option<DateTime<Utc>>,
    /// The VMI was Running.
    pub vmi_running: Option<DateTime<Utc>>,
    /// The guest agent answered.
    pub agent_up: Option<DateTime<Utc>>,
    /// The session became running.
    pub ready: Option<DateTime<Utc>>,
}

/// The stage name of a session row.
pub fn stage_of(s: &Session) -> &'static str {
    match s.status {
        SessionStatus::Starting => {
            if s.agent_up_at.is_some() {
                "agent_up"
            } else if s.vmi_running_at.is_some() {
                "vmi_running"
            } else if s.vm_created_at.is_some() {
                "vm_created"
            } else {
                "requested"
            }
        }
        SessionStatus::Running => "ready",
        other => other.as_str(),
    }
}

/// The failure reason a student is shown. Provisioning records "plain sentence: detail",
/// and the detail (an error chain) may name the agent's address, a cluster's answer or a
/// database error: a student sees the sentence, an admin (the admin page, `GET` as an
/// admin) and the log see it all. A parenthesis of the sentence (the VM's last condition, the
/// pod's last phase) stays unless it names an address. The setup script's own complaint is
/// the lesson's, and the student's to read.
pub fn student_reason(reason: &str) -> String {
    const SETUP: &str = "setup script failed";
    let reason = reason.trim();
    if reason.starts_with(SETUP) {
        return reason.to_owned();
    }
    // The first ": " outside parentheses starts the error chain.
    let mut depth = 0usize;
    let mut cut = reason.len();
    for (i, c) in reason.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ':' if depth == 0 && reason[i..].starts_with(": ") => {
                cut = i;
                break;
            }
            _ => {}
        }
    }
    let mut plain = reason[..cut].trim_end();
    if names_an_address(plain)
        && let Some(at) = plain.find(" (")
    {
        plain = &plain[..at];
    }
    if names_an_address(plain) {
        return "provisioning failed (the operators have the details)".to_owned();
    }
    if plain.len() == reason.len() {
        plain.to_owned()
    } else {
        format!("{plain} (the operators have the details)")
    }
}

/// Whether `text` holds a URL or an IPv4 address.
fn names_an_address(text: &str) -> bool {
    text.contains("://")
        || text
            .split(|c: char| !(c.is_ascii_digit() || c == '.'))
            .any(|t| t.parse::<std::net::Ipv4Addr>().is_ok())
}

impl SessionView {
    /// The view as `viewer` may see it: an admin sees everything, anyone else the plain
    /// failure reason ([`student_reason`]).
    pub fn for_viewer(mut self, viewer: &CurrentUser) -> Self {
        if !viewer.is_admin() {
            self.failure_reason = self.failure_reason.as_deref().map(student_reason);
        }
        self
    }

    /// The view of `s` at `now` (the database clock) under `policy`.
    pub fn new(s: &Session, policy: &Policy, now: DateTime<Utc>) -> Self {
        let lifespan = Lifespan {
            started_at: s.started_at,
            expires_at: s.expires_at,
            extensions_used: s.extensions_used,
        };
        let remaining = if s.status.is_live() {
            lifespan.remaining(now).as_secs()
        } else {
            0
        };
        Self {
            id: s.id.to_string(),
            user: s.user.clone(),
            lesson: s.lesson.to_string(),
            runtime: s.runtime.as_str().to_owned(),
            status: s.status,
            stage: stage_of(s),
            finishing_to: s.finishing_to.map(|f| f.as_str().to_owned()),
            started_at: s.started_at,
            expires_at: s.expires_at,
            max_expires_at: s.max_expires_at,
            remaining_seconds: remaining,
            extensions_used: s.extensions_used,
            extensions_left: lifespan.extensions_left(policy),
            server_time: now,
            disk: s.disk.as_ref().map(|(kind, reason)| DiskView {
                kind: kind.as_str().to_owned(),
                reason: reason.clone(),
            }),
            nodes: s
                .vms
                .iter()
                .map(|v| NodeView {
                    node: v.node.to_string(),
                    vm: v.name.clone(),
                })
                .collect(),
            stages: StagesView {
                requested: s.created_at,
                vm_created: s.vm_created_at,
                vmi_running: s.vmi_running_at,
                agent_up: s.agent_up_at,
                ready: s.ready_at,
            },
            finished_at: s.finished_at,
            failure_reason: s.failure_reason.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::student_reason;

    #[test]
    fn students_get_the_sentence_and_not_the_detail() {
        for (recorded, shown) in [
            (
                "the VM's agent refused the server: error sending request for url \
                 (http://10.244.3.17:8899/v1/ready): connection refused",
                "the VM's agent refused the server (the operators have the details)",
            ),
            (
                "could not create the VM: the API server answered 500: etcdserver: timeout",
                "could not create the VM (the operators have the details)",
            ),
            (
                "VM did not start within 300 s (Unschedulable: 0/3 nodes are available)",
                "VM did not start within 300 s (Unschedulable: 0/3 nodes are available)",
            ),
            (
                "the VM got no network address within 60 s (last seen 10.244.0.9)",
                "the VM got no network address within 60 s (the operators have the details)",
            ),
            (
                "lab pod did not start within 2 s (last seen: Pending): pods \"x\" is \
                 forbidden",
                "lab pod did not start within 2 s (last seen: Pending) (the operators have the \
                 details)",
            ),
            (
                "the VM's agent did not answer within 120 s",
                "the VM's agent did not answer within 120 s",
            ),
            (
                "the VM stopped before it was ready (Failed)",
                "the VM stopped before it was ready (Failed)",
            ),
            (
                "setup script failed: apt-get: unable to locate package nginx",
                "setup script failed: apt-get: unable to locate package nginx",
            ),
        ] {
            assert_eq!(student_reason(recorded), shown, "{recorded}");
        }
    }
}
