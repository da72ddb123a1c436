//! [`KubeCluster`]: the cluster traits ([`Cluster`](crate::Cluster)) over a kube-rs client.

mod console;
mod convert;
mod exec;
mod listing;
mod pod;
mod portforward;
mod wait;
mod watch;

use std::fmt;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Secret, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
    PropagationPolicy,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, Resource};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::{Semaphore, SemaphorePermit};

use crate::cluster::{
    CapacityCluster, ClusterFuture, ConsoleCluster, ProvisionCluster, ReaperCluster,
};
use crate::pod::{ExecOutput, PodState, PodWait, QuotaSummary};
use crate::types::{
    Created, DataSourceFacts, DataVolumeFacts, Deleted, Ensured, Kind, Lookup, ObjectSummary, Page,
    Propagation, PvcFacts, VmStatus, VmiState,
};
use crate::{ClusterError, ClusterSettings, PortStream, Terminal};

/// The [`Cluster`](crate::Cluster) implementation over a kube-rs [`Client`]: the same code runs in a pod
/// (in-cluster service account), against a kubeconfig, and against kube-sim.
///
/// Every API call holds one permit of a semaphore of
/// [`ClusterSettings::max_in_flight`] and is bounded by
/// [`ClusterSettings::request_timeout`]. Cheap to clone (clones share the client and the
/// semaphore).
#[derive(Clone)]
pub struct KubeCluster {
    inner: Arc<Inner>,
}

struct Inner {
    client: Client,
    namespace: String,
    settings: ClusterSettings,
    permits: Semaphore,
}

impl fmt::Debug for KubeCluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubeCluster")
            .field("namespace", &self.inner.namespace)
            .field("settings", &self.inner.settings)
            .finish_non_exhaustive()
    }
}

impl KubeCluster {
    /// Builds the client the standard way: the in-cluster service account when running in a
    /// pod, else `KUBECONFIG` / `~/.kube/config` (kube-rs' `Config::infer`). Must run inside
    /// a Tokio runtime.
    pub async fn try_default(settings: ClusterSettings) -> Result<Self, ClusterError> {
        let config = Config::infer().await.map_err(|e| ClusterError::Config {
            message: e.to_string(),
        })?;
        Self::from_config(config, settings)
    }

    /// Builds the client from the service account of the pod it runs in (kube-rs'
    /// `Config::incluster`): the server's own cluster, a site with `in_cluster: true`. An
    /// error outside a pod.
    pub fn in_cluster(settings: ClusterSettings) -> Result<Self, ClusterError> {
        let config = Config::incluster().map_err(|e| ClusterError::Config {
            message: format!("in-cluster service account: {e}"),
        })?;
        Self::from_config(config, settings)
    }

