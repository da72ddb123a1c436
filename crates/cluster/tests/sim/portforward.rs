//! A guest's port through the API server (KubeVirt's `portforward` subresource): the real
//! agent of a simulated guest answers over it, while the VMI's published address is one
//! nothing routes; refusals (no VMI, no right, a VMI not running or stopped) are typed.
//!
//! The agent is the built `ttlab-agent` (`cargo build -p ttlab-agent-bin`); without it these
//! tests print a `SKIPPED:` line, or fail under `CI=true`.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use ttlab_agent::protocol::{AgentToken, PORT, TOKEN_PATH};
use ttlab_agent::{AgentClient, AgentConnection, AgentRoute, Connector};
use ttlab_cluster::{ClusterError, ClusterSettings, ConsoleCluster, KubeCluster, ProvisionCluster};
use ttlab_kube_sim::SimConfig;

use crate::common::{self, Harness, SIM_NS};

/// kube-sim whose guests run the built agent and publish unroutable addresses; `None` (after
/// `skip_or_fail`) without the agent.
async fn harness() -> Option<Harness> {
    let agent = match ttlab_agent::locate_binary() {
        Ok(path) => path,
        Err(e) => {
            ttlab_testkit::skip_or_fail(&e.to_string());
            return None;
        }
    };
    let mut config = SimConfig::for_tests();
    config.agent_binary = Some(agent);
    config.unroutable_pod_ips = true;
    Some(Harness::start_sim(config, ClusterSettings::default()).await)
}

/// The agent's port of a VMI, opened through the cluster for each request.
struct Through {
    cluster: KubeCluster,
    vmi: String,
}

impl Connector for Through {
    fn describe(&self) -> String {
        format!("port {PORT} of VMI {} through the API server", self.vmi)
    }

    fn connect(&self) -> Pin<Box<dyn Future<Output = io::Result<AgentConnection>> + Send + '_>> {
        Box::pin(async move {
            match self.cluster.open_portforward(&self.vmi, PORT).await {
                Ok(stream) => Ok(Box::new(stream) as AgentConnection),
                Err(e) => Err(io::Error::other(e)),
            }
        })
    }
}

/// Opens the agent's port until it answers (the agent starts after the VMI runs).
async fn wait_open(cluster: &KubeCluster, vmi: &str) {
    let started = Instant::now();
    loop {
        match cluster.open_portforward(vmi, PORT).await {
            Ok(_) => return,
            Err(e) if e.is_retryable() && started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("port {PORT} of {vmi} never opened: {e:?}"),
        }
    }
}

#[tokio::test]
async fn a_port_forward_carries_a_request_to_the_guests_agent_whose_address_is_unroutable() {
    let Some(h) = harness().await else { return };
    h.cluster
        .create_vm(common::vm("lab-pf", &common::labels("dev")))
        .await
        .unwrap();
    let vmi = h
        .cluster
        .wait_vmi_running("lab-pf", Duration::from_secs(20))
        .await
        .unwrap();
    // The address the VMI reports is in TEST-NET-1: nothing answers there.
    let published = vmi.ip.expect("an address");
    assert!(
        matches!(published, IpAddr::V4(v4) if v4.octets()[..3] == [192, 0, 2]),
        "{published}"
    );
    let direct = AgentClient::new(
        std::net::SocketAddr::new(published, PORT),
        AgentToken::from_random_bytes([1; 32]),
    )
    .with_timeouts(Duration::from_millis(300), Duration::from_millis(300));
    assert!(
        direct.ready().await.is_err(),
        "the published address answered"
    );

    wait_open(&h.cluster, "lab-pf").await;
    // The guest's agent checks a token: give it one, as cloud-init would.
    let token = AgentToken::from_random_bytes([7; 32]);
    let dir = h
        .sim()
        .guest_dir(SIM_NS, "lab-pf")
        .expect("guest directory");
    let path = dir.join(TOKEN_PATH.trim_start_matches('/'));
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, format!("{}\n", token.reveal())).unwrap();

    let through = AgentClient::via(
        AgentRoute::Tunnel(Arc::new(Through {
            cluster: h.cluster.clone(),
            vmi: "lab-pf".into(),
        })),
        token,
    );
    through.ready().await.expect("the agent's answer");
    let out = through
        .exec("echo through the API server", Duration::from_secs(5))
        .await
        .expect("exec over the port forward");
    assert_eq!(
        (out.exit_code, out.stdout.as_str()),
        (Some(0), "through the API server\n")
    );
    // A wrong token is the agent's own refusal, carried back.
    let wrong = AgentClient::via(
        through.route().clone(),
        AgentToken::from_random_bytes([9; 32]),
    );
    assert!(matches!(
        wrong.ready().await,
        Err(ttlab_agent::Error::Unauthorized { .. })
    ));
}

