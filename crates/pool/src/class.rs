//! Scheduled classes: when a class's members are prepared (its lead time and phase), and how
//! the classes running at the same time share the VM places beyond the cold-start reserve.
//!
//! A class is a lesson, a number of seats and a window an operator booked. Its members are
//! created from `starts_at - lead time` on, so that they are ready at the start; the lead time
//! is a high percentile of the lesson's measured preparation times ([`LeadTime`]). Several
//! classes at once share the headroom in proportion to their seats ([`share_headroom`]): a
//! pure function over every class of the environment, whose answer is an input of
//! [`plan`](crate::plan), so each pool's plan stays a function of its inputs.

use std::fmt::{self, Write as _};
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use ttlab_model::ClassId;

/// The lead time before any preparation has been measured: 5 minutes.
pub const DEFAULT_LEAD_TIME: TimeDelta = TimeDelta::minutes(5);
/// The shortest lead time: 1 minute.
pub const MIN_LEAD_TIME: TimeDelta = TimeDelta::minutes(1);
/// The longest lead time: 30 minutes (a preparation slower than that is a problem to fix, not
/// to wait for).
pub const MAX_LEAD_TIME: TimeDelta = TimeDelta::minutes(30);
/// Added to the measured percentile: the refiller's rounds, and many members prepared at once.
pub const LEAD_TIME_MARGIN: TimeDelta = TimeDelta::seconds(30);
/// The percentile of the measured preparation times the lead time is made of.
pub const LEAD_TIME_PERCENTILE: u32 = 90;
/// Fewer measured preparations than this is no history yet: [`DEFAULT_LEAD_TIME`].
pub const LEAD_TIME_MIN_SAMPLES: usize = 3;

/// How long before a class's start its members begin to be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeadTime {
    value: TimeDelta,
    source: LeadTimeSource,
}

/// Where a [`LeadTime`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeadTimeSource {
    /// Fewer than [`LEAD_TIME_MIN_SAMPLES`] preparations measured: [`DEFAULT_LEAD_TIME`].
    Default,
    /// The [`LEAD_TIME_PERCENTILE`]th percentile of `samples` measured preparations, plus
    /// [`LEAD_TIME_MARGIN`], within [`MIN_LEAD_TIME`]..=[`MAX_LEAD_TIME`].
    Measured {
        /// How many preparations were measured.
        samples: usize,
        /// Their percentile (before the margin and the bounds).
        percentile: TimeDelta,
    },
}

impl LeadTime {
    /// From the lesson's recent members' preparation times (creation to ready), in any order;
    /// negative ones are ignored. The nearest-rank 90th percentile plus the margin, clamped to
    /// 1..=30 minutes; [`DEFAULT_LEAD_TIME`] with fewer than three.
    ///
    /// ```
    /// use chrono::TimeDelta;
    /// use ttlab_pool::{DEFAULT_LEAD_TIME, LeadTime};
    ///
    /// let s = TimeDelta::seconds;
    /// assert_eq!(LeadTime::from_prepare_times(&[s(100), s(200)]).value(), DEFAULT_LEAD_TIME);
    /// // Ten measured: the 9th smallest is the 90th percentile; plus 30 s.
    /// let times: Vec<_> = (1..=10).map(|i| s(60 * i)).collect();
    /// assert_eq!(LeadTime::from_prepare_times(&times).value(), s(9 * 60 + 30));
    /// ```
    pub fn from_prepare_times(times: &[TimeDelta]) -> Self {
        let mut times: Vec<TimeDelta> = times
            .iter()
            .copied()
            .filter(|d| *d >= TimeDelta::zero())
            .collect();
        if times.len() < LEAD_TIME_MIN_SAMPLES {
            return Self::default();
        }
        times.sort_unstable();
        let n = times.len();
        // Nearest rank: the smallest value with at least 90 % of the samples at or below it.
        let rank = (n * LEAD_TIME_PERCENTILE as usize).div_ceil(100).max(1);
        let percentile = times[rank - 1];
        let value = percentile
            .checked_add(&LEAD_TIME_MARGIN)
            .unwrap_or(MAX_LEAD_TIME)
            .clamp(MIN_LEAD_TIME, MAX_LEAD_TIME);
        Self {
            value,
            source: LeadTimeSource::Measured {
                samples: n,
                percentile,
            },
        }
    }

