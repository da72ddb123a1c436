//! kube-sim's integration tests through real clients (kube-rs, kubectl, raw HTTP), one module
//! per area, in one test binary. The real qemu guest test is a binary of its own
//! (`real_guest.rs`): it boots a guest for minutes and is kept apart from the rest. Run one
//! area with `cargo test -p ttlab-kube-sim --test suite quota::`.

mod agent;
mod api;
mod clients;
mod exec;
mod identity;
mod kubevirt;
mod metadata;
#[path = "../../../envtest/tests/shared/parity.rs"]
mod parity;
mod quota;
mod support;
mod watch;