    /// Builds the client from an explicit kubeconfig file (its current context), e.g. the one
    /// kube-sim writes. Must run inside a Tokio runtime.
    pub async fn from_kubeconfig(
        path: &Path,
        settings: ClusterSettings,
    ) -> Result<Self, ClusterError> {
        let kubeconfig = Kubeconfig::read_from(path).map_err(|e| ClusterError::Config {
            message: format!("{}: {e}", path.display()),
        })?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| ClusterError::Config {
                message: format!("{}: {e}", path.display()),
            })?;
        Self::from_config(config, settings)
    }

    /// Builds the client from a kube-rs [`Config`]. Must run inside a Tokio runtime (the
    /// client spawns its request buffer). Every request, the console and exec connections
    /// included, carries [`ClusterSettings::user_agent`].
    pub fn from_config(
        mut config: Config,
        settings: ClusterSettings,
    ) -> Result<Self, ClusterError> {
        config.default_retry = settings.retry_throttled;
        let agent = user_agent_header(&settings.user_agent)?;
        config
            .headers
            .retain(|(name, _)| *name != http::header::USER_AGENT);
        config.headers.push((http::header::USER_AGENT, agent));
        let client = Client::try_from(config).map_err(|e| ClusterError::Config {
            message: e.to_string(),
        })?;
        Ok(Self::new(client, settings))
    }

    /// Wraps an existing client. The namespace is `settings.namespace`, else the client's
    /// default namespace.
    pub fn new(client: Client, settings: ClusterSettings) -> Self {
        let namespace = settings
            .namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned());
        let permits = Semaphore::new(settings.max_in_flight.max(1));
        Self {
            inner: Arc::new(Inner {
                client,
                namespace,
                settings,
                permits,
            }),
        }
    }

    /// The settings in use.
    pub fn settings(&self) -> &ClusterSettings {
        &self.inner.settings
    }

    /// The underlying kube-rs client.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    async fn permit(&self) -> Result<SemaphorePermit<'_>, ClusterError> {
        // The semaphore lives as long as `self` and is never closed; the error is for form.
        self.inner
            .permits
            .acquire()
            .await
            .map_err(|_| ClusterError::Unexpected {
                message: "the request semaphore was closed".to_owned(),
            })
    }

    /// Runs one API call under a permit and the request timeout.
    async fn call<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<T, ClusterError> {
        self.call_raw(what, request)
            .await?
            .map_err(ClusterError::from_kube)
    }

    /// [`KubeCluster::call`], leaving the API server's answer unmapped (the outer error is a
    /// timeout or the semaphore).
    async fn call_raw<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<Result<T, kube::Error>, ClusterError> {
        let _permit = self.permit().await?;
        let timeout = self.inner.settings.request_timeout;
        match tokio::time::timeout(timeout, request).await {
            Ok(result) => Ok(result),
            Err(_) => Err(ClusterError::timed_out(what, timeout)),
        }
    }

    /// Runs a create; an answer of `409 AlreadyExists` adopts the object holding the name if
    /// it is this session's ([`KubeCluster::adopt`]). So does a quota's refusal when this
    /// session's object already holds the name: quota admission runs before storage looks at
    /// the name, so a full quota (one the object itself fills) answers a repeated create
    /// with `403 exceeded quota`, not `409`.
    async fn create_or_adopt<T>(
        &self,
        kind: Kind,
        wanted: &ObjectMeta,
        request: impl Future<Output = Result<T, kube::Error>>,
        created: impl FnOnce(&T) -> Result<Created, ClusterError>,
    ) -> Result<Created, ClusterError> {
        match self.call_raw(&format!("create {kind}"), request).await? {
            Ok(object) => created(&object),
            Err(kube::Error::Api(status))
                if status.code == 409 && status.reason == "AlreadyExists" =>
            {
                self.adopt(kind, wanted, status.message).await
            }
            Err(other) => {
                let refused = ClusterError::from_kube(other);
                if let ClusterError::QuotaExceeded { .. } | ClusterError::QuotaPending { .. } =
                    refused
                    && let Some(name) = wanted.name.as_deref()
                    && let Ok(Some(existing)) = self.find_by_name(kind, name).await
                    && adoptable(wanted, &existing).is_ok()
                {
                    tracing::info!(%kind, name, uid = %existing.uid, "adopted an object this session created before (the quota refused the repeated create)");
                    return Ok(Created {
                        kind,
                        name: existing.name,
                        uid: existing.uid,
                    });
                }
                Err(refused)
            }
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.inner.client.clone(), &self.inner.namespace)
    }

    fn ns(&self) -> &str {
        &self.inner.namespace
    }

    fn dynamic(&self, kind: Kind) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.inner.client.clone(),
            &self.inner.namespace,
            &api_resource(kind),
        )
    }

    fn dynamic_cdi(&self, namespace: Option<&str>, kind: &str, plural: &str) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk("cdi.kubevirt.io", "v1beta1", kind);
        Api::namespaced_with(
            self.inner.client.clone(),
            namespace.unwrap_or(&self.inner.namespace),
            &ApiResource::from_gvk_with_plural(&gvk, plural),
        )
    }

    fn post_params(&self) -> PostParams {
        PostParams {
            dry_run: false,
            field_manager: Some(self.inner.settings.field_manager.clone()),
        }
    }

    /// Fills in or checks the namespace of an object about to be created.
    fn claim_namespace(
        &self,
        kind: Kind,
        namespace: &mut Option<String>,
    ) -> Result<(), ClusterError> {
        match namespace {
            None => {
                *namespace = Some(self.inner.namespace.clone());
                Ok(())
            }
            Some(ns) if *ns == self.inner.namespace => Ok(()),
            Some(ns) => Err(ClusterError::Invalid {
                message: format!(
                    "{kind} is for namespace {ns:?}, this client manages {:?}",
                    self.inner.namespace
                ),
            }),
        }
    }

    async fn create_typed<K>(&self, kind: Kind, mut object: K) -> Result<Created, ClusterError>
    where
        K: Resource<Scope = NamespaceResourceScope, DynamicType = ()>
            + Clone
            + Serialize
            + DeserializeOwned
            + fmt::Debug,
    {
        self.claim_namespace(kind, &mut object.meta_mut().namespace)?;
        let api: Api<K> = Api::namespaced(self.inner.client.clone(), &self.inner.namespace);
        let pp = self.post_params();
        self.create_or_adopt(kind, object.meta(), api.create(&pp, &object), |c: &K| {
            convert::created(kind, c.meta())
        })
        .await
    }

    /// After a create answered `409 AlreadyExists`: reads the object that holds the name and
    /// adopts it when its labels say it is the same session's (same environment and session
    /// as the object that was to be created) and it is not being deleted — a create whose
    /// reply was lost, or one made twice, ends as if it had been made once. Any other holder
    /// of the name is a [`ClusterError::Conflict`] that says whose it is.
    async fn adopt(
        &self,
        kind: Kind,
        wanted: &ObjectMeta,
        conflict: String,
    ) -> Result<Created, ClusterError> {
        let Some(name) = wanted.name.as_deref() else {
            return Err(ClusterError::Conflict { message: conflict });
        };
        let existing = self.find_by_name(kind, name).await?;
        let Some(existing) = existing else {
            // It went between the create and the get: nothing to adopt, the create may now
            // succeed.
            return Err(ClusterError::Transient {
                message: format!(
                    "create {kind} {name}: it existed ({conflict}) and was gone a moment later"
                ),
            });
        };
        match adoptable(wanted, &existing) {
            Ok(()) => {
                tracing::info!(%kind, name, uid = %existing.uid, "adopted an object this session created before");
                Ok(Created {
                    kind,
                    name: existing.name,
                    uid: existing.uid,
                })
            }
            Err(why) => Err(ClusterError::Conflict {
                message: format!("{kind} {name} already exists and {why}"),
            }),
        }
    }

    /// Reads one object's metadata by name with a metadata-only list pinned to the name
    /// (`fieldSelector metadata.name=…`): the `list` both Roles grant on every kind ttlab
    /// creates is all the access it takes (the server may not `get` a Secret).
    async fn find_by_name(
        &self,
        kind: Kind,
        name: &str,
    ) -> Result<Option<ObjectSummary>, ClusterError> {
        check_name(kind.name(), name)?;
        let api = self.dynamic(kind);
        let lp = ListParams::default().fields(&format!("metadata.name={name}"));
        let list = self
            .call(&format!("list {kind} {name}"), api.list_metadata(&lp))
            .await?;
        Ok(list
            .items
            .iter()
            .find(|o| o.metadata.name.as_deref() == Some(name))
            .map(|o| convert::summary(kind, &o.metadata)))
    }

    async fn observe<T>(
        &self,
        what: &str,
        request: impl Future<Output = Result<T, kube::Error>>,
    ) -> Result<Lookup<T>, ClusterError> {
        match self.call(what, request).await {
            Ok(found) => Ok(Lookup::Found(found)),
            Err(ClusterError::NotFound { .. }) => Ok(Lookup::NotFound),
            Err(ClusterError::Forbidden { .. }) => Ok(Lookup::Forbidden),
            Err(other) => Err(other),
        }
    }
}

