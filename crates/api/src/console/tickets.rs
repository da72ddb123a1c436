//! One-time console tickets: a browser cannot put its bearer token on a WebSocket request, so
//! it trades the token for a ticket (`POST …/console-ticket`) and puts the ticket in the
//! WebSocket's URL. A ticket is random (256 bits), names one user and one session, is good
//! for [`TICKET_TTL`] and is taken on first use.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ttlab_model::{SessionId, UserId};

/// How long a ticket can be used.
pub const TICKET_TTL: Duration = Duration::from_secs(30);

/// Most tickets outstanding at once, all users together (older ones are dropped first).
const MAX_TICKETS: usize = 100_000;

#[derive(Debug, Clone)]
pub(super) struct Ticket {
    pub(super) user: UserId,
    pub(super) session: SessionId,
    issued: Instant,
}

/// The outstanding tickets of this process.
#[derive(Debug, Default)]
pub(super) struct Tickets {
    by_value: HashMap<String, Ticket>,
}

/// Why a ticket was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TicketRefusal {
    /// Never issued, already used, or expired.
    Unknown,
    /// Issued for another session.
    OtherSession,
}

impl Tickets {
    /// Issues a ticket for `user` and `session`.
    pub(super) fn issue(&mut self, user: UserId, session: SessionId, now: Instant) -> String {
        self.by_value
            .retain(|_, t| now.duration_since(t.issued) < TICKET_TTL);
        if self.by_value.len() >= MAX_TICKETS
            && let Some(oldest) = self
                .by_value
                .iter()
                .min_by_key(|(_, t)| t.issued)
                .map(|(k, _)| k.clone())
        {
            self.by_value.remove(&oldest);
        }
        let value = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        self.by_value.insert(
            value.clone(),
            Ticket {
                user,
                session,
                issued: now,
            },
        );
        value
    }

    /// Takes the ticket `value` for `session`: it is gone afterwards, whatever the answer.
    pub(super) fn take(
        &mut self,
        value: &str,
        session: SessionId,
        now: Instant,
    ) -> Result<Ticket, TicketRefusal> {
        let ticket = self.by_value.remove(value).ok_or(TicketRefusal::Unknown)?;
        if now.duration_since(ticket.issued) >= TICKET_TTL {
            return Err(TicketRefusal::Unknown);
        }
        if ticket.session != session {
            return Err(TicketRefusal::OtherSession);
        }
        Ok(ticket)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> (UserId, SessionId, SessionId) {
        (
            UserId::new("alice").unwrap(),
            SessionId::from_uuid(uuid::Uuid::new_v4()),
            SessionId::from_uuid(uuid::Uuid::new_v4()),
        )
    }

    #[test]
    fn a_ticket_is_good_once_for_its_session_within_its_lifetime() {
        let (alice, s1, s2) = ids();
        let mut t = Tickets::default();
        let now = Instant::now();
        let a = t.issue(alice.clone(), s1, now);
        assert_eq!(a.len(), 64);
        assert_eq!(t.take(&a, s1, now).unwrap().user, alice);
        assert_eq!(t.take(&a, s1, now).unwrap_err(), TicketRefusal::Unknown);

        let b = t.issue(alice.clone(), s1, now);
        assert_eq!(
            t.take(&b, s2, now).unwrap_err(),
            TicketRefusal::OtherSession
        );
        // Taken even when refused: it cannot be tried against the right session afterwards.
        assert_eq!(t.take(&b, s1, now).unwrap_err(), TicketRefusal::Unknown);

        let c = t.issue(alice, s1, now);
        let late = now + TICKET_TTL;
        assert_eq!(t.take(&c, s1, late).unwrap_err(), TicketRefusal::Unknown);
        assert_eq!(
            t.take("guess", s1, now).unwrap_err(),
            TicketRefusal::Unknown
        );
    }
}
