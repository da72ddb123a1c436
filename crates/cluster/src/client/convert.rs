//! Conversions between kube-rs objects and this crate's values.

use std::net::IpAddr;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::PersistentVolumeClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::DynamicObject;
use serde::Deserialize;

use crate::ClusterError;
use crate::types::{
    Condition, Created, DataSourceFacts, DataVolumeFacts, Kind, ObjectSummary, PvcFacts, VmStatus,
    VmiPhase, VmiState,
};

/// Turns a JSON manifest into a dynamic object, refusing any other kind.
pub(super) fn dynamic_of_kind(
    kind: Kind,
    manifest: serde_json::Value,
) -> Result<DynamicObject, ClusterError> {
    let api_version = manifest.get("apiVersion").and_then(|v| v.as_str());
    let got_kind = manifest.get("kind").and_then(|v| v.as_str());
    if api_version != Some(kind.api_version()) || got_kind != Some(kind.name()) {
        return Err(ClusterError::Invalid {
            message: format!(
                "expected apiVersion {} kind {}, got apiVersion {:?} kind {:?}",
                kind.api_version(),
                kind.name(),
                api_version.unwrap_or(""),
                got_kind.unwrap_or("")
            ),
        });
    }
    serde_json::from_value(manifest).map_err(|e| ClusterError::Invalid {
        message: format!("not a {} manifest: {e}", kind.name()),
    })
}

/// What the API server answered to a create.
pub(super) fn created(kind: Kind, meta: &ObjectMeta) -> Result<Created, ClusterError> {
    match (&meta.name, &meta.uid) {
        (Some(name), Some(uid)) if !uid.is_empty() => Ok(Created {
            kind,
            name: name.clone(),
            uid: uid.clone(),
        }),
        _ => Err(ClusterError::Unexpected {
            message: format!("the created {kind} came back without a name or uid"),
        }),
    }
}

fn timestamp(t: &Time) -> Option<DateTime<Utc>> {
    let nanos = i64::try_from(t.0.as_nanosecond()).ok()?;
    Some(DateTime::from_timestamp_nanos(nanos))
}

pub(super) fn summary(kind: Kind, meta: &ObjectMeta) -> ObjectSummary {
    ObjectSummary {
        kind,
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        labels: meta.labels.clone().unwrap_or_default(),
        created_at: meta.creation_timestamp.as_ref().and_then(timestamp),
        deleting: meta.deletion_timestamp.is_some(),
        owner_uids: meta
            .owner_references
            .iter()
            .flatten()
            .map(|o| o.uid.clone())
            .collect(),
    }
}

pub(super) fn pvc_facts(pvc: &PersistentVolumeClaim) -> PvcFacts {
    let spec = pvc.spec.as_ref();
    let status = pvc.status.as_ref();
    PvcFacts {
        namespace: pvc.metadata.namespace.clone().unwrap_or_default(),
        name: pvc.metadata.name.clone().unwrap_or_default(),
        phase: status.and_then(|s| s.phase.clone()),
        access_modes: spec
            .and_then(|s| s.access_modes.clone())
            .unwrap_or_default(),
        volume_mode: spec.and_then(|s| s.volume_mode.clone()),
        storage_class: spec.and_then(|s| s.storage_class_name.clone()),
        capacity: status
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get("storage"))
            .map(|q| q.0.clone()),
        deleting: pvc.metadata.deletion_timestamp.is_some(),
        annotations: pvc.metadata.annotations.clone().unwrap_or_default(),
        labels: pvc.metadata.labels.clone().unwrap_or_default(),
    }
}

fn str_at<'a>(value: &'a serde_json::Value, path: &[&str]) -> Option<&'a str> {
    path.iter()
        .try_fold(value, |v, key| v.get(key))
        .and_then(|v| v.as_str())
}

