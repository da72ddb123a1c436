//! The PostgreSQL store: the schema (embedded migrations), the queries — one module per table —
//! the LISTEN/NOTIFY channels, the [warm pools](pools) and [scheduled classes](classes), the
//! [leases] (the reaper's leadership, a server's provisioning of a session) and the
//! transaction-scoped locks through which the server and the reaper talk. It is the only
//! channel between them, and the only crate that holds SQL.
//! Every connection it opens is bounded (keepalives, `TCP_USER_TIMEOUT`, statement, lock and
//! idle-in-transaction timeouts, and a client-side watchdog on every request: [`Timeouts`])
//! and speaks TLS as `sslmode` in the URL says ([`SslMode`]).
//!
//! It owns persistence and nothing else: it never decides *when* a session expires (that is
//! `ttlab-lifespan`, fed with [`Store::db_now`] and a row's [`Session::lifespan`]), never
//! talks to Kubernetes, and refuses any status change the model's state machine
//! ([`SessionStatus::can_become`]) forbids — such a request fails before a statement is sent. Status changes are conditional and report whether
//! they applied, so two writers racing for the same row can both retry safely.
//!
//! Test support sits behind the `test-support` feature, which no shipped binary enables:
//! `ephemeral` starts throwaway PostgreSQL clusters from the machine's server binaries (for
//! tests and ttlabctl's demo, benchmarks and soak), and `testing::TestDb` gives each test a
//! fresh, migrated database. A crate whose tests use them enables the feature in its
//! dev-dependencies: `ttlab-store = { workspace = true, features = ["test-support"] }`.
//!
//! ```no_run
//! # async fn example() -> Result<(), ttlab_store::StoreError> {
//! use ttlab_store::{Store, StoreOptions};
//!
//! let store = Store::connect("postgres://ttlab:secret@127.0.0.1:5432/ttlab", StoreOptions::default()).await?;
//! store.migrate().await?;
//! let now = store.db_now().await?;
//! let env = "dev".parse().unwrap();
//! let due = store.sessions().list_expired(&env, now, 100).await?;
//! # let _ = due; Ok(()) }
//! ```
//!
//! Errors never show a password and always fit on one line:
//!
//! ```
//! let err = ttlab_store::DbUrl::parse("postgres://ttlab:hunter2@127.0.0.1:notaport/ttlab").unwrap_err();
//! assert!(err.to_string().starts_with("invalid database URL postgres://ttlab:***@127.0.0.1:notaport/ttlab"));
//! ```
//!
//! [`SessionStatus::can_become`]: ttlab_model::SessionStatus::can_become

pub mod admin_actions;
pub mod agent_tokens;
pub mod agent_versions;
pub mod classes;
pub mod collect_requests;
pub mod console_connections;
pub mod console_tickets;
#[cfg(feature = "test-support")]
pub mod ephemeral;
mod error;
pub mod grading_results;
pub mod leases;
pub mod locks;
mod migrate;
mod net;
pub mod notify;
pub mod pools;
pub mod reaper_cycles;
mod rows;
pub mod sessions;
#[cfg(feature = "test-support")]
pub mod testing;
mod url;
pub mod waitlist;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::{Manager, ManagerConfig, Pool, PoolError, RecyclingMethod, Runtime};

pub use admin_actions::{AdminAction, AdminActionKind, AdminActions};
pub use agent_tokens::AgentTokens;
pub use agent_versions::{AgentVersion, AgentVersions, RemovalGuard};
pub use classes::{
    CLASS_SEATS_CAP, CLASS_WINDOW_CAP, Class, ClassChange, ClassCounts, Classes, NewClass,
};
pub use collect_requests::{CollectRequest, CollectRequestId, CollectRequests};
pub use console_connections::{ConsoleClosedWhy, ConsoleConnection, ConsoleConnections};
pub use console_tickets::{ConsoleTicket, ConsoleTickets, TicketDigest};
pub use error::StoreError;
pub use grading_results::{GradingResult, GradingResults};
pub use leases::{HeldLease, Lease, LeaseHolder, LeaseKind, Leases};
pub use locks::{CapacityGuard, LeaderLock, LeaseTtls, ProvisioningLock};
pub use migrate::{MigrationReport, SCHEMA_VERSION};
pub use net::{SslMode, Timeouts};
pub use notify::{Channel, ConsoleTaken, Listener, Notification};
pub use pools::{
    EVENT_RETENTION, LessonPool, POOL_SIZE_CAP, PoolCounts, PoolSettings, Pools, RecentStarts,
};
pub use reaper_cycles::{
    CycleError, CycleId, CycleTrigger, Direction, DirectionCount, NewCycle, ReaperCycle,
    ReaperCycles,
};
pub use sessions::{
    CLAIM_MARGIN, DiskKind, NewPoolMember, NewSession, PoolClaim, Session, SessionTimes, SessionVm,
    Sessions, Stage, TerminatingSession,
};
pub use url::{DEFAULT_CONNECT_TIMEOUT, DbUrl, redact};
pub use waitlist::{GrantReport, Joined, Reservations, Waitlist, WaitlistEntry};