/// Whether `existing`, found under the name of the object `wanted` was to create, is that
/// object made before: both labelled with the same environment and session
/// (`ttlab_model::labels`), and not being deleted. `Err` says why not.
fn adoptable(wanted: &ObjectMeta, existing: &ObjectSummary) -> Result<(), String> {
    use ttlab_model::labels::{ENV, SESSION};
    let label = |key: &str| wanted.labels.as_ref().and_then(|l| l.get(key));
    let (Some(env), Some(session)) = (label(ENV), label(SESSION)) else {
        return Err("the new one carries no session labels to recognise it by".to_owned());
    };
    let theirs = |key: &str| {
        existing
            .labels
            .get(key)
            .map(String::as_str)
            .unwrap_or("none")
    };
    if existing.labels.get(ENV) != Some(env) || existing.labels.get(SESSION) != Some(session) {
        return Err(format!(
            "is not this session's (it belongs to session {} of environment {}, this is session \
             {session} of environment {env})",
            theirs(SESSION),
            theirs(ENV),
        ));
    }
    if existing.deleting {
        return Err("is being deleted".to_owned());
    }
    Ok(())
}

/// The `User-Agent` header value of `agent`, refused when it could not be sent as a header.
fn user_agent_header(agent: &str) -> Result<http::HeaderValue, ClusterError> {
    let agent = agent.trim();
    if agent.is_empty() {
        return Err(ClusterError::Config {
            message: "the User-Agent is empty".to_owned(),
        });
    }
    http::HeaderValue::from_str(agent).map_err(|_| ClusterError::Config {
        message: format!("{agent:?} cannot be sent as a User-Agent header"),
    })
}

