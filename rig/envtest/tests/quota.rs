//! What the real quota admission and controller report after a create they admitted and
//! storage refused (`409 AlreadyExists`): the charge stays until the controller recounts. The
//! body is shared with kube-sim's `rig/kube-sim/tests/suite/quota.rs` (`tests/shared/parity.rs`).

#[path = "shared/parity.rs"]
mod parity;

use std::time::Duration;

#[tokio::test]
async fn a_refused_repeat_create_stays_charged_until_the_controller_recounts() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("repeat").await.unwrap();
    let client = plane.admin_client().await.unwrap();
    parity::a_refused_repeat_create_stays_charged_until_the_controller_recounts(
        client,
        &ns,
        Duration::from_secs(20),
    )
    .await;
}
