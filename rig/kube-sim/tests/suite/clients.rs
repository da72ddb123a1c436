//! Real clients against the sim: kube-rs (typed and dynamic, watcher-based waits) and kubectl
//! (without it on `PATH`: a `SKIPPED:` line, or a failure under `CI=true`), plus the scale
//! figure.

use crate::support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Secret;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams,
};
use kube::runtime::wait::await_condition;
use serde_json::json;
use support::*;
use ttlab_kube_sim::Verb;

fn vm_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

#[tokio::test]
async fn kube_rs_creates_lists_waits_and_deletes() {
    let sim = start().await;
    let client = kube_client(&sim).await;
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), "ttlab", &vm_resource());
    let vmis: Api<DynamicObject> = Api::namespaced_with(client.clone(), "ttlab", &vmi_resource());
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "ttlab");
    let obj: DynamicObject = serde_json::from_value(vm(
        "lab-kube",
        json!({"ttlab.io/env": "dev"}),
        "RerunOnFailure",
        container_disk(),
    ))
    .unwrap();
    let pp = PostParams::default();
    vms.create(&pp, &obj).await.unwrap();
    match vms.create(&pp, &obj).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("expected 409, got {other:?}"),
    }
    let running = await_condition(vmis.clone(), "lab-kube", |o: Option<&DynamicObject>| {
        o.is_some_and(|o| o.data["status"]["phase"] == "Running")
    });
    tokio::time::timeout(Duration::from_secs(10), running)
        .await
        .unwrap()
        .unwrap();
    let listed = vms
        .list(&ListParams::default().labels("ttlab.io/env=dev").limit(1))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 1);
    let s: Secret =
        serde_json::from_value(secret("x", json!({}), json!({"userdata": "hi"}))).unwrap();
    let created = secrets.create(&PostParams::default(), &s).await.unwrap();
    assert!(created.data.unwrap().contains_key("userdata"));
    vms.delete("lab-kube", &DeleteParams::default())
        .await
        .unwrap();
    let gone = await_condition(vmis.clone(), "lab-kube", |o: Option<&DynamicObject>| {
        o.is_none()
    });
    tokio::time::timeout(Duration::from_secs(10), gone)
        .await
        .unwrap()
        .unwrap();
    match vms.get("nope").await {
        Err(kube::Error::Api(s)) => assert_eq!((s.code, s.reason.as_str()), (404, "NotFound")),
        other => panic!("expected 404, got {other:?}"),
    }
}

#[tokio::test]
async fn kubectl_gets_lists_and_applies_a_vm_that_reaches_running() {
    let Some(kubectl) = ttlab_testkit::which("kubectl") else {
        return ttlab_testkit::skip_or_fail(
            "kubectl is not on PATH; kubectl get/apply against the sim did not run",
        );
    };
    let kubectl = kubectl.as_path();
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.namespaces.push("students".into());
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kc, "students").unwrap();
    let run = |args: Vec<String>| {
        let kc = kc.clone();
        let home = dir.path().to_path_buf();
        async move {
            let out = tokio::process::Command::new(kubectl)
                .args(&args)
                .arg("--kubeconfig")
                .arg(&kc)
                .arg("--cache-dir")
                .arg(home.join("cache"))
                .output()
                .await
                .unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
    let secret_file = dir.path().join("secret.json");
    std::fs::write(&secret_file, serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "lab-abc123-cloudinit"}, "stringData": {"userdata": "#cloud-config\n{}"}})).unwrap()).unwrap();
    let (ok, _, err) = run(s(&["apply", "-f", secret_file.to_str().unwrap()])).await;
    assert!(ok, "{err}");
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/vm-valid-containerdisk.yaml"
    );
    let (ok, out, err) = run(s(&["apply", "-f", example])).await;
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("virtualmachine.kubevirt.io/lab-abc123 created"),
        "{out}"
    );
    let (ok, out, err) = run(s(&[
        "wait",
        "vmi/lab-abc123",
        "--for=jsonpath={.status.phase}=Running",
        "--timeout=20s",
    ]))
    .await;
    assert!(ok, "{out}{err}");
    let (ok, out, err) = run(s(&[
        "get",
        "vms",
        "-l",
        "app.example/session=abc123",
        "-o",
        "json",
    ]))
    .await;
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(list["items"][0]["metadata"]["name"], "lab-abc123");
    let (ok, out, _) = run(s(&["get", "vmi", "lab-abc123", "-o", "yaml"])).await;
    assert!(ok && out.contains("phase: Running"), "{out}");
    // Re-apply is a patch; a misspelt field is refused under kubectl's default validation.
    let (ok, out, err) = run(s(&["apply", "-f", example])).await;
    assert!(ok, "{out}{err}");
    let bad = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/vm-invalid-userdatasecretref.yaml"
    );
    let (ok, _, err) = run(s(&["apply", "-f", bad])).await;
    assert!(!ok && err.contains("unknown field"), "{err}");
    let (ok, out, err) = run(s(&["delete", "vm", "-l", "app.example/session=abc123"])).await;
    assert!(ok, "{out}{err}");
    let (ok, out, _) = run(s(&["get", "vm"])).await;
    assert!(ok && !out.contains("lab-abc123"), "{out}");
}

