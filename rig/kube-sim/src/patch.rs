//! The patch formats the API server accepts: JSON merge patch (RFC 7386, `json_patch::merge`),
//! strategic merge patch (merge patch plus merging of lists of named items, as kubectl's
//! client-side apply sends it for built-in types), and JSON patch (RFC 6902, by the
//! `json-patch` crate).

use serde_json::{Map, Value};

/// Strategic merge patch, for the shapes kubectl sends: like a merge patch, but lists whose items
/// are objects with a `name` (containers, volumes, ports, env) or `type` (conditions) merge
/// item by item; `$patch: delete` items are removed, `$setElementOrder/…`, `$retainKeys` and
/// `$deleteFromPrimitiveList/…` directives are honoured or dropped.
pub fn strategic(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut clean = p.clone();
        clean.remove("$patch");
        *target = Value::Object(clean);
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else { return };
    if let Some(Value::Array(keep)) = p.get("$retainKeys") {
        let keep: Vec<&str> = keep.iter().filter_map(Value::as_str).collect();
        t.retain(|k, _| keep.contains(&k.as_str()) || p.contains_key(k));
    }
    for (k, v) in p {
        if k.starts_with('$') {
            if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/")
                && let (Some(Value::Array(list)), Value::Array(del)) = (t.get_mut(field), v)
            {
                list.retain(|x| !del.contains(x));
            }
            continue;
        }
        if v.is_null() {
            t.remove(k);
            continue;
        }
        match (t.get_mut(k), v) {
            (Some(Value::Array(cur)), Value::Array(items)) if list_key(items).is_some() => {
                let key = list_key(items).unwrap_or("name");
                for item in items {
                    let id = item.get(key).cloned();
                    let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
                    let pos = cur.iter().position(|c| c.get(key) == id.as_ref());
                    match (pos, delete) {
                        (Some(i), true) => {
                            cur.remove(i);
                        }
                        (None, true) => {}
                        (Some(i), false) => strategic(&mut cur[i], item),
                        (None, false) => {
                            let mut fresh = Value::Null;
                            strategic(&mut fresh, item);
                            cur.push(fresh);
                        }
                    }
                }
                if let Some(Value::Array(order)) = p.get(&format!("$setElementOrder/{k}")) {
                    let mut ordered = Vec::with_capacity(cur.len());
                    for o in order {
                        if let Some(i) = cur.iter().position(|c| c.get(key) == o.get(key)) {
                            ordered.push(cur.remove(i));
                        }
                    }
                    ordered.append(cur);
                    *cur = ordered;
                }
            }
            (Some(cur), _) => strategic(cur, v),
            (None, _) => {
                let mut fresh = Value::Null;
                strategic(&mut fresh, v);
                t.insert(k.clone(), fresh);
            }
        }
    }
}

fn list_key(items: &[Value]) -> Option<&'static str> {
    let first = items.first()?.as_object()?;
    [
        "name",
        "type",
        "containerPort",
        "port",
        "ip",
        "mountPath",
        "devicePath",
    ]
    .into_iter()
    .find(|k| first.contains_key(*k))
}

/// Why a JSON patch was refused, as the API server answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JsonPatchError {
    /// The body is not a list of objects (`400 BadRequest`: the API server cannot decode it).
    Malformed(String),
    /// An operation is unknown, lacks a field, or does not apply to the object (`422
    /// Invalid`); nothing was changed.
    Failed(String),
}

/// RFC 6902 JSON patch (`add`, `remove`, `replace`, `move`, `copy`, `test`), by `json-patch`:
/// all operations or none.
pub fn json_patch(target: &mut Value, ops: &Value) -> Result<(), JsonPatchError> {
    if !ops
        .as_array()
        .is_some_and(|list| list.iter().all(Value::is_object))
    {
        return Err(JsonPatchError::Malformed(
            "the JSON patch must be a list of operations".to_owned(),
        ));
    }
    let ops: json_patch::Patch = serde_json::from_value(ops.clone())
        .map_err(|e| JsonPatchError::Failed(format!("invalid JSON patch operation: {e}")))?;
    json_patch::patch(target, &ops).map_err(|e| JsonPatchError::Failed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut t = json!({"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]});
        json_patch::merge(&mut t, &json!({"a": null, "b": {"c": 5}, "l": [3]}));
        assert_eq!(t, json!({"b": {"c": 5, "d": 3}, "l": [3]}));
    }

    #[test]
    fn strategic_merge_merges_named_lists() {
        let mut t = json!({"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}]}});
        strategic(
            &mut t,
            &json!({"spec": {"containers": [{"name": "b", "image": "z"}, {"name": "a", "$patch": "delete"}]}}),
        );
        assert_eq!(
            t,
            json!({"spec": {"containers": [{"name": "b", "image": "z"}]}})
        );
    }

    #[test]
    fn json_patch_ops() {
        let mut t = json!({"metadata": {"labels": {"a": "1"}}, "l": [1]});
        json_patch(
            &mut t,
            &json!([
                {"op": "add", "path": "/metadata/labels/b~1c", "value": "2"},
                {"op": "remove", "path": "/metadata/labels/a"},
                {"op": "add", "path": "/l/-", "value": 2},
                {"op": "test", "path": "/l/1", "value": 2}
            ]),
        )
        .unwrap();
        assert_eq!(
            t,
            json!({"metadata": {"labels": {"b/c": "2"}}, "l": [1, 2]})
        );
        assert!(json_patch(&mut t, &json!([{"op": "remove", "path": "/nope"}])).is_err());
    }
}
