//! The VMI serial console subresource: a WebSocket with subprotocol `plain.kubevirt.io`, raw
//! bytes in binary frames both ways, one client per VMI (a new one closes the old), and behind
//! it the simulated terminal of [`crate::terminal`] as root's autologin shell, with boot lines
//! for the first client. The terminal's size is the one the guest's agent set (`POST
//! /v1/console-size`, which under the agent's `--root` writes `ROWS COLS` to the guest's
//! `dev/ttyS0`): `stty size` prints it. A qemu guest's console is its serial port instead: raw bytes both
//! ways, and for the first client what the guest printed so far (the last 64 KiB).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request};
use axum::response::Response;
use bytes::Bytes;
use futures::{SinkExt as _, StreamExt as _};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::Sim;
use crate::api::error_response;
use crate::faults::{CallKey, FaultAction, Verb};
use crate::resources::VMIS;
use crate::status::ApiError;
use crate::terminal::{Action, Terminal, bulk_output};

/// The subprotocol KubeVirt's console speaks.
pub const PROTOCOL: &str = "plain.kubevirt.io";

struct Slot {
    uid: String,
    behind: Behind,
    current: Option<CancellationToken>,
}

/// What a console connects to.
#[derive(Clone)]
enum Behind {
    /// The simulated terminal.
    Sim(Arc<Mutex<Terminal>>),
    /// A qemu guest's serial port; whether a client has connected before.
    Qemu(
        ttlab_qemu_guest::Console,
        Arc<std::sync::atomic::AtomicBool>,
    ),
}

/// The consoles of running VMIs.
#[derive(Default)]
pub(crate) struct Consoles {
    slots: Mutex<HashMap<(String, String), Slot>>,
}

impl Consoles {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Slot>> {
        self.slots
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A VMI reached Running: its terminal exists from now on.
    pub(crate) fn boot(&self, ns: &str, name: &str, uid: &str, hostname: &str) {
        let mut slots = self.slots();
        if let Some(old) = slots.remove(&(ns.to_owned(), name.to_owned()))
            && let Some(c) = old.current
        {
            c.cancel();
        }
        slots.insert(
            (ns.to_owned(), name.to_owned()),
            Slot {
                uid: uid.to_owned(),
                behind: Behind::Sim(Arc::new(Mutex::new(Terminal::console(hostname)))),
                current: None,
            },
        );
    }

    /// A qemu guest started: its serial port is the console from now on.
    pub(crate) fn boot_qemu(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        console: ttlab_qemu_guest::Console,
    ) {
        let mut slots = self.slots();
        if let Some(old) = slots.remove(&(ns.to_owned(), name.to_owned()))
            && let Some(c) = old.current
        {
            c.cancel();
        }
        slots.insert(
            (ns.to_owned(), name.to_owned()),
            Slot {
                uid: uid.to_owned(),
                behind: Behind::Qemu(console, Arc::default()),
                current: None,
            },
        );
    }

    /// The VMI ended: its console connection closes.
    pub(crate) fn end(&self, ns: &str, name: &str) {
        if let Some(slot) = self.slots().remove(&(ns.to_owned(), name.to_owned()))
            && let Some(c) = slot.current
        {
            c.cancel();
        }
    }
}

/// `(namespace, name)` if `path` is a console path.
pub(crate) fn console_path(path: &str) -> Option<(String, String)> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    match segs.as_slice() {
        [
            "apis",
            "subresources.kubevirt.io",
            "v1",
            "namespaces",
            ns,
            "virtualmachineinstances",
            name,
            "console",
        ] => Some(((*ns).to_owned(), (*name).to_owned())),
        _ => None,
    }
}

