//! A throwaway cluster paused and resumed: the same URL serves the same data again, and
//! while paused connecting fails quickly with a connection error.

use std::time::{Duration, Instant};

use ttlab_store::ephemeral::PgCluster;
use ttlab_store::{Store, StoreError, StoreOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_cluster_resumes_at_the_same_url_with_its_data() {
    let mut cluster = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .unwrap();
    let url = cluster.create_database("kept").await.unwrap();
    let store = Store::connect(&url, StoreOptions::default()).await.unwrap();
    store.migrate().await.unwrap();
    let env = "dev".parse().unwrap();
    assert_eq!(store.sessions().count_live(&env).await.unwrap(), 0);

    tokio::task::block_in_place(|| cluster.pause()).unwrap();
    assert!(!cluster.is_running());
    let started = Instant::now();
    let err = store.ping().await.unwrap_err();
    assert!(
        matches!(err, StoreError::Connect { .. } | StoreError::Query { .. }),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );

    tokio::task::block_in_place(|| cluster.resume()).unwrap();
    assert!(cluster.is_running());
    assert_eq!(cluster.url("kept"), url);
    // The pool reconnects by itself; the schema is still there.
    let mut answered = false;
    for _ in 0..3 {
        if store.sessions().count_live(&env).await.is_ok() {
            answered = true;
            break;
        }
    }
    assert!(answered, "the store did not reconnect after the resume");
    tokio::task::block_in_place(|| cluster.stop()).unwrap();
}
