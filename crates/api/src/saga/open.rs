//! Steps ① and ②: the `starting` row, after the capacity check for VM lessons.

use futures::StreamExt as _;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use chrono::TimeDelta;
use ttlab_lesson::Lesson;
use ttlab_lifespan::Lifespan;
use ttlab_model::{ClassId, LessonId, Runtime, SessionId, UserId};
use ttlab_store::{NewSession, Session, SessionTimes, StoreError};

use crate::sites::SiteRuntime;
use crate::{ApiError, AppState, CapacityUse};

/// Opens a `starting` session of `lesson` for `user`: 409 `session_exists` if they have a
/// live one, 503 `capacity` if a VM lesson would pass the VM limit. Provisioning is not
/// started here (see [`super::spawn_provisioning`]). A student of a scheduled `class` takes
/// its members first, and a cold start is recorded as the class's.
pub async fn open_session(
    state: &AppState,
    user: &UserId,
    lesson: &Lesson,
    class: Option<ClassId>,
) -> Result<Session, ApiError> {
    // Handing over (SIGTERM): new starts go to another replica.
    if state.is_draining() {
        return Err(ApiError::ShuttingDown);
    }
    // Cheap early answer for a double click; the database's unique index decides anyway.
    if let Some(open) = state.store().sessions().live_for_user(user).await? {
        return Err(ApiError::SessionExists {
            lesson: open.lesson,
            session: open.id,
        });
    }
    let now = state.store().db_now().await?;
    let policy = &state.config().policy;
    let lifespan = Lifespan::open(now, policy);
    let wait = lesson.readiness_timeout + lesson.setup_timeout + state.config().readiness_margin;
    let new = NewSession {
        id: SessionId::new_random(),
        user: user.clone(),
        lesson: lesson.id.clone(),
        runtime: lesson.runtime,
        env: state.config().env.clone(),
        // A VM lab's site is chosen under the capacity check.
        site: pod_lab_site(state).name().clone(),
        times: SessionTimes {
            started_at: lifespan.started_at,
            expires_at: lifespan.expires_at,
            max_expires_at: lifespan.max_expires_at(policy),
        },
        readiness_deadline: now + TimeDelta::from_std(wait).unwrap_or(TimeDelta::MAX),
    };
    // Waiting for a place in one lab, a student cannot open another meanwhile.
    if let Some(waiting) = state.store().waitlist().get(user).await?
        && waiting.lesson != lesson.id
    {
        return Err(ApiError::WrongState {
            code: "waiting",
            message: format!(
                "you are on the waitlist for {}; leave it before starting another lab",
                waiting.lesson
            ),
        });
    }
    // A pooled lesson: a prepared member if one is ready (its places are already held, so
    // no capacity check); else the cold way, with no extra wait.
    let claimed = match lesson.runtime {
        Runtime::Vm => crate::pool::claim(state, user, lesson, class).await?,
        Runtime::Pod => None,
    };
    let session = match (claimed, lesson.runtime) {
        (Some(claimed), _) => {
            if let Err(e) = state.store().waitlist().remove(user).await {
                tracing::warn!(error = %e, "cannot remove the waitlist entry of an opened session");
            }
            claimed
        }
        (None, Runtime::Pod) => state.store().sessions().insert(&new).await?,
        (None, Runtime::Vm) => {
            let session = open_vm_session(state, lesson, &new).await?;
            // The class's seats started are counted from this; the lab itself does not
            // depend on it.
            if let Some(class) = class
                && let Err(e) = state
                    .store()
                    .classes()
                    .record_student(session.id, class)
                    .await
            {
                tracing::warn!(session = %session.id, %class, error = %e, "cannot record the class of a cold start");
            }
            session
        }
    };
    state
        .metrics()
        .opened
        .get_or_create(&crate::metrics::OpenedLabels {
            lesson: lesson.id.to_string(),
            runtime: lesson.runtime.as_str().to_owned(),
        })
        .inc();
    Ok(session)
}

