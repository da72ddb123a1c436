//! One simulated node: its kubelet and the scheduler that places pods on it.
//!
//! Every pod in the simulator's namespaces is bound to the node (through the `binding`
//! subresource, as kube-scheduler does). The kubelet then waits for the pod's Secrets,
//! ConfigMaps and claims, starts it after a short delay (Running, Ready, a loopback pod IP,
//! running containers), fails it at its `activeDeadlineSeconds`, ends a virt-launcher pod
//! when its guest stops, and confirms a graceful deletion once the containers stopped — for
//! a launcher pod, once its guest shut down — with a delete of grace period 0, as a real
//! kubelet does.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::{Value, json};

use crate::guests::{GuestEnd, GuestState, Shutdown};
use crate::object::{Cond, deleting, name, now, parse_time, set_condition, uid};
use crate::rest::{Kind, Part};
use crate::vmi::{APP_LABEL, CREATED_BY};
use crate::{Ctx, Error};

/// How often a pod waiting for a volume's source looks again.
const VOLUME_RETRY: Duration = Duration::from_secs(1);
/// The node's own address.
const HOST_IP: &str = "127.0.0.1";
/// Addresses per second octet: `127.<octet>.x.y`, `y` in 1..=254.
const IP_SPAN: u32 = 254 * 256;

/// The kubelet's memory of the pods it runs.
pub(crate) struct Kubelet {
    /// Pod uid → its address.
    pod_ips: Mutex<HashMap<String, Ipv4Addr>>,
    /// Pod uid → when the kubelet first saw it ready to start.
    starting: Mutex<HashMap<String, Instant>>,
    /// Pod uid → when the kubelet began stopping it.
    stopping: Mutex<HashMap<String, Instant>>,
    next_ip: AtomicU32,
    octet: u8,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Kubelet {
    pub(crate) fn new(octet: u8) -> Self {
        let b = uuid::Uuid::new_v4().into_bytes();
        Self {
            pod_ips: Mutex::new(HashMap::new()),
            starting: Mutex::new(HashMap::new()),
            stopping: Mutex::new(HashMap::new()),
            next_ip: AtomicU32::new(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % IP_SPAN),
            octet,
        }
    }

    /// The pod's address: the one it has, else the next one whose agent port is free
    /// (counted from a random start, so simulators side by side rarely meet).
    fn ip_for(&self, pod_uid: &str, port: u16) -> Ipv4Addr {
        let mut ips = lock(&self.pod_ips);
        if let Some(ip) = ips.get(pod_uid) {
            return *ip;
        }
        let mut ip = Ipv4Addr::LOCALHOST;
        for _ in 0..256 {
            let n = self.next_ip.fetch_add(1, Ordering::Relaxed) % IP_SPAN;
            let hi = u8::try_from(n / 254).unwrap_or(0);
            let lo = u8::try_from(n % 254).unwrap_or(0) + 1;
            ip = Ipv4Addr::new(127, self.octet, hi, lo);
            if std::net::TcpListener::bind((ip, port)).is_ok() {
                break;
            }
        }
        ips.insert(pod_uid.to_owned(), ip);
        ip
    }

    /// Where pod `pod_uid` really listens (its loopback address), once it has one.
    pub(crate) fn real_ip(&self, pod_uid: &str) -> Option<Ipv4Addr> {
        lock(&self.pod_ips).get(pod_uid).copied()
    }

    fn forget(&self, pod_uid: &str) {
        lock(&self.pod_ips).remove(pod_uid);
        lock(&self.starting).remove(pod_uid);
        lock(&self.stopping).remove(pod_uid);
    }
}

/// The address a pod that listens on `real` is published with: `real`, or with
/// [`crate::SimSettings::unroutable_pod_ips`] the same last two octets' place in
/// `192.0.2.0/24`, which nothing routes.
pub(crate) fn published_ip(settings: &crate::SimSettings, real: Ipv4Addr) -> Ipv4Addr {
    if settings.unroutable_pod_ips {
        let [_, _, _, lo] = real.octets();
        Ipv4Addr::new(192, 0, 2, lo.max(1))
    } else {
        real
    }
}

fn is_launcher(pod: &Value) -> bool {
    pod["metadata"]["labels"][APP_LABEL] == "virt-launcher"
}

fn launcher_vmi_uid(pod: &Value) -> Option<&str> {
    pod["metadata"]["labels"][CREATED_BY].as_str()
}

/// One pass over pod `obj`.
pub(crate) async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let pod_name = obj.metadata.name.clone().unwrap_or_default();
    let Some(pod) = ctx.rest.get(Kind::Pod, &ns, &pod_name).await? else {
        if let Some(u) = &obj.metadata.uid {
            ctx.kubelet.forget(u);
        }
        return Ok(Action::await_change());
    };
    let node = ctx.settings.node_name.as_str();
    let bound = pod["spec"]["nodeName"].as_str();
    if bound.is_some_and(|b| b != node) {
        return Ok(Action::await_change());
    }
    if deleting(&pod) {
        return stop(&ctx, &ns, &pod).await;
    }
    if bound.is_none() {
        return bind(&ctx, &ns, &pod).await;
    }
    match pod["status"]["phase"].as_str().unwrap_or("") {
        "" | "Pending" => start(&ctx, &ns, &pod).await,
        "Running" => running(&ctx, &ns, &pod).await,
        _ => Ok(Action::await_change()),
    }
}

