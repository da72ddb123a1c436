//! Rendered manifests: schema validity, labels, names, snapshots, determinism.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_model::NodeName;
use ttlab_model::labels::{self, ObjectLabels};
use ttlab_vm_manifest::{
    AGENT_DISK, AgentDisk, DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS, ManifestError,
    SessionManifests, SessionVms, render_with_agent, secret_name, service_name, vm_name,
};

/// The agent disk every lab VM gets (the server takes both from the agent payload).
fn agent() -> AgentDisk {
    AgentDisk {
        config_map: "ttlab-agent-50b7bf522747c966".into(),
        volume_label: "ttlab-agent".into(),
    }
}

/// What the server renders: every VM with the agent disk.
fn render(input: &SessionVms) -> Result<SessionManifests, ManifestError> {
    render_with_agent(input, &agent())
}

/// The KubeVirt schemas vendored in the repository (`reference/kubevirt/`, provenance in its
/// README.txt).
fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../reference/kubevirt")
}

fn input(nodes: &[&str], disk: DiskDecision) -> SessionVms {
    SessionVms {
        session: "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap(),
        env: "dev".parse().unwrap(),
        lesson: "kubeadm-cluster".parse().unwrap(),
        namespace: Some("ttlab-vms".into()),
        image: "quay.io/containerdisks/ubuntu:22.04".into(),
        memory: "4Gi".into(),
        cores: 2,
        nodes: nodes.iter().map(|n| n.parse().unwrap()).collect(),
        disk,
        termination_grace_period_seconds: DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS,
    }
}

fn golden() -> DiskDecision {
    DiskDecision::Golden {
        claim: "golden-ubuntu-2204".into(),
    }
}

/// Every combination the server can produce: one or three nodes × every disk decision.
fn all_inputs() -> Vec<SessionVms> {
    let mut disks = vec![golden()];
    disks.extend(
        FallbackReason::ALL
            .into_iter()
            .map(|reason| DiskDecision::ContainerDisk { reason }),
    );
    let mut out = Vec::new();
    for disk in disks {
        out.push(input(&["vm"], disk.clone()));
        out.push(input(&["control-plane", "worker-1", "worker-2"], disk));
    }
    out
}

fn to_value<T: serde::Serialize>(t: &T) -> Value {
    serde_json::to_value(t).unwrap()
}

fn yaml_stream(m: &SessionManifests) -> String {
    let mut docs: Vec<Value> = m.vms.iter().map(to_value).collect();
    docs.extend(m.service.iter().map(to_value));
    docs.extend(m.network_policy.iter().map(to_value));
    docs.iter()
        .map(|d| format!("---\n{}", serde_norway::to_string(d).unwrap()))
        .collect()
}

/// The strict VirtualMachine schema (see reference/kubevirt/README.txt for how it is derived).
fn load_schema() -> Value {
    let path = reference_dir().join("virtualmachine.v1.strict.schema.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("the vendored schema {} is unreadable: {e}", path.display()));
    serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("the vendored schema {} is not JSON: {e}", path.display()))
}

#[test]
fn every_rendered_vm_passes_the_strict_kubevirt_schema() {
    let schema = load_schema();
    let mut validator = common::Validator::new();
    let mut checked = 0;
    for inp in all_inputs() {
        for vm in render(&inp).unwrap().vms {
            let errors = validator.errors(&schema, &to_value(&vm));
            assert!(errors.is_empty(), "{:?}: {errors:#?}", vm.metadata.name);
            checked += 1;
        }
    }
    assert_eq!(checked, 11 * 4);
}

#[test]
fn the_validator_rejects_the_invalid_examples_and_accepts_the_valid_ones() {
    let schema = load_schema();
    let mut validator = common::Validator::new();
    let dir = reference_dir().join("examples");
    let mut seen = (0, 0);
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let doc: Value = serde_norway::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let errors = validator.errors(&schema, &doc);
        if name.starts_with("vm-invalid-") {
            assert!(!errors.is_empty(), "{name} must be rejected");
            seen.0 += 1;
        } else {
            assert!(errors.is_empty(), "{name}: {errors:#?}");
            seen.1 += 1;
        }
    }
    assert_eq!(seen, (4, 2), "examples found");
}

