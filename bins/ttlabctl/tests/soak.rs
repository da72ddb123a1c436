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
//! call the test stable.) The same with two kube-sim sites and one of them taken away at a
//! time (`--sites 2 --site-vm-limit 20 --duration 45s --lose-site-every 20s --lose-site-for 19s`): the invariants per site and
//! over all.
//!
//! The soak runs the sibling binaries `ttlab-server`, `ttlab-reaper` and `ttlab-agent`; when
//! they are missing it builds them with the cargo that builds this test.

use std::process::Stdio;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread")]
async fn the_short_soak_holds_every_invariant() {
    let stdout = soak(&[]).await;
    check_common_rows(&stdout);
    // One site: the row over its one namespace (with several, one row per site).
    assert_row_passed_with_checks(&stdout, "no object deleted by the other env");
}

/// Two sites of 20 VMs, one of them taken away for 24 s (25 s into the run, for 50 s of
/// load; the servers find it lost within 17 s), on top of the short profile's chaos: every invariant holds on each site and over all, both sites got
/// sessions, starts ran on the site in reach while the other was lost, and the lost site's
/// expired sessions were reclaimed once it was back.
#[tokio::test(flavor = "multi_thread")]
async fn two_sites_with_one_lost_at_a_time_hold_every_invariant() {
    let stdout = soak(&[
        "--sites",
        "2",
        "--duration",
        "50s",
        "--lose-site-every",
        "25s",
        "--lose-site-for",
        "24s",
        // Room on the site in reach for the starts while the other is lost.
        "--site-vm-limit",
        "20",
    ])
    .await;
    check_common_rows(&stdout);
    for row in [
        "site-a: VMs at once <= its limit",
        "site-b: VMs at once <= its limit",
        "site-a: no object deleted by the other env",
        "site-b: no object deleted by the other env",
        "site-a: no leak (nothing left after the drain)",
        "site-b: no leak (nothing left after the drain)",
        "objects only on their session's site",
        "starts go to the sites in reach 17s into a loss",
    ] {
        assert_row_passed_with_checks(&stdout, row);
    }
    // Checked when a session of the lost site expired while it was away (one loss of 24 s
    // may see none).
    let back = row_line(
        &stdout,
        "lost site's expired sessions reclaimed after it returns",
    );
    assert!(back.ends_with("PASS"), "{back}");
    // Checked when an expiry on the site in reach met no other fault (the chaos may leave none).
    let healthy = row_line(
        &stdout,
        "expired VM deleted <= 2s on the sites in reach during a loss",
    );
    assert!(healthy.ends_with("PASS"), "{healthy}");
    // Both sites had sessions placed on them.
    for site in ["site-a", "site-b"] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{site}: ")) && l.contains("sessions placed"))
            .unwrap_or_else(|| panic!("no sessions line of {site} in:\n{stdout}"));
        let placed: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no count in {line:?}"));
        assert!(placed > 0, "{line}");
    }
    let activity = row_line(&stdout, "activity:");
    assert!(activity.contains("sites lost"), "{activity}");
    // Starts ran on the site in reach while the other was lost (once the servers could know).
    let during = row_line(&stdout, "while a site was lost");
    let ran: u64 = during
        .split_once("on the other sites (")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count of the sessions that ran in {during:?}"));
    assert!(ran > 0, "{during}");
}

/// Runs `ttlabctl soak --profile short --seed 7` with `extra` arguments; its stdout, once it
/// exited successfully.
async fn soak(extra: &[&str]) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(600),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
            .args(["soak", "--profile", "short", "--seed", "7"])
            .args(extra)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the short soak ends within 10 minutes")
    .expect("ttlabctl runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    assert!(
        out.status.success(),
        "the soak failed ({}):\n{stdout}\n--- last lines of stderr ---\n{}",
        out.status,
        tail.join("\n")
    );
    stdout
}

/// The first line of `stdout` that starts with `start`.
fn row_line<'a>(stdout: &'a str, start: &str) -> &'a str {
    stdout
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("no line {start:?} in:\n{stdout}"))
}

/// The row `row` passed, and was actually checked.
fn assert_row_passed_with_checks(stdout: &str, row: &str) {
    let line = row_line(stdout, row);
    assert!(line.ends_with("PASS"), "{line}");
    let checks: u64 = line
        .split_whitespace()
        .rev()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no check count in {line:?}"));
    assert!(checks > 0, "{line}");
}

/// The rows and notes of every short soak, one site or several.
fn check_common_rows(stdout: &str) {
    let stdout = stdout.to_owned();
    for row in [
        "VMs at once <= limit (both envs)",
        "server VM limit held (quota unused)",
        "one live session per user",
        "expired VM deleted <= ",
        "row final only after its VMs/Secrets deleted",
        "drained: namespace empty, rows final",
        "no 5xx but 503 in a database outage",
        "no process exited by itself",
        "no running lab lost its VM (0 ghosts)",
        "row final only after its held VM was gone",
        "sessions reach running >= 99% (faults all transient)",
    ] {
        // Each invariant was actually checked.
        assert_row_passed_with_checks(&stdout, row);
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
