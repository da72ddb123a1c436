//! The cluster traits: every Kubernetes operation the server and the reaper perform, split by
//! who needs it, so each caller holds only what it uses. [`ReaperCluster`] (ttlab's objects by
//! name and label: get, find, list, delete) is all the reaper and a session's teardown use;
//! the server's provisioning adds [`ProvisionCluster`], its console and grading
//! [`ConsoleCluster`], its capacity count and admin view [`CapacityCluster`]. [`Cluster`] is
//! all four, what the server holds; [`KubeCluster`](crate::KubeCluster) implements each.

use std::net::IpAddr;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;

use crate::pod::{ExecOutput, PodState, PodWait, QuotaSummary};
use crate::types::{
    Created, DataSourceFacts, DataVolumeFacts, Deleted, Ensured, GoldenFacts, GoldenRef, Kind,
    Lookup, ObjectSummary, Page, Propagation, PvcFacts, VmStatus, VmiState,
};
use crate::{ClusterError, ObjectCache, PortStream, Terminal};

/// The future every cluster method returns: boxed, `Send`, borrowing its arguments.
pub type ClusterFuture<'a, T> = BoxFuture<'a, Result<T, ClusterError>>;

/// Everything ttlab does to Kubernetes, in one namespace: [`ReaperCluster`],
/// [`ProvisionCluster`], [`ConsoleCluster`] and [`CapacityCluster`] together, implemented for
/// every type that implements the four.
///
/// Methods return boxed futures ([`ClusterFuture`]) rather than being `async fn`s, so the
/// traits stay dyn-compatible: the server holds an `Arc<dyn Cluster>` (and hands out
/// `&dyn ReaperCluster` or `Arc<dyn ConsoleCluster>` where that is all a part needs), the
/// reaper an `Arc<dyn ReaperCluster>`, and unit tests of pure logic may substitute their own
/// implementation. The one real implementation is [`KubeCluster`](crate::KubeCluster).
///
/// Conventions: a missing object is `Ok(None)` / [`Deleted::AlreadyGone`] where absence is an
/// answer (get, delete), and [`ClusterError::NotFound`] where it is a failure (the VMI of a
/// console). Creates never update, and are safe to repeat: an object already holding the
/// name that carries the same environment and session labels (`ttlab_model::labels`) as the
/// one to create, and is not being deleted, is adopted — the create returns it as if it had
/// made it (a create whose reply was lost, or that the client retried after it was applied);
/// any other holder of the name is a [`ClusterError::Conflict`] that names whose it is.
pub trait Cluster: ReaperCluster + ProvisionCluster + ConsoleCluster + CapacityCluster {}

impl<T> Cluster for T where
    T: ReaperCluster + ProvisionCluster + ConsoleCluster + CapacityCluster + ?Sized
{
}

/// What the reaper needs, and all a session's teardown uses: ttlab's objects by name and by
/// label — read, listed page by page or from a watch-fed listing, and deleted. The reaper holds
/// an `Arc<dyn ReaperCluster>`; the server's [`Cluster`] is one too (upcast to it where only
/// this is needed, as [`teardown_session`](crate::teardown_session) takes it).
pub trait ReaperCluster: Send + Sync {
    /// The namespace every call works in.
    fn namespace(&self) -> &str;

    /// Reads one object's metadata by name; `Ok(None)` if it does not exist (the reaper's
    /// direct get before it declares a session a ghost).
    fn get<'a>(&'a self, kind: Kind, name: &'a str) -> ClusterFuture<'a, Option<ObjectSummary>>;

    /// Looks for one object by name, to confirm it is gone after its deletion was accepted:
    /// `Ok(None)` once it is absent, its summary (with [`ObjectSummary::deleting`]) while it
    /// lingers — a VM whose guest is still shutting down, an object held by a finalizer.
    /// [`KubeCluster`](crate::KubeCluster) reads it with a metadata-only `list` pinned to the
    /// name, which both Roles grant on every kind ttlab creates; the default is
    /// [`ReaperCluster::get`].
    fn find<'a>(&'a self, kind: Kind, name: &'a str) -> ClusterFuture<'a, Option<ObjectSummary>> {
        self.get(kind, name)
    }

    /// A listing of the objects of `kind` matching the label `selector` kept current by a
    /// watch and rebuilt from a full list at least every `max_age` (see [`ObjectCache`]), for
    /// a caller that would otherwise list them again and again; `None` where the cluster
    /// offers none (the default), and the caller lists. Call inside a tokio runtime.
    fn cached_listing(&self, kind: Kind, selector: &str, max_age: Duration) -> Option<ObjectCache> {
        let _ = (kind, selector, max_age);
        None
    }

