//! Warm pools against a real throwaway PostgreSQL: members are session rows held by no user,
//! claimed in one statement by concurrent replicas without ever sharing one; the claim keeps
//! the one-live-session rule; settings overrides are checked by the schema; counts, history
//! and recent starts read what was seeded.

use std::collections::BTreeSet;
use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, Utc};
use ttlab_model::{EnvName, LessonId, Runtime, SessionId, SessionStatus, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{
    CLAIM_MARGIN, NewPoolMember, NewSession, PoolClaim, PoolSettings, Session, SessionTimes, Store,
    StoreError,
};

fn env(name: &str) -> EnvName {
    name.parse().unwrap()
}

fn lesson(name: &str) -> LessonId {
    name.parse().unwrap()
}

fn user(name: &str) -> UserId {
    UserId::new(name).unwrap()
}

const TTL: StdDuration = StdDuration::from_secs(3600);
const MAX: StdDuration = StdDuration::from_secs(3 * 3600);

fn claim(env_name: &str, lesson_name: &str, who: &str) -> PoolClaim {
    PoolClaim {
        env: env(env_name),
        lesson: lesson(lesson_name),
        user: user(who),
        ttl: TTL,
        max: MAX,
        class: None,
        preparing_within: None,
    }
}

/// A member of `lesson_name`'s pool in `env_name` whose age limit is `age` from `now`.
fn new_member(
    env_name: &str,
    lesson_name: &str,
    now: DateTime<Utc>,
    age: Duration,
) -> NewPoolMember {
    NewPoolMember {
        id: SessionId::new_random(),
        lesson: lesson(lesson_name),
        runtime: Runtime::Vm,
        env: env(env_name),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + age,
            max_expires_at: now + age,
        },
        readiness_deadline: now + Duration::seconds(150),
        class: None,
    }
}

/// A member opened and made running (ready to be claimed).
async fn ready_member(store: &Store, env_name: &str, lesson_name: &str) -> Session {
    let now = store.db_now().await.unwrap();
    let member = store
        .sessions()
        .insert_pool_member(&new_member(env_name, lesson_name, now, Duration::hours(4)))
        .await
        .unwrap();
    assert_eq!(member.user, None);
    assert!(member.pool_member);
    store
        .sessions()
        .mark_running(member.id, None)
        .await
        .unwrap()
        .expect("a starting member becomes running")
}

fn new_session(who: &str, lesson_name: &str, now: DateTime<Utc>) -> NewSession {
    NewSession {
        id: SessionId::new_random(),
        user: user(who),
        lesson: lesson(lesson_name),
        runtime: Runtime::Vm,
        env: env("dev"),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::minutes(60),
            max_expires_at: now + Duration::minutes(180),
        },
        readiness_deadline: now + Duration::seconds(150),
    }
}

