//! Admission checks on request bodies, as the real API server and KubeVirt's webhook do them:
//! names and labels, unknown fields (pruned, or rejected under `fieldValidation=Strict`),
//! types, required fields, enums and schema defaults for the custom resources (against the
//! embedded upstream structural schemas), decoding through `k8s-openapi` for built-in types,
//! and the KubeVirt webhook rules the schema does not hold (run strategy values).

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde_json::{Map, Value};

use crate::resources::{NameRule, ResourceType, SchemaSource};
use crate::status::ApiError;

/// The `fieldValidation` query parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldValidation {
    /// Unknown fields are an error (400).
    Strict,
    /// Unknown fields are dropped and reported in a `Warning` header (the server default).
    Warn,
    /// Unknown fields are dropped silently.
    Ignore,
}

impl FieldValidation {
    /// Parses the query parameter (absent means [`FieldValidation::Warn`]).
    pub fn parse(v: Option<&str>) -> Result<Self, ApiError> {
        match v {
            None | Some("") | Some("Warn") => Ok(Self::Warn),
            Some("Strict") => Ok(Self::Strict),
            Some("Ignore") => Ok(Self::Ignore),
            Some(other) => Err(ApiError::bad_request(format!(
                "fieldValidation parameter unsupported: {other}; valid values are Ignore, Warn, Strict"
            ))),
        }
    }
}

type Cause = (String, String, String);

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1035_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')";

/// The shape of an RFC 1123 label (lower-case alphanumerics and `-`, alphanumeric at both
/// ends), of any length: apimachinery's subdomain regex repeats it between dots with no limit
/// of its own, only the whole name's 253.
fn is_label_shaped(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

fn is_label(s: &str) -> bool {
    s.len() <= 63 && is_label_shaped(s)
}

/// Why a name is invalid for a rule, if it is.
pub fn name_errors(name: &str, rule: NameRule) -> Option<String> {
    match rule {
        NameRule::Subdomain => {
            if name.len() > 253 {
                Some("must be no more than 253 characters".into())
            } else if name.split('.').all(is_label_shaped) {
                None
            } else {
                Some(SUBDOMAIN_MSG.into())
            }
        }
        NameRule::Label => {
            if name.len() > 63 {
                Some("must be no more than 63 characters".into())
            } else if is_label(name) {
                None
            } else {
                Some(LABEL_MSG.into())
            }
        }
        NameRule::Dns1035 => {
            if name.len() > 63 {
                Some("must be no more than 63 characters".into())
            } else if is_label(name) && name.as_bytes()[0].is_ascii_lowercase() {
                None
            } else {
                Some(DNS1035_MSG.into())
            }
        }
    }
}

fn is_qualified_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Why a label key is invalid, if it is.
pub fn label_key_errors(key: &str) -> Option<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.len() > 253 || !p.split('.').all(is_label))
    {
        return Some(format!("prefix part {SUBDOMAIN_MSG}"));
    }
    if !is_qualified_name(name) {
        return Some("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')".into());
    }
    None
}

/// Why a label value is invalid, if it is.
pub fn label_value_errors(v: &str) -> Option<String> {
    if v.is_empty() || is_qualified_name(v) {
        None
    } else if v.len() > 63 {
        Some("must be no more than 63 characters".into())
    } else {
        Some("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')".into())
    }
}

