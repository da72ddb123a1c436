//! The planner: from the pool's settings, members, capacity and demand to what to do now.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use ttlab_model::SessionId;

use crate::demand::{Demand, WindowCount, expected_starts};
use crate::settings::PoolSettings;

/// One unclaimed member of the pool: a whole set of nodes (VMs) prepared for one lesson.
///
/// Claimed members are no longer the pool's: leave them out, as well as members whose
/// retirement is already under way (count their VMs in [`Capacity::retiring`] instead).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// The member's session id.
    pub id: SessionId,
    /// When it was created: its age, and the order of retirement, count from here.
    pub created_at: DateTime<Utc>,
    /// When its setup finished and it became claimable; `None` while it is preparing.
    pub ready_at: Option<DateTime<Utc>>,
    /// Its VMs (the lesson's node count when it was created).
    pub nodes: NonZeroU32,
}

impl Member {
    /// Whether it is ready to be claimed.
    pub fn is_ready(&self) -> bool {
        self.ready_at.is_some()
    }
}

/// The VM places of the environment, counted from the cluster.
///
/// Every VM of every listed [`Member`] must be counted in `alive` or `starting`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// The VM limit of the environment.
    pub limit: u32,
    /// VMs alive in the cluster now, pool members and sessions alike.
    pub alive: u32,
    /// VMs of sessions and members being started that are not in the cluster yet.
    pub starting: u32,
    /// VMs, counted in `alive`, of members whose retirement is already under way: they will
    /// free their places, so they do not make the pool shrink again, but until they are gone
    /// nothing is created in their places.
    pub retiring: u32,
    /// The places a cold start needs and the pool never takes: the node count of the largest
    /// VM lesson, or a configured reserve.
    pub reserve: u32,
}

impl Capacity {
    /// `limit - alive - starting`: the places free right now (negative when over the limit).
    pub fn free(&self) -> i64 {
        i64::from(self.limit) - i64::from(self.alive) - i64::from(self.starting)
    }
}

/// Everything the planner looks at, for one pool (one lesson in one environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanInput {
    /// The instant the plan is for (the database clock).
    pub now: DateTime<Utc>,
    /// The pool's settings (the lesson's, or an operator's override).
    pub settings: PoolSettings,
    /// The VMs one new member takes: the lesson's node count.
    pub member_nodes: NonZeroU32,
    /// The unclaimed members, ready and preparing, in any order (a member listed twice counts
    /// once).
    pub members: Vec<Member>,
    /// The environment's VM places.
    pub capacity: Capacity,
    /// Recent starts, for a demand-driven pool; `None` (or a history too short to cover any
    /// window) makes a demand-driven pool use its `size`. Ignored by a fixed pool.
    pub demand: Option<Demand>,
    /// A member still preparing this long after its creation is stuck and retired (the lesson's
    /// readiness timeout plus its setup timeout is the natural bound).
    pub stuck_after: TimeDelta,
}

/// Why a member is retired.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, strum::Display, strum::IntoStaticStr,
)]
#[strum(serialize_all = "snake_case")]
pub enum RetireReason {
    /// Its `created_at` is at least the pool's max age ago.
    TooOld,
    /// Still preparing at least [`PlanInput::stuck_after`] after its creation.
    StuckPreparing,
    /// The pool holds more members than its target.
    Surplus,
    /// The places free (with those being freed) are fewer than a cold start's reserve.
    CapacityShort,
}

impl RetireReason {
    /// A stable lower-case name, for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

/// Where the target size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetSource {
    /// The pool is not demand-driven: its `size`.
    Fixed,
    /// Demand-driven, but no start history covers a window yet: its `size` as the starting
    /// point.
    StartingPoint,
    /// Demand-driven: the expected starts during one refill time, from this window, clamped to
    /// `min..=max`.
    Demand(WindowCount),
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The number of members the pool should hold (ready and preparing), within `min..=max`.
    pub target: u32,
    /// Where `target` came from.
    pub source: TargetSource,
    /// Fresh members to create now (each takes [`PlanInput::member_nodes`] VMs).
    pub create: u32,
    /// Members the target wants but capacity does not allow now (0 while paused).
    pub deferred: u32,
    /// Members to retire, each once, with the reason; in the order decided.
    pub retire: Vec<(SessionId, RetireReason)>,
    /// One line saying why, for the admin page and logs.
    pub why: String,
}

