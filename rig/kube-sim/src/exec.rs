//! The pod exec subresource: `GET /api/v1/namespaces/{ns}/pods/{name}/exec?command=…`
//! upgraded to a WebSocket with the Kubernetes channel subprotocols (`v5.channel.k8s.io`,
//! `v4.channel.k8s.io`, and the older `v3`, `v2` and `channel.k8s.io`). Every binary frame
//! starts with its channel: 0 stdin, 1 stdout, 2 stderr, 3 the error channel (a `Status` as
//! JSON from v4 on, the error text before), 4 terminal resize (v3 on), and from v5 on 255 to
//! close one channel (`[255, 0]`: the end of stdin).
//!
//! Behind it runs the simulated shell of [`crate::terminal`] as the pod's process: an
//! interactive shell (`bash`, `sh`, … with or without a TTY), a `sh -c SCRIPT`, or one builtin
//! program (`hostname`, `whoami`, …). When it ends, the exit status goes out on channel 3 and
//! the connection closes, as the kubelet does.
//!
//! The order in time is the real one: the upgrade, at once the empty frame that says the
//! stream is up, and only after [`crate::SimConfig::exec_start`] the process — its output,
//! its exit status. Answering everything in the instant of the upgrade loses output in
//! `kubectl exec` before 1.34 (client-go's WebSocket executor): it starts the goroutine that
//! reads and demultiplexes frames *before* another goroutine has registered the error, stdin,
//! stdout and stderr streams, and a frame whose stream is not registered yet is dropped with
//! `Unknown stream id 1, discarding message`. A real API server never meets that window,
//! since it must reach the kubelet and the runtime must start the process before a byte of
//! output exists; a sim that wrote `hostname`'s output together with the `101` did, whenever a
//! loaded machine held kubectl's stream-setup goroutine for a moment: empty output, exit 0
//! (client-go fixed the order in 1.34, kubernetes/kubernetes#131203). Nothing a client sends
//! tells the server its streams are ready (an exec without stdin or TTY sends nothing), so the
//! start latency is what the server can honestly give.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade, close_code};
use axum::extract::{FromRequestParts, Request};
use axum::response::Response;
use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use http::Method;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::Sim;
use crate::api::{decode, error_response};
use crate::faults::{CallKey, FaultAction, Verb};
use crate::resources::PODS;
use crate::status::ApiError;
use crate::terminal::{Action, Kind, Program, Terminal, User, bulk_output};

const STDIN: u8 = 0;
const STDOUT: u8 = 1;
const STDERR: u8 = 2;
const ERROR: u8 = 3;
const RESIZE: u8 = 4;
const CLOSE: u8 = 255;
/// How long the server waits for the client's Close after its own.
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// A channel subprotocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Protocol {
    V1,
    V2,
    V3,
    V4,
    V5,
}

impl Protocol {
    const ALL: [(Self, &'static str); 5] = [
        (Self::V5, "v5.channel.k8s.io"),
        (Self::V4, "v4.channel.k8s.io"),
        (Self::V3, "v3.channel.k8s.io"),
        (Self::V2, "v2.channel.k8s.io"),
        (Self::V1, "channel.k8s.io"),
    ];

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().find(|(_, n)| *n == s).map(|(p, _)| *p)
    }

    fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(p, _)| *p == self)
            .map_or("", |(_, n)| n)
    }
}

/// `(namespace, name)` if `path` is a pod's exec path.
pub(crate) fn exec_path(path: &str) -> Option<(String, String)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        ["api", "v1", "namespaces", ns, "pods", name, "exec"] => {
            Some(((*ns).to_owned(), (*name).to_owned()))
        }
        _ => None,
    }
}

/// The query of an exec call.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Options {
    command: Vec<String>,
    container: Option<String>,
    stdin: bool,
    stdout: bool,
    stderr: bool,
    tty: bool,
}

