//! Embedded schema migrations (`migrations/V*__*.sql`), applied under an advisory lock so that
//! several processes starting at once (server replicas, the reaper, `ttlabctl migrate`) take
//! turns: the first applies, the others find nothing left to do.

use crate::locks::{LockKind, lock_key};
use crate::{DbUrl, Store, StoreError};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// The newest schema version this build knows (the highest `V<n>` migration).
pub const SCHEMA_VERSION: i64 = 18;

/// What a migration run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationReport {
    /// The migrations applied by this run, oldest first (`V1__initial_schema`); empty when the
    /// schema was already up to date.
    pub applied: Vec<String>,
    /// The schema version after the run.
    pub version: i64,
}

impl Store {
    /// Applies every embedded migration not yet applied. Idempotent, and safe to run from
    /// several processes at once.
    pub async fn migrate(&self) -> Result<MigrationReport, StoreError> {
        migrate_url(self.url()).await
    }
}

/// How long a migration (a statement, a wait for the migration lock another process holds,
/// a silence of the server) may take: an index build on a large table is slow, and a replica
/// starting beside another one waits for its migrations. Bounded all the same.
const MIGRATION_BOUND: std::time::Duration = std::time::Duration::from_secs(30 * 60);

/// Applies the migrations on a dedicated connection (not from a pool) to `url`.
pub(crate) async fn migrate_url(url: &DbUrl) -> Result<MigrationReport, StoreError> {
    let url = &url.clone().with_timeouts(crate::Timeouts {
        call: MIGRATION_BOUND + std::time::Duration::from_secs(60),
        statement: MIGRATION_BOUND,
        lock: MIGRATION_BOUND,
        ..url.timeouts().clone()
    });
    let mut client = url.connect().await?;
    let (class, key) = lock_key(LockKind::Migrate, 0);
    client
        .execute("SELECT pg_advisory_lock($1, $2)", &[&class, &key])
        .await
        .map_err(StoreError::query("waiting for the migration lock"))?;
    let result = embedded::migrations::runner()
        .run_async(&mut client)
        .await
        .map_err(|e| StoreError::Migration {
            target: url.target().to_owned(),
            reason: migration_reason(&e),
        });
    // The lock is released with the session anyway; unlock explicitly to be quick about it.
    let _ = client
        .execute("SELECT pg_advisory_unlock($1, $2)", &[&class, &key])
        .await;
    let report = result?;
    Ok(MigrationReport {
        applied: report
            .applied_migrations()
            .iter()
            .map(ToString::to_string)
            .collect(),
        version: SCHEMA_VERSION,
    })
}

fn migration_reason(e: &refinery::Error) -> String {
    use std::error::Error as _;
    if let refinery::error::Kind::Connection(msg, source) = e.kind()
        && let Some(pg) = source.downcast_ref::<tokio_postgres::Error>()
    {
        return format!("{msg}: {}", crate::error::pg_reason(pg));
    }
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cur = inner.source();
    }
    crate::error::one_line(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_version_is_the_newest_embedded_migration() {
        let newest = embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| i64::from(m.version()))
            .max();
        assert_eq!(newest, Some(SCHEMA_VERSION));
    }
}
