//! Lab files: where they go in the guest, with which mode, holding which bytes.

use std::fmt;

use base64::Engine as _;
use serde::{Deserialize, Deserializer, Serialize};

/// Directories that belong to ttlab inside the guest (agent, token, markers, first-boot
/// scripts). A lab file may not be written under them.
pub const RESERVED_DIRS: [&str; 3] = ["/etc/ttlab/", "/var/lib/ttlab/", "/usr/local/lib/ttlab/"];

/// Directories where ttlab's own files are named `ttlab-…` (the agent binary, its unit, the
/// power-off timer, the serial-console drop-in). A lab file there may not use that prefix.
pub const RESERVED_NAME_DIRS: [&str; 2] = ["/usr/local/bin/", "/etc/systemd/system/"];

/// Whether `path` is one ttlab writes itself (see [`RESERVED_DIRS`] and
/// [`RESERVED_NAME_DIRS`]). Lab files at such paths are refused at load, so a lesson can never
/// overwrite the agent, its token or the readiness marker by accident.
pub fn is_reserved_path(path: &str) -> bool {
    RESERVED_DIRS
        .iter()
        .any(|d| path.starts_with(d) || path == d.trim_end_matches('/'))
        || RESERVED_NAME_DIRS.iter().any(|d| {
            path.strip_prefix(d).is_some_and(|rest| {
                rest.split('/')
                    .any(|component| component.starts_with("ttlab-"))
            })
        })
}

/// An absolute guest path for a lab file: starts with `/`, has no `.`, `..` or empty
/// component, no control character, is not a directory (`/` at the end) and is not one of
/// ttlab's own paths ([`is_reserved_path`]). At most 4096 bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct LabPath(String);

impl LabPath {
    /// Validates a guest path.
    pub fn new(path: impl Into<String>) -> Result<Self, String> {
        let path = path.into();
        let bad = |why: &str| Err(format!("file path {path:?} {why}"));
        if !path.starts_with('/') {
            return bad("is relative: lab file paths must be absolute (start with `/`)");
        }
        if path.len() > 4096 {
            return bad("is longer than 4096 bytes");
        }
        if path.ends_with('/') {
            return bad("names a directory (ends with `/`): give the file name");
        }
        if path.chars().any(char::is_control) {
            return bad("contains a control character (NUL, newline, tab, …)");
        }
        for component in path[1..].split('/') {
            match component {
                ".." => return bad("contains `..`: lab file paths may not climb directories"),
                "." => return bad("contains a `.` component: write the path without it"),
                "" => return bad("contains an empty component (`//`)"),
                _ => {}
            }
        }
        if is_reserved_path(&path) {
            return bad(
                "is reserved for ttlab's own files (/etc/ttlab, /var/lib/ttlab, \
                 /usr/local/lib/ttlab and ttlab-* units and binaries)",
            );
        }
        Ok(Self(path))
    }

    /// The path as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LabPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for LabPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = LabPath;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an absolute file path")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<LabPath, E> {
                LabPath::new(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

/// Unix permission bits of a lab file (at most `0o7777`). Written in lesson files as a quoted
/// octal string (`"0644"`, `"755"`); `0644` unquoted also works (a leading zero keeps it a
/// string), but a plain number such as `644` is refused: YAML parsers disagree on whether it is
/// octal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FileMode(u32);

impl FileMode {
    /// `0644`, the default for lab files.
    pub const DEFAULT: FileMode = FileMode(0o644);

    /// Permission bits from a number (at most `0o7777`).
    pub fn new(bits: u32) -> Result<Self, String> {
        if bits > 0o7777 {
            return Err(format!("file mode {bits:o} is larger than 7777"));
        }
        Ok(Self(bits))
    }

    /// The permission bits.
    pub fn bits(self) -> u32 {
        self.0
    }

    /// Four octal digits with a leading zero, as cloud-init's `permissions` expects (`0644`).
    pub fn to_octal_string(self) -> String {
        format!("{:04o}", self.0)
    }
}

impl Default for FileMode {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for FileMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_octal_string())
    }
}

impl Serialize for FileMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_octal_string())
    }
}

