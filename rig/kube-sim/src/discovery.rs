//! Discovery (`/version`, `/api`, `/apis`, APIResourceLists) and the OpenAPI v3 documents
//! kubectl reads before `create`/`apply` to learn that the server validates fields itself.

use axum::response::Response;
use http::Method;
use serde_json::{Value, json};

use crate::Sim;
use crate::api::error_response;
use crate::resources::{GROUP_VERSIONS, SUBRESOURCES_GROUP, TYPES, verbs};
use crate::status::ApiError;

/// The Kubernetes version kube-sim claims.
pub const MAJOR: &str = "1";
/// Minor version.
pub const MINOR: &str = "34";

fn ok(v: &Value) -> Response {
    let mut r = Response::new(axum::body::Body::from(
        serde_json::to_vec(v).unwrap_or_default(),
    ));
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn resource_list(group: &str, version: &str) -> Option<Value> {
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    if group == SUBRESOURCES_GROUP && version == "v1" {
        return Some(json!({
            "kind": "APIResourceList",
            "apiVersion": "v1",
            "groupVersion": gv,
            "resources": [
                {"name": "virtualmachineinstances/console", "singularName": "", "namespaced": true, "kind": "VirtualMachineInstance", "verbs": ["get"]},
                {"name": "virtualmachineinstances/portforward", "singularName": "", "namespaced": true, "kind": "VirtualMachineInstance", "verbs": ["get"]},
            ],
        }));
    }
    if !GROUP_VERSIONS.contains(&(group, version)) {
        return None;
    }
    let mut resources = Vec::new();
    for t in TYPES
        .iter()
        .filter(|t| t.group == group && t.version == version)
    {
        let mut r = json!({
            "name": t.plural,
            "singularName": t.singular,
            "namespaced": t.namespaced,
            "kind": t.kind,
            "verbs": verbs(),
        });
        if !t.short_names.is_empty() {
            r["shortNames"] = json!(t.short_names);
        }
        if !t.categories.is_empty() {
            r["categories"] = json!(t.categories);
        }
        resources.push(r);
        if t.status_subresource {
            resources.push(json!({
                "name": format!("{}/status", t.plural),
                "singularName": "",
                "namespaced": t.namespaced,
                "kind": t.kind,
                "verbs": ["get", "patch", "update"],
            }));
        }
    }
    Some(json!({
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": gv,
        "resources": resources,
    }))
}

fn group_json(group: &str) -> Option<Value> {
    let versions: Vec<&str> = GROUP_VERSIONS
        .iter()
        .filter(|(g, _)| *g == group)
        .map(|(_, v)| *v)
        .chain((group == SUBRESOURCES_GROUP).then_some("v1"))
        .collect();
    let first = versions.first()?;
    Some(json!({
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": group,
        "versions": versions.iter().map(|v| json!({"groupVersion": format!("{group}/{v}"), "version": v})).collect::<Vec<_>>(),
        "preferredVersion": {"groupVersion": format!("{group}/{first}"), "version": first},
    }))
}

fn groups() -> Vec<&'static str> {
    let mut g: Vec<&str> = GROUP_VERSIONS
        .iter()
        .map(|(g, _)| *g)
        .filter(|g| !g.is_empty())
        .collect();
    g.push(SUBRESOURCES_GROUP);
    g.dedup();
    g
}

fn gv_key(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

const HASH: &str = "6b7562652d73696d2d7631";

fn openapi_index() -> Value {
    let mut paths = serde_json::Map::new();
    for (g, v) in GROUP_VERSIONS {
        let key = gv_key(g, v);
        paths.insert(
            key.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{key}?hash={HASH}")}),
        );
    }
    json!({"paths": paths})
}

fn openapi_doc(group: &str, version: &str) -> Option<Value> {
    if !GROUP_VERSIONS.contains(&(group, version)) {
        return None;
    }
    let mut paths = serde_json::Map::new();
    let field_validation = json!({
        "name": "fieldValidation",
        "in": "query",
        "description": "fieldValidation instructs the server on how to handle objects in the request (POST/PUT/PATCH) containing unknown or duplicate fields. Valid values are: Ignore, Warn (default), Strict.",
        "schema": {"type": "string", "uniqueItems": true},
    });
    let patch_types = json!({
        "application/json-patch+json": {"schema": {"type": "object"}},
        "application/merge-patch+json": {"schema": {"type": "object"}},
        "application/apply-patch+yaml": {"schema": {"type": "object"}},
    });
    for t in TYPES
        .iter()
        .filter(|t| t.group == group && t.version == version)
    {
        let gvk = json!({"group": t.group, "version": t.version, "kind": t.kind});
        let base = t.group_version_path();
        let (collection, item) = if t.namespaced {
            (
                format!("{base}/namespaces/{{namespace}}/{}", t.plural),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", t.plural),
            )
        } else {
            (
                format!("{base}/{}", t.plural),
                format!("{base}/{}/{{name}}", t.plural),
            )
        };
        let op = |action: &str, params: Value| {
            json!({
                "operationId": format!("{action}{}", t.kind),
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": params,
                "responses": {"200": {"description": "OK"}},
            })
        };
        paths.insert(
            collection,
            json!({
                "get": op("list", json!([])),
                "post": op("post", json!([field_validation])),
            }),
        );
        let mut patch = op("patch", json!([field_validation]));
        patch["requestBody"] = json!({"content": patch_types, "required": true});
        paths.insert(
            item,
            json!({
                "get": op("get", json!([])),
                "put": op("put", json!([field_validation])),
                "patch": patch,
                "delete": op("delete", json!([])),
            }),
        );
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": format!("v{MAJOR}.{MINOR}.0")},
        "paths": paths,
        "components": {"schemas": {}},
    }))
}

/// Answers a discovery or OpenAPI path, or `None` if `path` is not one.
pub(crate) fn handle(
    sim: &Sim,
    method: &Method,
    path: &str,
    _query: Option<&str>,
) -> Option<Response> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let resp = match segs.as_slice() {
        ["version"] => json!({
            "major": MAJOR,
            "minor": MINOR,
            "gitVersion": format!("v{MAJOR}.{MINOR}.0-kube-sim"),
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24",
            "compiler": "gc",
            "platform": "linux/amd64",
        }),
        ["healthz" | "livez" | "readyz"] => {
            let mut r = Response::new(axum::body::Body::from("ok"));
            r.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain"),
            );
            return Some(r);
        }
        ["api"] => json!({
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": sim.config.listen.to_string()}],
        }),
        ["api", v] => match resource_list("", v) {
            Some(l) => l,
            None => return Some(error_response(&ApiError::unknown_path())),
        },
        ["apis"] => json!({
            "kind": "APIGroupList",
            "apiVersion": "v1",
            "groups": groups().into_iter().filter_map(group_json).collect::<Vec<_>>(),
        }),
        ["apis", g] => match group_json(g) {
            Some(j) => j,
            None => return Some(error_response(&ApiError::unknown_path())),
        },
        ["apis", g, v] => match resource_list(g, v) {
            Some(l) => l,
            None => return Some(error_response(&ApiError::unknown_path())),
        },
        ["openapi", "v3"] => openapi_index(),
        ["openapi", "v3", "api", v] => openapi_doc("", v)?,
        ["openapi", "v3", "apis", g, v] => openapi_doc(g, v)?,
        ["openapi", ..] => return Some(error_response(&ApiError::unknown_path())),
        _ => return None,
    };
    if method != Method::GET && method != Method::HEAD {
        return Some(error_response(&ApiError::method_not_allowed()));
    }
    Some(ok(&resp))
}
