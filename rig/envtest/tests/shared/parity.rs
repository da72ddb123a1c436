//! Test bodies that run unchanged on kube-sim and on the real control plane, so that
//! kube-sim is held to what the real API server does. Each takes a client (the
//! administrator's) and a namespace of its own; the tests that call them are
//! `rig/envtest/tests/immutable.rs`, `quota.rs` and `pods.rs` (the real control plane) and
//! `rig/kube-sim/tests/suite/api.rs` and `quota.rs` (kube-sim), which include this file.

#![allow(dead_code)]

use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Pod, ResourceQuota, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// The message of the real server's 422 for an update of an immutable ConfigMap or Secret that
/// changes `fields` (`ValidateConfigMapUpdate`, `ValidateSecretUpdate`).
fn immutable_refusal(kind: &str, name: &str, fields: &[&str]) -> String {
    let causes: Vec<String> = fields
        .iter()
        .map(|f| format!("{f}: Forbidden: field is immutable when `immutable` is set"))
        .collect();
    let joined = match causes.as_slice() {
        [one] => one.clone(),
        many => format!("[{}]", many.join(", ")),
    };
    format!("{kind} \"{name}\" is invalid: {joined}")
}

/// Asserts that `answer` is the 422 of [`immutable_refusal`].
fn assert_refused<T: std::fmt::Debug>(
    answer: Result<T, kube::Error>,
    kind: &str,
    name: &str,
    fields: &[&str],
) {
    assert_invalid(answer, &immutable_refusal(kind, name, fields));
}

/// Asserts that `answer` is a 422 Invalid with exactly `message`.
fn assert_invalid<T: std::fmt::Debug>(answer: Result<T, kube::Error>, message: &str) {
    match answer {
        Err(kube::Error::Api(e)) => {
            assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "{e:?}");
            assert_eq!(e.message, message);
        }
        other => panic!("expected 422 Invalid ({message}), got {other:?}"),
    }
}

