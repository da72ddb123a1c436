//! The harness against itself: the control plane is real (authorization is enforced, the
//! garbage collector and the quota controller run), and its audit log names every call.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

async fn client_of(path: &std::path::Path) -> kube::Client {
    let kubeconfig = kube::config::Kubeconfig::read_from(path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    kube::Client::try_from(config).unwrap()
}

#[tokio::test]
async fn a_service_account_without_a_role_is_forbidden_and_its_calls_are_audited() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("authz").await.unwrap();
    plane
        .create(&[json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "nobody", "namespace": ns}})])
        .await
        .unwrap();
    let kubeconfig = plane
        .service_account_kubeconfig(&ns, "nobody", &ns)
        .await
        .unwrap();
    let client = client_of(&kubeconfig).await;
    let err = Api::<ConfigMap>::namespaced(client, &ns)
        .list(&Default::default())
        .await
        .unwrap_err();
    match err {
        kube::Error::Api(e) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("expected 403, got {other:?}"),
    }
    let user = format!("system:serviceaccount:{ns}:nobody");
    let calls = plane.calls_of(&user, &ns).unwrap();
    assert!(
        calls
            .iter()
            .any(|c| c.resource == "configmaps" && c.verb == "list" && c.code == 403),
        "{calls:?}"
    );
}

#[tokio::test]
async fn the_garbage_collector_deletes_what_an_owner_owned() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("gc").await.unwrap();
    let client = plane.admin_client().await.unwrap();
    let owners = Api::<ServiceAccount>::namespaced(client.clone(), &ns);
    let owner = owners
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": "owner"}})).unwrap(),
        )
        .await
        .unwrap();
    let uid = owner.metadata.uid.unwrap();
    let maps = Api::<ConfigMap>::namespaced(client, &ns);
    let owned: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "owned",
        "ownerReferences": [{"apiVersion": "v1", "kind": "ServiceAccount", "name": "owner", "uid": uid}]}}))
    .unwrap();
    maps.create(&PostParams::default(), &owned).await.unwrap();
    owners
        .delete("owner", &DeleteParams::default())
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    while maps.get_opt("owned").await.unwrap().is_some() {
        assert!(
            tokio::time::Instant::now() < until,
            "the owned object outlived its owner by a minute"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn renaming_keeps_unrelated_objects() {
    let objects = vec![json!({"kind": "ConfigMap", "metadata": {"name": "x", "namespace": "a"}})];
    let out = ttlab_envtest::rename_namespaces(&objects, &BTreeMap::new());
    assert_eq!(out, objects);
}

#[tokio::test]
async fn the_shipped_objects_install_and_each_identity_gets_only_its_role() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let installed = plane.install_shipped(&["dev", "prod"]).await.unwrap();
    let dev = installed.env("dev");
    let kinds: std::collections::BTreeSet<&str> = installed
        .objects
        .iter()
        .filter_map(|o| o["kind"].as_str())
        .collect();
    for kind in [
        "Namespace",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ResourceQuota",
        "NetworkPolicy",
    ] {
        assert!(kinds.contains(kind), "{kind} installed: {kinds:?}");
    }
    let reaper = client_of(&dev.reaper_kubeconfig).await;
    let server = client_of(&dev.server_kubeconfig).await;
    let ns = &installed.vm_namespace;
    // The reaper may list Secrets but not create them; the server may create them.
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(reaper.clone(), ns)
        .list_metadata(&Default::default())
        .await
        .unwrap();
    let secret: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(json!({"metadata": {"name": "s"}})).unwrap();
    let err = Api::namespaced(reaper, ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap_err();
    assert!(
        matches!(err, kube::Error::Api(ref e) if e.code == 403),
        "{err:?}"
    );
    Api::namespaced(server, ns)
        .create(&PostParams::default(), &secret)
        .await
        .unwrap();
}

#[tokio::test]
async fn etcd_reports_its_database_size_and_it_grows_with_what_is_stored() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let size = |name: &str| plane.etcd_metric(name).unwrap().unwrap_or(-1.0);
    let before = size("etcd_mvcc_db_total_size_in_use_in_bytes");
    assert!(before > 0.0, "etcd reports no database size in use");
    assert!(size("etcd_mvcc_db_total_size_in_bytes") >= before);
    let ns = plane.create_namespace("etcd").await.unwrap();
    let api = Api::<ConfigMap>::namespaced(plane.admin_client().await.unwrap(), &ns);
    // 8 MiB stored, at least 4 MiB of growth asked for: the plane is shared, and the API
    // server's periodic compaction may free other tests' old revisions meanwhile.
    let data = "x".repeat(512 * 1024);
    for i in 0..16 {
        let cm: ConfigMap = serde_json::from_value(
            json!({"metadata": {"name": format!("big-{i}")}, "data": {"x": data}}),
        )
        .unwrap();
        api.create(&PostParams::default(), &cm).await.unwrap();
    }
    // etcd updates the gauge as it commits: give it a moment.
    let mut after = before;
    for _ in 0..50 {
        after = size("etcd_mvcc_db_total_size_in_use_in_bytes");
        if after >= before + 4.0 * 1024.0 * 1024.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        after >= before + 4.0 * 1024.0 * 1024.0,
        "8 MiB stored, the database in use went from {before} to {after} bytes"
    );
}
