//! `ttlabctl class add|list|cancel` against a running server (`ttlabctl demo`: PostgreSQL,
//! kube-sim, `ttlab-server`), with an admin token from `ttlabctl token --role admin`: a class
//! is scheduled and listed as a table, its lesson's labs are prepared for it, a bad one is
//! refused with the API's sentence and changes nothing, and cancelling takes it off the list.
//!
//! The demo runs the sibling binaries `ttlab-server`, `ttlab-reaper` and `ttlab-agent`; when
//! they are missing it builds them with the cargo that builds this test.

use std::net::{Ipv4Addr, TcpListener};
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt as _, BufReader};

const SECRET: &str = "a class test secret, long enough for HS256 tokens";

/// Sends SIGINT to the demo if the test ends early, so that it stops what it started.
struct Interrupt(Option<u32>);

impl Drop for Interrupt {
    fn drop(&mut self) {
        if let Some(pid) = self
            .0
            .and_then(|p| rustix::process::Pid::from_raw(p as i32))
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::INT);
        }
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `ttlabctl args…` with `TTLAB_TOKEN` set to `token` (when given).
async fn ttlabctl(args: &[&str], token: Option<&str>) -> Output {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"));
    cmd.args(args)
        .env_remove("TTLAB_TOKEN")
        .env_remove("TTLAB_URL")
        .env_remove("TTLAB_AUTH_SECRET")
        .stdin(Stdio::null());
    if let Some(t) = token {
        cmd.env("TTLAB_TOKEN", t);
    }
    cmd.output().await.expect("ttlabctl runs")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn classes_are_added_listed_refused_and_cancelled_through_the_api() {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(["demo", "--port", &port.to_string(), "--no-reaper"])
        .args(["--auth-secret", SECRET])
        .env("CARGO", env!("CARGO"))
        .env("TTLAB_SIM_BOOT", "300ms")
        .env("TTLAB_SIM_SETUP", "300ms")
        .env("RUST_LOG", "warn")
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("starting ttlabctl demo");
    let _interrupt = Interrupt(child.id());
    let pid = child.id().expect("the demo's pid");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Building missing sibling binaries on a fresh checkout can take minutes.
    tokio::time::timeout(Duration::from_secs(900), async {
        while let Some(line) = lines.next_line().await.expect("reading the demo's output") {
            if line.starts_with("Ctrl-C stops everything") {
                return;
            }
        }
        panic!("the demo ended before printing its banner");
    })
    .await
    .expect("the demo printed its banner in time");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let url = format!("http://127.0.0.1:{port}");

    // The admin token, as an operator mints it.
    let minted = ttlabctl(
        &[
            "token",
            "--user",
            "ops",
            "--role",
            "admin",
            "--auth-secret",
            SECRET,
        ],
        None,
    )
    .await;
    assert!(minted.status.success(), "{}", text(&minted.stderr));
    let admin = text(&minted.stdout).trim().to_owned();
    let token = Some(admin.as_str());

    // Nothing yet.
    let out = ttlabctl(&["class", "--url", &url, "list"], token).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "no upcoming or running class\n");

    // A bad class: the API's sentence, exit status 1, nothing scheduled.
    let out = ttlabctl(
        &[
            "class",
            "--url",
            &url,
            "add",
            "--lesson",
            "systemd-basics",
            "--seats",
            "0",
            "--starts-at",
            "+1d",
        ],
        token,
    )
    .await;
    assert!(!out.status.success());
    assert_eq!(
        text(&out.stderr).trim(),
        "ttlabctl: error: a class needs at least 1 seat, got 0 (422 invalid_class, field seats)"
    );
    let out = ttlabctl(
        &[
            "class",
            "--url",
            &url,
            "add",
            "--lesson",
            "shell-basics",
            "--seats",
            "5",
            "--starts-at",
            "+1d",
        ],
        token,
    )
    .await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("shell-basics is a pod lesson"),
        "{}",
        text(&out.stderr)
    );
    // A student's token is not an admin's.
    let student = ttlabctl(
        &[
            "token",
            "--user",
            "kim",
            "--role",
            "student",
            "--auth-secret",
            SECRET,
        ],
        None,
    )
    .await;
    let student = text(&student.stdout).trim().to_owned();
    let out = ttlabctl(&["class", "--url", &url, "list"], Some(&student)).await;
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("(403 forbidden)"),
        "{}",
        text(&out.stderr)
    );

    // Two classes: tomorrow's, with a code (given as a flag here), and one in three minutes.
    let out = ttlabctl(
        &[
            "class",
            "--url",
            &url,
            "--token",
            &admin,
            "add",
            "--lesson",
            "systemd-basics",
            "--title",
            "Intro tomorrow",
            "--seats",
            "12",
            "--starts-at",
            "+1d",
            "--minutes",
            "90",
            "--code",
            "demo-1",
        ],
        None,
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.starts_with("scheduled class "), "{said}");
    assert!(
        said.contains("\"Intro tomorrow\": 12 seats of systemd-basics"),
        "{said}"
    );
    assert!(
        said.contains("students enter the join code DEMO-1"),
        "{said}"
    );
    let tomorrow = said
        .split_whitespace()
        .nth(2)
        .expect("the class's id")
        .to_owned();
    let out = ttlabctl(
        &[
            "class",
            "--url",
            &url,
            "add",
            "--lesson",
            "systemd-basics",
            "--title",
            "Soon",
            "--seats",
            "2",
            "--starts-at",
            "+3m",
        ],
        token,
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));

    // Listed as a table; the class in three minutes gets its two labs prepared.
    let until = Instant::now() + Duration::from_secs(90);
    loop {
        let out = ttlabctl(&["class", "--url", &url, "list"], token).await;
        assert!(out.status.success(), "{}", text(&out.stderr));
        let table = text(&out.stdout);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 3, "{table}");
        assert!(lines[0].starts_with("ID "), "{table}");
        assert!(
            lines[0].contains("SEATS") && lines[0].contains("CAN BE WARM"),
            "{table}"
        );
        let soon = lines[1];
        let later = lines[2];
        assert!(soon.contains("Soon"), "{table}");
        assert!(
            later.contains("Intro tomorrow") && later.contains("DEMO-1"),
            "{table}"
        );
        assert!(later.starts_with(&tomorrow), "{table}");
        if soon.contains(" 2+0 ") {
            break;
        }
        assert!(
            Instant::now() < until,
            "the class's labs were never ready:\n{table}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // Cancelled once; a second time is the API's refusal.
    let out = ttlabctl(&["class", "--url", &url, "cancel", &tomorrow], token).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).starts_with(&format!("cancelled class {tomorrow} \"Intro tomorrow\"")),
        "{}",
        text(&out.stdout)
    );
    let out = ttlabctl(&["class", "--url", &url, "cancel", &tomorrow], token).await;
    assert!(!out.status.success());
    assert_eq!(
        text(&out.stderr).trim(),
        "ttlabctl: error: the class \"Intro tomorrow\" was cancelled (409 class_cancelled)"
    );
    let out = ttlabctl(&["class", "--url", &url, "list"], token).await;
    assert_eq!(
        text(&out.stdout).lines().count(),
        2,
        "{}",
        text(&out.stdout)
    );

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::INT,
    )
    .unwrap();
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the demo stopped in time after SIGINT")
        .unwrap();
    assert!(
        status.success(),
        "the demo exits cleanly on SIGINT: {status}"
    );
}
