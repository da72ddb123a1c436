//! The `console_connections` table: per (session, node), the current or last console
//! connection — who opened it, which server replica relays it, when it opened and closed, and
//! why it closed when that is known. Any replica may hold a console, so the admin's session
//! view reads its owner here.
//!
//! A newer connection to the same console replaces the row (a takeover: the console was
//! opened in another tab, perhaps on another replica). A close is conditional on the
//! connection id, so the late close of a replaced connection never marks the newer one
//! closed. Times are the database clock's.
//!
//! The replica relaying a console marks its row seen every few seconds
//! ([`ConsoleConnections::seen`]); a row left open by a replica that stopped doing so (it
//! crashed or was killed, and could not record the close) is closed by any other replica
//! with [`ConsoleClosedWhy::ReplicaGone`] ([`ConsoleConnections::close_unseen`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Row;
use ttlab_model::{NodeName, SessionId, UserId};
use uuid::Uuid;

use crate::rows::{get, parse, parse_opt};
use crate::{Store, StoreError};

/// Why a console connection closed, as far as the relay knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[derive(strum::Display, strum::EnumString, strum::IntoStaticStr, strum::EnumCount)]
#[strum(
    serialize_all = "snake_case",
    parse_err_ty = String,
    parse_err_fn = unknown_close_reason
)]
pub enum ConsoleClosedWhy {
    /// The browser closed it (the tab, the page, or the student's network).
    BrowserClosed,
    /// The console was opened elsewhere (another tab or window).
    TakenOver,
    /// The session ended: expired, finished, or its VM stopped.
    SessionEnded,
    /// The connection broke: to the VM's console, to an unresponsive browser, or the server
    /// stopped.
    Lost,
    /// The server replica relaying it is gone (it crashed or was killed without recording
    /// the close): another replica found the row no longer seen.
    ReplicaGone,
}

impl ConsoleClosedWhy {
    /// Every value, for exhaustive tests.
    pub const ALL: [Self; <ConsoleClosedWhy as strum::EnumCount>::COUNT] = [
        Self::BrowserClosed,
        Self::TakenOver,
        Self::SessionEnded,
        Self::Lost,
        Self::ReplicaGone,
    ];

    /// The name stored and shown: `browser_closed`, `taken_over`, `session_ended`, `lost`,
    /// `replica_gone`.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_close_reason(s: &str) -> String {
    format!("unknown console close reason {s:?}")
}

/// The current or last connection to one console.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConsoleConnection {
    /// The session.
    pub session: SessionId,
    /// The node (VM or pod) whose console it is.
    pub node: NodeName,
    /// The connection (random per connection; compared on close).
    pub connection: Uuid,
    /// The user who opened it.
    pub user: UserId,
    /// The server replica relaying it.
    pub replica: String,
    /// When it opened.
    pub opened_at: DateTime<Utc>,
    /// When it closed; `None` while open.
    pub closed_at: Option<DateTime<Utc>>,
    /// Why it closed, when known.
    pub closed_why: Option<ConsoleClosedWhy>,
}

const COLUMNS: &str =
    "session_id, node, connection_id, user_id, replica, opened_at, closed_at, closed_why";

impl ConsoleConnection {
    fn from_row(row: &Row) -> Result<Self, StoreError> {
        Ok(Self {
            session: SessionId::from_uuid(get(row, "session_id")?),
            node: parse(row, "node")?,
            connection: get(row, "connection_id")?,
            user: parse(row, "user_id")?,
            replica: get(row, "replica")?,
            opened_at: get(row, "opened_at")?,
            closed_at: get(row, "closed_at")?,
            closed_why: parse_opt(row, "closed_why")?,
        })
    }
}

/// The longest replica name accepted, in characters.
pub const MAX_REPLICA_CHARS: usize = 256;

/// Queries on `console_connections`, from [`Store::console_connections`].
#[derive(Debug, Clone, Copy)]
pub struct ConsoleConnections<'a> {
    store: &'a Store,
}

