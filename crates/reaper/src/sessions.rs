//! The database-driven directions, over the context's site's sessions only: finishing rows
//! retried, starting rows past their readiness deadline, and running rows whose lifespan says
//! expired. Each session goes to `finishing`
//! (recording where it lands) before its objects are deleted, and to its final status only
//! once every object is confirmed gone (looked for again after its deletion was accepted), with
//! `objects_gone_at`. Objects still terminating are recorded on the row and in the report, and
//! the session stays `finishing` — retried, deleted again and looked for again, every cycle.

use chrono::{DateTime, Utc};
use futures::StreamExt as _;
use std::time::Duration;

use ttlab_cluster::{
    Kind, SessionTarget, TeardownReport, await_gone, delete_session_objects, named_objects,
};
use ttlab_model::{NodeName, SessionStatus};
use ttlab_store::{Direction, Session};

use crate::error::{cluster_error_kind, store_error_kind};
use crate::{CycleReport, ReaperContext};

/// How long the teardown of a session keeps looking for objects whose deletion was accepted
/// before it leaves them terminating for the next cycle: a guest that shuts down within a
/// second or two is confirmed gone in the same cycle. Short, because a session being looked
/// at holds one of the cycle's concurrent slots, and a real guest's shutdown grace (30 s by
/// default) is longer anyway: such a session is completed by a later cycle. The wait never
/// delays another session's expiry: deadline cycles run side by side
/// ([`crate::schedule::MAX_DEADLINE_CYCLES`]).
const GONE_WITHIN: Duration = Duration::from_secs(3);

/// How many sessions may wait for their objects to go, per session being deleted, when the
/// watch-fed listings witness deletions (the wait then costs no request).
const CONFIRMING_PER_DELETING: usize = 16;

/// How a session enters `finishing`.
#[derive(Debug, Clone, Copy)]
enum Begin {
    /// running → finishing(expired), if `expires_at` is still the one judged expired.
    Expire { seen_expires_at: DateTime<Utc> },
    /// starting → finishing(failed), if the readiness deadline has passed at `now`.
    FailStuck { now: DateTime<Utc> },
    /// Already finishing (a previous attempt, the server's, or a crash in between): retry.
    Retry,
}

/// What happened to one session.
enum Item {
    /// Reclaimed: every object deleted and the row final (or, dry run: would be).
    Reclaimed(String),
    /// Nothing to do after all (extended meanwhile, or someone else finished it).
    Skipped,
    /// Failed; the row stays live for the next cycle.
    Failed(String),
    /// Every deletion was accepted, but these objects are still there (kind, name): the row
    /// stays `finishing` for the next cycle.
    Terminating(Vec<(ttlab_cluster::Kind, String)>),
}

fn nodes_of(session: &Session) -> Vec<NodeName> {
    session.vms.iter().map(|v| v.node.clone()).collect()
}

fn describe_objects(session: &Session) -> String {
    let nodes = nodes_of(session);
    let target = SessionTarget {
        env: &session.env,
        session: session.id,
        runtime: session.runtime,
        nodes: &nodes,
    };
    let named: Vec<String> = named_objects(&target)
        .into_iter()
        .map(|(k, n)| format!("{k}/{n}"))
        .collect();
    if named.is_empty() {
        "objects labelled with the session".to_owned()
    } else {
        named.join(", ")
    }
}

/// Why a session is reclaimed, in words: "expired at 2026-01-01T10:00:00Z".
fn why(session: &Session, begin: Begin) -> String {
    let at = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    match begin {
        Begin::Expire { seen_expires_at } => format!("expired at {}", at(seen_expires_at)),
        Begin::FailStuck { .. } => format!(
            "still starting after its readiness deadline {}",
            at(session.readiness_deadline)
        ),
        Begin::Retry => format!(
            "finishing as {}, objects left to delete",
            session
                .finishing_to
                .map_or("finished", ttlab_model::FinalStatus::as_str)
        ),
    }
}

