//! Session lifespan: expiry, extension, remaining time and hard deadlines, as pure functions of `now`.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
