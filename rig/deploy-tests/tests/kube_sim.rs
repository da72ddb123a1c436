//! The overlays applied with kubectl to kube-sim (an API server on loopback), and the quota
//! enforcing its bound on VMs rendered by the real manifest code.
//!
//! kube-sim serves the resource types ttlab itself touches (namespaces, Secrets, Pods,
//! Services, PVCs, ResourceQuotas, NetworkPolicies, KubeVirt and CDI types). The other kinds in
//! the overlays (Deployments, RBAC, Ingress, ...) are listed as skipped: kubectl cannot map
//! a kind the server does not serve, even for a client-side dry run.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::Value;
use ttlab_deploy_tests::Rendered;
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_kube_sim::resources::TYPES;
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_model::SessionId;
use ttlab_vm_manifest::{SessionVms, render};

use common::{ENVIRONMENTS, kubectl_or_skip, render_overlay};

struct Kubectl {
    binary: PathBuf,
    dir: tempfile::TempDir,
}

impl Kubectl {
    fn new(binary: PathBuf, sim: &KubeSim) -> Self {
        let dir = tempfile::tempdir().unwrap();
        sim.write_kubeconfig(&dir.path().join("kubeconfig"), "default")
            .unwrap();
        Self { binary, dir }
    }

    fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Runs kubectl against the sim; (success, stdout, stderr).
    async fn run(&self, args: &[&str]) -> (bool, String, String) {
        let out = tokio::process::Command::new(&self.binary)
            .args(args)
            .arg("--kubeconfig")
            .arg(self.kubeconfig())
            .arg("--cache-dir")
            .arg(self.dir.path().join("cache"))
            .output()
            .await
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// `kubectl apply <mode> -f file` succeeds and says "created" for each of its `objects`.
    async fn dry_run_creates(&self, mode: &str, file: &Path, objects: usize) {
        let (ok, out, err) = self.run(&["apply", mode, "-f", path_str(file)]).await;
        assert!(ok, "{} {mode}: {out}{err}", file.display());
        let created = out.lines().filter(|l| l.contains("created")).count();
        assert_eq!(created, objects, "{} {mode}: {out}", file.display());
    }

    /// Writes `objects` as one YAML stream (each document in JSON, which is YAML) and
    /// returns its path.
    fn write_stream(&self, name: &str, objects: &[Value]) -> PathBuf {
        let path = self.dir.path().join(name);
        let stream: String = objects
            .iter()
            .map(|o| format!("---\n{}\n", serde_json::to_string(o).unwrap()))
            .collect();
        std::fs::write(&path, stream).unwrap();
        path
    }
}

fn served(object: &Value) -> bool {
    TYPES
        .iter()
        .any(|t| object["apiVersion"] == t.api_version().as_str() && object["kind"] == t.kind)
}

/// The objects of `rendered` kube-sim serves, and the kinds it does not.
fn split(rendered: &Rendered) -> (Vec<Value>, BTreeSet<String>) {
    let mut skipped = BTreeSet::new();
    let mut ok = Vec::new();
    for o in &rendered.objects {
        if served(o) {
            ok.push(o.clone());
        } else {
            skipped.insert(format!("{}/{}", o["apiVersion"], o["kind"]).replace('"', ""));
        }
    }
    (ok, skipped)
}

async fn start_sim() -> KubeSim {
    KubeSim::start(SimConfig::for_tests()).await.unwrap()
}

fn path_str(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[tokio::test]
async fn kubectl_dry_runs_the_overlays_against_kube_sim() {
    let Some(binary) = kubectl_or_skip() else {
        return;
    };
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        // Each environment's dry runs on a kube-sim of their own: nothing is left of another.
        let sim = start_sim().await;
        let kubectl = Kubectl::new(binary.clone(), &sim);
        let (objects, skipped) = split(&rendered);
        eprintln!(
            "{env}: applying {} objects; kinds kube-sim does not serve, skipped: {skipped:?}",
            objects.len()
        );
        for kind in [
            "v1/Namespace",
            "v1/ResourceQuota",
            "networking.k8s.io/v1/NetworkPolicy",
        ] {
            assert!(
                objects
                    .iter()
                    .any(|o| format!("{}/{}", o["apiVersion"], o["kind"]).replace('"', "") == kind),
                "{kind} is applied, not skipped"
            );
        }
        let file = kubectl.write_stream(&format!("{env}.yaml"), &objects);
        kubectl
            .dry_run_creates("--dry-run=client", &file, objects.len())
            .await;
        // A server-side dry run creates no namespace, so what the overlay puts in its own
        // namespaces is refused, as the real server refuses it.
        let (ok, out, err) = kubectl
            .run(&["apply", "--dry-run=server", "-f", path_str(&file)])
            .await;
        assert!(
            !ok && err.contains("namespaces \"ttlab-vms\" not found"),
            "{env} server dry run without its namespaces: {out}{err}"
        );
        let (ok, out, err) = kubectl.run(&["get", "namespace", "ttlab-vms"]).await;
        assert!(
            !ok && err.contains("NotFound"),
            "a dry run leaves nothing: {out}{err}"
        );
        // With its namespaces created, every other object passes the server's checks.
        let (namespaces, rest): (Vec<Value>, Vec<Value>) = objects
            .iter()
            .cloned()
            .partition(|o| o["kind"] == "Namespace");
        let ns_file = kubectl.write_stream(&format!("{env}-namespaces.yaml"), &namespaces);
        let (ok, out, err) = kubectl.run(&["apply", "-f", path_str(&ns_file)]).await;
        assert!(ok, "{env} namespaces: {out}{err}");
        let rest_file = kubectl.write_stream(&format!("{env}-rest.yaml"), &rest);
        kubectl
            .dry_run_creates("--dry-run=server", &rest_file, rest.len())
            .await;
        let (ok, out, err) = kubectl
            .run(&["get", "resourcequota", "-n", "ttlab-vms", "-o", "name"])
            .await;
        assert!(
            ok && out.trim().is_empty(),
            "a dry run leaves nothing: {out}{err}"
        );
        sim.shutdown().await;
    }

    let sim = start_sim().await;
    let kubectl = Kubectl::new(binary, &sim);

    // Applied for real, the two environments write the same shared objects: the second apply
    // creates its own backend namespace and leaves every shared object unchanged.
    let mut outputs = Vec::new();
    for env in ENVIRONMENTS {
        let rendered = render_overlay(env).unwrap();
        let (objects, _) = split(&rendered);
        let file = kubectl.write_stream(&format!("{env}-real.yaml"), &objects);
        let (ok, out, err) = kubectl.run(&["apply", "-f", path_str(&file)]).await;
        assert!(ok, "{env}: {out}{err}");
        outputs.push(out);
    }
    let second = &outputs[1];
    let shared = ["namespace/ttlab-vms ", "resourcequota/", "networkpolicy."];
    let mut unchanged = 0;
    for line in second.lines() {
        if shared.iter().any(|s| line.starts_with(s)) {
            assert!(
                line.ends_with(" unchanged"),
                "applying prod changed: {line}"
            );
            unchanged += 1;
        } else {
            assert!(line.ends_with(" created"), "{line}");
        }
    }
    assert_eq!(unchanged, 5, "{second}");
    sim.shutdown().await;
}

fn vm_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}

