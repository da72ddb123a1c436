//! The launcher pod's cost against what KubeVirt v1.9 really did with ttlab's rendered VMs
//! (`reference/kubevirt/launcher/`: the virt-launcher pods and VMIs its virt-controller made
//! of the shipped lessons): the same memory overhead, compute requests and console-log
//! sidecar, from the lessons' memory and cores.

use std::path::{Path, PathBuf};

use serde_json::Value;
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_lesson::Lesson;
use ttlab_vm_manifest::launcher::{
    CONSOLE_LOG_CONTAINER, DEVICE_RESOURCES, EPHEMERAL_STORAGE_REQUEST, LauncherSpec,
    MEMORY_OVERHEAD_ANNOTATION,
};
use ttlab_vm_manifest::{AgentDisk, SessionVms, render_with_agent};

fn recorded(name: &str) -> Vec<Value> {
    let path: PathBuf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../reference/kubevirt/launcher")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("recorded JSON")
}

/// What ttlab renders for `lesson` with the container disk, as JSON.
fn rendered_vms(lesson: &Lesson) -> Vec<Value> {
    let input = SessionVms {
        session: "00000014-0000-0002-0000-000000001234".parse().unwrap(),
        env: "dev".parse().unwrap(),
        lesson: lesson.id.clone(),
        namespace: Some("ttlab-vms".into()),
        image: lesson.image.clone(),
        memory: lesson.memory.as_str().to_owned(),
        cores: lesson.cores,
        nodes: lesson.nodes.as_slice().to_vec(),
        disk: DiskDecision::ContainerDisk {
            reason: FallbackReason::NotFound,
        },
        termination_grace_period_seconds: 30,
    };
    let agent = AgentDisk {
        config_map: "ttlab-agent-06f9a8bde83af8ff".into(),
        volume_label: "ttlab-agent".into(),
    };
    render_with_agent(&input, &agent)
        .unwrap()
        .vms
        .iter()
        .map(|vm| serde_json::to_value(vm).unwrap())
        .collect()
}

fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
    pod["spec"][list]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
        .unwrap_or_else(|| panic!("no {list} {name} in {}", pod["metadata"]["name"]))
}

#[test]
fn the_cost_of_each_shipped_lesson_is_what_kubevirt_requested() {
    for (case, lesson, memory) in [
        (
            "systemd-basics-golden-missing",
            ttlab_lesson::samples::systemd_basics(),
            "2340Mi",
        ),
        (
            "kubeadm-cluster-golden-missing",
            ttlab_lesson::samples::kubeadm_cluster(),
            "4613734401",
        ),
    ] {
        let pods = recorded(&format!("{case}.launcher-pods.json"));
        let vmis = recorded(&format!("{case}.vmis.json"));
        assert_eq!(pods.len(), lesson.nodes.len(), "{case}");
        assert_eq!(vmis.len(), lesson.nodes.len(), "{case}");

        // What KubeVirt read: the rendered VMs' domain, unchanged but for its defaults.
        for (vm, vmi) in rendered_vms(&lesson).iter().zip(&vmis) {
            let ours = &vm["spec"]["template"]["spec"]["domain"];
            let theirs = &vmi["spec"]["domain"];
            assert_eq!(ours["cpu"]["cores"], theirs["cpu"]["cores"], "{case}");
            assert_eq!(ours["memory"]["guest"], theirs["memory"]["guest"], "{case}");
            assert_eq!(ours["resources"], theirs["resources"], "{case}");
            assert!(ours["devices"].get("autoattachGraphicsDevice").is_none());
            assert!(theirs["devices"].get("autoattachGraphicsDevice").is_none());
            assert_eq!(vmi["spec"]["architecture"], "amd64");
        }

        let cost = LauncherSpec::lab_vm(lesson.memory.bytes(), lesson.cores).resources();
        assert_eq!(cost.compute_memory_quantity(), memory, "{case}");
        for (pod, vmi) in pods.iter().zip(&vmis) {
            let compute = container(pod, "containers", "compute");
            let requests = &compute["resources"]["requests"];
            assert_eq!(requests["memory"], memory, "{case}");
            assert_eq!(
                requests["cpu"].as_str(),
                Some(cost.compute_cpu_quantity().as_str()),
                "{case}"
            );
            assert_eq!(requests["ephemeral-storage"], EPHEMERAL_STORAGE_REQUEST);
            for device in DEVICE_RESOURCES {
                assert_eq!(requests[device], "1", "{case} {device}");
                assert_eq!(
                    compute["resources"]["limits"][device], "1",
                    "{case} {device}"
                );
            }
            assert_eq!(
                pod["metadata"]["annotations"][MEMORY_OVERHEAD_ANNOTATION].as_str(),
                Some(cost.overhead.to_string().as_str()),
                "{case}"
            );
            assert_eq!(
                vmi["status"]["memory"]["memoryOverhead"].as_str(),
                Some(cost.overhead_quantity().as_str()),
                "{case}"
            );
            // The console log's sidecar, which the pod's requests (and so the quota) count.
            let log = container(pod, "initContainers", CONSOLE_LOG_CONTAINER.name);
            assert_eq!(log["restartPolicy"], "Always", "a sidecar");
            for (key, list) in [
                ("requests", CONSOLE_LOG_CONTAINER.requests),
                ("limits", CONSOLE_LOG_CONTAINER.limits),
            ] {
                for (resource, quantity) in list {
                    assert_eq!(log["resources"][key][resource], *quantity, "{case}");
                }
            }
        }
    }
}
