//! The JSON shape of a session, as the API shows it.

use chrono::{DateTime, Utc};
use serde::Serialize;
use ttlab_lifespan::Policy;
use ttlab_model::{SessionStatus, SiteName, UserId};
use ttlab_store::Session;

use crate::auth::CurrentUser;

/// A session as the API shows it (`GET /api/sessions/{id}`, event streams, admin lists).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionView {
    /// Session id.
    pub id: String,
    /// Whose session (`null` for a warm-pool member nobody has claimed yet: admin lists only).
    pub user: Option<UserId>,
    /// Lesson id.
    pub lesson: String,
    /// `vm` or `pod`.
    pub runtime: String,
    /// The site its VMs run on (`default` without a sites file).
    pub site: SiteName,
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
    /// What the extend button offers at `server_time` (the lifespan rules, described).
    pub extend: ExtendView,
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
    /// With a failure reason: the reference a student quotes to an operator (the start of the
    /// session id, which the log lines of its provisioning carry).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
    /// While starting: how long sessions of this lesson took to become ready recently.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_ready: Option<ExpectedView>,
    /// While live: why the cluster of its site cannot be reached now, in a sentence for the
    /// student (absent while it can).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub site_unreachable: Option<String>,
}

/// The measured time to ready of a lesson's recent sessions (request to ready, seconds).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExpectedView {
    /// How many recent ready sessions were measured.
    pub count: usize,
    /// Half of them were ready within this many seconds.
    pub p50_seconds: f64,
    /// Nine in ten were ready within this many seconds.
    pub p90_seconds: f64,
}

impl ExpectedView {
    /// The p50 and p90 (nearest rank) of `seconds`; `None` when there are none.
    pub fn from_seconds(mut seconds: Vec<f64>) -> Option<Self> {
        if seconds.is_empty() {
            return None;
        }
        seconds.sort_by(f64::total_cmp);
        let pick = |p: f64| {
            let rank = ((p * seconds.len() as f64).ceil() as usize).clamp(1, seconds.len());
            seconds[rank - 1]
        };
        Some(Self {
            count: seconds.len(),
            p50_seconds: pick(0.5),
            p90_seconds: pick(0.9),
        })
    }
}

/// What extending would do at the view's `server_time` ([`ttlab_lifespan::Lifespan::offer`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ExtendView {
    /// Whether the student may extend now.
    pub available: bool,
    /// Seconds the expiry would move later if extended now (0 when not available).
    pub gain_seconds: u64,
    /// From when extending is offered (the extend window opens).
    pub opens_at: DateTime<Utc>,
    /// The extend window: extending is offered only this many seconds before the expiry.
    pub window_seconds: u64,
    /// Why it is not available: the refusal's code (`not_yet`, `too_early`, `extension_limit`,
    /// `max_lifetime`, `expired`) and sentence.
    pub refusal: Option<RefusalView>,
}

/// A refusal, as code and sentence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusalView {
    /// Stable code.
    pub code: &'static str,
    /// Human sentence.
    pub message: String,
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

/// The reference a student quotes for a failure of session `id`: the first eight characters
/// of its id, which every log line of its provisioning carries (`session=…`) and the admin
/// page shows with the full detail.
pub fn reference_of(id: &str) -> String {
    id.chars().take(8).collect()
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
        let lifespan = s.lifespan();
        let offer = lifespan.offer(now, policy);
        let extend = ExtendView {
            available: offer.available && s.status == SessionStatus::Running,
            gain_seconds: if s.status == SessionStatus::Running {
                offer.gain.as_secs()
            } else {
                0
            },
            opens_at: offer.opens_at,
            window_seconds: policy.extend_window.as_secs(),
            refusal: if s.status == SessionStatus::Running {
                offer.refusal.map(|e| RefusalView {
                    code: e.code(),
                    message: e.to_string(),
                })
            } else {
                Some(RefusalView {
                    code: "not_running",
                    message: format!("the session is {}", s.status),
                })
            },
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
            site: s.site.clone(),
            status: s.status,
            stage: stage_of(s),
            finishing_to: s.finishing_to.map(|f| f.as_str().to_owned()),
            started_at: s.started_at,
            expires_at: s.expires_at,
            max_expires_at: s.max_expires_at,
            remaining_seconds: remaining,
            extensions_used: s.extensions_used,
            extensions_left: lifespan.extensions_left(policy),
            extend,
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
            reference: s
                .failure_reason
                .as_ref()
                .map(|_| reference_of(&s.id.to_string())),
            expected_ready: None,
            site_unreachable: None,
        }
    }

    /// The view with the lesson's measured time to ready.
    pub fn with_expected(mut self, expected: Option<ExpectedView>) -> Self {
        self.expected_ready = expected;
        self
    }

    /// The view with what is known of its site's cluster: a live session on a site that does
    /// not answer (`reachable` false) says so.
    pub fn with_site(mut self, reachable: bool) -> Self {
        self.site_unreachable = (!reachable && self.status.is_live()).then(|| {
            format!(
                "the cluster your lab runs on (site {}) cannot be reached right now: the \
                 console and grading are unavailable until it answers again",
                self.site
            )
        });
        self
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

    #[test]
    fn the_expected_time_is_the_median_and_the_ninetieth_percentile() {
        let e = super::ExpectedView::from_seconds((1..=10).map(f64::from).rev().collect()).unwrap();
        assert_eq!((e.count, e.p50_seconds, e.p90_seconds), (10, 5.0, 9.0));
        assert_eq!(super::ExpectedView::from_seconds(vec![]), None);
    }

    #[test]
    fn the_reference_is_the_start_of_the_session_id() {
        assert_eq!(
            super::reference_of("1a2b3c4d-0000-4000-8000-000000000000"),
            "1a2b3c4d"
        );
    }
}