/// Fifty students click "Start lab" at once on two replicas (two stores, two connection pools)
/// against the pool of `lesson_name`: returns the sessions they got and how many missed.
async fn fifty_claims(a: &Store, b: &Store, lesson_name: &str) -> (Vec<Session>, usize) {
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let store = if i % 2 == 0 { a.clone() } else { b.clone() };
            let lesson_name = lesson_name.to_owned();
            tokio::spawn(async move {
                let c = claim("dev", &lesson_name, &format!("student-{lesson_name}-{i}"));
                (c.user.clone(), store.sessions().claim_pool_member(&c).await)
            })
        })
        .collect();
    let mut claimed = Vec::new();
    let mut misses = 0;
    for t in tasks {
        let (who, result) = t.await.unwrap();
        match result.unwrap() {
            Some(s) => {
                assert_eq!(
                    s.user.as_ref(),
                    Some(&who),
                    "the member goes to its claimer"
                );
                claimed.push(s);
            }
            None => misses += 1,
        }
    }
    (claimed, misses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_claims_from_two_replicas_never_share_a_member() {
    let db = TestDb::new().await.unwrap();
    let a = db.store().await.unwrap();
    let b = db.store().await.unwrap();
    for (lesson_name, n) in [("small-pool", 20_usize), ("large-pool", 60)] {
        let mut members = BTreeSet::new();
        for _ in 0..n {
            members.insert(ready_member(&a, "dev", lesson_name).await.id);
        }
        let (claimed, misses) = fifty_claims(&a, &b, lesson_name).await;
        let ids: BTreeSet<SessionId> = claimed.iter().map(|s| s.id).collect();
        assert_eq!(ids.len(), claimed.len(), "no member is claimed twice");
        assert!(
            ids.is_subset(&members),
            "only members of this pool are claimed"
        );
        assert_eq!(
            claimed.len(),
            n.min(50),
            "{lesson_name}: every claim that can succeed does"
        );
        assert_eq!(misses, 50 - n.min(50), "{lesson_name}: the rest are misses");
        let counts = a
            .pools()
            .counts(&env("dev"), &lesson(lesson_name))
            .await
            .unwrap();
        assert_eq!(
            counts.ready,
            (n - n.min(50)) as u64,
            "unclaimed members stay ready"
        );
        assert_eq!(counts.claims_24h, n.min(50) as u64);
        assert_eq!(counts.misses_24h, (50 - n.min(50)) as u64);
        // Each claimed row is that user's one live session.
        for s in &claimed {
            let who = s.user.as_ref().unwrap();
            assert_eq!(
                a.sessions().live_for_user(who).await.unwrap().map(|l| l.id),
                Some(s.id)
            );
        }
    }
}

#[tokio::test]
async fn a_user_with_a_live_session_cannot_claim_and_the_member_stays_in_the_pool() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let open = store
        .sessions()
        .insert(&new_session("alice", "other-lesson", now))
        .await
        .unwrap();
    let member = ready_member(&store, "dev", "pooled").await;

    let err = store
        .sessions()
        .claim_pool_member(&claim("dev", "pooled", "alice"))
        .await
        .unwrap_err();
    match &err {
        StoreError::SessionExists {
            user: who,
            lesson: l,
            session,
            status,
        } => {
            assert_eq!(who.as_str(), "alice");
            assert_eq!(l.as_str(), "other-lesson");
            assert_eq!(*session, open.id);
            assert_eq!(*status, SessionStatus::Starting);
        }
        other => panic!("expected SessionExists, got {other}"),
    }
    // The same error as a second "Start lab" the cold way.
    let cold = store
        .sessions()
        .insert(&new_session("alice", "pooled", now))
        .await
        .unwrap_err();
    assert_eq!(cold.to_string(), err.to_string());

    let unchanged = store.sessions().get(member.id).await.unwrap().unwrap();
    assert_eq!(
        unchanged, member,
        "the refused claim left the member untouched"
    );
    let counts = store
        .pools()
        .counts(&env("dev"), &lesson("pooled"))
        .await
        .unwrap();
    assert_eq!(
        (counts.ready, counts.claims_24h, counts.misses_24h),
        (1, 0, 0)
    );

    let got = store
        .sessions()
        .claim_pool_member(&claim("dev", "pooled", "bob"))
        .await
        .unwrap()
        .expect("the member is still claimable");
    assert_eq!(got.id, member.id);
}