/// The kube-rs API resource of a kind.
fn api_resource(kind: Kind) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(kind.group(), kind.version(), kind.name()),
        kind.plural(),
    )
}

/// Refuses names that are not Kubernetes object names before they are put in a URL path.
fn check_name(kind: &str, name: &str) -> Result<(), ClusterError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name
            .bytes()
            .next()
            .is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .last()
            .is_some_and(|b| b.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(ClusterError::Invalid {
            message: format!("{name:?} is not a valid {kind} name"),
        })
    }
}

impl ReaperCluster for KubeCluster {
    fn namespace(&self) -> &str {
        &self.inner.namespace
    }

    fn get<'a>(&'a self, kind: Kind, name: &'a str) -> ClusterFuture<'a, Option<ObjectSummary>> {
        Box::pin(async move {
            check_name(kind.name(), name)?;
            // Metadata only (`as=PartialObjectMetadata`): the summary needs nothing else, and
            // a cloud-init Secret carries the whole guest agent.
            let api = self.dynamic(kind);
            let found = self
                .call(&format!("get {kind} {name}"), api.get_metadata_opt(name))
                .await?;
            Ok(found.map(|o| convert::summary(kind, &o.metadata)))
        })
    }

    fn find<'a>(&'a self, kind: Kind, name: &'a str) -> ClusterFuture<'a, Option<ObjectSummary>> {
        Box::pin(self.find_by_name(kind, name))
    }

    fn cached_listing(
        &self,
        kind: Kind,
        selector: &str,
        max_age: Duration,
    ) -> Option<crate::ObjectCache> {
        Some(self.object_cache(kind, selector, max_age))
    }

    fn list_page<'a>(
        &'a self,
        kind: Kind,
        selector: &'a str,
        continue_token: Option<String>,
    ) -> ClusterFuture<'a, Page> {
        Box::pin(async move {
            let mut lp = ListParams::default().limit(self.inner.settings.page_size.max(1));
            if !selector.is_empty() {
                lp = lp.labels(selector);
            }
            if let Some(token) = continue_token.as_deref() {
                lp = lp.continue_token(token);
            }
            // Metadata only (`as=PartialObjectMetadataList`): a page of 500 cloud-init
            // Secrets in full would be hundreds of megabytes (each embeds the guest agent),
            // and a summary needs names, labels, owners and timestamps alone.
            let api = self.dynamic(kind);
            let list = self
                .call(&format!("list {kind}"), api.list_metadata(&lp))
                .await?;
            Ok(Page {
                items: list
                    .items
                    .iter()
                    .map(|o| convert::summary(kind, &o.metadata))
                    .collect(),
                continue_token: list.metadata.continue_.filter(|t| !t.is_empty()),
            })
        })
    }

    fn delete<'a>(
        &'a self,
        kind: Kind,
        name: &'a str,
        propagation: Propagation,
    ) -> ClusterFuture<'a, Deleted> {
        Box::pin(async move {
            check_name(kind.name(), name)?;
            let dp = DeleteParams {
                propagation_policy: Some(match propagation {
                    Propagation::Background => PropagationPolicy::Background,
                    Propagation::Foreground => PropagationPolicy::Foreground,
                }),
                ..DeleteParams::default()
            };
            let api = self.dynamic(kind);
            match self
                .call(&format!("delete {kind} {name}"), api.delete(name, &dp))
                .await
            {
                // The API server answers with the object as it now is when the deletion left
                // it in place (marked with a `deletionTimestamp`: a finalizer or a grace
                // period holds it), and with a Status — or, for a custom resource, the object
                // as it was, unmarked — when it removed the object at once.
                Ok(answer) => Ok(match answer.left() {
                    Some(o) if o.metadata.deletion_timestamp.is_some() => Deleted::Deleted,
                    _ => Deleted::Removed,
                }),
                Err(ClusterError::NotFound { .. }) => Ok(Deleted::AlreadyGone),
                Err(other) => Err(other),
            }
        })
    }
}

