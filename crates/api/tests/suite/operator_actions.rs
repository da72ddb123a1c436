//! The extend window and the operators' actions on a session, against real PostgreSQL,
//! kube-sim over HTTP and the real agent binary: a student's extension before the window is
//! refused with when it opens; an operator extends beyond the student's extensions, capped at
//! the maximum lifetime and recorded; an operator ends a session and its objects are
//! reclaimed; students get 403 from every operator route.

use crate::support;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};
use support::{World, policy, sql, start_running, token, windowed_policy};
use ttlab_api::auth::Role;

fn instant(v: &Value) -> DateTime<Utc> {
    v.as_str()
        .unwrap_or_else(|| panic!("not an instant: {v}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn extending_before_the_window_is_refused_with_when_it_opens() {
    let w = World::new().await;
    // 60 minutes, at most 180, extended only in the last 15.
    let s = w.server(windowed_policy(3600, 3 * 3600, 3, 900), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;

    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let expires_at = instant(&v["expires_at"]);
    let opens_at = expires_at - chrono::TimeDelta::seconds(900);
    assert_eq!(v["extend"]["available"], false, "{v}");
    assert_eq!(v["extend"]["refusal"]["code"], "not_yet", "{v}");
    assert_eq!(instant(&v["extend"]["opens_at"]), opens_at);
    assert_eq!(v["extend"]["window_seconds"], 900);

    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!((status, e["error"].as_str()), (409, Some("not_yet")), "{e}");
    assert_eq!(instant(&e["opens_at"]), opens_at, "{e}");
    let message = e["message"].as_str().unwrap();
    assert!(
        message.contains("last 15m") && message.contains("opens at"),
        "{message}"
    );
    let (_, after) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(after["extensions_used"], 0, "a refusal uses no extension");
    assert_eq!(after["expires_at"], v["expires_at"]);

    // Ten minutes before the expiry the window is open: the view says what extending gains,
    // and extending gains exactly that (give or take the time between the two requests).
    let moved = sql(
        &w,
        "UPDATE sessions SET expires_at = now() + interval '10 minutes' WHERE id = $1::text::uuid",
        &sid,
    )
    .await;
    assert_eq!(moved, 1);
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["extend"]["available"], true, "{v}");
    let gain = v["extend"]["gain_seconds"].as_u64().unwrap();
    assert!((3000..=3001).contains(&gain), "gain {gain}: {v}");
    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{e}");
    assert_eq!(e["extensions_used"], 1);
    let gained = (instant(&e["expires_at"]) - instant(&v["expires_at"])).num_seconds();
    assert!((3000..=3005).contains(&gained), "gained {gained}");
    // Now 60 minutes are left: the window is shut again until 15 minutes before the expiry.
    assert_eq!(e["extend"]["refusal"]["code"], "not_yet", "{e}");
    s.stop().await;
}

#[tokio::test]
async fn an_operator_extends_beyond_the_students_extensions_capped_and_recorded() {
    let w = World::new().await;
    // No student extensions at all; at most 4,000 s from the start.
    let s = w.server(policy(3600, 4000, 0), 8).await;
    let admin = token("root-admin", Role::Admin);
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("extension_limit")),
        "{e}"
    );

    let (status, g) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{g}");
    let (_, before) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let (status, r) = s
        .post(
            &format!("/api/admin/sessions/{sid}/extend"),
            &admin,
            json!({"minutes": 5, "reason": "lost five minutes to a failed start"}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["action"]["added_seconds"], 300, "{r}");
    assert_eq!(r["action"]["admin"], "root-admin");
    assert_eq!(
        r["session"]["extensions_used"], 0,
        "no student extension used"
    );
    assert_eq!(
        (instant(&r["session"]["expires_at"]) - instant(&before["expires_at"])).num_seconds(),
        300
    );
    // The student sees the later expiry too.
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["expires_at"], r["session"]["expires_at"]);

    // Asking for an hour more gets what the maximum lifetime allows (100 s), recorded as such.
    let (status, r) = s
        .post(
            &format!("/api/admin/sessions/{sid}/extend"),
            &admin,
            json!({"minutes": 60, "reason": "the class runs late"}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["action"]["added_seconds"], 100, "{r}");
    assert_eq!(r["session"]["expires_at"], r["session"]["max_expires_at"]);
    // At the cap nothing more can be added.
    let (status, e) = s
        .post(
            &format!("/api/admin/sessions/{sid}/extend"),
            &admin,
            json!({"minutes": 1, "reason": "once more"}),
        )
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("max_lifetime")),
        "{e}"
    );
    // A reason is required, and the minutes must make sense; neither changes anything.
    for (body, code) in [
        (json!({"minutes": 5, "reason": "  "}), "reason_required"),
        (json!({"minutes": 0, "reason": "x"}), "invalid_minutes"),
    ] {
        let (status, e) = s
            .post(&format!("/api/admin/sessions/{sid}/extend"), &admin, body)
            .await;
        assert_eq!((status, e["error"].as_str()), (400, Some(code)), "{e}");
    }

    // The audit trail: in the session's detail and in the recent actions, oldest first there.
    let (status, d) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    assert_eq!(status, 200, "{d}");
    let actions = d["actions"].as_array().unwrap();
    assert_eq!(actions.len(), 2, "{d}");
    assert_eq!(actions[0]["reason"], "lost five minutes to a failed start");
    assert_eq!(actions[0]["action"], "extend");
    assert!(actions[0]["at"].is_string());
    assert_eq!(actions[1]["added_seconds"], 100);
    assert_eq!(d["reference"], &sid[..8]);
    assert!(
        d["objects"]
            .as_array()
            .unwrap()
            .iter()
            .any(|o| o["kind"] == "VirtualMachine"),
        "{d}"
    );
    assert_eq!(d["stages"][0]["stage"], "requested");
    // The grading history: the lesson "quick" has one check that passes and one that fails.
    assert_eq!(d["grading"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(d["grading"][0]["passed"], 1);
    assert_eq!(d["grading"][0]["total"], 2);
    assert_eq!(d["grading"][0]["failed"], json!(["fails"]));
    let (status, recent) = s.get("/api/admin/actions?limit=10", &admin).await;
    assert_eq!(status, 200, "{recent}");
    assert_eq!(recent[0]["added_seconds"], 100, "newest first: {recent}");
    assert_eq!(recent.as_array().unwrap().len(), 2);
    s.stop().await;
}

#[tokio::test]
async fn an_operator_ends_a_session_and_its_objects_are_reclaimed() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let admin = token("root-admin", Role::Admin);
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    assert!(w.leftovers() > 0, "the VM exists");

    let (status, r) = s
        .post(
            &format!("/api/admin/sessions/{sid}/end"),
            &admin,
            json!({"reason": "left running after class"}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["action"]["action"], "end");
    let v = s
        .wait_session(&sid, &alice, |v| v["status"] == "finished")
        .await;
    assert_eq!(v["status"], "finished");
    w.wait_empty().await;
    let (status, e) = s
        .post(
            &format!("/api/admin/sessions/{sid}/end"),
            &admin,
            json!({"reason": "again"}),
        )
        .await;
    assert_eq!(
        (status, e["error"].as_str()),
        (409, Some("not_live")),
        "{e}"
    );
    let (_, d) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    assert_eq!(d["actions"].as_array().unwrap().len(), 1, "{d}");
    assert_eq!(d["actions"][0]["reason"], "left running after class");
    assert_eq!(d["objects"], json!([]), "nothing of it is left: {d}");
    // The student can open a new lab at once.
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "quick"}))
        .await;
    assert_eq!(status, 202, "{v}");
    s.stop().await;
}

