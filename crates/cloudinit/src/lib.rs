//! Renders the cloud-init user-data and its Secret for one lab VM, injection-proof by construction.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
