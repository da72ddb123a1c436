//! The reaper: [`reap_once`] reclaims, in one idempotent cycle, everything ttlab no longer
//! needs in one environment on one site (a cluster's API server and a namespace: the
//! context's [`ReaperContext::site`]; `default` without a sites file), and [`run`] (one site)
//! or [`run_sites`] (every site, each on its own schedule, one leader for all) decides when
//! cycles happen. Every database read of a cycle is of its site's sessions only; live
//! sessions on a site the reaper is not configured with are left alone and reported by every
//! full cycle ([`CycleReport::unknown_sites`]).
//!
//! A cycle looks in three directions:
//! - **Expired** (and **stuck**): running sessions whose lifespan is over by the database
//!   clock (`ttlab-lifespan` decides), starting sessions past their readiness deadline, and
//!   rows left `finishing`. Each goes to `finishing` recording its final status, its objects
//!   are deleted by its recorded runtime ([`ttlab_cluster::teardown_session`]: VMs, then each
//!   cloud-init Secret by name, the session Service and NetworkPolicy, or the Pod), and only
//!   when every object is confirmed gone does the row become final, with `reclaimed_at` and
//!   `objects_gone_at`. Confirmed by the API server's answer for what it removed at once, by
//!   the watch-fed listings' report of the deletion for what lingered (a long-running reaper),
//!   and otherwise by looking again; the deletions and the wait for the objects to go are two
//!   stages, so sessions waiting for a guest's shutdown never hold back the next deletions. An object still
//!   terminating (a guest shutting down, a finalizer) keeps the row `finishing`: it is
//!   recorded on the row, named in the [`CycleReport`] (`terminating`) and the
//!   `ttlab_reaper_objects_terminating` gauge, and deleted and looked for again every cycle.
//! - **Orphans**: objects labelled as ttlab's *and* with this reaper's environment whose
//!   session is not live, older than a minimum age. Each session is read again just before
//!   its objects are deleted. Objects without labels or of another environment are never
//!   listed, let alone deleted.
//! - **Ghosts**: running rows whose VM (or pod) is gone, confirmed by a direct get, are
//!   marked `ghost`.
//! - **Unused agent versions** (counted with the orphans): the shared agent ConfigMaps of
//!   this environment that no VM references, older than [`ReaperSettings::agent_min_age`] and
//!   not recorded as seen by any server for as long (nor within the last 2 minutes, whatever
//!   the minimum age), checked and deleted under the version's database lock so that a
//!   server about to create a VM for it cannot lose it.
//!
//! Every item is isolated: a failure is counted, logged with the id and error kind, kept in
//! the [`CycleReport`], and the cycle goes on; a failed session stays live for the next
//! cycle. Items run with bounded concurrency; lists are paged. A long-running reaper
//! ([`ReaperContext::with_cached_listings`]) reads the environment's VMs and Secrets from
//! watch-fed listings ([`ttlab_cluster::ObjectCache`], rebuilt from a full list every few
//! minutes) instead of listing them every cycle; while a listing is not trustworthy the cycle
//! lists that kind itself.
//!
//! It refuses to own the lifespan rule (`ttlab-lifespan`), SQL (`ttlab-store`), Kubernetes
//! calls (`ttlab-cluster`: the reaper holds only its [`ttlab_cluster::ReaperCluster`] part —
//! get, find, list, delete —, never what creates objects) and configuration parsing (the `ttlab-reaper` binary). It never
//! talks to the server except through the database.
//!
//! ```
//! use ttlab_reaper::{ReaperSettings, DEFAULT_CONCURRENCY};
//! use ttlab_cluster::LabelSweep;
//!
//! let settings = ReaperSettings::default();
//! assert_eq!(settings.concurrency, DEFAULT_CONCURRENCY);
//! assert_eq!(settings.orphan_min_age, std::time::Duration::from_secs(120));
//! assert_eq!(settings.agent_min_age, std::time::Duration::from_secs(3600));
//! assert_eq!(settings.label_sweep, LabelSweep::IfNodesUnknown);
//! assert!(settings.validate().is_ok());
//! assert!(ReaperSettings { concurrency: 0, ..settings }.validate().is_err());
//! ```

mod agents;
mod context;
mod error;
mod metrics;
mod report;
mod scan;
mod schedule;
mod sessions;

use std::time::Instant;

pub use context::{
    CACHED_KINDS, DEFAULT_AGENT_MIN_AGE, DEFAULT_CONCURRENCY, DEFAULT_ORPHAN_MIN_AGE,
    DEFAULT_PAGE_SIZE, DEFAULT_RELIST_EVERY, ReaperContext, ReaperSettings,
};
pub use error::{ReaperError, cluster_error_kind, store_error_kind};
pub use metrics::{Metrics, SiteHealth, SiteState, serve_metrics};
pub use report::{Action, CycleReport, TerminatingObject};
pub use scan::{ORPHAN_KINDS, OrphanCandidate};
pub use schedule::{
    CONNECT_RETRY, Connector, LEADER_RETRY, MIN_PAUSE, OnceError, Reaper, RecordedCycle, SiteWork,
    run, run_cycle, run_once, run_once_sites, run_sites,
};

use ttlab_store::Direction;

/// Runs one cycle: expired, stuck and finishing sessions, then ghosts and orphans. Idempotent:
/// the timer, "collect now" and tests all call it. Never fails as a whole once the database
/// clock was read; everything else is in the report ([`CycleReport::ran`] is false only when
/// the database could not be reached at all).
pub async fn reap_once(ctx: &ReaperContext) -> CycleReport {
    reap(ctx, true).await
}

