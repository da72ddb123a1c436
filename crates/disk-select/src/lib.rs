//! The golden-disk decision table: what the cluster showed about the golden PVC, to golden or container disk with a reason.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
