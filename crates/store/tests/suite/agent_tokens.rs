//! The `agent_tokens` table against a real throwaway PostgreSQL: stored while the session is
//! starting, readable by any store on the database, forgotten when the session is final.

use chrono::Duration;
use ttlab_model::{FinalStatus, NodeName, Runtime, SessionId, SessionStatus, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, SessionTimes};

fn node(name: &str) -> NodeName {
    name.parse().unwrap()
}

#[tokio::test]
async fn tokens_are_kept_while_live_and_forgotten_when_final() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let new = NewSession {
        id: SessionId::new_random(),
        user: UserId::new("alice").unwrap(),
        lesson: "quick".parse().unwrap(),
        runtime: Runtime::Vm,
        env: "dev".parse().unwrap(),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + Duration::minutes(60),
            max_expires_at: now + Duration::minutes(180),
        },
        readiness_deadline: now + Duration::seconds(150),
    };
    let s = store.sessions().insert(&new).await.unwrap();
    let (a, b) = ("a".repeat(64), "b".repeat(64));
    let tokens = store.agent_tokens();
    assert!(
        tokens
            .put(s.id, &[(node("one"), &a), (node("two"), &b)])
            .await
            .unwrap()
    );
    // A second store (another replica) reads them.
    let other = db.store().await.unwrap();
    assert_eq!(
        other.agent_tokens().get(s.id, &node("two")).await.unwrap(),
        Some(b.clone())
    );
    assert_eq!(
        other
            .agent_tokens()
            .get(s.id, &node("three"))
            .await
            .unwrap(),
        None
    );
    // A retry replaces the node's token.
    let c = "c".repeat(64);
    assert!(tokens.put(s.id, &[(node("one"), &c)]).await.unwrap());
    assert_eq!(tokens.get(s.id, &node("one")).await.unwrap(), Some(c));
    assert_eq!(tokens.count(s.id).await.unwrap(), 2);

    // Running: nothing new may be stored, the existing tokens stay.
    store
        .sessions()
        .mark_running(s.id, None)
        .await
        .unwrap()
        .unwrap();
    assert!(!tokens.put(s.id, &[(node("one"), &a)]).await.unwrap());
    assert_eq!(tokens.count(s.id).await.unwrap(), 2);
    // A rotation replaces one node's token of a live session; a node without one is not
    // given one.
    let d = "d".repeat(64);
    assert!(tokens.replace(s.id, &node("two"), &d).await.unwrap());
    assert_eq!(tokens.get(s.id, &node("two")).await.unwrap(), Some(d));
    assert!(!tokens.replace(s.id, &node("three"), &a).await.unwrap());
    assert_eq!(tokens.count(s.id).await.unwrap(), 2);
    // Finishing keeps them (the agents still run); final forgets them.
    store
        .sessions()
        .begin_finishing(s.id, &[SessionStatus::Running], FinalStatus::Finished, None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(tokens.count(s.id).await.unwrap(), 2);
    store
        .sessions()
        .complete_finishing(s.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(tokens.count(s.id).await.unwrap(), 0);
    assert_eq!(tokens.get(s.id, &node("one")).await.unwrap(), None);
    // A final session's token is never brought back.
    assert!(!tokens.replace(s.id, &node("one"), &a).await.unwrap());
    assert_eq!(tokens.count(s.id).await.unwrap(), 0);

    // An unknown session stores nothing.
    assert!(
        !tokens
            .put(SessionId::new_random(), &[(node("one"), &a)])
            .await
            .unwrap()
    );
}