impl Options {
    fn parse(query: Option<&str>) -> Self {
        let mut o = Self::default();
        let truth = |v: &str| matches!(v, "true" | "1" | "True" | "TRUE");
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = decode(v);
            match decode(k).as_str() {
                "command" => o.command.push(v),
                "container" if !v.is_empty() => o.container = Some(v),
                "stdin" => o.stdin = truth(&v),
                "stdout" => o.stdout = truth(&v),
                "stderr" => o.stderr = truth(&v),
                "tty" => o.tty = truth(&v),
                _ => {}
            }
        }
        o
    }
}

pub(crate) async fn handle(sim: Arc<Sim>, req: Request, ns: String, name: String) -> Response {
    let arrived = Instant::now();
    let identity = sim.tokens.identify(req.headers());
    let user = identity.as_ref().ok().cloned().flatten();
    let user = user.as_deref();
    // The request's own verb is authorized and audited: `get` for a WebSocket upgrade (a
    // GET), `create` for a SPDY POST. Since Kubernetes 1.35 (AuthorizePodWebsocketUpgrade-
    // CreatePermission, on by default) a GET must pass a second check as `create` too.
    let verb = match *req.method() {
        Method::GET => Verb::Get,
        Method::POST => Verb::Create,
        _ => return error_response(&ApiError::method_not_allowed()),
    };
    let key = CallKey {
        verb,
        resource: "pods/exec",
        group: Some(""),
        namespace: Some(&ns),
        name: Some(&name),
    };
    if let Err(e) = identity {
        sim.faults.record_as(arrived, &key, None, e.code);
        return error_response(&e);
    }
    let synthetic_create = CallKey {
        verb: Verb::Create,
        ..key
    };
    let authorized = sim.rbac.authorize(user, &key).and_then(|()| {
        if verb == Verb::Get {
            sim.rbac.authorize(user, &synthetic_create)
        } else {
            Ok(())
        }
    });
    if let Err(e) = authorized {
        sim.faults.record_as(arrived, &key, user, e.code);
        return error_response(&e);
    }
    let decision = sim.faults.decide(&key);
    if !decision.delay.is_zero() {
        tokio::select! {
            () = tokio::time::sleep(decision.delay) => {}
            () = sim.shutdown.cancelled() => {}
        }
    }
    match decision.outcome {
        Some(FaultAction::Fail { status, message }) => {
            sim.faults.record_as(arrived, &key, user, status);
            let reason = match status {
                400 => "BadRequest",
                403 => "Forbidden",
                404 => "NotFound",
                429 => "TooManyRequests",
                503 => "ServiceUnavailable",
                _ => "InternalError",
            };
            return error_response(
                &ApiError::new(
                    status,
                    reason,
                    message
                        .unwrap_or_else(|| format!("injected fault: pods/exec answered {status}")),
                )
                .with_details("", "pods", &name),
            );
        }
        Some(FaultAction::Hang) => {
            sim.faults.record_as(arrived, &key, user, 0);
            sim.shutdown.cancelled().await;
            return error_response(&ApiError::new(
                503,
                "ServiceUnavailable",
                "kube-sim is shutting down",
            ));
        }
        _ => {}
    }
    let response = connect(&sim, req, &ns, &name).await;
    sim.faults
        .record_as(arrived, &key, user, response.status().as_u16());
    response
}

/// The container an exec goes to, as the API server picks it.
fn pick_container(pod: &Value, name: &str, wanted: Option<&str>) -> Result<Value, ApiError> {
    let containers = pod["spec"]["containers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let names: Vec<&str> = containers
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    match wanted {
        Some(w) => containers
            .iter()
            .find(|c| c["name"] == w)
            .cloned()
            .ok_or_else(|| {
                ApiError::bad_request(format!("container {w} is not valid for pod {name}"))
            }),
        None => match containers.as_slice() {
            [one] => Ok(one.clone()),
            [] => Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}"
            ))),
            _ => Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: [{}]",
                names.join(" ")
            ))),
        },
    }
}

