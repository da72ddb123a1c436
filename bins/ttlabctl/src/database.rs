//! The database connection flag shared by every subcommand that needs PostgreSQL.

use clap::Args;
use ttlab_store::{Store, StoreOptions};

/// Where the ttlab database is.
#[derive(Debug, Clone, Args)]
pub struct DatabaseArgs {
    /// PostgreSQL URL, e.g. postgres://ttlab:PASSWORD@127.0.0.1:5432/ttlab.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: String,
}

impl DatabaseArgs {
    /// Connects (one connection is opened to check the URL, server and credentials).
    pub async fn connect(&self) -> anyhow::Result<Store> {
        Ok(Store::connect(&self.database_url, StoreOptions::default()).await?)
    }
}