/// The scheduler's part: the pod goes to this node.
async fn bind(ctx: &Ctx, ns: &str, pod: &Value) -> Result<Action, Error> {
    let binding = json!({
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name(pod), "namespace": ns},
        "target": {"apiVersion": "v1", "kind": "Node", "name": ctx.settings.node_name},
    });
    match ctx
        .rest
        .post_sub(Kind::Pod, ns, name(pod), "binding", &binding)
        .await
    {
        Ok(_) => {
            tracing::debug!(
                ns,
                pod = name(pod),
                node = ctx.settings.node_name,
                "pod bound"
            );
            Ok(Action::await_change())
        }
        // Bound meanwhile (or gone): the pod's next event brings it back.
        Err(e) if e.is_conflict() || e.is_not_found() => Ok(Action::await_change()),
        Err(e) => Err(e),
    }
}

/// What the pod's volumes need that does not exist yet.
async fn missing_volume(ctx: &Ctx, ns: &str, pod: &Value) -> Result<Option<String>, Error> {
    for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        let vol = v["name"].as_str().unwrap_or("");
        let need = if let Some(s) = v["secret"]["secretName"].as_str() {
            (v["secret"]["optional"] != true).then_some((Kind::Secret, s, "secret"))
        } else if let Some(c) = v["configMap"]["name"].as_str() {
            (v["configMap"]["optional"] != true).then_some((Kind::ConfigMap, c, "configmap"))
        } else {
            v["persistentVolumeClaim"]["claimName"]
                .as_str()
                .map(|c| (Kind::Pvc, c, "persistentvolumeclaim"))
        };
        let Some((kind, obj, what)) = need else {
            continue;
        };
        if ctx.rest.get(kind, ns, obj).await?.is_none() {
            return Ok(Some(format!(
                "MountVolume.SetUp failed for volume \"{vol}\" : {what} \"{obj}\" not found"
            )));
        }
    }
    Ok(None)
}

