//! Waiting for a VMI to run, by watching it with kube-rs' runtime watcher ([`super::watch`]):
//! the list gives the current state, the watch every change; an expired resourceVersion (410)
//! is re-listed and transient failures are ridden out by the watcher itself, with a capped,
//! jittered backoff; anything else ends the wait. The whole thing runs under one
//! `tokio::time::timeout`, and the last state seen is kept outside it, so a timeout can say
//! where the VMI was stuck.

use std::time::Duration;

use futures::StreamExt;
use kube::runtime::watcher::Event;

use super::{KubeCluster, convert, watch};
use crate::ClusterError;
use crate::types::{Kind, VmiPhase, VmiState};

pub(super) async fn wait_running(
    cluster: &KubeCluster,
    name: &str,
    timeout: Duration,
) -> Result<VmiState, ClusterError> {
    let mut last = None;
    let mut faults = (0u32, None);
    match tokio::time::timeout(timeout, follow(cluster, name, &mut last, &mut faults)).await {
        Ok(result) => result,
        Err(_) => Err(ClusterError::WaitTimedOut {
            name: name.to_owned(),
            waited: timeout,
            last: last.map(Box::new),
            watch_faults: faults
                .1
                .map(|e: ClusterError| format!("the watch failed {} times (last: {e})", faults.0)),
        }),
    }
}

/// What one observed state means for the wait.
fn judge(name: &str, state: VmiState) -> Result<Option<VmiState>, ClusterError> {
    if state.phase == VmiPhase::Running && !state.deleting {
        Ok(Some(state))
    } else if state.phase.is_final() {
        Err(ClusterError::VmiEnded {
            name: name.to_owned(),
            state: Box::new(state),
        })
    } else {
        Ok(None)
    }
}

async fn follow(
    cluster: &KubeCluster,
    name: &str,
    last: &mut Option<VmiState>,
    faults: &mut (u32, Option<ClusterError>),
) -> Result<VmiState, ClusterError> {
    let api = cluster.dynamic(Kind::VirtualMachineInstance);
    let mut events = std::pin::pin!(watch::watch_named(api, name));
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(object) | Event::InitApply(object)) => {
                // The server should have filtered by name; check anyway.
                if object.metadata.name.as_deref() != Some(name) {
                    continue;
                }
                let state = convert::vmi_state(&object);
                if let Some(done) = judge(name, state.clone())? {
                    return Ok(done);
                }
                *last = Some(state);
            }
            Ok(Event::Delete(object)) => {
                if object.metadata.name.as_deref() == Some(name) {
                    // The VM may start a new VMI: keep waiting, remember the loss.
                    let mut state = convert::vmi_state(&object);
                    state.deleting = true;
                    *last = Some(state);
                }
            }
            Ok(Event::Init | Event::InitDone) => {}
            Err(e) => {
                let err = watch::watch_error(&format!("watch VirtualMachineInstance {name}"), e);
                if !err.is_retryable() {
                    return Err(err);
                }
                tracing::debug!(vmi = name, error = %err, "watching the VMI failed; the watcher recovers");
                faults.0 += 1;
                faults.1 = Some(err);
            }
        }
    }
    Err(ClusterError::Unexpected {
        message: format!("the watch of VirtualMachineInstance {name} ended"),
    })
}
