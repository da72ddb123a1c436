//! Scheduled classes against a real throwaway PostgreSQL: the schema refuses impossible
//! classes and writes nothing; changes are conditional on what was read; cancelling keeps the
//! row; the claim gives a class's students its members first and never gives them to anyone
//! else before the class ends; counts, students and preparation times read what was seeded.

use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, Utc};
use ttlab_model::{ClassId, EnvName, LessonId, Runtime, SessionId, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{
    ClassChange, NewClass, NewPoolMember, NewSession, PoolClaim, Session, SessionTimes, Store,
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

fn new_class(title: &str, starts_at: DateTime<Utc>, minutes: i64, seats: u32) -> NewClass {
    NewClass {
        id: ClassId::new_random(),
        env: env("dev"),
        lesson: lesson("intro"),
        title: title.into(),
        seats,
        starts_at,
        ends_at: starts_at + Duration::minutes(minutes),
        join_code: Some("ALPHA-7".into()),
        by: user("teacher"),
    }
}

/// A ready member of `intro`'s pool in dev, made for `class`.
async fn member_for(store: &Store, class: Option<ClassId>) -> Session {
    let now = store.db_now().await.unwrap();
    let new = NewPoolMember {
        id: SessionId::new_random(),
        lesson: lesson("intro"),
        runtime: Runtime::Vm,
        env: env("dev"),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::hours(4),
            max_expires_at: now + Duration::hours(4),
        },
        readiness_deadline: now + Duration::seconds(150),
        class,
    };
    let member = store.sessions().insert_pool_member(&new).await.unwrap();
    assert_eq!(member.class, class);
    store
        .sessions()
        .mark_running(member.id, None)
        .await
        .unwrap()
        .unwrap()
}

fn claim(who: &str, class: Option<ClassId>) -> PoolClaim {
    PoolClaim {
        env: env("dev"),
        lesson: lesson("intro"),
        user: user(who),
        ttl: StdDuration::from_secs(3600),
        max: StdDuration::from_secs(3 * 3600),
        class,
        preparing_within: None,
    }
}

#[tokio::test]
async fn a_class_is_scheduled_listed_while_current_and_read_back() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let classes = store.classes();
    let now = store.db_now().await.unwrap();
    let later = classes
        .insert(&new_class("Intro 14:00", now + Duration::hours(4), 60, 30))
        .await
        .unwrap();
    let running = classes
        .insert(&NewClass {
            join_code: None,
            ..new_class("Intro now", now - Duration::minutes(10), 60, 12)
        })
        .await
        .unwrap();
    let over = classes
        .insert(&new_class(
            "Intro yesterday",
            now - Duration::hours(26),
            60,
            5,
        ))
        .await
        .unwrap();
    let prod = classes
        .insert(&NewClass {
            env: env("prod"),
            ..new_class("Intro prod", now + Duration::hours(1), 60, 5)
        })
        .await
        .unwrap();
    assert_eq!(
        (
            later.title.as_str(),
            later.seats,
            later.join_code.as_deref()
        ),
        ("Intro 14:00", 30, Some("ALPHA-7"))
    );
    assert_eq!(later.created_by, user("teacher"));
    assert_eq!(later.cancelled_at, None);
    assert_eq!(running.join_code, None);

    let current = classes.current(&env("dev"), now).await.unwrap();
    assert_eq!(
        current.iter().map(|c| c.id).collect::<Vec<_>>(),
        [running.id, later.id],
        "upcoming and running, by start; not over, not another environment's"
    );
    assert_eq!(
        classes.get(&env("dev"), over.id).await.unwrap().as_ref(),
        Some(&over)
    );
    assert_eq!(classes.get(&env("dev"), prod.id).await.unwrap(), None);
}

#[tokio::test]
async fn impossible_classes_are_refused_and_nothing_is_written() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let classes = store.classes();
    let now = store.db_now().await.unwrap();
    let start = now + Duration::hours(1);
    let cases = [
        (
            new_class("no seats", start, 60, 0),
            "a class has 1 to 500 seats",
        ),
        (
            new_class("too many", start, 60, 501),
            "a class has 1 to 500 seats",
        ),
        (
            new_class("backwards", start, -10, 5),
            "a class ends after it starts, at most 12 hours later",
        ),
        (
            new_class("empty", start, 0, 5),
            "a class ends after it starts, at most 12 hours later",
        ),
        (
            new_class("a day", start, 13 * 60, 5),
            "a class ends after it starts, at most 12 hours later",
        ),
        (
            new_class("", start, 60, 5),
            "a title has 1 to 100 characters, a join code 4 to 32",
        ),
        (
            NewClass {
                join_code: Some("AB".into()),
                ..new_class("short code", start, 60, 5)
            },
            "a title has 1 to 100 characters, a join code 4 to 32",
        ),
    ];
    for (class, rule) in cases {
        match classes.insert(&class).await {
            Err(StoreError::Refused { what, rule: got }) => {
                assert_eq!((what, got), ("a class", rule), "{}", class.title);
            }
            other => panic!("{:?} was not refused: {other:?}", class.title),
        }
    }
    assert!(classes.current(&env("dev"), now).await.unwrap().is_empty());
}

