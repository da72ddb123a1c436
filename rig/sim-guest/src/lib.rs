//! sim-guest: the simulated guest's first boot, shared by the two simulations of KubeVirt
//! (kube-sim's own and `ttlab-kubevirt-sim`'s controller): cloud-init `write_files` from the
//! NoCloud user-data into a per-VM directory, the VMI's `configMap` volumes presented as
//! KubeVirt presents them (one disk per volume, its files the ConfigMap's keys, found by its
//! `volumeLabel`), the real `ttlab-agent` binary installed from the agent disk as ttlab's first
//! boot does — unpacked, checked against the sha256 the user-data pins, or the failure marker
//! with the reason and no agent — and started, and the readiness / failure markers the setup
//! writes ([`SetupOutcome`] says which). A guest whose user-data pins no digest runs whatever
//! binary its `write_files` put in place.
//!
//! The agent runs as `ttlab-agent --root <guest dir> --listen <VMI address>:<agent port>`; its
//! standard error and output go to the guest's `/var/log/ttlab-agent.log`; [`start_agent`]
//! returns once its `ttlab-agent listening on` line is out (awaited at most
//! [`AGENT_START_TIMEOUT`]). Values in, files and a process out: the simulations decide when.
//!
//! It refuses to own anything production runs: it is a test double's part.

use std::io::Read as _;
use std::net::Ipv4Addr;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::oneshot;

/// What the simulated guest's setup does for a lesson (chosen by the `ttlab.io/lesson` label
/// of the VM's template).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SetupOutcome {
    /// The readiness marker is written once the simulated setup has taken its time.
    Ready,
    /// Neither marker is ever written (a setup that hangs).
    Never,
    /// The failure marker is written once the simulated setup has taken its time, holding
    /// this reason.
    Fail {
        /// Content of the failure marker.
        reason: String,
    },
}

/// What applying a cloud-config produced.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// `hostname` (or `fqdn`'s first label) from the cloud-config.
    pub hostname: Option<String>,
    /// Number of files written.
    pub files: usize,
}

/// Maps an absolute guest path under `root`, refusing `..` escapes.
pub fn guest_path(root: &Path, path: &str) -> Result<PathBuf, String> {
    let mut out = root.to_path_buf();
    for c in Path::new(path).components() {
        match c {
            Component::RootDir | Component::CurDir => {}
            Component::Normal(p) => out.push(p),
            Component::ParentDir | Component::Prefix(_) => {
                return Err(format!("path {path:?} leaves the guest root"));
            }
        }
    }
    if out == root {
        return Err(format!("path {path:?} names no file"));
    }
    Ok(out)
}

/// Parses `#cloud-config` user-data and writes its `write_files` under `root`.
pub fn apply_cloud_config(root: &Path, userdata: &[u8]) -> Result<Applied, String> {
    let text = std::str::from_utf8(userdata).map_err(|_| "user-data is not UTF-8".to_owned())?;
    let Some(body) = text.strip_prefix("#cloud-config") else {
        return Err("user-data does not start with #cloud-config".into());
    };
    let config: Value =
        serde_norway::from_str(body).map_err(|e| format!("cloud-config does not parse: {e}"))?;
    let mut applied = Applied {
        hostname: config["hostname"].as_str().map(str::to_owned).or_else(|| {
            config["fqdn"]
                .as_str()
                .and_then(|f| f.split('.').next())
                .map(str::to_owned)
        }),
        files: 0,
    };
    for (i, f) in config["write_files"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        let path = f["path"]
            .as_str()
            .ok_or(format!("write_files[{i}] has no path"))?;
        let content = f["content"].as_str().unwrap_or("");
        let bytes = decode_content(content, f["encoding"].as_str().unwrap_or("text/plain"))
            .map_err(|e| format!("write_files[{i}] ({path}): {e}"))?;
        let target = guest_path(root, path)?;
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
        }
        if f["append"].as_bool() == Some(true) {
            use std::io::Write as _;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&target)
                .map_err(|e| format!("{}: {e}", target.display()))?;
            file.write_all(&bytes)
                .map_err(|e| format!("{}: {e}", target.display()))?;
        } else {
            std::fs::write(&target, &bytes).map_err(|e| format!("{}: {e}", target.display()))?;
        }
        let mode = match &f["permissions"] {
            Value::String(s) => {
                u32::from_str_radix(s.trim_start_matches("0o"), 8).map_err(|_| {
                    format!("write_files[{i}] ({path}): permissions {s:?} are not octal")
                })?
            }
            Value::Number(n) => n
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(0o644),
            _ => 0o644,
        };
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(&target, std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("{}: {e}", target.display()))?;
        }
        applied.files += 1;
    }
    Ok(applied)
}

