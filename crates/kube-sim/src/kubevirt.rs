//! The simulated KubeVirt: a VirtualMachine controller (run strategies, finalizer, status)
//! and one task per VirtualMachineInstance taking it Pending → Scheduling → Scheduled →
//! Running (launcher pod, domain started), and to its end. As on KubeVirt, Running comes
//! while the guest still boots: its agent listens only later (half of `Timings::boot` after
//! Running), and connections to it are refused until then.
//!
//! A VMI whose `configMap` volume names a missing ConfigMap never gets its launcher pod
//! (`FailedMount`, as kubelet reports a volume it cannot mount) and so never runs; once the
//! ConfigMap exists it goes on. The guest is simulated (a directory, the ConfigMaps as disks
//! found by their labels and the agent on the host, see [`crate::guest`]) unless
//! [`crate::SimConfig::guest`] asks for qemu: then each VMI is a real qemu guest
//! (`ttlab-qemu-guest`) whose root disk is an overlay on the image (a golden-disk VMI) or a
//! copy of it (a container-disk VMI), whose cloud-init reads the Secret through a NoCloud
//! seed, whose `configMap` volumes are ISO 9660 disks labelled as KubeVirt labels them, whose
//! agent port is forwarded from the VMI's loopback address, and whose power-off
//! ends the VMI as the run strategy says; deleting the VMI presses the ACPI power button and
//! kills qemu after the termination grace.

use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::watch;

use crate::quantity::Milli;
use crate::resources::{CONFIG_MAPS, PODS, PVCS, SECRETS, VMIS, VMS};
use crate::store::{Propagation, finalizers, is_deleting, meta_str, now_rfc3339};
use crate::{Error, SetupOutcome, Sim};

const VM_FINALIZER: &str = "kubevirt.io/virtualMachineControllerFinalize";
const VMI_FINALIZER: &str = "kubevirt.io/foregroundDeleteVirtualMachine";
const NODE: &str = "kube-sim-node-1";

/// How a guest ends by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GuestEnd {
    /// The guest powered itself off: the VMI ends `Succeeded`.
    PowerOff,
    /// The guest crashed: the VMI ends `Failed`.
    Crash,
}

/// What tests can see of a running guest.
#[derive(Debug, Clone)]
pub(crate) struct GuestInfo {
    /// The guest's root directory.
    pub dir: PathBuf,
    /// Its loopback address.
    pub ip: Ipv4Addr,
    /// The agent process, while it runs.
    pub agent_pid: Option<u32>,
}

struct GuestSlot {
    uid: String,
    info: GuestInfo,
    end: watch::Sender<Option<GuestEnd>>,
    running: bool,
}

/// Runtime state of the simulation beyond the objects.
pub(crate) struct Runtime {
    guests: Mutex<HashMap<(String, String), GuestSlot>>,
    /// VMs (by uid) whose guest powered off under RerunOnFailure, or that ran under Once.
    stay_off: Mutex<HashSet<String>>,
    /// Agent processes by VMI uid.
    agents: Mutex<HashMap<String, tokio::process::Child>>,
    next_ip: AtomicU32,
    second_octet: u8,
    stop: tokio_util::sync::CancellationToken,
    /// KVM or TCG for qemu guests, probed once.
    accel: tokio::sync::OnceCell<ttlab_qemu_guest::Accel>,
}

impl Runtime {
    pub(crate) fn new(second_octet: u8) -> Self {
        Self {
            guests: Mutex::new(HashMap::new()),
            stay_off: Mutex::new(HashSet::new()),
            agents: Mutex::new(HashMap::new()),
            next_ip: AtomicU32::new(random_start()),
            second_octet,
            stop: tokio_util::sync::CancellationToken::new(),
            accel: tokio::sync::OnceCell::new(),
        }
    }

    fn guests(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), GuestSlot>> {
        self.guests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stay_off(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.stay_off
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn guest(&self, ns: &str, name: &str) -> Option<GuestInfo> {
        self.guests()
            .get(&(ns.to_owned(), name.to_owned()))
            .map(|g| g.info.clone())
    }

    /// Stops every guest task (and so every agent process).
    pub(crate) fn stop_all(&self) {
        self.stop.cancel();
    }

    fn agents(&self) -> std::sync::MutexGuard<'_, HashMap<String, tokio::process::Child>> {
        self.agents
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Kills the agent of the VMI `uid` (if it has one) and waits for it to exit.
    async fn kill_agent(&self, uid: &str) {
        let child = self.agents().remove(uid);
        if let Some(mut c) = child {
            let _ = c.kill().await;
        }
    }

    /// Kills every agent and waits for each to exit.
    pub(crate) async fn kill_all_agents(&self) {
        let children: Vec<_> = self.agents().drain().map(|(_, c)| c).collect();
        for mut c in children {
            let _ = c.kill().await;
        }
    }

    /// Sends every agent SIGKILL without waiting (for `Drop`, which cannot await); the
    /// runtime reaps them.
    pub(crate) fn kill_all_agents_now(&self) {
        for (_, mut c) in self.agents().drain() {
            let _ = c.start_kill();
            let _ = c.try_wait();
        }
    }

    /// The next guest address whose agent port is free. Addresses are `127.<octet>.x.y` with
    /// `y` in 1..=254 (65,024 before reuse), counted from a random start, and one whose port
    /// is taken (by another simulator in this or another process) is skipped, so concurrent
    /// simulators do not hand out the same agent address.
    fn allocate_ip(&self, port: u16) -> Ipv4Addr {
        const SPAN: u32 = 254 * 256;
        let mut ip = Ipv4Addr::LOCALHOST;
        for _ in 0..256 {
            let n = self.next_ip.fetch_add(1, Ordering::Relaxed) % SPAN;
            let hi = (n / 254) as u8;
            let lo = (n % 254) as u8 + 1;
            ip = Ipv4Addr::new(127, self.second_octet, hi, lo);
            if std::net::TcpListener::bind((ip, port)).is_ok() {
                break;
            }
        }
        ip
    }
}

/// A random starting point in the guest address range.
fn random_start() -> u32 {
    let b = uuid::Uuid::new_v4().into_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % (254 * 256)
}

pub(crate) fn end_guest(sim: &Sim, ns: &str, name: &str, how: GuestEnd) -> Result<(), Error> {
    let guests = sim.kubevirt.guests();
    let Some(slot) = guests.get(&(ns.to_owned(), name.to_owned())) else {
        return Err(if sim.store().get(VMIS, ns, name).is_some() {
            Error::NotRunning {
                namespace: ns.into(),
                name: name.into(),
            }
        } else {
            Error::NoSuchVmi {
                namespace: ns.into(),
                name: name.into(),
            }
        });
    };
    if !slot.running {
        return Err(Error::NotRunning {
            namespace: ns.into(),
            name: name.into(),
        });
    }
    slot.end.send_replace(Some(how));
    Ok(())
}

/// Waits `d`, then until the simulation is not paused. False if the sim stops meanwhile.
async fn wait(sim: &Sim, d: Duration) -> bool {
    if !d.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(d) => {}
            () = sim.shutdown.cancelled() => return false,
            () = sim.kubevirt.stop.cancelled() => return false,
        }
    }
    unpaused(sim).await
}

