//! The object store: every object of every type, a global resourceVersion, label and owner
//! indexes, the watch history, consistent list snapshots for `continue`, finalizers and
//! deletion, and ResourceQuota admission and usage.
//!
//! Everything here is synchronous and runs under one lock held by the server; background work
//! (garbage collection, controllers) is driven from outside through [`Store::subscribe`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};
use tokio::sync::broadcast;

use crate::resources::{
    self, CONFIG_MAPS, NAMESPACES, PODS, PVCS, QUOTAS, SECRETS, TYPES, TypeId, VMIS, VMS,
};
use crate::selector::{FieldSelector, LabelSelector};
use crate::status::ApiError;
use ttlab_model::Quantity;

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
pub type Key = (String, String);

/// What happened to an object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// Created.
    Added,
    /// Changed.
    Modified,
    /// Removed.
    Deleted,
}

impl EventKind {
    /// The watch event `type`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One change, as kept in the watch history and sent to watchers.
#[derive(Debug)]
pub struct Event {
    /// resourceVersion of the change.
    pub rv: u64,
    /// Type of the object.
    pub type_id: TypeId,
    /// What happened.
    pub kind: EventKind,
    /// The object after the change (its last state for deletions).
    pub object: Arc<Value>,
    /// The object before a modification.
    pub prev: Option<Arc<Value>>,
}

#[derive(Default)]
struct Table {
    objects: BTreeMap<Key, Arc<Value>>,
    by_label: HashMap<(String, String), BTreeSet<Key>>,
    per_ns: HashMap<String, usize>,
}

struct Snapshot {
    created: Instant,
    rv: u64,
    items: Vec<Arc<Value>>,
}

/// A quota resource a request would exceed: (resource, requested, used, limit).
type Exceeded<'a> = (&'a str, Quantity, Quantity, Quantity);

/// What admission adds to one quota's `status.used`: the new totals.
struct QuotaCharge {
    quota: String,
    used: Vec<(String, Quantity)>,
}

/// Propagation policy of a delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Propagation {
    /// Delete the object now, dependents in the background.
    #[default]
    Background,
    /// Delete dependents first; the object stays (with a `foregroundDeletion` finalizer).
    Foreground,
    /// Leave dependents, removing their owner references.
    Orphan,
}

/// The outcome of a delete call.
#[derive(Debug)]
pub enum Deleted {
    /// The object is gone.
    Gone(Arc<Value>),
    /// The object is marked for deletion and waits for finalizers.
    Pending(Arc<Value>),
}

/// A page of a list.
#[derive(Debug)]
pub struct ListPage {
    /// The items of this page.
    pub items: Vec<Arc<Value>>,
    /// resourceVersion of the list.
    pub rv: u64,
    /// Token for the next page.
    pub continue_token: Option<String>,
    /// Items left after this page (only without selectors, as the real server reports it).
    pub remaining: Option<u64>,
}

/// List parameters.
#[derive(Debug, Default, Clone)]
pub struct ListQuery {
    /// Restrict to a namespace.
    pub namespace: Option<String>,
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
    /// Page size (0 = all).
    pub limit: usize,
    /// Continue token from a previous page.
    pub continue_token: Option<String>,
}

/// Most changes of a type kept in the watch history, whatever their age (the API server's
/// watch cache: at most 100 × 1024 per resource).
const HISTORY_MAX: usize = 100 * 1024;
/// Changes of a type kept in the watch history whatever their age (the watch cache keeps at
/// least its lower-bound capacity, 100 per resource).
const HISTORY_MIN: usize = 100;
/// How long a change stays in the watch history, by default (the API server's watch cache
/// keeps events 75 s: its bookmark frequency plus 15 s).
pub const HISTORY_WINDOW: std::time::Duration = std::time::Duration::from_secs(75);
const SNAPSHOTS: usize = 512;
const SNAPSHOT_TTL_SECS: u64 = 300;

/// The object store.
pub struct Store {
    rv: u64,
    tables: Vec<Table>,
    uids: HashMap<String, (TypeId, Key)>,
    dependents: HashMap<String, BTreeSet<(TypeId, Key)>>,
    /// Per type, its changes, oldest first, with when they happened.
    history: Vec<VecDeque<(Instant, Arc<Event>)>>,
    /// Per type, the resourceVersion through which changes are no longer in the history: a
    /// watch from an older one gets `410 Expired`.
    history_gone_through: Vec<u64>,
    history_window: std::time::Duration,
    tx: broadcast::Sender<Arc<Event>>,
    snapshots: BTreeMap<u64, Snapshot>,
    next_snapshot: u64,
    peak_vms: usize,
    peak_vmis: usize,
    /// Pods bound to a node are deleted gracefully, as a real API server deletes them for
    /// their kubelet (set with [`crate::Controllers::External`]).
    graceful_pods: bool,
}

/// Current time as the API server writes it.
pub fn now_rfc3339() -> String {
    rfc3339(chrono::Utc::now())
}

