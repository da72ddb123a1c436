//! Every typed error, produced by the server's real answers (on both backends) or kube-sim's
//! injected faults, and the client-side concurrency limit (measured with kube-sim's latency
//! and its record of arrival times). Faults, latency and stopping the server are kube-sim's.

use std::time::Duration;

use futures::future::join_all;
use ttlab_cluster::{
    ClusterError, ClusterSettings, Kind, Propagation, ProvisionCluster as _, ReaperCluster as _,
};
use ttlab_kube_sim::{FaultAction, FaultRule, Verb};

use crate::common::{self, Harness, within};

#[tokio::test]
async fn injected_statuses_map_to_typed_errors() {
    let settings = ClusterSettings {
        retry_throttled: false,
        ..ClusterSettings::default()
    };
    let h = Harness::start_with(settings).await;
    type Check = fn(&ClusterError) -> bool;
    let cases: [(u16, Check, bool); 7] = [
        (500, |e| matches!(e, ClusterError::Transient { .. }), true),
        (503, |e| matches!(e, ClusterError::Transient { .. }), true),
        (429, |e| matches!(e, ClusterError::Transient { .. }), true),
        (403, |e| matches!(e, ClusterError::Forbidden { .. }), false),
        (409, |e| matches!(e, ClusterError::Conflict { .. }), false),
        (422, |e| matches!(e, ClusterError::Invalid { .. }), false),
        (404, |e| matches!(e, ClusterError::NotFound { .. }), false),
    ];
    for (status, check, retryable) in cases {
        let id = h
            .sim()
            .faults()
            .add(FaultRule::fail(Some(Verb::Create), Some("secrets"), status).times(1));
        let err = h
            .cluster
            .create_secret(common::secret("s", &common::labels("dev")))
            .await
            .unwrap_err();
        assert!(check(&err), "{status}: got {err:?}");
        assert_eq!(err.is_retryable(), retryable, "{status}: {err:?}");
        h.sim().faults().remove(id);
    }
    // Listing fails the same way.
    h.sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::List), Some("virtualmachines"), 500).times(1));
    let err = h
        .cluster
        .list_all(Kind::VirtualMachine, "")
        .await
        .unwrap_err();
    assert!(err.is_retryable(), "{err:?}");
    // A failed delete is an error (only 404 is success).
    h.sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::Delete), Some("secrets"), 503).times(1));
    let err = h
        .cluster
        .delete(Kind::Secret, "whatever", Propagation::Background)
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Transient { .. }), "{err:?}");
}

#[tokio::test]
async fn throttling_is_retried_inside_the_client_until_the_request_timeout() {
    let h = Harness::start().await;
    // Two 429s (with `Retry-After`), then the real answer: the caller never sees them.
    h.sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::Create), Some("secrets"), 429).times(2));
    h.cluster
        .create_secret(common::secret("after-throttle", &common::labels("dev")))
        .await
        .unwrap();
    let creates = h
        .sim()
        .calls()
        .iter()
        .filter(|c| c.verb == Verb::Create && c.resource == "secrets")
        .map(|c| c.status)
        .collect::<Vec<_>>();
    assert_eq!(creates, [429, 429, 201]);
    // A server that stays unavailable: a transient error once the request timeout is spent.
    let impatient = h
        .client(ClusterSettings {
            request_timeout: Duration::from_millis(500),
            ..ClusterSettings::default()
        })
        .await;
    h.sim()
        .faults()
        .add(FaultRule::fail(Some(Verb::Get), Some("secrets"), 503));
    let err = within(10, impatient.get(Kind::Secret, "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Transient { .. }), "{err:?}");
}

#[tokio::test]
async fn a_quota_message_on_a_403_is_quota_exceeded() {
    let h = Harness::start().await;
    h.sim().faults().add(FaultRule {
        action: FaultAction::Fail {
            status: 403,
            message: Some(
                "virtualmachines.kubevirt.io \"x\" is forbidden: exceeded quota: vms, requested: count/virtualmachines.kubevirt.io=1, used: count/virtualmachines.kubevirt.io=8, limited: count/virtualmachines.kubevirt.io=8".into(),
            ),
        },
        ..FaultRule::fail(Some(Verb::Create), Some("virtualmachines"), 403).times(1)
    });
    let err = h
        .cluster
        .create_vm(common::vm("x", &common::labels("dev")))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::QuotaExceeded { .. }), "{err:?}");
}