/// The site of a pod lab (no VM limit, no listing): the first site whose last probe
/// answered; while none has (a server just started), the first not known to be lost; else
/// the first site. A site not probed yet comes after one that answered, so a server started
/// while a site is lost does not send pod labs there before its first probe of it ends.
fn pod_lab_site(state: &AppState) -> &Arc<SiteRuntime> {
    let sites = state.sites();
    sites
        .iter()
        .find(|s| s.answered_last_probe())
        .or_else(|| {
            sites
                .iter()
                .find(|s| s.reachability() == ttlab_site::Reachability::Reachable)
        })
        .unwrap_or_else(|| state.first_site())
}

async fn open_vm_session(
    state: &AppState,
    lesson: &Lesson,
    new: &NewSession,
) -> Result<Session, ApiError> {
    let wanted = wanted_of(lesson);
    if let Some(why) = no_site_carries(state, &wanted.labels) {
        tracing::warn!(lesson = %lesson.id, %why, "no site can run the lesson");
        return Err(ApiError::NoSite(why));
    }
    if let [site] = state.sites() {
        let mut new = new.clone();
        new.site = site.name().clone();
        return open_on_site(state, site, lesson, &new, true)
            .await?
            .map_err(|(limit, usage)| ApiError::Capacity {
                limit,
                needed: lesson.nodes.len(),
                usage,
            });
    }
    // Several sites: place the start among those that answer and have room, then check and
    // open on the chosen one under its own lock. A site found full under its lock is
    // observed again in the next round, so placement passes over it.
    let needed = lesson.nodes.len();
    let mut last_full: Option<(usize, CapacityUse)> = None;
    for _ in 0..state.sites().len() + 2 {
        let observed = observe_sites(state, &new.user, lesson).await?;
        if observed.queued {
            return Err(capacity_refused(state, &wanted, needed, &observed));
        }
        let placement = ttlab_site::place(&wanted, &observed.states);
        let Some(chosen) = placement.site() else {
            tracing::info!(%placement, "no site can take the start");
            let any_full = observed.states.iter().any(|s| {
                matches!(
                    s.pass_reason(&wanted),
                    Some(ttlab_site::PassReason::Full { .. })
                )
            });
            if any_full {
                return Err(capacity_refused(state, &wanted, needed, &observed));
            }
            return Err(ApiError::ClusterUnavailable(placement.to_string()));
        };
        let site = state.site_of(chosen);
        tracing::info!(site = %chosen, %placement, "placed");
        let mut new = new.clone();
        new.site = chosen.clone();
        match open_on_site(state, &site, lesson, &new, false).await {
            Ok(Ok(session)) => return Ok(session),
            Ok(Err(full)) => last_full = Some(full),
            // Its VMs could not be listed: the next round sees it unreachable.
            Err(ApiError::ClusterUnavailable(e)) => {
                tracing::info!(site = %chosen, error = %e, "the chosen site does not answer; placing again");
            }
            Err(e) => return Err(e),
        }
    }
    match last_full {
        Some((limit, usage)) => Err(ApiError::Capacity {
            limit,
            needed,
            usage,
        }),
        None => Err(ApiError::ClusterUnavailable(
            "the sites chosen for the start did not answer".to_owned(),
        )),
    }
}

/// What `lesson` asks of a site: its site labels, and whether it boots from a golden disk.
pub(crate) fn wanted_of(lesson: &Lesson) -> ttlab_site::Wanted {
    ttlab_site::Wanted {
        labels: lesson.site_labels.clone(),
        golden_disk: matches!(lesson.vm_disk, ttlab_lesson::VmDisk::Golden(_)),
    }
}

/// Why no configured site can ever run a lesson that requires the site labels `labels`
/// ([`ttlab_site::labels_nowhere`]); `None` when a site carries every one.
pub(crate) fn no_site_carries(
    state: &AppState,
    labels: &BTreeSet<ttlab_site::SiteLabel>,
) -> Option<String> {
    ttlab_site::labels_nowhere(labels, state.sites().iter().map(|s| s.site()))
}

/// What a start saw of every site: placement's view of each, the places they take, and
/// whether the student must wait behind others in the line.
struct Observed {
    states: Vec<ttlab_site::SiteState>,
    usage: Vec<Option<CapacityUse>>,
    queued: bool,
}

