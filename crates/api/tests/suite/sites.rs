//! Several sites: one server, one database, and a kube-sim per site (each its own API server
//! and guests). Starts are placed among the sites that answer and have room, each session's
//! objects live in its own site's cluster, and a site that stops answering is that site's
//! loss alone.

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use serde_json::{Value, json};
use support::{LESSONS, NS, Running, World, policy, sim_with, start_running, token};
use tokio_tungstenite::tungstenite::Message;
use ttlab_api::auth::Role;
use ttlab_api::sites::SiteRuntime;
use ttlab_cluster::{ClusterSettings, KubeCluster};
use ttlab_kube_sim::KubeSim;
use ttlab_lesson::LessonSet;
use ttlab_site::SitesConfig;

/// One site of a test: its name, its kube-sim's kubeconfig, VM limit, weight, agent path
/// and labels.
struct Spec<'a> {
    name: &'a str,
    kubeconfig: &'a Path,
    vm_limit: u32,
    weight: u32,
    agent_path: &'a str,
    labels: &'a [&'a str],
}

impl<'a> Spec<'a> {
    /// A site reached at its pod IPs, with no labels.
    fn new(name: &'a str, kubeconfig: &'a Path, vm_limit: u32, weight: u32) -> Self {
        Self {
            name,
            kubeconfig,
            vm_limit,
            weight,
            agent_path: "pod-ip",
            labels: &[],
        }
    }

    fn agent_path(self, agent_path: &'a str) -> Self {
        Self { agent_path, ..self }
    }

    fn labels(self, labels: &'a [&'a str]) -> Self {
        Self { labels, ..self }
    }
}

/// The sites file of `specs`, parsed as the server parses it, each site with its client.
async fn sites(specs: &[Spec<'_>]) -> Vec<SiteRuntime> {
    let mut yaml = String::from("sites:\n");
    for s in specs {
        yaml.push_str(&format!(
            "  - name: {}\n    kubeconfig: {}\n    namespace: {NS}\n    vm_limit: {}\n    \
             weight: {}\n    agent_path: {}\n    labels: [{}]\n",
            s.name,
            s.kubeconfig.join("config").display(),
            s.vm_limit,
            s.weight,
            s.agent_path,
            s.labels.join(", ")
        ));
    }
    let config = SitesConfig::parse(&yaml).expect("a valid sites file");
    let mut out = Vec::new();
    for site in config.sites() {
        let ttlab_site::Connection::Kubeconfig(path) = &site.connection else {
            unreachable!("every test site has a kubeconfig")
        };
        let client = KubeCluster::from_kubeconfig(path, ClusterSettings::in_namespace(NS))
            .await
            .expect("a client");
        out.push(SiteRuntime::connected(site.clone(), Arc::new(client)));
    }
    out
}

fn vm_of(sid: &str) -> String {
    ttlab_vm_manifest::vm_name(sid.parse().unwrap(), &"vm".parse().unwrap())
}

/// Starts `quick` for `user`: the session id, the student's token and the site it runs on,
/// once it runs.
async fn start_on(s: &Running, user: &str) -> (String, String, String) {
    start_lesson(s, user, "quick").await
}

/// Starts `lesson` for `user`: the session id, the student's token and the site it runs on,
/// once it runs.
async fn start_lesson(s: &Running, user: &str, lesson: &str) -> (String, String, String) {
    let (sid, t) = start_running(s, user, lesson).await;
    let (status, v) = s.get(&format!("/api/sessions/{sid}"), &t).await;
    assert_eq!(status, 200, "{v}");
    let site = v["site"].as_str().expect("a site").to_owned();
    (sid, t, site)
}

/// The site `sid`'s row records, read from the database.
async fn row_site(w: &World, sid: &str) -> String {
    let store = w.db.store().await.unwrap();
    let row = store
        .sessions()
        .get(sid.parse().unwrap())
        .await
        .unwrap()
        .expect("the row");
    row.site.to_string()
}

async fn grade(s: &Running, sid: &str, t: &str) -> (u16, Value) {
    s.post(&format!("/api/sessions/{sid}/grade"), t, json!({}))
        .await
}

fn site_named<'a>(capacity: &'a Value, name: &str) -> &'a Value {
    capacity["sites"]
        .as_array()
        .expect("a list of sites")
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no site {name} in {capacity}"))
}