pub(crate) async fn handle(sim: Arc<Sim>, req: Request, ns: String, name: String) -> Response {
    let arrived = Instant::now();
    let identity = sim.tokens.identify(req.headers());
    let user = identity.as_ref().ok().cloned().flatten();
    let user = user.as_deref();
    let key = CallKey {
        verb: Verb::Get,
        resource: "virtualmachineinstances/console",
        group: Some("subresources.kubevirt.io"),
        namespace: Some(&ns),
        name: Some(&name),
    };
    if let Err(e) = identity {
        sim.faults.record_as(arrived, &key, None, e.code);
        return error_response(&e);
    }
    if let Err(e) = sim.rbac.authorize(user, &key) {
        sim.faults.record_as(arrived, &key, user, e.code);
        return error_response(&e);
    }
    let decision = sim.faults.decide(&key);
    if !decision.delay.is_zero() {
        tokio::time::sleep(decision.delay).await;
    }
    match decision.outcome {
        Some(FaultAction::Fail { status, message }) => {
            sim.faults.record_as(arrived, &key, user, status);
            return error_response(&ApiError::new(
                status,
                "InternalError",
                message.unwrap_or_else(|| format!("injected fault: console answered {status}")),
            ));
        }
        Some(FaultAction::Hang) => {
            sim.faults.record_as(arrived, &key, user, 0);
            sim.shutdown.cancelled().await;
            return error_response(&ApiError::new(503, "ServiceUnavailable", "shutting down"));
        }
        _ => {}
    }
    let response = connect(&sim, req, &ns, &name).await;
    sim.faults
        .record_as(arrived, &key, user, response.status().as_u16());
    response
}

async fn connect(sim: &Arc<Sim>, req: Request, ns: &str, name: &str) -> Response {
    if let Some(addr) = sim.kubevirt_console.get() {
        return relay(sim, req, *addr, ns, name).await;
    }
    let vmi = sim.store().get(VMIS, ns, name);
    let Some(vmi) = vmi else {
        return error_response(&ApiError::not_found(
            "kubevirt.io",
            "virtualmachineinstances",
            name,
        ));
    };
    let phase = vmi["status"]["phase"].as_str().unwrap_or("").to_owned();
    if matches!(phase.as_str(), "Failed" | "Succeeded") {
        return error_response(&ApiError::new(
            409,
            "Conflict",
            format!(
                "Unable to connect to VirtualMachineInstance because phase is {phase} instead of Running"
            ),
        ));
    }
    let slot = {
        let slots = sim.consoles.slots();
        slots
            .get(&(ns.to_owned(), name.to_owned()))
            .filter(|s| vmi["metadata"]["uid"].as_str() == Some(s.uid.as_str()))
            .map(|s| s.behind.clone())
    };
    let Some(behind) = slot.filter(|_| phase == "Running") else {
        let shown = if phase.is_empty() {
            "Pending"
        } else {
            phase.as_str()
        };
        return error_response(&ApiError::bad_request(format!(
            "Internal error occurred: dialing virt-handler: Unable to connect to VirtualMachineInstance because phase is {shown} instead of Running"
        )));
    };
    let (mut parts, _body) = req.into_parts();
    let ws = match WebSocketUpgrade::from_request_parts(&mut parts, &()).await {
        Ok(ws) => ws,
        Err(_) => {
            return error_response(&ApiError::bad_request(
                "the console subresource needs a WebSocket upgrade (Sec-WebSocket-Protocol: plain.kubevirt.io)",
            ));
        }
    };
    let offered = ws
        .requested_protocols()
        .any(|p| p.to_str().is_ok_and(|s| s.trim() == PROTOCOL));
    if !offered {
        return error_response(&ApiError::bad_request(format!(
            "the console speaks the {PROTOCOL} subprotocol only"
        )));
    }
    let token = CancellationToken::new();
    {
        let mut slots = sim.consoles.slots();
        if let Some(s) = slots.get_mut(&(ns.to_owned(), name.to_owned()))
            && let Some(old) = s.current.replace(token.clone())
        {
            old.cancel();
        }
    }
    let shutdown = sim.shutdown.clone();
    // The simulated agent sets the console's size by writing it under the guest's root.
    let guest_dir = sim.kubevirt.guest(ns, name).map(|g| g.dir);
    match behind {
        Behind::Sim(terminal) => ws
            .protocols([PROTOCOL])
            .on_upgrade(move |socket| serve(socket, terminal, guest_dir, token, shutdown)),
        Behind::Qemu(console, shown) => ws
            .protocols([PROTOCOL])
            .on_upgrade(move |socket| serve_serial(socket, console, shown, token, shutdown)),
    }
}

