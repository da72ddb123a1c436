/// Why a value could not become one of the model's types.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The text is not a UUID.
    #[error("invalid session id {0:?}: expected a UUID")]
    InvalidSessionId(String),
    /// The text is not a UUID.
    #[error("invalid class id {0:?}: expected a UUID")]
    InvalidClassId(String),
    /// A user id must be 1 to 256 printable characters.
    #[error("invalid user id: {0}")]
    InvalidUserId(&'static str),
    /// The text is not a lowercase DNS-1123 label of the allowed length.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidName {
        /// Which kind of name (environment, lesson id, node name).
        what: &'static str,
        /// The rejected text.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The text is not one of the known session statuses.
    #[error("unknown session status {0:?}")]
    UnknownStatus(String),
    /// The text is not one of the known runtimes (`vm`, `pod`).
    #[error("unknown runtime {0:?}: expected `vm` or `pod`")]
    UnknownRuntime(String),
    /// The text is not a Kubernetes quantity ttlab can hold exactly.
    #[error("invalid quantity {value:?}: {fault}")]
    InvalidQuantity {
        /// The rejected text.
        value: String,
        /// What is wrong with it.
        fault: crate::QuantityFault,
    },
}
