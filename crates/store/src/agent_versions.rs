//! The `agent_versions` table: which agent versions (their shared ConfigMaps) servers run,
//! and when each was last seen.
//!
//! The server calls [`AgentVersions::seen`] at start-up, on a heartbeat while it runs, and
//! before each check that its ConfigMap exists. The reaper removes an unreferenced version
//! only through [`AgentVersions::lock_for_removal`], which takes the same per-ConfigMap
//! advisory lock as `seen` and answers `None` while any server (of any environment: one
//! ConfigMap name may serve several environments sharing a namespace) saw it within the
//! minimum age. The lock is held while the reaper deletes the ConfigMap, so a server that is
//! about to create a VM for that version has either recorded its sighting first — and the
//! reaper keeps the version — or waits, then finds the ConfigMap gone and creates it again.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ttlab_model::EnvName;

use crate::{Store, StoreError};

/// The advisory lock class of an agent version: `0x7474_0000 | 4`, after the kinds of
/// `crate::locks` (1 migrate, 3 capacity).
const LOCK_CLASS: i32 = 0x7474_0004;

/// Queries on `agent_versions`, from [`Store::agent_versions`].
#[derive(Debug, Clone, Copy)]
pub struct AgentVersions<'a> {
    store: &'a Store,
}

/// One recorded version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentVersion {
    /// The environment of the server that runs it.
    pub env: EnvName,
    /// The ConfigMap's name.
    pub config_map: String,
    /// The binary's sha256 (hex).
    pub sha256: String,
    /// When a server of that environment first recorded it.
    pub first_seen_at: DateTime<Utc>,
    /// When a server of that environment last recorded it.
    pub last_seen_at: DateTime<Utc>,
}

/// The lock key of a ConfigMap name (a stable 31-bit hash of it).
fn key_of(config_map: &str) -> (i32, i32) {
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let mut h: u32 = 0x811c_9dc5;
    for b in config_map.bytes() {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (LOCK_CLASS, (h & 0x7fff_ffff) as i32)
}

impl Store {
    /// Queries on `agent_versions`.
    pub fn agent_versions(&self) -> AgentVersions<'_> {
        AgentVersions { store: self }
    }
}

impl<'a> AgentVersions<'a> {
    /// Records that a server of `env` runs the agent of `config_map` (digest `sha256`) now,
    /// under the ConfigMap's lock: waits while a reaper is removing it.
    pub async fn seen(
        &self,
        env: &EnvName,
        config_map: &str,
        sha256: &str,
    ) -> Result<(), StoreError> {
        const SQL: &str = "INSERT INTO agent_versions (env, config_map, sha256) \
             VALUES ($1, $2, $3) \
             ON CONFLICT (env, config_map) DO UPDATE \
             SET last_seen_at = now(), sha256 = EXCLUDED.sha256";
        let (class, key) = key_of(config_map);
        let mut client = self.store.client().await?;
        let tx = client
            .transaction()
            .await
            .map_err(StoreError::query("beginning to record the agent version"))?;
        tx.execute("SELECT pg_advisory_xact_lock($1, $2)", &[&class, &key])
            .await
            .map_err(StoreError::query("taking the agent version lock"))?;
        tx.execute(SQL, &[&env.as_str(), &config_map, &sha256])
            .await
            .map_err(StoreError::query("recording the agent version"))?;
        tx.commit()
            .await
            .map_err(StoreError::query("committing the agent version"))
    }

    /// Every version recorded for `env`, by ConfigMap name.
    pub async fn list(&self, env: &EnvName) -> Result<Vec<AgentVersion>, StoreError> {
        let client = self.store.client().await?;
        let rows = client
            .query(
                "SELECT env, config_map, sha256, first_seen_at, last_seen_at \
                 FROM agent_versions WHERE env = $1 ORDER BY config_map",
                &[&env.as_str()],
            )
            .await
            .map_err(StoreError::query("listing the agent versions"))?;
        rows.iter()
            .map(|r| {
                Ok(AgentVersion {
                    env: r
                        .get::<_, String>(0)
                        .parse()
                        .map_err(|_| StoreError::InvalidArgument("a stored environment name"))?,
                    config_map: r.get(1),
                    sha256: r.get(2),
                    first_seen_at: r.get(3),
                    last_seen_at: r.get(4),
                })
            })
            .collect()
    }

