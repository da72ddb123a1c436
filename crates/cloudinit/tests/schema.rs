//! The rendered user-data checked by cloud-init itself (`cloud-init schema`) and read back by
//! PyYAML, the parser cloud-init uses (Debian: `apt-get install cloud-init python3-yaml`).
//! Where a tool is missing the check prints a `SKIPPED:` line, or fails under `CI=true`
//! (`.ci/run` installs both).

mod common;

use std::path::Path;
use std::process::Command;

use ttlab_cloudinit::UserData;
use ttlab_lesson::{FileMode, LabFile, LabPath, samples};

fn all_user_data() -> Vec<(String, UserData)> {
    let mut out = vec![(
        "systemd-basics/vm".to_owned(),
        common::render(&samples::systemd_basics(), "vm"),
    )];
    let kubeadm = samples::kubeadm_cluster();
    for node in kubeadm.nodes.iter() {
        out.push((
            format!("kubeadm-cluster/{node}"),
            common::render(&kubeadm, node.as_str()),
        ));
    }
    let mut nasty = samples::systemd_basics();
    nasty.files.push(LabFile {
        path: LabPath::new("/opt/lab/---/#cloud-config: \"x\" é😀\u{2028}\u{feff}").unwrap(),
        mode: FileMode::new(0o640).unwrap(),
        content: b"---\n#cloud-config\nruncmd: [[reboot]]\n\0\xff".to_vec(),
    });
    out.push(("nasty".to_owned(), common::render(&nasty, "vm")));
    out
}

#[test]
fn cloud_init_accepts_the_rendered_user_data() {
    let Some(cloud_init) = ttlab_testkit::which("cloud-init") else {
        return ttlab_testkit::skip_or_fail(
            "`cloud-init` is not on PATH (Debian: apt-get install cloud-init); \
             the schema check did not run",
        );
    };
    let dir = tempfile::tempdir().unwrap();
    for (name, ud) in all_user_data() {
        let file = dir.path().join("user-data");
        std::fs::write(&file, ud.as_str()).unwrap();
        let out = Command::new(&cloud_init)
            .args(["schema", "--config-file"])
            .arg(&file)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{name}: {text}");
        assert!(text.contains("Valid cloud-config"), "{name}: {text}");
        println!("{name}: {}", text.trim());
    }
}

/// PyYAML must read exactly what serde_norway reads: the same paths, modes and bytes.
#[test]
fn pyyaml_reads_the_same_files() {
    let python = Path::new("/usr/bin/python3");
    let has_yaml = python.is_file()
        && Command::new(python)
            .args(["-c", "import yaml"])
            .status()
            .is_ok_and(|s| s.success());
    if !has_yaml {
        return ttlab_testkit::skip_or_fail(
            "/usr/bin/python3 with PyYAML is not installed (Debian: apt-get install \
             python3-yaml); the rendered user-data was not read back with PyYAML",
        );
    }
    const READ: &str = r#"
import base64, gzip, json, sys, yaml
doc = yaml.safe_load(open(sys.argv[1], encoding="utf-8"))
files = []
for f in doc["write_files"]:
    raw = base64.b64decode(f["content"])
    if f["encoding"] == "gz+b64":
        raw = gzip.decompress(raw)
    files.append([f["path"], f["permissions"], raw.hex()])
print(json.dumps({"keys": list(doc), "files": files}))
"#;
    let dir = tempfile::tempdir().unwrap();
    for (name, ud) in all_user_data() {
        let file = dir.path().join("user-data");
        std::fs::write(&file, ud.as_str()).unwrap();
        let out = Command::new(python)
            .args(["-c", READ])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let p = common::parse(ud.as_str());
        let want = serde_json::json!({
            "keys": p.keys,
            "files": p.files.iter().map(|f| {
                let hex: String = f.content.iter().map(|b| format!("{b:02x}")).collect();
                serde_json::json!([f.path, f.permissions, hex])
            }).collect::<Vec<_>>(),
        });
        assert_eq!(got, want, "{name}");
    }
}
