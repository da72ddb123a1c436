//! The NoCloud seed: an ISO 9660 volume labelled `cidata` with `user-data` and `meta-data`,
//! and the disks KubeVirt makes of `configMap` volumes: an ISO 9660 volume per ConfigMap,
//! its files the ConfigMap's keys, its volume id the volume's `volumeLabel` (virt-launcher
//! runs `-volid <label> -joliet -rock -graft-points key=path…`) — both written by whichever
//! of genisoimage, mkisofs or xorriso is installed.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use crate::QemuError;

/// Writes `dir/seed.iso` holding the user-data and a meta-data with `instance_id` and
/// `hostname`; returns its path.
pub async fn write_seed(
    dir: &Path,
    instance_id: &str,
    hostname: &str,
    user_data: &[u8],
) -> Result<PathBuf, QemuError> {
    let files = dir.join("cidata");
    tokio::fs::create_dir_all(&files)
        .await
        .map_err(QemuError::io(&files))?;
    let ud = files.join("user-data");
    tokio::fs::write(&ud, user_data)
        .await
        .map_err(QemuError::io(&ud))?;
    let md = files.join("meta-data");
    // JSON is YAML: no value can break out of its string.
    let meta = serde_json::json!({"instance-id": instance_id, "local-hostname": hostname});
    tokio::fs::write(&md, format!("{meta}\n"))
        .await
        .map_err(QemuError::io(&md))?;
    let iso = dir.join("seed.iso");
    let tool = ["genisoimage", "mkisofs", "xorriso"]
        .into_iter()
        .find(|t| on_path(t))
        .ok_or(QemuError::Missing {
            tool: "genisoimage",
            hint: "Debian: apt-get install genisoimage (or xorriso)",
        })?;
    let mut cmd = tokio::process::Command::new(tool);
    if tool == "xorriso" {
        cmd.args(["-as", "mkisofs"]);
    }
    cmd.arg("-quiet")
        .arg("-output")
        .arg(&iso)
        .args(["-volid", "cidata", "-joliet", "-rock"])
        .arg(&ud)
        .arg(&md)
        .stdin(Stdio::null());
    let out = cmd.output().await.map_err(QemuError::io(tool))?;
    if !out.status.success() {
        return Err(QemuError::Tool {
            tool: tool.to_owned(),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(iso)
}

/// One disk built from a ConfigMap, as KubeVirt presents a `configMap` volume to the guest.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigDisk {
    /// The volume's name (names the ISO file in the guest's directory).
    pub name: String,
    /// The ISO 9660 volume id (`volumeLabel`; KubeVirt's default is `cfgdata`).
    pub label: String,
    /// The ConfigMap's keys and values, as files at the root of the volume.
    pub files: Vec<(String, Vec<u8>)>,
}

/// Writes `dir/<name>.iso` from `disk`, with the options virt-launcher uses; returns its path.
pub async fn write_config_disk(dir: &Path, disk: &ConfigDisk) -> Result<PathBuf, QemuError> {
    let safe = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
            && !s.starts_with('.')
    };
    if !safe(&disk.name) {
        return Err(QemuError::Tool {
            tool: "config disk".to_owned(),
            detail: format!("volume name {:?} is not a plain file name", disk.name),
        });
    }
    let files = dir.join(format!("{}.files", disk.name));
    let _ = tokio::fs::remove_dir_all(&files).await;
    tokio::fs::create_dir_all(&files)
        .await
        .map_err(QemuError::io(&files))?;
    let mut grafts = Vec::new();
    for (key, bytes) in &disk.files {
        // ConfigMap keys are [-._a-zA-Z0-9]+: plain file names, never a path.
        if !safe(key) {
            return Err(QemuError::Tool {
                tool: "config disk".to_owned(),
                detail: format!("key {key:?} is not a plain file name"),
            });
        }
        let path = files.join(key);
        tokio::fs::write(&path, bytes)
            .await
            .map_err(QemuError::io(&path))?;
        grafts.push(format!("{key}={}", path.display()));
    }
    let iso = dir.join(format!("{}.iso", disk.name));
    let tool = ["genisoimage", "mkisofs", "xorriso"]
        .into_iter()
        .find(|t| on_path(t))
        .ok_or(QemuError::Missing {
            tool: "genisoimage",
            hint: "Debian: apt-get install genisoimage (or xorriso)",
        })?;
    let mut cmd = tokio::process::Command::new(tool);
    if tool == "xorriso" {
        cmd.args(["-as", "mkisofs"]);
    }
    let label = if disk.label.is_empty() {
        "cfgdata"
    } else {
        disk.label.as_str()
    };
    cmd.arg("-quiet")
        .arg("-output")
        .arg(&iso)
        .args([
            "-follow-links",
            "-volid",
            label,
            "-joliet",
            "-rock",
            "-graft-points",
        ])
        .args(&grafts)
        .stdin(Stdio::null());
    let out = cmd.output().await.map_err(QemuError::io(tool))?;
    if !out.status.success() {
        return Err(QemuError::Tool {
            tool: tool.to_owned(),
            detail: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(iso)
}

/// Whether `tool` is an executable on `PATH`.
pub(crate) fn on_path(tool: &str) -> bool {
    std::env::var_os("PATH").is_some_and(|p| {
        std::env::split_paths(&p).any(|d| {
            std::fs::metadata(d.join(tool)).is_ok_and(|m| {
                use std::os::unix::fs::PermissionsExt as _;
                m.is_file() && m.permissions().mode() & 0o111 != 0
            })
        })
    })
}
