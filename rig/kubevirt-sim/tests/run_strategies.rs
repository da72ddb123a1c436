//! Run strategies against a real kube-apiserver with the simulator as its KubeVirt: what runs,
//! what restarts after the guest powers off or crashes, and what stays off.

#[macro_use]
mod support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::{Value, json};
use support::*;
use ttlab_kubevirt_sim::KubevirtSim;

async fn running_vmi(client: &kube::Client, ns: &str, name: &str) -> Value {
    let vmis = vmi_api(client, ns);
    eventually(&format!("VMI {name} Running"), 60, || async {
        get_json(&vmis, name)
            .await
            .filter(|v| v["status"]["phase"] == "Running")
    })
    .await
}

/// Ends the guest once it runs (the VMI's Running is written just before the guest is
/// marked running).
async fn end_guest(sim: &KubevirtSim, ns: &str, name: &str, crash: bool) {
    eventually(&format!("guest {name} ended"), 10, || async {
        if crash {
            sim.crash(ns, name).ok()
        } else {
            sim.power_off(ns, name).ok()
        }
    })
    .await;
}

fn uid(v: &Value) -> String {
    v["metadata"]["uid"].as_str().unwrap_or("").to_owned()
}

on_both!(run_strategies_decide_what_runs_and_what_stays_off);
async fn run_strategies_decide_what_runs_and_what_stays_off(on: On) {
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "lab").await;
    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&plane.controller_client(&client).await, &ns, guests.path()).await;
    let vms = vm_api(&client, &ns);
    let vmis = vmi_api(&client, &ns);

    for (name, strategy) in [
        ("halted", "Halted"),
        ("rerun-off", "RerunOnFailure"),
        ("rerun-crash", "RerunOnFailure"),
        ("always", "Always"),
        ("once", "Once"),
    ] {
        create_vm(&client, &ns, &plain_vm(name, strategy)).await;
    }
    let mut on_pvc = plain_vm("on-pvc", "Always");
    on_pvc["spec"]["template"]["spec"]["volumes"] = json!([{
        "name": "rootdisk",
        "ephemeral": {"persistentVolumeClaim": {"claimName": "golden", "readOnly": true}}
    }]);
    create_vm(&client, &ns, &on_pvc).await;
    let rerun_off = running_vmi(&client, &ns, "rerun-off").await;
    let rerun_crash = running_vmi(&client, &ns, "rerun-crash").await;
    let always = running_vmi(&client, &ns, "always").await;
    let once = running_vmi(&client, &ns, "once").await;

    // Halted: no VMI, ever; the VM holds its finalizer and says Stopped.
    let halted = eventually("Halted VM Stopped", 10, || async {
        get_json(&vms, "halted")
            .await
            .filter(|v| v["status"]["printableStatus"] == "Stopped")
    })
    .await;
    assert_eq!(halted["status"]["created"], false);
    assert_eq!(halted["status"]["ready"], false);
    assert_eq!(
        halted["metadata"]["finalizers"],
        json!(["kubevirt.io/virtualMachineControllerFinalize"])
    );
    assert!(get_json(&vmis, "halted").await.is_none());

    // RerunOnFailure, powered off: the VMI ends Succeeded and is removed; the VM stays off.
    end_guest(&sim, &ns, "rerun-off", false).await;
    eventually("rerun-off VMI gone", 30, || async {
        get_json(&vmis, "rerun-off").await.is_none().then_some(())
    })
    .await;
    // RerunOnFailure, crashed: a new VMI runs.
    end_guest(&sim, &ns, "rerun-crash", true).await;
    let vmis2 = vmis.clone();
    let old = uid(&rerun_crash);
    eventually("rerun-crash restarted", 60, || async {
        get_json(&vmis2, "rerun-crash")
            .await
            .filter(|v| uid(v) != old && v["status"]["phase"] == "Running")
    })
    .await;
    // Always, powered off: restarted too.
    end_guest(&sim, &ns, "always", false).await;
    let old = uid(&always);
    eventually("always restarted", 60, || async {
        get_json(&vmis, "always")
            .await
            .filter(|v| uid(v) != old && v["status"]["phase"] == "Running")
    })
    .await;
    // Once, powered off: the VMI stays, Succeeded, and its launcher pod completed.
    end_guest(&sim, &ns, "once", false).await;
    let done = eventually("once Succeeded", 30, || async {
        get_json(&vmis, "once")
            .await
            .filter(|v| v["status"]["phase"] == "Succeeded")
    })
    .await;
    assert_eq!(uid(&done), uid(&once));
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let once_uid = uid(&once);
    eventually("once's launcher pod Succeeded", 30, || async {
        let list = pods
            .list(&ListParams::default().labels(&format!("kubevirt.io/created-by={once_uid}")))
            .await
            .unwrap();
        list.items
            .first()
            .and_then(|p| p.status.as_ref())
            .filter(|s| s.phase.as_deref() == Some("Succeeded"))
            .map(|_| ())
    })
    .await;
    eventually("once VM Stopped", 10, || async {
        get_json(&vms, "once")
            .await
            .filter(|v| v["status"]["printableStatus"] == "Stopped")
    })
    .await;

    // Still off a while later, and Stopped.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        get_json(&vmis, "rerun-off").await.is_none(),
        "a powered-off RerunOnFailure VM stays off"
    );
    let vm = get_json(&vms, "rerun-off").await.unwrap();
    assert_eq!(vm["status"]["printableStatus"], "Stopped");
    assert_eq!(vm["status"]["runStrategy"], "RerunOnFailure");
    assert!(vm["status"].get("stateChangeRequests").is_none());
    assert!(get_json(&vmis, "halted").await.is_none());
    assert_eq!(uid(&get_json(&vmis, "once").await.unwrap()), uid(&once));
    let old_off = uid(&rerun_off);
    assert!(!old_off.is_empty());

    // A VM whose golden PVC is missing waits in Pending, as KubeVirt reports it, and starts
    // once the claim exists.
    let pending = get_json(&vmis, "on-pvc").await.expect("VMI on-pvc");
    assert_eq!(pending["status"]["phase"], "Pending", "{pending:#}");
    let sync = pending["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Synchronized")
        .cloned()
        .unwrap();
    assert_eq!(sync["status"], "False");
    assert_eq!(sync["reason"], "FailedPvcNotFound");
    eventually("on-pvc ErrorPvcNotFound", 10, || async {
        get_json(&vms, "on-pvc")
            .await
            .filter(|v| v["status"]["printableStatus"] == "ErrorPvcNotFound")
    })
    .await;
    let pvcs: Api<k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(client.clone(), &ns);
    pvcs.create(
        &Default::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "golden"},
            "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}
        }))
        .unwrap(),
    )
    .await
    .unwrap();
    running_vmi(&client, &ns, "on-pvc").await;

    // Halted → Always: it starts.
    vms.patch(
        "halted",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"runStrategy": "Always"}})),
    )
    .await
    .unwrap();
    running_vmi(&client, &ns, "halted").await;

    assert_nothing_refused(&sim);
    sim.stop().await;
}

