//! Label selectors (`=`, `==`, `!=`, `in`, `notin`, existence, `!` non-existence) and the
//! field selectors the API server supports on every type (`metadata.name`,
//! `metadata.namespace`), parsed like the real server parses them.

use std::collections::BTreeMap;

use serde_json::Value;

/// One requirement of a label selector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `key=value` / `key==value` / `key in (a,b)`.
    In(String, Vec<String>),
    /// `key!=value` / `key notin (a,b)`: true also when the key is absent.
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
}

impl Requirement {
    fn matches(&self, labels: Option<&serde_json::Map<String, Value>>) -> bool {
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        match self {
            Self::In(k, vs) => get(k).is_some_and(|v| vs.iter().any(|x| x == v)),
            Self::NotIn(k, vs) => get(k).is_none_or(|v| !vs.iter().any(|x| x == v)),
            Self::Exists(k) => get(k).is_some(),
            Self::DoesNotExist(k) => get(k).is_none(),
        }
    }

    /// The single (key, value) this requirement pins, usable with a label index.
    pub fn equality(&self) -> Option<(&str, &str)> {
        match self {
            Self::In(k, vs) if vs.len() == 1 => Some((k, &vs[0])),
            _ => None,
        }
    }
}

/// A parsed label selector: all requirements must hold. Empty matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LabelSelector {
    /// The requirements, in the order given.
    pub requirements: Vec<Requirement>,
}

impl LabelSelector {
    /// Parses `a=b,c!=d,e in (f,g),!h`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut p = Parser {
            s: text.as_bytes(),
            i: 0,
        };
        let mut requirements = Vec::new();
        p.ws();
        if p.done() {
            return Ok(Self::default());
        }
        loop {
            requirements.push(p.requirement()?);
            p.ws();
            if p.done() {
                break;
            }
            if !p.eat(b",") {
                return Err(format!(
                    "unable to parse requirement: found '{}', expected: ','",
                    p.rest()
                ));
            }
        }
        Ok(Self { requirements })
    }

    /// Whether an object's `metadata.labels` satisfy every requirement.
    pub fn matches(&self, object: &Value) -> bool {
        let labels = object
            .get("metadata")
            .and_then(|m| m.get("labels"))
            .and_then(Value::as_object);
        self.requirements.iter().all(|r| r.matches(labels))
    }

    /// Whether the labels of a label map satisfy every requirement.
    pub fn matches_map(&self, labels: &BTreeMap<String, String>) -> bool {
        let map: serde_json::Map<String, Value> = labels
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.clone())))
            .collect();
        self.requirements.iter().all(|r| r.matches(Some(&map)))
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn done(&self) -> bool {
        self.i >= self.s.len()
    }
    fn rest(&self) -> String {
        String::from_utf8_lossy(&self.s[self.i.min(self.s.len())..]).into_owned()
    }
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, tok: &[u8]) -> bool {
        if self.s[self.i..].starts_with(tok) {
            self.i += tok.len();
            true
        } else {
            false
        }
    }
    fn word(&mut self) -> String {
        let start = self.i;
        while self.i < self.s.len()
            && !matches!(self.s[self.i], b',' | b'=' | b'!' | b'(' | b')')
            && !self.s[self.i].is_ascii_whitespace()
        {
            self.i += 1;
        }
        String::from_utf8_lossy(&self.s[start..self.i]).into_owned()
    }
    fn requirement(&mut self) -> Result<Requirement, String> {
        self.ws();
        if self.eat(b"!") {
            self.ws();
            let key = self.word();
            check_key(&key)?;
            return Ok(Requirement::DoesNotExist(key));
        }
        let key = self.word();
        if key.is_empty() {
            return Err(format!(
                "unable to parse requirement: found '{}', expected: identifier",
                self.rest()
            ));
        }
        check_key(&key)?;
        self.ws();
        if self.done() || self.s[self.i] == b',' {
            return Ok(Requirement::Exists(key));
        }
        if self.eat(b"==") || self.eat(b"=") {
            self.ws();
            let v = self.word();
            check_value(&v)?;
            return Ok(Requirement::In(key, vec![v]));
        }
        if self.eat(b"!=") {
            self.ws();
            let v = self.word();
            check_value(&v)?;
            return Ok(Requirement::NotIn(key, vec![v]));
        }
        let op = self.word();
        let values = match op.as_str() {
            "in" | "notin" => self.set()?,
            other => {
                return Err(format!(
                    "unable to parse requirement: found '{other}', expected: in, notin, =, ==, !=, gt, lt"
                ));
            }
        };
        if op == "in" {
            Ok(Requirement::In(key, values))
        } else {
            Ok(Requirement::NotIn(key, values))
        }
    }
    fn set(&mut self) -> Result<Vec<String>, String> {
        self.ws();
        if !self.eat(b"(") {
            return Err(format!(
                "unable to parse requirement: found '{}', expected: '('",
                self.rest()
            ));
        }
        let mut values = Vec::new();
        loop {
            self.ws();
            let v = self.word();
            check_value(&v)?;
            values.push(v);
            self.ws();
            if self.eat(b")") {
                break;
            }
            if !self.eat(b",") {
                return Err(format!(
                    "unable to parse requirement: found '{}', expected: ',', ')'",
                    self.rest()
                ));
            }
        }
        if values.iter().all(String::is_empty) {
            return Err("for 'in', 'notin' operators, values set can't be empty".into());
        }
        Ok(values)
    }
}