/// Checks `metadata` (name, labels, annotations) and returns the causes of a 422.
pub fn metadata_causes(t: &ResourceType, meta: &Value, name: &str) -> Vec<Cause> {
    let mut causes = Vec::new();
    if let Some(e) = name_errors(name, t.name_rule) {
        causes.push((
            "FieldValueInvalid".into(),
            format!("metadata.name: Invalid value: {name:?}: {e}"),
            "metadata.name".into(),
        ));
    }
    match meta.get("labels") {
        None | Some(Value::Null) => {}
        Some(Value::Object(labels)) => {
            for (k, v) in labels {
                if let Some(e) = label_key_errors(k) {
                    causes.push((
                        "FieldValueInvalid".into(),
                        format!("metadata.labels: Invalid value: {k:?}: {e}"),
                        "metadata.labels".into(),
                    ));
                }
                match v.as_str() {
                    Some(s) => {
                        if let Some(e) = label_value_errors(s) {
                            causes.push((
                                "FieldValueInvalid".into(),
                                format!("metadata.labels: Invalid value: {s:?}: {e}"),
                                "metadata.labels".into(),
                            ));
                        }
                    }
                    None => causes.push((
                        "FieldValueInvalid".into(),
                        "metadata.labels: Invalid value: label values must be strings".into(),
                        "metadata.labels".into(),
                    )),
                }
            }
        }
        Some(_) => causes.push((
            "FieldValueInvalid".into(),
            "metadata.labels: Invalid value: must be a map of strings".into(),
            "metadata.labels".into(),
        )),
    }
    causes
}

/// The known fields of `ObjectMeta` (anything else is unknown).
const META_FIELDS: &[&str] = &[
    "name",
    "generateName",
    "namespace",
    "selfLink",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "labels",
    "annotations",
    "ownerReferences",
    "finalizers",
    "managedFields",
];
const OWNER_FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "name",
    "uid",
    "controller",
    "blockOwnerDeletion",
];

/// The outcome of checking a body: the cleaned object, or why it is refused.
#[derive(Debug)]
pub struct Checked {
    /// The object with unknown fields pruned and schema defaults applied.
    pub object: Value,
    /// Unknown fields that were dropped (for the `Warning` header).
    pub warnings: Vec<String>,
}

/// Checks a full object body of type `t` (named `name` for messages).
pub fn check_object(
    t: &ResourceType,
    mut object: Value,
    name: &str,
    mode: FieldValidation,
) -> Result<Checked, ApiError> {
    let mut unknown = Vec::new();
    let mut causes = Vec::new();
    // ObjectMeta first: the same for every type.
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        prune_keys(meta, META_FIELDS, "metadata", &mut unknown);
        if let Some(Value::Array(refs)) = meta.get_mut("ownerReferences") {
            for (i, r) in refs.iter_mut().enumerate() {
                if let Some(r) = r.as_object_mut() {
                    prune_keys(
                        r,
                        OWNER_FIELDS,
                        &format!("metadata.ownerReferences[{i}]"),
                        &mut unknown,
                    );
                }
            }
        }
    }
    match t.schema {
        SchemaSource::Crd(key) => {
            let schema = crd_schema(key);
            let props = schema.get("properties").and_then(Value::as_object);
            if let Some(obj) = object.as_object_mut() {
                for (k, v) in obj.iter_mut() {
                    if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
                        continue;
                    }
                    if let Some(s) = props.and_then(|p| p.get(k)) {
                        walk(s, v, k, &mut unknown, &mut causes);
                    }
                }
                let unknown_top: Vec<String> = obj
                    .keys()
                    .filter(|k| props.is_none_or(|p| !p.contains_key(*k)))
                    .cloned()
                    .collect();
                for k in unknown_top {
                    obj.remove(&k);
                    unknown.push(k);
                }
                apply_defaults_and_required(schema, obj, "", &mut causes);
            }
            if t.kind == "VirtualMachine" {
                causes.extend(vm_webhook_causes(&object));
                if !causes.is_empty()
                    && causes
                        .iter()
                        .all(|c| c.2 == "spec.runStrategy" || c.2 == "spec.running")
                    && !unknown_strict(mode, &unknown)
                {
                    let msg = causes
                        .iter()
                        .map(|c| c.1.clone())
                        .collect::<Vec<_>>()
                        .join(", ");
                    let mut e = ApiError::new(
                        422,
                        "Invalid",
                        format!(
                            "admission webhook \"virtualmachine-validator.kubevirt.io\" denied the request: {msg}"
                        ),
                    );
                    e.details.causes = causes;
                    return Err(e);
                }
            }
        }
        SchemaSource::Builtin => {
            if let Err(e) = builtin_roundtrip(t, &mut object, &mut unknown) {
                return Err(ApiError::bad_request(format!(
                    "{} in version \"{}\" cannot be handled as a {}: {e}",
                    t.kind, t.version, t.kind
                )));
            }
            causes.extend(builtin_causes(t, &object));
        }
    }
    if mode == FieldValidation::Strict && !unknown.is_empty() {
        let list = unknown
            .iter()
            .map(|u| format!("unknown field \"{u}\""))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(ApiError::bad_request(format!(
            "{} in version \"{}\" cannot be handled as a {}: strict decoding error: {list}",
            t.kind, t.version, t.kind
        )));
    }
    if !causes.is_empty() {
        return Err(ApiError::invalid(
            t.group,
            &t.qualified_kind(),
            t.plural,
            name,
            causes,
        ));
    }
    let warnings = if mode == FieldValidation::Warn {
        unknown
            .into_iter()
            .map(|u| format!("unknown field \"{u}\""))
            .collect()
    } else {
        Vec::new()
    };
    Ok(Checked { object, warnings })
}

