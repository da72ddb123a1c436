//! Locks: the migration lock and the capacity lock that serialises "count, then open a
//! session" (transaction-scoped advisory locks, which end with their transaction, bounded by
//! `lock_timeout`), and the two rights held for longer — the reaper's leadership of an
//! environment and a server's provisioning of a session — which are [leases](crate::leases)
//! renewed on a heartbeat, so a holder that vanishes loses them within a lease's duration
//! whatever its sockets do.
//!
//! Advisory keys are the two-integer form `(class, key)`: the class says what the lock is for.

use std::time::Duration;

use ttlab_model::EnvName;

use crate::leases::{HeldLease, LeaseKind};
use crate::sessions::{self, NewPoolMember, NewSession, Session};
use crate::{Store, StoreError};

/// What an advisory lock protects; its class is `0x7474_0000 | kind`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockKind {
    /// Applying migrations.
    Migrate = 1,
    /// Counting capacity and opening a session.
    Capacity = 3,
}

/// The `(class, key)` pair of a lock.
pub(crate) const fn lock_key(kind: LockKind, key: i32) -> (i32, i32) {
    (0x7474_0000 | kind as i32, key)
}

/// The capacity lock key of a site: 0 for `default` (the key of [`Store::lock_capacity`]),
/// else a hash of the name (FNV-1a, never 0; two sites sharing a key only wait for each
/// other).
fn site_lock_key(site: &ttlab_model::SiteName) -> i32 {
    if site.as_str() == "default" {
        return 0;
    }
    let mut hash: u32 = 0x811c_9dc5;
    for byte in site.as_str().bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    match i32::from_ne_bytes(hash.to_ne_bytes()) {
        0 => 1,
        key => key,
    }
}

/// Being the acting reaper of one environment: a [lease](crate::leases) of kind
/// `reaper-leader` keyed by the environment, renewed on a heartbeat. Dropping it stops the
/// heartbeat and releases it.
pub struct LeaderLock {
    lease: HeldLease,
    env: EnvName,
    target: String,
}

impl std::fmt::Debug for LeaderLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderLock")
            .field("env", &self.env)
            .field("holder", self.lease.holder())
            .field("target", &self.target)
            .finish()
    }
}

impl Store {
    /// Tries to become the acting reaper of `env`, without waiting. `None` means another
    /// process holds the (unexpired) lease.
    pub async fn try_leader_lock(&self, env: &EnvName) -> Result<Option<LeaderLock>, StoreError> {
        let lease = self
            .leases()
            .hold(
                LeaseKind::ReaperLeader,
                env.as_str(),
                self.lease_ttls().leader,
            )
            .await?;
        Ok(lease.map(|lease| LeaderLock {
            lease,
            env: env.clone(),
            target: self.target().to_owned(),
        }))
    }

    /// Takes the capacity lock in a new transaction, waiting for whoever holds it up to
    /// [`Timeouts::capacity_lock`](crate::Timeouts) ([`StoreError::Busy`] then: retryable). Count the
    /// live VMs while holding it, then either [`CapacityGuard::insert_session`] (which commits
    /// and releases) or drop the guard (which rolls back and releases).
    pub async fn lock_capacity(&self) -> Result<CapacityGuard, StoreError> {
        self.lock_capacity_key(0).await
    }

    /// [`Store::lock_capacity`] of one site: starts on different sites do not wait for each
    /// other, two on one site do. The site `default` (a deployment without a sites file)
    /// takes the very lock [`Store::lock_capacity`] takes.
    pub async fn lock_capacity_of_site(
        &self,
        site: &ttlab_model::SiteName,
    ) -> Result<CapacityGuard, StoreError> {
        self.lock_capacity_key(site_lock_key(site)).await
    }

    async fn lock_capacity_key(&self, key: i32) -> Result<CapacityGuard, StoreError> {
        let (class, key) = lock_key(LockKind::Capacity, key);
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
        // Bounded: behind a holder that vanished (or a slow one), a start is told to try again
        // rather than left waiting for the connection's end.
        let within = self.url().timeouts().capacity_lock;
        guard
            .client()
            .batch_execute(&format!(
                "SET LOCAL lock_timeout = {}",
                crate::net::millis(within)
            ))
            .await
            .map_err(StoreError::query("bounding the capacity lock wait"))?;
        match guard
            .client()
            .execute("SELECT pg_advisory_xact_lock($1, $2)", &[&class, &key])
            .await
        {
            Ok(_) => Ok(guard),
            Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
                Err(StoreError::Busy {
                    what: "the capacity lock (another start is counting capacity)",
                    waited: within,
                })
            }
            Err(e) => Err(StoreError::query("taking the capacity lock")(e)),
        }
    }
}

impl LeaderLock {
    /// The environment this lock makes us the reaper of.
    pub fn env(&self) -> &EnvName {
        &self.env
    }

    /// Who holds the lease: after the lock was lost with the database away, the lease row
    /// still names this holder until it expires, and only this holder may release it early
    /// ([`Leases::release`](crate::Leases::release)).
    pub fn holder(&self) -> &crate::LeaseHolder {
        self.lease.holder()
    }

    /// Confirms the lease is still ours to act on, from the local clock alone (no query, so a
    /// dead connection cannot make this wait). A reaper checks this before each cycle and
    /// stops acting when it fails ([`StoreError::LockLost`]).
    pub async fn check(&self) -> Result<(), StoreError> {
        if self.lease.is_held() {
            Ok(())
        } else {
            Err(StoreError::LockLost {
                what: "reaper leader",
                target: self.target.clone(),
            })
        }
    }