#[tokio::test]
async fn starts_fill_the_preferred_sites_limit_then_continue_on_the_next_each_in_its_own_cluster() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 2, 10),
                Spec::new("campus-b", kube_b.path(), 2, 1),
            ])
            .await,
        )
        .await;

    let mut started = Vec::new();
    for user in ["u1", "u2", "u3", "u4"] {
        started.push(start_on(&s, user).await);
    }
    let placed: Vec<&str> = started.iter().map(|(_, _, site)| site.as_str()).collect();
    assert_eq!(placed, ["campus-a", "campus-a", "campus-b", "campus-b"]);
    for (sid, t, site) in &started {
        assert_eq!(&row_site(&w, sid).await, site);
        let vm = vm_of(sid);
        let (here, there) = match site.as_str() {
            "campus-a" => (&w.sim, &sim_b),
            _ => (&sim_b, &w.sim),
        };
        assert!(
            here.get("virtualmachines", NS, &vm).is_some(),
            "{vm} on {site}"
        );
        assert!(here.get("virtualmachineinstances", NS, &vm).is_some());
        assert!(
            there.get("virtualmachines", NS, &vm).is_none(),
            "{vm} elsewhere"
        );
        // Graded through its own site's VM.
        let (status, g) = grade(&s, sid, t).await;
        assert_eq!(status, 200, "{g}");
        assert_eq!(
            (g["passed"].as_u64(), g["total"].as_u64()),
            (Some(1), Some(2))
        );
    }

    // Both sites full: the usual 503 capacity, and the student may wait in line.
    let u5 = token("u5", Role::Student);
    let (status, e) = s
        .post("/api/sessions", &u5, json!({"lesson": "quick"}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );

    let admin = token("root", Role::Admin);
    let (status, capacity) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{capacity}");
    assert_eq!(
        capacity["sites"].as_array().map(Vec::len),
        Some(2),
        "{capacity}"
    );
    for name in ["campus-a", "campus-b"] {
        let site = site_named(&capacity, name);
        assert_eq!(site["vm_limit"], 2, "{site}");
        assert_eq!(site["in_use"], 2, "{site}");
        assert_eq!(site["reachable"], true, "{site}");
    }

    // Finishing frees a place on that site, and the next start takes it.
    let (sid, t, _) = &started[2];
    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), t).await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );
    assert!(sim_b.get("virtualmachines", NS, &vm_of(sid)).is_none());
    // (The capacity check's listing of a site's VMs may be a second old.)
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, _, site) = start_on(&s, "u5").await;
    assert_eq!(site, "campus-b");
    s.stop().await;
}