impl<'a> ConsoleConnections<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Records that `connection` of `user`, relayed by `replica`, opened the console of
    /// `node`: it replaces whatever connection the row held (open or closed).
    pub async fn opened(
        &self,
        session: SessionId,
        node: &NodeName,
        connection: Uuid,
        user: &UserId,
        replica: &str,
    ) -> Result<ConsoleConnection, StoreError> {
        let n = replica.chars().count();
        if n == 0 || n > MAX_REPLICA_CHARS {
            return Err(StoreError::InvalidArgument(
                "a replica name needs between 1 and 256 characters",
            ));
        }
        let sql = format!(
            "INSERT INTO console_connections (session_id, node, connection_id, user_id, replica) \
             VALUES ($1, $2, $3, $4, $5) \
             ON CONFLICT (session_id, node) DO UPDATE SET \
                connection_id = EXCLUDED.connection_id, user_id = EXCLUDED.user_id, \
                replica = EXCLUDED.replica, opened_at = now(), closed_at = NULL, \
                closed_why = NULL, seen_at = now() \
             RETURNING {COLUMNS}"
        );
        let (client, statement) = self
            .store
            .prepared("recording a console connection", &sql)
            .await?;
        let row = client
            .query_one(
                &statement,
                &[
                    &session.as_uuid(),
                    &node.as_str(),
                    &connection,
                    &user.as_str(),
                    &replica,
                ],
            )
            .await
            .map_err(StoreError::query("recording a console connection"))?;
        ConsoleConnection::from_row(&row)
    }

    /// Records that `connection` to the console of `node` closed, for `why` when known.
    /// `false` when the row holds another connection now (a newer one took the console) or
    /// this one was already recorded closed: nothing changed.
    pub async fn closed(
        &self,
        session: SessionId,
        node: &NodeName,
        connection: Uuid,
        why: Option<ConsoleClosedWhy>,
    ) -> Result<bool, StoreError> {
        let sql = "UPDATE console_connections SET closed_at = now(), closed_why = $4 \
                   WHERE session_id = $1 AND node = $2 AND connection_id = $3 \
                   AND closed_at IS NULL";
        let (client, statement) = self
            .store
            .prepared("recording a console's close", sql)
            .await?;
        let n = client
            .execute(
                &statement,
                &[
                    &session.as_uuid(),
                    &node.as_str(),
                    &connection,
                    &why.map(ConsoleClosedWhy::as_str),
                ],
            )
            .await
            .map_err(StoreError::query("recording a console's close"))?;
        Ok(n == 1)
    }

    /// Marks the open rows of `connections` (the consoles a replica relays now) seen now.
    /// How many rows were marked.
    pub async fn seen(&self, connections: &[Uuid]) -> Result<u64, StoreError> {
        const WHAT: &str = "marking console connections seen";
        if connections.is_empty() {
            return Ok(0);
        }
        let sql = "UPDATE console_connections SET seen_at = now() \
                   WHERE connection_id = ANY($1) AND closed_at IS NULL";
        let (client, statement) = self.store.prepared(WHAT, sql).await?;
        client
            .execute(&statement, &[&connections])
            .await
            .map_err(StoreError::query(WHAT))
    }

    /// Closes, with [`ConsoleClosedWhy::ReplicaGone`], every open row not seen for `unseen`
    /// (its replica stopped marking it: it is gone). The rows closed.
    pub async fn close_unseen(
        &self,
        unseen: std::time::Duration,
    ) -> Result<Vec<ConsoleConnection>, StoreError> {
        const WHAT: &str = "closing the consoles of a replica that is gone";
        let millis = unseen.as_secs_f64() * 1000.0;
        let sql = format!(
            "UPDATE console_connections SET closed_at = now(), closed_why = 'replica_gone' \
             WHERE closed_at IS NULL AND seen_at < now() - $1::float8 * interval '1 millisecond' \
             RETURNING {COLUMNS}"
        );
        let (client, statement) = self.store.prepared(WHAT, &sql).await?;
        let rows = client
            .query(&statement, &[&millis])
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter().map(ConsoleConnection::from_row).collect()
    }

    /// The console connections of `session`, one per node that ever had one, by node name.
    pub async fn for_session(
        &self,
        session: SessionId,
    ) -> Result<Vec<ConsoleConnection>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM console_connections WHERE session_id = $1 ORDER BY node"
        );
        let client = self.store.client().await?;
        let rows = client
            .query(&sql, &[&session.as_uuid()])
            .await
            .map_err(StoreError::query("reading console connections"))?;
        rows.iter().map(ConsoleConnection::from_row).collect()
    }
}
