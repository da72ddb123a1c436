//! The few REST calls the simulation makes, on JSON values, through a `kube::Client`.
//!
//! Every write asks for `fieldValidation=Strict`, so the API server refuses a field its schema
//! does not know instead of dropping it silently, and every update is a JSON merge patch that
//! carries the `resourceVersion` it was computed from: a concurrent change answers 409, and
//! [`Rest::update`] re-reads the object and computes the change again.

use std::fmt::Write as _;

use http::{Method, Request};
use serde_json::{Map, Value, json};

use crate::Error;

/// The kinds of object the simulation reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Vm,
    Vmi,
    Pod,
    Pvc,
    Secret,
    ConfigMap,
    Node,
    Service,
    ApiService,
    SubjectAccessReview,
}

impl Kind {
    fn collection(self, ns: &str) -> String {
        match self {
            Kind::Vm => format!("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"),
            Kind::Vmi => format!("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"),
            Kind::Pod => format!("/api/v1/namespaces/{ns}/pods"),
            Kind::Pvc => format!("/api/v1/namespaces/{ns}/persistentvolumeclaims"),
            Kind::Secret => format!("/api/v1/namespaces/{ns}/secrets"),
            Kind::ConfigMap => format!("/api/v1/namespaces/{ns}/configmaps"),
            Kind::Node => "/api/v1/nodes".to_owned(),
            Kind::Service => format!("/api/v1/namespaces/{ns}/services"),
            Kind::ApiService => "/apis/apiregistration.k8s.io/v1/apiservices".to_owned(),
            Kind::SubjectAccessReview => {
                "/apis/authorization.k8s.io/v1/subjectaccessreviews".to_owned()
            }
        }
    }

    /// A short name for logs and errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Vm => "VirtualMachine",
            Kind::Vmi => "VirtualMachineInstance",
            Kind::Pod => "Pod",
            Kind::Pvc => "PersistentVolumeClaim",
            Kind::Secret => "Secret",
            Kind::ConfigMap => "ConfigMap",
            Kind::Node => "Node",
            Kind::Service => "Service",
            Kind::ApiService => "APIService",
            Kind::SubjectAccessReview => "SubjectAccessReview",
        }
    }
}

/// Which part of an object a write goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The object itself (metadata, spec); the server ignores `status` here.
    Main,
    /// The `/status` subresource; the server ignores everything but `status` here.
    Status,
}

/// Most attempts of one update under conflicts.
const CONFLICT_ATTEMPTS: usize = 10;

/// REST calls on JSON values.
#[derive(Clone)]
pub(crate) struct Rest {
    client: kube::Client,
}

impl Rest {
    pub(crate) fn new(client: kube::Client) -> Self {
        Self { client }
    }

