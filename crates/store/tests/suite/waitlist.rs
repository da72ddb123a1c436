//! The waitlist's line against a real throwaway PostgreSQL: a student put back at the front
//! (a start the namespace's quota refused at capacity) goes ahead of every normal joiner and
//! behind those put back before, in positions, reservations and grants alike; their entry
//! survives a grant while the session it replaces is still finishing.

use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, Utc};
use ttlab_model::{EnvName, FinalStatus, LessonId, Runtime, SessionId, SessionStatus, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, SessionTimes, Store};

fn env() -> EnvName {
    "dev".parse().unwrap()
}

fn lesson() -> LessonId {
    "intro".parse().unwrap()
}

fn user(name: &str) -> UserId {
    UserId::new(name).unwrap()
}

async fn setup() -> (TestDb, Store, DateTime<Utc>) {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    (db, store, now)
}

async fn join(store: &Store, name: &str) {
    store
        .waitlist()
        .join(&user(name), &lesson(), &env(), 1)
        .await
        .unwrap();
}

/// Who is in line, first first, with their positions.
async fn line(store: &Store) -> Vec<(String, u32)> {
    store
        .waitlist()
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.user.to_string(), e.position))
        .collect()
}

#[tokio::test]
async fn a_requeued_student_goes_ahead_of_joiners_and_behind_earlier_requeues() {
    let (_db, store, now) = setup().await;
    join(&store, "ann").await;
    join(&store, "bob").await;
    let back = store
        .waitlist()
        .requeue(&user("cat"), &lesson(), &env(), 1)
        .await
        .unwrap();
    assert_eq!(back.position, 1);
    assert!(back.front);
    store
        .waitlist()
        .requeue(&user("dan"), &lesson(), &env(), 1)
        .await
        .unwrap();
    join(&store, "eve").await;
    let order = |names: &[&str]| -> Vec<(String, u32)> {
        names
            .iter()
            .zip(1..)
            .map(|(n, p)| (n.to_string(), p))
            .collect()
    };
    assert_eq!(
        line(&store).await,
        order(&["cat", "dan", "ann", "bob", "eve"])
    );
    let bob = store.waitlist().get(&user("bob")).await.unwrap().unwrap();
    assert_eq!(bob.position, 4);
    assert!(!bob.front);

    // Somebody already in line who is requeued moves to the front (behind cat and dan).
    store
        .waitlist()
        .requeue(&user("eve"), &lesson(), &env(), 1)
        .await
        .unwrap();
    assert_eq!(
        line(&store).await,
        order(&["cat", "dan", "eve", "ann", "bob"])
    );

    // A free place is theirs first: ann counts three waiting ahead of her, cat none.
    let ann = store
        .waitlist()
        .reservations(&user("ann"), now)
        .await
        .unwrap();
    assert_eq!(ann.waiting_ahead, 3);
    let cat = store
        .waitlist()
        .reservations(&user("cat"), now)
        .await
        .unwrap();
    assert_eq!(cat.waiting_ahead, 0);

    // And a grant of two places holds them for cat and dan.
    let report = store
        .waitlist()
        .grant(
            2,
            now,
            StdDuration::from_secs(60),
            StdDuration::from_secs(3600),
        )
        .await
        .unwrap();
    assert_eq!(report.granted, [user("cat"), user("dan")]);
}

#[tokio::test]
async fn a_requeued_entry_outlives_the_finishing_session_it_replaces() {
    let (_db, store, now) = setup().await;
    let session = |name: &str| NewSession {
        id: SessionId::new_random(),
        user: user(name),
        lesson: lesson(),
        runtime: Runtime::Vm,
        env: env(),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::minutes(60),
            max_expires_at: now + Duration::minutes(180),
        },
        readiness_deadline: now + Duration::seconds(150),
    };
    // fay's start was refused at capacity: her session is finishing while she is back in line.
    let fay = store.sessions().insert(&session("fay")).await.unwrap();
    store
        .sessions()
        .begin_finishing(
            fay.id,
            &[SessionStatus::Starting],
            FinalStatus::Finished,
            None,
        )
        .await
        .unwrap()
        .unwrap();
    store
        .waitlist()
        .requeue(&user("fay"), &lesson(), &env(), 1)
        .await
        .unwrap();
    // gus joined normally but has a starting session: his entry goes.
    join(&store, "gus").await;
    store.sessions().insert(&session("gus")).await.unwrap();
    let report = store
        .waitlist()
        .grant(
            0,
            now,
            StdDuration::from_secs(60),
            StdDuration::from_secs(3600),
        )
        .await
        .unwrap();
    assert_eq!(report.removed, 1);
    assert_eq!(line(&store).await, [("fay".to_owned(), 1)]);
}
