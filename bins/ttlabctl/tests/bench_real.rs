//! `ttlabctl bench real --target kubeconfig` runs only in a namespace of its own: against a
//! namespace holding an object it did not create it refuses before creating anything (and
//! names the object), against an empty one it runs (here with every phase skipped) and leaves
//! the namespace as it found it. The cluster is the real control plane of `ttlab-envtest`.

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ListParams, PostParams};
use serde_json::json;

fn bench_real(kubeconfig: &std::path::Path, namespace: &str) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["bench", "real", "--target", "kubeconfig", "--kubeconfig"])
        .arg(kubeconfig)
        .args([
            "--namespace",
            namespace,
            "--skip",
            "etcd,reclaim,start,noop",
        ])
        .env("RUST_LOG", "error")
        .output()
        .expect("ttlabctl runs")
}

#[tokio::test]
async fn refuses_a_namespace_holding_objects_it_did_not_create() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("bench-foreign").await.unwrap();
    let api = Api::<ConfigMap>::namespaced(plane.admin_client().await.unwrap(), &ns);
    let theirs: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "someone-elses"}, "data": {"k": "v"}}))
            .unwrap();
    api.create(&PostParams::default(), &theirs).await.unwrap();
    let kubeconfig = plane.admin_kubeconfig(&ns).unwrap();

    let out = tokio::task::spawn_blocking(move || bench_real(&kubeconfig, &ns))
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "it ran in a foreign namespace: {stderr}"
    );
    assert!(
        stderr.contains("did not create") && stderr.contains("ConfigMaps someone-elses"),
        "the refusal does not name the object: {stderr}"
    );
    // Nothing of the benchmark's was created.
    let names: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n != "kube-root-ca.crt")
        .collect();
    assert_eq!(names, ["someone-elses"]);
}

#[tokio::test]
async fn runs_in_an_empty_namespace_and_leaves_it_empty() {
    let Some(plane) = ttlab_envtest::shared_or_skip() else {
        return;
    };
    let ns = plane.create_namespace("bench-own").await.unwrap();
    let kubeconfig = plane.admin_kubeconfig(&ns).unwrap();
    let ns2 = ns.clone();
    let out = tokio::task::spawn_blocking(move || bench_real(&kubeconfig, &ns2))
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "it refused an empty namespace: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let api = Api::<ConfigMap>::namespaced(plane.admin_client().await.unwrap(), &ns);
    let left: Vec<String> = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .filter_map(|c| c.metadata.name)
        .filter(|n| n != "kube-root-ca.crt")
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// The processes of session `sid` (every process started under a `setsid` leader, whatever
/// its process group), with their command lines.
fn session_processes(sid: u32) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp session …`: the fields after the last ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // A zombie waiting for its parent to read it is not running.
        if fields.first() == Some(&"Z") {
            continue;
        }
        if fields.get(3).and_then(|s| s.parse::<u32>().ok()) == Some(sid) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            found.push(format!(
                "{pid}: {}",
                String::from_utf8_lossy(&cmdline).replace('\0', " ")
            ));
        }
    }
    found
}

/// `timeout` signals the whole process group with SIGTERM: the benchmark stops, and nothing it
/// started outlives it — not etcd, not kube-apiserver (which ignores SIGTERM while it drains),
/// not PostgreSQL, not a simulated guest.
#[test]
fn stopped_as_timeout_stops_it_it_leaves_nothing_running() {
    use std::io::BufRead as _;
    if let Err(e) = ttlab_envtest::assets() {
        ttlab_testkit::skip_or_fail(&format!("the real control plane cannot start: {e}"));
        return;
    }
    let agent =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/agent/ttlab-agent");
    if !agent.is_file() {
        ttlab_testkit::skip_or_fail(&format!(
            "no agent at {} (cargo build --profile agent -p ttlab-agent-bin)",
            agent.display()
        ));
        return;
    }
    // A session of its own (util-linux `setsid`, which execs in place: the pid is
    // ttlabctl's), as `timeout` gives its command a process group of its own: every process it
    // starts is found by the session id afterwards.
    let mut cmd = std::process::Command::new("setsid");
    cmd.arg(env!("CARGO_BIN_EXE_ttlabctl"))
        .args([
            "bench",
            "real",
            "--sessions",
            "400",
            "--skip",
            "etcd,start,noop",
        ])
        .arg("--agent")
        .arg(&agent)
        .env("RUST_LOG", "error")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("ttlabctl starts");
    let pid = child.id();
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    // Once the control plane, PostgreSQL and the simulated KubeVirt run, and objects are
    // being created.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(180);
    loop {
        let left = until.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) if line.starts_with("ttlabctl bench real (") => break,
            Ok(_) => {}
            Err(e) => {
                let _ = child.kill();
                let out = child.wait_with_output().expect("output");
                panic!(
                    "the benchmark did not start ({e}): {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
    }
    std::thread::sleep(std::time::Duration::from_secs(2));
    rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(pid as i32).expect("pid"),
        rustix::process::Signal::TERM,
    )
    .expect("signal the group");
    let stopped = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            stopped.elapsed() < std::time::Duration::from_secs(60),
            "ttlabctl did not stop within 60 s of SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read as _;
        let _ = e.read_to_string(&mut stderr);
    }
    assert!(!status.success(), "a stopped benchmark is no success");
    assert!(
        stderr.contains("stopped by SIGTERM"),
        "it does not say it was stopped: {stderr}"
    );
    // What it started is stopped with it, or within seconds by the control plane's watchdog.
    let mut left = session_processes(pid);
    while !left.is_empty() && stopped.elapsed() < std::time::Duration::from_secs(75) {
        std::thread::sleep(std::time::Duration::from_millis(250));
        left = session_processes(pid);
    }
    assert!(
        left.is_empty(),
        "still running after the benchmark stopped: {left:#?}"
    );
}