on_both_backends!(real_refusals_are_typed_too);
async fn real_refusals_are_typed_too(h: &Harness) {
    // An invalid name is refused by the API server (422).
    let mut bad = common::vm("ok", &common::labels("dev"));
    bad["metadata"]["name"] = "Not_A_Name".into();
    let err = h.cluster.create_vm(bad).await.unwrap_err();
    assert!(matches!(err, ClusterError::Invalid { .. }), "{err:?}");
    // An object of another namespace is refused before it is sent.
    let mut other = common::secret("elsewhere", &common::labels("dev"));
    other.metadata.namespace = Some("default".into());
    let err = h.cluster.create_secret(other).await.unwrap_err();
    assert!(matches!(err, ClusterError::Invalid { .. }), "{err:?}");
    // A second create of the same name: 409.
    h.cluster
        .create_secret(common::secret("twice", &common::labels("dev")))
        .await
        .unwrap();
    let err = h
        .cluster
        .create_secret(common::secret("twice", &common::labels("dev")))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Conflict { .. }), "{err:?}");
}

#[tokio::test]
async fn a_hanging_call_becomes_a_transient_timeout() {
    let settings = ClusterSettings {
        request_timeout: Duration::from_millis(300),
        ..ClusterSettings::default()
    };
    let h = Harness::start_with(settings).await;
    h.sim()
        .faults()
        .add(FaultRule::hang(Some(Verb::Get), Some("virtualmachines")));
    let err = within(10, h.cluster.get(Kind::VirtualMachine, "slow"))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Transient { .. }), "{err:?}");
    assert!(err.is_retryable());
}

#[tokio::test]
async fn an_unreachable_server_is_transient() {
    let h = Harness::start().await;
    let cluster = h.cluster.clone();
    h.into_sim().shutdown().await;
    let err = within(30, cluster.get(Kind::Secret, "x"))
        .await
        .unwrap_err();
    assert!(matches!(err, ClusterError::Transient { .. }), "{err:?}");
}

#[tokio::test]
async fn no_more_calls_than_the_limit_are_in_flight() {
    const LIMIT: usize = 3;
    const LATENCY: Duration = Duration::from_millis(150);
    let settings = ClusterSettings {
        max_in_flight: LIMIT,
        ..ClusterSettings::default()
    };
    let h = Harness::start_with(settings).await;
    h.sim().faults().set_latency(LATENCY);
    h.sim().faults().clear_calls();
    let names: Vec<String> = (0..12).map(|i| format!("c-{i}")).collect();
    let results = within(
        30,
        join_all(names.iter().map(|n| h.cluster.get(Kind::Secret, n))),
    )
    .await;
    assert!(results.iter().all(|r| matches!(r, Ok(None))), "{results:?}");

    // Every call is held LATENCY by the sim, so calls arriving within less than LATENCY of
    // each other were in flight together.
    let arrivals: Vec<u64> = h
        .sim()
        .calls()
        .iter()
        .filter(|c| c.verb == Verb::Get && c.resource == "secrets")
        .map(|c| c.offset_ms)
        .collect();
    assert_eq!(arrivals.len(), 12);
    let window = u64::try_from(LATENCY.as_millis()).unwrap() - 30;
    let most_together = arrivals
        .iter()
        .map(|&t| {
            arrivals
                .iter()
                .filter(|&&u| u >= t && u < t + window)
                .count()
        })
        .max()
        .unwrap();
    assert_eq!(most_together, LIMIT, "arrivals (ms): {arrivals:?}");
    eprintln!("limit {LIMIT}, sim latency {LATENCY:?}: arrivals (ms) {arrivals:?}");
}
