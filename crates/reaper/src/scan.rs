//! The cluster-driven directions: ghosts (running rows whose VM or pod is gone) and orphans
//! (objects of this environment whose session is not live). Both start from one listing of
//! the environment's objects on this site's cluster, taken after the database's live sessions
//! of this site were read. A session live on another site is never an orphan here either: each
//! candidate's row is read again before deletion, and a live row (of any site) is left alone.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use ttlab_cluster::{Kind, ObjectSummary, Propagation};
use ttlab_model::labels::{ObjectLabels, env_selector};
use ttlab_model::{LessonId, Runtime, SessionId, SessionStatus};
use ttlab_store::Direction;

use crate::error::{cluster_error_kind, store_error_kind};
use crate::{CycleReport, ReaperContext};

/// The kinds the orphan direction looks at, in deletion order (VMs before their Secrets).
pub const ORPHAN_KINDS: [Kind; 5] = [
    Kind::VirtualMachine,
    Kind::Secret,
    Kind::Service,
    Kind::NetworkPolicy,
    Kind::Pod,
];

/// The label KubeVirt puts on the launcher pods it owns (they carry the VM's labels too, but
/// are KubeVirt's to delete).
const KUBEVIRT_LABEL: &str = "kubevirt.io";

/// The live sessions of the environment on this site, as read from the database.
#[derive(Debug, Default)]
pub(crate) struct LiveSet {
    /// Every live session id.
    pub(crate) ids: BTreeSet<SessionId>,
    /// The running ones, with what they run on and their object names.
    pub(crate) running: Vec<RunningSession>,
}

/// A running session as the ghost direction needs it.
#[derive(Debug, Clone)]
pub(crate) struct RunningSession {
    pub(crate) id: SessionId,
    pub(crate) lesson: LessonId,
    pub(crate) runtime: Runtime,
    /// The names of its VMs (or its pod).
    pub(crate) names: Vec<String>,
}

pub(crate) async fn read_live(ctx: &ReaperContext) -> Result<LiveSet, ttlab_store::StoreError> {
    let mut live = LiveSet::default();
    let mut after = None;
    loop {
        let page = ctx
            .store
            .sessions()
            .list_live_on(&ctx.env, &ctx.site, after, ctx.settings.page_size)
            .await?;
        let full = page.len() == ctx.settings.page_size as usize;
        after = page.last().map(|s| s.id);
        for s in page {
            live.ids.insert(s.id);
            if s.status == SessionStatus::Running {
                live.running.push(RunningSession {
                    id: s.id,
                    lesson: s.lesson,
                    runtime: s.runtime,
                    names: s.vms.into_iter().map(|v| v.name).collect(),
                });
            }
        }
        if !full {
            return Ok(live);
        }
    }
}

/// The environment's objects, by kind.
pub(crate) type Listing = BTreeMap<Kind, Objects>;

/// One kind's objects: listed for this cycle, or shared with a watch-fed listing (never
/// copied: a cycle over 10,000 VMs does not hold a second listing of them).
pub(crate) enum Objects {
    Listed(Vec<ObjectSummary>),
    Cached(ttlab_cluster::Snapshot),
}

impl Objects {
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = &ObjectSummary> + '_> {
        match self {
            Objects::Listed(v) => Box::new(v.iter()),
            Objects::Cached(m) => Box::new(m.values()),
        }
    }
}

/// Lists every kind the orphan direction looks at, selecting on this environment's label only
/// (an object of another environment, or without labels, is never even read). Metadata only,
/// and the kinds at once: each kind's pages follow one another, but the VMs' pages do not wait
/// for the Secrets'. A kind with a trustworthy watch-fed listing
/// ([`ReaperContext::with_cached_listings`]) is read from it instead: as safe as a list, since
/// an orphan is only ever an object whose session is no longer live (a listing from the past
/// can only miss new orphans until the watch brings them, never invent one), and a ghost is
/// confirmed by a direct get.
pub(crate) async fn list_env_objects(
    ctx: &ReaperContext,
) -> Result<Listing, ttlab_cluster::ClusterError> {
    let selector = env_selector(&ctx.env);
    let lists = futures::future::try_join_all(ORPHAN_KINDS.map(|kind| {
        let selector = &selector;
        async move {
            let objects = match ctx.cached(kind).await {
                Some(objects) => Objects::Cached(objects),
                None => Objects::Listed(ctx.cluster.list_all(kind, selector).await?),
            };
            Ok::<_, ttlab_cluster::ClusterError>((kind, objects))
        }
    }))
    .await?;
    Ok(lists.into_iter().collect())
}

