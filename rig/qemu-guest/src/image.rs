//! A guest image: a qcow2 (or raw) base disk, read-only, with the kernel and initrd beside it
//! when the disk has no boot loader, described by `manifest.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::QemuError;

/// The manifest's file name inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// What `manifest.json` records about an image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageManifest {
    /// A short name (`debian-12`, or the file a cloud image came from).
    pub name: String,
    /// The base disk, relative to the image directory.
    pub disk: String,
    /// `qcow2` or `raw`.
    pub disk_format: String,
    /// The kernel to boot directly (relative), for disks without a boot loader.
    pub kernel: Option<String>,
    /// The initrd beside the kernel (relative).
    pub initrd: Option<String>,
    /// The kernel command line, without the console (always `ttyS0`).
    pub cmdline: Option<String>,
    /// A digest of what the image was made from; a different recipe means a rebuild.
    pub recipe: String,
    /// Package versions inside (`cloud-init`, `systemd`, the kernel, libc).
    pub versions: BTreeMap<String, String>,
    /// Where it came from (the Debian mirror and suite, or the cloud image's path).
    pub source: String,
    /// When it was made (RFC 3339).
    pub built_at: String,
    /// How long making it took, in seconds.
    pub build_seconds: u64,
}

/// An image ready to boot, with absolute paths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestImage {
    /// The directory holding it.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: ImageManifest,
}

impl GuestImage {
    /// Reads `dir/manifest.json` and checks that the files it names exist.
    pub fn open(dir: &Path) -> Result<Self, QemuError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(QemuError::io(&path))?;
        let manifest: ImageManifest =
            serde_json::from_str(&text).map_err(|e| QemuError::Image {
                dir: dir.to_owned(),
                reason: format!("{MANIFEST_FILE} does not parse: {e}"),
            })?;
        let image = Self {
            dir: dir.to_owned(),
            manifest,
        };
        for file in [Some(image.disk()), image.kernel(), image.initrd()]
            .into_iter()
            .flatten()
        {
            if !file.is_file() {
                return Err(QemuError::Image {
                    dir: dir.to_owned(),
                    reason: format!("{} is missing", file.display()),
                });
            }
        }
        if !matches!(image.manifest.disk_format.as_str(), "qcow2" | "raw") {
            return Err(QemuError::Image {
                dir: dir.to_owned(),
                reason: format!(
                    "disk format {:?} is neither qcow2 nor raw",
                    image.manifest.disk_format
                ),
            });
        }
        Ok(image)
    }

    /// Writes the manifest into `dir`.
    pub fn write_manifest(dir: &Path, manifest: &ImageManifest) -> Result<(), QemuError> {
        let path = dir.join(MANIFEST_FILE);
        let text = serde_json::to_string_pretty(manifest).map_err(|e| QemuError::Image {
            dir: dir.to_owned(),
            reason: e.to_string(),
        })?;
        std::fs::write(&path, text + "\n").map_err(QemuError::io(&path))
    }

    /// The base disk.
    pub fn disk(&self) -> PathBuf {
        self.dir.join(&self.manifest.disk)
    }

    /// The kernel, when booted directly.
    pub fn kernel(&self) -> Option<PathBuf> {
        self.manifest.kernel.as_ref().map(|k| self.dir.join(k))
    }

    /// The initrd, when booted directly.
    pub fn initrd(&self) -> Option<PathBuf> {
        self.manifest.initrd.as_ref().map(|k| self.dir.join(k))
    }
}
