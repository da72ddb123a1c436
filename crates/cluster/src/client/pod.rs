//! Pod labs: a Pod's state, waiting for it to run (by watching with kube-rs' runtime watcher,
//! like the VMI wait), a command
//! run without a TTY (grading), and the namespace's ResourceQuotas.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Pod, ResourceQuota};
use kube::api::{Api, AttachParams, ListParams};
use kube::runtime::watcher::Event;
use tokio::io::{AsyncRead, AsyncReadExt};

use super::KubeCluster;
use crate::ClusterError;
use crate::pod::{EXEC_OUTPUT_LIMIT, ExecOutput, PodPhase, PodState, PodWait, QuotaSummary};

pub(super) fn pod_state(pod: &Pod) -> PodState {
    let status = pod.status.as_ref();
    PodState {
        name: pod.metadata.name.clone().unwrap_or_default(),
        phase: PodPhase::parse(status.and_then(|s| s.phase.as_deref()).unwrap_or("")),
        ready: status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True")),
        ip: status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse::<IpAddr>().ok()),
        deleting: pod.metadata.deletion_timestamp.is_some(),
        reason: status.and_then(|s| s.reason.clone()),
        message: status.and_then(|s| s.message.clone()),
    }
}

/// What one observed state means for the wait: `Some` ends it.
fn judge(state: PodState) -> Option<PodWait> {
    if state.is_usable() {
        Some(PodWait::Running(state))
    } else if state.phase.is_final() {
        Some(PodWait::Ended(state))
    } else {
        None
    }
}

pub(super) async fn wait_running(
    cluster: &KubeCluster,
    name: &str,
    timeout: Duration,
) -> Result<PodWait, ClusterError> {
    let mut last = None;
    match tokio::time::timeout(timeout, follow(cluster, name, &mut last)).await {
        Ok(result) => result,
        Err(_) => Ok(PodWait::TimedOut {
            waited: timeout,
            last,
        }),
    }
}

async fn follow(
    cluster: &KubeCluster,
    name: &str,
    last: &mut Option<PodState>,
) -> Result<PodWait, ClusterError> {
    let mut events = std::pin::pin!(super::watch::watch_named(cluster.pods(), name));
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Apply(pod) | Event::InitApply(pod)) => {
                if pod.metadata.name.as_deref() != Some(name) {
                    continue;
                }
                let state = pod_state(&pod);
                if let Some(done) = judge(state.clone()) {
                    return Ok(done);
                }
                *last = Some(state);
            }
            Ok(Event::Delete(pod)) => {
                if pod.metadata.name.as_deref() == Some(name) {
                    // A deleted Pod never comes back by itself (nothing recreates a lab Pod):
                    // the wait is over.
                    let mut state = pod_state(&pod);
                    state.deleting = true;
                    return Ok(PodWait::Ended(state));
                }
            }
            Ok(Event::Init | Event::InitDone) => {}
            Err(e) => {
                let err = super::watch::watch_error(&format!("watch Pod {name}"), e);
                if !err.is_retryable() {
                    return Err(err);
                }
                tracing::debug!(pod = name, error = %err, "watching the Pod failed; the watcher recovers");
            }
        }
    }
    Err(ClusterError::Unexpected {
        message: format!("the watch of Pod {name} ended"),
    })
}

/// Reads `reader` to its end, keeping at most [`EXEC_OUTPUT_LIMIT`] bytes.
async fn read_limited(reader: Option<impl AsyncRead + Unpin>) -> Vec<u8> {
    let mut kept = Vec::new();
    let Some(mut reader) = reader else {
        return kept;
    };
    let mut buf = [0u8; 8192];
    loop {
        match reader.read(&mut buf).await {
            Ok(0) | Err(_) => return kept,
            Ok(n) => {
                let room = EXEC_OUTPUT_LIMIT.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
}

/// The exit code in the exec's final `Status`: `Success` is 0, `NonZeroExitCode` carries it
/// in a cause `ExitCode`.
fn exit_code(
    status: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Status,
) -> Result<i32, ClusterError> {
    if status.status.as_deref() == Some("Success") {
        return Ok(0);
    }
    if status.reason.as_deref() == Some("NonZeroExitCode")
        && let Some(code) = status
            .details
            .as_ref()
            .and_then(|d| d.causes.as_ref())
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c.reason.as_deref() == Some("ExitCode"))
                    .and_then(|c| c.message.as_deref())
            })
            .and_then(|m| m.trim().parse::<i32>().ok())
    {
        return Ok(code);
    }
    Err(ClusterError::Unexpected {
        message: format!(
            "exec ended without an exit code: {}",
            status.message.as_deref().unwrap_or("no message")
        ),
    })
}

