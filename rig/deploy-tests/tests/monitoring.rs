//! The monitoring component (`deploy/components/monitoring`): it renders, alone and in each
//! overlay; its alerts pass `promtool check rules` and the unit tests beside them
//! (`promtool test rules alerts.test.yaml`); and every metric an alert or a dashboard panel
//! names is one the binaries really export, as scraped from a running `ttlab-server` and
//! `ttlab-reaper` after a session was started, graded and reaped.
//!
//! Without `kubectl`, `promtool` (Debian's `prometheus` package) or the built binaries the
//! tests say so with [`ttlab_testkit::skip_or_fail`]: a `SKIPPED:` line, or a failure under
//! `CI=true` (`.ci/run` installs and builds them).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use ttlab_deploy_tests::promql::{Exposition, Selector, selectors};
use ttlab_deploy_tests::{Rendered, deploy_dir, kustomize, repo_root, selects, string_map};
use ttlab_kube_sim::resources::TYPES;
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_store::ephemeral::PgCluster;

use common::{
    ENVIRONMENTS, binaries_dir, binary, free_port, http, kubectl_or_skip, render_overlay,
    render_with_components, start,
};

/// The labels Prometheus adds to every series from the scrape target a ServiceMonitor finds;
/// the binaries do not export them.
const TARGET_LABELS: &[&str] = &[
    "namespace",
    "pod",
    "instance",
    "job",
    "service",
    "endpoint",
    "container",
];

/// Where the runbooks' headings are linked from.
const RUNBOOKS_URL: &str = "https://github.com/ttlab/ttlab/blob/main/docs/runbooks.md#";

/// `promtool` if it is on `PATH`, else `None` after saying so.
fn promtool_or_skip() -> Option<PathBuf> {
    let found = ttlab_testkit::which("promtool");
    if found.is_none() {
        ttlab_testkit::skip_or_fail(
            "promtool is not on PATH, so the alerts were not checked (install Debian's \
             `prometheus` package; .ci/run does)",
        );
    }
    found
}

/// `kubectl kustomize deploy/components/monitoring`.
fn render_component() -> Option<Rendered> {
    let kubectl = kubectl_or_skip()?;
    Some(Rendered::new(
        kustomize(&kubectl, &deploy_dir("components/monitoring")).unwrap_or_else(|e| panic!("{e}")),
    ))
}

/// Every alerting rule of the PrometheusRule.
fn alerts(rendered: &Rendered) -> Vec<Value> {
    rendered.get("PrometheusRule", "ttlab")["spec"]["groups"]
        .as_array()
        .expect("the rule's groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .filter(|r| r.get("alert").is_some())
        .collect()
}

/// The dashboard, from its generated ConfigMap.
fn dashboard(rendered: &Rendered) -> Value {
    let cm = rendered.get("ConfigMap", "ttlab-dashboard");
    serde_json::from_str(cm["data"]["ttlab.json"].as_str().expect("ttlab.json")).unwrap()
}

/// Every PromQL query of the dashboard: panel targets and the templating queries.
fn dashboard_queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().into_iter().flatten() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("panel {:?}", panel["title"].as_str().unwrap_or_default()),
                target["expr"].as_str().unwrap_or_default().to_owned(),
            ));
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] == "query" {
            out.push((
                format!(
                    "variable {:?}",
                    variable["name"].as_str().unwrap_or_default()
                ),
                variable["query"]["query"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            ));
        }
    }
    out
}

/// The selectors a query reads: PromQL, or Grafana's `label_values(metric, label)`, whose
/// label must exist on the metric.
fn query_selectors(query: &str) -> Vec<Selector> {
    if let Some(args) = query
        .strip_prefix("label_values(")
        .and_then(|r| r.strip_suffix(')'))
    {
        let (metric, label) = args.split_once(',').expect("label_values(metric, label)");
        return vec![Selector {
            name: metric.trim().to_owned(),
            matchers: vec![(label.trim().to_owned(), "=~".to_owned(), ".+".to_owned())],
        }];
    }
    selectors(query)
}

/// GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces as hyphens.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn github_anchors_are_made_as_github_makes_them() {
    assert_eq!(
        anchor("4. A reaper restarts over and over (`/healthz` stalled)"),
        "4-a-reaper-restarts-over-and-over-healthz-stalled"
    );
    assert_eq!(
        anchor("6. A VM stuck terminating (its session stays `finishing`)"),
        "6-a-vm-stuck-terminating-its-session-stays-finishing"
    );
}

#[test]
fn the_component_renders_alone_and_in_each_overlay_and_the_overlays_leave_it_out() {
    let Some(component) = render_component() else {
        return;
    };
    let mut kinds: Vec<String> = component
        .objects
        .iter()
        .map(|o| o["kind"].as_str().unwrap_or_default().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [
            "ConfigMap",
            "PrometheusRule",
            "ServiceMonitor",
            "ServiceMonitor"
        ]
    );
    let cm = component.get("ConfigMap", "ttlab-dashboard");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let board = dashboard(&component);
    assert_eq!(board["uid"], "ttlab");
    let datasource = board["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["type"] == "datasource")
        .expect("a data source variable");
    assert_eq!(datasource["name"], "datasource");
    for panel in board["panels"].as_array().unwrap() {
        if panel["type"] == "row" {
            continue;
        }
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {}: its data source is the variable",
            panel["title"]
        );
        assert!(
            !panel["targets"].as_array().unwrap().is_empty(),
            "panel {} queries nothing",
            panel["title"]
        );
    }

    for env in ENVIRONMENTS {
        // As shipped, the overlays leave the component out: its kinds would fail
        // `kubectl apply -k` on a cluster without the Prometheus Operator.
        let Some(shipped) = render_overlay(env) else {
            return;
        };
        for kind in ["ServiceMonitor", "PrometheusRule"] {
            assert_eq!(shipped.of_kind(kind).count(), 0, "{env}: {kind}");
        }
        // Enabled, its objects land in the backend namespace, and each ServiceMonitor finds
        // the Service of its binary by label and port name.
        let Some(rendered) = render_with_components(env, &["monitoring"]) else {
            return;
        };
        let backend = format!("ttlab-{env}");
        for (monitor, service, port) in [
            ("ttlab-server", "ttlab-server-ops", "ops"),
            ("ttlab-reaper", "ttlab-reaper-metrics", "metrics"),
        ] {
            let sm = rendered.get("ServiceMonitor", monitor);
            assert_eq!(sm["metadata"]["namespace"], backend.as_str());
            let matching: Vec<&Value> = rendered
                .of_kind("Service")
                .filter(|s| {
                    selects(
                        &sm["spec"]["selector"],
                        &string_map(&s["metadata"]["labels"]),
                    )
                })
                .filter(|s| {
                    s["spec"]["ports"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|p| p["name"] == port)
                })
                .collect();
            assert_eq!(
                matching
                    .iter()
                    .map(|s| s["metadata"]["name"].as_str().unwrap())
                    .collect::<Vec<_>>(),
                [service],
                "{env}: {monitor}"
            );
            assert_eq!(sm["spec"]["endpoints"][0]["port"], port);
            assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
        }
        assert_eq!(
            rendered.get("PrometheusRule", "ttlab")["metadata"]["namespace"],
            backend.as_str()
        );
        assert_eq!(
            rendered.get("ConfigMap", "ttlab-dashboard")["metadata"]["namespace"],
            backend.as_str()
        );
        // With the reaper as a CronJob as well, there is no reaper Service to scrape.
        let Some(both) = render_with_components(env, &["reaper-cronjob", "monitoring"]) else {
            return;
        };
        assert!(
            both.names_of("Service")
                .iter()
                .all(|s| s != "ttlab-reaper-metrics")
        );
        assert_eq!(both.of_kind("ServiceMonitor").count(), 2);
    }
}

