//! The `ttlab-reaper` binary with a sites file (`TTLAB_SITES`): site `a` on kube-sim, site
//! `b` whose kubeconfig does not exist (its client cannot be built). Site `a`'s expiries are
//! reclaimed at once; `b` is reported down in `/healthz` (which stays 200), `/healthz/sites`
//! and `ttlab_reaper_site_up`, and its sessions are left alone; `--once` runs `a` and exits 1
//! for `b`.

#[path = "../../../crates/reaper/tests/common/mod.rs"]
mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use chrono::TimeDelta;
use common::Harness;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::Command;
use ttlab_model::{Runtime, SessionStatus};

const BIN: &str = env!("CARGO_BIN_EXE_ttlab-reaper");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The status and body of `GET path` on the reaper's metrics port.
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
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{what}: not within {secs} s");
}

fn reaper(h: &Harness, sites: &std::path::Path, extra: &[&str]) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args(extra)
        .env_clear()
        .env("DATABASE_URL", h.db.url())
        .env("TTLAB_SITES", sites)
        .env("TTLAB_ENV", "dev")
        .env("TTLAB_ORPHAN_MIN_AGE", "0s")
        .env("TTLAB_REAP_INTERVAL", "1s")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    cmd
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_sites_file_a_site_whose_client_cannot_be_built_holds_back_no_other_site() {
    let h = Harness::start().await;
    let sites = h.dir.path().join("sites.yaml");
    std::fs::write(
        &sites,
        format!(
            "sites:\n  - {{name: a, kubeconfig: {}, namespace: {}, vm_limit: 8}}\n  \
             - {{name: b, kubeconfig: {}, namespace: {}, vm_limit: 8}}\n",
            h.kubeconfig().display(),
            common::NS,
            h.dir.path().join("missing-b.kubeconfig").display(),
            common::NS,
        ),
    )
    .expect("sites file");
    let on_b = h
        .open_on(
            "b",
            "dev",
            Runtime::Vm,
            SessionStatus::Running,
            TimeDelta::seconds(-1),
            &["vm"],
        )
        .await;

    let port = free_port();
    let mut child = reaper(&h, &sites, &[])
        .env("TTLAB_METRICS_LISTEN", format!("127.0.0.1:{port}"))
        .spawn()
        .expect("the reaper starts");
    eventually("the reaper leads", 60, || async {
        get(port, "/metrics")
            .await
            .is_some_and(|(_, m)| m.lines().any(|l| l.trim() == "ttlab_reaper_leader 1"))
    })
    .await;

    let before = Instant::now();
    // Starting until its VM exists, then running: a running row without its VM would be a
    // ghost to a sweep in between.
    let on_a = h
        .open_on(
            "a",
            "dev",
            Runtime::Vm,
            SessionStatus::Starting,
            TimeDelta::milliseconds(1500),
            &["vm"],
        )
        .await;
    h.create_vms("dev", on_a.id, &["vm"], true).await;
    h.store
        .sessions()
        .mark_running(on_a.id, None)
        .await
        .expect("mark running")
        .expect("was starting");
    let expiry = before + Duration::from_millis(1500);
    eventually("site a's expired VM deleted", 10, || async {
        !h.vm_alive(on_a.id, "vm").await
    })
    .await;
    let took = expiry.elapsed();
    println!(
        "ttlab-reaper with site b's client unbuildable: site a expiry -> VM delete {} ms",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(2), "{took:?}");
    eventually("site a's session expired", 10, || async {
        h.status(on_a.id).await == SessionStatus::Expired
    })
    .await;

    let (status, body) = get(port, "/healthz").await.expect("an answer");
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ok\n"), "{body}");
    assert!(body.contains("site a: up"), "{body}");
    assert!(
        body.contains("site b: down") && body.contains("cannot build its client"),
        "{body}"
    );
    let (status, json) = get(port, "/healthz/sites").await.expect("an answer");
    assert_eq!(status, 200, "{json}");
    let json: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    let states: Vec<(&str, &str)> = json["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .map(|s| (s["site"].as_str().unwrap(), s["state"].as_str().unwrap()))
        .collect();
    assert_eq!(states, [("a", "up"), ("b", "down")], "{json}");
    let (_, metrics) = get(port, "/metrics").await.expect("an answer");
    assert!(
        metrics.contains("ttlab_reaper_site_up{site=\"a\"} 1")
            && metrics.contains("ttlab_reaper_site_up{site=\"b\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("ttlab_reaper_cycles_total{site=\"a\",trigger=\"Startup\"} 1"),
        "{metrics}"
    );
    // Site b's session is left alone: its client was never built.
    assert_eq!(h.status(on_b.id).await, SessionStatus::Running);
    child.start_kill().expect("SIGKILL");
    child.wait().await.expect("reaped");

    // A one-shot runs site a and says that site b's cycle could not run (exit status 1).
    let out = reaper(&h, &sites, &["--once"])
        .output()
        .await
        .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("site a: cycle in "), "{stdout}");
    assert_eq!(h.status(on_b.id).await, SessionStatus::Running);
}
