//! Runs the rendered power-off check for real (with `sh`) against a deadline the agent moved:
//! its guest paths moved into a temporary directory (the production script reads
//! `/etc/ttlab/power-off-at`; the test rewrites that path in its copy only), `date` answering
//! a chosen instant and `systemctl` recording the power-off request. The moved deadline wins
//! when the file holds one, earlier or later; a missing or garbage file leaves the deadline
//! baked in at first boot, never "no deadline".

mod common;

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;

use ttlab_agent::protocol::POWER_OFF_AT_PATH;
use ttlab_cloudinit::{POWEROFF_CHECK_PATH, POWEROFF_TIMER_PATH};
use ttlab_lesson::samples;

fn write_exec(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The baked deadline of the rendered sample.
fn baked() -> i64 {
    common::deadline().timestamp()
}

/// One check at a time. A script written while another test thread forks can be held open
/// for writing by that child until it execs, and running it then fails with ETXTBSY: the
/// shell then takes the next `date` on the PATH, the machine's own, and its real clock (past
/// the sample's deadline) read as a power-off.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs the rendered check at `now` with `moved` (if any) in the deadline file; returns
/// whether it asked to power off.
fn powers_off(now: i64, moved: Option<&[u8]>) -> bool {
    let _one = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).display().to_string();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let parsed = common::parse(common::render(&samples::systemd_basics(), "vm").as_str());
    let production = parsed.text(POWEROFF_CHECK_PATH);
    assert!(production.contains(POWER_OFF_AT_PATH), "{production}");
    let check = production
        .replace(POWER_OFF_AT_PATH, &p("power-off-at"))
        .replace(
            "/sbin/poweroff -f",
            &format!("echo forced >> {}", p("events")),
        )
        .replace("/dev/console", &p("console"));
    write_exec(Path::new(&p("check")), &check);
    if let Some(moved) = moved {
        std::fs::write(p("power-off-at"), moved).unwrap();
    }
    write_exec(&bin.join("date"), &format!("#!/bin/sh\necho {now}\n"));
    write_exec(
        &bin.join("systemctl"),
        &format!(
            "#!/bin/sh\ncase \"$*\" in\n  is-system-running) echo running ;;\n  \"--no-block poweroff\") echo requested >> {} ;;\nesac\nexit 0\n",
            p("events")
        ),
    );
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let status = Command::new("sh")
        .arg(p("check"))
        .env("PATH", path)
        .status()
        .unwrap();
    assert!(status.success(), "the check exits 0: {status}");
    let events = std::fs::read_to_string(p("events")).unwrap_or_default();
    assert!(!events.contains("forced"), "{events}");
    match events.as_str() {
        "" => false,
        "requested\n" => true,
        other => panic!("unexpected events {other:?}"),
    }
}

#[test]
fn without_a_moved_deadline_the_baked_one_decides() {
    assert!(!powers_off(baked() - 60, None));
    assert!(powers_off(baked(), None));
    assert!(powers_off(baked() + 60, None));
}

#[test]
fn a_moved_earlier_deadline_powers_off_before_the_baked_one() {
    let earlier = format!("{}\n", baked() - 3600);
    assert!(powers_off(baked() - 60, Some(earlier.as_bytes())));
    assert!(!powers_off(baked() - 3601, Some(earlier.as_bytes())));
}

#[test]
fn a_moved_later_deadline_keeps_the_guest_on_past_the_baked_one() {
    let later = format!("{}\n", baked() + 3 * 3600);
    assert!(!powers_off(baked() + 60, Some(later.as_bytes())));
    assert!(powers_off(baked() + 3 * 3600 + 1, Some(later.as_bytes())));
    // Without the trailing newline too.
    let bare = (baked() + 3 * 3600).to_string();
    assert!(!powers_off(baked() + 60, Some(bare.as_bytes())));
}

#[test]
fn a_garbage_deadline_file_leaves_the_baked_deadline_never_none() {
    let later = baked() + 3600;
    for garbage in [
        "".to_owned(),
        "\n".to_owned(),
        "soon\n".to_owned(),
        "-1\n".to_owned(),
        "0\n".to_owned(),
        "0x7fffffff\n".to_owned(),
        format!("{later} {later}\n"),
        format!(" {later}\n"),
        format!("{later}.5\n"),
        format!("{later}0\n"),
        "99999999999999999999999999\n".to_owned(),
        "$(reboot)\n".to_owned(),
    ] {
        let g = garbage.as_bytes();
        assert!(
            powers_off(baked() + 60, Some(g)),
            "{garbage:?}: past the baked deadline"
        );
        assert!(!powers_off(baked() - 60, Some(g)), "{garbage:?}: before it");
    }
    let binary: &[u8] = b"\x00\xff\x01";
    assert!(powers_off(baked() + 60, Some(binary)));
}

#[test]
fn the_timer_still_fires_every_minute_and_says_the_deadline_can_move() {
    let parsed = common::parse(common::render(&samples::systemd_basics(), "vm").as_str());
    let timer = parsed.text(POWEROFF_TIMER_PATH);
    assert!(timer.contains("OnCalendar=*-*-* *:*:00\n"), "{timer}");
    assert!(timer.contains("within a minute"), "{timer}");
    let check = parsed.text(POWEROFF_CHECK_PATH);
    assert!(check.contains("within a minute"), "{check}");
}
