//! The `ttlab-reaper` binary's `/healthz` is its loop's heartbeat: healthy while it reclaims,
//! 503 once the loop has made no progress for `TTLAB_REAP_STALL_AFTER` (here: its PostgreSQL
//! stopped), healthy again once the loop moves. And it never exits for want of its database:
//! started without it, or with it stopped under it, it stays alive (`/healthz` 200) and not
//! ready (`/readyz` 503 saying why), and reclaims again within seconds of its return; nor for
//! want of its cluster.

#[path = "../../../crates/reaper/tests/common/mod.rs"]
mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::Harness;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::Command;
use ttlab_store::ephemeral::PgCluster;
use ttlab_store::{Store, StoreOptions};

const BIN: &str = env!("CARGO_BIN_EXE_ttlab-reaper");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The status line and body of `GET path` on the reaper's metrics port.
async fn get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .ok()?
        .ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_owned();
    Some((status, body))
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
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what}: not within {secs} s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn healthz_fails_while_the_loop_is_stuck_and_recovers_after() {
    let h = Harness::start().await;
    let mut pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let url = pg.create_database("ttlab").await.unwrap();
    let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
    store.migrate().await.unwrap();
    store.close();

    let port = free_port();
    let mut child = Command::new(BIN)
        .env_clear()
        .env("DATABASE_URL", &url)
        .env("KUBECONFIG", h.kubeconfig())
        .env("TTLAB_ENV", "dev")
        .env("TTLAB_NAMESPACE", common::NS)
        .env("TTLAB_REAP_INTERVAL", "1s")
        .env("TTLAB_REAP_STALL_AFTER", "3s")
        .env("TTLAB_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the reaper starts");

    eventually("the reaper leads and says it is healthy", 60, || async {
        let healthy = get(port, "/healthz").await.is_some_and(|(s, _)| s == 200);
        let leads = get(port, "/metrics")
            .await
            .is_some_and(|(_, m)| m.lines().any(|l| l.trim() == "ttlab_reaper_leader 1"));
        healthy && leads
    })
    .await;
    // Healthy for a while with nothing to do: the timer's cycles are the heartbeat.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (status, body) = get(port, "/healthz").await.expect("an answer");
        assert_eq!(status, 200, "{body}");
    }

    // Its database stops: no cycle runs, no lock attempt is answered.
    let stopped = Instant::now();
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    let body = loop {
        if let Some((503, body)) = get(port, "/healthz").await {
            break body;
        }
        assert!(
            Instant::now() < until,
            "/healthz never failed while the loop stalled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(body.contains("no progress"), "{body}");
    // Not before the stall time (3 s after the last cycle, which ran at most one 1 s interval
    // before the database stopped): one missed cycle is not a stall.
    assert!(
        stopped.elapsed() >= Duration::from_secs(2),
        "unhealthy after {:?}",
        stopped.elapsed()
    );

    // Back: the loop moves again, and so does /healthz.
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    eventually("/healthz recovers with the database", 60, || async {
        get(port, "/healthz").await.is_some_and(|(s, _)| s == 200)
    })
    .await;

    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}

/// Starts the reaper as a service on `url` with the default stall time, its metrics on `port`.
fn service(h: &Harness, url: &str, port: u16) -> tokio::process::Child {
    Command::new(BIN)
        .env_clear()
        .env("DATABASE_URL", url)
        .env("KUBECONFIG", h.kubeconfig())
        .env("TTLAB_ENV", "dev")
        .env("TTLAB_NAMESPACE", common::NS)
        .env("TTLAB_REAP_INTERVAL", "1s")
        .env("TTLAB_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the reaper starts")
}

/// While its database is down the reaper stays up: `/healthz` 200, `/readyz` 503 saying the
/// database is unreachable and since when; checked for `secs` seconds.
async fn stays_up_without_its_database(child: &mut tokio::process::Child, port: u16, secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    let mut checks = 0;
    while Instant::now() < until || checks < 3 {
        assert_eq!(
            child.try_wait().unwrap(),
            None,
            "the reaper exited without its database"
        );
        match get(port, "/healthz").await {
            Some((200, _)) => {}
            other => panic!("liveness without the database: {other:?}"),
        }
        match get(port, "/readyz").await {
            Some((503, body)) if body.contains("unreachable since") => {}
            // Before its first attempt ended.
            Some((503, body)) if checks == 0 && body.contains("not answered yet") => {}
            other => panic!("/readyz without the database: {other:?}"),
        }
        checks += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How long after `returned` a cycle that started after it was recorded (at most 60 s).
async fn cycle_after(store: &Store, returned: Instant) -> Duration {
    let env: ttlab_model::EnvName = "dev".parse().unwrap();
    // The database clock when it returned: cycles that started after it count.
    let mut since = None;
    while returned.elapsed() < Duration::from_secs(60) {
        if since.is_none() {
            since = store.db_now().await.ok();
        }
        if let Some(since) = since
            && let Ok(cycles) = store.reaper_cycles().recent(Some(&env), 5).await
            && cycles.iter().any(|c| c.cycle.started_at >= since)
        {
            return returned.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no cycle 60 s after the database returned");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_its_database_the_reaper_stays_up_and_works_again_within_seconds_of_its_return() {
    let h = Harness::start().await;
    let mut pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let url = pg.create_database("ttlab").await.unwrap();
    let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
    store.migrate().await.unwrap();

    // 1. Started while PostgreSQL is down.
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    let port = free_port();
    let mut child = service(&h, &url, port);
    eventually("the reaper serves its endpoints", 60, || async {
        get(port, "/healthz").await.is_some()
    })
    .await;
    stays_up_without_its_database(&mut child, port, 4).await;
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let took = cycle_after(&store, Instant::now()).await;
    println!(
        "ttlab-reaper: working again {:.1} s after the database returned (started without it)",
        took.as_secs_f64()
    );
    assert!(took <= Duration::from_secs(5), "{took:?}");
    eventually("ready with its database", 10, || async {
        get(port, "/readyz").await.is_some_and(|(s, _)| s == 200)
    })
    .await;

    // 2. PostgreSQL stops under the leader.
    tokio::task::block_in_place(|| pg.pause()).unwrap();
    stays_up_without_its_database(&mut child, port, 4).await;
    tokio::task::block_in_place(|| pg.resume()).unwrap();
    let took = cycle_after(&store, Instant::now()).await;
    println!(
        "ttlab-reaper: working again {:.1} s after the database returned (stopped under it)",
        took.as_secs_f64()
    );
    assert!(took <= Duration::from_secs(5), "{took:?}");
    assert_eq!(child.try_wait().unwrap(), None, "the reaper exited");

    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");
    store.close();
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reaper_whose_cluster_does_not_answer_at_start_stays_up() {
    let pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let url = pg.create_database("ttlab").await.unwrap();
    let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
    store.migrate().await.unwrap();
    store.close();
    // An API server address nothing listens on: every call is refused.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        ttlab_kube_sim::kubeconfig_yaml(&format!("http://{dead}"), common::NS),
    )
    .unwrap();

    let port = free_port();
    let mut child = Command::new(BIN)
        .env_clear()
        .env("DATABASE_URL", &url)
        .env("KUBECONFIG", &kubeconfig)
        .env("TTLAB_ENV", "dev")
        .env("TTLAB_NAMESPACE", common::NS)
        .env("TTLAB_REAP_INTERVAL", "1s")
        .env("TTLAB_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("the reaper starts");
    eventually("the reaper leads", 60, || async {
        get(port, "/metrics")
            .await
            .is_some_and(|(_, m)| m.lines().any(|l| l.trim() == "ttlab_reaper_leader 1"))
    })
    .await;
    // Cycles run against the unreachable cluster (their items fail): the process stays up,
    // alive and ready (its database answers).
    for _ in 0..4 {
        assert_eq!(child.try_wait().unwrap(), None, "the reaper exited");
        assert_eq!(get(port, "/healthz").await.map(|(s, _)| s), Some(200));
        assert_eq!(get(port, "/readyz").await.map(|(s, _)| s), Some(200));
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");
    tokio::task::block_in_place(|| pg.stop()).unwrap();
}
