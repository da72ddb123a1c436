//! Scheduled classes in the planner, rule by rule: the lead time, the lead-in, the share of
//! the headroom, the seats already started, the end of the window, and what stops creation.

use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, TimeZone, Utc};
use ttlab_model::{ClassId, SessionId};
use ttlab_pool::{
    Capacity, Class, ClassAsk, ClassPhase, DEFAULT_LEAD_TIME, LeadTime, LeadTimeSource, Member,
    PlanInput, PoolSettings, RetireReason, class_headroom, plan, share_headroom,
};

fn id(n: u8) -> SessionId {
    format!("00000000-0000-4000-8000-0000000000{n:02x}")
        .parse()
        .unwrap()
}

fn class_id(n: u8) -> ClassId {
    format!("00000000-0000-4000-9000-0000000000{n:02x}")
        .parse()
        .unwrap()
}

/// 10:00, the start of the class of most tests.
fn ten() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 2, 10, 0, 0).unwrap()
}

fn nodes(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap()
}

/// `Intro 10:00`: 10:00 to 11:00, `seats` seats, nobody started yet.
fn intro(seats: u32) -> Class {
    Class {
        id: class_id(1),
        title: "Intro 10:00".into(),
        starts_at: ten(),
        ends_at: ten() + TimeDelta::hours(1),
        seats,
        started: 0,
    }
}

/// A member of `class` created `minutes` before `now`, ready two minutes after its creation
/// (or preparing when `ready` is false).
fn member(n: u8, class: Option<ClassId>, now: DateTime<Utc>, minutes: i64, ready: bool) -> Member {
    let created_at = now - TimeDelta::minutes(minutes);
    Member {
        id: id(n),
        created_at,
        ready_at: ready.then_some(created_at + TimeDelta::minutes(2)),
        nodes: nodes(1),
        class,
    }
}

fn fixed(size: u32) -> PoolSettings {
    PoolSettings::new(0, size, size, TimeDelta::minutes(240)).unwrap()
}

fn capacity(limit: u32, alive: u32) -> Capacity {
    Capacity {
        limit,
        alive,
        starting: 0,
        retiring: 0,
        reserve: 3,
    }
}

fn input(now: DateTime<Utc>, settings: PoolSettings, classes: Vec<Class>) -> PlanInput {
    PlanInput {
        now,
        settings,
        member_nodes: nodes(1),
        members: vec![],
        capacity: capacity(50, 0),
        demand: None,
        stuck_after: TimeDelta::minutes(15),
        classes,
        lead_time: LeadTime::default(),
        sharing: None,
        waiting_elsewhere: 0,
    }
}

#[test]
fn the_lead_time_is_the_p90_of_measured_preparations_plus_a_margin_within_bounds() {
    let s = TimeDelta::seconds;
    // No history, or too little: 5 minutes.
    let none = LeadTime::from_prepare_times(&[]);
    assert_eq!(
        (none.value(), none.source()),
        (DEFAULT_LEAD_TIME, LeadTimeSource::Default)
    );
    assert_eq!(
        LeadTime::from_prepare_times(&[s(90), s(100)]).value(),
        DEFAULT_LEAD_TIME
    );
    assert_eq!(
        none.to_string(),
        "lead time 5 min (default: fewer than 3 preparations measured)"
    );
    // Twenty preparations of 100 s and two slow ones of 400 s: the 90th percentile (by nearest
    // rank, the 20th of 22) is 100 s; plus 30 s.
    let mut times = vec![s(100); 20];
    times.extend([s(400), s(400)]);
    let lead = LeadTime::from_prepare_times(&times);
    assert_eq!(lead.value(), s(130));
    assert_eq!(
        lead.source(),
        LeadTimeSource::Measured {
            samples: 22,
            percentile: s(100)
        }
    );
    assert_eq!(
        lead.to_string(),
        "lead time 2 min 10 s (p90 of 22 preparations 1 min 40 s, plus 30 s)"
    );
    // Three slow ones of 23: the 90th percentile (the 21st) is slow.
    times.push(s(400));
    assert_eq!(LeadTime::from_prepare_times(&times).value(), s(430));
    // Fast guests still get a minute; a preparation of an hour is waited for 30 minutes at most.
    assert_eq!(
        LeadTime::from_prepare_times(&[s(5), s(6), s(7)]).value(),
        s(60)
    );
    assert_eq!(
        LeadTime::from_prepare_times(&[s(3600); 5]).value(),
        TimeDelta::minutes(30)
    );
    // A negative duration (a clock step) is not a measurement.
    assert_eq!(
        LeadTime::from_prepare_times(&[s(-5), s(100), s(100)]).source(),
        LeadTimeSource::Default
    );
}