#[tokio::test]
async fn a_site_that_stops_answering_takes_no_new_start_and_the_other_sites_sessions_carry_on() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 2, 5),
                Spec::new("campus-b", kube_b.path(), 4, 1),
            ])
            .await,
        )
        .await;
    let (alice_sid, alice, site) = start_on(&s, "alice").await;
    assert_eq!(site, "campus-a");
    let (bob_sid, bob, site) = start_on(&s, "bob").await;
    assert_eq!(site, "campus-a");
    let (carol_sid, carol, site) = start_on(&s, "carol").await;
    assert_eq!(site, "campus-b");
    // A place frees on campus-a, the preferred site.
    let (status, f) = s
        .delete(&format!("/api/sessions/{alice_sid}"), &alice)
        .await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );

    // campus-a's API server goes away.
    w.sim.stop();
    let lost = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (dave_sid, _dave, site) = start_on(&s, "dave").await;
    assert_eq!(site, "campus-b", "placed on the site that answers");
    assert!(
        sim_b
            .get("virtualmachines", NS, &vm_of(&dave_sid))
            .is_some()
    );

    // Bob, on the lost site, is told so plainly, within seconds.
    let seen = s
        .wait_session(&bob_sid, &bob, |v| v["site_unreachable"].is_string())
        .await;
    assert!(
        lost.elapsed() < Duration::from_secs(20),
        "{:?}",
        lost.elapsed()
    );
    assert_eq!(seen["status"], "running", "{seen}");
    let notice = seen["site_unreachable"].as_str().unwrap();
    assert!(
        notice.contains("campus-a") && notice.contains("cannot be reached"),
        "{notice}"
    );
    let (status, e) = grade(&s, &bob_sid, &bob).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("site_unavailable")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("campus-a"), "{e}");
    let (status, ticket) = s
        .post(
            &format!("/api/sessions/{bob_sid}/console-ticket"),
            &bob,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{ticket}");
    let url = format!(
        "{}{}",
        s.base.replacen("http://", "ws://", 1),
        ticket["url"].as_str().unwrap()
    );
    match tokio_tungstenite::connect_async(url).await {
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            assert_eq!(response.status().as_u16(), 503);
            let body: Value =
                serde_json::from_slice(&response.into_body().unwrap_or_default()).unwrap();
            assert_eq!(body["error"], "site_unavailable", "{body}");
        }
        other => panic!("the console of a lost site's session: {other:?}"),
    }

    // Carol, on the site that answers, has everything: view, grading, extension, console,
    // finish.
    let (status, v) = s.get(&format!("/api/sessions/{carol_sid}"), &carol).await;
    assert_eq!(status, 200, "{v}");
    assert!(v.get("site_unreachable").is_none(), "{v}");
    let (status, g) = grade(&s, &carol_sid, &carol).await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2))
    );
    let (status, e) = s
        .post(
            &format!("/api/sessions/{carol_sid}/extend"),
            &carol,
            json!({}),
        )
        .await;
    assert_eq!(
        (status, e["extensions_used"].as_u64()),
        (200, Some(1)),
        "{e}"
    );
    let (status, ticket) = s
        .post(
            &format!("/api/sessions/{carol_sid}/console-ticket"),
            &carol,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{ticket}");
    let (mut ws, _) = tokio_tungstenite::connect_async(format!(
        "{}{}",
        s.base.replacen("http://", "ws://", 1),
        ticket["url"].as_str().unwrap()
    ))
    .await
    .expect("carol's console opens");
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !text.contains(":~# ") {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => text.push_str(&String::from_utf8_lossy(&b)),
            Ok(Some(Ok(_))) => {}
            other => panic!("carol's console after {text:?}: {other:?}"),
        }
    }
    drop(ws);
    let (status, f) = s
        .delete(&format!("/api/sessions/{carol_sid}"), &carol)
        .await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );
    assert!(
        sim_b
            .get("virtualmachines", NS, &vm_of(&carol_sid))
            .is_none()
    );

    // The admin sees both sites, the lost one with why.
    let admin = token("root", Role::Admin);
    let (status, capacity) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{capacity}");
    let a = site_named(&capacity, "campus-a");
    assert_eq!(a["reachable"], false, "{a}");
    assert!(a["why"].is_string(), "{a}");
    let b = site_named(&capacity, "campus-b");
    assert_eq!(
        (b["reachable"].as_bool(), b["in_use"].as_u64()),
        (Some(true), Some(1)),
        "{b}"
    );
    // So do the ops endpoints: the cluster health names the lost site, and the gauges are
    // per site.
    let (status, cluster) = s
        .raw("GET", "/healthz/cluster", None, None, Vec::new())
        .await;
    assert_eq!(status, 503, "{cluster}");
    assert_eq!(cluster["reachable"], false, "{cluster}");
    assert!(
        cluster["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("site campus-a: ") && !e.contains("campus-b")),
        "{cluster}"
    );
    let per_site: Vec<(String, bool)> = cluster["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .map(|h| {
            (
                h["site"].as_str().unwrap().to_owned(),
                h["reachable"] == true,
            )
        })
        .collect();
    assert_eq!(
        per_site,
        [
            ("campus-a".to_owned(), false),
            ("campus-b".to_owned(), true)
        ]
    );
    let (_, metrics) = s.raw("GET", "/metrics", None, None, Vec::new()).await;
    let text = metrics.as_str().unwrap_or_default();
    for line in [
        "ttlab_cluster_reachable{site=\"campus-a\"} 0",
        "ttlab_cluster_reachable{site=\"campus-b\"} 1",
        "ttlab_capacity_limit{site=\"campus-a\"} 2",
        "ttlab_capacity_limit{site=\"campus-b\"} 4",
        "ttlab_capacity_used{site=\"campus-b\",by=\"labs\"} 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in:\n{text}");
    }
    s.stop().await;
}

