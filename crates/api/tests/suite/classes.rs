//! Scheduled classes through the real server on kube-sim and a real PostgreSQL: bad input is
//! refused with the field and why and changes nothing; overlapping classes beyond capacity are
//! accepted with how many seats can be warm; a running class changes its end and seats only;
//! a class's members are ready for its students, who take them first, while students outside
//! the class never drain them, and a wrong join code is a clear 422.

use crate::support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, TimeDelta, Utc};
use serde_json::{Value, json};
use support::{LESSONS, Running, World, policy, token};
use ttlab_api::auth::Role;
use ttlab_lesson::LessonSet;
use ttlab_model::{ClassId, SessionId};

/// A single-node lesson with a pool of two of its own.
const POOLED: &str = r#"
id: pooled
title: Pooled
runtime: vm
image: quay.io/containerdisks/debian:12
memory: 256Mi
readiness_timeout_seconds: 15
setup_timeout_seconds: 5
pool:
  size: 2
grading:
  - name: passes
    command: "true"
"#;

fn lessons() -> LessonSet {
    LessonSet::from_sources([
        ("test.yaml".into(), LESSONS.to_owned()),
        ("pooled.yaml".into(), POOLED.to_owned()),
    ])
    .unwrap()
}

async fn server(w: &World, vm_limit: usize) -> Running {
    let mut config = w.config(policy(3600, 7200, 3), vm_limit).await;
    config.lessons = lessons();
    w.serve(config).await
}

fn admin() -> String {
    token("operator", Role::Admin)
}

fn at(t: DateTime<Utc>) -> String {
    t.to_rfc3339()
}

async fn send(s: &Running, method: &str, path: &str, body: Value) -> (u16, Value) {
    s.raw(
        method,
        path,
        Some(&admin()),
        Some("application/json"),
        serde_json::to_vec(&body).unwrap(),
    )
    .await
}

async fn classes(s: &Running) -> Vec<Value> {
    let (status, v) = s.get("/api/admin/classes", &admin()).await;
    assert_eq!(status, 200, "{v}");
    v["classes"].as_array().unwrap().clone()
}

