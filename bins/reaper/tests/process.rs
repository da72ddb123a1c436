//! The `ttlab-reaper` binary as a process against PostgreSQL and kube-sim: killed at random
//! points and restarted, two replicas handing over, and the `--once` exit codes.

#[path = "../../../crates/reaper/tests/common/mod.rs"]
mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use chrono::TimeDelta;
use common::Harness;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};
use ttlab_model::labels::env_selector;
use ttlab_model::{SessionId, SessionStatus};

const BIN: &str = env!("CARGO_BIN_EXE_ttlab-reaper");

fn reaper(h: &Harness, env: &str, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(extra)
        .env_clear()
        .env("DATABASE_URL", h.db.url())
        .env("KUBECONFIG", h.kubeconfig())
        .env("TTLAB_ENV", env)
        .env("TTLAB_NAMESPACE", common::NS)
        .env("TTLAB_ORPHAN_MIN_AGE", "0s")
        .env("TTLAB_REAP_INTERVAL", "200ms")
        .env("TTLAB_METRICS_LISTEN", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    cmd
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

async fn metrics(port: u16) -> Option<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).await.ok()?;
    Some(out)
}

async fn is_leader(port: u16) -> Option<bool> {
    let text = metrics(port).await?;
    Some(text.lines().any(|l| l.trim() == "ttlab_reaper_leader 1"))
}

/// Waits (polling a state that has no notification) until `f` holds, or fails the test.
async fn eventually<F, Fut>(what: &str, secs: u64, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {secs} s");
}