/// With kubevirt-sim as the controllers the console is its own, served behind this server as
/// kube-apiserver's proxy serves an aggregated API: the upgrade goes on to kubevirt-sim's
/// console server, its refusals come back as they are, and frames flow both ways.
async fn relay(
    sim: &Arc<Sim>,
    req: Request,
    addr: std::net::SocketAddr,
    ns: &str,
    name: &str,
) -> Response {
    use tokio_tungstenite::tungstenite;
    use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
    let (mut parts, _body) = req.into_parts();
    let Ok(ws) = WebSocketUpgrade::from_request_parts(&mut parts, &()).await else {
        // Refused before it would reach kubevirt-sim, in the order it refuses.
        if sim.store().get(VMIS, ns, name).is_none() {
            return error_response(&ApiError::not_found(
                "kubevirt.io",
                "virtualmachineinstances",
                name,
            ));
        }
        return error_response(&ApiError::bad_request(
            "the console subresource needs a WebSocket upgrade (Sec-WebSocket-Protocol: plain.kubevirt.io)",
        ));
    };
    let url = format!(
        "ws://{addr}/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/console"
    );
    let mut upstream_req = match url.into_client_request() {
        Ok(r) => r,
        Err(e) => return error_response(&ApiError::bad_request(format!("console: {e}"))),
    };
    let offered = ws
        .requested_protocols()
        .filter_map(|p| p.to_str().ok().map(str::to_owned))
        .collect::<Vec<_>>()
        .join(", ");
    if let Ok(v) = http::HeaderValue::from_str(&offered) {
        upstream_req
            .headers_mut()
            .insert(http::header::SEC_WEBSOCKET_PROTOCOL, v);
    }
    let upstream = match tokio_tungstenite::connect_async(upstream_req).await {
        Ok((u, _)) => u,
        Err(tungstenite::Error::Http(refused)) => {
            let (head, body) = refused.into_parts();
            let mut r = Response::new(axum::body::Body::from(body.unwrap_or_default()));
            *r.status_mut() = head.status;
            if let Some(t) = head.headers.get(http::header::CONTENT_TYPE) {
                r.headers_mut()
                    .insert(http::header::CONTENT_TYPE, t.clone());
            }
            return r;
        }
        Err(e) => {
            return error_response(&ApiError::new(
                503,
                "ServiceUnavailable",
                format!("the console server of kubevirt-sim did not answer: {e}"),
            ));
        }
    };
    let shutdown = sim.shutdown.clone();
    ws.protocols([PROTOCOL])
        .on_upgrade(move |socket| bridge(socket, upstream, shutdown))
}

/// Frames both ways between a client and kubevirt-sim's console, until either side closes.
async fn bridge<S>(
    socket: WebSocket,
    upstream: tokio_tungstenite::WebSocketStream<S>,
    shutdown: CancellationToken,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use tokio_tungstenite::tungstenite::Message as Up;
    let (mut client_tx, mut client_rx) = socket.split();
    let (mut up_tx, mut up_rx) = upstream.split();
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            m = client_rx.next() => {
                let m = match m {
                    Some(Ok(Message::Binary(b))) => Up::Binary(b),
                    Some(Ok(Message::Text(t))) => Up::text(t.as_str()),
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
                    Some(Ok(Message::Close(_)) | Err(_)) | None => break,
                };
                if up_tx.send(m).await.is_err() {
                    break;
                }
            }
            m = up_rx.next() => {
                let m = match m {
                    Some(Ok(Up::Binary(b))) => Message::Binary(b),
                    Some(Ok(Up::Text(t))) => Message::Text(t.as_str().into()),
                    Some(Ok(Up::Ping(_) | Up::Pong(_) | Up::Frame(_))) => continue,
                    Some(Ok(Up::Close(_)) | Err(_)) | None => break,
                };
                if client_tx.send(m).await.is_err() {
                    break;
                }
            }
        }
    }
    let _ = client_tx.send(Message::Close(None)).await;
    let _ = client_tx.close().await;
    let _ = up_tx.close().await;
}

