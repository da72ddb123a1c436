//! Simulated students: one task each, on one environment, choosing with a seeded generator.
//! A student opens a lab (one VM, two VMs, or a pod lab; sometimes with a double click),
//! follows it until it runs, then
//! extends (also past the limits), grades, reconnects the console, finishes or abandons it,
//! and starts again. Every answer goes to the journal for the 5xx invariant.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use chrono::Utc;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_tungstenite::tungstenite;
use ttlab_api::auth::Role;

use super::ENVS;
use super::rig::{ApiCall, LESSON_MULTI, LESSON_POD, LESSON_SINGLE, Shared, lock};
use crate::dev::demo::client::{self, Method};

/// Longest wait for one answer.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A small seeded generator (SplitMix64): reproducible choices without a dependency.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// A duration between `lo` and `hi` milliseconds.
    pub(crate) fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

/// Starts every student.
pub(crate) fn spawn_all(
    shared: &Arc<Shared>,
    stop: watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let ttl = shared.settings.duration + Duration::from_secs(3600);
    (0..shared.settings.students)
        .filter_map(|i| {
            let env = (i % 2) as usize;
            let user = format!("soak-{}-{i}", ENVS[env]);
            let token = match user.parse().map_err(|e| format!("{e}")).and_then(|u| {
                shared
                    .auth
                    .mint(&u, Role::Student, now, ttl)
                    .map_err(|e| e.to_string())
            }) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("ttlabctl: soak: cannot mint a token for {user}: {e}");
                    return None;
                }
            };
            let student = Student {
                shared: shared.clone(),
                env,
                token,
                rng: Rng::new(
                    shared
                        .settings
                        .seed
                        .wrapping_mul(1_000_003)
                        .wrapping_add(u64::from(i)),
                ),
                stop: stop.clone(),
            };
            Some(tokio::spawn(student.run()))
        })
        .collect()
}

struct Student {
    shared: Arc<Shared>,
    env: usize,
    token: String,
    rng: Rng,
    stop: watch::Receiver<bool>,
}

/// An answer: status (0: none) and body.
type Answer = (u16, Value);

impl Student {
    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Sleeps, returning early when the run stops.
    async fn pause(&mut self, d: Duration) {
        let mut stop = self.stop.clone();
        tokio::select! {
            () = tokio::time::sleep(d) => {}
            _ = stop.wait_for(|s| *s) => {}
        }
    }

    async fn call(
        &self,
        route: &'static str,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Answer {
        call(
            &self.shared,
            self.env,
            &self.token,
            route,
            method,
            path,
            body,
        )
        .await
    }

    async fn run(mut self) {
        // Spread the first clicks over a few seconds.
        let first = self.rng.millis(0, 3000);
        self.pause(first).await;
        while !self.stopping() {
            let lesson = if self.rng.chance(self.shared.settings.pod_labs) {
                LESSON_POD
            } else if self.rng.chance(0.2) {
                LESSON_MULTI
            } else {
                LESSON_SINGLE
            };
            let body = json!({ "lesson": lesson });
            let (status, answer) = if self.rng.chance(0.15) {
                self.shared.journal.count("double clicks");
                let (a, b) = tokio::join!(
                    self.call(
                        "POST /api/sessions",
                        Method::POST,
                        "/api/sessions",
                        Some(&body)
                    ),
                    self.call(
                        "POST /api/sessions",
                        Method::POST,
                        "/api/sessions",
                        Some(&body)
                    ),
                );
                if a.0 == 202 { a } else { b }
            } else {
                self.call(
                    "POST /api/sessions",
                    Method::POST,
                    "/api/sessions",
                    Some(&body),
                )
                .await
            };
            let id = match (status, code(&answer)) {
                (202, _) => {
                    self.shared.journal.count("sessions opened");
                    answer["id"].as_str().map(str::to_owned)
                }
                (409, "session_exists") => {
                    let (s, current) = self
                        .call(
                            "GET /api/sessions/current",
                            Method::GET,
                            "/api/sessions/current",
                            None,
                        )
                        .await;
                    if s == 200 {
                        current["id"].as_str().map(str::to_owned)
                    } else {
                        None
                    }
                }
                (503, "capacity") => {
                    self.shared.journal.count("refused: capacity");
                    None
                }
                _ => None,
            };
            // A real control plane has no kubelet to serve a pod's exec (docs/testing.md):
            // there a pod lab is not graded and its terminal is not opened.
            let no_exec =
                lesson == LESSON_POD && self.shared.settings.backend == super::kube::Backend::Real;
            match id {
                Some(id) => self.follow(&id, no_exec).await,
                None => {
                    let d = self.rng.millis(500, 3000);
                    self.pause(d).await;
                }
            }
            let think = self.rng.millis(200, 1500);
            self.pause(think).await;
        }
    }

