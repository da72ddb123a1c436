use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// Checks `value` is a lowercase RFC 1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most `max`.
fn check_dns_label(what: &'static str, value: &str, max: usize) -> Result<(), ModelError> {
    let fail = |reason| {
        Err(ModelError::InvalidName {
            what,
            value: value.to_owned(),
            reason,
        })
    };
    if value.is_empty() {
        return fail("it is empty");
    }
    if value.len() > max {
        return fail(match max {
            63 => "it is longer than 63 characters",
            40 => "it is longer than 40 characters",
            _ => "it is longer than 20 characters",
        });
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return fail("only lowercase letters, digits and '-' are allowed");
    }
    if value.starts_with('-') || value.ends_with('-') {
        return fail("it must start and end with a letter or digit");
    }
    Ok(())
}

macro_rules! dns_name {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The longest accepted value, in bytes.
            pub const MAX_LEN: usize = $max;

            /// Validates and wraps the name.
            pub fn new(value: impl Into<String>) -> Result<Self, ModelError> {
                let value = value.into();
                check_dns_label($what, &value, $max)?;
                Ok(Self(value))
            }

            /// The name as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = ModelError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ModelError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(n: $name) -> Self {
                n.0
            }
        }
    };
}

dns_name!(
    /// The deployment environment a backend belongs to (`dev`, `prod`, …): stamped on every
    /// object it creates, and the only objects its reaper may treat as orphans.
    EnvName,
    "environment name",
    63
);

dns_name!(
    /// A lesson's id, as written in the lesson file (at most 40 characters, DNS label rules).
    LessonId,
    "lesson id",
    40
);

dns_name!(
    /// One node of a lab (`vm`, `control-plane`, `worker-1`, …): at most 20 characters, so
    /// that names derived from the session id and the node fit in 63.
    NodeName,
    "node name",
    20
);

dns_name!(
    /// A site, a place lab VMs run (`default`, `campus-a`, …): one cluster's API server and a
    /// namespace in it. At most 40 characters, DNS label rules, so that it fits in labels and
    /// metric values beside other names.
    SiteName,
    "site name",
    40
);

dns_name!(
    /// A capability a site offers and a lesson may require (`kvm-large`, `eu`, `gpu`): at
    /// most 63 characters, DNS label rules.
    SiteLabel,
    "site label",
    63
);

dns_name!(
    /// The Kubernetes namespace lab VMs live in: at most 63 characters, DNS label rules, as
    /// Kubernetes requires of namespaces.
    NamespaceName,
    "namespace",
    63
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_dns_label_rules() {
        for ok in ["dev", "prod", "a", "x-1", "0a"] {
            assert!(EnvName::new(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Dev", "-dev", "dev-", "de_v", "dév", &"a".repeat(64)] {
            assert!(EnvName::new(bad).is_err(), "{bad}");
        }
        assert!(NodeName::new("a".repeat(20)).is_ok());
        assert!(NodeName::new("a".repeat(21)).is_err());
        assert!(LessonId::new("a".repeat(40)).is_ok());
        assert!(LessonId::new("a".repeat(41)).is_err());
    }

    #[test]
    fn site_names_are_dns_labels_of_at_most_40() {
        for ok in ["default", "campus-a", "eu-1", &"a".repeat(40)] {
            assert_eq!(SiteName::new(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "Campus", "campus_a", "-a", "a-", &"a".repeat(41)] {
            assert!(SiteName::new(bad).is_err(), "{bad}");
        }
        let err = SiteName::new("Campus-A").unwrap_err().to_string();
        assert!(err.contains("site name"), "{err}");
        assert!(err.contains("\"Campus-A\""), "{err}");
    }

    #[test]
    fn errors_say_what_and_why() {
        let err = NodeName::new("Worker").unwrap_err().to_string();
        assert!(err.contains("node name"), "{err}");
        assert!(err.contains("lowercase"), "{err}");
    }

    #[test]
    fn site_labels_and_namespaces_are_dns_labels_of_at_most_63() {
        for ok in ["eu", "kvm-large", "0", &"a".repeat(63)] {
            assert_eq!(SiteLabel::new(ok).unwrap().as_str(), ok);
            assert_eq!(NamespaceName::new(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "EU", "kvm_large", "-eu", "eu-", "é", &"a".repeat(64)] {
            assert!(SiteLabel::new(bad).is_err(), "{bad}");
            assert!(NamespaceName::new(bad).is_err(), "{bad}");
        }
        let err = SiteLabel::new("KVM").unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid site label \"KVM\": only lowercase letters, digits and '-' are allowed"
        );
        let err = NamespaceName::new("a".repeat(64)).unwrap_err().to_string();
        assert!(err.contains("namespace") && err.contains("63"), "{err}");
    }
}
