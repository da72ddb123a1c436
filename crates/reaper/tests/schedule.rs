//! The scheduler ([`ttlab_reaper::run`]) against a real PostgreSQL and kube-sim: a deadline is
//! acted on when it comes due, even while a sweep of the cluster is still under way.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::TimeDelta;
use common::Harness;
use ttlab_kube_sim::{FaultAction, FaultRule, Verb};
use ttlab_model::SessionStatus;
use ttlab_reaper::Metrics;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_expiry_is_reclaimed_on_time_while_a_slow_sweep_is_still_listing() {
    let h = Harness::start().await;
    let session = h
        .open(
            "dev",
            SessionStatus::Running,
            TimeDelta::milliseconds(2500),
            &["vm"],
        )
        .await;
    h.create_vms("dev", session.id, &["vm"], true).await;
    let opened = Instant::now();
    // Listing VMs takes 8 s: the first sweep (at start) is still listing when the session
    // expires.
    h.sim.faults().add(FaultRule {
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
    assert!(!h.vm_alive(session.id, "vm"));
    // The cycle that did it ran the database-driven directions only.
    let cycles = h
        .store
        .reaper_cycles()
        .recent(Some(&common::env("dev")), 10)
        .await
        .unwrap();
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
