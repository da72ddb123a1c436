//! The generic Kubernetes API over HTTP with a plain client: errors, selectors, pagination,
//! watch, garbage collection, finalizers, quota, faults and the record; immutable ConfigMaps
//! and Secrets, a Secret's type and dry runs through kube-rs, with the body the real control
//! plane runs (`rig/envtest/tests/shared/parity.rs`).

/// Test bodies shared with the real control plane's suites.
use crate::parity;
use crate::support;

use serde_json::{Value, json};
use support::*;
use ttlab_kube_sim::{FaultRule, Verb};

#[tokio::test]
async fn bad_input_gets_kubernetes_errors_and_the_sim_keeps_serving() {
    let sim = start().await;
    let h = Http::new(&sim);
    let (code, body) = h
        .raw("POST", SECRETS, "application/json", b"{not json".to_vec())
        .await;
    assert_eq!(code, 400);
    assert_eq!(
        (body["kind"].as_str(), body["reason"].as_str()),
        (Some("Status"), Some("BadRequest"))
    );
    let (code, body) = h
        .post(
            SECRETS,
            &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}),
        )
        .await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = h.get("/api/v1/namespaces/ttlab/widgets").await;
    assert_eq!((code, body["reason"].as_str()), (404, Some("NotFound")));
    let (code, body) = h.get("/apis/example.com/v1/things").await;
    assert_eq!((code, body["kind"].as_str()), (404, Some("Status")));
    let (code, body) = h
        .post(SECRETS, &secret("Bad_Name", json!({}), json!({})))
        .await;
    assert_eq!((code, body["reason"].as_str()), (422, Some("Invalid")));
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .starts_with("Secret \"Bad_Name\" is invalid: metadata.name"),
        "{body}"
    );
    let (code, _) = h
        .raw(
            "POST",
            SECRETS,
            "application/vnd.kubernetes.protobuf",
            vec![0, 1],
        )
        .await;
    assert_eq!(code, 415);
    let (code, body) = h.get(&format!("{SECRETS}/nope")).await;
    assert_eq!(
        (code, body["message"].as_str()),
        (404, Some("secrets \"nope\" not found"))
    );
    // Still serving.
    assert_eq!(
        h.post(SECRETS, &secret("ok", json!({}), json!({"a": "b"})))
            .await
            .0,
        201
    );
    let (code, body) = h.post(SECRETS, &secret("ok", json!({}), json!({}))).await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (409, Some("AlreadyExists"))
    );
    let (code, body) = h
        .post(
            "/api/v1/namespaces/nowhere/secrets",
            &secret("a", json!({}), json!({})),
        )
        .await;
    assert_eq!(
        (code, body["message"].as_str()),
        (404, Some("namespaces \"nowhere\" not found"))
    );
    let (code, body) = h
        .raw("POST", &format!("{SECRETS}?fieldValidation=Strict"), "application/json", serde_json::to_vec(&json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "dta": {}})).unwrap())
        .await;
    assert_eq!(code, 400);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("unknown field \"dta\""),
        "{body}"
    );
    let (code, body) = h
        .post(
            SECRETS,
            &json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"generateName": "gen-"}}),
        )
        .await;
    assert_eq!(code, 201);
    assert!(
        body["metadata"]["name"]
            .as_str()
            .unwrap()
            .starts_with("gen-")
    );
    // As the real API server: a long generateName (KubeVirt's `virt-launcher-<vmi>-` for a
    // VMI named after a session and a node) keeps 58 characters, so the name stays a label; a
    // given name longer than 63 is still a valid subdomain.
    let prefix = format!("virt-launcher-tt-{}-control-plane-", "c".repeat(32));
    let secret_with =
        |metadata: Value| json!({"apiVersion": "v1", "kind": "Secret", "metadata": metadata});
    let (code, body) = h
        .post(SECRETS, &secret_with(json!({"generateName": prefix})))
        .await;
    assert_eq!(code, 201, "{body}");
    let name = body["metadata"]["name"].as_str().unwrap();
    assert_eq!(name.len(), 63, "{name}");
    assert!(name.starts_with(&prefix[..58]), "{name}");
    let given = format!("{}-x1234", &prefix[..58]);
    assert_eq!(given.len(), 64);
    let (code, body) = h.post(SECRETS, &secret_with(json!({"name": given}))).await;
    assert_eq!(code, 201, "{body}");
}