/// A refusal: the status, the error code and field, and a message containing `says`.
fn refused(got: &(u16, Value), status: u16, code: &str, field: Option<&str>, says: &str) {
    let (s, v) = got;
    assert_eq!(*s, status, "{v}");
    assert_eq!(v["error"], code, "{v}");
    if let Some(field) = field {
        assert_eq!(v["field"], field, "{v}");
    }
    let message = v["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{message:?} does not say {says:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_class_input_is_refused_with_the_field_and_why_and_nothing_changes() {
    let w = World::new().await;
    // Limit 3; the largest VM lesson (duo) keeps 2 places for a cold start.
    let s = server(&w, 3).await;
    let now = Utc::now();
    let start = now + TimeDelta::hours(2);
    let good = json!({
        "lesson": "quick", "title": "Intro 10:00", "seats": 10,
        "starts_at": at(start), "ends_at": at(start + TimeDelta::hours(1)),
    });
    let with = |field: &str, value: Value| {
        let mut b = good.clone();
        b[field] = value;
        b
    };
    let cases: Vec<(Value, u16, &str, Option<&str>, &str)> = vec![
        (
            with("ends_at", json!(at(start))),
            422,
            "invalid_class",
            Some("ends_at"),
            "must be after starts_at",
        ),
        (
            with("ends_at", json!(at(start - TimeDelta::minutes(30)))),
            422,
            "invalid_class",
            Some("ends_at"),
            "must be after starts_at",
        ),
        (
            with("ends_at", json!(at(start + TimeDelta::hours(13)))),
            422,
            "invalid_class",
            Some("ends_at"),
            "a class lasts at most 12 hours",
        ),
        (
            with("starts_at", json!(at(now - TimeDelta::hours(1)))),
            422,
            "invalid_class",
            Some("starts_at"),
            "is in the past",
        ),
        (
            with("starts_at", json!("tomorrow at ten")),
            422,
            "invalid_class",
            Some("starts_at"),
            "must be an RFC 3339 time",
        ),
        (
            with("seats", json!(0)),
            422,
            "invalid_class",
            Some("seats"),
            "a class needs at least 1 seat, got 0",
        ),
        (
            with("seats", json!(-3)),
            422,
            "invalid_class",
            Some("seats"),
            "a class needs at least 1 seat, got -3",
        ),
        (
            with("seats", json!(501)),
            422,
            "invalid_class",
            Some("seats"),
            "a class has at most 500 seats, got 501",
        ),
        (
            with("seats", Value::Null),
            422,
            "invalid_class",
            Some("seats"),
            "seats is required",
        ),
        (
            with("lesson", json!("no-such-lesson")),
            422,
            "unknown_lesson",
            Some("lesson"),
            "there is no lesson \"no-such-lesson\"",
        ),
        (
            with("lesson", json!("shell")),
            422,
            "not_pooled",
            Some("lesson"),
            "shell is a pod lesson",
        ),
        (
            with("lesson", json!("duo")),
            422,
            "not_pooled",
            Some("lesson"),
            "a lab of duo takes 2 VM(s); with the VM limit 3 and 2 kept for a cold start, none \
             can be prepared ahead",
        ),
        (
            with("title", json!("")),
            422,
            "invalid_class",
            Some("title"),
            "a title has 1 to 100 characters",
        ),
        (
            with("join_code", json!("a b")),
            422,
            "invalid_class",
            Some("join_code"),
            "a join code has 4 to 32 letters, digits or dashes",
        ),
        (
            with("room", json!("B12")),
            400,
            "unknown_field",
            None,
            "unknown field `room`",
        ),
    ];
    for (body, status, code, field, says) in cases {
        let got = send(&s, "POST", "/api/admin/classes", body.clone()).await;
        refused(&got, status, code, field, says);
    }
    // A student may not schedule one.
    let (status, _) = s
        .post(
            "/api/admin/classes",
            &token("student", Role::Student),
            good.clone(),
        )
        .await;
    assert_eq!(status, 403);
    assert!(classes(&s).await.is_empty(), "nothing was scheduled");
    let store = w.db.store().await.unwrap();
    let env = "dev".parse().unwrap();
    assert!(
        store
            .classes()
            .current(&env, now - TimeDelta::days(1))
            .await
            .unwrap()
            .is_empty()
    );

    // The good one is accepted.
    let (status, v) = send(&s, "POST", "/api/admin/classes", good).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(
        (&v["title"], &v["seats"], &v["phase"]),
        (&json!("Intro 10:00"), &json!(10), &json!("upcoming"))
    );
    // A second class may not use the first one's code at an overlapping time.
    let (status, first) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "quick", "seats": 2, "starts_at": at(start + TimeDelta::days(1)),
               "ends_at": at(start + TimeDelta::days(1) + TimeDelta::hours(1)), "join_code": "alpha-7"}),
    )
    .await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["join_code"], "ALPHA-7");
    assert_eq!(
        first["title"],
        format!("quick {}", (start + TimeDelta::days(1)).format("%H:%M"))
    );
    let got = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "pooled", "seats": 2, "starts_at": at(start + TimeDelta::days(1) + TimeDelta::minutes(30)),
               "ends_at": at(start + TimeDelta::days(1) + TimeDelta::hours(2)), "join_code": "ALPHA-7"}),
    )
    .await;
    refused(
        &got,
        422,
        "invalid_class",
        Some("join_code"),
        "another class uses this join code at an overlapping time",
    );
    assert_eq!(classes(&s).await.len(), 2);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overlapping_classes_beyond_capacity_are_accepted_and_say_how_many_seats_can_be_warm() {
    let w = World::new().await;
    // Limit 12, 2 kept for a cold start: 10 places for classes.
    let s = server(&w, 12).await;
    let start = Utc::now() + TimeDelta::hours(3);
    let (status, intro) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "quick", "title": "Intro", "seats": 30, "starts_at": at(start),
               "ends_at": at(start + TimeDelta::hours(1))}),
    )
    .await;
    assert_eq!(status, 201, "{intro}");
    assert_eq!(intro["seats_warm"], 10, "{intro}");
    let hm = start.format("%H:%M");
    assert_eq!(
        intro["capacity_note"],
        format!("capacity allows 10 of 30 seats warm at {hm} (headroom 10 VM(s))")
    );
    assert_eq!(intro["lead_time"]["seconds"], 300);
    assert_eq!(intro["lead_time"]["source"], "default");
    assert_eq!(intro["warm"], json!({"ready": 0, "preparing": 0}));

    // A second class at the same time: the ten places are shared 30:10.
    let (status, other) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "pooled", "title": "Pooled", "seats": 10,
               "starts_at": at(start + TimeDelta::minutes(2)), "ends_at": at(start + TimeDelta::hours(1))}),
    )
    .await;
    assert_eq!(status, 201, "{other}");
    assert_eq!(other["seats_warm"], 3, "{other}");
    assert_eq!(
        other["capacity_note"],
        format!(
            "capacity allows 3 of 10 seats warm at {} (headroom 10 VM(s) shared 10:30 with \
             'Intro' (7 warm))",
            (start + TimeDelta::minutes(2)).format("%H:%M")
        )
    );
    assert_eq!(
        other["overlapping"],
        json!([{"id": intro["id"], "title": "Intro", "lesson": "quick", "seats": 30, "seats_warm": 7}])
    );
    let listed = classes(&s).await;
    assert_eq!(listed.len(), 2);
    assert_eq!(
        (&listed[0]["title"], &listed[0]["seats_warm"]),
        (&json!("Intro"), &json!(7))
    );
    assert_eq!(
        (&listed[1]["title"], &listed[1]["seats_warm"]),
        (&json!("Pooled"), &json!(3))
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_class_changes_until_it_runs_then_only_its_end_and_seats_and_cancelling_is_final() {
    let w = World::new().await;
    let s = server(&w, 8).await;
    // Whole seconds: the database keeps microseconds.
    let start = (Utc::now() + TimeDelta::hours(2)).trunc_subsecs(0);
    let (status, c) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "quick", "title": "Later", "seats": 10, "starts_at": at(start),
               "ends_at": at(start + TimeDelta::hours(1)), "join_code": "LATER-1"}),
    )
    .await;
    assert_eq!(status, 201, "{c}");
    let path = format!("/api/admin/classes/{}", c["id"].as_str().unwrap());

    // An upcoming class changes its times, seats and code.
    let (status, v) = send(
        &s,
        "PATCH",
        &path,
        json!({"seats": 12, "starts_at": at(start + TimeDelta::minutes(30)), "join_code": null}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((&v["seats"], &v["join_code"]), (&json!(12), &Value::Null));
    assert_eq!(
        v["starts_at"]
            .as_str()
            .unwrap()
            .parse::<DateTime<Utc>>()
            .unwrap(),
        start + TimeDelta::minutes(30)
    );
    // Bad changes are refused and change nothing.
    let before = s.get(&path, &admin()).await.1;
    for (body, field, says) in [
        (
            json!({"starts_at": at(Utc::now() - TimeDelta::minutes(5))}),
            "starts_at",
            "is in the past",
        ),
        (
            json!({"ends_at": at(start)}),
            "ends_at",
            "must be after starts_at",
        ),
        (json!({"seats": 0}), "seats", "at least 1 seat"),
        (json!({}), "body", "nothing to change"),
    ] {
        let got = send(&s, "PATCH", &path, body).await;
        refused(&got, 422, "invalid_class", Some(field), says);
    }
    assert_eq!(s.get(&path, &admin()).await.1, before);
    let unknown = format!("/api/admin/classes/{}", ClassId::new_random());
    refused(
        &send(&s, "PATCH", &unknown, json!({"seats": 3})).await,
        404,
        "class_not_found",
        None,
        "no such class",
    );
    refused(
        &send(&s, "PATCH", "/api/admin/classes/nope", json!({"seats": 3})).await,
        400,
        "invalid_id",
        None,
        "is not a class id",
    );

    // A class that has started: its end and seats only.
    let soon = Utc::now() + TimeDelta::seconds(2);
    let (status, running) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "quick", "title": "Now", "seats": 4, "starts_at": at(soon),
               "ends_at": at(soon + TimeDelta::hours(1))}),
    )
    .await;
    assert_eq!(status, 201, "{running}");
    let running_path = format!("/api/admin/classes/{}", running["id"].as_str().unwrap());
    tokio::time::sleep(Duration::from_secs(3)).await;
    for (body, field) in [
        (
            json!({"starts_at": at(Utc::now() + TimeDelta::hours(1))}),
            "starts_at",
        ),
        (json!({"title": "Renamed"}), "title"),
        (json!({"join_code": "LATE-2"}), "join_code"),
    ] {
        let got = send(&s, "PATCH", &running_path, body).await;
        refused(
            &got,
            422,
            "invalid_class",
            Some(field),
            "is running: only its end and seats can change",
        );
    }
    let got = send(
        &s,
        "PATCH",
        &running_path,
        json!({"ends_at": at(Utc::now() - TimeDelta::minutes(1))}),
    )
    .await;
    refused(
        &got,
        422,
        "invalid_class",
        Some("ends_at"),
        "to end a class now, cancel it",
    );
    let (status, v) = send(
        &s,
        "PATCH",
        &running_path,
        json!({"seats": 6, "ends_at": at(soon + TimeDelta::hours(2))}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((&v["seats"], &v["phase"]), (&json!(6), &json!("running")));

    // Cancelling: once; then it changes no more, and it leaves the list.
    let (status, v) = s.delete(&path, &admin()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        (&v["phase"], &v["cancelled_by"]),
        (&json!("cancelled"), &json!("operator"))
    );
    refused(
        &s.delete(&path, &admin()).await,
        409,
        "class_cancelled",
        None,
        "was cancelled",
    );
    refused(
        &send(&s, "PATCH", &path, json!({"seats": 3})).await,
        409,
        "class_cancelled",
        None,
        "was cancelled",
    );
    let listed: Vec<Value> = classes(&s).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["title"], "Now");
    s.stop().await;
}