impl ProvisionCluster for KubeCluster {
    fn create_vm(&self, vm: serde_json::Value) -> ClusterFuture<'_, Created> {
        Box::pin(async move {
            let kind = Kind::VirtualMachine;
            let mut object: DynamicObject = convert::dynamic_of_kind(kind, vm)?;
            self.claim_namespace(kind, &mut object.metadata.namespace)?;
            let api = self.dynamic(kind);
            let pp = self.post_params();
            self.create_or_adopt(
                kind,
                &object.metadata,
                api.create(&pp, &object),
                |c: &DynamicObject| convert::created(kind, &c.metadata),
            )
            .await
        })
    }

    fn create_secret(&self, secret: Secret) -> ClusterFuture<'_, Created> {
        Box::pin(self.create_typed(Kind::Secret, secret))
    }

    fn create_service(&self, service: Service) -> ClusterFuture<'_, Created> {
        Box::pin(self.create_typed(Kind::Service, service))
    }

    fn create_network_policy(&self, policy: NetworkPolicy) -> ClusterFuture<'_, Created> {
        Box::pin(self.create_typed(Kind::NetworkPolicy, policy))
    }

    fn create_pod(&self, pod: Pod) -> ClusterFuture<'_, Created> {
        Box::pin(self.create_typed(Kind::Pod, pod))
    }

    fn ensure_config_map(&self, config_map: ConfigMap) -> ClusterFuture<'_, Ensured> {
        Box::pin(async move {
            let kind = Kind::ConfigMap;
            let mut config_map = config_map;
            let name = config_map.metadata.name.clone().unwrap_or_default();
            check_name(kind.name(), &name)?;
            self.claim_namespace(kind, &mut config_map.metadata.namespace)?;
            let wanted = config_map.metadata.annotations.clone().unwrap_or_default();
            let same = |found: &ObjectMeta| -> Result<Ensured, ClusterError> {
                if found.deletion_timestamp.is_some() {
                    return Err(ClusterError::Transient {
                        message: format!("{kind} {name} is being deleted"),
                    });
                }
                let theirs = found.annotations.clone().unwrap_or_default();
                match wanted.iter().find(|(k, v)| theirs.get(*k) != Some(*v)) {
                    None => Ok(Ensured::Present),
                    Some((key, value)) => Err(ClusterError::Conflict {
                        message: format!(
                            "{kind} {name} already exists with another content ({key} is {:?}, \
                             not {value:?})",
                            theirs.get(key).map_or("absent", String::as_str)
                        ),
                    }),
                }
            };
            let api = self.dynamic(kind);
            let what = format!("get {kind} {name}");
            if let Some(found) = self.call(&what, api.get_metadata_opt(&name)).await? {
                return same(&found.metadata);
            }
            let typed: Api<ConfigMap> =
                Api::namespaced(self.inner.client.clone(), &self.inner.namespace);
            let pp = self.post_params();
            match self
                .call_raw(
                    &format!("create {kind} {name}"),
                    typed.create(&pp, &config_map),
                )
                .await?
            {
                Ok(_) => Ok(Ensured::Created),
                Err(kube::Error::Api(status))
                    if status.code == 409 && status.reason == "AlreadyExists" =>
                {
                    match self.call(&what, api.get_metadata_opt(&name)).await? {
                        Some(found) => same(&found.metadata),
                        None => Err(ClusterError::Transient {
                            message: format!(
                                "create {kind} {name}: it existed and was gone a moment later"
                            ),
                        }),
                    }
                }
                Err(other) => Err(ClusterError::from_kube(other)),
            }
        })
    }

    fn observe_pvc<'a>(
        &'a self,
        namespace: Option<&'a str>,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<PvcFacts>> {
        Box::pin(async move {
            check_name("PersistentVolumeClaim", name)?;
            let api: Api<PersistentVolumeClaim> = Api::namespaced(
                self.inner.client.clone(),
                namespace.unwrap_or(&self.inner.namespace),
            );
            let found = self
                .observe(&format!("get PersistentVolumeClaim {name}"), api.get(name))
                .await?;
            Ok(match found {
                Lookup::Found(pvc) => Lookup::Found(convert::pvc_facts(&pvc)),
                Lookup::NotFound => Lookup::NotFound,
                Lookup::Forbidden => Lookup::Forbidden,
            })
        })
    }

    fn observe_data_volume<'a>(
        &'a self,
        namespace: Option<&'a str>,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<DataVolumeFacts>> {
        Box::pin(async move {
            check_name("DataVolume", name)?;
            let api = self.dynamic_cdi(namespace, "DataVolume", "datavolumes");
            let found = self
                .observe(&format!("get DataVolume {name}"), api.get(name))
                .await?;
            Ok(match found {
                Lookup::Found(dv) => Lookup::Found(convert::data_volume_facts(&dv)),
                Lookup::NotFound => Lookup::NotFound,
                Lookup::Forbidden => Lookup::Forbidden,
            })
        })
    }

    fn observe_data_source<'a>(
        &'a self,
        name: &'a str,
    ) -> ClusterFuture<'a, Lookup<DataSourceFacts>> {
        Box::pin(async move {
            check_name("DataSource", name)?;
            let api = self.dynamic_cdi(None, "DataSource", "datasources");
            let found = self
                .observe(&format!("get DataSource {name}"), api.get(name))
                .await?;
            Ok(match found {
                Lookup::Found(ds) => Lookup::Found(convert::data_source_facts(&ds)),
                Lookup::NotFound => Lookup::NotFound,
                Lookup::Forbidden => Lookup::Forbidden,
            })
        })
    }

    fn wait_vmi_running<'a>(
        &'a self,
        name: &'a str,
        timeout: Duration,
    ) -> ClusterFuture<'a, VmiState> {
        Box::pin(async move {
            check_name("VirtualMachineInstance", name)?;
            wait::wait_running(self, name, timeout).await
        })
    }

    fn wait_pod_running<'a>(
        &'a self,
        name: &'a str,
        timeout: Duration,
    ) -> ClusterFuture<'a, PodWait> {
        Box::pin(async move {
            check_name("Pod", name)?;
            pod::wait_running(self, name, timeout).await
        })
    }
}