#[test]
fn a_class_moves_from_upcoming_through_lead_in_and_running_to_over() {
    let c = intro(10);
    let lead = LeadTime::default();
    let at = |t: DateTime<Utc>| c.phase(t, lead);
    assert_eq!(c.lead_in_at(lead), ten() - TimeDelta::minutes(5));
    assert_eq!(
        at(ten() - TimeDelta::minutes(5) - TimeDelta::seconds(1)),
        ClassPhase::Upcoming
    );
    assert_eq!(at(ten() - TimeDelta::minutes(5)), ClassPhase::LeadIn);
    assert_eq!(at(ten()), ClassPhase::Running);
    assert_eq!(at(ten() + TimeDelta::minutes(59)), ClassPhase::Running);
    assert_eq!(at(ten() + TimeDelta::hours(1)), ClassPhase::Over);
    assert!(ClassPhase::LeadIn.is_active() && ClassPhase::Running.is_active());
    assert!(!ClassPhase::Upcoming.is_active() && !ClassPhase::Over.is_active());
    let names: Vec<_> = [
        ClassPhase::Upcoming,
        ClassPhase::LeadIn,
        ClassPhase::Running,
        ClassPhase::Over,
    ]
    .iter()
    .map(|p| p.as_str())
    .collect();
    assert_eq!(names, ["upcoming", "lead_in", "running", "over"]);
}

#[test]
fn members_are_prepared_from_the_lead_in_so_they_are_ready_at_the_start() {
    // Before the lead-in: nothing for the class; the next class is named.
    let before = ten() - TimeDelta::minutes(5) - TimeDelta::seconds(1);
    let p = plan(&input(before, fixed(0), vec![intro(10)]));
    assert_eq!((p.target, p.create), (0, 0), "{}", p.why);
    assert!(p.classes.is_empty());
    assert!(
        p.why.ends_with(
            "; lead time 5 min (default: fewer than 3 preparations measured); next class \
             'Intro 10:00' 10 seats at 10:00, members from 09:55"
        ),
        "{}",
        p.why
    );
    // From the lead-in: every seat, made for the class.
    let p = plan(&input(
        ten() - TimeDelta::minutes(5),
        fixed(0),
        vec![intro(10)],
    ));
    assert_eq!((p.target, p.create, p.deferred), (10, 10, 0), "{}", p.why);
    assert_eq!(p.create_for, vec![(class_id(1), 10)]);
    assert_eq!(p.classes.len(), 1);
    assert_eq!(
        (p.classes[0].phase, p.classes[0].warm, p.classes[0].create),
        (ClassPhase::LeadIn, 10, 10)
    );
    assert!(
        p.why.contains(
            "; class 'Intro 10:00' 10 seats, 0 started (lead-in, starts 10:00): 10 warm \
             (headroom 47 VM(s)), keep 0, create 10; lead time 5 min"
        ),
        "{}",
        p.why
    );
    // A measured lead time moves the lead-in: 12 minutes of preparation start at 09:47:30.
    let mut i = input(ten() - TimeDelta::minutes(13), fixed(0), vec![intro(10)]);
    i.lead_time = LeadTime::from_prepare_times(&[TimeDelta::minutes(12); 5]);
    assert_eq!(plan(&i).create, 0);
    i.now = ten() - TimeDelta::minutes(12) - TimeDelta::seconds(30);
    assert_eq!(plan(&i).create, 10);
}