/// Pool settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Most connections the pool opens (default 16); leases have [`LEASE_CONNECTIONS`] more
    /// of their own.
    pub max_connections: usize,
    /// How long a caller waits for a free connection before failing (default 10 s).
    pub acquire_timeout: Duration,
    /// Every other bound on waiting for the server (statement, lock, idle-in-transaction and
    /// call timeouts, keepalives): see [`Timeouts`].
    pub timeouts: Timeouts,
    /// How long the reaper leader's and provisioners' leases last unless renewed.
    pub leases: LeaseTtls,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            max_connections: 16,
            acquire_timeout: Duration::from_secs(10),
            timeouts: Timeouts::default(),
            leases: LeaseTtls::default(),
        }
    }
}

/// Connections of the pool that only takes, renews and releases leases (besides
/// [`StoreOptions::max_connections`]).
pub const LEASE_CONNECTIONS: usize = 2;

/// A handle on the database: a connection pool plus the URL it came from. Cheap to clone.
///
/// Leases are taken, renewed and released on a small pool of their own
/// ([`LEASE_CONNECTIONS`]): a main pool exhausted by slow statements or lock waits never holds
/// up a renewal, so a busy process keeps the leases it holds instead of losing them to a
/// standby for want of a connection.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    lease_pool: Pool,
    url: Arc<DbUrl>,
    lease_ttls: LeaseTtls,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("target", &self.url.target())
            .finish()
    }
}

impl Store {
    /// Parses `url`, builds the pool and opens one connection, so a wrong URL, an unreachable
    /// server or a bad password fails here with a one-line message naming host and database.
    pub async fn connect(url: &str, options: StoreOptions) -> Result<Self, StoreError> {
        let store = Self::open(DbUrl::parse(url)?, options)?;
        store.ping().await?;
        Ok(store)
    }

    /// Builds the pool without connecting; connections open on first use.
    pub fn open(url: DbUrl, options: StoreOptions) -> Result<Self, StoreError> {
        if options.max_connections == 0 {
            return Err(StoreError::InvalidArgument(
                "max_connections must be at least 1",
            ));
        }
        options.timeouts.validate()?;
        let url = url.with_timeouts(options.timeouts.clone());
        Ok(Self {
            pool: build_pool(&url, options.max_connections, options.acquire_timeout)?,
            lease_pool: build_pool(&url, LEASE_CONNECTIONS, options.acquire_timeout)?,
            url: Arc::new(url),
            lease_ttls: options.leases,
        })
    }

    /// `host:port/database` of the server, for messages and logs.
    pub fn target(&self) -> &str {
        self.url.target()
    }

    /// How long this store's leases last unless renewed.
    pub fn lease_ttls(&self) -> LeaseTtls {
        self.lease_ttls
    }

    /// The URL the store was opened with.
    pub fn url(&self) -> &DbUrl {
        &self.url
    }

