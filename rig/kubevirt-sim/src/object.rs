//! Reading and shaping Kubernetes objects held as JSON values: metadata accessors,
//! finalizers, owner references, conditions and timestamps.

use serde_json::{Value, json};

/// `metadata.<field>` as a string ("" when absent).
pub(crate) fn meta<'a>(obj: &'a Value, field: &str) -> &'a str {
    obj["metadata"][field].as_str().unwrap_or("")
}

pub(crate) fn uid(obj: &Value) -> &str {
    meta(obj, "uid")
}

pub(crate) fn name(obj: &Value) -> &str {
    meta(obj, "name")
}

/// The object has a deletionTimestamp.
pub(crate) fn deleting(obj: &Value) -> bool {
    obj["metadata"]["deletionTimestamp"].is_string()
}

pub(crate) fn has_finalizer(obj: &Value, f: &str) -> bool {
    obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|l| l.iter().any(|x| x == f))
}

/// A copy of `obj` with finalizer `f` added (at the end) or removed.
pub(crate) fn with_finalizer(obj: &Value, f: &str, present: bool) -> Value {
    let mut out = obj.clone();
    let mut list: Vec<Value> = obj["metadata"]["finalizers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    list.retain(|x| x != f);
    if present {
        list.push(Value::from(f));
    }
    if list.is_empty() {
        if let Some(m) = out["metadata"].as_object_mut() {
            m.remove("finalizers");
        }
    } else {
        out["metadata"]["finalizers"] = Value::Array(list);
    }
    out
}

/// Whether `obj` has a controller owner reference to the object with uid `owner_uid`.
pub(crate) fn controlled_by(obj: &Value, owner_uid: &str) -> bool {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter()
                .any(|r| r["uid"] == owner_uid && r["controller"] == true)
        })
}

/// A controller owner reference (`controller` and `blockOwnerDeletion` true), as
/// `metav1.NewControllerRef` makes it.
pub(crate) fn controller_ref(api_version: &str, kind: &str, owner: &Value) -> Value {
    json!({
        "apiVersion": api_version,
        "kind": kind,
        "name": name(owner),
        "uid": uid(owner),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

/// Now, as the API machinery writes times (RFC 3339, whole seconds, UTC).
pub(crate) fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Parses an RFC 3339 time.
pub(crate) fn parse_time(s: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::parse_from_rfc3339(s)
        .ok()
        .map(|t| t.with_timezone(&chrono::Utc))
}

/// The condition of `type_` in `conditions` (an array value), if any.
pub(crate) fn condition<'a>(conditions: &'a Value, type_: &str) -> Option<&'a Value> {
    conditions.as_array()?.iter().find(|c| c["type"] == type_)
}

/// Whether condition `type_` has status `True`.
pub(crate) fn condition_true(conditions: &Value, type_: &str) -> bool {
    condition(conditions, type_).is_some_and(|c| c["status"] == "True")
}

/// A condition to set with [`set_condition`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cond<'a> {
    pub type_: &'a str,
    pub status: bool,
    pub reason: &'a str,
    pub message: &'a str,
}

impl<'a> Cond<'a> {
    pub(crate) fn new(type_: &'a str, status: bool) -> Self {
        Self {
            type_,
            status,
            reason: "",
            message: "",
        }
    }

    pub(crate) fn because(mut self, reason: &'a str, message: &'a str) -> Self {
        self.reason = reason;
        self.message = message;
        self
    }
}

/// Sets a condition in `status[key]` (an array of conditions, created if absent). A condition
/// whose status, reason and message are unchanged is left as it is (times included), so
/// re-running a reconcile writes nothing; a changed one gets new times.
/// `probe_time` also writes `lastProbeTime` (KubeVirt's conditions carry it, pods' do not).
pub(crate) fn set_condition(status: &mut Value, key: &str, c: Cond<'_>, probe_time: bool) {
    if !status.is_object() {
        *status = json!({});
    }
    if !status[key].is_array() {
        status[key] = json!([]);
    }
    let Some(list) = status[key].as_array_mut() else {
        return;
    };
    let status_str = if c.status { "True" } else { "False" };
    let same = |old: &Value| {
        old["status"] == status_str
            && old["reason"].as_str().unwrap_or("") == c.reason
            && old["message"].as_str().unwrap_or("") == c.message
    };
    if let Some(old) = list.iter().find(|x| x["type"] == c.type_)
        && same(old)
    {
        return;
    }
    let t = now();
    let mut new = json!({"type": c.type_, "status": status_str, "lastTransitionTime": t});
    if probe_time {
        new["lastProbeTime"] = Value::from(t);
    }
    if !c.reason.is_empty() {
        new["reason"] = Value::from(c.reason);
    }
    if !c.message.is_empty() {
        new["message"] = Value::from(c.message);
    }
    match list.iter_mut().find(|x| x["type"] == c.type_) {
        Some(slot) => *slot = new,
        None => list.push(new),
    }
}

/// Removes condition `type_` from `status[key]`.
pub(crate) fn remove_condition(status: &mut Value, key: &str, type_: &str) {
    if let Some(list) = status[key].as_array_mut() {
        list.retain(|c| c["type"] != type_);
    }
}

/// The most of `s` worth logging or returning (API errors can quote a whole object).
pub(crate) fn clip(s: &str) -> String {
    const HEAD: usize = 300;
    const TAIL: usize = 900;
    if s.len() <= HEAD + TAIL {
        return s.to_owned();
    }
    let mut head = HEAD;
    while !s.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = s.len() - TAIL;
    while !s.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{} […{} bytes…] {}", &s[..head], tail - head, &s[tail..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finalizers_are_added_once_and_removed_with_the_list() {
        let o = json!({"metadata": {"name": "x"}});
        let a = with_finalizer(&o, "f", true);
        assert_eq!(a["metadata"]["finalizers"], json!(["f"]));
        assert_eq!(with_finalizer(&a, "f", true), a);
        let b = with_finalizer(&a, "f", false);
        assert!(b["metadata"].get("finalizers").is_none());
    }

    #[test]
    fn an_unchanged_condition_keeps_its_times() {
        let mut status = json!({});
        set_condition(&mut status, "conditions", Cond::new("Ready", false), true);
        let first = status.clone();
        set_condition(&mut status, "conditions", Cond::new("Ready", false), true);
        assert_eq!(status, first);
        set_condition(
            &mut status,
            "conditions",
            Cond::new("Ready", true).because("R", "m"),
            false,
        );
        let c = condition(&status["conditions"], "Ready").unwrap();
        assert_eq!(c["status"], "True");
        assert_eq!(c["reason"], "R");
        assert!(c.get("lastProbeTime").is_none());
        assert_eq!(status["conditions"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn long_messages_are_clipped_at_char_boundaries() {
        let s = "é".repeat(2000);
        let c = clip(&s);
        assert!(c.len() < s.len());
        assert!(c.contains("bytes"));
        assert_eq!(clip("short"), "short");
    }
}
