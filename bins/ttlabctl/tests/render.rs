//! `ttlabctl render` end to end: the real binary, the shipped sample lessons, every simulated
//! golden-disk state, and the errors an operator can cause.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use chrono::SubsecRound as _;
use serde::Deserialize as _;
use serde_json::Value;

const SESSION: &str = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a";
const CASES: [&str; 7] = [
    "ready",
    "missing",
    "importing",
    "deleting",
    "rwo",
    "wrong-image",
    "forbidden",
];

fn lessons_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lessons")
}

/// A stand-in agent binary: its bytes only travel inside the user-data.
fn fake_agent(dir: &tempfile::TempDir) -> PathBuf {
    let path = dir.path().join("ttlab-agent");
    let bytes: Vec<u8> = (0..64 * 1024u32).map(|i| (i * 7919 % 251) as u8).collect();
    std::fs::write(&path, bytes).unwrap();
    path
}

fn ttlabctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ttlabctl"))
        .args(args)
        .env_remove("TTLAB_LESSONS")
        .env_remove("TTLAB_NAMESPACE")
        .env_remove("TTLAB_AGENT_BINARY")
        .env_remove("TTLAB_SESSION_TTL")
        .env_remove("TTLAB_SESSION_MAX")
        .env_remove("TTLAB_MAX_EXTENSIONS")
        .env_remove("TTLAB_EXTEND_WINDOW")
        .env_remove("TTLAB_HARD_DEADLINE_GRACE")
        .output()
        .expect("ttlabctl runs")
}

/// A session start far enough ahead that its deadline is not past for decades: fixed, so the
/// output is the same from run to run.
const FIXED_NOW: &str = "2090-01-01T00:00:00Z";

fn render(lesson: &str, golden: &str, agent: &Path) -> String {
    let lessons = lessons_dir();
    let out = ttlabctl(&[
        "render",
        "--now",
        FIXED_NOW,
        "--lesson",
        lesson,
        "--lessons",
        lessons.to_str().unwrap(),
        "--session-id",
        SESSION,
        "--env",
        "dev",
        "--namespace",
        "labs",
        "--golden",
        golden,
        "--agent-binary",
        agent.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{lesson} --golden {golden}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The documents of a YAML stream, each with the comment lines heading it.
fn documents(stream: &str) -> Vec<(Vec<String>, Value)> {
    let comments: Vec<Vec<String>> = stream
        .split("\n---\n")
        .skip(1)
        .map(|doc| {
            doc.lines()
                .take_while(|l| l.starts_with('#'))
                .map(str::to_owned)
                .collect()
        })
        .collect();
    let values: Vec<Value> = serde_norway::Deserializer::from_str(stream)
        .map(|d| Value::deserialize(d).expect("valid YAML document"))
        .filter(|v| !v.is_null())
        .collect();
    assert_eq!(
        comments.len(),
        values.len(),
        "one comment block per document"
    );
    comments.into_iter().zip(values).collect()
}

#[test]
fn both_sample_lessons_render_for_every_golden_state() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    for (lesson, nodes) in [
        ("systemd-basics", vec!["vm"]),
        (
            "kubeadm-cluster",
            vec!["control-plane", "worker-1", "worker-2"],
        ),
    ] {
        for case in CASES {
            let stream = render(lesson, case, &agent);
            let docs = documents(&stream);
            // First the agent's shared ConfigMap, then the session's objects.
            let (agent_doc, docs) = docs.split_first().expect("documents");
            assert_eq!(agent_doc.1["kind"], "ConfigMap", "{lesson} {case}");
            assert_eq!(agent_doc.1["immutable"], true);
            assert_eq!(agent_doc.1["metadata"]["namespace"], "labs");
            let docs = docs.to_vec();
            let kinds: Vec<&str> = docs
                .iter()
                .map(|(_, v)| v["kind"].as_str().unwrap())
                .collect();
            let mut want = Vec::new();
            for _ in &nodes {
                want.extend(["Secret", "VirtualMachine"]);
            }
            if nodes.len() > 1 {
                want.extend(["Service", "NetworkPolicy"]);
            }
            assert_eq!(kinds, want, "{lesson} {case}");

            let reason = match case {
                "ready" => "ready",
                "missing" => "not_found",
                "importing" => "importing",
                "deleting" => "deleting",
                "rwo" => "single_node",
                "wrong-image" => "wrong_image",
                "forbidden" => "forbidden",
                _ => unreachable!(),
            };
            for (comments, doc) in &docs {
                let line = comments
                    .iter()
                    .find(|l| l.starts_with("# disk: "))
                    .unwrap_or_else(|| panic!("{lesson} {case}: no disk line in {comments:?}"));
                assert!(line.contains(&format!("reason: {reason};")), "{line}");
                assert!(line.contains(" bytes"), "size given: {line}");
                assert_eq!(doc["metadata"]["namespace"], "labs");
                assert_eq!(doc["metadata"]["labels"]["ttlab.io/session"], SESSION);
                assert_eq!(doc["metadata"]["labels"]["ttlab.io/env"], "dev");
            }
            for (i, node) in nodes.iter().enumerate() {
                let secret = &docs[2 * i].1;
                let vm = &docs[2 * i + 1].1;
                let name = format!("tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-{node}");
                assert_eq!(vm["metadata"]["name"], Value::String(name.clone()));
                assert_eq!(
                    secret["metadata"]["name"],
                    Value::String(format!("{name}-ci"))
                );
                let user_data = secret["stringData"]["userdata"].as_str().unwrap();
                assert!(
                    user_data.starts_with("#cloud-config\n{"),
                    "readable userdata"
                );
                assert!(secret.get("data").is_none());
                let spec = &vm["spec"]["template"]["spec"];
                assert_eq!(
                    spec["volumes"][1]["cloudInitNoCloud"]["secretRef"]["name"],
                    Value::String(format!("{name}-ci"))
                );
                let root = &spec["volumes"][0];
                if case == "ready" {
                    assert_eq!(root["ephemeral"]["persistentVolumeClaim"]["readOnly"], true);
                } else {
                    assert!(
                        root["containerDisk"]["image"].is_string(),
                        "{lesson} {case}: {root}"
                    );
                }
            }
        }
    }
}

#[test]
fn output_is_deterministic_and_carries_only_the_placeholder_token() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    let a = render("systemd-basics", "ready", &agent);
    let b = render("systemd-basics", "ready", &agent);
    assert_eq!(a, b);
    assert!(
        a.contains(&format!("#   | {}", "0".repeat(64))),
        "token shown as the zero placeholder"
    );
    assert!(
        a.contains("hard-deadline power-off at 2090-01-01T03:15:00Z"),
        "from the fixed --now"
    );
}

/// The `hard-deadline power-off at …` instant in a rendered stream's header.
fn rendered_deadline(stream: &str) -> chrono::DateTime<chrono::Utc> {
    let at = stream
        .split("hard-deadline power-off at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no deadline in the header:\n{}", &stream[..400]));
    at.parse().unwrap()
}

