//! No lesson content can change the shape of the user-data: whatever the file names, contents
//! and setup script, a YAML parser reads back exactly ttlab's files plus the lesson's, and the
//! same three top-level keys.

mod common;

use proptest::prelude::*;
use ttlab_cloudinit::{OWN_PATHS, SETUP_PATH, TOP_LEVEL_KEYS};
use ttlab_lesson::{FileMode, LabFile, LabPath, Lesson, samples};

/// Fragments that mean something to YAML, cloud-init or a shell.
const NASTY: &[&str] = &[
    "---",
    "...",
    "#cloud-config",
    "runcmd: [reboot]",
    "write_files:",
    "\"",
    "'",
    "\\",
    "{",
    "}",
    "[",
    "]",
    ": ",
    "- ",
    "&a",
    "*a",
    "!!binary",
    "|",
    ">",
    "%YAML 1.1",
    "@",
    "`",
    "$(reboot)",
    " ",
    "\t",
    "é",
    "✓",
    "😀",
    "\u{2028}",
    "\u{feff}",
    "\u{ffff}",
    "#",
    ",",
    "?",
];

fn segment() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            prop::sample::select(NASTY).prop_map(str::to_owned),
            "[a-zA-Z0-9._-]{1,6}",
            any::<char>().prop_map(String::from),
        ],
        1..4,
    )
    .prop_map(|parts| parts.concat())
}

fn lab_path() -> impl Strategy<Value = LabPath> {
    prop::collection::vec(segment(), 1..4).prop_filter_map("not a valid lab path", |segs| {
        LabPath::new(format!("/{}", segs.join("/"))).ok()
    })
}

fn content() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        prop::collection::vec(prop::sample::select(NASTY), 0..40)
            .prop_map(|parts| parts.concat().into_bytes()),
        // Long and repetitive: goes through gzip.
        (prop::sample::select(NASTY), 200usize..2000)
            .prop_map(|(s, n)| format!("{s}\n\0\u{85}").repeat(n / 4).into_bytes()),
    ]
}

fn lab_file() -> impl Strategy<Value = LabFile> {
    (lab_path(), 0u32..=0o7777, content()).prop_map(|(path, mode, content)| LabFile {
        path,
        mode: FileMode::new(mode).unwrap(),
        content,
    })
}

fn lesson() -> impl Strategy<Value = Lesson> {
    let setup = prop_oneof![
        Just(None),
        ".{1,200}".prop_map(Some),
        prop::collection::vec(prop::sample::select(NASTY), 1..30)
            .prop_map(|p| Some(format!("#!/bin/sh\n{}\0\n", p.concat()))),
    ];
    (prop::collection::vec(lab_file(), 0..8), setup).prop_map(|(files, setup)| {
        let mut lesson = samples::systemd_basics();
        let mut seen = std::collections::BTreeSet::new();
        lesson.files = files
            .into_iter()
            .filter(|f| seen.insert(f.path.clone()))
            .collect();
        lesson.setup = setup.filter(|s| !s.trim().is_empty());
        lesson
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_lessons_parse_back_to_exactly_their_files(lesson in lesson()) {
        let ud = common::render(&lesson, "vm");
        let p = common::parse(ud.as_str());
        prop_assert_eq!(&p.keys, &TOP_LEVEL_KEYS);
        prop_assert_eq!(&p.hostname, "vm");
        prop_assert_eq!(p.runcmd.len(), 1);

        let own: Vec<&str> = OWN_PATHS
            .iter()
            .copied()
            .filter(|path| *path != SETUP_PATH || lesson.setup.is_some())
            .collect();
        let got_own: Vec<&str> = p.files[..own.len()].iter().map(|f| f.path.as_str()).collect();
        prop_assert_eq!(got_own, own.clone());
        if let Some(setup) = &lesson.setup {
            prop_assert_eq!(&p.file(SETUP_PATH).content, setup.as_bytes());
        }

        let got: Vec<(String, String, String, Vec<u8>)> = p.files[own.len()..]
            .iter()
            .map(|f| (f.path.clone(), f.owner.clone(), f.permissions.clone(), f.content.clone()))
            .collect();
        let want: Vec<(String, String, String, Vec<u8>)> = lesson
            .files
            .iter()
            .map(|f| (f.path.to_string(), "root:root".to_owned(), f.mode.to_octal_string(), f.content.clone()))
            .collect();
        prop_assert_eq!(got, want);
        // Nothing a lesson wrote appears raw outside a JSON string.
        prop_assert!(ud.as_str().lines().skip(1).all(|l| !l.starts_with("---") && !l.starts_with('#')));
    }
}

#[test]
fn a_lesson_written_to_break_out_stays_inside_its_files() {
    let mut lesson = samples::systemd_basics();
    let evil = "\"\n---\n#cloud-config\nruncmd: [[reboot]]\nwrite_files: [{path: /etc/shadow}]\n\"},{\"path\":\"/x\"}]}\n";
    lesson.files = vec![LabFile {
        path: LabPath::new("/opt/\"},{\"path\": \"/etc/shadow\", \"content\": \"x\"}]}/---/#cloud-config: é😀\u{2028}").unwrap(),
        mode: FileMode::DEFAULT,
        content: [evil.as_bytes(), b"\0\xff\xfe invalid utf-8"].concat(),
    }];
    lesson.setup = Some(format!("{evil}\0"));
    let ud = common::render(&lesson, "vm");
    assert!(!ud.as_str().contains("reboot"));
    let p = common::parse(ud.as_str());
    assert_eq!(p.keys, TOP_LEVEL_KEYS);
    assert_eq!(p.files.len(), OWN_PATHS.len() + 1);
    let last = p.files.last().unwrap();
    assert_eq!(last.path, lesson.files[0].path.as_str());
    assert_eq!(last.content, lesson.files[0].content);
    assert_eq!(p.file(SETUP_PATH).content, lesson.setup.unwrap().as_bytes());
}
