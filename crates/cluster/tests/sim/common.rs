//! A cluster per test — kube-sim in process, or a fresh namespace of the real control plane of
//! `ttlab-envtest` with KubeVirt and the kubelet simulated by `ttlab-kubevirt-sim` — and the
//! kube-rs cluster client under test pointed at it through a kubeconfig.
//!
//! On the real control plane the client under test is the cluster administrator confined to
//! the test's namespace by its settings: what is under test is the client's compatibility
//! with a real API server (its validation, its asynchronous garbage collection and quota,
//! its answers), not what a Role allows. Fixtures the API has a way to make (a quota, a PVC
//! and its status, a ServiceAccount without rights) are made through the API as the
//! administrator; what only kube-sim can do (faults, latency, call records with arrival
//! times, stopping the server) is reached through [`Harness::sim`], which panics elsewhere.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use serde_json::{Value, json};
use ttlab_cluster::{ClusterError, ClusterSettings, KubeCluster};
use ttlab_kube_sim::{FaultRule, KubeSim, SimConfig, Verb};
use ttlab_kubevirt_sim::{KubevirtSim, SimSettings};
use ttlab_model::SessionId;
use ttlab_model::labels::ObjectLabels;

/// The namespace of tests on kube-sim (`SimConfig::for_tests` creates it).
pub const SIM_NS: &str = "ttlab";

/// Where the objects live.
pub enum Backend {
    /// kube-sim, in process.
    Sim(KubeSim),
    /// The real control plane shared by this test process; this test has a namespace of its
    /// own there.
    Real {
        plane: &'static ttlab_envtest::ControlPlane,
        /// KubeVirt and the kubelet for the test's namespace (`None` once paused).
        kubevirt: Mutex<Option<KubevirtSim>>,
        _guests: tempfile::TempDir,
    },
}

/// A cluster and a client of it.
pub struct Harness {
    pub backend: Backend,
    /// The namespace the client works in.
    pub ns: String,
    /// The client under test.
    pub cluster: KubeCluster,
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

/// A call the client under test made, as either backend records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenCall {
    /// The RBAC verb (`get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, ...).
    pub verb: String,
    /// The resource, with `/subresource` when there is one.
    pub resource: String,
}

impl SeenCall {
    /// Whether the call only reads.
    pub fn is_read(&self) -> bool {
        matches!(self.verb.as_str(), "get" | "list" | "watch")
    }
}

/// `settings` working in `ns`.
fn in_ns(settings: ClusterSettings, ns: &str) -> ClusterSettings {
    ClusterSettings {
        namespace: Some(ns.to_owned()),
        ..settings
    }
}

impl Harness {
    /// kube-sim with the default client settings.
    pub async fn start() -> Self {
        Self::start_with(ClusterSettings::default()).await
    }

    /// kube-sim with `settings` (their namespace is the harness's).
    pub async fn start_with(settings: ClusterSettings) -> Self {
        Self::start_sim(SimConfig::for_tests(), settings).await
    }

    pub async fn start_sim(config: SimConfig, settings: ClusterSettings) -> Self {
        let sim = KubeSim::start(config).await.expect("kube-sim starts");
        let dir = tempfile::tempdir().expect("temporary directory");
        let kubeconfig = dir.path().join("kubeconfig");
        sim.write_kubeconfig(&kubeconfig, SIM_NS)
            .expect("kubeconfig written");
        let cluster = KubeCluster::from_kubeconfig(&kubeconfig, in_ns(settings, SIM_NS))
            .await
            .expect("client from the sim's kubeconfig");
        Self {
            backend: Backend::Sim(sim),
            ns: SIM_NS.to_owned(),
            cluster,
            kubeconfig,
            _dir: dir,
        }
    }

