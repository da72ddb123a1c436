//! The server against real PostgreSQL, kube-sim over HTTP and the real agent binary.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::{NS, World, policy, token};
use ttlab_api::AgentPath;
use ttlab_api::auth::Role;

fn id(v: &Value) -> String {
    v["id"].as_str().expect("an id").to_owned()
}

#[tokio::test]
async fn a_session_starts_runs_extends_grades_and_finishes() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    assert_eq!(v["status"], "starting");
    assert_eq!(v["lesson"], "quick");
    assert_eq!(v["site"], "default", "{v}");
    let sid = id(&v);

    // A second click names the lab already open.
    let (status, v2) = s
        .post("/api/sessions", &alice, json!({"lesson": "duo"}))
        .await;
    assert_eq!(status, 409, "{v2}");
    assert_eq!(v2["error"], "session_exists");
    assert!(v2["message"].as_str().unwrap().contains("quick"), "{v2}");

    let v = s
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    assert_eq!(v["stage"], "ready");
    for stage in [
        "requested",
        "vm_created",
        "vmi_running",
        "agent_up",
        "ready",
    ] {
        assert!(v["stages"][stage].is_string(), "{stage} missing: {v}");
    }
    assert_eq!(v["disk"]["kind"], "container");
    assert_eq!(v["disk"]["reason"], "not_requested");
    let remaining = v["remaining_seconds"].as_u64().unwrap();
    assert!((3500..=3600).contains(&remaining), "{remaining}");
    assert_eq!(v["extensions_left"], 3);
    // Without a sites file every session is on the one site, `default`: in the student's
    // view, the current session and the admin's list alike.
    assert_eq!(v["site"], "default", "{v}");
    let (status, current) = s.get("/api/sessions/current", &alice).await;
    assert_eq!(status, 200, "{current}");
    assert_eq!(current["site"], "default", "{current}");
    let admin = token("root", Role::Admin);
    let (status, list) = s.get("/api/admin/sessions", &admin).await;
    assert_eq!(status, 200, "{list}");
    let listed: Vec<(&str, &str)> = list
        .as_array()
        .expect("a list")
        .iter()
        .map(|r| (r["id"].as_str().unwrap(), r["site"].as_str().unwrap()))
        .collect();
    assert_eq!(listed, [(sid.as_str(), "default")], "{list}");

    // Extensions: three granted, the fourth refused.
    for n in 1..=3 {
        let (status, e) = s
            .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
            .await;
        assert_eq!(status, 200, "{e}");
        assert_eq!(e["extensions_used"], n);
    }
    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("extension_limit")),
        "{e}"
    );

    // Grading runs through the real agent.
    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2)),
        "{g}"
    );
    assert_eq!(g["steps"][1]["exit_code"], 3);

    // Another student cannot see it; an admin can.
    let bob = token("bob", Role::Student);
    let (status, e) = s.get(&format!("/api/sessions/{sid}"), &bob).await;
    assert_eq!(
        (status, e["error"].as_str()),
        (404, Some("session_not_found"))
    );
    assert_eq!(s.get(&format!("/api/sessions/{sid}"), &admin).await.0, 200);
    let (status, e) = s.delete(&format!("/api/sessions/{sid}"), &bob).await;
    assert_eq!(status, 404, "{e}");

    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{f}");
    assert_eq!(f["status"], "finished", "{f}");
    w.wait_empty().await;
    let (status, _) = s.get("/api/sessions/current", &alice).await;
    assert_eq!(status, 404);

    let (status, stats) = s.get("/api/admin/stats", &admin).await;
    assert_eq!(status, 200, "{stats}");
    assert_eq!(stats["time_to_ready"][0]["seconds"]["count"], 1, "{stats}");
    s.stop().await;
}

#[tokio::test]
async fn through_the_api_servers_port_forward_a_session_runs_and_is_graded_while_its_pod_ip_is_unreachable()
 {
    // The cluster publishes pod and VMI addresses that nothing routes (TEST-NET-1): a server
    // on the `pod-ip` path could not reach any agent.
    let w = World::with(|c| c.unroutable_pod_ips = true).await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.agent_path = AgentPath::Portforward;
    let s = w.serve(config).await;
    let alice = token("alice", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] != "starting")
        .await;
    assert_eq!(v["status"], "running", "{v}");
    for stage in ["vmi_running", "agent_up", "ready"] {
        assert!(v["stages"][stage].is_string(), "{stage} missing: {v}");
    }

    let vm = ttlab_vm_manifest::vm_name(sid.parse().unwrap(), &"vm".parse().unwrap());
    let vmi = w
        .sim
        .get("virtualmachineinstances", NS, &vm)
        .expect("the VMI");
    let published: std::net::Ipv4Addr = vmi["status"]["interfaces"][0]["ipAddress"]
        .as_str()
        .expect("an address")
        .parse()
        .unwrap();
    assert_eq!(published.octets()[..3], [192, 0, 2], "{published}");
    let guest = w.sim.guest_ip(NS, &vm).expect("the guest's own address");
    assert_ne!(guest, published);
    let direct = tokio::time::timeout(
        Duration::from_millis(500),
        tokio::net::TcpStream::connect((published, ttlab_agent::protocol::PORT)),
    )
    .await;
    assert!(
        !matches!(direct, Ok(Ok(_))),
        "the published address answered"
    );

    // Grading runs through the port forward to the real agent.
    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    assert_eq!(
        (g["passed"].as_u64(), g["total"].as_u64()),
        (Some(1), Some(2)),
        "{g}"
    );
    assert_eq!(g["steps"][1]["exit_code"], 3);
    // Every call to the agent went through the API server.
    let forwards = w
        .sim
        .calls()
        .iter()
        .filter(|c| {
            c.resource.contains("portforward") || c.subresource.as_deref() == Some("portforward")
        })
        .count();
    assert!(forwards >= 2, "{forwards} port forwards");

    let (status, f) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{f}");
    assert_eq!(f["status"], "finished", "{f}");
    w.wait_empty().await;
    s.stop().await;
}

