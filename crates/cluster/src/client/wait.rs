//! Waiting for a VMI to run, by watching it.
//!
//! A list (with a `metadata.name` field selector) gives the current state and a
//! resourceVersion; a watch from there delivers every change. The watch is re-opened where it
//! stopped when the server ends it, and re-listed when its resourceVersion expired (410).
//! Transient failures are retried with a capped backoff; anything else ends the wait. The
//! whole thing runs under one `tokio::time::timeout`, and the last state seen is kept outside
//! it, so a timeout can say where the VMI was stuck.

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use kube::api::{ListParams, WatchEvent, WatchParams};

use super::{KubeCluster, convert};
use crate::ClusterError;
use crate::types::{Kind, VmiPhase, VmiState};

/// The longest pause between attempts after a transient failure.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// The first pause after a transient failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// How long the server may hold one watch open before it is re-opened.
const WATCH_SECONDS: u32 = 290;

pub(super) async fn wait_running(
    cluster: &KubeCluster,
    name: &str,
    timeout: Duration,
) -> Result<VmiState, ClusterError> {
    let mut last = None;
    match tokio::time::timeout(timeout, follow(cluster, name, &mut last)).await {
        Ok(result) => result,
        Err(_) => Err(ClusterError::WaitTimedOut {
            name: name.to_owned(),
            waited: timeout,
            last: last.map(Box::new),
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
) -> Result<VmiState, ClusterError> {
    let api = cluster.dynamic(Kind::VirtualMachineInstance);
    let field = format!("metadata.name={name}");
    let mut backoff = FIRST_BACKOFF;

    // Each turn of this loop starts from a fresh list.
    loop {
        let listed = cluster
            .call(
                &format!("list VirtualMachineInstance {name}"),
                api.list(&ListParams::default().fields(&field)),
            )
            .await;
        let list = match listed {
            Ok(list) => list,
            Err(e) if e.is_retryable() => {
                tracing::debug!(vmi = name, error = %e, "listing the VMI failed; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
            Err(e) => return Err(e),
        };
        let mut version = list.metadata.resource_version.clone().unwrap_or_default();
        // The server should have filtered by name; check anyway.
        for object in list
            .items
            .iter()
            .filter(|o| o.metadata.name.as_deref() == Some(name))
        {
            let state = convert::vmi_state(object);
            if let Some(done) = judge(name, state.clone())? {
                return Ok(done);
            }
            *last = Some(state);
        }

        // Watch from the listed version until it expires.
        'watch: loop {
            let wp = WatchParams::default().fields(&field).timeout(WATCH_SECONDS);
            let opened = cluster
                .call(
                    &format!("watch VirtualMachineInstance {name}"),
                    api.watch(&wp, &version),
                )
                .await;
            let stream = match opened {
                Ok(stream) => stream,
                Err(e) if e.is_retryable() => {
                    tracing::debug!(vmi = name, error = %e, "opening the watch failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue 'watch;
                }
                Err(e) => return Err(e),
            };
            let mut stream = std::pin::pin!(stream.map_err(ClusterError::from_kube));
            let mut saw_event = false;
            while let Some(event) = stream.next().await {
                let event = match event {
                    Ok(event) => event,
                    Err(e) if e.is_retryable() => {
                        tracing::debug!(vmi = name, error = %e, "the watch broke; re-opening");
                        break;
                    }
                    Err(e) => return Err(e),
                };
                saw_event = true;
                backoff = FIRST_BACKOFF;
                match event {
                    WatchEvent::Added(object) | WatchEvent::Modified(object) => {
                        if let Some(v) = &object.metadata.resource_version {
                            version.clone_from(v);
                        }
                        if object.metadata.name.as_deref() != Some(name) {
                            continue;
                        }
                        let state = convert::vmi_state(&object);
                        if let Some(done) = judge(name, state.clone())? {
                            return Ok(done);
                        }
                        *last = Some(state);
                    }
                    WatchEvent::Deleted(object) => {
                        if let Some(v) = &object.metadata.resource_version {
                            version.clone_from(v);
                        }
                        if object.metadata.name.as_deref() == Some(name) {
                            // The VM may start a new VMI: keep waiting, remember the loss.
                            let mut state = convert::vmi_state(&object);
                            state.deleting = true;
                            *last = Some(state);
                        }
                    }
                    WatchEvent::Bookmark(bookmark) => {
                        version = bookmark.metadata.resource_version;
                    }
                    WatchEvent::Error(status) => {
                        let err =
                            ClusterError::from_status(status.code, &status.reason, &status.message);
                        if status.code == 410 || status.reason == "Expired" {
                            tracing::debug!(vmi = name, "the watch expired; listing again");
                            break 'watch;
                        }
                        if err.is_retryable() {
                            break;
                        }
                        return Err(err);
                    }
                }
            }
            if !saw_event {
                // The server ended the watch at once (or it broke before any event): do not
                // spin on it.
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}