/// The first stage of a session's reclamation: enters `finishing` and asks for its objects'
/// deletions.
async fn delete_objects(ctx: &ReaperContext, session: &Session, begin: Begin) -> Stage {
    let id = session.id;
    if ctx.settings.dry_run {
        return Stage::Done(Item::Reclaimed(format!(
            "lesson {}, {}: would delete {}",
            session.lesson,
            why(session, begin),
            describe_objects(session)
        )));
    }
    let sessions = ctx.store.sessions();
    let entered = match begin {
        Begin::Expire { seen_expires_at } => sessions.begin_expiring(id, seen_expires_at).await,
        Begin::FailStuck { now } => sessions.fail_stuck_starting(id, now).await,
        Begin::Retry => Ok(Some(session.clone())),
    };
    let session = match entered {
        Ok(Some(s)) => s,
        Ok(None) => return Stage::Done(Item::Skipped),
        Err(e) => {
            tracing::warn!(session = %id, kind = store_error_kind(&e), error = %e, "cannot begin finishing");
            return Stage::Done(Item::Failed(format!("{}: {e}", store_error_kind(&e))));
        }
    };
    if !matches!(begin, Begin::Expire { .. }) {
        // A provisioner still running for the session may be creating objects: deleting now
        // could leave one behind a final row. Moving the row to `finishing` made it stop at its
        // next step, and it completes the session itself; a provisioner that died or was cut
        // off stops renewing its provisioning lease, which expires within the lease's
        // duration, so the session is reclaimed on a later cycle (not hours later).
        match ctx.store.provisioning_in_progress(id).await {
            Ok(false) => {}
            Ok(true) => {
                tracing::info!(session = %id, "its provisioner is still stopping; left to it this cycle");
                return Stage::Done(Item::Skipped);
            }
            Err(e) => {
                tracing::warn!(session = %id, kind = store_error_kind(&e), error = %e, "cannot tell whether a provisioner is running");
                return Stage::Done(Item::Failed(format!("{}: {e}", store_error_kind(&e))));
            }
        }
    }
    let nodes = nodes_of(&session);
    let target = SessionTarget {
        env: &session.env,
        session: id,
        runtime: session.runtime,
        nodes: &nodes,
    };
    let asked = std::time::Instant::now();
    let report =
        delete_session_objects(ctx.cluster.as_ref(), &target, ctx.settings.label_sweep).await;
    Stage::Deleted(Box::new(Deleting {
        session,
        begin,
        asked,
        report,
    }))
}

/// A session whose objects' deletions were asked for, waiting to see them go.
struct Deleting {
    session: Session,
    begin: Begin,
    /// When the deletions were asked for.
    asked: std::time::Instant,
    report: TeardownReport,
}

/// Where a session is after the first stage of its reclamation.
enum Stage {
    /// Nothing more to do.
    Done(Item),
    /// Its deletions were asked for; [`confirm`] waits for the objects to go.
    Deleted(Box<Deleting>),
}

/// The second stage: waits a moment for the objects to go, then marks the row final (or
/// records what is still terminating).
async fn confirm(ctx: &ReaperContext, deleting: Deleting) -> Item {
    let Deleting {
        session,
        begin,
        asked,
        mut report,
    } = deleting;
    let id = session.id;
    let sessions = ctx.store.sessions();
    if report.all_deleted() {
        // A moment for the objects to go: a guest that shuts down within a second or two is
        // confirmed gone in this cycle. The watch-fed listings see deletions as they happen
        // (no request); without them, VMs and Pods are looked for with a direct get, which the
        // reaper's Role grants (it reads them so before declaring a ghost), the other kinds
        // with a list pinned to the name.
        await_gone(
            ctx.cluster.as_ref(),
            &mut report,
            asked,
            GONE_WITHIN,
            &[Kind::VirtualMachine, Kind::Pod],
            ctx.witness(),
        )
        .await;
    }
    if !report.all_deleted() {
        let failures: Vec<String> = report
            .failures()
            .map(|(o, e)| format!("{}/{}: {}: {e}", o.kind, o.name, cluster_error_kind(e)))
            .collect();
        for (o, e) in report.failures() {
            tracing::warn!(session = %id, object = %format!("{}/{}", o.kind, o.name), kind = cluster_error_kind(e), error = %e, "deletion failed; the session stays finishing");
        }
        return Item::Failed(failures.join("; "));
    }
    if !report.all_gone() {
        let left: Vec<(ttlab_cluster::Kind, String)> = report
            .terminating()
            .map(|o| (o.kind, o.name.clone()))
            .collect();
        let names: Vec<String> = left.iter().map(|(k, n)| format!("{k}/{n}")).collect();
        tracing::info!(session = %id, objects = %names.join(", "), "deletions accepted, objects still terminating; the session stays finishing");
        if let Err(e) = sessions.record_terminating(id, &names).await {
            tracing::warn!(session = %id, kind = store_error_kind(&e), error = %e, "cannot record the objects still terminating");
        }
        return Item::Terminating(left);
    }
    match sessions.complete_objects_gone(id).await {
        Ok(Some(done)) => Item::Reclaimed(format!(
            "lesson {}, {}: {} ({} objects deleted)",
            session.lesson,
            why(&session, begin),
            done.status,
            report.deleted()
        )),
        Ok(None) => Item::Skipped,
        Err(e) => {
            tracing::warn!(session = %id, kind = store_error_kind(&e), error = %e, "cannot mark the session final");
            Item::Failed(format!("{}: {e}", store_error_kind(&e)))
        }
    }
}

