//! Advisory locks: the migration lock, the reaper's leader lock (one reaper per environment
//! acts at a time), the capacity lock that serialises "count, then open a session", and the
//! provisioning lock a server holds on each session it is provisioning.
//!
//! Keys are the two-integer form `(class, key)`: the class says what the lock is for, the key
//! which one (the environment's or session id's `hashtext`, or 0).

use ttlab_model::EnvName;

use crate::sessions::{self, NewSession, Session};
use crate::{Store, StoreError};

/// What an advisory lock protects; its class is `0x7474_0000 | kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockKind {
    /// Applying migrations.
    Migrate = 1,
    /// Being the acting reaper of an environment.
    ReaperLeader = 2,
    /// Counting capacity and opening a session.
    Capacity = 3,
    /// Provisioning one session (held by the server process doing it).
    Provisioning = 4,
}

/// The `(class, key)` pair of a lock.
pub(crate) const fn lock_key(kind: LockKind, key: i32) -> (i32, i32) {
    (0x7474_0000 | kind as i32, key)
}

/// Being the acting reaper of one environment: a session-level advisory lock held on a
/// dedicated connection. Dropping it (or losing the connection) releases the lock.
pub struct LeaderLock {
    client: tokio_postgres::Client,
    env: EnvName,
    target: String,
}

impl std::fmt::Debug for LeaderLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderLock")
            .field("env", &self.env)
            .field("target", &self.target)
            .finish()
    }
}

impl Store {
    /// Tries to become the acting reaper of `env`, without waiting. `None` means another
    /// process holds the lock.
    pub async fn try_leader_lock(&self, env: &EnvName) -> Result<Option<LeaderLock>, StoreError> {
        let client = self.url().connect().await?;
        let (class, _) = lock_key(LockKind::ReaperLeader, 0);
        let row = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, hashtext($2))",
                &[&class, &env.as_str()],
            )
            .await
            .map_err(StoreError::query("taking the reaper leader lock"))?;
        let got: bool = row
            .try_get(0)
            .map_err(StoreError::query("taking the reaper leader lock"))?;
        Ok(got.then(|| LeaderLock {
            client,
            env: env.clone(),
            target: self.target().to_owned(),
        }))
    }

    /// Takes the capacity lock in a new transaction, waiting for whoever holds it. Count the
    /// live VMs while holding it, then either [`CapacityGuard::insert_session`] (which commits
    /// and releases) or drop the guard (which rolls back and releases).
    pub async fn lock_capacity(&self) -> Result<CapacityGuard, StoreError> {
        let (class, key) = lock_key(LockKind::Capacity, 0);
        // The guard exists before the transaction begins: if this future is dropped half-way,
        // its Drop discards the connection rather than pooling one inside a transaction.
        let mut guard = CapacityGuard {
            client: Some(self.client().await?),
            store: self.clone(),
        };
        guard
            .client()
            .batch_execute("BEGIN")
            .await
            .map_err(StoreError::query("beginning the capacity transaction"))?;
        guard
            .client()
            .execute("SELECT pg_advisory_xact_lock($1, $2)", &[&class, &key])
            .await
            .map_err(StoreError::query("taking the capacity lock"))?;
        Ok(guard)
    }
}

impl LeaderLock {
    /// The environment this lock makes us the reaper of.
    pub fn env(&self) -> &EnvName {
        &self.env
    }

    /// Confirms the lock is still held. A reaper checks this before each cycle and stops
    /// acting when it fails ([`StoreError::LockLost`], or a query error if the connection
    /// is gone — which also released the lock).
    pub async fn check(&self) -> Result<(), StoreError> {
        let (class, _) = lock_key(LockKind::ReaperLeader, 0);
        let row = self
            .client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                 AND pid = pg_backend_pid() AND granted AND classid = $1::int::oid \
                 AND objid = hashtext($2)::oid AND objsubid = 2)",
                &[&class, &self.env.as_str()],
            )
            .await
            .map_err(StoreError::query("checking the reaper leader lock"))?;
        let held: bool = row
            .try_get(0)
            .map_err(StoreError::query("checking the reaper leader lock"))?;
        if held {
            Ok(())
        } else {
            Err(StoreError::LockLost {
                what: "reaper leader",
                target: self.target.clone(),
            })
        }
    }

    /// Releases the lock now (dropping the value releases it too, when the connection closes).
    pub async fn release(self) -> Result<(), StoreError> {
        let (class, _) = lock_key(LockKind::ReaperLeader, 0);
        self.client
            .execute(
                "SELECT pg_advisory_unlock($1, hashtext($2))",
                &[&class, &self.env.as_str()],
            )
            .await
            .map_err(StoreError::query("releasing the reaper leader lock"))?;
        Ok(())
    }
}

/// The right to provision one session: a session-level advisory lock on a dedicated
/// connection, held by the server process driving the session's provisioning. A server that
/// starts and finds a `starting` session it cannot lock knows another replica is still on it;
/// one it can lock was abandoned (its provisioner died, and its connection with it). Dropping
/// the value (or losing the connection) releases the lock.
pub struct ProvisioningLock {
    _client: tokio_postgres::Client,
}