    /// Reads one page of the objects of `kind` matching the label `selector`, starting at
    /// `continue_token` (`None` for the first page). The page size is the client's setting.
    /// Only metadata travels (a `PartialObjectMetadataList`): listing cloud-init Secrets never
    /// downloads their payloads.
    fn list_page<'a>(
        &'a self,
        kind: Kind,
        selector: &'a str,
        continue_token: Option<String>,
    ) -> ClusterFuture<'a, Page>;

    /// Reads every object of `kind` matching `selector`, page by page (each page is a
    /// separate call under the concurrency limit).
    fn list_all<'a>(
        &'a self,
        kind: Kind,
        selector: &'a str,
    ) -> ClusterFuture<'a, Vec<ObjectSummary>> {
        Box::pin(async move {
            let mut all = Vec::new();
            let mut token = None;
            loop {
                let page = self.list_page(kind, selector, token).await?;
                all.extend(page.items);
                match page.continue_token {
                    Some(t) => token = Some(t),
                    None => return Ok(all),
                }
            }
        })
    }

    /// Deletes one object by name. A missing object is [`Deleted::AlreadyGone`], a success:
    /// someone else already did it.
    fn delete<'a>(
        &'a self,
        kind: Kind,
        name: &'a str,
        propagation: Propagation,
    ) -> ClusterFuture<'a, Deleted>;
}

/// What the server's provisioning needs besides [`ReaperCluster`] (which its rollback uses):
/// creating a session's objects, making sure of the agent's ConfigMap, observing the golden
/// disk, and waiting for a VMI or a Pod to run.
pub trait ProvisionCluster: Send + Sync {
    /// Creates a `kubevirt.io/v1` VirtualMachine from its JSON manifest (the object must say
    /// `kind: VirtualMachine`; a missing namespace is filled in, a different one is refused).
    /// Returns its uid, which the VM's Secret (and, in multi-VM sessions, the other objects)
    /// name as their owner.
    fn create_vm(&self, vm: serde_json::Value) -> ClusterFuture<'_, Created>;

    /// Creates a Secret. Create only — ttlab never updates or patches a Secret, so its owner
    /// reference must be in `secret` already (create the VM first, then the Secret with
    /// [`Created::owner_reference`] of the VM).
    fn create_secret(&self, secret: Secret) -> ClusterFuture<'_, Created>;

    /// Creates a Service.
    fn create_service(&self, service: Service) -> ClusterFuture<'_, Created>;

    /// Creates a NetworkPolicy.
    fn create_network_policy(&self, policy: NetworkPolicy) -> ClusterFuture<'_, Created>;

    /// Creates a Pod.
    fn create_pod(&self, pod: Pod) -> ClusterFuture<'_, Created>;

    /// Makes sure the ConfigMap `config_map` (shared, immutable: the agent of one version)
    /// exists: reads its metadata by name (`get`), and creates it if absent. Never updates.
    /// Found — or created meanwhile by another process (`409 AlreadyExists`) — with every
    /// annotation `config_map` carries (the agent's digest) is [`Ensured::Present`]; a holder
    /// of the name with other annotations is a [`ClusterError::Conflict`], one being deleted
    /// a [`ClusterError::Transient`] (retry: it is gone in a moment).
    fn ensure_config_map(&self, config_map: ConfigMap) -> ClusterFuture<'_, Ensured>;

    /// Observes a PersistentVolumeClaim in `namespace` (`None`: the client's namespace).
    fn observe_pvc<'a>(
        &'a self,
        namespace: Option<&'a str>,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<PvcFacts>>;

    /// Observes a CDI DataVolume in `namespace` (`None`: the client's namespace).
    fn observe_data_volume<'a>(
        &'a self,
        namespace: Option<&'a str>,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<DataVolumeFacts>>;

    /// Observes a CDI DataSource in the client's namespace.
    fn observe_data_source<'a>(
        &'a self,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<DataSourceFacts>>;

    /// Observes a golden disk: resolves a DataSource to its current PVC, then observes that
    /// PVC and the DataVolume named like it. Missing and forbidden objects are facts, not
    /// errors; only failures to get an answer at all (transient errors) are errors.
    fn observe_golden<'a>(&'a self, golden: &'a GoldenRef) -> ClusterFuture<'a, GoldenFacts> {
        Box::pin(async move {
            let (data_source, pvc_ref) = match golden {
                GoldenRef::Pvc(name) => (None, Some((None, name.clone()))),
                GoldenRef::DataSource(name) => {
                    let ds = self.observe_data_source(name).await?;
                    let target = ds
                        .found()
                        .and_then(|f| Some((f.pvc_namespace.clone(), f.pvc_name.clone()?)));
                    (Some(ds), target)
                }
            };
            let Some((namespace, pvc_name)) = pvc_ref else {
                return Ok(GoldenFacts {
                    data_source,
                    pvc: None,
                    data_volume: None,
                });
            };
            let pvc = self.observe_pvc(namespace.as_deref(), &pvc_name).await?;
            let data_volume = self
                .observe_data_volume(namespace.as_deref(), &pvc_name)
                .await?;
            Ok(GoldenFacts {
                data_source,
                pvc: Some(pvc),
                data_volume: Some(data_volume),
            })
        })
    }