impl<'de> Deserialize<'de> for FileMode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FileMode;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quoted octal file mode such as \"0644\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FileMode, E> {
                let digits_ok =
                    (3..=4).contains(&v.len()) && v.bytes().all(|b| (b'0'..=b'7').contains(&b));
                if !digits_ok {
                    return Err(E::custom(format!(
                        "file mode {v:?} must be 3 or 4 octal digits, e.g. \"0644\" or \"0755\""
                    )));
                }
                let bits = u32::from_str_radix(v, 8).map_err(E::custom)?;
                FileMode::new(bits).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<FileMode, E> {
                Err(E::custom(format!(
                    "file mode {v} must be quoted (\"0{v}\"): YAML parsers disagree on unquoted octal"
                )))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<FileMode, E> {
                Err(E::custom(format!(
                    "file mode {v} must be a quoted octal string such as \"0644\""
                )))
            }
        }
        d.deserialize_any(V)
    }
}

/// One file the lesson puts into the guest before its setup script runs (owner root).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabFile {
    /// Where it goes.
    pub path: LabPath,
    /// Its permission bits.
    pub mode: FileMode,
    /// Its exact bytes (text content as UTF-8, or decoded `content_base64`).
    pub content: Vec<u8>,
}

/// A lab file as written in YAML: exactly one of `content` and `content_base64`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLabFile {
    path: LabPath,
    #[serde(default)]
    mode: FileMode,
    content: Option<String>,
    content_base64: Option<String>,
}

impl TryFrom<RawLabFile> for LabFile {
    type Error = String;
    fn try_from(raw: RawLabFile) -> Result<Self, String> {
        let content = match (raw.content, raw.content_base64) {
            (Some(text), None) => text.into_bytes(),
            (None, Some(b64)) => {
                let compact: String = b64.split_whitespace().collect();
                base64::engine::general_purpose::STANDARD
                    .decode(compact.as_bytes())
                    .map_err(|e| {
                        format!("file {}: content_base64 is not valid base64: {e}", raw.path)
                    })?
            }
            (Some(_), Some(_)) => {
                return Err(format!(
                    "file {}: give either `content` (text) or `content_base64` (bytes), not both",
                    raw.path
                ));
            }
            (None, None) => {
                return Err(format!(
                    "file {}: missing `content` (text) or `content_base64` (bytes)",
                    raw.path
                ));
            }
        };
        Ok(Self {
            path: raw.path,
            mode: raw.mode,
            content,
        })
    }
}

impl<'de> Deserialize<'de> for LabFile {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::validated_map::<D, RawLabFile, LabFile>(d, "a lab file (a mapping)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_must_be_absolute_plain_and_not_ours() {
        for ok in [
            "/etc/motd",
            "/opt/lab/a b/\"quoted\".txt",
            "/root/---",
            "/usr/local/bin/check",
            "/etc/systemd/system/web.service",
            "/opt/ttlab-notes",
        ] {
            assert!(LabPath::new(ok).is_ok(), "{ok}");
        }
        for (bad, why) in [
            ("etc/motd", "relative"),
            ("", "relative"),
            ("/opt/../etc/shadow", "`..`"),
            ("/opt/lab/..", "`..`"),
            ("/opt/./x", "`.` component"),
            ("/opt//x", "empty component"),
            ("/opt/lab/", "directory"),
            ("/", "directory"),
            ("/opt/a\nb", "control character"),
            ("/opt/a\0b", "control character"),
            ("/etc/ttlab/agent.token", "reserved"),
            ("/etc/ttlab", "reserved"),
            ("/var/lib/ttlab/ready", "reserved"),
            ("/usr/local/bin/ttlab-agent", "reserved"),
            ("/etc/systemd/system/ttlab-agent.service", "reserved"),
            (
                "/etc/systemd/system/serial-getty@ttyS0.service.d/ttlab-autologin.conf",
                "reserved",
            ),
        ] {
            let err = LabPath::new(bad).unwrap_err();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn modes_are_quoted_octal() {
        let m: FileMode = serde_norway::from_str("\"0755\"").unwrap();
        assert_eq!(m.bits(), 0o755);
        assert_eq!(m.to_octal_string(), "0755");
        let m: FileMode = serde_norway::from_str("'600'").unwrap();
        assert_eq!(m.bits(), 0o600);
        assert_eq!(
            serde_norway::from_str::<FileMode>("0644").unwrap().bits(),
            0o644
        );
        let err = serde_norway::from_str::<FileMode>("644")
            .unwrap_err()
            .to_string();
        assert!(err.contains("quoted"), "{err}");
        assert!(serde_norway::from_str::<FileMode>("\"0985\"").is_err());
        assert!(serde_norway::from_str::<FileMode>("\"07777\"").is_err());
    }
}
