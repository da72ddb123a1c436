//! The real guest agent in the simulated guest: a session rendered exactly as the server
//! renders it (the shipped systemd lesson, `ttlab-cloudinit` user-data pinning the built
//! `ttlab-agent`, the agent's shared ConfigMap, the `ttlab-vm-manifest` VirtualMachine
//! mounting it, its Secret owned by the VM), created over kube-rs, reached with `AgentClient`
//! at the VMI's reported address, and stopped with the VMI or the simulator. Without its
//! ConfigMap the VM does not start (as KubeVirt's launcher pod cannot mount it); with a
//! ConfigMap of another build the guest's first boot refuses the agent.
//!
//! The agent binary is `target/<profile>/ttlab-agent` (`cargo build -p ttlab-agent-bin`; a
//! workspace test run builds it); without it these tests print a `SKIPPED:` line, or fail
//! under `CI=true`.

use crate::support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use support::*;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::{AgentToken, PORT, ReadyResponse};
use ttlab_cloudinit::{AgentPayload, UserDataInput, UserDataSecret, render_user_data};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_kube_sim::{KubeSim, SetupOutcome, SimConfig};
use ttlab_model::SessionId;
use ttlab_model::labels::ObjectLabels;
use ttlab_vm_manifest::{AgentDisk, SessionVms, owner_reference, render_with_agent, secret_name};

/// The built agent, or `None` after [`ttlab_testkit::skip_or_fail`] when it has not been built.
fn agent_payload() -> Option<AgentPayload> {
    match ttlab_agent::locate_binary() {
        Ok(path) => {
            let bytes = std::fs::read(&path).expect("agent binary readable");
            Some(AgentPayload::new(&bytes).expect("agent payload"))
        }
        Err(e) => {
            ttlab_testkit::skip_or_fail(&e.to_string());
            None
        }
    }
}

/// Creates the agent ConfigMap of `payload` (as the server makes sure of it).
async fn create_agent_config_map(sim: &KubeSim, payload: &AgentPayload) {
    let config_maps: Api<ConfigMap> = Api::namespaced(kube_client(sim).await, "ttlab");
    config_maps
        .create(
            &PostParams::default(),
            &payload.config_map(&"dev".parse().unwrap()),
        )
        .await
        .expect("agent ConfigMap created");
}

/// A session created as the server creates it, its agent's ConfigMap first; returns the VM
/// name, the Secret name and the agent token.
async fn create_session(
    sim: &KubeSim,
    payload: &AgentPayload,
    session: &str,
    token_byte: u8,
) -> (String, String, AgentToken) {
    create_agent_config_map(sim, payload).await;
    create_session_only(sim, payload, session, token_byte).await
}

/// A session's VM and Secret, without making sure of the agent's ConfigMap.
async fn create_session_only(
    sim: &KubeSim,
    payload: &AgentPayload,
    session: &str,
    token_byte: u8,
) -> (String, String, AgentToken) {
    let client = kube_client(sim).await;
    let lesson = ttlab_lesson::samples::systemd_basics();
    let session: SessionId = session.parse().unwrap();
    let node = lesson.nodes.first().clone();
    let env: ttlab_model::EnvName = "dev".parse().unwrap();
    let input = SessionVms {
        session,
        env: env.clone(),
        lesson: lesson.id.clone(),
        namespace: Some("ttlab".into()),
        image: lesson.image.clone(),
        memory: lesson.memory.as_str().to_owned(),
        cores: lesson.cores,
        nodes: lesson.nodes.as_slice().to_vec(),
        disk: DiskDecision::ContainerDisk {
            reason: FallbackReason::NotRequested,
        },
        termination_grace_period_seconds: 30,
    };
    let agent = AgentDisk {
        config_map: payload.config_map_name(),
        volume_label: payload.volume_label().to_owned(),
    };
    let vm = render_with_agent(&input, &agent)
        .expect("manifests")
        .vms
        .remove(0);
    let token = AgentToken::from_random_bytes([token_byte; AgentToken::BYTES]);
    let user_data = render_user_data(&UserDataInput {
        lesson: &lesson,
        node: &node,
        agent: payload,
        token: &token,
        power_off_at: chrono::Utc::now() + chrono::Duration::hours(4),
    })
    .expect("user-data");
    let secret = UserDataSecret::new(
        secret_name(session, &node),
        ObjectLabels::new(session, env, lesson.id.clone(), Some(node.clone())),
        user_data,
    )
    .expect("secret");

    // The VM first, then its Secret owned by it (the VMI waits for the Secret).
    let vms: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        "ttlab",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    );
    let vm: DynamicObject = serde_json::from_value(serde_json::to_value(&vm).unwrap()).unwrap();
    let created = vms
        .create(&PostParams::default(), &vm)
        .await
        .expect("VM created");
    let name = created.metadata.name.clone().unwrap();
    let uid = created.metadata.uid.clone().unwrap();
    let secrets: Api<Secret> = Api::namespaced(client, "ttlab");
    secrets
        .create(
            &PostParams::default(),
            &secret.to_secret(Some(owner_reference(&name, &uid))),
        )
        .await
        .expect("Secret created");
    (name, secret.name().to_owned(), token)
}