    /// The lead time.
    pub fn value(&self) -> TimeDelta {
        self.value
    }

    /// Where it came from.
    pub fn source(&self) -> LeadTimeSource {
        self.source
    }
}

impl Default for LeadTime {
    /// [`DEFAULT_LEAD_TIME`], no history.
    fn default() -> Self {
        Self {
            value: DEFAULT_LEAD_TIME,
            source: LeadTimeSource::Default,
        }
    }
}

impl fmt::Display for LeadTime {
    /// `lead time 5 min (default: fewer than 3 preparations measured)`, or `lead time
    /// 4 min 10 s (p90 of 12 preparations 3 min 40 s, plus 30 s)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lead time {}", Minutes(self.value))?;
        match self.source {
            LeadTimeSource::Default => write!(
                f,
                " (default: fewer than {LEAD_TIME_MIN_SAMPLES} preparations measured)"
            ),
            LeadTimeSource::Measured {
                samples,
                percentile,
            } => write!(
                f,
                " (p{LEAD_TIME_PERCENTILE} of {samples} preparations {}, plus {})",
                Minutes(percentile),
                Minutes(LEAD_TIME_MARGIN)
            ),
        }
    }
}

/// A duration as `4 min 10 s`, `5 min` or `40 s`.
struct Minutes(TimeDelta);

impl fmt::Display for Minutes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0.num_seconds();
        match (s / 60, s % 60) {
            (0, sec) => write!(f, "{sec} s"),
            (min, 0) => write!(f, "{min} min"),
            (min, sec) => write!(f, "{min} min {sec} s"),
        }
    }
}

/// A scheduled class of the pool's lesson, as the planner sees it (cancelled classes are left
/// out by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Class {
    /// Its id: members prepared for it carry it ([`Member::class`](crate::Member::class)).
    pub id: ClassId,
    /// The operator's title (`Intro 10:00`), for `why`.
    pub title: String,
    /// When the class begins: its members should be ready then.
    pub starts_at: DateTime<Utc>,
    /// When it ends: from then on its members are ordinary members of the pool.
    pub ends_at: DateTime<Utc>,
    /// How many students it has.
    pub seats: u32,
    /// How many of its students have started a lab of it so far (from a member or cold): the
    /// seats left need members, these do not.
    pub started: u32,
}

/// Where a class stands at an instant, for a given lead time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ClassPhase {
    /// Before `starts_at - lead time`: nothing is prepared for it yet.
    Upcoming,
    /// From `starts_at - lead time` to `starts_at`: its members are being prepared.
    LeadIn,
    /// From `starts_at` to `ends_at`: its students claim its members.
    Running,
    /// From `ends_at` on: its members left are ordinary members (surplus beyond the pool's
    /// own target).
    Over,
}

impl ClassPhase {
    /// Whether members are kept for the class (lead-in or running).
    pub fn is_active(self) -> bool {
        matches!(self, ClassPhase::LeadIn | ClassPhase::Running)
    }

    /// A stable lower-case name, for the API and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ClassPhase::Upcoming => "upcoming",
            ClassPhase::LeadIn => "lead_in",
            ClassPhase::Running => "running",
            ClassPhase::Over => "over",
        }
    }
}

impl Class {
    /// The instant its members begin to be created: `starts_at - lead` (or the earliest
    /// instant there is).
    pub fn lead_in_at(&self, lead: LeadTime) -> DateTime<Utc> {
        self.starts_at
            .checked_sub_signed(lead.value())
            .unwrap_or(DateTime::<Utc>::MIN_UTC)
    }