/// Plans one round for one pool. Total and deterministic: the same input (whatever the order
/// of its members) gives the same plan. The rules, in order:
///
/// 1. **Stuck, then too old.** A member still preparing `stuck_after` after its creation is
///    retired ([`RetireReason::StuckPreparing`]); any other member created at least `max_age`
///    ago is retired ([`RetireReason::TooOld`]).
/// 2. **Target.** `size` for a fixed pool; for a demand-driven one, the expected starts during
///    one refill time ([`expected_starts`]), clamped to `min..=max`, or `size` while no history
///    covers a window.
/// 3. **Surplus.** Unless paused, members beyond the target are retired
///    ([`RetireReason::Surplus`]).
/// 4. **Capacity short.** While the places free, plus those being freed (`retiring` and the
///    members retired above), are fewer than the reserve, further members are retired
///    ([`RetireReason::CapacityShort`]) until the reserve is restored or the pool is empty.
/// 5. **Create.** Unless paused or short, `target - kept` members are created, as many as fit
///    with `free - create * member_nodes >= reserve`, where `free = limit - alive - starting`
///    counts retired members' VMs as taken until they are gone; the rest is `deferred`.
///
/// Whenever members must go for size or capacity, the ones still preparing go first (the
/// youngest first: furthest from serving anyone), then the ready ones (the oldest first: the
/// nearest to their own refresh). Ready members are what a click gets now.
pub fn plan(input: &PlanInput) -> Plan {
    let settings = &input.settings;
    let now = input.now;

    let mut members = input.members.clone();
    members.sort_by_key(|m| (m.created_at, m.id));
    let mut seen = BTreeSet::new();
    members.retain(|m| seen.insert(m.id));
    let listed_ready = members.iter().filter(|m| m.is_ready()).count();
    let listed_preparing = members.len() - listed_ready;

    let mut retire: Vec<(SessionId, RetireReason)> = Vec::new();
    let mut freed: i64 = 0;
    let mut kept: Vec<Member> = Vec::with_capacity(members.len());
    for m in members {
        let age = now.signed_duration_since(m.created_at);
        let reason = if !m.is_ready() && age >= input.stuck_after {
            Some(RetireReason::StuckPreparing)
        } else if age >= settings.max_age() {
            Some(RetireReason::TooOld)
        } else {
            None
        };
        match reason {
            Some(r) => {
                freed += i64::from(m.nodes.get());
                retire.push((m.id, r));
            }
            None => kept.push(m),
        }
    }
    let (too_old, stuck) = (
        count(&retire, RetireReason::TooOld),
        count(&retire, RetireReason::StuckPreparing),
    );

    // The order in which kept members go when some must: preparing (youngest first), then
    // ready (oldest first).
    let mut order: Vec<Member> = kept
        .iter()
        .filter(|m| !m.is_ready())
        .rev()
        .copied()
        .collect();
    order.extend(kept.iter().filter(|m| m.is_ready()).copied());

    let (target, source) = target(input);

    let mut leaving = order.into_iter();
    let mut kept_count = kept.len();
    if !settings.paused() {
        while kept_count > target as usize {
            let Some(m) = leaving.next() else { break };
            freed += i64::from(m.nodes.get());
            retire.push((m.id, RetireReason::Surplus));
            kept_count -= 1;
        }
    }

    let cap = &input.capacity;
    let free = cap.free();
    let reserve = i64::from(cap.reserve);
    let mut soon = free + i64::from(cap.retiring) + freed;
    let mut short = false;
    while soon < reserve {
        short = true;
        let Some(m) = leaving.next() else { break };
        soon += i64::from(m.nodes.get());
        retire.push((m.id, RetireReason::CapacityShort));
        kept_count -= 1;
    }

    let kept_count = u32::try_from(kept_count).unwrap_or(u32::MAX);
    let wanted = target.saturating_sub(kept_count);
    let room = if short {
        0
    } else {
        let spare = (free - reserve).max(0) / i64::from(input.member_nodes.get());
        u32::try_from(spare).unwrap_or(u32::MAX)
    };
    let (create, deferred) = if settings.paused() {
        (0, 0)
    } else {
        let create = wanted.min(room);
        (create, wanted - create)
    };

    let why = explain(&Explained {
        input,
        target,
        source,
        listed_ready,
        listed_preparing,
        kept: kept_count,
        too_old,
        stuck,
        retire: &retire,
        free,
        create,
        deferred,
        wanted,
    });
    Plan {
        target,
        source,
        create,
        deferred,
        retire,
        why,
    }
}