/// Observes every site for a start of `lesson` by `user`: a site whose probe failed, or
/// whose VMs cannot be listed now, is unreachable; places held for others on the waitlist
/// are taken on each site.
async fn observe_sites(
    state: &AppState,
    user: &UserId,
    lesson: &Lesson,
) -> Result<Observed, ApiError> {
    let now = state.store().db_now().await?;
    let wl = state.store().waitlist().reservations(user, now).await?;
    let queued = wl.own_hold.is_none() && wl.waiting_ahead > 0;
    let (states, usage) = site_states(state, lesson, wl.held_for_others).await?;
    Ok(Observed {
        states,
        usage,
        queued,
    })
}

/// Placement's view of every site for `lesson` (in configuration order), with `held` more
/// places taken on each, and the places its sessions and VMs take (`None`: it does not
/// answer). Its golden disk's readiness is the site's last observation
/// ([`crate::tasks::golden_disks`]).
pub(crate) async fn site_states(
    state: &AppState,
    lesson: &Lesson,
    held: usize,
) -> Result<(Vec<ttlab_site::SiteState>, Vec<Option<CapacityUse>>), ApiError> {
    let needed = lesson.nodes.len();
    let mut states = Vec::new();
    let mut usages = Vec::new();
    // The sites' listings side by side (a few at once: a start waits for the slowest site,
    // not for the sum of them), beside one query of the live VM sessions.
    let listings = futures::stream::iter(state.sites().to_vec())
        .map(|site| async move {
            let reach = site.reachability();
            if reach != ttlab_site::Reachability::Reachable {
                return Err(reach);
            }
            listed_vms(&site)
                .await
                .map_err(|e| ttlab_site::Reachability::Unreachable(e.to_string()))
        })
        .buffered(OBSERVED_AT_ONCE)
        .collect::<Vec<_>>();
    let sessions = state.store().sessions();
    let live = async {
        match state.sites() {
            // One site: every live session of the database is on it (today's count).
            [site] => Ok(BTreeMap::from([(
                site.name().clone(),
                sessions.live_vm_sessions_all_envs().await?,
            )])),
            _ => sessions.live_vm_sessions_by_site().await,
        }
    };
    let (listings, live) = tokio::join!(listings, live);
    let live = live?;
    for (site, listing) in state.sites().iter().zip(listings) {
        let (reach, usage) = match listing {
            Ok(listing) => {
                let rows = live.get(site.name()).map_or(&[][..], Vec::as_slice);
                (
                    ttlab_site::Reachability::Reachable,
                    Some(count_held(state, rows, &listing)),
                )
            }
            Err(reach) => (reach, None),
        };
        states.push(site_state(
            site,
            lesson,
            reach,
            usage.as_ref(),
            held,
            needed,
        ));
        usages.push(usage);
    }
    Ok((states, usages))
}

/// Placement's view of `site` for `needed` VMs of `lesson`, with `held` more places taken.
fn site_state(
    site: &SiteRuntime,
    lesson: &Lesson,
    reach: ttlab_site::Reachability,
    usage: Option<&CapacityUse>,
    held: usize,
    needed: usize,
) -> ttlab_site::SiteState {
    let in_use = usage.map_or(0, CapacityUse::total) + held;
    ttlab_site::SiteState::of(
        site.site(),
        reach,
        u32::try_from(in_use).unwrap_or(u32::MAX),
        u32::try_from(needed).unwrap_or(u32::MAX),
        site.golden_ready(&lesson.id),
    )
}

/// Sites a start lists at once (each a VM listing, at most a second old).
const OBSERVED_AT_ONCE: usize = 4;

/// The 503 `capacity` of a start no site has room for: the limits and places of the sites
/// that answer and carry the labels the lesson requires, added up.
fn capacity_refused(
    state: &AppState,
    wanted: &ttlab_site::Wanted,
    needed: usize,
    observed: &Observed,
) -> ApiError {
    state.metrics().capacity_rejections.inc();
    let mut limit = 0;
    let mut usage = CapacityUse::default();
    for (site, seen) in observed.states.iter().zip(&observed.usage) {
        if let Some(seen) = seen
            && wanted.labels.is_subset(&site.labels)
        {
            limit += usize::try_from(site.vm_limit).unwrap_or(usize::MAX);
            usage.labs += seen.labs;
            usage.shutting_down += seen.shutting_down;
            usage.without_lab += seen.without_lab;
        }
    }
    tracing::info!(
        labs = usage.labs,
        shutting_down = usage.shutting_down,
        without_lab = usage.without_lab,
        queued = observed.queued,
        needed,
        limit,
        "no site has room"
    );
    ApiError::Capacity {
        limit,
        needed,
        usage,
    }
}