/// Relays a qemu guest's serial port: its output as binary frames (what it printed before,
/// for the first client), the client's frames typed on it.
async fn serve_serial(
    socket: WebSocket,
    console: ttlab_qemu_guest::Console,
    shown: Arc<std::sync::atomic::AtomicBool>,
    token: CancellationToken,
    shutdown: CancellationToken,
) {
    let (mut sink, mut stream) = socket.split();
    let mut output = console.subscribe();
    let first = !shown.swap(true, std::sync::atomic::Ordering::SeqCst);
    let history = if first { console.history() } else { Vec::new() };
    let writer_token = token.clone();
    let writer = tokio::spawn(async move {
        if !history.is_empty()
            && sink
                .send(Message::Binary(Bytes::from(history)))
                .await
                .is_err()
        {
            return;
        }
        loop {
            tokio::select! {
                () = writer_token.cancelled() => break,
                msg = output.recv() => match msg {
                    Ok(b) => if sink.send(Message::Binary(b)).await.is_err() { return },
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => break,
                },
            }
        }
        let _ = sink.send(Message::Close(None)).await;
        let _ = sink.close().await;
    });
    loop {
        let msg = tokio::select! {
            () = token.cancelled() => break,
            () = shutdown.cancelled() => { token.cancel(); break }
            m = stream.next() => m,
        };
        match msg {
            Some(Ok(Message::Binary(b))) => {
                if console.send(b).await.is_err() {
                    break;
                }
            }
            Some(Ok(Message::Text(t))) => {
                if console
                    .send(Bytes::copy_from_slice(t.as_bytes()))
                    .await
                    .is_err()
                {
                    break;
                }
            }
            Some(Ok(Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
        }
    }
    token.cancel();
    let _ = writer.await;
}

async fn serve(
    socket: WebSocket,
    terminal: Arc<Mutex<Terminal>>,
    guest_dir: Option<std::path::PathBuf>,
    token: CancellationToken,
    shutdown: CancellationToken,
) {
    let (mut sink, mut stream) = socket.split();
    let (tx, mut rx) = mpsc::channel::<Bytes>(64);
    // Writer: everything the terminal prints, then a Close when replaced or ended.
    let writer_token = token.clone();
    let writer = tokio::spawn(async move {
        loop {
            tokio::select! {
                () = writer_token.cancelled() => break,
                msg = rx.recv() => match msg {
                    Some(b) => if sink.send(Message::Binary(b)).await.is_err() { return },
                    None => break,
                },
            }
        }
        let _ = sink.send(Message::Close(None)).await;
        let _ = sink.close().await;
    });
    let first = {
        let mut t = terminal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if t.shown_boot {
            Vec::new()
        } else {
            t.shown_boot = true;
            let mut v = t.boot_text();
            v.extend(t.prompt());
            v
        }
    };
    if !first.is_empty() {
        let _ = tx.send(Bytes::from(first)).await;
    }
    let mut bulk: Option<CancellationToken> = None;
    loop {
        let msg = tokio::select! {
            () = token.cancelled() => break,
            () = shutdown.cancelled() => { token.cancel(); break }
            m = stream.next() => m,
        };
        let data = match msg {
            Some(Ok(Message::Binary(b))) => b,
            Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_))) => continue,
            Some(Ok(Message::Close(_))) | Some(Err(_)) | None => break,
        };
        // What the agent set is the console's size from now on, as the kernel's TTY would
        // hold it: the shell's `stty size` reports it.
        let size = guest_dir.as_deref().and_then(ttlab_sim_guest::console_size);
        let actions = {
            let mut t = terminal
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((rows, cols)) = size {
                t.resize(cols, rows);
            }
            t.input(&data)
        };
        for a in actions {
            match a {
                Action::Out(b) | Action::Err(b) => {
                    if !b.is_empty() && tx.send(Bytes::from(b)).await.is_err() {
                        break;
                    }
                }
                Action::StopBulk => {
                    if let Some(b) = bulk.take() {
                        b.cancel();
                    }
                }
                Action::Bulk {
                    count,
                    pattern,
                    then,
                } => {
                    let stop = CancellationToken::new();
                    if let Some(old) = bulk.replace(stop.clone()) {
                        old.cancel();
                    }
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        if bulk_output(&tx, &stop, count, &pattern, true, |b| b).await {
                            let _ = tx.send(Bytes::from(then)).await;
                        }
                    });
                }
                // The console's shell never exits: getty logs root in again.
                Action::Exit(_) => {}
            }
        }
    }
    if let Some(b) = bulk.take() {
        b.cancel();
    }
    token.cancel();
    drop(tx);
    let _ = writer.await;
}
