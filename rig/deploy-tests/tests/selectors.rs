//! The quota and the network policies guard what the code really creates: the labels come
//! from `ttlab_vm_manifest::render` (VMs, and through their template the virt-launcher pods)
//! and `ttlab_model::labels` (pod labs), not from a copy in this test.

mod common;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde_json::Value;
use ttlab_deploy_tests::{Rendered, pod_labels, selects, string_map};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_model::labels::{self, ObjectLabels};
use ttlab_model::{EnvName, SessionId};
use ttlab_vm_manifest::launcher::LauncherSpec;
use ttlab_vm_manifest::{SessionManifests, SessionVms, render};

use common::{ENVIRONMENTS, render_overlay};

fn session(env: &str, nodes: &[&str], namespace: &str) -> (SessionVms, SessionManifests) {
    let input = SessionVms {
        session: SessionId::new_random(),
        env: env.parse().unwrap(),
        lesson: "kubeadm-cluster".parse().unwrap(),
        namespace: Some(namespace.to_owned()),
        image: "quay.io/containerdisks/ubuntu:22.04".into(),
        memory: "4Gi".into(),
        cores: 2,
        nodes: nodes.iter().map(|n| n.parse().unwrap()).collect(),
        disk: DiskDecision::ContainerDisk {
            reason: FallbackReason::NotRequested,
        },
        termination_grace_period_seconds: 30,
    };
    let out = render(&input).unwrap();
    (input, out)
}

/// The labels KubeVirt gives a VM's virt-launcher pod: every label of the VM's template,
/// plus its own.
fn launcher_pod_labels(vm: &ttlab_vm_manifest::VirtualMachine) -> BTreeMap<String, String> {
    let mut l = vm.spec.template.metadata.labels.clone();
    l.insert("kubevirt.io".into(), "virt-launcher".into());
    l.insert(
        "vm.kubevirt.io/name".into(),
        vm.metadata.name.clone().unwrap(),
    );
    l
}

/// The labels of a pod lab's Pod.
fn lab_pod_labels(env: &str) -> BTreeMap<String, String> {
    let mut l = ObjectLabels::new(
        SessionId::new_random(),
        env.parse::<EnvName>().unwrap(),
        "shell-basics".parse().unwrap(),
        Some("pod".parse().unwrap()),
    )
    .to_map();
    l.insert(labels::COMPONENT.into(), labels::component::POD.into());
    l
}

fn policy<'a>(rendered: &'a Rendered, name: &str) -> &'a Value {
    rendered.get("NetworkPolicy", name)
}

fn vm_namespace(rendered: &Rendered) -> String {
    rendered.generated_config_map("ttlab-config")["data"]["TTLAB_NAMESPACE"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[test]
fn the_policies_select_every_launcher_pod_the_code_creates() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let ns = vm_namespace(&rendered);
        for other_env in ENVIRONMENTS {
            // The policies are shared: they must hold for either environment's VMs.
            let (_, single) = session(other_env, &["vm"], &ns);
            let (_, multi) = session(other_env, &["control-plane", "worker-1", "worker-2"], &ns);
            for vm in single.vms.iter().chain(&multi.vms) {
                assert_eq!(vm.metadata.namespace.as_deref(), Some(ns.as_str()));
                let pod = launcher_pod_labels(vm);
                for name in ["ttlab-default-deny", "ttlab-agent-ingress", "ttlab-egress"] {
                    let p = policy(&rendered, name);
                    assert_eq!(p["metadata"]["namespace"], ns.as_str(), "{name}");
                    assert!(
                        selects(&p["spec"]["podSelector"], &pod),
                        "{env}: {name} misses the launcher pod of {other_env} {:?}",
                        vm.metadata.name
                    );
                }
            }
        }
    }
}