async fn kill(mut child: Child) {
    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_ten_times_at_random_points_the_system_still_converges() {
    let h = Harness::start().await;
    h.sim().faults().set_latency(Duration::from_millis(3));
    let mut seed: u64 = 0xdead_beef_1234_5678;
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut keep = Vec::new();
    for round in 0..10 {
        // Churn: expired sessions, orphans, stuck starts, and sessions that must survive.
        for _ in 0..6 {
            let s = h
                .open(
                    "dev",
                    SessionStatus::Running,
                    TimeDelta::seconds(-1),
                    &["vm"],
                )
                .await;
            h.create_vms("dev", s.id, &["vm"], rand(2) == 0).await;
        }
        h.create_vms("dev", SessionId::new_random(), &["a", "b"], true)
            .await;
        let stuck = h
            .open(
                "dev",
                SessionStatus::Starting,
                TimeDelta::seconds(-1),
                &["vm"],
            )
            .await;
        h.create_vms("dev", stuck.id, &["vm"], false).await;
        let live = h
            .open(
                "dev",
                SessionStatus::Running,
                TimeDelta::minutes(30),
                &["vm"],
            )
            .await;
        h.create_vms("dev", live.id, &["vm"], true).await;
        keep.push(live.id);

        let child = reaper(&h, "dev", &[]).spawn().expect("reaper starts");
        tokio::time::sleep(Duration::from_millis(50 + rand(400))).await;
        kill(child).await;
        let _ = round;
    }
    // A final, uninterrupted run converges.
    let status = reaper(&h, "dev", &["--once"]).status().await.unwrap();
    assert!(status.success());
    let selector = env_selector(&common::env("dev"));
    use ttlab_cluster::{Kind, ReaperCluster as _};
    for kind in [
        Kind::VirtualMachine,
        Kind::Secret,
        Kind::Service,
        Kind::NetworkPolicy,
        Kind::Pod,
    ] {
        for object in h.fixtures.list_all(kind, &selector).await.unwrap() {
            if object.deleting {
                continue;
            }
            let labels = ttlab_model::labels::ObjectLabels::from_map(&object.labels).unwrap();
            let row = h.store.sessions().get(labels.session).await.unwrap();
            assert!(
                row.is_some_and(|r| r.status.is_live()),
                "{kind}/{} is left without a live session",
                object.name
            );
        }
    }
    let finishing = h
        .store
        .sessions()
        .list_in_status(&common::env("dev"), SessionStatus::Finishing, None, 100)
        .await
        .unwrap();
    assert!(finishing.is_empty(), "rows left finishing: {finishing:?}");
    for id in keep {
        assert_eq!(h.status(id).await, SessionStatus::Running);
        assert!(h.vm_alive(id, "vm").await);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn of_two_replicas_exactly_one_acts_and_killing_it_hands_over() {
    let h = Harness::start().await;
    let ports = [free_port(), free_port()];
    let mut children: Vec<Option<Child>> = Vec::new();
    for port in ports {
        let listen = format!("127.0.0.1:{port}");
        let child = reaper(&h, "dev", &[])
            .env("TTLAB_METRICS_LISTEN", listen)
            .spawn()
            .expect("reaper starts");
        children.push(Some(child));
    }
    let mut leader = None;
    eventually("one replica leads", 30, || async {
        let a = is_leader(ports[0]).await.unwrap_or(false);
        let b = is_leader(ports[1]).await.unwrap_or(false);
        assert!(!(a && b), "both replicas act");
        a || b
    })
    .await;
    for (i, port) in ports.iter().enumerate() {
        if is_leader(*port).await == Some(true) {
            leader = Some(i);
        }
    }
    let leader = leader.expect("a leader");
    let follower = 1 - leader;
    // Still exactly one, a while later, and it reclaims.
    let s = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::seconds(-1),
            &["vm"],
        )
        .await;
    h.create_vms("dev", s.id, &["vm"], true).await;
    eventually("the leader reclaims", 30, || async {
        h.status(s.id).await == SessionStatus::Expired
    })
    .await;
    assert_eq!(is_leader(ports[follower]).await, Some(false));

    kill(children[leader].take().unwrap()).await;
    eventually("the follower takes over", 30, || async {
        is_leader(ports[follower]).await == Some(true)
    })
    .await;
    let s = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::seconds(-1),
            &["vm"],
        )
        .await;
    h.create_vms("dev", s.id, &["vm"], true).await;
    eventually("the new leader reclaims", 30, || async {
        h.status(s.id).await == SessionStatus::Expired
    })
    .await;
    kill(children[follower].take().unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn once_exit_codes_say_whether_the_cycle_ran() {
    let h = Harness::start().await;
    let s = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::seconds(-1),
            &["vm"],
        )
        .await;
    h.create_vms("dev", s.id, &["vm"], true).await;
    // A failing delete is an item failure, not a failed run.
    h.sim().faults().add(ttlab_kube_sim::FaultRule::fail(
        Some(ttlab_kube_sim::Verb::Delete),
        Some("virtualmachines"),
        500,
    ));
    let status = reaper(&h, "dev", &["--once"]).status().await.unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(h.status(s.id).await, SessionStatus::Finishing);
    h.sim().faults().clear();

    // Another reaper holds the leader lease (and renews it): `--once` waits out one lease
    // duration, then gives up.
    let lock = h
        .store
        .try_leader_lock(&common::env("dev"))
        .await
        .unwrap()
        .unwrap();
    let status = reaper(&h, "dev", &["--once"]).status().await.unwrap();
    assert_eq!(status.code(), Some(3));
    drop(lock);

    // The database cannot be reached.
    let status = reaper(&h, "dev", &["--once"])
        .env("DATABASE_URL", "postgres://ttlab@127.0.0.1:1/ttlab")
        .status()
        .await
        .unwrap();
    assert_eq!(status.code(), Some(1));

    let status = reaper(&h, "dev", &["--once", "--dry-run"])
        .status()
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(
        h.status(s.id).await,
        SessionStatus::Finishing,
        "a dry run changes nothing"
    );
    let status = reaper(&h, "dev", &["--once"]).status().await.unwrap();
    assert_eq!(status.code(), Some(0));
    assert_eq!(h.status(s.id).await, SessionStatus::Expired);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dry_run_prints_the_name_of_everything_it_would_reclaim() {
    use ttlab_vm_manifest::{secret_name, vm_name};
    let h = Harness::start().await;
    let expired = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::seconds(-1),
            &["vm"],
        )
        .await;
    h.create_vms("dev", expired.id, &["vm"], true).await;
    let orphan = SessionId::new_random();
    h.create_vms("dev", orphan, &["vm"], true).await;
    let ghost = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::minutes(30),
            &["vm"],
        )
        .await;
    let out = reaper(&h, "dev", &["--once", "--dry-run"])
        .stdout(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8(out.stdout).unwrap();
    let line_of = |needle: &str| -> String {
        text.lines()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no {needle:?} in:\n{text}"))
            .to_owned()
    };
    let node = common::node("vm");

    let line = line_of(&expired.id.to_string());
    for part in [
        common::LESSON,
        "expired at",
        "would delete",
        &format!("VirtualMachine/{}", vm_name(expired.id, &node)),
    ] {
        assert!(line.contains(part), "{part:?} not in {line:?}");
    }
    for object in [
        format!("VirtualMachine/{}", vm_name(orphan, &node)),
        format!("Secret/{}", secret_name(orphan, &node)),
    ] {
        let line = line_of(&object);
        assert!(
            line.contains("env dev") && line.contains(&orphan.to_string()),
            "{line:?}"
        );
    }
    let line = line_of(&ghost.id.to_string());
    assert!(
        line.contains(common::LESSON) && line.contains("would mark ghost"),
        "{line:?}"
    );

    assert_eq!(h.status(expired.id).await, SessionStatus::Running);
    assert_eq!(h.status(ghost.id).await, SessionStatus::Running);
    assert!(h.vm_alive(expired.id, "vm").await && h.vm_alive(orphan, "vm").await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn once_connects_over_verified_tls_and_a_wrong_ca_fails_clearly() {
    if ttlab_testkit::which("openssl").is_none() {
        return ttlab_testkit::skip_or_fail("openssl is not on PATH (test certificates)");
    }
    let h = Harness::start().await;
    let pg = tokio::task::spawn_blocking(ttlab_store::testing::TlsServer::start)
        .await
        .unwrap()
        .expect("TLS-enabled throwaway PostgreSQL");
    pg.create_database("ttlab", true).await.unwrap();
    let url = |ca: &std::path::Path| {
        pg.url(
            "localhost",
            "ttlab",
            &format!("sslmode=verify-full&sslrootcert={}", ca.display()),
        )
    };

    // The right CA: the cycle runs (and is recorded in that database).
    let out = reaper(&h, "dev", &["--once"])
        .env("DATABASE_URL", url(&pg.ca()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let store = ttlab_store::Store::connect(&url(&pg.ca()), Default::default())
        .await
        .unwrap();
    let cycles = store.reaper_cycles().recent(None, 10).await.unwrap();
    assert_eq!(cycles.len(), 1, "{cycles:?}");

    // A CA that did not sign the server's certificate: exit 1 with a one-line reason.
    let out = reaper(&h, "dev", &["--once"])
        .env("DATABASE_URL", url(&pg.wrong_ca()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .await
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot connect to PostgreSQL at localhost:")
            && err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );
}