#[test]
fn the_alerts_pass_promtool_check_and_their_unit_tests_and_link_their_runbooks() {
    let Some(rendered) = render_component() else {
        return;
    };
    let Some(promtool) = promtool_or_skip() else {
        return;
    };
    let rule = rendered.get("PrometheusRule", "ttlab");
    let dir = tempfile::tempdir().unwrap();
    let rules = json!({"groups": rule["spec"]["groups"]});
    std::fs::write(
        dir.path().join("rules.yaml"),
        serde_norway::to_string(&rules).unwrap(),
    )
    .unwrap();
    let tests = deploy_dir("components/monitoring/alerts.test.yaml");
    std::fs::copy(&tests, dir.path().join("alerts.test.yaml")).unwrap();

    for args in [
        ["check", "rules", "rules.yaml"],
        ["test", "rules", "alerts.test.yaml"],
    ] {
        let out = Command::new(&promtool)
            .args(args)
            .current_dir(dir.path())
            .output()
            .unwrap();
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        println!("promtool {}:\n{printed}", args.join(" "));
        assert!(
            out.status.success(),
            "promtool {} failed:\n{printed}",
            args.join(" ")
        );
        assert!(printed.contains("SUCCESS"), "{printed}");
    }

    // Every alert: a severity, a wait, what is wrong and what it costs, and a runbook that
    // exists; and a unit test in which it fires and one in which it stays silent.
    let runbooks = std::fs::read_to_string(repo_root().join("docs/runbooks.md")).unwrap();
    let anchors: BTreeSet<String> = runbooks
        .lines()
        .filter_map(|l| l.strip_prefix("## "))
        .map(anchor)
        .collect();
    let unit_tests: Value =
        serde_norway::from_str(&std::fs::read_to_string(&tests).unwrap()).unwrap();
    let mut fired: BTreeSet<String> = BTreeSet::new();
    let mut silent: BTreeSet<String> = BTreeSet::new();
    for case in unit_tests["tests"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().cloned().unwrap_or_default())
    {
        let name = case["alertname"].as_str().unwrap().to_owned();
        match case["exp_alerts"].as_array().map(Vec::len) {
            Some(0) | None => silent.insert(name),
            Some(_) => fired.insert(name),
        };
    }
    let all = alerts(&rendered);
    assert!(all.len() >= 7, "{} alerts", all.len());
    for alert in &all {
        let name = alert["alert"].as_str().unwrap();
        assert!(
            matches!(
                alert["labels"]["severity"].as_str(),
                Some("critical" | "warning")
            ),
            "{name}: severity"
        );
        assert!(alert["for"].as_str().is_some(), "{name}: no `for:`");
        for annotation in ["summary", "description"] {
            assert!(
                alert["annotations"][annotation]
                    .as_str()
                    .is_some_and(|t| t.len() > 20),
                "{name}: {annotation}"
            );
        }
        let url = alert["annotations"]["runbook_url"].as_str().unwrap_or("");
        let section = url
            .strip_prefix(RUNBOOKS_URL)
            .unwrap_or_else(|| panic!("{name}: runbook_url {url:?} is not into docs/runbooks.md"));
        assert!(
            anchors.contains(section),
            "{name}: docs/runbooks.md has no heading #{section}; it has {anchors:?}"
        );
        assert!(
            fired.contains(name),
            "{name} is never fired in alerts.test.yaml"
        );
        assert!(
            silent.contains(name),
            "{name} is never shown silent in alerts.test.yaml"
        );
    }
}