/// Checks capacity on `site` under its lock and opens `new` there: the session, or the
/// site's limit and the places taken when it has no room. `lenient`: a site whose VMs
/// cannot be counted does not block (the only site: the namespace quota still holds).
async fn open_on_site(
    state: &AppState,
    site: &SiteRuntime,
    lesson: &Lesson,
    new: &NewSession,
    lenient: bool,
) -> Result<Result<Session, (usize, CapacityUse)>, ApiError> {
    let _turn = site.capacity_turn().await;
    for attempt in 0..3 {
        // Listed before the lock is taken and the rows are read (see `count_vms`).
        let listed_at = tokio::time::Instant::now();
        let listing = listed_vms(site).await;
        let guard = state.store().lock_capacity_of_site(site.name()).await?;
        // With several sites, the listing is also what says the site answers: one taken
        // before a long wait for the database (a stalled connection, PostgreSQL restarting,
        // the lock held elsewhere) may be of a site lost since. The site is listed again; on
        // the last attempt the start is placed again instead. (One site has nowhere else to
        // go, and its database rows count its labs whatever the listing's age.)
        if !lenient && let Some(why) = stale_view(site, listed_at.elapsed()) {
            guard.rollback().await?;
            tracing::info!(site = %site.name(), %why, "the capacity check's view of the site is stale");
            if attempt < 2 {
                continue;
            }
            return Err(ApiError::ClusterUnavailable(why));
        }
        let limit = site.vm_limit();
        let needed = lesson.nodes.len();
        let count = match listing {
            Ok(listing) => count_vms(state, site, &listing).await,
            Err(e) => Err(e),
        };
        // Places held for students on the waitlist are taken for everybody but their
        // holder; a free place goes to those waiting ahead first.
        let count = match count {
            Ok(usage) => {
                let now = state.store().db_now().await?;
                let wl = state
                    .store()
                    .waitlist()
                    .reservations(&new.user, now)
                    .await?;
                let queued = wl.own_hold.is_none() && wl.waiting_ahead > 0;
                Ok((usage, wl.held_for_others, queued))
            }
            Err(e) => Err(e),
        };
        match count {
            Ok((usage, held, queued)) if queued || usage.total() + held + needed > limit => {
                guard.rollback().await?;
                if lenient {
                    state.metrics().capacity_rejections.inc();
                }
                tracing::info!(
                    site = %site.name(),
                    labs = usage.labs,
                    shutting_down = usage.shutting_down,
                    without_lab = usage.without_lab,
                    held_for_waitlist = held,
                    queued,
                    needed,
                    limit,
                    "VM limit reached"
                );
                return Ok(Err((limit, usage)));
            }
            Ok(_) => {}
            // If the count cannot be read, do not block: the namespace quota still holds.
            Err(e) if lenient => tracing::warn!(error = %e, "cannot count live VMs; not limiting"),
            // One of several sites: the next round places the start elsewhere.
            Err(e) => {
                guard.rollback().await?;
                return Err(e);
            }
        }
        match guard.insert_session(new).await {
            Ok(session) => {
                // A held place (or a wait) ends with the session it was for.
                if let Err(e) = state.store().waitlist().remove(&new.user).await {
                    tracing::warn!(error = %e, "cannot remove the waitlist entry of an opened session");
                }
                return Ok(Ok(session));
            }
            // The user's other session ended while this one was opened: try again.
            Err(StoreError::Conflict { .. }) => continue,
            Err(e) => return Err(e.into()),
        }
    }
    Err(ApiError::Internal(
        "the user's sessions kept changing while one was opened".into(),
    ))
}