pub(super) fn data_volume_facts(dv: &DynamicObject) -> DataVolumeFacts {
    DataVolumeFacts {
        name: dv.metadata.name.clone().unwrap_or_default(),
        phase: str_at(&dv.data, &["status", "phase"]).map(str::to_owned),
        progress: str_at(&dv.data, &["status", "progress"]).map(str::to_owned),
        deleting: dv.metadata.deletion_timestamp.is_some(),
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct RawCondition {
    #[serde(rename = "type")]
    type_: String,
    status: String,
    reason: Option<String>,
    message: Option<String>,
}

impl From<RawCondition> for Condition {
    fn from(c: RawCondition) -> Self {
        Condition {
            type_: c.type_,
            status: c.status,
            reason: c.reason,
            message: c.message,
        }
    }
}

fn conditions(status: Option<&serde_json::Value>) -> Vec<Condition> {
    status
        .and_then(|s| s.get("conditions"))
        .and_then(|c| Vec::<RawCondition>::deserialize(c).ok())
        .unwrap_or_default()
        .into_iter()
        .map(Condition::from)
        .collect()
}

pub(super) fn data_source_facts(ds: &DynamicObject) -> DataSourceFacts {
    let ready = conditions(ds.data.get("status"))
        .into_iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.status == "True");
    DataSourceFacts {
        name: ds.metadata.name.clone().unwrap_or_default(),
        pvc_namespace: str_at(&ds.data, &["spec", "source", "pvc", "namespace"])
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
        pvc_name: str_at(&ds.data, &["spec", "source", "pvc", "name"])
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
        ready,
        deleting: ds.metadata.deletion_timestamp.is_some(),
    }
}

pub(super) fn vm_status(vm: &DynamicObject) -> VmStatus {
    VmStatus {
        name: vm.metadata.name.clone().unwrap_or_default(),
        printable_status: str_at(&vm.data, &["status", "printableStatus"])
            .filter(|s| !s.is_empty())
            .map(str::to_owned),
        run_strategy: str_at(&vm.data, &["spec", "runStrategy"])
            .and_then(|s| serde_json::from_value(serde_json::Value::from(s)).ok()),
        start_requested: vm
            .data
            .pointer("/status/stateChangeRequests")
            .and_then(|r| r.as_array())
            .is_some_and(|r| r.iter().any(|c| c["action"] == "Start")),
        deleting: vm.metadata.deletion_timestamp.is_some(),
    }
}

pub(super) fn vmi_state(vmi: &DynamicObject) -> VmiState {
    let status = vmi.data.get("status");
    let ip = status
        .and_then(|s| s.get("interfaces"))
        .and_then(|i| i.get(0))
        .and_then(|i| i.get("ipAddress"))
        .and_then(|a| a.as_str())
        .and_then(|a| a.parse::<IpAddr>().ok());
    VmiState {
        name: vmi.metadata.name.clone().unwrap_or_default(),
        phase: VmiPhase::parse(
            status
                .and_then(|s| s.get("phase"))
                .and_then(|p| p.as_str())
                .unwrap_or(""),
        ),
        conditions: conditions(status),
        ip,
        node: status
            .and_then(|s| s.get("nodeName"))
            .and_then(|n| n.as_str())
            .filter(|n| !n.is_empty())
            .map(str::to_owned),
        deleting: vmi.metadata.deletion_timestamp.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::VmiPhase;
    use serde_json::json;
    use ttlab_vm_manifest::RunStrategy;

    fn vmi(value: serde_json::Value) -> DynamicObject {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn a_vm_status_says_whether_kubevirt_means_it_to_run() {
        let read = |value: serde_json::Value| vm_status(&vmi(value));
        let stopped = read(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "tt-1-vm"},
            "status": {"printableStatus": "Stopped"}
        }));
        assert_eq!(stopped.printable_status.as_deref(), Some("Stopped"));
        assert!(stopped.stopped_for_good());
        for restarting in ["Starting", "Stopping", "CrashLoopBackOff", "Running"] {
            let s = read(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"name": "tt-1-vm"},
                "status": {"printableStatus": restarting}
            }));
            assert!(!s.stopped_for_good(), "{restarting}");
        }
        let deleting = read(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "tt-1-vm", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"printableStatus": "Running"}
        }));
        assert!(deleting.stopped_for_good());
        let fresh = read(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "tt-1-vm"}
        }));
        assert_eq!(fresh.printable_status, None);
        assert!(!fresh.stopped_for_good());
    }

    #[test]
    fn a_vm_says_which_ended_vmis_it_restarts() {
        let read = |strategy: &str, status: serde_json::Value| {
            vm_status(&vmi(json!({
                "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"name": "tt-1-vm"},
                "spec": {"runStrategy": strategy},
                "status": status
            })))
        };
        let stopped = json!({"printableStatus": "Stopped"});
        let rerun = read("RerunOnFailure", stopped.clone());
        assert_eq!(rerun.run_strategy, Some(RunStrategy::RerunOnFailure));
        assert!(rerun.restarts_after(&VmiPhase::Failed));
        assert!(!rerun.restarts_after(&VmiPhase::Succeeded));
        let always = read("Always", stopped.clone());
        assert!(always.restarts_after(&VmiPhase::Succeeded));
        assert!(always.restarts_after(&VmiPhase::Failed));
        for strategy in ["Halted", "Manual", "Once", "Sometimes"] {
            let s = read(strategy, stopped.clone());
            assert!(!s.restarts_after(&VmiPhase::Failed), "{strategy}");
        }
        assert_eq!(read("Sometimes", stopped.clone()).run_strategy, None);
        // KubeVirt stopped the crashed VMI and asked for the next one: Stopped, not for good.
        let replacing = read(
            "RerunOnFailure",
            json!({"printableStatus": "Stopped", "stateChangeRequests": [{"action": "Start"}]}),
        );
        assert!(replacing.start_requested);
        assert!(!replacing.stopped_for_good());
        assert!(!rerun.start_requested);
        assert!(rerun.stopped_for_good());
    }

    #[test]
    fn a_pending_vmi_reports_its_blocking_condition() {
        let state = vmi_state(&vmi(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm-a"},
            // As KubeVirt lists them: Ready (with its own reason) before the one that says why.
            "status": {"phase": "Pending", "conditions": [
                {"type": "Ready", "status": "False", "reason": "PodNotExists",
                 "message": "virt-launcher pod has not yet been scheduled"},
                {"type": "Synchronized", "status": "False", "reason": "FailedPvcNotFound",
                 "message": "PVC ns/golden does not exist, waiting for it to appear"}
            ]}
        })));
        assert_eq!(state.phase, VmiPhase::Pending);
        assert_eq!(
            state.blocking_condition().and_then(|c| c.reason.as_deref()),
            Some("FailedPvcNotFound")
        );
        assert!(
            state.describe().contains("FailedPvcNotFound"),
            "{}",
            state.describe()
        );
        assert_eq!(state.ip, None);
        // With nothing else False, Ready's reason is the answer.
        let only_ready = vmi_state(&vmi(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm-a"},
            "status": {"phase": "Scheduling", "conditions": [
                {"type": "Ready", "status": "False", "reason": "PodNotExists"}
            ]}
        })));
        assert_eq!(
            only_ready
                .blocking_condition()
                .and_then(|c| c.reason.as_deref()),
            Some("PodNotExists")
        );
    }

    #[test]
    fn a_running_vmi_reports_its_first_interface_address() {
        let state = vmi_state(&vmi(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm-a"},
            "status": {"phase": "Running", "nodeName": "n1",
                       "interfaces": [{"ipAddress": "127.0.3.4"}, {"ipAddress": "10.0.0.1"}]}
        })));
        assert_eq!(state.phase, VmiPhase::Running);
        assert_eq!(state.ip, Some("127.0.3.4".parse().unwrap()));
        assert_eq!(state.node.as_deref(), Some("n1"));
    }

    #[test]
    fn a_manifest_of_another_kind_is_refused_before_sending() {
        let err = dynamic_of_kind(
            Kind::VirtualMachine,
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}),
        )
        .unwrap_err();
        assert!(matches!(err, ClusterError::Invalid { .. }), "{err:?}");
        assert!(dynamic_of_kind(
            Kind::VirtualMachine,
            json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "x"}, "spec": {}})
        )
        .is_ok());
    }

    #[test]
    fn a_data_source_resolves_to_its_pvc() {
        let ds: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataSource",
            "metadata": {"name": "ubuntu"},
            "spec": {"source": {"pvc": {"name": "ubuntu-ab12cd", "namespace": "vms"}}},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        let facts = data_source_facts(&ds);
        assert_eq!(facts.pvc_name.as_deref(), Some("ubuntu-ab12cd"));
        assert_eq!(facts.pvc_namespace.as_deref(), Some("vms"));
        assert_eq!(facts.ready, Some(true));
    }
}