    /// Waits, by watching (not polling), until the VMI `name` is `Running`, and returns its
    /// state then. The VMI need not exist yet (KubeVirt creates it shortly after the VM).
    ///
    /// Fails with [`ClusterError::WaitTimedOut`] after `timeout`, carrying the last state
    /// seen (a VMI whose PVC is missing stays `Pending` for ever: this timeout is the only
    /// way out), and with [`ClusterError::VmiEnded`] as soon as the VMI is `Succeeded` or
    /// `Failed`.
    fn wait_vmi_running<'a>(
        &'a self,
        name: &'a str,
        timeout: Duration,
    ) -> ClusterFuture<'a, VmiState>;

    /// Waits, by watching (not polling), until the Pod `name` is `Running` and ready. The
    /// Pod need not exist yet. How the wait ended is a value ([`PodWait`]): running, ended
    /// (`Succeeded`/`Failed`, or deleted) or timed out with the last state seen; only a
    /// failure to get answers at all is an error.
    fn wait_pod_running<'a>(
        &'a self,
        name: &'a str,
        timeout: Duration,
    ) -> ClusterFuture<'a, PodWait>;
}

/// What the server's console and grading need of a running lab: its VMI's or Pod's state
/// and address, the VM's status (why a console ended), the serial console, a guest's port
/// through the API server (the agent, where the server cannot reach the VMI's address), and
/// commands in a pod (a shell for the terminal, one command for grading).
pub trait ConsoleCluster: Send + Sync {
    /// Reads a VMI's state; `Ok(None)` if there is no VMI of that name.
    fn vmi_state<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<VmiState>>;

    /// The VMI's IP address (`status.interfaces[0].ipAddress`), where its agent listens;
    /// `Ok(None)` until reported. [`ClusterError::NotFound`] if there is no such VMI.
    fn vmi_ip<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<IpAddr>> {
        Box::pin(async move {
            match self.vmi_state(name).await? {
                Some(state) => Ok(state.ip),
                None => Err(ClusterError::NotFound {
                    message: format!("VirtualMachineInstance {name}"),
                }),
            }
        })
    }

    /// Reads a VirtualMachine's status (is it meant to run, stopped, restarting?); `Ok(None)` if
    /// there is no VM of that name. Read with a list pinned to the name (`fieldSelector
    /// metadata.name=…`), so the `list` the capacity count needs is all the access it takes.
    fn vm_status<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<VmStatus>>;

    /// Reads a Pod's state (phase, readiness, address); `Ok(None)` if there is no such Pod.
    fn pod_state<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<PodState>>;

    /// Opens the VMI's serial console (`plain.kubevirt.io`: raw bytes in binary frames).
    /// KubeVirt allows one console per VMI: opening one closes the previous connection.
    /// [`ClusterError::ConsoleNotReady`] while the VMI is not running (retry each second),
    /// [`ClusterError::Conflict`] if it has failed, [`ClusterError::NotFound`] if absent.
    fn open_console<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Terminal>;

    /// Opens a TCP connection to `port` of the VMI's guest through the API server (KubeVirt's
    /// `portforward` subresource: `plain.kubevirt.io`, the connection's bytes in binary
    /// frames), for a server that cannot reach the VMI's address itself. Each call is a
    /// connection of its own. [`ClusterError::PortUnreachable`] while the VMI has no address
    /// or nothing answers on the port (retry), [`ClusterError::Forbidden`] without `get` on
    /// `virtualmachineinstances/portforward`, [`ClusterError::NotFound`] if there is no VMI.
    fn open_portforward<'a>(&'a self, name: &'a str, port: u16) -> ClusterFuture<'a, PortStream>;

    /// Runs `command` in a pod's container (`None`: the pod's only or default container)
    /// with a TTY and stdin attached, for pod labs.
    fn exec_pod<'a>(
        &'a self,
        pod: &'a str,
        container: Option<&'a str>,
        command: Vec<String>,
    ) -> ClusterFuture<'a, Terminal>;

    /// Runs one command in a Pod's container (`None`: its only or default container)
    /// without a TTY or stdin, and returns its exit status and output (for grading pod
    /// labs). A command still running after `timeout` is abandoned and reported as timed
    /// out.
    fn exec_pod_command<'a>(
        &'a self,
        pod: &'a str,
        container: Option<&'a str>,
        command: Vec<String>,
        timeout: Duration,
    ) -> ClusterFuture<'a, ExecOutput>;
}

/// What the capacity count and the admin page's capacity view need besides listing objects:
/// the VMs that hold memory, and the namespace's quotas.
pub trait CapacityCluster: ReaperCluster {
    /// Counts the VirtualMachines in the namespace that ttlab manages, whatever their
    /// environment (`ttlab_model::labels::managed_selector`): ghosts and the other
    /// environment's VMs hold node memory too. VMs being deleted still count, since their
    /// guests hold memory until they are gone.
    fn count_live_vms(&self) -> ClusterFuture<'_, usize> {
        Box::pin(async move {
            let selector = ttlab_model::labels::managed_selector();
            Ok(self.list_all(Kind::VirtualMachine, &selector).await?.len())
        })
    }

    /// The namespace's ResourceQuotas with their limits and usage (the second layer of the
    /// capacity limit, after the VM count), sorted by name.
    fn resource_quotas(&self) -> ClusterFuture<'_, Vec<QuotaSummary>>;
}
