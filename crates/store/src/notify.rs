//! LISTEN/NOTIFY: the channel names (defined here once) and a [`Listener`] that yields
//! notifications from a dedicated connection.
//!
//! | channel | sent when | payload |
//! |---|---|---|
//! | [`SESSIONS_CHANGED`] | a session is opened, extended, changes status or records provisioning progress (stage, disk, VMs, failure reason) | its environment |
//! | [`COLLECT_REQUESTED`] | an admin asks for a collection now | the environment |
//! | [`COLLECT_ANSWERED`] | a reaper cycle answered a collect request | the request id |
//! | [`CONSOLE_TAKEN`] | a server replica opens a console (the VM allows one: every other replica closes its own) | [`ConsoleTaken`]: `session/node/connection` |
//!
//! Notifications are hints to wake up and re-read the tables, never the data itself: one may
//! be missed while a listener reconnects, so listeners also poll on a timer.

use std::fmt;

use tokio::sync::mpsc;
use ttlab_model::{NodeName, SessionId};
use uuid::Uuid;

use crate::{DbUrl, Store, StoreError};

macro_rules! channel_sessions_changed {
    () => {
        "ttlab_sessions_changed"
    };
}
macro_rules! channel_collect_requested {
    () => {
        "ttlab_collect_requested"
    };
}
macro_rules! channel_collect_answered {
    () => {
        "ttlab_collect_answered"
    };
}
macro_rules! channel_console_taken {
    () => {
        "ttlab_console_taken"
    };
}
pub(crate) use {channel_collect_answered, channel_collect_requested, channel_sessions_changed};

/// Channel: a session was opened, extended, changed status or recorded provisioning progress
/// (payload: its environment).
pub const SESSIONS_CHANGED: &str = channel_sessions_changed!();
/// Channel: an admin asked for a collection now (payload: the environment).
pub const COLLECT_REQUESTED: &str = channel_collect_requested!();
/// Channel: a reaper cycle answered a collect request (payload: the request id).
pub const COLLECT_ANSWERED: &str = channel_collect_answered!();
/// Channel: a console was opened on some server replica (payload: [`ConsoleTaken`]).
pub const CONSOLE_TAKEN: &str = channel_console_taken!();

/// One of ttlab's notification channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Channel {
    /// [`SESSIONS_CHANGED`].
    SessionsChanged,
    /// [`COLLECT_REQUESTED`].
    CollectRequested,
    /// [`COLLECT_ANSWERED`].
    CollectAnswered,
    /// [`CONSOLE_TAKEN`].
    ConsoleTaken,
}

impl Channel {
    /// Every channel.
    pub const ALL: [Channel; 4] = [
        Self::SessionsChanged,
        Self::CollectRequested,
        Self::CollectAnswered,
        Self::ConsoleTaken,
    ];

    /// The channel's name in PostgreSQL.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::SessionsChanged => SESSIONS_CHANGED,
            Self::CollectRequested => COLLECT_REQUESTED,
            Self::CollectAnswered => COLLECT_ANSWERED,
            Self::ConsoleTaken => CONSOLE_TAKEN,
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|c| c.as_str() == name)
    }
}

impl fmt::Display for Channel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A notification received on one of ttlab's channels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notification {
    /// The channel it came on.
    pub channel: Channel,
    /// Its payload (see the table in the module docs).
    pub payload: String,
}

/// The payload of [`CONSOLE_TAKEN`]: the console of `node` in `session` was opened by the
/// connection `connection` (an id the opening replica made up), so every other connection to
/// that console, on any replica, is closed ("opened in another tab") — KubeVirt allows one
/// console per VM and has already closed, or is about to close, the others.
///
/// ```
/// use ttlab_store::ConsoleTaken;
/// let taken = ConsoleTaken {
///     session: ttlab_model::SessionId::new_random(),
///     node: "main".parse().unwrap(),
///     connection: uuid::Uuid::new_v4(),
/// };
/// assert_eq!(ConsoleTaken::parse(&taken.payload()), Some(taken));
/// assert_eq!(ConsoleTaken::parse("garbage"), None);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsoleTaken {
    /// The session.
    pub session: SessionId,
    /// The node whose console was opened.
    pub node: NodeName,
    /// The connection that holds it now.
    pub connection: Uuid,
}

impl ConsoleTaken {
    /// `session/node/connection`.
    pub fn payload(&self) -> String {
        format!("{}/{}/{}", self.session, self.node, self.connection)
    }