    /// Where the class stands at `now`.
    pub fn phase(&self, now: DateTime<Utc>, lead: LeadTime) -> ClassPhase {
        if now >= self.ends_at {
            ClassPhase::Over
        } else if now >= self.starts_at {
            ClassPhase::Running
        } else if now >= self.lead_in_at(lead) {
            ClassPhase::LeadIn
        } else {
            ClassPhase::Upcoming
        }
    }

    /// The seats whose students have not started yet: the most members the class can use.
    pub fn seats_left(&self) -> u32 {
        self.seats.saturating_sub(self.started)
    }
}

/// One class asking for warm members: an input of [`share_headroom`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassAsk {
    /// The class.
    pub id: ClassId,
    /// Its title, for `why`.
    pub title: String,
    /// Its seats: the weight of its share.
    pub seats: u32,
    /// The members it can use: its seats left ([`Class::seats_left`]).
    pub wanted: u32,
    /// The VMs one member of its lesson takes.
    pub nodes: NonZeroU32,
    /// The unclaimed members prepared for it now (ready or preparing).
    pub held: u32,
}

/// A class's part of the headroom.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClassShare {
    /// The class.
    pub id: ClassId,
    /// Its title.
    pub title: String,
    /// Its seats (its weight).
    pub seats: u32,
    /// The members it can use.
    pub wanted: u32,
    /// The VMs one of its members takes.
    pub nodes: NonZeroU32,
    /// Its members now.
    pub held: u32,
    /// The members it may keep warm: at most `wanted`, and all shares' VMs together at most
    /// the headroom.
    pub warm: u32,
}

impl ClassShare {
    /// Whether it may keep fewer members warm than it can use.
    pub fn is_short(&self) -> bool {
        self.warm < self.wanted
    }
}

/// How the headroom was shared among the classes active at one instant.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Sharing {
    /// The VM places the classes share: those free beyond the cold-start reserve, plus those
    /// their members already hold ([`class_headroom`]).
    pub headroom: u32,
    /// Each class's share, by id.
    pub shares: Vec<ClassShare>,
}

impl Sharing {
    /// The share of class `id`, if it took part.
    pub fn share_of(&self, id: ClassId) -> Option<&ClassShare> {
        self.shares.iter().find(|s| s.id == id)
    }

    /// `headroom 22 VMs shared 30:10 with 'kubeadm 10:00'`, or `headroom 40 VMs` when `id`
    /// is the only class.
    pub fn describe_for(&self, id: ClassId) -> String {
        let mut s = format!("headroom {} VM(s)", self.headroom);
        let Some(own) = self.share_of(id) else {
            return s;
        };
        let others: Vec<&ClassShare> = self.shares.iter().filter(|c| c.id != id).collect();
        if others.is_empty() {
            return s;
        }
        let _ = write!(s, " shared {}", own.seats);
        for o in &others {
            let _ = write!(s, ":{}", o.seats);
        }
        s.push_str(" with ");
        for (i, o) in others.iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "'{}' ({} warm)", o.title, o.warm);
        }
        s
    }
}

/// The VM places classes share: the places free beyond the reserve (`free - reserve`, at least
/// 0) plus those their unclaimed members already hold (`class_member_vms`).
pub fn class_headroom(free: i64, reserve: u32, class_member_vms: u32) -> u32 {
    let beyond = (free - i64::from(reserve)).max(0);
    let total = beyond.saturating_add(i64::from(class_member_vms));
    u32::try_from(total).unwrap_or(u32::MAX)
}