fn unknown_strict(mode: FieldValidation, unknown: &[String]) -> bool {
    mode == FieldValidation::Strict && !unknown.is_empty()
}

fn prune_keys(obj: &mut Map<String, Value>, known: &[&str], path: &str, unknown: &mut Vec<String>) {
    let bad: Vec<String> = obj
        .keys()
        .filter(|k| !known.contains(&k.as_str()))
        .cloned()
        .collect();
    for k in bad {
        obj.remove(&k);
        unknown.push(format!("{path}.{k}"));
    }
}

fn crd_schema(key: &str) -> &'static Value {
    static SCHEMAS: OnceLock<BTreeMap<&'static str, Value>> = OnceLock::new();
    let all = SCHEMAS.get_or_init(|| {
        let parse = |s: &str| serde_json::from_str::<Value>(s).unwrap_or(Value::Null);
        BTreeMap::from([
            (
                "virtualmachine",
                parse(include_str!("../schemas/virtualmachine.v1.schema.json")),
            ),
            (
                "virtualmachineinstance",
                parse(include_str!(
                    "../schemas/virtualmachineinstance.v1.schema.json"
                )),
            ),
            (
                "datavolume",
                parse(include_str!("../schemas/datavolume.v1beta1.schema.json")),
            ),
            (
                "datasource",
                parse(include_str!("../schemas/datasource.v1beta1.schema.json")),
            ),
        ])
    });
    all.get(key).unwrap_or(&Value::Null)
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn walk(
    schema: &Value,
    v: &mut Value,
    path: &str,
    unknown: &mut Vec<String>,
    causes: &mut Vec<Cause>,
) {
    let flag = |k: &str| schema.get(k).and_then(Value::as_bool).unwrap_or(false);
    if v.is_null() {
        if !flag("nullable") {
            // The real server drops explicit nulls of non-nullable fields when pruning; keep
            // that lenient behaviour.
        }
        return;
    }
    if flag("x-kubernetes-int-or-string") {
        if !matches!(type_name(v), "integer" | "string") {
            causes.push(type_cause(path, v, "integer-or-string"));
        }
        return;
    }
    let want = schema.get("type").and_then(Value::as_str);
    if let Some(want) = want {
        let got = type_name(v);
        let ok = got == want || (want == "number" && got == "integer");
        if !ok {
            causes.push(type_cause(path, v, want));
            return;
        }
    }
    if let Some(values) = schema.get("enum").and_then(Value::as_array)
        && !values.contains(v)
    {
        let list = values
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        causes.push((
            "FieldValueNotSupported".into(),
            format!("{path}: Unsupported value: {v}: supported values: {list}"),
            path.to_owned(),
        ));
    }
    match v {
        Value::Object(obj) => {
            let preserve = flag("x-kubernetes-preserve-unknown-fields");
            if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                let mut bad = Vec::new();
                for (k, child) in obj.iter_mut() {
                    match props.get(k) {
                        Some(s) => walk(s, child, &format!("{path}.{k}"), unknown, causes),
                        None if !preserve => bad.push(k.clone()),
                        None => {}
                    }
                }
                for k in bad {
                    obj.remove(&k);
                    unknown.push(format!("{path}.{k}"));
                }
                apply_defaults_and_required(schema, obj, path, causes);
            } else if let Some(add) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for (k, child) in obj.iter_mut() {
                    walk(add, child, &format!("{path}.{k}"), unknown, causes);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for (i, item) in items.iter_mut().enumerate() {
                    walk(s, item, &format!("{path}[{i}]"), unknown, causes);
                }
            }
        }
        _ => {}
    }
}

