//! Guest memory as a Kubernetes quantity (`4Gi`, `512Mi`, `2G`, `1.5Gi`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use ttlab_model::{QuantityFault, QuantityParts};

/// The smallest guest memory a lesson may ask for: a stock cloud image does not boot in less.
pub const MIN_MEMORY_BYTES: u64 = 128 * 1024 * 1024;

/// Guest memory: the exact quantity text the lesson author wrote (used verbatim in manifests)
/// and its value in bytes.
///
/// Accepts the Kubernetes quantity forms ([`ttlab_model::Quantity`]) that make sense for
/// memory: a decimal number (optionally with a fraction) followed by a binary suffix (`Ki`,
/// `Mi`, `Gi`, `Ti`, `Pi`, `Ei`), a decimal suffix (`k`, `M`, `G`, `T`, `P`, `E`), a decimal
/// exponent (`e9`) or none (bytes); no sign. The value must be a whole number of bytes, at
/// least [`MIN_MEMORY_BYTES`].
///
/// ```
/// use ttlab_lesson::Memory;
///
/// let m: Memory = "1.5Gi".parse().unwrap();
/// assert_eq!(m.bytes(), 1_610_612_736);
/// assert_eq!(m.as_str(), "1.5Gi");
/// assert!("4GB".parse::<Memory>().is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Memory {
    text: String,
    bytes: u64,
}

impl Memory {
    /// The default guest memory of a lesson: `4Gi`.
    pub fn default_for_lesson() -> Self {
        Self {
            text: "4Gi".to_owned(),
            bytes: 4 << 30,
        }
    }

    /// The quantity as written (for `resources.requests.memory` and `domain.memory.guest`).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// The bytes of a memory quantity, or why it was refused (the message of a load error).
fn parse_quantity(text: &str) -> Result<u64, String> {
    let bad =
        |why: &dyn fmt::Display| Err(format!("memory {text:?} is not a valid quantity: {why}"));
    if text.starts_with(['-', '+']) {
        return bad(&"a sign is not allowed");
    }
    let quantity = match QuantityParts::lex(text).and_then(QuantityParts::value) {
        Ok(q) => q,
        Err(QuantityFault::TooFine) => return bad(&"it is not a whole number of bytes"),
        Err(QuantityFault::TooLarge) => return Err(format!("memory {text:?} is too large")),
        Err(fault) => return bad(&fault),
    };
    let Some(bytes) = quantity.whole_units() else {
        return bad(&"it is not a whole number of bytes");
    };
    let bytes = u64::try_from(bytes).map_err(|_| format!("memory {text:?} is too large"))?;
    if bytes < MIN_MEMORY_BYTES {
        return Err(format!(
            "memory {text:?} is {bytes} bytes; a lab VM needs at least 128Mi"
        ));
    }
    Ok(bytes)
}

impl FromStr for Memory {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self {
            text: s.to_owned(),
            bytes: parse_quantity(s)?,
        })
    }
}

impl<'de> Deserialize<'de> for Memory {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Memory;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes memory quantity such as \"4Gi\"")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Memory, E> {
                v.parse().map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Memory, E> {
                v.to_string().parse().map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Memory, E> {
                v.to_string().parse().map_err(E::custom)
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Memory, E> {
                Err(E::custom(format!(
                    "memory {v} is not a valid quantity: write it with a unit, e.g. \"4Gi\""
                )))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Memory {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_usual_forms() {
        for (text, bytes) in [
            ("4Gi", 4u64 << 30),
            ("512Mi", 512 << 20),
            ("1.5Gi", 3 << 29),
            ("2G", 2_000_000_000),
            ("1500M", 1_500_000_000),
            ("1e9", 1_000_000_000),
            ("268435456", 256 << 20),
            ("1Ti", 1 << 40),
            ("262144Ki", 256 << 20),
            ("134217728000m", 128 << 20),
        ] {
            let m: Memory = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(m.bytes(), bytes, "{text}");
            assert_eq!(m.as_str(), text);
        }
        assert_eq!(Memory::default_for_lesson().bytes(), 4 << 30);
        assert_eq!(
            Memory::default_for_lesson(),
            "4Gi".parse::<Memory>().unwrap()
        );
    }

    #[test]
    fn refuses_what_kubernetes_or_a_vm_would_refuse() {
        for (text, why) in [
            ("", "empty"),
            ("4GB", "unknown unit"),
            ("4gi", "unknown unit"),
            ("Gi", "expected a number"),
            ("-4Gi", "sign"),
            ("4 Gi", "unknown unit"),
            ("1.2.3Gi", "expected a number"),
            ("0.1", "whole number"),
            ("1m", "whole number"),
            ("64Mi", "at least 128Mi"),
            ("0", "at least 128Mi"),
            ("16Ei", "too large"),
            ("1e40", "exponent"),
        ] {
            let err = text.parse::<Memory>().unwrap_err();
            assert!(err.contains(why), "{text:?}: {err}");
        }
    }
}
