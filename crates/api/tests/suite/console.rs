//! The console end to end: a real server, real PostgreSQL, kube-sim's serial console over
//! HTTP, and a WebSocket client standing in for the browser.

use crate::support;

use std::time::{Duration, Instant};

use futures::{SinkExt as _, StreamExt as _};
use serde_json::{Value, json};
use support::{NS, Running, World, policy, start_running, token};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use ttlab_api::auth::Role;
use ttlab_kube_sim::{FaultRule, Verb};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

async fn ticket(s: &Running, sid: &str, token: &str) -> Value {
    let (status, v) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket"),
            token,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["expires_in_seconds"], 30);
    v
}

fn ws_url(s: &Running, path: &str) -> String {
    format!("{}{path}", s.base.replacen("http://", "ws://", 1))
}

async fn open(s: &Running, sid: &str, token: &str) -> Ws {
    let t = ticket(s, sid, token).await;
    let (ws, _) = tokio_tungstenite::connect_async(ws_url(s, t["url"].as_str().unwrap()))
        .await
        .expect("console opens");
    ws
}

/// The refusal of a WebSocket request that must not be upgraded: status and error body.
async fn refused(url: String) -> (u16, Value) {
    match tokio_tungstenite::connect_async(url).await {
        Ok(_) => panic!("the console opened"),
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            let status = response.status().as_u16();
            let body = response.into_body().unwrap_or_default();
            (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
        }
        Err(e) => panic!("unexpected error: {e}"),
    }
}

/// A status message of the server (the only text frames it sends), as the terminal text
/// read records it: `⟨{"type":"connected"}⟩`.
fn status(text: &str) -> String {
    assert!(
        text.starts_with(r#"{"type":""#),
        "a text frame that is not a status message: {text:?}"
    );
    format!("⟨{text}⟩")
}

/// Terminal text until `needle` appears (bounded); status messages appear in it as
/// [`status`] writes them.
async fn read_until(ws: &mut Ws, needle: &str) -> String {
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !text.contains(needle) {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {text:?}"));
        match msg {
            Some(Ok(Message::Binary(b))) => text.push_str(&String::from_utf8_lossy(&b)),
            Some(Ok(Message::Text(t))) => text.push_str(&status(&t)),
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("waiting for {needle:?} after {text:?}: {other:?}"),
        }
    }
    text
}

/// Terminal text until the Close frame, the frame's code and reason, and when it came.
async fn read_to_close(ws: &mut Ws, within: Duration) -> (String, u16, String, Instant) {
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let msg = tokio::time::timeout_at(deadline, ws.next())
            .await
            .unwrap_or_else(|_| panic!("no Close frame after {text:?}"));
        match msg {
            Some(Ok(Message::Binary(b))) => text.push_str(&String::from_utf8_lossy(&b)),
            Some(Ok(Message::Text(t))) => text.push_str(&status(&t)),
            Some(Ok(Message::Close(Some(close)))) => {
                return (
                    text,
                    close.code.into(),
                    close.reason.to_string(),
                    Instant::now(),
                );
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
            other => panic!("expected a Close frame after {text:?}, got {other:?}"),
        }
    }
}

async fn type_line(ws: &mut Ws, line: &str) {
    ws.send(Message::Binary(format!("{line}\r").into_bytes().into()))
        .await
        .unwrap();
}

#[tokio::test]
async fn the_owner_gets_a_root_shell_and_everyone_else_is_refused_before_the_upgrade() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;

    let mut ws = open(&s, &sid, &alice).await;
    let text = read_until(&mut ws, ":~# ").await;
    assert!(text.contains("login: root (automatic login)"), "{text:?}");
    assert!(text.contains("Connected to the console of"), "{text:?}");
    // The page is told once the console itself is open, before anything of the VM's.
    let connected = text.find(r#"⟨{"type":"connected"}⟩"#);
    assert!(
        connected.is_some_and(|at| at < text.find("Connected to the console of").unwrap()),
        "{text:?}"
    );
    let host = text
        .rsplit("root@")
        .next()
        .and_then(|rest| rest.split(':').next())
        .unwrap()
        .to_owned();
    // Typed as text: the relay still sends it to KubeVirt as binary.
    ws.send(Message::Text("hostname\r".into())).await.unwrap();
    let answer = read_until(&mut ws, &format!("\r\n{host}\r\n")).await;
    assert!(answer.starts_with("hostname"), "{answer:?}");

    // Refusals carry the JSON error body and never upgrade.
    let base = format!("/api/sessions/{sid}/console");
    let (status, body) = refused(ws_url(&s, &base)).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "{body}"
    );
    let (status, body) = refused(ws_url(&s, &format!("{base}?ticket=guessed"))).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "{body}"
    );
    let used = ticket(&s, &sid, &alice).await;
    let url = ws_url(&s, used["url"].as_str().unwrap());
    let (_second, _) = tokio_tungstenite::connect_async(url.clone()).await.unwrap();
    let (status, body) = refused(url).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "single use: {body}"
    );
    let t = ticket(&s, &sid, &alice).await;
    let (status, body) = refused(ws_url(
        &s,
        &format!("{}&node=nope", t["url"].as_str().unwrap()),
    ))
    .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("unknown_node")),
        "{body}"
    );

    // Another student: no ticket for this session, and their own ticket does not open it.
    let bob = token("bob", Role::Student);
    let (status, body) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket"),
            &bob,
            json!({}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (404, Some("session_not_found")),
        "{body}"
    );
    let (bob_sid, bob) = start_running(&s, "bob", "quick").await;
    let bobs = ticket(&s, &bob_sid, &bob).await;
    let (status, body) = refused(ws_url(
        &s,
        &format!("{base}?ticket={}", bobs["ticket"].as_str().unwrap()),
    ))
    .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "{body}"
    );

    // A plain request with a good ticket is not a WebSocket, and does not spend the ticket
    // (a link preview or a proxy's probe must not use up the student's terminal).
    let t = ticket(&s, &sid, &alice).await;
    let url = t["url"].as_str().unwrap();
    for _ in 0..2 {
        let (status, body) = s.get(url, &alice).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (400, Some("websocket_required")),
            "{body}"
        );
    }
    let (mut after, _) = tokio_tungstenite::connect_async(ws_url(&s, url))
        .await
        .expect("the ticket still opens the console after plain GETs");
    read_until(&mut after, "Connected to the console of").await;
    drop(after);
    s.stop().await;
}

