//! Renders what Kubernetes must hold for one VM session: a KubeVirt VirtualMachine per node
//! and, for a multi-VM session, a headless Service (peer DNS) and a NetworkPolicy (peers may
//! talk to each other). It also owns the names of those objects and of each node's cloud-init
//! Secret ([`vm_name`], [`secret_name`], [`service_name`], [`network_policy_name`]), and what
//! one VM costs the cluster once KubeVirt has added its overhead ([`launcher`]: the launcher
//! pod's requests, which the namespace quota and the nodes count).
//!
//! Pure: values in, values out, the same bytes for the same input. It refuses to own the
//! golden-disk decision (`ttlab-disk-select` gives it a [`DiskDecision`]), the cloud-init
//! content (`ttlab-cloudinit`), the lesson format (the input is plain values), and any API
//! call.
//!
//! What every VM gets, and why:
//! - `runStrategy: RerunOnFailure`: a crash restarts, a guest power-off (the guest's own
//!   hard-deadline safety) stays off and frees its memory; `running` is never set.
//! - labels ([`ObjectLabels`] plus `ttlab.io/component: vm`) on the VM and on
//!   `spec.template.metadata.labels`, so the VMI's launcher pod carries them too;
//! - root disk: golden → `ephemeral` over the claim, read-only (a per-VM copy-on-write layer);
//!   otherwise `containerDisk` with the lesson's image;
//! - cloud-init from `cloudInitNoCloud.secretRef` (the Secret [`secret_name`]), whatever the size;
//! - the grading agent from a third disk, [`AGENT_DISK`]: a `configMap` volume naming the
//!   shared ConfigMap of the agent's version with its `volumeLabel` ([`AgentDisk`], given by
//!   [`render_with_agent`]; [`render`] leaves it out, and such a guest's first boot fails for
//!   want of its agent);
//! - memory request equal to the guest memory (no overcommit discount; KubeVirt adds its
//!   overhead on the launcher pod, [`launcher::LauncherSpec::lab_vm`]), the lesson's cores,
//!   masquerade on the pod network.
//!
//! ```
//! use ttlab_disk_select::DiskDecision;
//! use ttlab_vm_manifest::{render_with_agent, secret_name, AgentDisk, SessionVms, VolumeSource};
//!
//! let input = SessionVms {
//!     session: "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
//!     env: "dev".parse().unwrap(),
//!     lesson: "systemd-basics".parse().unwrap(),
//!     namespace: Some("ttlab-vms".into()),
//!     image: "quay.io/containerdisks/debian:12".into(),
//!     memory: "4Gi".into(),
//!     cores: 2,
//!     nodes: vec!["vm".parse().unwrap()],
//!     disk: DiskDecision::Golden { claim: "golden-debian".into() },
//!     termination_grace_period_seconds: 30,
//! };
//! let agent = AgentDisk {
//!     config_map: "ttlab-agent-50b7bf522747c966".into(),
//!     volume_label: "ttlab-agent".into(),
//! };
//! let out = render_with_agent(&input, &agent).unwrap();
//! assert_eq!(out.vms.len(), 1);
//! assert!(out.service.is_none() && out.network_policy.is_none());
//! let vm = &out.vms[0];
//! assert_eq!(vm.metadata.name.as_deref(), Some("tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-vm"));
//! let volumes = &vm.spec.template.spec.volumes;
//! assert!(matches!(&volumes[0].source, VolumeSource::Ephemeral { persistent_volume_claim }
//!     if persistent_volume_claim.claim_name == "golden-debian" && persistent_volume_claim.read_only));
//! assert!(matches!(&volumes[1].source, VolumeSource::CloudInitNoCloud { secret_ref }
//!     if secret_ref.name == secret_name(input.session, &input.nodes[0])));
//! assert!(matches!(&volumes[2].source, VolumeSource::ConfigMap(c)
//!     if c.name == agent.config_map && c.volume_label == "ttlab-agent"));
//! ```

pub mod launcher;
mod names;
mod network;
mod vm;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use ttlab_disk_select::DiskDecision;
use ttlab_model::labels::{self, ObjectLabels};
use ttlab_model::{EnvName, LessonId, NodeName, Quantity, QuantityParts, SessionId, Suffix};

pub use names::{NAME_PREFIX, network_policy_name, pod_name, secret_name, service_name, vm_name};
pub use network::{network_policy, service};
pub use vm::{
    API_VERSION, ClaimRef, ConfigMapRef, Cpu, Devices, Disk, DiskTarget, Domain, Empty, Interface,
    KIND, Memory, Network, Port, Resources, RunStrategy, SecretRef, TemplateMeta, VirtualMachine,
    VirtualMachineSpec, VmiSpec, VmiTemplate, Volume, VolumeSource,
};

