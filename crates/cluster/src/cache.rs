//! A listing kept current by a watch: [`ObjectCache`], what the reaper reads its cycle's
//! objects from instead of listing 10,000 VMs every interval.
//!
//! A background task lists the objects of one kind matching a label selector (metadata only),
//! then follows a watch from the list's resourceVersion (kube-rs' runtime `watcher`), applying
//! every creation, change and deletion to an in-memory map of [`ObjectSummary`]s. Every
//! `max_age` it starts over from a fresh list, so what it serves is never older than one
//! rebuild even if a watch went quiet without failing (a half-open connection). Any watch
//! failure also starts it over, after a pause.
//!
//! [`ObjectCache::snapshot`] answers only while the cache is trustworthy: its last full list
//! completed less than `max_age` ago and no failure came after it. Otherwise `None`, and the
//! caller lists the cluster itself — the cache is an optimisation, never the only way to see.
//! [`ObjectCache::first_fill`] waits for the first list (a caller starting up reads it instead
//! of listing the same objects beside it), and [`ObjectCache::saw_deleted_since`] says
//! whether the watch reported an object's deletion: a teardown's confirmation that costs no
//! request.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::ObjectSummary;

/// The pause before a failed watch starts over, doubling up to [`MAX_RESTART_PAUSE`].
pub(crate) const FIRST_RESTART_PAUSE: Duration = Duration::from_millis(500);
/// The longest pause before a failed watch starts over.
pub(crate) const MAX_RESTART_PAUSE: Duration = Duration::from_secs(30);
/// How long a deletion the watch reported is remembered.
pub(crate) const REMEMBER_DELETIONS: Duration = Duration::from_secs(10 * 60);
/// How often [`ObjectCache::first_fill`] looks whether the first list is complete.
const FIRST_FILL_POLL: Duration = Duration::from_millis(20);

/// The objects of a [`ObjectCache`] at one moment, by name.
pub type Snapshot = Arc<BTreeMap<String, ObjectSummary>>;

/// A watch-fed listing of one kind and selector. Dropping it stops its watch.
#[derive(Debug)]
pub struct ObjectCache {
    state: Arc<Mutex<CacheState>>,
    task: tokio::task::AbortHandle,
}

impl ObjectCache {
    /// A cache over `state`, fed by `task` (aborted when the cache is dropped).
    pub(crate) fn new(state: Arc<Mutex<CacheState>>, task: tokio::task::AbortHandle) -> Self {
        Self { state, task }
    }

