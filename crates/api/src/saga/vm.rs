//! Steps ③ to ⑧ for a VM lesson: disk, Secrets and VMs, then VMI Running, then the agent's
//! readiness marker.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::try_join_all;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::AgentToken;
use ttlab_cloudinit::{UserDataInput, UserDataSecret, render_user_data};
use ttlab_cluster::{ClusterError, Created};
use ttlab_lesson::Lesson;
use ttlab_model::NodeName;
use ttlab_model::labels::ObjectLabels;
use ttlab_store::{DiskKind, Session, SessionVm, Stage};
use ttlab_vm_manifest::{AgentDisk, SessionVms, render_with_agent, secret_name, vm_name};

use super::{Stop, create_object, ensure_starting, with_db};
use crate::AppState;

/// Polls of the VMI's address: first pause, longest pause.
const AGENT_POLL_FIRST: Duration = Duration::from_millis(50);
const AGENT_POLL_MAX: Duration = Duration::from_millis(200);
/// Pause between readiness polls of the agent once the VMI runs: fixed and short, so a
/// session is marked running at most this long (plus one request) after its guest is ready.
const READY_POLL: Duration = Duration::from_millis(100);

pub(crate) async fn provision(state: &AppState, session: &Session) -> Result<(), Stop> {
    let lesson = state
        .config()
        .lessons
        .get(&session.lesson)
        .cloned()
        .ok_or_else(|| {
            Stop::Failed(format!(
                "the lesson {} is no longer offered",
                session.lesson
            ))
        })?;
    let store = state.store();

    // ④ the root disk.
    let (decision, reason) = super::disk::decide(state, &lesson).await;
    let kind = match decision {
        ttlab_disk_select::DiskDecision::Golden { .. } => DiskKind::Golden,
        ttlab_disk_select::DiskDecision::ContainerDisk { .. } => DiskKind::Container,
    };
    with_db(|| async {
        store
            .sessions()
            .record_disk(session.id, kind, &reason)
            .await
    })
    .await?;
    state
        .metrics()
        .disk_decisions
        .get_or_create(&crate::metrics::DiskLabels {
            kind: kind.as_str().to_owned(),
            reason: reason.clone(),
        })
        .inc();

    // The names first, so a crash after any creation leaves a row naming what to delete.
    let nodes: Vec<NodeName> = lesson.nodes.as_slice().to_vec();
    let vms: Vec<SessionVm> = nodes
        .iter()
        .map(|n| SessionVm {
            node: n.clone(),
            name: vm_name(session.id, n),
        })
        .collect();
    with_db(|| async { store.sessions().record_vms(session.id, &vms).await }).await?;

    let agent = &state.config().agent;
    let manifests = render_with_agent(
        &SessionVms {
            session: session.id,
            env: state.config().env.clone(),
            lesson: lesson.id.clone(),
            namespace: None,
            image: lesson.image.clone(),
            memory: lesson.memory.as_str().to_owned(),
            cores: lesson.cores,
            nodes: nodes.clone(),
            disk: decision,
            termination_grace_period_seconds:
                ttlab_vm_manifest::DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS,
        },
        &AgentDisk {
            config_map: agent.config_map_name(),
            volume_label: agent.volume_label().to_owned(),
        },
    )
    .map_err(|e| Stop::Failed(format!("the lesson cannot be turned into a VM: {e}")))?;

    let power_off_at = session.lifespan().hard_deadline(&state.config().policy);

    // ③ a fresh agent token per VM (those already stored, for a resumed session), stored
    // before any Secret carries it.
    let tokens: Vec<AgentToken> = super::resume_tokens(state, session, &nodes).await?;
    let pairs: Vec<(NodeName, &str)> = nodes
        .iter()
        .cloned()
        .zip(tokens.iter().map(AgentToken::reveal))
        .collect();
    if !with_db(|| async { store.agent_tokens().put(session.id, &pairs).await }).await? {
        return Err(Stop::Superseded);
    }

    // The agent's shared ConfigMap, before any VM references it: the version is recorded as
    // seen first (the reaper keeps what a server saw within its minimum age), then the
    // ConfigMap is made sure of.
    with_db(|| async { super::record_agent_seen(state).await }).await?;
    create_object(state, session, "agent ConfigMap", || {
        super::ensure_agent_config_map(state)
    })
    .await?;

    // ③ + ⑤: each VM, then its Secret owned by it; the representative (first) VM owns the
    // other VMs, the Service and the NetworkPolicy.
    let mut representative: Option<Created> = None;
    for ((vm, node), token) in manifests.vms.into_iter().zip(&nodes).zip(&tokens) {
        let mut vm = vm;
        if let Some(rep) = &representative {
            vm.metadata.owner_references = Some(vec![rep.owner_reference()]);
        }
        let json = serde_json::to_value(&vm)
            .map_err(|e| Stop::Failed(format!("cannot encode the VM: {e}")))?;
        let created = create_object(state, session, "VM", || {
            state.cluster().create_vm(json.clone())
        })
        .await?;
        if representative.is_none() {
            super::record_stage(state, session, Stage::VmCreated).await?;
            observe_stage(state, session, "vm_created").await;
        }
        ensure_starting(state, session).await?;
        let secret = user_data_secret(state, session, &lesson, node, token, power_off_at)?
            .to_secret(Some(created.owner_reference()));
        create_object(state, session, "cloud-init Secret", || {
            state.cluster().create_secret(secret.clone())
        })
        .await?;
        if representative.is_none() {
            representative = Some(created);
        }
    }
    let owner = representative
        .as_ref()
        .map(Created::owner_reference)
        .ok_or_else(|| Stop::Failed("the lesson has no node".into()))?;
    if let Some(mut service) = manifests.service {
        service.metadata.owner_references = Some(vec![owner.clone()]);
        create_object(state, session, "session Service", || {
            state.cluster().create_service(service.clone())
        })
        .await?;
    }
    if let Some(mut policy) = manifests.network_policy {
        policy.metadata.owner_references = Some(vec![owner]);
        create_object(state, session, "session NetworkPolicy", || {
            state.cluster().create_network_policy(policy.clone())
        })
        .await?;
    }
    ensure_starting(state, session).await?;

    // ⑥–⑦: every VMI Running within the lesson's readiness timeout.
    let readiness = lesson.readiness_timeout;
    let running = try_join_all(vms.iter().map(|v| async move {
        state
            .cluster()
            .wait_vmi_running(&v.name, readiness)
            .await
            .map_err(|e| vmi_failed(&e, readiness))
    }))
    .await;
    let running = match running {
        Ok(running) => running,
        Err(stop) => {
            // A VM that did not start may be waiting for its agent disk: check it again next
            // time rather than trust the earlier finding.
            super::agent::distrust_agent(state).await;
            return Err(stop);
        }
    };
    super::record_stage(state, session, Stage::VmiRunning).await?;
    observe_stage(state, session, "vmi_running").await;
    ensure_starting(state, session).await?;

    // ⑧: the agent's readiness marker on every node, within the setup timeout.
    let setup = lesson.setup_timeout;
    let agent_up = std::sync::atomic::AtomicBool::new(false);
    try_join_all(
        vms.iter()
            .zip(running)
            .zip(&tokens)
            .map(|((v, vmi), token)| {
                let agent_up = &agent_up;
                async move {
                    let ip = match vmi.ip {
                        Some(ip) => ip,
                        None => wait_ip(state, &v.name, setup).await?,
                    };
                    let client = AgentClient::new(
                        SocketAddr::new(ip, state.config().agent_port),
                        token.clone(),
                    )
                    .with_timeouts(Duration::from_secs(2), Duration::from_secs(5))
                    .with_user_agent(state.config().user_agent.as_str());
                    wait_agent(state, session, &client, setup, agent_up).await
                }
            }),
    )
    .await?;

    match with_db(|| async { store.sessions().mark_running(session.id, None).await }).await? {
        Some(_) => {
            observe_stage(state, session, "ready").await;
            Ok(())
        }
        None => Err(Stop::Superseded),
    }
}

