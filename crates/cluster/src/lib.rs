//! The `Cluster` trait and its kube-rs implementation: the only code that talks to Kubernetes.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