#[tokio::test]
async fn a_warning_the_page_was_shown_is_not_written_again_when_it_reconnects() {
    let w = World::new().await;
    let s = w.server(policy(240, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    // Under 5 minutes left: the first console writes the warning and tells the page.
    let mut ws = open(&s, &sid, &alice).await;
    let text = read_until(&mut ws, "minutes left in this lab").await;
    let told = text.find(r#"⟨{"type":"warned","leads":[300]}⟩"#);
    assert!(
        told.is_some_and(|at| at < text.find("minutes left in this lab").unwrap()),
        "{text:?}"
    );
    ws.close(None).await.unwrap();

    // The page reconnects naming it: the console opens without it.
    let t = ticket(&s, &sid, &alice).await;
    let url = format!("{}&warned=300", t["url"].as_str().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url(&s, &url))
        .await
        .expect("console opens");
    read_until(&mut ws, r#"⟨{"type":"connected"}⟩"#).await;
    // Past the redraw and its settling, after which a warning due would be written.
    tokio::time::sleep(Duration::from_secs(3)).await;
    type_line(&mut ws, "echo done-$((6*7))").await;
    let text = read_until(&mut ws, "done-42").await;
    assert!(!text.contains("left in this lab"), "{text:?}");
    assert!(!text.contains("warned"), "{text:?}");
    ws.close(None).await.unwrap();

    // A `warned` that is not a list of seconds is refused before the upgrade.
    let t = ticket(&s, &sid, &alice).await;
    let url = format!("{}&warned=soon", t["url"].as_str().unwrap());
    let (status, body) = refused(ws_url(&s, &url)).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("invalid_query")),
        "{body}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_session_that_is_not_running_gets_no_console() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let alice = token("alice", Role::Student);
    // This lesson's setup never finishes: the session stays `starting` for a while.
    let (status, v) = s
        .post("/api/sessions", &alice, json!({"lesson": "hangs"}))
        .await;
    assert_eq!(status, 202, "{v}");
    let sid = v["id"].as_str().unwrap();
    let (status, body) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket"),
            &alice,
            json!({}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (409, Some("not_running")),
        "{body}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_second_tab_takes_the_console_and_the_first_is_told_why() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let mut first = open(&s, &sid, &alice).await;
    read_until(&mut first, ":~# ").await;

    let mut second = open(&s, &sid, &alice).await;
    let (text, code, reason, _) = read_to_close(&mut first, Duration::from_secs(5)).await;
    assert_eq!(code, 4003);
    assert!(reason.contains("another tab"), "{reason}");
    assert!(text.contains("opened in another tab"), "{text:?}");

    read_until(&mut second, "Connected to the console").await;
    type_line(&mut second, "whoami").await;
    read_until(&mut second, "\r\nroot\r\n").await;
    s.stop().await;
}

#[tokio::test]
async fn the_console_closes_at_the_expiry_second_after_following_an_extension() {
    let w = World::new().await;
    // Long enough that provisioning on a slow machine cannot use it up before the extend.
    let s = w.server(policy(10, 60, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, ":~# ").await;

    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, before) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let (status, after) = s
        .post(&format!("/api/sessions/{sid}/extend"), &alice, json!({}))
        .await;
    assert_eq!(status, 200, "{after}");
    let old: chrono::DateTime<chrono::Utc> =
        before["expires_at"].as_str().unwrap().parse().unwrap();
    let new: chrono::DateTime<chrono::Utc> = after["expires_at"].as_str().unwrap().parse().unwrap();
    assert!(
        new > old + chrono::TimeDelta::milliseconds(1000),
        "{old} → {new}"
    );

    let (text, code, _, _) = read_to_close(&mut ws, Duration::from_secs(20)).await;
    let closed_at = chrono::Utc::now();
    assert_eq!(code, 4001);
    assert!(text.contains("Your lab session has expired."), "{text:?}");
    let late = (closed_at - new).num_milliseconds();
    assert!(
        (-50..=500).contains(&late),
        "closed {late} ms after the extended expiry (old expiry {old}, new {new})"
    );
    s.stop().await;
}

#[tokio::test]
async fn finishing_the_session_or_stopping_the_vm_closes_the_console_with_the_reason() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;

    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, ":~# ").await;
    let (status, v) = s.delete(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(status, 200, "{v}");
    let (text, code, _, _) = read_to_close(&mut ws, Duration::from_secs(15)).await;
    assert_eq!(code, 4002, "{text:?}");
    assert!(text.contains("This lab session was finished."), "{text:?}");

    let (sid, bob) = start_running(&s, "bob", "quick").await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &bob).await;
    let vm = v["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let mut ws = open(&s, &sid, &bob).await;
    read_until(&mut ws, ":~# ").await;
    w.sim.power_off(NS, &vm).unwrap();
    let (text, code, _, _) = read_to_close(&mut ws, Duration::from_secs(15)).await;
    assert_eq!(code, 4004, "{text:?}");
    assert!(text.contains("The VM has stopped."), "{text:?}");
    s.stop().await;
}

#[tokio::test]
async fn a_crashed_guest_is_restarting_not_stopped_and_its_console_comes_back() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let vm = v["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, ":~# ").await;
    // RerunOnFailure restarts a crashed guest: the page must be told to reconnect, not that
    // the VM stopped, whichever step of the VMI's replacement the server sees (each step is
    // covered by the unit tests of `console::upstream`, and held one at a time while the
    // server looks by `a_crashed_guest_reads_restarting_at_every_step_of_its_replacement`).
    w.sim.crash(NS, &vm).unwrap();
    let (text, code, reason, _) = read_to_close(&mut ws, Duration::from_secs(15)).await;
    assert_eq!(code, 4006, "{text:?} {reason:?}");
    assert!(!text.contains("The VM has stopped."), "{text:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut ws = open(&s, &sid, &alice).await;
    let mut seen = String::new();
    while !seen.contains(":~# ") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => seen.push_str(&String::from_utf8_lossy(&b)),
            Ok(Some(Ok(Message::Text(t)))) => {
                status(&t);
            }
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
            Ok(Some(Ok(Message::Close(close)))) => {
                assert!(!seen.contains("The VM has stopped."), "{seen:?} {close:?}");
                ws = open(&s, &sid, &alice).await;
            }
            other => panic!("no prompt from the restarted guest after {seen:?}: {other:?}"),
        }
    }
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["status"], "running", "{v}");
    s.stop().await;
}

/// A finalizer of the test's own on a VMI: once the VMI is deleted, it stays (Failed, being
/// deleted) until the test lets it go, as a slow shutdown would hold it.
const HOLD: &str = "test.ttlab.io/hold";

/// Applies a JSON patch to VMI `name` directly in kube-sim (as an administrator).
async fn patch_vmi(w: &World, name: &str, ops: Value) {
    use http_body_util::{BodyExt as _, Full};
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<bytes::Bytes>>();
    let req = http::Request::builder()
        .method("PATCH")
        .uri(format!(
            "{}/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachineinstances/{name}",
            w.sim.url()
        ))
        .header("content-type", "application/json-patch+json")
        .body(Full::new(serde_json::to_vec(&ops).unwrap().into()))
        .unwrap();
    let res = http.request(req).await.unwrap();
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    assert!(status.is_success(), "{ops}: {status} {body:?}");
}

/// Takes the test's finalizer off VMI `name` (the VMI goes once nothing else holds it).
async fn release_vmi(w: &World, name: &str) {
    let vmi = w.sim.get("virtualmachineinstances", NS, name).unwrap();
    let at = vmi["metadata"]["finalizers"]
        .as_array()
        .and_then(|f| f.iter().position(|f| f == HOLD))
        .unwrap_or_else(|| panic!("no {HOLD} on {}", vmi["metadata"]));
    let path = format!("/metadata/finalizers/{at}");
    patch_vmi(
        w,
        name,
        json!([{"op": "test", "path": path, "value": HOLD}, {"op": "remove", "path": path}]),
    )
    .await;
}

/// Waits (bounded) until `what` holds of kube-sim's objects.
async fn until(what: &str, holds: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !holds() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Opens the console until the guest's prompt shows, reconnecting as the page does while the
/// VM restarts (bounded).
async fn prompt(s: &Running, sid: &str, token: &str) -> Ws {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut ws = open(s, sid, token).await;
        let mut seen = String::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => {
                    seen.push_str(&String::from_utf8_lossy(&b));
                    if seen.contains(":~# ") {
                        return ws;
                    }
                }
                Ok(Some(Ok(Message::Text(t)))) => {
                    status(&t);
                }
                Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
                Ok(Some(Ok(Message::Close(_)))) | Ok(None) => break,
                other => panic!("no prompt from the guest after {seen:?}: {other:?}"),
            }
        }
    }
}

