//! What one VM really costs the cluster: the resources KubeVirt's virt-controller gives the
//! VM's virt-launcher pod, which the namespace quota (`requests.memory`) and the nodes'
//! headroom count — not the guest's memory alone.
//!
//! KubeVirt adds a per-VM memory overhead to the guest's memory request (its
//! `GetMemoryOverhead`, `pkg/hypervisor/kvm/hypervisorbackend.go`, called from
//! `CalculateMemoryOverhead` in `pkg/virt-controller/services/template.go` and added by
//! `WithMemoryOverhead` in `pkg/virt-controller/services/renderresources.go`), as of
//! [`KUBEVIRT_RELEASE`]:
//!
//! | part | bytes |
//! |---|---|
//! | page tables | `ceil(request / 1000) * 1000 / 512`, rounded down (the request scaled to kB, as `ScaledValue(Kilo)` does) |
//! | virt-launcher-monitor, virt-launcher, virtlogd, virtqemud, qemu | 25Mi + 100Mi + 25Mi + 40Mi + 50Mi |
//! | per vCPU (cores × sockets × threads, at least 1) | 8Mi each |
//! | the IOThread | 8Mi |
//! | video RAM, unless `devices.autoattachGraphicsDevice: false` | 32Mi |
//! | arm64 (the UEFI pflash) | 128Mi |
//!
//! The qemu part is 50Mi, not the 30Mi of the `v1.9.0` tag's source: the figures recorded
//! from KubeVirt v1.9's virt-controller against ttlab's rendered VMs (`reference/kubevirt/launcher/`:
//! 2340Mi for a 2Gi guest with 1 core, 4613734401 bytes for 4Gi with 2 cores) are both
//! exactly 20Mi above the tag's formula, and match the bump of `QemuOverhead` from 30Mi to
//! 50Mi (kubevirt/kubevirt commit `c822873795`, "hypervisor: bump QemuOverhead from 30Mi to
//! 50Mi"). The parts ttlab's VMs never have are left out: VFIO devices (1Gi), downward metrics
//! (1Mi), exec probes (100Mi + 10Mi each), SEV (256Mi), a TPM (53Mi), dedicated CPUs or
//! guaranteed QoS (100Mi), `memory.reservedOverhead`, the cluster's
//! `additionalGuestMemoryOverheadRatio`, and network binding plugins (passt: 250Mi); ttlab's
//! masquerade binding adds nothing.
//!
//! The compute container requests the guest's memory plus that overhead
//! ([`LauncherResources::compute_memory`], also written on the pod as
//! [`MEMORY_OVERHEAD_ANNOTATION`]) and a tenth of a core per vCPU (the default CPU allocation
//! ratio, 10). Beside it KubeVirt runs the serial console's log as a sidecar
//! ([`CONSOLE_LOG_CONTAINER`]: 35M, 5m), unless the VM or the cluster turns the console log
//! off; a sidecar (an init container with `restartPolicy: Always`) counts with the containers
//! in a pod's requests, so the quota and the scheduler charge both
//! ([`LauncherResources::pod_memory`]). The container disk's init container (1M) runs before
//! them and changes neither sum.
//!
//! ```
//! use ttlab_vm_manifest::launcher::LauncherSpec;
//!
//! // The systemd-basics lesson: 2Gi, 1 core.
//! let cost = LauncherSpec::lab_vm(2 << 30, 1).resources();
//! assert_eq!(cost.overhead, 292 << 20);
//! assert_eq!(cost.compute_memory_quantity(), "2340Mi");
//! assert_eq!(cost.compute_cpu_quantity(), "100m");
//! assert_eq!(cost.pod_memory, (2340 << 20) + 35_000_000);
//! ```

use ttlab_model::Quantity;

/// The KubeVirt release whose virt-controller this module follows.
pub const KUBEVIRT_RELEASE: &str = "v1.9";

/// The launcher pod's annotation with KubeVirt's memory overhead in bytes.
pub const MEMORY_OVERHEAD_ANNOTATION: &str = "kubevirt.io/memory-overhead-bytes";

/// The device-plugin resources the compute container requests (and limits), one of each.
pub const DEVICE_RESOURCES: [&str; 3] = [
    "devices.kubevirt.io/kvm",
    "devices.kubevirt.io/tun",
    "devices.kubevirt.io/vhost-net",
];

