//! Pod labs: a Pod's state, waiting for it to run, one command run without a TTY, and the
//! namespace's ResourceQuotas — on kube-sim and on the real control plane (with the kubelet
//! simulated by kubevirt-sim); exec needs a kubelet's streaming server, so kube-sim only.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use ttlab_cluster::{
    CapacityCluster as _, ConsoleCluster as _, PodPhase, PodWait, ProvisionCluster as _,
};

use crate::common::{self, Harness, retry_quota};

fn pod(h: &Harness, name: &str, deadline: Option<i64>) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": h.ns},
        "spec": {
            "activeDeadlineSeconds": deadline,
            "restartPolicy": "Never",
            "containers": [{"name": "lab", "image": "debian:12",
                "resources": {"requests": {"memory": "64Mi"}, "limits": {"memory": "64Mi"}}}]
        }
    }))
    .unwrap()
}

on_both_backends!(a_pod_is_waited_for_until_it_runs_and_ready);
async fn a_pod_is_waited_for_until_it_runs_and_ready(h: &Harness) {
    assert_eq!(h.cluster.pod_state("lab-1").await.unwrap(), None);
    // The wait starts before the Pod exists.
    let wait = h.cluster.wait_pod_running("lab-1", Duration::from_secs(10));
    let create = async {
        h.cluster.create_pod(pod(h, "lab-1", None)).await.unwrap();
    };
    let (waited, ()) = common::within(15, async { tokio::join!(wait, create) }).await;
    match waited.unwrap() {
        PodWait::Running(state) => {
            assert_eq!(state.phase, PodPhase::Running);
            assert!(state.ready && state.ip.is_some(), "{state:?}");
        }
        other => panic!("expected Running, got {other:?}"),
    }
    let state = h.cluster.pod_state("lab-1").await.unwrap().unwrap();
    assert!(state.is_usable(), "{state:?}");
}

on_both_backends!(a_pod_that_never_appears_times_out_and_one_past_its_deadline_ended);
async fn a_pod_that_never_appears_times_out_and_one_past_its_deadline_ended(h: &Harness) {
    let waited = h
        .cluster
        .wait_pod_running("nobody", Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(
        waited,
        PodWait::TimedOut {
            waited: Duration::from_millis(300),
            last: None
        }
    );
    h.cluster
        .create_pod(pod(h, "short", Some(1)))
        .await
        .unwrap();
    // Running first, then Failed (DeadlineExceeded) a second later.
    let first = h
        .cluster
        .wait_pod_running("short", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(first, PodWait::Running(_)), "{first:?}");
    let ended = common::within(10, async {
        loop {
            let s = h.cluster.pod_state("short").await.unwrap().unwrap();
            if s.phase.is_final() {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(ended.reason.as_deref(), Some("DeadlineExceeded"));
    match h
        .cluster
        .wait_pod_running("short", Duration::from_secs(5))
        .await
        .unwrap()
    {
        PodWait::Ended(s) => assert_eq!(s.phase, PodPhase::Failed),
        other => panic!("expected Ended, got {other:?}"),
    }
}

#[tokio::test]
async fn a_command_runs_without_a_tty_and_reports_its_exit_status() {
    let h = Harness::start().await;
    h.cluster.create_pod(pod(&h, "lab-2", None)).await.unwrap();
    let w = h
        .cluster
        .wait_pod_running("lab-2", Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(w, PodWait::Running(_)), "{w:?}");
    let sh = |script: &str| vec!["sh".to_owned(), "-c".to_owned(), script.to_owned()];
    let ok = h
        .cluster
        .exec_pod_command("lab-2", None, sh("echo hello"), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        (ok.exit_code, ok.stdout.as_str(), ok.timed_out),
        (Some(0), "hello\n", false)
    );
    let three = h
        .cluster
        .exec_pod_command("lab-2", Some("lab"), sh("exit 3"), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(three.exit_code, Some(3), "{three:?}");
    assert!(
        h.cluster
            .exec_pod_command("lab-2", None, vec![], Duration::from_secs(5))
            .await
            .is_err()
    );
    assert!(
        h.cluster
            .exec_pod_command("nope", None, sh("true"), Duration::from_secs(5))
            .await
            .unwrap_err()
            .is_not_found()
    );
}

on_both_backends!(resource_quotas_show_their_limits_and_usage);
async fn resource_quotas_show_their_limits_and_usage(h: &Harness) {
    h.pause_kubevirt();
    assert!(h.cluster.resource_quotas().await.unwrap().is_empty());
    h.create_quota(
        "ttlab-vms",
        json!({"count/virtualmachines.kubevirt.io": "8", "requests.memory": "48Gi"}),
    )
    .await;
    retry_quota(|| {
        h.cluster
            .create_vm(common::vm("q-1", &common::labels("dev")))
    })
    .await
    .unwrap();
    let quotas = h.cluster.resource_quotas().await.unwrap();
    assert_eq!(quotas.len(), 1, "{quotas:?}");
    let q = &quotas[0];
    assert_eq!(q.name, "ttlab-vms");
    assert_eq!(
        q.hard
            .get("count/virtualmachines.kubevirt.io")
            .map(String::as_str),
        Some("8")
    );
    assert_eq!(
        q.hard.get("requests.memory").map(String::as_str),
        Some("48Gi")
    );
    assert_eq!(
        q.used
            .get("count/virtualmachines.kubevirt.io")
            .map(String::as_str),
        Some("1"),
        "{q:?}"
    );
}
