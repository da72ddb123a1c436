//! The cluster traits and their kube-rs implementation, [`KubeCluster`]: the only code in
//! ttlab that talks to Kubernetes. The traits are cut by who calls them: [`ReaperCluster`]
//! (objects by name and label: get, find, list, delete) for the reaper and every teardown,
//! [`ProvisionCluster`] for provisioning, [`ConsoleCluster`] for consoles and grading,
//! [`CapacityCluster`] for the capacity count; [`Cluster`] is the four together, what the
//! server holds.
//!
//! It owns the API calls the server and the reaper make — creating (or, after a lost reply,
//! adopting an object of the same session under the same name) VirtualMachines, their
//! cloud-init Secrets (created after the VM, owned by it, never updated), Services,
//! NetworkPolicies and Pods; making sure the shared ConfigMap of the agent's version exists
//! (get, create if absent, never update); getting, listing by label selector page by page, and deleting
//! (a missing object is already deleted, which is success); counting the live VMs; observing
//! the golden PVC, DataVolume and DataSource; waiting for a VMI to run by watching it; the
//! VMI's address; the serial console; a guest's port through the API server (KubeVirt's
//! `portforward`); pod exec — and it maps every failure onto one typed
//! [`ClusterError`] that says whether a retry can help. A semaphore bounds the calls in
//! flight, so a reaper cycle cannot flood the API server.
//!
//! It refuses to own policy: what to create (manifests come from `ttlab-vm-manifest` and
//! `ttlab-cloudinit` as values), which disk to use (`ttlab-disk-select` decides from the raw
//! [`GoldenFacts`] observed here), what is an orphan (the reaper), or when a session is
//! ready (the api crate combines [`ProvisionCluster::wait_vmi_running`] with the agent).
//!
//! ```
//! use std::sync::Arc;
//! use ttlab_cluster::{Cluster, ClusterError, ClusterSettings, Created, Kind, ReaperCluster};
//!
//! // The server holds the whole cluster as a trait object, the reaper only its part; the
//! // server's is the reaper's too.
//! fn server(cluster: Arc<dyn Cluster>) -> Arc<dyn ReaperCluster> {
//!     cluster
//! }
//! let _ = server;
//!
//! let settings = ClusterSettings::in_namespace("ttlab-vms");
//! assert_eq!(settings.max_in_flight, 16);
//!
//! // A Secret names the VM it belongs to, by uid, when it is created.
//! let vm = Created { kind: Kind::VirtualMachine, name: "lab-1".into(), uid: "0d3c-…".into() };
//! let owner = vm.owner_reference();
//! assert_eq!((owner.api_version.as_str(), owner.kind.as_str()), ("kubevirt.io/v1", "VirtualMachine"));
//!
//! let busy = ClusterError::Transient { message: "HTTP 503".into() };
//! assert!(busy.is_retryable());
//! let full = ClusterError::QuotaExceeded { message: "exceeded quota: vms".into() };
//! assert!(!full.is_retryable());
//! ```

mod cache;
mod client;
mod cluster;
mod error;
mod pod;
mod settings;
mod teardown;
mod terminal;
mod types;

pub use cache::{ObjectCache, Snapshot};
pub use client::KubeCluster;
pub use cluster::{
    CapacityCluster, Cluster, ClusterFuture, ConsoleCluster, ProvisionCluster, ReaperCluster,
};
pub use error::ClusterError;
pub use pod::{EXEC_OUTPUT_LIMIT, ExecOutput, PodPhase, PodState, PodWait, QuotaSummary};
pub use settings::{ClusterSettings, DEFAULT_USER_AGENT};
pub use teardown::{
    GoneWitness, LabelSweep, ObjectOutcome, Outcome, SessionTarget, TeardownReport, await_gone,
    delete_session_objects, named_objects, teardown_session, teardown_session_within,
};
pub use terminal::{ByteSink, ByteStream, PortStream, ResizeSink, Terminal, TtySize};
pub use types::{
    Condition, Created, DataSourceFacts, DataVolumeFacts, Deleted, Ensured, GoldenFacts, GoldenRef,
    Kind, Lookup, ObjectSummary, Page, Propagation, PvcFacts, VmStatus, VmiPhase, VmiState,
};
