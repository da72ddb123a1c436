//! Relays a browser WebSocket to a VMI serial console (`plain.kubevirt.io`) with backpressure and keepalive.
//!
//! Not built yet: this crate is a documented placeholder and exports nothing.
