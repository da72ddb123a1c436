//! The real control plane of `ttlab-envtest` shared by every test of this test process (etcd,
//! kube-apiserver with the front-proxy flags, kube-controller-manager, the KubeVirt and CDI
//! CRDs), a namespace of each test's own there, the simulator started for it as a node of its
//! own, and helpers to wait on objects.

#![allow(dead_code)]

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::{Value, json};
use ttlab_envtest::ControlPlane;
use ttlab_kubevirt_sim::{KubevirtSim, SimSettings};

/// The shared control plane and a client of its administrator, or `None` after
/// `skip_or_fail` (a failure under `CI=true`) when its binaries are missing.
pub async fn shared_plane() -> Option<(&'static ControlPlane, kube::Client)> {
    init_logs();
    let plane = ttlab_envtest::shared_or_skip()?;
    let client = plane.admin_client().await.expect("administrator client");
    Some((plane, client))
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
