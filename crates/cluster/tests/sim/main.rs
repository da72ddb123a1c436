//! The kube-rs `Cluster` implementation against kube-sim, over HTTP.

mod common;
mod errors;
mod objects;
mod pods;
mod vmi;