    /// A fresh namespace of the real control plane, KubeVirt and the kubelet simulated for
    /// it, and a client with `settings` as the administrator. `None` (after `skip_or_fail`: a
    /// failure under CI=true) when the control plane's binaries are missing.
    pub async fn start_real(settings: ClusterSettings) -> Option<Self> {
        let plane = ttlab_envtest::shared_or_skip()?;
        let ns = plane.create_namespace("cluster").await.expect("namespace");
        let admin = plane.admin_client().await.expect("administrator client");
        let guests = tempfile::tempdir().expect("temporary directory");
        let kubevirt =
            KubevirtSim::start(admin, SimSettings::for_tests([ns.clone()], guests.path()))
                .await
                .expect("kubevirt-sim starts");
        let kubeconfig = plane.admin_kubeconfig(&ns).expect("kubeconfig");
        let cluster = KubeCluster::from_kubeconfig(&kubeconfig, in_ns(settings, &ns))
            .await
            .expect("client from the administrator's kubeconfig");
        Some(Self {
            backend: Backend::Real {
                plane,
                kubevirt: Mutex::new(Some(kubevirt)),
                _guests: guests,
            },
            ns,
            cluster,
            kubeconfig,
            _dir: tempfile::tempdir().expect("temporary directory"),
        })
    }

    /// Another client of the same cluster and identity, with other settings (their
    /// namespace is the harness's).
    pub async fn client(&self, settings: ClusterSettings) -> KubeCluster {
        KubeCluster::from_kubeconfig(&self.kubeconfig, in_ns(settings, &self.ns))
            .await
            .expect("client from the kubeconfig")
    }

    /// The simulator; panics on the real control plane (for tests of kube-sim's faults).
    pub fn sim(&self) -> &KubeSim {
        match &self.backend {
            Backend::Sim(sim) => sim,
            Backend::Real { .. } => panic!("this test needs kube-sim"),
        }
    }

    /// The simulator, to stop it; panics on the real control plane.
    pub fn into_sim(self) -> KubeSim {
        match self.backend {
            Backend::Sim(sim) => sim,
            Backend::Real { .. } => panic!("this test needs kube-sim"),
        }
    }

    /// Whether this is the real control plane.
    pub fn is_real(&self) -> bool {
        matches!(self.backend, Backend::Real { .. })
    }

    /// How long work the API server leaves to its controllers (garbage collection, the
    /// finalizers of KubeVirt and the kubelet) may take: kube-sim does it within
    /// milliseconds; a real control plane's garbage collector is asynchronous.
    pub fn settle_secs(&self) -> u64 {
        if self.is_real() { 60 } else { 10 }
    }

    /// Stops KubeVirt: no VMI is created, advanced or stopped from now on (and no finalizer
    /// is put on a VM). On the real control plane the simulating controller is stopped.
    pub fn pause_kubevirt(&self) {
        match &self.backend {
            Backend::Sim(sim) => sim.pause_kubevirt(true),
            Backend::Real { kubevirt, .. } => {
                drop(kubevirt.lock().expect("kubevirt-sim").take());
            }
        }
    }

    fn with_kubevirt<T>(&self, f: impl FnOnce(&KubevirtSim) -> T) -> T {
        match &self.backend {
            Backend::Real { kubevirt, .. } => f(kubevirt
                .lock()
                .expect("kubevirt-sim")
                .as_ref()
                .expect("KubeVirt runs")),
            Backend::Sim(_) => unreachable!("kube-sim simulates KubeVirt itself"),
        }
    }

    /// The simulated guest of VMI `name` crashes: the VMI ends `Failed`.
    pub fn crash(&self, name: &str) {
        match &self.backend {
            Backend::Sim(sim) => sim.crash(&self.ns, name).expect("crash"),
            Backend::Real { .. } => self.with_kubevirt(|k| k.crash(&self.ns, name).expect("crash")),
        }
    }

    /// The loopback address of the simulated guest of VMI `name`.
    pub fn guest_ip(&self, name: &str) -> Option<std::net::Ipv4Addr> {
        match &self.backend {
            Backend::Sim(sim) => sim.guest_ip(&self.ns, name),
            Backend::Real { .. } => self.with_kubevirt(|k| k.guest(&self.ns, name).map(|g| g.ip)),
        }
    }

