//! A kube-sim per test, and the kube-rs cluster client pointed at it through a kubeconfig.

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use serde_json::{Value, json};
use ttlab_cluster::{ClusterSettings, KubeCluster};
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_model::SessionId;
use ttlab_model::labels::ObjectLabels;

/// The namespace the tests work in (`SimConfig::for_tests` creates it).
pub const NS: &str = "ttlab";

/// A running sim and a client of it.
pub struct Harness {
    pub sim: KubeSim,
    pub cluster: KubeCluster,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// Another client of the same sim, with other settings.
    pub async fn client(&self, settings: ClusterSettings) -> KubeCluster {
        KubeCluster::from_kubeconfig(&self._dir.path().join("kubeconfig"), settings)
            .await
            .expect("client from the sim's kubeconfig")
    }
}

pub async fn start() -> Harness {
    start_with(ClusterSettings::in_namespace(NS)).await
}

pub async fn start_with(settings: ClusterSettings) -> Harness {
    start_sim(SimConfig::for_tests(), settings).await
}

pub async fn start_sim(config: SimConfig, settings: ClusterSettings) -> Harness {
    let sim = KubeSim::start(config).await.expect("kube-sim starts");
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&path, NS).expect("kubeconfig written");
    let cluster = KubeCluster::from_kubeconfig(&path, settings)
        .await
        .expect("client from the sim's kubeconfig");
    Harness {
        sim,
        cluster,
        _dir: dir,
    }
}

/// Fails the test instead of hanging if `f` does not finish within `secs`.
pub async fn within<T>(secs: u64, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .expect("finished in time")
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