/// What a console opened now says first: its waiting line, or why it closed.
async fn first_words(s: &Running, sid: &str, token: &str) -> String {
    let mut ws = open(s, sid, token).await;
    let mut text = String::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::time::timeout_at(deadline, ws.next()).await {
            Ok(Some(Ok(Message::Binary(b)))) => {
                text.push_str(&String::from_utf8_lossy(&b));
                if let Some(end) = text.find("\x1b[0m") {
                    let line = text[..end].rsplit("[ttlab] ").next().unwrap_or_default();
                    return line.to_owned();
                }
            }
            Ok(Some(Ok(Message::Text(t)))) => {
                status(&t);
            }
            Ok(Some(Ok(Message::Ping(_) | Message::Pong(_)))) => {}
            Ok(Some(Ok(Message::Close(close)))) => {
                return format!("closed: {close:?} after {text:?}");
            }
            other => return format!("{other:?} after {text:?}"),
        }
    }
}

/// A step of a crashed guest's replacement under `RerunOnFailure`, as KubeVirt shows it.
#[derive(Debug, Clone, Copy)]
enum Replacement {
    /// The crashed VMI, `Failed`, still there while it is deleted; the VM reads `Stopped`
    /// with a `Start` request pending.
    FailedVmi,
    /// No VMI; the VM reads `Stopped` with the `Start` request pending.
    StartPending,
    /// The next VMI, starting in this phase.
    NextVmi(ttlab_kube_sim::StartingPhase),
}

