//! The `console_tickets` table and the console-takeover channel against a real throwaway
//! PostgreSQL: a ticket issued through one store is taken once through another, never after
//! its expiry (database clock), and only its digest is stored.

use std::time::Duration;

use ttlab_model::{NodeName, Runtime, SessionId, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{
    Channel, ConsoleTaken, NewSession, SessionTimes, Store, StoreError, TicketDigest,
};

async fn session(store: &Store, user: &str) -> SessionId {
    let now = store.db_now().await.unwrap();
    let new = NewSession {
        id: SessionId::new_random(),
        user: UserId::new(user).unwrap(),
        lesson: "quick".parse().unwrap(),
        runtime: Runtime::Vm,
        env: "dev".parse().unwrap(),
        site: "default".parse().unwrap(),
        times: SessionTimes {
            started_at: now,
            expires_at: now + chrono::Duration::minutes(60),
            max_expires_at: now + chrono::Duration::minutes(180),
        },
        readiness_deadline: now + chrono::Duration::seconds(150),
    };
    store.sessions().insert(&new).await.unwrap().id
}

#[tokio::test]
async fn a_ticket_is_taken_once_on_any_replica_and_never_after_it_expired() {
    let db = TestDb::new().await.unwrap();
    let a = db.store().await.unwrap();
    let b = db.store().await.unwrap();
    let sid = session(&a, "alice").await;
    let alice = UserId::new("alice").unwrap();
    let node: NodeName = "two".parse().unwrap();

    let ticket = "f".repeat(64);
    let digest = TicketDigest::of(&ticket);
    let expires = a
        .console_tickets()
        .issue(&digest, &alice, sid, Some(&node), Duration::from_secs(30))
        .await
        .unwrap();
    let now = a.db_now().await.unwrap();
    assert!(
        expires > now + chrono::Duration::seconds(29),
        "{expires} vs {now}"
    );

    // Only the digest is stored.
    let (client, conn) = db
        .db_url()
        .config()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let dump: String = client
        .query_one(
            "SELECT string_agg(t::text, ' ') FROM console_tickets t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!dump.contains(&ticket), "{dump}");

    // Taken through another store (replica): once.
    let taken = b.console_tickets().take(&digest).await.unwrap().unwrap();
    assert_eq!(
        (taken.user, taken.session, taken.node, taken.expires_at),
        (alice.clone(), sid, Some(node), expires)
    );
    assert_eq!(a.console_tickets().take(&digest).await.unwrap(), None);
    assert_eq!(
        b.console_tickets()
            .take(&TicketDigest::of("guessed"))
            .await
            .unwrap(),
        None
    );

    // Expired: refused, then purged by the next issue.
    let short = TicketDigest::of("short");
    a.console_tickets()
        .issue(&short, &alice, sid, None, Duration::from_millis(200))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.console_tickets().take(&short).await.unwrap(), None);
    assert_eq!(a.console_tickets().count().await.unwrap(), 1);
    a.console_tickets()
        .issue(
            &TicketDigest::of("next"),
            &alice,
            sid,
            None,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    assert_eq!(
        a.console_tickets().count().await.unwrap(),
        1,
        "the expired one was purged"
    );

    // The same digest twice is a conflict, a zero lifetime is refused before any query.
    let err = a
        .console_tickets()
        .issue(
            &TicketDigest::of("next"),
            &alice,
            sid,
            None,
            Duration::from_secs(30),
        )
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err}");
    let err = a
        .console_tickets()
        .issue(&TicketDigest::of("zero"), &alice, sid, None, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)), "{err}");
}

#[tokio::test]
async fn a_console_takeover_reaches_every_listener() {
    let db = TestDb::new().await.unwrap();
    let a = db.store().await.unwrap();
    let b = db.store().await.unwrap();
    let mut on_a = a.listen(&[Channel::ConsoleTaken]).await.unwrap();
    let mut on_b = b.listen(&[Channel::ConsoleTaken]).await.unwrap();
    let taken = ConsoleTaken {
        session: SessionId::new_random(),
        node: "main".parse().unwrap(),
        connection: uuid::Uuid::new_v4(),
    };
    b.announce_console_taken(&taken).await.unwrap();
    for listener in [&mut on_a, &mut on_b] {
        let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(n.channel, Channel::ConsoleTaken);
        assert_eq!(ConsoleTaken::parse(&n.payload), Some(taken.clone()));
    }
}
