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

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::process::Command;
use ttlab_deploy_tests::repo_root;
use ttlab_kube_sim::resources::TYPES;
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_store::ephemeral::PgCluster;

use common::{binaries_dir, binary, free_port, get_status, render_overlay, start};

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
