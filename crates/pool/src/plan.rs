//! The planner: from the pool's settings, members, capacity, demand and scheduled classes to
//! what to do now.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use ttlab_model::{ClassId, SessionId};

use crate::class::{
    Class, ClassAsk, ClassPhase, LeadTime, Sharing, class_headroom, share_headroom,
};
use crate::demand::{
    DEMAND_HIT_RATE_PERCENT, Demand, WindowCount, WindowKind, expected_starts,
    expected_starts_so_far, members_for,
};
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
    /// The class it was prepared for, if any. Until that class ends the member is the class's
    /// (its students claim it first, and nobody else takes it); once the class is over, or
    /// when it is not listed (cancelled), it is an ordinary member of the pool.
    pub class: Option<ClassId>,
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
    /// The scheduled classes of the pool's lesson, in any order (cancelled ones left out).
    pub classes: Vec<Class>,
    /// How long before a class's start its members begin to be created
    /// ([`LeadTime::from_prepare_times`] over the lesson's measured preparations).
    pub lead_time: LeadTime,
    /// How the classes of every lesson active now share the headroom ([`share_headroom`],
    /// computed once for the environment): each active class of this pool keeps at most its
    /// share warm. `None`: this pool's own active classes share its own headroom.
    pub sharing: Option<Sharing>,
    /// Students on the waitlist for another lesson: while any wait, nothing is created (their
    /// lab needs the places more than a prepared one does).
    pub waiting_elsewhere: u32,
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
    /// Demand-driven: what the expected starts during one refill time need, from this window
    /// (from the recent window, the members that serve [`DEMAND_HIT_RATE_PERCENT`] % of random
    /// clicks: [`members_for`]), clamped to `min..=max`.
    Demand(WindowCount),
    /// Demand-driven, with a history shorter than the recent window that already asks for
    /// more than `size`: the same from the starts so far ([`expected_starts_so_far`]).
    EarlyDemand(WindowCount),
}

/// What to do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The number of members the pool should hold (ready and preparing): the pool's own target
    /// (within `min..=max`) plus each active class's ([`ClassPlan::target`]).
    pub target: u32,
    /// Where the pool's own target came from.
    pub source: TargetSource,
    /// Fresh members to create now (each takes [`PlanInput::member_nodes`] VMs), those of
    /// [`Plan::create_for`] included.
    pub create: u32,
    /// Of `create`, the members to prepare for each class, in the order to create them
    /// (classes first, then ordinary members); only classes with at least one.
    pub create_for: Vec<(ClassId, u32)>,
    /// Members the target wants but capacity does not allow now (0 while paused).
    pub deferred: u32,
    /// Members to retire, each once, with the reason; in the order decided.
    pub retire: Vec<(SessionId, RetireReason)>,
    /// Each class in its lead-in or running (and each class to come that already has members),
    /// by start: what it keeps and creates.
    pub classes: Vec<ClassPlan>,
    /// One line saying why, for the admin page and logs.
    pub why: String,
}

/// What a plan does for one active class of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassPlan {
    /// The class.
    pub id: ClassId,
    /// Its phase at `now`: lead-in or running; or upcoming for a class that already has
    /// members (its lead time shrank since they were made), which keeps them and creates none.
    pub phase: ClassPhase,
    /// Its warm share: the members it may keep (at most its seats left).
    pub warm: u32,
    /// The members it should hold: its share, or more while members beyond it are kept because
    /// no other class needs their places.
    pub target: u32,
    /// Its members kept after this plan's retirements.
    pub kept: u32,
    /// Members created for it now.
    pub create: u32,
    /// Members its share wants that capacity does not allow now.
    pub deferred: u32,
}

