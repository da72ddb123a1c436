//! The server and the reaper, started as processes with the environment the manifests give
//! them (the rendered ConfigMap, plus the Secret's two values), against kube-sim and a
//! throwaway PostgreSQL, come up and pass the checks their probes make.
//!
//! Only what cannot hold outside a pod is replaced: listen addresses (loopback, free ports),
//! the image's paths (lessons, agent, pages: the repository's and the dev build's), and the
//! kubeconfig (kube-sim's, instead of the in-cluster service account).
//!
//! The binaries are those of `target/<profile>/`: `cargo test --workspace` builds them; alone,
//! run `cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin` first. When
//! they are missing the test says so with [`ttlab_testkit::skip_or_fail`]: a `SKIPPED:` line,
//! or a failure under `CI=true` (`.ci/run` builds them).

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use ttlab_deploy_tests::repo_root;
use ttlab_kube_sim::resources::TYPES;
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_store::ephemeral::PgCluster;

use common::{binaries_dir, binary, free_port, render_overlay};

/// How long a process may take to come up (debug builds, a cold database).
const STARTUP: Duration = Duration::from_secs(60);

/// One HTTP/1.1 GET; returns the status code.
async fn get_status(addr: SocketAddr, path: &str) -> u16 {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {response:?}"))
}

