//! Lab files cannot escape where the lesson says they go, nor replace what ttlab writes.
//!
//! What the renderer guarantees (the rest of the analysis is in docs/threat-model.md):
//! - every `write_files` entry has exactly `path`, `owner`, `permissions`, `encoding`,
//!   `content`: no `append`, no `defer`, nothing cloud-init could turn into a link; cloud-init's
//!   `write_files` only ever creates regular files (and their parent directories);
//! - ttlab's own files come first, the lesson's after them, each at exactly the validated path:
//!   absolute, no `.`, `..` or empty component, so the path written is the path checked;
//! - no lesson file can name one of ttlab's own files or directories (the agent, its unit and
//!   token, the readiness and failure markers, the first-boot and setup scripts);
//! - the setup script (the first lesson code that runs) is started by `runcmd` in cloud-init's
//!   final stage, after `write_files` ran in the init stage, so a symlink it creates cannot
//!   redirect a lab file: by then every file is written.

mod common;

use ttlab_agent::protocol::{FAILED_MARKER_PATH, READY_MARKER_PATH};
use ttlab_cloudinit::{FIRSTBOOT_PATH, OWN_PATHS, SETUP_LOG_PATH, TOP_LEVEL_KEYS};
use ttlab_lesson::{FileMode, LabFile, LabPath, samples};

#[test]
fn no_lesson_file_can_name_ttlabs_own_files_or_their_directories() {
    let mut refused: Vec<String> = OWN_PATHS.iter().map(|p| (*p).to_owned()).collect();
    refused.extend([
        READY_MARKER_PATH.to_owned(),
        FAILED_MARKER_PATH.to_owned(),
        format!("{READY_MARKER_PATH}.tmp"),
        "/etc/ttlab".to_owned(),
        "/var/lib/ttlab".to_owned(),
        "/usr/local/lib/ttlab".to_owned(),
        // A drop-in or a replacement of the agent's or the power-off timer's units.
        "/etc/systemd/system/ttlab-agent.service.d/override.conf".to_owned(),
        "/etc/systemd/system/ttlab-poweroff.timer.d/never.conf".to_owned(),
        // Climbing or hiding, which a link-free path walk would have to resolve.
        "/opt/lab/../../etc/ttlab/agent.token".to_owned(),
        "/etc/./ttlab/agent.token".to_owned(),
        "/etc//ttlab/agent.token".to_owned(),
        "etc/ttlab/agent.token".to_owned(),
        "/opt/lab/".to_owned(),
    ]);
    for path in &refused {
        assert!(
            LabPath::new(path.as_str()).is_err(),
            "{path} is accepted as a lab file path"
        );
    }
    // The setup log is the lesson's own business (the setup script writes it anyway).
    assert!(LabPath::new(SETUP_LOG_PATH).is_ok());
}

#[test]
fn lab_files_are_written_after_ttlabs_own_exactly_where_validated_and_as_plain_files() {
    let mut lesson = samples::systemd_basics();
    let paths = [
        "/usr/local/lib/ttlab-notes",
        "/etc/systemd/system/lab.service",
        "/usr/local/bin/check",
        "/opt/lab/a b/\u{e9}\u{1f600}.txt",
        "/var/lib/ttlab-like/file",
        "/root/.bashrc",
    ];
    lesson.files = paths
        .iter()
        .map(|p| LabFile {
            path: LabPath::new(*p).unwrap(),
            mode: FileMode::new(0o4755).unwrap(),
            content: format!("content of {p}\n").into_bytes(),
        })
        .collect();
    lesson.setup = Some("#!/bin/sh\nln -s /etc/ttlab /opt/lab/link\n".to_owned());
    let ud = common::render(&lesson, "vm");
    let parsed = common::parse(ud.as_str());
    assert_eq!(parsed.keys, TOP_LEVEL_KEYS);
    // The entry shape (path, owner, permissions, encoding, content, nothing else) is asserted
    // by `common::parse` for every entry.
    let got: Vec<&str> = parsed.files.iter().map(|f| f.path.as_str()).collect();
    let own = &got[..OWN_PATHS.len()];
    assert_eq!(own, OWN_PATHS);
    assert_eq!(&got[OWN_PATHS.len()..], paths);
    for f in &parsed.files[OWN_PATHS.len()..] {
        assert_eq!(f.owner, "root:root");
        assert_eq!(f.content, format!("content of {}\n", f.path).into_bytes());
        assert_eq!(f.permissions, "4755");
    }
    // Every path appears once: a later entry can never overwrite an earlier one.
    let mut unique = got.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), got.len());
    // Lesson code runs only from runcmd (cloud-init's final stage), through the first-boot
    // script, after every file above is written.
    assert_eq!(
        parsed.runcmd,
        [vec!["/bin/sh".to_owned(), FIRSTBOOT_PATH.to_owned()]]
    );
    let firstboot = parsed.text(FIRSTBOOT_PATH);
    let setup_at = firstboot.find("/usr/local/lib/ttlab/setup").unwrap();
    let ready_at = firstboot.rfind("$READY.tmp").unwrap();
    assert!(
        setup_at < ready_at,
        "the readiness marker is written after the setup"
    );
}
