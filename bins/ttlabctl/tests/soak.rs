//! `ttlabctl soak --profile short` end to end: two environments, simulated students (pod labs
//! among them), injected faults and latency, SIGKILLed reapers and servers, a restarted
//! PostgreSQL, rolled servers, blackholed, stalled and reply-losing connections to PostgreSQL
//! and the Kubernetes API, and VMs whose deletion hangs on a finalizer, for about a minute plus
//! the drain; every invariant must hold and the table must say so. (The same on the real
//! control plane, `ttlabctl soak --profile short --backend real --expiry-bound 7s`
//! (docs/soak.md), is a command, not a test yet: it passes most runs, but at times an expired
//! VM's deletion takes a little longer than the row allows on a loaded machine, or a VMI stays
//! held by `kubevirt.io/virtualMachineControllerFinalize` after its deletion until the drain
//! gave up: a race in the simulated KubeVirt controller, fixed since, with too few runs yet to
//! call the test stable.)
//!
//! The soak runs the sibling binaries `ttlab-server`, `ttlab-reaper` and `ttlab-agent`; when
//! they are missing it builds them with the cargo that builds this test.

use std::process::Stdio;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn the_short_soak_holds_every_invariant() {
    short_soak().await;
}

/// Runs `ttlabctl soak --profile short` and checks its table.
async fn short_soak() {
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
            .args(["soak", "--profile", "short", "--seed", "7"])
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the short soak ends within 10 minutes")
    .expect("ttlabctl runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    assert!(
        out.status.success(),
        "the soak failed ({}):\n{stdout}\n--- last lines of stderr ---\n{}",
        out.status,
        tail.join("\n")
    );
    for row in [
        "VMs at once <= limit (both envs)",
        "server VM limit held (quota unused)",
        "one live session per user",
        "expired VM deleted <= ",
        "no object deleted by the other env",
        "row final only after its VMs/Secrets deleted",
        "drained: namespace empty, rows final",
        "no 5xx but 503 in a database outage",
        "no process exited by itself",
        "no running lab lost its VM (0 ghosts)",
        "row final only after its held VM was gone",
        "sessions reach running >= 99% (faults all transient)",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(row))
            .unwrap_or_else(|| panic!("no row {row:?} in:\n{stdout}"));
        assert!(line.ends_with("PASS"), "{line}");
        // Each invariant was actually checked.
        let checks: u64 = line
            .split_whitespace()
            .rev()
            .nth(2)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no check count in {line:?}"));
        assert!(checks > 0, "{line}");
    }
    // Checked whenever a deploy caught sessions in preparation (it may catch none).
    let deploy = stdout
        .lines()
        .find(|l| l.starts_with("0 sessions failed by a deploy"))
        .unwrap_or_else(|| panic!("no deploy row in:\n{stdout}"));
    assert!(deploy.ends_with("PASS"), "{deploy}");
    assert!(stdout.trim_end().ends_with("soak: PASS"), "{stdout}");
    // Failures are tabulated by reason, and pod labs were among the sessions.
    assert!(
        stdout.contains("failed sessions by reason"),
        "no failure table in:\n{stdout}"
    );
    let lessons = stdout
        .lines()
        .find(|l| l.starts_with("sessions by lesson:"))
        .expect("a sessions-by-lesson line");
    assert!(lessons.contains("soak-pod"), "{lessons}");
    // The chaos happened.
    let activity = stdout
        .lines()
        .find(|l| l.starts_with("activity:"))
        .expect("an activity line");
    for what in [
        "reapers killed",
        "servers killed",
        "PostgreSQL restarts",
        "rolling restarts",
        "connections blackholed",
        "connections stalled",
        "replies lost",
        "sessions opened",
    ] {
        assert!(activity.contains(what), "{activity}");
    }
}
