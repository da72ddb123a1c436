use std::collections::BTreeMap;
use std::fmt;
use std::io::Write as _;
use std::sync::Arc;

use flate2::Compression;
use flate2::write::GzEncoder;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use sha2::{Digest as _, Sha256};
use ttlab_model::EnvName;
use ttlab_model::labels;

use crate::CloudInitError;

/// The key of the agent ConfigMap's `binaryData` that holds the gzip of the agent; KubeVirt
/// presents it to the guest as the file of that name on the agent disk.
pub const AGENT_KEY: &str = "ttlab-agent.gz";
/// The volume label of the agent disk inside the guest (the ConfigMap volume's
/// `volumeLabel`; KubeVirt writes it as the ISO 9660 volume id). First boot finds the disk by
/// it.
pub const AGENT_VOLUME_LABEL: &str = "ttlab-agent";
/// Prefix of the agent ConfigMap's name; the rest is the start of the binary's sha256.
pub const AGENT_CONFIG_MAP_PREFIX: &str = "ttlab-agent-";
/// How many hex digits of the sha256 name the ConfigMap (64 bits: two versions never share
/// a name by chance; the full digest is pinned in each user-data and in an annotation).
pub const AGENT_NAME_DIGITS: usize = 16;

/// The grading agent binary, delivered once per version: gzip-compressed once (best
/// compression, no timestamp: the same binary gives the same bytes), named after its sha256.
///
/// The server builds it at start-up and keeps it. It renders the shared ConfigMap
/// ([`AgentPayload::config_map`]) that every VM of the environment mounts as a disk labelled
/// [`AGENT_VOLUME_LABEL`]; each user-data only pins the digest ([`AgentPayload::digest`]),
/// which first boot checks before it installs the agent.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentPayload {
    gz: Arc<[u8]>,
    sha256: String,
    binary_len: usize,
}

impl AgentPayload {
    /// Compresses the agent binary and computes its digest.
    pub fn new(binary: &[u8]) -> Result<Self, CloudInitError> {
        if binary.is_empty() {
            return Err(CloudInitError::EmptyAgent);
        }
        let mut gz = GzEncoder::new(Vec::with_capacity(binary.len() / 2), Compression::best());
        let compressed = gz
            .write_all(binary)
            .and_then(|()| gz.finish())
            .map_err(|e| CloudInitError::Compress(e.to_string()))?;
        let sha256 = Sha256::digest(binary)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Ok(Self {
            gz: compressed.into(),
            sha256,
            binary_len: binary.len(),
        })
    }

    /// Size of the binary.
    pub fn binary_len(&self) -> usize {
        self.binary_len
    }

    /// Size of the gzip stream (the ConfigMap's one value).
    pub fn compressed_len(&self) -> usize {
        self.gz.len()
    }

    /// Size of the gzip stream in base64, as the ConfigMap's `binaryData` carries it in JSON.
    pub fn encoded_len(&self) -> usize {
        self.gz.len().div_ceil(3) * 4
    }

    /// The gzip stream.
    pub fn gzip(&self) -> &[u8] {
        &self.gz
    }

    /// The sha256 of the binary, 64 lower-case hex digits: what first boot checks.
    pub fn digest(&self) -> &str {
        &self.sha256
    }

    /// The name of the agent ConfigMap of this version: `ttlab-agent-` and the first
    /// [`AGENT_NAME_DIGITS`] hex digits of [`AgentPayload::digest`].
    pub fn config_map_name(&self) -> String {
        format!(
            "{AGENT_CONFIG_MAP_PREFIX}{}",
            &self.sha256[..AGENT_NAME_DIGITS]
        )
    }

    /// The volume label of the agent disk, [`AGENT_VOLUME_LABEL`].
    pub fn volume_label(&self) -> &'static str {
        AGENT_VOLUME_LABEL
    }

    /// The ConfigMap of this version in environment `env` (no namespace: the namespaced API
    /// sets it): `binaryData` [`AGENT_KEY`] holding the gzip, `immutable`, labelled with
    /// `ttlab_model::labels::agent_labels`, the full digest in the annotation
    /// `ttlab_model::labels::AGENT_SHA256`. No owner: it is shared by every VM of the version
    /// and removed by the reaper once none references it.
    pub fn config_map(&self, env: &EnvName) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                name: Some(self.config_map_name()),
                labels: Some(labels::agent_labels(env)),
                annotations: Some(BTreeMap::from([(
                    labels::AGENT_SHA256.to_owned(),
                    self.sha256.clone(),
                )])),
                ..ObjectMeta::default()
            },
            binary_data: Some(BTreeMap::from([(
                AGENT_KEY.to_owned(),
                ByteString(self.gz.to_vec()),
            )])),
            immutable: Some(true),
            ..ConfigMap::default()
        }
    }

    /// The ConfigMap's size as the API server counts it against its 1 MiB limit (keys plus
    /// value bytes).
    pub fn config_map_size_bytes(&self) -> usize {
        AGENT_KEY.len() + self.gz.len()
    }
}

impl fmt::Debug for AgentPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentPayload")
            .field("sha256", &self.sha256)
            .field("binary_len", &self.binary_len)
            .field("compressed_len", &self.gz.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_map_is_named_after_the_digest_and_pins_it() {
        let a = AgentPayload::new(b"\x7fELF one").unwrap();
        let b = AgentPayload::new(b"\x7fELF two").unwrap();
        assert_eq!(a.digest().len(), 64);
        assert_ne!(a.config_map_name(), b.config_map_name());
        assert_eq!(a, AgentPayload::new(b"\x7fELF one").unwrap());
        let cm = a.config_map(&"dev".parse().unwrap());
        assert_eq!(
            cm.metadata.name.as_deref(),
            Some(a.config_map_name().as_str())
        );
        assert_eq!(cm.immutable, Some(true));
        assert_eq!(
            cm.metadata.annotations.unwrap()[labels::AGENT_SHA256],
            a.digest()
        );
        assert_eq!(cm.metadata.labels.unwrap()[labels::ENV], "dev");
        let gz = &cm.binary_data.unwrap()[AGENT_KEY].0;
        let mut out = Vec::new();
        std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(gz.as_slice()), &mut out)
            .unwrap();
        assert_eq!(out, b"\x7fELF one");
        assert!(AgentPayload::new(b"").is_err());
    }
}
