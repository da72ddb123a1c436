//! The real API server binds a pod once and deletes a bound pod for its kubelet (marked with
//! its grace period, removed by a delete of grace period 0), what a kubelet played outside
//! the API server relies on. The body is shared with kube-sim's
//! `rig/kube-sim/tests/suite/api.rs` (`tests/shared/parity.rs`).

#[path = "shared/parity.rs"]
mod parity;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ServiceAccount;
use kube::Api;

#[tokio::test]
async fn pods_are_bound_once_and_deleted_for_their_kubelet() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("pods").await.unwrap();
    let client = plane.admin_client().await.unwrap();
    // ServiceAccount admission refuses pods until the namespace's default account exists.
    let accounts: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    let until = Instant::now() + Duration::from_secs(30);
    while accounts.get_opt("default").await.unwrap().is_none() {
        assert!(Instant::now() < until, "no default ServiceAccount in {ns}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    parity::pods_are_bound_once_and_deleted_for_their_kubelet(client, &ns).await;
}