fn apply_defaults_and_required(
    schema: &Value,
    obj: &mut Map<String, Value>,
    path: &str,
    causes: &mut Vec<Cause>,
) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_owned()
        } else {
            format!("{path}.{k}")
        }
    };
    if let Some(props) = schema.get("properties").and_then(Value::as_object) {
        for (k, s) in props {
            if !obj.contains_key(k)
                && let Some(d) = s.get("default")
            {
                obj.insert(k.clone(), d.clone());
            }
        }
    }
    if let Some(req) = schema.get("required").and_then(Value::as_array) {
        for k in req.iter().filter_map(Value::as_str) {
            if obj.get(k).is_none_or(Value::is_null) {
                let p = join(k);
                causes.push((
                    "FieldValueRequired".into(),
                    format!("{p}: Required value"),
                    p,
                ));
            }
        }
    }
}

fn type_cause(path: &str, v: &Value, want: &str) -> Cause {
    let got = type_name(v);
    (
        "FieldValueTypeInvalid".into(),
        format!(
            "{path}: Invalid value: \"{got}\": {path} in body must be of type {want}: \"{got}\""
        ),
        path.to_owned(),
    )
}

const RUN_STRATEGIES: &[&str] = &["Always", "Halted", "Manual", "RerunOnFailure", "Once"];

fn vm_webhook_causes(vm: &Value) -> Vec<Cause> {
    let spec = &vm["spec"];
    let mut causes = Vec::new();
    let rs = spec.get("runStrategy").and_then(Value::as_str);
    let running = spec.get("running").filter(|v| !v.is_null());
    if rs.is_some() && running.is_some() {
        causes.push((
            "FieldValueInvalid".into(),
            "Running and RunStrategy are mutually exclusive. Note that Running is deprecated, please use RunStrategy instead".into(),
            "spec.running".into(),
        ));
    }
    if rs.is_none() && running.is_none() && spec.is_object() {
        causes.push((
            "FieldValueRequired".into(),
            "RunStrategy must be specified".into(),
            "spec.runStrategy".into(),
        ));
    }
    if let Some(rs) = rs
        && !RUN_STRATEGIES.contains(&rs)
    {
        causes.push((
            "FieldValueInvalid".into(),
            format!("Invalid RunStrategy ({rs})"),
            "spec.runStrategy".into(),
        ));
    }
    causes
}

fn builtin_roundtrip(
    t: &ResourceType,
    object: &mut Value,
    unknown: &mut Vec<String>,
) -> Result<(), String> {
    use k8s_openapi::api::core::v1 as core;
    use k8s_openapi::api::networking::v1 as net;
    fn rt<T: serde::de::DeserializeOwned + serde::Serialize>(v: &Value) -> Result<Value, String> {
        let typed: T = serde_json::from_value(v.clone()).map_err(|e| e.to_string())?;
        serde_json::to_value(typed).map_err(|e| e.to_string())
    }
    let back = match t.kind {
        "Namespace" => rt::<core::Namespace>(object)?,
        "Secret" => rt::<core::Secret>(object)?,
        "ConfigMap" => rt::<core::ConfigMap>(object)?,
        "Pod" => rt::<core::Pod>(object)?,
        "Service" => rt::<core::Service>(object)?,
        "PersistentVolumeClaim" => rt::<core::PersistentVolumeClaim>(object)?,
        "ResourceQuota" => rt::<core::ResourceQuota>(object)?,
        "Node" => rt::<core::Node>(object)?,
        "NetworkPolicy" => rt::<net::NetworkPolicy>(object)?,
        other => return Err(format!("no decoder for {other}")),
    };
    prune_against(object, &back, "", unknown);
    Ok(())
}

