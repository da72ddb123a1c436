//! Postgres store: schema, migrations, queries per table and LISTEN/NOTIFY channels; the only channel between server and reaper.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
