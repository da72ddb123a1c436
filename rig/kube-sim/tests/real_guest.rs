//! Real qemu guests behind kube-sim's KubeVirt (kubevirt-sim, the default controllers): sessions rendered exactly as the server
//! renders them (the shipped systemd lesson, `ttlab-cloudinit` user-data pinning the built
//! `ttlab-agent`, the agent's shared ConfigMap, the `ttlab-vm-manifest` VirtualMachine mounting
//! it and its Secret), created over kube-rs, booted by qemu from the Debian 12 image of
//! `ttlabctl guest-image`, the ConfigMap attached as KubeVirt attaches a `configMap` volume (an
//! ISO 9660 disk labelled with its `volumeLabel`), from which the guest's first boot installs
//! the agent after checking its digest.
//!
//! One guest goes from VM create to ready (the agent answering after boot, then the real
//! readiness marker after the setup), shows root's autologin shell on the serial console
//! subresource, grades 0/6 before and 6/6 after the task is done by typing on that console,
//! follows the terminal size the agent sets (`stty size` on the console prints it), and shuts
//! down (ACPI, within its grace) when its VM is deleted. Then two at once: one whose
//! hard deadline has already passed at first boot powers itself off (the VMI ends
//! `Succeeded`), one whose setup fails reports why and never writes the marker.
//!
//! Needs `qemu-system-x86_64`, `qemu-img`, `genisoimage` (or xorriso), the built agent, and the
//! image directory in `TTLAB_GUEST_IMAGE` (`.ci/run` builds and exports it); without them the
//! test prints a `SKIPPED:` line, or fails under `CI=true`. About 5 to 9 minutes under TCG on
//! two cores, depending on the load.

#[path = "suite/support/mod.rs"]
mod support;

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use futures::{SinkExt as _, StreamExt as _};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use serde_json::Value;
use support::*;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use ttlab_agent::AgentClient;
use ttlab_agent::protocol::{AgentToken, ConsoleSize, PORT};
use ttlab_cloudinit::{AgentPayload, UserDataInput, UserDataSecret, render_user_data};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_kube_sim::guest::{GuestBackend, QemuSettings};
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_lesson::Lesson;
use ttlab_model::SessionId;
use ttlab_model::labels::ObjectLabels;
use ttlab_qemu_guest::GuestImage;
use ttlab_vm_manifest::{AgentDisk, SessionVms, owner_reference, render_with_agent, secret_name};

/// Everything the test needs from the machine, or `None` after `skip_or_fail`.
fn prerequisites() -> Option<(GuestImage, AgentPayload)> {
    for (tool, why) in [
        (
            "qemu-system-x86_64",
            "Debian: apt-get install qemu-system-x86",
        ),
        ("qemu-img", "Debian: apt-get install qemu-utils"),
    ] {
        if ttlab_testkit::which(tool).is_none() {
            ttlab_testkit::skip_or_fail(&format!("{tool} is not installed ({why})"));
            return None;
        }
    }
    if ["genisoimage", "mkisofs", "xorriso"]
        .iter()
        .all(|t| ttlab_testkit::which(t).is_none())
    {
        ttlab_testkit::skip_or_fail("no ISO writer (Debian: apt-get install genisoimage)");
        return None;
    }
    let Some(dir) = std::env::var_os("TTLAB_GUEST_IMAGE") else {
        ttlab_testkit::skip_or_fail(
            "TTLAB_GUEST_IMAGE is not set: build the image with `sudo ttlabctl guest-image` and \
             set TTLAB_GUEST_IMAGE to the directory it prints",
        );
        return None;
    };
    let image = match GuestImage::open(std::path::Path::new(&dir)) {
        Ok(i) => i,
        Err(e) => {
            ttlab_testkit::skip_or_fail(&format!("TTLAB_GUEST_IMAGE: {e}"));
            return None;
        }
    };
    let payload = match ttlab_agent::locate_binary() {
        Ok(path) => AgentPayload::new(&std::fs::read(&path).expect("agent readable")).unwrap(),
        Err(e) => {
            ttlab_testkit::skip_or_fail(&e.to_string());
            return None;
        }
    };
    Some((image, payload))
}

struct Session {
    name: String,
    token: AgentToken,
    created: Instant,
}

