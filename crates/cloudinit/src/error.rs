use ttlab_model::{LessonId, NodeName};

/// Why user-data or its Secret could not be rendered. Every variant is detected before any
/// Kubernetes API call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CloudInitError {
    /// The agent binary given to [`crate::AgentPayload::new`] is empty.
    #[error("the agent binary is empty")]
    EmptyAgent,
    /// Compressing the agent binary failed (in memory; not expected to happen).
    #[error("compressing the agent binary failed: {0}")]
    Compress(String),
    /// Serializing the cloud-config body failed (plain strings; not expected to happen).
    #[error("serializing the cloud-config failed: {0}")]
    Serialize(String),
    /// The lesson runs as a pod, not a VM: it has no cloud-init.
    #[error("lesson `{0}` runs as a pod: cloud-init is only rendered for VM lessons")]
    NotAVmLesson(LessonId),
    /// The node is not one of the lesson's nodes.
    #[error("node `{node}` is not one of the nodes of lesson `{lesson}`")]
    UnknownNode {
        /// The lesson.
        lesson: LessonId,
        /// The node asked for.
        node: NodeName,
    },
    /// The power-off instant cannot be written as a Unix time of this century.
    #[error("the power-off instant {0} is out of range")]
    PowerOffOutOfRange(String),
    /// The Secret name is not a valid Kubernetes object name.
    #[error("invalid Secret name {0:?}: expected a DNS-1123 subdomain of at most 253 characters")]
    InvalidSecretName(String),
    /// The Secret would be larger than Kubernetes accepts.
    #[error(
        "the cloud-init Secret would be {size} bytes, over the {limit}-byte (1 MiB) limit of a \
         Kubernetes Secret: make the lesson's files smaller"
    )]
    TooLarge {
        /// Its size: key plus user-data bytes, as the API server counts it.
        size: usize,
        /// The limit, [`crate::UserDataSecret::MAX_BYTES`].
        limit: usize,
    },
}