#[tokio::test]
async fn extending_past_the_maximum_lifetime_is_refused() {
    let w = World::new().await;
    // The maximum lifetime equals one ttl: the session already runs until its cap, so any
    // extension would pass it (as a fourth extension would pass 180 minutes by default).
    let s = w.server(policy(60, 60, 5), 8).await;
    let alice = token("alice", Role::Student);
    let (_, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    let sid = id(&v);
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] == "running")
        .await;
    assert_eq!(v["expires_at"], v["max_expires_at"]);
    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("max_lifetime")),
        "{e}"
    );
    let (_, after) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(
        after["extensions_used"], 0,
        "a refused extension uses nothing"
    );
    s.stop().await;
}

#[tokio::test]
async fn auth_and_bad_input_are_4xx_with_the_error_body() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let alice = token("alice", Role::Student);

    // alg none, a wrong key, expired, missing claims, garbage.
    let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJhbGljZSIsInJvbGUiOiJhZG1pbiIsImV4cCI6NDEwMjQ0NDgwMH0.";
    let other =
        ttlab_api::auth::AuthConfig::new(ttlab_api::auth::AuthSecret::new(vec![9u8; 32]).unwrap())
            .mint(
                &"alice".parse().unwrap(),
                Role::Admin,
                1_900_000_000,
                Duration::from_secs(60),
            )
            .unwrap();
    let expired = support::auth()
        .mint(
            &"alice".parse().unwrap(),
            Role::Student,
            1_000_000_000,
            Duration::from_secs(60),
        )
        .unwrap();
    let no_role = {
        use base64::Engine as _;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let head = b64.encode(br#"{"alg":"HS256","typ":"JWT"}"#);
        let body = b64.encode(br#"{"sub":"alice","exp":4102444800}"#);
        let signed = format!("{head}.{body}");
        // HMAC-SHA256 by hand: the test forges its tokens without the server's code.
        use hmac::Mac as _;
        let mut mac =
            <hmac::Hmac<sha2::Sha256> as hmac::KeyInit>::new_from_slice(support::SECRET).unwrap();
        mac.update(signed.as_bytes());
        let sig = b64.encode(mac.finalize().into_bytes());
        format!("{signed}.{sig}")
    };
    for t in [
        none,
        other.as_str(),
        expired.as_str(),
        no_role.as_str(),
        "x.y.z",
    ] {
        let (status, e) = s.get("/api/lessons", t).await;
        assert_eq!(
            (status, e["error"].as_str()),
            (401, Some("unauthorized")),
            "{t}: {e}"
        );
    }
    let (status, e) = s.raw("GET", "/api/lessons", None, None, vec![]).await;
    assert_eq!((status, e["error"].as_str()), (401, Some("unauthorized")));
    let (status, e) = s.get("/api/admin/sessions", &alice).await;
    assert_eq!((status, e["error"].as_str()), (403, Some("forbidden")));

    let (status, lessons) = s.get("/api/lessons", &alice).await;
    assert_eq!(status, 200);
    assert_eq!(lessons.as_array().unwrap().len(), 6);

    type Case = (
        &'static str,
        Option<&'static str>,
        Vec<u8>,
        u16,
        &'static str,
    );
    let cases: Vec<Case> = vec![
        (
            "POST",
            Some("application/json"),
            b"{not json".to_vec(),
            400,
            "invalid_json",
        ),
        (
            "POST",
            Some("application/json"),
            br#"{"lesson": 5}"#.to_vec(),
            400,
            "invalid_body",
        ),
        (
            "POST",
            Some("application/json"),
            br#"{"lesson": "quick", "x": 1}"#.to_vec(),
            400,
            "unknown_field",
        ),
        (
            "POST",
            Some("application/json"),
            br#"{}"#.to_vec(),
            400,
            "invalid_body",
        ),
        (
            "POST",
            Some("text/plain"),
            br#"{"lesson": "quick"}"#.to_vec(),
            415,
            "unsupported_media_type",
        ),
        (
            "POST",
            Some("application/json"),
            vec![b' '; 100_000],
            413,
            "payload_too_large",
        ),
        (
            "POST",
            Some("application/json"),
            br#"{"lesson": "nope"}"#.to_vec(),
            404,
            "lesson_not_found",
        ),
        (
            "POST",
            Some("application/json"),
            br#"{"lesson": "NOT A LESSON!"}"#.to_vec(),
            404,
            "lesson_not_found",
        ),
    ];
    for (method, ct, body, want, code) in cases {
        let (status, e) = s.raw(method, "/api/sessions", Some(&alice), ct, body).await;
        assert_eq!((status, e["error"].as_str()), (want, Some(code)), "{e}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    for path in ["/api/sessions/not-a-uuid", "/api/sessions/123/extend"] {
        let (status, e) = s.raw("GET", path, Some(&alice), None, vec![]).await;
        assert!(status == 400 || status == 405, "{path}: {status} {e}");
        assert!(e["error"].is_string(), "{e}");
    }
    let (status, e) = s
        .get("/api/sessions/6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a", &alice)
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (404, Some("session_not_found"))
    );
    let (status, e) = s.get("/nowhere", &alice).await;
    assert_eq!((status, e["error"].as_str()), (404, Some("not_found")));
    let admin = token("root", Role::Admin);
    let (status, e) = s.get("/api/admin/sessions?scope=everything", &admin).await;
    assert_eq!((status, e["error"].as_str()), (400, Some("invalid_query")));
    let (status, e) = s.get("/api/admin/sessions?limit=-1", &admin).await;
    assert_eq!((status, e["error"].as_str()), (400, Some("invalid_query")));

    // No reaper runs here: collect-now times out with 504.
    let (status, e) = s.post("/api/admin/reaper/collect", &admin, json!({})).await;
    assert_eq!((status, e["error"].as_str()), (504, Some("timeout")), "{e}");

    assert_eq!(s.raw("GET", "/healthz", None, None, vec![]).await.0, 200);
    let (status, r) = s.raw("GET", "/readyz", None, None, vec![]).await;
    assert_eq!(status, 200, "{r}");
    let (status, m) = s.raw("GET", "/metrics", None, None, vec![]).await;
    assert_eq!(status, 200);
    assert!(
        m.as_str()
            .unwrap()
            .contains("ttlab_capacity_rejections_total"),
        "{m}"
    );
    s.stop().await;
}

#[tokio::test]
async fn the_openapi_document_names_every_route() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let (status, doc) = s.raw("GET", "/api/openapi.json", None, None, vec![]).await;
    assert_eq!(status, 200);
    let routes = [
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/healthz/cluster"),
        ("get", "/metrics"),
        ("get", "/api/openapi.json"),
        ("get", "/api/lessons"),
        ("post", "/api/sessions"),
        ("get", "/api/sessions/current"),
        ("get", "/api/sessions/{id}"),
        ("delete", "/api/sessions/{id}"),
        ("get", "/api/sessions/{id}/events"),
        ("post", "/api/sessions/{id}/extend"),
        ("post", "/api/sessions/{id}/grade"),
        ("post", "/api/sessions/{id}/console-ticket"),
        ("get", "/api/sessions/{id}/console"),
        ("get", "/api/admin/sessions"),
        ("get", "/api/admin/capacity"),
        ("get", "/api/admin/reaper"),
        ("post", "/api/admin/reaper/collect"),
        ("get", "/api/admin/stats"),
        ("get", "/api/admin/sessions/{id}"),
        ("post", "/api/admin/sessions/{id}/end"),
        ("post", "/api/admin/sessions/{id}/extend"),
        ("get", "/api/admin/actions"),
        ("get", "/api/admin/pools"),
        ("get", "/api/admin/pools/{lesson}"),
        ("put", "/api/admin/pools/{lesson}"),
        ("delete", "/api/admin/pools/{lesson}"),
        ("get", "/api/admin/tasks"),
        ("get", "/api/admin/classes"),
        ("post", "/api/admin/classes"),
        ("get", "/api/admin/classes/{id}"),
        ("patch", "/api/admin/classes/{id}"),
        ("delete", "/api/admin/classes/{id}"),
        ("get", "/api/waitlist"),
        ("post", "/api/waitlist"),
        ("delete", "/api/waitlist"),
        ("get", "/api/waitlist/events"),
    ];
    for (method, path) in routes {
        assert!(
            doc["paths"][path][method].is_object(),
            "{method} {path} missing"
        );
        // And the route exists: anything but the router's own 404.
        let concrete = path
            .replace("{id}", "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a")
            .replace("{lesson}", "quick");
        let (status, body) = s
            .raw(
                &method.to_uppercase(),
                &concrete,
                None,
                Some("application/json"),
                b"{}".to_vec(),
            )
            .await;
        assert!(
            body.get("error") != Some(&json!("not_found")),
            "{method} {path}: {status}"
        );
    }
    let documented: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|p| {
            p.as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "parameters")
                .count()
        })
        .sum();
    assert_eq!(documented, routes.len());
    s.stop().await;
}
