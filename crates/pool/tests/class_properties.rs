//! Invariants of scheduled classes over arbitrary classes, pools, capacities and shares: the
//! headroom is never exceeded, shares are proportional to seats and add up to at most the
//! headroom, plans are deterministic, and members are ready at the start when the lead time
//! covers the preparation.

use std::collections::BTreeSet;
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use proptest::prelude::*;
use ttlab_model::{ClassId, SessionId};
use ttlab_pool::{
    Capacity, Class, ClassAsk, LeadTime, Member, PlanInput, PoolSettings, RetireReason, plan,
    share_headroom,
};

/// 2020-01-01 .. 2040-01-01, in seconds.
const FROM_S: i64 = 1_577_836_800;
const TO_S: i64 = 2_208_988_800;

fn class_id(n: u128) -> ClassId {
    format!("00000000-0000-4000-9000-{:012x}", n + 1)
        .parse()
        .unwrap()
}

fn session_id(n: u128) -> SessionId {
    format!("00000000-0000-4000-8000-{:012x}", n + 1)
        .parse()
        .unwrap()
}

fn ask() -> impl Strategy<Value = ClassAsk> {
    (0..12u128, 1..=60u32, 0..=70u32, 1..=3u32, 0..=30u32).prop_map(
        |(id, seats, wanted, nodes, held)| ClassAsk {
            id: class_id(id),
            title: format!("class {id}"),
            seats,
            wanted: wanted.min(seats),
            nodes: NonZeroU32::new(nodes).unwrap(),
            held,
        },
    )
}

fn settings() -> impl Strategy<Value = PoolSettings> {
    (0..=6u32, 0..=6u32, 0..=6u32, any::<bool>()).prop_map(|(a, b, c, paused)| {
        let mut v = [a, b, c];
        v.sort_unstable();
        PoolSettings::new(v[0], v[1], v[2], TimeDelta::minutes(240))
            .unwrap()
            .with_paused(paused)
    })
}

/// A class whose window lies around `now` (from two hours before to two hours after).
fn class(now: DateTime<Utc>) -> impl Strategy<Value = Class> {
    (
        0..4u128,
        -7200..7200i64,
        600..10_800i64,
        1..=40u32,
        0..=45u32,
    )
        .prop_map(move |(id, start, length, seats, started)| Class {
            id: class_id(id),
            title: format!("class {id}"),
            starts_at: now + TimeDelta::seconds(start),
            ends_at: now + TimeDelta::seconds(start + length),
            seats,
            started,
        })
}

fn member(now: DateTime<Utc>) -> impl Strategy<Value = Member> {
    (
        0..(6 * 3600i64),
        proptest::option::of(0..1800i64),
        proptest::option::of(0..5u128),
    )
        .prop_map(move |(age, ready_after, class)| {
            let created_at = now - TimeDelta::seconds(age);
            Member {
                id: session_id(0),
                created_at,
                ready_at: ready_after.map(|s| created_at + TimeDelta::seconds(s)),
                nodes: NonZeroU32::MIN,
                class: class.map(class_id),
            }
        })
}

fn capacity() -> impl Strategy<Value = Capacity> {
    (0..=60u32, 0..=60u32, 0..=8u32, 0..=6u32, 0..=6u32).prop_map(
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
            proptest::collection::vec(member(now), 0..16).prop_map(|ms| {
                // Unique ids (a repeated id is the other property suite's business).
                ms.into_iter()
                    .enumerate()
                    .map(|(n, m)| Member {
                        id: session_id(n as u128),
                        ..m
                    })
                    .collect::<Vec<_>>()
            }),
            capacity(),
            proptest::collection::vec(class(now), 0..4).prop_map(|cs| {
                // Unique ids: a class is listed once.
                cs.into_iter()
                    .enumerate()
                    .map(|(n, c)| Class {
                        id: class_id(n as u128),
                        title: format!("class {n}"),
                        ..c
                    })
                    .collect::<Vec<_>>()
            }),
            proptest::collection::vec(1..2400i64, 0..8),
            proptest::option::of((0..=60u32, proptest::collection::vec(ask(), 0..3))),
            0..=2u32,
        )
            .prop_map(
                move |(settings, members, capacity, classes, prepared, sharing, waiting)| {
                    let lead_time = LeadTime::from_prepare_times(
                        &prepared
                            .iter()
                            .map(|s| TimeDelta::seconds(*s))
                            .collect::<Vec<_>>(),
                    );
                    // The environment's sharing: this pool's active classes and others.
                    let sharing = sharing.map(|(headroom, mut others)| {
                        for c in &classes {
                            if c.phase(now, lead_time).is_active() {
                                others.push(ClassAsk {
                                    id: c.id,
                                    title: c.title.clone(),
                                    seats: c.seats,
                                    wanted: c.seats_left(),
                                    nodes: NonZeroU32::MIN,
                                    held: 0,
                                });
                            }
                        }
                        share_headroom(headroom, &others)
                    });
                    PlanInput {
                        now,
                        settings,
                        member_nodes: NonZeroU32::MIN,
                        members,
                        capacity,
                        demand: None,
                        stuck_after: TimeDelta::minutes(15),
                        classes,
                        lead_time,
                        sharing,
                        waiting_elsewhere: waiting,
                    }
                },
            )
    })
}