#[tokio::test]
async fn label_selectors_and_pagination_over_a_snapshot() {
    let sim = start().await;
    let h = Http::new(&sim);
    for i in 0..25 {
        let env = if i % 2 == 0 { "dev" } else { "prod" };
        let labels = json!({"app.kubernetes.io/managed-by": "ttlab", "ttlab.io/env": env, "n": i.to_string()});
        assert_eq!(
            h.post(SECRETS, &secret(&format!("s-{i:02}"), labels, json!({})))
                .await
                .0,
            201
        );
    }
    h.post(SECRETS, &secret("unlabelled", json!({}), json!({})))
        .await;
    let count = |v: &Value| v["items"].as_array().map_or(0, Vec::len);
    for (sel, want) in [
        ("ttlab.io%2Fenv%3Ddev", 13),
        ("ttlab.io%2Fenv%3D%3Dprod", 12),
        ("ttlab.io%2Fenv!%3Ddev", 13),
        ("ttlab.io%2Fenv%20in%20(dev,prod)", 25),
        ("ttlab.io%2Fenv%20notin%20(dev)", 13),
        ("ttlab.io%2Fenv", 25),
        ("!ttlab.io%2Fenv", 1),
        ("ttlab.io%2Fenv%3Ddev,n%3D4", 1),
    ] {
        let (code, body) = h.get(&format!("{SECRETS}?labelSelector={sel}")).await;
        assert_eq!((code, count(&body)), (200, want), "{sel}");
    }
    let (code, body) = h.get(&format!("{SECRETS}?labelSelector=a%20in%20(")).await;
    assert_eq!((code, body["reason"].as_str()), (400, Some("BadRequest")));
    // Pages of 10 over the dev+prod set; a deletion between pages does not disturb them.
    let mut names = Vec::new();
    let mut cont = String::new();
    let mut first_rv = None;
    loop {
        let (code, body) = h
            .get(&format!(
                "{SECRETS}?labelSelector=ttlab.io%2Fenv&limit=10&continue={cont}"
            ))
            .await;
        assert_eq!(code, 200, "{body}");
        first_rv.get_or_insert(body["metadata"]["resourceVersion"].clone());
        assert_eq!(
            Some(&body["metadata"]["resourceVersion"]),
            first_rv.as_ref()
        );
        names.extend(
            body["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i["metadata"]["name"].as_str().unwrap().to_owned()),
        );
        if names.len() == 10 {
            assert_eq!(h.delete(&format!("{SECRETS}/s-24")).await.0, 200);
        }
        match body["metadata"]["continue"].as_str() {
            Some(c) => cont = c.to_owned(),
            None => break,
        }
    }
    assert_eq!(names.len(), 25);
    assert_eq!(names.last().map(String::as_str), Some("s-24"));
    let (code, _) = h.get(&format!("{SECRETS}?limit=10&continue=garbage")).await;
    assert_eq!(code, 400);
}

#[tokio::test]
async fn watch_from_a_resource_version_sees_later_changes_only() {
    let sim = start().await;
    let h = Http::new(&sim);
    let (_, a) = h
        .post(SECRETS, &secret("a", json!({"k": "v"}), json!({})))
        .await;
    let rv = a["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut rx = h
        .watch(&format!(
            "{SECRETS}?watch=true&resourceVersion={rv}&labelSelector=k%3Dv&timeoutSeconds=5"
        ))
        .await;
    h.post(SECRETS, &secret("b", json!({"k": "v"}), json!({})))
        .await;
    h.post(SECRETS, &secret("other", json!({"k": "w"}), json!({})))
        .await;
    h.raw(
        "PATCH",
        &format!("{SECRETS}/b"),
        "application/merge-patch+json",
        br#"{"metadata":{"labels":{"k":"changed"}}}"#.to_vec(),
    )
    .await;
    let e1 = rx.recv().await.unwrap();
    assert_eq!(
        (
            e1["type"].as_str(),
            e1["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("b"))
    );
    // b leaves the selection: the watcher sees it as deleted.
    let e2 = rx.recv().await.unwrap();
    assert_eq!(
        (
            e2["type"].as_str(),
            e2["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("b"))
    );
    // A watch with timeoutSeconds ends by itself.
    let mut short = h
        .watch(&format!(
            "{SECRETS}?watch=true&resourceVersion={rv}&timeoutSeconds=1&labelSelector=none%3Dx"
        ))
        .await;
    assert!(
        tokio::time::timeout(std::time::Duration::from_secs(5), short.recv())
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn a_json_patch_applies_whole_or_is_refused_as_the_api_server_refuses_it() {
    let sim = start().await;
    let h = Http::new(&sim);
    h.post(SECRETS, &secret("p", json!({"a": "1"}), json!({})))
        .await;
    let path = format!("{SECRETS}/p");
    let patch = |ops: Value| {
        h.raw(
            "PATCH",
            &path,
            "application/json-patch+json",
            serde_json::to_vec(&ops).unwrap(),
        )
    };
    let (code, body) = patch(json!([
        {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
        {"op": "remove", "path": "/metadata/labels/a"},
    ]))
    .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["metadata"]["labels"], json!({"b/c": "2"}));

    // An operation that does not apply: 422 Invalid, and the operations before it are undone.
    let (code, body) = patch(json!([
        {"op": "add", "path": "/metadata/labels/d", "value": "4"},
        {"op": "test", "path": "/metadata/labels/b~1c", "value": "not 2"},
    ]))
    .await;
    assert_eq!(code, 422, "{body}");
    assert_eq!(
        (body["kind"].as_str(), body["reason"].as_str()),
        (Some("Status"), Some("Invalid")),
        "{body}"
    );
    for bad in [
        json!([{"op": "remove", "path": "/metadata/labels/nope"}]),
        json!([{"op": "frobnicate", "path": "/metadata/labels/x"}]),
        json!([{"op": "add", "path": "/metadata/labels/x"}]),
    ] {
        let (code, body) = patch(bad.clone()).await;
        assert_eq!(code, 422, "{bad} → {body}");
    }
    let (_, now) = h.get(&format!("{SECRETS}/p")).await;
    assert_eq!(now["metadata"]["labels"], json!({"b/c": "2"}));

    // A body that is not a list of operations: 400 BadRequest.
    for bad in [json!({"op": "add"}), json!(["add"])] {
        let (code, body) = patch(bad.clone()).await;
        assert_eq!(code, 400, "{bad} → {body}");
        assert_eq!(body["reason"].as_str(), Some("BadRequest"), "{body}");
    }
}

#[tokio::test]
async fn garbage_collection_follows_owner_references() {
    let sim = start().await;
    let h = Http::new(&sim);
    sim.pause_kubevirt(true);
    let (_, owner) = h
        .post(VMS, &vm("lab-gc", json!({}), "Halted", container_disk()))
        .await;
    let uid = owner["metadata"]["uid"].as_str().unwrap();
    let mut s = secret(
        "lab-gc-cloudinit",
        json!({}),
        json!({"userdata": "#cloud-config\n{}"}),
    );
    s["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "lab-gc", "uid": uid}]);
    assert_eq!(h.post(SECRETS, &s).await.0, 201);
    let (code, _) = h.delete(&format!("{VMS}/lab-gc")).await;
    assert_eq!(code, 200);
    wait_gone(&h, SECRETS, "lab-gc-cloudinit").await;
    // Orphan propagation keeps the dependent and drops its owner reference.
    let (_, owner2) = h
        .post(VMS, &vm("lab-gc2", json!({}), "Halted", container_disk()))
        .await;
    let mut s = secret("keep", json!({}), json!({}));
    s["metadata"]["ownerReferences"] = json!([{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": "lab-gc2", "uid": owner2["metadata"]["uid"]}]);
    h.post(SECRETS, &s).await;
    let (code, _) = h
        .raw(
            "DELETE",
            &format!("{VMS}/lab-gc2"),
            "application/json",
            br#"{"propagationPolicy":"Orphan"}"#.to_vec(),
        )
        .await;
    assert_eq!(code, 200);
    let (code, kept) = h.get(&format!("{SECRETS}/keep")).await;
    assert_eq!(code, 200);
    assert!(
        kept["metadata"]["ownerReferences"]
            .as_array()
            .is_none_or(Vec::is_empty)
    );
}

#[tokio::test]
async fn a_pvc_in_use_stays_terminating_until_its_pod_goes() {
    let sim = start().await;
    let h = Http::new(&sim);
    let pvc = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "golden"}, "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "10Gi"}}}});
    assert_eq!(h.post(PVCS, &pvc).await.0, 201);
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "user"}, "spec": {"containers": [{"name": "c", "image": "busybox"}], "volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": "golden"}}]}});
    assert_eq!(h.post(PODS, &pod).await.0, 201);
    let (code, body) = h.delete(&format!("{PVCS}/golden")).await;
    assert_eq!(code, 200);
    assert!(body["metadata"]["deletionTimestamp"].is_string(), "{body}");
    let (code, still) = h.get(&format!("{PVCS}/golden")).await;
    assert_eq!(code, 200);
    assert_eq!(
        still["metadata"]["finalizers"],
        json!(["kubernetes.io/pvc-protection"])
    );
    h.delete(&format!("{PODS}/user")).await;
    wait_gone(&h, PVCS, "golden").await;
}

#[tokio::test]
async fn quota_rejects_like_the_api_server() {
    let sim = start().await;
    let h = Http::new(&sim);
    sim.pause_kubevirt(true);
    let quota = json!({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "vm-quota"}, "spec": {"hard": {"count/virtualmachines.kubevirt.io": "2", "requests.memory": "3Gi"}}});
    assert_eq!(
        h.post("/api/v1/namespaces/ttlab/resourcequotas", &quota)
            .await
            .0,
        201
    );
    // Admission judges by the status the quota controller fills in.
    let quotas = "/api/v1/namespaces/ttlab/resourcequotas";
    wait_for(&h, quotas, "vm-quota", |q| q["status"]["used"].is_object()).await;
    for n in ["a", "b"] {
        assert_eq!(
            h.post(VMS, &vm(n, json!({}), "Halted", container_disk()))
                .await
                .0,
            201
        );
    }
    let (code, body) = h
        .post(VMS, &vm("c", json!({}), "Halted", container_disk()))
        .await;
    assert_eq!((code, body["reason"].as_str()), (403, Some("Forbidden")));
    assert_eq!(
        body["message"],
        "virtualmachines.kubevirt.io \"c\" is forbidden: exceeded quota: vm-quota, requested: count/virtualmachines.kubevirt.io=1, used: count/virtualmachines.kubevirt.io=2, limited: count/virtualmachines.kubevirt.io=2"
    );
    let pod = |name: &str, mem: &str| json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "x", "resources": {"requests": {"memory": mem}}}]}});
    assert_eq!(h.post(PODS, &pod("p1", "2Gi")).await.0, 201);
    let (code, body) = h.post(PODS, &pod("p2", "2Gi")).await;
    assert_eq!(code, 403);
    assert!(body["message"].as_str().unwrap().contains("exceeded quota: vm-quota, requested: requests.memory=2Gi, used: requests.memory=2Gi, limited: requests.memory=3Gi"), "{body}");
    let (_, q) = h
        .get("/api/v1/namespaces/ttlab/resourcequotas/vm-quota")
        .await;
    assert_eq!(
        q["status"]["used"]["count/virtualmachines.kubevirt.io"],
        "2"
    );
    h.delete(&format!("{VMS}/a")).await;
    // What the deletion frees is free once the controller has recounted.
    wait_for(&h, quotas, "vm-quota", |q| {
        q["status"]["used"]["count/virtualmachines.kubevirt.io"] == "1"
    })
    .await;
    assert_eq!(
        h.post(VMS, &vm("c", json!({}), "Halted", container_disk()))
            .await
            .0,
        201
    );
}

