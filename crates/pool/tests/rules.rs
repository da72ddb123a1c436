//! Each rule of the planner, on small pools an operator could draw on a whiteboard.

use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use ttlab_model::SessionId;
use ttlab_pool::{
    Capacity, DAY, Demand, Forecast, LeadTime, Member, PlanInput, PoolSettings, RetireReason,
    TargetSource, WindowKind, plan,
};

/// Session ids that sort in the order of their number, so expected lists read plainly.
fn id(n: u8) -> SessionId {
    format!("00000000-0000-4000-8000-0000000000{n:02x}")
        .parse()
        .unwrap()
}

fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 2, 9, 0, 0).unwrap()
}

fn nodes(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// A ready member created `minutes` ago (ready two minutes after its creation).
fn ready(n: u8, minutes: i64) -> Member {
    let created_at = now() - TimeDelta::minutes(minutes);
    Member {
        id: id(n),
        created_at,
        ready_at: Some(created_at + TimeDelta::minutes(2)),
        nodes: nodes(1),
        class: None,
    }
}

/// A member created `minutes` ago and still preparing.
fn preparing(n: u8, minutes: i64) -> Member {
    Member {
        ready_at: None,
        ..ready(n, minutes)
    }
}

fn roomy() -> Capacity {
    Capacity {
        limit: 50,
        alive: 0,
        starting: 0,
        retiring: 0,
        reserve: 3,
    }
}

fn fixed(size: u32) -> PoolSettings {
    PoolSettings::new(0, size, size, TimeDelta::minutes(240)).unwrap()
}

fn input(settings: PoolSettings, members: Vec<Member>, capacity: Capacity) -> PlanInput {
    PlanInput {
        now: now(),
        settings,
        member_nodes: nodes(1),
        members,
        capacity,
        demand: None,
        stuck_after: TimeDelta::minutes(15),
        classes: vec![],
        lead_time: LeadTime::default(),
        sharing: None,
        waiting_elsewhere: 0,
    }
}

/// Capacity with every listed member's VMs alive.
fn alive(members: &[Member], limit: u32, reserve: u32) -> Capacity {
    Capacity {
        limit,
        alive: members.iter().map(|m| m.nodes.get()).sum(),
        starting: 0,
        retiring: 0,
        reserve,
    }
}

#[test]
fn an_empty_fixed_pool_is_filled_to_its_size() {
    let p = plan(&input(fixed(4), vec![], roomy()));
    assert_eq!(
        (p.target, p.source, p.create, p.deferred),
        (4, TargetSource::Fixed, 4, 0)
    );
    assert!(p.retire.is_empty());
    assert_eq!(
        p.why,
        "target 4 (fixed size); 0 ready, 0 preparing; VMs: limit 50, 0 alive, 0 starting, \
         0 being freed, reserve 3, 50 free; keep 0; create 4"
    );
}

#[test]
fn members_preparing_count_toward_the_pool() {
    let members = vec![ready(1, 30), preparing(2, 1), preparing(3, 0)];
    let p = plan(&input(fixed(4), members.clone(), alive(&members, 50, 3)));
    assert_eq!(p.create, 1, "{}", p.why);
    assert!(p.retire.is_empty());
    let p = plan(&input(fixed(3), members.clone(), alive(&members, 50, 3)));
    assert_eq!(p.create, 0);
}

#[test]
fn a_member_at_its_age_limit_is_retired_and_replaced_in_the_same_plan() {
    let members = vec![ready(1, 240), ready(2, 239), ready(3, 500)];
    let p = plan(&input(fixed(3), members.clone(), alive(&members, 50, 3)));
    assert_eq!(
        p.retire,
        vec![(id(3), RetireReason::TooOld), (id(1), RetireReason::TooOld)]
    );
    assert_eq!(p.create, 2, "{}", p.why);
    assert!(p.why.contains("2 older than 240 min"), "{}", p.why);
}

#[test]
fn a_refresh_waits_for_the_old_places_when_there_is_no_headroom() {
    // Limit 4, reserve 3: the one old member holds the only place the pool may use. Its
    // replacement comes once its VM is gone, never in a place of the reserve.
    let members = vec![ready(1, 300)];
    let p = plan(&input(fixed(1), members.clone(), alive(&members, 4, 3)));
    assert_eq!(p.retire, vec![(id(1), RetireReason::TooOld)]);
    assert_eq!((p.create, p.deferred), (0, 1), "{}", p.why);
    assert!(
        p.why
            .ends_with("create 0 (1 deferred: each needs 1 free VM place(s) beyond the reserve)"),
        "{}",
        p.why
    );
    // Next round: the old VM is being deleted (retiring) and the member is no longer listed.
    let cap = Capacity {
        retiring: 1,
        ..alive(&members, 4, 3)
    };
    let p = plan(&input(fixed(1), vec![], cap));
    assert_eq!((p.create, p.deferred), (0, 1));
    assert!(p.retire.is_empty());
    // Once it is gone, the replacement is created.
    let p = plan(&input(fixed(1), vec![], alive(&[], 4, 3)));
    assert_eq!(p.create, 1);
}

#[test]
fn a_member_preparing_too_long_is_retired_as_stuck() {
    let members = vec![preparing(1, 15), preparing(2, 14), ready(3, 20)];
    let p = plan(&input(fixed(3), members.clone(), alive(&members, 50, 3)));
    assert_eq!(p.retire, vec![(id(1), RetireReason::StuckPreparing)]);
    assert_eq!(p.create, 1);
    assert!(p.why.contains("1 still preparing after 900 s"), "{}", p.why);
    // Stuck wins over too old: the more telling reason.
    let old = preparing(4, 300);
    let p = plan(&input(fixed(1), vec![old], alive(&[old], 50, 3)));
    assert_eq!(p.retire, vec![(id(4), RetireReason::StuckPreparing)]);
}

#[test]
fn surplus_goes_preparing_youngest_first_then_ready_oldest_first() {
    let members = vec![
        ready(1, 100),
        ready(2, 50),
        preparing(3, 2),
        preparing(4, 1),
        ready(5, 80),
    ];
    let cap = alive(&members, 50, 3);
    let p = plan(&input(fixed(4), members.clone(), cap));
    assert_eq!(p.retire, vec![(id(4), RetireReason::Surplus)]);
    let p = plan(&input(fixed(1), members.clone(), cap));
    assert_eq!(
        p.retire,
        vec![
            (id(4), RetireReason::Surplus),
            (id(3), RetireReason::Surplus),
            (id(1), RetireReason::Surplus),
            (id(5), RetireReason::Surplus),
        ]
    );
    assert_eq!(p.create, 0);
    let p = plan(&input(fixed(0), members.clone(), cap));
    assert_eq!(p.retire.len(), 5);
}

#[test]
fn creation_stops_at_the_cold_start_reserve() {
    // 8 places, 2 alive sessions, 1 VM starting, reserve 3: 2 places for the pool.
    let cap = Capacity {
        limit: 8,
        alive: 2,
        starting: 1,
        retiring: 0,
        reserve: 3,
    };
    let p = plan(&input(fixed(4), vec![], cap));
    assert_eq!((p.create, p.deferred), (2, 2), "{}", p.why);
    // A three-node lesson: a member needs 3 places beyond the reserve; 2 are not enough.
    let mut i = input(fixed(4), vec![], cap);
    i.member_nodes = nodes(3);
    let p = plan(&i);
    assert_eq!((p.create, p.deferred), (0, 4));
    // With 6 places beyond the reserve, two three-node members fit.
    i.capacity.limit = 12;
    assert_eq!(plan(&i).create, 2);
}

#[test]
fn short_capacity_shrinks_the_pool_first_until_the_reserve_is_restored() {
    // Limit 8, reserve 3; 3 members alive plus 4 student VMs: 1 free, 2 short.
    let members = vec![ready(1, 60), ready(2, 30), preparing(3, 1)];
    let cap = Capacity {
        limit: 8,
        alive: 7,
        starting: 0,
        retiring: 0,
        reserve: 3,
    };
    let p = plan(&input(fixed(3), members.clone(), cap));
    assert_eq!(
        p.retire,
        vec![
            (id(3), RetireReason::CapacityShort),
            (id(1), RetireReason::CapacityShort),
        ]
    );
    assert_eq!((p.create, p.deferred), (0, 2));
    assert!(
        p.why.contains("2 retired to restore the reserve"),
        "{}",
        p.why
    );
    // Places already being freed count: one VM on its way out leaves one more to retire.
    let p = plan(&input(
        fixed(3),
        members.clone(),
        Capacity { retiring: 1, ..cap },
    ));
    assert_eq!(p.retire, vec![(id(3), RetireReason::CapacityShort)]);
    // A too-old member's places count as freed too.
    let members = vec![ready(1, 300), ready(2, 30), preparing(3, 1)];
    let p = plan(&input(fixed(3), members.clone(), cap));
    assert_eq!(
        p.retire,
        vec![
            (id(1), RetireReason::TooOld),
            (id(3), RetireReason::CapacityShort),
        ]
    );
    // With no member left to retire, the plan stays short and creates nothing.
    let cap = Capacity {
        limit: 8,
        alive: 8,
        starting: 0,
        retiring: 0,
        reserve: 3,
    };
    let p = plan(&input(fixed(3), vec![], cap));
    assert!(p.retire.is_empty());
    assert_eq!((p.create, p.deferred), (0, 3));
}

#[test]
fn a_paused_pool_keeps_its_members_and_creates_nothing() {
    let members = vec![ready(1, 60), ready(2, 30), preparing(3, 1)];
    let paused = fixed(1).with_paused(true);
    let p = plan(&input(paused, members.clone(), alive(&members, 50, 3)));
    assert!(p.retire.is_empty(), "no retirement for size while paused");
    assert_eq!((p.create, p.deferred), (0, 0));
    assert!(
        p.why
            .ends_with("keep 3; paused: nothing created, nothing retired for size (0 wanted)"),
        "{}",
        p.why
    );
    let p = plan(&input(fixed(5).with_paused(true), vec![], roomy()));
    assert_eq!((p.target, p.create), (5, 0));
    // Age, stuck and capacity rules still apply.
    let members = vec![ready(1, 300), preparing(2, 20), ready(3, 10)];
    let cap = Capacity {
        limit: 5,
        alive: 5,
        starting: 0,
        retiring: 0,
        reserve: 3,
    };
    let p = plan(&input(fixed(3).with_paused(true), members.clone(), cap));
    assert_eq!(
        p.retire,
        vec![
            (id(1), RetireReason::TooOld),
            (id(2), RetireReason::StuckPreparing),
            (id(3), RetireReason::CapacityShort),
        ]
    );
    assert_eq!(p.create, 0);
}

fn demand_pool(min: u32, size: u32, max: u32) -> PoolSettings {
    PoolSettings::new(min, size, max, TimeDelta::minutes(240))
        .unwrap()
        .with_demand(true)
}

fn with_demand(mut i: PlanInput, starts: Vec<DateTime<Utc>>, since: DateTime<Utc>) -> PlanInput {
    i.demand = Some(Demand {
        forecast: Forecast::default(),
        starts,
        recorded_since: since,
    });
    i
}

#[test]
fn yesterdays_nine_oclock_class_finds_members_ready_today() {
    // 30 students started yesterday from 9:00, one every 10 s; refill time 3 minutes.
    let starts: Vec<_> = (0..30)
        .map(|i| now() - DAY + TimeDelta::seconds(10 * i))
        .collect();
    let since = now() - TimeDelta::days(30);
    let settings = demand_pool(0, 4, 30);
    let at = |t: DateTime<Utc>| {
        let mut i = with_demand(input(settings, vec![], roomy()), starts.clone(), since);
        i.now = t;
        plan(&i)
    };
    // Evening before: nothing.
    assert_eq!(at(now() - TimeDelta::hours(12)).target, 0);
    // One refill time before 9:00 the first members are planned, so they are ready at 9:00.
    let early = at(now() - TimeDelta::minutes(3) + TimeDelta::seconds(1));
    assert_eq!(early.create, 1, "{}", early.why);
    let p = at(now() - TimeDelta::seconds(30));
    assert_eq!(p.target, 15, "{}", p.why);
    assert!(matches!(p.source, TargetSource::Demand(w) if w.kind == WindowKind::DayBefore));
    assert!(
        p.why.starts_with(
            "target 15 (demand-driven: 15 start(s) in the same time a day before, 15 expected \
             per refill time, within 0..=30)"
        ),
        "{}",
        p.why
    );
    // Bounded by max.
    let mut i = with_demand(
        input(demand_pool(0, 4, 8), vec![], roomy()),
        starts.clone(),
        since,
    );
    i.now = now();
    assert_eq!(plan(&i).target, 8);
}

#[test]
fn an_idle_evening_holds_the_minimum_and_retires_the_rest() {
    let members = vec![ready(1, 60), ready(2, 30)];
    let since = now() - TimeDelta::days(30);
    let i = with_demand(
        input(
            demand_pool(0, 4, 8),
            members.clone(),
            alive(&members, 50, 3),
        ),
        vec![now() - TimeDelta::hours(3)],
        since,
    );
    let p = plan(&i);
    assert_eq!((p.target, p.create), (0, 0));
    assert_eq!(
        p.retire,
        vec![
            (id(1), RetireReason::Surplus),
            (id(2), RetireReason::Surplus)
        ]
    );
    let i = with_demand(
        input(
            demand_pool(1, 4, 8),
            members.clone(),
            alive(&members, 50, 3),
        ),
        vec![],
        since,
    );
    let p = plan(&i);
    assert_eq!(p.target, 1);
    assert_eq!(p.retire, vec![(id(1), RetireReason::Surplus)]);
}

#[test]
fn recent_starts_keep_members_coming() {
    // 20 starts in the last 15 minutes, 3-minute refill: 4 expected per refill time, which
    // arriving at random need 7 members to find one ready 9 times in 10 (Erlang B).
    let starts = (0..20)
        .map(|i| now() - TimeDelta::seconds(10 + 40 * i))
        .collect();
    let i = with_demand(
        input(demand_pool(0, 1, 8), vec![], roomy()),
        starts,
        now() - DAY,
    );
    let p = plan(&i);
    assert_eq!((p.target, p.create), (7, 7), "{}", p.why);
    assert!(
        matches!(p.source, TargetSource::Demand(w) if w.kind == WindowKind::Recent && w.starts == 20 && w.expected == 4)
    );
    assert!(
        p.why
            .contains("4 expected per refill time, 7 members serve 90 % of random clicks"),
        "{}",
        p.why
    );
}

#[test]
fn a_new_deployments_first_students_grow_the_pool_before_a_whole_window_is_recorded() {
    // The history began 5 minutes ago (shorter than the 15-minute recent window) and holds 10
    // starts: 6 expected per refill time, which need 9 members, at most 8.
    let starts = (0..10)
        .map(|i| now() - TimeDelta::seconds(5 + 25 * i))
        .collect();
    let i = with_demand(
        input(demand_pool(0, 2, 8), vec![], roomy()),
        starts,
        now() - TimeDelta::minutes(5),
    );
    let p = plan(&i);
    assert_eq!((p.target, p.create), (8, 8), "{}", p.why);
    assert!(matches!(p.source, TargetSource::EarlyDemand(w) if w.starts == 10 && w.expected == 6));
    assert!(
        p.why.contains("10 start(s) in the history so far"),
        "{}",
        p.why
    );
    // Few starts so far never shrink the pool below its starting size.
    let i = with_demand(
        input(demand_pool(0, 4, 8), vec![], roomy()),
        vec![now() - TimeDelta::seconds(30)],
        now() - TimeDelta::minutes(5),
    );
    let p = plan(&i);
    assert_eq!(
        (p.target, p.source),
        (4, TargetSource::StartingPoint),
        "{}",
        p.why
    );
}

#[test]
fn without_history_a_demand_driven_pool_starts_at_its_size() {
    let i = input(demand_pool(0, 3, 8), vec![], roomy());
    let p = plan(&i);
    assert_eq!(
        (p.target, p.source, p.create),
        (3, TargetSource::StartingPoint, 3)
    );
    // History of five minutes covers no window: still the starting point, even with no starts.
    let i = with_demand(i, vec![], now() - TimeDelta::minutes(5));
    let p = plan(&i);
    assert_eq!((p.target, p.source), (3, TargetSource::StartingPoint));
    assert!(
        p.why
            .starts_with("target 3 (demand-driven, no start history yet: size)")
    );
}

#[test]
fn a_fixed_pool_ignores_demand() {
    let i = with_demand(input(fixed(2), vec![], roomy()), vec![], now() - DAY * 30);
    assert_eq!((plan(&i).target, plan(&i).source), (2, TargetSource::Fixed));
}

#[test]
fn the_plan_does_not_depend_on_the_order_of_members_and_counts_a_repeat_once() {
    let members = vec![
        ready(1, 100),
        ready(2, 100),
        preparing(3, 2),
        ready(4, 300),
        preparing(5, 2),
    ];
    let cap = alive(&members, 6, 3);
    let a = plan(&input(fixed(2), members.clone(), cap));
    let mut reversed = members.clone();
    reversed.reverse();
    reversed.push(members[0]);
    let b = plan(&input(fixed(2), reversed, cap));
    assert_eq!(a, b);
    assert!(a.why.contains("3 ready, 2 preparing"), "{}", a.why);
}

#[test]
fn reasons_have_stable_names() {
    let names: Vec<_> = [
        RetireReason::TooOld,
        RetireReason::StuckPreparing,
        RetireReason::Surplus,
        RetireReason::CapacityShort,
    ]
    .iter()
    .map(|r| r.as_str())
    .collect();
    assert_eq!(
        names,
        ["too_old", "stuck_preparing", "surplus", "capacity_short"]
    );
}
