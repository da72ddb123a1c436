//! The scheduler ([`ttlab_reaper::run`]) against a real PostgreSQL and kube-sim: a deadline is
//! acted on when it comes due, even while a sweep of the cluster is still under way.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::TimeDelta;
use common::Harness;
use ttlab_cluster::ReaperCluster as _;
use ttlab_kube_sim::{FaultAction, FaultRule, Verb};
use ttlab_model::SessionStatus;
use ttlab_reaper::Metrics;

/// A running `dev` session with its VM, expiring in `millis`.
async fn running_vm(h: &Harness, millis: i64) -> ttlab_store::Session {
    let session = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::milliseconds(millis),
            &["vm"],
        )
        .await;
    h.create_vms("dev", session.id, &["vm"], true).await;
    session
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_is_reclaimed_on_time_while_a_slow_sweep_is_still_listing() {
    let h = Harness::start().await;
    let session = running_vm(&h, 2500).await;
    let opened = Instant::now();
    // Listing VMs takes 8 s: the first sweep (at start) is still listing when the session
    // expires.
    h.sim().faults().add(FaultRule {
        action: FaultAction::Delay { millis: 8000 },
        ..FaultRule::fail(Some(Verb::List), Some("virtualmachines"), 500)
    });
    let ctx = h.ctx("dev");
    let reaper = tokio::spawn(ttlab_reaper::run(
        ctx.clone(),
        Duration::from_secs(60),
        Arc::new(Metrics::new()),
    ));
    while h.status(session.id).await != SessionStatus::Expired {
        assert!(
            opened.elapsed() < Duration::from_secs(6),
            "not reclaimed within 6 s of opening (expiry at 2.5 s; the sweep lists for 8 s)"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        opened.elapsed() >= Duration::from_millis(2400),
        "reclaimed before its expiry"
    );
    assert!(!h.vm_alive(session.id, "vm").await);
    // The cycle that did it ran the database-driven directions only (its report is written
    // just after the row went final: wait for it, briefly).
    let recorded = Instant::now();
    let cycles = loop {
        let cycles = h
            .store
            .reaper_cycles()
            .recent(Some(&common::env("dev")), 10)
            .await
            .unwrap();
        if cycles
            .iter()
            .any(|c| c.cycle.trigger == ttlab_store::CycleTrigger::Wakeup)
            || recorded.elapsed() > Duration::from_secs(2)
        {
            break cycles;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        cycles
            .iter()
            .any(|c| c.cycle.trigger == ttlab_store::CycleTrigger::Wakeup
                && c.cycle.expired.done == 1),
        "{cycles:?}"
    );
    ctx.shutdown.cancel();
    reaper.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_is_reclaimed_on_time_while_other_sessions_change_all_the_time() {
    let h = Arc::new(Harness::start().await);
    let ctx = h.ctx("dev");
    let reaper = tokio::spawn(ttlab_reaper::run(
        ctx.clone(),
        Duration::from_secs(60),
        Arc::new(Metrics::new()),
    ));
    // The measured sessions are written as `running` before their VMs exist (a shortcut of
    // this harness: the server creates VMs while the row is `starting`). The startup sweep
    // would rightly mark such a row a ghost if it read it in that gap, so they are opened
    // after that sweep is done; later sweeps are a minute away.
    h.wait_for_cycle("dev", ttlab_store::CycleTrigger::Startup)
        .await;
    // Other students open and finish sessions without pause: a stream of notifications.
    let churn = {
        let h = h.clone();
        let stop = ctx.shutdown.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.is_cancelled() {
                let s = h
                    .open(
                        "dev",
                        SessionStatus::Running,
                        TimeDelta::minutes(30),
                        &["vm"],
                    )
                    .await
                    .id;
                let sessions = h.store.sessions();
                sessions
                    .begin_finishing(
                        s,
                        &[SessionStatus::Running],
                        ttlab_model::FinalStatus::Finished,
                        None,
                    )
                    .await
                    .unwrap();
                sessions.complete_finishing(s).await.unwrap();
                n += 1;
                // A steady stream (about a hundred changes a second), not a saturated database.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            n
        })
    };
    let mut delays = Vec::new();
    for _ in 0..5 {
        let session = running_vm(&h, 1500).await;
        let expires = Instant::now() + Duration::from_millis(1400);
        loop {
            let status = h.status(session.id).await;
            if status == SessionStatus::Expired {
                break;
            }
            assert!(
                expires.elapsed() < Duration::from_secs(10),
                "not reclaimed within 10 s of its expiry (status {status:?})"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        delays.push(Instant::now().saturating_duration_since(expires));
    }
    ctx.shutdown.cancel();
    let churned = churn.await.unwrap();
    reaper.await.unwrap();
    assert!(churned > 20, "only {churned} sessions churned");
    // Reclaimed every time, and typically within the product's second. (The old scheduler
    // never got to it while the stream lasted; how fast is `ttlabctl bench reaper`'s to say,
    // on a quiet machine: a loaded CI machine runs this next to another test.)
    let mut sorted = delays.clone();
    sorted.sort();
    assert!(
        sorted[sorted.len() / 2] < Duration::from_millis(1000),
        "{delays:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_is_not_held_back_by_a_vm_of_another_session_still_terminating() {
    const HOLD: &str = "test.ttlab.io/node-unreachable";
    let h = Harness::start().await;
    let ctx = h.ctx("dev");
    let reaper = tokio::spawn(ttlab_reaper::run(
        ctx.clone(),
        Duration::from_secs(60),
        Arc::new(Metrics::new()),
    ));
    // Rows written as running before their VMs exist would be ghosts to the startup sweep:
    // open them after it (the next sweep is a minute away).
    h.wait_for_cycle("dev", ttlab_store::CycleTrigger::Startup)
        .await;
    // The first session's VM stays terminating (its node is gone): the cycle that expires it
    // waits a few seconds for it to go. The second expires half a second later.
    let opened = Instant::now();
    let held = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::milliseconds(1000),
            &["vm"],
        )
        .await;
    h.create_vms_held("dev", held.id, &["vm"], true, Some(HOLD))
        .await;
    let next = running_vm(&h, 1500).await;
    while h.status(next.id).await != SessionStatus::Expired {
        // Waiting behind the first cycle's wait would take it past 1 s + 3 s.
        assert!(
            opened.elapsed() < Duration::from_millis(3600),
            "the second expiry waited for the first session's VM (status {:?}, first {:?})",
            h.status(next.id).await,
            h.status(held.id).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!h.vm_alive(next.id, "vm").await);
    // Meanwhile the first is still finishing: its VM is being deleted, and has not gone.
    assert_eq!(h.status(held.id).await, SessionStatus::Finishing);
    let held_vm = ttlab_vm_manifest::vm_name(held.id, &common::node("vm"));
    let vm = h
        .fixtures
        .get(ttlab_cluster::Kind::VirtualMachine, &held_vm)
        .await
        .unwrap();
    assert!(
        vm.is_some_and(|o| o.deleting),
        "the held VM is still there, terminating"
    );
    h.release(&held_vm, HOLD).await;
    ctx.shutdown.cancel();
    reaper.await.unwrap();
}

/// A store on the harness's database reached through `proxy`, with bounds short enough for a
/// test: a 2 s leader lease and 1 s without an answer before a connection is given up.
async fn store_behind(h: &Harness, proxy: &ttlab_testkit::FaultProxy) -> ttlab_store::Store {
    ttlab_store::Store::connect(&h.db.url_at(proxy.addr()), short_bounds())
        .await
        .expect("store through the proxy")
}

fn short_bounds() -> ttlab_store::StoreOptions {
    ttlab_store::StoreOptions {
        acquire_timeout: Duration::from_secs(3),
        timeouts: ttlab_store::Timeouts {
            call: Duration::from_secs(1),
            ..ttlab_store::Timeouts::default()
        },
        leases: ttlab_store::LeaseTtls {
            leader: Duration::from_secs(2),
            provisioning: Duration::from_secs(2),
        },
        ..ttlab_store::StoreOptions::default()
    }
}

fn proxy_for(h: &Harness) -> ttlab_testkit::FaultProxy {
    use ttlab_store::testing::ServerSocket;
    let upstream = match h.db.server_socket() {
        ServerSocket::Unix(path) => ttlab_testkit::Upstream::Unix(path),
        ServerSocket::Tcp(host, port) => {
            use std::net::ToSocketAddrs as _;
            ttlab_testkit::Upstream::Tcp(
                (host.as_str(), port)
                    .to_socket_addrs()
                    .expect("resolvable database host")
                    .next()
                    .expect("an address"),
            )
        }
    };
    ttlab_testkit::FaultProxy::start(upstream).expect("fault proxy")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_reclaims_on_time_when_the_leaders_database_connection_goes_half_open() {
    let h = Harness::start().await;
    let interval = Duration::from_secs(5);
    let proxy = proxy_for(&h);
    let leader = ttlab_reaper::ReaperContext {
        store: store_behind(&h, &proxy).await,
        ..h.ctx("dev")
    };
    let leader_metrics = Arc::new(Metrics::new());
    let leader_task = tokio::spawn(ttlab_reaper::run(
        leader.clone(),
        interval,
        leader_metrics.clone(),
    ));
    // The leader is acting (its startup sweep is recorded) before the standby starts.
    h.wait_for_cycle("dev", ttlab_store::CycleTrigger::Startup)
        .await;
    let standby = ttlab_reaper::ReaperContext {
        store: h.db.store_with(short_bounds()).await.unwrap(),
        ..h.ctx("dev")
    };
    let standby_task = tokio::spawn(ttlab_reaper::run(
        standby.clone(),
        interval,
        Arc::new(Metrics::new()),
    ));

    // A session expiring in 1.5 s; just before, the leader's connections go half-open (no
    // reply, no RST, no FIN): it can no longer act, and the sockets alone would keep a
    // session lock for hours.
    let session = running_vm(&h, 1500).await;
    proxy.set_mode(ttlab_testkit::FaultMode::Blackhole);
    let cut = Instant::now();
    while h.status(session.id).await != SessionStatus::Expired {
        assert!(
            cut.elapsed() < interval * 2,
            "not reclaimed within two sweep intervals ({:?}) of the leader vanishing",
            interval * 2
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "reclaimed by the standby {:.1}s after the leader's connections went half-open (bound: {:?})",
        cut.elapsed().as_secs_f64(),
        interval * 2
    );
    assert!(!h.vm_alive(session.id, "vm").await);
    // The old leader knows it is no longer the leader (once its cycle in flight, whose
    // statements each give up within a second, has ended).
    while leader_metrics.leader.get() != 0 {
        assert!(
            cut.elapsed() < Duration::from_secs(30),
            "the blackholed leader still believes it leads"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    leader.shutdown.cancel();
    standby.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), standby_task)
        .await
        .expect("the standby stops")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), leader_task)
        .await
        .expect("the blackholed leader stops too: its waits are bounded")
        .unwrap();
}

/// `metric{task="name"}`'s value in the rendered metrics.
fn task_metric(text: &str, metric: &str, name: &str) -> Option<f64> {
    let prefix = format!("{metric}{{task=\"{name}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// Waits (bounded: 30 s) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let began = Instant::now();
    while !done() {
        assert!(began.elapsed() < Duration::from_secs(30), "never {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_leader_lease_attempts_and_the_listeners_are_recorded_with_their_errors_until_they_recover()
 {
    let h = Harness::start().await;
    let proxy = proxy_for(&h);
    let ctx = ttlab_reaper::ReaperContext {
        store: store_behind(&h, &proxy).await,
        ..h.ctx("dev")
    };
    // Cut off from its database from the start: no attempt at the lease gets an answer.
    proxy.set_mode(ttlab_testkit::FaultMode::Blackhole);
    let metrics = Arc::new(Metrics::new());
    let task = tokio::spawn(ttlab_reaper::run(
        ctx.clone(),
        Duration::from_secs(5),
        metrics.clone(),
    ));
    until("two failed attempts at the lease", || {
        metrics.leader_lease.status().consecutive_failures >= 2
    })
    .await;
    let lease = metrics.leader_lease.status();
    let error = lease.last_error.clone().unwrap_or_default();
    assert!(error.contains("cannot try the leader lock"), "{lease:?}");
    assert!(lease.last_success_at.is_none(), "{lease:?}");
    let text = metrics.render();
    assert!(
        task_metric(&text, "ttlab_reaper_task_failures_total", "leader_lease")
            .is_some_and(|n| n >= 2.0),
        "{text}"
    );
    assert_eq!(metrics.leader.get(), 0);

    // The database answers again: the lease is taken, the error is gone, the listeners open.
    proxy.set_mode(ttlab_testkit::FaultMode::Pass);
    until("leading", || metrics.leader.get() == 1).await;
    let lease = metrics.leader_lease.status();
    assert_eq!(lease.consecutive_failures, 0, "{lease:?}");
    assert!(
        lease.last_error.is_none() && lease.last_success_at.is_some(),
        "{lease:?}"
    );
    assert!(lease.failures >= 2, "the failures stay counted: {lease:?}");
    until("both listeners open", || {
        let n = metrics.notifications.status();
        n.activations >= 2 && n.consecutive_failures == 0 && n.last_success_at.is_some()
    })
    .await;
    let text = metrics.render();
    assert!(
        task_metric(
            &text,
            "ttlab_reaper_task_activations_total",
            "notifications"
        )
        .is_some_and(|n| n >= 2.0),
        "{text}"
    );

    ctx.shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the reaper stops")
        .unwrap();
}
