//! Invariants of the planner over arbitrary pools, capacities and start histories.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use proptest::prelude::*;
use ttlab_model::SessionId;
use ttlab_pool::{
    Capacity, Demand, Forecast, LeadTime, Member, PlanInput, PoolSettings, RetireReason,
    TargetSource, plan,
};

/// 2020-01-01 .. 2040-01-01, in seconds.
const FROM_S: i64 = 1_577_836_800;
const TO_S: i64 = 2_208_988_800;

fn settings() -> impl Strategy<Value = PoolSettings> {
    (
        0..=12u32,
        0..=12u32,
        0..=12u32,
        1..=1440i64,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(a, b, c, age, demand, paused)| {
            let mut v = [a, b, c];
            v.sort_unstable();
            PoolSettings::new(v[0], v[1], v[2], TimeDelta::minutes(age))
                .unwrap()
                .with_demand(demand)
                .with_paused(paused)
        })
}

fn member(now: DateTime<Utc>) -> impl Strategy<Value = Member> {
    (
        0..16u128,
        0..(3 * 24 * 3600i64),
        proptest::option::of(0..3600i64),
        1..=4u32,
    )
        .prop_map(move |(id, age, ready_after, nodes)| {
            let created_at = now - TimeDelta::seconds(age);
            Member {
                // Few distinct ids, so repeats happen.
                id: uuid_of(id),
                created_at,
                ready_at: ready_after.map(|s| created_at + TimeDelta::seconds(s)),
                nodes: NonZeroU32::new(nodes).unwrap(),
                class: None,
            }
        })
}

fn uuid_of(n: u128) -> SessionId {
    format!("00000000-0000-4000-8000-{:012x}", n + 1)
        .parse()
        .unwrap()
}

/// The members as the planner counts them: by `(created_at, id)`, a repeated id once.
fn distinct(members: &[Member]) -> Vec<Member> {
    let mut seen = BTreeSet::new();
    let mut ms = members.to_vec();
    ms.sort_by_key(|m| (m.created_at, m.id));
    ms.into_iter().filter(|m| seen.insert(m.id)).collect()
}

fn capacity() -> impl Strategy<Value = Capacity> {
    (0..=40u32, 0..=40u32, 0..=8u32, 0..=6u32, 0..=8u32).prop_map(
        |(limit, alive, starting, retiring, reserve)| Capacity {
            limit,
            alive,
            starting,
            retiring: retiring.min(alive),
            reserve,
        },
    )
}

