//! Why a console closed: the message the student reads and the WebSocket close code the page
//! acts on.

use std::fmt;

/// Why a console connection ended.
///
/// Each reason has a close code ([`CloseReason::code`]) and a sentence for the student
/// ([`CloseReason::message`]), written into the terminal as its last line and sent as the
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
    /// The VM is not running any more (powered off, crashed or deleted).
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

    /// The sentence shown to the student.
    pub fn message(&self) -> String {
        match self {
            Self::Expired => "Your lab session has expired. The VM is being reclaimed.".to_owned(),
            Self::Finished => "This lab session was finished.".to_owned(),
            Self::Replaced => {
                "The console was opened in another tab or window, so this one was closed."
                    .to_owned()
            }
            Self::VmStopped => "The VM has stopped.".to_owned(),
            Self::Unavailable(why) => format!("The VM's console could not be opened: {why}"),
            Self::ConsoleLost(why) => format!("The connection to the VM's console was lost: {why}"),
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