#[test]
fn the_validator_catches_the_mistakes_the_renderer_must_not_make() {
    let schema = load_schema();
    let mut validator = common::Validator::new();
    let vm = to_value(&render(&input(&["vm"], golden())).unwrap().vms[0]);
    let mutate = |f: &dyn Fn(&mut Value)| {
        let mut v = vm.clone();
        f(&mut v);
        v
    };
    let bad = [
        mutate(&|v| {
            let ci = &mut v["spec"]["template"]["spec"]["volumes"][1]["cloudInitNoCloud"];
            ci["userDataSecretRef"] = ci["secretRef"].take();
            ci.as_object_mut().unwrap().remove("secretRef");
        }),
        mutate(&|v| v["spec"]["runStrategy"] = "Sometimes".into()),
        mutate(&|v| v["spec"]["template"]["spec"]["domain"]["memory"]["guest"] = "4 GiB".into()),
        mutate(&|v| {
            v["spec"]["template"]["spec"]["domain"]["resources"]["requests"]["memory"] = Value::Null
        }),
        mutate(&|v| {
            v["spec"]["template"]["spec"]["volumes"][0]["ephemeral"]["persistentVolumeClaim"]["readonly"] =
                true.into()
        }),
    ];
    for (i, v) in bad.iter().enumerate() {
        assert!(
            !validator.errors(&schema, v).is_empty(),
            "mutation {i} must be rejected"
        );
    }
}

#[test]
fn single_vm_with_golden_disk_matches_snapshot() {
    snapshot(
        "single-golden.yaml",
        &yaml_stream(&render(&input(&["vm"], golden())).unwrap()),
    );
}

#[test]
fn three_vms_on_container_disk_match_snapshot() {
    let inp = input(
        &["control-plane", "worker-1", "worker-2"],
        DiskDecision::ContainerDisk {
            reason: FallbackReason::Importing,
        },
    );
    snapshot("multi-container.yaml", &yaml_stream(&render(&inp).unwrap()));
}

/// Compares with `tests/snapshots/<name>`; `TTLAB_UPDATE_SNAPSHOTS=1` rewrites it.
fn snapshot(name: &str, actual: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/snapshots")
        .join(name);
    if std::env::var_os("TTLAB_UPDATE_SNAPSHOTS").is_some() {
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with TTLAB_UPDATE_SNAPSHOTS=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        actual, expected,
        "snapshot {name} differs; TTLAB_UPDATE_SNAPSHOTS=1 to accept"
    );
}

#[test]
fn rendering_is_deterministic() {
    for inp in all_inputs() {
        assert_eq!(
            yaml_stream(&render(&inp).unwrap()),
            yaml_stream(&render(&inp.clone()).unwrap())
        );
    }
}

#[test]
fn vm_and_launcher_pod_carry_the_session_labels() {
    for inp in all_inputs() {
        let m = render(&inp).unwrap();
        for (vm, node) in m.vms.iter().zip(&inp.nodes) {
            let meta = vm.metadata.labels.as_ref().unwrap();
            assert_eq!(meta, &vm.spec.template.metadata.labels);
            let parsed = ObjectLabels::from_map(meta).expect("labels read back");
            assert_eq!(parsed.session, inp.session);
            assert_eq!(parsed.env, inp.env);
            assert_eq!(parsed.lesson, inp.lesson);
            assert_eq!(parsed.node.as_ref(), Some(node));
            assert_eq!(meta[labels::COMPONENT], "vm");
            assert_eq!(
                vm.metadata.name.as_deref(),
                Some(vm_name(inp.session, node).as_str())
            );
            assert_eq!(vm.metadata.namespace.as_deref(), Some("ttlab-vms"));
        }
    }
}