/// What the student saw of a crash whose replacement stood at `step` when the server looked.
struct Seen {
    step: Replacement,
    /// The close code and reason of the console that was open at the crash.
    code: u16,
    reason: String,
    /// The terminal's text of that console.
    text: String,
    /// What a console opened at that step said first (the page reconnecting).
    reopened: String,
}

impl Seen {
    fn wanted_on_reopening(&self) -> String {
        match self.step {
            Replacement::FailedVmi | Replacement::StartPending => {
                "Waiting for the VM's console: the VM is restarting".to_owned()
            }
            Replacement::NextVmi(phase) => format!(
                "Waiting for the VM's console: the VM is {}, not yet Running",
                phase.as_str()
            ),
        }
    }

    /// What the student was told wrong, if anything.
    fn wrong(&self) -> Option<String> {
        let mut wrong = Vec::new();
        if self.code != 4006
            || !self.reason.contains("the VM is restarting")
            || self.text.contains("The VM has stopped.")
        {
            wrong.push(format!(
                "the open console closed {} {:?}",
                self.code, self.reason
            ));
        }
        let wanted = self.wanted_on_reopening();
        if self.reopened != wanted {
            wrong.push(format!(
                "a console opened then said {:?}, not {wanted:?}",
                self.reopened
            ));
        }
        (!wrong.is_empty()).then(|| format!("- at {:?}: {}", self.step, wrong.join("; ")))
    }
}

