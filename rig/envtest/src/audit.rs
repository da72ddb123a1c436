//! The API server's audit log, read back as the calls each identity made.

use std::path::Path;

use serde::Deserialize;

use crate::EnvtestError;

/// One audit event (the fields the tests use).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuditEvent {
    /// `ResponseComplete`, `ResponseStarted` (watches) or `Panic`.
    pub stage: String,
    /// The RBAC verb the request was authorized as (`get`, `list`, `watch`, `create`, ...).
    pub verb: String,
    /// The request's path and query.
    #[serde(rename = "requestURI")]
    pub request_uri: String,
    /// Who made it.
    pub user: AuditUser,
    /// What it was about; absent for non-resource URLs (`/readyz`, `/apis`).
    #[serde(default)]
    pub object_ref: Option<ObjectRef>,
    /// The answer; absent while a watch is still open.
    #[serde(default)]
    pub response_status: Option<ResponseStatus>,
    /// The User-Agent header the client sent.
    #[serde(default)]
    pub user_agent: Option<String>,
    /// When the API server received the request (RFC 3339, microseconds).
    #[serde(default)]
    pub request_received_timestamp: Option<String>,
}

/// The authenticated user of an [`AuditEvent`].
#[derive(Debug, Clone, Deserialize)]
pub struct AuditUser {
    /// e.g. `system:serviceaccount:ttlab-dev:ttlab-server`.
    pub username: String,
}

/// The object an [`AuditEvent`] is about.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectRef {
    /// The resource (plural), e.g. `virtualmachines`.
    #[serde(default)]
    pub resource: Option<String>,
    /// The subresource, e.g. `exec`, `console`, `status`.
    #[serde(default)]
    pub subresource: Option<String>,
    /// The API group (`""` or absent for the core group).
    #[serde(default)]
    pub api_group: Option<String>,
    /// The namespace.
    #[serde(default)]
    pub namespace: Option<String>,
    /// The object's name, for calls on one object.
    #[serde(default)]
    pub name: Option<String>,
}

/// The answer's status of an [`AuditEvent`].
#[derive(Debug, Clone, Deserialize)]
pub struct ResponseStatus {
    /// The HTTP status code.
    #[serde(default)]
    pub code: Option<u16>,
}

/// One call in RBAC terms: what a Role rule would have to grant for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Call {
    /// The API group (`""` for the core group).
    pub group: String,
    /// The resource, with `/subresource` when there is one (`pods/exec`).
    pub resource: String,
    /// The verb.
    pub verb: String,
    /// The namespace it was made in.
    pub namespace: Option<String>,
    /// The HTTP status code of the answer (0 while unknown).
    pub code: u16,
}

impl AuditEvent {
    /// The call this event records, for resource requests; `None` for non-resource URLs
    /// (discovery, health) and for the `ResponseStarted` half of a watch whose
    /// `ResponseComplete` comes later (a watch still open at the end is kept: it only has the
    /// started stage).
    pub fn call(&self) -> Option<Call> {
        let object = self.object_ref.as_ref()?;
        let resource = object.resource.clone()?;
        let resource = match &object.subresource {
            Some(sub) => format!("{resource}/{sub}"),
            None => resource,
        };
        Some(Call {
            group: object.api_group.clone().unwrap_or_default(),
            resource,
            verb: self.verb.clone(),
            namespace: object.namespace.clone(),
            code: self
                .response_status
                .as_ref()
                .and_then(|s| s.code)
                .unwrap_or(0),
        })
    }
}

/// Reads every event of the audit log at `path` (one JSON object a line).
pub(crate) fn read(path: &Path) -> Result<Vec<AuditEvent>, EnvtestError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(EnvtestError::io(format!("{}", path.display()))(e)),
    };
    let mut events = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<AuditEvent>(line) {
            Ok(event) => events.push(event),
            // The last line may be half-written while the server is logging.
            Err(e) if e.is_eof() => break,
            Err(e) => return Err(EnvtestError::Manifest(format!("audit log line: {e}"))),
        }
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subresource_call_is_named_as_rbac_names_it() {
        let line = r#"{"kind":"Event","stage":"ResponseComplete","verb":"create","requestURI":"/api/v1/namespaces/n/pods/p/exec","user":{"username":"system:serviceaccount:n:s"},"objectRef":{"resource":"pods","subresource":"exec","namespace":"n","name":"p","apiVersion":"v1"},"responseStatus":{"code":101}}"#;
        let event: AuditEvent = serde_json::from_str(line).unwrap();
        let call = event.call().unwrap();
        assert_eq!(
            (
                call.group.as_str(),
                call.resource.as_str(),
                call.verb.as_str()
            ),
            ("", "pods/exec", "create")
        );
        assert_eq!(call.code, 101);
    }

    #[test]
    fn a_discovery_request_is_no_call() {
        let line = r#"{"stage":"ResponseComplete","verb":"get","requestURI":"/apis","user":{"username":"u"},"responseStatus":{"code":200}}"#;
        let event: AuditEvent = serde_json::from_str(line).unwrap();
        assert!(event.call().is_none());
    }
}
