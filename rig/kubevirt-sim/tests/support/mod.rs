//! Where the tests run — the real control plane of `ttlab-envtest` shared by every test of
//! this test process (etcd, kube-apiserver with the front-proxy flags,
//! kube-controller-manager, the KubeVirt and CDI CRDs), or a kube-sim of the test's own with
//! its KubeVirt, scheduler and kubelet turned off ([`Controllers::External`]), so that the same
//! simulator plays them on both — a namespace of each test's own there, the simulator started
//! for it as a node of its own, and helpers to wait on objects.

#![allow(dead_code)]

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};
use ttlab_envtest::ControlPlane;
use ttlab_kube_sim::{Controllers, KubeSim, SimConfig};
use ttlab_kubevirt_sim::{KubevirtSim, SimSettings};

/// Which API server a test runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    /// The shared real control plane.
    RealControlPlane,
    /// A kube-sim of the test's own, serving the API only.
    KubeSim,
}

/// The API server of a test.
pub enum Plane {
    /// The shared real control plane.
    Real(&'static ControlPlane),
    /// A kube-sim of the test's own (stopped when dropped).
    Sim(KubeSim),
}

impl Plane {
    /// Creates a namespace `<prefix>-<random>` of the test's own and, on the real control
    /// plane, waits for its default ServiceAccount (pods need it there); returns its name.
    pub async fn namespace(&self, client: &kube::Client, prefix: &str) -> String {
        match self {
            Plane::Real(plane) => namespace(plane, client, prefix).await,
            Plane::Sim(_) => {
                let name = format!("{prefix}-{}", &uuid_like()[..8]);
                let namespaces: Api<Namespace> = Api::all(client.clone());
                let ns: Namespace =
                    serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
                namespaces
                    .create(&PostParams::default(), &ns)
                    .await
                    .expect("namespace");
                name
            }
        }
    }

    /// A client for the simulator: on kube-sim as its controllers' identity (no fault, no
    /// authorization, not in the call record), on the real control plane the administrator.
    pub async fn controller_client(&self, admin: &kube::Client) -> kube::Client {
        match self {
            Plane::Real(_) => admin.clone(),
            Plane::Sim(sim) => client_of(&sim.controller_kubeconfig_yaml()).await,
        }
    }

    /// The real control plane, for what only it has (the aggregated API's proxy).
    pub fn real(&self) -> Option<&'static ControlPlane> {
        match self {
            Plane::Real(plane) => Some(plane),
            Plane::Sim(_) => None,
        }
    }
}

/// A random lower-case hex string (32 characters).
fn uuid_like() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The API server `on` and a client of its administrator, or `None` after `skip_or_fail` (a
/// failure under `CI=true`) when the real control plane's binaries are missing.
pub async fn plane(on: On) -> Option<(Plane, kube::Client)> {
    init_logs();
    match on {
        On::RealControlPlane => {
            let plane = ttlab_envtest::shared_or_skip()?;
            let client = plane.admin_client().await.expect("administrator client");
            Some((Plane::Real(plane), client))
        }
        On::KubeSim => {
            let mut config = SimConfig::for_tests();
            config.controllers = Controllers::External;
            let sim = KubeSim::start(config).await.expect("kube-sim starts");
            let client = client_of(&sim.kubeconfig_yaml("default")).await;
            Some((Plane::Sim(sim), client))
        }
    }
}

/// A client of the kubeconfig `yaml`.
async fn client_of(yaml: &str) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    kube::Client::try_from(config).unwrap()
}

/// The shared control plane and a client of its administrator, or `None` after
/// `skip_or_fail` (a failure under `CI=true`) when its binaries are missing.
pub async fn shared_plane() -> Option<(&'static ControlPlane, kube::Client)> {
    init_logs();
    let plane = ttlab_envtest::shared_or_skip()?;
    let client = plane.admin_client().await.expect("administrator client");
    Some((plane, client))
}

/// Runs the test body `$body` (an `async fn(On)`) as two tests,
/// `$body::on_the_real_control_plane` and `$body::on_kube_sim` (`#[macro_use] mod support;`).
#[allow(unused_macros)]
macro_rules! on_both {
    ($body:ident) => {
        mod $body {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_the_real_control_plane() {
                super::$body($crate::support::On::RealControlPlane).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_kube_sim() {
                super::$body($crate::support::On::KubeSim).await;
            }
        }
    };
}

/// Logs of the simulator (and the test) on the test's output; `RUST_LOG` overrides.
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| "ttlab_kubevirt_sim=info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

/// Creates a namespace `<prefix>-<random>` of the test's own and waits for its default
/// ServiceAccount (pods need it); returns its name.
pub async fn namespace(plane: &ControlPlane, client: &kube::Client, prefix: &str) -> String {
    let ns = plane.create_namespace(prefix).await.expect("namespace");
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    eventually("the default ServiceAccount", 30, || async {
        sas.get_opt("default").await.ok().flatten()
    })
    .await;
    ns
}

/// Test settings for namespace `ns`, guests under `guests`, on a node of the test's own
/// (`<ns>-node`: pods of other tests' simulators are bound to their own nodes).
pub fn sim_settings(ns: &str, guests: &Path) -> SimSettings {
    let mut settings = SimSettings::for_tests([ns], guests);
    settings.node_name = format!("{ns}-node");
    settings
}

/// The simulator on `client` for namespace `ns`, its guests under `guests`.
pub async fn start_sim(client: &kube::Client, ns: &str, guests: &Path) -> KubevirtSim {
    KubevirtSim::start(client.clone(), sim_settings(ns, guests))
        .await
        .expect("kubevirt-sim starts")
}

/// Polls `f` every 50 ms until it gives `Some`, for at most `secs` seconds.
pub async fn eventually<T, F, Fut>(what: &str, secs: u64, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub fn vm_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    )
}

pub fn vmi_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
            "virtualmachineinstances",
        ),
    )
}

/// The object as JSON, or `None` if absent.
pub async fn get_json(api: &Api<DynamicObject>, name: &str) -> Option<Value> {
    api.get_opt(name)
        .await
        .expect("get")
        .map(|o| serde_json::to_value(o).expect("json"))
}

/// A small VirtualMachine with a container disk (and no cloud-init) under `strategy`.
pub fn plain_vm(name: &str, strategy: &str) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {
            "runStrategy": strategy,
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 30,
                    "domain": {
                        "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}]},
                        "resources": {"requests": {"memory": "128Mi"}}
                    },
                    "volumes": [{"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/debian:12"}}]
                }
            }
        }
    })
}

pub async fn create_vm(client: &kube::Client, ns: &str, vm: &Value) -> Value {
    let obj: DynamicObject = serde_json::from_value(vm.clone()).expect("VM object");
    let created = vm_api(client, ns)
        .create(&PostParams::default(), &obj)
        .await
        .expect("VM created");
    serde_json::to_value(created).expect("json")
}

/// Fails the test if the API server refused anything the simulator wrote as invalid.
pub fn assert_nothing_refused(sim: &KubevirtSim) {
    let refused = sim.refused();
    assert!(
        refused.is_empty(),
        "the API server refused writes of the simulator:\n{}",
        refused.join("\n")
    );
}