impl ConsoleCluster for KubeCluster {
    fn vmi_state<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<VmiState>> {
        Box::pin(async move {
            check_name("VirtualMachineInstance", name)?;
            let api = self.dynamic(Kind::VirtualMachineInstance);
            let found = self
                .call(
                    &format!("get VirtualMachineInstance {name}"),
                    api.get_opt(name),
                )
                .await?;
            Ok(found.map(|o| convert::vmi_state(&o)))
        })
    }

    fn vm_status<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<VmStatus>> {
        Box::pin(async move {
            check_name("VirtualMachine", name)?;
            let api = self.dynamic(Kind::VirtualMachine);
            let lp = ListParams::default().fields(&format!("metadata.name={name}"));
            let list = self
                .call(&format!("list VirtualMachine {name}"), api.list(&lp))
                .await?;
            Ok(list
                .items
                .iter()
                .find(|o| o.metadata.name.as_deref() == Some(name))
                .map(convert::vm_status))
        })
    }

    fn pod_state<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Option<PodState>> {
        Box::pin(async move {
            check_name("Pod", name)?;
            let found = self
                .call(&format!("get Pod {name}"), self.pods().get_opt(name))
                .await?;
            Ok(found.as_ref().map(pod::pod_state))
        })
    }

    fn open_console<'a>(&'a self, name: &'a str) -> ClusterFuture<'a, Terminal> {
        Box::pin(async move {
            check_name("VirtualMachineInstance", name)?;
            let _permit = self.permit().await?;
            let timeout = self.inner.settings.request_timeout;
            let open = console::open(
                &self.inner.client,
                &self.inner.namespace,
                name,
                self.inner.settings.console_ping_interval,
            );
            match tokio::time::timeout(timeout, open).await {
                Ok(result) => result,
                Err(_) => Err(ClusterError::timed_out(
                    &format!("console of VirtualMachineInstance {name}"),
                    timeout,
                )),
            }
        })
    }

    fn open_portforward<'a>(&'a self, name: &'a str, port: u16) -> ClusterFuture<'a, PortStream> {
        Box::pin(async move {
            check_name("VirtualMachineInstance", name)?;
            let _permit = self.permit().await?;
            let timeout = self.inner.settings.request_timeout;
            let open = portforward::open(&self.inner.client, &self.inner.namespace, name, port);
            match tokio::time::timeout(timeout, open).await {
                Ok(result) => result,
                Err(_) => Err(ClusterError::timed_out(
                    &format!("port forward to port {port} of VirtualMachineInstance {name}"),
                    timeout,
                )),
            }
        })
    }