#[tokio::test]
async fn changes_apply_only_to_what_was_read_and_cancelling_keeps_the_row() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let classes = store.classes();
    let dev = env("dev");
    let now = store.db_now().await.unwrap();
    let class = classes
        .insert(&new_class("Intro 10:00", now + Duration::hours(2), 60, 30))
        .await
        .unwrap();
    let change = ClassChange {
        title: None,
        seats: Some(24),
        starts_at: None,
        ends_at: Some(class.ends_at + Duration::minutes(30)),
        join_code: Some(None),
        seen: class.updated_at,
        by: user("admin-2"),
    };
    let changed = classes
        .update(&dev, class.id, &change)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(changed.seats, 24);
    assert_eq!(changed.ends_at, class.ends_at + Duration::minutes(30));
    assert_eq!(changed.join_code, None, "Some(None) removes the code");
    assert_eq!(
        (changed.title.as_str(), changed.starts_at),
        ("Intro 10:00", class.starts_at)
    );
    assert_eq!(changed.updated_by, user("admin-2"));
    assert!(changed.updated_at > class.updated_at);

    // Decided against the old read: nothing is written.
    let stale = ClassChange {
        seats: Some(2),
        ..change.clone()
    };
    assert_eq!(classes.update(&dev, class.id, &stale).await.unwrap(), None);
    assert_eq!(
        classes.get(&dev, class.id).await.unwrap().unwrap().seats,
        24
    );
    // A change the schema forbids is refused and writes nothing.
    let bad = ClassChange {
        seats: Some(0),
        seen: changed.updated_at,
        ..change.clone()
    };
    assert!(matches!(
        classes.update(&dev, class.id, &bad).await,
        Err(StoreError::Refused { .. })
    ));
    assert_eq!(classes.get(&dev, class.id).await.unwrap().unwrap(), changed);

    let cancelled = classes
        .cancel(&dev, class.id, &user("admin-3"))
        .await
        .unwrap()
        .unwrap();
    assert!(cancelled.cancelled_at.is_some());
    assert_eq!(cancelled.cancelled_by, Some(user("admin-3")));
    assert_eq!(
        classes
            .cancel(&dev, class.id, &user("admin-3"))
            .await
            .unwrap(),
        None,
        "cancelled once"
    );
    let fresh = ClassChange {
        seen: cancelled.updated_at,
        ..change
    };
    assert_eq!(
        classes.update(&dev, class.id, &fresh).await.unwrap(),
        None,
        "a cancelled class does not change"
    );
    assert!(classes.current(&dev, now).await.unwrap().is_empty());
    assert!(classes.get(&dev, class.id).await.unwrap().is_some());
    // Another environment's class is not this one's to cancel.
    assert_eq!(
        classes
            .cancel(&env("prod"), class.id, &user("admin"))
            .await
            .unwrap(),
        None
    );
}

