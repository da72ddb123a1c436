//! A Kubernetes-API-compatible HTTP server with a simulated KubeVirt, for tests, benchmarks and the demo.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
