//! The NoCloud seed: an ISO 9660 volume labelled `cidata` with `user-data` and `meta-data`,
//! written by whichever of genisoimage, mkisofs or xorriso is installed.

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