#[test]
fn vm_spec_follows_the_lab_rules() {
    let m = render(&input(&["vm"], golden())).unwrap();
    let v = to_value(&m.vms[0]);
    assert_eq!(v["apiVersion"], "kubevirt.io/v1");
    assert_eq!(v["kind"], "VirtualMachine");
    assert_eq!(v["spec"]["runStrategy"], "RerunOnFailure");
    assert!(v["spec"].get("running").is_none());
    let t = &v["spec"]["template"]["spec"];
    assert_eq!(t["domain"]["memory"]["guest"], "4Gi");
    assert_eq!(
        t["domain"]["resources"]["requests"]["memory"], "4Gi",
        "no discount"
    );
    assert_eq!(t["domain"]["cpu"]["cores"], 2);
    assert_eq!(t["terminationGracePeriodSeconds"], 30);
    assert_eq!(
        t["domain"]["devices"]["interfaces"][0]["masquerade"],
        serde_json::json!({})
    );
    assert_eq!(
        t["domain"]["devices"]["interfaces"][0]["ports"][0]["port"],
        8899
    );
    assert_eq!(
        t["volumes"][0]["ephemeral"]["persistentVolumeClaim"],
        serde_json::json!({"claimName": "golden-ubuntu-2204", "readOnly": true})
    );
    assert_eq!(
        t["volumes"][1]["cloudInitNoCloud"],
        serde_json::json!({"secretRef": {"name": secret_name(input(&["vm"], golden()).session, &"vm".parse().unwrap())}})
    );
    assert!(t.get("subdomain").is_none(), "single VM has no peer DNS");
    assert_eq!(
        t["volumes"][2],
        serde_json::json!({"name": AGENT_DISK, "configMap": {"name": "ttlab-agent-50b7bf522747c966", "volumeLabel": "ttlab-agent"}}),
        "the agent comes from its version's shared ConfigMap"
    );
    assert_eq!(
        t["domain"]["devices"]["disks"][2],
        serde_json::json!({"name": AGENT_DISK, "disk": {"bus": "virtio"}})
    );
    let without = ttlab_vm_manifest::render(&input(&["vm"], golden())).unwrap();
    let t = &to_value(&without.vms[0])["spec"]["template"]["spec"];
    assert_eq!(t["volumes"].as_array().unwrap().len(), 2);
    assert_eq!(t["domain"]["devices"]["disks"].as_array().unwrap().len(), 2);

    let c = render(&input(
        &["vm"],
        DiskDecision::ContainerDisk {
            reason: FallbackReason::NotFound,
        },
    ))
    .unwrap();
    let t = &to_value(&c.vms[0])["spec"]["template"]["spec"];
    assert_eq!(
        t["volumes"][0],
        serde_json::json!({"name": "rootdisk", "containerDisk": {"image": "quay.io/containerdisks/ubuntu:22.04"}})
    );
}

