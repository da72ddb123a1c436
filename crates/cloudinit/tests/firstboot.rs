//! Runs the rendered first-boot script for real (with `sh`), its guest paths moved into a
//! temporary directory and `systemctl`/`getconf`/`blkid`/`mount` replaced by recording
//! stand-ins (the agent disk is a directory holding what KubeVirt would put on it; `gzip` and
//! `sha256sum` are the real ones): the readiness marker appears only after a successful
//! setup, and every failure — a missing agent disk or one of another version included —
//! leaves the failure marker with its reason instead.

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use ttlab_agent::protocol::BINARY_PATH;
use ttlab_agent::protocol::{FAILED_MARKER_PATH, POWER_OFF_AT_PATH, READY_MARKER_PATH};
use ttlab_cloudinit::{
    AGENT_DIGEST_PATH, AGENT_DISK_MOUNT, AGENT_KEY, AGENT_VOLUME_LABEL, FIRSTBOOT_PATH,
    POWEROFF_CHECK_PATH, SETUP_LOG_PATH, SETUP_PATH,
};
use ttlab_lesson::samples;

struct Guest {
    dir: tempfile::TempDir,
}

/// What the guest's agent disk holds.
#[derive(Clone, Copy)]
enum AgentDisk {
    /// The ConfigMap of the version the user-data pins.
    Matching,
    /// The ConfigMap of another build.
    OtherVersion,
    /// No disk (KubeVirt would not have started the VM; a guest booted without it).
    Missing,
}

