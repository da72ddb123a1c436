//! The VirtualMachine controller, after KubeVirt's virt-controller
//! (`pkg/virt-controller/watch/vm/vm.go`): the run strategy decides whether the VM's
//! VirtualMachineInstance is created or deleted, the VM's finalizer holds the VM until its
//! VMI is gone, and the VM's status mirrors its VMI.
//!
//! Whether a RerunOnFailure VM starts again is kept where KubeVirt keeps it, in the VM's
//! status (`runStrategy` last acted on, and a `Start` entry in `stateChangeRequests` after a
//! failure), so a restarted simulator decides the same way.

use std::sync::Arc;

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::object::{
    Cond, condition, condition_true, controlled_by, controller_ref, deleting, has_finalizer, meta,
    name, set_condition, uid, with_finalizer,
};
use crate::rest::{Kind, Part};
use crate::{Ctx, Error};

/// The VM controller's finalizer, on the VM and on the VMIs it creates.
pub(crate) const VM_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";
/// Put on every VMI (by KubeVirt's admission webhook); released by the VMI controller once the
/// guest is off and the launcher pod gone.
pub(crate) const VMI_FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";
/// The VM generation a VMI was created from.
const GENERATION_ANNOTATION: &str = "kubevirt.io/vm-generation";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Always,
    RerunOnFailure,
    Once,
    Manual,
    Halted,
}

impl Strategy {
    fn of(vm: &Value) -> Self {
        match (
            vm["spec"]["runStrategy"].as_str(),
            vm["spec"]["running"].as_bool(),
        ) {
            (Some("Always"), _) => Strategy::Always,
            (Some("RerunOnFailure"), _) => Strategy::RerunOnFailure,
            (Some("Once"), _) => Strategy::Once,
            (Some("Manual"), _) => Strategy::Manual,
            (Some(_), _) => Strategy::Halted,
            (None, Some(true)) => Strategy::Always,
            (None, _) => Strategy::Halted,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Strategy::Always => "Always",
            Strategy::RerunOnFailure => "RerunOnFailure",
            Strategy::Once => "Once",
            Strategy::Manual => "Manual",
            Strategy::Halted => "Halted",
        }
    }
}

