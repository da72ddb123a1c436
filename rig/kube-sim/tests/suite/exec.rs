//! Pod exec over the Kubernetes channel protocols, driven by real clients: kube-rs'
//! `Api::<Pod>::exec` (with and without a TTY) and `kubectl exec` (without kubectl on `PATH`:
//! a `SKIPPED:` line, or a failure under `CI=true`); the API server's refusals; faults and the
//! call record.

use crate::support;

use std::time::Duration;

use futures::SinkExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, AttachedProcess, TerminalSize};
use serde_json::{Value, json};
use support::*;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use ttlab_kube_sim::{FaultRule, Verb};

fn pod(name: &str, container: Value) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"ttlab.io/component": "lab"}},
        "spec": {"containers": [container]}
    })
}

async fn running_pod(h: &Http, name: &str, container: Value) {
    let (code, body) = h.post(PODS, &pod(name, container)).await;
    assert_eq!(code, 201, "{body}");
    wait_for(h, PODS, name, |o| o["status"]["phase"] == "Running").await;
}

/// Reads `process`'s stdout until `needle` shows up; returns everything read.
async fn read_until(out: &mut (impl tokio::io::AsyncRead + Unpin), needle: &str) -> String {
    let mut text = String::new();
    let mut buf = vec![0u8; 64 * 1024];
    tokio::time::timeout(Duration::from_secs(20), async {
        while !text.contains(needle) {
            let n = out.read(&mut buf).await.expect("stdout readable");
            assert!(n > 0, "stdout ended before {needle:?}; got {text:?}");
            text.push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {needle:?} in {text:?}"));
    text
}

async fn read_all(out: &mut (impl tokio::io::AsyncRead + Unpin)) -> String {
    let mut v = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), out.read_to_end(&mut v))
        .await
        .expect("output ends")
        .expect("output readable");
    String::from_utf8_lossy(&v).into_owned()
}

async fn status(
    process: &mut AttachedProcess,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Status {
    tokio::time::timeout(
        Duration::from_secs(20),
        process.take_status().expect("status"),
    )
    .await
    .expect("status in time")
    .expect("a status on the error channel")
}

#[tokio::test]
async fn kube_rs_interactive_tty_echoes_runs_builtins_and_reports_the_exit_status() {
    let sim = start().await;
    let h = Http::new(&sim);
    running_pod(&h, "lab-pod", json!({"name": "lab", "image": "debian:12"})).await;
    let pods: Api<Pod> = Api::namespaced(kube_client(&sim).await, "ttlab");

    let mut p = pods
        .exec("lab-pod", ["/bin/bash"], &AttachParams::interactive_tty())
        .await
        .expect("exec upgrades");
    let mut stdin = p.stdin().expect("stdin");
    let mut stdout = p.stdout().expect("stdout");
    read_until(&mut stdout, "root@lab-pod:~# ").await;
    stdin.write_all(b"hostname\r").await.unwrap();
    let out = read_until(&mut stdout, "lab-pod\r\nroot@lab-pod:~# ").await;
    assert_eq!(out, "hostname\r\nlab-pod\r\nroot@lab-pod:~# ");
    stdin.write_all(b"whoami\r").await.unwrap();
    let out = read_until(&mut stdout, "root@lab-pod:~# ").await;
    assert_eq!(out, "whoami\r\nroot\r\nroot@lab-pod:~# ");
    // Resize, as a browser terminal does; the shell sees it. (The client sends resize and
    // stdin frames from separate queues, so ask until the new size shows.)
    let mut size = p.terminal_size().expect("tty resize");
    size.send(TerminalSize {
        width: 132,
        height: 43,
    })
    .await
    .unwrap();
    let mut resized = false;
    for _ in 0..50 {
        stdin.write_all(b"stty size\r").await.unwrap();
        let out = read_until(&mut stdout, "root@lab-pod:~# ").await;
        if out == "stty size\r\n43 132\r\nroot@lab-pod:~# " {
            resized = true;
            break;
        }
        assert_eq!(out, "stty size\r\n24 80\r\nroot@lab-pod:~# ");
    }
    assert!(resized, "the resize never reached the shell");
    // Bulk output arrives whole and in order.
    stdin.write_all(b"seq 50000\r").await.unwrap();
    let out = read_until(&mut stdout, "50000\r\nroot@lab-pod:~# ").await;
    assert!(out.contains("\r\n1\r\n2\r\n3\r\n"), "{}", &out[..40]);
    assert_eq!(out.matches("\r\n").count(), 50_001);
    stdin.write_all(b"nope\r").await.unwrap();
    read_until(
        &mut stdout,
        "bash: nope: command not found\r\nroot@lab-pod:~# ",
    )
    .await;
    stdin.write_all(b"exit 3\r").await.unwrap();
    let st = status(&mut p).await;
    assert_eq!(st.status.as_deref(), Some("Failure"));
    assert_eq!(st.reason.as_deref(), Some("NonZeroExitCode"));
    let cause = &st.details.unwrap().causes.unwrap()[0];
    assert_eq!(cause.message.as_deref(), Some("3"));
    drop((stdin, stdout));
    tokio::time::timeout(Duration::from_secs(10), p.join())
        .await
        .expect("the process ends")
        .expect("cleanly");

    // `exit` after a success is a success; Ctrl-D ends the shell too.
    for ending in [&b"exit\r"[..], &b"\x04"[..]] {
        let mut p = pods
            .exec("lab-pod", ["sh"], &AttachParams::interactive_tty())
            .await
            .unwrap();
        let mut stdin = p.stdin().unwrap();
        let mut stdout = p.stdout().unwrap();
        read_until(&mut stdout, "# ").await;
        stdin.write_all(ending).await.unwrap();
        assert_eq!(status(&mut p).await.status.as_deref(), Some("Success"));
    }
}

#[tokio::test]
async fn kube_rs_single_commands_without_a_tty() {
    let sim = start().await;
    let h = Http::new(&sim);
    running_pod(
        &h,
        "lab-user",
        json!({"name": "lab", "image": "debian:12", "securityContext": {"runAsUser": 1000}, "env": [{"name": "USER", "value": "student"}]}),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(kube_client(&sim).await, "ttlab");
    let params = AttachParams::default()
        .stdout(true)
        .stderr(true)
        .stdin(false);

    let mut p = pods.exec("lab-user", ["hostname"], &params).await.unwrap();
    let mut out = p.stdout().unwrap();
    assert_eq!(read_all(&mut out).await, "lab-user\n");
    assert_eq!(status(&mut p).await.status.as_deref(), Some("Success"));

    let mut p = pods
        .exec(
            "lab-user",
            ["sh", "-c", "whoami; id; nope; exit 4"],
            &params,
        )
        .await
        .unwrap();
    let (mut out, mut err) = (p.stdout().unwrap(), p.stderr().unwrap());
    let st = status(&mut p).await;
    assert_eq!(
        read_all(&mut out).await,
        "student\nuid=1000(student) gid=1000(student) groups=1000(student)\n"
    );
    assert_eq!(read_all(&mut err).await, "sh: nope: command not found\n");
    assert_eq!(st.reason.as_deref(), Some("NonZeroExitCode"));
    assert_eq!(
        st.details.unwrap().causes.unwrap()[0].message.as_deref(),
        Some("4")
    );

    let mut p = pods.exec("lab-user", ["vim"], &params).await.unwrap();
    let st = status(&mut p).await;
    assert_eq!(st.reason.as_deref(), Some("InternalError"));
    assert!(
        st.message
            .unwrap()
            .contains("exec: \"vim\": executable file not found in $PATH"),
    );

    // A shell without a TTY reads commands from stdin until its end (v5 closes the channel).
    let mut p = pods
        .exec(
            "lab-user",
            ["sh"],
            &AttachParams::default()
                .stdin(true)
                .stdout(true)
                .stderr(false),
        )
        .await
        .unwrap();
    let mut stdin = p.stdin().unwrap();
    let mut out = p.stdout().unwrap();
    stdin.write_all(b"hostname\npwd\n").await.unwrap();
    read_until(&mut out, "lab-user\n/home/student\n").await;
    stdin.shutdown().await.unwrap();
    assert_eq!(status(&mut p).await.status.as_deref(), Some("Success"));
}

#[tokio::test]
async fn exec_is_refused_like_the_api_server_and_honours_faults() {
    let sim = start().await;
    let h = Http::new(&sim);
    let client = kube_client(&sim).await;
    let pods: Api<Pod> = Api::namespaced(client, "ttlab");
    let tty = AttachParams::interactive_tty();
    let api_code = |r: Result<AttachedProcess, kube::Error>| match r {
        Err(kube::Error::Api(s)) => (s.code, s.message),
        Err(e) => panic!("not an API error: {e}"),
        Ok(_) => panic!("exec unexpectedly succeeded"),
    };
    // Missing pod: 404.
    let (code, msg) = api_code(pods.exec("nowhere", ["sh"], &tty).await);
    assert_eq!((code, msg.as_str()), (404, "pods \"nowhere\" not found"));
    // A pod whose Secret volume is missing stays Pending: 400.
    let mut pending = pod("lab-pending", json!({"name": "lab", "image": "debian:12"}));
    pending["spec"]["volumes"] = json!([{"name": "s", "secret": {"secretName": "absent"}}]);
    assert_eq!(h.post(PODS, &pending).await.0, 201);
    let (code, msg) = api_code(pods.exec("lab-pending", ["sh"], &tty).await);
    assert_eq!(code, 400, "{msg}");
    assert!(msg.contains("container not found (\"lab\")"), "{msg}");
    // Two containers, none named: 400 naming them; a wrong name: 400.
    let mut two = pod("lab-two", json!({"name": "a", "image": "debian:12"}));
    two["spec"]["containers"]
        .as_array_mut()
        .unwrap()
        .push(json!({"name": "b", "image": "debian:12"}));
    assert_eq!(h.post(PODS, &two).await.0, 201);
    wait_for(&h, PODS, "lab-two", |o| o["status"]["phase"] == "Running").await;
    let (code, msg) = api_code(pods.exec("lab-two", ["sh"], &tty).await);
    assert_eq!(code, 400);
    assert!(msg.contains("choose one of: [a b]"), "{msg}");
    let (code, msg) = api_code(
        pods.exec(
            "lab-two",
            ["sh"],
            &AttachParams::interactive_tty().container("c"),
        )
        .await,
    );
    assert_eq!(
        (code, msg.as_str()),
        (400, "container c is not valid for pod lab-two")
    );
    let mut p = pods
        .exec(
            "lab-two",
            ["hostname"],
            &AttachParams::default().container("b"),
        )
        .await
        .expect("a named container");
    assert_eq!(read_all(&mut p.stdout().unwrap()).await, "lab-two\n");
    // A completed pod: 400.
    sim.set_status("pods", "ttlab", "lab-two", json!({"phase": "Succeeded"}))
        .unwrap();
    let (code, msg) = api_code(
        pods.exec(
            "lab-two",
            ["sh"],
            &AttachParams::interactive_tty().container("a"),
        )
        .await,
    );
    assert_eq!(code, 400);
    assert!(
        msg.contains("completed pod; current phase is Succeeded"),
        "{msg}"
    );

    running_pod(&h, "lab-f", json!({"name": "lab", "image": "debian:12"})).await;
    // Without an upgrade (or with an unknown subprotocol): 400.
    let path =
        "/api/v1/namespaces/ttlab/pods/lab-f/exec?command=sh&stdin=true&stdout=true&tty=true";
    let (code, body) = h.get(path).await;
    assert_eq!(
        (code, body["message"].as_str()),
        (400, Some("Upgrade request required"))
    );
    // Injected faults answer before the upgrade, and every call is recorded. (500: kube-rs
    // retries a 503 by itself.)
    sim.faults()
        .add(FaultRule::fail(Some(Verb::Get), Some("pods/exec"), 500).times(1));
    let (code, _) = api_code(pods.exec("lab-f", ["sh"], &tty).await);
    assert_eq!(code, 500);
    let mut p = pods
        .exec("lab-f", ["true"], &tty)
        .await
        .expect("fault spent");
    assert_eq!(status(&mut p).await.status.as_deref(), Some("Success"));
    let execs: Vec<(String, u16)> = sim
        .calls()
        .into_iter()
        .filter(|c| c.resource == "pods/exec")
        .map(|c| (c.name.unwrap_or_default(), c.status))
        .collect();
    assert_eq!(
        execs,
        vec![
            ("nowhere".into(), 404),
            ("lab-pending".into(), 400),
            ("lab-two".into(), 400),
            ("lab-two".into(), 400),
            ("lab-two".into(), 101),
            ("lab-two".into(), 400),
            ("lab-f".into(), 400),
            ("lab-f".into(), 500),
            ("lab-f".into(), 101),
        ]
    );
}

#[tokio::test]
async fn kubectl_exec_runs_single_commands_and_piped_shells() {
    let Some(kubectl) = ttlab_testkit::which("kubectl") else {
        return ttlab_testkit::skip_or_fail("kubectl is not on PATH; `kubectl exec` did not run");
    };
    let sim = start().await;
    let h = Http::new(&sim);
    running_pod(&h, "lab-k", json!({"name": "lab", "image": "debian:12"})).await;
    let dir = tempfile::tempdir().unwrap();
    let kc = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kc, "ttlab").unwrap();
    let run = |args: &[&str], input: Option<&'static [u8]>| {
        let mut cmd = tokio::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig")
            .arg(&kc)
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .args(args)
            .stdin(if input.is_some() {
                std::process::Stdio::piped()
            } else {
                std::process::Stdio::null()
            })
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("kubectl starts");
        async move {
            if let Some(data) = input {
                let mut stdin = child.stdin.take().unwrap();
                stdin.write_all(data).await.unwrap();
            }
            let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
                .await
                .expect("kubectl finishes")
                .unwrap();
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (code, out, err) = run(&["exec", "lab-k", "--", "hostname"], None).await;
    assert_eq!((code, out.as_str()), (Some(0), "lab-k\n"), "{err}");
    let (code, out, err) = run(&["exec", "lab-k", "--", "sh", "-c", "whoami; exit 3"], None).await;
    assert_eq!((code, out.as_str()), (Some(3), "root\n"), "{err}");
    let (code, out, err) = run(
        &["exec", "-i", "lab-k", "--", "sh"],
        Some(b"hostname\nuname\n"),
    )
    .await;
    assert_eq!((code, out.as_str()), (Some(0), "lab-k\nLinux\n"), "{err}");
    let (code, _, err) = run(&["exec", "nowhere", "--", "hostname"], None).await;
    assert_ne!(code, Some(0));
    assert!(err.contains("pods \"nowhere\" not found"), "{err}");
    let gets = sim
        .calls()
        .iter()
        .filter(|c| c.resource == "pods/exec" && c.status == 101)
        .count();
    assert_eq!(gets, 3, "each kubectl exec upgraded once over WebSocket");
}

#[tokio::test]
async fn the_subprotocol_is_the_first_one_the_client_offers_that_the_server_speaks() {
    use futures::StreamExt as _;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

    let sim = start().await;
    let h = Http::new(&sim);
    running_pod(&h, "lab-p", json!({"name": "lab", "image": "debian:12"})).await;
    let url = format!(
        "{}/api/v1/namespaces/ttlab/pods/lab-p/exec?command=hostname&stdout=true",
        sim.url().replace("http://", "ws://")
    );
    for (offer, chosen) in [
        ("v5.channel.k8s.io, v4.channel.k8s.io", "v5.channel.k8s.io"),
        ("v4.channel.k8s.io, v5.channel.k8s.io", "v4.channel.k8s.io"),
        (
            "base64.channel.k8s.io, v3.channel.k8s.io",
            "v3.channel.k8s.io",
        ),
    ] {
        let mut req = url.as_str().into_client_request().unwrap();
        req.headers_mut()
            .insert("Sec-WebSocket-Protocol", offer.parse().unwrap());
        let (mut ws, resp) = tokio_tungstenite::connect_async(req).await.unwrap();
        assert_eq!(resp.headers()["sec-websocket-protocol"], chosen);
        let mut frames = Vec::new();
        while let Some(Ok(m)) = ws.next().await {
            if let Message::Binary(b) = m {
                frames.push(b.to_vec());
            }
        }
        // The empty stdout frame that says the stream is up, the output, and (v4 on) the
        // status; v3 sends nothing on the error channel for a success.
        assert_eq!(frames[0], vec![1u8]);
        assert_eq!(frames[1], b"\x01lab-p\n".to_vec());
        if chosen == "v3.channel.k8s.io" {
            assert_eq!(frames.len(), 2);
        } else {
            assert_eq!(frames[2][0], 3);
            let st: Value = serde_json::from_slice(&frames[2][1..]).unwrap();
            assert_eq!(st["status"], "Success");
        }
    }
    let mut req = url.as_str().into_client_request().unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "base64.channel.k8s.io".parse().unwrap(),
    );
    match tokio_tungstenite::connect_async(req).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(r)) => assert_eq!(r.status(), 400),
        other => panic!("an unsupported subprotocol was accepted: {other:?}"),
    }
}