/// A session of `lesson` created as the server creates it (VM, then its Secret owned by it).
async fn create_session(
    sim: &KubeSim,
    lesson: &Lesson,
    payload: &AgentPayload,
    session: &str,
    power_off_at: chrono::DateTime<chrono::Utc>,
) -> Session {
    let client = kube_client(sim).await;
    let session: SessionId = session.parse().unwrap();
    let node = lesson.nodes.first().clone();
    let env: ttlab_model::EnvName = "dev".parse().unwrap();
    // The agent's shared ConfigMap first, as the server makes sure of it.
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), "ttlab");
    match config_maps
        .create(&PostParams::default(), &payload.config_map(&env))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(e) => panic!("agent ConfigMap: {e}"),
    }
    let agent = AgentDisk {
        config_map: payload.config_map_name(),
        volume_label: payload.volume_label().to_owned(),
    };
    let vm = render_with_agent(
        &SessionVms {
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
            termination_grace_period_seconds: 60,
        },
        &agent,
    )
    .expect("manifests")
    .vms
    .remove(0);
    let mut bytes = [0u8; AgentToken::BYTES];
    bytes[..16].copy_from_slice(&session.as_uuid().into_bytes());
    let token = AgentToken::from_random_bytes(bytes);
    let user_data = render_user_data(&UserDataInput {
        lesson,
        node: &node,
        agent: payload,
        token: &token,
        power_off_at,
    })
    .expect("user-data");
    let secret = UserDataSecret::new(
        secret_name(session, &node),
        ObjectLabels::new(session, env, lesson.id.clone(), Some(node.clone())),
        user_data,
    )
    .expect("secret");
    let vms = vm_api(client.clone());
    let vm: DynamicObject = serde_json::from_value(serde_json::to_value(&vm).unwrap()).unwrap();
    let created_at = Instant::now();
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
    Session {
        name,
        token,
        created: created_at,
    }
}

fn vm_api(client: kube::Client) -> Api<DynamicObject> {
    Api::namespaced_with(
        client,
        "ttlab",
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    )
}