fn container_names(pod: &Value, key: &str) -> Vec<(String, String)> {
    pod["spec"][key]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["name"].as_str().unwrap_or("").to_owned(),
                c["image"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn container_id(pod_uid: &str, container: &str) -> String {
    format!("containerd://{}-{container}", pod_uid.replace('-', ""))
}

/// Waits for the pod's volumes, then (after the start delay) runs it.
async fn start(ctx: &Ctx, ns: &str, pod: &Value) -> Result<Action, Error> {
    let pod_uid = uid(pod).to_owned();
    let containers = container_names(pod, "containers");
    let inits = container_names(pod, "initContainers");
    if let Some(why) = missing_volume(ctx, ns, pod).await? {
        tracing::debug!(ns, pod = name(pod), why, "pod waits for a volume");
        let unready = format!(
            "containers with unready status: [{}]",
            containers
                .iter()
                .map(|c| c.0.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        );
        ctx.rest
            .update(Kind::Pod, ns, name(pod), Part::Status, |cur| {
                if uid(cur) != pod_uid {
                    return None;
                }
                let mut new = cur.clone();
                let s = &mut new["status"];
                s["phase"] = Value::from("Pending");
                s["hostIP"] = Value::from(HOST_IP);
                s["hostIPs"] = json!([{"ip": HOST_IP}]);
                if !s["startTime"].is_string() {
                    s["startTime"] = Value::from(now());
                }
                set_condition(s, "conditions", Cond::new("PodReadyToStartContainers", false), false);
                set_condition(s, "conditions", Cond::new("Initialized", inits.is_empty()), false);
                let c = Cond::new("Ready", false).because("ContainersNotReady", &unready);
                set_condition(s, "conditions", c, false);
                let c = Cond::new("ContainersReady", false).because("ContainersNotReady", &unready);
                set_condition(s, "conditions", c, false);
                s["containerStatuses"] = Value::Array(
                    containers
                        .iter()
                        .map(|(n, image)| {
                            json!({"name": n, "image": image, "imageID": "", "ready": false, "started": false,
                                   "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}})
                        })
                        .collect(),
                );
                Some(new)
            })
            .await?;
        return Ok(Action::requeue(VOLUME_RETRY));
    }
    let since = *lock(&ctx.kubelet.starting)
        .entry(pod_uid.clone())
        .or_insert_with(Instant::now);
    let elapsed = since.elapsed();
    if elapsed < ctx.settings.pod_start {
        return Ok(Action::requeue(ctx.settings.pod_start - elapsed));
    }
    let ip = published_ip(
        &ctx.settings,
        ctx.kubelet.ip_for(&pod_uid, ctx.settings.agent_port),
    );
    let written = ctx
        .rest
        .update(Kind::Pod, ns, name(pod), Part::Status, |cur| {
            if uid(cur) != pod_uid {
                return None;
            }
            let t = now();
            let mut new = cur.clone();
            let s = &mut new["status"];
            s["phase"] = Value::from("Running");
            s["hostIP"] = Value::from(HOST_IP);
            s["hostIPs"] = json!([{"ip": HOST_IP}]);
            s["podIP"] = Value::from(ip.to_string());
            s["podIPs"] = json!([{"ip": ip.to_string()}]);
            if !s["startTime"].is_string() {
                s["startTime"] = Value::from(t.clone());
            }
            for c in ["PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady"] {
                set_condition(s, "conditions", Cond::new(c, true), false);
            }
            if !inits.is_empty() {
                s["initContainerStatuses"] = Value::Array(
                    inits
                        .iter()
                        .map(|(n, image)| {
                            json!({"name": n, "image": image, "imageID": format!("{image}@sim"),
                                   "containerID": container_id(&pod_uid, n), "ready": true, "started": false,
                                   "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                                   "startedAt": t, "finishedAt": t, "containerID": container_id(&pod_uid, n)}}})
                        })
                        .collect(),
                );
            }
            s["containerStatuses"] = Value::Array(
                containers
                    .iter()
                    .map(|(n, image)| {
                        json!({"name": n, "image": image, "imageID": format!("{image}@sim"),
                               "containerID": container_id(&pod_uid, n), "ready": true, "started": true,
                               "restartCount": 0, "state": {"running": {"startedAt": t}}})
                    })
                    .collect(),
            );
            Some(new)
        })
        .await?;
    lock(&ctx.kubelet.starting).remove(&pod_uid);
    if written.is_some() {
        tracing::info!(ns, pod = name(pod), %ip, "pod running");
    }
    Ok(Action::await_change())
}

/// A running pod: ends when its guest stops (launcher pods) or at its deadline.
async fn running(ctx: &Ctx, ns: &str, pod: &Value) -> Result<Action, Error> {
    if is_launcher(pod)
        && let Some(vmi_uid) = launcher_vmi_uid(pod)
        && let Some(GuestState::Off(Some(end))) = ctx.guests.state(vmi_uid)
    {
        let (phase, code, reason) = match end {
            GuestEnd::PowerOff => ("Succeeded", 0, "Completed"),
            GuestEnd::Crash => ("Failed", 1, "Error"),
        };
        terminate(ctx, ns, pod, phase, code, reason, None).await?;
        return Ok(Action::await_change());
    }
    let Some(deadline) = pod["spec"]["activeDeadlineSeconds"].as_i64() else {
        return Ok(Action::await_change());
    };
    let Some(started) = pod["status"]["startTime"].as_str().and_then(parse_time) else {
        return Ok(Action::await_change());
    };
    let Some(end) =
        chrono::TimeDelta::try_seconds(deadline).and_then(|d| started.checked_add_signed(d))
    else {
        // A deadline beyond what time can hold never comes.
        return Ok(Action::await_change());
    };
    let left = end - chrono::Utc::now();
    if left > chrono::TimeDelta::zero() {
        // Looked at again by then (at least hourly, in case of a very far deadline).
        let left = left.to_std().unwrap_or(Duration::from_secs(1));
        return Ok(Action::requeue(left.min(Duration::from_secs(3600))));
    }
    tracing::info!(
        ns,
        pod = name(pod),
        deadline,
        "pod past its activeDeadlineSeconds"
    );
    terminate(
        ctx,
        ns,
        pod,
        "Failed",
        137,
        "Error",
        Some((
            "DeadlineExceeded",
            "Pod was active on the node longer than the specified deadline",
        )),
    )
    .await?;
    Ok(Action::await_change())
}

/// The pod's containers ended: phase, terminated container states, not ready.
async fn terminate(
    ctx: &Ctx,
    ns: &str,
    pod: &Value,
    phase: &str,
    exit_code: i64,
    container_reason: &str,
    pod_reason: Option<(&str, &str)>,
) -> Result<(), Error> {
    let pod_uid = uid(pod).to_owned();
    ctx.rest
        .update(Kind::Pod, ns, name(pod), Part::Status, |cur| {
            if uid(cur) != pod_uid || cur["status"]["phase"] == phase {
                return None;
            }
            let t = now();
            let mut new = cur.clone();
            let s = &mut new["status"];
            s["phase"] = Value::from(phase);
            if let Some((reason, message)) = pod_reason {
                s["reason"] = Value::from(reason);
                s["message"] = Value::from(message);
            }
            for c in ["Ready", "ContainersReady"] {
                set_condition(
                    s,
                    "conditions",
                    Cond::new(c, false).because("PodCompleted", ""),
                    false,
                );
            }
            set_condition(
                s,
                "conditions",
                Cond::new("PodReadyToStartContainers", false),
                false,
            );
            if let Some(list) = s["containerStatuses"].as_array_mut() {
                for c in list {
                    let started = c["state"]["running"]["startedAt"].clone();
                    let mut term =
                        json!({"exitCode": exit_code, "reason": container_reason, "finishedAt": t});
                    if started.is_string() {
                        term["startedAt"] = started;
                    }
                    if let Some(id) = c["containerID"].as_str() {
                        term["containerID"] = Value::from(id);
                    }
                    c["state"] = json!({"terminated": term});
                    c["ready"] = Value::from(false);
                    c["started"] = Value::from(false);
                }
            }
            Some(new)
        })
        .await?;
    tracing::info!(ns, pod = name(pod), phase, "pod ended");
    Ok(())
}

/// A deleted pod: its containers stop (a launcher's guest shuts down) within the grace,
/// then the deletion is confirmed.
async fn stop(ctx: &Ctx, ns: &str, pod: &Value) -> Result<Action, Error> {
    let pod_uid = uid(pod).to_owned();
    let pod_grace = pod["metadata"]["deletionGracePeriodSeconds"]
        .as_i64()
        .or_else(|| pod["spec"]["terminationGracePeriodSeconds"].as_i64())
        .unwrap_or(30)
        .max(0);
    let grace = ctx
        .settings
        .shutdown_grace
        .min(Duration::from_secs(pod_grace.unsigned_abs()));
    let ended = matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    );
    if !ended {
        let left = match (is_launcher(pod), launcher_vmi_uid(pod)) {
            (true, Some(vmi_uid)) => match ctx.guests.shutdown(vmi_uid, grace) {
                Shutdown::Pending(d) => Some(d),
                Shutdown::Done => None,
            },
            _ => {
                let since = *lock(&ctx.kubelet.stopping)
                    .entry(pod_uid.clone())
                    .or_insert_with(Instant::now);
                grace.checked_sub(since.elapsed()).filter(|d| !d.is_zero())
            }
        };
        if let Some(d) = left {
            return Ok(Action::requeue(d));
        }
    }
    ctx.rest
        .delete(Kind::Pod, ns, name(pod), Some(0), Some(&pod_uid))
        .await?;
    ctx.kubelet.forget(&pod_uid);
    tracing::info!(ns, pod = name(pod), "pod deletion confirmed");
    Ok(Action::await_change())
}

/// Registers the node (and reports it Ready), as a kubelet does at start.
pub(crate) async fn register_node(ctx: &Ctx) -> Result<(), Error> {
    let node = ctx.settings.node_name.as_str();
    let body = json!({
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": node, "labels": {
            "kubernetes.io/hostname": node,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "kubevirt.io/schedulable": "true",
            "machine-type.node.kubevirt.io/q35": "true",
        }},
    });
    match ctx.rest.create(Kind::Node, "", &body).await {
        Ok(_) => {}
        Err(e) if e.is_already_exists() => {}
        Err(e) => return Err(e),
    }
    let t = now();
    let mut status = json!({
        "addresses": [{"type": "InternalIP", "address": HOST_IP}, {"type": "Hostname", "address": node}],
        "capacity": {"cpu": "16", "memory": "64Gi", "pods": "250", "ephemeral-storage": "100Gi", "devices.kubevirt.io/kvm": "1k", "devices.kubevirt.io/tun": "1k", "devices.kubevirt.io/vhost-net": "1k"},
        "allocatable": {"cpu": "16", "memory": "64Gi", "pods": "250", "ephemeral-storage": "100Gi", "devices.kubevirt.io/kvm": "1k", "devices.kubevirt.io/tun": "1k", "devices.kubevirt.io/vhost-net": "1k"},
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": "", "systemUUID": "", "bootID": uuid::Uuid::new_v4().to_string(),
            "kernelVersion": "6.1.0-sim", "osImage": "kubevirt-sim", "containerRuntimeVersion": "containerd://sim",
            "kubeletVersion": "v1.36.0-sim", "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
        },
    });
    for (type_, ok, reason, message) in [
        (
            "MemoryPressure",
            false,
            "KubeletHasSufficientMemory",
            "kubelet has sufficient memory available",
        ),
        (
            "DiskPressure",
            false,
            "KubeletHasNoDiskPressure",
            "kubelet has no disk pressure",
        ),
        (
            "PIDPressure",
            false,
            "KubeletHasSufficientPID",
            "kubelet has sufficient PID available",
        ),
        (
            "Ready",
            true,
            "KubeletReady",
            "kubelet is posting ready status",
        ),
    ] {
        set_condition(
            &mut status,
            "conditions",
            Cond::new(type_, ok).because(reason, message),
            false,
        );
    }
    if let Some(list) = status["conditions"].as_array_mut() {
        for c in list {
            c["lastHeartbeatTime"] = Value::from(t.clone());
        }
    }
    ctx.rest
        .update(Kind::Node, "", node, Part::Status, |cur| {
            let mut new = cur.clone();
            new["status"] = status.clone();
            Some(new)
        })
        .await?;
    tracing::info!(node, "node registered");
    Ok(())
}