#[test]
fn only_the_server_reaches_the_agent_port() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let deny = &policy(&rendered, "ttlab-default-deny")["spec"];
        assert_eq!(deny["podSelector"], serde_json::json!({}));
        assert_eq!(
            deny["policyTypes"],
            serde_json::json!(["Ingress", "Egress"])
        );
        assert!(deny.get("ingress").is_none() && deny.get("egress").is_none());

        let agent = &policy(&rendered, "ttlab-agent-ingress")["spec"];
        assert_eq!(agent["policyTypes"], serde_json::json!(["Ingress"]));
        let rules = agent["ingress"].as_array().unwrap();
        assert_eq!(rules.len(), 1, "one way in");
        let ports = rules[0]["ports"].as_array().unwrap();
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0]["protocol"], "TCP");
        assert_eq!(
            ports[0]["port"].as_u64(),
            Some(u64::from(ttlab_agent::protocol::PORT))
        );
        let from = rules[0]["from"].as_array().unwrap();
        assert_eq!(from.len(), 1);
        assert!(from[0].get("ipBlock").is_none());

        // The peer is the server: its namespace and its pods, and nothing else there.
        let backend_ns = rendered.get("Namespace", &format!("ttlab-{env}"));
        let ns_labels = string_map(&backend_ns["metadata"]["labels"]);
        assert!(selects(&from[0]["namespaceSelector"], &ns_labels));
        let vm_ns = rendered.get("Namespace", "ttlab-vms");
        assert!(
            !selects(
                &from[0]["namespaceSelector"],
                &string_map(&vm_ns["metadata"]["labels"])
            ),
            "VMs must not reach each other's agents"
        );
        let server = pod_labels(rendered.get("Deployment", "ttlab-server"));
        let reaper = pod_labels(rendered.get("Deployment", "ttlab-reaper"));
        assert!(selects(&from[0]["podSelector"], &server));
        assert!(!selects(&from[0]["podSelector"], &reaper));

        // A pod lab gets no way in at all; it is still denied and confined.
        let pod = lab_pod_labels(env);
        assert!(!selects(&agent["podSelector"], &pod));
        assert!(selects(&deny["podSelector"], &pod));
        assert!(selects(
            &policy(&rendered, "ttlab-egress")["spec"]["podSelector"],
            &pod
        ));
    }
}

fn parse_cidr(cidr: &str) -> Option<(Ipv4Addr, u32)> {
    let (addr, len) = cidr.split_once('/')?;
    Some((addr.parse().ok()?, len.parse().ok()?))
}

fn contains(cidr: &str, ip: Ipv4Addr) -> bool {
    let Some((net, len)) = parse_cidr(cidr) else {
        return false;
    };
    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
    u32::from(net) & mask == u32::from(ip) & mask
}

/// Whether `ip` may be reached under the egress policy's ipBlocks (the DNS rule aside).
fn internet_allows(egress: &Value, ip: Ipv4Addr) -> bool {
    egress.as_array().unwrap().iter().any(|rule| {
        rule["to"].as_array().into_iter().flatten().any(|peer| {
            let block = &peer["ipBlock"];
            block["cidr"].as_str().is_some_and(|c| contains(c, ip))
                && !block["except"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|e| e.as_str().is_some_and(|e| contains(e, ip)))
        })
    })
}

#[test]
fn egress_reaches_dns_and_the_internet_but_not_the_cluster_or_the_metadata_address() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let spec = &policy(&rendered, "ttlab-egress")["spec"];
        assert_eq!(spec["policyTypes"], serde_json::json!(["Egress"]));
        let egress = &spec["egress"];
        let dns = &egress[0];
        assert_eq!(
            dns["to"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
            "kube-system"
        );
        assert_eq!(
            dns["to"][0]["podSelector"]["matchLabels"]["k8s-app"],
            "kube-dns"
        );
        let dns_ports: Vec<_> = dns["ports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["protocol"].as_str().unwrap(), p["port"].as_u64().unwrap()))
            .collect();
        assert_eq!(dns_ports, [("UDP", 53), ("TCP", 53)]);

        for public in ["1.1.1.1", "151.101.2.132", "8.8.8.8"] {
            assert!(
                internet_allows(egress, public.parse().unwrap()),
                "{env}: {public}"
            );
        }
        for internal in [
            "169.254.169.254", // cloud metadata
            "10.96.0.1",       // the usual service network (kubernetes.default)
            "10.244.1.7",      // the usual pod network
            "192.168.0.10",    // a kubeadm lab's own pod network, or nodes
            "172.17.0.1",
            "100.64.0.1",
        ] {
            assert!(
                !internet_allows(egress, internal.parse().unwrap()),
                "{env}: {internal} reachable"
            );
        }
    }
}