/// Starts `program` with exactly `env` (plus PATH) and waits until a line of its output
/// contains `marker`. Panics with the output so far if it exits or takes too long.
async fn start(
    program: &Path,
    args: &[&str],
    env: &BTreeMap<String, String>,
    marker: &str,
) -> Child {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env_clear()
        .envs(env)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = cmd.spawn().unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap()).lines();
    let stderr = BufReader::new(child.stderr.take().unwrap()).lines();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    for mut lines in [Box::new(stdout) as Box<dyn LinesSource>, Box::new(stderr)] {
        let tx = tx.clone();
        tokio::spawn(async move {
            while let Some(line) = lines.next().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    drop(tx);
    let mut seen = Vec::new();
    let found = tokio::time::timeout(STARTUP, async {
        while let Some(line) = rx.recv().await {
            let hit = line.contains(marker);
            seen.push(line);
            if hit {
                return true;
            }
        }
        false
    })
    .await;
    match found {
        Ok(true) => {
            // Keep draining so the process never blocks on a full pipe.
            tokio::spawn(async move { while rx.recv().await.is_some() {} });
            child
        }
        _ => {
            let _ = child.start_kill();
            panic!(
                "{} did not print {marker:?} within {STARTUP:?}:\n{}",
                program.display(),
                seen.join("\n")
            );
        }
    }
}

/// Lines from a child's stdout or stderr.
trait LinesSource: Send {
    fn next(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + '_>>;
}

impl<R: tokio::io::AsyncBufRead + Unpin + Send> LinesSource for tokio::io::Lines<R> {
    fn next(
        &mut self,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = Option<String>> + Send + '_>> {
        Box::pin(async move { self.next_line().await.ok().flatten() })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_and_reaper_start_with_the_manifests_environment_and_pass_their_probes() {
    let (Some(server_bin), Some(reaper_bin), Some(agent_bin)) = (
        binary("ttlab-server"),
        binary("ttlab-reaper"),
        binary("ttlab-agent"),
    ) else {
        return ttlab_testkit::skip_or_fail(&format!(
            "ttlab-server, ttlab-reaper or ttlab-agent is not built in {}; build them first: \
             cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin",
            binaries_dir().display()
        ));
    };
    let Some(rendered) = render_overlay("prod") else {
        return;
    };
    let (mut env, secrets) = rendered.container_env(rendered.get("Deployment", "ttlab-server"));
    assert_eq!(secrets, ["ttlab-secrets"]);
    let (reaper_env, _) = rendered.container_env(rendered.get("Deployment", "ttlab-reaper"));
    assert_eq!(env, reaper_env);
    assert_eq!(env["TTLAB_ENV"], "prod");

    // The cluster: kube-sim with the VM namespace and the objects it serves from ttlab-vms.
    let namespace = env["TTLAB_NAMESPACE"].clone();
    let mut config = SimConfig::for_tests();
    config.namespaces.push(namespace.clone());
    let sim = KubeSim::start(config).await.unwrap();
    for object in &rendered.objects {
        let served = TYPES
            .iter()
            .any(|t| object["apiVersion"] == t.api_version().as_str() && object["kind"] == t.kind);
        if served && object["metadata"]["namespace"] == namespace.as_str() {
            sim.create(object.clone()).unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig, &namespace).unwrap();

    // The database: a throwaway PostgreSQL, empty (the binaries migrate it).
    let pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let database_url = pg.create_database("ttlab").await.unwrap();

    // The Secret's two values, and what cannot hold outside the image and the pod.
    let server_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let ops_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let root = repo_root();
    let path = |p: &Path| p.display().to_string();
    for (k, v) in [
        ("DATABASE_URL", database_url),
        (
            "TTLAB_AUTH_SECRET",
            "a-test-secret-of-at-least-thirty-two-bytes".to_owned(),
        ),
        ("KUBECONFIG", path(&kubeconfig)),
        ("TTLAB_LISTEN", server_addr.to_string()),
        ("TTLAB_METRICS_LISTEN", metrics_addr.to_string()),
        ("TTLAB_OPS_LISTEN", ops_addr.to_string()),
        ("TTLAB_LESSONS", path(&root.join("lessons"))),
        ("TTLAB_AGENT_BINARY", path(&agent_bin)),
        ("TTLAB_WEB_DIR", path(&root.join("web"))),
    ] {
        env.insert(k.to_owned(), v);
    }

    // Both pods' migrate init container, then the processes, as in the Deployments.
    if let Some(ttlabctl) = binary("ttlabctl") {
        let out = Command::new(&ttlabctl)
            .arg("migrate")
            .env_clear()
            .env("DATABASE_URL", &env["DATABASE_URL"])
            .output()
            .await
            .unwrap();
        assert!(
            out.status.success(),
            "ttlabctl migrate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut server = start(&server_bin, &[], &env, "ttlab-server listening").await;
    // The first cycle's report line ("cycle in … ms: …") comes after the leader lock and a
    // full pass over the database and the cluster.
    let mut reaper = start(&reaper_bin, &[], &env, "cycle in ").await;

    // The probes of deploy/base/backend: server liveness and readiness on the ops port (which
    // the ConfigMap sets), reaper liveness. The public port, the one the Ingress routes, does
    // not serve them.
    assert_eq!(get_status(ops_addr, "/healthz").await, 200);
    assert_eq!(
        get_status(ops_addr, "/readyz").await,
        200,
        "server not ready"
    );
    assert_eq!(get_status(ops_addr, "/metrics").await, 200);
    for path in ["/healthz", "/readyz", "/healthz/cluster", "/metrics"] {
        assert_eq!(get_status(server_addr, path).await, 404, "public {path}");
    }
    assert_eq!(get_status(metrics_addr, "/healthz").await, 200);
    assert_eq!(get_status(metrics_addr, "/metrics").await, 200);

    // The reaper ran its first cycle (it printed the report: the marker above) in the
    // manifests' environment, and recorded it where the admin page reads it.
    let store =
        ttlab_store::Store::connect(&env["DATABASE_URL"], ttlab_store::StoreOptions::default())
            .await
            .unwrap();
    let prod: ttlab_model::EnvName = env["TTLAB_ENV"].parse().unwrap();
    // The report line is logged just before the cycle is recorded: wait for the row.
    let asked = std::time::Instant::now();
    let cycles = loop {
        let cycles = store.reaper_cycles().recent(None, 10).await.unwrap();
        if !cycles.is_empty() || asked.elapsed() > Duration::from_secs(15) {
            break cycles;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !cycles.is_empty(),
        "no reaper cycle recorded within 15 s of its report line"
    );
    assert!(cycles.iter().all(|c| c.cycle.env == prod), "{cycles:?}");
    store.close();

    for child in [&mut server, &mut reaper] {
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
    sim.shutdown().await;
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .unwrap()
        .unwrap();
}