    async fn call(
        &self,
        method: Method,
        path: String,
        content_type: &str,
        body: Option<&Value>,
    ) -> Result<Value, Error> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| Error::Encode(e.to_string()))?,
            None => Vec::new(),
        };
        let req = Request::builder()
            .method(method.clone())
            .uri(&path)
            .header(http::header::CONTENT_TYPE, content_type)
            .header(http::header::ACCEPT, "application/json")
            .body(bytes)
            .map_err(|e| Error::Encode(e.to_string()))?;
        self.client
            .request::<Value>(req)
            .await
            .map_err(|source| Error::from_kube(method.as_str(), &path, source))
    }

    /// The object, or `None` if it does not exist.
    pub(crate) async fn get(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
    ) -> Result<Option<Value>, Error> {
        let path = format!("{}/{name}", kind.collection(ns));
        match self.call(Method::GET, path, "application/json", None).await {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every object of `kind` in `ns` matching `label_selector`.
    pub(crate) async fn list(
        &self,
        kind: Kind,
        ns: &str,
        label_selector: &str,
    ) -> Result<Vec<Value>, Error> {
        let mut items = Vec::new();
        let mut cont = String::new();
        loop {
            let mut path = format!(
                "{}?labelSelector={}&limit=500",
                kind.collection(ns),
                encode(label_selector)
            );
            if !cont.is_empty() {
                let _ = write!(path, "&continue={}", encode(&cont));
            }
            let list = self
                .call(Method::GET, path, "application/json", None)
                .await?;
            if let Some(page) = list["items"].as_array() {
                items.extend(page.iter().cloned());
            }
            match list["metadata"]["continue"].as_str() {
                Some(c) if !c.is_empty() => cont = c.to_owned(),
                _ => return Ok(items),
            }
        }
    }

    /// Creates `body` in `ns` (strict field validation) and returns the stored object.
    pub(crate) async fn create(&self, kind: Kind, ns: &str, body: &Value) -> Result<Value, Error> {
        let path = format!("{}?fieldValidation=Strict", kind.collection(ns));
        self.call(Method::POST, path, "application/json", Some(body))
            .await
    }

    /// Posts `body` to a subresource of an object (a pod's `binding`).
    pub(crate) async fn post_sub(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
        sub: &str,
        body: &Value,
    ) -> Result<Value, Error> {
        let path = format!(
            "{}/{name}/{sub}?fieldValidation=Strict",
            kind.collection(ns)
        );
        self.call(Method::POST, path, "application/json", Some(body))
            .await
    }

    /// A JSON merge patch (strict field validation).
    pub(crate) async fn patch(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
        part: Part,
        patch: &Value,
    ) -> Result<Value, Error> {
        let sub = match part {
            Part::Main => "",
            Part::Status => "/status",
        };
        let path = format!("{}/{name}{sub}?fieldValidation=Strict", kind.collection(ns));
        self.call(
            Method::PATCH,
            path,
            "application/merge-patch+json",
            Some(patch),
        )
        .await
    }

    /// Deletes an object (an absent one counts as deleted). `grace` overrides the object's
    /// grace period; `uid` makes the call apply only to that incarnation of the name.
    pub(crate) async fn delete(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
        grace: Option<i64>,
        uid: Option<&str>,
    ) -> Result<(), Error> {
        let mut opts = json!({"apiVersion": "v1", "kind": "DeleteOptions"});
        if let Some(g) = grace {
            opts["gracePeriodSeconds"] = Value::from(g);
        }
        if let Some(u) = uid {
            opts["preconditions"] = json!({"uid": u});
        }
        let path = format!("{}/{name}", kind.collection(ns));
        match self
            .call(Method::DELETE, path, "application/json", Some(&opts))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            // The uid precondition failed: the name now belongs to another object.
            Err(e) if e.is_conflict() && uid.is_some() => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads the object, lets `change` compute its new form from the current one (`None`: no
    /// change wanted), and writes the difference to `part` as a merge patch guarded by the
    /// resourceVersion it read. On a conflict it reads again and recomputes. Returns the
    /// object as written (or as read, when nothing changed), or `None` if it does not exist.
    pub(crate) async fn update(
        &self,
        kind: Kind,
        ns: &str,
        name: &str,
        part: Part,
        change: impl Fn(&Value) -> Option<Value>,
    ) -> Result<Option<Value>, Error> {
        let mut last = None;
        for _ in 0..CONFLICT_ATTEMPTS {
            let Some(cur) = self.get(kind, ns, name).await? else {
                return Ok(None);
            };
            let Some(new) = change(&cur) else {
                return Ok(Some(cur));
            };
            let Some(mut patch) = part_patch(&cur, &new, part) else {
                return Ok(Some(cur));
            };
            patch["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
            match self.patch(kind, ns, name, part, &patch).await {
                Ok(v) => return Ok(Some(v)),
                Err(e) if e.is_conflict() => {
                    tracing::debug!(kind = kind.name(), ns, name, "conflict; reading again");
                    last = Some(e);
                }
                Err(e) if e.is_not_found() => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::Encode("no attempt made".into())))
    }
}

/// The merge patch taking `cur` to `new`, restricted to what `part` writes, or `None` when
/// they do not differ there.
fn part_patch(cur: &Value, new: &Value, part: Part) -> Option<Value> {
    let mut patch = Map::new();
    match part {
        Part::Status => {
            let d = merge_diff(&cur["status"], &new["status"])?;
            patch.insert("status".into(), d);
        }
        Part::Main => {
            for key in ["metadata", "spec"] {
                if let Some(d) = merge_diff(&cur[key], &new[key]) {
                    patch.insert(key.into(), d);
                }
            }
            if patch.is_empty() {
                return None;
            }
        }
    }
    Some(Value::Object(patch))
}

/// The RFC 7386 merge patch that turns `old` into `new`, or `None` if they are equal.
pub(crate) fn merge_diff(old: &Value, new: &Value) -> Option<Value> {
    if old == new {
        return None;
    }
    match (old, new) {
        (Value::Object(o), Value::Object(n)) => {
            let mut out = Map::new();
            for (k, nv) in n {
                match o.get(k) {
                    Some(ov) => {
                        if let Some(d) = merge_diff(ov, nv) {
                            out.insert(k.clone(), d);
                        }
                    }
                    None if nv.is_null() => {}
                    None => {
                        out.insert(k.clone(), nv.clone());
                    }
                }
            }
            for k in o.keys() {
                if !n.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            if out.is_empty() {
                None
            } else {
                Some(Value::Object(out))
            }
        }
        _ => Some(new.clone()),
    }
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_diff_sets_changes_and_nulls_removals() {
        let old = json!({"a": 1, "b": {"c": 2, "d": 3}, "e": [1], "f": "x"});
        let new = json!({"a": 1, "b": {"c": 2, "d": 4}, "e": [1, 2], "g": true});
        assert_eq!(
            merge_diff(&old, &new),
            Some(json!({"b": {"d": 4}, "e": [1, 2], "g": true, "f": null}))
        );
        assert_eq!(merge_diff(&old, &old), None);
    }

    #[test]
    fn part_patch_keeps_to_its_part() {
        let cur = json!({"metadata": {"name": "x", "finalizers": ["a"]}, "spec": {}, "status": {"phase": "Pending"}});
        let mut new = cur.clone();
        new["status"]["phase"] = json!("Running");
        new["metadata"]["finalizers"] = json!([]);
        assert_eq!(
            part_patch(&cur, &new, Part::Status),
            Some(json!({"status": {"phase": "Running"}}))
        );
        assert_eq!(
            part_patch(&cur, &new, Part::Main),
            Some(json!({"metadata": {"finalizers": []}}))
        );
        assert_eq!(part_patch(&cur, &cur, Part::Main), None);
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(
            encode("kubevirt.io/created-by=a b"),
            "kubevirt.io%2Fcreated-by%3Da%20b"
        );
    }
}