/// Gives waitlist holds for the places free now: under the capacity lock of every site
/// (taken in configuration order, so no start and no other replica's grant counts at the
/// same time), counts the places sessions and VMs take as the capacity check does, and lets
/// the store grant them first in line first, removing lapsed holds and stale entries in the
/// same transaction. With several sites, the free places of the sites that answer are added
/// up; a site that cannot be counted offers none.
pub(crate) async fn grant_waitlist(state: &AppState) -> Result<ttlab_store::GrantReport, ApiError> {
    let single = state.sites().len() == 1;
    let mut turns = Vec::new();
    let mut guards = Vec::new();
    let mut free = 0;
    for site in state.sites() {
        turns.push(site.capacity_turn().await);
        let listing = match listed_vms(site).await {
            Ok(listing) => listing,
            Err(e) if single => return Err(e),
            Err(e) => {
                tracing::debug!(site = %site.name(), error = %e, "a site that does not answer offers no place");
                continue;
            }
        };
        guards.push(state.store().lock_capacity_of_site(site.name()).await?);
        let usage = count_vms(state, site, &listing).await?;
        free += site.vm_limit().saturating_sub(usage.total());
    }
    let now = state.store().db_now().await?;
    let report = state
        .store()
        .waitlist()
        .grant(
            free,
            now,
            state.config().waitlist_hold,
            state.config().waitlist_max_wait,
        )
        .await?;
    for guard in guards {
        guard.rollback().await?;
    }
    drop(turns);
    Ok(report)
}

/// How old a listing of the namespace's VMs the capacity check may use.
const LISTING_MAX_AGE: Duration = Duration::from_secs(1);

/// How long before the capacity lock was taken a start's listing of the chosen site may
/// have been asked for, with several sites (see [`stale_view`]).
const LISTED_BEFORE_LOCK_MAX: Duration = Duration::from_secs(3);

/// Why a start's view of `site`, listed `since_listed` before its capacity lock was taken,
/// can no longer place a session there: the site's probe has failed since, or the listing
/// is older than [`LISTED_BEFORE_LOCK_MAX`]. `None` when it still can.
fn stale_view(site: &SiteRuntime, since_listed: Duration) -> Option<String> {
    if let ttlab_site::Reachability::Unreachable(why) = site.reachability() {
        return Some(format!("its probe failed since it was listed: {why}"));
    }
    (since_listed > LISTED_BEFORE_LOCK_MAX).then(|| {
        format!(
            "it was listed {} ms before the capacity lock was taken",
            since_listed.as_millis()
        )
    })
}

/// How long a failed listing is the answer, before the next start tries the cluster again.
const FAILURE_MAX_AGE: Duration = Duration::from_secs(5);

/// The VMs ttlab manages in the namespace (whatever their environment), from a listing at
/// most [`LISTING_MAX_AGE`] old, taken again when older. Single-flight: one request of this
/// process lists, the others wait for its answer; a failure (the 5 s timeout included) is
/// the answer for [`FAILURE_MAX_AGE`], so starts behind a slow cluster do not each wait out
/// the timeout in turn.
pub(crate) async fn listed_vms(site: &SiteRuntime) -> Result<Arc<Vec<ListedVm>>, ApiError> {
    let mut cached = site.listed_vms().lock().await;
    match cached.as_ref() {
        Some((at, Ok(names))) if at.elapsed() <= LISTING_MAX_AGE => return Ok(names.clone()),
        Some((at, Err(why))) if at.elapsed() <= FAILURE_MAX_AGE => {
            return Err(ApiError::ClusterUnavailable(why.clone()));
        }
        _ => {}
    }
    let selector = ttlab_model::labels::managed_selector();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        site.cluster()
            .list_all(ttlab_cluster::Kind::VirtualMachine, &selector),
    )
    .await;
    let listed = match answer {
        Ok(Ok(listed)) => listed,
        failed => {
            let why = match failed {
                Ok(Err(e)) => e.to_string(),
                _ => "listing VMs took longer than 5 s".to_owned(),
            };
            *cached = Some((tokio::time::Instant::now(), Err(why.clone())));
            return Err(ApiError::ClusterUnavailable(why));
        }
    };
    let names = Arc::new(
        listed
            .into_iter()
            .map(|o| ListedVm {
                name: o.name,
                deleting: o.deleting,
            })
            .collect::<Vec<_>>(),
    );
    *cached = Some((tokio::time::Instant::now(), Ok(names.clone())));
    Ok(names)
}