/// Polls the VMI until `until` holds (at most `within`).
async fn vmi_until(
    h: &Http,
    name: &str,
    within: Duration,
    until: impl Fn(&Value) -> bool,
) -> Value {
    let path = format!("/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{name}");
    let start = Instant::now();
    loop {
        let (code, v) = h.get(&path).await;
        if code == 200 && until(&v) {
            return v;
        }
        assert!(
            start.elapsed() < within,
            "VMI {name} not as expected after {within:?}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn agent_of(vmi: &Value, token: AgentToken) -> AgentClient {
    let ip: IpAddr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .expect("VMI address")
        .parse()
        .unwrap();
    AgentClient::new(SocketAddr::new(ip, PORT), token)
        .with_timeouts(Duration::from_secs(5), Duration::from_secs(30))
}

/// How many of the lesson's checks pass, run through the agent as the server grades.
async fn grade(agent: &AgentClient, lesson: &Lesson) -> usize {
    let mut passed = 0;
    for check in &lesson.grading {
        let out = agent
            .exec(&check.command, check.timeout)
            .await
            .expect("the agent runs the check");
        if out.exit_code == Some(0) {
            passed += 1;
        }
    }
    passed
}

/// The serial console subresource, as the server's relay opens it.
struct SerialConsole {
    ws: tokio_tungstenite::WebSocketStream<
        tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
    >,
    seen: String,
}

impl SerialConsole {
    async fn open(sim: &KubeSim, name: &str) -> Self {
        let url = format!(
            "{}/apis/subresources.kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{name}/console",
            sim.url().replacen("http", "ws", 1)
        );
        let mut req = url.into_client_request().unwrap();
        req.headers_mut().insert(
            "sec-websocket-protocol",
            "plain.kubevirt.io".parse().unwrap(),
        );
        let (ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .expect("console opens");
        Self {
            ws,
            seen: String::new(),
        }
    }

    async fn type_text(&mut self, text: &str) {
        self.ws
            .send(Message::Binary(text.as_bytes().to_vec().into()))
            .await
            .expect("console input");
    }

    /// Reads until `needle` appears in the output (at most `within`).
    async fn expect(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.seen.contains(needle) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => {
                    self.seen.push_str(&String::from_utf8_lossy(&b))
                }
                Ok(Some(Ok(_))) => {}
                other => panic!(
                    "console: {needle:?} not seen ({other:?}); last output:\n{}",
                    tail(&self.seen)
                ),
            }
        }
    }
}

fn tail(s: &str) -> &str {
    let mut start = s.len().saturating_sub(3000);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// What doing the systemd-basics task looks like at a root shell.
const THE_TASK: &str = "cat > /etc/systemd/system/greeter.service <<'UNIT'
[Unit]
Description=Greeter
[Service]
User=greeter
ExecStart=/opt/lab/bin/greeter
Restart=on-failure
[Install]
WantedBy=multi-user.target
UNIT
sed -i 's#/usr/local/sbin/tar#/usr/bin/tar#' /etc/systemd/system/backup.service
printf '[Unit]\\nDescription=Nightly backup\\n[Timer]\\nOnCalendar=*-*-* 02:00:00\\n[Install]\\nWantedBy=timers.target\\n' > /etc/systemd/system/backup.timer
systemctl daemon-reload && systemctl enable --now greeter.service && systemctl enable backup.timer && echo task-$((40+2))-done
";

async fn start_sim(image: GuestImage) -> KubeSim {
    let mut config = SimConfig::for_tests();
    let mut settings = QemuSettings::new(image);
    settings.max_memory_mib = 1024;
    config.guest = GuestBackend::Qemu(Box::new(settings));
    KubeSim::start(config).await.expect("sim starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_guests_boot_set_up_grade_power_off_and_fail_as_the_lesson_says() {
    let Some((image, payload)) = prerequisites() else {
        return;
    };
    let sim = start_sim(image).await;
    let h = Http::new(&sim);
    let lesson = ttlab_lesson::samples::systemd_basics();

    // 1. One guest, from create to ready, graded before and after the task.
    let s = create_session(
        &sim,
        &lesson,
        &payload,
        "1f0e2d3c-4b5a-4c2b-9a55-6f1c1d2e0b7a",
        chrono::Utc::now() + chrono::Duration::hours(4),
    )
    .await;
    let vmi = vmi_until(&h, &s.name, Duration::from_secs(120), |v| {
        v["status"]["phase"] == "Running"
    })
    .await;
    let running = s.created.elapsed();
    let agent = agent_of(&vmi, s.token.clone());
    let boot_deadline = Instant::now() + Duration::from_secs(600);
    let first = loop {
        match agent.ready().await {
            Ok(r) => break r,
            Err(_) if Instant::now() < boot_deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            Err(e) => panic!("the agent never answered: {e}"),
        }
    };
    let answering = s.created.elapsed();
    let ready = if first.ready || first.failed.is_some() {
        first
    } else {
        agent
            .wait_ready(Duration::from_secs(600))
            .await
            .expect("the setup finished")
    };
    let ready_at = s.created.elapsed();
    assert!(ready.ready, "the real marker: {ready:?}");
    assert_eq!(ready.failed, None);
    println!(
        "real guest timings: VM create -> VMI Running {:.1} s; -> agent answering {:.1} s (boot); \
         -> ready {:.1} s (setup {:.1} s)",
        running.as_secs_f64(),
        answering.as_secs_f64(),
        ready_at.as_secs_f64(),
        (ready_at - answering).as_secs_f64()
    );
    // A wrong token is refused by the agent in the guest.
    let wrong = AgentClient::via(
        agent.route().clone(),
        AgentToken::from_random_bytes([9; 32]),
    );
    assert!(matches!(
        wrong.ready().await,
        Err(ttlab_agent::Error::Unauthorized { .. })
    ));

    let mut console = SerialConsole::open(&sim, &s.name).await;
    // The first client sees what the guest printed, the autologin among it; Enter gives
    // root's prompt.
    console.type_text("\r").await;
    console.expect("root@vm:~#", Duration::from_secs(60)).await;
    assert!(
        console.seen.contains("(automatic login)") || console.seen.contains("vm login: root"),
        "autologin on the console:\n{}",
        tail(&console.seen)
    );
    console
        .type_text("systemctl is-system-running; uname -sr\r")
        .await;
    console.expect("Linux 6.", Duration::from_secs(60)).await;

    assert_eq!(grade(&agent, &lesson).await, 0, "nothing done yet");
    console.type_text(THE_TASK).await;
    console
        .expect("task-42-done", Duration::from_secs(120))
        .await;
    assert_eq!(
        grade(&agent, &lesson).await,
        lesson.grading.len(),
        "every check passes once the task is done; console:\n{}",
        tail(&console.seen)
    );

    // The page's terminal size reaches the guest: the agent sets the serial console's rows
    // and columns (`TIOCSWINSZ` on /dev/ttyS0) and `stty size` typed on the console prints
    // exactly that, for each new size; a size the guest cannot have is refused before it is
    // sent.
    for (rows, cols) in [(37, 101), (52, 143)] {
        let set = agent
            .set_console_size(ConsoleSize { rows, cols })
            .await
            .expect("the agent sets the console's size");
        assert_eq!(set, ConsoleSize { rows, cols });
        console.type_text("stty size\r").await;
        console
            .expect(&format!("{rows} {cols}\r\n"), Duration::from_secs(30))
            .await;
    }
    assert!(matches!(
        agent
            .set_console_size(ConsoleSize { rows: 0, cols: 80 })
            .await,
        Err(ttlab_agent::Error::InvalidRequest(_))
    ));

    // Deleting the VM shuts the guest down: the VMI goes within its grace.
    let pid = sim.agent_pid("ttlab", &s.name);
    let deleting = Instant::now();
    vm_api(kube_client(&sim).await)
        .delete(&s.name, &DeleteParams::default())
        .await
        .expect("VM deleted");
    let path = format!(
        "/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{}",
        s.name
    );
    while h.get(&path).await.0 != 404 {
        assert!(
            deleting.elapsed() < Duration::from_secs(120),
            "VMI still there"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "real guest shut down for the deletion in {:.1} s",
        deleting.elapsed().as_secs_f64()
    );
    if let Some(pid) = pid {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "qemu {pid} is gone"
        );
    }

    // 2. Two at once: a hard deadline already past at first boot, and a failing setup.
    let past = create_session(
        &sim,
        &lesson,
        &payload,
        "2f0e2d3c-4b5a-4c2b-9a55-6f1c1d2e0b7a",
        chrono::Utc::now() - chrono::Duration::minutes(1),
    )
    .await;
    let mut failing_lesson = lesson.clone();
    failing_lesson.setup =
        Some("#!/bin/sh\necho 'E: Unable to locate package kubeadm' >&2\nexit 3\n".into());
    let failing = create_session(
        &sim,
        &failing_lesson,
        &payload,
        "3f0e2d3c-4b5a-4c2b-9a55-6f1c1d2e0b7a",
        chrono::Utc::now() + chrono::Duration::hours(4),
    )
    .await;
    let vmi = vmi_until(&h, &failing.name, Duration::from_secs(120), |v| {
        v["status"]["phase"] == "Running"
    })
    .await;
    let agent = agent_of(&vmi, failing.token.clone());
    let boot_deadline = Instant::now() + Duration::from_secs(600);
    let outcome = loop {
        match agent.wait_ready(Duration::from_secs(30)).await {
            Ok(r) => break r,
            Err(_) if Instant::now() < boot_deadline => {}
            Err(e) => panic!("the failing guest's agent never reported: {e}"),
        }
    };
    assert!(
        !outcome.ready,
        "no marker after a failed setup: {outcome:?}"
    );
    let reason = outcome.failed.expect("the failure's reason");
    assert!(
        reason.contains("the setup script exited with status 3")
            && reason.contains("E: Unable to locate package kubeadm"),
        "{reason}"
    );
    let marker = agent
        .exec(
            &format!("test ! -e {}", ttlab_agent::protocol::READY_MARKER_PATH),
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(
        marker.exit_code,
        Some(0),
        "no readiness marker in the guest"
    );
    println!(
        "failing setup reported after {:.1} s",
        failing.created.elapsed().as_secs_f64()
    );

    // Powered off by itself: under RerunOnFailure the VMI ended Succeeded and is gone, and
    // the VM stays Stopped (a crash would have been rerun with a new VMI).
    let vm_path = format!(
        "/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachines/{}",
        past.name
    );
    let vmi_path = format!(
        "/apis/kubevirt.io/v1/namespaces/ttlab/virtualmachineinstances/{}",
        past.name
    );
    let waiting = Instant::now();
    loop {
        let (_, vm) = h.get(&vm_path).await;
        if vm["status"]["printableStatus"] == "Stopped" && h.get(&vmi_path).await.0 == 404 {
            break;
        }
        assert!(
            waiting.elapsed() < Duration::from_secs(600),
            "the guest past its deadline did not power off: {vm}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "guest past its hard deadline powered itself off {:.1} s after VM create",
        past.created.elapsed().as_secs_f64()
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.get(&vmi_path).await.0, 404, "and stays off");
    sim.shutdown().await;
}
