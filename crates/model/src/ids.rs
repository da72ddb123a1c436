use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::ModelError;

/// The id of one lab session (a UUID). Kubernetes object names are derived from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SessionId(Uuid);

impl SessionId {
    /// A fresh random (v4) session id.
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps an existing UUID.
    pub const fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The UUID inside.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// The 32 lowercase hex digits without dashes, used inside Kubernetes names.
    pub fn simple(&self) -> String {
        self.0.simple().to_string()
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl FromStr for SessionId {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s)
            .map(Self)
            .map_err(|_| ModelError::InvalidSessionId(s.to_owned()))
    }
}

/// The id of one scheduled class (a UUID): a lesson, seats and a window an operator booked,
/// for which warm-pool members are prepared ahead of its start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClassId(Uuid);

impl ClassId {
    /// A fresh random (v4) class id.
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Wraps an existing UUID.
    pub const fn from_uuid(id: Uuid) -> Self {
        Self(id)
    }

    /// The UUID inside.
    pub const fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl fmt::Display for ClassId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl FromStr for ClassId {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s)
            .map(Self)
            .map_err(|_| ModelError::InvalidClassId(s.to_owned()))
    }
}

/// The id of a person, as the authentication layer names them (the JWT `sub`).
///
/// 1 to 256 characters, none of them control characters.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct UserId(String);

impl UserId {
    /// Validates and wraps a user id.
    pub fn new(id: impl Into<String>) -> Result<Self, ModelError> {
        let id = id.into();
        if id.is_empty() {
            return Err(ModelError::InvalidUserId("it is empty"));
        }
        if id.chars().count() > 256 {
            return Err(ModelError::InvalidUserId(
                "it is longer than 256 characters",
            ));
        }
        if id.chars().any(char::is_control) {
            return Err(ModelError::InvalidUserId("it contains control characters"));
        }
        Ok(Self(id))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for UserId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for UserId {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl TryFrom<String> for UserId {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        Self::new(s)
    }
}

impl From<UserId> for String {
    fn from(u: UserId) -> Self {
        u.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_ids_parse_and_print_hyphenated() {
        let id: SessionId = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap();
        assert_eq!(id.to_string(), "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a");
        assert_eq!(id.simple(), "6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a");
        assert!("not-a-uuid".parse::<SessionId>().is_err());
    }

    #[test]
    fn class_ids_parse_print_and_are_not_session_ids() {
        let id: ClassId = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap();
        assert_eq!(id.to_string(), "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a");
        assert_eq!(
            serde_json::to_string(&id).unwrap(),
            "\"6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a\""
        );
        assert_eq!(
            "class-1".parse::<ClassId>().unwrap_err().to_string(),
            "invalid class id \"class-1\": expected a UUID"
        );
    }

    #[test]
    fn user_ids_reject_empty_long_and_control() {
        assert!(UserId::new("").is_err());
        assert!(UserId::new("a".repeat(257)).is_err());
        assert!(UserId::new("bad\nname").is_err());
        assert_eq!(
            UserId::new("alice@example.org").unwrap().as_str(),
            "alice@example.org"
        );
        let json = serde_json::to_string(&UserId::new("bob").unwrap()).unwrap();
        assert_eq!(json, "\"bob\"");
        assert!(serde_json::from_str::<UserId>("\"\"").is_err());
    }
}