#[tokio::test]
async fn a_claimed_member_is_a_normal_session_of_its_user() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let member = ready_member(&store, "dev", "pooled").await;
    let before = store.db_now().await.unwrap();
    let s = store
        .sessions()
        .claim_pool_member(&claim("dev", "pooled", "bob"))
        .await
        .unwrap()
        .unwrap();
    let after = store.db_now().await.unwrap();

    assert_eq!(s.id, member.id);
    assert_eq!(s.user, Some(user("bob")));
    assert_eq!(s.status, SessionStatus::Running);
    assert!(s.pool_member);
    assert_eq!(s.site, member.site, "a claimed member stays on its site");
    assert_eq!(s.site.as_str(), "default");
    let claimed_at = s.claimed_at.expect("claimed_at is set");
    assert!(before <= claimed_at && claimed_at <= after);
    assert_eq!(s.started_at, claimed_at, "the lifespan starts at the claim");
    assert_eq!(s.expires_at, claimed_at + Duration::hours(1));
    assert_eq!(s.max_expires_at, claimed_at + Duration::hours(3));
    assert_eq!(s.extensions_used, 0);
    assert_eq!(
        s.ready_at, member.ready_at,
        "its provisioning history is kept"
    );

    assert_eq!(
        store.sessions().live_for_user(&user("bob")).await.unwrap(),
        Some(s.clone())
    );
    // One live session per user still holds: bob cannot open another, either way.
    let now = store.db_now().await.unwrap();
    match store.sessions().insert(&new_session("bob", "x", now)).await {
        Err(StoreError::SessionExists { session, .. }) => assert_eq!(session, s.id),
        other => panic!("expected SessionExists, got {other:?}"),
    }
    let _spare = ready_member(&store, "dev", "pooled").await;
    match store
        .sessions()
        .claim_pool_member(&claim("dev", "pooled", "bob"))
        .await
    {
        Err(StoreError::SessionExists { session, .. }) => assert_eq!(session, s.id),
        other => panic!("expected SessionExists, got {other:?}"),
    }
    // It extends like any session.
    let extended = store
        .sessions()
        .extend(s.id, 0, s.expires_at + Duration::minutes(30))
        .await
        .unwrap()
        .expect("a claimed member can be extended");
    assert_eq!(extended.extensions_used, 1);
    // The reaper sees its new expiry, not the member's age limit.
    assert!(
        store
            .sessions()
            .list_expired(&env("dev"), s.expires_at - Duration::seconds(1), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn unclaimed_members_are_invisible_to_user_queries_and_visible_to_the_reaper() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let sessions = store.sessions();
    let now = store.db_now().await.unwrap();
    let starting = sessions
        .insert_pool_member(&new_member("dev", "pooled", now, Duration::hours(4)))
        .await
        .unwrap();
    let running = ready_member(&store, "dev", "pooled").await;
    // A member past its age limit, and one within the claim margin of it.
    let old = sessions
        .insert_pool_member(&new_member(
            "dev",
            "pooled",
            now - Duration::hours(5),
            Duration::hours(4),
        ))
        .await
        .unwrap();
    sessions.mark_running(old.id, None).await.unwrap().unwrap();
    let margin = Duration::from_std(CLAIM_MARGIN).unwrap();
    let closing = sessions
        .insert_pool_member(&new_member("dev", "pooled", now, margin / 2))
        .await
        .unwrap();
    sessions
        .mark_running(closing.id, None)
        .await
        .unwrap()
        .unwrap();
    let students = sessions
        .insert(&new_session("alice", "pooled", now))
        .await
        .unwrap();

    // The reaper's live listing and the capacity count include every member.
    let live: BTreeSet<SessionId> = sessions
        .list_live(&env("dev"), None, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    let all = BTreeSet::from([starting.id, running.id, old.id, closing.id, students.id]);
    assert_eq!(live, all);
    let capacity: BTreeSet<SessionId> = sessions
        .live_vm_sessions_all_envs()
        .await
        .unwrap()
        .into_iter()
        .map(|(id, _, _)| id)
        .collect();
    assert_eq!(capacity, all, "members count against the VM limit");
    assert_eq!(sessions.count_live(&env("dev")).await.unwrap(), 5);
    // The old member is due for the reaper like an expired session.
    let expired: Vec<SessionId> = sessions
        .list_expired(&env("dev"), store.db_now().await.unwrap(), 10)
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(expired, [old.id]);
    // No user query returns a member.
    assert_eq!(
        sessions
            .live_for_user(&user("alice"))
            .await
            .unwrap()
            .map(|s| s.id),
        Some(students.id)
    );
    assert_eq!(sessions.live_for_user(&user("nobody")).await.unwrap(), None);
    assert_eq!(sessions.get(running.id).await.unwrap().unwrap().user, None);

    // The old and the closing member are passed over; the ready one is claimed, then none.
    let first = sessions
        .claim_pool_member(&claim("dev", "pooled", "bob"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.id, running.id);
    assert_eq!(
        sessions
            .claim_pool_member(&claim("dev", "pooled", "carol"))
            .await
            .unwrap(),
        None,
        "a starting member, an old one and one about to age out are not claimable"
    );
    // Another environment's or lesson's pool is never claimed from.
    let _elsewhere = ready_member(&store, "prod", "pooled").await;
    let _other_lesson = ready_member(&store, "dev", "other").await;
    assert_eq!(
        sessions
            .claim_pool_member(&claim("dev", "pooled", "carol"))
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn pool_settings_are_saved_replaced_removed_and_checked_by_the_schema() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let pools = store.pools();
    let (dev, l) = (env("dev"), lesson("pooled"));
    assert_eq!(pools.get(&dev, &l).await.unwrap(), None);
    let settings = PoolSettings {
        size: 4,
        min: 1,
        max: 10,
        paused: false,
        max_age: StdDuration::from_secs(4 * 3600),
        demand_driven: true,
    };
    let saved = pools
        .upsert(&dev, &l, &settings, &user("admin-1"))
        .await
        .unwrap();
    assert_eq!(saved.settings, settings);
    assert_eq!(saved.updated_by, user("admin-1"));
    assert_eq!(pools.get(&dev, &l).await.unwrap(), Some(saved.clone()));

    let paused = PoolSettings {
        paused: true,
        size: 0,
        min: 0,
        ..settings
    };
    let replaced = pools
        .upsert(&dev, &l, &paused, &user("admin-2"))
        .await
        .unwrap();
    assert_eq!(replaced.settings, paused);
    assert_eq!(replaced.updated_by, user("admin-2"));
    assert!(replaced.updated_at >= saved.updated_at);
    pools
        .upsert(&dev, &lesson("another"), &settings, &user("admin-1"))
        .await
        .unwrap();
    pools
        .upsert(&env("prod"), &l, &settings, &user("admin-1"))
        .await
        .unwrap();
    let listed: Vec<String> = pools
        .list(&dev)
        .await
        .unwrap()
        .into_iter()
        .map(|p| p.lesson.to_string())
        .collect();
    assert_eq!(listed, ["another", "pooled"]);

    let sizes = "pool settings refused: a pool needs 0 <= min <= size <= max <= 200";
    let age = "pool settings refused: a pool member's age limit must be between 60 s and 7 days";
    for (bad, message) in [
        (PoolSettings { min: 5, ..settings }, sizes),
        (
            PoolSettings {
                size: 11,
                ..settings
            },
            sizes,
        ),
        (
            PoolSettings {
                max: 201,
                size: 201,
                ..settings
            },
            sizes,
        ),
        (
            PoolSettings {
                max: u32::MAX,
                ..settings
            },
            sizes,
        ),
        (
            PoolSettings {
                max_age: StdDuration::from_secs(59),
                ..settings
            },
            age,
        ),
        (
            PoolSettings {
                max_age: StdDuration::from_secs(8 * 24 * 3600),
                ..settings
            },
            age,
        ),
    ] {
        let err = pools
            .upsert(&dev, &l, &bad, &user("admin-3"))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Refused { .. }), "{bad:?}: {err}");
        assert_eq!(err.to_string(), message);
    }
    assert_eq!(
        pools.get(&dev, &l).await.unwrap(),
        Some(replaced),
        "a refused change leaves the settings as they were"
    );
    let widest = PoolSettings {
        size: 200,
        min: 200,
        max: 200,
        ..settings
    };
    pools
        .upsert(&dev, &l, &widest, &user("admin-3"))
        .await
        .unwrap();

    assert!(pools.delete(&dev, &l).await.unwrap());
    assert!(!pools.delete(&dev, &l).await.unwrap());
    assert_eq!(pools.get(&dev, &l).await.unwrap(), None);
    assert!(pools.get(&env("prod"), &l).await.unwrap().is_some());
}

/// A raw connection for seeding history at chosen instants.
async fn raw(db: &TestDb) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    client
}

/// A session row created `created_ago` seconds ago (ready `ready_ago` ago, claimed
/// `claimed_ago` ago, if given).
#[allow(clippy::too_many_arguments)]
async fn seed(
    client: &tokio_postgres::Client,
    who: Option<&str>,
    env_name: &str,
    lesson_name: &str,
    status: &str,
    pool_member: bool,
    created_ago: f64,
    ready_ago: Option<f64>,
    claimed_ago: Option<f64>,
) -> SessionId {
    let id = SessionId::new_random();
    client
        .execute(
            "INSERT INTO sessions (id, user_id, lesson, runtime, env, status, started_at, \
             expires_at, max_expires_at, readiness_deadline, created_at, ready_at, \
             pool_member, claimed_at) VALUES ($1, $2, $3, 'vm', $4, $5, \
             now() - $6::float8 * interval '1 second', now() + interval '1 hour', \
             now() + interval '2 hours', now() + interval '1 hour', \
             now() - $6::float8 * interval '1 second', \
             now() - $7::float8 * interval '1 second', $8, \
             now() - $9::float8 * interval '1 second')",
            &[
                &id.as_uuid(),
                &who,
                &lesson_name,
                &env_name,
                &status,
                &created_ago,
                &ready_ago,
                &pool_member,
                &claimed_ago,
            ],
        )
        .await
        .unwrap();
    id
}

async fn seed_event(client: &tokio_postgres::Client, lesson_name: &str, kind: &str, ago: f64) {
    client
        .execute(
            "INSERT INTO pool_events (env, lesson, kind, at) \
             VALUES ('dev', $1, $2, now() - $3::float8 * interval '1 second')",
            &[&lesson_name, &kind, &ago],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn counts_history_and_recent_starts_read_a_seeded_history() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let c = raw(&db).await;
    const H: f64 = 3600.0;
    const D: f64 = 24.0 * H;
    // Members of dev/pooled: two ready (refill 60 s and 120 s), one claimed (refill 180 s),
    // one preparing, one old and gone (refill 10 s, but more than a day ago).
    seed(
        &c,
        None,
        "dev",
        "pooled",
        "running",
        true,
        600.0,
        Some(540.0),
        None,
    )
    .await;
    seed(
        &c,
        None,
        "dev",
        "pooled",
        "running",
        true,
        800.0,
        Some(680.0),
        None,
    )
    .await;
    seed(
        &c,
        Some("carol"),
        "dev",
        "pooled",
        "running",
        true,
        1000.0,
        Some(820.0),
        Some(100.0),
    )
    .await;
    seed(
        &c, None, "dev", "pooled", "starting", true, 30.0, None, None,
    )
    .await;
    seed(
        &c,
        None,
        "dev",
        "pooled",
        "expired",
        true,
        31.0 * H,
        Some(31.0 * H - 10.0),
        None,
    )
    .await;
    // Not this pool: another lesson, another environment, a cold session.
    seed(
        &c,
        None,
        "dev",
        "other",
        "running",
        true,
        600.0,
        Some(590.0),
        None,
    )
    .await;
    seed(
        &c,
        None,
        "prod",
        "pooled",
        "running",
        true,
        600.0,
        Some(599.0),
        None,
    )
    .await;
    seed(
        &c,
        Some("dave"),
        "dev",
        "pooled",
        "running",
        false,
        300.0,
        Some(200.0),
        None,
    )
    .await;
    for ago in [60.0, 2.0 * H, 20.0 * H] {
        seed_event(&c, "pooled", "claim", ago).await;
    }
    seed_event(&c, "pooled", "claim", 25.0 * H).await;
    for ago in [30.0, 5.0 * H] {
        seed_event(&c, "pooled", "miss", ago).await;
    }
    seed_event(&c, "other", "miss", 30.0).await;
    seed_event(&c, "pooled", "miss", 9.0 * D).await;

    let counts = store
        .pools()
        .counts(&env("dev"), &lesson("pooled"))
        .await
        .unwrap();
    assert_eq!(counts.ready, 2);
    assert_eq!(counts.preparing, 1);
    assert_eq!(counts.claims_24h, 3);
    assert_eq!(counts.misses_24h, 2);
    assert_eq!(counts.hit_rate(), Some(0.6));
    assert_eq!(counts.median_refill, Some(StdDuration::from_secs(120)));
    let empty = store
        .pools()
        .counts(&env("dev"), &lesson("never-pooled"))
        .await
        .unwrap();
    assert_eq!(
        (empty.ready, empty.median_refill, empty.hit_rate()),
        (0, None, None)
    );

    // Recent starts, a one-hour window: cold sessions' creation and members' claims.
    for (who, ago) in [
        ("s1", 10.0 * 60.0),
        ("s2", D + 5.0 * 60.0),
        ("s3", D + 2.0 * H),
        ("s4", 7.0 * D + 30.0 * 60.0),
        ("s5", 7.0 * D + 59.0 * 60.0),
        ("s6", 3.0 * D),
    ] {
        seed(
            &c,
            Some(who),
            "dev",
            "pooled",
            "finished",
            false,
            ago,
            None,
            None,
        )
        .await;
    }
    seed(
        &c,
        Some("s7"),
        "prod",
        "pooled",
        "finished",
        false,
        60.0,
        None,
        None,
    )
    .await;
    let now = store.db_now().await.unwrap();
    let starts = store
        .pools()
        .recent_starts(
            &env("dev"),
            &lesson("pooled"),
            now,
            StdDuration::from_secs(3600),
        )
        .await
        .unwrap();
    let ago = |list: &[DateTime<Utc>]| -> Vec<i64> {
        list.iter().map(|t| (now - *t).num_seconds()).collect()
    };
    // dave's session (300 s), carol's claim (100 s), s1 (600 s); the unclaimed members'
    // creation is not a start.
    let recent = ago(&starts.recent);
    assert_eq!(recent.len(), 3, "{recent:?}");
    for (got, want) in recent.iter().zip([600, 300, 100]) {
        assert!((got - want).abs() <= 2, "{recent:?}");
    }
    assert_eq!(ago(&starts.day_before).len(), 1, "s2 only");
    assert_eq!(ago(&starts.week_before).len(), 2, "s4 and s5");
    // Any window, half-open.
    let pools = store.pools();
    let (dev, pooled) = (env("dev"), lesson("pooled"));
    let hour = pools
        .starts_between(&dev, &pooled, now - Duration::hours(1), now)
        .await
        .unwrap();
    assert_eq!(hour, starts.recent);
    let first_two = pools
        .starts_between(&dev, &pooled, starts.recent[0], starts.recent[2])
        .await
        .unwrap();
    assert_eq!(
        first_two,
        starts.recent[..2],
        "the end is outside, the start inside"
    );
    // The history goes back to s5, the oldest row of dev.
    let since = pools.history_since(&dev).await.unwrap().unwrap();
    assert!(((now - since).num_seconds() - (7 * 24 * 3600 + 59 * 60)).abs() <= 2);
    assert_eq!(pools.history_since(&env("empty")).await.unwrap(), None);
    // The pool's unclaimed live members, oldest first: not the claimed one, not the gone one.
    let members: Vec<(Option<UserId>, SessionStatus)> = pools
        .members(&dev, &pooled)
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.user, m.status))
        .collect();
    assert_eq!(
        members,
        [
            (None, SessionStatus::Running),
            (None, SessionStatus::Running),
            (None, SessionStatus::Starting)
        ]
    );

    assert_eq!(
        store.pools().prune_events().await.unwrap(),
        1,
        "the 9-day-old miss"
    );
    assert_eq!(store.pools().prune_events().await.unwrap(), 0);
}

