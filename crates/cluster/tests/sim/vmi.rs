//! Waiting for a VMI by watching it, its address, its serial console, pod exec. Waiting and
//! the address run on kube-sim and on the real control plane (with KubeVirt simulated by
//! kubevirt-sim); consoles need KubeVirt's virt-api and pod exec a kubelet, so they, and the
//! tests of injected faults, run on kube-sim only.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use ttlab_cluster::{ClusterError, ConsoleCluster as _, ProvisionCluster as _, Terminal, VmiPhase};
use ttlab_kube_sim::{FaultRule, Verb};

use crate::common::{self, Harness, within};

on_both_backends!(waiting_returns_once_the_vmi_runs);
async fn waiting_returns_once_the_vmi_runs(h: &Harness) {
    h.cluster
        .create_vm(common::vm("lab-run", &common::labels("dev")))
        .await
        .unwrap();
    let mark = h.mark();
    let started = Instant::now();
    let state = h
        .cluster
        .wait_vmi_running("lab-run", Duration::from_secs(20))
        .await
        .unwrap();
    eprintln!(
        "VMI Running after {:?} (simulated KubeVirt, fast timings)",
        started.elapsed()
    );
    assert_eq!(state.phase, VmiPhase::Running);
    assert_eq!(state.name, "lab-run");
    let ip = h
        .cluster
        .vmi_ip("lab-run")
        .await
        .unwrap()
        .expect("a Running VMI has an IP");
    assert_eq!(Some(ip), h.guest_ip("lab-run").map(Into::into));
    assert!(ip.is_loopback());
    // It watched rather than polled: one list, then watches, and no repeated gets.
    let on_vmis: Vec<String> = h
        .calls_since(mark)
        .into_iter()
        .filter(|c| c.resource == "virtualmachineinstances")
        .map(|c| c.verb)
        .collect();
    assert!(on_vmis.iter().any(|v| v == "watch"), "{on_vmis:?}");
    assert!(
        on_vmis.iter().filter(|v| *v == "list").count() <= 2,
        "{on_vmis:?}"
    );
}

on_both_backends!(an_already_running_vmi_is_returned_at_once);
async fn an_already_running_vmi_is_returned_at_once(h: &Harness) {
    h.cluster
        .create_vm(common::vm("lab-early", &common::labels("dev")))
        .await
        .unwrap();
    h.cluster
        .wait_vmi_running("lab-early", Duration::from_secs(20))
        .await
        .unwrap();
    let again = within(
        5,
        h.cluster
            .wait_vmi_running("lab-early", Duration::from_secs(20)),
    )
    .await
    .unwrap();
    assert_eq!(again.phase, VmiPhase::Running);
}

