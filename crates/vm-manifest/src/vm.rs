//! Typed serde structs for the subset of `kubevirt.io/v1` VirtualMachine that ttlab renders.
//!
//! Field names follow the JSON schema exactly (`secretRef`, not the Go name
//! `userDataSecretRef`); optional fields are skipped rather than written as `null`, which the
//! CRD schema would reject.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize};

/// `apiVersion` of a VirtualMachine.
pub const API_VERSION: &str = "kubevirt.io/v1";
/// `kind` of a VirtualMachine.
pub const KIND: &str = "VirtualMachine";

/// A KubeVirt VirtualMachine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachine {
    /// Always [`API_VERSION`].
    pub api_version: String,
    /// Always [`KIND`].
    pub kind: String,
    /// Name, namespace, labels (and owner references, added by the caller if any).
    pub metadata: ObjectMeta,
    /// The desired state.
    pub spec: VirtualMachineSpec,
}

/// `spec` of a VirtualMachine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineSpec {
    /// When KubeVirt (re)starts the VMI. `spec.running` is never set: it is deprecated and
    /// rejected together with a run strategy.
    pub run_strategy: RunStrategy,
    /// The VMI template.
    pub template: VmiTemplate,
}

/// `spec.runStrategy` values accepted by the virt-api webhook.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunStrategy {
    /// Restart on any end.
    Always,
    /// Keep stopped.
    Halted,
    /// Started and stopped by hand.
    Manual,
    /// Restart a crashed (Failed) VMI; a guest power-off (Succeeded) stays off.
    RerunOnFailure,
    /// Run once, never restart.
    Once,
}

/// `spec.template`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VmiTemplate {
    /// Labels copied to the VMI and its virt-launcher pod.
    pub metadata: TemplateMeta,
    /// The VMI spec.
    pub spec: VmiSpec,
}

/// `spec.template.metadata` (only labels).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TemplateMeta {
    /// The launcher pod carries these, so Services and NetworkPolicies select it by them.
    pub labels: BTreeMap<String, String>,
}

/// `spec.template.spec`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiSpec {
    /// The guest's hostname (DHCP), the node name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    /// The headless Service of a multi-VM session: peers resolve as `<hostname>.<subdomain>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub subdomain: Option<String>,
    /// Seconds between the ACPI shutdown request and the forced stop.
    pub termination_grace_period_seconds: i64,
    /// What a node drain does to the VMI.
    pub eviction_strategy: String,
    /// CPU, memory, devices.
    pub domain: Domain,
    /// The pod network.
    pub networks: Vec<Network>,
    /// Root disk and cloud-init volumes.
    pub volumes: Vec<Volume>,
}

/// `domain`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Domain {
    /// Virtual CPU topology.
    pub cpu: Cpu,
    /// Guest memory.
    pub memory: Memory,
    /// Resource requests of the launcher pod.
    pub resources: Resources,
    /// Disks and interfaces.
    pub devices: Devices,
}

/// `domain.cpu`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cpu {
    /// Number of cores.
    pub cores: u32,
}

/// `domain.memory`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Memory {
    /// Guest memory as a Kubernetes quantity.
    pub guest: String,
}

/// `domain.resources`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Resources {
    /// Requests (`memory`), quantities as text.
    pub requests: BTreeMap<String, String>,
}

/// `domain.devices`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Devices {
    /// Disks, by volume name.
    pub disks: Vec<Disk>,
    /// Network interfaces, by network name.
    pub interfaces: Vec<Interface>,
}

/// One disk device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Disk {
    /// The volume it shows.
    pub name: String,
    /// A plain disk on this bus.
    pub disk: DiskTarget,
}

/// `disk.disk`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskTarget {
    /// `virtio`.
    pub bus: String,
}

/// One network interface.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Interface {
    /// The network it attaches to.
    pub name: String,
    /// Masquerade (NAT) binding to the pod network.
    pub masquerade: Empty,
    /// The ports forwarded into the guest; absent means every port.
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub ports: Vec<Port>,
}

/// A forwarded port.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Port {
    /// An IANA service name.
    pub name: String,
    /// The port number.
    pub port: u16,
    /// `TCP`.
    pub protocol: String,
}

/// An empty object (`{}`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}

/// One network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Network {
    /// Its name, referenced by an interface.
    pub name: String,
    /// The pod network.
    pub pod: Empty,
}

/// One volume: a name and exactly one source.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Volume {
    /// Referenced by a disk.
    pub name: String,
    /// The source, flattened into the volume object.
    #[serde(flatten)]
    pub source: VolumeSource,
}

/// The source of a volume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum VolumeSource {
    /// A read-only PVC under a per-VMI copy-on-write overlay (discarded with the VMI).
    Ephemeral {
        /// The claim.
        #[serde(rename = "persistentVolumeClaim")]
        persistent_volume_claim: ClaimRef,
    },
    /// A disk image shipped in a container image.
    ContainerDisk {
        /// The image reference.
        image: String,
    },
    /// cloud-init NoCloud user-data from a Secret (key `userdata`).
    CloudInitNoCloud {
        /// The Secret.
        #[serde(rename = "secretRef")]
        secret_ref: SecretRef,
    },
    /// A ConfigMap of the VM's namespace, presented to the guest as an ISO 9660 disk whose
    /// files are its keys and whose volume id is `volumeLabel`.
    ConfigMap(ConfigMapRef),
}

/// `configMap` of a volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapRef {
    /// The ConfigMap name.
    pub name: String,
    /// The volume label of the disk inside the guest.
    pub volume_label: String,
}

/// `ephemeral.persistentVolumeClaim`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimRef {
    /// The PVC name.
    pub claim_name: String,
    /// Always true: the golden base is never written.
    pub read_only: bool,
}

/// `cloudInitNoCloud.secretRef`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SecretRef {
    /// The Secret name.
    pub name: String,
}