pub(super) async fn exec_command(
    cluster: &KubeCluster,
    pod: &str,
    container: Option<&str>,
    command: Vec<String>,
    timeout: Duration,
) -> Result<ExecOutput, ClusterError> {
    let api: Api<Pod> = cluster.pods();
    let mut params = AttachParams::default()
        .stdin(false)
        .stdout(true)
        .stderr(true)
        .tty(false);
    if let Some(c) = container {
        params = params.container(c);
    }
    let started = Instant::now();
    let mut process = cluster
        .call(
            &format!("exec in Pod {pod}"),
            api.exec(pod, command, &params),
        )
        .await?;
    let stdout = process.stdout();
    let stderr = process.stderr();
    let status = process.take_status();
    let run = async move {
        let (out, err) = tokio::join!(read_limited(stdout), read_limited(stderr));
        let status = match status {
            Some(s) => s.await,
            None => None,
        };
        (out, err, status)
    };
    match tokio::time::timeout(timeout, run).await {
        Ok((out, err, status)) => {
            let status = status.ok_or_else(|| ClusterError::Transient {
                message: format!("exec in Pod {pod}: the connection ended without a status"),
            })?;
            Ok(ExecOutput {
                exit_code: Some(exit_code(&status)?),
                stdout: String::from_utf8_lossy(&out).into_owned(),
                stderr: String::from_utf8_lossy(&err).into_owned(),
                timed_out: false,
                duration: started.elapsed(),
            })
        }
        Err(_) => {
            process.abort();
            Ok(ExecOutput {
                exit_code: None,
                stdout: String::new(),
                stderr: String::new(),
                timed_out: true,
                duration: started.elapsed(),
            })
        }
    }
}

pub(super) async fn quotas(cluster: &KubeCluster) -> Result<Vec<QuotaSummary>, ClusterError> {
    let api: Api<ResourceQuota> = Api::namespaced(cluster.client().clone(), cluster.ns());
    let list = cluster
        .call("list ResourceQuota", api.list(&ListParams::default()))
        .await?;
    let quantities = |m: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >| {
        m.map(|m| m.iter().map(|(k, v)| (k.clone(), v.0.clone())).collect())
            .unwrap_or_default()
    };
    let mut all: Vec<QuotaSummary> = list
        .items
        .iter()
        .map(|q| {
            let status = q.status.as_ref();
            QuotaSummary {
                name: q.metadata.name.clone().unwrap_or_default(),
                hard: match status.and_then(|s| s.hard.as_ref()) {
                    Some(h) => quantities(Some(h)),
                    None => quantities(q.spec.as_ref().and_then(|s| s.hard.as_ref())),
                },
                used: quantities(status.and_then(|s| s.used.as_ref())),
            }
        })
        .collect();
    all.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Status, StatusCause, StatusDetails};

    #[test]
    fn exit_codes_come_from_the_final_status() {
        let ok = Status {
            status: Some("Success".into()),
            ..Status::default()
        };
        assert_eq!(exit_code(&ok).unwrap(), 0);
        let three = Status {
            status: Some("Failure".into()),
            reason: Some("NonZeroExitCode".into()),
            details: Some(StatusDetails {
                causes: Some(vec![StatusCause {
                    reason: Some("ExitCode".into()),
                    message: Some("3".into()),
                    ..StatusCause::default()
                }]),
                ..StatusDetails::default()
            }),
            ..Status::default()
        };
        assert_eq!(exit_code(&three).unwrap(), 3);
        let broken = Status {
            status: Some("Failure".into()),
            message: Some("container not found".into()),
            ..Status::default()
        };
        assert!(exit_code(&broken).is_err());
    }
}