#[tokio::test]
async fn port_forward_refusals_say_why() {
    let Some(h) = harness().await else { return };
    // No VMI.
    let err = h
        .cluster
        .open_portforward("no-such-vmi", PORT)
        .await
        .unwrap_err();
    assert!(err.is_not_found(), "{err:?}");

    // A VMI that never runs (its PVC is missing) has no address yet.
    h.cluster
        .create_vm(common::vm_on_pvc(
            "lab-pending",
            &common::labels("dev"),
            "nope",
        ))
        .await
        .unwrap();
    let started = Instant::now();
    let err = loop {
        match h.cluster.open_portforward("lab-pending", PORT).await {
            Err(e) if e.is_not_found() && started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap_err(),
        }
    };
    assert!(
        matches!(&err, ClusterError::PortUnreachable { message, .. } if message.contains("no network interfaces")),
        "{err:?}"
    );
    assert!(err.is_retryable());

    // A guest that powered itself off (run strategy Once: its VMI stays, Succeeded): nothing
    // answers on its port.
    let mut once = common::vm("lab-once", &common::labels("dev"));
    once["spec"]["runStrategy"] = json!("Once");
    h.cluster.create_vm(once).await.unwrap();
    h.cluster
        .wait_vmi_running("lab-once", Duration::from_secs(20))
        .await
        .unwrap();
    wait_open(&h.cluster, "lab-once").await;
    h.sim().power_off(SIM_NS, "lab-once").unwrap();
    let started = Instant::now();
    let err = loop {
        match h.cluster.open_portforward("lab-once", PORT).await {
            Ok(_) if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => break other.unwrap_err(),
        }
    };
    assert!(
        matches!(&err, ClusterError::PortUnreachable { message, .. } if message.contains("dialing VM")),
        "{err:?}"
    );

    // An identity with the console but not the port forward.
    h.sim()
        .apply_rbac(&[
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "console-only", "namespace": SIM_NS},
                   "rules": [{"apiGroups": ["subresources.kubevirt.io"],
                              "resources": ["virtualmachineinstances/console"], "verbs": ["get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "console-only", "namespace": SIM_NS},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "console-only"},
                   "subjects": [{"kind": "User", "name": "console-user"}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "forwarder", "namespace": SIM_NS},
                   "rules": [{"apiGroups": ["subresources.kubevirt.io"],
                              "resources": ["virtualmachineinstances/portforward"], "verbs": ["get"]}]}),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "forwarder", "namespace": SIM_NS},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "forwarder"},
                   "subjects": [{"kind": "User", "name": "forwarder"}]}),
        ])
        .unwrap();
    let as_user = |user: &'static str| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kubeconfig");
        h.sim().write_kubeconfig_for(&path, SIM_NS, user).unwrap();
        async move {
            let c = KubeCluster::from_kubeconfig(&path, ClusterSettings::in_namespace(SIM_NS))
                .await
                .unwrap();
            drop(dir);
            c
        }
    };
    let console_user = as_user("console-user").await;
    let err = console_user
        .open_portforward("lab-pending", PORT)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ClusterError::Forbidden { message } if message.contains("virtualmachineinstances/portforward")),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // `get` on `virtualmachineinstances/portforward` is what it takes.
    let forwarder = as_user("forwarder").await;
    let err = forwarder
        .open_portforward("lab-pending", PORT)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ClusterError::PortUnreachable { .. }),
        "{err:?}"
    );
}
