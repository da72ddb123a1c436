//! Kubernetes `Status` bodies: every failed call is answered with one, shaped like the real API
//! server's (`kind: Status`, `status: Failure`, `reason`, `message`, `details`, `code`).

use serde_json::{Value, json};

/// A failed API call, rendered as a `Status` body with its HTTP code.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    /// HTTP status code (also `code` in the body).
    pub code: u16,
    /// `reason` (`NotFound`, `AlreadyExists`, `Invalid`, …).
    pub reason: &'static str,
    /// Human-readable `message`.
    pub message: String,
    /// `details` of the body.
    pub details: Box<Details>,
}

/// The `details` of a `Status`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Details {
    /// `details.name`.
    pub name: Option<String>,
    /// `details.group`.
    pub group: Option<String>,
    /// `details.kind` (the plural resource, as the real server writes it).
    pub kind: Option<String>,
    /// `details.causes`: (reason, message, field).
    pub causes: Vec<(String, String, String)>,
}

impl ApiError {
    /// A bare error with code, reason and message.
    pub fn new(code: u16, reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason,
            message: message.into(),
            details: Box::default(),
        }
    }

    /// Adds `details` naming the object.
    pub fn with_details(mut self, group: &str, kind: &str, name: &str) -> Self {
        if !group.is_empty() {
            self.details.group = Some(group.to_owned());
        }
        self.details.kind = Some(kind.to_owned());
        self.details.name = Some(name.to_owned());
        self
    }

    /// 404 `<resource> "<name>" not found`.
    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        let res = qualified(group, plural);
        Self::new(404, "NotFound", format!("{res} \"{name}\" not found"))
            .with_details(group, plural, name)
    }

    /// 409 `<resource> "<name>" already exists`.
    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        let res = qualified(group, plural);
        Self::new(
            409,
            "AlreadyExists",
            format!("{res} \"{name}\" already exists"),
        )
        .with_details(group, plural, name)
    }

    /// 409 optimistic-concurrency conflict.
    pub fn conflict(group: &str, plural: &str, name: &str, why: &str) -> Self {
        let res = qualified(group, plural);
        Self::new(
            409,
            "Conflict",
            format!("Operation cannot be fulfilled on {res} \"{name}\": {why}"),
        )
        .with_details(group, plural, name)
    }

    /// 422 `<Kind.group> "<name>" is invalid: <causes>`.
    pub fn invalid(
        group: &str,
        qualified_kind: &str,
        kind: &str,
        name: &str,
        causes: Vec<(String, String, String)>,
    ) -> Self {
        let joined = match causes.as_slice() {
            [one] => one.1.clone(),
            many => format!(
                "[{}]",
                many.iter()
                    .map(|c| c.1.clone())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        let mut e = Self::new(
            422,
            "Invalid",
            format!("{qualified_kind} \"{name}\" is invalid: {joined}"),
        )
        .with_details(group, kind, name);
        e.details.causes = causes;
        e
    }

    /// 400 BadRequest.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 403 Forbidden for `<resource> "<name>"`.
    pub fn forbidden(group: &str, plural: &str, name: &str, why: &str) -> Self {
        let res = qualified(group, plural);
        Self::new(
            403,
            "Forbidden",
            format!("{res} \"{name}\" is forbidden: {why}"),
        )
        .with_details(group, plural, name)
    }

    /// 401 Unauthorized: credentials the server cannot authenticate.
    pub fn unauthorized() -> Self {
        Self::new(401, "Unauthorized", "Unauthorized")
    }

    /// 405 MethodNotAllowed.
    pub fn method_not_allowed() -> Self {
        Self::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    /// 410 Expired (an old `resourceVersion` or `continue` token).
    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 415 UnsupportedMediaType.
    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {content_type:?}; kube-sim does not speak protobuf: use `kubectl apply -f` or `kubectl create -f`)"
            ),
        )
    }

    /// 404 for a path that names no served resource.
    pub fn unknown_path() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
    }

    /// 500 with a message (injected faults use the chosen code instead).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// The `Status` body.
    pub fn body(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        let mut details = serde_json::Map::new();
        if let Some(n) = &self.details.name {
            details.insert("name".into(), Value::from(n.clone()));
        }
        if let Some(g) = &self.details.group {
            details.insert("group".into(), Value::from(g.clone()));
        }
        if let Some(k) = &self.details.kind {
            details.insert("kind".into(), Value::from(k.clone()));
        }
        if !self.details.causes.is_empty() {
            details.insert(
                "causes".into(),
                Value::Array(
                    self.details
                        .causes
                        .iter()
                        .map(|(reason, message, field)| {
                            json!({"reason": reason, "message": message, "field": field})
                        })
                        .collect(),
                ),
            );
        }
        if !details.is_empty() {
            status["details"] = Value::Object(details);
        }
        status
    }
}

/// A success `Status` for an object deleted at once.
pub fn deleted(group: &str, plural: &str, name: &str, uid: &str) -> Value {
    let mut details = json!({"name": name, "kind": plural, "uid": uid});
    if !group.is_empty() {
        details["group"] = Value::from(group);
    }
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": details,
    })
}

fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_owned()
    } else {
        format!("{plural}.{group}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_is_shaped_like_the_api_server() {
        let b = ApiError::not_found("kubevirt.io", "virtualmachines", "x").body();
        assert_eq!(b["code"], 404);
        assert_eq!(b["reason"], "NotFound");
        assert_eq!(b["message"], "virtualmachines.kubevirt.io \"x\" not found");
        assert_eq!(b["details"]["group"], "kubevirt.io");
    }
}
