//! The sites of this server at run time: per site its configuration ([`ttlab_site::Site`]),
//! its cluster client (or why none could be built), its own capacity turn, listing of VMs
//! and probe health. A session lives on the site its row names; everything done for it later
//! goes to that site's client ([`crate::AppState::site_of`]), and a start is placed among the
//! sites that answer and have room (`saga::open`).
//!
//! A site whose client could not be built at start-up is kept, unreachable, with the reason:
//! its client is [`Unconnected`], which answers every call with that reason, so one site's
//! bad kubeconfig never stops the others.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use ttlab_cluster::{
    CapacityCluster, Cluster, ClusterError, ClusterFuture, ConsoleCluster, Created,
    DataSourceFacts, DataVolumeFacts, Deleted, Ensured, ExecOutput, Kind, Lookup, ObjectSummary,
    Page, PodState, PodWait, PortStream, ProvisionCluster, PvcFacts, QuotaSummary, ReaperCluster,
    Terminal, VmStatus, VmiState,
};
use ttlab_model::LessonId;
use ttlab_site::{AgentPath, Reachability, Site, SiteName};

use crate::ClusterHealth;
use crate::state::ListedVms;

/// One site at run time. Cheap to share (`Arc`).
pub struct SiteRuntime {
    site: Site,
    cluster: Arc<dyn Cluster>,
    /// Why no client could be built (`None`: it was).
    client_error: Option<String>,
    /// Whether this runtime stands for a site the server is not configured with (a session
    /// row naming a site no longer in the sites file).
    configured: bool,
    capacity: tokio::sync::Mutex<()>,
    listed_vms: tokio::sync::Mutex<Option<ListedVms>>,
    health: Mutex<ClusterHealth>,
    /// The lessons whose golden disk its last observation found ready
    /// ([`crate::tasks::golden_disks`]).
    golden_ready: Mutex<BTreeSet<LessonId>>,
}

impl std::fmt::Debug for SiteRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SiteRuntime")
            .field("site", &self.site)
            .field("client_error", &self.client_error)
            .finish_non_exhaustive()
    }
}

impl SiteRuntime {
    /// A site and its client.
    pub fn connected(site: Site, cluster: Arc<dyn Cluster>) -> Self {
        Self::build(site, cluster, None, true)
    }

    /// A site whose client could not be built, for `reason`: kept, unreachable, and reported
    /// under its name.
    pub fn unconnected(site: Site, reason: impl Into<String>) -> Self {
        let reason = reason.into();
        let cluster = Arc::new(Unconnected {
            namespace: site.namespace.as_str().to_owned(),
            reason: reason.clone(),
        });
        Self::build(site, cluster, Some(reason), true)
    }

    /// What stands for a site a session row names but this server is not configured with.
    pub(crate) fn missing(name: &SiteName) -> Self {
        let reason = format!("the site {name} is not configured on this server");
        let site = Site {
            name: name.clone(),
            connection: ttlab_site::Connection::Inferred,
            namespace: "unknown"
                .parse()
                .unwrap_or_else(|_| unreachable!("`unknown` is a namespace name")),
            vm_limit: std::num::NonZeroU32::MIN,
            labels: Default::default(),
            weight: std::num::NonZeroU32::MIN,
            agent_path: AgentPath::PodIp,
        };
        let cluster = Arc::new(Unconnected {
            namespace: site.namespace.as_str().to_owned(),
            reason: reason.clone(),
        });
        Self::build(site, cluster, Some(reason), false)
    }

    fn build(
        site: Site,
        cluster: Arc<dyn Cluster>,
        client_error: Option<String>,
        configured: bool,
    ) -> Self {
        let health = ClusterHealth {
            reachable: client_error.as_ref().map(|_| false),
            error: client_error.clone(),
            ..ClusterHealth::default()
        };
        Self {
            site,
            cluster,
            client_error,
            configured,
            capacity: tokio::sync::Mutex::new(()),
            listed_vms: tokio::sync::Mutex::new(None),
            health: Mutex::new(health),
            golden_ready: Mutex::new(BTreeSet::new()),
        }
    }

    /// Its name.
    pub fn name(&self) -> &SiteName {
        &self.site.name
    }

    /// Its configuration.
    pub fn site(&self) -> &Site {
        &self.site
    }

    /// Its cluster client (one that answers every call with an error when none could be
    /// built).
    pub fn cluster(&self) -> &Arc<dyn Cluster> {
        &self.cluster
    }

    /// Most VMs ttlab may run there at once.
    pub fn vm_limit(&self) -> usize {
        usize::try_from(self.site.vm_limit.get()).unwrap_or(usize::MAX)
    }

    /// How the server reaches the agents of its VMs.
    pub fn agent_path(&self) -> AgentPath {
        self.site.agent_path
    }

    /// Whether a client could be built for it.
    pub fn has_client(&self) -> bool {
        self.client_error.is_none()
    }

    /// Whether the server is configured with this site.
    pub fn is_configured(&self) -> bool {
        self.configured
    }

