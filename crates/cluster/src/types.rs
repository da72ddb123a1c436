//! The values the [`Cluster`](crate::Cluster) trait takes and returns.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;

use chrono::{DateTime, Utc};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use ttlab_vm_manifest::RunStrategy;

/// The kinds of object ttlab creates, reads, lists and deletes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `kubevirt.io/v1` VirtualMachine.
    VirtualMachine,
    /// `kubevirt.io/v1` VirtualMachineInstance (created by KubeVirt, named like its VM).
    VirtualMachineInstance,
    /// `v1` Secret (the cloud-init user data).
    Secret,
    /// `v1` Service (multi-VM sessions).
    Service,
    /// `networking.k8s.io/v1` NetworkPolicy.
    NetworkPolicy,
    /// `v1` Pod (pod labs).
    Pod,
    /// `v1` ConfigMap (the agent of one version, shared by the VMs that run it).
    ConfigMap,
}

impl Kind {
    /// Every kind, in a stable order.
    pub const ALL: [Kind; 7] = [
        Kind::VirtualMachine,
        Kind::VirtualMachineInstance,
        Kind::Secret,
        Kind::Service,
        Kind::NetworkPolicy,
        Kind::Pod,
        Kind::ConfigMap,
    ];

    /// The API group (`""` for the core group).
    pub fn group(self) -> &'static str {
        match self {
            Kind::VirtualMachine | Kind::VirtualMachineInstance => "kubevirt.io",
            Kind::NetworkPolicy => "networking.k8s.io",
            Kind::Secret | Kind::Service | Kind::Pod | Kind::ConfigMap => "",
        }
    }

    /// The API version within the group.
    pub fn version(self) -> &'static str {
        "v1"
    }

    /// The `apiVersion` field of an object of this kind.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::VirtualMachine | Kind::VirtualMachineInstance => "kubevirt.io/v1",
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            Kind::Secret | Kind::Service | Kind::Pod | Kind::ConfigMap => "v1",
        }
    }

    /// The `kind` field of an object of this kind.
    pub fn name(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "VirtualMachine",
            Kind::VirtualMachineInstance => "VirtualMachineInstance",
            Kind::Secret => "Secret",
            Kind::Service => "Service",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::Pod => "Pod",
            Kind::ConfigMap => "ConfigMap",
        }
    }

    /// The resource (plural) in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::VirtualMachine => "virtualmachines",
            Kind::VirtualMachineInstance => "virtualmachineinstances",
            Kind::Secret => "secrets",
            Kind::Service => "services",
            Kind::NetworkPolicy => "networkpolicies",
            Kind::Pod => "pods",
            Kind::ConfigMap => "configmaps",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What [`crate::ProvisionCluster::ensure_config_map`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// It was there already (or another process created it meanwhile), with the same
    /// content.
    Present,
    /// This call created it.
    Created,
}

/// An object the cluster has just created: enough to refer to it, and to own other objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created {
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// The uid the API server gave it (owner references point at this).
    pub uid: String,
}

impl Created {
    /// An owner reference to this object, for a dependent that Kubernetes' garbage collector
    /// deletes when this object is deleted. `blockOwnerDeletion` and `controller` are left
    /// unset: setting `blockOwnerDeletion` needs update rights on the owner's finalizers
    /// (which ttlab's service account does not have), and a controller reference would fight
    /// KubeVirt's own. Same shape as `ttlab_vm_manifest::owner_reference`.
    pub fn owner_reference(&self) -> OwnerReference {
        OwnerReference {
            api_version: self.kind.api_version().to_owned(),
            kind: self.kind.name().to_owned(),
            name: self.name.clone(),
            uid: self.uid.clone(),
            block_owner_deletion: None,
            controller: None,
        }
    }
}

/// The metadata of one object, as lists and gets return it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectSummary {
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// Its uid.
    pub uid: String,
    /// Its labels (read them with `ttlab_model::labels::ObjectLabels::from_map`).
    pub labels: BTreeMap<String, String>,
    /// When it was created, if the server said.
    pub created_at: Option<DateTime<Utc>>,
    /// Whether its deletion has been requested (it has a `deletionTimestamp`).
    pub deleting: bool,
    /// The uids of its owners.
    pub owner_uids: Vec<String>,
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// The objects of this page.
    pub items: Vec<ObjectSummary>,
    /// The token for the next page; `None` on the last page.
    pub continue_token: Option<String>,
}

/// How the dependents of a deleted object are deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// The object goes at once; the garbage collector deletes its dependents afterwards.
    /// The default: the reaper deletes a VM, then its Secret explicitly, and does not wait.
    #[default]
    Background,
    /// The object stays (with a `deletionTimestamp` and the `foregroundDeletion` finalizer)
    /// while the garbage collector deletes its dependents, and goes once those with
    /// `blockOwnerDeletion` are gone. For callers that want the owner to disappear last.
    Foreground,
}