#[tokio::test]
async fn a_member_being_prepared_is_claimed_only_when_none_is_ready_and_it_is_young_enough() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let sessions = store.sessions();
    let preparing = sessions
        .insert_pool_member(&new_member("dev", "intro", now, Duration::hours(4)))
        .await
        .unwrap();
    // Ready members only: a miss.
    assert!(
        sessions
            .claim_pool_member(&claim("dev", "intro", "ann"))
            .await
            .unwrap()
            .is_none()
    );
    // Younger than allowed? Not when nothing is young enough (it may be stuck).
    let mut ann = claim("dev", "intro", "ann");
    ann.preparing_within = Some(StdDuration::ZERO);
    assert!(sessions.claim_pool_member(&ann).await.unwrap().is_none());
    // A ready member goes first, even one made later.
    let ready = ready_member(&store, "dev", "intro").await;
    ann.preparing_within = Some(StdDuration::from_secs(3600));
    let got = sessions.claim_pool_member(&ann).await.unwrap().unwrap();
    assert_eq!(got.id, ready.id);
    // With none ready, the member being prepared: still starting, now the student's.
    let mut bea = claim("dev", "intro", "bea");
    bea.preparing_within = Some(StdDuration::from_secs(3600));
    let got = sessions.claim_pool_member(&bea).await.unwrap().unwrap();
    assert_eq!(got.id, preparing.id);
    assert_eq!(got.status, SessionStatus::Starting);
    assert_eq!(got.user, Some(user("bea")));
    // Its provisioner finds it claimed: marking it running unclaimed does nothing, and after
    // the hand-over it is marked running claimed.
    assert!(
        sessions
            .mark_member_running(preparing.id, false)
            .await
            .unwrap()
            .is_none()
    );
    let running = sessions
        .mark_member_running(preparing.id, true)
        .await
        .unwrap()
        .expect("claimed, starting");
    assert_eq!(running.status, SessionStatus::Running);
}