/// The user the container runs as: `runAsUser` of the container, else of the pod, else root;
/// its name from the container's `USER` environment variable (none for a bare uid).
fn user_of(pod: &Value, container: &Value) -> User {
    let uid = container["securityContext"]["runAsUser"]
        .as_u64()
        .or_else(|| pod["spec"]["securityContext"]["runAsUser"].as_u64())
        .and_then(|u| u32::try_from(u).ok())
        .unwrap_or(0);
    if uid == 0 {
        return User::root();
    }
    let name = container["env"].as_array().and_then(|env| {
        env.iter()
            .find(|e| e["name"] == "USER")
            .and_then(|e| e["value"].as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    });
    User { name, uid }
}

async fn connect(sim: &Arc<Sim>, req: Request, ns: &str, name: &str) -> Response {
    let Some(pod) = sim.store().get(PODS, ns, name) else {
        return error_response(&ApiError::not_found("", "pods", name));
    };
    let opts = Options::parse(req.uri().query());
    let container = match pick_container(&pod, name, opts.container.as_deref()) {
        Ok(c) => c,
        Err(e) => return error_response(&e),
    };
    let container_name = container["name"].as_str().unwrap_or("").to_owned();
    let phase = pod["status"]["phase"].as_str().unwrap_or("Pending");
    match phase {
        "Running" => {}
        "Succeeded" | "Failed" => {
            return error_response(&ApiError::bad_request(format!(
                "cannot exec into a container in a completed pod; current phase is {phase}"
            )));
        }
        _ => {
            return error_response(&ApiError::bad_request(format!(
                "unable to upgrade connection: container not found (\"{container_name}\")"
            )));
        }
    }
    if opts.command.is_empty() {
        return error_response(&ApiError::bad_request(
            "you must specify at least 1 command",
        ));
    }
    if !opts.stdin && !opts.stdout && !opts.stderr {
        return error_response(&ApiError::bad_request(
            "you must specify at least one of stdin, stdout, stderr",
        ));
    }
    // In the client's order of preference (axum's own list is sorted).
    let offered: Vec<String> = req
        .headers()
        .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();
    let (mut parts, _body) = req.into_parts();
    let Ok(ws) = WebSocketUpgrade::from_request_parts(&mut parts, &()).await else {
        return error_response(&ApiError::bad_request("Upgrade request required"));
    };
    // The first protocol the client offers that the server speaks; no header at all means
    // the original `channel.k8s.io`.
    let protocol = if offered.is_empty() {
        Some(Protocol::V1)
    } else {
        offered.iter().find_map(|p| Protocol::parse(p))
    };
    let Some(protocol) = protocol else {
        return error_response(&ApiError::bad_request(format!(
            "unable to upgrade connection: none of the requested subprotocols ({}) is supported; use v5.channel.k8s.io or v4.channel.k8s.io",
            offered.join(", ")
        )));
    };
    let hostname = pod["spec"]["hostname"]
        .as_str()
        .filter(|h| !h.is_empty())
        .unwrap_or(name)
        .to_owned();
    let session = Session {
        protocol,
        opts,
        hostname,
        user: user_of(&pod, &container),
        start_after: sim.config.exec_start,
    };
    let shutdown = sim.shutdown.clone();
    let ws = if offered.is_empty() {
        ws
    } else {
        ws.protocols([protocol.name()])
    };
    ws.on_upgrade(move |socket| serve(socket, session, shutdown))
}

struct Session {
    protocol: Protocol,
    opts: Options,
    hostname: String,
    user: User,
    /// How long the process takes to start after the upgrade.
    start_after: std::time::Duration,
}

/// What the writer task sends.
enum Out {
    Frame(u8, Bytes),
    /// The process ended with this status (or could not start: the message): the error
    /// channel, then Close.
    End(Ending),
}

enum Ending {
    Exit(i32),
    NotFound(String),
}

/// The body of channel 3 for `ending` under `protocol` (`None`: nothing to send).
fn status_frame(protocol: Protocol, ending: &Ending, command: &[String]) -> Option<Vec<u8>> {
    let (message, status) = match ending {
        Ending::Exit(0) => (None, json!({"metadata": {}, "status": "Success"})),
        Ending::Exit(code) => {
            let message = format!(
                "command terminated with non-zero exit code: error executing command [{}], exit code {code}",
                command.join(" ")
            );
            let status = json!({
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
            });
            (Some(message), status)
        }
        Ending::NotFound(program) => {
            let message = format!(
                "Internal error occurred: error executing command in container: failed to exec in container: OCI runtime exec failed: exec failed: unable to start container process: exec: \"{program}\": executable file not found in $PATH: unknown"
            );
            let status = json!({
                "metadata": {},
                "status": "Failure",
                "message": message,
                "reason": "InternalError",
                "details": {"causes": [{"message": message}]},
                "code": 500,
            });
            (Some(message), status)
        }
    };
    let body = if protocol >= Protocol::V4 {
        serde_json::to_vec(&status).unwrap_or_default()
    } else {
        message?.into_bytes()
    };
    let mut frame = Vec::with_capacity(body.len() + 1);
    frame.push(ERROR);
    frame.extend(body);
    Some(frame)
}

/// An incoming frame, decoded.
enum In {
    Stdin(Vec<u8>),
    Resize(u16, u16),
    StdinClosed,
    Gone,
}

fn decode_frame(protocol: Protocol, msg: Option<Result<Message, axum::Error>>) -> Option<In> {
    match msg {
        Some(Ok(Message::Binary(b))) => match b.first().copied() {
            Some(STDIN) => Some(In::Stdin(b[1..].to_vec())),
            Some(RESIZE) if protocol >= Protocol::V3 => {
                let v: Value = serde_json::from_slice(&b[1..]).ok()?;
                let w = u16::try_from(v["Width"].as_u64()?).ok()?;
                let h = u16::try_from(v["Height"].as_u64()?).ok()?;
                Some(In::Resize(w, h))
            }
            Some(CLOSE) if protocol >= Protocol::V5 && b.get(1) == Some(&STDIN) => {
                Some(In::StdinClosed)
            }
            _ => None,
        },
        Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_))) => None,
        Some(Ok(Message::Close(_)) | Err(_)) | None => Some(In::Gone),
    }
}

