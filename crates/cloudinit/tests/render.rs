//! What a guest receives: files, modes, the first-boot order, snapshots and the Secret.

mod common;

use std::path::PathBuf;

use common::{FAKE_AGENT, parse, render};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use ttlab_agent::protocol::{
    BINARY_PATH, FAILED_MARKER_PATH, READY_MARKER_PATH, TOKEN_PATH, UNIT_PATH,
};
use ttlab_cloudinit::*;
use ttlab_lesson::{FileMode, LabFile, LabPath, samples};
use ttlab_model::labels::ObjectLabels;

fn snapshot(name: &str, actual: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var_os("TTLAB_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with TTLAB_BLESS=1 to create it",
            path.display()
        )
    });
    assert!(
        expected == actual,
        "{} differs from the rendered user-data; review and re-run with TTLAB_BLESS=1",
        path.display()
    );
}

/// The user-data as a reviewer reads it: every file decoded (text as is, binary as a size).
fn decoded(user_data: &str) -> String {
    let p = parse(user_data);
    let mut out = format!("hostname: {}\nruncmd: {:?}\n", p.hostname, p.runcmd);
    for f in &p.files {
        out.push_str(&format!(
            "\n=== {} ({} {})\n",
            f.path, f.owner, f.permissions
        ));
        match std::str::from_utf8(&f.content) {
            Ok(text) if !text.contains('\0') => out.push_str(text),
            _ => out.push_str(&format!("<{} bytes of binary>\n", f.content.len())),
        }
    }
    out
}

#[test]
fn snapshots_of_both_sample_lessons() {
    let kubeadm = samples::kubeadm_cluster();
    for (name, ud) in [
        (
            "systemd-basics.vm",
            render(&samples::systemd_basics(), "vm"),
        ),
        (
            "kubeadm-cluster.control-plane",
            render(&kubeadm, "control-plane"),
        ),
        ("kubeadm-cluster.worker-2", render(&kubeadm, "worker-2")),
    ] {
        snapshot(&format!("{name}.user-data"), ud.as_str());
        snapshot(&format!("{name}.decoded.txt"), &decoded(ud.as_str()));
    }
}

#[test]
fn same_input_same_bytes() {
    let lesson = samples::kubeadm_cluster();
    assert_eq!(render(&lesson, "worker-1"), render(&lesson, "worker-1"));
    assert_ne!(render(&lesson, "worker-1"), render(&lesson, "worker-2"));
}

#[test]
fn the_guest_gets_agent_token_files_and_setup() {
    let lesson = samples::systemd_basics();
    let p = parse(render(&lesson, "vm").as_str());
    assert_eq!(p.keys, TOP_LEVEL_KEYS);
    assert_eq!(p.hostname, "vm");
    assert_eq!(p.runcmd, [["/bin/sh", FIRSTBOOT_PATH]]);

    // Only the agent's digest is per VM: the binary comes from the agent disk.
    assert!(!p.files.iter().any(|f| f.path == BINARY_PATH));
    let pin = p.file(ttlab_cloudinit::AGENT_DIGEST_PATH);
    let agent = AgentPayload::new(FAKE_AGENT).unwrap();
    assert_eq!(pin.content, format!("{}\n", agent.digest()).as_bytes());
    assert!(
        p.text(FIRSTBOOT_PATH)
            .contains(&format!("blkid -L {}", ttlab_cloudinit::AGENT_VOLUME_LABEL))
    );
    let token = p.file(TOKEN_PATH);
    assert_eq!(
        (token.owner.as_str(), token.permissions.as_str()),
        ("root:root", "0600")
    );
    assert_eq!(
        token.content,
        format!("{}\n", common::token().reveal()).as_bytes()
    );
    assert!(
        p.text(UNIT_PATH)
            .contains("ExecStart=/usr/local/bin/ttlab-agent\n")
    );
    assert!(p.text(AUTOLOGIN_DROPIN_PATH).contains("--autologin root"));
    assert_eq!(
        p.file(SETUP_PATH).content,
        lesson.setup.as_deref().unwrap().as_bytes()
    );
    assert_eq!(p.file(SETUP_PATH).permissions, "0700");

    let own: Vec<&str> = p
        .files
        .iter()
        .take(OWN_PATHS.len())
        .map(|f| f.path.as_str())
        .collect();
    assert_eq!(own, OWN_PATHS);
    let lab: Vec<(String, String, Vec<u8>)> = p.files[OWN_PATHS.len()..]
        .iter()
        .map(|f| (f.path.clone(), f.permissions.clone(), f.content.clone()))
        .collect();
    let expected: Vec<(String, String, Vec<u8>)> = lesson
        .files
        .iter()
        .map(|f| {
            (
                f.path.to_string(),
                f.mode.to_octal_string(),
                f.content.clone(),
            )
        })
        .collect();
    assert_eq!(lab, expected);
}

