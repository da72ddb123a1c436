//! The VMI serial console subresource: a WebSocket with subprotocol `plain.kubevirt.io`, raw
//! bytes in binary frames both ways, one client per VMI (a new one closes the old), and behind
//! it a small simulated serial terminal (boot lines, autologin, echo, a few builtins, and
//! `yes` / `seq N` for bulk output).

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

/// The subprotocol KubeVirt's console speaks.
pub const PROTOCOL: &str = "plain.kubevirt.io";

struct Terminal {
    hostname: String,
    shown_boot: bool,
    line: Vec<u8>,
}

struct Slot {
    uid: String,
    terminal: Arc<Mutex<Terminal>>,
    current: Option<CancellationToken>,
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
                terminal: Arc::new(Mutex::new(Terminal {
                    hostname: hostname.to_owned(),
                    shown_boot: false,
                    line: Vec::new(),
                })),
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
    let key = CallKey {
        verb: Verb::Get,
        resource: "virtualmachineinstances/console",
        group: Some("subresources.kubevirt.io"),
        namespace: Some(&ns),
        name: Some(&name),
    };
    let decision = sim.faults.decide(&key);
    if !decision.delay.is_zero() {
        tokio::time::sleep(decision.delay).await;
    }
    match decision.outcome {
        Some(FaultAction::Fail { status, message }) => {
            sim.faults.record(arrived, &key, status);
            return error_response(&ApiError::new(
                status,
                "InternalError",
                message.unwrap_or_else(|| format!("injected fault: console answered {status}")),
            ));
        }
        Some(FaultAction::Hang) => {
            sim.faults.record(arrived, &key, 0);
            sim.shutdown.cancelled().await;
            return error_response(&ApiError::new(503, "ServiceUnavailable", "shutting down"));
        }
        _ => {}
    }
    let response = connect(&sim, req, &ns, &name).await;
    sim.faults.record(arrived, &key, response.status().as_u16());
    response
}

async fn connect(sim: &Arc<Sim>, req: Request, ns: &str, name: &str) -> Response {
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
            .map(|s| s.terminal.clone())
    };
    let Some(terminal) = slot.filter(|_| phase == "Running") else {
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
    ws.protocols([PROTOCOL])
        .on_upgrade(move |socket| serve(socket, terminal, token, shutdown))
}

enum Action {
    Out(Vec<u8>),
    Bulk(Option<u64>, Vec<u8>),
    StopBulk,
}

fn prompt(t: &Terminal) -> Vec<u8> {
    format!("root@{}:~# ", t.hostname).into_bytes()
}

fn boot_text(t: &Terminal) -> Vec<u8> {
    let h = &t.hostname;
    format!(
        "[    0.000000] Linux version 5.15.0-kube-sim (simulated serial console)\r\n\
         [    1.234567] cloud-init[512]: Cloud-init v. 22.4 running 'modules:final'\r\n\
         \r\nUbuntu 22.04 LTS {h} ttyS0\r\n\r\n\
         {h} login: root (automatic login)\r\n\r\n\
         Welcome to Ubuntu 22.04 LTS (GNU/Linux 5.15.0 x86_64)\r\n\r\n"
    )
    .into_bytes()
}

fn run_line(t: &mut Terminal, line: &str) -> Vec<Action> {
    let mut words = line.split_whitespace();
    let cmd = words.next().unwrap_or("");
    let args: Vec<&str> = words.collect();
    let mut out = Vec::new();
    let text = match cmd {
        "" => String::new(),
        "hostname" => format!("{}\r\n", t.hostname),
        "whoami" => "root\r\n".to_owned(),
        "id" => "uid=0(root) gid=0(root) groups=0(root)\r\n".to_owned(),
        "pwd" => "/root\r\n".to_owned(),
        "uname" => {
            if args.first() == Some(&"-a") {
                format!(
                    "Linux {} 5.15.0-kube-sim #1 SMP x86_64 GNU/Linux\r\n",
                    t.hostname
                )
            } else {
                "Linux\r\n".to_owned()
            }
        }
        "echo" => format!("{}\r\n", args.join(" ")),
        "true" | "clear" => String::new(),
        "yes" => {
            let word = if args.is_empty() {
                "y".to_owned()
            } else {
                args.join(" ")
            };
            return vec![Action::Bulk(None, format!("{word}\r\n").into_bytes())];
        }
        "seq" => match args.last().and_then(|n| n.parse::<u64>().ok()) {
            Some(n) => return vec![Action::Bulk(Some(n), Vec::new())],
            None => "seq: missing operand\r\n".to_owned(),
        },
        "exit" | "logout" => {
            t.shown_boot = true;
            format!(
                "logout\r\n\r\nUbuntu 22.04 LTS {h} ttyS0\r\n\r\n{h} login: root (automatic login)\r\n\r\n",
                h = t.hostname
            )
        }
        other => format!("-bash: {other}: command not found\r\n"),
    };
    out.push(Action::Out(text.into_bytes()));
    out.push(Action::Out(prompt(t)));
    out
}