fn render_args(agent: &Path, extra: &[&str]) -> Output {
    let lessons = lessons_dir();
    let mut args = vec![
        "render",
        "--lesson",
        "systemd-basics",
        "--lessons",
        lessons.to_str().unwrap(),
        "--session-id",
        SESSION,
        "--env",
        "dev",
        "--agent-binary",
        agent.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    ttlabctl(&args)
}

#[test]
fn without_now_the_session_starts_at_the_present() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    let before = chrono::Utc::now();
    let out = render_args(&agent, &[]);
    let after = chrono::Utc::now();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = rendered_deadline(&String::from_utf8(out.stdout).unwrap());
    // The default policy: 180 min of lifetime at most, plus 15 min of grace.
    let span = chrono::Duration::minutes(195);
    assert!(
        deadline >= (before + span).trunc_subsecs(0) && deadline <= after + span,
        "deadline {deadline} is not 195 min after the present ({before} .. {after})"
    );
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("warning"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_deadline_already_past_is_refused_unless_allowed_and_then_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    let out = render_args(&agent, &["--now", "2026-01-01T00:00:00Z"]);
    assert!(!out.status.success());
    assert!(out.stdout.is_empty(), "nothing rendered");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the hard-deadline power-off (2026-01-01T03:15:00Z, from --now 2026-01-01T00:00:00Z) is already past")
            && stderr.contains("--allow-past-deadline"),
        "{stderr}"
    );

    let out = render_args(
        &agent,
        &["--now", "2026-01-01T00:00:00Z", "--allow-past-deadline"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(
            "warning: the hard-deadline power-off (2026-01-01T03:15:00Z) is already past"
        ),
        "{stderr}"
    );
    assert_eq!(
        rendered_deadline(&String::from_utf8(out.stdout).unwrap()),
        "2026-01-01T03:15:00Z"
            .parse::<chrono::DateTime<chrono::Utc>>()
            .unwrap()
    );
}

#[test]
fn bad_input_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    let lessons = lessons_dir();
    let base = |lesson: &str, session: &str, agent: &str| {
        ttlabctl(&[
            "render",
            "--now",
            FIXED_NOW,
            "--lesson",
            lesson,
            "--lessons",
            lessons.to_str().unwrap(),
            "--session-id",
            session,
            "--env",
            "dev",
            "--agent-binary",
            agent,
        ])
    };
    let agent = agent.to_str().unwrap();
    let cases = [
        (
            base("no-such-lesson", SESSION, agent),
            "unknown lesson `no-such-lesson`",
        ),
        (base("systemd-basics", "not-a-uuid", agent), "--session-id"),
        (base("Bad_Id", SESSION, agent), "--lesson"),
        (
            base("systemd-basics", SESSION, "/nonexistent/ttlab-agent"),
            "cannot read the agent binary /nonexistent/ttlab-agent",
        ),
        (
            ttlabctl(&[
                "render",
                "--lesson",
                "systemd-basics",
                "--lessons",
                "/nonexistent",
                "--session-id",
                SESSION,
                "--env",
                "dev",
                "--agent-binary",
                agent,
            ]),
            "cannot load lessons from /nonexistent",
        ),
        (
            ttlabctl(&[
                "render",
                "--lesson",
                "systemd-basics",
                "--lessons",
                lessons.to_str().unwrap(),
                "--session-id",
                SESSION,
                "--env",
                "dev",
                "--golden",
                "sometimes",
                "--agent-binary",
                agent,
            ]),
            "--golden",
        ),
    ];
    for (out, want) in cases {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{want}: must fail");
        assert!(out.stdout.is_empty(), "{want}: nothing on stdout");
        assert!(
            stderr.contains(want),
            "stderr {stderr:?} should mention {want:?}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

#[test]
fn the_header_says_what_a_session_really_costs_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    for (lesson, per_vm, vm_line, session) in [
        (
            "systemd-basics",
            "memory per VM (KubeVirt v1.9): guest 2Gi + KubeVirt's overhead 292Mi = 2340Mi \
             requested by the launcher pod's compute container, + 35M for its serial-console log \
             sidecar = 2488667840 bytes (2373.4 MiB) counted by requests.memory quotas and the nodes",
            "memory: guest 2Gi + KubeVirt's overhead 292Mi = launcher pod request 2340Mi \
             (2488667840 bytes (2373.4 MiB) with the console log's sidecar)",
            "memory of a session: 1 VM × 2488667840 bytes = 2488667840 bytes (2.32 GiB) of \
             requests.memory",
        ),
        (
            "kubeadm-cluster",
            "memory per VM (KubeVirt v1.9): guest 4Gi + KubeVirt's overhead 318767105 bytes \
             (304.0 MiB) = 4613734401 bytes (4400.0 MiB) requested by the launcher pod's compute \
             container, + 35M for its serial-console log sidecar = 4648734401 bytes (4433.4 MiB) \
             counted by requests.memory quotas and the nodes",
            "memory: guest 4Gi + KubeVirt's overhead 318767105 bytes (304.0 MiB) = launcher pod \
             request 4613734401 bytes (4400.0 MiB) (4648734401 bytes (4433.4 MiB) with the \
             console log's sidecar)",
            "memory of a session: 3 VMs × 4648734401 bytes = 13946203203 bytes (12.99 GiB) of \
             requests.memory",
        ),
    ] {
        for case in ["ready", "missing"] {
            let stream = render(lesson, case, &agent);
            let header: Vec<&str> = stream.lines().take_while(|l| *l != "---").collect();
            assert!(
                header.contains(&format!("# {per_vm}").as_str()),
                "{lesson}: {header:#?}"
            );
            assert!(
                header.contains(&format!("# {session}").as_str()),
                "{lesson}: {header:#?}"
            );
            // Every VirtualMachine's comments say it too; the stream stays plain YAML.
            let vms: Vec<_> = documents(&stream)
                .into_iter()
                .filter(|(_, doc)| doc["kind"] == "VirtualMachine")
                .collect();
            assert!(!vms.is_empty());
            for (comments, _) in vms {
                assert!(
                    comments.contains(&format!("# {vm_line}")),
                    "{lesson}: {comments:#?}"
                );
            }
        }
    }
}

/// The power-off instant the rendered user-data of the stream's first Secret arms: the Unix
/// time in the power-off check and the timer's `OnCalendar`, which must agree.
fn user_data_power_off(stream: &str) -> chrono::DateTime<chrono::Utc> {
    use base64::Engine as _;
    let (_, secret) = documents(stream)
        .into_iter()
        .find(|(_, d)| d["kind"] == "Secret")
        .expect("a Secret");
    let user_data = secret["stringData"]["userdata"].as_str().unwrap();
    let config: Value =
        serde_json::from_str(user_data.strip_prefix("#cloud-config\n").unwrap()).unwrap();
    let file = |path: &str| -> String {
        let f = config["write_files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["path"] == path)
            .unwrap_or_else(|| panic!("no {path} in the user-data"));
        let raw = base64::engine::general_purpose::STANDARD
            .decode(f["content"].as_str().unwrap())
            .unwrap();
        let mut text = String::new();
        match f["encoding"].as_str() {
            Some("b64") => text = String::from_utf8(raw).unwrap(),
            Some("gz+b64") => {
                std::io::Read::read_to_string(
                    &mut flate2::read::GzDecoder::new(raw.as_slice()),
                    &mut text,
                )
                .unwrap();
            }
            other => panic!("encoding {other:?} of {path}"),
        }
        text
    };
    let check = file(ttlab_cloudinit::POWEROFF_CHECK_PATH);
    let unix: i64 = check
        .lines()
        .find_map(|l| l.strip_prefix("deadline="))
        .expect("the deadline in the power-off check")
        .parse()
        .unwrap();
    let at = chrono::DateTime::from_timestamp(unix, 0).unwrap();
    let timer = file(ttlab_cloudinit::POWEROFF_TIMER_PATH);
    assert!(
        timer.contains(&format!(
            "OnCalendar={}",
            at.format("%Y-%m-%d %H:%M:%S UTC")
        )),
        "{timer}"
    );
    at
}

#[test]
fn the_guest_power_off_follows_the_hard_deadline_grace_setting() {
    let dir = tempfile::tempdir().unwrap();
    let agent = fake_agent(&dir);
    let at = |text: &str| text.parse::<chrono::DateTime<chrono::Utc>>().unwrap();
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let lessons = lessons_dir();
        let mut args = vec![
            "render",
            "--now",
            FIXED_NOW,
            "--lesson",
            "systemd-basics",
            "--lessons",
            lessons.to_str().unwrap(),
            "--session-id",
            SESSION,
            "--env",
            "dev",
            "--agent-binary",
            agent.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let mut command = Command::new(env!("CARGO_BIN_EXE_ttlabctl"));
        command
            .args(&args)
            .env_remove("TTLAB_LESSONS")
            .env_remove("TTLAB_SESSION_TTL")
            .env_remove("TTLAB_SESSION_MAX")
            .env_remove("TTLAB_MAX_EXTENSIONS")
            .env_remove("TTLAB_EXTEND_WINDOW")
            .env_remove("TTLAB_HARD_DEADLINE_GRACE");
        for (k, v) in env {
            command.env(k, v);
        }
        command.output().expect("ttlabctl runs")
    };
    let stream = |out: Output| {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };

    // The default: 180 minutes of lifetime and 15 of grace.
    let default = stream(run(&[], &[]));
    assert_eq!(user_data_power_off(&default), at("2090-01-01T03:15:00Z"));
    assert_eq!(rendered_deadline(&default), at("2090-01-01T03:15:00Z"));
    // The server's setting, from the environment as the Deployment gives it, or the flag.
    for out in [
        run(&[], &[("TTLAB_HARD_DEADLINE_GRACE", "5m")]),
        run(&["--hard-deadline-grace", "5m"], &[]),
    ] {
        let s = stream(out);
        assert_eq!(user_data_power_off(&s), at("2090-01-01T03:05:00Z"));
        assert_eq!(rendered_deadline(&s), at("2090-01-01T03:05:00Z"));
    }
    // With the maximum lifetime too.
    let s = stream(run(
        &[],
        &[
            ("TTLAB_SESSION_MAX", "2h"),
            ("TTLAB_HARD_DEADLINE_GRACE", "90s"),
        ],
    ));
    assert_eq!(user_data_power_off(&s), at("2090-01-01T02:01:30Z"));

    // A setting the server refuses is refused here too, naming it.
    for (env, named) in [
        (
            ("TTLAB_HARD_DEADLINE_GRACE", "0s"),
            "TTLAB_HARD_DEADLINE_GRACE",
        ),
        (
            ("TTLAB_HARD_DEADLINE_GRACE", "soon"),
            "TTLAB_HARD_DEADLINE_GRACE",
        ),
        (("TTLAB_EXTEND_WINDOW", "0s"), "TTLAB_EXTEND_WINDOW"),
        (("TTLAB_MAX_EXTENSIONS", "many"), "TTLAB_MAX_EXTENSIONS"),
    ] {
        let out = run(&[], &[env]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{env:?} accepted");
        assert!(out.stdout.is_empty());
        assert!(
            stderr.contains("invalid session time settings") && stderr.contains(named),
            "{env:?}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