    /// Fails the test if the real API server refused a write of the simulated KubeVirt (it
    /// must write only what a real API server accepts).
    pub fn assert_kubevirt_accepted(&self) {
        if let Backend::Real { kubevirt, .. } = &self.backend
            && let Some(k) = kubevirt.lock().expect("kubevirt-sim").as_ref()
        {
            let refused = k.refused();
            assert!(
                refused.is_empty(),
                "the API server refused writes of kubevirt-sim:\n{}",
                refused.join("\n")
            );
        }
    }

    /// Creates `object` in the test's namespace as an administrator would (kubectl).
    pub async fn create_object(&self, mut object: Value) {
        object["metadata"]["namespace"] = self.ns.clone().into();
        match &self.backend {
            Backend::Sim(sim) => {
                sim.create(object).expect("create");
            }
            Backend::Real { plane, .. } => plane.create(&[object]).await.expect("create"),
        }
    }

    /// Creates the ResourceQuota `name` with `hard` limits in the test's namespace, as an
    /// administrator would, and returns once it is enforced: until the quota controller has
    /// written its status a new quota limits nothing (creates pass uncounted, about a second
    /// on the real control plane), whereas the quota of a namespace ttlab works in was counted
    /// long before.
    pub async fn create_quota(&self, name: &str, hard: Value) {
        self.create_object(json!({
            "apiVersion": "v1", "kind": "ResourceQuota",
            "metadata": {"name": name},
            "spec": {"hard": hard},
        }))
        .await;
        let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
            Api::namespaced(self.cluster.client().clone(), &self.ns);
        let keys: Vec<&String> = hard.as_object().expect("limits").keys().collect();
        within(60, async {
            loop {
                let status = quotas.get(name).await.expect("quota").status;
                let used = status.and_then(|s| s.used).unwrap_or_default();
                if keys.iter().all(|k| used.contains_key(*k)) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
    }

    /// Replaces the `status` of an object (as its controller would): a PVC's phase, a
    /// DataVolume's progress. On the real control plane, through the status subresource.
    pub async fn set_status(&self, resource: &str, name: &str, status: Value) {
        match &self.backend {
            Backend::Sim(sim) => {
                sim.set_status(resource, &self.ns, name, status)
                    .expect("set status");
            }
            Backend::Real { plane, .. } => {
                let (group, version, kind) = match resource {
                    "persistentvolumeclaims" => ("", "v1", "PersistentVolumeClaim"),
                    "datavolumes" => ("cdi.kubevirt.io", "v1beta1", "DataVolume"),
                    other => panic!("no status of {other} in these tests"),
                };
                let ar = ApiResource::from_gvk_with_plural(
                    &GroupVersionKind::gvk(group, version, kind),
                    resource,
                );
                let api: Api<DynamicObject> = Api::namespaced_with(
                    plane.admin_client().await.expect("administrator client"),
                    &self.ns,
                    &ar,
                );
                api.patch_status(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": status})),
                )
                .await
                .expect("status patched");
            }
        }
    }

    /// A client like the one under test whose `verb` of `resource` the server refuses with
    /// 403: on kube-sim an injected fault (for every client, from now on), on the real
    /// control plane a ServiceAccount no Role grants anything.
    pub async fn denied(&self, verb: Verb, resource: &str) -> KubeCluster {
        match &self.backend {
            Backend::Sim(sim) => {
                sim.faults()
                    .add(FaultRule::fail(Some(verb), Some(resource), 403));
                self.client(ClusterSettings::default()).await
            }
            Backend::Real { plane, .. } => {
                let account = "no-rights";
                plane
                    .create(&[json!({
                        "apiVersion": "v1", "kind": "ServiceAccount",
                        "metadata": {"name": account, "namespace": self.ns},
                    })])
                    .await
                    .expect("ServiceAccount created");
                let kubeconfig = plane
                    .service_account_kubeconfig(&self.ns, account, &self.ns)
                    .await
                    .expect("ServiceAccount kubeconfig");
                KubeCluster::from_kubeconfig(
                    &kubeconfig,
                    in_ns(ClusterSettings::default(), &self.ns),
                )
                .await
                .expect("client as the ServiceAccount")
            }
        }
    }

    /// Ends what [`Harness::denied`] refused the client under test (on kube-sim: removes every
    /// fault; on the real control plane only the other identity was refused).
    pub fn undeny(&self) {
        if let Backend::Sim(sim) = &self.backend {
            sim.faults().clear();
        }
    }

    /// A marker in the record of calls: [`Harness::calls_since`] returns what came after.
    pub fn mark(&self) -> usize {
        match &self.backend {
            Backend::Sim(sim) => {
                sim.faults().clear_calls();
                0
            }
            Backend::Real { plane, .. } => plane.audit_events().expect("audit log").len(),
        }
    }

    /// The calls of the client under test since `mark`, in order (on kube-sim every call: the
    /// tests make no others meanwhile; on the real control plane those in the test's
    /// namespace carrying the client's User-Agent, a watch counted once).
    pub fn calls_since(&self, mark: usize) -> Vec<SeenCall> {
        match &self.backend {
            Backend::Sim(sim) => sim
                .calls()
                .into_iter()
                .map(|c| SeenCall {
                    verb: c.verb.as_str().to_owned(),
                    resource: c.resource,
                })
                .collect(),
            Backend::Real { plane, .. } => {
                let agent = &self.cluster.settings().user_agent;
                plane
                    .audit_events()
                    .expect("audit log")
                    .into_iter()
                    .skip(mark)
                    .filter(|e| e.user_agent.as_ref() == Some(agent))
                    .filter(|e| {
                        let watch = e.verb == "watch";
                        e.stage
                            == if watch {
                                "ResponseStarted"
                            } else {
                                "ResponseComplete"
                            }
                    })
                    .filter_map(|e| e.call())
                    .filter(|c| c.namespace.as_deref() == Some(self.ns.as_str()))
                    .map(|c| SeenCall {
                        verb: c.verb,
                        resource: c.resource,
                    })
                    .collect()
            }
        }
    }
}

/// Fails the test instead of hanging if `f` does not finish within `secs`.
pub async fn within<T>(secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("finished in time")
}

/// `create` retried while a namespace quota is not yet counted (a real API server refuses
/// with 403 "status unknown for quota" for a moment after a quota appears): for fixtures.
pub async fn retry_quota<T, F, Fut>(mut create: F) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClusterError>>,
{
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match create().await {
            Err(ClusterError::QuotaPending { .. }) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// The labels of a fresh session of environment `env`.
pub fn labels(env: &str) -> ObjectLabels {
    ObjectLabels::new(
        SessionId::new_random(),
        env.parse().expect("env"),
        "systemd-basics".parse().expect("lesson"),
        None,
    )
}

fn label_json(labels: &BTreeMap<String, String>) -> Value {
    serde_json::to_value(labels).expect("labels")
}

/// A VirtualMachine with a container disk, started at once (`runStrategy: Always`).
pub fn vm(name: &str, labels: &ObjectLabels) -> Value {
    vm_with_volume(
        name,
        labels,
        json!({"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/debian:12"}}),
    )
}

/// A VirtualMachine whose root disk is an ephemeral layer over the PVC `claim`.
pub fn vm_on_pvc(name: &str, labels: &ObjectLabels, claim: &str) -> Value {
    vm_with_volume(
        name,
        labels,
        json!({"name": "rootdisk", "ephemeral": {"persistentVolumeClaim": {"claimName": claim, "readOnly": true}}}),
    )
}

fn vm_with_volume(name: &str, labels: &ObjectLabels, volume: Value) -> Value {
    let labels = label_json(&labels.to_map());
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "runStrategy": "Always",
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "domain": {
                        "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}]},
                        "resources": {"requests": {"memory": "128Mi"}}
                    },
                    "volumes": [volume]
                }
            }
        }
    })
}

/// A Secret named `name` with `labels`.
pub fn secret(name: &str, labels: &ObjectLabels) -> k8s_openapi::api::core::v1::Secret {
    k8s_openapi::api::core::v1::Secret {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels.to_map()),
            ..Default::default()
        },
        string_data: Some(BTreeMap::from([(
            "userdata".to_owned(),
            "#cloud-config\n{}\n".to_owned(),
        )])),
        ..Default::default()
    }
}
