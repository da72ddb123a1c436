//! How the server reaches the agent in a session's VM, by its site's [`AgentPath`] (the sites
//! file's `agent_path`, or `TTLAB_AGENT_PATH` without one): a TCP connection to the VMI's address (`pod-ip`: the server runs in
//! the VMs' cluster), or a connection through the cluster's API server for each request
//! (`portforward`: KubeVirt's `portforward` subresource of the VMI, for a server the pod
//! network does not reach). Every agent client of the server is built here, by
//! [`agent_client`], from the site the VM runs on.

use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;

use ttlab_agent::protocol::AgentToken;
use ttlab_agent::{AgentClient, AgentConnection, AgentRoute, Connector};
use ttlab_cluster::{ClusterError, ConsoleCluster};

use crate::AppState;
use crate::config::AgentPath;
use crate::sites::SiteRuntime;

/// Why no agent client could be built.
#[derive(Debug)]
pub(crate) enum NoAgent {
    /// The VM has no running instance (powered off, or deleted behind the server's back).
    NoInstance,
    /// The VMI reports no address yet.
    NoAddress,
    /// Reading the VMI failed.
    Cluster(ClusterError),
}

impl std::fmt::Display for NoAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoInstance => f.write_str("it has no running instance"),
            Self::NoAddress => f.write_str("it has no address yet"),
            Self::Cluster(e) => write!(f, "{e}"),
        }
    }
}

/// A client of the agent in VMI `vmi` on `site`, presenting `token` and the server's
/// `User-Agent`, reached as the site's [`AgentPath`] says. `known_ip` is the VMI's address when the
/// caller has just read it (`pod-ip` then asks the cluster for nothing); `portforward` needs
/// no address and never asks the cluster here: each request opens its own port forward.
/// The caller sets the timeouts (the connect timeout covers opening a port forward).
pub(crate) async fn agent_client(
    state: &AppState,
    site: &SiteRuntime,
    vmi: &str,
    known_ip: Option<IpAddr>,
    token: AgentToken,
) -> Result<AgentClient, NoAgent> {
    let port = state.config().agent_port;
    let cluster: Arc<dyn ConsoleCluster> = site.cluster().clone();
    let route = match site.agent_path() {
        AgentPath::PodIp => {
            let ip = match known_ip {
                Some(ip) => ip,
                None => match cluster.vmi_ip(vmi).await {
                    Ok(Some(ip)) => ip,
                    Ok(None) => return Err(NoAgent::NoAddress),
                    Err(ClusterError::NotFound { .. }) => return Err(NoAgent::NoInstance),
                    Err(e) => return Err(NoAgent::Cluster(e)),
                },
            };
            AgentRoute::Direct(SocketAddr::new(ip, port))
        }
        AgentPath::Portforward => AgentRoute::Tunnel(Arc::new(PortForward {
            cluster,
            vmi: vmi.to_owned(),
            port,
        })),
    };
    Ok(AgentClient::via(route, token).with_user_agent(state.config().user_agent.as_str()))
}

/// The agent's port of a VMI through the API server, a port forward per connection.
struct PortForward {
    cluster: Arc<dyn ConsoleCluster>,
    vmi: String,
    port: u16,
}

impl Connector for PortForward {
    fn describe(&self) -> String {
        format!(
            "port {} of VMI {} through the API server",
            self.port, self.vmi
        )
    }

    fn connect(&self) -> Pin<Box<dyn Future<Output = io::Result<AgentConnection>> + Send + '_>> {
        Box::pin(async move {
            match self.cluster.open_portforward(&self.vmi, self.port).await {
                Ok(stream) => Ok(Box::new(stream) as AgentConnection),
                Err(e) => Err(io::Error::new(kind_of(&e), e)),
            }
        })
    }
}

/// How the agent client should take a port forward's failure: refused for good (no right, no
/// VMI, a request the server calls invalid) or, like a refused TCP connection, worth a retry.
fn kind_of(e: &ClusterError) -> io::ErrorKind {
    match e {
        ClusterError::Forbidden { .. } => io::ErrorKind::PermissionDenied,
        ClusterError::NotFound { .. } => io::ErrorKind::NotFound,
        ClusterError::Invalid { .. } | ClusterError::Config { .. } => io::ErrorKind::InvalidInput,
        ClusterError::PortUnreachable { .. } => io::ErrorKind::ConnectionRefused,
        _ => io::ErrorKind::Other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_for_good_are_not_retried_and_the_rest_are() {
        let m = || "x".to_owned();
        let cases = [
            (ClusterError::Forbidden { message: m() }, false),
            (ClusterError::NotFound { message: m() }, false),
            (ClusterError::Invalid { message: m() }, false),
            (
                ClusterError::PortUnreachable {
                    name: m(),
                    port: 8899,
                    message: m(),
                },
                true,
            ),
            (ClusterError::Transient { message: m() }, true),
        ];
        for (e, retried) in cases {
            let kind = kind_of(&e);
            let refused = matches!(
                kind,
                io::ErrorKind::PermissionDenied
                    | io::ErrorKind::NotFound
                    | io::ErrorKind::InvalidInput
            );
            assert_eq!(!refused, retried, "{e}: {kind:?}");
        }
    }
}
