//! The `/sim/…` control endpoints: the same fault, record and simulation controls as the
//! in-process API, for a standalone sim (`ttlabctl sim`). These calls are neither faulted
//! nor recorded.
//!
//! | method | path | body / answer |
//! |---|---|---|
//! | GET | `/sim/stats` | [`crate::SimStats`] |
//! | GET | `/sim/calls?verb=&resource=` | `[CallRecord]` |
//! | DELETE | `/sim/calls` | forget the record |
//! | GET | `/sim/faults` | `[{"id", "rule"}]` |
//! | POST | `/sim/faults` | a [`crate::FaultRule`] → `{"id"}` |
//! | DELETE | `/sim/faults` / `/sim/faults/{id}` | remove all / one |
//! | PUT | `/sim/latency` | `{"millis": n}` |
//! | POST | `/sim/kubevirt/pause` / `/sim/kubevirt/resume` | |
//! | POST | `/sim/vmis/{ns}/{name}/poweroff` / `…/crash` | guest ends |
//! | GET | `/sim/vmis/{ns}/{name}/guest` | `{"dir", "ip"}` |
//! | PUT | `/sim/lessons/{lesson}/setup` | a [`crate::SetupOutcome`] |
//! | POST | `/sim/objects` | `{"object", "creationTimestamp"?}` → the stored object (created directly, optionally backdated) |

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::Response;
use http::{Method, StatusCode, header};
use serde_json::{Value, json};

use crate::faults::FaultRule;
use crate::{Error, SetupOutcome, Sim};
use ttlab_kubevirt_sim::GuestEnd;

fn reply(code: StatusCode, v: &Value) -> Response {
    let mut r = Response::new(Body::from(serde_json::to_vec(v).unwrap_or_default()));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    r
}

fn err(code: StatusCode, msg: impl Into<String>) -> Response {
    reply(code, &json!({"error": msg.into()}))
}

