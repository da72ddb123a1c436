//! The `console_tickets` table: one-time tickets that open a session's console, shared by
//! every server replica.
//!
//! A browser cannot put its bearer token on a WebSocket request, so it trades the token for a
//! ticket and puts the ticket in the WebSocket's URL; the WebSocket may reach another replica
//! than the one that issued the ticket. Only the ticket's SHA-256 digest ([`TicketDigest`]) is
//! stored, never the ticket. [`ConsoleTickets::take`] deletes the row it returns, with the
//! expiry compared to the database clock, so a ticket opens one console, once, on any
//! replica, and nothing after it expired. Expired rows are purged whenever a ticket is issued.
//!
//! Generating tickets (randomness, length) is the caller's business; this module only keeps
//! their digests.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sha2::{Digest as _, Sha256};
use tokio_postgres::Row;
use ttlab_model::{NodeName, SessionId, UserId};

use crate::rows::{get, parse_opt};
use crate::{Store, StoreError};

/// The SHA-256 digest of a console ticket: what the table keys on. Its `Debug` shows a
/// prefix only.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TicketDigest([u8; 32]);

impl TicketDigest {
    /// The digest of `ticket`.
    ///
    /// ```
    /// use ttlab_store::console_tickets::TicketDigest;
    /// assert_eq!(TicketDigest::of("t"), TicketDigest::of("t"));
    /// assert_ne!(TicketDigest::of("t"), TicketDigest::of("u"));
    /// ```
    pub fn of(ticket: &str) -> Self {
        Self(Sha256::digest(ticket.as_bytes()).into())
    }

    /// The 32 bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for TicketDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TicketDigest({:02x}{:02x}{:02x}{:02x}…)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

/// What a ticket was issued for, as [`ConsoleTickets::take`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleTicket {
    /// Who asked for it.
    pub user: UserId,
    /// The session whose console it opens.
    pub session: SessionId,
    /// The node it opens; `None`: the node chosen when the console is opened.
    pub node: Option<NodeName>,
    /// When it stops being accepted (database clock).
    pub expires_at: DateTime<Utc>,
}

impl ConsoleTicket {
    fn from_row(row: &Row) -> Result<Self, StoreError> {
        let user: Option<&str> = get(row, "user_id")?;
        Ok(Self {
            user: user
                .unwrap_or_default()
                .parse()
                .map_err(|e| StoreError::corrupt("user_id", e))?,
            session: SessionId::from_uuid(get(row, "session_id")?),
            node: parse_opt(row, "node")?,
            expires_at: get(row, "expires_at")?,
        })
    }
}

/// Queries on `console_tickets`, from [`Store::console_tickets`].
#[derive(Debug, Clone, Copy)]
pub struct ConsoleTickets<'a> {
    store: &'a Store,
}

impl<'a> ConsoleTickets<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Stores a ticket (by its digest) for `user` and `session` (and `node`, if named), good
    /// for `ttl` from the database clock's now; returns when it expires. Expired tickets of
    /// everyone are purged in the same statement. A digest already stored is a
    /// [`StoreError::Conflict`] (a ticket is never issued twice).
    pub async fn issue(
        &self,
        digest: &TicketDigest,
        user: &UserId,
        session: SessionId,
        node: Option<&NodeName>,
        ttl: Duration,
    ) -> Result<DateTime<Utc>, StoreError> {
        const SQL: &str = "WITH purged AS (DELETE FROM console_tickets WHERE expires_at <= now()) \
             INSERT INTO console_tickets (digest, user_id, session_id, node, expires_at) \
             VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5)) \
             RETURNING expires_at";
        if ttl.is_zero() || ttl > Duration::from_secs(24 * 3600) {
            return Err(StoreError::InvalidArgument(
                "a console ticket's lifetime must be between 1 ms and 24 h",
            ));
        }
        let client = self.store.client().await?;
        let row = client
            .query_one(
                SQL,
                &[
                    &digest.as_bytes().as_slice(),
                    &user.as_str(),
                    &session.as_uuid(),
                    &node.map(NodeName::as_str),
                    &ttl.as_secs_f64(),
                ],
            )
            .await
            .map_err(|e| {
                if e.code() == Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION) {
                    StoreError::Conflict {
                        what: "a console ticket with the same digest exists",
                    }
                } else {
                    StoreError::query("issuing a console ticket")(e)
                }
            })?;
        row.try_get(0)
            .map_err(StoreError::query("issuing a console ticket"))
    }

    /// Takes the ticket whose digest is `digest`: returns what it was issued for and deletes
    /// it, in one statement, if it exists and has not expired (database clock). `None`
    /// otherwise — never issued, already taken (here or on another replica), or expired.
    pub async fn take(&self, digest: &TicketDigest) -> Result<Option<ConsoleTicket>, StoreError> {
        const SQL: &str = "DELETE FROM console_tickets \
             WHERE digest = $1 AND expires_at > now() \
             RETURNING user_id, session_id, node, expires_at";
        let client = self.store.client().await?;
        let row = client
            .query_opt(SQL, &[&digest.as_bytes().as_slice()])
            .await
            .map_err(StoreError::query("taking a console ticket"))?;
        row.as_ref().map(ConsoleTicket::from_row).transpose()
    }

    /// Deletes every expired ticket; returns how many. ([`ConsoleTickets::issue`] does this
    /// too, so a busy server needs no timer for it.)
    pub async fn purge_expired(&self) -> Result<u64, StoreError> {
        const SQL: &str = "DELETE FROM console_tickets WHERE expires_at <= now()";
        let client = self.store.client().await?;
        client
            .execute(SQL, &[])
            .await
            .map_err(StoreError::query("purging expired console tickets"))
    }

    /// How many tickets are stored, expired or not (for checks and metrics).
    pub async fn count(&self) -> Result<u64, StoreError> {
        const SQL: &str = "SELECT count(*) FROM console_tickets";
        let client = self.store.client().await?;
        let row = client
            .query_one(SQL, &[])
            .await
            .map_err(StoreError::query("counting console tickets"))?;
        let n: i64 = row
            .try_get(0)
            .map_err(StoreError::query("counting console tickets"))?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
