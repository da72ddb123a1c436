//! Developer and CI tooling, compiled only with the `dev-tools` feature (the default; the
//! production image builds `ttlabctl` without it): `sim` (kube-sim alone), `demo` (the whole
//! stack on one machine), `bench` (figures against targets), `soak` (invariants under faults
//! and chaos) and `guest-image` (the Debian image real qemu guests boot). They bring the test
//! rig (`rig/`: kube-sim, kubevirt-sim, the real control plane's harness, qemu guests) along;
//! nothing here runs in production.

pub mod bench;
pub mod demo;
pub mod guest_image;
pub mod sim;
mod sites;
pub mod soak;