/// What a delete found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deleted {
    /// The deletion was accepted and the object is still there, marked for deletion: a
    /// finalizer or a grace period holds it, and it may linger.
    Deleted,
    /// The API server removed the object at once (nothing held it): its answer confirms the
    /// object gone, with no need to look for it again.
    Removed,
    /// There was no such object: someone else already deleted it. Success all the same.
    AlreadyGone,
}

/// The phase of a VirtualMachineInstance.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum VmiPhase {
    /// No phase yet (`""`).
    Unset,
    /// Accepted, waiting for a launcher pod.
    Pending,
    /// The launcher pod is being scheduled.
    Scheduling,
    /// The launcher pod is on a node.
    Scheduled,
    /// The guest runs.
    Running,
    /// The guest stopped by itself (power-off).
    Succeeded,
    /// The guest crashed or could not start.
    Failed,
    /// Waiting for a migration target to sync.
    WaitingForSync,
    /// The state cannot be determined.
    Unknown,
    /// A phase this client does not know.
    Other(String),
}

impl VmiPhase {
    /// Parses the `status.phase` string.
    pub fn parse(s: &str) -> Self {
        match s {
            "" => Self::Unset,
            "Pending" => Self::Pending,
            "Scheduling" => Self::Scheduling,
            "Scheduled" => Self::Scheduled,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            "WaitingForSync" => Self::WaitingForSync,
            "Unknown" => Self::Unknown,
            other => Self::Other(other.to_owned()),
        }
    }

    /// The phase as KubeVirt spells it.
    pub fn as_str(&self) -> &str {
        match self {
            Self::Unset => "",
            Self::Pending => "Pending",
            Self::Scheduling => "Scheduling",
            Self::Scheduled => "Scheduled",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::WaitingForSync => "WaitingForSync",
            Self::Unknown => "Unknown",
            Self::Other(s) => s,
        }
    }

    /// Whether the VMI has ended and will not run again by itself.
    pub fn is_final(&self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed)
    }
}

impl fmt::Display for VmiPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unset => f.write_str("(no phase)"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// One entry of `status.conditions`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Condition {
    /// The condition type (`Ready`, `Synchronized`, …).
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// Machine-readable reason (`FailedPvcNotFound`, …).
    pub reason: Option<String>,
    /// Human-readable message.
    pub message: Option<String>,
}

/// What a VirtualMachine's own status says (KubeVirt's VM controller writes it): whether
/// KubeVirt means it to run, whatever its VMI is doing at the moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmStatus {
    /// The VM's name.
    pub name: String,
    /// `status.printableStatus`: `Running`, `Stopped`, `Starting`, `Stopping`,
    /// `CrashLoopBackOff`, `Terminating`, … (as `kubectl get vm` shows it); `None` until the
    /// controller wrote one.
    pub printable_status: Option<String>,
    /// `spec.runStrategy`, when set to a value KubeVirt knows.
    pub run_strategy: Option<RunStrategy>,
    /// Whether `status.stateChangeRequests` holds a `Start` not yet acted on: KubeVirt adds
    /// one when it stops a crashed VMI under `RerunOnFailure`, and starts the next VMI from
    /// it. Until then the VM reads `Stopped`.
    pub start_requested: bool,
    /// Whether its deletion has been requested.
    pub deleting: bool,
}

impl VmStatus {
    /// Whether the VM is not going to run again by itself: being deleted, or `Stopped` (no
    /// VMI, and the run strategy does not start one: the guest powered itself off) with no
    /// start pending.
    pub fn stopped_for_good(&self) -> bool {
        self.deleting
            || (matches!(
                self.printable_status.as_deref(),
                Some("Stopped" | "Terminating")
            ) && !self.start_requested)
    }

    /// Whether KubeVirt starts a new VMI after one that ended in `phase`: `Always` after any
    /// end, `RerunOnFailure` after a crash (`Failed`) but not after the guest powered itself
    /// off (`Succeeded`). A VM being deleted is never restarted.
    pub fn restarts_after(&self, phase: &VmiPhase) -> bool {
        if self.deleting {
            return false;
        }
        match self.run_strategy {
            Some(RunStrategy::Always) => phase.is_final(),
            Some(RunStrategy::RerunOnFailure) => *phase == VmiPhase::Failed,
            Some(RunStrategy::Halted | RunStrategy::Manual | RunStrategy::Once) | None => false,
        }
    }
}

/// What the status of a VirtualMachineInstance says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmiState {
    /// The VMI's name (its VM's name).
    pub name: String,
    /// Its phase.
    pub phase: VmiPhase,
    /// Its conditions, as reported.
    pub conditions: Vec<Condition>,
    /// `status.interfaces[0].ipAddress`, when reported and well formed.
    pub ip: Option<IpAddr>,
    /// `status.nodeName`, once scheduled.
    pub node: Option<String>,
    /// Whether its deletion has been requested.
    pub deleting: bool,
}

