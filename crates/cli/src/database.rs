//! The database group: `--database-url` and the bounds on waiting for PostgreSQL
//! (docs/postgres.md).

use std::time::Duration;

use ttlab_store::{Store, StoreError, StoreOptions, Timeouts};

/// Where the ttlab database is, and how long to wait for it.
#[derive(Debug, Clone, clap::Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://ttlab:PASSWORD@127.0.0.1:5432/ttlab (its value is
    /// never shown by --help).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: String,
    /// PostgreSQL cancels a statement running longer (`statement_timeout`).
    #[arg(long, env = "TTLAB_DB_STATEMENT_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub db_statement_timeout: Duration,
    /// PostgreSQL gives up waiting for a lock this long (`lock_timeout`).
    #[arg(long, env = "TTLAB_DB_LOCK_TIMEOUT", default_value = "10s", value_parser = humantime::parse_duration)]
    pub db_lock_timeout: Duration,
    /// A request that gets no byte of answer for this long fails and its connection is given
    /// up (half-open connections, stalled servers).
    #[arg(long, env = "TTLAB_DB_CALL_TIMEOUT", default_value = "40s", value_parser = humantime::parse_duration)]
    pub db_call_timeout: Duration,
}

impl DatabaseArgs {
    /// The store's timeouts with these bounds, the others at their defaults.
    pub fn timeouts(&self) -> Timeouts {
        Timeouts {
            statement: self.db_statement_timeout,
            lock: self.db_lock_timeout,
            call: self.db_call_timeout,
            ..Timeouts::default()
        }
    }

    /// The store's default options with these timeouts; a binary sets its own on top
    /// (`StoreOptions { max_connections: …, ..db.store_options() }`).
    pub fn store_options(&self) -> StoreOptions {
        StoreOptions {
            timeouts: self.timeouts(),
            ..StoreOptions::default()
        }
    }

    /// Connects to the database with `options` (one connection is opened to check the URL,
    /// the server and the credentials).
    pub async fn connect(&self, options: StoreOptions) -> Result<Store, StoreError> {
        Store::connect(&self.database_url, options).await
    }

    /// Builds the pool without connecting (a wrong URL still fails here): connections open on
    /// first use, so a process that starts before its database answers keeps trying instead
    /// of exiting.
    pub fn open(&self, options: StoreOptions) -> Result<Store, StoreError> {
        Store::open(ttlab_store::DbUrl::parse(&self.database_url)?, options)
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(Debug, clap::Parser)]
    struct Args {
        #[command(flatten)]
        db: DatabaseArgs,
    }

    #[test]
    fn the_defaults_are_the_stores_and_each_bound_can_be_set() {
        let args = Args::try_parse_from(["x", "--database-url", "postgres://h/db"]).unwrap();
        let defaults = Timeouts::default();
        let t = args.db.timeouts();
        assert_eq!(
            (t.statement, t.lock, t.call),
            (defaults.statement, defaults.lock, defaults.call)
        );
        let args = Args::try_parse_from([
            "x",
            "--database-url",
            "postgres://h/db",
            "--db-statement-timeout",
            "5s",
            "--db-lock-timeout",
            "2s",
            "--db-call-timeout",
            "1m",
        ])
        .unwrap();
        let t = args.db.timeouts();
        assert_eq!(
            (t.statement, t.lock, t.call),
            (
                Duration::from_secs(5),
                Duration::from_secs(2),
                Duration::from_secs(60)
            )
        );
        let bad = Args::try_parse_from([
            "x",
            "--database-url",
            "postgres://h/db",
            "--db-lock-timeout",
            "soon",
        ])
        .unwrap_err()
        .to_string();
        assert!(bad.contains("--db-lock-timeout"), "{bad}");
    }

    #[test]
    fn the_database_url_is_marked_secret_in_the_help() {
        // Its value comes from the environment in production: --help must not print it
        // (the binaries' tests check the printed help with a password in DATABASE_URL).
        let command = <Args as clap::CommandFactory>::command();
        let url = command
            .get_arguments()
            .find(|a| a.get_id() == "database_url")
            .unwrap();
        assert!(url.is_hide_env_values_set());
        assert_eq!(url.get_env().and_then(|e| e.to_str()), Some("DATABASE_URL"));
    }
}