/// The run strategy of every lab VM (see the crate docs).
pub const RUN_STRATEGY: RunStrategy = RunStrategy::RerunOnFailure;
/// KubeVirt's default grace period, in seconds, between shutdown request and forced stop.
pub const DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS: i64 = 30;
/// Name of the root-disk volume (and disk).
pub const ROOT_DISK: &str = "rootdisk";
/// Name of the cloud-init volume (and disk).
pub const CLOUD_INIT_DISK: &str = "cloudinit";
/// Name of the agent volume (and disk).
pub const AGENT_DISK: &str = "agent";
/// Name of the pod network (and interface).
pub const POD_NETWORK: &str = "default";
/// The disk bus of every disk.
pub const DISK_BUS: &str = "virtio";
/// `ttlab.io/component` of VMs (and so of their launcher pods).
pub const COMPONENT_VM: &str = labels::component::VM;
/// `ttlab.io/component` of the session Service and NetworkPolicy.
pub const COMPONENT_SESSION_NETWORK: &str = labels::component::SESSION_NETWORK;
/// `ttlab.io/component` of the cloud-init Secrets (for the cloudinit crate).
pub const COMPONENT_CLOUD_INIT: &str = labels::component::CLOUD_INIT;

/// Errors of this crate: an input that cannot become a valid manifest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    /// The session has no node.
    #[error("a VM session needs at least one node")]
    NoNodes,
    /// Two nodes share a name (their VMs would share a name).
    #[error("node {0:?} appears twice")]
    DuplicateNode(String),
    /// The memory text is not a Kubernetes quantity.
    #[error("memory {0:?} is not a Kubernetes quantity (like 4Gi, 512Mi or 2G)")]
    BadMemory(String),
    /// Zero cores.
    #[error("a VM needs at least one core")]
    NoCores,
    /// The container-disk image is empty (it is the fallback of every golden disk).
    #[error("the container disk image is empty")]
    NoImage,
    /// The golden claim name is empty.
    #[error("the golden disk claim name is empty")]
    NoClaim,
    /// The namespace is not a DNS label.
    #[error("namespace {0:?} is not a valid DNS label")]
    BadNamespace(String),
    /// A negative grace period.
    #[error("terminationGracePeriodSeconds must not be negative, got {0}")]
    BadGracePeriod(i64),
    /// The agent disk names no valid ConfigMap or volume label.
    #[error("invalid agent disk: {0}")]
    BadAgentDisk(String),
}

/// Everything needed to render a session's VMs, as plain values (the server fills it from the
/// lesson and the disk decision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionVms {
    /// The session.
    pub session: SessionId,
    /// The environment of the backend creating it (stamped as a label).
    pub env: EnvName,
    /// The lesson.
    pub lesson: LessonId,
    /// Namespace of every object; `None` leaves `metadata.namespace` unset (the namespaced
    /// API call sets it).
    pub namespace: Option<String>,
    /// Container-disk image (used unless the disk decision is golden).
    pub image: String,
    /// Guest memory as a Kubernetes quantity; also the memory request.
    pub memory: String,
    /// Virtual CPU cores per VM.
    pub cores: u32,
    /// The nodes, in lesson order; the first is the representative VM (see [`SessionManifests`]).
    pub nodes: Vec<NodeName>,
    /// Which root disk every VM gets.
    pub disk: DiskDecision,
    /// Grace period of a shutdown, usually [`DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS`].
    pub termination_grace_period_seconds: i64,
}

/// The objects of one session, in creation order after the cloud-init Secrets: VMs (first the
/// representative), then the Service and NetworkPolicy of a multi-VM session.
///
/// Owner references are not rendered (they need the representative VM's uid, known only after
/// it is created): the caller adds [`owner_reference`] to the other VMs, the Secrets, the
/// Service and the NetworkPolicy, so deleting the representative VM takes the rest along.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionManifests {
    /// One per node, in node order.
    pub vms: Vec<VirtualMachine>,
    /// Headless Service for peer DNS; `None` for a single-VM session.
    pub service: Option<Service>,
    /// Peer NetworkPolicy; `None` for a single-VM session.
    pub network_policy: Option<NetworkPolicy>,
}

