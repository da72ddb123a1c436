//! A session's VM against a real kube-apiserver with the simulator as its KubeVirt: rendered
//! exactly as the server renders it (the shipped systemd lesson, `ttlab-cloudinit` user-data
//! pinning the built `ttlab-agent`, the agent's shared ConfigMap, the `ttlab-vm-manifest`
//! VirtualMachine mounting it, its Secret owned by the VM), running, answering through the
//! agent its guest installed from the ConfigMap, and reclaimed with everything it owned.
//! Without the ConfigMap the launcher pod cannot mount it and the VMI does not run.
//!
//! The agent binary is `target/<profile>/ttlab-agent` (`cargo build -p ttlab-agent-bin`).

#[macro_use]
mod support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Pod, Secret};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use serde_json::Value;
use support::*;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::{AgentToken, PORT};
use ttlab_cloudinit::{AgentPayload, UserDataInput, UserDataSecret, render_user_data};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_model::SessionId;
use ttlab_model::labels::ObjectLabels;
use ttlab_vm_manifest::{AgentDisk, SessionVms, owner_reference, render_with_agent, secret_name};

fn agent_payload() -> Option<AgentPayload> {
    match ttlab_agent::locate_binary() {
        Ok(path) => {
            let bytes = std::fs::read(&path).expect("agent binary readable");
            Some(AgentPayload::new(&bytes).expect("agent payload"))
        }
        Err(e) => {
            ttlab_testkit::skip_or_fail(&format!("{e} (cargo build -p ttlab-agent-bin)"));
            None
        }
    }
}

/// Creates the agent ConfigMap of `payload`, as the server makes sure of it.
async fn create_agent_config_map(client: &kube::Client, ns: &str, payload: &AgentPayload) {
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    config_maps
        .create(
            &PostParams::default(),
            &payload.config_map(&"dev".parse().unwrap()),
        )
        .await
        .expect("agent ConfigMap created");
}

/// Creates the agent's ConfigMap, then a session's VM and its Secret (owned by the VM) as the
/// server does; returns the VM's name, the Secret's name, the agent token and when the VM was
/// created.
async fn create_session(
    client: &kube::Client,
    ns: &str,
    payload: &AgentPayload,
) -> (String, String, AgentToken, Instant) {
    create_agent_config_map(client, ns, payload).await;
    create_session_only(client, ns, payload).await
}