#[tokio::test]
async fn students_get_403_from_every_operator_route_and_nothing_changes() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let (_, before) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    for (method, path, body) in [
        ("GET", format!("/api/admin/sessions/{sid}"), json!({})),
        (
            "POST",
            format!("/api/admin/sessions/{sid}/end"),
            json!({"reason": "mine"}),
        ),
        (
            "POST",
            format!("/api/admin/sessions/{sid}/extend"),
            json!({"minutes": 30, "reason": "mine"}),
        ),
        ("GET", "/api/admin/actions".to_owned(), json!({})),
    ] {
        let (status, e) = match method {
            "GET" => s.get(&path, &alice).await,
            _ => s.post(&path, &alice, body).await,
        };
        assert_eq!(
            (status, e["error"].as_str()),
            (403, Some("forbidden")),
            "{method} {path}: {e}"
        );
    }
    let (_, after) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(after["status"], "running");
    assert_eq!(after["expires_at"], before["expires_at"]);
    s.stop().await;
}

#[tokio::test]
async fn a_server_failure_tells_the_student_a_plain_message_with_a_reference() {
    let w = World::new().await;
    let s = w.server(policy(3600, 7200, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    // The VM's agent dies: grading fails on the server's side (502) with a plain sentence
    // and a reference, never the agent's address.
    let (_, view) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let vm = view["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let pid = w
        .sim
        .agent_pid(support::NS, &vm)
        .expect("the guest agent runs");
    let killed = std::process::Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let (status, e) = s
        .post(&format!("/api/sessions/{sid}/grade"), &alice, json!({}))
        .await;
    assert!(status >= 500, "{status} {e}");
    let reference = e["reference"].as_str().expect("a reference").to_owned();
    assert_eq!(reference.len(), 8);
    let message = e["message"].as_str().unwrap();
    assert!(
        message.ends_with(&format!("(reference {reference})")),
        "{message}"
    );
    assert!(
        !message.contains("://") && !message.contains(":8899"),
        "{message}"
    );

    // A lab that fails to start: the student reads the plain reason and a reference, the
    // start of the session id that the provisioning's log lines carry.
    let bob = token("bob", Role::Student);
    let (status, v) = s
        .post("/api/sessions", &bob, json!({ "lesson": "broken" }))
        .await;
    assert_eq!(status, 202, "{v}");
    let bid = v["id"].as_str().unwrap().to_owned();
    let v = s
        .wait_session(&bid, &bob, |v| v["status"] == "failed")
        .await;
    assert_eq!(v["reference"], &bid[..8], "{v}");
    s.stop().await;
}