/// The agent disk of every VM of a session: the shared ConfigMap of the agent's version and
/// the volume label the guest finds it by (both given by `ttlab_cloudinit::AgentPayload`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentDisk {
    /// The ConfigMap's name (`ttlab-agent-<digest prefix>`).
    pub config_map: String,
    /// The disk's volume label inside the guest.
    pub volume_label: String,
}

/// Renders every object of a VM session (see [`SessionManifests`]) without the agent disk:
/// for VMs whose guest needs no grading agent. Lab VMs are rendered by [`render_with_agent`].
pub fn render(input: &SessionVms) -> Result<SessionManifests, ManifestError> {
    render_vms(input, None)
}

/// Renders every object of a VM session (see [`SessionManifests`]), each VM with the agent
/// disk `agent`.
pub fn render_with_agent(
    input: &SessionVms,
    agent: &AgentDisk,
) -> Result<SessionManifests, ManifestError> {
    if !is_subdomain(&agent.config_map) || agent.config_map.len() > 63 {
        return Err(ManifestError::BadAgentDisk(format!(
            "the ConfigMap name {:?} is not a DNS-1123 label of at most 63 characters",
            agent.config_map
        )));
    }
    // ISO 9660 allows 32 characters in a volume id.
    if agent.volume_label.is_empty()
        || agent.volume_label.len() > 32
        || !agent
            .volume_label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(ManifestError::BadAgentDisk(format!(
            "the volume label {:?} is not 1 to 32 letters, digits, '-' or '_'",
            agent.volume_label
        )));
    }
    render_vms(input, Some(agent))
}

fn render_vms(
    input: &SessionVms,
    agent: Option<&AgentDisk>,
) -> Result<SessionManifests, ManifestError> {
    validate(input)?;
    let multi = input.nodes.len() > 1;
    let vms = input
        .nodes
        .iter()
        .map(|node| render_vm(input, node, multi, agent))
        .collect();
    let (service, network_policy) = if multi {
        (Some(service(input)), Some(network_policy(input)))
    } else {
        (None, None)
    };
    Ok(SessionManifests {
        vms,
        service,
        network_policy,
    })
}

/// An owner reference to a VirtualMachine (to set on objects that must go when it goes).
/// `blockOwnerDeletion` is left unset: setting it needs update rights on the VM's finalizers.
pub fn owner_reference(vm_name: &str, vm_uid: &str) -> OwnerReference {
    OwnerReference {
        api_version: API_VERSION.to_owned(),
        kind: KIND.to_owned(),
        name: vm_name.to_owned(),
        uid: vm_uid.to_owned(),
        block_owner_deletion: None,
        controller: None,
    }
}

/// The labels of `node`'s objects, plus `ttlab.io/component`.
pub fn object_labels(
    input: &SessionVms,
    node: Option<&NodeName>,
    component: &str,
) -> BTreeMap<String, String> {
    let mut map = ObjectLabels::new(
        input.session,
        input.env.clone(),
        input.lesson.clone(),
        node.cloned(),
    )
    .to_map();
    map.insert(labels::COMPONENT.to_owned(), component.to_owned());
    map
}

fn validate(input: &SessionVms) -> Result<(), ManifestError> {
    if input.nodes.is_empty() {
        return Err(ManifestError::NoNodes);
    }
    let mut seen = BTreeSet::new();
    for node in &input.nodes {
        if !seen.insert(node) {
            return Err(ManifestError::DuplicateNode(node.to_string()));
        }
    }
    if !is_quantity(&input.memory) {
        return Err(ManifestError::BadMemory(input.memory.clone()));
    }
    if input.cores == 0 {
        return Err(ManifestError::NoCores);
    }
    if input.image.trim().is_empty() {
        return Err(ManifestError::NoImage);
    }
    if let DiskDecision::Golden { claim } = &input.disk
        && claim.trim().is_empty()
    {
        return Err(ManifestError::NoClaim);
    }
    if let Some(ns) = &input.namespace
        && EnvName::new(ns.as_str()).is_err()
    {
        return Err(ManifestError::BadNamespace(ns.clone()));
    }
    if input.termination_grace_period_seconds < 0 {
        return Err(ManifestError::BadGracePeriod(
            input.termination_grace_period_seconds,
        ));
    }
    Ok(())
}