/// Plans one round for one pool. Total and deterministic: the same input (whatever the order
/// of its members and classes) gives the same plan. The rules, in order:
///
/// 1. **Stuck, then too old.** A member still preparing `stuck_after` after its creation is
///    retired ([`RetireReason::StuckPreparing`]); any other member created at least `max_age`
///    ago is retired ([`RetireReason::TooOld`]).
/// 2. **Target.** `size` for a fixed pool; for a demand-driven one, what the expected starts
///    during one refill time ([`expected_starts`]) need, clamped to `min..=max`: from the recent
///    window's rate, the members that serve 9 random clicks in 10 ([`members_for`]); from the
///    same time a day or a week before, that window's count. While no history covers a window,
///    `size`, or more if the history so far already asks for more ([`expected_starts_so_far`]). Each class in its lead-in (from `starts_at - lead_time`) or running adds
///    its warm share ([`share_headroom`]: the headroom shared by seats, at most its seats
///    left); members of a class over, or not listed, are ordinary members.
/// 3. **Surplus.** Unless paused, ordinary members beyond the pool's own target are retired
///    ([`RetireReason::Surplus`]); so are a class's members beyond its seats left, and beyond
///    its share while another class holds less than its own.
/// 4. **Capacity short.** While the places free, plus those being freed (`retiring` and the
///    members retired above), are fewer than the reserve, further members are retired
///    ([`RetireReason::CapacityShort`]), ordinary ones before a class's, until the reserve is
///    restored or the pool is empty.
/// 5. **Create.** Unless paused, short, or students of another lesson wait, the classes' missing
///    members (by start), then the pool's own, are created, as many as fit with
///    `free - create * member_nodes >= reserve`, where `free = limit - alive - starting`
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

    // The classes in their lead-in or running, by start; a member of another class (over,
    // upcoming, cancelled) is an ordinary member.
    let mut classes: Vec<&Class> = input.classes.iter().collect();
    classes.sort_by(|a, b| {
        (a.starts_at, a.id, a.ends_at, a.seats, a.started, &a.title).cmp(&(
            b.starts_at,
            b.id,
            b.ends_at,
            b.seats,
            b.started,
            &b.title,
        ))
    });
    let mut class_ids = BTreeSet::new();
    classes.retain(|c| class_ids.insert(c.id));
    // So are the classes still to come that already have members (their lead time shrank
    // since): those members stay theirs, and none is created until the lead-in.
    let preparing_for = |c: &Class| c.phase(now, input.lead_time).is_active();
    let active: Vec<&Class> = classes
        .iter()
        .copied()
        .filter(|c| {
            preparing_for(c)
                || (c.phase(now, input.lead_time) == ClassPhase::Upcoming
                    && kept.iter().any(|m| m.class == Some(c.id)))
        })
        .collect();
    let class_of = |m: &Member| {
        m.class
            .and_then(|id| active.iter().position(|c| c.id == id))
    };

    let (own_target, source) = target(input);

    let cap = &input.capacity;
    let free = cap.free();
    let reserve = i64::from(cap.reserve);

    // Each active class's warm share.
    let local;
    let sharing: &Sharing = match &input.sharing {
        Some(s) => s,
        None => {
            let held = |i: usize| kept.iter().filter(|m| class_of(m) == Some(i)).count();
            let vms: u64 = kept
                .iter()
                .filter(|m| class_of(m).is_some_and(|i| preparing_for(active[i])))
                .map(|m| u64::from(m.nodes.get()))
                .sum();
            let asks: Vec<ClassAsk> = active
                .iter()
                .enumerate()
                .filter(|(_, c)| preparing_for(c))
                .map(|(i, c)| ClassAsk {
                    id: c.id,
                    title: c.title.clone(),
                    seats: c.seats,
                    wanted: c.seats_left(),
                    nodes: input.member_nodes,
                    held: u32::try_from(held(i)).unwrap_or(u32::MAX),
                })
                .collect();
            local = share_headroom(
                class_headroom(free, cap.reserve, u32::try_from(vms).unwrap_or(u32::MAX)),
                &asks,
            );
            &local
        }
    };
    let warm: Vec<u32> = active
        .iter()
        .map(|c| {
            if !preparing_for(c) {
                return 0;
            }
            sharing
                .share_of(c.id)
                .map_or(0, |s| s.warm)
                .min(c.seats_left())
        })
        .collect();

    // The order in which kept members go when some must: preparing (youngest first), then
    // ready (oldest first); ordinary ones and each class's apart.
    let leaving_order = |of: Option<usize>| -> Vec<Member> {
        let mine: Vec<Member> = kept.iter().filter(|m| class_of(m) == of).copied().collect();
        let mut order: Vec<Member> = mine
            .iter()
            .filter(|m| !m.is_ready())
            .rev()
            .copied()
            .collect();
        order.extend(mine.iter().filter(|m| m.is_ready()).copied());
        order
    };

    let mut ordinary = leaving_order(None).into_iter();
    let mut ordinary_kept = kept.iter().filter(|m| class_of(m).is_none()).count();
    if !settings.paused() {
        while ordinary_kept > own_target as usize {
            let Some(m) = ordinary.next() else { break };
            freed += i64::from(m.nodes.get());
            retire.push((m.id, RetireReason::Surplus));
            ordinary_kept -= 1;
        }
    }

    // Each class: beyond its seats left always surplus; beyond its share only while another
    // class holds less than its own (its places serve that class better).
    let another_short = |id: ClassId| sharing.shares.iter().any(|s| s.id != id && s.held < s.warm);
    let mut class_kept: Vec<usize> = Vec::with_capacity(active.len());
    let mut class_target: Vec<u32> = Vec::with_capacity(active.len());
    let mut class_leaving: Vec<Member> = Vec::new();
    for (i, c) in active.iter().enumerate() {
        let mut order = leaving_order(Some(i)).into_iter();
        let mut n = kept.iter().filter(|m| class_of(m) == Some(i)).count();
        let keep = if preparing_for(c) && another_short(c.id) {
            warm[i]
        } else {
            c.seats_left()
        };
        if !settings.paused() {
            while n > keep as usize {
                let Some(m) = order.next() else { break };
                freed += i64::from(m.nodes.get());
                retire.push((m.id, RetireReason::Surplus));
                n -= 1;
            }
        }
        class_kept.push(n);
        class_target.push(warm[i].max(u32::try_from(n).unwrap_or(u32::MAX)));
        class_leaving.extend(order);
    }

    let mut soon = free + i64::from(cap.retiring) + freed;
    let mut short = false;
    let mut leaving = ordinary.chain(class_leaving);
    while soon < reserve {
        short = true;
        let Some(m) = leaving.next() else { break };
        soon += i64::from(m.nodes.get());
        retire.push((m.id, RetireReason::CapacityShort));
        match class_of(&m) {
            Some(i) => class_kept[i] -= 1,
            None => ordinary_kept -= 1,
        }
    }

    let as_u32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let mut room = if short {
        0
    } else {
        let spare = (free - reserve).max(0) / i64::from(input.member_nodes.get());
        u32::try_from(spare).unwrap_or(u32::MAX)
    };
    let blocked = settings.paused() || input.waiting_elsewhere > 0;
    let mut class_plans = Vec::with_capacity(active.len());
    let mut create_for = Vec::new();
    let (mut create, mut deferred, mut wanted) = (0u32, 0u32, 0u32);
    for (i, c) in active.iter().enumerate() {
        let kept_i = as_u32(class_kept[i]);
        let want = class_target[i].saturating_sub(kept_i);
        let made = if blocked { 0 } else { want.min(room) };
        room -= made;
        let put_off = if settings.paused() { 0 } else { want - made };
        if made > 0 {
            create_for.push((c.id, made));
        }
        create += made;
        deferred += put_off;
        wanted += want;
        class_plans.push(ClassPlan {
            id: c.id,
            phase: c.phase(now, input.lead_time),
            warm: warm[i],
            target: class_target[i],
            kept: kept_i,
            create: made,
            deferred: put_off,
        });
    }
    let ordinary_kept = as_u32(ordinary_kept);
    let own_wanted = own_target.saturating_sub(ordinary_kept);
    let own_create = if blocked { 0 } else { own_wanted.min(room) };
    create += own_create;
    wanted += own_wanted;
    if !settings.paused() {
        deferred += own_wanted - own_create;
    }
    let target = class_target
        .iter()
        .fold(own_target, |t, c| t.saturating_add(*c));
    let kept_count = class_kept
        .iter()
        .fold(ordinary_kept, |t, c| t.saturating_add(as_u32(*c)));

    let mut why = explain(&Explained {
        input,
        target: own_target,
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
    explain_classes(&mut why, input, &classes, &class_plans, sharing);
    Plan {
        target,
        source,
        create,
        create_for,
        deferred,
        retire,
        classes: class_plans,
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
    let (min, max) = (u64::from(s.min()), u64::from(s.max()));
    // What one refill time's starts need: starts arriving at random (a rate from the recent
    // window) need the members that serve nine clicks in ten; the same time a day or a week
    // before is a schedule replayed, its count as it was.
    let needed = |w: &WindowCount| match w.kind {
        WindowKind::Recent => members_for(w.expected, max),
        WindowKind::DayBefore | WindowKind::WeekBefore => w.expected,
    };
    let Some(demand) = input.demand.as_ref() else {
        return (s.size(), TargetSource::StartingPoint);
    };
    if let Some(w) = expected_starts(demand, input.now) {
        let target = u32::try_from(needed(&w).clamp(min, max)).unwrap_or(s.max());
        return (target, TargetSource::Demand(w));
    }
    // A history shorter than the recent window may raise the starting size, never lower it.
    match expected_starts_so_far(demand, input.now) {
        Some(w) if needed(&w).clamp(min, max) > u64::from(s.size()) => {
            let target = u32::try_from(needed(&w).clamp(min, max)).unwrap_or(s.max());
            (target, TargetSource::EarlyDemand(w))
        }
        _ => (s.size(), TargetSource::StartingPoint),
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
                " (demand-driven: {} start(s) in {}, {} expected per refill time",
                w.starts,
                w.kind.describe(),
                w.expected,
            );
            if w.kind == WindowKind::Recent {
                let _ = write!(
                    why,
                    ", {} members serve {DEMAND_HIT_RATE_PERCENT} % of random clicks",
                    members_for(w.expected, u64::from(s.max()))
                );
            }
            let _ = write!(why, ", within {}..={})", s.min(), s.max());
        }
        TargetSource::EarlyDemand(w) => {
            let _ = write!(
                why,
                " (demand-driven, {} start(s) in the history so far, {} expected per refill \
                 time, {} members serve {DEMAND_HIT_RATE_PERCENT} % of random clicks, within \
                 {}..={})",
                w.starts,
                w.expected,
                members_for(w.expected, u64::from(s.max())),
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
    } else if e.input.waiting_elsewhere > 0 {
        let _ = write!(
            why,
            "; {} student(s) of other lessons waiting: nothing created ({} deferred)",
            e.input.waiting_elsewhere, e.deferred
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

/// The classes' part of `why`: each active class with its share and how the headroom was
/// shared, the lead time, and the next class to come.
fn explain_classes(
    why: &mut String,
    input: &PlanInput,
    classes: &[&Class],
    plans: &[ClassPlan],
    sharing: &Sharing,
) {
    if classes.is_empty() {
        return;
    }
    let hm = |t: DateTime<Utc>| t.format("%H:%M").to_string();
    for p in plans {
        let Some(c) = classes.iter().find(|c| c.id == p.id) else {
            continue;
        };
        let _ = write!(
            why,
            "; class '{}' {} seats, {} started",
            c.title, c.seats, c.started
        );
        match p.phase {
            ClassPhase::Upcoming => {
                let _ = write!(
                    why,
                    " (upcoming, lead-in at {}: its members are kept, none created)",
                    hm(c.lead_in_at(input.lead_time))
                );
            }
            ClassPhase::LeadIn => {
                let _ = write!(why, " (lead-in, starts {})", hm(c.starts_at));
            }
            _ => {
                let _ = write!(why, " (running until {})", hm(c.ends_at));
            }
        }
        let _ = write!(
            why,
            ": {} warm ({}), keep {}, create {}",
            p.warm,
            sharing.describe_for(c.id),
            p.kept,
            p.create
        );
        if p.deferred > 0 {
            let _ = write!(why, " ({} deferred)", p.deferred);
        }
    }
    let _ = write!(why, "; {}", input.lead_time);
    if let Some(next) = classes
        .iter()
        .find(|c| c.phase(input.now, input.lead_time) == ClassPhase::Upcoming)
    {
        let _ = write!(
            why,
            "; next class '{}' {} seats at {}, members from {}",
            next.title,
            next.seats,
            hm(next.starts_at),
            hm(next.lead_in_at(input.lead_time))
        );
    }
}