fn check_key(key: &str) -> Result<(), String> {
    crate::validate::label_key_errors(key)
        .map_or(Ok(()), |e| Err(format!("key: Invalid value: {key:?}: {e}")))
}

fn check_value(v: &str) -> Result<(), String> {
    crate::validate::label_value_errors(v).map_or(Ok(()), |e| {
        Err(format!("values[0]: Invalid value: {v:?}: {e}"))
    })
}

/// A parsed field selector: `metadata.name=x,metadata.namespace!=y`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldSelector {
    /// (field path, wanted value, equal?)
    pub terms: Vec<(String, String, bool)>,
}

const FIELDS: &[&str] = &["metadata.name", "metadata.namespace"];
const POD_FIELDS: &[&str] = &["status.phase", "spec.nodeName"];

impl FieldSelector {
    /// Parses a field selector; `pods` additionally supports `status.phase` and `spec.nodeName`.
    pub fn parse(text: &str, is_pods: bool) -> Result<Self, String> {
        let mut terms = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (field, value, eq) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = part.split_once("==") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once('=') {
                (f, v, true)
            } else {
                return Err(format!(
                    "invalid selector: '{part}'; can't understand '{part}'"
                ));
            };
            let field = field.trim();
            if !(FIELDS.contains(&field) || (is_pods && POD_FIELDS.contains(&field))) {
                return Err(format!("field label not supported: {field}"));
            }
            terms.push((field.to_owned(), value.trim().to_owned(), eq));
        }
        Ok(Self { terms })
    }

    /// The `metadata.name` this selector pins, if any.
    pub fn name(&self) -> Option<&str> {
        self.terms
            .iter()
            .find(|(f, _, eq)| f == "metadata.name" && *eq)
            .map(|(_, v, _)| v.as_str())
    }

    /// Whether an object satisfies every term.
    pub fn matches(&self, object: &Value) -> bool {
        self.terms.iter().all(|(field, want, eq)| {
            let mut v = object;
            for seg in field.split('.') {
                v = v.get(seg).unwrap_or(&Value::Null);
            }
            let got = v.as_str().unwrap_or("");
            (got == want) == *eq
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(labels: Value) -> Value {
        json!({"metadata": {"name": "a", "labels": labels}})
    }

    #[test]
    fn every_operator_matches_like_kubernetes() {
        let o = obj(json!({"env": "dev", "tier": "web"}));
        let yes = [
            "",
            "env=dev",
            "env==dev",
            "env!=prod",
            "env in (dev, prod)",
            "env notin (prod)",
            "tier",
            "!missing",
            "env=dev,tier=web",
            "missing!=x",
            "missing notin (x)",
        ];
        let no = [
            "env=prod",
            "env!=dev",
            "env in (prod)",
            "env notin (dev,prod)",
            "missing",
            "!tier",
            "env=dev,tier=db",
            "missing in (x)",
        ];
        for s in yes {
            assert!(LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
        for s in no {
            assert!(!LabelSelector::parse(s).unwrap().matches(&o), "{s}");
        }
    }

    #[test]
    fn malformed_selectors_are_rejected() {
        for s in [
            "env=dev,",
            "env in dev",
            "env in (",
            "a b",
            "Bad Key=1",
            "env=a b",
        ] {
            assert!(LabelSelector::parse(s).is_err(), "{s}");
        }
    }

    #[test]
    fn field_selectors_pin_names_and_reject_unknown_fields() {
        let f = FieldSelector::parse("metadata.name=a", false).unwrap();
        assert_eq!(f.name(), Some("a"));
        assert!(f.matches(&obj(json!({}))));
        assert!(
            !FieldSelector::parse("metadata.name!=a", false)
                .unwrap()
                .matches(&obj(json!({})))
        );
        assert!(FieldSelector::parse("spec.foo=a", false).is_err());
        assert!(FieldSelector::parse("status.phase=Running", true).is_ok());
    }
}
