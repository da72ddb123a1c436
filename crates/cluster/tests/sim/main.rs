//! The kube-rs `Cluster` implementation over HTTP, against kube-sim and — for every test that
//! needs none of kube-sim's own features (injected faults and latency, call records with
//! arrival times, stopping the server, consoles and pod exec, which need KubeVirt's virt-api
//! and a kubelet) — against the real control plane of `ttlab-envtest` too, KubeVirt and the
//! kubelet simulated there by `ttlab-kubevirt-sim`.

/// Runs the test body `$name(&Harness)` twice: on kube-sim (`$name::on_kube_sim`) and in a
/// namespace of its own on the real control plane (`$name::on_the_real_control_plane`), with
/// the client settings `$settings` (default: `ClusterSettings::default()`; the namespace is
/// the harness's).
macro_rules! on_both_backends {
    ($name:ident) => {
        on_both_backends!($name, ttlab_cluster::ClusterSettings::default());
    };
    ($name:ident, $settings:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_kube_sim() {
                let h = crate::common::Harness::start_with($settings).await;
                super::$name(&h).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn on_the_real_control_plane() {
                if let Some(h) = crate::common::Harness::start_real($settings).await {
                    super::$name(&h).await;
                    h.assert_kubevirt_accepted();
                }
            }
        }
    };
}

mod common;
mod console;
mod errors;
mod objects;
mod pods;
mod portforward;
mod vmi;