/// The names `e` exports, for failure messages.
fn exported_names(e: &Exposition) -> String {
    e.names.iter().cloned().collect::<Vec<_>>().join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_an_alert_or_a_panel_names_is_exported_by_the_server_or_the_reaper() {
    let (Some(server_bin), Some(reaper_bin), Some(agent_bin)) = (
        binary("ttlab-server"),
        binary("ttlab-reaper"),
        binary("ttlab-agent"),
    ) else {
        return ttlab_testkit::skip_or_fail(&format!(
            "ttlab-server, ttlab-reaper or ttlab-agent is not built in {}; build them first: \
             cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin",
            binaries_dir().display()
        ));
    };
    let (Some(component), Some(rendered)) = (render_component(), render_overlay("prod")) else {
        return;
    };

    // What the alerts and the panels read.
    let mut queries: Vec<(String, String)> = alerts(&component)
        .iter()
        .map(|a| {
            (
                format!("alert {}", a["alert"].as_str().unwrap()),
                a["expr"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    queries.extend(dashboard_queries(&dashboard(&component)));
    let named: BTreeSet<String> = queries
        .iter()
        .flat_map(|(_, q)| query_selectors(q))
        .map(|s| s.name)
        .collect();
    assert!(named.len() > 20, "{named:?}");

    // The binaries with the prod overlay's environment, against kube-sim and a throwaway
    // PostgreSQL (as tests/processes.rs starts them).
    let (mut env, _) = rendered.container_env(rendered.get("Deployment", "ttlab-server"));
    let namespace = env["TTLAB_NAMESPACE"].clone();
    let mut config = SimConfig::for_tests();
    config.namespaces.push(namespace.clone());
    let sim = KubeSim::start(config).await.unwrap();
    for object in &rendered.objects {
        let served = TYPES
            .iter()
            .any(|t| object["apiVersion"] == t.api_version().as_str() && object["kind"] == t.kind);
        if served && object["metadata"]["namespace"] == namespace.as_str() {
            sim.create(object.clone()).unwrap();
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    sim.write_kubeconfig(&kubeconfig, &namespace).unwrap();
    let pg = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .unwrap()
        .expect("a throwaway PostgreSQL (initdb and postgres must be installed)");
    let database_url = pg.create_database("ttlab").await.unwrap();
    let secret = "a-test-secret-of-at-least-thirty-two-bytes";
    let server_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let ops_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let metrics_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()));
    let root = repo_root();
    let path = |p: &Path| p.display().to_string();
    for (k, v) in [
        ("DATABASE_URL", database_url.clone()),
        ("TTLAB_AUTH_SECRET", secret.to_owned()),
        ("KUBECONFIG", path(&kubeconfig)),
        ("TTLAB_LISTEN", server_addr.to_string()),
        ("TTLAB_OPS_LISTEN", ops_addr.to_string()),
        ("TTLAB_METRICS_LISTEN", metrics_addr.to_string()),
        ("TTLAB_LESSONS", path(&root.join("lessons"))),
        ("TTLAB_AGENT_BINARY", path(&agent_bin)),
        ("TTLAB_WEB_DIR", path(&root.join("web"))),
    ] {
        env.insert(k.to_owned(), v);
    }
    let mut server = start(&server_bin, &[], &env, "ttlab-server listening").await;
    let mut reaper = start(&reaper_bin, &[], &env, "cycle in ").await;

    // Activity, so that labelled series exist: a warm pool given to a lesson, a lab claimed
    // from it, the pool emptied (its other member retired), a start that misses it, a
    // grading, and a lab expired and reaped.
    let auth = ttlab_api::auth::AuthConfig::new(
        ttlab_api::auth::AuthSecret::new(secret.as_bytes().to_vec()).unwrap(),
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mint = |user: &str, role| {
        auth.mint(&user.parse().unwrap(), role, now, Duration::from_secs(3600))
            .unwrap()
    };
    let admin = mint("root", ttlab_api::auth::Role::Admin);
    let call = async |method: &str, path: &str, token: &str, body: Option<Value>| {
        let (status, text) = http(server_addr, method, path, Some(token), body.as_ref()).await;
        let value = serde_json::from_str::<Value>(&text).unwrap_or(Value::String(text));
        (status, value)
    };
    let until = async |what: &str, ok: &dyn Fn(&Exposition, &str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let (status, text) = http(ops_addr, "GET", "/metrics", None, None).await;
            assert_eq!(status, 200, "{text}");
            if ok(&Exposition::parse(&text), &text) {
                return;
            }
            assert!(Instant::now() < deadline, "never {what}:\n{text}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    };
    let pool = "/api/admin/pools/systemd-basics";
    let (status, v) = call("PUT", pool, &admin, Some(json!({"size": 2}))).await;
    assert_eq!(status, 200, "{v}");
    until("two pool members ready", &|_, text| {
        text.lines()
            .any(|l| l == "ttlab_pool_ready{lesson=\"systemd-basics\"} 2")
    })
    .await;
    let start = async |user: &str| {
        let token = mint(user, ttlab_api::auth::Role::Student);
        let (status, v) = call(
            "POST",
            "/api/sessions",
            &token,
            Some(json!({"lesson": "systemd-basics"})),
        )
        .await;
        assert_eq!(status, 202, "{v}");
        let id = v["id"].as_str().unwrap().to_owned();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (status, v) = call("GET", &format!("/api/sessions/{id}"), &token, None).await;
            assert_eq!(status, 200, "{v}");
            if v["status"] == "running" {
                return (id, token);
            }
            assert!(Instant::now() < deadline, "the lab never ran: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let (alice, alice_token) = start("alice").await;
    let (status, v) = call("PUT", pool, &admin, Some(json!({"size": 0}))).await;
    assert_eq!(status, 200, "{v}");
    until("the pool emptied, its other members retired", &|e, text| {
        e.names.contains("ttlab_pool_retired_total")
            && text
                .lines()
                .any(|l| l == "ttlab_pool_ready{lesson=\"systemd-basics\"} 0")
            && text
                .lines()
                .any(|l| l == "ttlab_pool_preparing{lesson=\"systemd-basics\"} 0")
    })
    .await;
    start("bob").await;
    let (status, v) = call(
        "POST",
        &format!("/api/sessions/{alice}/grade"),
        &alice_token,
        Some(json!({})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (db, connection) = tokio_postgres::connect(&database_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let moved = db
        .execute(
            "UPDATE sessions SET expires_at = now() WHERE id = $1::text::uuid",
            &[&alice],
        )
        .await
        .unwrap();
    assert_eq!(moved, 1);
    drop(db);
    let _ = connection.await;
    let (status, v) = call("POST", "/api/admin/reaper/collect", &admin, Some(json!({}))).await;
    assert_eq!(status, 200, "collect now: {v}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, v) = call("GET", &format!("/api/sessions/{alice}"), &alice_token, None).await;
        if v["status"] == "expired" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the expired lab was never reaped: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    until("a claim and a miss counted", &|e, _| {
        e.names.contains("ttlab_pool_claims_total") && e.names.contains("ttlab_pool_misses_total")
    })
    .await;

    // Both /metrics, as Prometheus would scrape them.
    let mut exported = Exposition::default();
    for (who, addr) in [("server", ops_addr), ("reaper", metrics_addr)] {
        let (status, text) = http(addr, "GET", "/metrics", None, None).await;
        assert_eq!(status, 200, "{who}: {text}");
        let e = Exposition::parse(&text);
        assert!(e.names.len() > 10, "{who} exports {}", exported_names(&e));
        exported.names.extend(e.names);
        for (name, labels) in e.labels {
            let mine: &mut BTreeMap<String, BTreeSet<String>> =
                exported.labels.entry(name).or_default();
            for (label, values) in labels {
                mine.entry(label).or_default().extend(values);
            }
        }
    }
    let mut problems = Vec::new();
    for (what, query) in &queries {
        for selector in query_selectors(query) {
            for problem in exported.problems(&selector, TARGET_LABELS) {
                problems.push(format!("{what}: {problem}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "names the binaries do not export:\n{}\nexported: {}",
        problems.join("\n"),
        exported_names(&exported)
    );
    println!(
        "{} metrics named by {} alert and panel queries, each exported",
        named.len(),
        queries.len()
    );

    for child in [&mut server, &mut reaper] {
        child.start_kill().unwrap();
        child.wait().await.unwrap();
    }
    sim.shutdown().await;
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .unwrap()
        .unwrap();
}