/// Running sessions whose VMs (or pod) are not in the listing are confirmed gone by a direct
/// get, then marked ghost. Returns the sessions marked.
pub(crate) async fn ghosts(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    live: &LiveSet,
    listing: &Listing,
) -> BTreeSet<SessionId> {
    let present = |kind: Kind| -> BTreeSet<&str> {
        listing
            .get(&kind)
            .map(|v| v.iter().map(|o| o.name.as_str()).collect())
            .unwrap_or_default()
    };
    let vms = present(Kind::VirtualMachine);
    let pods = present(Kind::Pod);
    let suspects: Vec<(RunningSession, Kind)> = live
        .running
        .iter()
        .filter_map(|s| {
            let (kind, seen) = match s.runtime {
                Runtime::Vm => (Kind::VirtualMachine, &vms),
                Runtime::Pod => (Kind::Pod, &pods),
            };
            // Without recorded names there is nothing to confirm against.
            let all_missing =
                !s.names.is_empty() && s.names.iter().all(|n| !seen.contains(n.as_str()));
            all_missing.then(|| (s.clone(), kind))
        })
        .collect();
    let shutdown = ctx.shutdown.clone();
    let mut results = futures::stream::iter(suspects)
        .take_while(|_| std::future::ready(!shutdown.is_cancelled()))
        .map(|(s, kind)| async move {
            let result = confirm_ghost(ctx, s.id, kind, &s.names).await;
            (s, kind, result)
        })
        .buffer_unordered(ctx.settings.concurrency.max(1));
    let mut marked = BTreeSet::new();
    while let Some((s, kind, result)) = results.next().await {
        match result {
            Ok(true) => {
                marked.insert(s.id);
                let gone: Vec<String> = s.names.iter().map(|n| format!("{kind}/{n}")).collect();
                let what = format!(
                    "lesson {}, running but {} gone: {}",
                    s.lesson,
                    gone.join(", "),
                    if ctx.settings.dry_run {
                        "would mark ghost"
                    } else {
                        "marked ghost"
                    }
                );
                report.done(Direction::Ghosts, s.id.to_string(), what);
            }
            Ok(false) => {}
            Err(message) => {
                tracing::warn!(session = %s.id, error = %message, "ghost check failed");
                report.failed(Direction::Ghosts, s.id.to_string(), message);
            }
        }
    }
    marked
}

/// `Ok(true)` when every object of the session is confirmed absent and the row was marked
/// ghost (or, dry run, would be).
async fn confirm_ghost(
    ctx: &ReaperContext,
    id: SessionId,
    kind: Kind,
    names: &[String],
) -> Result<bool, String> {
    for name in names {
        match ctx.cluster.get(kind, name).await {
            Ok(None) => {}
            Ok(Some(_)) => return Ok(false),
            Err(e) => {
                return Err(format!(
                    "get {kind}/{name}: {}: {e}",
                    cluster_error_kind(&e)
                ));
            }
        }
    }
    if ctx.settings.dry_run {
        return Ok(true);
    }
    match ctx.store.sessions().mark_ghost(id).await {
        Ok(Some(_)) => Ok(true),
        // No longer running (finished, expired or extended into finishing meanwhile).
        Ok(None) => Ok(false),
        Err(e) => Err(format!("mark ghost: {}: {e}", store_error_kind(&e))),
    }
}

/// One object judged an orphan when the listing was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrphanCandidate {
    /// Its kind.
    pub kind: Kind,
    /// Its name.
    pub name: String,
    /// The session its labels name.
    pub session: SessionId,
}

