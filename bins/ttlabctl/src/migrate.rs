//! `ttlabctl migrate`: applies the embedded schema migrations to the database. Idempotent, and
//! safe while servers or reapers migrate the same database at the same moment. With `--wait`
//! it waits for a database that does not answer yet (the pods' migrate init container does:
//! an init container that fails is restarted with a growing back-off, which would keep the
//! pod away long after the database returned).

use std::time::{Duration, Instant};

use clap::Args;

use ttlab_background::Backoff;
use ttlab_cli::DatabaseArgs;
use ttlab_store::{MigrationReport, Store, StoreError};

/// Arguments of `ttlabctl migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    db: DatabaseArgs,
    /// How long to keep trying while the database does not answer (e.g. 1h), trying again
    /// at most 2 s apart; 0s tries once. A database that refuses the connection (its
    /// certificate, the credentials, the database name) fails at once.
    #[arg(long, env = "TTLAB_MIGRATE_WAIT", default_value = "0s", value_parser = humantime::parse_duration)]
    wait: Duration,
}

/// The pauses between attempts while the database does not answer.
const RETRY: Backoff = Backoff::doubling(Duration::from_millis(100), Duration::from_secs(2));

/// Connects and migrates once.
async fn attempt(args: &MigrateArgs) -> Result<(Store, MigrationReport), StoreError> {
    let store = args.db.connect(args.db.store_options()).await?;
    let report = store.migrate().await?;
    Ok((store, report))
}

/// Applies the migrations and says what was done.
pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    let began = Instant::now();
    let mut pauses = RETRY.pauses();
    let mut announced = false;
    let (store, report) = loop {
        match attempt(&args).await {
            Ok(done) => break done,
            Err(e) if !e.is_rejection() && began.elapsed() < args.wait => {
                if !announced {
                    eprintln!("ttlabctl migrate: waiting for the database: {e}");
                    announced = true;
                }
                tokio::time::sleep(pauses.next_pause()).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    if report.applied.is_empty() {
        println!(
            "schema of {} is up to date (version {})",
            store.target(),
            report.version
        );
    } else {
        println!(
            "applied {} migration(s) to {}: {}; schema now at version {}",
            report.applied.len(),
            store.target(),
            report.applied.join(", "),
            report.version
        );
    }
    store.close();
    Ok(())
}