/// Crashes the guest of `vm` with the server's view of the cluster held back (a stalled
/// `proxy`) until the replacement stands at `step`, held there; then lets the server see
/// the console's end, opens a console as the page would, and lets the replacement finish.
async fn crash_seen_at(
    w: &World,
    s: &Running,
    proxy: &ttlab_testkit::FaultProxy,
    (sid, token, vm): (&str, &str, &str),
    step: Replacement,
) -> Seen {
    let crashed = w.sim.get("virtualmachineinstances", NS, vm).unwrap();
    let crashed_uid = crashed["metadata"]["uid"].clone();
    match step {
        Replacement::FailedVmi | Replacement::StartPending => {
            patch_vmi(
                w,
                vm,
                json!([{"op": "add", "path": "/metadata/finalizers/-", "value": HOLD}]),
            )
            .await;
        }
        Replacement::NextVmi(phase) => w.sim.hold_starting_vmis(Some(phase)),
    }
    let mut ws = prompt(s, sid, token).await;

    proxy.set_mode(ttlab_testkit::FaultMode::Stall);
    w.sim.crash(NS, vm).unwrap();
    let vmi = || w.sim.get("virtualmachineinstances", NS, vm);
    let vm_start_pending = || {
        w.sim.get("virtualmachines", NS, vm).is_some_and(|v| {
            v["status"]["printableStatus"] == "Stopped"
                && v["status"]["stateChangeRequests"][0]["action"] == "Start"
        })
    };
    let failed_and_held = || {
        vmi().is_some_and(|v| {
            v["metadata"]["uid"] == crashed_uid
                && v["status"]["phase"] == "Failed"
                && v["metadata"]["deletionTimestamp"].is_string()
        })
    };
    match step {
        Replacement::FailedVmi => {
            until(
                "the Failed VMI held, the VM Stopped with a start pending",
                || failed_and_held() && vm_start_pending(),
            )
            .await;
        }
        Replacement::StartPending => {
            until("the Failed VMI held by the test's finalizer alone", || {
                failed_and_held()
                    && vm_start_pending()
                    && vmi().is_some_and(|v| v["metadata"]["finalizers"] == json!([HOLD]))
            })
            .await;
            // Nothing may start the next VMI: the VM controller is paused, then the VMI goes.
            w.sim.pause_kubevirt(true);
            release_vmi(w, vm).await;
            until("the Failed VMI gone", || vmi().is_none()).await;
            assert!(
                vm_start_pending(),
                "{:?}",
                w.sim.get("virtualmachines", NS, vm)
            );
        }
        Replacement::NextVmi(phase) => {
            until(&format!("the next VMI {}", phase.as_str()), || {
                vmi().is_some_and(|v| {
                    v["metadata"]["uid"] != crashed_uid && v["status"]["phase"] == phase.as_str()
                })
            })
            .await;
        }
    }

    // The server now learns that the console ended, and looks at the VM.
    proxy.set_mode(ttlab_testkit::FaultMode::Pass);
    let (text, code, reason, _) = read_to_close(&mut ws, Duration::from_secs(15)).await;
    let reopened = first_words(s, sid, token).await;

    match step {
        Replacement::FailedVmi => release_vmi(w, vm).await,
        Replacement::StartPending => w.sim.pause_kubevirt(false),
        Replacement::NextVmi(_) => w.sim.hold_starting_vmis(None),
    }
    until("the next VMI running", || {
        vmi().is_some_and(|v| {
            v["metadata"]["uid"] != crashed_uid && v["status"]["phase"] == "Running"
        })
    })
    .await;
    Seen {
        step,
        code,
        reason,
        text,
        reopened,
    }
}

/// A crashed guest is restarted (`RerunOnFailure`): its console must close "the VM is
/// restarting" (4006: the page reconnects), never "The VM has stopped.", at whichever step of
/// the replacement the server looks — the Failed VMI, the VM Stopped with a start pending, the
/// next VMI Pending, Scheduling or Scheduled — and a console opened meanwhile must wait, not
/// close. Each step is held while the server looks (a stalled proxy keeps the console's end
/// from the server until then).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_guest_reads_restarting_at_every_step_of_its_replacement() {
    use ttlab_kube_sim::StartingPhase;
    let w = World::new().await;
    let proxy =
        ttlab_testkit::FaultProxy::start(ttlab_testkit::Upstream::Tcp(w.sim.addr())).unwrap();
    let config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    let s = w
        .serve_with(
            config,
            w.db.store().await.unwrap(),
            w.cluster_through(proxy.addr()).await,
        )
        .await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let vm = v["nodes"][0]["vm"].as_str().unwrap().to_owned();

    let mut seen = Vec::new();
    for step in [
        Replacement::FailedVmi,
        Replacement::StartPending,
        Replacement::NextVmi(StartingPhase::Pending),
        Replacement::NextVmi(StartingPhase::Scheduling),
        Replacement::NextVmi(StartingPhase::Scheduled),
    ] {
        seen.push(crash_seen_at(&w, &s, &proxy, (&sid, &alice, &vm), step).await);
    }
    let wrong: Vec<String> = seen.iter().filter_map(Seen::wrong).collect();
    assert!(
        wrong.is_empty(),
        "a crashed guest must read \"the VM is restarting\" at every step of its \
         replacement:\n{}",
        wrong.join("\n")
    );
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["status"], "running", "{v}");
    s.stop().await;
}

