//! The reaper over two sites ([`ttlab_reaper::run_sites`]) against a real PostgreSQL and two
//! kube-sim servers in the same namespace and environment: each site's sessions are reclaimed
//! on that site only; a site that refuses, never answers or whose client cannot even be built
//! holds back no expiry of the other; and a session on a site missing from the configuration
//! is reported and left alone until the site is configured again.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::TimeDelta;
use common::{Harness, NS};
use tokio_util::sync::CancellationToken;
use ttlab_cluster::{ClusterSettings, Kind, KubeCluster, ReaperCluster as _};
use ttlab_kube_sim::{KubeSim, SimConfig, Verb};
use ttlab_model::{Runtime, SessionId, SessionStatus, SiteName};
use ttlab_reaper::{Connector, Metrics, Reaper, ReaperContext, SiteState, SiteWork};
use ttlab_testkit::{FaultMode, FaultProxy, Upstream};
use ttlab_vm_manifest::{secret_name, vm_name};

const INTERVAL: Duration = Duration::from_secs(1);

fn site(name: &str) -> SiteName {
    name.parse().expect("site name")
}

/// Site `b`: its own kube-sim, reached by the reaper through a proxy that can refuse or
/// swallow every call; the fixtures go to the simulator directly.
struct SiteB {
    sim: KubeSim,
    proxy: FaultProxy,
    fixtures: Arc<KubeCluster>,
    /// The reaper's kubeconfig (through the proxy).
    kubeconfig: PathBuf,
    _dir: tempfile::TempDir,
}

async fn site_b() -> SiteB {
    let sim = KubeSim::start(SimConfig::for_tests())
        .await
        .expect("kube-sim starts");
    let proxy = FaultProxy::start(Upstream::Tcp(sim.addr())).expect("proxy");
    let dir = tempfile::tempdir().expect("temporary directory");
    let direct = dir.path().join("direct");
    sim.write_kubeconfig(&direct, NS).expect("kubeconfig");
    let fixtures = Arc::new(
        KubeCluster::from_kubeconfig(&direct, ClusterSettings::in_namespace(NS))
            .await
            .expect("client"),
    );
    SiteB {
        sim,
        proxy,
        fixtures,
        kubeconfig: dir.path().join("reaper-kubeconfig"),
        _dir: dir,
    }
}

impl SiteB {
    /// Writes the reaper's kubeconfig (until then its client cannot be built).
    fn write_kubeconfig(&self) {
        std::fs::write(
            &self.kubeconfig,
            ttlab_kube_sim::kubeconfig_yaml(&format!("http://{}", self.proxy.addr()), NS),
        )
        .expect("kubeconfig");
    }
}

/// Site `a`'s context: the harness's kube-sim, with watch-fed listings as the service has.
fn ctx_a(h: &Harness, known: &[SiteName], shutdown: &CancellationToken) -> ReaperContext {
    let mut ctx = h.ctx("dev").with_site(site("a"), known);
    ctx.shutdown = shutdown.clone();
    ctx.with_cached_listings(Duration::from_secs(300))
}

/// Site `b`'s connector: builds its client from `kubeconfig` (failing while the file is
/// missing), with a short request timeout, as `ttlab-reaper` does from a sites file.
fn connect_b(
    h: &Harness,
    kubeconfig: &Path,
    known: &[SiteName],
    shutdown: &CancellationToken,
) -> Connector {
    connect_b_waiting(h, kubeconfig, known, shutdown, Duration::from_secs(3))
}

/// [`connect_b`] with each call given up after `request_timeout`.
fn connect_b_waiting(
    h: &Harness,
    kubeconfig: &Path,
    known: &[SiteName],
    shutdown: &CancellationToken,
    request_timeout: Duration,
) -> Connector {
    let base = h.ctx("dev");
    let kubeconfig = kubeconfig.to_path_buf();
    let known: Arc<[SiteName]> = known.into();
    let shutdown = shutdown.clone();
    Arc::new(move || {
        let (base, kubeconfig, known, shutdown) = (
            base.clone(),
            kubeconfig.clone(),
            known.clone(),
            shutdown.clone(),
        );
        Box::pin(async move {
            let settings = ClusterSettings {
                request_timeout,
                ..ClusterSettings::in_namespace(NS)
            };
            let cluster = KubeCluster::from_kubeconfig(&kubeconfig, settings).await?;
            let mut ctx = ReaperContext {
                cluster: Arc::new(cluster),
                ..base
            }
            .with_site(site("b"), &known);
            ctx.shutdown = shutdown;
            Ok(ctx.with_cached_listings(Duration::from_secs(300)))
        })
    })
}