/// The compute container's `ephemeral-storage` request (KubeVirt's `ephemeralStorageOverheadSize`).
pub const EPHEMERAL_STORAGE_REQUEST: &str = "50M";

/// KubeVirt's default CPU allocation ratio: a vCPU requests a tenth of a core.
pub const CPU_ALLOCATION_RATIO: u64 = 10;

const MI: u64 = 1 << 20;

/// The fixed part of the overhead: virt-launcher-monitor 25Mi, virt-launcher 100Mi, virtlogd
/// 25Mi, virtqemud 40Mi, qemu 50Mi.
pub const FIXED_OVERHEAD: u64 = (25 + 100 + 25 + 40 + 50) * MI;
/// The overhead of each vCPU.
pub const PER_VCPU_OVERHEAD: u64 = 8 * MI;
/// The overhead of the IOThread.
pub const IOTHREAD_OVERHEAD: u64 = 8 * MI;
/// The video RAM of the auto-attached graphics device.
pub const VIDEO_OVERHEAD: u64 = 32 * MI;
/// The two UEFI pflash devices of an arm64 guest.
pub const ARM64_OVERHEAD: u64 = 128 * MI;

/// One of KubeVirt's support containers: its name and resources, as KubeVirt writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SupportContainer {
    /// The container's name.
    pub name: &'static str,
    /// Its requests, by resource, as quantities.
    pub requests: &'static [(&'static str, &'static str)],
    /// Its limits, by resource, as quantities.
    pub limits: &'static [(&'static str, &'static str)],
    /// Its memory request in bytes.
    pub memory_request: u64,
    /// Its CPU request in thousandths of a core.
    pub cpu_request_millis: u64,
}

/// The serial console's log, a sidecar of every launcher pod unless the console log is off
/// (`serialconsolelog.go`).
pub const CONSOLE_LOG_CONTAINER: SupportContainer = SupportContainer {
    name: "guest-console-log",
    requests: &[("cpu", "5m"), ("memory", "35M")],
    limits: &[("cpu", "15m"), ("memory", "60M")],
    memory_request: 35_000_000,
    cpu_request_millis: 5,
};

/// A CPU architecture, as a VMI's `spec.architecture` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arch {
    /// `amd64`: ttlab's VMs (KubeVirt's webhook sets it from the cluster's architecture).
    #[default]
    Amd64,
    /// `arm64`: 128Mi more for the UEFI pflash devices.
    Arm64,
    /// Another architecture (`s390x`, `ppc64le`): nothing more than amd64.
    Other,
}

impl Arch {
    /// The architecture of a VMI's `spec.architecture` (unset or empty: amd64).
    pub fn from_spec(text: Option<&str>) -> Self {
        match text {
            None | Some("" | "amd64") => Self::Amd64,
            Some("arm64") => Self::Arm64,
            Some(_) => Self::Other,
        }
    }
}

/// What KubeVirt's launcher-pod rendering reads of a VMI, as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LauncherSpec {
    /// `domain.resources.requests.memory` in bytes (ttlab: the guest's memory).
    pub memory_request: u64,
    /// vCPUs: cores × sockets × threads (ttlab: the lesson's cores); 0 counts as 1.
    pub vcpus: u32,
    /// Whether a graphics device is attached: `devices.autoattachGraphicsDevice` unset or true
    /// (ttlab leaves it unset).
    pub graphics: bool,
    /// Whether the serial console's log sidecar runs: `devices.autoattachSerialConsole` and
    /// `devices.logSerialConsole` not false, and the cluster not disabling it (ttlab sets
    /// neither; KubeVirt's default runs it).
    pub console_log: bool,
    /// The VMI's architecture.
    pub arch: Arch,
}

impl LauncherSpec {
    /// A ttlab lab VM as `ttlab-vm-manifest` renders it: a memory request equal to the guest's
    /// `memory` bytes, `cores` vCPUs, KubeVirt's defaults for the rest, amd64.
    pub fn lab_vm(memory: u64, cores: u32) -> Self {
        Self {
            memory_request: memory,
            vcpus: cores,
            graphics: true,
            console_log: true,
            arch: Arch::Amd64,
        }
    }

