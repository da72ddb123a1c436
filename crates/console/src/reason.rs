//! Why a console closed: the message the student reads and the WebSocket close code the page
//! acts on.

use std::fmt;

/// What the lab runs in, which decides the words the student reads: a VM lab has a VM and its
/// console, a pod lab a container and a shell in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LabKind {
    /// A KubeVirt VM, reached through its serial console.
    #[default]
    Vm,
    /// A container (a pod lab), reached through a shell exec'd in it.
    Container,
}

impl LabKind {
    /// What the student's terminal is connected to: "the VM's console", "the lab's shell".
    pub fn console(self) -> &'static str {
        match self {
            Self::Vm => "the VM's console",
            Self::Container => "the lab's shell",
        }
    }

    /// What the lab runs in: "the VM", "the lab's container".
    pub fn machine(self) -> &'static str {
        match self {
            Self::Vm => "the VM",
            Self::Container => "the lab's container",
        }
    }
}

/// "the VM's console" → "The VM's console".
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Why a console connection ended.
///
/// Each reason has a close code ([`CloseReason::code`]) and a sentence for the student
/// ([`CloseReason::message_for`] the kind of lab), written into the terminal as its last line and sent as the
/// Close frame's reason. The page reconnects by itself only when
/// [`CloseReason::may_reconnect`] says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CloseReason {
    /// The session reached its expiry (the instant the countdown shows).
    Expired,
    /// The session was finished.
    Finished,
    /// The console was opened elsewhere (another tab or window): a VM has one console.
    Replaced,
    /// The VM (or a pod lab's container) is not running any more (powered off, crashed for
    /// good or deleted).
    VmStopped,
    /// The console could not be opened (not running in time, refused, unreachable).
    Unavailable(String),
    /// The connection to the VM's console broke while it was in use.
    ConsoleLost(String),
    /// The browser stopped answering pings, or could not take output in time.
    BrowserUnresponsive,
    /// The browser closed the connection (or it broke on the browser's side).
    BrowserClosed,
    /// The server is shutting down.
    ServerShutdown,
}

impl CloseReason {
    /// The WebSocket close code.
    ///
    /// | code | reason | page reconnects |
    /// |---|---|---|
    /// | 1000 | browser closed | no |
    /// | 1012 | server restarting | yes |
    /// | 4001 | session expired | no |
    /// | 4002 | session finished | no |
    /// | 4003 | opened in another tab | no |
    /// | 4004 | VM stopped | no |
    /// | 4005 | console unavailable | yes |
    /// | 4006 | console connection lost | yes |
    /// | 4007 | browser not responding | yes |
    pub fn code(&self) -> u16 {
        match self {
            Self::BrowserClosed => 1000,
            Self::ServerShutdown => 1012,
            Self::Expired => 4001,
            Self::Finished => 4002,
            Self::Replaced => 4003,
            Self::VmStopped => 4004,
            Self::Unavailable(_) => 4005,
            Self::ConsoleLost(_) => 4006,
            Self::BrowserUnresponsive => 4007,
        }
    }

    /// Whether opening the console again may work without the student doing anything.
    pub fn may_reconnect(&self) -> bool {
        matches!(
            self,
            Self::ServerShutdown
                | Self::Unavailable(_)
                | Self::ConsoleLost(_)
                | Self::BrowserUnresponsive
        )
    }

    /// The sentence shown to the student of a VM lab (see [`CloseReason::message_for`]).
    pub fn message(&self) -> String {
        self.message_for(LabKind::Vm)
    }

    /// The sentence shown to the student, in the words of `lab`: a pod lab has no VM.
    pub fn message_for(&self, lab: LabKind) -> String {
        match self {
            Self::Expired => format!(
                "Your lab session has expired. {} is being reclaimed.",
                capitalized(lab.machine())
            ),
            Self::Finished => "This lab session was finished.".to_owned(),
            Self::Replaced => {
                "The console was opened in another tab or window, so this one was closed."
                    .to_owned()
            }
            Self::VmStopped => format!("{} has stopped.", capitalized(lab.machine())),
            Self::Unavailable(why) => {
                format!("{} could not be opened: {why}", capitalized(lab.console()))
            }
            Self::ConsoleLost(why) => {
                format!("The connection to {} was lost: {why}", lab.console())
            }
            Self::BrowserUnresponsive => "The browser stopped responding.".to_owned(),
            Self::BrowserClosed => "The browser closed the console.".to_owned(),
            Self::ServerShutdown => "The server is restarting; reconnect in a moment.".to_owned(),
        }
    }
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Vec<CloseReason> {
        vec![
            CloseReason::Expired,
            CloseReason::Finished,
            CloseReason::Replaced,
            CloseReason::VmStopped,
            CloseReason::Unavailable("x".into()),
            CloseReason::ConsoleLost("x".into()),
            CloseReason::BrowserUnresponsive,
            CloseReason::BrowserClosed,
            CloseReason::ServerShutdown,
        ]
    }

    #[test]
    fn a_pod_lab_is_never_told_about_a_vm() {
        for reason in all() {
            let vm = reason.message_for(LabKind::Vm);
            let pod = reason.message_for(LabKind::Container);
            assert_eq!(vm, reason.message(), "{reason:?}");
            assert!(!pod.contains("VM"), "{reason:?}: {pod}");
        }
        assert_eq!(CloseReason::VmStopped.message(), "The VM has stopped.");
        assert_eq!(
            CloseReason::VmStopped.message_for(LabKind::Container),
            "The lab's container has stopped."
        );
        assert_eq!(
            CloseReason::Expired.message_for(LabKind::Container),
            "Your lab session has expired. The lab's container is being reclaimed."
        );
        assert_eq!(
            CloseReason::ConsoleLost("x".into()).message_for(LabKind::Container),
            "The connection to the lab's shell was lost: x"
        );
    }

    #[test]
    fn every_reason_has_its_own_code() {
        let mut codes: Vec<u16> = all().iter().map(CloseReason::code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), all().len());
    }

    #[test]
    fn the_page_never_reconnects_into_a_session_that_is_over_or_open_elsewhere() {
        for reason in all() {
            let final_one = matches!(
                reason,
                CloseReason::Expired
                    | CloseReason::Finished
                    | CloseReason::Replaced
                    | CloseReason::VmStopped
                    | CloseReason::BrowserClosed
            );
            assert_eq!(reason.may_reconnect(), !final_one, "{reason:?}");
        }
    }
}
