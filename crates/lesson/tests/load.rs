//! Loading lessons from disk: the samples load, and every bad lesson names file, line and cause.

use std::path::{Path, PathBuf};

use ttlab_lesson::{GoldenSource, LessonError, LessonSet, VmDisk, samples};
use ttlab_model::Runtime;

fn repo_lessons() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lessons")
}

const GOOD: &str = "\
id: hello
title: Hello
runtime: vm
image: quay.io/containerdisks/debian:12
";

/// Writes `text` as `name` in a fresh directory and loads that directory.
fn load_one(name: &str, text: &str) -> Result<LessonSet, LessonError> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join(name), text).unwrap();
    LessonSet::load(dir.path())
}

/// Loads `text` and returns (file name, line, column, message) of the expected failure.
fn invalid(text: &str) -> (String, Option<usize>, Option<usize>, String) {
    match load_one("bad.yaml", text) {
        Err(LessonError::Invalid { at, message }) => (
            at.file.file_name().unwrap().to_string_lossy().into_owned(),
            at.line,
            at.column,
            message,
        ),
        other => panic!("expected an invalid-lesson error, got {other:?}"),
    }
}

#[test]
fn the_shipped_lessons_load_from_the_repository_directory() {
    let set = LessonSet::load(&repo_lessons()).unwrap();
    let ids: Vec<_> = set.ids().map(|i| i.as_str().to_owned()).collect();
    assert_eq!(ids, ["kubeadm-cluster", "shell-basics", "systemd-basics"]);

    let systemd = set.get(&"systemd-basics".parse().unwrap()).unwrap();
    assert_eq!(systemd, &samples::systemd_basics());
    assert_eq!(systemd.runtime, Runtime::Vm);
    assert_eq!(systemd.memory.bytes(), 2 << 30);
    assert_eq!(systemd.nodes.as_slice().len(), 1);
    assert_eq!(systemd.nodes.first().as_str(), "vm");
    assert!(
        matches!(&systemd.vm_disk, VmDisk::Golden(g) if g.source == GoldenSource::Pvc("golden-debian-12".into()))
    );
    assert_eq!(systemd.grading.len(), 6);
    let greeter = systemd
        .files
        .iter()
        .find(|f| f.path.as_str() == "/opt/lab/bin/greeter")
        .unwrap();
    assert_eq!(greeter.mode.bits(), 0o755);
    assert!(greeter.content.starts_with(b"#!/bin/sh\n"));

    let kubeadm = set.get(&"kubeadm-cluster".parse().unwrap()).unwrap();
    let nodes: Vec<_> = kubeadm.nodes.iter().map(|n| n.as_str()).collect();
    assert_eq!(nodes, ["control-plane", "worker-1", "worker-2"]);
    assert_eq!(kubeadm.setup_timeout.as_secs(), 900);
    assert!(
        matches!(&kubeadm.vm_disk, VmDisk::Golden(g) if g.source == GoldenSource::DataSource("ubuntu-2204".into()))
    );
    assert!(
        kubeadm
            .grading
            .iter()
            .any(|s| s.node.as_str() == "worker-2")
    );

    let at = set.source_of(&kubeadm.id).unwrap();
    assert!(at.file.ends_with("kubeadm-cluster.yaml"));
    assert_eq!(at.line, Some(3), "line of `id:`");
}

#[test]
fn a_single_file_may_hold_several_lessons() {
    let text = format!("{GOOD}---\n{}", GOOD.replace("hello", "second"));
    let set = load_one("two.yml", &text).unwrap();
    assert_eq!(set.len(), 2);
    assert_eq!(
        set.source_of(&"second".parse().unwrap()).unwrap().line,
        Some(6)
    );
}

#[test]
fn defaults_apply() {
    let set = load_one("hello.yaml", GOOD).unwrap();
    let l = set.iter().next().unwrap();
    assert_eq!(l.memory.as_str(), "4Gi");
    assert_eq!(l.cores, 1);
    assert_eq!(l.readiness_timeout.as_secs(), 150);
    assert_eq!(l.setup_timeout.as_secs(), 600);
    assert_eq!(l.vm_disk, VmDisk::Container);
    assert!(l.files.is_empty() && l.grading.is_empty() && l.setup.is_none());
}

