//! The simulated KubeVirt over HTTP: VM → VMI → Running with its launcher pod, volumes that
//! keep a VMI Pending, run strategies on guest power-off, cloud-init applied to the guest
//! directory with the agent started from it, readiness markers, and the serial console.

use crate::support;

use std::time::Duration;

use base64::Engine as _;
use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use support::*;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use ttlab_kube_sim::SetupOutcome;

fn cloud_init_volumes(secret: &str) -> Value {
    json!([
        {"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:22.04"}},
        {"name": "cloudinit", "cloudInitNoCloud": {"secretRef": {"name": secret}}}
    ])
}

fn b64(s: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[tokio::test]
async fn a_running_vm_gets_a_vmi_and_a_launcher_pod_that_carries_its_labels() {
    let sim = start().await;
    let h = Http::new(&sim);
    let labels = json!({"ttlab.io/session": "s1", "ttlab.io/env": "dev"});
    assert_eq!(
        h.post(
            VMS,
            &vm("lab-1", labels, "RerunOnFailure", container_disk())
        )
        .await
        .0,
        201
    );
    let vmi = wait_for(&h, VMIS, "lab-1", |o| o["status"]["phase"] == "Running").await;
    let phases: Vec<&str> = vmi["status"]["phaseTransitionTimestamps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        vec!["Pending", "Scheduling", "Scheduled", "Running"]
    );
    assert_eq!(
        vmi["metadata"]["ownerReferences"][0]["kind"],
        "VirtualMachine"
    );
    let ip = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .unwrap();
    assert!(ip.starts_with("127."), "{ip}");
    let (_, pods) = h
        .get(&format!(
            "{PODS}?labelSelector=kubevirt.io%3Dvirt-launcher,ttlab.io%2Fsession%3Ds1"
        ))
        .await;
    assert_eq!(pods["items"].as_array().unwrap().len(), 1);
    wait_for(&h, VMS, "lab-1", |o| {
        o["status"]["printableStatus"] == "Running"
    })
    .await;
    // Deleting the VM takes the VMI and the pod with it.
    assert_eq!(h.delete(&format!("{VMS}/lab-1")).await.0, 200);
    wait_gone(&h, VMS, "lab-1").await;
    wait_gone(&h, VMIS, "lab-1").await;
    let pod = pods["items"][0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_gone(&h, PODS, &pod).await;
}

/// The VMI's `Synchronized` condition (`Null` when it has none).
fn synchronized(vmi: &serde_json::Value) -> serde_json::Value {
    vmi["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "Synchronized"))
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn missing_pvc_or_secret_keeps_the_vmi_pending_until_it_appears() {
    let sim = start().await;
    let h = Http::new(&sim);
    let vols = json!([{"name": "rootdisk", "ephemeral": {"persistentVolumeClaim": {"claimName": "golden-x", "readOnly": true}}}]);
    h.post(VMS, &vm("lab-pvc", json!({}), "Always", vols)).await;
    let vmi = wait_for(&h, VMIS, "lab-pvc", |o| {
        synchronized(o)["reason"] == "FailedPvcNotFound"
    })
    .await;
    // As KubeVirt lists them: Ready=False first, then the condition that says why.
    assert_eq!(vmi["status"]["conditions"][0]["reason"], "PodNotExists");
    assert_eq!(vmi["status"]["phase"], "Pending");
    wait_for(&h, VMS, "lab-pvc", |o| {
        o["status"]["printableStatus"] == "ErrorPvcNotFound"
    })
    .await;
    let pvc = json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "golden-x"}, "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}});
    h.post(PVCS, &pvc).await;
    wait_for(&h, VMIS, "lab-pvc", |o| o["status"]["phase"] == "Running").await;

    h.post(
        VMS,
        &vm(
            "lab-sec",
            json!({}),
            "Always",
            cloud_init_volumes("lab-sec-ci"),
        ),
    )
    .await;
    // A Secret is the launcher pod's to mount, as on KubeVirt: the pod waits, and so does the
    // VMI.
    let pod = launcher_pod_waiting_for_a_volume(&h, "lab-sec").await;
    assert!(
        pod["spec"]["volumes"].to_string().contains("lab-sec-ci"),
        "{pod}"
    );
    let (_, vmi) = h.get(&format!("{VMIS}/lab-sec")).await;
    assert_ne!(vmi["status"]["phase"], "Running", "{vmi}");
    h.post(
        SECRETS,
        &secret(
            "lab-sec-ci",
            json!({}),
            json!({"userdata": "#cloud-config\n{}"}),
        ),
    )
    .await;
    wait_for(&h, VMIS, "lab-sec", |o| o["status"]["phase"] == "Running").await;
}

/// Runs VM `lab-off` under RerunOnFailure until its VMI runs, hands that VMI to `check`, then
/// crashes the guest and waits for the new VMI (new uid) to run.
async fn crash_restarts_a_rerun_on_failure_vm(
    sim: &ttlab_kube_sim::KubeSim,
    h: &Http,
    check: impl Fn(&Value),
) {
    h.post(
        VMS,
        &vm("lab-off", json!({}), "RerunOnFailure", container_disk()),
    )
    .await;
    let first = wait_for(h, VMIS, "lab-off", |o| o["status"]["phase"] == "Running").await;
    check(&first);
    // A crash: Failed, and a new VMI (new uid) comes up.
    sim.crash("ttlab", "lab-off").unwrap();
    let uid = first["metadata"]["uid"].clone();
    wait_for(h, VMIS, "lab-off", |o| {
        o["metadata"]["uid"] != uid && o["status"]["phase"] == "Running"
    })
    .await;
}

#[tokio::test]
async fn a_guest_power_off_under_rerun_on_failure_stays_off_and_a_crash_restarts() {
    let sim = start().await;
    let h = Http::new(&sim);
    crash_restarts_a_rerun_on_failure_vm(&sim, &h, |_| {}).await;
    // Power-off over HTTP: Succeeded, deleted, and the VM stays Stopped.
    let (code, _) = h.post("/sim/vmis/ttlab/lab-off/poweroff", &json!({})).await;
    assert_eq!(code, 200);
    wait_gone(&h, VMIS, "lab-off").await;
    let vm = wait_for(&h, VMS, "lab-off", |o| {
        o["status"]["printableStatus"] == "Stopped"
    })
    .await;
    assert_eq!(vm["status"]["ready"], false);
    let (code, _) = h.post("/sim/vmis/ttlab/lab-off/poweroff", &json!({})).await;
    assert_eq!(code, 404);
    assert!(h.get(&format!("{VMIS}/lab-off")).await.0 == 404);
}

/// A crashed guest's replacement held with its next VMI in each starting phase: the VMI stays
/// there (longer than a whole start takes with the test timings) until the hold is lifted,
/// then runs.
#[tokio::test]
async fn a_new_vmi_held_in_a_starting_phase_stays_there_until_the_hold_is_lifted() {
    use ttlab_kube_sim::StartingPhase;
    let sim = start().await;
    let h = Http::new(&sim);
    h.post(
        VMS,
        &vm("lab-held", json!({}), "RerunOnFailure", container_disk()),
    )
    .await;
    let mut running = wait_for(&h, VMIS, "lab-held", |o| o["status"]["phase"] == "Running").await;
    for phase in [
        StartingPhase::Pending,
        StartingPhase::Scheduling,
        StartingPhase::Scheduled,
    ] {
        sim.hold_starting_vmis(Some(phase));
        sim.crash("ttlab", "lab-held").unwrap();
        let uid = running["metadata"]["uid"].clone();
        let held = wait_for(&h, VMIS, "lab-held", |o| {
            o["metadata"]["uid"] != uid && o["status"]["phase"] == phase.as_str()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (_, now) = h.get(&format!("{VMIS}/lab-held")).await;
        assert_eq!(now["metadata"]["uid"], held["metadata"]["uid"]);
        assert_eq!(now["status"]["phase"], phase.as_str(), "{phase:?}: {now}");
        sim.hold_starting_vmis(None);
        running = wait_for(&h, VMIS, "lab-held", |o| {
            o["metadata"]["uid"] == held["metadata"]["uid"] && o["status"]["phase"] == "Running"
        })
        .await;
    }
}

/// kubevirt-sim, kube-sim's default controllers, runs every namespace: a VM in a namespace
/// created after the sim started (an overlay applied with kubectl) runs, and its VMI is
/// deleted with it.
#[tokio::test]
async fn a_vm_in_a_namespace_created_after_start_runs() {
    let sim = start().await;
    let h = Http::new(&sim);
    let (code, body) = h
        .post(
            "/api/v1/namespaces",
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "late"}}),
        )
        .await;
    assert_eq!(code, 201, "{body}");
    let vms = "/apis/kubevirt.io/v1/namespaces/late/virtualmachines";
    let vmis = "/apis/kubevirt.io/v1/namespaces/late/virtualmachineinstances";
    let (code, body) = h
        .post(vms, &vm("lab-late", json!({}), "Always", container_disk()))
        .await;
    assert_eq!(code, 201, "{body}");
    wait_for(&h, vmis, "lab-late", |o| o["status"]["phase"] == "Running").await;
    wait_for(&h, vms, "lab-late", |o| o["status"]["ready"] == true).await;
    let (code, _) = h.delete(&format!("{vms}/lab-late")).await;
    assert_eq!(code, 200);
    wait_gone(&h, vmis, "lab-late").await;
    wait_gone(&h, vms, "lab-late").await;
}

/// With `Controllers::KubevirtSim`, ttlab-kubevirt-sim plays KubeVirt through the API and the
/// in-process guest controls go to it: the same run-strategy outcomes.
#[tokio::test]
async fn with_kubevirt_sim_as_its_controllers_the_guest_controls_reach_it() {
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.controllers = ttlab_kube_sim::Controllers::KubevirtSim;
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    let h = Http::new(&sim);
    crash_restarts_a_rerun_on_failure_vm(&sim, &h, |first| {
        assert_eq!(
            first["status"]["interfaces"][0]["ipAddress"].as_str(),
            sim.guest_ip("ttlab", "lab-off")
                .map(|ip| ip.to_string())
                .as_deref()
        );
        assert!(
            sim.guest_dir("ttlab", "lab-off")
                .is_some_and(|d| d.is_dir())
        );
    })
    .await;
    // A power-off: the VMI goes and the VM stays Stopped.
    sim.power_off("ttlab", "lab-off").unwrap();
    wait_gone(&h, VMIS, "lab-off").await;
    wait_for(&h, VMS, "lab-off", |o| {
        o["status"]["printableStatus"] == "Stopped"
    })
    .await;
    assert!(matches!(
        sim.power_off("ttlab", "lab-off"),
        Err(ttlab_kube_sim::Error::NoSuchVmi { .. })
    ));
    sim.shutdown().await;
}

/// With `Controllers::KubevirtSim` the console is kubevirt-sim's, relayed by kube-sim as
/// kube-apiserver relays to KubeVirt's aggregated API: its refusals in KubeVirt's words, its
/// shell, one client per VMI, and the end with the guest.
#[tokio::test]
async fn with_kubevirt_sim_as_its_controllers_its_console_is_relayed() {
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.controllers = ttlab_kube_sim::Controllers::KubevirtSim;
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    let h = Http::new(&sim);
    let url = |name: &str| {
        format!(
            "{}/apis/subresources.kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{name}/console",
            sim.url().replace("http://", "ws://")
        )
    };
    let open = |name: &str| {
        let mut req = url(name).into_client_request().unwrap();
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "plain.kubevirt.io".parse().unwrap(),
        );
        tokio_tungstenite::connect_async(req)
    };
    let refusal = |e: tokio_tungstenite::tungstenite::Error| match e {
        tokio_tungstenite::tungstenite::Error::Http(r) => {
            let body = r.body().clone().unwrap_or_default();
            (
                r.status().as_u16(),
                String::from_utf8_lossy(&body).into_owned(),
            )
        }
        other => panic!("not an HTTP refusal: {other}"),
    };
    // No VMI: 404. A VMI kubevirt-sim has not started (it is paused): 400 in KubeVirt's words.
    let (code, _) = refusal(open("lab-r").await.unwrap_err());
    assert_eq!(code, 404);
    sim.pause_kubevirt(true);
    sim.create(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "lab-waiting", "namespace": "ttlab"},
        "spec": {"domain": {"devices": {}}},
    }))
    .unwrap();
    let (code, body) = refusal(open("lab-waiting").await.unwrap_err());
    assert_eq!(code, 400, "{body}");
    assert!(
        body.contains("because phase is Pending instead of Running"),
        "{body}"
    );
    sim.pause_kubevirt(false);
    h.post(VMS, &vm("lab-r", json!({}), "Always", container_disk()))
        .await;
    wait_for(&h, VMIS, "lab-r", |o| o["status"]["phase"] == "Running").await;
    // Until its guest has booted the console is refused with 400 too; then it opens.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut first = loop {
        match open("lab-r").await {
            Ok((ws, resp)) => {
                assert_eq!(
                    resp.headers()["sec-websocket-protocol"],
                    "plain.kubevirt.io"
                );
                break ws;
            }
            Err(e) => {
                let (code, body) = refusal(e);
                assert_eq!(code, 400, "{body}");
                assert!(tokio::time::Instant::now() < deadline, "{body}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    read_until(&mut first, "root@lab-r:~# ").await;
    first
        .send(Message::Binary(b"echo relayed\r".to_vec().into()))
        .await
        .unwrap();
    read_until(&mut first, "relayed\r\nroot@lab-r:~# ").await;
    // A second client closes the first.
    let (mut second, _) = open("lab-r").await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match first.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the first console was not closed");
    read_until(&mut second, "root@lab-r:~# ").await;
    // The console ends with the guest.
    sim.power_off("ttlab", "lab-r").unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match second.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok(), "the console outlived its guest");
    sim.shutdown().await;
}

#[tokio::test]
async fn the_guest_applies_cloud_init_runs_the_agent_and_writes_markers() {
    let sim = start().await;
    sim.set_lesson_setup(
        "broken",
        SetupOutcome::Fail {
            reason: "exit 3".into(),
        },
    );
    let h = Http::new(&sim);
    let marker = tempfile::tempdir().unwrap();
    let args_file = marker.path().join("args");
    // A stand-in agent: records its arguments, says it listens (the guest waits for that
    // line before its setup's marker), and stays up until killed.
    let agent = format!(
        "#!/bin/sh\necho \"$@\" > {}\necho \"ttlab-agent listening on $4\"\nexec sleep 600\n",
        args_file.display()
    );
    let cfg = json!({
        "hostname": "lab-guest",
        "write_files": [
            {"path": ttlab_agent::protocol::BINARY_PATH, "content": b64(&agent), "encoding": "b64", "permissions": "0755"},
            {"path": ttlab_agent::protocol::TOKEN_PATH, "content": b64("t0k"), "encoding": "b64", "permissions": "0600"}
        ]
    });
    for (name, lesson) in [("lab-ok", "basics"), ("lab-bad", "broken")] {
        h.post(
            SECRETS,
            &secret(
                &format!("{name}-ci"),
                json!({}),
                json!({"userdata": format!("#cloud-config\n{cfg}")}),
            ),
        )
        .await;
        h.post(
            VMS,
            &vm(
                name,
                json!({"ttlab.io/lesson": lesson}),
                "RerunOnFailure",
                cloud_init_volumes(&format!("{name}-ci")),
            ),
        )
        .await;
    }
    let vmi = wait_for(&h, VMIS, "lab-ok", |o| o["status"]["phase"] == "Running").await;
    let dir = sim.guest_dir("ttlab", "lab-ok").unwrap();
    let ip = sim.guest_ip("ttlab", "lab-ok").unwrap();
    assert_eq!(vmi["status"]["interfaces"][0]["ipAddress"], ip.to_string());
    assert_eq!(
        std::fs::read_to_string(dir.join("etc/ttlab/agent.token")).unwrap(),
        "t0k"
    );
    let ready = dir.join(ttlab_agent::protocol::READY_MARKER_PATH.trim_start_matches('/'));
    wait_for(&h, VMIS, "lab-bad", |o| o["status"]["phase"] == "Running").await;
    let bad_dir = sim.guest_dir("ttlab", "lab-bad").unwrap();
    assert_ne!(sim.guest_ip("ttlab", "lab-bad"), Some(ip));
    // Markers appear after the (short) setup time: files have no event to await, so check
    // the file system until they exist (generously, for a loaded machine).
    let failed = bad_dir.join(ttlab_agent::protocol::FAILED_MARKER_PATH.trim_start_matches('/'));
    let started = std::time::Instant::now();
    while !(ready.exists() && failed.exists() && args_file.exists())
        && started.elapsed() < Duration::from_secs(20)
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(ready.exists());
    assert_eq!(std::fs::read_to_string(&failed).unwrap(), "exit 3\n");
    assert!(
        !bad_dir
            .join(ttlab_agent::protocol::READY_MARKER_PATH.trim_start_matches('/'))
            .exists()
    );
    let args = std::fs::read_to_string(&args_file).unwrap();
    assert!(
        args.contains(&format!("--listen {ip}:8899")) || args.contains("--listen 127."),
        "{args}"
    );
    assert!(args.contains("--root "), "{args}");
    // The console's prompt uses the cloud-config hostname.
    let mut ws = console(&sim, "lab-ok").await;
    let text = read_until(&mut ws, "root@lab-guest:~# ").await;
    assert!(
        text.contains("lab-guest login: root (automatic login)"),
        "{text}"
    );
}

async fn console(
    sim: &ttlab_kube_sim::KubeSim,
    name: &str,
) -> tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>> {
    let url = format!(
        "{}/apis/subresources.kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{name}/console",
        sim.url().replace("http://", "ws://")
    );
    let mut req = url.into_client_request().unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "plain.kubevirt.io".parse().unwrap(),
    );
    let (ws, resp) = tokio_tungstenite::connect_async(req)
        .await
        .expect("console upgrade");
    assert_eq!(
        resp.headers()["sec-websocket-protocol"],
        "plain.kubevirt.io"
    );
    ws
}