    fn exec_pod<'a>(
        &'a self,
        pod: &'a str,
        container: Option<&'a str>,
        command: Vec<String>,
    ) -> ClusterFuture<'a, Terminal> {
        Box::pin(async move {
            check_name("Pod", pod)?;
            if command.is_empty() {
                return Err(ClusterError::Invalid {
                    message: "exec needs a command".to_owned(),
                });
            }
            let api: Api<Pod> = Api::namespaced(self.inner.client.clone(), &self.inner.namespace);
            let process = self
                .call(
                    &format!("exec in Pod {pod}"),
                    exec::attach(&api, pod, container, command),
                )
                .await?;
            exec::terminal(process)
        })
    }

    fn exec_pod_command<'a>(
        &'a self,
        pod: &'a str,
        container: Option<&'a str>,
        command: Vec<String>,
        timeout: Duration,
    ) -> ClusterFuture<'a, ExecOutput> {
        Box::pin(async move {
            check_name("Pod", pod)?;
            if command.is_empty() {
                return Err(ClusterError::Invalid {
                    message: "exec needs a command".to_owned(),
                });
            }
            pod::exec_command(self, pod, container, command, timeout).await
        })
    }
}

impl CapacityCluster for KubeCluster {
    fn resource_quotas(&self) -> ClusterFuture<'_, Vec<QuotaSummary>> {
        Box::pin(pod::quotas(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_escape_a_url_path_are_refused() {
        for bad in [
            "",
            "a/b",
            "../x",
            "A",
            "a b",
            "-a",
            "a-",
            "x?y=1",
            &"a".repeat(254),
        ] {
            assert!(check_name("Pod", bad).is_err(), "{bad:?}");
        }
        for good in ["a", "vm-1", "golden.ubuntu-22", "0abc"] {
            assert!(check_name("Pod", good).is_ok(), "{good:?}");
        }
    }

    /// Accepts one connection, reads one request head, answers 404 with a Kubernetes
    /// `Status`, and returns the head in lower case.
    async fn answer_one(listener: &tokio::net::TcpListener) -> String {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let (mut socket, _) = listener.accept().await.expect("a connection");
        let mut head = Vec::new();
        let mut chunk = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = socket.read(&mut chunk).await.expect("the request");
            if n == 0 {
                break;
            }
            head.extend_from_slice(&chunk[..n]);
        }
        let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound","code":404,"message":"not found"}"#;
        let answer = format!(
            "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(answer.as_bytes()).await.expect("answered");
        String::from_utf8_lossy(&head).to_lowercase()
    }

    async fn user_agent_sent(settings: ClusterSettings) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: http::Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let cluster = KubeCluster::from_config(Config::new(url), settings).unwrap();
        let (head, got) = tokio::join!(answer_one(&listener), cluster.get(Kind::Secret, "s"));
        assert_eq!(got.unwrap(), None);
        head.lines()
            .find_map(|l| l.strip_prefix("user-agent:"))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no User-Agent in {head}"))
    }

    #[tokio::test]
    async fn every_request_names_the_program_in_its_user_agent() {
        let server = ClusterSettings {
            user_agent: "ttlab-server/0.1.0".to_owned(),
            ..ClusterSettings::in_namespace("ns")
        };
        assert_eq!(user_agent_sent(server).await, "ttlab-server/0.1.0");
        let unnamed = ClusterSettings::in_namespace("ns");
        assert_eq!(
            user_agent_sent(unnamed).await,
            concat!("ttlab/", env!("CARGO_PKG_VERSION"))
        );
    }

    #[test]
    fn a_user_agent_that_cannot_be_a_header_is_a_configuration_error() {
        for bad in ["", "  ", "ttlab\nx: y"] {
            assert!(
                matches!(user_agent_header(bad), Err(ClusterError::Config { .. })),
                "{bad:?}"
            );
        }
        assert!(user_agent_header("ttlab-reaper/0.1.0").is_ok());
    }

    #[test]
    fn api_resources_name_the_real_groups() {
        let vm = api_resource(Kind::VirtualMachine);
        assert_eq!(vm.api_version, "kubevirt.io/v1");
        assert_eq!(vm.plural, "virtualmachines");
        let np = api_resource(Kind::NetworkPolicy);
        assert_eq!(np.api_version, "networking.k8s.io/v1");
        let secret = api_resource(Kind::Secret);
        assert_eq!(secret.api_version, "v1");
        assert_eq!(secret.group, "");
    }
}