fn input() -> impl Strategy<Value = PlanInput> {
    (FROM_S..TO_S).prop_flat_map(|now_s| {
        let now = DateTime::from_timestamp(now_s, 0).unwrap();
        (
            settings(),
            1..=4u32,
            proptest::collection::vec(member(now), 0..12),
            capacity(),
            proptest::option::of((
                proptest::collection::vec(0..(8 * 24 * 3600i64), 0..40),
                0..(9 * 24 * 3600i64),
                1..=900i64,
                1..=3600i64,
            )),
            1..=7200i64,
        )
            .prop_map(
                move |(settings, member_nodes, members, capacity, demand, stuck)| PlanInput {
                    now,
                    settings,
                    member_nodes: NonZeroU32::new(member_nodes).unwrap(),
                    members,
                    capacity,
                    demand: demand.map(|(ago, since, refill, window)| Demand {
                        forecast: Forecast::new(
                            TimeDelta::seconds(refill),
                            TimeDelta::seconds(window),
                        )
                        .unwrap(),
                        starts: ago.iter().map(|s| now - TimeDelta::seconds(*s)).collect(),
                        recorded_since: now - TimeDelta::seconds(since),
                    }),
                    stuck_after: TimeDelta::seconds(stuck),
                    classes: vec![],
                    lead_time: LeadTime::default(),
                    sharing: None,
                    waiting_elsewhere: 0,
                },
            )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Planned members never take a place of the reserve: if anything is created, everything
    /// alive, starting and created still leaves `reserve` places under the limit.
    #[test]
    fn planned_members_never_take_a_place_of_the_reserve(i in input()) {
        let p = plan(&i);
        let c = &i.capacity;
        if p.create > 0 {
            let used = u64::from(c.alive) + u64::from(c.starting)
                + u64::from(p.create) * u64::from(i.member_nodes.get());
            prop_assert!(used + u64::from(c.reserve) <= u64::from(c.limit), "{}", p.why);
        }
    }

    /// A paused pool creates nothing and retires nothing for size.
    #[test]
    fn a_paused_pool_creates_nothing(i in input()) {
        let p = plan(&i);
        if i.settings.paused() {
            prop_assert_eq!(p.create, 0);
            prop_assert_eq!(p.deferred, 0);
            prop_assert!(p.retire.iter().all(|(_, r)| *r != RetireReason::Surplus));
        }
    }

    /// The target is within min..=max, and is the size unless demand decided it.
    #[test]
    fn the_target_is_within_its_bounds(i in input()) {
        let p = plan(&i);
        let s = &i.settings;
        prop_assert!(s.min() <= p.target && p.target <= s.max());
        match p.source {
            TargetSource::Fixed => prop_assert!(!s.demand_driven() && p.target == s.size()),
            TargetSource::StartingPoint => prop_assert!(s.demand_driven() && p.target == s.size()),
            TargetSource::Demand(_) => prop_assert!(s.demand_driven()),
            TargetSource::EarlyDemand(_) => prop_assert!(s.demand_driven() && p.target > s.size()),
        }
    }

    /// Every retired id is a listed member and is retired once.
    #[test]
    fn retirements_are_unique_and_only_of_known_members(i in input()) {
        let p = plan(&i);
        let known: BTreeSet<_> = i.members.iter().map(|m| m.id).collect();
        let mut seen = BTreeSet::new();
        for (id, _) in &p.retire {
            prop_assert!(known.contains(id));
            prop_assert!(seen.insert(*id), "{id} retired twice");
        }
    }

    /// Old and stuck members always go, for the right reason; nothing else goes for age.
    #[test]
    fn old_and_stuck_members_always_go(i in input()) {
        let p = plan(&i);
        for m in distinct(&i.members) {
            let age = i.now - m.created_at;
            let got = p.retire.iter().find(|(id, _)| *id == m.id).map(|(_, r)| *r);
            if m.ready_at.is_none() && age >= i.stuck_after {
                prop_assert_eq!(got, Some(RetireReason::StuckPreparing));
            } else if age >= i.settings.max_age() {
                prop_assert_eq!(got, Some(RetireReason::TooOld));
            } else {
                prop_assert!(!matches!(got, Some(RetireReason::TooOld | RetireReason::StuckPreparing)));
            }
        }
    }

    /// The pool never grows past its target; while running, with room, it reaches it; and the
    /// reserve is restored whenever members are left to retire.
    #[test]
    fn the_pool_moves_to_its_target_within_capacity(i in input()) {
        let p = plan(&i);
        let members = distinct(&i.members);
        let kept = members.len() - p.retire.len();
        let after = kept as u64 + u64::from(p.create);
        if !i.settings.paused() {
            prop_assert!(after <= u64::from(p.target), "{}", p.why);
            prop_assert_eq!(after + u64::from(p.deferred), u64::from(p.target));
        }
        let c = &i.capacity;
        let freed: i64 = p.retire.iter().map(|(id, _)| {
            members.iter().find(|m| m.id == *id).map_or(0, |m| i64::from(m.nodes.get()))
        }).sum();
        let soon = c.free() + i64::from(c.retiring) + freed;
        if kept > 0 {
            prop_assert!(soon >= i64::from(c.reserve), "{}", p.why);
        }
        // Retiring for capacity only when short before it, and never one member too many.
        let short: Vec<_> = p.retire.iter().filter(|(_, r)| *r == RetireReason::CapacityShort).collect();
        if let Some((last, _)) = short.last() {
            let last_nodes = members.iter().find(|m| m.id == *last).map_or(0, |m| i64::from(m.nodes.get()));
            prop_assert!(soon - last_nodes < i64::from(c.reserve), "{}", p.why);
        }
    }

    /// The same pool listed in another order gives the same plan.
    #[test]
    fn the_plan_is_deterministic(i in input(), seed in any::<u64>()) {
        let mut shuffled = i.clone();
        let n = shuffled.members.len();
        if n > 1 {
            let mut s = seed;
            for k in (1..n).rev() {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let j = (s >> 33) as usize % (k + 1);
                shuffled.members.swap(k, j);
            }
        }
        prop_assert_eq!(plan(&i), plan(&shuffled));
    }
}