async fn unpaused(sim: &Sim) -> bool {
    let mut rx = sim.paused.subscribe();
    loop {
        if !*rx.borrow_and_update() {
            return true;
        }
        tokio::select! {
            r = rx.changed() => if r.is_err() { return false },
            () = sim.shutdown.cancelled() => return false,
            () = sim.kubevirt.stop.cancelled() => return false,
        }
    }
}

pub(crate) fn spawn(sim: Arc<Sim>) {
    let mut rx = sim.store().subscribe();
    let mut paused = sim.paused.subscribe();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                () = sim.shutdown.cancelled() => return,
                r = paused.changed() => {
                    if r.is_err() { return }
                    if !*paused.borrow_and_update() {
                        reconcile_all(&sim);
                    }
                }
                ev = rx.recv() => match ev {
                    Ok(ev) => {
                        if *sim.paused.borrow() {
                            continue;
                        }
                        match ev.type_id {
                            VMS => reconcile_vm(&sim, meta_str(&ev.object, "namespace").unwrap_or(""), meta_str(&ev.object, "name").unwrap_or("")),
                            VMIS => {
                                let ns = meta_str(&ev.object, "namespace").unwrap_or("").to_owned();
                                let name = meta_str(&ev.object, "name").unwrap_or("").to_owned();
                                if ev.kind == crate::store::EventKind::Added && !is_deleting(&ev.object) {
                                    spawn_vmi(sim.clone(), ns.clone(), name.clone(), meta_str(&ev.object, "uid").unwrap_or("").to_owned());
                                }
                                reconcile_vm(&sim, &ns, &name);
                            }
                            _ => {}
                        }
                    }
                    Err(RecvError::Lagged(_)) => reconcile_all(&sim),
                    Err(RecvError::Closed) => return,
                }
            }
        }
    });
}