async fn serve(socket: WebSocket, session: Session, shutdown: CancellationToken) {
    let Session {
        protocol,
        opts,
        hostname,
        user,
        start_after,
    } = session;
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<Out>(64);
    let done = CancellationToken::new();
    let command = opts.command.clone();
    let writer_done = done.clone();
    let writer = tokio::spawn(async move {
        loop {
            let out = tokio::select! {
                () = writer_done.cancelled() => break,
                o = rx.recv() => o,
            };
            match out {
                Some(Out::Frame(ch, data)) => {
                    let mut frame = Vec::with_capacity(data.len() + 1);
                    frame.push(ch);
                    frame.extend_from_slice(&data);
                    if sink.send(Message::Binary(frame.into())).await.is_err() {
                        return;
                    }
                }
                Some(Out::End(ending)) => {
                    if let Some(f) = status_frame(protocol, &ending, &command) {
                        let _ = sink.send(Message::Binary(f.into())).await;
                    }
                    break;
                }
                None => break,
            }
        }
        // A normal closure (1000): clients such as kubectl treat a Close without a code as
        // an error.
        let close = CloseFrame {
            code: close_code::NORMAL,
            reason: "".into(),
        };
        let _ = sink.send(Message::Close(Some(close))).await;
        let _ = sink.close().await;
    });
    // As the kubelet: an empty frame on the lowest writable channel says the stream is up.
    let first = if opts.stdout {
        STDOUT
    } else if opts.stderr {
        STDERR
    } else {
        ERROR
    };
    let _ = tx.send(Out::Frame(first, Bytes::new())).await;
    // The process starts (and can write, or fail to start) only after the way to the kubelet
    // and the runtime (see the module documentation): frames the client sends meanwhile wait
    // in the connection, as they would in the API server's buffers.
    tokio::select! {
        () = tokio::time::sleep(start_after) => {}
        () = shutdown.cancelled() => {
            finish(&mut stream, &done, writer, &shutdown).await;
            return;
        }
    }

    let tty = opts.tty;
    let (stdout, stderr) = (opts.stdout, opts.stderr && !tty);
    let program = Program::parse(&opts.command);
    let kind = match &program {
        Program::Shell { name } | Program::Script { name, .. } => {
            Kind::Shell { name: name.clone() }
        }
        _ => Kind::Shell {
            name: "sh".to_owned(),
        },
    };
    let mut term = Terminal::new(&hostname, user, kind, tty);
    let mut bulk: Option<(CancellationToken, tokio::task::JoinHandle<()>)> = None;
    let emit = |a: Action| -> Option<Out> {
        match a {
            Action::Out(b) if stdout && !b.is_empty() => Some(Out::Frame(STDOUT, Bytes::from(b))),
            Action::Err(b) if stderr && !b.is_empty() => Some(Out::Frame(STDERR, Bytes::from(b))),
            // With a TTY both streams are the terminal.
            Action::Err(b) if tty && stdout && !b.is_empty() => {
                Some(Out::Frame(STDOUT, Bytes::from(b)))
            }
            _ => None,
        }
    };
    // Initial actions: a single program or script runs at once; a shell shows its prompt.
    let (initial, interactive) = match &program {
        Program::Shell { .. } => (vec![Action::Out(term.prompt())], true),
        Program::Script { script, .. } => (term.run_script(script), false),
        Program::Command(argv) => {
            let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
            (term.run(&argv), false)
        }
        Program::NotFound(p) => {
            let _ = tx.send(Out::End(Ending::NotFound(p.clone()))).await;
            finish(&mut stream, &done, writer, &shutdown).await;
            return;
        }
    };
    let mut ending: Option<Ending> = None;
    let mut pending = initial;
    loop {
        for a in pending.drain(..) {
            match a {
                Action::Exit(code) => ending = Some(Ending::Exit(code)),
                Action::StopBulk => {
                    if let Some((stop, _)) = bulk.take() {
                        stop.cancel();
                    }
                }
                Action::Bulk {
                    count,
                    pattern,
                    then,
                } => {
                    if let Some((stop, _)) = bulk.take() {
                        stop.cancel();
                    }
                    let stop = CancellationToken::new();
                    let tx = tx.clone();
                    let crlf = term.crlf();
                    let s = stop.clone();
                    let task = tokio::spawn(async move {
                        if !stdout {
                            return;
                        }
                        let wrap = |b: Bytes| Out::Frame(STDOUT, b);
                        if bulk_output(&tx, &s, count, &pattern, crlf, wrap).await
                            && !then.is_empty()
                        {
                            let _ = tx.send(Out::Frame(STDOUT, Bytes::from(then))).await;
                        }
                    });
                    bulk = Some((stop, task));
                }
                other => {
                    if let Some(out) = emit(other)
                        && tx.send(out).await.is_err()
                    {
                        ending = Some(Ending::Exit(term.status()));
                    }
                }
            }
            if ending.is_some() {
                break;
            }
        }
        if ending.is_none() && !interactive {
            // A single program ends when its output is complete.
            match bulk.take() {
                None => ending = Some(Ending::Exit(term.status())),
                Some((stop, mut task)) => {
                    let finished = loop {
                        tokio::select! {
                            _ = &mut task => break true,
                            () = shutdown.cancelled() => break false,
                            m = stream.next() => match decode_frame(protocol, m) {
                                Some(In::Gone) => break false,
                                Some(In::Stdin(d)) if tty && d.contains(&0x03) => {
                                    stop.cancel();
                                    let _ = tx.send(Out::Frame(STDOUT, Bytes::from_static(b"^C\r\n"))).await;
                                    ending = Some(Ending::Exit(130));
                                    break true;
                                }
                                _ => {}
                            },
                        }
                    };
                    stop.cancel();
                    if !finished {
                        break;
                    }
                    if ending.is_none() {
                        ending = Some(Ending::Exit(term.status()));
                    }
                }
            }
        }
        if let Some(e) = ending.take() {
            if let Some((stop, _)) = bulk.take() {
                stop.cancel();
            }
            let _ = tx.send(Out::End(e)).await;
            break;
        }
        let msg = tokio::select! {
            () = shutdown.cancelled() => break,
            m = stream.next() => m,
        };
        match decode_frame(protocol, msg) {
            Some(In::Stdin(data)) => pending = term.input(&data),
            Some(In::Resize(w, h)) => term.resize(w, h),
            Some(In::StdinClosed) => pending = term.end_of_input(),
            Some(In::Gone) => break,
            None => {}
        }
    }
    if let Some((stop, _)) = bulk.take() {
        stop.cancel();
    }
    finish(&mut stream, &done, writer, &shutdown).await;
}