/// Starts the reaper over `sites`; returns its task.
fn start(
    h: &Harness,
    sites: Vec<SiteWork>,
    shutdown: &CancellationToken,
    metrics: Arc<Metrics>,
) -> tokio::task::JoinHandle<()> {
    let reaper = Reaper {
        store: h.store.clone(),
        env: common::env("dev"),
        shutdown: shutdown.clone(),
        sites,
    };
    tokio::spawn(ttlab_reaper::run_sites(reaper, INTERVAL, metrics))
}

async fn stop(shutdown: &CancellationToken, task: tokio::task::JoinHandle<()>) {
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(30), task)
        .await
        .expect("the reaper stops")
        .expect("the reaper task ends normally");
}

/// A running session on `site_name` expiring in `millis`, with its VM and Secret on
/// `client`'s cluster; and the instant it expires at the latest (measured times from it are
/// upper bounds).
async fn running_on(
    h: &Harness,
    site_name: &str,
    client: &KubeCluster,
    millis: i64,
) -> (SessionId, Instant) {
    let before = Instant::now();
    // Starting until its objects exist, then running: a running row without its VM would be
    // a ghost to a sweep in between.
    let s = h
        .open_on(
            site_name,
            "dev",
            Runtime::Vm,
            SessionStatus::Starting,
            TimeDelta::milliseconds(millis),
            &["vm"],
        )
        .await;
    h.create_vms_via(client, "dev", s.id, &["vm"], true, None)
        .await;
    h.store
        .sessions()
        .mark_running(s.id, None)
        .await
        .expect("mark running")
        .expect("was starting");
    let expiry = before + Duration::from_millis(u64::try_from(millis.max(0)).unwrap_or(0));
    (s.id, expiry)
}

fn vm_of(id: SessionId) -> String {
    vm_name(id, &common::node("vm"))
}

fn secret_of(id: SessionId) -> String {
    secret_name(id, &common::node("vm"))
}

/// Whether the object is there and not being deleted.
async fn alive(client: &KubeCluster, kind: Kind, name: &str) -> bool {
    client
        .get(kind, name)
        .await
        .expect("get")
        .is_some_and(|o| !o.deleting)
}