/// Immutable ConfigMaps and Secrets in `ns`, as ttlab's agent ConfigMap is: their payload
/// and the flag itself cannot change, their metadata can, and they can be deleted.
pub async fn immutable_objects_keep_their_payload(client: kube::Client, ns: &str) {
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client, ns);
    let pp = PostParams::default();
    let merge = |v: serde_json::Value| Patch::Merge(v);
    let pa = PatchParams::default();

    let map: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "agent"},
        "immutable": true,
        "data": {"version": "1"},
        "binaryData": {"agent.gz": "AAEC"},
    }))
    .unwrap();
    let stored = maps.create(&pp, &map).await.unwrap();

    // A full update that changes the data.
    let mut changed = stored.clone();
    changed.data = Some([("version".to_owned(), "2".to_owned())].into());
    assert_refused(
        maps.replace("agent", &pp, &changed).await,
        "ConfigMap",
        "agent",
        &["data"],
    );
    // A dry run is refused alike, and changes nothing.
    let dry = PatchParams {
        dry_run: true,
        ..PatchParams::default()
    };
    let dry_post = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    assert_refused(
        maps.patch("agent", &dry, &merge(json!({"data": {"version": "2"}})))
            .await,
        "ConfigMap",
        "agent",
        &["data"],
    );
    assert_refused(
        maps.replace("agent", &dry_post, &changed).await,
        "ConfigMap",
        "agent",
        &["data"],
    );
    assert_eq!(maps.get("agent").await.unwrap().data, stored.data);
    // Patches of binaryData, of the flag (unset, or false), and of both at once.
    assert_refused(
        maps.patch(
            "agent",
            &pa,
            &merge(json!({"binaryData": {"agent.gz": "AwQF"}})),
        )
        .await,
        "ConfigMap",
        "agent",
        &["binaryData"],
    );
    assert_refused(
        maps.patch("agent", &pa, &merge(json!({"immutable": null})))
            .await,
        "ConfigMap",
        "agent",
        &["immutable"],
    );
    assert_refused(
        maps.patch(
            "agent",
            &pa,
            &merge(json!({"immutable": false, "data": {"version": "2"}})),
        )
        .await,
        "ConfigMap",
        "agent",
        &["immutable", "data"],
    );
    // Metadata changes are allowed.
    let labelled = maps
        .patch(
            "agent",
            &pa,
            &merge(json!({"metadata": {"labels": {"ttlab.io/in-use": "yes"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        labelled
            .metadata
            .labels
            .unwrap_or_default()
            .get("ttlab.io/in-use"),
        Some(&"yes".to_owned())
    );
    let now = maps.get("agent").await.unwrap();
    assert_eq!(now.immutable, Some(true));
    assert_eq!(now.data, stored.data);
    assert_eq!(now.binary_data, stored.binary_data);

    // A mutable ConfigMap can change, and be made immutable in the same update.
    let open: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "open"},
        "data": {"version": "1"},
    }))
    .unwrap();
    maps.create(&pp, &open).await.unwrap();
    // A dry run of an allowed change answers the change and stores nothing.
    let answered = maps
        .patch("open", &dry, &merge(json!({"data": {"version": "9"}})))
        .await
        .unwrap();
    assert_eq!(answered.data.unwrap()["version"], "9");
    let mut nine = maps.get("open").await.unwrap();
    nine.data = Some([("version".to_owned(), "8".to_owned())].into());
    let answered = maps.replace("open", &dry_post, &nine).await.unwrap();
    assert_eq!(answered.data.unwrap()["version"], "8");
    assert_eq!(
        maps.get("open").await.unwrap().data.unwrap()["version"],
        "1",
        "a dry run stored its change"
    );
    let sealed = maps
        .patch(
            "open",
            &pa,
            &merge(json!({"immutable": true, "data": {"version": "2"}})),
        )
        .await
        .unwrap();
    assert_eq!(sealed.immutable, Some(true));
    assert_refused(
        maps.patch("open", &pa, &merge(json!({"data": {"version": "3"}})))
            .await,
        "ConfigMap",
        "open",
        &["data"],
    );

    // Secrets: `stringData` is folded into `data` first, so it is refused as `data`.
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "token"},
        "immutable": true,
        "stringData": {"token": "one"},
    }))
    .unwrap();
    secrets.create(&pp, &secret).await.unwrap();
    assert_refused(
        secrets
            .patch(
                "token",
                &pa,
                &merge(json!({"stringData": {"token": "two"}})),
            )
            .await,
        "Secret",
        "token",
        &["data"],
    );
    assert_refused(
        secrets
            .patch(
                "token",
                &dry,
                &merge(json!({"stringData": {"token": "two"}})),
            )
            .await,
        "Secret",
        "token",
        &["data"],
    );
    assert_refused(
        secrets
            .patch("token", &pa, &merge(json!({"immutable": false})))
            .await,
        "Secret",
        "token",
        &["immutable"],
    );
    // The type never changes, immutable or not; it is the first cause.
    assert_invalid(
        secrets
            .patch(
                "token",
                &pa,
                &merge(json!({"type": "ttlab.io/other", "stringData": {"token": "two"}})),
            )
            .await,
        "Secret \"token\" is invalid: [type: Invalid value: \"ttlab.io/other\": field is immutable, data: Forbidden: field is immutable when `immutable` is set]",
    );
    assert_eq!(
        secrets.get("token").await.unwrap().type_.as_deref(),
        Some("Opaque"),
        "a Secret without a type is Opaque"
    );
    secrets
        .patch(
            "token",
            &pa,
            &merge(json!({"metadata": {"annotations": {"ttlab.io/note": "kept"}}})),
        )
        .await
        .unwrap();
    // Setting the same data again is no change.
    secrets
        .patch(
            "token",
            &pa,
            &merge(json!({"stringData": {"token": "one"}})),
        )
        .await
        .unwrap();

    // A Secret's type cannot change, in an update, a patch or a dry run of either.
    let typed: Secret = serde_json::from_value(json!({
        "metadata": {"name": "typed"},
        "type": "ttlab.io/one",
        "stringData": {"k": "v"},
    }))
    .unwrap();
    let typed = secrets.create(&pp, &typed).await.unwrap();
    let type_refusal =
        "Secret \"typed\" is invalid: type: Invalid value: \"ttlab.io/two\": field is immutable";
    for params in [&pa, &dry] {
        assert_invalid(
            secrets
                .patch("typed", params, &merge(json!({"type": "ttlab.io/two"})))
                .await,
            type_refusal,
        );
    }
    let mut retyped = typed.clone();
    retyped.type_ = Some("ttlab.io/two".to_owned());
    for params in [&pp, &dry_post] {
        assert_invalid(
            secrets.replace("typed", params, &retyped).await,
            type_refusal,
        );
    }
    assert_invalid(
        secrets
            .patch("typed", &pa, &merge(json!({"type": "Opaque"})))
            .await,
        "Secret \"typed\" is invalid: type: Invalid value: \"Opaque\": field is immutable",
    );
    // The same type, and other changes, are fine.
    secrets
        .patch(
            "typed",
            &pa,
            &merge(json!({"type": "ttlab.io/one", "stringData": {"k": "w"}})),
        )
        .await
        .unwrap();
    assert_eq!(
        secrets.get("typed").await.unwrap().type_.as_deref(),
        Some("ttlab.io/one")
    );

    // Immutable objects can still be deleted.
    maps.delete("agent", &DeleteParams::default())
        .await
        .unwrap();
    secrets
        .delete("token", &DeleteParams::default())
        .await
        .unwrap();
}

