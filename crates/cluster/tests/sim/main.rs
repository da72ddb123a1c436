//! The kube-rs `Cluster` implementation against kube-sim, over HTTP.

mod common;
mod console;
mod errors;
mod objects;
mod pods;
mod vmi;