fn reconcile_all(sim: &Arc<Sim>) {
    let vms: Vec<(String, String)> = sim
        .store()
        .all(VMS, None)
        .iter()
        .map(|v| {
            (
                meta_str(v, "namespace").unwrap_or("").to_owned(),
                meta_str(v, "name").unwrap_or("").to_owned(),
            )
        })
        .collect();
    for (ns, name) in vms {
        reconcile_vm(sim, &ns, &name);
    }
    // VMIs created while paused (directly, or before the pause) need their task.
    for vmi in sim.store().all(VMIS, None) {
        let ns = meta_str(&vmi, "namespace").unwrap_or("").to_owned();
        let name = meta_str(&vmi, "name").unwrap_or("").to_owned();
        let uid = meta_str(&vmi, "uid").unwrap_or("").to_owned();
        let known = sim
            .kubevirt
            .guests()
            .get(&(ns.clone(), name.clone()))
            .is_some_and(|g| g.uid == uid);
        if !known
            && vmi["status"]["phase"]
                .as_str()
                .is_none_or(|p| p == "Pending" || p.is_empty())
        {
            spawn_vmi(sim.clone(), ns, name, uid);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    Always,
    RerunOnFailure,
    Once,
    Manual,
    Halted,
}

fn strategy(vm: &Value) -> Strategy {
    match (
        vm["spec"]["runStrategy"].as_str(),
        vm["spec"]["running"].as_bool(),
    ) {
        (Some("Always"), _) | (None, Some(true)) => Strategy::Always,
        (Some("RerunOnFailure"), _) => Strategy::RerunOnFailure,
        (Some("Once"), _) => Strategy::Once,
        (Some("Manual"), _) => Strategy::Manual,
        _ => Strategy::Halted,
    }
}

fn reconcile_vm(sim: &Arc<Sim>, ns: &str, name: &str) {
    let mut store = sim.store();
    let Some(vm) = store.get(VMS, ns, name) else {
        return;
    };
    let vm_uid = meta_str(&vm, "uid").unwrap_or("").to_owned();
    let vmi = store.get(VMIS, ns, name).filter(|v| {
        v["metadata"]["ownerReferences"]
            .as_array()
            .is_some_and(|r| r.iter().any(|o| o["uid"] == vm_uid.as_str()))
    });
    let phase = vmi
        .as_ref()
        .and_then(|v| v["status"]["phase"].as_str().map(str::to_owned))
        .unwrap_or_default();
    let vmi_deleting = vmi.as_ref().is_some_and(|v| is_deleting(v));
    if is_deleting(&vm) {
        match &vmi {
            Some(_) if !vmi_deleting => {
                let _ = store.delete(VMIS, ns, name, Propagation::Background, None, None);
            }
            Some(_) => {}
            None => {
                sim.kubevirt.stay_off().remove(&vm_uid);
                if finalizers(&vm).iter().any(|f| f == VM_FINALIZER) {
                    store.remove_finalizer(VMS, ns, name, VM_FINALIZER);
                }
                return;
            }
        }
        set_vm_status(&mut store, &vm, "Terminating", vmi.as_deref());
        return;
    }
    if !finalizers(&vm).iter().any(|f| f == VM_FINALIZER) {
        let _ = store.update_with(VMS, ns, name, |c| {
            let mut c = c.clone();
            let list = c["metadata"]["finalizers"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let mut list = list;
            list.push(Value::from(VM_FINALIZER));
            c["metadata"]["finalizers"] = Value::Array(list);
            c["metadata"]["resourceVersion"] = Value::from("");
            Ok(c)
        });
    }
    let strat = strategy(&vm);
    let ended = matches!(phase.as_str(), "Succeeded" | "Failed");
    let stay_off = sim.kubevirt.stay_off().contains(&vm_uid);
    match (strat, &vmi) {
        (Strategy::Halted, Some(_)) if !vmi_deleting => {
            let _ = store.delete(VMIS, ns, name, Propagation::Background, None, None);
        }
        (Strategy::Always, Some(_)) if ended && !vmi_deleting => {
            let _ = store.delete(VMIS, ns, name, Propagation::Background, None, None);
        }
        (Strategy::RerunOnFailure, Some(_)) if ended && !vmi_deleting => {
            if phase == "Succeeded" {
                sim.kubevirt.stay_off().insert(vm_uid.clone());
            }
            let _ = store.delete(VMIS, ns, name, Propagation::Background, None, None);
        }
        (Strategy::Always | Strategy::RerunOnFailure | Strategy::Once, None) if !stay_off => {
            if strat == Strategy::Once {
                sim.kubevirt.stay_off().insert(vm_uid.clone());
            }
            if store.get(VMIS, ns, name).is_none() {
                let vmi = new_vmi(&vm);
                if let Err(e) = store.create(VMIS, ns, vmi) {
                    tracing::warn!(vm = name, error = %e.message, "VMI not created");
                    if strat == Strategy::Once {
                        sim.kubevirt.stay_off().remove(&vm_uid);
                    }
                }
            }
        }
        _ => {}
    }
    let vmi = store.get(VMIS, ns, name);
    let vm = store.get(VMS, ns, name).unwrap_or(vm);
    let printable = match vmi.as_deref() {
        None => "Stopped".to_owned(),
        Some(v) if is_deleting(v) => "Stopping".to_owned(),
        Some(v) => match v["status"]["phase"].as_str().unwrap_or("Pending") {
            "Running" => "Running".to_owned(),
            "Succeeded" => "Stopped".to_owned(),
            "Failed" => "CrashLoopBackOff".to_owned(),
            _ => {
                let reason = v["status"]["conditions"]
                    .as_array()
                    .and_then(|c| {
                        c.iter()
                            .find(|c| c["type"] == "Synchronized" && c["status"] == "False")
                    })
                    .and_then(|c| c["reason"].as_str());
                match reason {
                    Some("FailedPvcNotFound") => "ErrorPvcNotFound".to_owned(),
                    _ => "Starting".to_owned(),
                }
            }
        },
    };
    set_vm_status(&mut store, &vm, &printable, vmi.as_deref());
}

fn set_vm_status(
    store: &mut crate::store::Store,
    vm: &Value,
    printable: &str,
    vmi: Option<&Value>,
) {
    let running = vmi.is_some_and(|v| v["status"]["phase"] == "Running" && !is_deleting(v));
    let mut status = json!({
        "printableStatus": printable,
        "created": vmi.is_some(),
        "ready": running,
        "runStrategy": vm["spec"]["runStrategy"].as_str().unwrap_or(if vm["spec"]["running"] == true { "Always" } else { "Halted" }),
        "conditions": [{
            "type": "Ready",
            "status": if running { "True" } else { "False" },
            "lastProbeTime": null,
            "lastTransitionTime": now_rfc3339(),
        }],
    });
    if let Some(g) = vm["metadata"]["generation"].as_i64() {
        status["observedGeneration"] = Value::from(g);
        status["desiredGeneration"] = Value::from(g);
    }
    // Only write when something a reader would notice changed.
    let cur = &vm["status"];
    if cur["printableStatus"] == status["printableStatus"]
        && cur["ready"] == status["ready"]
        && cur["created"] == status["created"]
        && cur["observedGeneration"] == status["observedGeneration"]
    {
        return;
    }
    let ns = meta_str(vm, "namespace").unwrap_or("").to_owned();
    let name = meta_str(vm, "name").unwrap_or("").to_owned();
    store.set_status(VMS, &ns, &name, status);
}

fn new_vmi(vm: &Value) -> Value {
    let name = meta_str(vm, "name").unwrap_or("");
    let template = &vm["spec"]["template"];
    let mut labels = template["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    labels.insert("vm.kubevirt.io/name".into(), Value::from(name));
    let mut meta = json!({
        "name": name,
        "labels": labels,
        "ownerReferences": [{
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachine",
            "name": name,
            "uid": meta_str(vm, "uid").unwrap_or(""),
            "controller": true,
            "blockOwnerDeletion": true,
        }],
        "finalizers": [VMI_FINALIZER],
    });
    if let Some(a) = template["metadata"]["annotations"].as_object() {
        meta["annotations"] = Value::Object(a.clone());
    }
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": meta,
        "spec": template["spec"].clone(),
        "status": {"phase": "Pending", "phaseTransitionTimestamps": [{"phase": "Pending", "phaseTransitionTimestamp": now_rfc3339()}]},
    })
}

/// Why a VMI cannot get a launcher pod yet, as KubeVirt reports it.
fn missing_volume(
    store: &crate::store::Store,
    ns: &str,
    vmi: &Value,
) -> Option<(&'static str, String)> {
    for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
        let claim = v["ephemeral"]["persistentVolumeClaim"]["claimName"]
            .as_str()
            .or_else(|| v["persistentVolumeClaim"]["claimName"].as_str())
            .or_else(|| v["dataVolume"]["name"].as_str());
        if let Some(c) = claim {
            match store.get(PVCS, ns, c) {
                None => {
                    return Some((
                        "FailedPvcNotFound",
                        format!("PVC {ns}/{c} does not exist, waiting for it to appear"),
                    ));
                }
                Some(p) if is_deleting(&p) => {
                    return Some((
                        "FailedPvcNotFound",
                        format!("PVC {ns}/{c} is being deleted"),
                    ));
                }
                Some(_) => {}
            }
        }
        if let Some(s) = v["cloudInitNoCloud"]["secretRef"]["name"]
            .as_str()
            .or_else(|| v["cloudInitNoCloud"]["networkDataSecretRef"]["name"].as_str())
            .or_else(|| v["secret"]["secretName"].as_str())
            && store.get(SECRETS, ns, s).is_none()
        {
            return Some(("FailedCreate", format!("secret \"{s}\" not found")));
        }
        // As kubelet reports a configMap volume it cannot mount: the launcher pod never
        // starts, the VMI never runs.
        if let Some(c) = v["configMap"]["name"].as_str()
            && v["configMap"]["optional"].as_bool() != Some(true)
            && store.get(CONFIG_MAPS, ns, c).is_none()
        {
            return Some((
                "FailedMount",
                format!(
                    "MountVolume.SetUp failed for volume \"{}\" : configmap \"{c}\" not found",
                    v["name"].as_str().unwrap_or("")
                ),
            ));
        }
    }
    None
}

/// The disks KubeVirt builds from the VMI's `configMap` volumes (absent optional ones
/// skipped), in volume order.
pub(crate) fn config_disks(
    store: &crate::store::Store,
    ns: &str,
    vmi: &Value,
) -> Vec<crate::guest::ConfigDisk> {
    vmi["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let name = v["configMap"]["name"].as_str()?;
            let cm = store.get(CONFIG_MAPS, ns, name)?;
            Some(crate::guest::ConfigDisk::from_config_map(
                v["configMap"]["volumeLabel"].as_str().unwrap_or(""),
                &cm,
            ))
        })
        .collect()
}