fn user_data_secret(
    state: &AppState,
    session: &Session,
    lesson: &Lesson,
    node: &NodeName,
    token: &AgentToken,
    power_off_at: DateTime<Utc>,
) -> Result<UserDataSecret, Stop> {
    let user_data = render_user_data(&UserDataInput {
        lesson,
        node,
        agent: &state.config().agent,
        token,
        power_off_at,
    })
    .map_err(|e| Stop::Failed(format!("cannot render cloud-init: {e}")))?;
    let labels = ObjectLabels::new(
        session.id,
        state.config().env.clone(),
        lesson.id.clone(),
        Some(node.clone()),
    );
    UserDataSecret::new(secret_name(session.id, node), labels, user_data)
        .map_err(|e| Stop::Failed(format!("cannot build the cloud-init Secret: {e}")))
}

/// Records the time from the request to `stage` in the metrics (database clock).
async fn observe_stage(state: &AppState, session: &Session, stage: &str) {
    if let Ok(now) = state.store().db_now().await {
        let secs = (now - session.created_at).num_milliseconds() as f64 / 1000.0;
        state.metrics().observe_stage(stage, secs);
    }
}

fn vmi_failed(e: &ClusterError, readiness: Duration) -> Stop {
    match e {
        ClusterError::WaitTimedOut {
            last, watch_faults, ..
        } => {
            // What held the VMI, else why it could not be watched.
            let why = last
                .as_deref()
                .and_then(|s| s.blocking_condition())
                .map(|c| {
                    format!(
                        " ({}: {})",
                        c.reason.as_deref().unwrap_or(""),
                        c.message.as_deref().unwrap_or("")
                    )
                })
                .or_else(|| watch_faults.as_ref().map(|f| format!(" ({f})")))
                .unwrap_or_default();
            Stop::Failed(format!(
                "VM did not start within {} s{why}",
                readiness.as_secs()
            ))
        }
        ClusterError::VmiEnded { state, .. } => Stop::Failed(format!(
            "the VM stopped before it was ready ({})",
            state.describe()
        )),
        other => Stop::Failed(format!("could not watch the VM start: {other}")),
    }
}