pub(crate) fn is_final(vmi: &Value) -> bool {
    matches!(
        vmi["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

fn has_start_request(vm: &Value) -> bool {
    vm["status"]["stateChangeRequests"][0]["action"] == "Start"
}

/// One pass over VM `obj`: finalizer, run strategy, status.
pub(crate) async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let vm_name = obj.metadata.name.clone().unwrap_or_default();
    let rest = &ctx.rest;
    let Some(vm) = rest.get(Kind::Vm, &ns, &vm_name).await? else {
        return Ok(Action::await_change());
    };
    let vm_uid = uid(&vm).to_owned();
    let found = rest.get(Kind::Vmi, &ns, &vm_name).await?;
    if let Some(v) = &found
        && !controlled_by(v, &vm_uid)
    {
        tracing::warn!(
            ns,
            vm = vm_name,
            "a VirtualMachineInstance of this name belongs to something else; the VM waits"
        );
    }
    let mut vmi = found.filter(|v| controlled_by(v, &vm_uid));
    let mut failure: Option<Error> = None;

    if deleting(&vm) {
        match &vmi {
            None => {
                if has_finalizer(&vm, VM_FINALIZER) {
                    rest.update(Kind::Vm, &ns, &vm_name, Part::Main, |cur| {
                        (uid(cur) == vm_uid && has_finalizer(cur, VM_FINALIZER))
                            .then(|| with_finalizer(cur, VM_FINALIZER, false))
                    })
                    .await?;
                    tracing::info!(ns, vm = vm_name, "VM finalizer released");
                }
                return Ok(Action::await_change());
            }
            Some(v) if !deleting(v) => {
                rest.delete(Kind::Vmi, &ns, &vm_name, None, Some(uid(v)))
                    .await?;
                tracing::info!(ns, vm = vm_name, "VM deleted: deleting its VMI");
                vmi = rest
                    .get(Kind::Vmi, &ns, &vm_name)
                    .await?
                    .filter(|v| controlled_by(v, &vm_uid));
            }
            Some(_) => {}
        }
    } else {
        if !has_finalizer(&vm, VM_FINALIZER) {
            let now = rest
                .update(Kind::Vm, &ns, &vm_name, Part::Main, |cur| {
                    (uid(cur) == vm_uid && !deleting(cur) && !has_finalizer(cur, VM_FINALIZER))
                        .then(|| with_finalizer(cur, VM_FINALIZER, true))
                })
                .await?;
            // A VM whose deletion began before its finalizer went on gets no VMI: nothing
            // would hold the VM until that VMI is gone, and the VMI would keep the VM's
            // finalizer with no VM left to release it (seen in the soak on the real control
            // plane: VMIs held for minutes after their VMs were gone).
            if !now.is_some_and(|cur| {
                uid(&cur) == vm_uid && !deleting(&cur) && has_finalizer(&cur, VM_FINALIZER)
            }) {
                return Ok(Action::await_change());
            }
        }
        match run_strategy(&ctx, &ns, &vm, vmi.as_ref()).await {
            Ok(true) => {
                vmi = rest
                    .get(Kind::Vmi, &ns, &vm_name)
                    .await?
                    .filter(|v| controlled_by(v, &vm_uid));
            }
            Ok(false) => {}
            Err(e) => failure = Some(e),
        }
    }

    let message = failure.as_ref().map(ToString::to_string);
    update_status(
        &ctx,
        &ns,
        &vm_name,
        &vm_uid,
        vmi.as_ref(),
        message.as_deref(),
    )
    .await?;

    // The VM's state is recorded: a final VMI may go.
    if let Some(v) = &vmi
        && is_final(v)
        && has_finalizer(v, VM_FINALIZER)
    {
        let vmi_uid = uid(v).to_owned();
        rest.update(Kind::Vmi, &ns, &vm_name, Part::Main, |cur| {
            (uid(cur) == vmi_uid && has_finalizer(cur, VM_FINALIZER))
                .then(|| with_finalizer(cur, VM_FINALIZER, false))
        })
        .await?;
    }
    match failure {
        // Retried with the controller's backoff, as KubeVirt requeues a sync error.
        Some(e) => Err(e),
        None => Ok(Action::await_change()),
    }
}

/// Starts or stops the VMI as the run strategy says. True if it created or deleted one.
async fn run_strategy(ctx: &Ctx, ns: &str, vm: &Value, vmi: Option<&Value>) -> Result<bool, Error> {
    let strategy = Strategy::of(vm);
    let vm_name = name(vm);
    let stop = |v: &Value| {
        let vmi_uid = uid(v).to_owned();
        async move {
            ctx.rest
                .delete(Kind::Vmi, ns, vm_name, None, Some(&vmi_uid))
                .await
        }
    };
    match (strategy, vmi) {
        (Strategy::Always, Some(v)) => {
            if is_final(v) && !deleting(v) {
                tracing::info!(ns, vm = vm_name, phase = %v["status"]["phase"], "runStrategy Always: restarting");
                stop(v).await?;
                return Ok(true);
            }
            Ok(false)
        }
        (Strategy::RerunOnFailure, Some(v)) => {
            let failed = v["status"]["phase"] == "Failed";
            if !deleting(v) && is_final(v) {
                tracing::info!(ns, vm = vm_name, phase = %v["status"]["phase"], "runStrategy RerunOnFailure: stopping");
                stop(v).await?;
                if failed {
                    add_start_request(ctx, ns, vm).await?;
                }
                return Ok(true);
            }
            Ok(false)
        }
        (Strategy::Halted, Some(v)) => {
            if !deleting(v) {
                tracing::info!(ns, vm = vm_name, "runStrategy Halted: stopping");
                stop(v).await?;
                return Ok(true);
            }
            Ok(false)
        }
        (Strategy::Once | Strategy::Manual, Some(_)) => Ok(false),
        (Strategy::Always | Strategy::Once, None) => start(ctx, ns, vm).await.map(|()| true),
        (Strategy::RerunOnFailure, None) => {
            // Started when asked to (after a failure) or when the strategy just became
            // RerunOnFailure; a VMI that succeeded stays off.
            if has_start_request(vm) || vm["status"]["runStrategy"] != strategy.as_str() {
                start(ctx, ns, vm).await.map(|()| true)
            } else {
                Ok(false)
            }
        }
        (Strategy::Manual, None) => {
            if has_start_request(vm) {
                start(ctx, ns, vm).await.map(|()| true)
            } else {
                Ok(false)
            }
        }
        (Strategy::Halted, None) => Ok(false),
    }
}

/// Creates the VMI from the VM's template, as `SetupVMIFromVM` does.
async fn start(ctx: &Ctx, ns: &str, vm: &Value) -> Result<(), Error> {
    let vmi = new_vmi(vm);
    match ctx.rest.create(Kind::Vmi, ns, &vmi).await {
        Ok(created) => {
            tracing::info!(ns, vm = name(vm), vmi_uid = uid(&created), "VMI created");
            Ok(())
        }
        // An older incarnation still terminating; the VMI watch brings the VM back here.
        Err(e) if e.is_already_exists() => Ok(()),
        Err(e) => Err(e),
    }
}

/// The VMI for `vm`: named like it, its template's metadata and spec, owned by it.
pub(crate) fn new_vmi(vm: &Value) -> Value {
    let template = &vm["spec"]["template"];
    let mut metadata = json!({
        "name": name(vm),
        "namespace": meta(vm, "namespace"),
        "ownerReferences": [controller_ref("kubevirt.io/v1", "VirtualMachine", vm)],
        "finalizers": [VMI_FINALIZER, VM_FINALIZER],
    });
    if let Some(l) = template["metadata"]["labels"].as_object()
        && !l.is_empty()
    {
        metadata["labels"] = Value::Object(l.clone());
    }
    let mut annotations = template["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    if let Some(g) = vm["metadata"]["generation"].as_i64() {
        annotations.insert(GENERATION_ANNOTATION.into(), Value::from(g.to_string()));
    }
    if !annotations.is_empty() {
        metadata["annotations"] = Value::Object(annotations);
    }
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": metadata,
        "spec": template["spec"].clone(),
    })
}