fn launcher_pod(vmi: &Value, overhead_mib: u64) -> Value {
    let name = meta_str(vmi, "name").unwrap_or("");
    let uid = meta_str(vmi, "uid").unwrap_or("");
    let mut labels = vmi["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    labels.insert("kubevirt.io".into(), Value::from("virt-launcher"));
    labels.insert("kubevirt.io/created-by".into(), Value::from(uid));
    labels.insert("vm.kubevirt.io/name".into(), Value::from(name));
    let domain = &vmi["spec"]["domain"];
    let guest_mem = Milli::from_json(&domain["resources"]["requests"]["memory"])
        .or_else(|| Milli::from_json(&domain["memory"]["guest"]))
        .unwrap_or(Milli(0));
    let memory = Milli(guest_mem.0 + i128::from(overhead_mib) * (1 << 20) * 1000);
    let mut requests = json!({"memory": memory.render()});
    if let Some(cpu) = domain["resources"]["requests"].get("cpu") {
        requests["cpu"] = cpu.clone();
    }
    let volumes: Vec<Value> = vmi["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let vname = v["name"].as_str()?;
            let claim = v["ephemeral"]["persistentVolumeClaim"]["claimName"]
                .as_str()
                .or_else(|| v["persistentVolumeClaim"]["claimName"].as_str())
                .or_else(|| v["dataVolume"]["name"].as_str())?;
            Some(json!({"name": vname, "persistentVolumeClaim": {"claimName": claim, "readOnly": v["ephemeral"].is_object()}}))
        })
        .collect();
    let suffix: String = uuid::Uuid::new_v4().simple().to_string()[..5].to_owned();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": format!("virt-launcher-{name}-{suffix}"),
            "labels": labels,
            "ownerReferences": [{
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstance",
                "name": name,
                "uid": uid,
                "controller": true,
                "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "containers": [{"name": "compute", "image": "quay.io/kubevirt/virt-launcher:v1.9.0", "resources": {"requests": requests}}],
            "volumes": volumes,
            "terminationGracePeriodSeconds": vmi["spec"]["terminationGracePeriodSeconds"].as_i64().unwrap_or(30),
        },
        "status": {"phase": "Pending"},
    })
}

