//! Migrations and connection errors against a real throwaway PostgreSQL.

use ttlab_store::testing::TestDb;
use ttlab_store::{SCHEMA_VERSION, Store, StoreError, StoreOptions};

#[tokio::test]
async fn migrating_twice_applies_once() {
    let db = TestDb::new_empty().await.unwrap();
    let store = db.store().await.unwrap();
    let first = store.migrate().await.unwrap();
    assert_eq!(
        first.applied,
        [
            "V1__initial_schema",
            "V2__agent_tokens",
            "V3__console_tickets",
            "V4__live_sessions_by_id",
            "V5__leases",
            "V6__objects_gone",
            "V7__agent_versions",
            "V8__admin_actions",
            "V9__grading_results",
            "V10__waitlist",
            "V11__console_connections",
            "V12__warm_pools",
            "V13__classes",
            "V14__console_replica_gone",
            "V15__handover_failures",
            "V16__waitlist_front",
            "V17__session_site",
            "V18__reaper_cycle_site"
        ]
    );
    assert_eq!(first.version, SCHEMA_VERSION);
    let second = store.migrate().await.unwrap();
    assert!(second.applied.is_empty());
    // The schema is there: the store's queries work.
    let env = "dev".parse().unwrap();
    assert_eq!(store.sessions().count_live(&env).await.unwrap(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_migrations_take_turns() {
    let db = TestDb::new_empty().await.unwrap();
    let store = db.store().await.unwrap();
    let runs: Vec<_> = (0..8)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    let mut applied = 0;
    for r in runs {
        let report = r.await.unwrap().unwrap();
        applied += report.applied.len();
    }
    assert_eq!(
        applied,
        usize::try_from(SCHEMA_VERSION).unwrap(),
        "each migration is applied exactly once"
    );
}

#[tokio::test]
async fn an_unreachable_server_is_named_without_the_password() {
    let err = Store::connect(
        "postgres://ttlab:hunter2@127.0.0.1:1/ttlab",
        StoreOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, StoreError::Connect { .. }), "{err:?}");
    // An outage, not a refusal: a process waits for it.
    assert!(!err.is_rejection(), "{err:?}");
    assert_eq!(
        err.to_string(),
        "cannot connect to PostgreSQL at 127.0.0.1:1/ttlab: connection refused"
    );
    assert!(!format!("{err:?}").contains("hunter2"));
}

#[tokio::test]
async fn a_missing_database_is_named() {
    let db = TestDb::new_empty().await.unwrap();
    let url = db.url().replace(db.name(), "no_such_database");
    let err = Store::connect(&url, StoreOptions::default())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with("cannot connect to PostgreSQL at "),
        "{text}"
    );
    assert!(
        text.ends_with(":5432/no_such_database: database \"no_such_database\" does not exist"),
        "{text}"
    );
}

#[tokio::test]
async fn a_malformed_url_fails_before_any_connection() {
    let err = Store::connect(
        "postgres://ttlab:hunter2@127.0.0.1:notaport/ttlab",
        StoreOptions::default(),
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StoreError::InvalidUrl { .. }));
    assert!(
        text.contains("postgres://ttlab:***@127.0.0.1:notaport/ttlab"),
        "{text}"
    );
    assert!(text.contains("port"), "{text}");
    assert!(!text.contains("hunter2"));
}