/// Removes from `input` every non-null field that decoding dropped (an unknown field).
fn prune_against(input: &mut Value, back: &Value, path: &str, unknown: &mut Vec<String>) {
    match (input, back) {
        (Value::Object(a), Value::Object(b)) => {
            let mut bad = Vec::new();
            for (k, v) in a.iter_mut() {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                if p == "metadata" {
                    continue;
                }
                match b.get(k) {
                    Some(bv) => prune_against(v, bv, &p, unknown),
                    None if v.is_null() => {}
                    None => bad.push((k.clone(), p)),
                }
            }
            for (k, p) in bad {
                a.remove(&k);
                unknown.push(p);
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            for (i, (x, y)) in a.iter_mut().zip(b).enumerate() {
                prune_against(x, y, &format!("{path}[{i}]"), unknown);
            }
        }
        _ => {}
    }
}

/// The 1 MiB limit on a Secret's data, as the API server enforces it.
pub const SECRET_MAX_BYTES: usize = 1024 * 1024;

fn builtin_causes(t: &ResourceType, object: &Value) -> Vec<Cause> {
    let mut causes = Vec::new();
    match t.kind {
        "Secret" => {
            use base64::Engine as _;
            let mut total = 0usize;
            if let Some(data) = object.get("data").and_then(Value::as_object) {
                for v in data.values() {
                    total += v
                        .as_str()
                        .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                        .map_or(0, |b| b.len());
                }
            }
            if let Some(data) = object.get("stringData").and_then(Value::as_object) {
                for v in data.values() {
                    total += v.as_str().map_or(0, str::len);
                }
            }
            if total > SECRET_MAX_BYTES {
                causes.push((
                    "FieldValueTooLong".into(),
                    format!("data: Too long: must have at most {SECRET_MAX_BYTES} bytes"),
                    "data".into(),
                ));
            }
        }
        "ConfigMap" => {
            use base64::Engine as _;
            let mut total = 0usize;
            if let Some(data) = object.get("data").and_then(Value::as_object) {
                total += data
                    .iter()
                    .map(|(k, v)| k.len() + v.as_str().map_or(0, str::len))
                    .sum::<usize>();
            }
            if let Some(data) = object.get("binaryData").and_then(Value::as_object) {
                for (k, v) in data {
                    total += k.len()
                        + v.as_str()
                            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
                            .map_or(0, |b| b.len());
                }
            }
            if total > SECRET_MAX_BYTES {
                causes.push((
                    "FieldValueTooLong".into(),
                    format!("[]: Too long: must have at most {SECRET_MAX_BYTES} bytes"),
                    String::new(),
                ));
            }
        }
        "Pod" => {
            let containers = object["spec"]["containers"].as_array();
            if containers.is_none_or(Vec::is_empty) {
                causes.push((
                    "FieldValueRequired".into(),
                    "spec.containers: Required value".into(),
                    "spec.containers".into(),
                ));
            }
            for (i, c) in containers.into_iter().flatten().enumerate() {
                if c["image"].as_str().is_none_or(str::is_empty) {
                    let p = format!("spec.containers[{i}].image");
                    causes.push((
                        "FieldValueRequired".into(),
                        format!("{p}: Required value"),
                        p,
                    ));
                }
            }
        }
        _ => {}
    }
    causes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{SECRETS, TYPES, VMS};
    use serde_json::json;

    fn example(name: &str) -> Value {
        let text =
            std::fs::read_to_string(format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR")))
                .unwrap_or_default();
        serde_norway::from_str(&text).unwrap_or(Value::Null)
    }

    #[test]
    fn names_follow_the_rules() {
        assert!(name_errors("lab-1", NameRule::Label).is_none());
        assert!(name_errors("Lab_1", NameRule::Label).is_some());
        assert!(name_errors("a.b", NameRule::Subdomain).is_none());
        assert!(name_errors("a.b", NameRule::Label).is_some());
        assert!(name_errors("1abc", NameRule::Dns1035).is_some());
        assert!(name_errors(&"a".repeat(64), NameRule::Label).is_some());
        // A subdomain's parts are not labels of at most 63: only the whole is limited.
        let long = format!("virt-launcher-tt-{}-worker-1-v4rnf", "c".repeat(32));
        assert_eq!(long.len(), 64);
        assert!(name_errors(&long, NameRule::Subdomain).is_none());
        assert!(name_errors(&"a".repeat(253), NameRule::Subdomain).is_none());
        assert!(name_errors(&"a".repeat(254), NameRule::Subdomain).is_some());
        assert!(name_errors("a..b", NameRule::Subdomain).is_some());
    }

    #[test]
    fn valid_vm_passes_and_misspelt_secret_ref_is_caught_only_when_strict() {
        let t = &TYPES[VMS];
        let ok = example("vm-valid-ephemeral-pvc.yaml");
        assert!(check_object(t, ok, "lab-abc123", FieldValidation::Strict).is_ok());
        let bad = example("vm-invalid-userdatasecretref.yaml");
        let e = check_object(t, bad.clone(), "lab-abc123", FieldValidation::Strict).unwrap_err();
        assert_eq!(e.code, 400);
        assert!(
            e.message.contains(
                "unknown field \"spec.template.spec.volumes[1].cloudInitNoCloud.userDataSecretRef\""
            ),
            "{}",
            e.message
        );
        let warned = check_object(t, bad, "lab-abc123", FieldValidation::Warn).unwrap();
        assert_eq!(warned.warnings.len(), 1);
        assert!(
            warned.object["spec"]["template"]["spec"]["volumes"][1]["cloudInitNoCloud"]
                .get("userDataSecretRef")
                .is_none()
        );
    }

    #[test]
    fn vm_schema_and_webhook_rules_answer_422() {
        let t = &TYPES[VMS];
        for (file, needle) in [
            (
                "vm-invalid-no-template.yaml",
                "spec.template: Required value",
            ),
            (
                "vm-invalid-runstrategy-type.yaml",
                "spec.runStrategy in body must be of type string",
            ),
            (
                "vm-invalid-runstrategy.yaml",
                "Invalid RunStrategy (Sometimes)",
            ),
        ] {
            let e =
                check_object(t, example(file), "lab-abc123", FieldValidation::Strict).unwrap_err();
            assert_eq!(e.code, 422, "{file}");
            assert!(e.message.contains(needle), "{file}: {}", e.message);
        }
    }

    #[test]
    fn builtin_unknown_fields_and_bad_base64() {
        let t = &TYPES[SECRETS];
        let s = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "a"}, "data": {"k": "aGk="}, "strngData": {}});
        let e = check_object(t, s.clone(), "a", FieldValidation::Strict).unwrap_err();
        assert!(
            e.message.contains("unknown field \"strngData\""),
            "{}",
            e.message
        );
        assert!(
            check_object(t, s, "a", FieldValidation::Ignore)
                .unwrap()
                .object
                .get("strngData")
                .is_none()
        );
        let b = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "a"}, "data": {"k": "!!"}});
        assert_eq!(
            check_object(t, b, "a", FieldValidation::Strict)
                .unwrap_err()
                .code,
            400
        );
    }
}