fn decode_content(content: &str, encoding: &str) -> Result<Vec<u8>, String> {
    let b64 = |s: &str| {
        let clean: String = s.chars().filter(|c| !c.is_whitespace()).collect();
        base64::engine::general_purpose::STANDARD
            .decode(clean)
            .map_err(|e| format!("bad base64: {e}"))
    };
    match encoding {
        "b64" | "base64" => b64(content),
        "gz+b64" | "gzip+base64" | "gz+base64" | "gzip+b64" => {
            let raw = b64(content)?;
            let mut out = Vec::new();
            flate2::read::GzDecoder::new(raw.as_slice())
                .read_to_end(&mut out)
                .map_err(|e| format!("bad gzip: {e}"))?;
            Ok(out)
        }
        "gz" | "gzip" => Err("gzip without base64 cannot be carried in YAML".into()),
        "text/plain" | "" => Ok(content.as_bytes().to_vec()),
        other => Err(format!("unknown encoding {other:?}")),
    }
}

/// Where ttlab's user-data pins the sha256 of the agent the guest must run
/// (`ttlab_cloudinit::AGENT_DIGEST_PATH`).
pub const AGENT_DIGEST_PATH: &str = "/usr/local/lib/ttlab/agent.sha256";
/// The volume label of the agent disk (`ttlab_cloudinit::AGENT_VOLUME_LABEL`).
pub const AGENT_VOLUME_LABEL: &str = "ttlab-agent";
/// The file on the agent disk holding the gzip of the agent (`ttlab_cloudinit::AGENT_KEY`).
pub const AGENT_KEY: &str = "ttlab-agent.gz";

/// One disk KubeVirt built from a `configMap` volume: its volume label and its files (the
/// ConfigMap's keys, `data` and `binaryData` alike).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigDisk {
    /// `volumeLabel` (KubeVirt's default, `cfgdata`, when the volume sets none).
    pub label: String,
    /// File name → bytes.
    pub files: std::collections::BTreeMap<String, Vec<u8>>,
}

impl ConfigDisk {
    /// The disk of a ConfigMap object (JSON as stored) under `label`.
    pub fn from_config_map(label: &str, config_map: &Value) -> Self {
        let mut files = std::collections::BTreeMap::new();
        for (k, v) in config_map["data"].as_object().into_iter().flatten() {
            files.insert(k.clone(), v.as_str().unwrap_or("").as_bytes().to_vec());
        }
        for (k, v) in config_map["binaryData"].as_object().into_iter().flatten() {
            if let Some(bytes) = v
                .as_str()
                .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            {
                files.insert(k.clone(), bytes);
            }
        }
        Self {
            label: if label.is_empty() {
                "cfgdata".to_owned()
            } else {
                label.to_owned()
            },
            files,
        }
    }
}

/// What ttlab's first boot does with the agent disk: when the user-data pinned a digest,
/// finds the disk labelled [`AGENT_VOLUME_LABEL`], unpacks [`AGENT_KEY`], checks its sha256
/// against the pin and installs it (0755) at the agent's path. `Err` carries the reason the
/// real first boot writes into the failure marker. Without a pin (user-data of another
/// shape) nothing is done.
pub fn install_agent(root: &Path, disks: &[ConfigDisk]) -> Result<(), String> {
    let Ok(pin_path) = guest_path(root, AGENT_DIGEST_PATH) else {
        return Ok(());
    };
    let Ok(pin) = std::fs::read_to_string(&pin_path) else {
        return Ok(());
    };
    let want = pin.trim();
    let Some(disk) = disks.iter().find(|d| d.label == AGENT_VOLUME_LABEL) else {
        return Err(format!(
            "the grading agent cannot be installed: no disk labelled {AGENT_VOLUME_LABEL} appeared"
        ));
    };
    let Some(gz) = disk.files.get(AGENT_KEY) else {
        return Err(format!(
            "the grading agent cannot be installed: {AGENT_KEY} on the agent disk is missing or damaged"
        ));
    };
    let mut binary = Vec::new();
    flate2::read::GzDecoder::new(gz.as_slice())
        .read_to_end(&mut binary)
        .map_err(|_| {
            format!(
                "the grading agent cannot be installed: {AGENT_KEY} on the agent disk is missing or damaged"
            )
        })?;
    let got = sha256_hex(&binary)?;
    if got != want {
        return Err(format!(
            "the grading agent on the agent disk is not the expected version (sha256 {got}, expected {want})"
        ));
    }
    let target = guest_path(root, ttlab_agent::protocol::BINARY_PATH)?;
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let tmp = target.with_extension("tmp");
    std::fs::write(&tmp, &binary).map_err(|e| format!("{}: {e}", tmp.display()))?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", tmp.display()))?;
    }
    std::fs::rename(&tmp, &target).map_err(|e| format!("{}: {e}", target.display()))
}