on_both!(a_qemu_guest_that_cannot_start_ends_its_vmi_failed);
/// With qemu guests (`SimSettings::qemu`), a guest whose image cannot be booted (its base
/// disk is missing) takes its launcher pod down with it and ends its VMI `Failed`, as KubeVirt
/// does when the domain does not start, instead of leaving it `Scheduled`. No qemu process is
/// needed to see it.
async fn a_qemu_guest_that_cannot_start_ends_its_vmi_failed(on: On) {
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "qemu").await;
    let guests = tempfile::tempdir().unwrap();
    let image_dir = tempfile::tempdir().unwrap();
    let image = ttlab_qemu_guest::GuestImage {
        dir: image_dir.path().to_path_buf(),
        manifest: ttlab_qemu_guest::ImageManifest {
            name: "missing".into(),
            disk: "missing.qcow2".into(),
            disk_format: "qcow2".into(),
            kernel: None,
            initrd: None,
            cmdline: None,
            recipe: "none".into(),
            versions: Default::default(),
            source: "this test".into(),
            built_at: "2026-01-01T00:00:00Z".into(),
            build_seconds: 0,
        },
    };
    let mut qemu = ttlab_qemu_guest::QemuSettings::new(image);
    qemu.accel = Some(ttlab_qemu_guest::Accel::Tcg);
    let mut settings = sim_settings(&ns, guests.path());
    settings.qemu = Some(qemu);
    let sim = KubevirtSim::start(plane.controller_client(&client).await, settings)
        .await
        .expect("kubevirt-sim starts");
    create_vm(&client, &ns, &plain_vm("broken", "Once")).await;
    let vmis = vmi_api(&client, &ns);
    let vmi = eventually("VMI broken Failed", 60, || async {
        get_json(&vmis, "broken")
            .await
            .filter(|v| v["status"]["phase"] == "Failed")
    })
    .await;
    assert!(
        !vmi["status"]["phaseTransitionTimestamps"]
            .to_string()
            .contains("\"Running\""),
        "the VMI never ran: {vmi}"
    );
    assert!(
        sim.guest(&ns, "broken")
            .is_none_or(|g| g.agent_pid.is_none())
    );
    sim.stop().await;
}
