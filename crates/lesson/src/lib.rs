//! Lesson definitions: the YAML format, its validation and the typed lesson model.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
