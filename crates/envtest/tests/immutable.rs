//! The real API server refuses changes to an immutable ConfigMap's or Secret's payload with
//! the 422 kube-sim gives (`crates/kube-sim/tests/api.rs` runs the same body against kube-sim).

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

#[tokio::test]
async fn immutable_config_maps_and_secrets_refuse_payload_changes() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("immutable").await.unwrap();
    let client = plane.admin_client().await.unwrap();
    immutable_objects_keep_their_payload(client, &ns).await;
}

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
    match answer {
        Err(kube::Error::Api(e)) => {
            assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "{e:?}");
            assert_eq!(e.message, immutable_refusal(kind, name, fields));
        }
        other => panic!("expected 422 Invalid for {fields:?}, got {other:?}"),
    }
}

/// Immutable ConfigMaps and Secrets in `ns`, as ttlab's agent ConfigMap is: their payload
/// and the flag itself cannot change, their metadata can, and they can be deleted.
async fn immutable_objects_keep_their_payload(client: kube::Client, ns: &str) {
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
            .patch("token", &pa, &merge(json!({"immutable": false})))
            .await,
        "Secret",
        "token",
        &["immutable"],
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

    // Immutable objects can still be deleted.
    maps.delete("agent", &DeleteParams::default())
        .await
        .unwrap();
    secrets
        .delete("token", &DeleteParams::default())
        .await
        .unwrap();
}