#[tokio::test]
async fn a_session_on_a_port_forward_site_is_graded_through_its_api_server_beside_a_pod_ip_site() {
    let w = World::new().await;
    // The second site publishes guest addresses nothing routes: only its API server's port
    // forward reaches its agents.
    let (sim_b, kube_b) = sim_with(|c| c.unroutable_pod_ips = true).await;
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let mut runtimes = sites(&[
        Spec::new("campus-a", w.kubeconfig.path(), 1, 5),
        Spec::new("campus-b", kube_b.path(), 2, 1).agent_path("portforward"),
    ])
    .await;
    // A third site, preferred by weight, whose client could not be built: kept, reported,
    // and passed over.
    let broken = SitesConfig::parse(&format!(
        "sites:\n  - {{name: campus-c, kubeconfig: /nonexistent/c.kubeconfig, namespace: {NS}, \
         vm_limit: 8, weight: 100}}\n"
    ))
    .unwrap();
    runtimes.push(SiteRuntime::unconnected(
        broken.sites()[0].clone(),
        "no client could be built: /nonexistent/c.kubeconfig: no such file",
    ));
    let s = w.serve_sites(config, runtimes).await;

    let (alice_sid, alice, site) = start_on(&s, "alice").await;
    assert_eq!(site, "campus-a");
    let (bob_sid, bob, site) = start_on(&s, "bob").await;
    assert_eq!(site, "campus-b");
    let forwards = |sim: &KubeSim| {
        sim.calls()
            .iter()
            .filter(|c| {
                c.resource.contains("portforward")
                    || c.subresource.as_deref() == Some("portforward")
            })
            .count()
    };
    let before = forwards(&sim_b);
    let (status, g) = grade(&s, &bob_sid, &bob).await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2)),
        "{g}"
    );
    assert_eq!(g["steps"][1]["exit_code"], 3);
    assert!(
        forwards(&sim_b) >= before + 2,
        "bob's grading went through the API server"
    );
    // Alice's site reaches its agents by pod IP: no port forward there.
    let (status, g) = grade(&s, &alice_sid, &alice).await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(forwards(&w.sim), 0);

    let admin = token("root", Role::Admin);
    let (status, capacity) = s.get("/api/admin/capacity", &admin).await;
    assert_eq!(status, 200, "{capacity}");
    let c = site_named(&capacity, "campus-c");
    assert_eq!(c["reachable"], false, "{c}");
    assert!(
        c["why"]
            .as_str()
            .unwrap()
            .contains("/nonexistent/c.kubeconfig"),
        "{c}"
    );
    assert_eq!(
        site_named(&capacity, "campus-b")["agent_path"],
        "portforward"
    );

    for (sid, t) in [(&alice_sid, &alice), (&bob_sid, &bob)] {
        let (status, f) = s.delete(&format!("/api/sessions/{sid}"), t).await;
        assert_eq!(
            (status, f["status"].as_str()),
            (200, Some("finished")),
            "{f}"
        );
    }
    assert!(sim_b.get("virtualmachines", NS, &vm_of(&bob_sid)).is_none());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_session_left_starting_on_the_second_site_by_a_crashed_server_is_adopted_and_finished_there()
 {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let first = w
        .serve_sites(
            w.config(policy(3600, 7200, 3), 8).await,
            adoption_sites(w.kubeconfig.path(), kube_b.path()).await,
        )
        .await;
    let (alice_sid, alice, site) = start_on(&first, "alice").await;
    assert_eq!(site, "campus-a");
    // campus-b's KubeVirt holds the next VM back: the session stays starting there.
    sim_b.pause_kubevirt(true);
    let bob = token("bob", Role::Student);
    let (status, v) = first
        .post("/api/sessions", &bob, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let bob_sid = v["id"].as_str().unwrap().to_owned();
    first
        .wait_session(&bob_sid, &bob, |v| v["stages"]["vm_created"].is_string())
        .await;
    assert_eq!(row_site(&w, &bob_sid).await, "campus-b");
    first.kill().await;

    // Another server, with the same sites, adopts it and finishes it on campus-b.
    let second = w
        .serve_sites(
            w.config(policy(3600, 7200, 3), 8).await,
            adoption_sites(w.kubeconfig.path(), kube_b.path()).await,
        )
        .await;
    sim_b.pause_kubevirt(false);
    let v = second
        .wait_session(&bob_sid, &bob, |v| v["status"] != "starting")
        .await;
    assert_eq!(
        (v["status"].as_str(), v["site"].as_str()),
        (Some("running"), Some("campus-b")),
        "{v}"
    );
    assert!(
        sim_b
            .get("virtualmachineinstances", NS, &vm_of(&bob_sid))
            .is_some()
    );
    assert!(w.sim.get("virtualmachines", NS, &vm_of(&bob_sid)).is_none());
    assert_eq!(sim_b.stats().peak_vms, 1, "{:?}", sim_b.stats());
    // Both sessions are served by the new server, each on its own site.
    for (sid, t) in [(&alice_sid, &alice), (&bob_sid, &bob)] {
        let (status, g) = grade(&second, sid, t).await;
        assert_eq!(status, 200, "{g}");
        let (status, f) = second.delete(&format!("/api/sessions/{sid}"), t).await;
        assert_eq!(
            (status, f["status"].as_str()),
            (200, Some("finished")),
            "{f}"
        );
    }
    assert_eq!(sim_b.stats().vms, 0);
    second.stop().await;
}

/// The sites of the adoption test: campus-a (1 place, preferred) and campus-b.
async fn adoption_sites(a: &Path, b: &Path) -> Vec<SiteRuntime> {
    sites(&[
        Spec::new("campus-a", a, 1, 5),
        Spec::new("campus-b", b, 4, 1),
    ])
    .await
}

#[tokio::test]
async fn a_session_on_a_site_the_server_is_no_longer_configured_with_gets_a_clear_503() {
    let w = World::new().await;
    let (_sim_b, kube_b) = sim_with(|_| {}).await;
    let first = w
        .serve_sites(
            w.config(policy(3600, 7200, 3), 8).await,
            adoption_sites(w.kubeconfig.path(), kube_b.path()).await,
        )
        .await;
    let (_, _, site) = start_on(&first, "alice").await;
    assert_eq!(site, "campus-a");
    let (bob_sid, bob, site) = start_on(&first, "bob").await;
    assert_eq!(site, "campus-b");
    first.stop().await;

    // The next server's sites file has campus-a only.
    let mut only_a = adoption_sites(w.kubeconfig.path(), kube_b.path()).await;
    only_a.truncate(1);
    let s = w
        .serve_sites(w.config(policy(3600, 7200, 3), 8).await, only_a)
        .await;
    let (status, v) = s.get(&format!("/api/sessions/{bob_sid}"), &bob).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["site_unreachable"]
            .as_str()
            .is_some_and(|m| m.contains("campus-b")),
        "{v}"
    );
    let (status, e) = grade(&s, &bob_sid, &bob).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("site_unavailable")),
        "{e}"
    );
    let (status, e) = s
        .post(&format!("/api/sessions/{bob_sid}/extend"), &bob, json!({}))
        .await;
    assert_eq!(status, 200, "the lifespan is the database's: {e}");
    // Finishing cannot reach its objects: never a 500, and the row stays live for whoever
    // is configured with the site.
    let (status, f) = s.delete(&format!("/api/sessions/{bob_sid}"), &bob).await;
    assert!(status < 500, "{status} {f}");
    assert_ne!(f["status"], "finished", "{f}");
    s.stop().await;
}