#[test]
fn the_token_never_appears_in_clear_or_in_debug_output() {
    let ud = render(&samples::systemd_basics(), "vm");
    assert!(!ud.as_str().contains(common::token().reveal()));
    let debug = format!("{ud:?}");
    assert!(
        debug.starts_with("UserData(<") && debug.contains("redacted"),
        "{debug}"
    );
    let secret = UserDataSecret::new("s", labels(), ud).unwrap();
    assert!(!format!("{secret:?}").contains("cloud-config"));
}

#[test]
fn first_boot_arms_the_deadline_then_the_agent_then_setup_then_the_marker_last() {
    let p = parse(render(&samples::systemd_basics(), "vm").as_str());
    let script = p.text(FIRSTBOOT_PATH);
    let pos = |needle: &str| {
        script
            .find(needle)
            .unwrap_or_else(|| panic!("{needle:?} not in\n{script}"))
    };
    let order = [
        pos("systemctl enable --now ttlab-poweroff.timer"),
        pos("\nsystemctl start --no-block ttlab-poweroff.service "),
        pos("getconf GNU_LIBC_VERSION"),
        pos("systemctl enable --now ttlab-agent.service"),
        pos("timeout --kill-after=10 300 /usr/local/lib/ttlab/setup"),
        pos("mv -f \"$READY.tmp\" \"$READY\""),
    ];
    assert!(order.is_sorted(), "{order:?}");
    assert!(script.contains(&format!("READY={READY_MARKER_PATH}\n")));
    assert!(script.contains(&format!("FAILED={FAILED_MARKER_PATH}\n")));
    assert_eq!(
        script.matches(">\"$READY.tmp\"").count(),
        1,
        "one place writes the marker"
    );
    assert!(script.contains("TTLAB_NODE=vm "));
    assert!(
        !script.contains(&format!("\n{POWEROFF_CHECK_PATH}")),
        "the check runs as its unit only, never beside it"
    );

    let timer = p.text(POWEROFF_TIMER_PATH);
    assert!(
        timer.contains("OnCalendar=2026-10-16 15:15:00 UTC\n"),
        "{timer}"
    );
    assert!(timer.contains("OnCalendar=*-*-* *:*:00\n"));
    assert!(timer.contains("WantedBy=timers.target"));
    let check = p.text(POWEROFF_CHECK_PATH);
    assert!(check.contains("deadline=1792163700\n"), "{check}");
    assert_eq!(common::deadline().timestamp(), 1_792_163_700);
}

#[test]
fn a_setup_without_shebang_runs_with_sh_and_no_setup_means_no_setup_file() {
    let mut lesson = samples::systemd_basics();
    lesson.setup = Some("echo hi\n".into());
    let p = parse(render(&lesson, "vm").as_str());
    assert!(
        p.text(FIRSTBOOT_PATH)
            .contains("/bin/sh /usr/local/lib/ttlab/setup <")
    );
    lesson.setup = None;
    let p = parse(render(&lesson, "vm").as_str());
    assert!(p.files.iter().all(|f| f.path != SETUP_PATH));
    assert!(!p.text(FIRSTBOOT_PATH).contains("timeout --kill-after"));
}

