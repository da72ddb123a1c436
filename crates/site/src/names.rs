use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Why `value` is not a lowercase RFC 1123 label of at most `max` bytes, if it is not one.
fn dns_label_fault(value: &str, max: usize) -> Option<String> {
    if value.is_empty() {
        return Some("it is empty".to_owned());
    }
    if value.len() > max {
        return Some(format!("it is longer than {max} characters"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Some("only lowercase letters, digits and '-' are allowed".to_owned());
    }
    if value.starts_with('-') || value.ends_with('-') {
        return Some("it must start and end with a letter or digit".to_owned());
    }
    None
}

/// A text that is not a valid [`SiteLabel`] or [`Namespace`], and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: {reason}")]
pub struct InvalidLabel {
    /// Which kind of label (`site label`, `namespace`).
    pub what: &'static str,
    /// The rejected text.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

macro_rules! label_type {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// The longest accepted value, in bytes.
            pub const MAX_LEN: usize = $max;

            /// Validates and wraps the text.
            pub fn new(value: impl Into<String>) -> Result<Self, InvalidLabel> {
                let value = value.into();
                match dns_label_fault(&value, $max) {
                    None => Ok(Self(value)),
                    Some(reason) => Err(InvalidLabel { what: $what, value, reason }),
                }
            }

            /// The text.
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
            type Err = InvalidLabel;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidLabel;
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

label_type!(
    /// A capability a site offers and a lesson may require (`kvm-large`, `eu`, `gpu`): a
    /// lowercase RFC 1123 label of at most 63 characters.
    SiteLabel,
    "site label",
    63
);

label_type!(
    /// The Kubernetes namespace a site's VMs live in: a lowercase RFC 1123 label of at most 63
    /// characters, as Kubernetes requires of namespaces.
    Namespace,
    "namespace",
    63
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_namespaces_are_dns_labels_of_at_most_63() {
        for ok in ["eu", "kvm-large", "0", &"a".repeat(63)] {
            assert_eq!(SiteLabel::new(ok).unwrap().as_str(), ok);
            assert_eq!(Namespace::new(ok).unwrap().as_str(), ok);
        }
        for bad in ["", "EU", "kvm_large", "-eu", "eu-", "é", &"a".repeat(64)] {
            assert!(SiteLabel::new(bad).is_err(), "{bad}");
            assert!(Namespace::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn errors_say_what_the_text_is_and_why() {
        let err = SiteLabel::new("KVM").unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid site label \"KVM\": only lowercase letters, digits and '-' are allowed"
        );
        let err = Namespace::new("a".repeat(64)).unwrap_err().to_string();
        assert!(err.contains("namespace") && err.contains("63"), "{err}");
    }
}