#[test]
fn unknown_field_names_file_line_and_field() {
    let (file, line, column, msg) = invalid(&format!(
        "{GOOD}files:\n  - path: /etc/motd\n    content: hi\n    owner: root\n"
    ));
    assert_eq!(file, "bad.yaml");
    assert_eq!((line, column), (Some(8), Some(5)));
    assert!(msg.contains("unknown field `owner`"), "{msg}");
    // At the top level too.
    let (_, line, _, msg) = invalid(&format!("{GOOD}memroy: 2Gi\n"));
    assert_eq!(line, Some(5));
    assert!(msg.contains("unknown field `memroy`"), "{msg}");
}

#[test]
fn missing_image_is_refused() {
    let (_, line, _, msg) = invalid("id: hello\ntitle: Hello\nruntime: vm\n");
    assert_eq!(line, Some(1));
    assert!(msg.contains("missing field `image`"), "{msg}");
    let (_, _, _, msg) = invalid(&GOOD.replace("quay.io/containerdisks/debian:12", "\"\""));
    assert!(msg.contains("`image` is empty"), "{msg}");
}

#[test]
fn relative_and_climbing_paths_are_refused_at_their_line() {
    let (_, line, column, msg) = invalid(&format!(
        "{GOOD}files:\n  - path: etc/motd\n    content: hi\n"
    ));
    assert_eq!((line, column), (Some(6), Some(11)));
    assert!(msg.contains("relative"), "{msg}");
    assert!(msg.contains("files[0].path"), "{msg}");
    let (_, line, _, msg) = invalid(&format!(
        "{GOOD}files:\n  - path: /opt/a\n    content: a\n  - path: /opt/lab/../../etc/shadow\n    content: hi\n"
    ));
    assert_eq!(line, Some(8));
    assert!(msg.contains("`..`"), "{msg}");
}

#[test]
fn duplicate_node_names_are_refused() {
    let (_, line, _, msg) = invalid(&format!("{GOOD}nodes: [control-plane, worker, worker]\n"));
    assert_eq!(line, Some(5));
    assert!(msg.contains("duplicate node name `worker`"), "{msg}");
    let (_, _, _, msg) = invalid(&format!("{GOOD}nodes: [Worker]\n"));
    assert!(msg.contains("node name"), "{msg}");
}

#[test]
fn unparsable_memory_is_refused() {
    for (mem, why) in [
        ("4GB", "unknown unit"),
        ("lots", "expected a number"),
        ("64Mi", "at least 128Mi"),
        ("2.5", "unit"),
    ] {
        let (_, line, column, msg) = invalid(&format!("{GOOD}memory: {mem}\n"));
        assert_eq!((line, column), (Some(5), Some(9)), "{mem}");
        assert!(msg.contains("memory") && msg.contains(why), "{mem}: {msg}");
    }
}

#[test]
fn duplicate_lesson_ids_across_files_name_both_places() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), GOOD).unwrap();
    std::fs::write(dir.path().join("b.yml"), format!("# another\n{GOOD}")).unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not a lesson").unwrap();
    match LessonSet::load(dir.path()) {
        Err(e @ LessonError::DuplicateId { .. }) => {
            let LessonError::DuplicateId { id, at, first } = &e else {
                unreachable!()
            };
            assert_eq!(id.as_str(), "hello");
            assert!(at.file.ends_with("b.yml") && at.line == Some(2), "{at}");
            assert!(
                first.file.ends_with("a.yaml") && first.line == Some(1),
                "{first}"
            );
            let text = e.to_string();
            assert!(
                text.contains("b.yml:2:1: duplicate lesson id `hello`"),
                "{text}"
            );
            assert!(text.contains("a.yaml:1:1"), "{text}");
        }
        other => panic!("expected a duplicate id, got {other:?}"),
    }
}