    /// The objects as the watch last saw them, by name; `None` while the cache is not
    /// trustworthy (never listed yet, rebuilding, failed since its last list, or its last list
    /// older than its maximum age).
    /// Shared, not copied: a reader holds the listing as it was while the watch goes on (the
    /// cache copies its map only when it changes while someone holds it).
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.lock().snapshot(Instant::now())
    }

    /// The objects once the first list has completed, waiting for it at most `within`; `None`
    /// at once when the cache is past its first list (trustworthy or not: see
    /// [`ObjectCache::snapshot`]), or when the first list failed or did not complete in time.
    /// For a caller starting up, which would otherwise list the same objects beside the
    /// cache's own first list and hold both in memory at once.
    pub async fn first_fill(&self, within: Duration) -> Option<Snapshot> {
        let until = Instant::now() + within;
        loop {
            {
                let state = self.lock();
                if let Some(objects) = state.snapshot(Instant::now()) {
                    return Some(objects);
                }
                if !state.filling_first {
                    return None;
                }
            }
            if Instant::now() + FIRST_FILL_POLL > until {
                return None;
            }
            tokio::time::sleep(FIRST_FILL_POLL).await;
        }
    }

    /// Whether the watch reported the deletion of the object `name` at or after `since` (in
    /// the last [`REMEMBER_DELETIONS`]). Only a reported deletion counts: an object merely
    /// absent may be one the watch has not brought yet.
    pub fn saw_deleted_since(&self, name: &str, since: std::time::Instant) -> bool {
        self.lock()
            .deleted
            .at
            .get(name)
            .is_some_and(|seen| seen.into_std() >= since)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, CacheState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for ObjectCache {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the watch has seen, and whether it can be trusted. Changed by the feeding task, read
/// by [`ObjectCache::snapshot`].
#[derive(Debug)]
pub(crate) struct CacheState {
    /// The objects since the last completed list, kept current by the watch (shared with
    /// the readers of a snapshot).
    objects: Snapshot,
    /// A list in progress (`Init` seen, `InitDone` not yet).
    building: Option<BTreeMap<String, ObjectSummary>>,
    /// When the last list completed; `None` when the contents are not trustworthy.
    synced_at: Option<Instant>,
    /// How old a list may be before the contents stop being served.
    max_age: Duration,
    /// Until the first list completes or the watch first fails.
    filling_first: bool,
    /// The deletions the watch reported.
    deleted: Deletions,
}

/// The deletions a watch reported in the last [`REMEMBER_DELETIONS`], by name.
#[derive(Debug, Default)]
struct Deletions {
    /// When each name's deletion was reported (the last one).
    at: HashMap<String, Instant>,
    /// The same, oldest first, to forget them in order.
    order: VecDeque<(Instant, String)>,
}

impl Deletions {
    fn record(&mut self, name: String, now: Instant) {
        while let Some((seen, _)) = self.order.front() {
            if now.saturating_duration_since(*seen) < REMEMBER_DELETIONS {
                break;
            }
            if let Some((seen, old)) = self.order.pop_front()
                && self.at.get(&old) == Some(&seen)
            {
                self.at.remove(&old);
            }
        }
        self.at.insert(name.clone(), now);
        self.order.push_back((now, name));
    }
}

/// One change the watch reports, as the cache needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Change {
    /// A (re)list begins.
    ListStart,
    /// One object of the list in progress.
    Listed(ObjectSummary),
    /// The list is complete.
    ListDone,
    /// An object was created or changed.
    Applied(ObjectSummary),
    /// An object was deleted.
    Deleted(String),
    /// The watch failed: nothing is trusted until the next complete list.
    Failed,
}

impl CacheState {
    /// An empty, untrusted state.
    pub(crate) fn new(max_age: Duration) -> Self {
        Self {
            objects: Arc::default(),
            building: None,
            synced_at: None,
            max_age,
            filling_first: true,
            deleted: Deletions::default(),
        }
    }

    /// Applies one change, seen at `now`.
    pub(crate) fn apply(&mut self, change: Change, now: Instant) {
        match change {
            Change::ListStart => self.building = Some(BTreeMap::new()),
            Change::Listed(o) => {
                self.building
                    .get_or_insert_with(BTreeMap::new)
                    .insert(o.name.clone(), o);
            }
            Change::ListDone => {
                self.objects = Arc::new(self.building.take().unwrap_or_default());
                self.synced_at = Some(now);
                self.filling_first = false;
            }
            Change::Applied(o) => {
                Arc::make_mut(&mut self.objects).insert(o.name.clone(), o);
            }
            Change::Deleted(name) => {
                if self.objects.contains_key(&name) {
                    Arc::make_mut(&mut self.objects).remove(&name);
                }
                self.deleted.record(name, now);
            }
            Change::Failed => {
                self.building = None;
                self.synced_at = None;
                self.filling_first = false;
            }
        }
    }

    /// How many objects it holds (trustworthy or not).
    pub(crate) fn len(&self) -> usize {
        self.objects.len()
    }

    /// The objects at `now`, if trustworthy.
    pub(crate) fn snapshot(&self, now: Instant) -> Option<Snapshot> {
        let synced = self.synced_at?;
        (now.saturating_duration_since(synced) < self.max_age).then(|| Arc::clone(&self.objects))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kind;

    fn object(name: &str) -> ObjectSummary {
        ObjectSummary {
            kind: Kind::VirtualMachine,
            name: name.into(),
            uid: format!("uid-{name}"),
            labels: BTreeMap::new(),
            created_at: None,
            deleting: false,
            owner_uids: Vec::new(),
        }
    }

    fn names(s: Option<Snapshot>) -> Option<Vec<String>> {
        s.map(|v| v.keys().cloned().collect())
    }

    #[test]
    fn nothing_is_served_before_the_first_list_completes() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        assert_eq!(s.snapshot(t0), None);
        s.apply(Change::ListStart, t0);
        s.apply(Change::Listed(object("a")), t0);
        assert_eq!(s.snapshot(t0), None, "a list half done is not served");
        s.apply(Change::ListDone, t0);
        assert_eq!(names(s.snapshot(t0)), Some(vec!["a".to_owned()]));
    }

    #[test]
    fn watch_events_keep_the_listing_current() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        for c in [
            Change::ListStart,
            Change::Listed(object("a")),
            Change::Listed(object("b")),
            Change::ListDone,
            Change::Applied(object("c")),
            Change::Deleted("a".into()),
        ] {
            s.apply(c, t0);
        }
        assert_eq!(
            names(s.snapshot(t0)),
            Some(vec!["b".to_owned(), "c".to_owned()])
        );
    }

    #[test]
    fn a_relist_replaces_the_contents_and_a_failure_withdraws_them() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        for c in [
            Change::ListStart,
            Change::Listed(object("a")),
            Change::ListDone,
        ] {
            s.apply(c, t0);
        }
        // A relist in progress keeps serving the previous contents...
        s.apply(Change::ListStart, t0);
        s.apply(Change::Listed(object("b")), t0);
        assert_eq!(names(s.snapshot(t0)), Some(vec!["a".to_owned()]));
        // ...and replaces them when complete: what the list did not return is gone.
        s.apply(Change::ListDone, t0);
        assert_eq!(names(s.snapshot(t0)), Some(vec!["b".to_owned()]));
        s.apply(Change::Failed, t0);
        assert_eq!(s.snapshot(t0), None, "nothing is trusted after a failure");
    }

    #[test]
    fn deletions_are_remembered_from_when_they_were_reported_and_forgotten_later() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        for c in [
            Change::ListStart,
            Change::Listed(object("a")),
            Change::Listed(object("b")),
            Change::ListDone,
        ] {
            s.apply(c, t0);
        }
        let later = t0 + Duration::from_secs(1);
        s.apply(Change::Deleted("a".into()), later);
        let seen = |s: &CacheState, name: &str, since: Instant| {
            s.deleted.at.get(name).is_some_and(|at| *at >= since)
        };
        assert!(
            seen(&s, "a", t0),
            "reported after the deletion was asked for"
        );
        assert!(
            !seen(&s, "a", later + Duration::from_millis(1)),
            "a report from before a deletion was asked for is not its confirmation"
        );
        assert!(!seen(&s, "b", t0), "absent from reports: not confirmed");
        // Reports older than the memory are forgotten as new ones come.
        s.apply(
            Change::Deleted("b".into()),
            later + REMEMBER_DELETIONS + Duration::from_secs(1),
        );
        assert!(!seen(&s, "a", t0));
        assert!(seen(&s, "b", t0));
        assert_eq!(s.deleted.order.len(), 1);
    }

    #[test]
    fn the_first_fill_ends_with_the_first_list_or_the_first_failure() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        assert!(s.filling_first);
        s.apply(Change::ListStart, t0);
        s.apply(Change::Listed(object("a")), t0);
        assert!(s.filling_first, "half a list");
        s.apply(Change::ListDone, t0);
        assert!(!s.filling_first);
        let mut f = CacheState::new(Duration::from_secs(300));
        f.apply(Change::Failed, t0);
        assert!(!f.filling_first, "a failed first list is not waited for");
    }

    #[test]
    fn contents_older_than_the_maximum_age_are_not_served() {
        let t0 = Instant::now();
        let mut s = CacheState::new(Duration::from_secs(300));
        for c in [Change::ListStart, Change::ListDone] {
            s.apply(c, t0);
        }
        assert_eq!(
            names(s.snapshot(t0 + Duration::from_secs(299))),
            Some(Vec::<String>::new())
        );
        // Events alone do not make old contents young again: only a full list does.
        s.apply(Change::Applied(object("a")), t0 + Duration::from_secs(299));
        assert_eq!(s.snapshot(t0 + Duration::from_secs(300)), None);
    }
}