/// A session's VM and Secret, without the agent's ConfigMap.
async fn create_session_only(
    client: &kube::Client,
    ns: &str,
    payload: &AgentPayload,
) -> (String, String, AgentToken, Instant) {
    let lesson = ttlab_lesson::samples::systemd_basics();
    let session = SessionId::new_random();
    let node = lesson.nodes.first().clone();
    let env: ttlab_model::EnvName = "dev".parse().unwrap();
    let input = SessionVms {
        session,
        env: env.clone(),
        lesson: lesson.id.clone(),
        namespace: Some(ns.into()),
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
    let token = AgentToken::from_random_bytes([7; AgentToken::BYTES]);
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
    let created = create_vm(client, ns, &serde_json::to_value(&vm).unwrap()).await;
    let at = Instant::now();
    let name = created["metadata"]["name"].as_str().unwrap().to_owned();
    let uid = created["metadata"]["uid"].as_str().unwrap().to_owned();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    secrets
        .create(
            &PostParams::default(),
            &secret.to_secret(Some(owner_reference(&name, &uid))),
        )
        .await
        .expect("Secret created");
    (name, secret.name().to_owned(), token, at)
}

on_both!(a_vm_runs_answers_through_its_agent_and_is_reclaimed_with_what_it_owns);
async fn a_vm_runs_answers_through_its_agent_and_is_reclaimed_with_what_it_owns(on: On) {
    init_logs();
    let Some(payload) = agent_payload() else {
        return;
    };
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "ttlab").await;
    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&plane.controller_client(&client).await, &ns, guests.path()).await;

    let (name, secret, token, t0) = create_session(&client, &ns, &payload).await;
    let vmis = vmi_api(&client, &ns);
    let vms = vm_api(&client, &ns);

    // Running, with an address, on the node.
    let vmi = eventually("VMI Running", 60, || async {
        get_json(&vmis, &name)
            .await
            .filter(|v| v["status"]["phase"] == "Running")
    })
    .await;
    let t_running = t0.elapsed();
    let ip: IpAddr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .expect("VMI address")
        .parse()
        .unwrap();
    assert!(ip.is_loopback(), "{ip}");
    assert_eq!(vmi["status"]["nodeName"], sim.settings().node_name.as_str());
    assert_eq!(
        vmi["metadata"]["labels"]["kubevirt.io/nodeName"],
        sim.settings().node_name.as_str()
    );
    let vm_uid = get_json(&vms, &name).await.unwrap()["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_owned();
    let owner = &vmi["metadata"]["ownerReferences"][0];
    assert_eq!(owner["kind"], "VirtualMachine");
    assert_eq!(owner["uid"], vm_uid.as_str());
    assert_eq!(owner["controller"], true);
    assert_eq!(owner["blockOwnerDeletion"], true);
    let finalizers = vmi["metadata"]["finalizers"].as_array().unwrap();
    assert!(
        finalizers
            .iter()
            .any(|f| f == "kubevirt.io/foregroundDeleteVirtualMachine")
    );
    let phases: Vec<&str> = vmi["status"]["phaseTransitionTimestamps"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["phase"].as_str())
        .collect();
    assert_eq!(phases, ["Pending", "Scheduling", "Scheduled", "Running"]);

    // The launcher pod: owned by the VMI, KubeVirt's labels and the template's, Running at the
    // VMI's address.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let vmi_uid = vmi["metadata"]["uid"].as_str().unwrap().to_owned();
    let launchers = pods
        .list(&ListParams::default().labels(&format!("kubevirt.io/created-by={vmi_uid}")))
        .await
        .unwrap()
        .items;
    assert_eq!(launchers.len(), 1);
    let launcher = serde_json::to_value(&launchers[0]).unwrap();
    let pod_name = launcher["metadata"]["name"].as_str().unwrap().to_owned();
    assert!(
        pod_name.starts_with(&format!("virt-launcher-{name}-")),
        "{pod_name}"
    );
    assert_eq!(
        launcher["metadata"]["labels"]["kubevirt.io"],
        "virt-launcher"
    );
    assert!(
        launcher["metadata"]["labels"]["vm.kubevirt.io/name"].is_string(),
        "{launcher:#}"
    );
    assert_eq!(
        launcher["metadata"]["labels"][ttlab_model::labels::SESSION],
        vmi["metadata"]["labels"][ttlab_model::labels::SESSION]
    );
    let pod_owner = &launcher["metadata"]["ownerReferences"][0];
    assert_eq!(pod_owner["kind"], "VirtualMachineInstance");
    assert_eq!(pod_owner["uid"], vmi_uid.as_str());
    assert_eq!(launcher["status"]["phase"], "Running");
    assert_eq!(launcher["status"]["podIP"], ip.to_string());

    // The VM's status.
    let vm = eventually("VM status Running", 10, || async {
        get_json(&vms, &name)
            .await
            .filter(|v| v["status"]["printableStatus"] == "Running" && v["status"]["ready"] == true)
    })
    .await;
    assert_eq!(vm["status"]["created"], true);
    assert!(
        vm["metadata"]["finalizers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "kubevirt.io/virtualMachineControllerFinalize")
    );

    // The agent answers on the VMI's address, after Running, and the setup finishes.
    let agent = AgentClient::new(SocketAddr::new(ip, PORT), token);
    let ready = agent
        .wait_ready(Duration::from_secs(30))
        .await
        .expect("agent ready");
    assert!(ready.ready, "{ready:?}");
    let t_agent = t0.elapsed();
    let out = agent
        .exec("echo hello from the guest", Duration::from_secs(5))
        .await
        .expect("exec");
    assert_eq!(out.stdout.trim(), "hello from the guest");
    let guest = sim.guest(&ns, &name).expect("guest known");
    assert_eq!(IpAddr::V4(guest.ip), ip);
    assert!(guest.agent_pid.is_some());

    // Deleting the VM: the VMI goes through deletion, the guest shuts down, and the VMI, the
    // launcher pod, the VM and (by the garbage collector) the Secret disappear.
    let t_delete = Instant::now();
    vms.delete(&name, &DeleteParams::default()).await.unwrap();
    eventually("VMI deletionTimestamp", 10, || async {
        match get_json(&vmis, &name).await {
            None => Some(()),
            Some(v) => v["metadata"]["deletionTimestamp"].is_string().then_some(()),
        }
    })
    .await;
    eventually("VMI gone", 30, || async {
        get_json(&vmis, &name).await.is_none().then_some(())
    })
    .await;
    let t_vmi_gone = t_delete.elapsed();
    assert!(
        t_vmi_gone >= sim.settings().shutdown_grace,
        "the guest had its shutdown grace ({t_vmi_gone:?})"
    );
    assert!(
        agent.ready().await.is_err(),
        "the agent is gone with the guest"
    );
    eventually("launcher pod gone", 30, || async {
        pods.get_opt(&pod_name)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    eventually("VM gone", 30, || async {
        get_json(&vms, &name).await.is_none().then_some(())
    })
    .await;
    let t_vm_gone = t_delete.elapsed();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    eventually("Secret collected", 60, || async {
        secrets
            .get_opt(&secret)
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let t_secret_gone = t_delete.elapsed();
    eprintln!(
        "TIMINGS: VM created → VMI Running {t_running:?}; → agent ready {t_agent:?}; \
         VM deleted → VMI gone {t_vmi_gone:?}, VM gone {t_vm_gone:?}, Secret collected {t_secret_gone:?}"
    );
    assert_nothing_refused(&sim);
    sim.stop().await;
}

on_both!(the_vmi_is_running_before_the_agent_answers);

/// The VMI's `Running` is reported before the guest's agent answers, as on a real cluster.
async fn the_vmi_is_running_before_the_agent_answers(on: On) {
    init_logs();
    let Some(payload) = agent_payload() else {
        return;
    };
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "ttlab").await;
    let guests = tempfile::tempdir().unwrap();
    let mut settings = sim_settings(&ns, guests.path());
    settings.agent_start = Duration::from_secs(2);
    let sim =
        ttlab_kubevirt_sim::KubevirtSim::start(plane.controller_client(&client).await, settings)
            .await
            .unwrap();
    let (name, _, token, _) = create_session(&client, &ns, &payload).await;
    let vmis = vmi_api(&client, &ns);
    let vmi: Value = eventually("VMI Running", 60, || async {
        get_json(&vmis, &name)
            .await
            .filter(|v| v["status"]["phase"] == "Running")
    })
    .await;
    let ip: IpAddr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let agent = AgentClient::new(SocketAddr::new(ip, PORT), token);
    assert!(
        agent.ready().await.is_err(),
        "nothing answers right after Running"
    );
    let ready = agent.wait_ready(Duration::from_secs(30)).await.unwrap();
    assert!(ready.ready);
    // Then KubeVirt reports what it learns from the guest agent.
    let vmi = eventually("AgentConnected", 30, || async {
        get_json(&vmis, &name).await.filter(|v| {
            v["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "AgentConnected" && c["status"] == "True")
            })
        })
    })
    .await;
    assert!(vmi["status"]["guestOSInfo"]["id"].is_string(), "{vmi:#}");
    assert_nothing_refused(&sim);
    sim.stop().await;
}

on_both!(a_vm_waits_for_its_agent_config_map);

/// A VM whose agent ConfigMap is missing does not run (its launcher pod cannot mount it) until
/// the ConfigMap appears; then its guest installs the agent from it.
async fn a_vm_waits_for_its_agent_config_map(on: On) {
    init_logs();
    let Some(payload) = agent_payload() else {
        return;
    };
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "ttlab").await;
    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&plane.controller_client(&client).await, &ns, guests.path()).await;
    let (name, _, token, _) = create_session_only(&client, &ns, &payload).await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pod = eventually("the launcher pod waiting for the ConfigMap", 60, || async {
        let list = pods.list(&ListParams::default()).await.ok()?;
        list.items.into_iter().find(|p| {
            p.spec.as_ref().is_some_and(|s| {
                s.volumes.iter().flatten().any(|v| {
                    v.config_map
                        .as_ref()
                        .is_some_and(|c| c.name == payload.config_map_name())
                })
            })
        })
    })
    .await;
    assert_ne!(pod.status.and_then(|s| s.phase).as_deref(), Some("Running"));
    let vmis = vmi_api(&client, &ns);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let vmi = get_json(&vmis, &name).await;
    assert!(
        vmi.as_ref()
            .is_none_or(|v| v["status"]["phase"] != "Running"),
        "{vmi:?}"
    );
    create_agent_config_map(&client, &ns, &payload).await;
    let vmi: Value = eventually("VMI Running", 60, || async {
        get_json(&vmis, &name)
            .await
            .filter(|v| v["status"]["phase"] == "Running")
    })
    .await;
    let ip: IpAddr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    let agent = AgentClient::new(SocketAddr::new(ip, PORT), token);
    let ready = agent.wait_ready(Duration::from_secs(30)).await.unwrap();
    assert!(ready.ready);
    sim.stop().await;
}

on_both!(a_launcher_pod_requests_the_guest_memory_and_kubevirts_overhead_which_the_quota_counts);

/// A session of each shipped VM lesson, rendered as the server renders it: each launcher pod
/// requests what KubeVirt v1.9 requested for the same VMs (2340Mi for systemd-basics' 2Gi
/// guest with 1 core, 4613734401 bytes for each 4Gi kubeadm node with 2 cores), and the
/// namespace's `requests.memory` quota is charged that plus the console log's sidecar.
async fn a_launcher_pod_requests_the_guest_memory_and_kubevirts_overhead_which_the_quota_counts(
    on: On,
) {
    use k8s_openapi::api::core::v1::ResourceQuota;
    use ttlab_vm_manifest::launcher::LauncherSpec;

    init_logs();
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "ttlab").await;
    let quotas: Api<ResourceQuota> = Api::namespaced(client.clone(), &ns);
    let quota: ResourceQuota = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ttlab-vms"},
        "spec": {"hard": {"requests.memory": "48Gi", "count/virtualmachines.kubevirt.io": "8"}}
    }))
    .unwrap();
    quotas.create(&PostParams::default(), &quota).await.unwrap();
    let used_memory = || async {
        let q = quotas.get("ttlab-vms").await.ok()?;
        let used = q.status?.used?;
        let q: ttlab_model::Quantity = used.get("requests.memory")?.0.parse().ok()?;
        u64::try_from(q.whole_units()?).ok()
    };
    // The quota controller has counted the empty namespace.
    assert_eq!(eventually("the quota counted", 60, used_memory).await, 0);

    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&plane.controller_client(&client).await, &ns, guests.path()).await;
    let agent = AgentDisk {
        config_map: "ttlab-agent-0123456789abcdef".into(),
        volume_label: "ttlab-agent".into(),
    };
    let mut charged = 0;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    for (lesson, memory, cpu) in [
        (ttlab_lesson::samples::systemd_basics(), "2340Mi", "100m"),
        (
            ttlab_lesson::samples::kubeadm_cluster(),
            "4613734401",
            "200m",
        ),
    ] {
        let input = SessionVms {
            session: SessionId::new_random(),
            env: "dev".parse().unwrap(),
            lesson: lesson.id.clone(),
            namespace: Some(ns.clone()),
            image: lesson.image.clone(),
            memory: lesson.memory.as_str().to_owned(),
            cores: lesson.cores,
            nodes: lesson.nodes.as_slice().to_vec(),
            disk: DiskDecision::ContainerDisk {
                reason: FallbackReason::NotFound,
            },
            termination_grace_period_seconds: 30,
        };
        let cost = LauncherSpec::lab_vm(lesson.memory.bytes(), lesson.cores).resources();
        for vm in render_with_agent(&input, &agent).unwrap().vms {
            let name = vm.metadata.name.clone().unwrap();
            create_vm(&client, &ns, &serde_json::to_value(&vm).unwrap()).await;
            let pod = eventually("the launcher pod", 60, || async {
                pods.list(&ListParams::default().labels(&format!("vmi.kubevirt.io/id={name}")))
                    .await
                    .ok()?
                    .items
                    .pop()
            })
            .await;
            let pod = serde_json::to_value(pod).unwrap();
            let compute = &pod["spec"]["containers"][0];
            assert_eq!(compute["name"], "compute");
            let requests = &compute["resources"]["requests"];
            assert_eq!(requests["memory"], memory, "{name}");
            assert_eq!(requests["cpu"], cpu, "{name}");
            assert_eq!(requests["ephemeral-storage"], "50M", "{name}");
            assert_eq!(requests["devices.kubevirt.io/kvm"], "1", "{name}");
            assert_eq!(
                pod["metadata"]["annotations"]["kubevirt.io/memory-overhead-bytes"],
                cost.overhead.to_string()
            );
            assert_eq!(
                pod["spec"]["initContainers"][0]["name"], "guest-console-log",
                "the console log's sidecar"
            );
            charged += cost.pod_memory;
            // What the API server's quota admission charged for it.
            let want = charged;
            eventually(&format!("requests.memory used = {want}"), 60, || async {
                used_memory().await.filter(|u| *u == want)
            })
            .await;
        }
    }
    // 2340Mi + 35M and three times 4613734401 + 35M.
    assert_eq!(charged, 2_488_667_840 + 3 * 4_648_734_401);
    assert_nothing_refused(&sim);
    sim.stop().await;
}