/// One VM of a listing: its name, and whether its deletion was requested (its guest is
/// shutting down, still holding memory until it is gone).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListedVm {
    pub(crate) name: String,
    pub(crate) deleting: bool,
}

/// Live VMs of `site`: the VMs that live sessions of every environment sharing this database
/// hold or are about to create on it (recorded names, else the lesson's nodes), plus every VM ttlab manages
/// in the namespace without such a session (ghosts, leftovers, the other environment's
/// objects hold memory too). A VM counted twice counts once; a VM being deleted counts as
/// shutting down, whoever held it.
///
/// A session's row is live from before its first VM is created until after its last is
/// deleted, so the database alone accounts for every session's VMs, whatever the age of the
/// listing; the listing (`listing`, taken before the database is read, usually a second
/// old or less) only adds VMs no live session accounts for, where its delay is harmless.
pub(crate) async fn count_vms(
    state: &AppState,
    site: &SiteRuntime,
    listing: &[ListedVm],
) -> Result<CapacityUse, ApiError> {
    // One site: every live session of the database is on it (today's count). Several: the
    // sessions whose row records this site.
    let live = if state.sites().len() == 1 {
        state.store().sessions().live_vm_sessions_all_envs().await?
    } else {
        state
            .store()
            .sessions()
            .live_vm_sessions_of_site(site.name())
            .await?
    };
    Ok(count_held(state, &live, listing))
}

/// [`count_vms`] with the site's live VM sessions already read.
fn count_held(
    state: &AppState,
    live: &[(SessionId, LessonId, Vec<String>)],
    listing: &[ListedVm],
) -> CapacityUse {
    let mut held: BTreeSet<String> = BTreeSet::new();
    for (id, lesson, vms) in live {
        let (id, lesson) = (*id, lesson);
        if !vms.is_empty() {
            held.extend(vms.iter().cloned());
            continue;
        }
        match state.config().lessons.get(lesson) {
            Some(l) if !l.nodes.is_empty() => {
                for node in l.nodes.as_slice() {
                    held.insert(ttlab_vm_manifest::vm_name(id, node));
                }
            }
            // A lesson this server does not know (another environment's): one VM at least.
            _ => {
                held.insert(format!("unknown-lesson-{id}"));
            }
        }
    }
    tally(&held, listing)
}

/// Splits the VMs of `held` (names live sessions account for) and `listing` into the places
/// they take: each name once.
fn tally(held: &BTreeSet<String>, listing: &[ListedVm]) -> CapacityUse {
    let mut usage = CapacityUse::default();
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    for vm in listing {
        if !seen.insert(vm.name.as_str()) {
            continue;
        }
        if vm.deleting {
            usage.shutting_down += 1;
        } else if held.contains(&vm.name) {
            usage.labs += 1;
        } else {
            usage.without_lab += 1;
        }
    }
    usage.labs += held.iter().filter(|n| !seen.contains(n.as_str())).count();
    usage
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(name: &str, deleting: bool) -> ListedVm {
        ListedVm {
            name: name.to_owned(),
            deleting,
        }
    }

    #[test]
    fn every_vm_takes_one_place_and_is_told_apart_by_what_holds_it() {
        let held: BTreeSet<String> = ["a", "b", "c", "gone-soon"]
            .into_iter()
            .map(str::to_owned)
            .collect();
        let listing = [
            listed("a", false),
            listed("a", false),
            listed("b", false),
            // A live session's VM being deleted (its session finishing) is shutting down.
            listed("gone-soon", true),
            listed("x", true),
            listed("y", true),
            listed("ghost", false),
        ];
        let usage = tally(&held, &listing);
        assert_eq!(
            usage,
            CapacityUse {
                // a and b listed, c not listed yet (about to be created).
                labs: 3,
                shutting_down: 3,
                without_lab: 1,
            }
        );
        assert_eq!(usage.total(), 7);
    }
}