#[test]
fn multi_vm_sessions_get_peer_dns_and_a_peer_policy_that_selects_them() {
    let inp = input(&["control-plane", "worker-1", "worker-2"], golden());
    let m = render(&inp).unwrap();
    let svc = m.service.as_ref().unwrap();
    let np = m.network_policy.as_ref().unwrap();
    assert_eq!(
        svc.metadata.name.as_deref(),
        Some(service_name(inp.session).as_str())
    );
    let spec = svc.spec.as_ref().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"), "headless");
    let selector = spec.selector.as_ref().unwrap();
    let np_spec = np.spec.as_ref().unwrap();
    let np_selector = np_spec
        .pod_selector
        .as_ref()
        .unwrap()
        .match_labels
        .as_ref()
        .unwrap();
    assert_eq!(selector, np_selector);
    assert!(selector.contains_key(labels::SESSION) && selector.contains_key(labels::ENV));
    for vm in &m.vms {
        let pod_labels = &vm.spec.template.metadata.labels;
        assert!(
            selector.iter().all(|(k, v)| pod_labels.get(k) == Some(v)),
            "the Service and policy select every VM's launcher pod"
        );
        assert_eq!(
            vm.spec.template.spec.subdomain.as_deref(),
            Some(service_name(inp.session).as_str())
        );
        assert!(
            to_value(vm)["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"][0]
                .get("ports")
                .is_none(),
            "peers reach every port"
        );
    }
    // Another session's launcher pods are not selected.
    let other = render(&SessionVms {
        session: "00000000-0000-4000-8000-000000000001".parse().unwrap(),
        ..inp.clone()
    })
    .unwrap();
    let other_labels = &other.vms[0].spec.template.metadata.labels;
    assert!(!selector.iter().all(|(k, v)| other_labels.get(k) == Some(v)));
    let v = to_value(np);
    assert_eq!(v["apiVersion"], "networking.k8s.io/v1");
    assert_eq!(
        v["spec"]["policyTypes"],
        serde_json::json!(["Ingress", "Egress"])
    );
    assert_eq!(
        v["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"],
        serde_json::to_value(selector).unwrap()
    );
    assert_eq!(
        v["spec"]["egress"][0]["to"][0]["podSelector"]["matchLabels"],
        serde_json::to_value(selector).unwrap()
    );
    assert_eq!(to_value(svc)["kind"], "Service");
    for obj in [&svc.metadata, &np.metadata] {
        let l = ObjectLabels::from_map(obj.labels.as_ref().unwrap()).unwrap();
        assert_eq!(l.node, None);
        assert_eq!(l.session, inp.session);
    }
}

#[test]
fn an_agent_disk_that_kubevirt_or_the_guest_would_refuse_is_refused() {
    for bad in [
        AgentDisk {
            config_map: "Ttlab_Agent".into(),
            ..agent()
        },
        AgentDisk {
            config_map: String::new(),
            ..agent()
        },
        AgentDisk {
            volume_label: "a-label-longer-than-iso-9660-allows".into(),
            ..agent()
        },
        AgentDisk {
            volume_label: "two words".into(),
            ..agent()
        },
    ] {
        let err = render_with_agent(&input(&["vm"], golden()), &bad).unwrap_err();
        assert!(
            matches!(err, ManifestError::BadAgentDisk(_)),
            "{bad:?}: {err}"
        );
    }
}

#[test]
fn bad_input_is_refused_with_a_reason() {
    let ok = input(&["vm"], golden());
    let cases: Vec<(SessionVms, ManifestError)> = vec![
        (
            SessionVms {
                nodes: vec![],
                ..ok.clone()
            },
            ManifestError::NoNodes,
        ),
        (
            SessionVms {
                nodes: vec!["a".parse().unwrap(), "a".parse::<NodeName>().unwrap()],
                ..ok.clone()
            },
            ManifestError::DuplicateNode("a".into()),
        ),
        (
            SessionVms {
                memory: "4GB".into(),
                ..ok.clone()
            },
            ManifestError::BadMemory("4GB".into()),
        ),
        (
            SessionVms {
                cores: 0,
                ..ok.clone()
            },
            ManifestError::NoCores,
        ),
        (
            SessionVms {
                image: " ".into(),
                ..ok.clone()
            },
            ManifestError::NoImage,
        ),
        (
            SessionVms {
                disk: DiskDecision::Golden {
                    claim: String::new(),
                },
                ..ok.clone()
            },
            ManifestError::NoClaim,
        ),
        (
            SessionVms {
                namespace: Some("Bad_NS".into()),
                ..ok.clone()
            },
            ManifestError::BadNamespace("Bad_NS".into()),
        ),
        (
            SessionVms {
                termination_grace_period_seconds: -1,
                ..ok.clone()
            },
            ManifestError::BadGracePeriod(-1),
        ),
    ];
    for (inp, want) in cases {
        assert_eq!(render(&inp), Err(want.clone()));
        assert!(!want.to_string().is_empty());
    }
}