#[tokio::test]
async fn faults_fail_hang_and_are_recorded() {
    let sim = start().await;
    let h = Http::new(&sim);
    sim.faults()
        .add(FaultRule::fail(Some(Verb::Create), Some("secrets"), 503).times(1));
    let (code, body) = h.post(SECRETS, &secret("a", json!({}), json!({}))).await;
    assert_eq!((code, body["kind"].as_str()), (503, Some("Status")));
    assert_eq!(
        h.post(SECRETS, &secret("a", json!({}), json!({}))).await.0,
        201
    );
    // Over HTTP: hang the deletes of one name.
    let (code, _) = h.post("/sim/faults", &json!({"verb": "delete", "resource": "secrets", "name": "a", "action": {"kind": "hang"}})).await;
    assert_eq!(code, 201);
    let hung = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        h.delete(&format!("{SECRETS}/a")),
    )
    .await;
    assert!(hung.is_err(), "the delete should hang");
    h.raw("DELETE", "/sim/faults", "application/json", Vec::new())
        .await;
    assert_eq!(h.delete(&format!("{SECRETS}/a")).await.0, 200);
    let (code, calls) = h.get("/sim/calls?verb=delete").await;
    assert_eq!(code, 200);
    let statuses: Vec<u64> = calls
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["status"].as_u64().unwrap())
        .collect();
    assert_eq!(statuses, vec![0, 200]);
    let creates: Vec<u16> = sim
        .calls()
        .iter()
        .filter(|c| c.verb == Verb::Create)
        .map(|c| c.status)
        .collect();
    assert_eq!(creates, vec![503, 201]);
    let (code, body) = h
        .post(
            "/sim/faults",
            &json!({"verb": "explode", "action": {"kind": "hang"}}),
        )
        .await;
    assert_eq!(code, 400, "{body}");
}