    /// Reads a payload written by [`ConsoleTaken::payload`]; `None` if it is not one.
    pub fn parse(payload: &str) -> Option<Self> {
        let mut parts = payload.split('/');
        let (session, node, connection) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        Some(Self {
            session: session.parse().ok()?,
            node: node.parse().ok()?,
            connection: connection.parse().ok()?,
        })
    }
}

impl Store {
    /// Announces on [`CONSOLE_TAKEN`] that `taken.connection` now holds the console of
    /// `taken.node` in `taken.session`. Every listener, on every replica, receives it (the
    /// sender's own listeners too).
    pub async fn announce_console_taken(&self, taken: &ConsoleTaken) -> Result<(), StoreError> {
        const SQL: &str = concat!("SELECT pg_notify('", channel_console_taken!(), "', $1)");
        let client = self.client().await?;
        client
            .execute(SQL, &[&taken.payload()])
            .await
            .map_err(StoreError::query("announcing a console takeover"))?;
        Ok(())
    }
}

/// Receives notifications on a dedicated connection (never a pooled one: `LISTEN` belongs to
/// the connection). Dropping it closes the connection.
///
/// An idle listening connection asks nothing, so nothing would notice it go half-open: it
/// sends an empty query every half [call timeout](crate::Timeouts::call) (at least 1 s, at
/// most 30 s), and a ping that gets no answer ends the connection, so [`Listener::recv`] fails
/// and its owner opens a new one.
pub struct Listener {
    // Held so the connection stays open; the driving task ends when it is dropped.
    _client: std::sync::Arc<tokio_postgres::Client>,
    rx: mpsc::UnboundedReceiver<Result<Notification, String>>,
    task: tokio::task::JoinHandle<()>,
    ping: tokio::task::JoinHandle<()>,
    target: String,
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("target", &self.target)
            .finish()
    }
}

impl Store {
    /// Opens a dedicated connection listening on `channels`.
    pub async fn listen(&self, channels: &[Channel]) -> Result<Listener, StoreError> {
        Listener::open(self.url(), channels).await
    }
}

impl Listener {
    pub(crate) async fn open(url: &DbUrl, channels: &[Channel]) -> Result<Self, StoreError> {
        let (client, mut connection) = url.open_connection().await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let message = std::future::poll_fn(|cx| connection.poll_message(cx)).await;
                let sent = match message {
                    Some(Ok(tokio_postgres::AsyncMessage::Notification(n))) => {
                        match Channel::from_name(n.channel()) {
                            Some(channel) => tx.send(Ok(Notification {
                                channel,
                                payload: n.payload().to_owned(),
                            })),
                            None => Ok(()),
                        }
                    }
                    Some(Ok(_notice)) => Ok(()),
                    Some(Err(e)) => {
                        let _ = tx.send(Err(crate::error::pg_reason(&e)));
                        return;
                    }
                    None => {
                        let _ = tx.send(Err("the server closed the connection".into()));
                        return;
                    }
                };
                if sent.is_err() {
                    return;
                }
            }
        });
        let client = std::sync::Arc::new(client);
        let ping = {
            let client = client.clone();
            let every = (url.timeouts().call / 2).clamp(
                std::time::Duration::from_secs(1),
                std::time::Duration::from_secs(30),
            );
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(every).await;
                    if client.simple_query("").await.is_err() {
                        return;
                    }
                }
            })
        };
        let listener = Self {
            _client: client,
            rx,
            task,
            ping,
            target: url.target().to_owned(),
        };
        let sql: String = channels
            .iter()
            .map(|c| format!("LISTEN {};", c.as_str()))
            .collect();
        listener
            ._client
            .batch_execute(&sql)
            .await
            .map_err(StoreError::query("subscribing to notifications"))?;
        Ok(listener)
    }

    /// The next notification. Fails with [`StoreError::ListenerClosed`] when the connection
    /// ends; open a new listener then (and re-read, since notifications may have been missed).
    pub async fn recv(&mut self) -> Result<Notification, StoreError> {
        match self.rx.recv().await {
            Some(Ok(n)) => Ok(n),
            Some(Err(reason)) => Err(StoreError::ListenerClosed {
                target: self.target.clone(),
                reason,
            }),
            None => Err(StoreError::ListenerClosed {
                target: self.target.clone(),
                reason: "the connection ended".into(),
            }),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.ping.abort();
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_names_are_distinct_and_round_trip() {
        for c in Channel::ALL {
            assert_eq!(Channel::from_name(c.as_str()), Some(c));
            assert!(c.as_str().starts_with("ttlab_"));
        }
        assert_eq!(Channel::from_name("other"), None);
    }
}