#[test]
fn cross_field_mistakes_are_explained() {
    for (extra, why) in [
        ("vm_disk: golden\n", "needs a `golden` section"),
        (
            "vm_disk: container\ngolden: {pvc: g}\n",
            "`vm_disk` is `container`",
        ),
        ("golden: {pvc: g, data_source: d}\n", "exactly one of `pvc`"),
        (
            "golden: {pvc: Golden_Disk}\n",
            "not a valid Kubernetes object name",
        ),
        ("cores: 0\n", "`cores` is 0"),
        ("setup_timeout_seconds: 0\n", "at least 1"),
        (
            "files:\n  - {path: /a, content: x}\n  - {path: /a, content: y}\n",
            "appears twice",
        ),
        ("files:\n  - {path: /a}\n", "missing `content`"),
        (
            "files:\n  - {path: /a, content: x, content_base64: eA==}\n",
            "not both",
        ),
        (
            "files:\n  - {path: /a, content_base64: '***'}\n",
            "not valid base64",
        ),
        ("files:\n  - {path: /a, content: x, mode: 644}\n", "quoted"),
        (
            "files:\n  - {path: /etc/ttlab/agent.token, content: x}\n",
            "reserved",
        ),
        (
            "grading:\n  - {name: a, command: 'true', node: worker}\n",
            "not one of the lesson's nodes",
        ),
        (
            "grading:\n  - {name: a, command: 'true'}\n  - {name: a, command: 'false'}\n",
            "duplicate step name",
        ),
        (
            "grading:\n  - {name: a, command: 'true', expect_exit: 300}\n",
            "exit codes are 0 to 255",
        ),
        ("runtime: pod\n", "duplicate field"),
    ] {
        let (_, line, _, msg) = invalid(&format!("{GOOD}{extra}"));
        assert!(line.is_some(), "{extra}: no line in {msg}");
        assert!(msg.contains(why), "{extra}: {msg}");
    }
    let (_, _, _, msg) = invalid(&GOOD.replace("runtime: vm", "runtime: pod\nnodes: [a, b]"));
    assert!(msg.contains("exactly one node"), "{msg}");
    let (_, _, _, msg) = invalid(&GOOD.replace("runtime: vm", "runtime: kvm"));
    assert!(msg.contains("unknown variant `kvm`"), "{msg}");
}

#[test]
fn binary_content_round_trips_through_base64() {
    let set = load_one("bin.yaml", &format!("{GOOD}files:\n  - path: /opt/blob\n    mode: '0600'\n    content_base64: |\n      AAEC\n      /w==\n")).unwrap();
    let f = &set.iter().next().unwrap().files[0];
    assert_eq!(f.content, [0, 1, 2, 0xff]);
    assert_eq!(f.mode.bits(), 0o600);
}

#[test]
fn empty_and_unreadable_sources_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(matches!(
        LessonSet::load(dir.path()),
        Err(LessonError::Empty { .. })
    ));
    let err = LessonSet::load(&dir.path().join("missing.yaml")).unwrap_err();
    assert!(matches!(err, LessonError::Io { .. }));
    assert!(err.to_string().contains("missing.yaml"), "{err}");
    let (_, line, _, msg) = invalid("id: [unclosed\n");
    assert!(line.is_some(), "{msg}");
}

#[test]
fn the_shipped_lessons_carry_instructions_that_name_the_page_s_button() {
    let set = LessonSet::load(&repo_lessons()).unwrap();
    for lesson in set.iter() {
        let instructions = lesson
            .instructions
            .as_ref()
            .unwrap_or_else(|| panic!("{} has no instructions", lesson.id));
        let html = instructions.html();
        assert!(html.contains("Check my work"), "{}: {html}", lesson.id);
        // The page's button is "Check my work": no file or instruction names another one.
        assert!(
            !instructions.markdown().contains("\"Grade\""),
            "{}",
            lesson.id
        );
        for file in &lesson.files {
            let text = String::from_utf8_lossy(&file.content);
            assert!(
                !text.contains("\"Grade\""),
                "{}: {:?}",
                lesson.id,
                file.path
            );
        }
    }
}

#[test]
fn instructions_are_markdown_with_html_escaped_and_blank_ones_are_refused() {
    let set = load_one(
        "ok.yaml",
        &format!("{GOOD}instructions: |\n  # Do it\n  Run `ls` <script>alert(1)</script>\n"),
    )
    .unwrap();
    let html = set
        .iter()
        .next()
        .unwrap()
        .instructions
        .as_ref()
        .unwrap()
        .html();
    assert_eq!(
        html,
        "<h2>Do it</h2>\n<p>Run <code>ls</code> &lt;script&gt;alert(1)&lt;/script&gt;</p>\n"
    );
    let (file, _, _, message) = invalid(&format!("{GOOD}instructions: \"  \"\n"));
    assert_eq!(file, "bad.yaml");
    assert!(message.contains("`instructions` is empty"), "{message}");
}

