//! Test support for the `deploy/` manifests and the code examples in `docs/`.
//!
//! It owns the few steps the tests of this package share: finding the repository, rendering a
//! kustomization with `kubectl kustomize` into JSON objects, picking objects out of the
//! rendered set, reading the environment a Deployment would give its container, and finding
//! the metrics an alert or a dashboard panel names ([`promql`]). It also compiles and runs the
//! examples of `docs/crates.md` as doctests ([`stable_crates`]), so an example in the docs
//! cannot stop compiling unnoticed.
//!
//! It refuses to own anything that runs in production, and it never changes the cluster
//! manifests: tests read `deploy/` as an operator would apply it.
//!
//! ```
//! let stream = "kind: Namespace\nmetadata: {name: a}\n---\n---\nkind: Namespace\nmetadata: {name: b}\n";
//! let objects = ttlab_deploy_tests::parse_stream(stream).unwrap();
//! let rendered = ttlab_deploy_tests::Rendered::new(objects);
//! assert_eq!(rendered.names_of("Namespace"), ["a", "b"]);
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize as _;
use serde_json::Value;

pub mod promql;

#[doc = include_str!("../../../docs/crates.md")]
pub mod stable_crates {}

/// Errors of rendering and reading manifests.
#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    /// `kubectl` could not be started.
    #[error("cannot run kubectl: {0}")]
    Spawn(#[from] std::io::Error),
    /// `kubectl kustomize` failed.
    #[error("kubectl kustomize {dir} failed: {stderr}")]
    Kustomize {
        /// The kustomization directory.
        dir: String,
        /// What kubectl printed on standard error.
        stderr: String,
    },
    /// The output is not a YAML stream of objects.
    #[error("rendered YAML does not parse: {0}")]
    Yaml(String),
}

/// The repository root (two levels above this package).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// A kustomization directory under `deploy/`, e.g. `overlays/prod`.
pub fn deploy_dir(relative: &str) -> PathBuf {
    repo_root().join("deploy").join(relative)
}

/// `kubectl` if it is on `PATH`; tests that need it report its absence with
/// `ttlab_testkit::skip_or_fail` (a `SKIPPED:` line, or a failure under `CI=true`).
pub fn kubectl() -> Option<PathBuf> {
    ttlab_testkit::which("kubectl")
}