on_both_backends!(a_vmi_that_never_appears_times_out_with_nothing_seen);
async fn a_vmi_that_never_appears_times_out_with_nothing_seen(h: &Harness) {
    h.pause_kubevirt();
    h.cluster
        .create_vm(common::vm("lab-paused", &common::labels("dev")))
        .await
        .unwrap();
    let started = Instant::now();
    let err = h
        .cluster
        .wait_vmi_running("lab-paused", Duration::from_millis(500))
        .await
        .unwrap_err();
    let waited = started.elapsed();
    match err {
        ClusterError::WaitTimedOut {
            name,
            waited: w,
            last,
            watch_faults,
        } => {
            assert_eq!(watch_faults, None);
            assert_eq!(name, "lab-paused");
            assert_eq!(w, Duration::from_millis(500));
            assert!(last.is_none(), "{last:?}");
        }
        other => panic!("expected WaitTimedOut, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_millis(500) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}

on_both_backends!(a_vmi_stuck_on_a_missing_pvc_times_out_saying_why);
async fn a_vmi_stuck_on_a_missing_pvc_times_out_saying_why(h: &Harness) {
    h.cluster
        .create_vm(common::vm_on_pvc(
            "lab-nopvc",
            &common::labels("dev"),
            "golden-missing",
        ))
        .await
        .unwrap();
    // Long enough for KubeVirt to have created the VMI and said why it is stuck (through
    // watches on a real API server, in process on kube-sim).
    let wait = Duration::from_secs(if h.is_real() { 5 } else { 1 });
    let err = h
        .cluster
        .wait_vmi_running("lab-nopvc", wait)
        .await
        .unwrap_err();
    let ClusterError::WaitTimedOut { last, .. } = &err else {
        panic!("expected WaitTimedOut, got {err:?}");
    };
    let last = last.as_ref().expect("the VMI was seen");
    assert_eq!(last.phase, VmiPhase::Pending);
    let reason = last.blocking_condition().and_then(|c| c.reason.clone());
    assert_eq!(reason.as_deref(), Some("FailedPvcNotFound"), "{last:?}");
    assert!(err.to_string().contains("FailedPvcNotFound"), "{err}");
}

on_both_backends!(a_vmi_that_ends_stops_the_wait);
async fn a_vmi_that_ends_stops_the_wait(h: &Harness) {
    let mut vm = common::vm("lab-once", &common::labels("dev"));
    vm["spec"]["runStrategy"] = "Once".into();
    h.cluster.create_vm(vm).await.unwrap();
    h.cluster
        .wait_vmi_running("lab-once", Duration::from_secs(20))
        .await
        .unwrap();
    h.crash("lab-once");
    // The guest's end reaches the VMI's status asynchronously (KubeVirt's node agent reports
    // it), so a wait begun at once may still see it Running, and rightly return.
    within(h.settle_secs(), async {
        while !h
            .cluster
            .vmi_state("lab-once")
            .await
            .unwrap()
            .is_some_and(|s| s.phase.is_final())
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let err = within(
        10,
        h.cluster
            .wait_vmi_running("lab-once", Duration::from_secs(60)),
    )
    .await
    .unwrap_err();
    match err {
        ClusterError::VmiEnded { state, .. } => assert_eq!(state.phase, VmiPhase::Failed),
        other => panic!("expected VmiEnded, got {other:?}"),
    }
}

#[tokio::test]
async fn a_transient_failure_during_the_wait_is_ridden_out() {
    let h = Harness::start().await;
    h.sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::Watch), Some("virtualmachineinstances"), 503).times(2));
    h.cluster
        .create_vm(common::vm("lab-flaky", &common::labels("dev")))
        .await
        .unwrap();
    let state = h
        .cluster
        .wait_vmi_running("lab-flaky", Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(state.phase, VmiPhase::Running);
}

on_both_backends!(a_forbidden_watch_fails_at_once);
async fn a_forbidden_watch_fails_at_once(h: &Harness) {
    let denied = h.denied(Verb::List, "virtualmachineinstances").await;
    let err = within(5, denied.wait_vmi_running("lab-x", Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Forbidden { .. }), "{err:?}");
}

/// Reads console output until `needle` appears (or the stream ends).
async fn read_until(term: &mut Terminal, needle: &str) -> String {
    let mut seen = String::new();
    while !seen.contains(needle) {
        match term.output.next().await {
            Some(Ok(bytes)) => seen.push_str(&String::from_utf8_lossy(&bytes)),
            Some(Err(e)) => panic!("console error after {seen:?}: {e}"),
            None => panic!("console closed before {needle:?}; saw {seen:?}"),
        }
    }
    seen
}

#[tokio::test]
async fn the_console_echoes_binary_frames_and_runs_builtins() {
    let h = Harness::start().await;
    h.cluster
        .create_vm(common::vm("lab-tty", &common::labels("dev")))
        .await
        .unwrap();
    h.cluster
        .wait_vmi_running("lab-tty", Duration::from_secs(20))
        .await
        .unwrap();
    let mut term = h.cluster.open_console("lab-tty").await.unwrap();
    term.input
        .send(Bytes::from_static(b"hostname\r"))
        .await
        .unwrap();
    let out = within(10, read_until(&mut term, "lab-tty\r\n")).await;
    assert!(
        out.contains("hostname"),
        "the typed command is echoed: {out:?}"
    );
}

#[tokio::test]
async fn a_second_console_closes_the_first() {
    let h = Harness::start().await;
    h.cluster
        .create_vm(common::vm("lab-two", &common::labels("dev")))
        .await
        .unwrap();
    h.cluster
        .wait_vmi_running("lab-two", Duration::from_secs(20))
        .await
        .unwrap();
    let mut first = h.cluster.open_console("lab-two").await.unwrap();
    let mut second = h.cluster.open_console("lab-two").await.unwrap();
    // The first one's output ends (after whatever it had buffered).
    within(10, async {
        while let Some(item) = first.output.next().await {
            if item.is_err() {
                break;
            }
        }
    })
    .await;
    second
        .input
        .send(Bytes::from_static(b"whoami\r"))
        .await
        .unwrap();
    within(10, read_until(&mut second, "root")).await;
}

#[tokio::test]
async fn a_console_before_running_is_not_ready_and_a_missing_vmi_not_found() {
    let h = Harness::start().await;
    let err = h.cluster.open_console("no-such-vmi").await.unwrap_err();
    assert!(matches!(err, ClusterError::NotFound { .. }), "{err:?}");

    // A VMI whose PVC is missing stays Pending for ever.
    h.cluster
        .create_vm(common::vm_on_pvc(
            "lab-pending",
            &common::labels("dev"),
            "nope",
        ))
        .await
        .unwrap();
    let err = h
        .cluster
        .wait_vmi_running("lab-pending", Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClusterError::WaitTimedOut { last: Some(_), .. }),
        "{err:?}"
    );
    let err = h.cluster.open_console("lab-pending").await.unwrap_err();
    assert!(
        matches!(err, ClusterError::ConsoleNotReady { .. }),
        "{err:?}"
    );
    assert!(err.is_retryable());
}

#[tokio::test]
async fn console_refusals_from_the_server_are_typed() {
    let h = Harness::start().await;
    h.cluster
        .create_vm(common::vm("lab-deny", &common::labels("dev")))
        .await
        .unwrap();
    h.cluster
        .wait_vmi_running("lab-deny", Duration::from_secs(20))
        .await
        .unwrap();
    h.sim().faults().add(
        FaultRule::fail(
            Some(Verb::Get),
            Some("virtualmachineinstances/console"),
            403,
        )
        .times(1),
    );
    let err = h.cluster.open_console("lab-deny").await.unwrap_err();
    assert!(matches!(err, ClusterError::Forbidden { .. }), "{err:?}");
    h.sim().faults().add(
        FaultRule::fail(
            Some(Verb::Get),
            Some("virtualmachineinstances/console"),
            400,
        )
        .times(1),
    );
    let err = h.cluster.open_console("lab-deny").await.unwrap_err();
    assert!(
        matches!(err, ClusterError::ConsoleNotReady { .. }),
        "{err:?}"
    );
    // And then it opens.
    h.cluster.open_console("lab-deny").await.unwrap();
}

#[tokio::test]
async fn pod_exec_is_a_tty_byte_stream() {
    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
    let h = Harness::start().await;
    let pod = Pod {
        metadata: kube::api::ObjectMeta {
            name: Some("lab-pod".into()),
            labels: Some(common::labels("dev").to_map()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "lab".into(),
                image: Some("debian:12".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    };
    h.cluster.create_pod(pod).await.unwrap();
    let api: kube::Api<Pod> = kube::Api::namespaced(h.cluster.client().clone(), &h.ns);
    within(
        10,
        kube::runtime::wait::await_condition(
            api,
            "lab-pod",
            kube::runtime::wait::conditions::is_pod_running(),
        ),
    )
    .await
    .unwrap();
    let mut term = h
        .cluster
        .exec_pod("lab-pod", Some("lab"), vec!["/bin/sh".into()])
        .await
        .unwrap();
    term.input
        .send(Bytes::from_static(b"echo hi-there\n"))
        .await
        .unwrap();
    within(10, read_until(&mut term, "hi-there")).await;
}