/// Installs the stand-ins for the agent disk in `dir` (`blkid` finds it by its label only if
/// it is present; `mount`, `umount`, `udevadm` and `sleep` do nothing) and returns the
/// replacements that move the agent's guest paths into `dir`.
fn agent_disk(dir: &Path, parsed: &common::Parsed, disk: AgentDisk) -> Vec<(String, String)> {
    let p = |name: &str| dir.join(name).display().to_string();
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(p("agent-disk")).unwrap();
    let binary: Option<&[u8]> = match disk {
        AgentDisk::Matching => Some(common::FAKE_AGENT),
        AgentDisk::OtherVersion => Some(b"\x7fELF another build of the agent"),
        AgentDisk::Missing => None,
    };
    if let Some(binary) = binary {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        std::io::Write::write_all(&mut gz, binary).unwrap();
        std::fs::write(dir.join("agent-disk").join(AGENT_KEY), gz.finish().unwrap()).unwrap();
    }
    let blkid = if binary.is_some() {
        format!(
            "#!/bin/sh
[ \"$*\" = \"-L {AGENT_VOLUME_LABEL}\" ] && echo /dev/sr1 && exit 0
exit 2
"
        )
    } else {
        "#!/bin/sh
exit 2
"
        .to_owned()
    };
    write_exec(&bin.join("blkid"), &blkid);
    for tool in ["mount", "umount", "udevadm", "sleep"] {
        write_exec(
            &bin.join(tool),
            "#!/bin/sh
exit 0
",
        );
    }
    std::fs::create_dir_all(p("usr-local-bin")).unwrap();
    std::fs::write(p("agent.sha256"), parsed.text(AGENT_DIGEST_PATH)).unwrap();
    vec![
        (AGENT_DIGEST_PATH.to_owned(), p("agent.sha256")),
        (AGENT_DISK_MOUNT.to_owned(), p("agent-disk")),
        (BINARY_PATH.to_owned(), p("usr-local-bin/ttlab-agent")),
    ]
}

struct Outcome {
    success: bool,
    ready: Option<String>,
    failed: Option<String>,
    /// `systemctl` calls, the power-off check and the setup, in the order they happened.
    events: Vec<String>,
    console: String,
}

impl Guest {
    /// `glibc` is what `getconf GNU_LIBC_VERSION` prints (empty: it fails, as on musl);
    /// `agent_starts` whether `systemctl enable --now ttlab-agent.service` succeeds.
    fn new(glibc: &str, agent_starts: bool) -> Self {
        Self::with_disk(glibc, agent_starts, AgentDisk::Matching)
    }

    fn with_disk(glibc: &str, agent_starts: bool, disk: AgentDisk) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        let events = dir.path().join("events");
        let agent_rc = if agent_starts { 0 } else { 1 };
        write_exec(
            &bin.join("systemctl"),
            &format!(
                "#!/bin/sh\necho \"systemctl $*\" >> {events}\ncase \"$*\" in *ttlab-agent*) exit {agent_rc};; esac\nexit 0\n",
                events = events.display()
            ),
        );
        let getconf = if glibc.is_empty() {
            "#!/bin/sh\nexit 1\n".to_owned()
        } else {
            format!("#!/bin/sh\necho '{glibc}'\n")
        };
        write_exec(&bin.join("getconf"), &getconf);
        write_exec(
            &dir.path().join("poweroff-check"),
            &format!("#!/bin/sh\necho poweroff-check >> {}\n", events.display()),
        );
        std::fs::write(
            dir.path().join("disk"),
            match disk {
                AgentDisk::Matching => "matching",
                AgentDisk::OtherVersion => "other",
                AgentDisk::Missing => "missing",
            },
        )
        .unwrap();
        Self { dir }
    }

    fn disk(&self) -> AgentDisk {
        match std::fs::read_to_string(self.path("disk")).unwrap().as_str() {
            "matching" => AgentDisk::Matching,
            "other" => AgentDisk::OtherVersion,
            _ => AgentDisk::Missing,
        }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Renders `setup` with `timeout` seconds, moves the guest paths here and runs first boot.
    fn boot(&self, setup: Option<&str>, timeout: u64) -> Outcome {
        let mut lesson = samples::systemd_basics();
        lesson.setup = setup.map(|s| s.replace("EVENTS", &self.path("events")));
        lesson.setup_timeout = Duration::from_secs(timeout);
        let parsed = common::parse(common::render(&lesson, "vm").as_str());
        if lesson.setup.is_some() {
            write_exec(Path::new(&self.path("setup")), &parsed.text(SETUP_PATH));
        }
        let moved = agent_disk(self.dir.path(), &parsed, self.disk());
        let script = moved
            .iter()
            .fold(parsed.text(FIRSTBOOT_PATH), |s, (from, to)| {
                s.replace(from, to)
            })
            .replace(READY_MARKER_PATH, &self.path("state/ready"))
            .replace(FAILED_MARKER_PATH, &self.path("state/failed"))
            .replace(POWEROFF_CHECK_PATH, &self.path("poweroff-check"))
            .replace(SETUP_LOG_PATH, &self.path("setup.log"))
            .replace(SETUP_PATH, &self.path("setup"))
            .replace("/dev/console", &self.path("console"));
        assert!(!script.contains("/var/lib/ttlab") && !script.contains("/usr/local/lib/ttlab"));
        std::fs::write(self.path("firstboot"), script).unwrap();
        let path = format!(
            "{}:{}",
            self.path("bin"),
            std::env::var("PATH").unwrap_or_default()
        );
        let status = run_sh(&self.path("firstboot"), &path);
        let read = |name: &str| std::fs::read_to_string(self.path(name)).ok();
        Outcome {
            success: status.success(),
            ready: read("state/ready"),
            failed: read("state/failed"),
            events: read("events")
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect(),
            console: read("console").unwrap_or_default(),
        }
    }
}

/// Held while a script is written and while a child is forked. A child forked while another
/// test thread has a script open for writing holds that file open until it execs, and
/// running the script then fails with ETXTBSY: the shell would take the next command of that
/// name on the PATH, the machine's own.
fn no_write_open() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Runs `script` with `sh` and `path` as its PATH, forked while no script is open for writing.
fn run_sh(script: &str, path: &str) -> std::process::ExitStatus {
    let mut child = {
        let _no_write_open = no_write_open();
        Command::new("sh")
            .arg(script)
            .env("PATH", path)
            .spawn()
            .unwrap()
    };
    child.wait().unwrap()
}

fn write_exec(path: &Path, text: &str) {
    let _no_write_open = no_write_open();
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

const MODERN: &str = "glibc 2.36";

#[test]
fn a_successful_setup_ends_with_the_readiness_marker_after_everything_else() {
    let g = Guest::new(MODERN, true);
    let o = g.boot(
        Some("#!/bin/sh\necho \"setup on $TTLAB_NODE of $TTLAB_LESSON\" >> EVENTS\n"),
        30,
    );
    assert!(o.success);
    assert_eq!(o.ready.as_deref(), Some("ready\n"));
    assert_eq!(o.failed, None);
    assert_eq!(
        o.events,
        [
            "systemctl daemon-reload",
            "systemctl enable --now ttlab-poweroff.timer",
            "systemctl start --no-block ttlab-poweroff.service",
            "systemctl enable --now ttlab-agent.service",
            "systemctl restart serial-getty@ttyS0.service",
            "setup on vm of systemd-basics",
        ]
    );
    assert!(
        o.console.contains("ttlab: the lab is ready"),
        "{}",
        o.console
    );
}

#[test]
fn a_failing_setup_writes_the_reason_and_never_the_marker() {
    let g = Guest::new(MODERN, true);
    std::fs::create_dir_all(g.path("state")).unwrap();
    std::fs::write(g.path("state/ready"), "stale from a previous boot").unwrap();
    let o = g.boot(
        Some("echo 'E: Unable to locate package kubeadm' >&2\nexit 3\n"),
        30,
    );
    assert!(!o.success);
    assert_eq!(
        o.ready, None,
        "a stale marker is removed and no new one written"
    );
    let failed = o.failed.unwrap();
    assert!(
        failed.starts_with("the setup script exited with status 3\n"),
        "{failed}"
    );
    assert!(
        failed.contains("E: Unable to locate package kubeadm"),
        "{failed}"
    );
    assert!(
        o.console.contains("the lab could not be prepared"),
        "{}",
        o.console
    );
}

#[test]
fn a_hung_setup_is_killed_at_its_timeout() {
    let g = Guest::new(MODERN, true);
    let o = g.boot(Some("#!/bin/sh\nsleep 30\n"), 1);
    assert!(!o.success);
    assert_eq!(o.ready, None);
    assert_eq!(
        o.failed.as_deref(),
        Some("the setup script did not finish within 1 s\n")
    );
}

#[test]
fn a_guest_too_old_for_the_agent_fails_with_that_reason() {
    for (glibc, reason) in [
        ("glibc 2.31", "glibc 2.31 is older than 2.34"),
        ("glibc 1.99", "glibc 1.99 is older than 2.34"),
        ("", "no glibc found"),
    ] {
        let g = Guest::new(glibc, true);
        let o = g.boot(Some("echo setup >> EVENTS\n"), 30);
        assert!(!o.success);
        assert_eq!(o.ready, None);
        let failed = o.failed.unwrap();
        assert!(failed.contains(reason), "{glibc}: {failed}");
        assert!(o.console.contains(reason), "{glibc}: {}", o.console);
        assert!(
            o.events
                .contains(&"systemctl start --no-block ttlab-poweroff.service".to_owned()),
            "the deadline is armed first"
        );
        assert!(
            !o.events
                .iter()
                .any(|e| e.contains("ttlab-agent") || e == "setup"),
            "{:?}",
            o.events
        );
    }
    let o = Guest::new("glibc 2.34", true).boot(None, 30);
    assert!(o.success && o.ready.is_some());
    let o = Guest::new("glibc 3.0", true).boot(None, 30);
    assert!(o.success && o.ready.is_some());
}

#[test]
fn the_agent_is_installed_from_its_disk_only_when_its_digest_matches() {
    let g = Guest::new(MODERN, true);
    let o = g.boot(None, 30);
    assert!(o.success && o.ready.is_some(), "{:?}", o.failed);
    assert_eq!(
        std::fs::read(g.path("usr-local-bin/ttlab-agent")).unwrap(),
        common::FAKE_AGENT,
        "the binary of the disk, unpacked where the unit runs it"
    );
    let mode = std::fs::metadata(g.path("usr-local-bin/ttlab-agent"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o755);

    for (disk, reason) in [
        (AgentDisk::OtherVersion, "is not the expected version"),
        (AgentDisk::Missing, "no disk labelled ttlab-agent appeared"),
    ] {
        let g = Guest::with_disk(MODERN, true, disk);
        let o = g.boot(Some("echo setup >> EVENTS\n"), 30);
        assert!(!o.success);
        assert_eq!(o.ready, None, "never the readiness marker");
        let failed = o.failed.unwrap();
        assert!(failed.contains(reason), "{failed}");
        assert!(
            o.console.contains(reason),
            "said on the console: {}",
            o.console
        );
        assert!(
            !o.events
                .iter()
                .any(|e| e.contains("ttlab-agent") || e == "setup"),
            "no agent started, no setup run: {:?}",
            o.events
        );
        assert!(
            !Path::new(&g.path("usr-local-bin/ttlab-agent")).exists(),
            "nothing installed"
        );
    }
}

#[test]
fn an_agent_that_does_not_start_fails_the_lab() {
    let o = Guest::new(MODERN, false).boot(Some("echo setup >> EVENTS\n"), 30);
    assert!(!o.success);
    assert_eq!(o.ready, None);
    assert_eq!(
        o.failed.as_deref(),
        Some("the grading agent service did not start\n")
    );
    assert!(!o.events.contains(&"setup".to_owned()));
}

/// A guest whose `systemctl` behaves as systemd does for the power-off unit: enabling the
/// timer fires it at once (`OnActiveSec=0`) and runs the unit; starting the unit while that
/// run is queued or done merges into the same job; a second `poweroff` while one is under way
/// fails with systemd's message, and `is-system-running` then says `stopping`. The real
/// rendered power-off check runs, with `date` at one minute past the deadline and
/// `/sbin/poweroff -f` recorded instead of cutting anything.
fn boot_past_the_deadline() -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).display().to_string();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let parsed = common::parse(common::render(&samples::systemd_basics(), "vm").as_str());
    let check = parsed
        .text(POWEROFF_CHECK_PATH)
        .replace(POWER_OFF_AT_PATH, &p("power-off-at"))
        .replace(
            "/sbin/poweroff -f",
            &format!("echo 'forced power-off' >> {}", p("events")),
        )
        .replace("/dev/console", &p("console"));
    write_exec(Path::new(&p("poweroff-check")), &check);
    write_exec(
        &bin.join("date"),
        &format!("#!/bin/sh\necho {}\n", common::deadline().timestamp() + 60),
    );
    write_exec(
        &bin.join("systemctl"),
        &format!(
            r#"#!/bin/sh
events={events}
run_unit() {{
  if [ -e {dir}/unit-job ]; then echo "power-off unit: merged into the queued job" >> $events; return 0; fi
  : > {dir}/unit-job
  echo "power-off unit runs the check" >> $events
  {check}
}}
case "$*" in
  "enable --now ttlab-poweroff.timer") run_unit ;;
  "start --no-block ttlab-poweroff.service") run_unit ;;
  "--no-block poweroff")
    if [ -e {dir}/stopping ]; then
      echo "Call to PowerOff failed: There's already a shutdown or sleep operation in progress" >&2
      echo "second power-off request refused" >> $events
      exit 1
    fi
    : > {dir}/stopping
    echo "power-off requested" >> $events ;;
  is-system-running) if [ -e {dir}/stopping ]; then echo stopping; else echo running; fi ;;
