//! Leases, bounded waits and half-open connections, against a real throwaway PostgreSQL (and a
//! `FaultProxy` between a store and the server where the network must go bad).

use std::time::{Duration, Instant};

use ttlab_store::testing::{ServerSocket, TestDb};
use ttlab_store::{LeaseHolder, LeaseKind, LeaseTtls, Store, StoreError, StoreOptions, Timeouts};
use ttlab_testkit::{FaultMode, FaultProxy, Upstream};

fn proxy_for(db: &TestDb) -> FaultProxy {
    let upstream = match db.server_socket() {
        ServerSocket::Unix(path) => Upstream::Unix(path),
        ServerSocket::Tcp(host, port) => {
            use std::net::ToSocketAddrs as _;
            Upstream::Tcp(
                (host.as_str(), port)
                    .to_socket_addrs()
                    .unwrap()
                    .next()
                    .unwrap(),
            )
        }
    };
    FaultProxy::start(upstream).unwrap()
}

/// Short bounds, as a test can afford to wait for them.
fn short(call: Duration, ttl: Duration) -> StoreOptions {
    StoreOptions {
        acquire_timeout: Duration::from_secs(5),
        timeouts: Timeouts {
            call,
            ..Timeouts::default()
        },
        leases: LeaseTtls {
            leader: ttl,
            provisioning: ttl,
        },
        ..StoreOptions::default()
    }
}