#[tokio::test]
async fn a_console_that_is_not_ready_is_retried_every_second_with_a_message() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    w.sim.faults().add(
        FaultRule::fail(
            Some(Verb::Get),
            Some("virtualmachineinstances/console"),
            400,
        )
        .times(2),
    );
    let started = Instant::now();
    let mut ws = open(&s, &sid, &alice).await;
    let text = read_until(&mut ws, "Connected to the console").await;
    assert!(text.contains("Waiting for the VM's console"), "{text:?}");
    let waited = started.elapsed();
    assert!(
        (Duration::from_millis(1900)..Duration::from_secs(4)).contains(&waited),
        "two refusals, one second apart, then connected: {waited:?}"
    );
    read_until(&mut ws, ":~# ").await;
    s.stop().await;
}

#[tokio::test]
async fn a_console_answering_404_while_the_vm_runs_is_waited_for_not_called_stopped() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    // The console subresource is not served for a moment (virt-api restarting, the VMI being
    // replaced): KubeVirt answers 404 while the VM runs.
    w.sim.faults().add(
        FaultRule::fail(
            Some(Verb::Get),
            Some("virtualmachineinstances/console"),
            404,
        )
        .times(2),
    );
    let mut ws = open(&s, &sid, &alice).await;
    let text = read_until(&mut ws, "Connected to the console").await;
    assert!(
        text.contains(
            "Waiting for the VM's console: the VM is running, but its console is not available \
             right now; retrying"
        ),
        "{text:?}"
    );
    assert!(!text.contains("stopped"), "{text:?}");
    read_until(&mut ws, ":~# ").await;
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Several server replicas behind a load balancer without sticky sessions

/// A ticket from `s`, with whatever lifetime that server gives.
async fn any_ticket(s: &Running, sid: &str, token: &str) -> Value {
    let (status, v) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket"),
            token,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    v
}

#[tokio::test]
async fn a_ticket_issued_by_one_replica_opens_the_console_on_another_once_and_not_after_it_expired()
{
    let w = World::new().await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.console_ticket_ttl = Duration::from_secs(1);
    let a = w.serve(config.clone()).await;
    let b = w.serve(config).await;
    let (sid, alice) = start_running(&a, "alice", "quick").await;

    let t = any_ticket(&a, &sid, &alice).await;
    assert_eq!(t["expires_in_seconds"], 1);
    let url = t["url"].as_str().unwrap().to_owned();
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url(&b, &url))
        .await
        .expect("the console opens on the other replica");
    read_until(&mut ws, ":~# ").await;
    // Single use, on every replica.
    for s in [&a, &b] {
        let (status, body) = refused(ws_url(s, &url)).await;
        assert_eq!(
            (status, body["error"].as_str()),
            (403, Some("invalid_ticket")),
            "second use: {body}"
        );
    }
    // Expired (database clock): refused, whichever replica is asked.
    let late = any_ticket(&b, &sid, &alice).await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let (status, body) = refused(ws_url(&a, late["url"].as_str().unwrap())).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "expired: {body}"
    );
    // Only digests are stored, and the expired one is purged by the next issue.
    let store = w.db.store().await.unwrap();
    any_ticket(&a, &sid, &alice).await;
    assert_eq!(store.console_tickets().count().await.unwrap(), 1);
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn a_ticket_can_name_its_node_and_then_opens_that_node_only() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "duo").await;
    let (status, t) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket?node=two"),
            &alice,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{t}");
    let url = t["url"].as_str().unwrap();
    assert!(url.ends_with("&node=two"), "{url}");
    let (status, body) = refused(ws_url(&s, &url.replace("&node=two", "&node=one"))).await;
    assert_eq!(
        (status, body["error"].as_str()),
        (403, Some("invalid_ticket")),
        "{body}"
    );
    let (status, t) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket?node=two"),
            &alice,
            json!({}),
        )
        .await;
    assert_eq!(status, 200, "{t}");
    // Without `&node=` the ticket's node is opened.
    let url = t["url"].as_str().unwrap().replace("&node=two", "");
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url(&s, &url))
        .await
        .unwrap();
    let text = read_until(&mut ws, ":~# ").await;
    assert!(text.contains("Connected to the console of two"), "{text:?}");
    let (status, body) = s
        .post(
            &format!("/api/sessions/{sid}/console-ticket?node=three"),
            &alice,
            json!({}),
        )
        .await;
    assert_eq!(
        (status, body["error"].as_str()),
        (400, Some("unknown_node")),
        "{body}"
    );
    s.stop().await;
}

