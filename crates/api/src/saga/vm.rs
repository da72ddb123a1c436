//! Steps ③ to ⑧ for a VM lesson: disk, Secrets and VMs, then VMI Running, then the agent's
//! readiness marker. [`provision`] is the walk, one named step per line; the steps follow it
//! in the same order. A step that fails returns [`Stop`]; whatever was created is deleted by
//! the caller (`saga::provision`), which marks the session failed with the reason.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::try_join_all;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::AgentToken;
use ttlab_background::Backoff;
use ttlab_cloudinit::{UserDataInput, UserDataSecret, render_user_data};
use ttlab_cluster::{ClusterError, Created, VmiState};
use ttlab_disk_select::DiskDecision;
use ttlab_lesson::Lesson;
use ttlab_model::labels::ObjectLabels;
use ttlab_model::{NodeName, SessionStatus};
use ttlab_store::{DiskKind, Session, SessionVm, Stage};
use ttlab_vm_manifest::{
    AgentDisk, SessionManifests, SessionVms, VirtualMachine, render_with_agent, secret_name,
    vm_name,
};

use super::steps::{self, ensure_starting, observe_stage, record_stage};
use super::{Failure, Stop, create_object, with_db};
use crate::AppState;
use crate::agent_route::agent_client;
use crate::config::AgentPath;
use crate::sites::SiteRuntime;

/// Polls of the VMI's address: 50 ms, doubling up to 200 ms.
const ADDRESS_POLL: Backoff =
    Backoff::doubling(Duration::from_millis(50), Duration::from_millis(200)).without_jitter();
/// Pause between readiness polls of the agent once the VMI runs: fixed and short, so a
/// session is marked running at most this long (plus one request) after its guest is ready.
const READY_POLL: Duration = Duration::from_millis(100);

/// Provisions a VM lesson's session, from its `starting` row to `running`.
pub(crate) async fn provision(state: &AppState, session: &Session) -> Result<(), Stop> {
    let lesson = steps::offered_lesson(state, session)?;
    let vm = VmProvisioning {
        state,
        session,
        lesson: &lesson,
    };
    let disk = vm.choose_disk().await?; // ④
    let vms = vm.record_vm_names().await?;
    let manifests = vm.render(disk)?;
    let tokens = vm.store_agent_tokens(&vms).await?; // ③
    let owner = vm.create_vms_and_secrets(manifests.vms, &tokens).await?; // ③ + ⑤
    vm.create_peer_network(manifests.service, manifests.network_policy, owner)
        .await?;
    ensure_starting(state, session).await?;
    let running = vm.wait_vmis_running(&vms).await?; // ⑥–⑦
    ensure_starting(state, session).await?;
    vm.wait_agents_ready(&vms, running, &tokens).await?; // ⑧
    if session.pool_member {
        member_ready(state, session).await?;
    } else {
        steps::mark_running(state, session).await?;
    }
    observe_stage(state, session, "ready").await;
    Ok(())
}

/// A pool member is ready: marked running unclaimed; or, claimed by a student while it was
/// prepared, handed over to them first (the guests' hard deadline re-armed, the agent tokens
/// rotated) and then marked running. The two statements are conditional on the claim, so a
/// claim racing the readiness is seen either way.
async fn member_ready(state: &AppState, session: &Session) -> Result<(), Stop> {
    let sessions = || state.store().sessions();
    for _ in 0..3 {
        let marked =
            with_db(|| async { sessions().mark_member_running(session.id, false).await }).await?;
        if marked.is_some() {
            return Ok(());
        }
        let fresh = with_db(|| async { sessions().get(session.id).await })
            .await?
            .ok_or(Stop::Superseded)?;
        if fresh.status != SessionStatus::Starting {
            return Err(Stop::Superseded);
        }
        if fresh.claimed_at.is_some() {
            if let Err(why) = crate::pool::hand_over(state, &fresh).await {
                return Err(handover_failed(state, &fresh, &why).await);
            }
            let marked =
                with_db(|| async { sessions().mark_member_running(session.id, true).await })
                    .await?;
            return marked.map(|_| ()).ok_or(Stop::Superseded);
        }
    }
    Err(Stop::Superseded)
}

