//! Creating manifests of any kind through discovery, the vendored CRDs, and renaming the
//! shipped namespaces into a test's own.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::GroupVersionKind;
use kube::discovery::Scope;
use serde::Deserialize as _;
use serde_json::Value;

use crate::EnvtestError;

/// The vendored KubeVirt and CDI CRDs (`crds/*.yaml`), in file order.
pub fn load_crds() -> Result<Vec<Value>, EnvtestError> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map_err(EnvtestError::io(format!("{}", dir.display())))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .map_err(EnvtestError::io(format!("{}", file.display())))?;
        out.extend(parse_stream(&text)?);
    }
    Ok(out)
}

/// The documents of a YAML stream as JSON objects (empty documents skipped).
pub(crate) fn parse_stream(text: &str) -> Result<Vec<Value>, EnvtestError> {
    let mut out = Vec::new();
    for document in serde_norway::Deserializer::from_str(text) {
        let value = Value::deserialize(document)
            .map_err(|e| EnvtestError::Manifest(format!("YAML: {e}")))?;
        if value.is_object() {
            out.push(value);
        }
    }
    Ok(out)
}

/// `objects` with every string equal to a key of `names` replaced by its value: namespaces of
/// objects, the Namespace objects themselves, RoleBinding subjects, namespace selectors and
/// settings that name a namespace. Lets each test install the shipped `deploy/` objects into
/// namespaces of its own.
pub fn rename_namespaces(objects: &[Value], names: &BTreeMap<String, String>) -> Vec<Value> {
    fn walk(v: &mut Value, names: &BTreeMap<String, String>) {
        match v {
            Value::String(s) => {
                if let Some(new) = names.get(s.as_str()) {
                    *s = new.clone();
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|i| walk(i, names)),
            Value::Object(map) => map.values_mut().for_each(|i| walk(i, names)),
            _ => {}
        }
    }
    objects
        .iter()
        .map(|o| {
            let mut o = o.clone();
            walk(&mut o, names);
            o
        })
        .collect()
}

fn order(object: &Value) -> u8 {
    match object["kind"].as_str() {
        Some("Namespace") => 0,
        Some("CustomResourceDefinition") => 1,
        Some("ServiceAccount") => 2,
        Some("Role" | "ClusterRole") => 3,
        _ => 4,
    }
}

fn gvk(object: &Value) -> Result<GroupVersionKind, EnvtestError> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind = object["kind"].as_str().unwrap_or_default();
    if api_version.is_empty() || kind.is_empty() {
        return Err(EnvtestError::Manifest(format!(
            "an object without apiVersion or kind: {object}"
        )));
    }
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    Ok(GroupVersionKind::gvk(group, version, kind))
}

/// Creates every object, Namespaces and CRDs first. A kind that was just defined by a CRD is
/// retried until discovery serves it.
pub(crate) async fn create_all(
    client: &kube::Client,
    objects: &[Value],
) -> Result<(), EnvtestError> {
    let mut sorted: Vec<&Value> = objects.iter().collect();
    sorted.sort_by_key(|o| order(o));
    for object in sorted {
        let gvk = gvk(object)?;
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        let what = format!("create {} {name}", gvk.kind);
        let mut found = None;
        for _ in 0..100 {
            match kube::discovery::pinned_kind(client, &gvk).await {
                Ok(pair) => {
                    found = Some(pair);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        let (resource, caps) = found.ok_or_else(|| {
            EnvtestError::Manifest(format!("{what}: the API server does not serve {gvk:?}"))
        })?;
        let dynamic: DynamicObject = serde_json::from_value(object.clone())
            .map_err(|e| EnvtestError::Manifest(format!("{what}: {e}")))?;
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => {
                let ns = object["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or("default");
                Api::namespaced_with(client.clone(), ns, &resource)
            }
            Scope::Cluster => Api::all_with(client.clone(), &resource),
        };
        api.create(&PostParams::default(), &dynamic)
            .await
            .map_err(EnvtestError::kube(what))?;
    }
    Ok(())
}

/// Waits until every CRD among `objects` is `Established`.
pub(crate) async fn wait_crds_established(
    client: &kube::Client,
    objects: &[Value],
) -> Result<(), EnvtestError> {
    let api = Api::<CustomResourceDefinition>::all(client.clone());
    for crd in objects
        .iter()
        .filter(|o| o["kind"] == "CustomResourceDefinition")
    {
        let name = crd["metadata"]["name"].as_str().unwrap_or_default();
        let mut established = false;
        for _ in 0..300 {
            let current = api
                .get(name)
                .await
                .map_err(EnvtestError::kube(format!("get crd {name}")))?;
            established = current
                .status
                .and_then(|s| s.conditions)
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True");
            if established {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if !established {
            return Err(EnvtestError::Manifest(format!(
                "crd {name} not established after 30 s"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renaming_reaches_namespaces_subjects_and_settings_but_not_other_strings() {
        let objects = vec![
            json!({"kind": "Namespace", "metadata": {"name": "ttlab-vms"}}),
            json!({"kind": "RoleBinding", "metadata": {"name": "b", "namespace": "ttlab-vms"},
                   "subjects": [{"kind": "ServiceAccount", "name": "s", "namespace": "ttlab-dev"}]}),
            json!({"kind": "ConfigMap", "data": {"TTLAB_NAMESPACE": "ttlab-vms", "OTHER": "ttlab-vms-x"}}),
        ];
        let names = BTreeMap::from([
            ("ttlab-vms".to_owned(), "t1-vms".to_owned()),
            ("ttlab-dev".to_owned(), "t1-dev".to_owned()),
        ]);
        let out = rename_namespaces(&objects, &names);
        assert_eq!(out[0]["metadata"]["name"], "t1-vms");
        assert_eq!(out[1]["metadata"]["namespace"], "t1-vms");
        assert_eq!(out[1]["subjects"][0]["namespace"], "t1-dev");
        assert_eq!(out[2]["data"]["TTLAB_NAMESPACE"], "t1-vms");
        assert_eq!(out[2]["data"]["OTHER"], "ttlab-vms-x");
    }

    #[test]
    fn the_vendored_crds_define_vms_vmis_and_cdi_kinds() {
        let crds = load_crds().unwrap();
        let names: Vec<&str> = crds
            .iter()
            .filter_map(|c| c["metadata"]["name"].as_str())
            .collect();
        for expected in [
            "virtualmachines.kubevirt.io",
            "virtualmachineinstances.kubevirt.io",
            "datavolumes.cdi.kubevirt.io",
            "datasources.cdi.kubevirt.io",
        ] {
            assert!(names.contains(&expected), "{expected} in {names:?}");
        }
    }
}