/// The class's unclaimed members, from the database.
async fn members_of(w: &World, class: ClassId) -> BTreeSet<SessionId> {
    let store = w.db.store().await.unwrap();
    let env = "dev".parse().unwrap();
    store
        .pools()
        .members(&env, &"pooled".parse().unwrap())
        .await
        .unwrap()
        .into_iter()
        .filter(|m| m.class == Some(class))
        .map(|m| m.id)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_classs_students_take_its_members_first_and_others_never_drain_them() {
    let w = World::new().await;
    let s = server(&w, 12).await;
    // In its lead-in at once (the default lead time is 5 minutes).
    let start = Utc::now() + TimeDelta::minutes(2);
    let (status, c) = send(
        &s,
        "POST",
        "/api/admin/classes",
        json!({"lesson": "pooled", "title": "Intro", "seats": 2, "starts_at": at(start),
               "ends_at": at(start + TimeDelta::hours(1)), "join_code": "ALPHA-7"}),
    )
    .await;
    assert_eq!(status, 201, "{c}");
    assert_eq!(c["phase"], "lead_in");
    let class: ClassId = c["id"].as_str().unwrap().parse().unwrap();
    let path = format!("/api/admin/classes/{class}");

    // The class's two members and the pool's own two become ready.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, v) = s.get(&path, &admin()).await;
        let (_, p) = s.get("/api/admin/pools/pooled", &admin()).await;
        if v["warm"] == json!({"ready": 2, "preparing": 0}) && p["ready"] == 4 {
            assert!(
                p["why"]
                    .as_str()
                    .unwrap()
                    .contains("class 'Intro' 2 seats, 0 started ("),
                "{p}"
            );
            break;
        }
        assert!(Instant::now() < until, "the class was never warm: {v} {p}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let prepared = members_of(&w, class).await;
    assert_eq!(prepared.len(), 2);

    // A student outside the class gets an ordinary member, the second one too; the third
    // starts cold: the class's members stay for its students.
    for (i, want) in [(1, "running"), (2, "running"), (3, "starting")] {
        let (status, v) = s
            .post(
                "/api/sessions",
                &token(&format!("outsider-{i}"), Role::Student),
                json!({"lesson": "pooled"}),
            )
            .await;
        assert_eq!(status, 202, "{v}");
        let id: SessionId = v["id"].as_str().unwrap().parse().unwrap();
        assert!(
            !prepared.contains(&id),
            "outsider-{i} took a class's member"
        );
        if want == "running" {
            assert_eq!(v["status"], "running", "outsider-{i}: {v}");
        }
    }
    assert_eq!(members_of(&w, class).await, prepared, "nothing drained");

    // A wrong code: refused, nothing opened.
    let stranger = token("stranger", Role::Student);
    let got = s
        .post(
            "/api/sessions",
            &stranger,
            json!({"lesson": "pooled", "class_code": "BETA-9"}),
        )
        .await;
    refused(
        &got,
        422,
        "unknown_class_code",
        Some("class_code"),
        "no class with this code is open now",
    );
    assert_eq!(s.get("/api/sessions/current", &stranger).await.0, 404);
    // The right code for another lesson opens nothing either.
    let got = s
        .post(
            "/api/sessions",
            &stranger,
            json!({"lesson": "quick", "class_code": "ALPHA-7"}),
        )
        .await;
    refused(
        &got,
        422,
        "unknown_class_code",
        Some("class_code"),
        "no class with this code is open now",
    );

    // The class's students, with the code as they type it: each takes a member of the class.
    for (i, code) in [(1, "ALPHA-7"), (2, " alpha-7 ")] {
        let (status, v) = s
            .post(
                "/api/sessions",
                &token(&format!("student-{i}"), Role::Student),
                json!({"lesson": "pooled", "class_code": code}),
            )
            .await;
        assert_eq!(status, 202, "{v}");
        assert_eq!(v["status"], "running", "{v}");
        let id: SessionId = v["id"].as_str().unwrap().parse().unwrap();
        assert!(
            prepared.contains(&id),
            "student-{i} did not get the class's member"
        );
    }
    let (_, v) = s.get(&path, &admin()).await;
    assert_eq!(v["started"], 2, "{v}");
    s.stop().await;
}
