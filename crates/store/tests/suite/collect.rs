//! "Collect now" requests and reaper cycle reports against a real throwaway PostgreSQL.

use std::time::Duration;

use ttlab_model::{EnvName, UserId};
use ttlab_store::testing::TestDb;
use ttlab_store::{
    Channel, CycleError, CycleTrigger, Direction, DirectionCount, NewCycle, StoreError,
};

fn cycle(env: &EnvName, started_at: chrono::DateTime<chrono::Utc>) -> NewCycle {
    NewCycle {
        env: env.clone(),
        started_at,
        duration: Duration::from_millis(1234),
        trigger: CycleTrigger::Collect,
        dry_run: false,
        expired: DirectionCount { done: 2, failed: 1 },
        orphans: DirectionCount { done: 1, failed: 0 },
        ghosts: DirectionCount::default(),
        stuck: DirectionCount { done: 0, failed: 3 },
        errors: (0..30)
            .map(|i| CycleError {
                direction: Direction::Stuck,
                subject: format!("session {i}"),
                message: "delete VirtualMachine: 503".into(),
            })
            .collect(),
        collect_request: None,
    }
}

#[tokio::test]
async fn a_collect_request_is_answered_with_the_cycle_report() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let env: EnvName = "dev".parse().unwrap();
    let admin = UserId::new("admin@example.org").unwrap();

    // The reaper listens for requests.
    let mut reaper = store.listen(&[Channel::CollectRequested]).await.unwrap();
    let request = store
        .collect_requests()
        .request(&env, &admin)
        .await
        .unwrap();
    let n = reaper.recv().await.unwrap();
    assert_eq!(
        (n.channel, n.payload.as_str()),
        (Channel::CollectRequested, "dev")
    );
    let pending = store.collect_requests().pending(&env).await.unwrap();
    assert_eq!(
        pending.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![request.id]
    );
    assert_eq!(pending[0].requested_by, admin);

    // The admin waits while the reaper runs its cycle and records it.
    let waiter = tokio::spawn({
        let store = store.clone();
        async move {
            store
                .collect_requests()
                .wait_for_answer(request.id, Duration::from_secs(30))
                .await
        }
    });
    let now = store.db_now().await.unwrap();
    let mut new = cycle(&env, now);
    new.collect_request = Some(request.id);
    let recorded = store
        .reaper_cycles()
        .record(&new, &[request.id])
        .await
        .unwrap();
    let answer = waiter.await.unwrap().unwrap();
    assert_eq!(answer.id, recorded.id);
    assert_eq!(answer.cycle.expired, DirectionCount { done: 2, failed: 1 });
    assert_eq!(
        answer.cycle.errors.len(),
        ttlab_store::reaper_cycles::MAX_ERRORS_KEPT
    );
    assert_eq!(answer.cycle.collect_request, Some(request.id));
    assert_eq!(answer.cycle.duration, Duration::from_millis(1234));

    assert!(
        store
            .collect_requests()
            .pending(&env)
            .await
            .unwrap()
            .is_empty()
    );
    let answered = store
        .collect_requests()
        .get(request.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(answered.cycle, Some(recorded.id));
    assert!(answered.answered_at.is_some());

    // Waiting for an already answered request returns at once.
    let again = store
        .collect_requests()
        .wait_for_answer(request.id, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.id, recorded.id);
}

#[tokio::test]
async fn recent_cycles_are_newest_first_per_environment() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let dev: EnvName = "dev".parse().unwrap();
    let prod: EnvName = "prod".parse().unwrap();
    let now = store.db_now().await.unwrap();
    let mut ids = Vec::new();
    for i in 0..3 {
        let mut c = cycle(&dev, now + chrono::Duration::seconds(i));
        c.trigger = CycleTrigger::Timer;
        c.errors.clear();
        ids.push(store.reaper_cycles().record(&c, &[]).await.unwrap().id);
    }
    store
        .reaper_cycles()
        .record(&cycle(&prod, now), &[])
        .await
        .unwrap();
    let recent = store.reaper_cycles().recent(Some(&dev), 2).await.unwrap();
    assert_eq!(
        recent.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![ids[2], ids[1]]
    );
    assert!(
        recent
            .iter()
            .all(|c| c.cycle.env == dev && c.cycle.errors.is_empty())
    );
    assert_eq!(
        store.reaper_cycles().recent(None, 10).await.unwrap().len(),
        4
    );
    assert_eq!(
        store
            .reaper_cycles()
            .get(ids[0])
            .await
            .unwrap()
            .unwrap()
            .cycle
            .trigger,
        CycleTrigger::Timer
    );
}

#[tokio::test]
async fn an_unanswered_request_times_out() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let env: EnvName = "dev".parse().unwrap();
    let request = store
        .collect_requests()
        .request(&env, &UserId::new("admin").unwrap())
        .await
        .unwrap();
    let err = store
        .collect_requests()
        .wait_for_answer(request.id, Duration::from_millis(300))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Timeout { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "timed out after 0.3s waiting for the reaper to answer a collect request"
    );
}

#[tokio::test]
async fn a_cycle_records_the_site_it_ran_on() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let dev: EnvName = "dev".parse().unwrap();
    let now = store.db_now().await.unwrap();
    let site: ttlab_model::SiteName = "campus-b".parse().unwrap();
    let on_site = store
        .reaper_cycles()
        .record_on_site(&cycle(&dev, now), Some(&site), &[])
        .await
        .unwrap();
    assert_eq!(on_site.site.as_ref(), Some(&site));
    let without = store
        .reaper_cycles()
        .record(&cycle(&dev, now), &[])
        .await
        .unwrap();
    assert_eq!(without.site, None);
    let read = store
        .reaper_cycles()
        .get(on_site.id)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(read.site, Some(site));
}