/// The process starts a while after the upgrade, as behind a real API server (which must first
/// reach the kubelet): the empty frame that says the stream is up comes first, the output and
/// the exit status only once the process has started, including the status of one that cannot
/// start. kubectl before 1.34 drops frames that arrive before it has registered its streams, so
/// output sent in the instant of the upgrade was lost whenever the machine was loaded.
#[tokio::test]
async fn output_and_status_follow_the_upgrade_only_once_the_process_has_started() {
    use futures::StreamExt as _;
    use tokio_tungstenite::tungstenite::Message;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;

    let start = Duration::from_millis(300);
    let mut config = ttlab_kube_sim::SimConfig::for_tests();
    config.exec_start = start;
    let sim = ttlab_kube_sim::KubeSim::start(config).await.unwrap();
    let h = Http::new(&sim);
    running_pod(&h, "lab-t", json!({"name": "lab", "image": "debian:12"})).await;
    for command in ["hostname", "vim"] {
        let url = format!(
            "{}/api/v1/namespaces/ttlab/pods/lab-t/exec?command={command}&stdout=true&stderr=true",
            sim.url().replace("http://", "ws://")
        );
        let mut req = url.as_str().into_client_request().unwrap();
        req.headers_mut().insert(
            "Sec-WebSocket-Protocol",
            "v5.channel.k8s.io".parse().unwrap(),
        );
        let (mut ws, _) = tokio_tungstenite::connect_async(req).await.unwrap();
        let upgraded = std::time::Instant::now();
        let mut frames = Vec::new();
        let read = async {
            while let Some(Ok(m)) = ws.next().await {
                if let Message::Binary(b) = m {
                    frames.push((upgraded.elapsed(), b.to_vec()));
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(20), read)
            .await
            .expect("the exec ends");
        assert_eq!(
            frames[0].1,
            vec![1u8],
            "{command}: the stream-is-up frame comes first"
        );
        let (at, last) = frames.last().unwrap();
        assert_eq!(last[0], 3, "{command}: the status ends the stream");
        for (at, frame) in &frames[1..] {
            assert!(
                *at >= start - Duration::from_millis(100),
                "{command}: frame {frame:?} came {at:?} after the upgrade, before the process could start"
            );
        }
        if command == "hostname" {
            assert_eq!(frames[1].1, b"\x01lab-t\n".to_vec());
        } else {
            let st: Value = serde_json::from_slice(&last[1..]).unwrap();
            assert_eq!(st["reason"], "InternalError", "{st}");
        }
        assert!(*at < Duration::from_secs(10));
    }
}