/// Waits until the session's VM on `client` is deleted (gone or being deleted); returns the
/// time from `expiry` to then. Fails after `limit`.
async fn deleted_after(
    client: &KubeCluster,
    id: SessionId,
    expiry: Instant,
    limit: Duration,
) -> Duration {
    let name = vm_of(id);
    loop {
        if !alive(client, Kind::VirtualMachine, &name).await {
            return expiry.elapsed();
        }
        assert!(
            expiry.elapsed() < limit,
            "VirtualMachine/{name} not deleted within {limit:?} of its expiry"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_status(h: &Harness, id: SessionId, want: SessionStatus, secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        let now = h.status(id).await;
        if now == want {
            return;
        }
        assert!(
            Instant::now() < until,
            "session {id} is {now}, not {want}, after {secs} s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `f` holds (polling), or fails the test.
async fn eventually<F, Fut>(what: &str, secs: u64, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if f().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{what}: not within {secs} s");
}

/// The names of the objects deleted on a simulator since its calls were last cleared.
fn deleted_names(sim: &KubeSim) -> Vec<String> {
    sim.calls()
        .into_iter()
        .filter(|c| c.verb == Verb::Delete)
        .filter_map(|c| c.name)
        .collect()
}

fn state_of(metrics: &Metrics, name: &str) -> Option<(SiteState, Option<String>)> {
    metrics
        .sites()
        .into_iter()
        .find(|s| s.site == name)
        .map(|s| (s.state, s.last_error))
}

/// Waits until a full cycle of `site_name` ended after `since` was recorded.
async fn full_cycle_of(h: &Harness, site_name: &str, since: chrono::DateTime<chrono::Utc>) {
    eventually(&format!("a full cycle of site {site_name}"), 30, || async {
        let cycles = h
            .store
            .reaper_cycles()
            .recent(Some(&common::env("dev")), 50)
            .await
            .expect("recent cycles");
        cycles.iter().any(|c| {
            c.site.as_ref().map(SiteName::as_str) == Some(site_name)
                && c.cycle.started_at > since
                && c.cycle.trigger != ttlab_store::CycleTrigger::Wakeup
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_on_two_sites_are_each_reclaimed_on_their_own_site_and_nothing_across() {
    let h = Harness::start().await;
    let b = site_b().await;
    b.write_kubeconfig();
    let known = [site("a"), site("b")];
    let a_client = h.fixtures.clone();

    let mut expiring = Vec::new();
    for _ in 0..2 {
        expiring.push(("a", running_on(&h, "a", &a_client, 1500).await));
        expiring.push(("b", running_on(&h, "b", &b.fixtures, 1500).await));
    }
    let (a_live, _) = running_on(&h, "a", &a_client, 30 * 60 * 1000).await;
    let (b_live, _) = running_on(&h, "b", &b.fixtures, 30 * 60 * 1000).await;
    // Traps: on each site, a Secret labelled with the other site's live session (as if the
    // two sites shared a namespace). Neither is an orphan: its session is live.
    h.create_secret_via(&a_client, "dev", b_live, "trap", None)
        .await;
    h.create_secret_via(&b.fixtures, "dev", a_live, "trap", None)
        .await;
    h.sim().faults().clear_calls();
    b.sim.faults().clear_calls();

    let shutdown = CancellationToken::new();
    let metrics = Arc::new(Metrics::new().with_stall_after(Duration::from_secs(30)));
    let task = start(
        &h,
        vec![
            SiteWork::ready(ctx_a(&h, &known, &shutdown)),
            SiteWork::connect_with(site("b"), connect_b(&h, &b.kubeconfig, &known, &shutdown)),
        ],
        &shutdown,
        metrics.clone(),
    );

    // Every VM is watched at once, so that each time is its own.
    let a_ref = &a_client;
    let b_ref = &b.fixtures;
    let times = futures::future::join_all(expiring.iter().map(|(site_name, (id, expiry))| {
        let client = if *site_name == "a" { a_ref } else { b_ref };
        async move {
            (
                *site_name,
                *id,
                deleted_after(client, *id, *expiry, Duration::from_secs(10)).await,
            )
        }
    }))
    .await;
    for (site_name, id, took) in times {
        println!(
            "site {site_name}: session {id} expiry -> VM delete {} ms",
            took.as_millis()
        );
        wait_status(&h, id, SessionStatus::Expired, 10).await;
    }
    // A full cycle of each site after the expiries: ghosts and orphans were looked at too.
    let after = h.now().await;
    full_cycle_of(&h, "a", after).await;
    full_cycle_of(&h, "b", after).await;
    stop(&shutdown, task).await;

    // The live sessions and every object of theirs, on both sites, are untouched: no ghost
    // (each site judged only its own sessions), no orphan across sites.
    assert_eq!(h.status(a_live).await, SessionStatus::Running);
    assert_eq!(h.status(b_live).await, SessionStatus::Running);
    assert!(alive(&a_client, Kind::VirtualMachine, &vm_of(a_live)).await);
    assert!(alive(&b.fixtures, Kind::VirtualMachine, &vm_of(b_live)).await);
    let trap = |id| secret_name(id, &common::node("trap"));
    assert!(alive(&a_client, Kind::Secret, &trap(b_live)).await);
    assert!(alive(&b.fixtures, Kind::Secret, &trap(a_live)).await);
    // Each simulator saw deletions of its own site's expired objects only.
    let own = |site_name: &str| -> Vec<String> {
        expiring
            .iter()
            .filter(|(s, _)| *s == site_name)
            .flat_map(|(_, (id, _))| [vm_of(*id), secret_of(*id)])
            .collect()
    };
    for (site_name, sim) in [("a", h.sim()), ("b", &b.sim)] {
        let deleted = deleted_names(sim);
        let own = own(site_name);
        assert!(
            deleted.iter().all(|n| own.contains(n)),
            "site {site_name} deleted {deleted:?}, its own expired objects being {own:?}"
        );
        for id in expiring
            .iter()
            .filter(|(s, _)| *s == site_name)
            .map(|(_, (id, _))| *id)
        {
            assert!(deleted.contains(&vm_of(id)), "{site_name}: {deleted:?}");
        }
    }
    // Each site's cycles are recorded as its own, and counted by site.
    let text = metrics.render();
    for s in ["a", "b"] {
        assert!(
            text.contains(&format!(
                "ttlab_reaper_items_total{{site=\"{s}\",direction=\"Expired\",outcome=\"Done\"}} 2"
            )),
            "{text}"
        );
        assert!(
            text.contains(&format!("ttlab_reaper_site_up{{site=\"{s}\"}} 1")),
            "{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_site_that_cannot_be_built_refuses_or_never_answers_holds_back_no_expiry_of_the_other() {
    let h = Harness::start().await;
    let b = site_b().await;
    let known = [site("a"), site("b")];
    let a_client = h.fixtures.clone();
    let limit = Duration::from_secs(2);
    let mut b_sessions = Vec::new();

    let shutdown = CancellationToken::new();
    let metrics = Arc::new(Metrics::new().with_stall_after(Duration::from_secs(30)));
    // Site b's kubeconfig does not exist yet: its client cannot be built.
    let task = start(
        &h,
        vec![
            SiteWork::ready(ctx_a(&h, &known, &shutdown)),
            SiteWork::connect_with(site("b"), connect_b(&h, &b.kubeconfig, &known, &shutdown)),
        ],
        &shutdown,
        metrics.clone(),
    );

    // 1. b's client cannot be built.
    let (b1, _) = running_on(&h, "b", &b.fixtures, 500).await;
    b_sessions.push(b1);
    let (a1, expiry) = running_on(&h, "a", &a_client, 1500).await;
    let took = deleted_after(&a_client, a1, expiry, limit).await;
    println!(
        "site b's client cannot be built: site a expiry -> VM delete {} ms",
        took.as_millis()
    );
    eventually("site b reported down", 10, || async {
        matches!(state_of(&metrics, "b"), Some((SiteState::Down, Some(e))) if e.contains("cannot build its client"))
    })
    .await;
    assert!(metrics.health().is_ok(), "one site down fails /healthz");

    // 2. b refuses every connection (its API server stopped).
    b.proxy.set_mode(FaultMode::Close);
    b.write_kubeconfig();
    eventually("site b's client built and its cycles failing", 15, || async {
        matches!(state_of(&metrics, "b"), Some((SiteState::Down, Some(e))) if !e.contains("cannot build its client"))
    })
    .await;
    let (b2, _) = running_on(&h, "b", &b.fixtures, 500).await;
    b_sessions.push(b2);
    for round in 0..2 {
        let (a, expiry) = running_on(&h, "a", &a_client, 1500).await;
        let took = deleted_after(&a_client, a, expiry, limit).await;
        println!(
            "site b refusing (round {round}): site a expiry -> VM delete {} ms",
            took.as_millis()
        );
        wait_status(&h, a, SessionStatus::Expired, 10).await;
    }
    assert_eq!(state_of(&metrics, "a").map(|(s, _)| s), Some(SiteState::Up));
    let text = metrics.render();
    assert!(
        text.contains("ttlab_reaper_site_up{site=\"b\"} 0"),
        "{text}"
    );
    assert!(metrics.health().is_ok(), "one site down fails /healthz");

    // 3. b accepts connections and never answers.
    b.proxy.set_mode(FaultMode::Blackhole);
    let (b3, _) = running_on(&h, "b", &b.fixtures, 500).await;
    b_sessions.push(b3);
    for round in 0..3 {
        let (a, expiry) = running_on(&h, "a", &a_client, 1500).await;
        let took = deleted_after(&a_client, a, expiry, limit).await;
        println!(
            "site b never answering (round {round}): site a expiry -> VM delete {} ms",
            took.as_millis()
        );
        wait_status(&h, a, SessionStatus::Expired, 10).await;
    }
    assert!(metrics.health().is_ok(), "one site hung fails /healthz");
    // Nothing of b's was reclaimed meanwhile: its rows are still live.
    for id in &b_sessions {
        assert!(h.status(*id).await.is_live(), "{id}");
        assert!(alive(&b.fixtures, Kind::VirtualMachine, &vm_of(*id)).await);
    }

    // 4. b answers again: its expired sessions are reclaimed, and nothing of b's leaks.
    b.proxy.set_mode(FaultMode::Pass);
    let back = Instant::now();
    for id in &b_sessions {
        wait_status(&h, *id, SessionStatus::Expired, 30).await;
    }
    println!(
        "site b back: its {} expired sessions reclaimed within {} ms",
        b_sessions.len(),
        back.elapsed().as_millis()
    );
    eventually("site b reported up again", 15, || async {
        state_of(&metrics, "b").map(|(s, _)| s) == Some(SiteState::Up)
    })
    .await;
    stop(&shutdown, task).await;
    for id in &b_sessions {
        h.sim().faults().clear_calls();
        assert_eq!(
            b.fixtures
                .get(Kind::VirtualMachine, &vm_of(*id))
                .await
                .expect("get")
                .filter(|o| !o.deleting)
                .map(|o| o.name),
            None
        );
        assert!(!alive(&b.fixtures, Kind::Secret, &secret_of(*id)).await);
    }
    let selector = ttlab_model::labels::env_selector(&common::env("dev"));
    let left_b = b
        .fixtures
        .list_all(Kind::VirtualMachine, &selector)
        .await
        .expect("list");
    assert!(
        left_b.iter().all(|o| o.deleting),
        "site b still runs {left_b:?}"
    );
    let left_a = a_client
        .list_all(Kind::VirtualMachine, &selector)
        .await
        .expect("list");
    assert!(
        left_a.iter().all(|o| o.deleting),
        "site a still runs {left_a:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_on_a_site_not_configured_is_reported_left_alone_and_reclaimed_once_it_is() {
    let h = Harness::start().await;
    let b = site_b().await;
    b.write_kubeconfig();
    let a_client = h.fixtures.clone();
    let (gone_site, _) = running_on(&h, "b", &b.fixtures, 200).await;
    // Also a Secret of it on site a (as if the sites shared a namespace): not an orphan, its
    // session being live.
    h.create_secret_via(&a_client, "dev", gone_site, "trap", None)
        .await;
    let (a1, _) = running_on(&h, "a", &a_client, 200).await;

    // Only site a is configured.
    let only_a = [site("a")];
    let shutdown = CancellationToken::new();
    let metrics = Arc::new(Metrics::new());
    let task = start(
        &h,
        vec![SiteWork::ready(ctx_a(&h, &only_a, &shutdown))],
        &shutdown,
        metrics.clone(),
    );
    wait_status(&h, a1, SessionStatus::Expired, 10).await;
    let after = h.now().await;
    full_cycle_of(&h, "a", after).await;
    full_cycle_of(&h, "a", h.now().await).await;
    stop(&shutdown, task).await;
    // Reported: in the cycle reports, the metric and the report's own field.
    let cycles = h
        .store
        .reaper_cycles()
        .recent(Some(&common::env("dev")), 50)
        .await
        .expect("recent cycles");
    let full: Vec<_> = cycles
        .iter()
        .filter(|c| c.cycle.trigger != ttlab_store::CycleTrigger::Wakeup)
        .collect();
    assert!(full.len() >= 2, "{cycles:?}");
    for c in &full {
        assert!(
            c.cycle
                .errors
                .iter()
                .any(|e| e.subject == "site b" && e.message.contains("1 live sessions on site b")),
            "{c:?}"
        );
    }
    let text = metrics.render();
    assert!(
        text.contains("ttlab_reaper_sessions_unknown_site{site=\"b\"} 1"),
        "{text}"
    );
    // Left alone: still running, its VM on b and its Secret on a untouched.
    assert_eq!(h.status(gone_site).await, SessionStatus::Running);
    assert!(alive(&b.fixtures, Kind::VirtualMachine, &vm_of(gone_site)).await);
    let trap = secret_name(gone_site, &common::node("trap"));
    assert!(alive(&a_client, Kind::Secret, &trap).await);
    let report = ttlab_reaper::reap_once(&ctx_a(&h, &only_a, &CancellationToken::new())).await;
    assert_eq!(report.unknown_sites, vec![(site("b"), 1)]);
    assert!(
        report
            .details()
            .contains("live sessions on site b, which is not configured: 1 (left alone)"),
        "{}",
        report.details()
    );

    // Site b configured again: its session is reclaimed as usual, on b.
    let both = [site("a"), site("b")];
    let shutdown = CancellationToken::new();
    let metrics = Arc::new(Metrics::new());
    let again = Instant::now();
    let task = start(
        &h,
        vec![
            SiteWork::ready(ctx_a(&h, &both, &shutdown)),
            SiteWork::connect_with(site("b"), connect_b(&h, &b.kubeconfig, &both, &shutdown)),
        ],
        &shutdown,
        metrics.clone(),
    );
    wait_status(&h, gone_site, SessionStatus::Expired, 20).await;
    println!(
        "site b configured again: its expired session reclaimed within {} ms",
        again.elapsed().as_millis()
    );
    assert!(!alive(&b.fixtures, Kind::VirtualMachine, &vm_of(gone_site)).await);
    full_cycle_of(&h, "a", h.now().await).await;
    stop(&shutdown, task).await;
    let text = metrics.render();
    assert!(
        !text.contains("ttlab_reaper_sessions_unknown_site{site=\"b\"} 1"),
        "{text}"
    );
}

/// The leader lease lost while one site's calls hang (each given up after a minute): the
/// reaper stops acting, takes the lease again and reclaims the other site's expiries within
/// seconds, not once the hung site's calls end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_lost_while_a_site_hangs_is_taken_again_and_the_other_site_reclaimed_on_time() {
    let h = Harness::start().await;
    let b = site_b().await;
    b.write_kubeconfig();
    let known = [site("a"), site("b")];
    let a_client = h.fixtures.clone();
    // A short leader lease, so its loss is seen within a second.
    let store =
        h.db.store_with(ttlab_store::StoreOptions {
            leases: ttlab_store::LeaseTtls {
                leader: Duration::from_secs(2),
                provisioning: Duration::from_secs(2),
            },
            ..ttlab_store::StoreOptions::default()
        })
        .await
        .expect("store");
    let shutdown = CancellationToken::new();
    let metrics = Arc::new(Metrics::new().with_stall_after(Duration::from_secs(120)));
    let reaper = Reaper {
        store,
        env: common::env("dev"),
        shutdown: shutdown.clone(),
        sites: vec![
            SiteWork::ready(ctx_a(&h, &known, &shutdown)),
            SiteWork::connect_with(
                site("b"),
                connect_b_waiting(
                    &h,
                    &b.kubeconfig,
                    &known,
                    &shutdown,
                    Duration::from_secs(60),
                ),
            ),
        ],
    };
    let task = tokio::spawn(ttlab_reaper::run_sites(reaper, INTERVAL, metrics.clone()));
    eventually("both sites acting", 15, || async {
        state_of(&metrics, "a").map(|(s, _)| s) == Some(SiteState::Up)
            && state_of(&metrics, "b").map(|(s, _)| s) == Some(SiteState::Up)
    })
    .await;

    // b stops answering; its cycles wait on calls that take a minute to be given up.
    b.proxy.set_mode(FaultMode::Blackhole);
    let (b1, _) = running_on(&h, "b", &b.fixtures, 200).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // The lease is taken from the reaper (an operator's cleanup, a clock jump): its next
    // renewal is refused.
    let (db, connection) = tokio_postgres::connect(h.db.url(), tokio_postgres::NoTls)
        .await
        .expect("database");
    let connection = tokio::spawn(connection);
    let gone = db
        .execute(
            "DELETE FROM leases WHERE kind = 'reaper-leader' AND key = 'dev'",
            &[],
        )
        .await
        .expect("delete the lease");
    assert_eq!(gone, 1, "the reaper held the lease");
    let (a1, expiry) = running_on(&h, "a", &a_client, 4000).await;
    let took = deleted_after(&a_client, a1, expiry, Duration::from_secs(3)).await;
    println!(
        "lease lost while site b hangs: site a expiry -> VM delete {} ms",
        took.as_millis()
    );
    wait_status(&h, a1, SessionStatus::Expired, 10).await;
    // b's session waits for b.
    assert!(h.status(b1).await.is_live());
    b.proxy.set_mode(FaultMode::Pass);
    b.proxy.cut_open();
    wait_status(&h, b1, SessionStatus::Expired, 30).await;
    stop(&shutdown, task).await;
    connection.abort();
}