#[test]
fn every_own_path_is_reserved_so_no_lesson_can_overwrite_it() {
    for path in OWN_PATHS
        .iter()
        .chain([&READY_MARKER_PATH, &FAILED_MARKER_PATH])
    {
        assert!(ttlab_lesson::is_reserved_path(path), "{path}");
        assert!(LabPath::new(*path).is_err(), "{path}");
    }
}

#[test]
fn unknown_nodes_and_pod_lessons_are_refused() {
    let lesson = samples::kubeadm_cluster();
    let agent = AgentPayload::new(FAKE_AGENT).unwrap();
    let node = "worker-9".parse().unwrap();
    let input = UserDataInput {
        lesson: &lesson,
        node: &node,
        agent: &agent,
        token: &common::token(),
        power_off_at: common::deadline(),
    };
    let err = render_user_data(&input).unwrap_err();
    assert!(matches!(err, CloudInitError::UnknownNode { .. }), "{err}");
    let mut pod = samples::systemd_basics();
    pod.runtime = ttlab_model::Runtime::Pod;
    let node = "vm".parse().unwrap();
    let err = render_user_data(&UserDataInput {
        lesson: &pod,
        node: &node,
        ..input
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "lesson `systemd-basics` runs as a pod: cloud-init is only rendered for VM lessons"
    );
    assert_eq!(
        AgentPayload::new(b"").unwrap_err(),
        CloudInitError::EmptyAgent
    );
}

fn labels() -> ObjectLabels {
    ObjectLabels::new(
        "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
        "dev".parse().unwrap(),
        "systemd-basics".parse().unwrap(),
        Some("vm".parse().unwrap()),
    )
}

#[test]
fn the_secret_carries_userdata_labels_and_owner() {
    let ud = render(&samples::systemd_basics(), "vm");
    let text = ud.as_str().to_owned();
    let secret = UserDataSecret::new("ttlab-6f1c1d2e-vm", labels(), ud).unwrap();
    assert_eq!(secret.size_bytes(), "userdata".len() + text.len());
    let owner = OwnerReference {
        api_version: "kubevirt.io/v1".into(),
        kind: "VirtualMachine".into(),
        name: "ttlab-6f1c1d2e-vm".into(),
        uid: "0b0e6b8e-1111-2222-3333-444455556666".into(),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };
    let s = secret.to_secret(Some(owner.clone()));
    assert_eq!(s.metadata.name.as_deref(), Some("ttlab-6f1c1d2e-vm"));
    assert_eq!(s.metadata.owner_references, Some(vec![owner]));
    assert_eq!(s.type_.as_deref(), Some("Opaque"));
    let data = s.data.unwrap();
    assert_eq!(data.keys().collect::<Vec<_>>(), ["userdata"]);
    assert_eq!(data["userdata"].0, text.as_bytes());
    assert!(s.string_data.is_none());
    let l = s.metadata.labels.unwrap();
    assert_eq!(l["ttlab.io/component"], "cloud-init");
    assert_eq!(ObjectLabels::from_map(&l), Some(labels()));
    assert!(secret.to_secret(None).metadata.owner_references.is_none());
    assert!(matches!(
        UserDataSecret::new(
            "Bad_Name",
            labels(),
            render(&samples::systemd_basics(), "vm")
        ),
        Err(CloudInitError::InvalidSecretName(_))
    ));
}

#[test]
fn an_oversized_lesson_fails_before_any_api_call_and_reports_its_size() {
    let mut lesson = samples::systemd_basics();
    // Incompressible bytes, so gzip cannot save it.
    let mut x: u32 = 0x1234_5678;
    let noise: Vec<u8> = (0..800 * 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect();
    lesson.files.push(LabFile {
        path: LabPath::new("/opt/lab/big.bin").unwrap(),
        mode: FileMode::DEFAULT,
        content: noise,
    });
    let ud = render(&lesson, "vm");
    let size = "userdata".len() + ud.len();
    match UserDataSecret::new("big", labels(), ud) {
        Err(e @ CloudInitError::TooLarge { .. }) => {
            assert_eq!(
                e,
                CloudInitError::TooLarge {
                    size,
                    limit: 1024 * 1024
                }
            );
            let text = e.to_string();
            assert!(
                text.contains(&size.to_string()) && text.contains("1 MiB"),
                "{text}"
            );
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

#[test]
fn large_text_files_are_compressed() {
    let mut lesson = samples::systemd_basics();
    lesson.files.push(LabFile {
        path: LabPath::new("/opt/lab/words.txt").unwrap(),
        mode: FileMode::DEFAULT,
        content: "all work and no play\n".repeat(10_000).into_bytes(),
    });
    let ud = render(&lesson, "vm");
    assert!(ud.len() < 20_000, "{}", ud.len());
    assert!(ud.as_str().contains("\"encoding\": \"gz+b64\""));
    let p = parse(ud.as_str());
    assert_eq!(p.file("/opt/lab/words.txt").content.len(), 210_000);
}

/// With the real agent (built by `cargo build -p ttlab-agent-bin --profile agent`, as shipped),
/// the per-session Secret of every node of every shipped VM lesson (`lessons/`) holds only
/// what is per session — at most 16 KiB for a single-VM lesson — while the agent travels once,
/// in its ConfigMap, well under the 1 MiB limit. Prints the measured sizes. Without that build:
/// a `SKIPPED:` line, or a failure under `CI=true` (`.ci/run` builds it).
#[test]
fn real_agent_secret_sizes() {
    // This test runs from `<target>/<profile>/deps/`; the agent profile builds into
    // `<target>/agent/`.
    let exe = std::env::current_exe().unwrap();
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test executable is in <target>/<profile>/deps/");
    let path = target.join("agent/ttlab-agent");
    let binary = match std::fs::read(&path) {
        Ok(binary) => binary,
        Err(e) => {
            return ttlab_testkit::skip_or_fail(&format!(
                "{} is unreadable ({e}), so the shipped agent's Secret sizes were not measured; \
                 build it first: cargo build --profile agent -p ttlab-agent-bin",
                path.display()
            ));
        }
    };
    let agent = AgentPayload::new(&binary).unwrap();
    let config_map = agent.config_map(&"dev".parse().unwrap());
    let config_map_json = serde_json::to_vec(&config_map).unwrap().len();
    println!(
        "agent: {} bytes, gzip {} bytes; ConfigMap {}: {} bytes of data, {} bytes as JSON",
        agent.binary_len(),
        agent.compressed_len(),
        agent.config_map_name(),
        agent.config_map_size_bytes(),
        config_map_json,
    );
    assert!(agent.config_map_size_bytes() < 1024 * 1024);
    assert!(config_map_json < 1024 * 1024);
    let shipped = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lessons");
    let lessons = ttlab_lesson::LessonSet::load(&shipped).unwrap();
    let mut measured = 0;
    for lesson in lessons
        .iter()
        .filter(|l| l.runtime == ttlab_model::Runtime::Vm)
    {
        for node in lesson.nodes.iter() {
            let ud = render_user_data(&UserDataInput {
                lesson,
                node,
                agent: &agent,
                token: &common::token(),
                power_off_at: common::deadline(),
            })
            .unwrap();
            let parsed = parse(ud.as_str());
            assert_eq!(
                parsed.text(ttlab_cloudinit::AGENT_DIGEST_PATH).trim(),
                agent.digest()
            );
            assert!(
                !parsed.files.iter().any(|f| f.path == BINARY_PATH),
                "the binary is not in the user-data"
            );
            let secret = UserDataSecret::new("s", labels(), ud).unwrap();
            println!("{}/{node}: Secret {} bytes", lesson.id, secret.size_bytes());
            if lesson.nodes.len() == 1 {
                assert!(
                    secret.size_bytes() <= 16 * 1024,
                    "{}: {} bytes",
                    lesson.id,
                    secret.size_bytes()
                );
            }
            assert!(secret.size_bytes() < 64 * 1024);
            measured += 1;
        }
    }
    assert!(
        measured >= 1,
        "no shipped VM lesson under {}",
        shipped.display()
    );
}