    /// What its last probe found.
    pub fn health(&self) -> ClusterHealth {
        self.health
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Records what a probe found.
    pub(crate) fn update_health(&self, update: impl FnOnce(&mut ClusterHealth)) {
        update(
            &mut self
                .health
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
    }

    /// Whether its last observation found `lesson`'s golden disk ready (`false` before the
    /// first, and with a single site, where none is made).
    pub fn golden_ready(&self, lesson: &LessonId) -> bool {
        self.golden_ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(lesson)
    }

    /// The lessons whose golden disk its last observation found ready, in name order.
    pub fn golden_ready_lessons(&self) -> Vec<LessonId> {
        self.golden_ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// Records whether `lesson`'s golden disk is ready there.
    pub(crate) fn record_golden(&self, lesson: &LessonId, ready: bool) {
        let mut seen = self
            .golden_ready
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if ready {
            seen.insert(lesson.clone());
        } else {
            seen.remove(lesson);
        }
    }

    /// Whether its last probe answered (a site not probed yet has not).
    pub fn answered_last_probe(&self) -> bool {
        self.client_error.is_none() && self.health().reachable == Some(true)
    }

    /// Whether it can be used now, and if not why: no client, or its last probe failed.
    /// A site not probed yet counts as reachable.
    pub fn reachability(&self) -> Reachability {
        if let Some(e) = &self.client_error {
            return Reachability::Unreachable(e.clone());
        }
        let health = self.health();
        match health.reachable {
            Some(false) => Reachability::Unreachable(
                health
                    .error
                    .unwrap_or_else(|| "its API server does not answer".to_owned()),
            ),
            _ => Reachability::Reachable,
        }
    }

    /// Serialises the capacity check of this process on this site, so at most one of its
    /// requests waits on the database's capacity lock of the site at a time.
    pub(crate) async fn capacity_turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.capacity.lock().await
    }

    /// The last listing of the site's VMs the capacity check took (see
    /// `saga::open::listed_vms`).
    pub(crate) fn listed_vms(&self) -> &tokio::sync::Mutex<Option<ListedVms>> {
        &self.listed_vms
    }
}

/// The client of a site none could be built for: every call fails with the reason.
struct Unconnected {
    namespace: String,
    reason: String,
}

impl Unconnected {
    fn fail<'a, T: Send + 'a>(&self) -> ClusterFuture<'a, T> {
        let message = self.reason.clone();
        Box::pin(async move { Err(ClusterError::Config { message }) })
    }
}

impl ReaperCluster for Unconnected {
    fn namespace(&self) -> &str {
        &self.namespace
    }

    fn get<'a>(&'a self, _: Kind, _: &'a str) -> ClusterFuture<'a, Option<ObjectSummary>> {
        self.fail()
    }

    fn list_page<'a>(&'a self, _: Kind, _: &'a str, _: Option<String>) -> ClusterFuture<'a, Page> {
        self.fail()
    }

    fn delete<'a>(
        &'a self,
        _: Kind,
        _: &'a str,
        _: ttlab_cluster::Propagation,
    ) -> ClusterFuture<'a, Deleted> {
        self.fail()
    }
}

impl ProvisionCluster for Unconnected {
    fn create_vm(&self, _: serde_json::Value) -> ClusterFuture<'_, Created> {
        self.fail()
    }

    fn create_secret(&self, _: Secret) -> ClusterFuture<'_, Created> {
        self.fail()
    }

    fn create_service(&self, _: Service) -> ClusterFuture<'_, Created> {
        self.fail()
    }

    fn create_network_policy(&self, _: NetworkPolicy) -> ClusterFuture<'_, Created> {
        self.fail()
    }

    fn create_pod(&self, _: Pod) -> ClusterFuture<'_, Created> {
        self.fail()
    }

    fn ensure_config_map(&self, _: ConfigMap) -> ClusterFuture<'_, Ensured> {
        self.fail()
    }

    fn observe_pvc<'a>(
        &'a self,
        _: Option<&'a str>,
        _: &'a str,
    ) -> ClusterFuture<'a, Lookup<PvcFacts>> {
        self.fail()
    }

    fn observe_data_volume<'a>(
        &'a self,
        _: Option<&'a str>,
        _: &'a str,
    ) -> ClusterFuture<'a, Lookup<DataVolumeFacts>> {
        self.fail()
    }

    fn observe_data_source<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Lookup<DataSourceFacts>> {
        self.fail()
    }

    fn wait_vmi_running<'a>(&'a self, _: &'a str, _: Duration) -> ClusterFuture<'a, VmiState> {
        self.fail()
    }

    fn wait_pod_running<'a>(&'a self, _: &'a str, _: Duration) -> ClusterFuture<'a, PodWait> {
        self.fail()
    }
}

impl ConsoleCluster for Unconnected {
    fn vmi_state<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Option<VmiState>> {
        self.fail()
    }

    fn vmi_ip<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Option<IpAddr>> {
        self.fail()
    }

    fn vm_status<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Option<VmStatus>> {
        self.fail()
    }

    fn pod_state<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Option<PodState>> {
        self.fail()
    }

    fn open_console<'a>(&'a self, _: &'a str) -> ClusterFuture<'a, Terminal> {
        self.fail()
    }

    fn open_portforward<'a>(&'a self, _: &'a str, _: u16) -> ClusterFuture<'a, PortStream> {
        self.fail()
    }

    fn exec_pod<'a>(
        &'a self,
        _: &'a str,
        _: Option<&'a str>,
        _: Vec<String>,
    ) -> ClusterFuture<'a, Terminal> {
        self.fail()
    }

    fn exec_pod_command<'a>(
        &'a self,
        _: &'a str,
        _: Option<&'a str>,
        _: Vec<String>,
        _: Duration,
    ) -> ClusterFuture<'a, ExecOutput> {
        self.fail()
    }
}

impl CapacityCluster for Unconnected {
    fn resource_quotas(&self) -> ClusterFuture<'_, Vec<QuotaSummary>> {
        self.fail()
    }
}