/// Runs what a deadline coming due needs: expired, then stuck starting sessions, from the
/// database alone, without listing the cluster (at a cost independent of its size) and
/// without retrying rows already `finishing` (the full cycles do). [`run`] does this at each
/// deadline, alongside its full sweeps.
pub async fn reap_sessions(ctx: &ReaperContext) -> CycleReport {
    reap(ctx, false).await
}

async fn reap(ctx: &ReaperContext, scan_cluster: bool) -> CycleReport {
    let clock = Instant::now();
    let now = match ctx.store.db_now().await {
        Ok(now) => now,
        Err(e) => {
            let mut report = CycleReport::new(
                ctx.env.clone(),
                ctx.site.clone(),
                chrono::Utc::now(),
                ctx.settings.dry_run,
            );
            report.fatal = Some(format!("cannot read the database clock: {e}"));
            report.duration = clock.elapsed();
            return report;
        }
    };
    let mut report = CycleReport::new(ctx.env.clone(), ctx.site.clone(), now, ctx.settings.dry_run);

    // The database alone says what these need, even when the cluster cannot be listed. A
    // deadline cycle does what just came due, expiries first, and leaves the rows already
    // `finishing` (a deletion failed, often again) to the sweeps, so retries never hold back
    // an expiry.
    if scan_cluster {
        sessions::finishing(ctx, &mut report).await;
        sessions::stuck_starting(ctx, &mut report, now).await;
        sessions::expired(ctx, &mut report, now).await;
    } else {
        sessions::expired(ctx, &mut report, now).await;
        sessions::stuck_starting(ctx, &mut report, now).await;
    }

    report.sessions_only = !scan_cluster;
    if scan_cluster {
        unknown_sites(ctx, &mut report).await;
    }
    if scan_cluster
        && !ctx.shutdown.is_cancelled()
        && let Ok(candidates) = find_orphans_at(ctx, &mut report, now).await
    {
        scan::delete_orphans(ctx, &mut report, candidates).await;
        if !ctx.shutdown.is_cancelled() {
            agents::remove_unused(ctx, &mut report, now).await;
        }
    }
    report.duration = clock.elapsed();
    report
}

/// Notes the live sessions of the environment on sites the reaper is not configured with: no
/// cycle touches them (they are never marked final), and each cycle says so, until their site
/// is configured again and its own cycles reclaim them as usual.
async fn unknown_sites(ctx: &ReaperContext, report: &mut CycleReport) {
    match ctx
        .store
        .sessions()
        .live_on_other_sites(&ctx.env, &ctx.known_sites)
        .await
    {
        Ok(found) => {
            for (site, n) in &found {
                tracing::warn!(site = %site, sessions = n, "live sessions on a site that is not configured; left alone until it is");
                report.note(
                    Direction::Stuck,
                    format!("site {site}"),
                    format!(
                        "{n} live sessions on site {site}, which is not configured: left alone \
                         (never marked final) until it is configured again"
                    ),
                );
            }
            report.unknown_sites = found;
        }
        Err(e) => report.note(
            Direction::Stuck,
            "sites".into(),
            format!("cannot count the live sessions on sites not configured: {e}"),
        ),
    }
}

/// Reads the live sessions, lists the cluster, marks ghosts, and returns the orphan
/// candidates. `Err` when the database or the cluster could not be read (noted in `report`).
async fn find_orphans_at(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Vec<OrphanCandidate>, ()> {
    // The live set is read before the listing: an object in the listing whose session was
    // opened after the read looks orphaned here, which the re-read before deletion catches.
    let live = match scan::read_live(ctx).await {
        Ok(live) => live,
        Err(e) => {
            report.note(
                Direction::Orphans,
                "live sessions".into(),
                format!("list: {e}"),
            );
            return Err(());
        }
    };
    let listing = match scan::list_env_objects(ctx).await {
        Ok(listing) => listing,
        Err(e) => {
            tracing::warn!(kind = cluster_error_kind(&e), error = %e, "cannot list the cluster; orphans and ghosts wait for the next cycle");
            report.note(
                Direction::Orphans,
                "cluster".into(),
                format!("list: {}: {e}", cluster_error_kind(&e)),
            );
            return Err(());
        }
    };
    report.cluster_listed = true;
    let ghosts = scan::ghosts(ctx, report, &live, &listing).await;
    let mut live_ids = live.ids;
    for g in ghosts {
        live_ids.remove(&g);
    }
    Ok(scan::orphan_candidates(ctx, &listing, &live_ids, now))
}

/// The first half of the orphan direction, on its own: reads the live sessions, lists the
/// environment's objects and returns those judged orphans at this moment (ghosts are not
/// marked). With [`delete_orphans`], this lets a caller (a test) act between the listing and
/// the deletion, where a session may be opened.
pub async fn find_orphans(ctx: &ReaperContext) -> Result<Vec<OrphanCandidate>, ReaperError> {
    let now = ctx.store.db_now().await?;
    let live = scan::read_live(ctx).await?;
    let listing = scan::list_env_objects(ctx).await?;
    Ok(scan::orphan_candidates(ctx, &listing, &live.ids, now))
}

/// The second half of the orphan direction: re-reads each candidate's session and deletes the
/// objects of those still not live. Returns a report holding only the orphan counts.
pub async fn delete_orphans(
    ctx: &ReaperContext,
    candidates: Vec<OrphanCandidate>,
) -> Result<CycleReport, ReaperError> {
    let clock = Instant::now();
    let now = ctx.store.db_now().await?;
    let mut report = CycleReport::new(ctx.env.clone(), ctx.site.clone(), now, ctx.settings.dry_run);
    report.cluster_listed = true;
    scan::delete_orphans(ctx, &mut report, candidates).await;
    report.duration = clock.elapsed();
    Ok(report)
}
