//! The student and admin HTTP API, auth and the provisioning saga (steps 1 to 8).
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
