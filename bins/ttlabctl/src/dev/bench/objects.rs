//! The objects of one benchmark session, rendered as the server renders them: the VMs of
//! `ttlab_vm_manifest` (with the agent disk), each VM's cloud-init Secret from
//! `ttlab_cloudinit::render_user_data`, the session's Service and NetworkPolicy when the lesson
//! has them, and the agent's shared ConfigMap of the version. Every size a benchmark reports
//! comes from here, so the figures follow the renderer.

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{ConfigMap, Service};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use ttlab_agent::protocol::AgentToken;
use ttlab_cloudinit::{AgentPayload, UserDataInput, UserDataSecret, render_user_data};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_lesson::Lesson;
use ttlab_model::labels::ObjectLabels;
use ttlab_model::{EnvName, NodeName, SessionId};
use ttlab_vm_manifest::{AgentDisk, SessionVms, render_with_agent, secret_name};

/// One VM of a session and the cloud-init Secret it boots with.
pub(crate) struct VmObjects {
    pub(crate) node: NodeName,
    pub(crate) name: String,
    /// The VirtualMachine, as the server sends it.
    pub(crate) vm: serde_json::Value,
    /// Its cloud-init Secret (owned by the VM once created).
    pub(crate) secret: UserDataSecret,
}

/// Everything the server creates for one session.
pub(crate) struct SessionObjects {
    pub(crate) vms: Vec<VmObjects>,
    pub(crate) service: Option<Service>,
    pub(crate) network_policy: Option<NetworkPolicy>,
}

impl SessionObjects {
    /// Bytes of the VM objects and of the Secrets (as the API server counts a Secret: keys
    /// plus values).
    pub(crate) fn sizes(&self) -> (usize, usize) {
        let vms = self
            .vms
            .iter()
            .map(|v| serde_json::to_vec(&v.vm).map_or(0, |b| b.len()))
            .sum();
        let secrets = self.vms.iter().map(|v| v.secret.size_bytes()).sum();
        (vms, secrets)
    }

    /// Every object, by kind and name, in the order the teardown deletes them.
    pub(crate) fn names(&self) -> Vec<(ttlab_cluster::Kind, String)> {
        use ttlab_cluster::Kind;
        let mut out: Vec<(Kind, String)> = self
            .vms
            .iter()
            .map(|v| (Kind::VirtualMachine, v.name.clone()))
            .collect();
        out.extend(
            self.vms
                .iter()
                .map(|v| (Kind::Secret, v.secret.name().to_owned())),
        );
        if let Some(name) = self.service.as_ref().and_then(|s| s.metadata.name.clone()) {
            out.push((Kind::Service, name));
        }
        if let Some(name) = self
            .network_policy
            .as_ref()
            .and_then(|p| p.metadata.name.clone())
        {
            out.push((Kind::NetworkPolicy, name));
        }
        out
    }

    /// How many objects the session has.
    pub(crate) fn count(&self) -> usize {
        self.names().len()
    }
}

/// The agent's shared ConfigMap of `agent`'s version in `env`.
pub(crate) fn agent_config_map(agent: &AgentPayload, env: &EnvName) -> ConfigMap {
    agent.config_map(env)
}

/// Renders session `session`'s objects for `lesson` in `env`: what the server's saga creates
/// (a fresh random agent token per VM; the container disk, as without a golden disk).
pub(crate) fn session_objects(
    lesson: &Lesson,
    agent: &AgentPayload,
    env: &EnvName,
    session: SessionId,
    power_off_at: DateTime<Utc>,
) -> anyhow::Result<SessionObjects> {
    let nodes: Vec<NodeName> = lesson.nodes.as_slice().to_vec();
    let manifests = render_with_agent(
        &SessionVms {
            session,
            env: env.clone(),
            lesson: lesson.id.clone(),
            namespace: None,
            image: lesson.image.clone(),
            memory: lesson.memory.as_str().to_owned(),
            cores: lesson.cores,
            nodes: nodes.clone(),
            disk: DiskDecision::ContainerDisk {
                reason: FallbackReason::NotRequested,
            },
            termination_grace_period_seconds:
                ttlab_vm_manifest::DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS,
        },
        &AgentDisk {
            config_map: agent.config_map_name(),
            volume_label: agent.volume_label().to_owned(),
        },
    )?;
    let mut vms = Vec::with_capacity(nodes.len());
    for (vm, node) in manifests.vms.into_iter().zip(&nodes) {
        let token = AgentToken::from_random_bytes(random_bytes()?);
        let user_data = render_user_data(&UserDataInput {
            lesson,
            node,
            agent,
            token: &token,
            power_off_at,
        })?;
        let labels = ObjectLabels::new(session, env.clone(), lesson.id.clone(), Some(node.clone()));
        let secret = UserDataSecret::new(secret_name(session, node), labels, user_data)?;
        vms.push(VmObjects {
            node: node.clone(),
            name: vm.metadata.name.clone().unwrap_or_default(),
            vm: serde_json::to_value(&vm)?,
            secret,
        });
    }
    Ok(SessionObjects {
        vms,
        service: manifests.service,
        network_policy: manifests.network_policy,
    })
}

fn random_bytes() -> anyhow::Result<[u8; AgentToken::BYTES]> {
    use std::io::Read as _;
    let mut bytes = [0u8; AgentToken::BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes)
}