/// The sha256 of `bytes` in hex, by `sha256sum` as the guest computes it.
fn sha256_hex(bytes: &[u8]) -> Result<String, String> {
    use std::io::Write as _;
    let mut child = std::process::Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("the guest has no sha256sum: {e}"))?;
    let mut stdin = child.stdin.take().ok_or("sha256sum has no stdin")?;
    let data = bytes.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = child
        .wait_with_output()
        .map_err(|e| format!("sha256sum failed: {e}"))?;
    let _ = writer.join();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .map(str::to_owned)
        .ok_or_else(|| "sha256sum printed nothing".to_owned())
}

/// Where the simulated guest writes its agent's standard error and output: the guest's
/// `/var/log/ttlab-agent.log`.
pub fn agent_log(root: &Path) -> PathBuf {
    root.join("var/log/ttlab-agent.log")
}

/// The size the guest's agent set on its serial console, `(rows, cols)`, if it set one: it
/// writes `ROWS COLS` to [`ttlab_agent::protocol::CONSOLE_TTY_PATH`] under the guest's root
/// (`POST /v1/console-size`), where a real guest's kernel would hold it as the TTY's size.
pub fn console_size(root: &Path) -> Option<(u16, u16)> {
    let file = root.join(ttlab_agent::protocol::CONSOLE_TTY_PATH.trim_start_matches('/'));
    let text = std::fs::read_to_string(file).ok()?;
    let mut words = text.split_whitespace().map(str::parse::<u16>);
    match (words.next(), words.next()) {
        (Some(Ok(rows)), Some(Ok(cols))) => Some((rows, cols)),
        _ => None,
    }
}

/// How long the guest waits for the agent's listening line before it goes on without it.
pub const AGENT_START_TIMEOUT: Duration = Duration::from_secs(10);

/// A started agent: the process, and the line it prints once listening (the bound address),
/// or the end of its output if it dies first.
pub struct StartedAgent {
    /// The agent process (killed when dropped).
    pub child: tokio::process::Child,
    /// Receives the address from the agent's listening line; closed if it exits first.
    pub listening: oneshot::Receiver<String>,
}

/// Starts the agent binary found in the guest payload, if there is one and it is executable.
/// Its standard error and output go to [`agent_log`].
pub fn start_agent(root: &Path, ip: Ipv4Addr, port: u16) -> Option<StartedAgent> {
    let bin = guest_path(root, ttlab_agent::protocol::BINARY_PATH).ok()?;
    let meta = std::fs::metadata(&bin).ok()?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        if meta.permissions().mode() & 0o111 == 0 {
            tracing::warn!(path = %bin.display(), "guest agent binary is not executable; no agent in this guest");
            return None;
        }
    }
    let log_path = agent_log(root);
    if let Some(dir) = log_path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    // Truncated once, then appended to by both streams (so neither overwrites the other).
    let _ = std::fs::File::create(&log_path);
    let open = || {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .ok()
    };
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("--root")
        .arg(root)
        .arg("--listen")
        .arg(format!("{ip}:{port}"))
        .current_dir(root)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    match open() {
        Some(l) => cmd.stderr(l),
        None => cmd.stderr(std::process::Stdio::null()),
    };
    // The binary was written into the guest moments ago; a process this one forked meanwhile
    // (another guest's agent) may still hold it open for writing until it execs, which makes
    // exec fail with ETXTBSY for that instant. Retried briefly.
    let mut busy = 0;
    let mut child = loop {
        match cmd.spawn() {
            Ok(child) => break child,
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy && busy < 50 => {
                busy += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Err(e) => {
                tracing::warn!(path = %bin.display(), error = %e, "guest agent did not start");
                return None;
            }
        }
    };
    let (tx, listening) = oneshot::channel();
    if let Some(stdout) = child.stdout.take() {
        let log = open();
        tokio::spawn(async move {
            use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _};
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            let mut log = log.map(tokio::fs::File::from_std);
            let mut tx = Some(tx);
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(addr) = line.strip_prefix(ttlab_agent::protocol::LISTENING_PREFIX)
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(addr.trim().to_owned());
                }
                if let Some(l) = log.as_mut() {
                    let _ = l.write_all(format!("{line}\n").as_bytes()).await;
                }
            }
        });
    }
    Some(StartedAgent { child, listening })
}

