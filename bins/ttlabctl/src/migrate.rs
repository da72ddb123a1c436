//! `ttlabctl migrate`: applies the embedded schema migrations to the database. Idempotent, and
//! safe while servers or reapers migrate the same database at the same moment.

use clap::Args;

use ttlab_cli::DatabaseArgs;

/// Arguments of `ttlabctl migrate`.
#[derive(Debug, Clone, Args)]
pub struct MigrateArgs {
    #[command(flatten)]
    db: DatabaseArgs,
}

/// Applies the migrations and says what was done.
pub async fn run(args: MigrateArgs) -> anyhow::Result<()> {
    let store = args.db.connect(args.db.store_options()).await?;
    let report = store.migrate().await?;
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