/// Lets the writer send what is queued (status, Close), then waits (briefly) for the client's
/// Close so the connection ends with a closing handshake.
async fn finish(
    stream: &mut futures::stream::SplitStream<WebSocket>,
    done: &CancellationToken,
    writer: tokio::task::JoinHandle<()>,
    shutdown: &CancellationToken,
) {
    tokio::select! {
        _ = writer => {}
        () = shutdown.cancelled() => { done.cancel(); return }
    }
    let drain = async {
        while let Some(Ok(m)) = stream.next().await {
            if matches!(m, Message::Close(_)) {
                break;
            }
        }
    };
    tokio::select! {
        () = drain => {}
        () = tokio::time::sleep(CLOSE_GRACE) => {}
        () = shutdown.cancelled() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_paths_and_queries_parse() {
        assert_eq!(
            exec_path("/api/v1/namespaces/ns/pods/p-1/exec"),
            Some(("ns".into(), "p-1".into()))
        );
        assert_eq!(exec_path("/api/v1/namespaces/ns/pods/p-1/log"), None);
        let o = Options::parse(Some(
            "command=sh&command=-c&command=echo%20a%3Bexit%203&stdin=true&stdout=true&tty=true&container=lab",
        ));
        assert_eq!(o.command, vec!["sh", "-c", "echo a;exit 3"]);
        assert!(o.stdin && o.stdout && o.tty && !o.stderr);
        assert_eq!(o.container.as_deref(), Some("lab"));
    }

    #[test]
    fn the_error_channel_carries_a_status_from_v4_on_and_text_before() {
        let cmd = vec!["sh".to_owned(), "-c".to_owned(), "exit 3".to_owned()];
        let ok = status_frame(Protocol::V5, &Ending::Exit(0), &cmd).unwrap();
        assert_eq!(ok[0], ERROR);
        let v: Value = serde_json::from_slice(&ok[1..]).unwrap();
        assert_eq!(v["status"], "Success");
        let bad = status_frame(Protocol::V4, &Ending::Exit(3), &cmd).unwrap();
        let v: Value = serde_json::from_slice(&bad[1..]).unwrap();
        assert_eq!(v["reason"], "NonZeroExitCode");
        assert_eq!(v["details"]["causes"][0]["message"], "3");
        assert_eq!(status_frame(Protocol::V2, &Ending::Exit(0), &cmd), None);
        let text = status_frame(Protocol::V1, &Ending::Exit(3), &cmd).unwrap();
        assert!(String::from_utf8_lossy(&text[1..]).contains("exit code 3"));
    }
}