/// A member claimed while it was prepared could not be handed over at readiness: counted as
/// a failed hand-over, and its student, who is already waiting on it, goes back in the line
/// at the front (the session ends `requeued`, its objects reclaimed) for the next member or
/// a cold start, rather than being shown a failure.
async fn handover_failed(state: &AppState, member: &Session, why: &str) -> Stop {
    tracing::warn!(session = %member.id, error = %why, "a member claimed while it was prepared could not be handed over; its student goes back in the line");
    state
        .metrics()
        .pool_handover_failures
        .get_or_create(&crate::metrics::LessonLabels {
            lesson: member.lesson.to_string(),
        })
        .inc();
    let recorded = with_db(|| async {
        state
            .store()
            .pools()
            .record_handover_failure(&member.env, &member.lesson)
            .await
    })
    .await;
    if let Err(e) = recorded {
        tracing::warn!(error = %e, "could not record the failed hand-over");
    }
    Stop::Requeued(format!(
        "the lab prepared for you could not be handed over ({why}); you are back in the line, \
         at the front"
    ))
}

/// One session of a VM lesson being provisioned: what every step works with.
struct VmProvisioning<'a> {
    state: &'a AppState,
    session: &'a Session,
    lesson: &'a Lesson,
}

impl VmProvisioning<'_> {
    /// ④ The root disk: what the cluster shows of the golden disk, through the decision
    /// table; recorded on the row (kind and reason) and counted in the metrics.
    async fn choose_disk(&self) -> Result<DiskDecision, Stop> {
        let site = self.state.site_of(&self.session.site);
        let (decision, reason) = super::disk::decide(&site, self.lesson).await;
        let kind = match decision {
            DiskDecision::Golden { .. } => DiskKind::Golden,
            DiskDecision::ContainerDisk { .. } => DiskKind::Container,
        };
        with_db(|| async {
            self.state
                .store()
                .sessions()
                .record_disk(self.session.id, kind, &reason)
                .await
        })
        .await?;
        self.state
            .metrics()
            .disk_decisions
            .get_or_create(&crate::metrics::DiskLabels {
                kind: kind.as_str().to_owned(),
                reason,
            })
            .inc();
        Ok(decision)
    }

    /// The VMs' names, one per lesson node, recorded on the row before anything is created,
    /// so a crash after any creation leaves a row naming what to delete.
    async fn record_vm_names(&self) -> Result<Vec<SessionVm>, Stop> {
        let vms: Vec<SessionVm> = self
            .lesson
            .nodes
            .as_slice()
            .iter()
            .map(|n| SessionVm {
                node: n.clone(),
                name: vm_name(self.session.id, n),
            })
            .collect();
        with_db(|| async {
            self.state
                .store()
                .sessions()
                .record_vms(self.session.id, &vms)
                .await
        })
        .await?;
        Ok(vms)
    }

    /// The session's VirtualMachines (and, with several nodes, its Service and
    /// NetworkPolicy), with `disk` as their root disk and the agent's ConfigMap as a disk.
    fn render(&self, disk: DiskDecision) -> Result<SessionManifests, Stop> {
        let state = self.state;
        let agent = &state.config().agent;
        render_with_agent(
            &SessionVms {
                session: self.session.id,
                env: state.config().env.clone(),
                lesson: self.lesson.id.clone(),
                namespace: None,
                image: self.lesson.image.clone(),
                memory: self.lesson.memory.as_str().to_owned(),
                cores: self.lesson.cores,
                nodes: self.lesson.nodes.as_slice().to_vec(),
                disk,
                termination_grace_period_seconds:
                    ttlab_vm_manifest::DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS,
            },
            &AgentDisk {
                config_map: agent.config_map_name(),
                volume_label: agent.volume_label().to_owned(),
            },
        )
        .map_err(|e| Failure::Unrenderable(e.to_string()).into())
    }

    /// ③ A fresh agent token per VM (those already stored, for a resumed session), stored
    /// before any Secret carries it.
    async fn store_agent_tokens(&self, vms: &[SessionVm]) -> Result<Vec<AgentToken>, Stop> {
        let nodes: Vec<NodeName> = vms.iter().map(|v| v.node.clone()).collect();
        let tokens = super::tokens::for_nodes(self.state, self.session, &nodes).await?;
        let pairs: Vec<(NodeName, &str)> = nodes
            .into_iter()
            .zip(tokens.iter().map(AgentToken::reveal))
            .collect();
        let stored = with_db(|| async {
            self.state
                .store()
                .agent_tokens()
                .put(self.session.id, &pairs)
                .await
        })
        .await?;
        if !stored {
            return Err(Stop::Superseded);
        }
        Ok(tokens)
    }

    /// ③ + ⑤ Each VM, then its cloud-init Secret owned by it; the first VM (the
    /// representative) owns the other VMs. Returns the owner reference of the representative,
    /// which the session's other objects carry too.
    async fn create_vms_and_secrets(
        &self,
        vms: Vec<VirtualMachine>,
        tokens: &[AgentToken],
    ) -> Result<OwnerReference, Stop> {
        let (state, session) = (self.state, self.session);
        let site = state.site_of(&session.site);
        let power_off_at = self.power_off_at();
        let mut representative: Option<Created> = None;
        for ((mut vm, node), token) in vms
            .into_iter()
            .zip(self.lesson.nodes.as_slice())
            .zip(tokens)
        {
            if let Some(rep) = &representative {
                vm.metadata.owner_references = Some(vec![rep.owner_reference()]);
            }
            let json = serde_json::to_value(&vm).map_err(|e| Failure::VmEncoding(e.to_string()))?;
            // The agent's ConfigMap is made sure of right before each attempt: a VM created
            // while it is missing would wait for its agent disk for ever.
            let created = create_object(state, session, "VM", || async {
                super::agent::agent_before_vm(state, &site).await?;
                site.cluster().create_vm(json.clone()).await
            })
            .await?;
            if representative.is_none() {
                record_stage(state, session, Stage::VmCreated).await?;
                observe_stage(state, session, "vm_created").await;
            }
            ensure_starting(state, session).await?;
            let secret = self
                .user_data_secret(node, token, power_off_at)?
                .to_secret(Some(created.owner_reference()));
            create_object(state, session, "cloud-init Secret", || {
                site.cluster().create_secret(secret.clone())
            })
            .await?;
            if representative.is_none() {
                representative = Some(created);
            }
        }
        representative
            .as_ref()
            .map(Created::owner_reference)
            .ok_or_else(|| Failure::NoNode.into())
    }

    /// The session's Service and NetworkPolicy (a lesson of several nodes), owned by the
    /// representative VM.
    async fn create_peer_network(
        &self,
        service: Option<Service>,
        policy: Option<NetworkPolicy>,
        owner: OwnerReference,
    ) -> Result<(), Stop> {
        let (state, session) = (self.state, self.session);
        let site = state.site_of(&session.site);
        if let Some(mut service) = service {
            service.metadata.owner_references = Some(vec![owner.clone()]);
            create_object(state, session, "session Service", || {
                site.cluster().create_service(service.clone())
            })
            .await?;
        }
        if let Some(mut policy) = policy {
            policy.metadata.owner_references = Some(vec![owner]);
            create_object(state, session, "session NetworkPolicy", || {
                site.cluster().create_network_policy(policy.clone())
            })
            .await?;
        }
        Ok(())
    }

    /// ⑥–⑦ Every VMI `Running` within the lesson's readiness timeout (watched); the stage is
    /// recorded. Returns their states then, in `vms`' order.
    async fn wait_vmis_running(&self, vms: &[SessionVm]) -> Result<Vec<VmiState>, Stop> {
        let (state, session) = (self.state, self.session);
        let readiness = self.lesson.readiness_timeout;
        let site = &state.site_of(&session.site);
        let running = try_join_all(vms.iter().map(|v| async move {
            site.cluster()
                .wait_vmi_running(&v.name, readiness)
                .await
                .map_err(|e| vmi_failed(e, readiness))
        }))
        .await?;
        record_stage(state, session, Stage::VmiRunning).await?;
        observe_stage(state, session, "vmi_running").await;
        Ok(running)
    }

    /// ⑧ The agent's readiness marker on every node, within the lesson's setup timeout. The
    /// first agent to answer records the `agent_up` stage.
    async fn wait_agents_ready(
        &self,
        vms: &[SessionVm],
        running: Vec<VmiState>,
        tokens: &[AgentToken],
    ) -> Result<(), Stop> {
        let state = self.state;
        let site = &state.site_of(&self.session.site);
        let setup = self.lesson.setup_timeout;
        let agent_up = AtomicBool::new(false);
        let agent_up = &agent_up;
        try_join_all(
            vms.iter()
                .zip(running)
                .zip(tokens)
                .map(|((v, vmi), token)| async move {
                    // The VMI's address matters on the `pod-ip` path only.
                    let known_ip = match (site.agent_path(), vmi.ip) {
                        (AgentPath::PodIp, None) => Some(wait_ip(site, &v.name, setup).await?),
                        (_, ip) => ip,
                    };
                    let client = agent_client(state, site, &v.name, known_ip, token.clone())
                        .await
                        .map_err(|e| Failure::AgentRefused(format!("{}: {e}", v.name)))?
                        .with_timeouts(Duration::from_secs(2), Duration::from_secs(5));
                    self.wait_agent(&client, setup, agent_up).await
                }),
        )
        .await?;
        Ok(())
    }

    /// Polls the agent's readiness every [`READY_POLL`] until the marker is reported (Ok), the
    /// setup reports failure, or `within` runs out.
    async fn wait_agent(
        &self,
        client: &AgentClient,
        within: Duration,
        agent_up: &AtomicBool,
    ) -> Result<(), Stop> {
        let deadline = tokio::time::Instant::now() + within;
        let mut polls = Backoff::constant(READY_POLL).pauses();
        let mut answered = false;
        loop {
            match client.ready().await {
                Ok(r) => {
                    if !answered {
                        answered = true;
                        if !agent_up.swap(true, Ordering::SeqCst) {
                            record_stage(self.state, self.session, Stage::AgentUp).await?;
                            observe_stage(self.state, self.session, "agent_up").await;
                        }
                    }
                    if let Some(reason) = r.failed {
                        return Err(Failure::SetupFailed(reason.trim().to_owned()).into());
                    }
                    if r.ready {
                        return Ok(());
                    }
                }
                Err(e) if e.is_retryable() => {}
                Err(e) => return Err(Failure::AgentRefused(e.to_string()).into()),
            }
            let pause = polls.next_pause();
            if tokio::time::Instant::now() + pause > deadline {
                return Err(if answered {
                    Failure::SetupTimedOut(within)
                } else {
                    Failure::AgentSilent(within)
                }
                .into());
            }
            tokio::time::sleep(pause).await;
        }
    }

    /// When the guests power themselves off, should nothing reclaim them first: the
    /// lifespan's hard deadline.
    fn power_off_at(&self) -> DateTime<Utc> {
        self.session
            .lifespan()
            .hard_deadline(&self.state.config().policy)
    }

    /// The cloud-init Secret of `node`'s VM.
    fn user_data_secret(
        &self,
        node: &NodeName,
        token: &AgentToken,
        power_off_at: DateTime<Utc>,
    ) -> Result<UserDataSecret, Stop> {
        let (state, lesson) = (self.state, self.lesson);
        let user_data = render_user_data(&UserDataInput {
            lesson,
            node,
            agent: &state.config().agent,
            token,
            power_off_at,
        })
        .map_err(|e| Failure::CloudInit(e.to_string()))?;
        let labels = ObjectLabels::new(
            self.session.id,
            state.config().env.clone(),
            lesson.id.clone(),
            Some(node.clone()),
        );
        UserDataSecret::new(secret_name(self.session.id, node), labels, user_data)
            .map_err(|e| Failure::CloudInitSecret(e.to_string()).into())
    }
}

/// Why a VMI did not come up, for the student.
fn vmi_failed(e: ClusterError, readiness: Duration) -> Stop {
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
            Failure::VmiTimedOut {
                within: readiness,
                why,
            }
        }
        ClusterError::VmiEnded { state, .. } => Failure::VmiEnded(state.describe()),
        other => Failure::VmiUnwatchable(other),
    }
    .into()
}

/// The VMI's address, polled until reported or `within` runs out.
async fn wait_ip(site: &SiteRuntime, vmi: &str, within: Duration) -> Result<IpAddr, Stop> {
    let deadline = tokio::time::Instant::now() + within;
    let mut polls = ADDRESS_POLL.pauses();
    loop {
        if let Ok(Some(ip)) = site.cluster().vmi_ip(vmi).await {
            return Ok(ip);
        }
        let pause = polls.next_pause();
        if tokio::time::Instant::now() + pause > deadline {
            return Err(Failure::NoAddress(within).into());
        }
        tokio::time::sleep(pause).await;
    }
}
