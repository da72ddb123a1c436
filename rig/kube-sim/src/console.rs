//! The VMI subresources that are WebSocket streams, relayed to kubevirt-sim as
//! kube-apiserver's proxy relays an aggregated API: the serial console
//! (`subresources.kubevirt.io/v1 …/console`) and the port forward (`…/portforward/{port}`,
//! `…/portforward/{port}/{protocol}`: one TCP connection to the guest's port). kube-sim
//! authenticates, authorizes (RBAC `get` on `virtualmachineinstances/console` or
//! `virtualmachineinstances/portforward`, as KubeVirt's aggregated roles grant them), injects
//! faults and records the call, then relays the WebSocket (subprotocol `plain.kubevirt.io`,
//! raw bytes in binary frames both ways) to kubevirt-sim's console server, whose refusals
//! come back as they are. kubevirt-sim serves the simulated serial line or a qemu guest's
//! serial port, and dials the guest's port for a port forward. With
//! [`crate::Controllers::External`] nothing serves them: `404`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{FromRequestParts, Request};
use axum::response::Response;
use futures::{SinkExt as _, StreamExt as _};
use tokio_util::sync::CancellationToken;

use crate::Sim;
use crate::api::error_response;
use crate::faults::{CallKey, FaultAction, Verb};
use crate::resources::VMIS;
use crate::status::ApiError;

/// The subprotocol KubeVirt's console speaks.
pub const PROTOCOL: &str = "plain.kubevirt.io";

/// A streaming subresource of a VMI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Subresource {
    /// The serial console.
    Console,
    /// A port forward; what follows `portforward/` in the path (`8899`, `8899/tcp`).
    PortForward(String),
}

impl Subresource {
    /// The resource RBAC and the fault table know it by.
    fn resource(&self) -> &'static str {
        match self {
            Self::Console => "virtualmachineinstances/console",
            Self::PortForward(_) => "virtualmachineinstances/portforward",
        }
    }

    /// The path's last segments.
    fn tail(&self) -> String {
        match self {
            Self::Console => "console".to_owned(),
            Self::PortForward(rest) => format!("portforward/{rest}"),
        }
    }

    fn what(&self) -> &'static str {
        match self {
            Self::Console => "console",
            Self::PortForward(_) => "portforward",
        }
    }
}

/// `(namespace, name, subresource)` if `path` is the path of a console or a port forward.
pub(crate) fn stream_path(path: &str) -> Option<(String, String, Subresource)> {
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
        ] => Some(((*ns).to_owned(), (*name).to_owned(), Subresource::Console)),
        [
            "apis",
            "subresources.kubevirt.io",
            "v1",
            "namespaces",
            ns,
            "virtualmachineinstances",
            name,
            "portforward",
            rest @ ..,
        ] if matches!(rest.len(), 1 | 2) && rest.iter().all(|s| !s.is_empty()) => Some((
            (*ns).to_owned(),
            (*name).to_owned(),
            Subresource::PortForward(rest.join("/")),
        )),
        _ => None,
    }
}

pub(crate) async fn handle(
    sim: Arc<Sim>,
    req: Request,
    ns: String,
    name: String,
    sub: Subresource,
) -> Response {
    let arrived = Instant::now();
    let identity = sim.tokens.identify(req.headers());
    let user = identity.as_ref().ok().cloned().flatten();
    let user = user.as_deref();
    let key = CallKey {
        verb: Verb::Get,
        resource: sub.resource(),
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
                message
                    .unwrap_or_else(|| format!("injected fault: {} answered {status}", sub.what())),
            ));
        }
        Some(FaultAction::Hang) => {
            sim.faults.record_as(arrived, &key, user, 0);
            sim.shutdown.cancelled().await;
            return error_response(&ApiError::new(503, "ServiceUnavailable", "shutting down"));
        }
        _ => {}
    }
    let response = connect(&sim, req, &ns, &name, &sub).await;
    sim.faults
        .record_as(arrived, &key, user, response.status().as_u16());
    response
}

async fn connect(
    sim: &Arc<Sim>,
    req: Request,
    ns: &str,
    name: &str,
    sub: &Subresource,
) -> Response {
    match sim.kubevirt_console.get() {
        Some(addr) => relay(sim, req, *addr, ns, name, sub).await,
        // No KubeVirt here: its aggregated API is not served.
        None => error_response(&ApiError::new(
            404,
            "NotFound",
            "the server could not find the requested resource (no KubeVirt runs here: Controllers::External)",
        )),
    }
}

/// With kubevirt-sim as the controllers the console and the port forward are its own, served
/// behind this server as kube-apiserver's proxy serves an aggregated API: the upgrade goes on
/// to kubevirt-sim's console server, its refusals come back as they are, and frames flow both
/// ways.
async fn relay(
    sim: &Arc<Sim>,
    req: Request,
    addr: std::net::SocketAddr,
    ns: &str,
    name: &str,
    sub: &Subresource,
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
        return error_response(&ApiError::bad_request(format!(
            "the {} subresource needs a WebSocket upgrade (Sec-WebSocket-Protocol: plain.kubevirt.io)",
            sub.what()
        )));
    };
    let url = format!(
        "ws://{addr}/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{name}/{}",
        sub.tail()
    );
    let mut upstream_req = match url.into_client_request() {
        Ok(r) => r,
        Err(e) => {
            return error_response(&ApiError::bad_request(format!("{}: {e}", sub.what())));
        }
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