impl std::fmt::Debug for ProvisioningLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProvisioningLock").finish_non_exhaustive()
    }
}

impl Store {
    /// Tries to take the provisioning lock of session `id`, without waiting. `None` means
    /// another process holds it.
    pub async fn try_provisioning_lock(
        &self,
        id: ttlab_model::SessionId,
    ) -> Result<Option<ProvisioningLock>, StoreError> {
        let client = self.url().connect().await?;
        let (class, _) = lock_key(LockKind::Provisioning, 0);
        let row = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, hashtext($2))",
                &[&class, &id.to_string()],
            )
            .await
            .map_err(StoreError::query("taking a provisioning lock"))?;
        let got: bool = row
            .try_get(0)
            .map_err(StoreError::query("taking a provisioning lock"))?;
        Ok(got.then_some(ProvisioningLock { _client: client }))
    }

    /// Takes the provisioning lock of session `id`, waiting up to `within` for whoever holds
    /// it to let go. `None` means it was still held when the time was up. Used by whoever ends
    /// a session that was `starting`: once it holds the lock, no provisioner is creating
    /// objects for the session any more, so what it deletes stays deleted.
    pub async fn wait_provisioning_lock(
        &self,
        id: ttlab_model::SessionId,
        within: std::time::Duration,
    ) -> Result<Option<ProvisioningLock>, StoreError> {
        let client = self.url().connect().await?;
        let (class, _) = lock_key(LockKind::Provisioning, 0);
        let ms = within.as_millis().clamp(1, i32::MAX as u128);
        client
            .batch_execute(&format!("SET lock_timeout = {ms}"))
            .await
            .map_err(StoreError::query("waiting for a provisioning lock"))?;
        match client
            .execute(
                "SELECT pg_advisory_lock($1, hashtext($2))",
                &[&class, &id.to_string()],
            )
            .await
        {
            Ok(_) => Ok(Some(ProvisioningLock { _client: client })),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                Ok(None)
            }
            Err(e) => Err(StoreError::query("waiting for a provisioning lock")(e)),
        }
    }

    /// Whether some process holds the provisioning lock of session `id` (a provisioner is
    /// still running for it). The reaper leaves such a session to its provisioner, which ends
    /// it once it notices the session is no longer `starting`.
    pub async fn provisioning_in_progress(
        &self,
        id: ttlab_model::SessionId,
    ) -> Result<bool, StoreError> {
        let (class, _) = lock_key(LockKind::Provisioning, 0);
        let client = self.client().await?;
        let row = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' \
                 AND granted AND classid = $1::int::oid \
                 AND objid = hashtext($2)::oid AND objsubid = 2)",
                &[&class, &id.to_string()],
            )
            .await
            .map_err(StoreError::query("looking for a provisioning lock"))?;
        row.try_get(0)
            .map_err(StoreError::query("looking for a provisioning lock"))
    }
}

/// An open transaction holding the capacity lock. See [`Store::lock_capacity`].
pub struct CapacityGuard {
    client: Option<deadpool_postgres::Object>,
    store: Store,
}

impl std::fmt::Debug for CapacityGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapacityGuard")
            .field("target", &self.store.target())
            .finish()
    }
}

impl CapacityGuard {
    fn client(&mut self) -> &deadpool_postgres::Object {
        self.client
            .as_ref()
            .expect("the client is only taken by methods consuming the guard")
    }

    /// Opens the session and commits, releasing the lock. A user who already has a live
    /// session gets [`StoreError::SessionExists`].
    pub async fn insert_session(mut self, new: &NewSession) -> Result<Session, StoreError> {
        let inserted = sessions::insert_on(self.client(), new).await;
        match inserted {
            Ok(session) => {
                self.client()
                    .batch_execute("COMMIT")
                    .await
                    .map_err(StoreError::query("committing the new session"))?;
                self.return_to_pool();
                Ok(session)
            }
            Err(sessions::InsertError::LiveExists) => {
                self.rollback_in_place().await?;
                match self.store.sessions().live_for_user(&new.user).await? {
                    Some(open) => Err(sessions::exists_error(open)),
                    // The other session ended in the meantime: the caller may simply retry.
                    None => Err(StoreError::Conflict {
                        what: "another session of this user ended while this one was opened",
                    }),
                }
            }
            Err(sessions::InsertError::Other(e)) => Err(e),
        }
    }

    /// Rolls back and releases the lock without opening anything.
    pub async fn rollback(mut self) -> Result<(), StoreError> {
        self.rollback_in_place().await
    }

    async fn rollback_in_place(&mut self) -> Result<(), StoreError> {
        self.client()
            .batch_execute("ROLLBACK")
            .await
            .map_err(StoreError::query("rolling back the capacity transaction"))?;
        self.return_to_pool();
        Ok(())
    }

    fn return_to_pool(&mut self) {
        // Dropping the pooled object returns it, now outside any transaction.
        drop(self.client.take());
    }
}

impl Drop for CapacityGuard {
    fn drop(&mut self) {
        // Still inside the transaction: take the connection out of the pool and close it, so
        // the server rolls back and releases the lock, and nobody reuses a connection stuck in
        // an open transaction.
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}