/// Shares `headroom` VM places among the classes active now, in proportion to their seats:
/// every class gets the same fraction of its seats warm (a class of 30 seats twice the members
/// of a class of 15), each at most the members it can use. In VMs, a class's part is in
/// proportion to what its seats need (seats times its lesson's node count). Total and
/// deterministic: the same classes in any order give the same shares (listed by id).
///
/// - A class that can use less than its proportional part takes only what it can use; the
///   rest is shared again among the others, the same way.
/// - Shares are whole members, rounded down; the VMs left over by rounding go, one member at a
///   time, to the classes with the smallest fraction of their seats warm while a member fits.
/// - So every class short of what it can use gets at least its proportional part of the whole
///   headroom (up to one member of rounding), and no member that would fit is left out.
///
/// ```
/// use std::num::NonZeroU32;
/// use ttlab_model::ClassId;
/// use ttlab_pool::{ClassAsk, share_headroom};
///
/// let ask = |title: &str, seats, nodes| ClassAsk {
///     id: ClassId::new_random(),
///     title: title.into(),
///     seats,
///     wanted: seats,
///     nodes: NonZeroU32::new(nodes).unwrap(),
///     held: 0,
/// };
/// let intro = ask("Intro 10:00", 30, 1);
/// let kubeadm = ask("kubeadm 10:00", 10, 1);
/// let s = share_headroom(20, &[intro.clone(), kubeadm.clone()]);
/// assert_eq!(s.share_of(intro.id).unwrap().warm, 15);
/// assert_eq!(s.share_of(kubeadm.id).unwrap().warm, 5);
/// ```
pub fn share_headroom(headroom: u32, asks: &[ClassAsk]) -> Sharing {
    let mut asks: Vec<ClassAsk> = asks.to_vec();
    // By id, a class listed twice once (whichever way round it was listed).
    asks.sort_by(|a, b| {
        (a.id, a.seats, a.wanted, a.nodes, a.held, &a.title)
            .cmp(&(b.id, b.seats, b.wanted, b.nodes, b.held, &b.title))
    });
    asks.dedup_by_key(|a| a.id);
    let mut warm = vec![0u64; asks.len()];
    let nodes = |i: usize| u64::from(asks[i].nodes.get());
    let wanted = |i: usize| u64::from(asks[i].wanted);
    let seats = |i: usize| u64::from(asks[i].seats.max(1));
    // A class's weight is the VMs its seats need: so every class gets the same fraction of its
    // seats warm, whatever its lesson's node count.
    let weight_of = |i: usize| seats(i) * nodes(i);

    let mut left = u64::from(headroom);
    let mut open: Vec<usize> = (0..asks.len()).filter(|&i| wanted(i) > 0).collect();
    // Water-filling: those who can use less than their part take it and leave; the rest is
    // shared again.
    loop {
        let weight: u64 = open.iter().map(|&i| weight_of(i)).sum();
        if open.is_empty() || weight == 0 {
            break;
        }
        let part = |i: usize| {
            let vms = u128::from(left) * u128::from(weight_of(i)) / u128::from(weight);
            u64::try_from(vms / u128::from(nodes(i))).unwrap_or(u64::MAX)
        };
        let satisfied: Vec<usize> = open
            .iter()
            .copied()
            .filter(|&i| part(i) >= wanted(i))
            .collect();
        if satisfied.is_empty() {
            for &i in &open {
                warm[i] = part(i);
            }
            let used: u64 = open.iter().map(|&i| warm[i] * nodes(i)).sum();
            left -= used;
            break;
        }
        for &i in &satisfied {
            warm[i] = wanted(i);
            left -= wanted(i) * nodes(i);
        }
        open.retain(|i| !satisfied.contains(i));
    }
    // What rounding left over: one member at a time, to the smallest fraction of its seats
    // first.
    loop {
        let next = open
            .iter()
            .copied()
            .filter(|&i| warm[i] < wanted(i) && nodes(i) <= left)
            .min_by(|&a, &b| {
                // warm[a] / seats(a) against warm[b] / seats(b), without division.
                let ka = u128::from(warm[a]) * u128::from(seats(b));
                let kb = u128::from(warm[b]) * u128::from(seats(a));
                ka.cmp(&kb).then(asks[a].id.cmp(&asks[b].id))
            });
        let Some(i) = next else { break };
        warm[i] += 1;
        left -= nodes(i);
    }
    Sharing {
        headroom,
        shares: asks
            .into_iter()
            .zip(warm)
            .map(|(a, w)| ClassShare {
                id: a.id,
                title: a.title,
                seats: a.seats,
                wanted: a.wanted,
                nodes: a.nodes,
                held: a.held,
                warm: u32::try_from(w).unwrap_or(u32::MAX),
            })
            .collect(),
    }
}
