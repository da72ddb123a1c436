use std::fmt;
use std::io::Write as _;

use base64::Engine as _;
use flate2::Compression;
use flate2::write::GzEncoder;

use crate::CloudInitError;

/// The agent binary, gzip-compressed and base64-encoded once, ready to be placed in every
/// user-data (`write_files` with `encoding: gz+b64`). The server builds it at start-up and
/// keeps it; rendering then costs no compression.
#[derive(Clone, PartialEq, Eq)]
pub struct AgentPayload {
    gz_b64: String,
    binary_len: usize,
    gz_len: usize,
}

impl AgentPayload {
    /// Compresses (gzip, best compression, no timestamp: the same binary gives the same bytes)
    /// and encodes the agent binary.
    pub fn new(binary: &[u8]) -> Result<Self, CloudInitError> {
        if binary.is_empty() {
            return Err(CloudInitError::EmptyAgent);
        }
        let mut gz = GzEncoder::new(Vec::with_capacity(binary.len() / 2), Compression::best());
        let compressed = gz
            .write_all(binary)
            .and_then(|()| gz.finish())
            .map_err(|e| CloudInitError::Compress(e.to_string()))?;
        Ok(Self {
            gz_b64: base64::engine::general_purpose::STANDARD.encode(&compressed),
            binary_len: binary.len(),
            gz_len: compressed.len(),
        })
    }

    /// Size of the binary.
    pub fn binary_len(&self) -> usize {
        self.binary_len
    }

    /// Size of the gzip stream.
    pub fn compressed_len(&self) -> usize {
        self.gz_len
    }

    /// Size of the base64 text placed in the user-data.
    pub fn encoded_len(&self) -> usize {
        self.gz_b64.len()
    }

    /// The base64 text of the gzip stream.
    pub(crate) fn gz_b64(&self) -> &str {
        &self.gz_b64
    }
}

impl fmt::Debug for AgentPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentPayload")
            .field("binary_len", &self.binary_len)
            .field("compressed_len", &self.gz_len)
            .field("encoded_len", &self.gz_b64.len())
            .finish()
    }
}
