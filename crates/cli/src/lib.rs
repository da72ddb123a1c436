//! The command-line flag groups ttlab's binaries share, declared once: where the database is
//! and how long to wait for it ([`DatabaseArgs`]), which cluster and namespace to work in
//! ([`ClusterArgs`], feature `cluster`), and the sites file naming every place lab VMs run
//! ([`SitesArgs`], feature `cluster`: `TTLAB_SITES`, or the one cluster as the site `default`,
//! and [`connect_site`] for one site's client). `ttlab-server`, `ttlab-reaper` and `ttlabctl`
//! flatten them (`#[command(flatten)]`), so a flag, its variable, its default and its help
//! are the same in every binary, and `DATABASE_URL` is never printed by `--help`.
//!
//! It owns flags and their translation into the libraries' settings
//! ([`ttlab_store::StoreOptions`], `ttlab_cluster::ClusterSettings`), and nothing else: a
//! binary's own flags stay in the binary, and no library depends on this crate (so clap stays
//! out of them).
//!
//! ```
//! use clap::Parser;
//! use ttlab_cli::DatabaseArgs;
//!
//! #[derive(Parser)]
//! struct Args {
//!     #[command(flatten)]
//!     db: DatabaseArgs,
//! }
//!
//! let args = Args::parse_from(["x", "--database-url", "postgres://127.0.0.1/ttlab", "--db-lock-timeout", "3s"]);
//! let timeouts = args.db.timeouts();
//! assert_eq!(timeouts.lock, std::time::Duration::from_secs(3));
//! assert_eq!(timeouts.statement, std::time::Duration::from_secs(30));
//! ```

#[cfg(feature = "cluster")]
mod cluster;
mod database;
#[cfg(feature = "cluster")]
mod sites;

#[cfg(feature = "cluster")]
pub use cluster::ClusterArgs;
pub use database::DatabaseArgs;
#[cfg(feature = "cluster")]
pub use sites::{LoadSitesError, SitesArgs, connect_site, site_settings};