/// An instant as the API server writes it (whole seconds, UTC).
pub fn rfc3339(at: chrono::DateTime<chrono::Utc>) -> String {
    at.format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// `metadata.<field>` as a string.
pub fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn labels_of(obj: &Value) -> Vec<(String, String)> {
    obj.get("metadata")
        .and_then(|m| m.get("labels"))
        .and_then(Value::as_object)
        .map(|l| {
            l.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                .collect()
        })
        .unwrap_or_default()
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj.get("metadata")
        .and_then(|m| m.get("ownerReferences"))
        .and_then(Value::as_array)
        .map(|r| {
            r.iter()
                .filter_map(|o| o.get("uid")?.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The finalizers of an object.
pub fn finalizers(obj: &Value) -> Vec<String> {
    obj.get("metadata")
        .and_then(|m| m.get("finalizers"))
        .and_then(Value::as_array)
        .map(|f| {
            f.iter()
                .filter_map(|x| x.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether the object has a deletionTimestamp.
pub fn is_deleting(obj: &Value) -> bool {
    meta_str(obj, "deletionTimestamp").is_some()
}

impl Default for Store {
    fn default() -> Self {
        Self::new()
    }
}

impl Store {
    /// An empty store.
    pub fn new() -> Self {
        let (tx, _) = broadcast::channel(65_536);
        Self {
            rv: 1000,
            tables: TYPES.iter().map(|_| Table::default()).collect(),
            uids: HashMap::new(),
            dependents: HashMap::new(),
            history: TYPES.iter().map(|_| VecDeque::new()).collect(),
            history_gone_through: vec![0; TYPES.len()],
            history_window: HISTORY_WINDOW,
            graceful_pods: false,
            tx,
            snapshots: BTreeMap::new(),
            next_snapshot: 1,
            peak_vms: 0,
            peak_vmis: 0,
        }
    }

    /// Receives every change from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Event>> {
        self.tx.subscribe()
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.rv
    }

    /// Most VirtualMachines / VirtualMachineInstances that ever existed at once.
    pub fn peaks(&self) -> (usize, usize) {
        (self.peak_vms, self.peak_vmis)
    }

    /// Number of objects of a type (all namespaces).
    pub fn count(&self, t: TypeId) -> usize {
        self.tables[t].objects.len()
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn emit(
        &mut self,
        type_id: TypeId,
        kind: EventKind,
        object: Arc<Value>,
        prev: Option<Arc<Value>>,
    ) {
        let ev = Arc::new(Event {
            rv: self.rv,
            type_id,
            kind,
            object,
            prev,
        });
        let now = Instant::now();
        self.history[type_id].push_back((now, ev.clone()));
        self.prune_history(type_id, now);
        let _ = self.tx.send(ev);
    }

    /// Drops the changes of type `t` the API server's watch cache would no longer hold:
    /// beyond [`HISTORY_MAX`], and those older than the window while [`HISTORY_MIN`] newer
    /// ones remain.
    fn prune_history(&mut self, t: TypeId, now: Instant) {
        let history = &mut self.history[t];
        while let Some((at, front)) = history.front() {
            let full = history.len() > HISTORY_MAX;
            let stale =
                history.len() > HISTORY_MIN && now.duration_since(*at) > self.history_window;
            if !full && !stale {
                break;
            }
            self.history_gone_through[t] = self.history_gone_through[t].max(front.rv);
            history.pop_front();
        }
    }

    /// Sets how long changes stay in the watch history (see [`HISTORY_WINDOW`]).
    pub fn set_history_window(&mut self, window: std::time::Duration) {
        self.history_window = window;
    }

    /// Whether a pod bound to a node is deleted gracefully: marked (`deletionTimestamp` its
    /// grace period ahead, `deletionGracePeriodSeconds`) and removed only by a delete of grace
    /// period 0, its kubelet's confirmation that the containers have stopped.
    pub fn set_graceful_pods(&mut self, graceful: bool) {
        self.graceful_pods = graceful;
    }

    /// Forgets the whole watch history, as when etcd has compacted and the API server's watch
    /// cache holds nothing older than now: a watch from any earlier resourceVersion gets
    /// `410 Expired`.
    pub fn compact_history(&mut self) {
        self.history.iter_mut().for_each(VecDeque::clear);
        self.history_gone_through.fill(self.rv);
    }

    fn index_insert(&mut self, t: TypeId, key: &Key, obj: &Value) {
        let table = &mut self.tables[t];
        for l in labels_of(obj) {
            table.by_label.entry(l).or_default().insert(key.clone());
        }
        if let Some(uid) = meta_str(obj, "uid") {
            self.uids.insert(uid.to_owned(), (t, key.clone()));
        }
        for o in owner_uids(obj) {
            self.dependents
                .entry(o)
                .or_default()
                .insert((t, key.clone()));
        }
    }

    fn index_remove(&mut self, t: TypeId, key: &Key, obj: &Value) {
        let table = &mut self.tables[t];
        for l in labels_of(obj) {
            if let Some(set) = table.by_label.get_mut(&l) {
                set.remove(key);
                if set.is_empty() {
                    table.by_label.remove(&l);
                }
            }
        }
        if let Some(uid) = meta_str(obj, "uid") {
            self.uids.remove(uid);
        }
        for o in owner_uids(obj) {
            if let Some(set) = self.dependents.get_mut(&o) {
                set.remove(&(t, key.clone()));
                if set.is_empty() {
                    self.dependents.remove(&o);
                }
            }
        }
    }

    /// Gets an object.
    pub fn get(&self, t: TypeId, ns: &str, name: &str) -> Option<Arc<Value>> {
        self.tables[t]
            .objects
            .get(&(ns.to_owned(), name.to_owned()))
            .cloned()
    }

    /// Looks up an object by uid.
    pub fn by_uid(&self, uid: &str) -> Option<(TypeId, Arc<Value>)> {
        let (t, key) = self.uids.get(uid)?;
        Some((*t, self.tables[*t].objects.get(key)?.clone()))
    }

    /// The objects whose owner references name `uid`.
    pub fn dependents_of(&self, uid: &str) -> Vec<(TypeId, Key)> {
        self.dependents
            .get(uid)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// All objects of a type in a namespace (or everywhere), in key order.
    pub fn all(&self, t: TypeId, ns: Option<&str>) -> Vec<Arc<Value>> {
        let table = &self.tables[t];
        match ns {
            Some(ns) => table
                .objects
                .range((ns.to_owned(), String::new())..)
                .take_while(|((n, _), _)| n == ns)
                .map(|(_, v)| v.clone())
                .collect(),
            None => table.objects.values().cloned().collect(),
        }
    }

    /// Whether a namespace exists, and whether it is terminating.
    pub fn namespace_state(&self, ns: &str) -> Option<bool> {
        self.get(NAMESPACES, "", ns).map(|o| is_deleting(&o))
    }

    /// Creates an object (metadata.name already resolved, body validated). Returns the stored
    /// object.
    pub fn create(&mut self, t: TypeId, ns: &str, obj: Value) -> Result<Arc<Value>, ApiError> {
        self.create_at(t, ns, obj, &now_rfc3339(), false)
    }

    /// The dry run of [`Store::create`] (`?dryRun=All`): the same refusals (a missing or
    /// terminating namespace, the quota, a taken name), nothing
    /// stored and no quota charged. Returns the object as given.
    pub fn dry_run_create(&mut self, t: TypeId, ns: &str, obj: Value) -> Result<Value, ApiError> {
        let checked = obj.clone();
        self.create_at(t, ns, obj, &now_rfc3339(), true)?;
        Ok(checked)
    }

    /// Creates an object as [`Store::create`] does, with `created` (RFC 3339, whole seconds,
    /// as the API server writes it) as its `creationTimestamp`: an object that has been
    /// lying around for a month, without waiting a month.
    pub fn create_backdated(
        &mut self,
        t: TypeId,
        ns: &str,
        obj: Value,
        created: chrono::DateTime<chrono::Utc>,
    ) -> Result<Arc<Value>, ApiError> {
        self.create_at(t, ns, obj, &rfc3339(created), false)
    }

    fn create_at(
        &mut self,
        t: TypeId,
        ns: &str,
        mut obj: Value,
        created: &str,
        dry_run: bool,
    ) -> Result<Arc<Value>, ApiError> {
        let rt = &TYPES[t];
        let name = meta_str(&obj, "name").unwrap_or_default().to_owned();
        if rt.namespaced {
            match self.namespace_state(ns) {
                // A dry run too, as on the real server: a dry-run create of a namespace
                // creates nothing for the objects after it.
                None => return Err(ApiError::not_found("", "namespaces", ns)),
                Some(true) => {
                    return Err(ApiError::forbidden(
                        rt.group,
                        rt.plural,
                        &name,
                        &format!(
                            "unable to create new content in namespace {ns} because it is being terminated"
                        ),
                    ));
                }
                Some(false) => {}
            }
        }
        let key = (ns.to_owned(), name.clone());
        // Quota admission comes before storage, as on the real server: a create of a name
        // that is taken is refused by a full quota (403, not 409), and one the quota admits
        // is charged to `status.used` before storage answers `409 AlreadyExists` — an
        // over-count the quota controller corrects only at its next recount.
        let charges = self.admit_quota(t, ns, &name, &obj, None)?;
        if !dry_run {
            self.charge_quotas(ns, charges);
        }
        if self.tables[t].objects.contains_key(&key) {
            return Err(ApiError::already_exists(rt.group, rt.plural, &name));
        }
        if dry_run {
            return Ok(Arc::new(Value::Null));
        }
        let rv = self.bump();
        {
            let meta = obj
                .as_object_mut()
                .map(|o| o.entry("metadata").or_insert_with(|| json!({})))
                .and_then(Value::as_object_mut);
            if let Some(meta) = meta {
                meta.insert("uid".into(), Value::from(uuid::Uuid::new_v4().to_string()));
                meta.insert("resourceVersion".into(), Value::from(rv.to_string()));
                meta.insert("creationTimestamp".into(), Value::from(created));
                meta.insert("generation".into(), Value::from(1));
                meta.remove("deletionTimestamp");
                meta.remove("deletionGracePeriodSeconds");
                meta.remove("selfLink");
                if rt.namespaced {
                    meta.insert("namespace".into(), Value::from(ns));
                } else {
                    meta.remove("namespace");
                }
                if t == PVCS {
                    add_finalizer(meta, "kubernetes.io/pvc-protection");
                }
            }
            if t == NAMESPACES {
                obj["spec"] = json!({"finalizers": ["kubernetes"]});
                obj["status"] = json!({"phase": "Active"});
            }
            if t == QUOTAS {
                // Callers cannot set a quota's status; its controller fills it.
                obj["status"] = json!({});
            }
            obj["apiVersion"] = Value::from(rt.api_version());
            obj["kind"] = Value::from(rt.kind);
            if t == SECRETS {
                normalize_secret(&mut obj);
            }
        }
        let obj = Arc::new(obj);
        self.index_insert(t, &key, &obj);
        self.tables[t].objects.insert(key, obj.clone());
        *self.tables[t].per_ns.entry(ns.to_owned()).or_default() += 1;
        self.emit(t, EventKind::Added, obj.clone(), None);
        self.track_peaks();
        Ok(obj)
    }

    fn track_peaks(&mut self) {
        self.peak_vms = self.peak_vms.max(self.tables[VMS].objects.len());
        self.peak_vmis = self.peak_vmis.max(self.tables[VMIS].objects.len());
    }

    /// Replaces an object with `f(current)`. Keeps identity fields, checks a non-empty
    /// `resourceVersion` in the result against the current one (409 on mismatch), bumps
    /// `generation` on spec changes, finishes a pending deletion when the last finalizer goes.
    pub fn update_with(
        &mut self,
        t: TypeId,
        ns: &str,
        name: &str,
        f: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Arc<Value>, ApiError> {
        self.update_or_dry_run(t, ns, name, false, f)
    }

    /// [`Store::update_with`], or with `dry_run` its dry run (`?dryRun=All`): every check of a
    /// real update (conflict, immutable fields, finalizers, quota), the same refusals, and
    /// the object that would be stored returned without storing it or charging a quota.
    pub fn update_or_dry_run(
        &mut self,
        t: TypeId,
        ns: &str,
        name: &str,
        dry_run: bool,
        f: impl FnOnce(&Value) -> Result<Value, ApiError>,
    ) -> Result<Arc<Value>, ApiError> {
        let rt = &TYPES[t];
        let key = (ns.to_owned(), name.to_owned());
        let Some(cur) = self.tables[t].objects.get(&key).cloned() else {
            return Err(ApiError::not_found(rt.group, rt.plural, name));
        };
        let mut new = f(&cur)?;
        if let Some(want) = meta_str(&new, "resourceVersion").filter(|s| !s.is_empty())
            && Some(want) != meta_str(&cur, "resourceVersion")
        {
            return Err(ApiError::conflict(
                rt.group,
                rt.plural,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            ));
        }
        if meta_str(&new, "name").is_some_and(|n| n != name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({}) does not match the name on the URL ({name})",
                meta_str(&new, "name").unwrap_or_default()
            )));
        }
        // Immutable identity and server-owned fields.
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
            "namespace",
            "name",
        ] {
            match cur["metadata"].get(f) {
                Some(v) => new["metadata"][f] = v.clone(),
                None => {
                    if let Some(m) = new["metadata"].as_object_mut() {
                        m.remove(f);
                    }
                }
            }
        }
        if is_deleting(&cur) {
            let before: BTreeSet<String> = finalizers(&cur).into_iter().collect();
            let added: BTreeSet<String> = finalizers(&new)
                .into_iter()
                .filter(|f| !before.contains(f))
                .collect();
            if !added.is_empty() {
                let list: Vec<String> = added.iter().map(|f| format!("{f:?}")).collect();
                return Err(ApiError::invalid(
                    rt.group,
                    &rt.qualified_kind(),
                    rt.plural,
                    name,
                    vec![(
                        "FieldValueForbidden".into(),
                        format!(
                            "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{{{}}}",
                            list.join(", ")
                        ),
                        "metadata.finalizers".into(),
                    )],
                ));
            }
        }
        if new.get("spec") != cur.get("spec") {
            let g = cur["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
            new["metadata"]["generation"] = Value::from(g);
        }
        new["apiVersion"] = Value::from(rt.api_version());
        new["kind"] = Value::from(rt.kind);
        if t == SECRETS {
            normalize_secret(&mut new);
        }
        if t == SECRETS || t == CONFIG_MAPS {
            let mut causes = if t == SECRETS {
                secret_type_causes(&cur, &new)
            } else {
                Vec::new()
            };
            causes.extend(immutable_causes(t, &cur, &new));
            if !causes.is_empty() {
                return Err(ApiError::invalid(
                    rt.group,
                    &rt.qualified_kind(),
                    rt.plural,
                    name,
                    causes,
                ));
            }
        }
        if new == *cur {
            return Ok(cur);
        }
        let charges = self.admit_quota(t, ns, name, &new, Some(&cur))?;
        if dry_run {
            // What would be stored; the real server's dry run keeps the current version.
            new["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
            return Ok(Arc::new(new));
        }
        self.charge_quotas(ns, charges);
        let rv = self.bump();
        new["metadata"]["resourceVersion"] = Value::from(rv.to_string());
        let finished = is_deleting(&new)
            && finalizers(&new).is_empty()
            && (t != NAMESPACES || self.namespace_is_empty(name));
        let new = Arc::new(new);
        self.index_remove(t, &key, &cur);
        if finished {
            self.remove_now(t, &key, new.clone());
            return Ok(new);
        }
        self.index_insert(t, &key, &new);
        self.tables[t].objects.insert(key, new.clone());
        self.emit(t, EventKind::Modified, new.clone(), Some(cur));
        Ok(new)
    }

    fn remove_now(&mut self, t: TypeId, key: &Key, last: Arc<Value>) {
        if let Some(old) = self.tables[t].objects.remove(key) {
            self.index_remove(t, key, &old);
            if let Some(c) = self.tables[t].per_ns.get_mut(&key.0) {
                *c = c.saturating_sub(1);
            }
        }
        let mut last = (*last).clone();
        last["metadata"]["resourceVersion"] = Value::from(self.rv.to_string());
        self.emit(t, EventKind::Deleted, Arc::new(last), None);
    }

    /// Deletes an object (see [`Propagation`]); `precondition_uid` / `precondition_rv` give a
    /// 409 when they do not match.
    pub fn delete(
        &mut self,
        t: TypeId,
        ns: &str,
        name: &str,
        propagation: Propagation,
        precondition_uid: Option<&str>,
        precondition_rv: Option<&str>,
    ) -> Result<Deleted, ApiError> {
        self.delete_with_grace(
            t,
            ns,
            name,
            propagation,
            (precondition_uid, precondition_rv),
            None,
        )
    }

    /// [`Store::delete`] with the request's `gracePeriodSeconds`, which decides how a pod
    /// bound to a node goes (see [`Store::set_graceful_pods`]): its own
    /// `terminationGracePeriodSeconds` (else 30) when `None`.
    pub fn delete_with_grace(
        &mut self,
        t: TypeId,
        ns: &str,
        name: &str,
        propagation: Propagation,
        (precondition_uid, precondition_rv): (Option<&str>, Option<&str>),
        grace: Option<i64>,
    ) -> Result<Deleted, ApiError> {
        let rt = &TYPES[t];
        let key = (ns.to_owned(), name.to_owned());
        let Some(cur) = self.tables[t].objects.get(&key).cloned() else {
            return Err(ApiError::not_found(rt.group, rt.plural, name));
        };
        if let Some(u) = precondition_uid
            && Some(u) != meta_str(&cur, "uid")
        {
            return Err(ApiError::conflict(
                rt.group,
                rt.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                    meta_str(&cur, "uid").unwrap_or_default()
                ),
            ));
        }
        if let Some(r) = precondition_rv
            && Some(r) != meta_str(&cur, "resourceVersion")
        {
            return Err(ApiError::conflict(
                rt.group,
                rt.plural,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {r}, ResourceVersion in object meta: {}",
                    meta_str(&cur, "resourceVersion").unwrap_or_default()
                ),
            ));
        }
        let uid = meta_str(&cur, "uid").unwrap_or_default().to_owned();
        if propagation == Propagation::Orphan {
            for (dt, dk) in self.dependents_of(&uid) {
                let _ = self.update_with(dt, &dk.0, &dk.1, |d| {
                    let mut d = d.clone();
                    if let Some(refs) = d["metadata"]["ownerReferences"].as_array_mut() {
                        refs.retain(|r| r["uid"].as_str() != Some(uid.as_str()));
                    }
                    d["metadata"]["resourceVersion"] = Value::from("");
                    Ok(d)
                });
            }
        }
        let mut fins = finalizers(&cur);
        if propagation == Propagation::Foreground && !self.dependents_of(&uid).is_empty() {
            fins.push("foregroundDeletion".into());
        }
        if t == NAMESPACES && !self.namespace_is_empty(name) {
            fins.push("kubernetes".into());
        }
        // A pod on a node ends when its kubelet says so: a grace period above 0 marks it (its
        // containers are told to stop), 0 removes it.
        let bound = self.graceful_pods
            && t == PODS
            && cur["spec"]["nodeName"]
                .as_str()
                .is_some_and(|n| !n.is_empty());
        let grace = grace
            .or_else(|| cur["spec"]["terminationGracePeriodSeconds"].as_i64())
            .unwrap_or(30)
            .max(0);
        if bound && grace > 0 && !is_deleting(&cur) {
            let rv = self.bump();
            let mut marked = (*cur).clone();
            let at = chrono::Utc::now() + chrono::TimeDelta::seconds(grace);
            marked["metadata"]["deletionTimestamp"] = Value::from(rfc3339(at));
            marked["metadata"]["deletionGracePeriodSeconds"] = Value::from(grace);
            marked["metadata"]["resourceVersion"] = Value::from(rv.to_string());
            let marked = Arc::new(marked);
            self.index_remove(t, &key, &cur);
            self.index_insert(t, &key, &marked);
            self.tables[t].objects.insert(key, marked.clone());
            self.emit(t, EventKind::Modified, marked.clone(), Some(cur));
            return Ok(Deleted::Pending(marked));
        }
        let confirmed = bound && grace == 0 && fins.is_empty();
        if is_deleting(&cur) && !confirmed {
            return Ok(Deleted::Pending(cur));
        }
        if fins.is_empty() {
            let rv = self.bump();
            let mut last = (*cur).clone();
            last["metadata"]["resourceVersion"] = Value::from(rv.to_string());
            let last = Arc::new(last);
            self.remove_now(t, &key, last.clone());
            return Ok(Deleted::Gone(last));
        }
        let rv = self.bump();
        let mut marked = (*cur).clone();
        marked["metadata"]["deletionTimestamp"] = Value::from(now_rfc3339());
        marked["metadata"]["deletionGracePeriodSeconds"] = Value::from(0);
        marked["metadata"]["resourceVersion"] = Value::from(rv.to_string());
        if let Some(m) = marked["metadata"].as_object_mut() {
            for f in fins.iter().filter(|f| *f == "foregroundDeletion") {
                add_finalizer(m, f);
            }
        }
        if t == NAMESPACES {
            marked["status"]["phase"] = Value::from("Terminating");
        }
        let marked = Arc::new(marked);
        self.index_remove(t, &key, &cur);
        self.index_insert(t, &key, &marked);
        self.tables[t].objects.insert(key, marked.clone());
        self.emit(t, EventKind::Modified, marked.clone(), Some(cur));
        Ok(Deleted::Pending(marked))
    }

    /// Removes a finalizer (by a controller); finishes the deletion if it was the last one.
    pub fn remove_finalizer(&mut self, t: TypeId, ns: &str, name: &str, finalizer: &str) {
        let _ = self.update_with(t, ns, name, |c| {
            let mut c = c.clone();
            if let Some(f) = c["metadata"]["finalizers"].as_array_mut() {
                f.retain(|x| x.as_str() != Some(finalizer));
                if f.is_empty()
                    && let Some(m) = c["metadata"].as_object_mut()
                {
                    m.remove("finalizers");
                }
            }
            c["metadata"]["resourceVersion"] = Value::from("");
            Ok(c)
        });
    }

    /// Removes a terminating object whose finalizers are all gone (a namespace once empty).
    pub fn finish_if_unblocked(&mut self, t: TypeId, ns: &str, name: &str) {
        let key = (ns.to_owned(), name.to_owned());
        if let Some(cur) = self.tables[t].objects.get(&key).cloned()
            && is_deleting(&cur)
            && finalizers(&cur).is_empty()
            && (t != NAMESPACES || self.namespace_is_empty(name))
        {
            self.bump();
            self.remove_now(t, &key, cur);
        }
    }

    /// Whether a namespace holds no objects.
    pub fn namespace_is_empty(&self, ns: &str) -> bool {
        self.tables
            .iter()
            .enumerate()
            .filter(|(t, _)| TYPES[*t].namespaced)
            .all(|(_, table)| table.per_ns.get(ns).copied().unwrap_or(0) == 0)
    }

    /// Lists with selectors and pagination over a consistent snapshot. The first page selects
    /// (through the label index when the selector has an equality) and keeps the matching
    /// objects (shared, not copied) for the pages after it; a later page is a slice of that
    /// snapshot.
    pub fn list(&mut self, t: TypeId, q: &ListQuery) -> Result<ListPage, ApiError> {
        let selectors = !q.labels.requirements.is_empty() || !q.fields.terms.is_empty();
        let page_end = |offset: usize, len: usize| {
            if q.limit == 0 {
                len
            } else {
                offset.saturating_add(q.limit).min(len)
            }
        };
        if let Some(tok) = &q.continue_token {
            let (id, offset) = decode_continue(tok).ok_or_else(|| {
                ApiError::bad_request(format!("continue key is not valid: {tok}"))
            })?;
            self.expire_snapshots();
            let snap = self.snapshots.get(&id).ok_or_else(|| {
                ApiError::gone("The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter.")
            })?;
            let end = page_end(offset, snap.items.len());
            let items = snap
                .items
                .get(offset..end)
                .map(<[_]>::to_vec)
                .unwrap_or_default();
            let left = snap.items.len().saturating_sub(end);
            return Ok(ListPage {
                items,
                rv: snap.rv,
                continue_token: (left > 0).then(|| encode_continue(id, end, snap.rv)),
                remaining: (left > 0 && !selectors).then_some(left as u64),
            });
        }
        let rv = self.rv;
        let mut all = self.select(t, q);
        let end = page_end(0, all.len());
        if end == all.len() {
            return Ok(ListPage {
                items: all,
                rv,
                continue_token: None,
                remaining: None,
            });
        }
        let items = all[..end].to_vec();
        let left = all.len() - end;
        all.shrink_to_fit();
        let id = self.next_snapshot;
        self.next_snapshot += 1;
        self.expire_snapshots();
        if self.snapshots.len() >= SNAPSHOTS
            && let Some(first) = self.snapshots.keys().next().copied()
        {
            self.snapshots.remove(&first);
        }
        self.snapshots.insert(
            id,
            Snapshot {
                created: Instant::now(),
                rv,
                items: all,
            },
        );
        Ok(ListPage {
            items,
            rv,
            continue_token: Some(encode_continue(id, end, rv)),
            remaining: (!selectors).then_some(left as u64),
        })
    }

    fn expire_snapshots(&mut self) {
        self.snapshots
            .retain(|_, s| s.created.elapsed().as_secs() < SNAPSHOT_TTL_SECS);
    }

    /// The objects matching a query (no pagination), in key order.
    pub fn select(&self, t: TypeId, q: &ListQuery) -> Vec<Arc<Value>> {
        let table = &self.tables[t];
        let ns = q.namespace.as_deref();
        if let Some(name) = q.fields.name() {
            return match ns {
                Some(ns) => table
                    .objects
                    .get(&(ns.to_owned(), name.to_owned()))
                    .filter(|o| q.labels.matches(o) && q.fields.matches(o))
                    .cloned()
                    .into_iter()
                    .collect(),
                None => table
                    .objects
                    .values()
                    .filter(|o| q.labels.matches(o) && q.fields.matches(o))
                    .cloned()
                    .collect(),
            };
        }
        // Use the smallest equality index among the requirements, if any.
        let indexed = q
            .labels
            .requirements
            .iter()
            .filter_map(|r| r.equality())
            .map(|(k, v)| table.by_label.get(&(k.to_owned(), v.to_owned())))
            .min_by_key(|s| s.map_or(0, BTreeSet::len));
        let matches = |o: &&Arc<Value>| q.labels.matches(o) && q.fields.matches(o);
        match indexed {
            Some(None) => Vec::new(),
            Some(Some(keys)) => keys
                .iter()
                .filter(|(n, _)| ns.is_none_or(|ns| ns == n))
                .filter_map(|k| table.objects.get(k))
                .filter(matches)
                .cloned()
                .collect(),
            None => match ns {
                Some(ns) => table
                    .objects
                    .range((ns.to_owned(), String::new())..)
                    .take_while(|((n, _), _)| n == ns)
                    .map(|(_, v)| v)
                    .filter(matches)
                    .cloned()
                    .collect(),
                None => table.objects.values().filter(matches).cloned().collect(),
            },
        }
    }

    /// The changes of type `t` after `rv`, or `Err` with the resourceVersion through which
    /// they are no longer kept if `rv` is older than that.
    pub fn history_since(&self, t: TypeId, rv: u64) -> Result<Vec<Arc<Event>>, u64> {
        let gone = self.history_gone_through[t];
        if rv < gone {
            return Err(gone);
        }
        let history = &self.history[t];
        let start = history.partition_point(|(_, e)| e.rv <= rv);
        Ok(history.range(start..).map(|(_, e)| e.clone()).collect())
    }

    // ---- ResourceQuota ----
    //
    // As on a real cluster, admission judges a request by the quota's *status*, never by its
    // spec: `status.hard` says what the quota covers and `status.used` what is in use. The
    // status is written by the quota controller (`crate::quota`, after
    // `SimConfig::quota_sync`) and by admission itself, which adds what it admits to
    // `status.used` at once. So a new quota (whose status the API server clears) covers
    // nothing until the controller's first sync, a changed `spec.hard` takes effect only
    // then, usage drops only when the controller recounts after a deletion, and a covered
    // resource the controller has not counted refuses creates with `status unknown for quota`
    // (kube-apiserver `plugin/pkg/admission/resourcequota`, `CheckRequest`).

    /// What is in use in `ns` of the quota resource `resource`, counted as the quota
    /// controller counts it (`None`: nothing it can count).
    fn quota_usage(&self, ns: &str, resource: &str) -> Option<Quantity> {
        let count = |t: TypeId| {
            Quantity::from_units(self.tables[t].per_ns.get(ns).copied().unwrap_or(0) as i64)
        };
        let live_pods = || {
            self.all(PODS, Some(ns))
                .into_iter()
                .filter(|p| !matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
        };
        match resource {
            "pods" | "count/pods" => Some(Quantity::from_units(live_pods().count() as i64)),
            "requests.memory" | "memory" => Some(
                live_pods()
                    .map(|p| pod_request(&p, "requests", "memory"))
                    .sum(),
            ),
            "limits.memory" => Some(
                live_pods()
                    .map(|p| pod_request(&p, "limits", "memory"))
                    .sum(),
            ),
            "requests.cpu" | "cpu" => Some(
                live_pods()
                    .map(|p| pod_request(&p, "requests", "cpu"))
                    .sum(),
            ),
            "limits.cpu" => Some(live_pods().map(|p| pod_request(&p, "limits", "cpu")).sum()),
            other => {
                let plural = other.strip_prefix("count/").unwrap_or(other);
                resources::find_by_resource(plural)
                    .filter(|t| {
                        TYPES[*t].namespaced
                            && (other.starts_with("count/") || TYPES[*t].group.is_empty())
                    })
                    .map(count)
            }
        }
    }

    /// Whether objects of type `t` count in the quota resource `resource` (the resources an
    /// evaluator matches: the object count, and for pods their compute resources).
    fn quota_covers(t: TypeId, resource: &str) -> bool {
        let rt = &TYPES[t];
        let plural = resource.strip_prefix("count/").unwrap_or(resource);
        if (plural == rt.plural || plural == rt.qualified())
            && (resource.starts_with("count/") || rt.group.is_empty())
        {
            return true;
        }
        t == PODS && compute_resource(resource).is_some()
    }

    /// What creating (or changing `old` into) `obj` adds to a quota resource it covers.
    fn quota_delta(t: TypeId, resource: &str, obj: &Value, old: Option<&Value>) -> Quantity {
        match compute_resource(resource) {
            Some((kind, res)) if t == PODS => {
                let new = pod_request(obj, kind, res);
                let before = old.map_or(Quantity::ZERO, |o| pod_request(o, kind, res));
                new - before
            }
            _ => Quantity::from_units(if old.is_none() { 1 } else { 0 }),
        }
    }

    /// Admission of a create (`old` is `None`) or a pod update against the namespace's quotas.
    /// Returns what to add to each quota's `status.used`.
    fn admit_quota(
        &self,
        t: TypeId,
        ns: &str,
        name: &str,
        obj: &Value,
        old: Option<&Value>,
    ) -> Result<Vec<QuotaCharge>, ApiError> {
        let rt = &TYPES[t];
        // Quota admission handles creates, and updates of pods only (in-place resize).
        if !rt.namespaced || (old.is_some() && t != PODS) {
            return Ok(Vec::new());
        }
        let forbidden = |why: String| ApiError::forbidden(rt.group, rt.plural, name, &why);
        let mut charges = Vec::new();
        for q in self.all(QUOTAS, Some(ns)) {
            let qname = meta_str(&q, "name").unwrap_or_default();
            let Some(hard) = q["status"]["hard"].as_object() else {
                continue;
            };
            let used = q["status"]["used"].as_object();
            let covered: Vec<&String> = hard.keys().filter(|r| Self::quota_covers(t, r)).collect();
            if covered.is_empty() {
                continue;
            }
            if t == PODS && old.is_none() {
                let missing = missing_requests(obj, &covered);
                if !missing.is_empty() {
                    return Err(forbidden(format!(
                        "failed quota: {qname}: must specify {missing}"
                    )));
                }
            }
            if covered
                .iter()
                .any(|r| used.is_none_or(|u| !u.contains_key(r.as_str())))
            {
                let mut names: Vec<&str> = covered.iter().map(|r| r.as_str()).collect();
                names.sort_unstable();
                return Err(forbidden(format!(
                    "status unknown for quota: {qname}, resources: {}",
                    names.join(",")
                )));
            }
            let mut charge = QuotaCharge {
                quota: qname.to_owned(),
                used: Vec::new(),
            };
            let mut exceeded = Vec::new();
            for res in covered {
                let delta = Self::quota_delta(t, res, obj, old);
                if delta <= Quantity::ZERO {
                    continue;
                }
                let cur = used
                    .and_then(|u| u.get(res.as_str()))
                    .and_then(quantity)
                    .unwrap_or_default();
                let limit = hard
                    .get(res.as_str())
                    .and_then(quantity)
                    .unwrap_or_default();
                if cur + delta > limit {
                    exceeded.push((res.as_str(), delta, cur, limit));
                }
                charge.used.push((res.clone(), cur + delta));
            }
            if !exceeded.is_empty() {
                exceeded.sort_unstable_by_key(|e| e.0);
                let list = |pick: fn(&Exceeded<'_>) -> Quantity| {
                    exceeded
                        .iter()
                        .map(|e| format!("{}={}", e.0, pick(e)))
                        .collect::<Vec<_>>()
                        .join(",")
                };
                return Err(forbidden(format!(
                    "exceeded quota: {qname}, requested: {}, used: {}, limited: {}",
                    list(|e| e.1),
                    list(|e| e.2),
                    list(|e| e.3)
                )));
            }
            if !charge.used.is_empty() {
                charges.push(charge);
            }
        }
        Ok(charges)
    }

    /// Writes what admission admitted into the quotas' `status.used`, as the admission plugin
    /// does before the object is stored.
    fn charge_quotas(&mut self, ns: &str, charges: Vec<QuotaCharge>) {
        for charge in charges {
            let key = (ns.to_owned(), charge.quota);
            let Some(q) = self.tables[QUOTAS].objects.get(&key).cloned() else {
                continue;
            };
            let mut new = (*q).clone();
            for (res, total) in charge.used {
                new["status"]["used"][res] = Value::from(total.to_string());
            }
            let rv = self.bump();
            new["metadata"]["resourceVersion"] = Value::from(rv.to_string());
            let new = Arc::new(new);
            self.tables[QUOTAS].objects.insert(key, new.clone());
            self.emit(QUOTAS, EventKind::Modified, new, Some(q));
        }
    }

    /// The quota controller's sync of the namespace's quotas: `status.hard` becomes
    /// `spec.hard`, and `status.used` the usage it counts now of each hard resource (except
    /// those `counts` refuses, which keep their last value, if any). Returns whether a quota
    /// changed.
    pub fn sync_quotas(&mut self, ns: &str, counts: &dyn Fn(&str) -> bool) -> bool {
        let mut changed = false;
        for q in self.all(QUOTAS, Some(ns)) {
            let hard = q["spec"]["hard"].as_object().cloned().unwrap_or_default();
            let mut used = serde_json::Map::new();
            for res in hard.keys() {
                let counted = counts(res)
                    .then(|| self.quota_usage(ns, res))
                    .flatten()
                    .map(|u| Value::from(u.to_string()));
                if let Some(u) = counted.or_else(|| q["status"]["used"].get(res).cloned()) {
                    used.insert(res.clone(), u);
                }
            }
            let status = json!({"hard": hard, "used": used});
            if q.get("status") == Some(&status) {
                continue;
            }
            let name = meta_str(&q, "name").unwrap_or_default().to_owned();
            let key = (ns.to_owned(), name);
            let rv = self.bump();
            let mut new = (*q).clone();
            new["status"] = status;
            new["metadata"]["resourceVersion"] = Value::from(rv.to_string());
            let new = Arc::new(new);
            self.tables[QUOTAS].objects.insert(key, new.clone());
            self.emit(QUOTAS, EventKind::Modified, new, Some(q));
            changed = true;
        }
        changed
    }

    /// Sets the status of an object directly (controllers), bumping resourceVersion.
    pub fn set_status(
        &mut self,
        t: TypeId,
        ns: &str,
        name: &str,
        status: Value,
    ) -> Option<Arc<Value>> {
        self.update_with(t, ns, name, |c| {
            let mut c = c.clone();
            c["status"] = status;
            c["metadata"]["resourceVersion"] = Value::from("");
            Ok(c)
        })
        .ok()
    }
}

/// Why an update of the Secret or ConfigMap `cur` into `new` is refused, when `cur` is
/// `immutable: true`: the flag cannot be unset, and its payload (`data`; a ConfigMap's
/// `binaryData` too; a Secret's `stringData` is already folded into `data` here) cannot
/// change. Metadata can. The causes of the real server's 422
/// (`ValidateConfigMapUpdate`, `ValidateSecretUpdate`).
fn immutable_causes(t: TypeId, cur: &Value, new: &Value) -> Vec<(String, String, String)> {
    if cur["immutable"].as_bool() != Some(true) {
        return Vec::new();
    }
    // An absent map and an empty one are the same map once stored.
    let payload = |obj: &Value, field: &str| -> Option<Value> {
        obj.get(field)
            .filter(|v| !v.is_null() && v.as_object().is_none_or(|m| !m.is_empty()))
            .cloned()
    };
    let mut fields = Vec::new();
    if new["immutable"].as_bool() != Some(true) {
        fields.push("immutable");
    }
    let payload_fields: &[&str] = if t == CONFIG_MAPS {
        &["data", "binaryData"]
    } else {
        &["data"]
    };
    for field in payload_fields {
        if payload(cur, field) != payload(new, field) {
            fields.push(field);
        }
    }
    fields
        .into_iter()
        .map(|field| {
            (
                "FieldValueForbidden".to_owned(),
                format!("{field}: Forbidden: field is immutable when `immutable` is set"),
                field.to_owned(),
            )
        })
        .collect()
}

/// Why an update of the Secret `cur` into `new` is refused for its `type`, which never
/// changes (`ValidateSecretUpdate`: `type: Invalid value: "<new>": field is immutable`, the
/// first cause, before those of [`immutable_causes`]). Both are already defaulted
/// ([`normalize_secret`]).
fn secret_type_causes(cur: &Value, new: &Value) -> Vec<(String, String, String)> {
    let type_of = |obj: &Value| obj["type"].as_str().unwrap_or_default().to_owned();
    let (before, after) = (type_of(cur), type_of(new));
    if before == after {
        return Vec::new();
    }
    vec![(
        "FieldValueInvalid".to_owned(),
        format!(
            "type: Invalid value: {}: field is immutable",
            Value::from(after)
        ),
        "type".to_owned(),
    )]
}

/// Moves `stringData` into `data` (base64), as the API server does on every write, and
/// defaults an absent or empty `type` to `Opaque`, as its defaulting does.
fn normalize_secret(obj: &mut Value) {
    use base64::Engine as _;
    if obj["type"].as_str().is_none_or(str::is_empty) {
        obj["type"] = Value::from("Opaque");
    }
    let Some(string_data) = obj.as_object_mut().and_then(|o| o.remove("stringData")) else {
        return;
    };
    let Some(map) = string_data.as_object() else {
        return;
    };
    if !obj["data"].is_object() {
        obj["data"] = json!({});
    }
    for (k, v) in map {
        let text = v.as_str().unwrap_or_default();
        obj["data"][k] = Value::from(base64::engine::general_purpose::STANDARD.encode(text));
    }
}

fn add_finalizer(meta: &mut serde_json::Map<String, Value>, f: &str) {
    let list = meta
        .entry("finalizers")
        .or_insert_with(|| Value::Array(Vec::new()));
    if let Some(a) = list.as_array_mut()
        && !a.iter().any(|x| x.as_str() == Some(f))
    {
        a.push(Value::from(f));
    }
}

/// A pod's `kind` (`requests` or `limits`) of `res`, as Kubernetes sums them for quotas and
/// the scheduler (`PodRequests`, `PodLimits`): the containers, plus every sidecar (an init
/// container with `restartPolicy: Always`, which runs beside them), or the most any init
/// step needs if that is more (an init container with the sidecars started before it). A
/// container's missing request is its limit, as defaulting makes it.
fn pod_request(pod: &Value, kind: &str, res: &str) -> Quantity {
    let of = |c: &Value| -> Quantity {
        quantity(&c["resources"][kind][res])
            .or_else(|| {
                (kind == "requests")
                    .then(|| quantity(&c["resources"]["limits"][res]))
                    .flatten()
            })
            .unwrap_or_default()
    };
    let list = |key: &str| pod["spec"][key].as_array().cloned().unwrap_or_default();
    let mut total: Quantity = list("containers").iter().map(of).sum();
    let mut sidecars = Quantity::ZERO;
    let mut init_peak = Quantity::ZERO;
    for c in list("initContainers") {
        let step = if c["restartPolicy"] == "Always" {
            total = total + of(&c);
            sidecars = sidecars + of(&c);
            sidecars
        } else {
            of(&c) + sidecars
        };
        init_peak = init_peak.max(step);
    }
    total.max(init_peak)
}

/// A quantity in an object: a string (surrounding spaces ignored, as the API server reads
/// it) or a JSON number.
fn quantity(v: &Value) -> Option<Quantity> {
    match v {
        Value::String(s) => s.trim().parse().ok(),
        Value::Number(n) => n.to_string().parse().ok(),
        _ => None,
    }
}

/// `(requests|limits, memory|cpu)` of a quota compute resource.
fn compute_resource(quota_res: &str) -> Option<(&'static str, &'static str)> {
    match quota_res {
        "requests.memory" | "memory" => Some(("requests", "memory")),
        "limits.memory" => Some(("limits", "memory")),
        "requests.cpu" | "cpu" => Some(("requests", "cpu")),
        "limits.cpu" => Some(("limits", "cpu")),
        _ => None,
    }
}

/// The compute resources among `covered` some container of `pod` does not set, as quota
/// admission words them: `limits.cpu for: a,b; requests.memory for: a` (empty: none). A
/// limit stands for a missing request, as defaulting makes it one.
fn missing_requests(pod: &Value, covered: &[&String]) -> String {
    // Init containers too, as quota admission checks them (`podEvaluator.Constraints`).
    let containers: Vec<&Value> = ["containers", "initContainers"]
        .iter()
        .filter_map(|key| pod["spec"][*key].as_array())
        .flatten()
        .collect();
    let mut missing: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    for res in covered {
        let Some((kind, r)) = compute_resource(res) else {
            continue;
        };
        for c in &containers {
            let set = !c["resources"][kind][r].is_null()
                || (kind == "requests" && !c["resources"]["limits"][r].is_null());
            if !set {
                missing
                    .entry(res.as_str())
                    .or_default()
                    .insert(c["name"].as_str().unwrap_or_default());
            }
        }
    }
    missing
        .iter()
        .map(|(res, names)| {
            format!(
                "{res} for: {}",
                names.iter().copied().collect::<Vec<_>>().join(",")
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn encode_continue(id: u64, offset: usize, rv: u64) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!(
        "{{\"v\":\"meta.k8s.io/v1\",\"rv\":{rv},\"snapshot\":{id},\"offset\":{offset}}}"
    ))
}

fn decode_continue(tok: &str) -> Option<(u64, usize)> {
    use base64::Engine as _;
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(tok.trim_end_matches('='))
        .ok()?;
    let v: Value = serde_json::from_slice(&raw).ok()?;
    Some((
        v["snapshot"].as_u64()?,
        usize::try_from(v["offset"].as_u64()?).ok()?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_renders_common_quantities() {
        let parse = |s: &str| quantity(&Value::from(s));
        let milli = |m: i128| Some(Quantity::from_milli(m));
        assert_eq!(parse("1Gi"), milli(1_073_741_824_000));
        assert_eq!(parse("500m"), milli(500));
        assert_eq!(
            parse("1.5Gi").map(|q| q.to_string()).as_deref(),
            Some("1536Mi")
        );
        assert_eq!(parse("2").map(|q| q.to_string()).as_deref(), Some("2"));
        assert_eq!(parse("1e3"), milli(1_000_000));
        assert_eq!(parse("1k"), milli(1_000_000));
        assert_eq!(parse("abc"), None);
        assert_eq!(parse("1Xi"), None);
        assert_eq!(
            Quantity::from_milli(48 * (1 << 30) * 1000).to_string(),
            "48Gi"
        );
        assert_eq!(parse(" 2Gi "), parse("2Gi"));
        assert_eq!(quantity(&json!(3)), milli(3000));
        assert_eq!(quantity(&json!(0.5)), milli(500));
    }

    fn store_with_ns() -> Store {
        let mut s = Store::new();
        s.create(NAMESPACES, "", json!({"metadata": {"name": "ns"}}))
            .unwrap();
        s
    }

    fn secret(name: &str, env: &str) -> Value {
        json!({"metadata": {"name": name, "labels": {"env": env}}, "type": "Opaque"})
    }

    #[test]
    fn pagination_is_a_consistent_snapshot() {
        let mut s = store_with_ns();
        for i in 0..10 {
            s.create(SECRETS, "ns", secret(&format!("s{i:02}"), "dev"))
                .unwrap();
        }
        let mut q = ListQuery {
            namespace: Some("ns".into()),
            limit: 4,
            ..Default::default()
        };
        let p1 = s.list(SECRETS, &q).unwrap();
        assert_eq!(p1.items.len(), 4);
        assert_eq!(p1.remaining, Some(6));
        // A change between pages does not show up in later pages.
        s.delete(SECRETS, "ns", "s09", Propagation::Background, None, None)
            .unwrap();
        q.continue_token = p1.continue_token.clone();
        let p2 = s.list(SECRETS, &q).unwrap();
        q.continue_token = p2.continue_token.clone();
        let p3 = s.list(SECRETS, &q).unwrap();
        assert_eq!(p3.items.len(), 2);
        assert!(p3.continue_token.is_none());
        assert_eq!(meta_str(&p3.items[1], "name"), Some("s09"));
        assert_eq!(p2.rv, p1.rv);
    }

    #[test]
    fn string_data_is_stored_as_data() {
        let mut s = store_with_ns();
        let o = s
            .create(
                SECRETS,
                "ns",
                json!({"metadata": {"name": "a"}, "stringData": {"userdata": "hi"}}),
            )
            .unwrap();
        assert_eq!(o["data"]["userdata"], "aGk=");
        assert!(o.get("stringData").is_none());
    }

    #[test]
    fn quota_counts_and_rejects_like_admission() {
        let mut s = store_with_ns();
        s.create(
            QUOTAS,
            "ns",
            json!({"metadata": {"name": "q"}, "spec": {"hard": {"count/secrets": "1"}}, "status": {"hard": {"count/secrets": "9"}}}),
        )
        .unwrap();
        // The status is the controller's: cleared on create, and nothing is covered yet.
        assert_eq!(s.get(QUOTAS, "ns", "q").unwrap()["status"], json!({}));
        s.create(SECRETS, "ns", secret("early", "dev")).unwrap();
        assert!(s.sync_quotas("ns", &|_| true));
        assert_eq!(
            s.get(QUOTAS, "ns", "q").unwrap()["status"],
            json!({"hard": {"count/secrets": "1"}, "used": {"count/secrets": "1"}})
        );
        s.delete(SECRETS, "ns", "early", Propagation::Background, None, None)
            .unwrap();
        // Still counted until the controller recounts.
        let e = s.create(SECRETS, "ns", secret("a", "dev")).unwrap_err();
        assert!(e.message.contains("exceeded quota: q"), "{}", e.message);
        s.sync_quotas("ns", &|_| true);
        s.create(SECRETS, "ns", secret("a", "dev")).unwrap();
        let e = s.create(SECRETS, "ns", secret("b", "dev")).unwrap_err();
        assert_eq!(e.code, 403);
        assert_eq!(
            e.message,
            "secrets \"b\" is forbidden: exceeded quota: q, requested: count/secrets=1, used: count/secrets=1, limited: count/secrets=1"
        );
        // Admission itself charged the quota.
        assert_eq!(
            s.get(QUOTAS, "ns", "q").unwrap()["status"]["used"]["count/secrets"],
            "1"
        );
    }

    #[test]
    fn an_uncounted_resource_leaves_the_quota_status_unknown() {
        let mut s = store_with_ns();
        s.create(
            QUOTAS,
            "ns",
            json!({"metadata": {"name": "q"}, "spec": {"hard": {"count/secrets": "5", "pods": "2"}}}),
        )
        .unwrap();
        s.sync_quotas("ns", &|r| r != "count/secrets");
        let e = s.create(SECRETS, "ns", secret("a", "dev")).unwrap_err();
        assert_eq!((e.code, e.reason), (403, "Forbidden"));
        assert_eq!(
            e.message,
            "secrets \"a\" is forbidden: status unknown for quota: q, resources: count/secrets"
        );
        // Creates the quota does not cover for the unknown resource are unaffected.
        s.create(
            PVCS,
            "ns",
            json!({"metadata": {"name": "p"}, "spec": {"resources": {"requests": {"storage": "1Gi"}}}}),
        )
        .unwrap();
        s.sync_quotas("ns", &|_| true);
        s.create(SECRETS, "ns", secret("a", "dev")).unwrap();
    }

    #[test]
    fn pods_must_name_the_compute_resources_a_quota_covers() {
        let mut s = store_with_ns();
        s.create(
            QUOTAS,
            "ns",
            json!({"metadata": {"name": "q"}, "spec": {"hard": {"requests.memory": "1Gi", "limits.cpu": "2"}}}),
        )
        .unwrap();
        s.sync_quotas("ns", &|_| true);
        let pod = json!({"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "a", "resources": {"requests": {"memory": "1Mi"}}},
            {"name": "b"}
        ]}});
        let e = s.create(PODS, "ns", pod).unwrap_err();
        assert_eq!(
            e.message,
            "pods \"p\" is forbidden: failed quota: q: must specify limits.cpu for: a,b; requests.memory for: b"
        );
        // Init containers must name them too.
        let pod = json!({"metadata": {"name": "p"}, "spec": {
            "containers": [{"name": "a", "resources": {"requests": {"memory": "1Mi"}, "limits": {"cpu": "1"}}}],
            "initContainers": [{"name": "i", "resources": {"limits": {"cpu": "1"}}}]
        }});
        let e = s.create(PODS, "ns", pod).unwrap_err();
        assert_eq!(
            e.message,
            "pods \"p\" is forbidden: failed quota: q: must specify requests.memory for: i"
        );
    }

    #[test]
    fn sidecars_count_with_the_containers_and_init_steps_by_their_peak() {
        let mem = |m: &str| json!({"requests": {"memory": m}});
        // A launcher pod: the compute container, the console log's sidecar, the container
        // disk's init container.
        let launcher = json!({"spec": {
            "containers": [{"name": "compute", "resources": mem("2340Mi")}],
            "initContainers": [
                {"name": "guest-console-log", "restartPolicy": "Always", "resources": mem("35M")},
                {"name": "volumerootdisk", "resources": mem("1M")}
            ]
        }});
        assert_eq!(
            pod_request(&launcher, "requests", "memory"),
            Quantity::from_units((2340 << 20) + 35_000_000)
        );
        // An init step bigger than the containers (with the sidecars started before it).
        let big_init = json!({"spec": {
            "containers": [{"name": "c", "resources": mem("100M")}],
            "initContainers": [
                {"name": "s", "restartPolicy": "Always", "resources": mem("10M")},
                {"name": "i", "resources": mem("500M")}
            ]
        }});
        assert_eq!(
            pod_request(&big_init, "requests", "memory"),
            Quantity::from_units(510_000_000)
        );
        // A limit stands for a missing request.
        let limited = json!({"spec": {"containers": [{"name": "c", "resources": {"limits": {"memory": "1Gi"}}}]}});
        assert_eq!(
            pod_request(&limited, "requests", "memory"),
            Quantity::from_units(1 << 30)
        );
    }
}