fn count(retire: &[(SessionId, RetireReason)], reason: RetireReason) -> usize {
    retire.iter().filter(|(_, r)| *r == reason).count()
}

fn target(input: &PlanInput) -> (u32, TargetSource) {
    let s = &input.settings;
    if !s.demand_driven() {
        return (s.size(), TargetSource::Fixed);
    }
    match input
        .demand
        .as_ref()
        .and_then(|d| expected_starts(d, input.now))
    {
        None => (s.size(), TargetSource::StartingPoint),
        Some(w) => {
            let clamped = w.expected.clamp(u64::from(s.min()), u64::from(s.max()));
            let target = u32::try_from(clamped).unwrap_or(s.max());
            (target, TargetSource::Demand(w))
        }
    }
}

struct Explained<'a> {
    input: &'a PlanInput,
    target: u32,
    source: TargetSource,
    listed_ready: usize,
    listed_preparing: usize,
    kept: u32,
    too_old: usize,
    stuck: usize,
    retire: &'a [(SessionId, RetireReason)],
    free: i64,
    create: u32,
    deferred: u32,
    wanted: u32,
}

fn explain(e: &Explained<'_>) -> String {
    let s = &e.input.settings;
    let cap = &e.input.capacity;
    let mut why = String::new();
    let _ = write!(why, "target {}", e.target);
    match e.source {
        TargetSource::Fixed => why.push_str(" (fixed size)"),
        TargetSource::StartingPoint => why.push_str(" (demand-driven, no start history yet: size)"),
        TargetSource::Demand(w) => {
            let _ = write!(
                why,
                " (demand-driven: {} start(s) in {}, {} expected per refill time, within {}..={})",
                w.starts,
                w.kind.describe(),
                w.expected,
                s.min(),
                s.max()
            );
        }
    }
    let _ = write!(
        why,
        "; {} ready, {} preparing",
        e.listed_ready, e.listed_preparing
    );
    if e.too_old > 0 {
        let _ = write!(
            why,
            "; {} older than {} min",
            e.too_old,
            s.max_age().num_minutes()
        );
    }
    if e.stuck > 0 {
        let _ = write!(
            why,
            "; {} still preparing after {} s",
            e.stuck,
            e.input.stuck_after.num_seconds()
        );
    }
    let surplus = count(e.retire, RetireReason::Surplus);
    if surplus > 0 {
        let _ = write!(why, "; {surplus} above the target");
    }
    let _ = write!(
        why,
        "; VMs: limit {}, {} alive, {} starting, {} being freed, reserve {}, {} free",
        cap.limit, cap.alive, cap.starting, cap.retiring, cap.reserve, e.free
    );
    let short = count(e.retire, RetireReason::CapacityShort);
    if short > 0 {
        let _ = write!(why, "; {short} retired to restore the reserve");
    }
    let _ = write!(why, "; keep {}", e.kept);
    if s.paused() {
        let _ = write!(
            why,
            "; paused: nothing created, nothing retired for size ({} wanted)",
            e.wanted
        );
    } else {
        let _ = write!(why, "; create {}", e.create);
        if e.deferred > 0 {
            let _ = write!(
                why,
                " ({} deferred: each needs {} free VM place(s) beyond the reserve)",
                e.deferred, e.input.member_nodes
            );
        }
    }
    why
}
