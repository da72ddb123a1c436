//! The `grading_results` table against a real throwaway PostgreSQL: each grading of a
//! session is kept, read back oldest first and bounded to the last few.

use crate::common;

use ttlab_store::StoreError;
use ttlab_store::testing::TestDb;

#[tokio::test]
async fn gradings_are_kept_in_order_and_the_last_ones_are_read() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let now = store.db_now().await.unwrap();
    let s = common::starting(&store, "alice", now).await;
    let g = store.grading_results();
    assert!(g.for_session(s.id, 10).await.unwrap().is_empty());
    g.record(s.id, 0, 2, &["a".into(), "b".into()])
        .await
        .unwrap();
    g.record(s.id, 1, 2, &["b".into()]).await.unwrap();
    g.record(s.id, 2, 2, &[]).await.unwrap();
    let all = g.for_session(s.id, 10).await.unwrap();
    assert_eq!(
        all.iter().map(|r| r.passed).collect::<Vec<_>>(),
        [0, 1, 2],
        "oldest first"
    );
    assert_eq!(all[0].failed, ["a", "b"]);
    let last = g.for_session(s.id, 2).await.unwrap();
    assert_eq!(last.iter().map(|r| r.passed).collect::<Vec<_>>(), [1, 2]);
    assert!(matches!(
        g.record(s.id, 3, 2, &[]).await,
        Err(StoreError::InvalidArgument(_))
    ));
}
