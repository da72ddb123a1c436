//! A small JSON Schema (draft 7) validator for the subset of keywords the KubeVirt CRD schema
//! uses. Any keyword it does not know makes it panic, so it can never pass a manifest by
//! silently ignoring a rule.

use std::collections::HashMap;

use regex::Regex;
use serde_json::Value;

/// Keywords that only annotate (or that the API server checks by other means): skipped.
const IGNORED: &[&str] = &[
    "description",
    "default",
    "nullable",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-validations",
];

pub struct Validator {
    patterns: HashMap<String, Regex>,
}

impl Validator {
    pub fn new() -> Self {
        Self {
            patterns: HashMap::new(),
        }
    }

    /// Every violation, as `path: message`.
    pub fn errors(&mut self, schema: &Value, instance: &Value) -> Vec<String> {
        let mut out = Vec::new();
        self.check(schema, instance, "", &mut out);
        out
    }

    fn check(&mut self, schema: &Value, v: &Value, path: &str, out: &mut Vec<String>) {
        let s = match schema {
            Value::Bool(true) => return,
            Value::Bool(false) => {
                out.push(format!("{path}: not allowed"));
                return;
            }
            Value::Object(s) => s,
            other => panic!("schema at {path} is not an object: {other}"),
        };
        for (key, kw) in s {
            match key.as_str() {
                k if IGNORED.contains(&k) => {}
                "type" => {
                    let want = kw.as_str().expect("type is a string");
                    let ok = match want {
                        "object" => v.is_object(),
                        "array" => v.is_array(),
                        "string" => v.is_string(),
                        "boolean" => v.is_boolean(),
                        "number" => v.is_number(),
                        "integer" => {
                            v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0)
                        }
                        other => panic!("unknown type {other}"),
                    };
                    if !ok {
                        out.push(format!("{path}: {v} is not of type {want}"));
                    }
                }
                "format" => {
                    let f = kw.as_str().expect("format is a string");
                    let range = match f {
                        "int32" => Some((i32::MIN as i64, i32::MAX as i64)),
                        "int64" => None,
                        // Only annotates status timestamps, which manifests never carry.
                        "date-time" => None,
                        other => panic!("unknown format {other}"),
                    };
                    if let (Some((lo, hi)), Some(n)) = (range, v.as_i64())
                        && !(lo..=hi).contains(&n)
                    {
                        out.push(format!("{path}: {n} out of {f} range"));
                    }
                }
                "properties" => {
                    if let Some(obj) = v.as_object() {
                        for (name, sub) in kw.as_object().expect("properties object") {
                            if let Some(child) = obj.get(name) {
                                self.check(sub, child, &format!("{path}/{name}"), out);
                            }
                        }
                    }
                }
                "additionalProperties" => {
                    if let Some(obj) = v.as_object() {
                        let known = s.get("properties").and_then(Value::as_object);
                        for (name, child) in obj {
                            if known.is_some_and(|p| p.contains_key(name)) {
                                continue;
                            }
                            if kw == &Value::Bool(false) {
                                out.push(format!("{path}: unknown field {name:?}"));
                            } else {
                                self.check(kw, child, &format!("{path}/{name}"), out);
                            }
                        }
                    }
                }
                "required" => {
                    if let Some(obj) = v.as_object() {
                        for name in kw.as_array().expect("required array") {
                            let name = name.as_str().expect("required names");
                            if !obj.contains_key(name) {
                                out.push(format!("{path}: missing required field {name:?}"));
                            }
                        }
                    }
                }
                "items" => {
                    if let Some(items) = v.as_array() {
                        for (i, item) in items.iter().enumerate() {
                            self.check(kw, item, &format!("{path}/{i}"), out);
                        }
                    }
                }
                "maxItems" => {
                    let max = kw.as_u64().expect("maxItems") as usize;
                    if v.as_array().is_some_and(|a| a.len() > max) {
                        out.push(format!("{path}: more than {max} items"));
                    }
                }
                "maxLength" => {
                    let max = kw.as_u64().expect("maxLength") as usize;
                    if v.as_str().is_some_and(|t| t.chars().count() > max) {
                        out.push(format!("{path}: longer than {max}"));
                    }
                }
                "enum" => {
                    if !kw.as_array().expect("enum array").contains(v) {
                        out.push(format!("{path}: {v} is not one of {kw}"));
                    }
                }
                "pattern" => {
                    if let Some(text) = v.as_str() {
                        let p = kw.as_str().expect("pattern string");
                        let re = self
                            .patterns
                            .entry(p.to_owned())
                            .or_insert_with(|| Regex::new(p).expect("schema pattern compiles"));
                        if !re.is_match(text) {
                            out.push(format!("{path}: {text:?} does not match {p}"));
                        }
                    }
                }
                "anyOf" => {
                    let any = kw.as_array().expect("anyOf array").iter().any(|sub| {
                        let mut sub_out = Vec::new();
                        self.check(sub, v, path, &mut sub_out);
                        sub_out.is_empty()
                    });
                    if !any {
                        out.push(format!("{path}: {v} matches none of anyOf"));
                    }
                }
                other => panic!("schema keyword {other:?} at {path} is not supported"),
            }
        }
    }
}
