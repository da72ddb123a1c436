//! Renders KubeVirt VirtualMachines and the multi-VM Service and NetworkPolicy for a session, with typed labels and names.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