pub(crate) async fn handle(sim: Arc<Sim>, req: Request) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or("").to_owned();
    let body = match axum::body::to_bytes(req.into_body(), 1 << 20).await {
        Ok(b) => b,
        Err(_) => return err(StatusCode::PAYLOAD_TOO_LARGE, "body too large"),
    };
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (method, segs.as_slice()) {
        (Method::GET, ["sim", "stats"]) => reply(StatusCode::OK, &json!(sim.stats())),
        (Method::GET, ["sim", "calls"]) => {
            let mut verb = None;
            let mut resource = None;
            for pair in query.split('&') {
                match pair.split_once('=') {
                    Some(("verb", v)) => verb = Some(v.to_owned()),
                    Some(("resource", r)) => resource = Some(r.to_owned()),
                    _ => {}
                }
            }
            let calls: Vec<_> = sim
                .faults
                .calls()
                .into_iter()
                .filter(|c| verb.as_deref().is_none_or(|v| c.verb.as_str() == v))
                .filter(|c| resource.as_deref().is_none_or(|r| c.resource == r))
                .collect();
            reply(StatusCode::OK, &json!(calls))
        }
        (Method::DELETE, ["sim", "calls"]) => {
            sim.faults.clear_calls();
            reply(StatusCode::OK, &json!({}))
        }
        (Method::GET, ["sim", "faults"]) => {
            let rules: Vec<Value> = sim
                .faults
                .rules()
                .into_iter()
                .map(|(id, rule)| json!({"id": id, "rule": rule}))
                .collect();
            reply(StatusCode::OK, &json!(rules))
        }
        (Method::POST, ["sim", "faults"]) => {
            let rule: FaultRule = match serde_json::from_slice(&body) {
                Ok(r) => r,
                Err(e) => return err(StatusCode::BAD_REQUEST, format!("not a fault rule: {e}")),
            };
            if rule.fraction.is_some_and(|f| !(0.0..=1.0).contains(&f)) {
                return err(StatusCode::BAD_REQUEST, "fraction must be within 0.0..=1.0");
            }
            reply(StatusCode::CREATED, &json!({"id": sim.faults.add(rule)}))
        }
        (Method::DELETE, ["sim", "faults"]) => {
            sim.faults.clear();
            reply(StatusCode::OK, &json!({}))
        }
        (Method::DELETE, ["sim", "faults", id]) => match id.parse::<u64>() {
            Ok(id) if sim.faults.remove(id) => reply(StatusCode::OK, &json!({})),
            Ok(_) => err(StatusCode::NOT_FOUND, format!("no fault rule {id}")),
            Err(_) => err(StatusCode::BAD_REQUEST, format!("bad rule id {id:?}")),
        },
        (Method::PUT, ["sim", "latency"]) => match serde_json::from_slice::<Value>(&body) {
            Ok(v) => match v["millis"].as_u64() {
                Some(ms) => {
                    sim.faults.set_latency(Duration::from_millis(ms));
                    reply(StatusCode::OK, &json!({"millis": ms}))
                }
                None => err(
                    StatusCode::BAD_REQUEST,
                    "expected {\"millis\": <non-negative integer>}",
                ),
            },
            Err(e) => err(StatusCode::BAD_REQUEST, format!("latency: {e}")),
        },
        (Method::POST, ["sim", "kubevirt", "pause"]) => {
            sim.pause_kubevirt(true);
            reply(StatusCode::OK, &json!({"paused": true}))
        }
        (Method::POST, ["sim", "kubevirt", "resume"]) => {
            sim.pause_kubevirt(false);
            reply(StatusCode::OK, &json!({"paused": false}))
        }
        (Method::POST, ["sim", "vmis", ns, name, action @ ("poweroff" | "crash")]) => {
            let how = if *action == "poweroff" {
                GuestEnd::PowerOff
            } else {
                GuestEnd::Crash
            };
            match sim.end_guest(ns, name, how) {
                Ok(()) => reply(StatusCode::OK, &json!({})),
                Err(e @ Error::NoSuchVmi { .. }) => err(StatusCode::NOT_FOUND, e.to_string()),
                Err(e) => err(StatusCode::CONFLICT, e.to_string()),
            }
        }
        (Method::GET, ["sim", "vmis", ns, name, "guest"]) => match sim.guest_info(ns, name) {
            Some(g) => reply(
                StatusCode::OK,
                &json!({"dir": g.dir, "ip": g.ip.to_string()}),
            ),
            None => err(
                StatusCode::NOT_FOUND,
                format!("no guest for VMI {ns}/{name}"),
            ),
        },
        (Method::PUT, ["sim", "lessons", lesson, "setup"]) => {
            let outcome: SetupOutcome = match serde_json::from_slice(&body) {
                Ok(o) => o,
                Err(e) => return err(StatusCode::BAD_REQUEST, format!("not a setup outcome: {e}")),
            };
            sim.set_lesson_setup(lesson, outcome);
            reply(StatusCode::OK, &json!({}))
        }
        (Method::POST, ["sim", "objects"]) => create_object(&sim, &body),
        _ => err(StatusCode::NOT_FOUND, format!("no control endpoint {path}")),
    }
}

/// `POST /sim/objects`: creates `object` as an administrator would, with `creationTimestamp`
/// (RFC 3339) as its creation time when given.
fn create_object(sim: &Sim, body: &[u8]) -> Response {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    struct Create {
        object: Value,
        #[serde(default)]
        creation_timestamp: Option<String>,
    }
    let create: Create = match serde_json::from_slice(body) {
        Ok(c) => c,
        Err(e) => {
            return err(
                StatusCode::BAD_REQUEST,
                format!("expected {{\"object\": {{…}}, \"creationTimestamp\": \"RFC 3339\"}}: {e}"),
            );
        }
    };
    let created = match create
        .creation_timestamp
        .as_deref()
        .map(chrono::DateTime::parse_from_rfc3339)
    {
        None => None,
        Some(Ok(at)) => Some(at.with_timezone(&chrono::Utc)),
        Some(Err(e)) => {
            return err(
                StatusCode::BAD_REQUEST,
                format!("creationTimestamp is not an RFC 3339 time: {e}"),
            );
        }
    };
    match crate::api::create_direct_at(sim, create.object, created) {
        Ok(stored) => reply(StatusCode::CREATED, &stored),
        Err(e) => crate::api::error_response(&e),
    }
}
