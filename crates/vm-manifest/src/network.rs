//! The session Service and NetworkPolicy of a multi-VM session.
//!
//! How the NetworkPolicy composes with the namespace's own policies: Kubernetes
//! NetworkPolicies only ever add allowed traffic — a connection is allowed if ANY policy that
//! selects the pod (for that direction) allows it. The namespace is expected to hold a
//! deny-by-default policy (every pod, Ingress and Egress), one allowing the backend to reach
//! the agent port, and one allowing egress to DNS and the internet. The session policy selects
//! only this session's VMs and adds, in both directions, traffic to and from pods carrying the
//! same session labels. It cannot open anything to another session (its peers are selected by
//! the session id) nor to anything outside the namespace (a `podSelector` peer without a
//! `namespaceSelector` means this namespace only). Egress is included because a namespace
//! egress policy of "internet only" would otherwise drop traffic to peers' pod addresses.

use k8s_openapi::api::core::v1::{Service, ServiceSpec};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

use crate::{
    COMPONENT_SESSION_NETWORK, COMPONENT_VM, SessionVms, network_policy_name, object_labels,
    service_name,
};

/// The labels selecting this session's VM launcher pods.
fn vm_selector(input: &SessionVms) -> std::collections::BTreeMap<String, String> {
    // No node label: every node of the session.
    object_labels(input, None, COMPONENT_VM)
}

fn meta(input: &SessionVms, name: String) -> ObjectMeta {
    ObjectMeta {
        name: Some(name),
        namespace: input.namespace.clone(),
        labels: Some(object_labels(input, None, COMPONENT_SESSION_NETWORK)),
        ..ObjectMeta::default()
    }
}

/// The headless Service that gives each VM of the session a DNS name
/// (`<node>.<service>`, since each VM's `subdomain` is this Service). No ports: a headless
/// Service resolves to the pod addresses whatever the port. Not-ready addresses are published
/// so peers resolve while the lab is still being set up.
pub fn service(input: &SessionVms) -> Service {
    Service {
        metadata: meta(input, service_name(input.session)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".to_owned()),
            selector: Some(vm_selector(input)),
            publish_not_ready_addresses: Some(true),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// The NetworkPolicy letting the session's VMs talk to each other, on any port, both ways
/// (see the module docs for how it composes with the namespace's policies).
pub fn network_policy(input: &SessionVms) -> NetworkPolicy {
    let selector = LabelSelector {
        match_labels: Some(vm_selector(input)),
        match_expressions: None,
    };
    let peers = vec![NetworkPolicyPeer {
        pod_selector: Some(selector.clone()),
        ..NetworkPolicyPeer::default()
    }];
    NetworkPolicy {
        metadata: meta(input, network_policy_name(input.session)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(selector),
            policy_types: Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(peers.clone()),
                ports: None,
            }]),
            egress: Some(vec![NetworkPolicyEgressRule {
                to: Some(peers),
                ports: None,
            }]),
        }),
    }
}
