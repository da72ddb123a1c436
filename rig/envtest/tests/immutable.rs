//! The real API server refuses changes to an immutable ConfigMap's or Secret's payload, and
//! to any Secret's `type`, with a 422, in a dry run too, which stores nothing. The body is
//! shared with kube-sim's `rig/kube-sim/tests/suite/api.rs` (`tests/shared/parity.rs`).

#[path = "shared/parity.rs"]
mod parity;

#[tokio::test]
async fn immutable_config_maps_and_secrets_refuse_payload_changes() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("immutable").await.unwrap();
    let client = plane.admin_client().await.unwrap();
    parity::immutable_objects_keep_their_payload(client, &ns).await;
}
