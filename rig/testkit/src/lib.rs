//! Test support shared by every suite of the workspace, with no dependencies of its own.
//!
//! It owns one rule: **no test passes by skipping in CI.** A test that needs a tool the machine
//! may lack (kubectl, cloud-init, Chromium, the real control plane's binaries, a binary built by
//! another profile) asks [`skip_or_fail`] when the tool is missing. On a developer's machine the
//! test prints a `SKIPPED:` line (which `.ci/run` counts) and returns; with `CI=true` it panics
//! with the same message, so a CI run whose machine lacks a tool is red, not green.
//!
//! ```
//! fn needs_kubectl() {
//!     let Some(kubectl) = ttlab_testkit::which("kubectl") else {
//!         // Under CI=true this panics instead of returning.
//!         # if ttlab_testkit::in_ci() { return; }
//!         return ttlab_testkit::skip_or_fail("kubectl is not on PATH");
//!     };
//!     assert!(kubectl.is_file());
//! }
//! needs_kubectl();
//! ```
//!
//! It also holds [`FaultProxy`] ([`fault_proxy`]), a loopback TCP proxy that passes,
//! blackholes (half-open: no reply, no RST, no FIN), stalls, loses replies (the request takes
//! effect, its answer is dropped) or closes connections on command, and can cut the
//! connections open now ([`FaultProxy::cut_open`]), for suites that test what a process does
//! when the network under it goes bad. In front of PostgreSQL it can also lose the answer to
//! one chosen statement ([`FaultProxy::lose_answer_to`]).

pub mod fault_proxy;

pub use fault_proxy::{FaultMode, FaultProxy, Upstream};

use std::path::PathBuf;

/// Whether this run is CI's: the environment variable `CI` is `true` (or `1`).
pub fn in_ci() -> bool {
    matches!(
        std::env::var("CI").as_deref().map(str::trim),
        Ok("true") | Ok("TRUE") | Ok("True") | Ok("1")
    )
}

/// Reports that a test cannot run because `why` (a missing tool, binary or file).
///
/// Outside CI it prints `SKIPPED: <why>` on standard error and returns, and the caller returns
/// from the test. When `TTLAB_SKIPPED_LOG` names a file, the line is appended there too. Under `CI=true` it panics with the same text: CI installs every tool the
/// tests need, so a missing one is a broken CI machine, never a pass.
#[track_caller]
pub fn skip_or_fail(why: &str) {
    // Also recorded where `.ci/run` counts them (test output is hidden for passing tests).
    if let Some(log) = std::env::var_os("TTLAB_SKIPPED_LOG") {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
        {
            let _ = writeln!(f, "SKIPPED: {why}");
        }
    }
    if in_ci() {
        panic!("CI=true and a test's tool is missing: {why}");
    }
    eprintln!("SKIPPED: {why}");
}

/// The first file called `name` in a directory of `PATH`.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_finds_a_shell_and_not_a_made_up_name() {
        assert!(which("sh").is_some(), "sh is on PATH on every machine");
        assert!(which("no-such-tool-ttlab-7f3a").is_none());
    }

    /// Runs this test binary again, with `CI` set to `ci`, to call [`skip_or_fail`] in a child
    /// process; the child's success and everything it printed.
    fn probe(ci: &str) -> (bool, String) {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "tests::skip_or_fail_returns_outside_ci_and_panics_under_ci",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("TTLAB_TESTKIT_PROBE", "1")
            .env("CI", ci)
            // The probe's skip is not a skipped test of this run.
            .env_remove("TTLAB_SKIPPED_LOG")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    }

    #[test]
    fn skip_or_fail_returns_outside_ci_and_panics_under_ci() {
        if std::env::var_os("TTLAB_TESTKIT_PROBE").is_some() {
            skip_or_fail("the probe's tool");
            println!("skip_or_fail returned");
            return;
        }
        for ci in ["", "false", "0"] {
            let (ok, text) = probe(ci);
            assert!(ok, "CI={ci:?}: {text}");
            assert!(
                text.contains("SKIPPED: the probe's tool"),
                "CI={ci:?}: {text}"
            );
            assert!(text.contains("skip_or_fail returned"), "CI={ci:?}: {text}");
        }
        for ci in ["true", "TRUE", "True", "1"] {
            let (ok, text) = probe(ci);
            assert!(!ok, "CI={ci:?}: {text}");
            assert!(
                text.contains("CI=true and a test's tool is missing: the probe's tool"),
                "CI={ci:?}: {text}"
            );
            assert!(!text.contains("skip_or_fail returned"), "CI={ci:?}: {text}");
        }
    }
}