async fn add_start_request(ctx: &Ctx, ns: &str, vm: &Value) -> Result<(), Error> {
    let vm_uid = uid(vm).to_owned();
    ctx.rest
        .update(Kind::Vm, ns, name(vm), Part::Status, |cur| {
            if uid(cur) != vm_uid {
                return None;
            }
            let mut new = cur.clone();
            let mut list = cur["status"]["stateChangeRequests"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            list.push(json!({"action": "Start"}));
            if !new["status"].is_object() {
                new["status"] = json!({});
            }
            new["status"]["stateChangeRequests"] = Value::Array(list);
            Some(new)
        })
        .await
        .map(|_| ())
}

/// The VM's status from its VMI, as `updateStatus` computes it.
async fn update_status(
    ctx: &Ctx,
    ns: &str,
    vm_name: &str,
    vm_uid: &str,
    vmi: Option<&Value>,
    failure: Option<&str>,
) -> Result<(), Error> {
    ctx.rest
        .update(Kind::Vm, ns, vm_name, Part::Status, |cur| {
            (uid(cur) == vm_uid).then(|| vm_with_status(cur, vmi, failure))
        })
        .await
        .map(|_| ())
}

/// `vm` with the status KubeVirt would give it for `vmi`.
pub(crate) fn vm_with_status(vm: &Value, vmi: Option<&Value>, failure: Option<&str>) -> Value {
    let mut out = vm.clone();
    let mut status = match &vm["status"] {
        Value::Object(m) => Value::Object(m.clone()),
        _ => json!({}),
    };
    let created = vmi.is_some();
    let ready = vmi.is_some_and(|v| condition_true(&v["status"]["conditions"], "Ready"));
    status["created"] = Value::from(created);
    status["ready"] = Value::from(ready);
    let strategy = Strategy::of(vm);
    // Recorded from the first time a VMI exists, so a RerunOnFailure VM can tell "just
    // switched to this strategy" from "already acted on it".
    if status["runStrategy"]
        .as_str()
        .is_some_and(|s| !s.is_empty())
        || created
    {
        status["runStrategy"] = Value::from(strategy.as_str());
    }
    // A start request is done once a live VMI exists.
    if let Some(v) = vmi
        && !deleting(v)
        && !is_final(v)
        && has_start_request(&status_holder(&status))
        && let Some(list) = status["stateChangeRequests"].as_array_mut()
    {
        list.remove(0);
        if list.is_empty()
            && let Some(m) = status.as_object_mut()
        {
            m.remove("stateChangeRequests");
        }
    }
    // Ready mirrors the VMI's Ready condition.
    let vmi_ready = vmi.and_then(|v| condition(&v["status"]["conditions"], "Ready"));
    let ready_cond = match (vmi, vmi_ready) {
        (None, _) => Cond::new("Ready", false).because("VMINotExists", "VMI does not exist"),
        (Some(_), None) => Cond::new("Ready", false)
            .because("VMIConditionMissing", "VMI is missing the Ready condition"),
        (Some(_), Some(c)) => Cond::new("Ready", c["status"] == "True").because(
            c["reason"].as_str().unwrap_or(""),
            c["message"].as_str().unwrap_or(""),
        ),
    };
    set_condition(&mut status, "conditions", ready_cond, true);
    match failure {
        Some(m) => set_condition(
            &mut status,
            "conditions",
            Cond::new("Failure", true).because("FailedCreate", m),
            true,
        ),
        None => crate::object::remove_condition(&mut status, "conditions", "Failure"),
    }
    status["printableStatus"] = Value::from(printable_status(vm, vmi));
    if let Some(g) = vm["metadata"]["generation"].as_i64() {
        status["desiredGeneration"] = Value::from(g);
    }
    if let Some(g) = vmi
        .and_then(|v| v["metadata"]["annotations"][GENERATION_ANNOTATION].as_str())
        .and_then(|g| g.parse::<i64>().ok())
    {
        status["observedGeneration"] = Value::from(g);
    }
    out["status"] = status;
    out
}

fn status_holder(status: &Value) -> Value {
    json!({"status": status})
}

/// `printableStatus`, first match wins (`setPrintableStatus`).
fn printable_status(vm: &Value, vmi: Option<&Value>) -> &'static str {
    let vmi_cond = |type_: &str, status: &str, reason: &str| {
        vmi.and_then(|v| condition(&v["status"]["conditions"], type_))
            .is_some_and(|c| c["status"] == status && c["reason"] == reason)
    };
    if deleting(vm) {
        return "Terminating";
    }
    let Some(v) = vmi else {
        return "Stopped";
    };
    let phase = v["status"]["phase"].as_str().unwrap_or("");
    if !is_final(v) && deleting(v) {
        return "Stopping";
    }
    if phase == "Running" {
        return "Running";
    }
    if vmi_cond("Synchronized", "False", "FailedPvcNotFound") {
        return "ErrorPvcNotFound";
    }
    if vmi_cond("PodScheduled", "False", "Unschedulable") {
        return "ErrorUnschedulable";
    }
    match phase {
        "" | "Pending" | "Scheduling" | "Scheduled" => "Starting",
        "Succeeded" | "Failed" => "Stopped",
        _ => "Unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(strategy: &str) -> Value {
        json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": {"name": "lab-1", "namespace": "ns", "uid": "u-1", "generation": 2},
            "spec": {"runStrategy": strategy, "template": {
                "metadata": {"labels": {"ttlab.io/session": "s"}},
                "spec": {"domain": {"devices": {}}, "volumes": []}
            }}
        })
    }

    #[test]
    fn the_vmi_is_named_like_the_vm_and_controlled_by_it() {
        let vmi = new_vmi(&vm("Always"));
        assert_eq!(vmi["metadata"]["name"], "lab-1");
        assert_eq!(vmi["metadata"]["labels"]["ttlab.io/session"], "s");
        assert_eq!(vmi["metadata"]["annotations"][GENERATION_ANNOTATION], "2");
        assert!(controlled_by(&vmi, "u-1"));
        assert_eq!(
            vmi["metadata"]["ownerReferences"][0]["blockOwnerDeletion"],
            true
        );
        assert!(has_finalizer(&vmi, VMI_FINALIZER));
        assert!(vmi.get("status").is_none());
    }

    #[test]
    fn status_follows_the_vmi() {
        let v = vm("Always");
        let s = vm_with_status(&v, None, None);
        assert_eq!(s["status"]["printableStatus"], "Stopped");
        assert_eq!(s["status"]["created"], false);
        assert!(s["status"].get("runStrategy").is_none());
        let vmi = json!({"metadata": {"annotations": {GENERATION_ANNOTATION: "2"}}, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        let s = vm_with_status(&v, Some(&vmi), None);
        assert_eq!(s["status"]["printableStatus"], "Running");
        assert_eq!(s["status"]["ready"], true);
        assert_eq!(s["status"]["runStrategy"], "Always");
        assert_eq!(s["status"]["observedGeneration"], 2);
        // Unchanged input, unchanged output: no write loop.
        let again = vm_with_status(&s, Some(&vmi), None);
        assert_eq!(again["status"], s["status"]);
    }

    #[test]
    fn a_start_request_is_trimmed_once_a_live_vmi_exists() {
        let mut v = vm("RerunOnFailure");
        v["status"] =
            json!({"runStrategy": "RerunOnFailure", "stateChangeRequests": [{"action": "Start"}]});
        let pending = json!({"status": {"phase": "Pending"}});
        let s = vm_with_status(&v, Some(&pending), None);
        assert!(s["status"].get("stateChangeRequests").is_none());
        let failed = json!({"status": {"phase": "Failed"}});
        let s = vm_with_status(&v, Some(&failed), None);
        assert_eq!(s["status"]["stateChangeRequests"][0]["action"], "Start");
    }

    #[test]
    fn strategies_parse_like_kubevirt() {
        assert_eq!(
            Strategy::of(&json!({"spec": {"running": true}})),
            Strategy::Always
        );
        assert_eq!(Strategy::of(&json!({"spec": {}})), Strategy::Halted);
        assert_eq!(Strategy::of(&vm("Once")), Strategy::Once);
    }
}