/// Lessons that need a site label: `large` (`kvm-large`), `large-pooled` (`kvm-large`, a
/// pool of one) and `gpu` (a label no test site offers).
const LABELLED: &str = r#"
id: large
title: Large
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
site_labels: [kvm-large]
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
---
id: large-pooled
title: Large, pooled
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
site_labels: [kvm-large]
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
pool:
  size: 1
---
id: gpu
title: Needs a GPU
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
site_labels: [gpu]
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
"#;

/// The test lessons with the labelled ones.
fn labelled_lessons() -> LessonSet {
    LessonSet::from_sources([
        ("test.yaml".into(), LESSONS.to_owned()),
        ("labelled.yaml".into(), LABELLED.to_owned()),
    ])
    .unwrap()
}

/// A start of `lesson` by `user` that is refused: its status and answer.
async fn refused(s: &Running, user: &str, lesson: &str) -> (u16, Value) {
    let t = token(user, Role::Student);
    s.post("/api/sessions", &t, json!({ "lesson": lesson }))
        .await
}

async fn finish(s: &Running, sid: &str, t: &str) {
    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), t).await;
    assert_eq!(
        (status, f["status"].as_str()),
        (200, Some("finished")),
        "{f}"
    );
}

#[tokio::test]
async fn a_lesson_that_needs_a_site_label_runs_only_where_it_is_and_waits_for_room_there() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.lessons = labelled_lessons();
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 3, 10).labels(&["eu"]),
                Spec::new("campus-b", kube_b.path(), 2, 1).labels(&["eu", "kvm-large"]),
            ])
            .await,
        )
        .await;

    // campus-a is preferred by weight, but only campus-b carries kvm-large.
    let (first, first_t, site) = start_lesson(&s, "u1", "large").await;
    assert_eq!(site, "campus-b");
    assert!(sim_b.get("virtualmachines", NS, &vm_of(&first)).is_some());
    let (_, _, site) = start_on(&s, "u2").await;
    assert_eq!(site, "campus-a", "a lesson without labels goes by weight");
    let (_, _, site) = start_lesson(&s, "u3", "large").await;
    assert_eq!(site, "campus-b");

    // campus-b is full: the usual capacity answer, with campus-b's limit alone, though
    // campus-a has room...
    let (status, e) = refused(&s, "u4", "large").await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("2 of 2 VMs"), "{e}");
    assert_eq!(w.sim.stats().vms, 1, "nothing placed on campus-a");
    // ...which a lesson without labels still takes.
    let (_, _, site) = start_on(&s, "u5").await;
    assert_eq!(site, "campus-a");

    // A place frees on campus-b, and the labelled lesson takes it.
    finish(&s, &first, &first_t).await;
    // (The capacity check's listing of a site's VMs may be a second old.)
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, _, site) = start_lesson(&s, "u4", "large").await;
    assert_eq!(site, "campus-b");

    // A label no site offers: refused, saying which.
    let (status, e) = refused(&s, "u6", "gpu").await;
    assert_eq!((status, e["error"].as_str()), (503, Some("no_site")), "{e}");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("no site offers the site label gpu"),
        "{message}"
    );

    // A class is checked against the sites its lesson may use: a lab of `large` and the 2
    // places kept for a cold start do not fit campus-b's limit of 2 (they would fit
    // campus-a's 3); one of `quick` does.
    let class = |lesson: &str| {
        let start = chrono::Utc::now() + chrono::TimeDelta::hours(2);
        json!({
            "lesson": lesson, "title": "Morning", "seats": 4,
            "starts_at": start.to_rfc3339(),
            "ends_at": (start + chrono::TimeDelta::hours(1)).to_rfc3339(),
        })
    };
    let admin = token("root", Role::Admin);
    let schedule = |body: Value| {
        s.raw(
            "POST",
            "/api/admin/classes",
            Some(&admin),
            Some("application/json"),
            serde_json::to_vec(&body).unwrap(),
        )
    };
    for (lesson, says) in [
        ("large", "with the VM limit 2"),
        ("gpu", "no site offers the site label gpu"),
    ] {
        let (status, v) = schedule(class(lesson)).await;
        assert_eq!(
            (status, v["error"].as_str(), v["field"].as_str()),
            (422, Some("not_pooled"), Some("lesson")),
            "{v}"
        );
        assert!(v["message"].as_str().unwrap().contains(says), "{v}");
    }
    let (status, v) = schedule(class("quick")).await;
    assert_eq!(status, 201, "{v}");
    s.stop().await;

    // One site without the label refuses the same way, before any place is counted.
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.lessons = labelled_lessons();
    let single = w.serve(config).await;
    let (status, e) = refused(&single, "u7", "large").await;
    assert_eq!((status, e["error"].as_str()), (503, Some("no_site")), "{e}");
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("no site offers the site label kvm-large"),
        "{e}"
    );
    single.stop().await;
}

