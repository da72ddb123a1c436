//! The cluster's own controllers, driven by store events: the garbage collector
//! (ownerReferences, foreground deletion), PVC protection and namespace deletion.

use std::sync::Arc;

use serde_json::Value;
use tokio::sync::broadcast::error::RecvError;

use crate::Sim;
use crate::resources::{NAMESPACES, PODS, PVCS, TYPES, TypeId};
use crate::store::{Event, EventKind, Propagation, finalizers, is_deleting, meta_str};

const PVC_PROTECTION: &str = "kubernetes.io/pvc-protection";

pub(crate) fn spawn(sim: Arc<Sim>) {
    let mut rx = sim.store().subscribe();
    tokio::spawn(async move {
        loop {
            let ev = tokio::select! {
                () = sim.shutdown.cancelled() => return,
                ev = rx.recv() => ev,
            };
            match ev {
                Ok(ev) => on_event(&sim, &ev),
                Err(RecvError::Lagged(_)) => sweep(&sim),
                Err(RecvError::Closed) => return,
            }
        }
    });
}

fn later(sim: &Arc<Sim>, f: impl FnOnce(&Arc<Sim>) + Send + 'static) {
    let sim = sim.clone();
    let delay = sim.config.timings.gc;
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(delay) => f(&sim),
            () = sim.shutdown.cancelled() => {}
        }
    });
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|o| o["uid"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn on_event(sim: &Arc<Sim>, ev: &Event) {
    let obj = &ev.object;
    let ns = meta_str(obj, "namespace").unwrap_or_default().to_owned();
    match ev.kind {
        EventKind::Deleted => {
            if let Some(uid) = meta_str(obj, "uid").map(str::to_owned) {
                later(sim, move |sim| collect_dependents(sim, &uid));
            }
            // An owner waiting in foreground deletion may now be free.
            for owner in owner_uids(obj) {
                release_foreground(sim, &owner);
            }
            if ev.type_id == PODS {
                check_pvcs(sim, &ns);
            }
            if TYPES[ev.type_id].namespaced {
                sim.store().finish_if_unblocked(NAMESPACES, "", &ns);
            }
        }
        EventKind::Added => {
            let owners = owner_uids(obj);
            if !owners.is_empty() {
                let t = ev.type_id;
                let name = meta_str(obj, "name").unwrap_or_default().to_owned();
                let uid = meta_str(obj, "uid").unwrap_or_default().to_owned();
                let ns = ns.clone();
                later(sim, move |sim| {
                    collect_if_orphaned(sim, t, &ns, &name, &uid)
                });
            }
        }
        EventKind::Modified => {
            if is_deleting(obj) {
                let uid = meta_str(obj, "uid").unwrap_or_default().to_owned();
                if finalizers(obj).iter().any(|f| f == "foregroundDeletion") {
                    let dependents = sim.store().dependents_of(&uid);
                    for (t, (dns, dname)) in dependents {
                        let _ = sim.store().delete(
                            t,
                            &dns,
                            &dname,
                            Propagation::Foreground,
                            None,
                            None,
                        );
                    }
                    release_foreground(sim, &uid);
                }
                if ev.type_id == PVCS {
                    check_pvcs(sim, &ns);
                }
                if ev.type_id == NAMESPACES && ev.prev.as_ref().is_some_and(|p| !is_deleting(p)) {
                    let name = meta_str(obj, "name").unwrap_or_default().to_owned();
                    empty_namespace(sim, &name);
                }
            }
            if ev.type_id == PODS
                && matches!(
                    obj["status"]["phase"].as_str(),
                    Some("Succeeded" | "Failed")
                )
            {
                check_pvcs(sim, &ns);
            }
        }
    }
}

/// Deletes the dependents of a removed owner whose owners are all gone.
fn collect_dependents(sim: &Arc<Sim>, owner_uid: &str) {
    let mut store = sim.store();
    for (t, (ns, name)) in store.dependents_of(owner_uid) {
        let Some(obj) = store.get(t, &ns, &name) else {
            continue;
        };
        if owner_uids(&obj).iter().all(|u| store.by_uid(u).is_none()) {
            let _ = store.delete(t, &ns, &name, Propagation::Background, None, None);
        }
    }
}

/// An object created with owner references to objects that do not exist is collected.
fn collect_if_orphaned(sim: &Arc<Sim>, t: TypeId, ns: &str, name: &str, uid: &str) {
    let mut store = sim.store();
    let Some(obj) = store.get(t, ns, name) else {
        return;
    };
    if meta_str(&obj, "uid") != Some(uid) {
        return;
    }
    let owners = owner_uids(&obj);
    if !owners.is_empty() && owners.iter().all(|u| store.by_uid(u).is_none()) {
        let _ = store.delete(t, ns, name, Propagation::Background, None, None);
    }
}

fn release_foreground(sim: &Arc<Sim>, owner_uid: &str) {
    let mut store = sim.store();
    let Some((t, owner)) = store.by_uid(owner_uid) else {
        return;
    };
    if is_deleting(&owner)
        && finalizers(&owner).iter().any(|f| f == "foregroundDeletion")
        && store.dependents_of(owner_uid).is_empty()
    {
        let ns = meta_str(&owner, "namespace").unwrap_or_default().to_owned();
        let name = meta_str(&owner, "name").unwrap_or_default().to_owned();
        store.remove_finalizer(t, &ns, &name, "foregroundDeletion");
    }
}

/// The PVC names a pod mounts.
pub(crate) fn pod_claims(pod: &Value) -> Vec<String> {
    pod["spec"]["volumes"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter_map(|v| {
                    v["persistentVolumeClaim"]["claimName"]
                        .as_str()
                        .map(str::to_owned)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Releases terminating PVCs no live pod uses any more.
fn check_pvcs(sim: &Arc<Sim>, ns: &str) {
    let mut store = sim.store();
    let terminating: Vec<String> = store
        .all(PVCS, Some(ns))
        .iter()
        .filter(|p| is_deleting(p) && finalizers(p).iter().any(|f| f == PVC_PROTECTION))
        .filter_map(|p| meta_str(p, "name").map(str::to_owned))
        .collect();
    if terminating.is_empty() {
        return;
    }
    let in_use: Vec<String> = store
        .all(PODS, Some(ns))
        .iter()
        .filter(|p| !matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
        .flat_map(|p| pod_claims(p))
        .collect();
    for name in terminating {
        if !in_use.contains(&name) {
            store.remove_finalizer(PVCS, ns, &name, PVC_PROTECTION);
        }
    }
}

fn empty_namespace(sim: &Arc<Sim>, ns: &str) {
    let mut store = sim.store();
    for (t, rt) in TYPES.iter().enumerate() {
        if !rt.namespaced {
            continue;
        }
        for obj in store.all(t, Some(ns)) {
            let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
            let _ = store.delete(t, ns, &name, Propagation::Background, None, None);
        }
    }
    store.finish_if_unblocked(NAMESPACES, "", ns);
}

fn sweep(sim: &Arc<Sim>) {
    let namespaces: Vec<String> = sim
        .store()
        .all(NAMESPACES, None)
        .iter()
        .filter_map(|n| meta_str(n, "name").map(str::to_owned))
        .collect();
    for ns in &namespaces {
        check_pvcs(sim, ns);
        let deleting = sim.store().namespace_state(ns) == Some(true);
        if deleting {
            empty_namespace(sim, ns);
        }
    }
    let mut orphans = Vec::new();
    {
        let store = sim.store();
        for (t, _) in TYPES.iter().enumerate() {
            for obj in store.all(t, None) {
                let owners = owner_uids(&obj);
                if !owners.is_empty() && owners.iter().all(|u| store.by_uid(u).is_none()) {
                    orphans.push((
                        t,
                        meta_str(&obj, "namespace").unwrap_or_default().to_owned(),
                        meta_str(&obj, "name").unwrap_or_default().to_owned(),
                    ));
                }
            }
        }
    }
    let mut store = sim.store();
    for (t, ns, name) in orphans {
        let _ = store.delete(t, &ns, &name, Propagation::Background, None, None);
    }
}