#[test]
fn a_pool_section_is_read_for_single_and_multi_vm_lessons() {
    let set = LessonSet::load(&repo_lessons()).unwrap();
    assert!(
        set.iter().all(|l| l.pool.is_none()),
        "no shipped lesson has a pool"
    );
    assert!(
        load_one("hello.yaml", GOOD)
            .unwrap()
            .iter()
            .next()
            .unwrap()
            .pool
            .is_none()
    );

    let text = format!(
        "{GOOD}pool:\n  size: 4\n  min: 1\n  max: 8\n  max_age_minutes: 120\n  demand: true\n  paused: true\n"
    );
    let set = load_one("pooled.yaml", &text).unwrap();
    let pool = set.iter().next().unwrap().pool.unwrap();
    assert_eq!((pool.min, pool.size, pool.max), (1, 4, 8));
    assert_eq!(pool.max_age.as_secs(), 120 * 60);
    assert!(pool.demand && pool.paused);

    // A member of a multi-VM lesson is the whole set of nodes: the section is the same.
    let text = format!("{GOOD}nodes: [control-plane, worker-1, worker-2]\npool:\n  size: 2\n");
    let set = load_one("cluster.yaml", &text).unwrap();
    let lesson = set.iter().next().unwrap();
    assert_eq!(lesson.nodes.len(), 3);
    let pool = lesson.pool.unwrap();
    assert_eq!((pool.min, pool.size, pool.max), (0, 2, 2));
    assert_eq!(pool.max_age.as_secs(), 240 * 60);
    assert!(!pool.demand && !pool.paused);
}

#[test]
fn a_bad_pool_section_is_refused_at_its_line_naming_the_field() {
    let (file, line, column, msg) = invalid(&format!("{GOOD}pool:\n  size: 4\n  max: 3\n"));
    assert_eq!(file, "bad.yaml");
    assert_eq!((line, column), (Some(6), Some(3)));
    assert!(
        msg.contains("`pool.size` (4) is above `pool.max` (3): the rule is min <= size <= max"),
        "{msg}"
    );
    let (_, line, column, msg) = invalid(&format!("{GOOD}pool:\n  size: 4\n  warm: yes\n"));
    assert_eq!((line, column), (Some(7), Some(3)));
    assert!(msg.contains("unknown field `warm`"), "{msg}");
    for (pool, why) in [
        ("{size: 60}", "`pool.size` is 60; the most allowed is 50"),
        (
            "{size: 2, max: 80, demand: true}",
            "`pool.max` is 80; the most allowed is 50",
        ),
        (
            "{size: 2, min: 3, max: 4}",
            "`pool.min` (3) is above `pool.size` (2)",
        ),
        (
            "{size: 2, max_age_minutes: 5}",
            "`pool.max_age_minutes` is 5; it must be from 10 to 1440",
        ),
        ("{size: 0}", "`pool.size` is 0 and `pool.demand` is false"),
        ("{max: 4}", "missing field `size`"),
        ("[4]", "a pool (a mapping)"),
    ] {
        let (_, line, _, msg) = invalid(&format!("{GOOD}pool: {pool}\n"));
        assert_eq!(line, Some(5), "{pool}");
        assert!(msg.contains(why), "{pool}: {msg}");
    }
}

#[test]
fn a_pod_lesson_may_not_have_a_pool() {
    let text = GOOD.replace("runtime: vm", "runtime: pod") + "pool:\n  size: 2\n";
    let (_, line, _, msg) = invalid(&text);
    assert_eq!(line, Some(1));
    assert!(
        msg.contains("lesson `hello`: `pool` only applies to `runtime: vm` lessons"),
        "{msg}"
    );
}

#[test]
fn a_vm_lesson_may_require_site_labels_and_a_bad_or_pod_one_is_refused() {
    let lesson = ttlab_lesson::parse_lesson(&format!("{GOOD}site_labels: [kvm-large, eu]\n"))
        .expect("a lesson with site labels");
    let labels: Vec<&str> = lesson.site_labels.iter().map(|l| l.as_str()).collect();
    assert_eq!(labels, ["eu", "kvm-large"]);
    assert!(
        ttlab_lesson::parse_lesson(GOOD)
            .unwrap()
            .site_labels
            .is_empty(),
        "no labels: any site"
    );

    let (_, line, _, msg) = invalid(&format!("{GOOD}site_labels: [KVM_Large]\n"));
    assert_eq!(line, Some(5));
    assert!(msg.contains("site label"), "{msg}");

    let text = GOOD.replace("runtime: vm", "runtime: pod") + "site_labels: [eu]\n";
    let (_, _, _, msg) = invalid(&text);
    assert!(
        msg.contains("`site_labels` only applies to `runtime: vm` lessons"),
        "{msg}"
    );
}