/// The agent address the VMI reports, once it is Running.
async fn running_agent(h: &Http, name: &str, token: AgentToken) -> AgentClient {
    let vmi = wait_for(h, VMIS, name, |o| o["status"]["phase"] == "Running").await;
    let ip: IpAddr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .expect("VMI address")
        .parse()
        .unwrap();
    AgentClient::new(SocketAddr::new(ip, PORT), token)
}

/// Whether the process exists and is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().to_owned())
        })
        .is_some_and(|rest| !rest.starts_with('Z') && !rest.starts_with('X'))
}

/// Waits (up to 10 s, checking every 20 ms) for the process to be gone.
async fn wait_dead(pid: u32) {
    let start = Instant::now();
    while alive(pid) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "agent {pid} still running"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_real_agent_answers_at_the_vmi_address_and_stops_with_the_vm() {
    let Some(payload) = agent_payload() else {
        return;
    };
    let mut config = SimConfig::for_tests();
    // Running after 1 s, the agent a second later; the setup's marker 4 s after Running.
    config.timings.boot = Duration::from_secs(2);
    config.timings.setup = Duration::from_secs(4);
    let sim = KubeSim::start(config).await.unwrap();
    let h = Http::new(&sim);
    let (name, secret, token) =
        create_session(&sim, &payload, "0b9d7c1e-2f4a-4c3b-8d5e-6f7a8b9c0d1e", 1).await;
    let agent = running_agent(&h, &name, token).await;
    assert_eq!(
        sim.guest_ip("ttlab", &name).map(IpAddr::V4),
        agent.addr().socket_addr().map(|a| a.ip())
    );
    // Running comes first, as on KubeVirt: the guest still boots and its agent's port
    // refuses connections.
    let running_at = Instant::now();
    assert!(
        matches!(
            agent.ready().await,
            Err(ttlab_agent::Error::Unreachable { .. })
        ),
        "the agent answered as soon as the VMI was Running"
    );
    // Then the agent listens, while the setup is still going, and the VMI says it is there.
    let answered = loop {
        match agent.ready().await {
            Ok(answer) => break answer,
            Err(ttlab_agent::Error::Unreachable { .. }) => {
                assert!(
                    running_at.elapsed() < Duration::from_secs(20),
                    "the agent never listened"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    };
    assert!(
        running_at.elapsed() >= Duration::from_millis(500),
        "the agent listened {:?} after Running",
        running_at.elapsed()
    );
    assert_eq!(
        answered,
        ReadyResponse {
            ready: false,
            failed: None
        }
    );
    wait_for(&h, VMIS, &name, |o| {
        o["status"]["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["type"] == "AgentConnected"))
    })
    .await;
    let ready = agent
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("ready");
    assert!(ready.ready && ready.failed.is_none(), "{ready:?}");
    // The agent runs commands with this machine's /bin/sh.
    let out = agent
        .exec("hostname", Duration::from_secs(10))
        .await
        .unwrap();
    let local = std::process::Command::new("/bin/sh")
        .args(["-c", "hostname"])
        .output()
        .unwrap();
    assert_eq!(out.exit_code, Some(0), "{out:?}");
    assert_eq!(out.stdout, String::from_utf8_lossy(&local.stdout));
    // A wrong token is refused by the real agent.
    let wrong = AgentClient::via(
        agent.route().clone(),
        AgentToken::from_random_bytes([9; 32]),
    );
    assert!(matches!(
        wrong.ready().await,
        Err(ttlab_agent::Error::Unauthorized { .. })
    ));
    // Its output is in the guest's agent log.
    let log = std::fs::read_to_string(sim.agent_log("ttlab", &name).unwrap()).unwrap();
    assert!(
        log.contains(&format!("ttlab-agent listening on {}", agent.addr())),
        "{log}"
    );

    // Deleting the VM stops the agent: gone with the VMI, and the port stops answering.
    let pid = sim.agent_pid("ttlab", &name).expect("agent pid");
    assert!(alive(pid));
    let vms: Api<DynamicObject> = Api::namespaced_with(
        kube_client(&sim).await,
        "ttlab",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    );
    vms.delete(&name, &DeleteParams::default()).await.unwrap();
    wait_gone(&h, VMIS, &name).await;
    assert!(!alive(pid), "the agent outlived its VMI");
    assert!(matches!(
        agent.ready().await,
        Err(ttlab_agent::Error::Unreachable { .. })
    ));
    // The Secret goes with the VM (owner reference).
    wait_gone(&h, SECRETS, &secret).await;
    sim.shutdown().await;
}

#[tokio::test]
async fn a_failing_setup_is_reported_by_the_agent() {
    let Some(payload) = agent_payload() else {
        return;
    };
    let sim = start().await;
    sim.set_lesson_setup(
        "systemd-basics",
        SetupOutcome::Fail {
            reason: "setup exited with 1".into(),
        },
    );
    let h = Http::new(&sim);
    let (name, _, token) =
        create_session(&sim, &payload, "1c2d3e4f-5a6b-4c7d-8e9f-0a1b2c3d4e5f", 2).await;
    let agent = running_agent(&h, &name, token).await;
    let r = agent
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("an answer");
    assert!(!r.ready, "{r:?}");
    assert!(
        r.failed
            .as_deref()
            .is_some_and(|f| f.contains("setup exited with 1")),
        "{r:?}"
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn two_simulators_at_once_give_their_agents_distinct_addresses_and_drop_kills_them() {
    let Some(payload) = agent_payload() else {
        return;
    };
    // Same configuration (same address range): they must not hand out the same address.
    let (a, b) = (start().await, start().await);
    let (ha, hb) = (Http::new(&a), Http::new(&b));
    let (na, _, ta) = create_session(&a, &payload, "2d3e4f5a-6b7c-4d8e-9f0a-1b2c3d4e5f6a", 3).await;
    let (nb, _, tb) = create_session(&b, &payload, "2d3e4f5a-6b7c-4d8e-9f0a-1b2c3d4e5f6a", 4).await;
    let (ca, cb) = (
        running_agent(&ha, &na, ta).await,
        running_agent(&hb, &nb, tb).await,
    );
    assert_ne!(ca.addr(), cb.addr());
    for c in [&ca, &cb] {
        let r = c.wait_ready(Duration::from_secs(30)).await.expect("ready");
        assert!(r.ready, "{r:?}");
    }
    // Dropping a simulator (without shutdown) kills its agents too.
    let (pa, pb) = (
        a.agent_pid("ttlab", &na).unwrap(),
        b.agent_pid("ttlab", &nb).unwrap(),
    );
    drop(a);
    wait_dead(pa).await;
    assert!(alive(pb), "the other simulator's agent was killed");
    assert!(cb.ready().await.is_ok());
    b.shutdown().await;
    assert!(!alive(pb), "shutdown returned before its agent exited");
}

#[tokio::test]
async fn a_vm_whose_agent_config_map_is_missing_does_not_start_until_it_appears() {
    let Some(payload) = agent_payload() else {
        return;
    };
    let sim = start().await;
    let h = Http::new(&sim);
    let (name, _, token) =
        create_session_only(&sim, &payload, "3e4f5a6b-7c8d-4e9f-8a1b-2c3d4e5f6a7b", 5).await;
    // As KubeVirt's launcher pod that cannot mount the volume: it stays Pending, its
    // containers creating, and the VMI never runs.
    let pod = launcher_pod_waiting_for_a_volume(&h, &name).await;
    let volumes = pod["spec"]["volumes"].to_string();
    assert!(volumes.contains(&payload.config_map_name()), "{volumes}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, vmi) = h.get(&format!("{VMIS}/{name}")).await;
    assert_eq!(status, 200);
    assert_ne!(vmi["status"]["phase"], "Running", "{vmi}");
    assert!(sim.agent_pid("ttlab", &name).is_none());
    // The ConfigMap appears: the VM starts, its agent installed from it.
    create_agent_config_map(&sim, &payload).await;
    let agent = running_agent(&h, &name, token).await;
    let r = agent
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("ready");
    assert!(r.ready, "{r:?}");
    sim.shutdown().await;
}

#[tokio::test]
async fn an_agent_disk_of_another_build_fails_first_boot_and_starts_no_agent() {
    let Some(payload) = agent_payload() else {
        return;
    };
    let sim = start().await;
    let h = Http::new(&sim);
    // A ConfigMap under this version's name holding another binary.
    let other = AgentPayload::new(b"\x7fELF another build").unwrap();
    let mut config_map = other.config_map(&"dev".parse().unwrap());
    config_map.metadata.name = Some(payload.config_map_name());
    let config_maps: Api<ConfigMap> = Api::namespaced(kube_client(&sim).await, "ttlab");
    config_maps
        .create(&PostParams::default(), &config_map)
        .await
        .unwrap();
    let (name, _, token) =
        create_session_only(&sim, &payload, "4f5a6b7c-8d9e-4f0a-9b1c-2d3e4f5a6b7c", 6).await;
    let agent = running_agent(&h, &name, token).await;
    // The first boot goes on after Running: the marker comes when it fails (files have no
    // event to await, so check the file system, generously for a loaded machine).
    let dir = sim.guest_dir("ttlab", &name).unwrap();
    let marker = dir.join(ttlab_agent::protocol::FAILED_MARKER_PATH.trim_start_matches('/'));
    let started = Instant::now();
    while !marker.exists() && started.elapsed() < Duration::from_secs(20) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failed = std::fs::read_to_string(&marker).expect("the failure marker");
    assert!(sim.agent_pid("ttlab", &name).is_none(), "no agent started");
    assert!(matches!(
        agent.ready().await,
        Err(ttlab_agent::Error::Unreachable { .. })
    ));
    assert!(failed.contains("is not the expected version"), "{failed}");
    assert!(
        !dir.join(ttlab_agent::protocol::READY_MARKER_PATH.trim_start_matches('/'))
            .exists()
    );
    sim.shutdown().await;
}

#[test]
fn the_simulated_guest_reads_the_agent_disk_by_ttlabs_own_names() {
    assert_eq!(
        ttlab_kube_sim::guest::AGENT_DIGEST_PATH,
        ttlab_cloudinit::AGENT_DIGEST_PATH
    );
    assert_eq!(
        ttlab_kube_sim::guest::AGENT_VOLUME_LABEL,
        ttlab_cloudinit::AGENT_VOLUME_LABEL
    );
    assert_eq!(ttlab_kube_sim::guest::AGENT_KEY, ttlab_cloudinit::AGENT_KEY);
}
