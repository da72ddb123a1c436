//! Console keepalive against kube-sim: the client pings, kube-sim answers as any WebSocket
//! server does, and the connection stays usable well past the point where an unanswered ping
//! would have been taken for a dead connection. kube-sim only: the console subresource is
//! served by KubeVirt's virt-api, which the real control plane does not run.

use std::time::Duration;

use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use ttlab_cluster::{ClusterSettings, ConsoleCluster as _, ProvisionCluster as _, Terminal};

use crate::common::{self, Harness, within};

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
async fn pings_are_answered_by_kube_sim_and_an_idle_console_stays_open() {
    let every = Duration::from_millis(100);
    let h = Harness::start_with(ClusterSettings {
        console_ping_interval: Some(every),
        ..ClusterSettings::default()
    })
    .await;
    h.cluster
        .create_vm(common::vm("lab-idle", &common::labels("dev")))
        .await
        .unwrap();
    h.cluster
        .wait_vmi_running("lab-idle", Duration::from_secs(20))
        .await
        .unwrap();
    let mut term = h.cluster.open_console("lab-idle").await.unwrap();
    within(10, read_until(&mut term, ":~# ")).await;

    // Fifteen intervals of silence from the VM: only pongs arrive. Had one ping gone
    // unanswered for an interval, the output would have ended with an error.
    let idle = tokio::time::timeout(15 * every, term.output.next()).await;
    assert!(idle.is_err(), "the idle console ended: {idle:?}");

    term.input
        .send(Bytes::from_static(b"hostname\r"))
        .await
        .unwrap();
    within(10, read_until(&mut term, "lab-idle\r\n")).await;
}
