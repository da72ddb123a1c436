//! One-time console tickets: a browser cannot put its bearer token on a WebSocket request, so
//! it trades the token for a ticket (`POST …/console-ticket`) and puts the ticket in the
//! WebSocket's URL. A ticket is random (256 bits from the operating system's CSPRNG, 64 hex
//! digits), names one user, one session and possibly one node, is good for
//! [`ApiConfig::console_ticket_ttl`](crate::ApiConfig::console_ticket_ttl) (database clock) and
//! is taken on first use.
//!
//! Tickets are kept in PostgreSQL (`ttlab_store::console_tickets`, as SHA-256 digests only),
//! so the replica that receives the WebSocket need not be the one that issued the ticket.

use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, Utc};
use ttlab_model::{NodeName, SessionId, UserId};
use ttlab_store::{ConsoleTicket, Store, StoreError, TicketDigest};

/// How long a ticket can be used, by default.
pub const TICKET_TTL: Duration = Duration::from_secs(30);

/// Why a ticket was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TicketRefusal {
    /// Never issued, already used, or expired.
    Unknown,
    /// Issued for another session.
    OtherSession,
    /// Issued for another node of the session.
    OtherNode,
}

/// A fresh ticket value: 32 random bytes as 64 lowercase hex digits.
fn fresh() -> Result<String, getrandom::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)?;
    let mut value = String::with_capacity(64);
    for b in bytes {
        let _ = write!(value, "{b:02x}");
    }
    Ok(value)
}

/// Issues a ticket for `user`'s console of `session` (and `node`, if named). Returns the
/// ticket and when it expires.
pub(super) async fn issue(
    store: &Store,
    user: &UserId,
    session: SessionId,
    node: Option<&NodeName>,
    ttl: Duration,
) -> Result<(String, DateTime<Utc>), StoreError> {
    let value = fresh()
        .map_err(|_| StoreError::InvalidArgument("the operating system's random source failed"))?;
    let expires = store
        .console_tickets()
        .issue(&TicketDigest::of(&value), user, session, node, ttl)
        .await?;
    Ok((value, expires))
}

/// Takes the ticket `value` for `session` (and `node`, if the WebSocket names one): it is gone
/// afterwards, whatever the answer.
pub(super) async fn take(
    store: &Store,
    value: &str,
    session: SessionId,
    node: Option<&str>,
) -> Result<Result<ConsoleTicket, TicketRefusal>, StoreError> {
    // A value that cannot be a ticket is not looked up.
    if value.len() != 64 || !value.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(Err(TicketRefusal::Unknown));
    }
    let Some(ticket) = store
        .console_tickets()
        .take(&TicketDigest::of(value))
        .await?
    else {
        return Ok(Err(TicketRefusal::Unknown));
    };
    if ticket.session != session {
        return Ok(Err(TicketRefusal::OtherSession));
    }
    if let (Some(issued), Some(asked)) = (&ticket.node, node)
        && issued.as_str() != asked
    {
        return Ok(Err(TicketRefusal::OtherNode));
    }
    Ok(Ok(ticket))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_are_64_hex_digits_and_never_repeat() {
        let a = fresh().unwrap();
        let b = fresh().unwrap();
        assert_eq!(a.len(), 64);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
