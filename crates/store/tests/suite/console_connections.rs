//! The `console_connections` table against a real throwaway PostgreSQL: an open is recorded
//! with its user and replica, a newer open of the same console replaces it (a takeover), the
//! late close of the replaced connection leaves the newer one open, and a close records when
//! and why.

use crate::common;
use ttlab_model::{NodeName, UserId};

use common::running;
use ttlab_store::ConsoleClosedWhy;
use ttlab_store::testing::TestDb;
use uuid::Uuid;

#[tokio::test]
async fn a_takeover_replaces_the_connection_and_a_stale_close_leaves_it_open() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "alice", now).await;
    let other = running(&store, "bob", now).await;
    let consoles = store.console_connections();
    let node: NodeName = "vm".parse().unwrap();
    let alice = UserId::new("alice").unwrap();

    assert!(consoles.for_session(s.id).await.unwrap().is_empty());

    let first = Uuid::new_v4();
    let opened = consoles
        .opened(s.id, &node, first, &alice, "server-a")
        .await
        .unwrap();
    assert_eq!(opened.connection, first);
    assert_eq!(opened.user, alice);
    assert_eq!(opened.replica, "server-a");
    assert_eq!(opened.closed_at, None);
    assert_eq!(
        consoles.for_session(s.id).await.unwrap(),
        std::slice::from_ref(&opened)
    );

    // Another tab, relayed by another replica, takes the console.
    let second = Uuid::new_v4();
    let taken = consoles
        .opened(s.id, &node, second, &alice, "server-b")
        .await
        .unwrap();
    assert!(taken.opened_at >= opened.opened_at);
    let rows = consoles.for_session(s.id).await.unwrap();
    assert_eq!(rows.len(), 1, "one row per console: {rows:?}");
    assert_eq!(rows[0].connection, second);
    assert_eq!(rows[0].replica, "server-b");

    // The replaced connection's relay ends afterwards: its close does not touch the newer one.
    assert!(
        !consoles
            .closed(s.id, &node, first, Some(ConsoleClosedWhy::TakenOver))
            .await
            .unwrap()
    );
    let rows = consoles.for_session(s.id).await.unwrap();
    assert_eq!(rows[0].connection, second);
    assert_eq!(rows[0].closed_at, None);
    assert_eq!(rows[0].closed_why, None);

    // Another session's console is its own.
    assert!(consoles.for_session(other.id).await.unwrap().is_empty());
}

#[tokio::test]
async fn a_close_records_when_and_why_once() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "carol", now).await;
    let consoles = store.console_connections();
    let carol = UserId::new("carol").unwrap();
    let (vm, worker): (NodeName, NodeName) =
        ("control".parse().unwrap(), "worker".parse().unwrap());

    let a = Uuid::new_v4();
    let b = Uuid::new_v4();
    consoles.opened(s.id, &vm, a, &carol, "r1").await.unwrap();
    consoles
        .opened(s.id, &worker, b, &carol, "r1")
        .await
        .unwrap();

    assert!(
        consoles
            .closed(s.id, &vm, a, Some(ConsoleClosedWhy::BrowserClosed))
            .await
            .unwrap()
    );
    // Closed once: a second close changes nothing.
    assert!(
        !consoles
            .closed(s.id, &vm, a, Some(ConsoleClosedWhy::Lost))
            .await
            .unwrap()
    );
    assert!(consoles.closed(s.id, &worker, b, None).await.unwrap());

    let rows = consoles.for_session(s.id).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].node, vm);
    let closed_at = rows[0].closed_at.expect("closed");
    assert!(closed_at >= rows[0].opened_at);
    assert_eq!(rows[0].closed_why, Some(ConsoleClosedWhy::BrowserClosed));
    assert_eq!(rows[1].node, worker);
    assert!(rows[1].closed_at.is_some());
    assert_eq!(rows[1].closed_why, None, "an unknown reason stays unknown");

    // Opening again after a close starts a fresh, open row.
    let c = Uuid::new_v4();
    consoles.opened(s.id, &vm, c, &carol, "r2").await.unwrap();
    let rows = consoles.for_session(s.id).await.unwrap();
    assert_eq!(rows[0].connection, c);
    assert_eq!(rows[0].closed_at, None);
    assert_eq!(rows[0].closed_why, None);

    // Every reason is stored and read back.
    for why in ConsoleClosedWhy::ALL {
        let id = Uuid::new_v4();
        consoles.opened(s.id, &vm, id, &carol, "r2").await.unwrap();
        assert!(consoles.closed(s.id, &vm, id, Some(why)).await.unwrap());
        let rows = consoles.for_session(s.id).await.unwrap();
        assert_eq!(rows[0].closed_why, Some(why));
        assert_eq!(why.as_str().parse::<ConsoleClosedWhy>().unwrap(), why);
    }
}

#[tokio::test]
async fn a_console_needs_a_replica_name() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "dave", now).await;
    let dave = UserId::new("dave").unwrap();
    let node: NodeName = "vm".parse().unwrap();
    let err = store
        .console_connections()
        .opened(s.id, &node, Uuid::new_v4(), &dave, "")
        .await
        .unwrap_err();
    assert!(err.to_string().contains("replica"), "{err}");
    assert!(
        store
            .console_connections()
            .for_session(s.id)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn an_open_row_no_longer_seen_is_closed_as_its_replica_gone() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "alice", now).await;
    let consoles = store.console_connections();
    let alice = UserId::new("alice").unwrap();
    let (vm, worker): (NodeName, NodeName) = ("vm".parse().unwrap(), "worker".parse().unwrap());
    let (alive, gone) = (Uuid::new_v4(), Uuid::new_v4());
    consoles
        .opened(s.id, &vm, alive, &alice, "alive")
        .await
        .unwrap();
    consoles
        .opened(s.id, &worker, gone, &alice, "gone")
        .await
        .unwrap();
    let pause = std::time::Duration::from_millis(300);
    tokio::time::sleep(pause).await;
    // The live replica marks its console seen; the other one no longer does.
    assert_eq!(consoles.seen(&[alive]).await.unwrap(), 1);
    assert_eq!(consoles.seen(&[]).await.unwrap(), 0);
    let closed = consoles.close_unseen(pause / 2).await.unwrap();
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(closed[0].connection, gone);
    assert_eq!(closed[0].closed_why, Some(ConsoleClosedWhy::ReplicaGone));
    assert!(closed[0].closed_at.is_some());
    let rows = consoles.for_session(s.id).await.unwrap();
    assert_eq!(rows[0].closed_at, None, "the seen one stays open: {rows:?}");
    assert_eq!(rows[1].closed_why, Some(ConsoleClosedWhy::ReplicaGone));
    // A closed row is not marked seen, nor closed again.
    assert_eq!(consoles.seen(&[gone]).await.unwrap(), 0);
    tokio::time::sleep(pause).await;
    assert_eq!(consoles.seen(&[alive]).await.unwrap(), 1);
    assert!(consoles.close_unseen(pause / 2).await.unwrap().is_empty());
}
