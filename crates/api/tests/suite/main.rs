//! The API crate's integration tests, one module per area, in one test binary (one link
//! instead of one per file): each test starts its own PostgreSQL database and kube-sim, and
//! serves the real router on a loopback port. Run one area with
//! `cargo test -p ttlab-api --test suite pools::`.

mod api;
mod capacity_lock;
mod classes;
mod console;
mod database_restart;
mod gone;
mod handover;
mod lost_answers;
mod metrics;
mod operator_actions;
mod pods;
mod pools;
mod provisioning;
mod resilience;
mod security;
mod sites;
mod support;
mod tasks;
mod tokens;
mod waitlist;
