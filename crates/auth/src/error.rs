//! The one error type of this crate.

use crate::MIN_SECRET_BYTES;

/// Why a secret, a token or a signature was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret is shorter than [`MIN_SECRET_BYTES`] (a configuration mistake).
    #[error(
        "TTLAB_AUTH_SECRET is {bytes} bytes; it must be at least {MIN_SECRET_BYTES} \
         (e.g. `openssl rand -hex 32`)"
    )]
    SecretTooShort {
        /// How long the secret given was.
        bytes: usize,
    },
    /// The token is not a valid ttlab token (malformed, another algorithm, a wrong signature,
    /// expired, a claim missing or invalid); the sentence says which, for the caller.
    #[error("{0}")]
    Rejected(String),
    /// The secret could not be made into a signing or verifying key (a defect).
    #[error("the signing key: {0}")]
    Key(String),
    /// Signing failed (a defect).
    #[error("signing a token: {0}")]
    Sign(String),
}