/// Renders the kustomization in `dir` with `kubectl kustomize` into JSON objects, in the order
/// kubectl prints them.
pub fn kustomize(kubectl: &Path, dir: &Path) -> Result<Vec<Value>, DeployError> {
    let out = Command::new(kubectl).arg("kustomize").arg(dir).output()?;
    if !out.status.success() {
        return Err(DeployError::Kustomize {
            dir: dir.display().to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    parse_stream(&String::from_utf8_lossy(&out.stdout))
}

/// Parses a YAML stream (`---`-separated documents) into JSON objects, skipping empty
/// documents.
pub fn parse_stream(yaml: &str) -> Result<Vec<Value>, DeployError> {
    let mut objects = Vec::new();
    for document in serde_norway::Deserializer::from_str(yaml) {
        let value = Value::deserialize(document).map_err(|e| DeployError::Yaml(e.to_string()))?;
        if !value.is_null() {
            objects.push(value);
        }
    }
    Ok(objects)
}

/// A rendered set of objects.
#[derive(Debug, Clone)]
pub struct Rendered {
    /// Every object, in render order.
    pub objects: Vec<Value>,
}

impl Rendered {
    /// Wraps rendered objects.
    pub fn new(objects: Vec<Value>) -> Self {
        Self { objects }
    }

    /// The objects of `kind`.
    pub fn of_kind<'a>(&'a self, kind: &str) -> impl Iterator<Item = &'a Value> + 'a {
        let kind = kind.to_owned();
        self.objects
            .iter()
            .filter(move |o| o["kind"] == kind.as_str())
    }

    /// The names of the objects of `kind`, in render order.
    pub fn names_of(&self, kind: &str) -> Vec<String> {
        self.of_kind(kind)
            .filter_map(|o| o["metadata"]["name"].as_str().map(str::to_owned))
            .collect()
    }

    /// The one object of `kind` named `name`; panics with the names there are otherwise.
    pub fn get(&self, kind: &str, name: &str) -> &Value {
        self.of_kind(kind)
            .find(|o| o["metadata"]["name"] == name)
            .unwrap_or_else(|| panic!("no {kind} {name}; there are {:?}", self.names_of(kind)))
    }

    /// The ConfigMap whose generated name starts with `prefix-` (kustomize adds a content
    /// hash).
    pub fn generated_config_map(&self, prefix: &str) -> &Value {
        self.of_kind("ConfigMap")
            .find(|o| {
                o["metadata"]["name"]
                    .as_str()
                    .and_then(|n| n.strip_prefix(prefix))
                    .is_some_and(|rest| rest.starts_with('-'))
            })
            .unwrap_or_else(|| panic!("no generated ConfigMap {prefix}-<hash>"))
    }

    /// The environment the first container of `workload`'s pod template gets from the
    /// ConfigMaps it names in `envFrom` (Secrets are not in the manifests: they are listed
    /// in the second value) and its literal `env` entries.
    pub fn container_env(&self, workload: &Value) -> (BTreeMap<String, String>, Vec<String>) {
        let spec = pod_spec(workload);
        let container = &spec["containers"][0];
        let mut env = BTreeMap::new();
        let mut secrets = Vec::new();
        for source in container["envFrom"].as_array().into_iter().flatten() {
            if let Some(name) = source["configMapRef"]["name"].as_str() {
                let cm = self.get("ConfigMap", name);
                for (k, v) in cm["data"].as_object().into_iter().flatten() {
                    env.insert(k.clone(), v.as_str().unwrap_or_default().to_owned());
                }
            }
            if let Some(name) = source["secretRef"]["name"].as_str() {
                secrets.push(name.to_owned());
            }
        }
        for var in container["env"].as_array().into_iter().flatten() {
            if let (Some(k), Some(v)) = (var["name"].as_str(), var["value"].as_str()) {
                env.insert(k.to_owned(), v.to_owned());
            }
        }
        (env, secrets)
    }
}

/// The pod spec of a Deployment, Job or CronJob (or a Pod).
pub fn pod_spec(workload: &Value) -> &Value {
    match workload["kind"].as_str() {
        Some("Deployment" | "Job") => &workload["spec"]["template"]["spec"],
        Some("CronJob") => &workload["spec"]["jobTemplate"]["spec"]["template"]["spec"],
        _ => &workload["spec"],
    }
}

/// The pod template's labels of a Deployment, Job or CronJob.
pub fn pod_labels(workload: &Value) -> BTreeMap<String, String> {
    let template = match workload["kind"].as_str() {
        Some("CronJob") => &workload["spec"]["jobTemplate"]["spec"]["template"],
        _ => &workload["spec"]["template"],
    };
    string_map(&template["metadata"]["labels"])
}

/// A JSON object of strings as a map (other values are skipped).
pub fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect()
}

/// Whether a `matchLabels`-only label selector selects `labels` (an empty selector selects
/// everything). Panics on `matchExpressions`, which these manifests do not use.
pub fn selects(selector: &Value, labels: &BTreeMap<String, String>) -> bool {
    assert!(
        selector.get("matchExpressions").is_none(),
        "matchExpressions are not evaluated here: {selector}"
    );
    string_map(&selector["matchLabels"])
        .iter()
        .all(|(k, v)| labels.get(k) == Some(v))
}

/// Renders an OpenAPI 3.1 document (the server's `/api/openapi.json`) as the Markdown of
/// `docs/api.md`: one section per operation (summary, parameters, body, responses) and one
/// table per component schema. Deterministic: paths and fields in document order.
pub fn openapi_markdown(doc: &Value) -> String {
    let mut out = String::new();
    let info = &doc["info"];
    out.push_str(&format!(
        "# {} API reference\n\n<!-- Generated from the server's OpenAPI document ({} {}) by \
         rig/deploy-tests (tests/docs.rs). Do not edit: run\n     \
         TTLAB_BLESS_DOCS=1 cargo test -p ttlab-deploy-tests --test docs -->\n\n",
        info["title"].as_str().unwrap_or("ttlab"),
        doc["openapi"].as_str().unwrap_or_default(),
        info["version"].as_str().unwrap_or_default(),
    ));
    if let Some(d) = info["description"].as_str() {
        out.push_str(&format!("{d}\n\n"));
    }
    out.push_str(
        "The live document is served at `GET /api/openapi.json`. Authenticated operations take \
         `Authorization: Bearer <token>` (`ttlabctl token` mints one).\n\n## Operations\n\n",
    );
    for (path, item) in doc["paths"].as_object().into_iter().flatten() {
        let shared_params = item["parameters"].as_array().cloned().unwrap_or_default();
        for method in ["get", "post", "put", "patch", "delete"] {
            let Some(op) = item.get(method) else { continue };
            out.push_str(&format!(
                "### `{} {path}`\n\n{}\n\n",
                method.to_uppercase(),
                op["summary"].as_str().unwrap_or_default()
            ));
            if op.get("security").is_some() {
                out.push_str("Authentication: bearer token.\n\n");
            }
            let mut params = shared_params.clone();
            params.extend(op["parameters"].as_array().cloned().unwrap_or_default());
            if !params.is_empty() {
                out.push_str("| parameter | in | type | required |\n|---|---|---|---|\n");
                for p in &params {
                    out.push_str(&format!(
                        "| `{}` | {} | {} | {} |\n",
                        p["name"].as_str().unwrap_or_default(),
                        p["in"].as_str().unwrap_or_default(),
                        schema_text(&p["schema"]),
                        if p["required"] == true { "yes" } else { "no" },
                    ));
                }
                out.push('\n');
            }
            if let Some(body) = op.get("requestBody") {
                for (media, content) in body["content"].as_object().into_iter().flatten() {
                    out.push_str(&format!(
                        "Request body (`{media}`): {}\n\n",
                        schema_text(&content["schema"])
                    ));
                }
            }
            out.push_str("| status | meaning | body |\n|---|---|---|\n");
            for (status, response) in op["responses"].as_object().into_iter().flatten() {
                let body = response["content"]
                    .as_object()
                    .and_then(|c| c.iter().next())
                    .map(|(media, c)| format!("`{media}`: {}", schema_text(&c["schema"])))
                    .unwrap_or_default();
                out.push_str(&format!(
                    "| {status} | {} | {body} |\n",
                    response["description"]
                        .as_str()
                        .unwrap_or_default()
                        .replace('|', "\\|")
                ));
            }
            out.push('\n');
        }
    }
    out.push_str("## Schemas\n\n");
    for (name, schema) in doc["components"]["schemas"]
        .as_object()
        .into_iter()
        .flatten()
    {
        out.push_str(&format!(
            "### {name}\n\n| field | type | required |\n|---|---|---|\n"
        ));
        let required: Vec<&str> = schema["required"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .collect();
        for (field, s) in schema["properties"].as_object().into_iter().flatten() {
            out.push_str(&format!(
                "| `{field}` | {} | {} |\n",
                schema_text(s),
                if required.contains(&field.as_str()) {
                    "yes"
                } else {
                    "no"
                }
            ));
        }
        out.push('\n');
    }
    out
}

/// A one-line description of a JSON schema.
fn schema_text(s: &Value) -> String {
    if let Some(r) = s["$ref"].as_str() {
        let name = r.rsplit('/').next().unwrap_or(r);
        return format!("[{name}](#{})", name.to_lowercase());
    }
    let ty = match &s["type"] {
        Value::String(t) => t.clone(),
        Value::Array(ts) => ts
            .iter()
            .filter_map(Value::as_str)
            .collect::<Vec<_>>()
            .join(" \\| "),
        _ => "any".to_owned(),
    };
    let mut text = if ty == "array" {
        format!("array of {}", schema_text(&s["items"]))
    } else if ty == "object" && s["properties"].is_object() {
        let fields: Vec<String> = s["properties"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| format!("`{k}`: {}", schema_text(v)))
            .collect();
        format!("object {{ {} }}", fields.join(", "))
    } else {
        ty
    };
    if let Some(f) = s["format"].as_str() {
        text.push_str(&format!(" ({f})"));
    }
    if let Some(e) = s["enum"].as_array() {
        let values: Vec<String> = e
            .iter()
            .map(|v| format!("`{}`", v.as_str().unwrap_or_default()))
            .collect();
        text.push_str(&format!(", one of {}", values.join(", ")));
    }
    if let (Some(min), Some(max)) = (s["minimum"].as_i64(), s["maximum"].as_i64()) {
        text.push_str(&format!(", {min}–{max}"));
    }
    text
}