fn is_subdomain(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// A plain positive Kubernetes quantity ([`Quantity`]): digits with an optional fraction
/// (never `1.` or `.5`), a binary or decimal suffix or none; no sign, exponent or milli.
fn is_quantity(s: &str) -> bool {
    let Ok(parts) = QuantityParts::lex(s) else {
        return false;
    };
    let plain = !parts.signed
        && !parts.integer.is_empty()
        && parts.fraction != Some("")
        && matches!(parts.suffix, Suffix::Binary(_) | Suffix::Decimal(0..));
    plain && parts.value().is_ok_and(|q| q > Quantity::ZERO)
}

fn render_vm(
    input: &SessionVms,
    node: &NodeName,
    multi: bool,
    agent: Option<&AgentDisk>,
) -> VirtualMachine {
    let mut labels = object_labels(input, Some(node), COMPONENT_VM);
    if let Some(agent) = agent {
        labels.insert(
            labels::AGENT_CONFIG_MAP.to_owned(),
            agent.config_map.clone(),
        );
    }
    let root = match &input.disk {
        DiskDecision::Golden { claim } => VolumeSource::Ephemeral {
            persistent_volume_claim: ClaimRef {
                claim_name: claim.clone(),
                read_only: true,
            },
        },
        DiskDecision::ContainerDisk { .. } => VolumeSource::ContainerDisk {
            image: input.image.clone(),
        },
    };
    // Masquerade forwards only the listed ports, or every port when none is listed. A single
    // VM needs only the agent's port; the VMs of a multi-VM lab must reach each other on any
    // port (a kubeadm lab uses many), and the NetworkPolicy bounds who may.
    let ports = if multi {
        Vec::new()
    } else {
        vec![Port {
            name: "agent".to_owned(),
            port: ttlab_agent::protocol::PORT,
            protocol: "TCP".to_owned(),
        }]
    };
    let disk = |name: &str| Disk {
        name: name.to_owned(),
        disk: DiskTarget {
            bus: DISK_BUS.to_owned(),
        },
    };
    let mut disks = vec![disk(ROOT_DISK), disk(CLOUD_INIT_DISK)];
    let mut volumes = vec![
        Volume {
            name: ROOT_DISK.to_owned(),
            source: root,
        },
        Volume {
            name: CLOUD_INIT_DISK.to_owned(),
            source: VolumeSource::CloudInitNoCloud {
                secret_ref: SecretRef {
                    name: secret_name(input.session, node),
                },
            },
        },
    ];
    if let Some(agent) = agent {
        disks.push(disk(AGENT_DISK));
        volumes.push(Volume {
            name: AGENT_DISK.to_owned(),
            source: VolumeSource::ConfigMap(ConfigMapRef {
                name: agent.config_map.clone(),
                volume_label: agent.volume_label.clone(),
            }),
        });
    }
    VirtualMachine {
        api_version: API_VERSION.to_owned(),
        kind: KIND.to_owned(),
        metadata: ObjectMeta {
            name: Some(vm_name(input.session, node)),
            namespace: input.namespace.clone(),
            labels: Some(labels.clone()),
            ..ObjectMeta::default()
        },
        spec: VirtualMachineSpec {
            run_strategy: RUN_STRATEGY,
            template: VmiTemplate {
                metadata: TemplateMeta { labels },
                spec: VmiSpec {
                    hostname: Some(node.to_string()),
                    subdomain: multi.then(|| service_name(input.session)),
                    termination_grace_period_seconds: input.termination_grace_period_seconds,
                    // A lab VM is not worth a live migration: a drain shuts it down (and
                    // RerunOnFailure starts it again elsewhere if it did not end cleanly).
                    eviction_strategy: "None".to_owned(),
                    domain: Domain {
                        cpu: Cpu { cores: input.cores },
                        memory: Memory {
                            guest: input.memory.clone(),
                        },
                        resources: Resources {
                            requests: BTreeMap::from([("memory".to_owned(), input.memory.clone())]),
                        },
                        devices: Devices {
                            disks,
                            interfaces: vec![Interface {
                                name: POD_NETWORK.to_owned(),
                                masquerade: Empty {},
                                ports,
                            }],
                        },
                    },
                    networks: vec![Network {
                        name: POD_NETWORK.to_owned(),
                        pod: Empty {},
                    }],
                    volumes,
                },
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        for ok in ["4Gi", "512Mi", "2G", "1.5Gi", "1073741824", "0.5Gi"] {
            assert!(is_quantity(ok), "{ok}");
        }
        for bad in [
            "", "Gi", "4GB", "4 Gi", "-1Gi", "0", "0Gi", "1.Gi", ".5Gi", "4gi", "1e3",
        ] {
            assert!(!is_quantity(bad), "{bad}");
        }
    }
}