#[tokio::test]
async fn a_lease_is_taken_if_free_or_expired_renewed_and_released_only_by_its_holder() {
    let db = TestDb::new().await.unwrap();
    let store = db.store().await.unwrap();
    let leases = store.leases();
    let (a, b) = (LeaseHolder::fresh(), LeaseHolder::fresh());
    let kind = LeaseKind::ReaperLeader;
    let ttl = Duration::from_millis(800);

    let got = leases.acquire(kind, "dev", &a, ttl).await.unwrap();
    assert_eq!(got.as_ref().map(|l| l.holder.as_str()), Some(a.as_str()));
    // Another holder is refused while it runs, on this key only.
    assert!(
        leases
            .acquire(kind, "dev", &b, ttl)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        leases
            .acquire(kind, "prod", &b, ttl)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        leases
            .acquire(LeaseKind::Provisioning, "dev", &b, ttl)
            .await
            .unwrap()
            .is_some()
    );
    // Only the holder renews or releases.
    assert!(leases.renew(kind, "dev", &b, ttl).await.unwrap().is_none());
    assert!(!leases.release(kind, "dev", &b).await.unwrap());
    assert!(leases.renew(kind, "dev", &a, ttl).await.unwrap().is_some());
    assert_eq!(
        leases.current(kind, "dev").await.unwrap().map(|l| l.holder),
        Some(a.as_str().to_owned())
    );

    // Expired: anyone takes it, and the old holder can no longer renew.
    tokio::time::sleep(ttl + Duration::from_millis(300)).await;
    assert!(leases.current(kind, "dev").await.unwrap().is_none());
    assert!(
        leases
            .acquire(kind, "dev", &b, ttl)
            .await
            .unwrap()
            .is_some()
    );
    assert!(leases.renew(kind, "dev", &a, ttl).await.unwrap().is_none());
    assert!(leases.release(kind, "dev", &b).await.unwrap());
    assert!(leases.current(kind, "dev").await.unwrap().is_none());

    // Nonsense durations are refused before anything is sent.
    let err = leases
        .acquire(kind, "dev", &a, Duration::ZERO)
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidArgument(_)), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_held_lease_survives_on_its_heartbeat_and_is_taken_over_once_its_holder_is_blackholed() {
    let db = TestDb::new().await.unwrap();
    let proxy = proxy_for(&db);
    let ttl = Duration::from_secs(2);
    let behind_proxy = Store::connect(&db.url_at(proxy.addr()), short(Duration::from_secs(1), ttl))
        .await
        .unwrap();
    let other = db
        .store_with(short(Duration::from_secs(5), ttl))
        .await
        .unwrap();
    let env = "dev".parse().unwrap();

    let leader = behind_proxy.try_leader_lock(&env).await.unwrap().unwrap();
    // Renewed on its heartbeat: still held well past its first expiry.
    tokio::time::sleep(ttl * 2).await;
    leader.check().await.unwrap();
    assert!(other.try_leader_lock(&env).await.unwrap().is_none());

    // The leader's connections go half-open: it stops acting within the lease, and the
    // standby takes over soon after, though no socket was ever closed.
    proxy.set_mode(FaultMode::Blackhole);
    let cut = Instant::now();
    tokio::time::timeout(ttl * 3, leader.lost())
        .await
        .expect("the leader noticed it could not renew");
    assert!(leader.check().await.is_err());
    let noticed = cut.elapsed();
    let standby = loop {
        if let Some(l) = other.try_leader_lock(&env).await.unwrap() {
            break l;
        }
        assert!(
            cut.elapsed() < ttl * 3,
            "the standby could not take over within {:?}",
            ttl * 3
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let taken = cut.elapsed();
    // The old leader stopped acting before the standby started.
    assert!(noticed <= taken, "{noticed:?} vs {taken:?}");
    standby.check().await.unwrap();
    standby.release().await.unwrap();
    drop(leader);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_query_on_a_blackholed_connection_fails_within_the_call_timeout() {
    let db = TestDb::new().await.unwrap();
    let proxy = proxy_for(&db);
    let store = Store::connect(
        &db.url_at(proxy.addr()),
        short(Duration::from_secs(2), Duration::from_secs(10)),
    )
    .await
    .unwrap();
    store.db_now().await.unwrap();
    proxy.set_mode(FaultMode::Blackhole);
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(30), store.db_now())
        .await
        .expect("bounded by the call timeout, not the kernel's")
        .unwrap_err();
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(1900), "{took:?}");
    assert!(took < Duration::from_secs(15), "{took:?}");
    // The connection was given up (the log says why: no answer within 2.0 s); the caller sees
    // a statement without an answer, which the server maps to "database unavailable".
    assert!(err.sqlstate().is_none(), "{err:?}");
    let text = err.to_string();
    assert!(text.contains("closed"), "{text}");
    assert!(!text.contains('\n'), "{text}");

    // The network heals: new connections work again (the dead one is not reused).
    proxy.set_mode(FaultMode::Pass);
    let healed = Instant::now();
    loop {
        match store.db_now().await {
            Ok(_) => break,
            Err(e) => assert!(healed.elapsed() < Duration::from_secs(20), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_connection_is_never_timed_out_by_the_watchdog() {
    let db = TestDb::new().await.unwrap();
    let store = db
        .store_with(StoreOptions {
            max_connections: 1,
            ..short(Duration::from_millis(500), Duration::from_secs(10))
        })
        .await
        .unwrap();
    let mut listener = store
        .listen(&[ttlab_store::Channel::ConsoleTaken])
        .await
        .unwrap();
    store.db_now().await.unwrap();
    // Well past the call timeout with nothing asked: still usable, still listening.
    tokio::time::sleep(Duration::from_secs(2)).await;
    store.db_now().await.unwrap();
    let taken = ttlab_store::ConsoleTaken {
        session: ttlab_model::SessionId::new_random(),
        node: "main".parse().unwrap(),
        connection: uuid::Uuid::new_v4(),
    };
    store.announce_console_taken(&taken).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(10), listener.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n.payload, taken.payload());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_start_blocked_on_the_capacity_lock_gets_a_clear_retryable_error() {
    let db = TestDb::new().await.unwrap();
    let store = db
        .store_with(StoreOptions {
            timeouts: Timeouts {
                capacity_lock: Duration::from_millis(700),
                ..Timeouts::default()
            },
            ..StoreOptions::default()
        })
        .await
        .unwrap();
    let held = store.lock_capacity().await.unwrap();
    let started = Instant::now();
    let err = tokio::time::timeout(Duration::from_secs(20), store.lock_capacity())
        .await
        .expect("the wait is bounded")
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(650));
    assert!(matches!(err, StoreError::Busy { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains(
            "the capacity lock (another start is counting capacity) stayed busy for 0.7s; try again"
        ),
        "{text}"
    );
    // Once the holder lets go, the next start gets it at once.
    held.rollback().await.unwrap();
    let again = tokio::time::timeout(Duration::from_secs(5), store.lock_capacity())
        .await
        .unwrap()
        .unwrap();
    again.rollback().await.unwrap();
}

#[tokio::test]
async fn every_connection_runs_with_the_configured_timeouts_and_custom_plans() {
    let db = TestDb::new().await.unwrap();
    let store = db
        .store_with(StoreOptions {
            timeouts: Timeouts {
                statement: Duration::from_millis(1500),
                lock: Duration::from_millis(2500),
                idle_in_transaction: Duration::from_secs(45),
                ..Timeouts::default()
            },
            ..StoreOptions::default()
        })
        .await
        .unwrap();
    let settings = store.session_settings().await.unwrap();
    let get = |name: &str| {
        settings
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert_eq!(get("statement_timeout"), "1500ms");
    assert_eq!(get("lock_timeout"), "2500ms");
    assert_eq!(get("idle_in_transaction_session_timeout"), "45s");
    assert_eq!(get("plan_cache_mode"), "force_custom_plan");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_listener_on_a_blackholed_connection_says_so_instead_of_waiting_forever() {
    let db = TestDb::new().await.unwrap();
    let proxy = proxy_for(&db);
    let store = Store::connect(
        &db.url_at(proxy.addr()),
        short(Duration::from_secs(2), Duration::from_secs(10)),
    )
    .await
    .unwrap();
    let mut listener = store
        .listen(&[ttlab_store::Channel::SessionsChanged])
        .await
        .unwrap();
    proxy.set_mode(FaultMode::Blackhole);
    let cut = Instant::now();
    // It pings every second (half the call timeout) and gives up 2 s after an unanswered one.
    let err = tokio::time::timeout(Duration::from_secs(30), listener.recv())
        .await
        .expect("the listener notices its connection is dead")
        .unwrap_err();
    assert!(matches!(err, StoreError::ListenerClosed { .. }), "{err:?}");
    assert!(
        cut.elapsed() < Duration::from_secs(15),
        "{:?}",
        cut.elapsed()
    );
}

#[tokio::test]
async fn leases_are_renewed_while_every_pooled_connection_is_busy() {
    let db = TestDb::new().await.unwrap();
    let store = Store::connect(
        db.url(),
        StoreOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_millis(500),
            ..StoreOptions::default()
        },
    )
    .await
    .unwrap();
    // The only pooled connection is held (a start counting capacity, a slow statement).
    let busy = store.lock_capacity().await.unwrap();
    assert!(
        store.db_now().await.is_err(),
        "the pool is exhausted: another statement waits for a connection and gives up"
    );
    let (leases, holder) = (store.leases(), LeaseHolder::fresh());
    let ttl = Duration::from_secs(5);
    let started = Instant::now();
    let got = leases
        .acquire(LeaseKind::Provisioning, "s-1", &holder, ttl)
        .await
        .unwrap();
    assert!(got.is_some(), "the lease is free");
    let renewed = leases
        .renew(LeaseKind::Provisioning, "s-1", &holder, ttl)
        .await
        .unwrap();
    assert!(renewed.is_some(), "its holder renews it");
    assert!(
        leases
            .release(LeaseKind::Provisioning, "s-1", &holder)
            .await
            .unwrap()
    );
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "lease calls do not wait for the busy pool: {:?}",
        started.elapsed()
    );
    drop(busy);
    store.db_now().await.unwrap();
}
