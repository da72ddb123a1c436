//! The guest grading agent: its protocol, token check and command runner, and the typed client the server uses.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