/// Handles `rows` with bounded concurrency, counting into `report`; returns how many rows left
/// the state they were listed in (reclaimed, failed after entering finishing, or skipped
/// because someone else moved them).
async fn handle_rows(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    direction: Direction,
    rows: Vec<(Session, Begin)>,
) {
    let shutdown = ctx.shutdown.clone();
    let concurrency = ctx.settings.concurrency.max(1);
    // Two stages: the deletions, `concurrency` sessions at a time, and the wait for the
    // objects to go. With watch-fed listings that wait costs no request, so many more
    // sessions wait at once and the deletions of the next ones go on meanwhile (a whole
    // class expiring together is reclaimed at the pace of the deletions); without them it
    // looks with requests, as many at once as the deletions.
    let waiting = if ctx.witness().is_some() {
        concurrency * CONFIRMING_PER_DELETING
    } else {
        concurrency
    };
    let mut results =
        futures::stream::iter(rows)
            .take_while(|_| std::future::ready(!shutdown.is_cancelled()))
            .map(|(session, begin)| async move {
                (session.id, delete_objects(ctx, &session, begin).await)
            })
            .buffer_unordered(concurrency)
            .map(|(id, stage)| async move {
                let item = match stage {
                    Stage::Done(item) => item,
                    Stage::Deleted(deleting) => confirm(ctx, *deleting).await,
                };
                (id, item)
            })
            .buffer_unordered(waiting);
    while let Some((id, item)) = results.next().await {
        match item {
            Item::Reclaimed(what) => report.done(direction, id.to_string(), what),
            Item::Skipped => {}
            Item::Failed(message) => report.failed(direction, id.to_string(), message),
            Item::Terminating(objects) => {
                for (kind, name) in objects {
                    report.still_terminating(direction, id.to_string(), kind, name);
                }
            }
        }
    }
}

/// Retries every `finishing` row of the environment on this site (paged by id).
pub(crate) async fn finishing(ctx: &ReaperContext, report: &mut CycleReport) {
    let mut after = None;
    loop {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        let page = match ctx
            .store
            .sessions()
            .list_in_status_on(
                &ctx.env,
                &ctx.site,
                SessionStatus::Finishing,
                after,
                ctx.settings.page_size,
            )
            .await
        {
            Ok(p) => p,
            Err(e) => {
                report.note(
                    Direction::Stuck,
                    "finishing sessions".into(),
                    format!("list: {e}"),
                );
                return;
            }
        };
        let full = page.len() == ctx.settings.page_size as usize;
        after = page.last().map(|s| s.id);
        let rows = page.into_iter().map(|s| (s, Begin::Retry)).collect();
        handle_rows(ctx, report, Direction::Stuck, rows).await;
        if !full {
            return;
        }
    }
}

/// Starting rows of this site past their readiness deadline at `now`.
pub(crate) async fn stuck_starting(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    now: DateTime<Utc>,
) {
    let mut seen = std::collections::BTreeSet::new();
    loop {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        let page = match ctx
            .store
            .sessions()
            .list_stuck_starting_on(&ctx.env, &ctx.site, now, ctx.settings.page_size)
            .await
        {
            Ok(p) => p,
            Err(e) => {
                report.note(
                    Direction::Stuck,
                    "starting sessions".into(),
                    format!("list: {e}"),
                );
                return;
            }
        };
        let full = page.len() == ctx.settings.page_size as usize;
        // Rows that stay listed (a failure before they left `starting`) are not retried in
        // the same cycle; when a page brings nothing new, the pass ends.
        let fresh: Vec<_> = page
            .into_iter()
            .filter(|s| seen.insert(s.id))
            .map(|s| (s, Begin::FailStuck { now }))
            .collect();
        if fresh.is_empty() {
            return;
        }
        handle_rows(ctx, report, Direction::Stuck, fresh).await;
        if !full || ctx.settings.dry_run {
            return;
        }
    }
}

/// Running rows of this site whose lifespan is over at `now` (the database clock).
pub(crate) async fn expired(ctx: &ReaperContext, report: &mut CycleReport, now: DateTime<Utc>) {
    let mut seen = std::collections::BTreeSet::new();
    loop {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        let page = match ctx
            .store
            .sessions()
            .list_expired_on(&ctx.env, &ctx.site, now, ctx.settings.page_size)
            .await
        {
            Ok(p) => p,
            Err(e) => {
                report.note(
                    Direction::Expired,
                    "running sessions".into(),
                    format!("list: {e}"),
                );
                return;
            }
        };
        let full = page.len() == ctx.settings.page_size as usize;
        let fresh: Vec<_> = page
            .into_iter()
            .filter(|s| seen.insert(s.id))
            .filter(|s| {
                // The one lifespan rule, the same the student's countdown uses.
                s.lifespan().is_expired(now)
            })
            .map(|s| {
                let seen_expires_at = s.expires_at;
                (s, Begin::Expire { seen_expires_at })
            })
            .collect();
        if fresh.is_empty() {
            return;
        }
        handle_rows(ctx, report, Direction::Expired, fresh).await;
        if !full || ctx.settings.dry_run {
            return;
        }
    }
}