    /// Checks a connection can be had and the server answers.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .simple_query("SELECT 1")
            .await
            .map_err(StoreError::query("ping"))?;
        Ok(())
    }

    /// The database clock. Every comparison against "now" in the running system uses this, so
    /// server replicas and the reaper agree whatever their own clocks say.
    pub async fn db_now(&self) -> Result<DateTime<Utc>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT now()", &[])
            .await
            .map_err(StoreError::query("reading the database clock"))?;
        row.try_get(0)
            .map_err(StoreError::query("reading the database clock"))
    }

    /// The settings this store's connections run with (`statement_timeout`, `lock_timeout`,
    /// `idle_in_transaction_session_timeout`, `plan_cache_mode`), as the server reports them
    /// for a pooled connection: what an operator checks behind a pooler.
    pub async fn session_settings(&self) -> Result<Vec<(String, String)>, StoreError> {
        const WHAT: &str = "reading the session settings";
        let client = self.client().await?;
        let mut out = Vec::new();
        for name in [
            "statement_timeout",
            "lock_timeout",
            "idle_in_transaction_session_timeout",
            "plan_cache_mode",
        ] {
            let row = client
                .query_one("SELECT current_setting($1)", &[&name])
                .await
                .map_err(StoreError::query(WHAT))?;
            out.push((
                name.to_owned(),
                row.try_get(0).map_err(StoreError::query(WHAT))?,
            ));
        }
        Ok(out)
    }

    /// Queries on the `sessions` table.
    pub fn sessions(&self) -> Sessions<'_> {
        Sessions::new(self)
    }

    /// Warm pools: settings overrides, counts and history, recent starts.
    pub fn pools(&self) -> Pools<'_> {
        Pools::new(self)
    }

    /// Scheduled classes: the `classes` table, their members and students, a lesson's
    /// measured preparation times.
    pub fn classes(&self) -> Classes<'_> {
        Classes::new(self)
    }

    /// Queries on the `admin_actions` table (the operators' audit trail).
    pub fn admin_actions(&self) -> AdminActions<'_> {
        AdminActions::new(self)
    }

    /// Queries on the `grading_results` table (each session's "Check my work" history).
    pub fn grading_results(&self) -> GradingResults<'_> {
        GradingResults::new(self)
    }

    /// Queries on the `agent_tokens` table (secrets: see [`agent_tokens`]).
    pub fn agent_tokens(&self) -> AgentTokens<'_> {
        AgentTokens::new(self)
    }

    /// Queries on the `console_tickets` table (digests only: see [`console_tickets`]).
    pub fn console_tickets(&self) -> ConsoleTickets<'_> {
        ConsoleTickets::new(self)
    }

    /// Queries on the `console_connections` table (who holds each console, on which replica).
    pub fn console_connections(&self) -> ConsoleConnections<'_> {
        ConsoleConnections::new(self)
    }

    /// Queries on the `reaper_cycles` table.
    pub fn reaper_cycles(&self) -> ReaperCycles<'_> {
        ReaperCycles::new(self)
    }

    /// Queries on the `collect_requests` table.
    pub fn collect_requests(&self) -> CollectRequests<'_> {
        CollectRequests::new(self)
    }

    /// Closes the pool: idle connections are dropped, and new requests fail.
    pub fn close(&self) {
        self.pool.close();
        self.lease_pool.close();
    }

    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| self.pool_error(e))
    }

    /// [`Store::prepared`] on the leases' own pool.
    pub(crate) async fn lease_prepared(
        &self,
        what: &'static str,
        sql: &str,
    ) -> Result<(deadpool_postgres::Object, tokio_postgres::Statement), StoreError> {
        let client = self
            .lease_pool
            .get()
            .await
            .map_err(|e| self.pool_error(e))?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(StoreError::query(what))?;
        Ok((client, statement))
    }

    /// A pooled connection and `sql` prepared on it (once per connection: later calls reuse
    /// the statement, saving a round trip each).
    pub(crate) async fn prepared(
        &self,
        what: &'static str,
        sql: &str,
    ) -> Result<(deadpool_postgres::Object, tokio_postgres::Statement), StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(sql)
            .await
            .map_err(StoreError::query(what))?;
        Ok((client, statement))
    }

    fn pool_error(&self, e: PoolError) -> StoreError {
        match e {
            PoolError::Backend(e) => self.url.connect_error(&e),
            PoolError::Timeout(deadpool_postgres::TimeoutType::Wait) => StoreError::Connect {
                target: self.target().to_owned(),
                reason: "timed out waiting for a free pooled connection".into(),
                rejected: false,
            },
            PoolError::Timeout(_) => StoreError::Connect {
                target: self.target().to_owned(),
                reason: "timed out".into(),
                rejected: false,
            },
            other => StoreError::Connect {
                target: self.target().to_owned(),
                reason: error::one_line(&other.to_string()),
                rejected: false,
            },
        }
    }
}