#[tokio::test]
async fn a_second_tab_on_another_replica_takes_the_console_and_the_first_does_not_take_it_back() {
    let w = World::new().await;
    let a = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let b = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&a, "alice", "quick").await;
    let mut first = open(&a, &sid, &alice).await;
    read_until(&mut first, ":~# ").await;

    let mut second = open(&b, &sid, &alice).await;
    let (text, code, reason, _) = read_to_close(&mut first, Duration::from_secs(5)).await;
    assert_eq!(code, 4003, "{reason}: {text:?}");
    assert!(reason.contains("another tab"), "{reason}");

    // The page does not reconnect after 4003, so nothing takes the console back: the second
    // tab stays open and usable (`read_until` fails on any Close frame).
    read_until(&mut second, "Connected to the console").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    type_line(&mut second, "whoami").await;
    read_until(&mut second, "\r\nroot\r\n").await;

    // And back: a third tab on the first replica closes the second one the same way.
    let mut third = open(&a, &sid, &alice).await;
    let (_, code, _, _) = read_to_close(&mut second, Duration::from_secs(5)).await;
    assert_eq!(code, 4003);
    read_until(&mut third, "Connected to the console").await;
    type_line(&mut third, "hostname").await;
    read_until(&mut third, "hostname\r\n").await;
    a.stop().await;
    b.stop().await;
}

// ---------------------------------------------------------------------------------------------
// Pod labs: the same browser protocol over pod exec

const POD_LESSON: &str = r#"
id: console-pod
title: A shell in a pod (console test)
runtime: pod
image: docker.io/library/debian:12
memory: 128Mi
readiness_timeout_seconds: 5
"#;

#[tokio::test]
async fn a_pod_lab_console_is_a_shell_in_the_pod() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.lessons = ttlab_lesson::LessonSet::from_sources([
        ("test.yaml".into(), support::LESSONS.to_owned()),
        ("pod.yaml".into(), POD_LESSON.to_owned()),
    ])
    .unwrap();
    let s = w.serve(config).await;
    let (sid, alice) = start_running(&s, "alice", "console-pod").await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    assert_eq!(v["runtime"], "pod", "{v}");
    let pod = v["nodes"][0]["vm"].as_str().unwrap().to_owned();

    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, "Connected to ").await;
    type_line(&mut ws, "hostname").await;
    read_until(&mut ws, &format!("\r\n{pod}\r\n")).await;
    s.stop().await;
}

#[tokio::test]
async fn a_pod_lab_whose_container_stops_is_told_so_without_a_word_of_a_vm() {
    let w = World::new().await;
    let mut config = w.config(policy(3600, 4 * 3600, 3), 8).await;
    config.lessons = ttlab_lesson::LessonSet::from_sources([
        ("test.yaml".into(), support::LESSONS.to_owned()),
        ("pod.yaml".into(), POD_LESSON.to_owned()),
    ])
    .unwrap();
    let s = w.serve(config).await;
    let (sid, alice) = start_running(&s, "alice", "console-pod").await;
    let (_, v) = s.get(&format!("/api/sessions/{sid}"), &alice).await;
    let pod = v["nodes"][0]["vm"].as_str().unwrap().to_owned();
    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, "Connected to ").await;

    // The pod goes away under the student (evicted, deleted by hand), and the shell ends.
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let req = http::Request::delete(format!("{}/api/v1/namespaces/{NS}/pods/{pod}", w.sim.url()))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    assert!(http.request(req).await.unwrap().status().is_success());
    type_line(&mut ws, "exit").await;
    let (text, code, reason, _) = read_to_close(&mut ws, Duration::from_secs(15)).await;
    assert_eq!(code, 4004, "{text:?}");
    assert_eq!(reason, "The lab's container has stopped.");
    assert!(!text.contains("VM"), "{text:?}");
    s.stop().await;
}

// ---------------------------------------------------------------------------------------------
// The console's owner in the admin's session view

/// The `console` list of the admin's view of `sid`.
async fn console_owners(s: &Running, sid: &str) -> Vec<Value> {
    let admin = token("root-admin", Role::Admin);
    let (status, v) = s.get(&format!("/api/admin/sessions/{sid}"), &admin).await;
    assert_eq!(status, 200, "{v}");
    v["console"]
        .as_array()
        .cloned()
        .unwrap_or_else(|| panic!("no console list: {v}"))
}