/// Creates on `sim` the golden PVC of the `golden` test lesson, bound and ready.
fn golden_pvc(sim: &KubeSim) {
    sim.create(json!({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "golden-debian", "namespace": NS},
        "spec": {"accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}}))
        .unwrap();
    sim.set_status(
        "persistentvolumeclaims",
        NS,
        "golden-debian",
        json!({"phase": "Bound", "accessModes": ["ReadOnlyMany"]}),
    )
    .unwrap();
}

#[tokio::test]
async fn a_start_prefers_the_site_where_its_golden_disk_is_ready_over_more_free_places() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    golden_pvc(&sim_b);
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 4, 10),
                Spec::new("campus-b", kube_b.path(), 2, 1),
            ])
            .await,
        )
        .await;

    // The sites' golden disks are observed from the server's start: the admin sees where.
    let admin = token("root", Role::Admin);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, capacity) = s.get("/api/admin/capacity", &admin).await;
        assert_eq!(status, 200, "{capacity}");
        if site_named(&capacity, "campus-b")["golden_disks_ready"] == json!(["golden"]) {
            assert_eq!(
                site_named(&capacity, "campus-a")["golden_disks_ready"],
                json!([]),
                "{capacity}"
            );
            break;
        }
        assert!(Instant::now() < until, "never observed: {capacity}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // campus-a has 4 × 10 free, campus-b 2 × 1; the golden disk is ready on campus-b only.
    let (sid, t, site) = start_lesson(&s, "alice", "golden").await;
    assert_eq!(site, "campus-b");
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &t).await;
    assert_eq!(
        (v["disk"]["kind"].as_str(), v["disk"]["reason"].as_str()),
        (Some("golden"), Some("ready")),
        "{v}"
    );
    assert!(sim_b.get("virtualmachines", NS, &vm_of(&sid)).is_some());
    // A lesson on a container disk goes by free places and weight.
    let (_, _, site) = start_on(&s, "bob").await;
    assert_eq!(site, "campus-a");
    s.stop().await;
}

