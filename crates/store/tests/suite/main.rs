//! The store crate's integration tests, one module per table or concern, in one test binary:
//! each test gets a fresh database on a throwaway PostgreSQL cluster (or on `DATABASE_URL`'s
//! server). Run one area with `cargo test -p ttlab-store --test suite sessions::`.

mod admin_actions;
mod agent_tokens;
mod classes;
mod collect;
mod common;
mod console_connections;
mod console_tickets;
mod ephemeral;
mod grading_results;
mod leases;
mod migrate;
mod pools;
mod schema;
mod sessions;
mod tls;
mod waitlist;