#[tokio::test]
async fn ten_thousand_vms_and_a_label_selected_list_in_milliseconds() {
    // The API server alone: no controller caches and reconciles the 10 000 VMs beside it.
    let sim = start_with(ttlab_kube_sim::Controllers::External).await;
    let started = Instant::now();
    for i in 0..10_000 {
        let env = if i % 2 == 0 { "dev" } else { "prod" };
        let mut v = vm(
            &format!("vm-{i:05}"),
            json!({"app.kubernetes.io/managed-by": "ttlab", "ttlab.io/env": env, "ttlab.io/session": format!("s{i}")}),
            "Halted",
            container_disk(),
        );
        v["metadata"]["namespace"] = json!("ttlab");
        sim.create(v).unwrap();
    }
    let fill = started.elapsed();
    let h = Http::new(&sim);
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        let (code, body) = h
            .get(&format!("{VMS}?labelSelector=ttlab.io%2Fsession%3Ds4242"))
            .await;
        best = best.min(t.elapsed());
        assert_eq!(code, 200);
        assert_eq!(body["items"].as_array().unwrap().len(), 1);
    }
    let t = Instant::now();
    let (_, page) = h
        .get(&format!(
            "{VMS}?labelSelector=ttlab.io%2Fenv%3Ddev&limit=500"
        ))
        .await;
    let page_time = t.elapsed();
    assert_eq!(page["items"].as_array().unwrap().len(), 500);
    eprintln!(
        "scale: 10000 VMs stored in {fill:?}; label-selected list (1 match) best of 5: {best:?}; first page of 500 dev VMs: {page_time:?}"
    );
    assert_eq!(sim.stats().vms, 10_000);
    assert!(
        best < Duration::from_millis(50),
        "label-selected list took {best:?}"
    );
}

#[tokio::test]
async fn calls_are_recorded_with_the_user_the_kubeconfig_acts_as() {
    let sim = start().await;
    grant_everything(&sim, &["ttlab-dev-reaper", "ttlab-prod-reaper"]);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut clients = Vec::new();
    for user in ["ttlab-dev-reaper", "ttlab-prod-reaper"] {
        let path = dir.path().join(user);
        sim.write_kubeconfig_as(&path, "ttlab", Some(user))
            .expect("kubeconfig written");
        let kc = kube::config::Kubeconfig::read_from(&path).expect("kubeconfig read");
        let cfg =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .expect("kube config");
        clients.push(kube::Client::try_from(cfg).expect("kube client"));
    }
    let dev: Api<Secret> = Api::namespaced(clients[0].clone(), "ttlab");
    let prod: Api<Secret> = Api::namespaced(clients[1].clone(), "ttlab");
    let s: Secret = serde_json::from_value(json!({"metadata": {"name": "shared"}})).unwrap();
    dev.create(&PostParams::default(), &s)
        .await
        .expect("created");
    prod.delete("shared", &DeleteParams::default())
        .await
        .expect("deleted");
    // Without `as:`, no user is recorded.
    let anonymous: Api<Secret> = Api::namespaced(kube_client(&sim).await, "ttlab");
    assert!(anonymous.get_opt("shared").await.expect("get").is_none());
    let seen: Vec<(Verb, Option<String>, Option<String>)> = sim
        .calls()
        .into_iter()
        .filter(|c| c.resource == "secrets")
        .map(|c| (c.verb, c.name, c.user))
        .collect();
    let shared = || Some("shared".to_owned());
    // A create names its object in the body; the record has the requested name too.
    assert_eq!(
        seen,
        vec![
            (Verb::Create, shared(), Some("ttlab-dev-reaper".to_owned())),
            (Verb::Delete, shared(), Some("ttlab-prod-reaper".to_owned())),
            (Verb::Get, shared(), None),
        ]
    );
}