fn at(v: &Value) -> chrono::DateTime<chrono::Utc> {
    v.as_str()
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("not a time: {v}"))
}

#[tokio::test]
async fn the_admin_sees_who_holds_the_console_and_when_it_closed() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    assert_eq!(
        console_owners(&s, &sid).await,
        Vec::<Value>::new(),
        "never opened"
    );

    let mut first = open(&s, &sid, &alice).await;
    read_until(&mut first, ":~# ").await;
    let owners = console_owners(&s, &sid).await;
    assert_eq!(owners.len(), 1, "{owners:?}");
    let held = &owners[0];
    assert_eq!(held["user"], "alice", "{held}");
    assert!(
        held["node"].as_str().is_some_and(|n| !n.is_empty()),
        "{held}"
    );
    assert!(
        held["replica"].as_str().is_some_and(|r| !r.is_empty()),
        "{held}"
    );
    assert!(held["opened_at"].is_string(), "{held}");
    assert_eq!(held["closed_at"], Value::Null, "open: {held}");
    assert_eq!(held["closed_why"], Value::Null, "{held}");

    // A second tab takes the console: the first one's close does not mark the second closed.
    let mut second = open(&s, &sid, &alice).await;
    let (_, code, _, _) = read_to_close(&mut first, Duration::from_secs(5)).await;
    assert_eq!(code, 4003);
    read_until(&mut second, "Connected to the console").await;
    type_line(&mut second, "whoami").await;
    read_until(&mut second, "\r\nroot\r\n").await;
    let owners = console_owners(&s, &sid).await;
    assert_eq!(owners.len(), 1, "one row per console: {owners:?}");
    assert_eq!(
        owners[0]["closed_at"],
        Value::Null,
        "the second tab holds it: {owners:?}"
    );
    assert!(
        at(&owners[0]["opened_at"]) >= at(&held["opened_at"]),
        "{owners:?} after {held}"
    );

    // The browser closes it: the view says when and why.
    second.close(None).await.unwrap();
    let mut closed = None;
    for _ in 0..200 {
        let owners = console_owners(&s, &sid).await;
        if !owners[0]["closed_at"].is_null() {
            closed = Some(owners[0].clone());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let closed = closed.expect("the close is recorded within 10 s");
    assert_eq!(closed["closed_why"], "browser_closed", "{closed}");
    assert_eq!(closed["user"], "alice", "{closed}");
    assert!(
        at(&closed["closed_at"]) >= at(&closed["opened_at"]),
        "{closed}"
    );
    s.stop().await;
}

#[tokio::test]
async fn the_console_record_of_a_replica_that_is_gone_is_closed_as_replica_gone() {
    let w = World::new().await;
    let s = w.server(policy(3600, 4 * 3600, 3), 8).await;
    let (sid, alice) = start_running(&s, "alice", "quick").await;
    // A console this replica relays: it marks its record seen, which stays open.
    let mut ws = open(&s, &sid, &alice).await;
    read_until(&mut ws, ":~# ").await;
    // Bob's console was relayed by a replica that crashed: its record stays open, and
    // nobody marks it seen any more. (A replica stopped in-process still closes its consoles
    // on the way out; the record of a killed process is what this stands for.)
    let (bob_sid, _bob) = start_running(&s, "bob", "quick").await;
    let store = w.db.store().await.unwrap();
    store
        .console_connections()
        .opened(
            bob_sid.parse().unwrap(),
            &"vm".parse().unwrap(),
            uuid::Uuid::new_v4(),
            &ttlab_model::UserId::new("bob").unwrap(),
            "crashed-replica",
        )
        .await
        .unwrap();
    let recorded = Instant::now();
    let deadline = recorded + Duration::from_secs(60);
    let closed = loop {
        let owners = console_owners(&s, &bob_sid).await;
        if !owners[0]["closed_at"].is_null() {
            break owners[0].clone();
        }
        assert!(
            Instant::now() < deadline,
            "still open a minute after its replica stopped marking it: {owners:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(closed["closed_why"], "replica_gone", "{closed}");
    assert_eq!(closed["replica"], "crashed-replica", "{closed}");
    assert!(
        recorded.elapsed() >= Duration::from_secs(25),
        "closed {:?} after it was last seen",
        recorded.elapsed()
    );
    // The live replica's console is still open, and says so.
    let owners = console_owners(&s, &sid).await;
    assert_eq!(owners[0]["closed_at"], Value::Null, "{owners:?}");
    type_line(&mut ws, "whoami").await;
    read_until(&mut ws, "\r\nroot\r\n").await;
    s.stop().await;
}