    /// Resolves once the lease is lost (a renewal refused, or none got through in time).
    pub async fn lost(&self) {
        self.lease.lost().await;
    }

    /// Releases the lease now (dropping the value releases it too, in the background).
    pub async fn release(self) -> Result<(), StoreError> {
        self.lease.release().await.map(|_| ())
    }
}

/// How long the leases of this store last unless renewed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseTtls {
    /// The reaper leader's lease (default 10 s): a standby takes over at most this long
    /// (plus its one-second retry) after the leader stopped renewing.
    pub leader: Duration,
    /// A session's provisioning lease (default 10 s): another server may adopt the session
    /// this long after its provisioner stopped renewing.
    pub provisioning: Duration,
}

impl Default for LeaseTtls {
    fn default() -> Self {
        Self {
            leader: Duration::from_secs(10),
            provisioning: Duration::from_secs(10),
        }
    }
}

/// The right to provision one session: a [lease](crate::leases) of kind `provisioning` keyed
/// by the session id, held by the server process driving the session's provisioning and
/// renewed on a heartbeat. A server that finds a `starting` session whose lease nobody holds
/// knows its provisioner is gone (stopped, or cut off for longer than the lease) and may
/// adopt it. Dropping the value stops the heartbeat and releases the lease.
pub struct ProvisioningLock {
    lease: HeldLease,
}

impl std::fmt::Debug for ProvisioningLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProvisioningLock")
            .field("session", &self.lease.key())
            .field("holder", self.lease.holder())
            .finish()
    }
}

impl ProvisioningLock {
    /// Whether it is still ours to act on (local clock only).
    pub fn is_held(&self) -> bool {
        self.lease.is_held()
    }

    /// Resolves once the lease is lost: the provisioner must stop creating objects.
    pub async fn lost(&self) {
        self.lease.lost().await;
    }

    /// Releases the lease now, so another server may adopt the session at once.
    pub async fn release(self) -> Result<(), StoreError> {
        self.lease.release().await.map(|_| ())
    }
}

/// How often a waiter looks whether a provisioning lease became free.
const LEASE_POLL: Duration = Duration::from_millis(50);

impl Store {
    /// Tries to take the provisioning lease of session `id`, without waiting. `None` means
    /// another process holds it.
    pub async fn try_provisioning_lock(
        &self,
        id: ttlab_model::SessionId,
    ) -> Result<Option<ProvisioningLock>, StoreError> {
        let lease = self
            .leases()
            .hold(
                LeaseKind::Provisioning,
                &id.to_string(),
                self.lease_ttls().provisioning,
            )
            .await?;
        Ok(lease.map(|lease| ProvisioningLock { lease }))
    }

    /// Takes the provisioning lease of session `id`, waiting up to `within` for whoever holds
    /// it to let go (or for it to expire). `None` means it was still held when the time was
    /// up. Used by whoever ends a session that was `starting`: once it holds the lease, no
    /// provisioner is creating objects for the session any more, so what it deletes stays
    /// deleted.
    pub async fn wait_provisioning_lock(
        &self,
        id: ttlab_model::SessionId,
        within: Duration,
    ) -> Result<Option<ProvisioningLock>, StoreError> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(lock) = self.try_provisioning_lock(id).await? {
                return Ok(Some(lock));
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(LEASE_POLL.min(deadline - now)).await;
        }
    }

    /// Whether some process holds the provisioning lease of session `id` (a provisioner is
    /// still running for it). The reaper leaves such a session to its provisioner, which ends
    /// it once it notices the session is no longer `starting`.
    pub async fn provisioning_in_progress(
        &self,
        id: ttlab_model::SessionId,
    ) -> Result<bool, StoreError> {
        Ok(self
            .leases()
            .current(LeaseKind::Provisioning, &id.to_string())
            .await?
            .is_some())
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
                    Some(open) => Err(sessions::exists_error(&new.user, open)),
                    // The other session ended in the meantime: the caller may simply retry.
                    None => Err(StoreError::Conflict {
                        what: "another session of this user ended while this one was opened",
                    }),
                }
            }
            Err(sessions::InsertError::Other(e)) => Err(e),
        }
    }

    /// Opens a warm-pool member (held by no user) and commits, releasing the lock: members
    /// count against the same capacity as sessions.
    pub async fn insert_pool_member(mut self, new: &NewPoolMember) -> Result<Session, StoreError> {
        match sessions::insert_member_on(self.client(), new).await {
            Ok(session) => {
                self.client()
                    .batch_execute("COMMIT")
                    .await
                    .map_err(StoreError::query("committing the new pool member"))?;
                self.return_to_pool();
                Ok(session)
            }
            Err(e) => {
                self.rollback_in_place().await?;
                Err(e)
            }
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

#[cfg(test)]
mod tests {
    use super::site_lock_key;

    #[test]
    fn the_default_site_shares_todays_capacity_lock_and_other_sites_have_their_own() {
        let key = |name: &str| site_lock_key(&name.parse().unwrap());
        assert_eq!(key("default"), 0);
        assert_ne!(key("campus-a"), 0);
        assert_ne!(key("campus-a"), key("campus-b"));
        assert_eq!(key("campus-a"), key("campus-a"));
    }
}
