//! `GET /api/openapi.json`: the OpenAPI 3.1 description of every route, written by hand
//! (a test checks that every route of the router appears in it).

use axum::routing::get;
use axum::{Json, Router};
use serde_json::{Value, json};

use crate::AppState;

pub(super) fn routes() -> Router<AppState> {
    Router::new().route("/api/openapi.json", get(|| async { Json(document()) }))
}

fn err(description: &str) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn ok(description: &str, schema: Value) -> Value {
    json!({"description": description, "content": {"application/json": {"schema": schema}}})
}

fn op(summary: &str, responses: Value) -> Value {
    json!({"summary": summary, "security": [{"bearer": []}], "responses": responses})
}

fn id_param() -> Value {
    json!([{"name": "id", "in": "path", "required": true, "schema": {"type": "string", "format": "uuid"}}])
}

fn session() -> Value {
    json!({"$ref": "#/components/schemas/Session"})
}

/// The document.
pub fn document() -> Value {
    let auth_errors = |mut v: Value| {
        v["401"] = err("missing, invalid or expired token");
        v["503"] = err(
            "database or cluster unavailable; or overloaded (more requests at once than the \
             server takes) or request_timeout (not answered within the request timeout), both \
             with Retry-After",
        );
        v
    };
    // Start, extend and grade are limited per user (each counted apart).
    let limited = |mut v: Value| {
        v["429"] = err(
            "rate_limited: too many of this action by this user; the Retry-After header says \
             in how many seconds the next one is accepted",
        );
        v
    };
    let admin_errors = |v: Value| {
        let mut v = auth_errors(v);
        v["403"] = err("not an admin");
        v
    };
    let mut start_lab = limited(auth_errors(json!({
        "202": ok("accepted", session()),
        "400": err("malformed body, wrong types or unknown fields"),
        "404": err("lesson_not_found"),
        "409": err("session_exists: the lab already open is named"),
        "413": err("body too large"),
        "415": err("not application/json"),
        "422": err("unknown_class_code (field `class_code`): no class with this code is open now"),
    })));
    start_lab["503"] = err(
        "capacity: no VM place is free (the message counts the VMs of open labs, those still \
         shutting down and leftovers, against the limit; with several sites, of the sites that \
         carry the lesson's site labels); no_site: the lesson requires a site label no \
         configured site carries (the message says which); or the database or cluster is \
         unavailable",
    );
    let mut doc = json!({
        "openapi": "3.1.0",
        "info": {"title": "ttlab", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Lab sessions on KubeVirt VMs: start, follow, extend, grade, finish; admin views. Errors are {\"error\": code, \"message\": sentence}; failures on the server's side add a `reference` that the server's log line of the detail carries."},
        "paths": {
            "/healthz": {"get": {"summary": "The process answers. On the ops port when one is configured (TTLAB_OPS_LISTEN), not on the public one", "responses": {"200": ok("alive", json!({"type": "object"}))}}},
            "/readyz": {"get": {"summary": "This process and its database answer (the cluster is not consulted: see /healthz/cluster). 503 says why not: reason, database (unreachable_since, last_error) and the last cluster probe. On the ops port when one is configured", "responses": {"200": ok("ready", json!({"type": "object"})), "503": {"description": "not ready: the database has not answered (since when, the last error)", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/healthz/cluster": {"get": {"summary": "What the last probe of each site's Kubernetes API found, over all sites (reachable, checked_at, latency_ms, error, consecutive_failures) and per site (sites: the same with its name, site); reported, never used for readiness. On the ops port when one is configured", "responses": {"200": ok("every site's last probe answered", json!({"type": "object"})), "503": {"description": "a site's last probe failed (error names it)", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (OpenMetrics text). On the ops port when one is configured", "responses": {"200": {"description": "metrics", "content": {"application/openmetrics-text": {"schema": {"type": "string"}}}}}}},
            "/api/openapi.json": {"get": {"summary": "This document", "responses": {"200": ok("OpenAPI document", json!({"type": "object"}))}}},
            "/api/lessons": {"get": op("Lessons offered", auth_errors(json!({"200": ok("lessons", json!({"type": "array", "items": {"$ref": "#/components/schemas/Lesson"}}))})))},
            "/api/sessions": {"post": {
                "summary": "Start a lab: 202 with the session in `starting` (provisioning continues in the background), or already `running` when a prepared member of the lesson's warm pool was claimed. A scheduled class's student gives its join code (`class_code`; a class without a code takes everyone starting its lesson during its window) and takes a member prepared for the class first; nobody else takes those members before the class ends",
                "security": [{"bearer": []}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["lesson"], "additionalProperties": false, "properties": {"lesson": {"type": "string"}, "class_code": {"type": "string", "description": "a scheduled class's join code, accepted from 15 minutes before its start to its end (case and surrounding blanks do not matter)"}}}}}},
                "responses": start_lab
            }},
            "/api/sessions/current": {"get": op("The caller's live session", auth_errors(json!({"200": ok("session", session()), "404": err("no live session")})))},
            "/api/sessions/{id}": {
                "parameters": id_param(),
                "get": op("One session (owner or admin)", auth_errors(json!({"200": ok("session", session()), "400": err("invalid_id"), "404": err("no such session, or not yours")}))),
                "delete": op("Finish now: everything of the session is deleted", auth_errors(json!({"200": ok("the session, finished", session()), "400": err("invalid_id"), "404": err("no such session, or not yours")})))
            },
            "/api/sessions/{id}/events": {
                "parameters": id_param(),
                "get": {"summary": "Server-sent `session` events: the session now and on every change, until it is final", "security": [{"bearer": []}],
                        "responses": auth_errors(json!({"200": {"description": "event stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}}, "404": err("no such session, or not yours")}))}
            },
            "/api/sessions/{id}/extend": {
                "parameters": id_param(),
                "post": op("Extend, in the last TTLAB_EXTEND_WINDOW (15 min by default) before the expiry: expiry becomes min(now + ttl, start + max); the session's `extend` says whether it is offered, what it gains and from when", limited(auth_errors(json!({"200": ok("the session with its new expiry", session()), "404": err("no such session, or not yours"), "409": err("not_yet (before the extend window: `opens_at` in the body says when it opens), extension_limit, max_lifetime, expired, too_early or not_running")}))))
            },
            "/api/sessions/{id}/grade": {
                "parameters": id_param(),
                "post": op("Run the lesson's grading steps: through the agent in each VM, or in the lab pod's container (pod exec)", limited(auth_errors(json!({"200": ok("each step's result", json!({"type": "object", "properties": {"passed": {"type": "integer"}, "total": {"type": "integer"}, "steps": {"type": "array", "items": {"type": "object"}}}})), "404": err("no such session, or not yours"), "409": err("not_running"), "502": err("agent_unavailable: the VM's agent (or the lab pod) did not answer (the message is a plain sentence; the detail is in the server's log)"), "503": err("site_unavailable: the cluster of the session's site cannot be reached now (with Retry-After)")}))))
            },
            "/api/sessions/{id}/console-ticket": {
                "parameters": id_param(),
                "post": {"summary": "A one-time ticket for the console WebSocket: good once, for 30 s, on any server replica", "security": [{"bearer": []}],
                         "parameters": [{"name": "node", "in": "query", "required": false, "description": "the node whose console the ticket opens (multi-VM labs; default: chosen when the WebSocket opens)", "schema": {"type": "string"}}],
                         "responses": auth_errors(json!({
                             "200": ok("the ticket and where to open the WebSocket", json!({"type": "object", "required": ["ticket", "url", "expires_in_seconds"], "properties": {"ticket": {"type": "string"}, "url": {"type": "string"}, "expires_in_seconds": {"type": "integer"}}})),
                             "400": err("invalid_query, unknown_node"),
                             "404": err("no such session, or not yours"),
                             "409": err("not_running, expired")
                         }))}
            },
            "/api/sessions/{id}/console": {
                "parameters": id_param(),
                "get": {"summary": "The terminal: a WebSocket relayed to the VM's serial console (or a shell in the lab pod), raw bytes in binary frames both ways; authenticated by its ticket, not a bearer token. The server's only text frames are status messages: {\"type\":\"connected\"} once the console itself is open (until then the VM may still be booting), {\"type\":\"warned\",\"leads\":[300]} after a warning line was written (lead times before the expiry, in seconds); a page that reconnects names the warnings it was shown for the current expiry with `warned` (300,60), and they are not written again. Close codes: 4001 session expired, 4002 finished, 4003 opened in another tab, 4004 VM (or the pod lab's container) stopped, 4005 console unavailable, 4006 connection lost, 4007 browser not responding, 1012 server restarting (the page reconnects after 4005-4007 and 1012 only). When the VM's console ends, the VM says which: a guest that powered itself off closes 4004; a guest that crashed is restarted by the run strategy (RerunOnFailure) and closes 4006 \"the VM is restarting\", whichever step of the replacement KubeVirt shows (the Failed VMI, the VM reading Stopped with a start pending, the next VMI starting). The serial console closes a moment before KubeVirt records the guest's end, so a VMI that still reads Running is looked at again for up to 1.2 s",
                        "parameters": [
                            {"name": "ticket", "in": "query", "required": true, "schema": {"type": "string"}},
                            {"name": "node", "in": "query", "required": false, "schema": {"type": "string"}},
                            {"name": "warned", "in": "query", "required": false, "schema": {"type": "string"}}
                        ],
                        "responses": {
                            "101": {"description": "switching to the WebSocket"},
                            "400": err("websocket_required, invalid_query, unknown_node"),
                            "403": err("invalid_ticket (unknown, used, expired, or for another session or node), not_your_session"),
                            "404": err("no such session"),
                            "409": err("not_running, expired"),
                            "503": err("database_unavailable, or site_unavailable: the cluster of the session's site cannot be reached now")
                        }}
            },
            "/api/admin/sessions": {"get": {
                "summary": "Sessions of this environment",
                "security": [{"bearer": []}],
                "parameters": [
                    {"name": "scope", "in": "query", "schema": {"type": "string", "enum": ["live", "recent"]}},
                    {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 5000}}
                ],
                "responses": admin_errors(json!({"200": ok("sessions", json!({"type": "array", "items": session()})), "400": err("invalid_query")}))
            }},
            "/api/admin/capacity": {"get": op("Live VMs counted from the cluster, starting sessions, the limit, the namespace's ResourceQuotas, and memory against the quota: what one session of each VM lesson costs with KubeVirt's overhead, and how many more the quota's memory allows; `sites`: the same per site (one, `default`, without a sites file), with its weight, labels and agent path and whether the last cluster probe reached it (the top-level fields are the first site's)", admin_errors(json!({"200": ok("capacity", json!({"$ref": "#/components/schemas/Capacity"}))})))},
            "/api/admin/reaper": {"get": {
                "summary": "Recent reaper cycle reports, each with the site it ran on (site; null before sites were recorded)",
                "security": [{"bearer": []}],
                "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}}],
                "responses": admin_errors(json!({"200": ok("cycles", json!({"type": "array", "items": {"type": "object"}}))}))
            }},
            "/api/admin/reaper/collect": {"post": op("Collect now: the reaper runs a cycle and answers with its report", admin_errors(json!({"200": ok("the cycle report", json!({"type": "object"})), "504": err("no reaper answered in time")})))},
            "/api/admin/stats": {"get": op("p50/p90/p99 and count of time-to-ready per lesson and disk, and of expiry to reclaimed; `readiness`: a histogram per lesson and stage (vm_created, vmi_running, agent_up, ready, total) from the recorded stage times", admin_errors(json!({"200": ok("statistics", json!({"type": "object"}))})))}
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT (HS256; claims sub, role, exp)"}},
            "schemas": {
                "Error": {"type": "object", "required": ["error", "message"], "properties": {"error": {"type": "string"}, "message": {"type": "string"}, "reference": {"type": "string", "description": "failures on the server's side (5xx): the reference of the log line with the detail; the message ends with it"}, "opens_at": {"type": "string", "format": "date-time", "description": "not_yet: when the extend window opens"}}},
                "Capacity": {"type": "object", "properties": {
                    "live_vms": {"type": ["integer", "null"], "description": "VMs ttlab manages in the namespace (any environment); null if the cluster could not be read"},
                    "starting_sessions": {"type": "integer"}, "limit": {"type": "integer"}, "available": {"type": ["integer", "null"]},
                    "namespace": {"type": "string"},
                    "quota": {"type": ["array", "null"], "description": "the namespace's ResourceQuotas; null if they could not be read", "items": {"type": "object", "properties": {
                        "name": {"type": "string"},
                        "hard": {"type": "object", "additionalProperties": {"type": "string"}, "description": "limits by resource, e.g. requests.memory, count/virtualmachines.kubevirt.io, pods"},
                        "used": {"type": "object", "additionalProperties": {"type": "string"}}}}},
                    "terminating_vms": {"type": ["array", "null"], "items": {"type": "string"}, "description": "VMs being deleted but not gone yet (counted in live_vms); null if the cluster could not be read"},
                    "terminating": {"type": "array", "description": "finishing sessions kept from going final because objects of theirs are still terminating after their deletion was accepted, as the reaper last saw them (every environment)", "items": {"type": "object", "properties": {
                        "session": {"type": "string", "format": "uuid"}, "env": {"type": "string"}, "lesson": {"type": "string"},
                        "finishing_to": {"type": ["string", "null"]},
                        "objects": {"type": "array", "items": {"type": "string"}, "description": "Kind/name of each object still terminating"},
                        "since": {"type": "string", "format": "date-time", "description": "when an object of the session was first seen terminating"}}}},
                    "error": {"type": ["string", "null"], "description": "why live_vms could not be counted"},
                    "quota_error": {"type": ["string", "null"], "description": "why the quotas could not be read"}
                }},
                "Lesson": {"type": "object", "properties": {"id": {"type": "string"}, "title": {"type": "string"}, "runtime": {"type": "string", "enum": ["vm", "pod"]}, "nodes": {"type": "array", "items": {"type": "string"}}, "grading_steps": {"type": "integer"}}},
                "Session": {"type": "object", "properties": {
                    "id": {"type": "string", "format": "uuid"}, "user": {"type": ["string", "null"]}, "lesson": {"type": "string"}, "runtime": {"type": "string"},
                    "status": {"type": "string", "enum": ["starting", "running", "finishing", "expired", "finished", "failed", "ghost", "requeued"]},
                    "stage": {"type": "string"}, "finishing_to": {"type": ["string", "null"]},
                    "started_at": {"type": "string", "format": "date-time"}, "expires_at": {"type": "string", "format": "date-time"}, "max_expires_at": {"type": "string", "format": "date-time"},
                    "remaining_seconds": {"type": "integer"}, "extensions_used": {"type": "integer"}, "extensions_left": {"type": "integer"}, "server_time": {"type": "string", "format": "date-time"},
                    "disk": {"type": ["object", "null"], "properties": {"kind": {"type": "string"}, "reason": {"type": "string"}}},
                    "nodes": {"type": "array", "items": {"type": "object", "properties": {"node": {"type": "string"}, "vm": {"type": "string"}}}},
                    "stages": {"type": "object", "properties": {"requested": {"type": "string"}, "vm_created": {"type": ["string", "null"]}, "vmi_running": {"type": ["string", "null"]}, "agent_up": {"type": ["string", "null"]}, "ready": {"type": ["string", "null"]}}},
                    "finished_at": {"type": ["string", "null"]}, "failure_reason": {"type": ["string", "null"], "description": "why provisioning failed: to its student, the plain sentence; to an admin, with the detail (the agent's or the cluster's error)"}
                }}
            }
        }
    });
    let admin_actions = json!({
            "/api/admin/sessions/{id}": {
                "parameters": id_param(),
                "get": op("One session for an operator: the session (full failure detail), the reference its student is shown, each stage with its time, the cluster objects with their state, the grading history (when, passed of total, which failed), the operators' actions and the console of each node: who opened the current or last connection, on which server replica, when it opened and closed (`closed_at` null while open) and why it closed (`browser_closed`, `taken_over`, `session_ended`, `lost`, `replica_gone` when the server replica relaying it crashed or was killed and another one closed its record, or null when unknown); `console` is empty when no console was ever opened; `terminating` names (as `Kind/name`, with since when) the objects whose deletion was accepted but that were still there at the last look (the session stays `finishing` until they are gone), and `objects_gone_at` is when all of them were confirmed gone", admin_errors(json!({"200": ok("the session in detail", json!({"type": "object", "properties": {"terminating": {"type": ["object", "null"], "properties": {"objects": {"type": "array", "items": {"type": "string"}}, "since": {"type": "string", "format": "date-time"}}}, "objects_gone_at": {"type": ["string", "null"], "format": "date-time"}, "console": {"type": "array", "items": {"type": "object", "properties": {"node": {"type": "string"}, "user": {"type": "string"}, "replica": {"type": "string"}, "opened_at": {"type": "string", "format": "date-time"}, "closed_at": {"type": ["string", "null"], "format": "date-time"}, "closed_why": {"type": ["string", "null"], "enum": ["browser_closed", "taken_over", "session_ended", "lost", "replica_gone"]}}}}}})), "400": err("invalid_id"), "404": err("no such session")})))
            },
            "/api/admin/sessions/{id}/end": {
                "parameters": id_param(),
                "post": {"summary": "End a starting or running session (as finished; its objects are deleted and the session goes final once they are confirmed gone: while one lingers, a VM shutting down, it answers with the session still `finishing`; what fails is retried, and left to the reaper) and record who, when and why", "security": [{"bearer": []}],
                         "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["reason"], "additionalProperties": false, "properties": {"reason": {"type": "string", "maxLength": 500}}}}}},
                         "responses": admin_errors(json!({"200": ok("the session and the recorded action", json!({"type": "object"})), "400": err("reason_required, reason_too_long, invalid_json"), "404": err("no such session"), "409": err("not_live")}))}
            },
            "/api/admin/sessions/{id}/extend": {
                "parameters": id_param(),
                "post": {"summary": "Move a running session's expiry `minutes` later, beyond its student's extensions (none is used) but never past start + max, and record who, when, how much and why", "security": [{"bearer": []}],
                         "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["minutes", "reason"], "additionalProperties": false, "properties": {"minutes": {"type": "integer", "minimum": 1, "maximum": 1440}, "reason": {"type": "string", "maxLength": 500}}}}}},
                         "responses": admin_errors(json!({"200": ok("the session and the recorded action (added_seconds: what the cap allowed)", json!({"type": "object"})), "400": err("invalid_minutes, reason_required, reason_too_long, invalid_json"), "404": err("no such session"), "409": err("max_lifetime, expired, not_running")}))}
            },
            "/api/admin/actions": {"get": {
                "summary": "The operators' recent actions (end, extend), newest first",
                "security": [{"bearer": []}],
                "parameters": [{"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 500}}],
                "responses": admin_errors(json!({"200": ok("actions", json!({"type": "array", "items": {"type": "object"}}))}))
            }}
    });
    if let (Some(paths), Some(more)) = (doc["paths"].as_object_mut(), admin_actions.as_object()) {
        paths.extend(more.clone());
    }
    let waitlist_view = json!({"$ref": "#/components/schemas/Waitlist"});
    let waitlist = json!({
            "/api/waitlist": {
                "get": op("The caller's place on the waitlist (`waiting: false` when not on it)", auth_errors(json!({"200": ok("the caller's place", waitlist_view.clone())}))),
                "post": {"summary": "Wait for a place in a VM lab when the VM limit is reached (the page joins on a 503 `capacity` from POST /api/sessions): the queue is served first come, first served across every server replica; when a place frees it is held for the first in line for TTLAB_WAITLIST_HOLD (2 min by default), and only they can start that lab meanwhile (POST /api/sessions). One entry per user", "security": [{"bearer": []}],
                         "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["lesson"], "additionalProperties": false, "properties": {"lesson": {"type": "string"}}}}}},
                         "responses": auth_errors(json!({"201": ok("on the waitlist", waitlist_view.clone()), "400": err("not_limited (a pod lab: start it directly), malformed body, unknown fields"), "404": err("lesson_not_found"), "409": err("session_exists (a live lab cannot wait), already_waiting"), "415": err("not application/json")}))},
                "delete": op("Leave the waitlist", auth_errors(json!({"200": ok("no longer waiting", waitlist_view.clone()), "409": err("not_waiting")})))
            },
            "/api/waitlist/events": {
                "get": {"summary": "Server-sent `waitlist` events: the caller's place now and on every change (position, a place held, leaving), until they are no longer waiting", "security": [{"bearer": []}],
                        "responses": auth_errors(json!({"200": {"description": "event stream", "content": {"text/event-stream": {"schema": {"type": "string"}}}}}))}
            }
    });
    if let (Some(paths), Some(more)) = (doc["paths"].as_object_mut(), waitlist.as_object()) {
        paths.extend(more.clone());
    }
    let tasks = task_paths(admin_errors);
    if let (Some(paths), Some(more)) = (doc["paths"].as_object_mut(), tasks.as_object()) {
        paths.extend(more.clone());
    }
    let pools = pool_paths(&admin_errors);
    if let (Some(paths), Some(more)) = (doc["paths"].as_object_mut(), pools.as_object()) {
        paths.extend(more.clone());
    }
    let classes = class_paths(&admin_errors);
    if let (Some(paths), Some(more)) = (doc["paths"].as_object_mut(), classes.as_object()) {
        paths.extend(more.clone());
    }
    doc["components"]["schemas"]["Pool"] = pool_schema();
    doc["components"]["schemas"]["Task"] = task_schema();
    doc["components"]["schemas"]["Class"] = class_schema();
    doc["components"]["schemas"]["Error"]["properties"]["field"] =
        json!({"type": "string", "description": "with a 422: the field of the request at fault"});
    doc["components"]["schemas"]["Capacity"]["properties"]["memory"] = capacity_memory_schema();
    doc["components"]["schemas"]["SiteCapacity"] = site_capacity_schema();
    doc["components"]["schemas"]["Capacity"]["properties"]["sites"] = json!({"type": "array", "description": "one entry per site, a place VMs run, in the sites file's order (without a sites file one: `default`, the server's cluster and namespace); the top-level fields are the first site's", "items": {"$ref": "#/components/schemas/SiteCapacity"}});
    doc["components"]["schemas"]["Waitlist"] = json!({"type": "object", "required": ["waiting"], "properties": {
        "waiting": {"type": "boolean"},
        "lesson": {"type": "string"},
        "position": {"type": "integer", "description": "1 for the first in line"},
        "enqueued_at": {"type": "string", "format": "date-time"},
        "held_until": {"type": "string", "format": "date-time", "description": "while a place is held for the caller: until when only they can take it"},
        "hold_seconds_left": {"type": "integer"},
        "leaves_at": {"type": "string", "format": "date-time", "description": "while waiting without a hold: when the caller is taken off the list if no place is held for them by then (TTLAB_WAITLIST_MAX_WAIT after joining, 1 h by default)"},
        "leaves_in_seconds": {"type": "integer", "description": "while waiting without a hold: whole seconds until leaves_at"},
        "max_wait_seconds": {"type": "integer", "description": "while waiting: the longest wait without a hold (TTLAB_WAITLIST_MAX_WAIT)"}}});
    let session = &mut doc["components"]["schemas"]["Session"]["properties"];
    session["extend"] = json!({"type": "object", "description": "what the extend button offers at server_time", "properties": {
        "available": {"type": "boolean"},
        "gain_seconds": {"type": "integer", "description": "how much later the expiry moves if extended now"},
        "opens_at": {"type": "string", "format": "date-time", "description": "from when extending is offered"},
        "window_seconds": {"type": "integer"},
        "refusal": {"type": ["object", "null"], "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}});
    session["site"] = json!({"type": "string", "description": "the site its VMs run on: a cluster's API server and a namespace in it (`default` without a sites file)"});
    session["site_unreachable"] = json!({"type": "string", "description": "while live, only when the cluster of its site cannot be reached now: a sentence for the student (the console and grading then answer 503 site_unavailable)"});
    session["reference"] = json!({"type": "string", "description": "with a failure reason: the reference its student quotes to an operator (the first 8 characters of the session id, which the provisioning's log lines carry)"});
    session["expected_ready"] = json!({"type": "object", "description": "while starting, if measured: p50_seconds, p90_seconds and count of the lesson's recent starts (request to ready)", "properties": {
        "count": {"type": "integer"}, "p50_seconds": {"type": "number"}, "p90_seconds": {"type": "number"}}});
    doc
}

/// The background tasks' admin route (apart, to keep `json!`'s recursion in bounds).
fn task_paths(admin_errors: impl Fn(Value) -> Value) -> Value {
    json!({
        "/api/admin/tasks": {"get": op("The background tasks of the replica that answers (the cluster probe, the notification hub, the waitlist, the pool refiller, the adoption of abandoned sessions, the console watchers once a console was opened there, the agent keeper): for each, when it last ran, how long it took, its last success and, until the next success, its last error", admin_errors(json!({"200": ok("the tasks", json!({"type": "object", "required": ["replica", "server_time", "tasks"], "properties": {
            "replica": {"type": "string", "description": "the server replica that answered (each replica runs its own tasks)"},
            "server_time": {"type": "string", "format": "date-time"},
            "tasks": {"type": "array", "items": {"$ref": "#/components/schemas/Task"}}}}))})))}
    })
}

/// The `Task` schema.
fn task_schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string", "enum": ["database", "cluster_probe", "golden_disks", "hub", "waitlist", "pool_refill", "adoption", "console_sessions", "console_takeovers", "console_replicas", "agent_keeper"]},
        "description": {"type": "string"},
        "period_seconds": {"type": ["number", "null"], "description": "how often it runs; null for a listener, which runs continuously"},
        "running": {"type": "boolean", "description": "an activation is running now (a listener: it is connected or connecting)"},
        "finished": {"type": "boolean", "description": "it stopped for good (what it served is gone, or the server is stopping)"},
        "activations": {"type": "integer"}, "failures": {"type": "integer"},
        "consecutive_failures": {"type": "integer", "description": "failures since the last success; after each, the next activation waits a backoff (100 ms doubling to 2 s)"},
        "last_started_at": {"type": ["string", "null"], "format": "date-time"},
        "last_reason": {"type": ["string", "null"], "enum": ["start", "period", "trigger", "again", null]},
        "last_duration_ms": {"type": ["integer", "null"]},
        "last_success_at": {"type": ["string", "null"], "format": "date-time"},
        "last_error": {"type": ["string", "null"], "description": "why the last activation failed, until the next success"},
        "last_error_at": {"type": ["string", "null"], "format": "date-time"}
    }})
}

/// `Capacity.sites[]` (apart, to keep `json!`'s recursion in bounds).
fn site_capacity_schema() -> Value {
    json!({"type": "object", "required": ["name", "namespace", "vm_limit", "in_use", "reachable"], "properties": {
        "name": {"type": "string", "description": "the site's name (a DNS label of at most 40 characters)"},
        "namespace": {"type": "string", "description": "the namespace its VMs live in"},
        "vm_limit": {"type": "integer", "description": "most VMs at once on the site"},
        "weight": {"type": "integer", "description": "its share in placement: free places count this many times"},
        "labels": {"type": "array", "items": {"type": "string"}, "description": "the capabilities it offers"},
        "agent_path": {"type": "string", "enum": ["pod-ip", "portforward"], "description": "how the server reaches the agents of its VMs"},
        "in_use": {"type": ["integer", "null"], "description": "VMs ttlab manages there, those being deleted included (as live_vms); null if the cluster could not be read"},
        "available": {"type": ["integer", "null"], "description": "vm_limit minus in_use (0 if above); null if the cluster could not be read"},
        "starting_sessions": {"type": "integer", "description": "this environment's sessions on the site still starting"},
        "quota": {"type": ["array", "null"], "description": "the site namespace's ResourceQuotas (as the top-level quota); null if they could not be read"},
        "quota_error": {"type": ["string", "null"]},
        "memory": {"type": "object", "description": "memory against the site's quota (as the top-level memory)"},
        "error": {"type": ["string", "null"], "description": "why in_use could not be counted"},
        "reachable": {"type": "boolean", "description": "whether the last probe of the site's Kubernetes API answered (before the first probe ends: whether this view's count of its VMs did)"},
        "why": {"type": ["string", "null"], "description": "when not reachable: the probe's last error, or why no client could be built for it (it then takes no start)"},
        "checked_at": {"type": ["string", "null"], "format": "date-time", "description": "when the last probe ended; null before the first"},
        "golden_disks_ready": {"type": ["array", "null"], "items": {"type": "string"}, "description": "the lessons whose golden disk the last observation (every 30 s) found ready there, which placement prefers for them; null with a single site, where none is made"}
    }})
}

/// `Capacity.memory` (apart, to keep `json!`'s recursion in bounds).
fn capacity_memory_schema() -> Value {
    json!({"type": "object", "description": "memory against the quota: KubeVirt's launcher pod of a VM requests the guest's memory plus KubeVirt's overhead, with the serial-console log's sidecar beside it, and that is what a requests.memory quota and the nodes count", "properties": {
                        "quota": {"type": ["string", "null"], "description": "the quota whose requests.memory has the least left; null if no quota limits memory or the quotas could not be read"},
                        "hard": {"type": ["string", "null"], "description": "its requests.memory limit, as the API server accounts it (e.g. 48Gi)"},
                        "used": {"type": ["string", "null"], "description": "its requests.memory in use"},
                        "hard_bytes": {"type": ["integer", "null"]}, "used_bytes": {"type": ["integer", "null"]},
                        "free_bytes": {"type": ["integer", "null"], "description": "hard minus used (0 if used is above hard)"},
                        "lessons": {"type": "array", "description": "what one session of each VM lesson costs", "items": {"type": "object", "properties": {
                            "lesson": {"type": "string"}, "vms": {"type": "integer"},
                            "guest_bytes": {"type": "integer", "description": "a VM's guest memory (its memory request)"},
                            "overhead_bytes": {"type": "integer", "description": "KubeVirt's per-VM overhead (the launcher pod's kubevirt.io/memory-overhead-bytes)"},
                            "launcher_request_bytes": {"type": "integer", "description": "the launcher pod's compute container request: guest plus overhead"},
                            "vm_bytes": {"type": "integer", "description": "what the quota is charged for one VM: the launcher pod's requests, its sidecar included"},
                            "session_bytes": {"type": "integer", "description": "vm_bytes times vms"},
                            "more_sessions": {"type": ["integer", "null"], "description": "how many more sessions of the lesson free_bytes allows (the VM limit aside); null without a memory quota"}}}}}})
}

/// The warm-pool admin routes (apart, to keep `json!`'s recursion in bounds).
fn pool_paths(admin_errors: &impl Fn(Value) -> Value) -> Value {
    json!({
    "/api/admin/pools": {"get": op("Every VM lesson's warm pool: settings and where they come from (`lesson` file or `admin` override), members ready and preparing, claims, misses and failed hand-overs in 24 h, hit rate, median refill time, and this replica's last plan (target, deferred, why)", admin_errors(json!({"200": ok("pools", json!({"type": "object", "properties": {"pools": {"type": "array", "items": {"$ref": "#/components/schemas/Pool"}}}}))})))},
            "/api/admin/pools/{lesson}": {
                "parameters": [{"name": "lesson", "in": "path", "required": true, "schema": {"type": "string"}}],
                "get": op("One VM lesson's warm pool", admin_errors(json!({"200": ok("pool", json!({"$ref": "#/components/schemas/Pool"})), "400": err("not_pooled: a pod lesson"), "404": err("lesson_not_found")}))),
                "put": {
                    "summary": "Override the pool's settings (resize, pause, resume, or a pool for a lesson whose file has none); fields left out keep their current value",
                    "security": [{"bearer": []}],
                    "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": false, "properties": {
                        "size": {"type": "integer", "minimum": 0, "maximum": 200}, "min": {"type": "integer", "minimum": 0}, "max": {"type": "integer", "maximum": 200},
                        "max_age_minutes": {"type": "integer", "minimum": 1, "maximum": 10080}, "demand": {"type": "boolean"}, "paused": {"type": "boolean"}}}}}},
                    "responses": admin_errors(json!({"200": ok("the pool with its new settings", json!({"$ref": "#/components/schemas/Pool"})), "400": err("invalid_pool (min <= size <= max <= 200, max_age_minutes 1..10080), not_pooled, invalid_body"), "404": err("lesson_not_found")}))
                },
                "delete": op("Drop the override: the lesson file's pool settings again (or no pool; members left are retired)", admin_errors(json!({"200": ok("the pool, with `removed_override`", json!({"$ref": "#/components/schemas/Pool"})), "400": err("not_pooled"), "404": err("lesson_not_found")})))
            }
    })
}

/// The `Pool` schema.
fn pool_schema() -> Value {
    json!({"type": "object", "properties": {
        "lesson": {"type": "string"}, "title": {"type": "string"}, "nodes": {"type": "integer", "description": "VMs per member"},
        "pooled": {"type": "boolean"}, "source": {"type": ["string", "null"], "enum": ["lesson", "admin", null]},
        "settings": {"type": ["object", "null"], "properties": {"size": {"type": "integer"}, "min": {"type": "integer"}, "max": {"type": "integer"}, "max_age_minutes": {"type": "integer"}, "demand": {"type": "boolean"}, "paused": {"type": "boolean"}}},
        "updated_by": {"type": ["string", "null"]}, "updated_at": {"type": ["string", "null"], "format": "date-time"},
        "ready": {"type": "integer"}, "preparing": {"type": "integer"}, "claims_24h": {"type": "integer"}, "misses_24h": {"type": "integer"},
        "handover_failures_24h": {"type": "integer", "description": "claimed members whose hand-over failed in 24 h (each also one of claims_24h): failed, reclaimed, and the student given the next member or a cold start"},
        "hit_rate": {"type": ["number", "null"]}, "median_refill_seconds": {"type": ["number", "null"]},
        "target": {"type": ["integer", "null"], "description": "the size this replica's refiller keeps the pool at (null before its first look)"},
        "deferred": {"type": ["integer", "null"], "description": "members the target wants that capacity does not allow now"},
        "why": {"type": ["string", "null"]}
    }})
}

/// The scheduled classes' admin routes.
fn class_paths(admin_errors: &impl Fn(Value) -> Value) -> Value {
    let class = json!({"$ref": "#/components/schemas/Class"});
    let invalid = "invalid_class (the field at fault is named: seats 1 to 500, ends_at after starts_at and at most 12 hours later, starts_at not in the past and at most 366 days ahead, a title of 1 to 100 characters, a join code of 4 to 32 letters, digits or dashes that no other class uses at an overlapping time), unknown_lesson, not_pooled (a pod lesson, or a lab too large to prepare beside the cold-start reserve)";
    json!({
        "/api/admin/classes": {
            "get": op("The upcoming and running classes of this environment, by start, each with its members warm now, its students so far, the seats the capacity allows warm at its start, and its lesson's lead time", admin_errors(json!({"200": ok("classes", json!({"type": "object", "properties": {"classes": {"type": "array", "items": class.clone()}, "now": {"type": "string", "format": "date-time"}, "vm_limit": {"type": "integer"}, "reserve": {"type": "integer", "description": "VM places kept for a cold start, never used for classes"}}}))}))),
            "post": {
                "summary": "Schedule a class: members of its lesson are prepared from its start minus the lead time so that they are ready at its start. Classes that overlap and together ask more than the capacity are accepted: `seats_warm` and `capacity_note` say how many of its seats can be warm, and `overlapping` lists the classes it shares the capacity with",
                "security": [{"bearer": []}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "required": ["lesson", "seats", "starts_at", "ends_at"], "additionalProperties": false, "properties": {
                    "lesson": {"type": "string"}, "title": {"type": "string", "maxLength": 100, "description": "default: the lesson and the start's time of day"},
                    "seats": {"type": "integer", "minimum": 1, "maximum": 500},
                    "starts_at": {"type": "string", "format": "date-time"}, "ends_at": {"type": "string", "format": "date-time"},
                    "join_code": {"type": "string", "minLength": 4, "maxLength": 32, "description": "what its students enter; without one, everyone starting the lesson during the window is its student"}}}}}},
                "responses": admin_errors(json!({"201": ok("the class scheduled", class.clone()), "400": err("malformed body, wrong types or unknown fields"), "422": err(invalid)}))
            }
        },
        "/api/admin/classes/{id}": {
            "parameters": id_param(),
            "get": op("One class (also when over or cancelled)", admin_errors(json!({"200": ok("class", class.clone()), "400": err("invalid_id"), "404": err("class_not_found")}))),
            "patch": {
                "summary": "Change a class's seats, times, title or join code (`null` removes the code); once it is running, only its end and seats. Nothing is written unless every field is accepted",
                "security": [{"bearer": []}],
                "requestBody": {"required": true, "content": {"application/json": {"schema": {"type": "object", "additionalProperties": false, "properties": {
                    "title": {"type": "string"}, "seats": {"type": "integer", "minimum": 1, "maximum": 500},
                    "starts_at": {"type": "string", "format": "date-time"}, "ends_at": {"type": "string", "format": "date-time"},
                    "join_code": {"type": ["string", "null"]}}}}}},
                "responses": admin_errors(json!({"200": ok("the class changed", class.clone()), "400": err("invalid_id, malformed body"), "404": err("class_not_found"), "409": err("class_over, class_cancelled, class_changed (changed meanwhile: read it again)"), "422": err(invalid)}))
            },
            "delete": op("Cancel a class: the row stays (`cancelled_at`), and members prepared for it become ordinary members of the pool (surplus beyond its size)", admin_errors(json!({"200": ok("the class cancelled", class), "400": err("invalid_id"), "404": err("class_not_found"), "409": err("class_over, class_cancelled")})))
        }
    })
}

/// The `Class` schema.
fn class_schema() -> Value {
    json!({"type": "object", "properties": {
        "id": {"type": "string", "format": "uuid"}, "lesson": {"type": "string"}, "title": {"type": "string"},
        "seats": {"type": "integer"}, "starts_at": {"type": "string", "format": "date-time"}, "ends_at": {"type": "string", "format": "date-time"},
        "join_code": {"type": ["string", "null"]},
        "phase": {"type": "string", "enum": ["upcoming", "lead_in", "running", "over", "cancelled"]},
        "lead_time": {"type": "object", "description": "how long before its start its members begin to be prepared: the 90th percentile of the lesson's recent members' preparation plus 30 s, from 1 to 30 minutes; 5 minutes while fewer than 3 are measured", "properties": {"seconds": {"type": "integer"}, "source": {"type": "string", "enum": ["default", "measured"]}, "measured": {"type": ["integer", "null"]}, "describe": {"type": "string"}}},
        "lead_in_at": {"type": "string", "format": "date-time"},
        "warm": {"type": ["object", "null"], "description": "its unclaimed members now", "properties": {"ready": {"type": "integer"}, "preparing": {"type": "integer"}}},
        "started": {"type": ["integer", "null"], "description": "distinct students who started a lab in it so far"},
        "seats_warm": {"type": ["integer", "null"], "description": "how many of its seats can be warm at its start: its share, by seats, of the VM places beyond the cold-start reserve with the classes running then (students' own labs take from it); null once over or cancelled"},
        "capacity_note": {"type": ["string", "null"], "description": "when not every seat can be warm: how many, and with whom the places are shared"},
        "overlapping": {"type": "array", "description": "(one class's answers) the classes running at its start, with their seats warm", "items": {"type": "object"}},
        "created_at": {"type": "string", "format": "date-time"}, "created_by": {"type": "string"},
        "updated_at": {"type": "string", "format": "date-time"}, "updated_by": {"type": "string"},
        "cancelled_at": {"type": ["string", "null"], "format": "date-time"}, "cancelled_by": {"type": ["string", "null"]}
    }})
}
