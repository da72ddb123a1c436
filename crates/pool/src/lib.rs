//! The warm-pool planner: for one pool (one lesson in one environment), how many fresh members
//! to create now and which members to retire, and why.
//!
//! A pool member is a whole prepared lab (every node of the lesson, setup done) bound to no
//! session, waiting for a student's click. This crate owns the decision only: [`plan`] takes
//! the pool's [`PoolSettings`], its unclaimed [`Member`]s, the environment's VM [`Capacity`]
//! and, for a demand-driven pool, recent starts ([`Demand`]), and the lesson's scheduled
//! classes ([`Class`]), with `now` passed in, and returns a [`Plan`]. It refuses to own a
//! clock, a database, a cluster client or the claim: the server reads the inputs, acts on the
//! plan through the normal provisioning and reclamation paths, and claims members in the
//! database (a class's students take its members first). Claimed members are not the
//! planner's business, and it never reuses anything: it only ever asks for fresh members.
//!
//! The rules (each one tested, the invariants also by property tests; operators read them in
//! `docs/pools.md`):
//!
//! - A member still preparing after `stuck_after` is retired; any other member whose
//!   `created_at` is at least `max_age` ago is retired. A replacement is created in the same
//!   plan when capacity allows; the old member's VMs count as taken until they are gone.
//! - The target is `size`, or for a demand-driven pool what the starts expected during one
//!   refill time need, clamped to `min..=max`: the largest of the recent rate scaled to one
//!   refill time and the starts of the next refill time one day and one week earlier, counted
//!   only where the history covers the window ([`expected_starts`]); a recent rate (random
//!   arrivals) needs the members that serve 9 clicks in 10 by Erlang B ([`members_for`]). With
//!   a history shorter than the recent window, `size`, or more if the starts so far ask for
//!   more ([`expected_starts_so_far`]).
//! - Members beyond the target are retired; preparing ones first, then the oldest ready ones.
//! - Capacity stays honest: a member is created only while `limit - alive - starting -
//!   create * nodes >= reserve`, so planned members never take a place a cold start needs; when
//!   the free places (with those being freed) are fewer than the reserve, members are retired
//!   until the reserve is restored.
//! - Paused: nothing is created and nothing is retired for size (ready members keep serving
//!   claims); age, stuck and capacity rules still apply. To empty a pool, resize it to 0.
//! - Scheduled classes ([`Class`]): from `starts_at - lead time` ([`LeadTime`], a high
//!   percentile of the lesson's measured preparations) to the class's end, the pool also keeps
//!   the class's warm share of members, made for it ([`Member::class`]), so they are ready at
//!   the start. The classes of every lesson active at once share the headroom in proportion to
//!   their seats ([`share_headroom`], computed once for the environment and given to each
//!   pool's plan). Nothing is created while students of another lesson wait for a place. After
//!   the class, its members are ordinary members, and the surplus rule retires those beyond
//!   the pool's own target.
//!
//! ```
//! use std::num::NonZeroU32;
//! use chrono::{TimeDelta, TimeZone, Utc};
//! use ttlab_model::SessionId;
//! use ttlab_pool::{Capacity, LeadTime, Member, PlanInput, PoolSettings, RetireReason, plan};
//!
//! let now = Utc.with_ymd_and_hms(2026, 12, 2, 9, 0, 0).unwrap();
//! let one = NonZeroU32::MIN;
//! let old = Member {
//!     id: SessionId::new_random(),
//!     created_at: now - TimeDelta::hours(5),
//!     ready_at: Some(now - TimeDelta::hours(5) + TimeDelta::minutes(2)),
//!     nodes: one,
//!     class: None,
//! };
//! let input = PlanInput {
//!     now,
//!     settings: PoolSettings::new(0, 2, 2, TimeDelta::minutes(240)).unwrap(),
//!     member_nodes: one,
//!     members: vec![old],
//!     capacity: Capacity { limit: 8, alive: 3, starting: 0, retiring: 0, reserve: 3 },
//!     demand: None,
//!     stuck_after: TimeDelta::minutes(15),
//!     classes: vec![],
//!     lead_time: LeadTime::default(),
//!     sharing: None,
//!     waiting_elsewhere: 0,
//! };
//! let p = plan(&input);
//! assert_eq!(p.retire, vec![(old.id, RetireReason::TooOld)]);
//! // Two wanted; 8 - 3 = 5 free, so two fit beside the reserve of 3.
//! assert_eq!((p.target, p.create, p.deferred), (2, 2, 0));
//! assert!(p.why.starts_with("target 2 (fixed size); 1 ready, 0 preparing; 1 older than 240 min"));
//! ```

mod class;
mod demand;
mod error;
mod plan;
mod settings;

pub use class::{
    Class, ClassAsk, ClassPhase, ClassShare, DEFAULT_LEAD_TIME, LEAD_TIME_MARGIN,
    LEAD_TIME_MIN_SAMPLES, LEAD_TIME_PERCENTILE, LeadTime, LeadTimeSource, MAX_LEAD_TIME,
    MIN_LEAD_TIME, Sharing, class_headroom, share_headroom,
};
pub use demand::{
    DAY, DEFAULT_RECENT_WINDOW, DEFAULT_REFILL_TIME, DEMAND_HIT_RATE_PERCENT, Demand,
    DemandWindows, Forecast, MAX_FORECAST_DURATION, WEEK, Window, WindowCount, WindowKind,
    expected_starts, expected_starts_so_far, members_for,
};
pub use error::PoolError;
pub use plan::{Capacity, ClassPlan, Member, Plan, PlanInput, RetireReason, TargetSource, plan};
pub use settings::{DEFAULT_MAX_AGE, PoolSettings};