/// A pool of at most `max` connections to `url`, waiting `acquire_timeout` for a free one.
fn build_pool(url: &DbUrl, max: usize, acquire_timeout: Duration) -> Result<Pool, StoreError> {
    let manager = Manager::from_connect(
        url.config().clone(),
        net::PoolConnect(url.clone()),
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(acquire_timeout))
        .create_timeout(Some(
            url.config()
                .get_connect_timeout()
                .copied()
                .unwrap_or(DEFAULT_CONNECT_TIMEOUT),
        ))
        .build()
        .map_err(|e| StoreError::Connect {
            target: url.target().to_owned(),
            reason: e.to_string(),
            rejected: false,
        })
}

#[cfg(test)]
mod tests {
    use std::fmt::{Debug, Display};
    use std::str::FromStr;

    use super::*;

    /// `(value, its stored name)` for every value: the name reads back as the value, and is
    /// also how it displays.
    fn names_read_back<T>(names: &[(T, &'static str)])
    where
        T: Copy + PartialEq + Debug + Display + FromStr + Into<&'static str>,
        T::Err: Debug,
    {
        for &(value, name) in names {
            assert_eq!(Into::<&'static str>::into(value), name);
            assert_eq!(value.to_string(), name);
            assert_eq!(name.parse::<T>().unwrap(), value);
        }
    }

    /// The names the store writes into its tables never change (rows written before must read
    /// back), and a name it never writes is refused with a message that names it.
    #[test]
    fn stored_names_read_back_and_unknown_ones_are_named() {
        names_read_back(&[
            (DiskKind::Golden, "golden"),
            (DiskKind::Container, "container"),
        ]);
        assert_eq!(DiskKind::ALL.len(), 2);
        names_read_back(&[
            (AdminActionKind::End, "end"),
            (AdminActionKind::Extend, "extend"),
        ]);
        names_read_back(&[
            (ConsoleClosedWhy::BrowserClosed, "browser_closed"),
            (ConsoleClosedWhy::TakenOver, "taken_over"),
            (ConsoleClosedWhy::SessionEnded, "session_ended"),
            (ConsoleClosedWhy::Lost, "lost"),
            (ConsoleClosedWhy::ReplicaGone, "replica_gone"),
        ]);
        assert_eq!(ConsoleClosedWhy::ALL.len(), 5);
        names_read_back(&[
            (CycleTrigger::Startup, "startup"),
            (CycleTrigger::Timer, "timer"),
            (CycleTrigger::Wakeup, "wakeup"),
            (CycleTrigger::Collect, "collect"),
        ]);
        assert_eq!(CycleTrigger::ALL.len(), 4);
        names_read_back(&[
            (LeaseKind::ReaperLeader, "reaper-leader"),
            (LeaseKind::Provisioning, "provisioning"),
        ]);
        assert_eq!(LeaseKind::ALL.len(), 2);
        names_read_back(&[
            (SslMode::Disable, "disable"),
            (SslMode::Prefer, "prefer"),
            (SslMode::Require, "require"),
            (SslMode::VerifyCa, "verify-ca"),
            (SslMode::VerifyFull, "verify-full"),
        ]);

        assert_eq!(
            "ceph".parse::<DiskKind>().unwrap_err().to_string(),
            "unexpected value in column disk_kind: unknown disk kind \"ceph\""
        );
        assert_eq!(
            "renew".parse::<AdminActionKind>().unwrap_err(),
            "unknown admin action \"renew\""
        );
        assert_eq!(
            "closed".parse::<ConsoleClosedWhy>().unwrap_err(),
            "unknown console close reason \"closed\""
        );
        assert_eq!(
            "cron".parse::<CycleTrigger>().unwrap_err().to_string(),
            "unexpected value in column trigger: unknown trigger \"cron\""
        );
        assert_eq!(
            "reaper_leader".parse::<LeaseKind>().unwrap_err(),
            "unknown lease kind \"reaper_leader\""
        );
    }
}