fn lab_vm(namespace: &str) -> Value {
    let input = SessionVms {
        session: SessionId::new_random(),
        env: "prod".parse().unwrap(),
        lesson: "systemd-basics".parse().unwrap(),
        namespace: Some(namespace.to_owned()),
        image: "quay.io/containerdisks/debian:12".into(),
        memory: "4Gi".into(),
        cores: 1,
        nodes: vec!["vm".parse().unwrap()],
        disk: DiskDecision::ContainerDisk {
            reason: FallbackReason::NotRequested,
        },
        termination_grace_period_seconds: 30,
    };
    serde_json::to_value(&render(&input).unwrap().vms[0]).unwrap()
}

#[tokio::test]
async fn the_applied_quota_refuses_the_ninth_vm() {
    let Some(binary) = kubectl_or_skip() else {
        return;
    };
    let Some(rendered) = render_overlay("prod") else {
        return;
    };
    let sim = start_sim().await;
    // Only the count matters here: no guests boot.
    sim.pause_kubevirt(true);
    let kubectl = Kubectl::new(binary, &sim);
    let (objects, _) = split(&rendered);
    let file = kubectl.write_stream("prod.yaml", &objects);
    let (ok, out, err) = kubectl.run(&["apply", "-f", path_str(&file)]).await;
    assert!(ok, "{out}{err}");

    let config = kube::Config::from_custom_kubeconfig(
        kube::config::Kubeconfig::read_from(kubectl.kubeconfig()).unwrap(),
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    // A new quota covers nothing until the quota controller has filled its status (as on a
    // real cluster): wait for it before counting.
    let quotas: Api<k8s_openapi::api::core::v1::ResourceQuota> =
        Api::namespaced(client.clone(), "ttlab-vms");
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let q = quotas.get("ttlab-vms").await.unwrap();
        let used = q.status.and_then(|s| s.used).unwrap_or_default();
        if used.contains_key("count/virtualmachines.kubevirt.io") {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "the quota was never counted"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let vms: Api<DynamicObject> = Api::namespaced_with(client, "ttlab-vms", &vm_resource());
    let pp = PostParams::default();
    for i in 0..8 {
        let vm: DynamicObject = serde_json::from_value(lab_vm("ttlab-vms")).unwrap();
        vms.create(&pp, &vm)
            .await
            .unwrap_or_else(|e| panic!("VM {} refused: {e}", i + 1));
    }
    let ninth: DynamicObject = serde_json::from_value(lab_vm("ttlab-vms")).unwrap();
    match vms.create(&pp, &ninth).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(
                status.message.contains("exceeded quota: ttlab-vms"),
                "{}",
                status.message
            );
        }
        other => panic!("the ninth VM was not refused: {other:?}"),
    }
    sim.shutdown().await;
}
