//! `reap_once`: reclaims expired sessions, orphaned objects and ghost rows, isolating every failure.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