fn distinct(members: &[Member]) -> Vec<Member> {
    let mut seen = BTreeSet::new();
    let mut ms = members.to_vec();
    ms.sort_by_key(|m| (m.created_at, m.id));
    ms.into_iter().filter(|m| seen.insert(m.id)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Shares never exceed the headroom or what a class can use, and a class short of what it
    /// can use got at least its proportional part of the whole headroom (by the VMs its seats
    /// need, up to one member of rounding), with no member that would still fit left out.
    #[test]
    fn shares_are_proportional_and_add_up_to_at_most_the_headroom(
        headroom in 0..=200u32,
        asks in proptest::collection::vec(ask(), 0..6),
    ) {
        let s = share_headroom(headroom, &asks);
        let used: u64 = s.shares.iter().map(|c| u64::from(c.warm) * u64::from(c.nodes.get())).sum();
        prop_assert!(used <= u64::from(headroom), "{s:?}");
        // A class's weight: the VMs its seats need.
        let weight = |c: &ttlab_pool::ClassShare| u64::from(c.seats) * u64::from(c.nodes.get());
        let total: u64 = s.shares.iter().filter(|c| c.wanted > 0).map(weight).sum();
        for c in &s.shares {
            prop_assert!(c.warm <= c.wanted, "{c:?}");
            if c.is_short() {
                let n = u64::from(c.nodes.get());
                // Its part of the whole: headroom * weight / total weight, in VMs.
                prop_assert!(
                    ((u64::from(c.warm) + 1) * n + 1) * total > u64::from(headroom) * weight(c),
                    "{c:?} of {s:?}"
                );
                prop_assert!(u64::from(headroom) - used < n, "a member of {} would still fit: {s:?}", c.title);
            }
        }
    }

    /// The same classes in another order get the same shares.
    #[test]
    fn shares_do_not_depend_on_the_order(headroom in 0..=200u32, asks in proptest::collection::vec(ask(), 0..6)) {
        let mut reversed = asks.clone();
        reversed.reverse();
        prop_assert_eq!(share_headroom(headroom, &asks), share_headroom(headroom, &reversed));
    }

    /// With classes, planned members never take a place of the reserve.
    #[test]
    fn class_members_never_take_a_place_of_the_reserve(i in input()) {
        let p = plan(&i);
        let c = &i.capacity;
        if p.create > 0 {
            let used = u64::from(c.alive) + u64::from(c.starting) + u64::from(p.create);
            prop_assert!(used + u64::from(c.reserve) <= u64::from(c.limit), "{}", p.why);
        }
        let for_classes: u32 = p.create_for.iter().map(|(_, n)| n).sum();
        prop_assert!(for_classes <= p.create);
    }

    /// A class gets at most its share and its seats left; only classes in their lead-in or
    /// running get members; nothing is created while others wait or the pool is paused.
    #[test]
    fn classes_get_at_most_their_share_and_only_in_their_window(i in input()) {
        let p = plan(&i);
        let members = distinct(&i.members);
        for (id, n) in &p.create_for {
            let class = i.classes.iter().find(|c| c.id == *id);
            prop_assert!(class.is_some_and(|c| c.phase(i.now, i.lead_time).is_active()), "{}", p.why);
            let cp = p.classes.iter().find(|c| c.id == *id).unwrap();
            prop_assert_eq!(cp.create, *n);
            prop_assert!(cp.kept + cp.create <= cp.target.max(cp.kept));
            prop_assert!(cp.kept + cp.create <= cp.warm.max(cp.kept), "{}", p.why);
            if let Some(s) = &i.sharing {
                prop_assert!(cp.warm <= s.share_of(*id).map_or(0, |s| s.warm));
            }
        }
        for cp in &p.classes {
            let class = i.classes.iter().find(|c| c.id == cp.id).unwrap();
            prop_assert!(cp.warm <= class.seats_left());
            if !i.settings.paused() {
                prop_assert!(cp.kept <= class.seats_left(), "{}", p.why);
            }
            let listed = members.iter().filter(|m| m.class == Some(cp.id)).count();
            prop_assert!(cp.kept as usize <= listed);
        }
        if i.waiting_elsewhere > 0 || i.settings.paused() {
            prop_assert_eq!(p.create, 0);
        }
    }

    /// The pool (its own members and its classes') moves to its target within capacity, and
    /// every retired id is a listed member, retired once.
    #[test]
    fn with_classes_the_pool_moves_to_its_target(i in input()) {
        let p = plan(&i);
        let members = distinct(&i.members);
        let mut seen = BTreeSet::new();
        for (id, _) in &p.retire {
            prop_assert!(members.iter().any(|m| m.id == *id));
            prop_assert!(seen.insert(*id));
        }
        let kept = members.len() - p.retire.len();
        let after = kept as u64 + u64::from(p.create);
        if !i.settings.paused() {
            prop_assert!(after <= u64::from(p.target), "{}", p.why);
            prop_assert_eq!(after + u64::from(p.deferred), u64::from(p.target), "{}", p.why);
        }
        // Old and stuck members still go for those reasons, classes or not.
        for m in &members {
            let age = i.now - m.created_at;
            let got = p.retire.iter().find(|(id, _)| *id == m.id).map(|(_, r)| *r);
            if m.ready_at.is_none() && age >= i.stuck_after {
                prop_assert_eq!(got, Some(RetireReason::StuckPreparing));
            } else if age >= i.settings.max_age() {
                prop_assert_eq!(got, Some(RetireReason::TooOld));
            }
        }
    }

    /// Members and classes listed in another order give the same plan.
    #[test]
    fn with_classes_the_plan_is_deterministic(i in input()) {
        let mut other = i.clone();
        other.members.reverse();
        other.classes.reverse();
        prop_assert_eq!(plan(&i), plan(&other));
    }

    /// A class whose lesson prepares within its measured 90th percentile finds every seat's
    /// member ready at its start, when the capacity allows it: the refiller runs every few
    /// seconds, creates what the plan says, and each member is ready `prepare` after its
    /// creation.
    #[test]
    fn members_are_ready_at_the_start_when_the_lead_time_covers_the_preparation(
        start_s in FROM_S..TO_S,
        seats in 1..=40u32,
        nodes in 1..=3u32,
        measured in proptest::collection::vec(30..1500i64, 3..30),
        pick in any::<prop::sample::Index>(),
        tick in 1..=10i64,
        spare in 0..=10u32,
    ) {
        let starts_at = DateTime::from_timestamp(start_s, 0).unwrap();
        let lead_time = LeadTime::from_prepare_times(
            &measured.iter().map(|s| TimeDelta::seconds(*s)).collect::<Vec<_>>(),
        );
        // A preparation no slower than the 90th percentile of those measured.
        let mut sorted = measured.clone();
        sorted.sort_unstable();
        let p90 = sorted[(sorted.len() * 90).div_ceil(100) - 1];
        let prepare = TimeDelta::seconds(sorted[pick.index(sorted.len())].min(p90));
        let class = Class {
            id: class_id(0),
            title: "the class".into(),
            starts_at,
            ends_at: starts_at + TimeDelta::hours(1),
            seats,
            started: 0,
        };
        let reserve = 3;
        let limit = seats * nodes + reserve + spare;
        let nodes = NonZeroU32::new(nodes).unwrap();
        let mut members: Vec<Member> = Vec::new();
        let mut next = 0u128;
        // From a few rounds before the lead-in until every seat has its member (nothing
        // changes after that but readiness).
        let mut now = class.lead_in_at(lead_time) - TimeDelta::seconds(3 * tick);
        while now <= starts_at && members.len() < seats as usize {
            // What the cluster shows: members ready once prepared.
            let listed: Vec<Member> = members
                .iter()
                .map(|m| Member {
                    ready_at: (now >= m.created_at + prepare).then_some(m.created_at + prepare),
                    ..*m
                })
                .collect();
            let input = PlanInput {
                now,
                settings: PoolSettings::new(0, 0, 0, TimeDelta::minutes(240)).unwrap(),
                member_nodes: nodes,
                members: listed.clone(),
                capacity: Capacity {
                    limit,
                    alive: listed.len() as u32 * nodes.get(),
                    starting: 0,
                    retiring: 0,
                    reserve,
                },
                demand: None,
                stuck_after: TimeDelta::hours(1),
                classes: vec![class.clone()],
                lead_time,
                sharing: None,
                waiting_elsewhere: 0,
            };
            let p = plan(&input);
            prop_assert!(p.retire.is_empty(), "{}", p.why);
            if now < class.lead_in_at(lead_time) {
                prop_assert_eq!(p.create, 0, "{}", p.why);
            }
            for (id, n) in &p.create_for {
                for _ in 0..*n {
                    let m = Member {
                        id: session_id(next),
                        created_at: now,
                        ready_at: None,
                        nodes,
                        class: Some(*id),
                    };
                    next += 1;
                    members.push(m);
                }
            }
            now += TimeDelta::seconds(tick);
        }
        let ready = members
            .iter()
            .filter(|m| m.created_at + prepare <= starts_at)
            .count();
        prop_assert_eq!(ready, seats as usize, "lead time {}, prepare {}", lead_time, prepare);
    }
}