#[test]
fn the_pools_own_members_come_beside_the_classs() {
    // A fixed pool of 2 with one ordinary member ready: the class adds its 10.
    let now = ten() - TimeDelta::minutes(2);
    let mut i = input(now, fixed(2), vec![intro(10)]);
    i.members = vec![
        member(1, None, now, 30, true),
        member(2, Some(class_id(1)), now, 3, false),
    ];
    i.capacity = capacity(50, 2);
    let p = plan(&i);
    assert_eq!((p.target, p.create), (12, 10), "{}", p.why);
    assert_eq!(p.create_for, vec![(class_id(1), 9)]);
    assert!(p.retire.is_empty());
}

#[test]
fn a_class_never_takes_a_place_of_the_reserve() {
    // Limit 12, reserve 3: 9 places beyond it, so 9 of 30 seats can be warm.
    let mut i = input(ten() - TimeDelta::minutes(4), fixed(0), vec![intro(30)]);
    i.capacity = capacity(12, 0);
    let p = plan(&i);
    assert_eq!((p.create, p.deferred), (9, 0), "{}", p.why);
    assert_eq!(p.classes[0].warm, 9);
    assert!(
        p.why
            .contains("30 seats, 0 started (lead-in, starts 10:00): 9 warm (headroom 9 VM(s))"),
        "{}",
        p.why
    );
    // Three-node members: three of them fit.
    i.member_nodes = nodes(3);
    let p = plan(&i);
    assert_eq!((p.create, p.classes[0].warm), (3, 3), "{}", p.why);
}

#[test]
fn classes_at_the_same_time_share_the_headroom_by_seats() {
    // Intro (30 seats, this pool) and kubeadm (10 seats, another lesson's pool) at 10:00, with
    // 22 VM places beyond the reserve: 30:10, rounding's last place to the one with less per
    // seat.
    let kubeadm = ClassAsk {
        id: class_id(2),
        title: "kubeadm 10:00".into(),
        seats: 10,
        wanted: 10,
        nodes: nodes(1),
        held: 0,
    };
    let intro_ask = ClassAsk {
        id: class_id(1),
        title: "Intro 10:00".into(),
        seats: 30,
        wanted: 30,
        nodes: nodes(1),
        held: 0,
    };
    let sharing = share_headroom(22, &[kubeadm.clone(), intro_ask.clone()]);
    assert_eq!(sharing.share_of(class_id(1)).unwrap().warm, 16);
    assert_eq!(sharing.share_of(class_id(2)).unwrap().warm, 6);
    let mut i = input(ten() - TimeDelta::minutes(3), fixed(0), vec![intro(30)]);
    i.capacity = capacity(25, 0);
    i.sharing = Some(sharing);
    let p = plan(&i);
    assert_eq!((p.target, p.create), (16, 16), "{}", p.why);
    assert!(
        p.why.contains(
            "class 'Intro 10:00' 30 seats, 0 started (lead-in, starts 10:00): 16 warm \
             (headroom 22 VM(s) shared 30:10 with 'kubeadm 10:00' (6 warm)), keep 0, create 16"
        ),
        "{}",
        p.why
    );
    // A class that can use less than its part leaves the rest to the other: kubeadm's
    // students have all started but 2.
    let sharing = share_headroom(
        22,
        &[
            ClassAsk {
                wanted: 2,
                ..kubeadm.clone()
            },
            intro_ask.clone(),
        ],
    );
    assert_eq!(sharing.share_of(class_id(2)).unwrap().warm, 2);
    assert_eq!(sharing.share_of(class_id(1)).unwrap().warm, 20);
    // The same fraction of each class's seats, whatever the node count: 12 places, 10 seats
    // of three-node labs and 10 of one-node labs → three of each (9 VMs and 3 VMs).
    let sharing = share_headroom(
        12,
        &[
            ClassAsk {
                nodes: nodes(3),
                seats: 10,
                ..kubeadm
            },
            ClassAsk {
                seats: 10,
                ..intro_ask
            },
        ],
    );
    assert_eq!(sharing.share_of(class_id(2)).unwrap().warm, 3);
    assert_eq!(sharing.share_of(class_id(1)).unwrap().warm, 3);
    // The headroom is the free places beyond the reserve plus those classes' members hold.
    assert_eq!(class_headroom(10, 3, 4), 11);
    assert_eq!(class_headroom(2, 3, 4), 4);
}