#[tokio::test]
async fn the_pool_of_a_lesson_that_needs_a_site_label_prepares_on_the_site_that_has_it() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.lessons = labelled_lessons();
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 4, 10),
                Spec::new("campus-b", kube_b.path(), 4, 1).labels(&["kvm-large"]),
            ])
            .await,
        )
        .await;
    let admin = token("root", Role::Admin);
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, v) = s.get("/api/admin/pools/large-pooled", &admin).await;
        assert_eq!(status, 200, "{v}");
        if v["ready"].as_u64() == Some(1) {
            break;
        }
        assert!(Instant::now() < until, "the member was never ready: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sim_b.stats().vms, 1, "{:?}", sim_b.stats());
    assert_eq!(w.sim.stats().vms, 0, "nothing prepared on campus-a");

    // A student takes the member on campus-b.
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "large-pooled"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "running", "served by the pool: {v}");
    let sid = v["id"].as_str().unwrap();
    assert_eq!(row_site(&w, sid).await, "campus-b");
    assert!(sim_b.get("virtualmachines", NS, &vm_of(sid)).is_some());
    s.stop().await;
}

#[tokio::test]
async fn three_sites_of_one_place_take_one_start_each_and_a_freed_place_on_a_live_site_is_taken_after_one_is_lost()
 {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let (sim_c, kube_c) = sim_with(|_| {}).await;
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let one = |name, kubeconfig| Spec::new(name, kubeconfig, 1, 1);
    let s = w
        .serve_sites(
            config,
            sites(&[
                one("campus-a", w.kubeconfig.path()),
                one("campus-b", kube_b.path()),
                one("campus-c", kube_c.path()),
            ])
            .await,
        )
        .await;

    let mut started = Vec::new();
    for user in ["u1", "u2", "u3"] {
        started.push(start_on(&s, user).await);
    }
    let mut placed: Vec<&str> = started.iter().map(|(_, _, site)| site.as_str()).collect();
    placed.sort_unstable();
    assert_eq!(placed, ["campus-a", "campus-b", "campus-c"]);
    for (sim, name) in [
        (&w.sim, "campus-a"),
        (&sim_b, "campus-b"),
        (&sim_c, "campus-c"),
    ] {
        assert_eq!(sim.stats().vms, 1, "{name}: {:?}", sim.stats());
    }
    // Every site full: the usual capacity answer, the three limits added up.
    let (status, e) = refused(&s, "u4", "quick").await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );
    assert!(e["message"].as_str().unwrap().contains("3 of 3 VMs"), "{e}");

    // campus-c is lost; the session on campus-b finishes.
    sim_c.stop();
    let (sid_b, t_b, _) = started
        .iter()
        .find(|(_, _, site)| site == "campus-b")
        .unwrap();
    finish(&s, sid_b, t_b).await;
    assert_eq!(sim_b.stats().vms, 0);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (sid, _, site) = start_on(&s, "u4").await;
    assert_eq!(site, "campus-b", "the freed place on the site that answers");
    assert!(sim_b.get("virtualmachines", NS, &vm_of(&sid)).is_some());
    // Nothing else is free: the next start is refused with the capacity answer.
    let (status, e) = refused(&s, "u5", "quick").await;
    assert_eq!(
        (status, e["error"].as_str()),
        (503, Some("capacity")),
        "{e}"
    );
    s.stop().await;
}