async fn wait_ip(state: &AppState, vmi: &str, within: Duration) -> Result<IpAddr, Stop> {
    let deadline = tokio::time::Instant::now() + within;
    let mut pause = AGENT_POLL_FIRST;
    loop {
        if let Ok(Some(ip)) = state.cluster().vmi_ip(vmi).await {
            return Ok(ip);
        }
        if tokio::time::Instant::now() + pause > deadline {
            return Err(Stop::Failed(format!(
                "the VM got no network address within {} s",
                within.as_secs()
            )));
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(AGENT_POLL_MAX);
    }
}

/// Polls the agent's readiness every [`READY_POLL`] until the marker is reported (Ok), the
/// setup reports failure, or `within` runs out.
async fn wait_agent(
    state: &AppState,
    session: &Session,
    client: &AgentClient,
    within: Duration,
    agent_up: &std::sync::atomic::AtomicBool,
) -> Result<(), Stop> {
    let deadline = tokio::time::Instant::now() + within;
    let mut answered = false;
    loop {
        match client.ready().await {
            Ok(r) => {
                if !answered {
                    answered = true;
                    if !agent_up.swap(true, std::sync::atomic::Ordering::SeqCst) {
                        super::record_stage(state, session, Stage::AgentUp).await?;
                        observe_stage(state, session, "agent_up").await;
                    }
                }
                if let Some(reason) = r.failed {
                    let reason = reason.trim();
                    return Err(Stop::Failed(if reason.is_empty() {
                        "setup script failed".to_owned()
                    } else {
                        format!("setup script failed: {reason}")
                    }));
                }
                if r.ready {
                    return Ok(());
                }
            }
            Err(e) if e.is_retryable() => {}
            Err(e) => {
                return Err(Stop::Failed(format!(
                    "the VM's agent refused the server: {e}"
                )));
            }
        }
        if tokio::time::Instant::now() + READY_POLL > deadline {
            return Err(Stop::Failed(if answered {
                format!("setup script did not finish within {} s", within.as_secs())
            } else {
                format!(
                    "the VM's agent did not answer within {} s",
                    within.as_secs()
                )
            }));
        }
        tokio::time::sleep(READY_POLL).await;
    }
}
