//! `ttlabctl bench real --target kubeconfig` runs only in a namespace of its own: against a
//! namespace holding an object it did not create it refuses before creating anything (and
//! names the object), against an empty one it runs (here with every phase skipped) and leaves
//! the namespace as it found it. The cluster is the real control plane of `ttlab-envtest`.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

fn bench_real(kubeconfig: &std::path::Path, namespace: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["bench", "real", "--target", "kubeconfig", "--kubeconfig"])
        .arg(kubeconfig)
        .args([
            "--namespace",
            namespace,
            "--skip",
            "etcd,reclaim,start,noop",
        ])
        .env("RUST_LOG", "error")
        .output()
        .expect("ttlabctl runs")
}

#[tokio::test]
async fn refuses_a_namespace_holding_objects_it_did_not_create() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("bench-foreign").await.unwrap();
    let api = Api::<ConfigMap>::namespaced(plane.admin_client().await.unwrap(), &ns);
    let theirs: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}, "data": {"k": "v"}}))
            .unwrap();
    api.create(&PostParams::default(), &theirs).await.unwrap();
    let kubeconfig = plane.admin_kubeconfig(&ns).unwrap();

    let out = tokio::task::spawn_blocking(move || bench_real(&kubeconfig, &ns))
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "it ran in a foreign namespace: {stderr}"
    );
    assert!(
        stderr.contains("did not create") && stderr.contains("ConfigMaps someone-elses"),
        "the refusal does not name the object: {stderr}"
    );
    // Nothing of the benchmark's was created.
    let names: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n != "kube-root-ca.crt")
        .collect();
    assert_eq!(names, ["someone-elses"]);
}

#[tokio::test]
async fn runs_in_an_empty_namespace_and_leaves_it_empty() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("bench-own").await.unwrap();
    let kubeconfig = plane.admin_kubeconfig(&ns).unwrap();
    let ns2 = ns.clone();
    let out = tokio::task::spawn_blocking(move || bench_real(&kubeconfig, &ns2))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "it refused an empty namespace: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let api = Api::<ConfigMap>::namespaced(plane.admin_client().await.unwrap(), &ns);
    let left: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n != "kube-root-ca.crt")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}