/// `status.used[resource]` of the quota `name`, once its controller has counted it (waits up
/// to a minute; the real controller fills a new quota's status within seconds).
async fn counted(quotas: &Api<ResourceQuota>, name: &str, resource: &str) -> i64 {
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let q = quotas.get(name).await.unwrap();
        let used = q
            .status
            .and_then(|s| s.used)
            .and_then(|u| u.get(resource).cloned());
        if let Some(u) = used {
            return u.0.parse().unwrap_or_else(|_| panic!("{resource}: {u:?}"));
        }
        assert!(
            tokio::time::Instant::now() < until,
            "quota {name} never counted {resource}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `status.used[resource]` of the quota `name` now (it has been counted).
async fn used_now(quotas: &Api<ResourceQuota>, name: &str, resource: &str) -> i64 {
    let q = quotas.get(name).await.unwrap();
    let used = q.status.and_then(|s| s.used).unwrap_or_default();
    used.get(resource)
        .map(|u| u.0.parse().unwrap())
        .unwrap_or_else(|| panic!("{resource} not in {used:?}"))
}

/// A create the quota admits and storage then refuses (`409 AlreadyExists`: the name is
/// taken, as for a retried create whose first answer was lost) stays charged to the quota's
/// `status.used` — quota admission charges before storage — and nothing corrects it when
/// creates follow: for `observed` (seconds; the full resync of kube-controller-manager comes
/// every 5 minutes) a client reads the over-count. A deletion in the namespace makes the
/// controller recount, and the over-count is gone then.
pub async fn a_refused_repeat_create_stays_charged_until_the_controller_recounts(
    client: kube::Client,
    ns: &str,
    observed: Duration,
) {
    const RESOURCE: &str = "count/secrets";
    let quotas: Api<ResourceQuota> = Api::namespaced(client.clone(), ns);
    let secrets: Api<Secret> = Api::namespaced(client, ns);
    let pp = PostParams::default();
    let quota: ResourceQuota = serde_json::from_value(json!({
        "metadata": {"name": "repeat-quota"},
        "spec": {"hard": {RESOURCE: "50"}},
    }))
    .unwrap();
    quotas.create(&pp, &quota).await.unwrap();
    // The real controller may write a new quota's status more than once while it settles
    // (seen once on a control plane started a moment before): the count is taken once it
    // has held for two seconds.
    let mut base = counted(&quotas, "repeat-quota", RESOURCE).await;
    let mut held_since = tokio::time::Instant::now();
    while held_since.elapsed() < Duration::from_secs(2) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = used_now(&quotas, "repeat-quota", RESOURCE).await;
        if now != base {
            (base, held_since) = (now, tokio::time::Instant::now());
        }
    }

    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "repeat"},
        "stringData": {"k": "v"},
    }))
    .unwrap();
    secrets.create(&pp, &secret).await.unwrap();
    assert_eq!(
        used_now(&quotas, "repeat-quota", RESOURCE).await,
        base + 1,
        "the create is charged (base {base})"
    );
    match secrets.create(&pp, &secret).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"), "{e:?}")
        }
        other => panic!("expected 409 AlreadyExists, got {other:?}"),
    }
    assert_eq!(
        used_now(&quotas, "repeat-quota", RESOURCE).await,
        base + 2,
        "the refused create is charged (base {base})"
    );
    // Dry runs of creates are judged alike (a taken name is 409) and charge nothing.
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match secrets.create(&dry, &secret).await {
        Err(kube::Error::Api(e)) => {
            assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"), "{e:?}")
        }
        other => panic!("expected 409 AlreadyExists for a dry run, got {other:?}"),
    }
    let mut other = secret.clone();
    other.metadata.name = Some("dry".to_owned());
    secrets.create(&dry, &other).await.unwrap();
    assert!(
        secrets.get_opt("dry").await.unwrap().is_none(),
        "a dry run stored"
    );
    assert_eq!(
        used_now(&quotas, "repeat-quota", RESOURCE).await,
        base + 2,
        "a dry run was charged (base {base})"
    );
    // Nothing recounts on creates: the over-count is what a client reads meanwhile.
    let until = tokio::time::Instant::now() + observed;
    while tokio::time::Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            used_now(&quotas, "repeat-quota", RESOURCE).await,
            base + 2,
            "recounted without a deletion (base {base})"
        );
    }
    // A deletion replenishes: the controller recounts what is there.
    secrets
        .delete("repeat", &DeleteParams::default())
        .await
        .unwrap();
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let now = used_now(&quotas, "repeat-quota", RESOURCE).await;
        if now == base {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "not recounted after a deletion: {now} (base {base})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How the API server binds pods and deletes them for their kubelet (what a kubelet played
/// outside the API server, as `ttlab-kubevirt-sim` plays it, relies on; kube-sim with
/// `Controllers::External`): a binding sets `spec.nodeName` and `PodScheduled` once, a second
/// is `409`; a bound pod's delete marks it with its grace period and a delete of grace period
/// 0 removes it; a pod bound to no node goes at once.
pub async fn pods_are_bound_once_and_deleted_for_their_kubelet(client: kube::Client, ns: &str) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pp = PostParams::default();
    let pod = |name: &str| -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "docker.io/library/debian:12"}]},
        }))
        .unwrap()
    };
    pods.create(&pp, &pod("bound")).await.unwrap();
    pods.create(&pp, &pod("unbound")).await.unwrap();

    let bind = |node: &'static str| {
        let client = client.clone();
        let path = format!("/api/v1/namespaces/{ns}/pods/bound/binding");
        async move {
            let body = json!({
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": "bound"},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            });
            let req = http::Request::post(path)
                .header("content-type", "application/json")
                .body(serde_json::to_vec(&body).unwrap())
                .unwrap();
            client.request::<serde_json::Value>(req).await
        }
    };
    let bound = bind("parity-node").await.unwrap();
    assert_eq!(bound["status"], "Success", "{bound}");
    let p = serde_json::to_value(pods.get("bound").await.unwrap()).unwrap();
    assert_eq!(p["spec"]["nodeName"], "parity-node");
    let scheduled = p["status"]["conditions"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["type"] == "PodScheduled"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(scheduled["status"], "True", "{p}");
    match bind("other-node").await {
        Err(kube::Error::Api(e)) => {
            assert_eq!(e.code, 409, "{e:?}");
            assert_eq!(
                e.message,
                "Operation cannot be fulfilled on pods/binding \"bound\": pod bound is already assigned to node \"parity-node\""
            );
        }
        other => panic!("a second binding is a conflict, got {other:?}"),
    }

    // Bound: marked, with the pod's grace period (30 s by default), until a delete of 0.
    pods.delete("bound", &DeleteParams::default())
        .await
        .unwrap();
    let marked = serde_json::to_value(pods.get("bound").await.unwrap()).unwrap();
    assert!(
        marked["metadata"]["deletionTimestamp"].is_string(),
        "{marked}"
    );
    assert_eq!(marked["metadata"]["deletionGracePeriodSeconds"], 30);
    let confirm = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    pods.delete("bound", &confirm).await.unwrap();
    assert!(pods.get_opt("bound").await.unwrap().is_none());

    // Bound to no node: nothing runs it, so it goes at once.
    pods.delete("unbound", &DeleteParams::default())
        .await
        .unwrap();
    assert!(pods.get_opt("unbound").await.unwrap().is_none());
}