    /// KubeVirt's memory overhead of the VM, in bytes (see the module's table).
    pub fn memory_overhead(&self) -> u64 {
        let kilo = self.memory_request.div_ceil(1000);
        let page_tables = kilo.saturating_mul(1000) / 512;
        let vcpus = u64::from(self.vcpus.max(1));
        let mut overhead = page_tables
            .saturating_add(FIXED_OVERHEAD)
            .saturating_add(PER_VCPU_OVERHEAD.saturating_mul(vcpus))
            .saturating_add(IOTHREAD_OVERHEAD);
        if self.graphics {
            overhead = overhead.saturating_add(VIDEO_OVERHEAD);
        }
        if self.arch == Arch::Arm64 {
            overhead = overhead.saturating_add(ARM64_OVERHEAD);
        }
        overhead
    }

    /// The launcher pod's resources.
    pub fn resources(&self) -> LauncherResources {
        let overhead = self.memory_overhead();
        let compute_memory = self.memory_request.saturating_add(overhead);
        let compute_cpu_millis = u64::from(self.vcpus.max(1)) * 1000 / CPU_ALLOCATION_RATIO;
        let (log_memory, log_cpu) = if self.console_log {
            (
                CONSOLE_LOG_CONTAINER.memory_request,
                CONSOLE_LOG_CONTAINER.cpu_request_millis,
            )
        } else {
            (0, 0)
        };
        LauncherResources {
            guest: self.memory_request,
            overhead,
            compute_memory,
            compute_cpu_millis,
            pod_memory: compute_memory.saturating_add(log_memory),
            pod_cpu_millis: compute_cpu_millis + log_cpu,
        }
    }
}

/// The resources of one VM's launcher pod (see [`LauncherSpec::resources`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LauncherResources {
    /// The guest's memory request, in bytes.
    pub guest: u64,
    /// KubeVirt's overhead, in bytes ([`MEMORY_OVERHEAD_ANNOTATION`]).
    pub overhead: u64,
    /// The compute container's memory request: the guest's plus the overhead.
    pub compute_memory: u64,
    /// The compute container's CPU request, in thousandths of a core.
    pub compute_cpu_millis: u64,
    /// What the pod requests in all, and so what a `requests.memory` quota and a node's
    /// allocatable memory are charged: the compute container and the console log's sidecar.
    pub pod_memory: u64,
    /// What the pod requests of CPU in all, in thousandths of a core.
    pub pod_cpu_millis: u64,
}

impl LauncherResources {
    /// The compute container's memory request as KubeVirt's quantity reads back from the API
    /// server: `2340Mi`, or bytes when no binary suffix divides it (`4613734401`).
    pub fn compute_memory_quantity(&self) -> String {
        bytes_quantity(self.compute_memory).to_string()
    }

    /// The overhead as the VMI's `status.memory.memoryOverhead` shows it (`292Mi`).
    pub fn overhead_quantity(&self) -> String {
        bytes_quantity(self.overhead).to_string()
    }

    /// The compute container's CPU request as the API server writes it back (`100m`, `1`).
    pub fn compute_cpu_quantity(&self) -> String {
        if self.compute_cpu_millis.is_multiple_of(1000) {
            (self.compute_cpu_millis / 1000).to_string()
        } else {
            format!("{}m", self.compute_cpu_millis)
        }
    }
}