fn vmi_status(cur: &Value, phase: &str) -> Value {
    let mut status = cur["status"].clone();
    if !status.is_object() {
        status = json!({});
    }
    status["phase"] = Value::from(phase);
    let mut ts = status["phaseTransitionTimestamps"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ts.push(json!({"phase": phase, "phaseTransitionTimestamp": now_rfc3339()}));
    status["phaseTransitionTimestamps"] = Value::Array(ts);
    status
}

/// Waits for any store change (or a guest end, or the sim stopping). False when stopping.
async fn changed(
    sim: &Sim,
    rx: &mut tokio::sync::broadcast::Receiver<Arc<crate::store::Event>>,
) -> bool {
    tokio::select! {
        r = rx.recv() => !matches!(r, Err(RecvError::Closed)),
        () = sim.shutdown.cancelled() => false,
        () = sim.kubevirt.stop.cancelled() => false,
    }
}

/// The VMI's current object if it is still this one (same uid).
fn current(sim: &Sim, ns: &str, name: &str, uid: &str) -> Option<Arc<Value>> {
    sim.store()
        .get(VMIS, ns, name)
        .filter(|v| meta_str(v, "uid") == Some(uid))
}

fn spawn_vmi(sim: Arc<Sim>, ns: String, name: String, uid: String) {
    let (end_tx, end_rx) = watch::channel(None);
    let dir = sim
        .guest_root
        .join(&ns)
        .join(format!("{name}-{}", &uid[..uid.len().min(8)]));
    let mut guests = sim.kubevirt.guests();
    // One task per VMI: the VMI event and a resync may both ask for it.
    if guests
        .get(&(ns.clone(), name.clone()))
        .is_some_and(|g| g.uid == uid)
    {
        return;
    }
    let ip = sim.kubevirt.allocate_ip(sim.config.agent_port);
    guests.insert(
        (ns.clone(), name.clone()),
        GuestSlot {
            uid: uid.clone(),
            info: GuestInfo {
                dir: dir.clone(),
                ip,
                agent_pid: None,
            },
            end: end_tx,
            running: false,
        },
    );
    drop(guests);
    tokio::spawn(async move {
        run_vmi(&sim, &ns, &name, &uid, dir, ip, end_rx).await;
        let mut guests = sim.kubevirt.guests();
        if guests
            .get(&(ns.clone(), name.clone()))
            .is_some_and(|g| g.uid == uid)
        {
            guests.remove(&(ns.clone(), name.clone()));
        }
        drop(guests);
        sim.consoles.end(&ns, &name);
    });
}

async fn run_vmi(
    sim: &Arc<Sim>,
    ns: &str,
    name: &str,
    uid: &str,
    dir: PathBuf,
    ip: Ipv4Addr,
    mut end_rx: watch::Receiver<Option<GuestEnd>>,
) {
    let mut rx = sim.store().subscribe();
    let t = sim.config.timings.clone();
    if !wait(sim, t.pending).await {
        return;
    }
    // Pending until every volume exists and the launcher pod is admitted.
    let mut reported: Option<String> = None;
    let pod_name = loop {
        let Some(vmi) = current(sim, ns, name, uid) else {
            return;
        };
        if is_deleting(&vmi) {
            finish_deletion(sim, ns, name, uid).await;
            return;
        }
        let blocked = {
            let mut store = sim.store();
            match missing_volume(&store, ns, &vmi) {
                Some(b) => Some(b),
                None => {
                    let pod = launcher_pod(&vmi, sim.config.launcher_memory_overhead_mib);
                    match store.create(PODS, ns, pod) {
                        Ok(p) => break meta_str(&p, "name").unwrap_or("").to_owned(),
                        Err(e) => Some(("FailedCreate", e.message)),
                    }
                }
            }
        };
        if let Some((reason, message)) = blocked
            && reported.as_deref() != Some(message.as_str())
        {
            let mut store = sim.store();
            let mut status = vmi["status"].clone();
            // As KubeVirt lists them: Ready=False (no launcher pod) first, then the reason.
            let now = now_rfc3339();
            status["conditions"] = json!([
                {"type": "Ready", "status": "False", "reason": "PodNotExists", "message": "virt-launcher pod has not yet been scheduled", "lastTransitionTime": now, "lastProbeTime": null},
                {"type": "Synchronized", "status": "False", "reason": reason, "message": message, "lastTransitionTime": now, "lastProbeTime": null}
            ]);
            store.set_status(VMIS, ns, name, status);
            reported = Some(message);
        }
        if !changed(sim, &mut rx).await || !unpaused(sim).await {
            return;
        }
    };
    let steps = [("Scheduling", Duration::ZERO), ("Scheduled", t.scheduling)];
    for (phase, delay) in steps {
        if !wait(sim, delay).await {
            return;
        }
        let Some(vmi) = current(sim, ns, name, uid) else {
            return;
        };
        if is_deleting(&vmi) {
            finish_deletion(sim, ns, name, uid).await;
            return;
        }
        let mut store = sim.store();
        let mut status = vmi_status(&vmi, phase);
        status["conditions"] = json!([]);
        if phase == "Scheduled" {
            status["nodeName"] = Value::from(NODE);
            if let Some(pod) = store.get(PODS, ns, &pod_name) {
                let mut ps = pod["status"].clone();
                ps["phase"] = Value::from("Running");
                ps["podIP"] = Value::from(ip.to_string());
                store.set_status(PODS, ns, &pod_name, ps);
            }
        }
        store.set_status(VMIS, ns, name, status);
    }
    // The domain starts: the VMI is Running while the guest still boots, as on KubeVirt. A
    // qemu guest boots for real from here; a simulated one takes the first half of
    // `Timings::boot` to reach Running and the second half to get its agent listening.
    let qemu = matches!(sim.config.guest, crate::guest::GuestBackend::Qemu(_));
    let to_running = if qemu { t.boot } else { t.boot / 2 };
    if !wait(sim, to_running).await {
        return;
    }
    let Some(vmi) = current(sim, ns, name, uid) else {
        return;
    };
    if is_deleting(&vmi) {
        finish_deletion(sim, ns, name, uid).await;
        return;
    }
    let _ = std::fs::create_dir_all(&dir);
    if let crate::guest::GuestBackend::Qemu(settings) = &sim.config.guest {
        let settings = (**settings).clone();
        match run_qemu(
            sim,
            ns,
            name,
            uid,
            &dir,
            ip,
            &vmi,
            &settings,
            &mut end_rx,
            &mut rx,
        )
        .await
        {
            QemuRun::Stopped | QemuRun::Deleted => {}
            QemuRun::Ended(how) => after_end(sim, ns, name, uid, &pod_name, how, &mut rx).await,
        }
        return;
    }
    let userdata = {
        let store = sim.store();
        vmi["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find_map(|v| v["cloudInitNoCloud"]["secretRef"]["name"].as_str())
            .and_then(|s| store.get(SECRETS, ns, s))
            .and_then(|s| {
                let d = &s["data"];
                d["userdata"]
                    .as_str()
                    .or_else(|| d["userData"].as_str())
                    .map(str::to_owned)
            })
            .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
    };
    let mut hostname = name.to_owned();
    let mut cloud_init_ok = false;
    if let Some(ud) = userdata {
        match crate::guest::apply_cloud_config(&dir, &ud) {
            Ok(a) => {
                if let Some(h) = a.hostname {
                    hostname = h;
                }
                cloud_init_ok = true;
            }
            Err(e) => {
                tracing::warn!(vmi = name, error = %e, "cloud-init failed in the simulated guest")
            }
        }
    }
    sim.consoles.boot(ns, name, uid, &hostname);
    {
        let mut store = sim.store();
        let mut status = vmi_status(&vmi, "Running");
        status["nodeName"] = Value::from(NODE);
        status["interfaces"] = json!([{"name": "default", "ipAddress": ip.to_string(), "ipAddresses": [ip.to_string()], "interfaceName": "eth0", "infoSource": "domain"}]);
        status["conditions"] = json!([{"type": "Ready", "status": "True", "lastTransitionTime": now_rfc3339(), "lastProbeTime": null}]);
        store.set_status(VMIS, ns, name, status);
    }
    let running_since = tokio::time::Instant::now();
    if let Some(g) = sim
        .kubevirt
        .guests()
        .get_mut(&(ns.to_owned(), name.to_owned()))
        && g.uid == uid
    {
        g.running = true;
    }
    reconcile_vm(sim, ns, name);
    // The rest of the boot, in the guest's own task: the agent comes up (after the second
    // half of `Timings::boot`; until then its port refuses connections), then the setup
    // writes its marker (`Timings::setup` after Running). The task stops when the guest
    // does: `guest_tasks` is cancelled before the agent is killed, and the task checks it
    // after starting the agent, so no agent outlives its guest.
    let guest_tasks = sim.kubevirt.stop.child_token();
    let _stop_guest_tasks = guest_tasks.clone().drop_guard();
    if cloud_init_ok {
        let lesson = vmi["metadata"]["labels"][ttlab_model::labels::LESSON]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let outcome = sim
            .lesson_setup
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&lesson)
            .cloned()
            .unwrap_or(SetupOutcome::Ready);
        let rest_of_boot = t.boot.saturating_sub(to_running);
        let (sim, ns, name, uid, dir) = (
            sim.clone(),
            ns.to_owned(),
            name.to_owned(),
            uid.to_owned(),
            dir.clone(),
        );
        let (setup, tasks) = (t.setup, guest_tasks.clone());
        tokio::spawn(async move {
            tokio::select! {
                ok = wait(&sim, rest_of_boot) => if !ok { return },
                () = tasks.cancelled() => return,
            }
            // First boot installs the agent from its disk (or fails, as a real guest would).
            let disks = config_disks(&sim.store(), &ns, &vmi);
            if let Err(reason) = crate::guest::install_agent(&dir, &disks) {
                tracing::warn!(vmi = name, %reason, "the simulated guest's first boot failed");
                if let Err(e) = crate::guest::write_marker(&dir, Some(&reason)) {
                    tracing::warn!(error = %e, "failure marker not written");
                }
                return;
            }
            let started = start_agent(&sim, &ns, &name, &uid, &dir, ip).await;
            if !started || tasks.is_cancelled() {
                sim.kubevirt.kill_agent(&uid).await;
                return;
            }
            agent_connected(&sim, &ns, &name, &uid);
            if matches!(outcome, SetupOutcome::Never) {
                return;
            }
            tokio::select! {
                ok = wait(&sim, setup.saturating_sub(running_since.elapsed())) => if !ok { return },
                () = tasks.cancelled() => return,
            }
            let failed = match &outcome {
                SetupOutcome::Fail { reason } => Some(reason.as_str()),
                _ => None,
            };
            if let Err(e) = crate::guest::write_marker(&dir, failed) {
                tracing::warn!(error = %e, "marker not written");
            }
        });
    }
    // Running until deleted, powered off or crashed.
    let end = loop {
        match current(sim, ns, name, uid) {
            None => break None,
            Some(v) if is_deleting(&v) => break None,
            Some(_) => {}
        }
        if let Some(how) = *end_rx.borrow_and_update() {
            break Some(how);
        }
        tokio::select! {
            ok = changed(sim, &mut rx) => if !ok { guest_tasks.cancel(); sim.kubevirt.kill_agent(uid).await; return },
            r = end_rx.changed() => if r.is_err() { guest_tasks.cancel(); sim.kubevirt.kill_agent(uid).await; return },
        }
        if *sim.paused.borrow() && !unpaused(sim).await {
            guest_tasks.cancel();
            sim.kubevirt.kill_agent(uid).await;
            return;
        }
    };
    guest_tasks.cancel();
    if let Some(g) = sim
        .kubevirt
        .guests()
        .get_mut(&(ns.to_owned(), name.to_owned()))
        && g.uid == uid
    {
        g.running = false;
    }
    sim.consoles.end(ns, name);
    match end {
        None => finish_deletion(sim, ns, name, uid).await,
        Some(how) => {
            sim.kubevirt.kill_agent(uid).await;
            after_end(sim, ns, name, uid, &pod_name, how, &mut rx).await;
        }
    }
}

/// A guest that ended by itself: the VMI and its pod take the final phase, the VM controller
/// applies the run strategy, and the VMI goes once deleted.
async fn after_end(
    sim: &Arc<Sim>,
    ns: &str,
    name: &str,
    uid: &str,
    pod_name: &str,
    how: GuestEnd,
    rx: &mut tokio::sync::broadcast::Receiver<Arc<crate::store::Event>>,
) {
    {
        {
            let phase = match how {
                GuestEnd::PowerOff => "Succeeded",
                GuestEnd::Crash => "Failed",
            };
            {
                let mut store = sim.store();
                if let Some(vmi) = store
                    .get(VMIS, ns, name)
                    .filter(|v| meta_str(v, "uid") == Some(uid))
                {
                    let mut status = vmi_status(&vmi, phase);
                    status["conditions"] = json!([]);
                    store.set_status(VMIS, ns, name, status);
                }
                if let Some(pod) = store.get(PODS, ns, pod_name) {
                    let mut ps = pod["status"].clone();
                    ps["phase"] = Value::from(phase);
                    store.set_status(PODS, ns, pod_name, ps);
                }
            }
            reconcile_vm(sim, ns, name);
            // Wait for the deletion that the run strategy (or a user) decides.
            loop {
                match current(sim, ns, name, uid) {
                    None => return,
                    Some(v) if is_deleting(&v) => break,
                    Some(_) => {}
                }
                if !changed(sim, rx).await {
                    return;
                }
            }
            finish_deletion(sim, ns, name, uid).await;
        }
    }
}

/// The guest's agents are up: the VMI reports what KubeVirt learns from the guest agent (the
/// OS, the interface as the guest sees it, `AgentConnected`), if it is still this VMI and
/// running.
fn agent_connected(sim: &Sim, ns: &str, name: &str, uid: &str) {
    let mut store = sim.store();
    let Some(vmi) = store
        .get(VMIS, ns, name)
        .filter(|v| meta_str(v, "uid") == Some(uid) && v["status"]["phase"] == "Running")
    else {
        return;
    };
    let mut status = vmi["status"].clone();
    status["guestOSInfo"] = json!({"id": "ubuntu", "name": "Ubuntu", "prettyName": "Ubuntu 22.04 LTS (kube-sim)", "version": "22.04"});
    if let Some(interfaces) = status["interfaces"].as_array_mut() {
        for i in interfaces {
            i["infoSource"] = Value::from("domain, guest-agent");
        }
    }
    if let Some(conditions) = status["conditions"].as_array_mut() {
        conditions.push(json!({"type": "AgentConnected", "status": "True", "lastTransitionTime": now_rfc3339(), "lastProbeTime": null}));
    }
    store.set_status(VMIS, ns, name, status);
}

/// Starts the guest's agent and waits (at most [`crate::guest::AGENT_START_TIMEOUT`]) for its
/// listening line. A guest without an agent, or whose agent dies or stays silent, runs on
/// without one (see the agent log). False if the simulation stops meanwhile.
async fn start_agent(
    sim: &Arc<Sim>,
    ns: &str,
    name: &str,
    uid: &str,
    dir: &std::path::Path,
    ip: Ipv4Addr,
) -> bool {
    let Some(started) = crate::guest::start_agent(dir, ip, sim.config.agent_port) else {
        return true;
    };
    let pid = started.child.id();
    sim.kubevirt.agents().insert(uid.to_owned(), started.child);
    if let Some(g) = sim
        .kubevirt
        .guests()
        .get_mut(&(ns.to_owned(), name.to_owned()))
        && g.uid == uid
    {
        g.info.agent_pid = pid;
    }
    let log = crate::guest::agent_log(dir);
    tokio::select! {
        r = tokio::time::timeout(crate::guest::AGENT_START_TIMEOUT, started.listening) => match r {
            Ok(Ok(addr)) => tracing::debug!(vmi = name, %addr, "guest agent listening"),
            Ok(Err(_)) => tracing::warn!(vmi = name, log = %log.display(), "guest agent exited before listening"),
            Err(_) => tracing::warn!(vmi = name, log = %log.display(), "guest agent not listening after {:?}", crate::guest::AGENT_START_TIMEOUT),
        },
        () = sim.shutdown.cancelled() => return false,
        () = sim.kubevirt.stop.cancelled() => return false,
    }
    true
}

/// The guest shuts down within its grace, then the VMI's finalizer goes (and with the VMI,
/// through garbage collection, its launcher pod).
async fn finish_deletion(sim: &Arc<Sim>, ns: &str, name: &str, uid: &str) {
    let _ = wait(sim, sim.config.timings.stop).await;
    sim.kubevirt.kill_agent(uid).await;
    if current(sim, ns, name, uid).is_some() {
        sim.store().remove_finalizer(VMIS, ns, name, VMI_FINALIZER);
    }
    reconcile_vm(sim, ns, name);
}

/// How a qemu guest's life ended, for [`run_vmi`].
enum QemuRun {
    /// The simulation stopped (qemu is killed with the guest handle).
    Stopped,
    /// The VMI was deleted: the guest was shut down and the finalizer removed.
    Deleted,
    /// The guest ended by itself (or was ended by [`end_guest`]).
    Ended(GuestEnd),
}

/// The user-data of the VMI's NoCloud Secret.
fn vmi_user_data(sim: &Sim, ns: &str, vmi: &Value) -> Option<Vec<u8>> {
    let store = sim.store();
    vmi["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|v| v["cloudInitNoCloud"]["secretRef"]["name"].as_str())
        .and_then(|s| store.get(SECRETS, ns, s))
        .and_then(|s| {
            let d = &s["data"];
            d["userdata"]
                .as_str()
                .or_else(|| d["userData"].as_str())
                .map(str::to_owned)
        })
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
}

/// The VMI's `configMap` volumes as the disks qemu attaches, as KubeVirt presents them.
fn qemu_config_disks(sim: &Sim, ns: &str, vmi: &Value) -> Vec<ttlab_qemu_guest::ConfigDisk> {
    let store = sim.store();
    vmi["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let name = v["configMap"]["name"].as_str()?;
            let cm = store.get(CONFIG_MAPS, ns, name)?;
            let disk = crate::guest::ConfigDisk::from_config_map(
                v["configMap"]["volumeLabel"].as_str().unwrap_or(""),
                &cm,
            );
            Some(ttlab_qemu_guest::ConfigDisk {
                name: v["name"].as_str().unwrap_or(name).to_owned(),
                label: disk.label,
                files: disk.files.into_iter().collect(),
            })
        })
        .collect()
}

/// Boots the VMI as a qemu guest and follows it until it ends or the VMI is deleted.
#[allow(clippy::too_many_arguments)]
async fn run_qemu(
    sim: &Arc<Sim>,
    ns: &str,
    name: &str,
    uid: &str,
    dir: &std::path::Path,
    ip: Ipv4Addr,
    vmi: &Value,
    settings: &crate::guest::QemuSettings,
    end_rx: &mut watch::Receiver<Option<GuestEnd>>,
    rx: &mut tokio::sync::broadcast::Receiver<Arc<crate::store::Event>>,
) -> QemuRun {
    use ttlab_qemu_guest::{Exit, Guest, GuestSpec, RootDisk, probe_accel};
    let accel = match settings.accel {
        Some(a) => a,
        None => {
            *sim.kubevirt
                .accel
                .get_or_init(|| probe_accel(&settings.image, settings.probe_timeout))
                .await
        }
    };
    let domain = &vmi["spec"]["domain"];
    let memory_mib = Milli::from_json(&domain["resources"]["requests"]["memory"])
        .or_else(|| Milli::from_json(&domain["memory"]["guest"]))
        .map(|m| u64::try_from(m.0 / 1000 / (1 << 20)).unwrap_or(u64::MAX))
        .unwrap_or(1024)
        .clamp(256, settings.max_memory_mib);
    let cpus = domain["cpu"]["cores"]
        .as_u64()
        .and_then(|c| u32::try_from(c).ok())
        .unwrap_or(1)
        .clamp(1, settings.max_cpus);
    let golden = vmi["spec"]["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|v| v.get("ephemeral").is_some());
    let hostname = name.to_owned();
    let spec = GuestSpec {
        image: settings.image.clone(),
        root: if golden {
            RootDisk::Overlay
        } else {
            RootDisk::Copy
        },
        dir: dir.to_owned(),
        instance_id: uid.to_owned(),
        hostname: hostname.clone(),
        config_disks: qemu_config_disks(sim, ns, vmi),
        user_data: vmi_user_data(sim, ns, vmi).unwrap_or_default(),
        memory_mib,
        cpus,
        accel,
        forward_from: std::net::SocketAddr::from((ip, sim.config.agent_port)),
        forward_to: ttlab_agent::protocol::PORT,
    };
    let started = std::time::Instant::now();
    let mut guest = match Guest::start(spec).await {
        Ok(g) => g,
        Err(e) => {
            tracing::warn!(vmi = name, error = %e, "qemu guest did not start");
            return QemuRun::Ended(GuestEnd::Crash);
        }
    };
    tracing::info!(vmi = name, %accel, memory_mib, cpus, golden, pid = ?guest.pid(), "qemu guest started");
    if let Some(g) = sim
        .kubevirt
        .guests()
        .get_mut(&(ns.to_owned(), name.to_owned()))
        && g.uid == uid
    {
        g.info.agent_pid = guest.pid();
        g.running = true;
    }
    sim.consoles.boot_qemu(ns, name, uid, guest.console());
    {
        let mut store = sim.store();
        let mut status = vmi_status(vmi, "Running");
        status["nodeName"] = Value::from(NODE);
        status["interfaces"] = json!([{"name": "default", "ipAddress": ip.to_string(), "ipAddresses": [ip.to_string()], "interfaceName": "eth0", "infoSource": "domain"}]);
        status["conditions"] = json!([{"type": "Ready", "status": "True", "lastTransitionTime": now_rfc3339(), "lastProbeTime": null}]);
        store.set_status(VMIS, ns, name, status);
    }
    reconcile_vm(sim, ns, name);
    let grace = vmi["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .map(Duration::from_secs)
        .unwrap_or(sim.config.timings.stop);
    let outcome = loop {
        match current(sim, ns, name, uid) {
            None => break None,
            Some(v) if is_deleting(&v) => break None,
            Some(_) => {}
        }
        let ended = *end_rx.borrow_and_update();
        if let Some(how) = ended {
            guest.kill_now();
            let _ = guest.exited().await;
            break Some(how);
        }
        tokio::select! {
            exit = guest.exited() => {
                tracing::info!(vmi = name, ?exit, after = ?started.elapsed(), "qemu guest ended");
                break Some(match exit { Exit::PoweredOff => GuestEnd::PowerOff, Exit::Failed(_) => GuestEnd::Crash });
            }
            ok = changed(sim, rx) => if !ok { return QemuRun::Stopped },
            r = end_rx.changed() => if r.is_err() { return QemuRun::Stopped },
        }
    };
    if let Some(g) = sim
        .kubevirt
        .guests()
        .get_mut(&(ns.to_owned(), name.to_owned()))
        && g.uid == uid
    {
        g.running = false;
    }
    sim.consoles.end(ns, name);
    match outcome {
        Some(how) => QemuRun::Ended(how),
        None => {
            let exit = tokio::select! {
                e = guest.shutdown(grace) => e,
                () = sim.shutdown.cancelled() => return QemuRun::Stopped,
            };
            tracing::info!(vmi = name, ?exit, "qemu guest shut down for the deletion");
            if current(sim, ns, name, uid).is_some() {
                sim.store().remove_finalizer(VMIS, ns, name, VMI_FINALIZER);
            }
            reconcile_vm(sim, ns, name);
            QemuRun::Deleted
        }
    }
}
