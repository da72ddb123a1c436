//! The quota controller of kube-controller-manager: after [`crate::SimConfig::quota_sync`] it
//! fills a new quota's status, applies a changed `spec.hard`, and recounts a namespace's
//! usage when what it counts is replenished — an object deleted, a pod ended — so what a
//! deletion frees is free only then. Like the real controller it does not recount on creates
//! or other updates (admission charges those itself), only at its full resync every
//! [`crate::SimConfig::quota_resync`]: usage admission charged for a create that storage then
//! refused (`409 AlreadyExists`) stays counted until the next replenishment or resync.
//! Admission (in [`crate::store`]) judges requests by the status this controller writes.
//!
//! A quota resource the controller does not count
//! ([`crate::KubeSim::set_quota_counting`]) stays out of `status.used`, as on a cluster whose
//! controller has not yet discovered a resource type; creates such a quota covers are then
//! refused with `status unknown for quota`.

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::Notify;
use tokio::sync::broadcast::error::RecvError;

use crate::Sim;
use crate::resources::{PODS, QUOTAS, TYPES};
use crate::store::{Event, EventKind, meta_str};

/// The controller's state shared with the in-process API.
#[derive(Default)]
pub(crate) struct Controller {
    /// Quota resources it does not count.
    uncounted: Mutex<BTreeSet<String>>,
    /// Namespaces with a sync scheduled.
    pending: Mutex<HashSet<String>>,
    /// Asks for a sync of every namespace with a quota.
    resync: Notify,
}

impl Controller {
    fn uncounted(&self) -> BTreeSet<String> {
        self.uncounted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Counts (true) or stops counting (false) `resource`.
    pub(crate) fn set_counting(&self, resource: &str, counting: bool) {
        let mut u = self
            .uncounted
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if counting {
            u.remove(resource);
        } else {
            u.insert(resource.to_owned());
        }
        drop(u);
        self.resync.notify_one();
    }
}

pub(crate) fn spawn(sim: Arc<Sim>) {
    let mut rx = sim.store().subscribe();
    tokio::spawn(async move {
        let every = sim
            .config
            .quota_resync
            .max(std::time::Duration::from_millis(1));
        let mut full = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            let ev = tokio::select! {
                () = sim.shutdown.cancelled() => return,
                () = sim.quota.resync.notified() => {
                    resync_all(&sim);
                    continue;
                }
                _ = full.tick() => {
                    resync_all(&sim);
                    continue;
                }
                ev = rx.recv() => ev,
            };
            match ev {
                Ok(ev) => {
                    if let Some(ns) = affects_usage(&ev) {
                        schedule(&sim, ns);
                    }
                }
                Err(RecvError::Lagged(_)) => resync_all(&sim),
                Err(RecvError::Closed) => return,
            }
        }
    });
}

/// Schedules a sync of every namespace that holds a quota.
fn resync_all(sim: &Arc<Sim>) {
    let namespaces: BTreeSet<String> = sim
        .store()
        .all(QUOTAS, None)
        .iter()
        .filter_map(|q| meta_str(q, "namespace").map(str::to_owned))
        .collect();
    for ns in namespaces {
        schedule(sim, ns);
    }
}

/// The namespace whose quotas this change makes the controller recount, as the real one's
/// replenishment does: a quota added or its `spec` changed; a namespaced object deleted; a
/// pod that ended (`Succeeded` or `Failed`: it no longer counts). Creates and other updates
/// are not recounted (admission charged them).
fn affects_usage(ev: &Event) -> Option<String> {
    if !TYPES[ev.type_id].namespaced {
        return None;
    }
    let replenished = if ev.type_id == QUOTAS {
        match ev.kind {
            EventKind::Added => true,
            EventKind::Modified => ev
                .prev
                .as_ref()
                .is_some_and(|p| p.get("spec") != ev.object.get("spec")),
            EventKind::Deleted => false,
        }
    } else {
        match ev.kind {
            EventKind::Added => false,
            EventKind::Deleted => true,
            EventKind::Modified => {
                ev.type_id == PODS
                    && ev.prev.as_ref().is_some_and(|p| !ended(p))
                    && ended(&ev.object)
            }
        }
    };
    if !replenished {
        return None;
    }
    meta_str(&ev.object, "namespace").map(str::to_owned)
}

/// Whether a pod has ended (and so no longer counts in a quota).
fn ended(pod: &serde_json::Value) -> bool {
    matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

fn schedule(sim: &Arc<Sim>, ns: String) {
    {
        let mut pending = sim
            .quota
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if !pending.insert(ns.clone()) {
            return;
        }
    }
    let sim = sim.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(sim.config.quota_sync) => {}
            () = sim.shutdown.cancelled() => return,
        }
        sim.quota
            .pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ns);
        let uncounted = sim.quota.uncounted();
        sim.store()
            .sync_quotas(&ns, &|res: &str| !uncounted.contains(res));
    });
}