#[tokio::test]
async fn a_classs_students_claim_its_members_first_and_nobody_else_takes_them() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let classes = store.classes();
    let now = store.db_now().await.unwrap();
    // A class starting in three minutes (its members are being prepared).
    let class = classes
        .insert(&new_class("Intro", now + Duration::minutes(3), 60, 2))
        .await
        .unwrap();
    let other = classes
        .insert(&new_class("Other", now + Duration::minutes(3), 60, 2))
        .await
        .unwrap();
    // An ordinary member, ready longest, then two of the class.
    let ordinary = member_for(&store, None).await;
    let first = member_for(&store, Some(class.id)).await;
    let second = member_for(&store, Some(class.id)).await;
    let sessions = store.sessions();

    // A student of the class takes the class's member, though the ordinary one waited longer.
    let got = sessions
        .claim_pool_member(&claim("student-1", Some(class.id)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.id, first.id);
    assert_eq!(got.class, Some(class.id));
    // Someone outside the class takes the ordinary member, never the class's.
    let got = sessions
        .claim_pool_member(&claim("outsider-1", None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.id, ordinary.id);
    assert_eq!(got.class, None);
    for who in ["outsider-2", "outsider-3"] {
        assert_eq!(
            sessions.claim_pool_member(&claim(who, None)).await.unwrap(),
            None,
            "the class's last member is not drained by {who}"
        );
    }
    // Nor by a student of another class.
    assert_eq!(
        sessions
            .claim_pool_member(&claim("other-1", Some(other.id)))
            .await
            .unwrap(),
        None
    );
    // Cancelled, the class's members are ordinary members.
    classes
        .cancel(&env("dev"), class.id, &user("admin"))
        .await
        .unwrap()
        .unwrap();
    let got = sessions
        .claim_pool_member(&claim("outsider-2", None))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got.id, second.id);
    assert_eq!(got.class, None, "the claim records the claimer's class");

    // A class already over: its members are anyone's; a class's student with no member of
    // their class left takes an ordinary one.
    let over = classes
        .insert(&new_class("Earlier", now - Duration::hours(2), 60, 2))
        .await
        .unwrap();
    let left = member_for(&store, Some(over.id)).await;
    let got = sessions
        .claim_pool_member(&claim("other-1", Some(other.id)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((got.id, got.class), (left.id, Some(other.id)));
}

#[tokio::test]
async fn counts_and_students_read_each_classs_members_and_distinct_students() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let classes = store.classes();
    let now = store.db_now().await.unwrap();
    let class = classes
        .insert(&new_class("Intro", now + Duration::minutes(2), 60, 10))
        .await
        .unwrap();
    let empty = classes
        .insert(&new_class("Empty", now + Duration::hours(3), 60, 10))
        .await
        .unwrap();
    // Two ready members and one preparing for the class; one claimed by a student.
    member_for(&store, Some(class.id)).await;
    member_for(&store, Some(class.id)).await;
    let preparing = NewPoolMember {
        id: SessionId::new_random(),
        lesson: lesson("intro"),
        runtime: Runtime::Vm,
        env: env("dev"),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::hours(4),
            max_expires_at: now + Duration::hours(4),
        },
        readiness_deadline: now + Duration::seconds(150),
        class: Some(class.id),
    };
    store
        .sessions()
        .insert_pool_member(&preparing)
        .await
        .unwrap();
    store
        .sessions()
        .claim_pool_member(&claim("student-1", Some(class.id)))
        .await
        .unwrap()
        .unwrap();
    // A student who came the cold way is recorded once.
    let cold = store
        .sessions()
        .insert(&NewSession {
            id: SessionId::new_random(),
            user: user("student-2"),
            lesson: lesson("intro"),
            runtime: Runtime::Vm,
            env: env("dev"),
            site: "default".parse().unwrap(),
            times: SessionTimes {
                started_at: now,
                expires_at: now + Duration::minutes(60),
                max_expires_at: now + Duration::minutes(180),
            },
            readiness_deadline: now + Duration::seconds(150),
        })
        .await
        .unwrap();
    assert!(classes.record_student(cold.id, class.id).await.unwrap());
    assert!(
        !classes.record_student(cold.id, empty.id).await.unwrap(),
        "a session belongs to one class"
    );
    assert!(
        !classes
            .record_student(preparing.id, class.id)
            .await
            .unwrap(),
        "a member is nobody's session"
    );
    assert_eq!(
        store.sessions().get(cold.id).await.unwrap().unwrap().class,
        Some(class.id)
    );

    let counts = classes.counts(&[empty.id, class.id]).await.unwrap();
    assert_eq!(counts.len(), 2);
    assert_eq!(
        (
            counts[0].class,
            counts[0].ready,
            counts[0].preparing,
            counts[0].started
        ),
        (empty.id, 0, 0, 0)
    );
    assert_eq!(
        (
            counts[1].class,
            counts[1].ready,
            counts[1].preparing,
            counts[1].retiring,
            counts[1].started
        ),
        (class.id, 1, 1, 0, 2)
    );
}

#[tokio::test]
async fn preparation_times_are_the_recent_members_creation_to_ready() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    // Members of dev/intro that took 60, 90 and 120 s (ready a minute ago), one that took
    // 30 s eight days ago (too old to count), a cold session (not a member), another lesson's
    // and another environment's member.
    let seed = |who: Option<&'static str>,
                env_name: &'static str,
                lesson_name: &'static str,
                member: bool,
                took: f64,
                ready_ago: f64| {
        let client = &client;
        async move {
            client
                .execute(
                    "INSERT INTO sessions (id, user_id, lesson, runtime, env, status, \
                     started_at, expires_at, max_expires_at, readiness_deadline, created_at, \
                     ready_at, pool_member) VALUES ($1, $2, $3, 'vm', $4, 'running', now(), \
                     now() + interval '1 hour', now() + interval '2 hours', \
                     now() + interval '1 hour', \
                     now() - ($6::float8 + $5::float8) * interval '1 second', \
                     now() - $6::float8 * interval '1 second', $7)",
                    &[
                        &SessionId::new_random().as_uuid(),
                        &who,
                        &lesson_name,
                        &env_name,
                        &took,
                        &ready_ago,
                        &member,
                    ],
                )
                .await
                .unwrap();
        }
    };
    seed(None, "dev", "intro", true, 90.0, 60.0).await;
    seed(None, "dev", "intro", true, 60.0, 120.0).await;
    seed(None, "dev", "intro", true, 120.0, 30.0).await;
    seed(None, "dev", "intro", true, 30.0, 8.0 * 86_400.0).await;
    seed(Some("cold"), "dev", "intro", false, 45.0, 60.0).await;
    seed(None, "dev", "other", true, 45.0, 60.0).await;
    seed(None, "prod", "intro", true, 45.0, 60.0).await;
    let got = store
        .classes()
        .prepare_durations(&env("dev"), &lesson("intro"))
        .await
        .unwrap();
    let secs: Vec<u64> = got.iter().map(|d| d.as_secs_f64().round() as u64).collect();
    assert_eq!(secs, [120, 90, 60], "newest first");
    assert!(
        store
            .classes()
            .prepare_durations(&env("dev"), &lesson("never"))
            .await
            .unwrap()
            .is_empty()
    );
}