async fn read_until<S>(ws: &mut S, needle: &str) -> String
where
    S: futures::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !text.contains(needle) {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => text.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(Message::Text(t))) => panic!("text frame from the console: {t}"),
                Some(Ok(_)) => {}
                other => {
                    panic!("console ended while waiting for {needle:?}: {other:?} after {text:?}")
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {needle:?} in {text:?}"));
    text
}

#[tokio::test]
async fn console_handshake_echo_builtins_bulk_and_one_client_per_vmi() {
    let sim = start().await;
    let h = Http::new(&sim);
    // Not found, then not running.
    let path =
        "/apis/subresources.kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/lab-c/console";
    assert_eq!(h.get(path).await.0, 404);
    sim.pause_kubevirt(true);
    h.post(VMS, &vm("lab-c", json!({}), "Always", container_disk()))
        .await;
    sim.pause_kubevirt(false);
    wait_for(&h, VMIS, "lab-c", |o| o["status"]["phase"] == "Pending").await;
    let (code, body) = h.get(path).await;
    if code != 400 {
        // The VMI may have raced to Running; a plain GET without upgrade is still refused.
        assert_eq!(code, 400, "{body}");
    }
    wait_for(&h, VMIS, "lab-c", |o| o["status"]["phase"] == "Running").await;
    let mut ws = console(&sim, "lab-c").await;
    let boot = read_until(&mut ws, "root@lab-c:~# ").await;
    assert!(boot.contains("lab-c login: root (automatic login)"));
    ws.send(Message::Binary(b"hostname\r".to_vec().into()))
        .await
        .unwrap();
    read_until(&mut ws, "hostname\r\nlab-c\r\nroot@lab-c:~# ").await;
    // Text frames are dropped.
    ws.send(Message::Text("whoami\r".into())).await.unwrap();
    ws.send(Message::Binary(b"whoami\r".to_vec().into()))
        .await
        .unwrap();
    let out = read_until(&mut ws, "root\r\nroot@lab-c:~# ").await;
    assert_eq!(out, "whoami\r\nroot\r\nroot@lab-c:~# ");
    // Bulk output until Ctrl-C.
    ws.send(Message::Binary(b"yes\r".to_vec().into()))
        .await
        .unwrap();
    let mut got = 0usize;
    while got < 1 << 20 {
        if let Some(Ok(Message::Binary(b))) = ws.next().await {
            got += b.len();
        }
    }
    ws.send(Message::Binary(vec![3u8].into())).await.unwrap();
    read_until(&mut ws, "^C\r\nroot@lab-c:~# ").await;
    // A second client closes the first.
    let mut second = console(&sim, "lab-c").await;
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the first console was not closed");
    second
        .send(Message::Binary(b"\r".to_vec().into()))
        .await
        .unwrap();
    read_until(&mut second, "root@lab-c:~# ").await;
    // The console ends with the VMI.
    sim.power_off("ttlab", "lab-c").unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match second.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(ended.is_ok());
}