impl VmiState {
    /// The condition that explains why the VMI is not progressing: one with status `False`
    /// and a reason (for example `Synchronized=False` with `FailedPvcNotFound`). KubeVirt lists
    /// `Ready=False` (`PodNotExists`: "virt-launcher pod has not yet been scheduled") first,
    /// which only restates that the VMI is not running, so a `False` condition of any other
    /// type is preferred; `Ready` is the answer only when nothing else is `False`.
    pub fn blocking_condition(&self) -> Option<&Condition> {
        let blocking = |c: &&Condition| {
            c.status == "False" && c.reason.as_deref().is_some_and(|r| !r.is_empty())
        };
        self.conditions
            .iter()
            .filter(blocking)
            .find(|c| c.type_ != "Ready")
            .or_else(|| self.conditions.iter().find(blocking))
    }

    /// One line for logs and errors: the phase and, if any, the blocking reason and message.
    pub fn describe(&self) -> String {
        let mut s = format!("phase {}", self.phase);
        if let Some(c) = self.blocking_condition() {
            s.push_str(&format!(
                " ({}={}: {}",
                c.type_,
                c.reason.as_deref().unwrap_or(""),
                c.message.as_deref().unwrap_or("")
            ));
            s.push(')');
        }
        if self.deleting {
            s.push_str(", being deleted");
        }
        s
    }
}

/// The outcome of looking up one object whose absence or inaccessibility is an answer, not a
/// failure (the golden disk: missing or forbidden both mean "use the container disk").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup<T> {
    /// The object exists; here are its facts.
    Found(T),
    /// There is no such object (404).
    NotFound,
    /// The service account may not read it (403).
    Forbidden,
}

impl<T> Lookup<T> {
    /// The facts, if found.
    pub fn found(&self) -> Option<&T> {
        match self {
            Lookup::Found(t) => Some(t),
            _ => None,
        }
    }
}

/// Raw facts about a PersistentVolumeClaim (the golden disk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PvcFacts {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// `status.phase` (`Pending`, `Bound`, `Lost`).
    pub phase: Option<String>,
    /// `spec.accessModes` (`ReadOnlyMany`, `ReadWriteMany`, `ReadWriteOnce`, …).
    pub access_modes: Vec<String>,
    /// `spec.volumeMode` (`Filesystem` or `Block`).
    pub volume_mode: Option<String>,
    /// `spec.storageClassName`.
    pub storage_class: Option<String>,
    /// `status.capacity.storage`.
    pub capacity: Option<String>,
    /// Whether it has a `deletionTimestamp` (the pvc-protection finalizer keeps it
    /// Terminating while pods use it; it refuses new pods).
    pub deleting: bool,
    /// Its annotations (CDI's `cdi.kubevirt.io/storage.pod.phase`, the import source, …).
    pub annotations: BTreeMap<String, String>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
}

/// Raw facts about a CDI DataVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataVolumeFacts {
    /// Its name (the PVC it fills is named like it).
    pub name: String,
    /// `status.phase` (`ImportScheduled`, `ImportInProgress`, `Succeeded`, `Failed`, …).
    pub phase: Option<String>,
    /// `status.progress` (`"45.20%"`, `"N/A"`).
    pub progress: Option<String>,
    /// Whether it has a `deletionTimestamp`.
    pub deleting: bool,
}

/// Raw facts about a CDI DataSource, and the PVC it points at now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataSourceFacts {
    /// Its name.
    pub name: String,
    /// `spec.source.pvc.namespace` (defaults to the DataSource's own namespace).
    pub pvc_namespace: Option<String>,
    /// `spec.source.pvc.name`: the current import (`<source>-<digest>` under a DataImportCron).
    pub pvc_name: Option<String>,
    /// The `Ready` condition's status, if reported (`Some(true)` when `True`).
    pub ready: Option<bool>,
    /// Whether it has a `deletionTimestamp`.
    pub deleting: bool,
}

/// How a lesson names its golden disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GoldenRef {
    /// A PVC in the VM namespace, by name.
    Pvc(String),
    /// A DataSource in the VM namespace, resolved to its current PVC at observation time.
    DataSource(String),
}

/// Everything observed about a golden disk in one go: the raw input of the disk-select
/// decision table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoldenFacts {
    /// The DataSource, when the disk was named through one.
    pub data_source: Option<Lookup<DataSourceFacts>>,
    /// The PVC; `None` when a DataSource was named but did not resolve to a PVC name.
    pub pvc: Option<Lookup<PvcFacts>>,
    /// The DataVolume named like the PVC (CDI may have garbage-collected it after a
    /// successful import, so `NotFound` alone does not mean the PVC is unusable); `None`
    /// when there was no PVC name to look for.
    pub data_volume: Option<Lookup<DataVolumeFacts>>,
}
