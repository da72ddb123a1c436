//! Kubernetes object names derived from the session id and node.
//!
//! Every name starts with `tt-` and the session id's 32 hex digits, so it starts with a letter
//! (valid as a DNS-1035 label, which Services need) and is unique per session. A [`NodeName`]
//! is at most 20 characters, so the longest name here is 3 + 32 + 1 + 20 + 4 = 60 ≤ 63.

use ttlab_model::{NodeName, SessionId};

/// The prefix of every object name ttlab derives.
pub const NAME_PREFIX: &str = "tt-";

/// The VirtualMachine (and so the VMI and launcher pod) of `node`: `tt-<32 hex>-<node>`.
pub fn vm_name(session: SessionId, node: &NodeName) -> String {
    format!("{NAME_PREFIX}{}-{node}", session.simple())
}

/// The cloud-init Secret of `node`'s VM: `tt-<32 hex>-<node>-ci`.
pub fn secret_name(session: SessionId, node: &NodeName) -> String {
    format!("{}-ci", vm_name(session, node))
}

/// The headless Service of a multi-VM session: `tt-<32 hex>`. Also the VMs' `subdomain`, so a
/// peer resolves as `<node>.tt-<32 hex>` inside the namespace.
pub fn service_name(session: SessionId) -> String {
    format!("{NAME_PREFIX}{}", session.simple())
}

/// The Pod of a pod lab (`runtime: pod`, exactly one node): `tt-<32 hex>-<node>-pod`.
pub fn pod_name(session: SessionId, node: &NodeName) -> String {
    format!("{}-pod", vm_name(session, node))
}

/// The NetworkPolicy letting a multi-VM session's VMs reach each other: `tt-<32 hex>-peers`.
pub fn network_policy_name(session: SessionId) -> String {
    format!("{}-peers", service_name(session))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns1123_label(s: &str) -> bool {
        !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-')
            && !s.ends_with('-')
    }

    #[test]
    fn names_are_dns_labels_even_for_the_longest_node() {
        let id: SessionId = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap();
        let longest = NodeName::new("w".repeat(NodeName::MAX_LEN)).unwrap();
        for name in [
            vm_name(id, &longest),
            secret_name(id, &longest),
            service_name(id),
            network_policy_name(id),
            pod_name(id, &longest),
        ] {
            assert!(is_dns1123_label(&name), "{name}");
            assert!(
                name.starts_with("tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a"),
                "{name}"
            );
        }
        assert_eq!(secret_name(id, &longest).len(), 59);
        assert_eq!(
            vm_name(id, &"vm".parse().unwrap()),
            "tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-vm"
        );
    }

    #[test]
    fn names_differ_per_node_and_kind() {
        let id = SessionId::new_random();
        let a: NodeName = "a".parse().unwrap();
        let b: NodeName = "b".parse().unwrap();
        let all = [
            vm_name(id, &a),
            vm_name(id, &b),
            secret_name(id, &a),
            secret_name(id, &b),
            service_name(id),
            network_policy_name(id),
            pod_name(id, &a),
        ];
        let unique: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(unique.len(), all.len());
    }
}