/// Writes the readiness marker (or the failure marker with `reason`).
pub fn write_marker(root: &Path, failed: Option<&str>) -> Result<(), String> {
    let (path, content) = match failed {
        None => (
            ttlab_agent::protocol::READY_MARKER_PATH,
            "ready\n".to_owned(),
        ),
        Some(r) => (ttlab_agent::protocol::FAILED_MARKER_PATH, format!("{r}\n")),
    };
    let target = guest_path(root, path)?;
    if let Some(p) = target.parent() {
        std::fs::create_dir_all(p).map_err(|e| e.to_string())?;
    }
    std::fs::write(&target, content).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn write_files_are_decoded_and_placed_under_the_root() {
        let dir = tempfile::tempdir().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"zipped").unwrap();
        let gz = base64::engine::general_purpose::STANDARD.encode(gz.finish().unwrap());
        let plain = base64::engine::general_purpose::STANDARD.encode("#!/bin/sh\necho hi\n");
        let cfg = serde_json::json!({
            "hostname": "lab-1",
            "write_files": [
                {"path": "/etc/ttlab/agent.token", "content": base64::engine::general_purpose::STANDARD.encode("tok"), "encoding": "b64", "permissions": "0600"},
                {"path": "/usr/local/bin/x", "content": plain, "encoding": "b64", "permissions": "0755"},
                {"path": "/opt/lab/z", "content": gz, "encoding": "gz+b64"},
                {"path": "/opt/lab/t", "content": "---\nruncmd: [x]\n"}
            ]
        });
        let ud = format!("#cloud-config\n{cfg}");
        let a = apply_cloud_config(dir.path(), ud.as_bytes()).unwrap();
        assert_eq!(
            a,
            Applied {
                hostname: Some("lab-1".into()),
                files: 4
            }
        );
        assert_eq!(
            std::fs::read(dir.path().join("etc/ttlab/agent.token")).unwrap(),
            b"tok"
        );
        assert_eq!(
            std::fs::read(dir.path().join("opt/lab/z")).unwrap(),
            b"zipped"
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("opt/lab/t")).unwrap(),
            "---\nruncmd: [x]\n"
        );
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(dir.path().join("usr/local/bin/x"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    #[test]
    fn escapes_and_non_cloud_config_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(guest_path(dir.path(), "/../../etc/passwd").is_err());
        let ud =
            "#cloud-config\n{\"write_files\": [{\"path\": \"/a/../../b\", \"content\": \"x\"}]}";
        assert!(apply_cloud_config(dir.path(), ud.as_bytes()).is_err());
        assert!(apply_cloud_config(dir.path(), b"#!/bin/sh\n").is_err());
    }

    #[test]
    fn the_console_size_is_what_the_agent_wrote_if_well_formed() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(console_size(dir.path()), None);
        let tty = dir
            .path()
            .join(ttlab_agent::protocol::CONSOLE_TTY_PATH.trim_start_matches('/'));
        std::fs::create_dir_all(tty.parent().unwrap()).unwrap();
        std::fs::write(&tty, "40 132\n").unwrap();
        assert_eq!(console_size(dir.path()), Some((40, 132)));
        for bad in ["", "40", "40 wide", "70000 80"] {
            std::fs::write(&tty, bad).unwrap();
            assert_eq!(console_size(dir.path()), None, "{bad:?}");
        }
    }
}
