//! Sessions for the store's table tests: a VM session of lesson `quick` in `dev`, 60 minutes
//! (at most 90) from `now`.

#![allow(dead_code)] // each test binary uses what it needs

use chrono::{DateTime, Duration, Utc};
use ttlab_model::{Runtime, SessionId, UserId};
use ttlab_store::{NewSession, Session, SessionTimes, Store};

/// A new `starting` session of `user`.
pub async fn starting(store: &Store, user: &str, now: DateTime<Utc>) -> Session {
    let new = NewSession {
        id: SessionId::new_random(),
        user: UserId::new(user).unwrap(),
        lesson: "quick".parse().unwrap(),
        runtime: Runtime::Vm,
        env: "dev".parse().unwrap(),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::minutes(60),
            max_expires_at: now + Duration::minutes(90),
        },
        readiness_deadline: now + Duration::seconds(150),
    };
    store.sessions().insert(&new).await.unwrap()
}

/// A new session of `user`, marked running.
pub async fn running(store: &Store, user: &str, now: DateTime<Utc>) -> Session {
    let row = starting(store, user, now).await;
    store
        .sessions()
        .mark_running(row.id, None)
        .await
        .unwrap()
        .unwrap()
}
