//! The `portforward` subresource (`…/virtualmachineinstances/{name}/portforward/{port}` and
//! `…/portforward/{port}/{protocol}`), served as KubeVirt's virt-api serves it
//! (`pkg/virt-api/rest/portforward.go`, `streamer.go`, `dialers.go`): one TCP connection to
//! the guest's port, carried by a WebSocket with subprotocol `plain.kubevirt.io`, its bytes in
//! binary frames both ways (text frames ignored, a Close frame ends it).
//!
//! The refusals are KubeVirt's, in its order, all before the upgrade: no such VMI `404`; a
//! paused VMI `409`; a VMI with no address in `status.interfaces` (not running yet) `400`
//! `no network interfaces are present`; a port nothing answers on (the guest stopped, or its
//! program not started yet) `500` `dialing VM: …`. KubeVirt does not look at the phase: an
//! ended VMI that still reports an address is dialed, and refuses as a closed port does.
//!
//! The connection goes to where the simulated guest really listens (its loopback address),
//! which is what the VMI reports unless the pod addresses are published unroutable
//! ([`crate::SimSettings::unroutable_pod_ips`]): then the guest is still reached here, as
//! virt-api reaches a pod network the API's clients cannot. Only `tcp` is served (KubeVirt
//! dials whatever protocol Go's `net.Dial` takes).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use http::{Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_util::sync::CancellationToken;

use super::{Body, PROTOCOL, Server, status, switching_protocols};
use crate::object::uid;

/// How long the dial of the guest's port may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(10);

impl Server {
    /// One portforward: admitted, the VMI checked, the guest's port dialed, then upgraded.
    pub(super) async fn portforward(
        self: Arc<Self>,
        req: Request<Incoming>,
        ns: &str,
        vmi_name: &str,
        port: &str,
        protocol: &str,
        stop: CancellationToken,
    ) -> Response<Body> {
        if let Err(refused) = self.admit(&req, ns, vmi_name, "portforward").await {
            return refused;
        }
        let Some(port) = port.parse::<u16>().ok().filter(|p| *p > 0) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("invalid port {port:?}"),
            );
        };
        if protocol != "tcp" {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                &format!("protocol {protocol:?} is not forwarded here (only tcp)"),
            );
        }
        let vmi = match self.vmi(ns, vmi_name).await {
            Ok(vmi) => vmi,
            Err(refused) => return refused,
        };
        let paused = vmi["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Paused" && c["status"] == "True");
        if paused {
            return status(
                StatusCode::CONFLICT,
                "Conflict",
                &format!(
                    "Operation cannot be fulfilled on virtualmachineinstance.kubevirt.io \"{vmi_name}\": VMI is paused"
                ),
            );
        }
        let Some(published) = vmi["status"]["interfaces"][0]["ipAddress"]
            .as_str()
            .map(str::to_owned)
        else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "no network interfaces are present",
            );
        };
        // Where the guest of this VMI really listens; else the address it reports.
        let vmi_uid = uid(&vmi).to_owned();
        let ip = self
            .ctx
            .guests
            .info(ns, vmi_name)
            .filter(|g| g.vmi_uid == vmi_uid)
            .map(|g| IpAddr::V4(g.ip))
            .or_else(|| published.parse().ok());
        let Some(ip) = ip else {
            return status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &format!("dialing VM: dial tcp {published}: not an address"),
            );
        };
        let addr = SocketAddr::new(ip, port);
        let guest = match tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                return status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    &format!("dialing VM: dial tcp {addr}: {e}"),
                );
            }
            Err(_) => {
                return status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "InternalError",
                    &format!("dialing VM: dial tcp {addr}: i/o timeout"),
                );
            }
        };
        // The upgrade (after the dial, as virt-api does it).
        let h = req.headers();
        let upgrade = h
            .get(header::UPGRADE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
        let offered = h
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|p| p.trim() == PROTOCOL);
        let key = h
            .get(header::SEC_WEBSOCKET_KEY)
            .map(|k| k.as_bytes().to_vec());
        let Some(key) = key.filter(|_| upgrade) else {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "websocket: the client is not using the websocket protocol: 'upgrade' token not found in 'Connection' header",
            );
        };
        let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(&key);
        let (ns, vmi_name) = (ns.to_owned(), vmi_name.to_owned());
        tokio::spawn(async move {
            let upgraded = match hyper::upgrade::on(req).await {
                Ok(u) => u,
                Err(e) => {
                    tracing::warn!(error = %e, "portforward: upgrade failed");
                    return;
                }
            };
            let ws =
                WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await;
            tracing::debug!(ns, vmi = vmi_name, port, "portforward opened");
            pump(ws, guest, &stop).await;
            tracing::debug!(ns, vmi = vmi_name, port, "portforward closed");
        });
        switching_protocols(&accept, offered)
    }
}

/// Bytes both ways between the WebSocket and the guest's connection: binary frames to the
/// guest, what the guest sends as binary frames. Either side's end ends both (the guest's
/// with a Close frame), as does the server's stop.
async fn pump<S>(mut ws: WebSocketStream<S>, guest: TcpStream, stop: &CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let (mut from_guest, mut to_guest) = guest.into_split();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            m = ws.next() => match m {
                Some(Ok(Message::Binary(data))) => {
                    if to_guest.write_all(&data).await.is_err() {
                        break;
                    }
                }
                // Text frames are dropped, as KubeVirt's reader does; pings are answered by
                // the codec.
                Some(Ok(Message::Text(_) | Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => {}
                Some(Ok(Message::Close(_)) | Err(_)) | None => {
                    let _ = to_guest.shutdown().await;
                    return;
                }
            },
            n = from_guest.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if ws.send(Message::binary(buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            },
        }
    }
    let _ = ws.close(None).await;
}