#[test]
fn seats_whose_students_started_need_no_member() {
    let now = ten() + TimeDelta::minutes(3);
    let class = Class {
        started: 6,
        ..intro(10)
    };
    let mut i = input(now, fixed(0), vec![class.clone()]);
    i.members = vec![
        member(1, Some(class_id(1)), now, 8, true),
        member(2, Some(class_id(1)), now, 8, true),
    ];
    i.capacity = capacity(50, 2);
    let p = plan(&i);
    assert_eq!((p.target, p.create), (4, 2), "{}", p.why);
    assert!(
        p.why.contains("10 seats, 6 started (running until 11:00)"),
        "{}",
        p.why
    );
    // More members than seats left (students came the cold way): the extra one goes.
    i.classes = vec![Class {
        started: 9,
        ..class
    }];
    let p = plan(&i);
    assert_eq!(p.retire, vec![(id(1), RetireReason::Surplus)], "{}", p.why);
    assert_eq!((p.target, p.create), (1, 0));
}

#[test]
fn after_the_class_its_members_are_ordinary_and_the_surplus_goes() {
    let end = ten() + TimeDelta::hours(1);
    let mut i = input(end, fixed(1), vec![intro(10)]);
    i.members = vec![
        member(1, Some(class_id(1)), end, 70, true),
        member(2, Some(class_id(1)), end, 65, true),
        member(3, None, end, 64, true),
    ];
    i.capacity = capacity(50, 3);
    let p = plan(&i);
    assert!(p.classes.is_empty());
    assert_eq!(
        p.retire,
        vec![
            (id(1), RetireReason::Surplus),
            (id(2), RetireReason::Surplus)
        ],
        "{}",
        p.why
    );
    assert_eq!((p.target, p.create), (1, 0));
    // A cancelled class is not listed: the same.
    i.now = ten();
    i.classes = vec![];
    assert_eq!(plan(&i).retire.len(), 2);
}

#[test]
fn a_classs_members_beyond_its_share_go_only_when_another_class_needs_the_places() {
    let now = ten() - TimeDelta::minutes(1);
    let members: Vec<Member> = (1..=6)
        .map(|n| member(n, Some(class_id(1)), now, 4, true))
        .collect();
    let ask = |id: ClassId, title: &str, held: u32| ClassAsk {
        id,
        title: title.into(),
        seats: 10,
        wanted: 10,
        nodes: nodes(1),
        held,
    };
    // Six places, shared 10:10 with a class holding nothing: three go to it.
    let mut i = input(now, fixed(0), vec![intro(10)]);
    i.members = members.clone();
    i.capacity = capacity(9, 6);
    i.sharing = Some(share_headroom(
        6,
        &[
            ask(class_id(1), "Intro 10:00", 6),
            ask(class_id(2), "kubeadm 10:00", 0),
        ],
    ));
    let p = plan(&i);
    assert_eq!(p.retire.len(), 3, "{}", p.why);
    assert!(p.retire.iter().all(|(_, r)| *r == RetireReason::Surplus));
    assert_eq!((p.target, p.classes[0].kept), (3, 3));
    // The other class holds its share already: nothing goes (its places serve nobody better).
    i.sharing = Some(share_headroom(
        6,
        &[
            ask(class_id(1), "Intro 10:00", 6),
            ask(class_id(2), "kubeadm 10:00", 3),
        ],
    ));
    let p = plan(&i);
    assert!(p.retire.is_empty(), "{}", p.why);
    assert_eq!((p.target, p.classes[0].warm, p.classes[0].kept), (6, 3, 6));
}

#[test]
fn nothing_is_created_while_students_of_another_lesson_wait() {
    let mut i = input(ten() - TimeDelta::minutes(2), fixed(2), vec![intro(10)]);
    i.waiting_elsewhere = 2;
    let p = plan(&i);
    assert_eq!((p.create, p.deferred, p.target), (0, 12, 12), "{}", p.why);
    assert!(p.create_for.is_empty());
    assert!(
        p.why
            .contains("; 2 student(s) of other lessons waiting: nothing created (12 deferred)"),
        "{}",
        p.why
    );
}