esac
exit 0
"#,
            events = p("events"),
            dir = dir.path().display(),
            check = p("poweroff-check"),
        ),
    );
    write_exec(&bin.join("getconf"), "#!/bin/sh\necho 'glibc 2.36'\n");
    let moved = agent_disk(dir.path(), &parsed, AgentDisk::Matching);
    let script = moved
        .iter()
        .fold(parsed.text(FIRSTBOOT_PATH), |s, (from, to)| {
            s.replace(from, to)
        })
        .replace(READY_MARKER_PATH, &p("state/ready"))
        .replace(FAILED_MARKER_PATH, &p("state/failed"))
        .replace(POWEROFF_CHECK_PATH, &p("poweroff-check"))
        .replace(SETUP_LOG_PATH, &p("setup.log"))
        .replace(SETUP_PATH, &p("setup"))
        .replace("/dev/console", &p("console"));
    std::fs::write(p("firstboot"), script).unwrap();
    write_exec(Path::new(&p("setup")), "#!/bin/sh\nexit 0\n");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run_sh(&p("firstboot"), &path);
    std::fs::read_to_string(p("events"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_deadline_already_past_at_first_boot_makes_one_clean_power_off_request() {
    let events = boot_past_the_deadline();
    assert_eq!(
        events
            .iter()
            .filter(|e| *e == "power-off unit runs the check")
            .count(),
        1,
        "the check runs once, as the unit: {events:?}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| *e == "power-off requested")
            .count(),
        1,
        "{events:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| e == "second power-off request refused" || e == "forced power-off"),
        "no racing request, no forced power cut: {events:?}"
    );
}

#[test]
fn the_power_off_check_leaves_a_shutdown_under_way_alone() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).display().to_string();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let parsed = common::parse(common::render(&samples::systemd_basics(), "vm").as_str());
    let check = parsed
        .text(POWEROFF_CHECK_PATH)
        .replace(POWER_OFF_AT_PATH, &p("power-off-at"))
        .replace(
            "/sbin/poweroff -f",
            &format!("echo forced >> {}", p("events")),
        )
        .replace("/dev/console", &p("console"));
    write_exec(Path::new(&p("check")), &check);
    write_exec(
        &bin.join("date"),
        &format!("#!/bin/sh\necho {}\n", common::deadline().timestamp() + 60),
    );
    write_exec(
        &bin.join("systemctl"),
        &format!(
            "#!/bin/sh\necho \"systemctl $*\" >> {}\ncase \"$*\" in is-system-running) echo stopping ;; *) exit 1 ;; esac\n",
            p("events")
        ),
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let status = run_sh(&p("check"), &path);
    assert!(status.success());
    let events = std::fs::read_to_string(p("events")).unwrap();
    assert_eq!(events, "systemctl is-system-running\n", "{events}");
}