#[test]
fn a_session_peers_policy_admits_its_own_vms_only() {
    let Some(rendered) = render_overlay("prod") else {
        return;
    };
    let ns = vm_namespace(&rendered);
    let (_, a) = session("prod", &["control-plane", "worker-1"], &ns);
    let (_, b) = session("prod", &["control-plane", "worker-1"], &ns);
    let peers = serde_json::to_value(a.network_policy.as_ref().unwrap()).unwrap();
    let spec = &peers["spec"];
    let from = &spec["ingress"][0]["from"][0]["podSelector"];
    let to = &spec["egress"][0]["to"][0]["podSelector"];
    for vm in &a.vms {
        let pod = launcher_pod_labels(vm);
        assert!(selects(&spec["podSelector"], &pod));
        assert!(selects(from, &pod) && selects(to, &pod));
    }
    for vm in &b.vms {
        let pod = launcher_pod_labels(vm);
        assert!(!selects(&spec["podSelector"], &pod));
        assert!(!selects(from, &pod) && !selects(to, &pod));
    }
}

#[test]
fn the_quota_bounds_the_vms_the_code_creates_behind_the_backend_limit() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let ns = vm_namespace(&rendered);
        let quota = rendered.get("ResourceQuota", "ttlab-vms");
        assert_eq!(quota["metadata"]["namespace"], ns.as_str());
        let hard = &quota["spec"]["hard"];

        // The quota counts the resource the rendered VMs are.
        let (_, single) = session(env, &["vm"], &ns);
        let vm = &single.vms[0];
        let (group, _) = vm.api_version.split_once('/').unwrap();
        assert_eq!(vm.kind, "VirtualMachine");
        let count_key = format!("count/virtualmachines.{group}");
        let limit: u64 = rendered.generated_config_map("ttlab-config")["data"]["TTLAB_VM_LIMIT"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(hard[&count_key].as_str(), Some("8"), "{count_key}");
        assert_eq!(limit, 8, "the backend's limit and the quota agree");

        // Memory: the backend's limit of default-size VMs fits under the quota (it is the
        // backend that refuses first, with a clear message), with room for the launcher
        // overhead; twice as many would not.
        let gib = |q: &str| -> u64 { q.strip_suffix("Gi").unwrap().parse().unwrap() };
        let per_vm = gib(&vm.spec.template.spec.domain.resources.requests["memory"]);
        let quota_gib = gib(hard["requests.memory"].as_str().unwrap());
        assert_eq!(quota_gib, 48);
        assert!(
            limit * per_vm + limit < quota_gib,
            "8 VMs of 4Gi + ~1Gi overhead each"
        );
        assert!(2 * limit * per_vm > quota_gib);
        // Exactly: what the quota is charged for each VM's launcher pod (the guest, KubeVirt's
        // overhead and the console log's sidecar), 8 × 4648734401 bytes = 34.6 GiB.
        let cores = vm.spec.template.spec.domain.cpu.cores;
        let charged = LauncherSpec::lab_vm(per_vm << 30, cores)
            .resources()
            .pod_memory;
        assert_eq!(charged, 4_648_734_401);
        assert!(
            limit * charged < quota_gib << 30,
            "the VM count refuses before the quota's memory: {limit} × {charged} bytes"
        );
    }
}