    /// Uses one session until it is final (or, when the run stops, finishes or abandons it);
    /// with `no_exec`, without grading it or opening its terminal.
    async fn follow(&mut self, id: &str, no_exec: bool) {
        let path = format!("/api/sessions/{id}");
        let mut abandoned = false;
        loop {
            if self.stopping() {
                if self.rng.chance(0.5) {
                    self.call("DELETE /api/sessions/{id}", Method::DELETE, &path, None)
                        .await;
                }
                return;
            }
            let (status, s) = self
                .call("GET /api/sessions/{id}", Method::GET, &path, None)
                .await;
            let state = s["status"].as_str().unwrap_or("");
            if status == 404
                || matches!(
                    state,
                    "expired" | "finished" | "failed" | "ghost" | "requeued"
                )
            {
                if !state.is_empty() {
                    self.shared.journal.count(match state {
                        "expired" => "seen expired",
                        "finished" => "seen finished",
                        "failed" => "seen failed",
                        "requeued" => "seen requeued",
                        _ => "seen ghost",
                    });
                }
                return;
            }
            if state != "running" || abandoned {
                let d = self.rng.millis(300, 1200);
                self.pause(d).await;
                continue;
            }
            let roll = self.rng.next() % 100;
            match roll {
                0..=5 => {
                    self.shared.journal.count("finishes");
                    self.call("DELETE /api/sessions/{id}", Method::DELETE, &path, None)
                        .await;
                }
                6..=10 => {
                    self.shared.journal.count("abandons");
                    abandoned = true;
                }
                11..=30 => {
                    let (st, a) = self
                        .call(
                            "POST /api/sessions/{id}/extend",
                            Method::POST,
                            &format!("{path}/extend"),
                            None,
                        )
                        .await;
                    self.shared.journal.count(match (st, code(&a)) {
                        (200, _) => "extensions granted",
                        (409, "extension_limit") => "extensions refused: limit",
                        (409, "max_lifetime") => "extensions refused: max lifetime",
                        (409, "too_early") => "extensions refused: too early",
                        _ => "extensions refused: other",
                    });
                }
                31..=60 if no_exec => {
                    self.shared
                        .journal
                        .count("pod-lab grades and terminals left out (no kubelet)");
                }
                31..=45 => {
                    let (st, _) = self
                        .call(
                            "POST /api/sessions/{id}/grade",
                            Method::POST,
                            &format!("{path}/grade"),
                            None,
                        )
                        .await;
                    if st == 200 {
                        self.shared.journal.count("grades");
                    }
                }
                46..=60 => self.console(id).await,
                _ => {}
            }
            let d = self.rng.millis(300, 1500);
            self.pause(d).await;
        }
    }

    /// Trades the token for a ticket and opens the console WebSocket, reads a little, leaves.
    async fn console(&mut self, id: &str) {
        let (status, ticket) = self
            .call(
                "POST /api/sessions/{id}/console-ticket",
                Method::POST,
                &format!("/api/sessions/{id}/console-ticket"),
                None,
            )
            .await;
        if status != 200 {
            return;
        }
        let Some(path) = ticket["url"].as_str() else {
            return;
        };
        let base = self.shared.url(self.env);
        let url = format!("ws{}{path}", base.trim_start_matches("http"));
        let started = Utc::now();
        let opened =
            tokio::time::timeout(REQUEST_TIMEOUT, tokio_tungstenite::connect_async(url)).await;
        let (status, code) = match opened {
            Ok(Ok((mut ws, _))) => {
                use futures::StreamExt as _;
                let _ = tokio::time::timeout(Duration::from_millis(500), ws.next()).await;
                let _ = ws.close(None).await;
                self.shared.journal.count("consoles opened");
                (101, String::new())
            }
            Ok(Err(tungstenite::Error::Http(r))) => {
                let body = r
                    .body()
                    .as_deref()
                    .and_then(|b| serde_json::from_slice::<Value>(b).ok())
                    .unwrap_or(Value::Null);
                (r.status().as_u16(), code(&body).to_owned())
            }
            Ok(Err(_)) | Err(_) => (0, String::new()),
        };
        lock(&self.shared.journal.calls).push(ApiCall {
            env: self.env,
            route: "GET /api/sessions/{id}/console",
            status,
            code,
            session: Some(id.to_owned()),
            started,
            ended: Utc::now(),
        });
    }
}

fn code(v: &Value) -> &str {
    v["error"].as_str().unwrap_or("")
}

/// Sends one request to an environment's server and journals the answer.
pub(crate) async fn call(
    shared: &Shared,
    env: usize,
    token: &str,
    route: &'static str,
    method: Method,
    path: &str,
    body: Option<&Value>,
) -> Answer {
    let url = format!("{}{path}", shared.url(env));
    let started = Utc::now();
    let answer = tokio::time::timeout(
        REQUEST_TIMEOUT,
        client::send(&shared.http, method, &url, Some(token), body),
    )
    .await;
    let (status, value) = match answer {
        Ok(Ok((s, bytes))) => (
            s.as_u16(),
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ),
        // No answer: the server is down (connection refused or cut), or too slow.
        Ok(Err(_)) => (0, json!({"error": "no connection"})),
        Err(_) => (0, json!({"error": "timed out"})),
    };
    lock(&shared.journal.calls).push(ApiCall {
        env,
        route,
        status,
        code: code(&value).to_owned(),
        session: path
            .strip_prefix("/api/sessions/")
            .and_then(|rest| rest.split('/').next())
            .filter(|id| *id != "current")
            .map(str::to_owned),
        started,
        ended: Utc::now(),
    });
    (status, value)
}