#[tokio::test]
async fn two_environments_share_a_namespace() {
    let sim = start().await;
    let h = Http::new(&sim);
    sim.pause_kubevirt(true);
    for (name, env) in [("dev-1", "dev"), ("prod-1", "prod"), ("dev-2", "dev")] {
        let labels = json!({"app.kubernetes.io/managed-by": "ttlab", "ttlab.io/env": env});
        assert_eq!(
            h.post(VMS, &vm(name, labels, "Halted", container_disk()))
                .await
                .0,
            201
        );
    }
    let (_, dev) = h
        .get(&format!(
            "{VMS}?labelSelector=app.kubernetes.io%2Fmanaged-by%3Dttlab,ttlab.io%2Fenv%3Ddev"
        ))
        .await;
    let names: Vec<&str> = dev["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["metadata"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["dev-1", "dev-2"]);
    assert_eq!(sim.stats().peak_vms, 3);
}

#[tokio::test]
async fn with_its_controllers_outside_pods_are_bound_once_and_deleted_for_their_kubelet() {
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.controllers = ttlab_kube_sim::Controllers::External;
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    let client = kube_client(&sim).await;
    // The same body runs on the real control plane in `rig/envtest/tests/pods.rs`.
    parity::pods_are_bound_once_and_deleted_for_their_kubelet(client, "ttlab").await;
}

#[tokio::test]
async fn immutable_config_maps_and_secrets_refuse_payload_changes_as_the_api_server_does() {
    let sim = start().await;
    let client = kube_client(&sim).await;
    // The same body runs on the real control plane in `rig/envtest/tests/immutable.rs`.
    parity::immutable_objects_keep_their_payload(client, "ttlab").await;
}
