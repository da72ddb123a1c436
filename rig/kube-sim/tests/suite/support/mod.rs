//! Shared helpers: a plain HTTP client against a started sim, and object builders.

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use ttlab_kube_sim::{Controllers, KubeSim, SimConfig};

pub struct Http {
    pub base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    pub fn new(sim: &KubeSim) -> Self {
        Self {
            base: sim.url().to_owned(),
            client: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let req = http::Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base))
            .header("content-type", content_type)
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        let res = self.client.request(req).await.expect("response");
        let status = res.status().as_u16();
        let bytes = res.into_body().collect().await.expect("body").to_bytes();
        let v = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        (status, v)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.raw("GET", path, "application/json", Vec::new()).await
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.raw(
            "POST",
            path,
            "application/json",
            serde_json::to_vec(body).expect("json"),
        )
        .await
    }

    pub async fn delete(&self, path: &str) -> (u16, Value) {
        self.raw("DELETE", path, "application/json", Vec::new())
            .await
    }

    /// Opens a watch and returns a receiver of its events.
    pub async fn watch(&self, path: &str) -> tokio::sync::mpsc::Receiver<Value> {
        let req = http::Request::builder()
            .method("GET")
            .uri(format!("{}{path}", self.base))
            .body(Full::new(Bytes::new()))
            .expect("request");
        let res = self.client.request(req).await.expect("response");
        assert_eq!(res.status().as_u16(), 200);
        let (tx, rx) = tokio::sync::mpsc::channel(1024);
        tokio::spawn(async move {
            let mut body = res.into_body();
            let mut buf = Vec::new();
            while let Some(Ok(frame)) = body.frame().await {
                if let Some(d) = frame.data_ref() {
                    buf.extend_from_slice(d);
                    while let Some(i) = buf.iter().position(|b| *b == b'\n') {
                        let line: Vec<u8> = buf.drain(..=i).collect();
                        if let Ok(v) = serde_json::from_slice::<Value>(&line)
                            && tx.send(v).await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        rx
    }
}

/// A kube-rs client for the sim, built from a kubeconfig file as production builds it, with
/// `ttlab` as the default namespace.
pub async fn kube_client(sim: &KubeSim) -> kube::Client {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&path, "ttlab")
        .expect("kubeconfig written");
    let kc = kube::config::Kubeconfig::read_from(&path).expect("kubeconfig read");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .expect("kube config");
    assert_eq!(cfg.default_namespace, "ttlab");
    kube::Client::try_from(cfg).expect("kube client")
}

/// The installed kubectl, if any.
pub fn kubectl() -> Option<&'static str> {
    ["/usr/bin/kubectl", "/usr/local/bin/kubectl"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

pub async fn start() -> KubeSim {
    start_with(Controllers::default()).await
}

/// A sim whose KubeVirt, scheduler and kubelet are `controllers`: [`Controllers::External`]
/// (none running) to measure the API server alone.
pub async fn start_with(controllers: Controllers) -> KubeSim {
    let mut config = SimConfig::for_tests();
    config.controllers = controllers;
    KubeSim::start(config).await.expect("sim starts")
}

pub fn vm(name: &str, labels: Value, run_strategy: &str, volumes: Value) -> Value {
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name, "labels": labels.clone()},
        "spec": {
            "runStrategy": run_strategy,
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "domain": {
                        "memory": {"guest": "1Gi"},
                        "resources": {"requests": {"memory": "1Gi"}},
                        "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}]}
                    },
                    "volumes": volumes
                }
            }
        }
    })
}

pub fn container_disk() -> Value {
    json!([{"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:22.04"}}])
}

pub fn secret(name: &str, labels: Value, data: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels}, "stringData": data})
}

pub const VMS: &str = "/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachines";
pub const VMIS: &str = "/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances";
pub const SECRETS: &str = "/api/v1/namespaces/ttlab/secrets";
pub const PODS: &str = "/api/v1/namespaces/ttlab/pods";
pub const PVCS: &str = "/api/v1/namespaces/ttlab/persistentvolumeclaims";

/// Waits (by watching) until the object at `collection`/`name` satisfies `pred`.
pub async fn wait_for(
    http: &Http,
    collection: &str,
    name: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    let mut rx = http
        .watch(&format!(
            "{collection}?watch=true&fieldSelector=metadata.name%3D{name}&timeoutSeconds=20"
        ))
        .await;
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = rx.recv().await {
            if ev["type"] != "DELETED" && pred(&ev["object"]) {
                return ev["object"].clone();
            }
        }
        panic!("watch ended before {name} matched");
    })
    .await
    .expect("condition reached in time")
}

/// Waits until the launcher pod of VMI `vmi` exists and is held `Pending` with its containers
/// `ContainerCreating`: what a kubelet that cannot mount one of its volumes shows (it says why
/// in a `FailedMount` Event).
pub async fn launcher_pod_waiting_for_a_volume(http: &Http, vmi: &str) -> Value {
    let url = format!("{PODS}?labelSelector=vmi.kubevirt.io%2Fid%3D{vmi}");
    let started = std::time::Instant::now();
    loop {
        let (status, list) = http.get(&url).await;
        assert_eq!(status, 200, "{list}");
        if let Some(pod) = list["items"].as_array().and_then(|items| {
            items.iter().find(|p| {
                p["status"]["phase"] == "Pending"
                    && p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"]
                        == "ContainerCreating"
            })
        }) {
            return pod.clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "no launcher pod of {vmi} waiting for a volume: {list}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until the object is gone.
pub async fn wait_gone(http: &Http, collection: &str, name: &str) {
    let mut rx = http
        .watch(&format!(
            "{collection}?watch=true&fieldSelector=metadata.name%3D{name}&timeoutSeconds=20"
        ))
        .await;
    if http.get(&format!("{collection}/{name}")).await.0 == 404 {
        return;
    }
    tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = rx.recv().await {
            if ev["type"] == "DELETED" {
                return;
            }
        }
        panic!("watch ended before {name} was deleted");
    })
    .await
    .expect("deleted in time");
}

/// Lets `users` do everything, as a ClusterRoleBinding to an all-verbs ClusterRole does.
pub fn grant_everything(sim: &KubeSim, users: &[&str]) {
    let subjects: Vec<_> = users
        .iter()
        .map(|u| json!({"kind": "User", "name": u}))
        .collect();
    sim.apply_rbac(&[
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
               "metadata": {"name": "everything"},
               "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": "everything"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "everything"},
               "subjects": subjects}),
    ])
    .expect("RBAC objects apply");
}