/// `bytes` as a quantity, whose display is the canonical form the API server writes back a
/// binary-suffixed quantity in: the largest binary suffix that divides it (`2340Mi`), else
/// bytes (`4613734401`).
pub fn bytes_quantity(bytes: u64) -> Quantity {
    Quantity::from_units(i64::try_from(bytes).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GI: u64 = 1 << 30;

    #[test]
    fn the_recorded_figures_come_out_exactly() {
        // systemd-basics: 2Gi, 1 core → the compute container requests 2340Mi.
        let small = LauncherSpec::lab_vm(2 * GI, 1).resources();
        assert_eq!(small.overhead, 306_184_192);
        assert_eq!(small.compute_memory_quantity(), "2340Mi");
        assert_eq!(small.overhead_quantity(), "292Mi");
        assert_eq!(small.compute_cpu_quantity(), "100m");
        // kubeadm-cluster: 4Gi, 2 cores → 4613734401 bytes (the page tables' extra byte).
        let big = LauncherSpec::lab_vm(4 * GI, 2).resources();
        assert_eq!(big.overhead, 318_767_105);
        assert_eq!(big.compute_memory, 4_613_734_401);
        assert_eq!(big.compute_memory_quantity(), "4613734401");
        assert_eq!(big.overhead_quantity(), "318767105");
        assert_eq!(big.compute_cpu_quantity(), "200m");
    }

    #[test]
    fn every_part_of_the_overhead_counts() {
        let base = LauncherSpec::lab_vm(2 * GI, 1);
        let o = base.memory_overhead();
        assert_eq!(
            LauncherSpec { vcpus: 3, ..base }.memory_overhead(),
            o + 2 * PER_VCPU_OVERHEAD
        );
        assert_eq!(
            LauncherSpec { vcpus: 0, ..base }.memory_overhead(),
            o,
            "no vCPU counts as one"
        );
        assert_eq!(
            LauncherSpec {
                graphics: false,
                ..base
            }
            .memory_overhead(),
            o - VIDEO_OVERHEAD
        );
        assert_eq!(
            LauncherSpec {
                arch: Arch::Arm64,
                ..base
            }
            .memory_overhead(),
            o + ARM64_OVERHEAD
        );
        assert_eq!(
            LauncherSpec {
                arch: Arch::Other,
                ..base
            }
            .memory_overhead(),
            o
        );
        // Page tables: one byte per 512 of the request scaled up to whole kB.
        assert_eq!(
            LauncherSpec {
                memory_request: 1_000_000_000,
                ..base
            }
            .memory_overhead(),
            o - 4 * MI + 1_953_125
        );
        assert_eq!(
            LauncherSpec {
                memory_request: 1_000_000_001,
                ..base
            }
            .memory_overhead(),
            o - 4 * MI + 1_953_126
        );
    }

    #[test]
    fn the_pod_counts_the_console_log_sidecar() {
        let with = LauncherSpec::lab_vm(2 * GI, 1).resources();
        assert_eq!(with.pod_memory, with.compute_memory + 35_000_000);
        assert_eq!(with.pod_cpu_millis, 105);
        let without = LauncherSpec {
            console_log: false,
            ..LauncherSpec::lab_vm(2 * GI, 1)
        }
        .resources();
        assert_eq!(without.pod_memory, without.compute_memory);
        assert_eq!(without.pod_cpu_millis, 100);
        // The sidecar's written quantities are the numbers counted.
        let request = |name: &str| {
            CONSOLE_LOG_CONTAINER
                .requests
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| *v)
        };
        assert_eq!(
            request("memory"),
            Some(format!("{}M", CONSOLE_LOG_CONTAINER.memory_request / 1_000_000).as_str())
        );
        assert_eq!(
            request("cpu"),
            Some(format!("{}m", CONSOLE_LOG_CONTAINER.cpu_request_millis).as_str())
        );
    }

    #[test]
    fn cpu_requests_are_a_tenth_of_a_core_per_vcpu() {
        for (vcpus, text) in [
            (1, "100m"),
            (2, "200m"),
            (10, "1"),
            (12, "1200m"),
            (20, "2"),
        ] {
            assert_eq!(
                LauncherSpec::lab_vm(GI, vcpus)
                    .resources()
                    .compute_cpu_quantity(),
                text
            );
        }
    }

    #[test]
    fn quantities_are_canonical() {
        for (bytes, text) in [
            (0, "0"),
            (1, "1"),
            (1024, "1Ki"),
            (1536, "1536"),
            (3072, "3Ki"),
            (2 * GI, "2Gi"),
            (2340 * MI, "2340Mi"),
            (4_613_734_401, "4613734401"),
        ] {
            assert_eq!(bytes_quantity(bytes).to_string(), text);
        }
    }

    #[test]
    fn architectures_read_from_the_spec() {
        assert_eq!(Arch::from_spec(None), Arch::Amd64);
        assert_eq!(Arch::from_spec(Some("amd64")), Arch::Amd64);
        assert_eq!(Arch::from_spec(Some("arm64")), Arch::Arm64);
        assert_eq!(Arch::from_spec(Some("s390x")), Arch::Other);
    }
}