/// A start whose capacity check waited on the database while its chosen site was lost is
/// placed again, on the site that answers, not on the site its listing saw before the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_that_waited_for_the_capacity_lock_while_its_site_was_lost_goes_to_the_other_site()
{
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let s = w
        .serve_sites(
            config,
            sites(&[
                Spec::new("campus-a", w.kubeconfig.path(), 2, 5),
                Spec::new("campus-b", kube_b.path(), 2, 1),
            ])
            .await,
        )
        .await;
    // Another replica holds campus-a's capacity lock (a long count, a stalled connection).
    let store = w.db.store().await.unwrap();
    let held = store
        .lock_capacity_of_site(&"campus-a".parse().unwrap())
        .await
        .unwrap();
    let (db, connection) = tokio_postgres::connect(w.db.url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let t = token("alice", Role::Student);
    let start = s.post("/api/sessions", &t, json!({ "lesson": "quick" }));
    let lose_a_while_the_start_waits = async {
        // The start listed campus-a (it answered) and waits for its lock.
        let waiting = Instant::now();
        loop {
            let row = db
                .query_one(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted",
                    &[],
                )
                .await
                .unwrap();
            if row.get::<_, i64>(0) > 0 {
                break;
            }
            assert!(
                waiting.elapsed() < Duration::from_secs(20),
                "the start never waited for campus-a's capacity lock"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Then campus-a's API server goes away, and the lock is let go only after it.
        w.sim.stop();
        tokio::time::sleep(Duration::from_millis(3500)).await;
        held.rollback().await.unwrap();
    };
    let ((status, v), ()) = tokio::join!(start, lose_a_while_the_start_waits);
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().expect("a session id").to_owned();
    assert_eq!(
        row_site(&w, &sid).await,
        "campus-b",
        "placed on the site that answers"
    );
    let running = s.wait_session(&sid, &t, |v| v["status"] == "running").await;
    assert_eq!(running["site"], "campus-b", "{running}");
    assert!(sim_b.get("virtualmachines", NS, &vm_of(&sid)).is_some());
    drop(db);
    connection.abort();
    s.stop().await;
}

/// A server started while its preferred site hangs sends a pod lab to the site whose probe
/// answered, not to the site it has not heard from yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_while_a_site_hangs_sends_pod_labs_to_the_site_that_answered() {
    let w = World::new().await;
    let (sim_b, kube_b) = sim_with(|_| {}).await;
    // campus-a's API server is behind a link that has gone silent (no answer, no RST).
    let link =
        ttlab_testkit::FaultProxy::start(ttlab_testkit::Upstream::Tcp(w.sim.addr())).unwrap();
    link.set_mode(ttlab_testkit::FaultMode::Blackhole);
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let mut configured = sites(&[
        Spec::new("campus-a", w.kubeconfig.path(), 2, 5),
        Spec::new("campus-b", kube_b.path(), 2, 1),
    ])
    .await;
    configured[0] = SiteRuntime::connected(
        configured[0].site().clone(),
        w.cluster_through(link.addr()).await,
    );
    let s = w.serve_sites(config, configured).await;
    // campus-b's first probe answered; campus-a's is still waiting (5 s budget).
    let until = Instant::now() + Duration::from_secs(4);
    loop {
        let (_, cluster) = s
            .raw("GET", "/healthz/cluster", None, None, Vec::new())
            .await;
        let sites = cluster["sites"].as_array().cloned().unwrap_or_default();
        let reachable = |name: &str| {
            sites
                .iter()
                .find(|h| h["site"] == name)
                .map(|h| h["reachable"].clone())
        };
        if reachable("campus-b") == Some(Value::Bool(true)) {
            assert_eq!(
                reachable("campus-a"),
                Some(Value::Null),
                "campus-a's first probe has not ended: {cluster}"
            );
            break;
        }
        assert!(
            Instant::now() < until,
            "campus-b never answered a probe: {cluster}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &t, json!({ "lesson": "shell" }))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["site"], "campus-b", "{v}");
    let sid = v["id"].as_str().unwrap().to_owned();
    assert_eq!(row_site(&w, &sid).await, "campus-b");
    let running = s.wait_session(&sid, &t, |v| v["status"] == "running").await;
    assert_eq!(running["site"], "campus-b", "{running}");
    let pod = running["nodes"][0]["vm"].as_str().unwrap();
    assert!(sim_b.get("pods", NS, pod).is_some(), "{running}");
    s.stop().await;
}