/// Feeds typed bytes to the terminal.
fn input(t: &mut Terminal, data: &[u8]) -> Vec<Action> {
    let mut actions = Vec::new();
    for &b in data {
        match b {
            b'\r' | b'\n' => {
                let line = String::from_utf8_lossy(&t.line).into_owned();
                t.line.clear();
                actions.push(Action::Out(b"\r\n".to_vec()));
                actions.extend(run_line(t, &line));
            }
            0x03 => {
                t.line.clear();
                actions.push(Action::StopBulk);
                actions.push(Action::Out(b"^C\r\n".to_vec()));
                actions.push(Action::Out(prompt(t)));
            }
            0x7f | 0x08 if t.line.pop().is_some() => {
                actions.push(Action::Out(b"\x08 \x08".to_vec()));
            }
            0x7f | 0x08 => {}
            0x04 if t.line.is_empty() => actions.extend(run_line(t, "logout")),
            b if b >= 0x20 || b == b'\t' => {
                t.line.push(b);
                actions.push(Action::Out(vec![b]));
            }
            _ => {}
        }
    }
    actions
}

async fn serve(
    socket: WebSocket,
    terminal: Arc<Mutex<Terminal>>,
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
            let mut v = boot_text(&t);
            v.extend(prompt(&t));
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
        let actions = {
            let mut t = terminal
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            input(&mut t, &data)
        };
        for a in actions {
            match a {
                Action::Out(b) => {
                    if !b.is_empty() && tx.send(Bytes::from(b)).await.is_err() {
                        break;
                    }
                }
                Action::StopBulk => {
                    if let Some(b) = bulk.take() {
                        b.cancel();
                    }
                }
                Action::Bulk(count, pattern) => {
                    let stop = CancellationToken::new();
                    bulk = Some(stop.clone());
                    let tx = tx.clone();
                    let terminal = terminal.clone();
                    tokio::spawn(async move {
                        bulk_output(tx.clone(), stop.clone(), count, pattern).await;
                        if !stop.is_cancelled() {
                            let p = {
                                let t = terminal
                                    .lock()
                                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                                prompt(&t)
                            };
                            let _ = tx.send(Bytes::from(p)).await;
                        }
                    });
                }
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

/// `yes` (pattern, until Ctrl-C) or `seq N` (N numbered lines) in 16 KiB chunks.
async fn bulk_output(
    tx: mpsc::Sender<Bytes>,
    stop: CancellationToken,
    count: Option<u64>,
    pattern: Vec<u8>,
) {
    const CHUNK: usize = 16 * 1024;
    let mut next: u64 = 1;
    loop {
        let mut buf = Vec::with_capacity(CHUNK + 32);
        match count {
            None => {
                while buf.len() < CHUNK {
                    buf.extend_from_slice(&pattern);
                }
            }
            Some(n) => {
                while buf.len() < CHUNK && next <= n {
                    buf.extend_from_slice(format!("{next}\r\n").as_bytes());
                    next += 1;
                }
                if buf.is_empty() {
                    return;
                }
            }
        }
        tokio::select! {
            () = stop.cancelled() => return,
            r = tx.send(Bytes::from(buf)) => if r.is_err() { return },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn term() -> Terminal {
        Terminal {
            hostname: "lab-1".into(),
            shown_boot: true,
            line: Vec::new(),
        }
    }

    fn text(actions: &[Action]) -> String {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Out(b) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn typed_lines_echo_and_run_builtins() {
        let mut t = term();
        assert_eq!(
            text(&input(&mut t, b"hostname\r")),
            "hostname\r\nlab-1\r\nroot@lab-1:~# "
        );
        assert_eq!(
            text(&input(&mut t, b"whoami\r")),
            "whoami\r\nroot\r\nroot@lab-1:~# "
        );
        assert!(text(&input(&mut t, b"nope\r")).contains("-bash: nope: command not found"));
        assert_eq!(text(&input(&mut t, b"ab\x7f")), "ab\x08 \x08");
    }

    #[test]
    fn yes_starts_bulk_output_and_ctrl_c_stops_it() {
        let mut t = term();
        assert!(
            matches!(input(&mut t, b"yes\r").last(), Some(Action::Bulk(None, p)) if p == b"y\r\n")
        );
        assert!(
            input(&mut t, b"\x03")
                .iter()
                .any(|a| matches!(a, Action::StopBulk))
        );
    }
}