#[test]
fn a_paused_pool_prepares_nothing_for_a_class_and_keeps_its_members() {
    let now = ten() + TimeDelta::minutes(1);
    let class = Class {
        started: 9,
        ..intro(10)
    };
    let mut i = input(now, fixed(0).with_paused(true), vec![class]);
    i.members = vec![
        member(1, Some(class_id(1)), now, 6, true),
        member(2, Some(class_id(1)), now, 6, true),
    ];
    i.capacity = capacity(50, 2);
    let p = plan(&i);
    assert_eq!((p.create, p.deferred), (0, 0));
    assert!(p.retire.is_empty(), "{}", p.why);
}

#[test]
fn short_capacity_gives_back_ordinary_members_before_a_classs() {
    let now = ten() - TimeDelta::minutes(1);
    let mut i = input(now, fixed(2), vec![intro(2)]);
    i.members = vec![
        member(1, Some(class_id(1)), now, 4, true),
        member(2, None, now, 30, true),
        member(3, Some(class_id(1)), now, 4, true),
        member(4, None, now, 20, true),
    ];
    // Limit 6, 4 alive plus 1 starting: 1 free, reserve 3 → two members must go.
    i.capacity = Capacity {
        starting: 1,
        ..capacity(6, 4)
    };
    let p = plan(&i);
    assert_eq!(
        p.retire,
        vec![
            (id(2), RetireReason::CapacityShort),
            (id(4), RetireReason::CapacityShort)
        ],
        "{}",
        p.why
    );
    assert_eq!(p.classes[0].kept, 2);
}

#[test]
fn the_plan_does_not_depend_on_the_order_of_classes() {
    let other = Class {
        id: class_id(2),
        title: "Intro 10:30".into(),
        starts_at: ten() + TimeDelta::minutes(30),
        ends_at: ten() + TimeDelta::minutes(90),
        seats: 5,
        started: 0,
    };
    let now = ten() + TimeDelta::minutes(27);
    let mut a = input(now, fixed(1), vec![intro(8), other.clone()]);
    a.capacity = capacity(12, 0);
    let mut b = a.clone();
    b.classes = vec![other, intro(8)];
    let (pa, pb) = (plan(&a), plan(&b));
    assert_eq!(pa, pb);
    // 9 places shared 8:5: the class that started first is created first.
    assert_eq!(
        pa.classes.iter().map(|c| c.warm).sum::<u32>(),
        9,
        "{}",
        pa.why
    );
    assert_eq!(pa.create_for[0].0, class_id(1));
    assert_eq!(pa.create, 9);
    assert_eq!(pa.deferred, 1, "{}", pa.why);
}

#[test]
fn a_lead_time_that_shrank_keeps_the_members_already_made_and_makes_no_more() {
    // Made during a 5-minute lead-in; the lesson's preparations were then measured at a
    // minute: at 09:57 the class is upcoming again, and its members stay its own.
    let now = ten() - TimeDelta::minutes(3);
    let mut i = input(now, fixed(1), vec![intro(4)]);
    i.lead_time = LeadTime::from_prepare_times(&[TimeDelta::seconds(10); 5]);
    i.members = vec![
        member(1, None, now, 30, true),
        member(2, Some(class_id(1)), now, 2, true),
        member(3, Some(class_id(1)), now, 2, true),
    ];
    i.capacity = capacity(50, 3);
    let p = plan(&i);
    assert!(p.retire.is_empty(), "{}", p.why);
    assert_eq!((p.create, p.target), (0, 3), "{}", p.why);
    assert_eq!(
        (p.classes[0].phase, p.classes[0].kept, p.classes[0].warm),
        (ClassPhase::Upcoming, 2, 0)
    );
    assert!(
        p.why.contains(
            "class 'Intro 10:00' 4 seats, 0 started (upcoming, lead-in at 09:59: its members are \
             kept, none created): 0 warm"
        ),
        "{}",
        p.why
    );
    // From its lead-in, the rest are made.
    i.now = ten() - TimeDelta::minutes(1);
    let p = plan(&i);
    assert_eq!(p.create_for, vec![(class_id(1), 2)], "{}", p.why);
}
