//! The `admin_actions` table against a real throwaway PostgreSQL: an operator's extension
//! moves the expiry and is recorded in one conditional statement, never past the maximum
//! lifetime and never on a stale read; ends are recorded; reasons are required.

use crate::common;
use chrono::Duration;
use ttlab_model::UserId;

use common::running;
use ttlab_store::testing::TestDb;
use ttlab_store::{AdminActionKind, StoreError};

#[tokio::test]
async fn an_extension_applies_once_is_recorded_and_never_passes_the_cap() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "alice", now).await;
    let admin = UserId::new("root-admin").unwrap();
    let actions = store.admin_actions();

    let later = s.expires_at + Duration::minutes(10);
    let a = actions
        .extend(s.id, &admin, s.expires_at, later, "  lost time  ")
        .await
        .unwrap()
        .expect("applied");
    assert_eq!(a.action, AdminActionKind::Extend);
    assert_eq!(a.added_seconds, Some(600));
    assert_eq!(a.reason, "lost time");
    assert_eq!(
        (a.expires_before, a.expires_after),
        (Some(s.expires_at), Some(later))
    );
    let row = store.sessions().get(s.id).await.unwrap().unwrap();
    assert_eq!(row.expires_at, later);
    assert_eq!(row.extensions_used, 0, "no student extension used");

    // The same request again is stale (the expiry moved): nothing applies, nothing recorded.
    let again = actions
        .extend(
            s.id,
            &admin,
            s.expires_at,
            later + Duration::minutes(1),
            "again",
        )
        .await
        .unwrap();
    assert_eq!(again, None);
    // Past the maximum lifetime: refused by the statement itself.
    let past = actions
        .extend(
            s.id,
            &admin,
            later,
            s.max_expires_at + Duration::seconds(1),
            "too far",
        )
        .await
        .unwrap();
    assert_eq!(past, None);
    assert_eq!(actions.for_session(s.id).await.unwrap().len(), 1);

    let end = actions
        .record_end(s.id, &admin, "end of class")
        .await
        .unwrap();
    assert_eq!(end.action, AdminActionKind::End);
    assert_eq!(end.added_seconds, None);
    let all = actions.for_session(s.id).await.unwrap();
    assert_eq!(
        all.iter().map(|a| a.action).collect::<Vec<_>>(),
        [AdminActionKind::Extend, AdminActionKind::End]
    );
    assert_eq!(
        actions.recent(1).await.unwrap()[0].id,
        end.id,
        "newest first"
    );
}

#[tokio::test]
async fn an_action_needs_a_reason_and_an_extension_must_add_time() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = running(&store, "bob", now).await;
    let admin = UserId::new("root-admin").unwrap();
    let actions = store.admin_actions();
    for reason in ["", "   ", &"x".repeat(501)] {
        assert!(matches!(
            actions.record_end(s.id, &admin, reason).await,
            Err(StoreError::InvalidArgument(_))
        ));
    }
    assert!(matches!(
        actions
            .extend(s.id, &admin, s.expires_at, s.expires_at, "nothing")
            .await,
        Err(StoreError::InvalidArgument(_))
    ));
    assert!(actions.for_session(s.id).await.unwrap().is_empty());
}