/// The orphan candidates of a listing: objects labelled as ttlab's with this environment,
/// whose session is not in `live`, that are not being deleted already and are at least
/// `orphan_min_age` old at `now`. Unlabelled objects and other environments' objects are
/// never candidates, whatever they look like.
pub(crate) fn orphan_candidates(
    ctx: &ReaperContext,
    listing: &Listing,
    live: &BTreeSet<SessionId>,
    now: DateTime<Utc>,
) -> Vec<OrphanCandidate> {
    let min_age =
        chrono::TimeDelta::from_std(ctx.settings.orphan_min_age).unwrap_or(chrono::TimeDelta::MAX);
    let mut out = Vec::new();
    for kind in ORPHAN_KINDS {
        for object in listing.get(&kind).into_iter().flat_map(Objects::iter) {
            let Some(labels) = ObjectLabels::from_map(&object.labels) else {
                continue;
            };
            if labels.env != ctx.env || live.contains(&labels.session) || object.deleting {
                continue;
            }
            if kind == Kind::Pod && object.labels.contains_key(KUBEVIRT_LABEL) {
                continue;
            }
            // Age unknown counts as young: never guess.
            let old_enough = object
                .created_at
                .is_some_and(|created| now.signed_duration_since(created) >= min_age);
            if !old_enough {
                continue;
            }
            out.push(OrphanCandidate {
                kind,
                name: object.name.clone(),
                session: labels.session,
            });
        }
    }
    out
}

/// Deletes orphan candidates, grouped by session: each session is read from the database
/// again just before its objects are deleted (a session created after the listing was read is
/// not an orphan), and every object is its own item — one failure never holds back the rest.
pub(crate) async fn delete_orphans(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    candidates: Vec<OrphanCandidate>,
) {
    let mut groups: BTreeMap<SessionId, Vec<OrphanCandidate>> = BTreeMap::new();
    for c in candidates {
        groups.entry(c.session).or_default().push(c);
    }
    let shutdown = ctx.shutdown.clone();
    let mut results = futures::stream::iter(groups)
        .take_while(|_| std::future::ready(!shutdown.is_cancelled()))
        .map(|(session, objects)| async move { delete_group(ctx, session, objects).await })
        .buffer_unordered(ctx.settings.concurrency.max(1));
    while let Some(outcomes) = results.next().await {
        for (subject, outcome) in outcomes {
            match outcome {
                Ok(what) => report.done(Direction::Orphans, subject, what),
                Err(message) => report.failed(Direction::Orphans, subject, message),
            }
        }
    }
}

type GroupOutcome = Vec<(String, Result<String, String>)>;

async fn delete_group(
    ctx: &ReaperContext,
    session: SessionId,
    objects: Vec<OrphanCandidate>,
) -> GroupOutcome {
    let subjects = |objects: &[OrphanCandidate]| -> Vec<String> {
        objects
            .iter()
            .map(|o| format!("{}/{}", o.kind, o.name))
            .collect()
    };
    match ctx.store.sessions().get(session).await {
        Ok(Some(row)) if row.status.is_live() || row.env != ctx.env => {
            tracing::debug!(session = %session, "not an orphan after all: the session is live");
            return Vec::new();
        }
        Ok(_) => {}
        Err(e) => {
            let message = format!(
                "re-reading session {session}: {}: {e}",
                store_error_kind(&e)
            );
            tracing::warn!(session = %session, kind = store_error_kind(&e), error = %e, "orphan check failed");
            return subjects(&objects)
                .into_iter()
                .map(|s| (s, Err(message.clone())))
                .collect();
        }
    }
    let mut out = Vec::new();
    for object in objects {
        let subject = format!("{}/{}", object.kind, object.name);
        if ctx.settings.dry_run {
            out.push((
                subject,
                Ok(format!(
                    "env {}, session {session} not live: would delete orphan",
                    ctx.env
                )),
            ));
            continue;
        }
        match ctx
            .cluster
            .delete(object.kind, &object.name, Propagation::Background)
            .await
        {
            Ok(_) => out.push((
                subject,
                Ok(format!(
                    "env {}, session {session} not live: deleted orphan",
                    ctx.env
                )),
            )),
            Err(e) => {
                tracing::warn!(session = %session, object = %subject, kind = cluster_error_kind(&e), error = %e, "orphan deletion failed");
                out.push((subject, Err(format!("{}: {e}", cluster_error_kind(&e)))));
            }
        }
    }
    out
}