    /// Takes the lock of `config_map` in a new transaction and checks that no server of any
    /// environment has seen it within `min_age` (database clock). `None` (lock released) if
    /// one has. Otherwise the guard holds the lock: delete the ConfigMap, then
    /// [`RemovalGuard::forget`] (which drops its rows and commits) — or drop the guard to
    /// release the lock without forgetting.
    pub async fn lock_for_removal(
        &self,
        config_map: &str,
        min_age: Duration,
    ) -> Result<Option<RemovalGuard>, StoreError> {
        let (class, key) = key_of(config_map);
        let mut guard = RemovalGuard {
            client: Some(self.store.client().await?),
            config_map: config_map.to_owned(),
        };
        let client = guard.client();
        client
            .batch_execute("BEGIN")
            .await
            .map_err(StoreError::query("beginning the agent version removal"))?;
        client
            .execute("SELECT pg_advisory_xact_lock($1, $2)", &[&class, &key])
            .await
            .map_err(StoreError::query("taking the agent version lock"))?;
        let secs = min_age.as_secs_f64();
        let recent = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM agent_versions WHERE config_map = $1 \
                 AND last_seen_at > now() - make_interval(secs => $2))",
                &[&config_map, &secs],
            )
            .await
            .map_err(StoreError::query(
                "reading when the agent version was last seen",
            ))?
            .get::<_, bool>(0);
        if recent {
            guard.rollback().await?;
            return Ok(None);
        }
        Ok(Some(guard))
    }
}

/// The lock of one agent version held for its removal (see
/// [`AgentVersions::lock_for_removal`]). Dropping it rolls back and releases the lock.
pub struct RemovalGuard {
    client: Option<deadpool_postgres::Object>,
    config_map: String,
}

impl std::fmt::Debug for RemovalGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemovalGuard")
            .field("config_map", &self.config_map)
            .finish()
    }
}

impl RemovalGuard {
    fn client(&mut self) -> &deadpool_postgres::Object {
        self.client
            .as_ref()
            .expect("the client is only taken by methods consuming the guard")
    }

    /// Forgets the version (its ConfigMap was deleted) and commits, releasing the lock.
    pub async fn forget(mut self) -> Result<(), StoreError> {
        let name = self.config_map.clone();
        let client = self.client();
        client
            .execute("DELETE FROM agent_versions WHERE config_map = $1", &[&name])
            .await
            .map_err(StoreError::query("forgetting the agent version"))?;
        client
            .batch_execute("COMMIT")
            .await
            .map_err(StoreError::query("committing the agent version removal"))?;
        drop(self.client.take());
        Ok(())
    }

    async fn rollback(mut self) -> Result<(), StoreError> {
        self.client()
            .batch_execute("ROLLBACK")
            .await
            .map_err(StoreError::query("releasing the agent version lock"))?;
        drop(self.client.take());
        Ok(())
    }
}

impl Drop for RemovalGuard {
    fn drop(&mut self) {
        // Still inside the transaction: close the connection rather than pool it, so the
        // server rolls back and releases the lock.
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::testing::TestDb;

    #[tokio::test]
    async fn a_version_seen_recently_cannot_be_locked_for_removal_and_a_removal_blocks_a_sighting()
    {
        let db = TestDb::new().await.expect("test database");
        let store = db.store().await.unwrap();
        let dev = "dev".parse().unwrap();
        let versions = store.agent_versions();
        versions.seen(&dev, "ttlab-agent-aaaa", "aa").await.unwrap();
        versions.seen(&dev, "ttlab-agent-aaaa", "aa").await.unwrap();
        assert_eq!(versions.list(&dev).await.unwrap().len(), 1);
        assert!(
            versions
                .lock_for_removal("ttlab-agent-aaaa", Duration::from_secs(3600))
                .await
                .unwrap()
                .is_none(),
            "seen just now"
        );
        // Never seen: removable. While the reaper holds the lock, a server's sighting waits.
        let guard = versions
            .lock_for_removal("ttlab-agent-bbbb", Duration::from_secs(3600))
            .await
            .unwrap()
            .expect("never seen");
        let store2 = store.clone();
        let sighting = tokio::spawn(async move {
            store2
                .agent_versions()
                .seen(&"prod".parse().unwrap(), "ttlab-agent-bbbb", "bb")
                .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            !sighting.is_finished(),
            "the sighting waits for the removal"
        );
        guard.forget().await.unwrap();
        sighting.await.unwrap().unwrap();
        // Recorded after the removal: the next reaper keeps it.
        assert!(
            versions
                .lock_for_removal("ttlab-agent-bbbb", Duration::from_secs(3600))
                .await
                .unwrap()
                .is_none()
        );
        // With no minimum age, anything may go.
        let guard = versions
            .lock_for_removal("ttlab-agent-aaaa", Duration::ZERO)
            .await
            .unwrap()
            .expect("no minimum age");
        guard.forget().await.unwrap();
        assert!(versions.list(&dev).await.unwrap().is_empty());
    }
}
