//! Real virtual machines for the simulated KubeVirt: one qemu process per guest.
//!
//! This crate owns what it takes to run a lab VM on one machine without a cluster: the guest
//! image on disk and its manifest ([`GuestImage`]), the per-VM root disk (a qcow2
//! copy-on-write overlay on the read-only base, or a fresh copy: [`RootDisk`]), the NoCloud
//! `cidata` seed that hands cloud-init its user-data ([`write_seed`]), one more ISO 9660 disk
//! per KubeVirt `configMap` volume, labelled with its `volumeLabel` ([`ConfigDisk`],
//! [`write_config_disk`]), the choice of KVM or
//! software emulation ([`probe_accel`], with a timeout: `/dev/kvm` can exist and hang), and
//! the qemu process itself ([`Guest`]): its serial console as raw bytes both ways, the agent
//! port forwarded from one loopback address, guest power-off observed as the process ending,
//! and a shutdown that asks by ACPI first and kills after a grace.
//!
//! The guest's network is qemu's user-mode network with `restrict=on`: the guest reaches no
//! address at all, on this machine or off it; only the forwarded agent port reaches the guest.
//!
//! It refuses to own Kubernetes: no objects, phases or run strategies (kube-sim and
//! kubevirt-sim decide those), and it never builds images (`ttlabctl guest-image` does).

mod accel;
mod error;
mod guest;
mod image;
mod seed;

pub use accel::{Accel, probe_accel};
pub use error::QemuError;
pub use guest::{Console, Exit, Guest, GuestSpec, RootDisk};
pub use image::{GuestImage, ImageManifest, MANIFEST_FILE};
pub use seed::{ConfigDisk, write_config_disk, write_seed};

use std::time::Duration;

/// How a simulated KubeVirt (kube-sim's own, or kubevirt-sim) runs its guests as qemu guests.
#[derive(Debug, Clone)]
pub struct QemuSettings {
    /// The image every guest boots (`ttlabctl guest-image` prints its directory).
    pub image: GuestImage,
    /// KVM or TCG; `None` probes once (KVM if a kernel boots under it within
    /// [`QemuSettings::probe_timeout`]).
    pub accel: Option<Accel>,
    /// How long the KVM probe may take.
    pub probe_timeout: Duration,
    /// The most memory a guest gets, whatever its VMI asks for (MiB).
    pub max_memory_mib: u64,
    /// The most virtual CPUs a guest gets.
    pub max_cpus: u32,
}

impl QemuSettings {
    /// Guests of `image`, the accelerator probed, at most 2 GiB and 2 CPUs each.
    pub fn new(image: GuestImage) -> Self {
        Self {
            image,
            accel: None,
            probe_timeout: Duration::from_secs(15),
            max_memory_mib: 2048,
            max_cpus: 2,
        }
    }
}

/// The qemu system emulator this crate runs.
pub const QEMU: &str = "qemu-system-x86_64";
/// The disk image tool (overlays, conversions).
pub const QEMU_IMG: &str = "qemu-img";
