//! The VirtualMachineInstance controller: what KubeVirt's virt-controller does for a VMI
//! (`pkg/virt-controller/watch/vmi/lifecycle.go`: the launcher pod, Pending → Scheduling →
//! Scheduled, failure when the pod goes, the finalizer once the pod is gone) and what
//! virt-handler does on the node (the guest boots, Scheduled → Running with the pod's address,
//! Succeeded when the guest stops).
//!
//! On a real cluster the VMI turns Running when the domain runs, before anything inside the
//! guest answers: here too the status is written first and the agent started afterwards.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use kube::api::DynamicObject;
use kube::runtime::controller::Action;
use serde_json::{Value, json};
use ttlab_vm_manifest::launcher;

use crate::guests::{GuestEnd, GuestState, Shutdown};
use crate::object::{
    Cond, condition_true, controlled_by, controller_ref, deleting, has_finalizer, meta, name,
    remove_condition, set_condition, uid, with_finalizer,
};
use crate::rest::{Kind, Part};
use crate::vm::VMI_FINALIZER;
use crate::{Ctx, Error};

/// Label of a launcher pod naming its VMI's uid.
pub(crate) const CREATED_BY: &str = "kubevirt.io/created-by";
/// The app label of launcher pods.
pub(crate) const APP_LABEL: &str = "kubevirt.io";
/// The VMI's node, as a label.
const NODE_LABEL: &str = "kubevirt.io/nodeName";
/// KubeVirt's default `terminationGracePeriodSeconds`.
const DEFAULT_GRACE_SECONDS: i64 = 30;
/// How often a VMI waiting for a PVC looks again.
const PVC_RETRY: Duration = Duration::from_secs(1);

/// One pass over VMI `obj`.
pub(crate) async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let ns = obj.metadata.namespace.clone().unwrap_or_default();
    let vmi_name = obj.metadata.name.clone().unwrap_or_default();
    let Some(vmi) = ctx.rest.get(Kind::Vmi, &ns, &vmi_name).await? else {
        return Ok(Action::await_change());
    };
    let pods = launcher_pods(&ctx, &ns, &vmi).await?;
    let live_pod = pods.iter().find(|p| !deleting(p)).cloned();
    let pod = live_pod.clone().or_else(|| pods.first().cloned());
    let r = Vmi {
        ctx: &ctx,
        ns: &ns,
        name: &vmi_name,
        uid: uid(&vmi).to_owned(),
    };
    if deleting(&vmi) {
        return r.deleting(&vmi, &pods).await;
    }
    let phase = vmi["status"]["phase"].as_str().unwrap_or("");
    if ctx.holds(phase) {
        return Ok(Action::requeue(crate::PAUSED_RECHECK));
    }
    match phase {
        "" | "Pending" => r.pending(pod.as_ref()).await,
        "Scheduling" => r.scheduling(pod.as_ref()).await,
        "Scheduled" => r.scheduled(&vmi, pod.as_ref()).await,
        "Running" => r.running(pod.as_ref()).await,
        "Succeeded" | "Failed" => {
            ctx.guests.power_down(&r.uid, None);
            r.write_status(|s| sync_ready_condition(s, pod.as_ref()))
                .await?;
            Ok(Action::await_change())
        }
        _ => Ok(Action::await_change()),
    }
}

/// The launcher pods of `vmi` (label `kubevirt.io/created-by`, controlled by it).
async fn launcher_pods(ctx: &Ctx, ns: &str, vmi: &Value) -> Result<Vec<Value>, Error> {
    let vmi_uid = uid(vmi);
    let pods = ctx
        .rest
        .list(Kind::Pod, ns, &format!("{CREATED_BY}={vmi_uid}"))
        .await?;
    Ok(pods
        .into_iter()
        .filter(|p| controlled_by(p, vmi_uid))
        .collect())
}

fn pod_phase(pod: &Value) -> &str {
    pod["status"]["phase"].as_str().unwrap_or("")
}

fn pod_ready(pod: &Value) -> bool {
    pod_phase(pod) == "Running" && condition_true(&pod["status"]["conditions"], "Ready")
}

fn pod_down(pod: &Value) -> bool {
    deleting(pod) || matches!(pod_phase(pod), "Succeeded" | "Failed")
}

/// The VMI's Ready condition from its pod, as `syncReadyConditionFromPod` does.
fn sync_ready_condition(status: &mut Value, pod: Option<&Value>) {
    let running = status["phase"] == "Running";
    let c = match pod {
        None => Cond::new("Ready", false).because(
            "PodNotExists",
            "virt-launcher pod has not yet been scheduled",
        ),
        Some(p) if pod_down(p) => {
            Cond::new("Ready", false).because("PodTerminating", "virt-launcher pod is terminating")
        }
        Some(_) if !running => Cond::new("Ready", false)
            .because("GuestNotRunning", "Guest VM is not reported as running"),
        Some(p) => match crate::object::condition(&p["status"]["conditions"], "Ready") {
            Some(c) => Cond::new("Ready", c["status"] == "True").because(
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or(""),
            ),
            None => Cond::new("Ready", false).because(
                "PodConditionMissing",
                "virt-launcher pod is missing the Ready condition",
            ),
        },
    };
    set_condition(status, "conditions", c, true);
}

/// Sets the phase, recording the transition.
fn set_phase(status: &mut Value, phase: &str) {
    if status["phase"] == phase {
        return;
    }
    status["phase"] = Value::from(phase);
    let mut ts = status["phaseTransitionTimestamps"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ts.push(json!({"phase": phase, "phaseTransitionTimestamp": crate::object::now()}));
    status["phaseTransitionTimestamps"] = Value::Array(ts);
}

/// The VMI being reconciled.
struct Vmi<'a> {
    ctx: &'a Ctx,
    ns: &'a str,
    name: &'a str,
    uid: String,
}

impl Vmi<'_> {
    /// Rewrites the status of this VMI (this incarnation only) with `f`.
    async fn write_status(&self, f: impl Fn(&mut Value)) -> Result<Option<Value>, Error> {
        let vmi_uid = self.uid.clone();
        self.ctx
            .rest
            .update(Kind::Vmi, self.ns, self.name, Part::Status, |cur| {
                if uid(cur) != vmi_uid {
                    return None;
                }
                let mut new = cur.clone();
                if !new["status"].is_object() {
                    new["status"] = json!({});
                }
                f(&mut new["status"]);
                Some(new)
            })
            .await
    }

    async fn fail(&self, pod: Option<&Value>, why: &str) -> Result<Action, Error> {
        tracing::info!(ns = self.ns, vmi = self.name, why, "VMI failed");
        self.ctx.guests.power_down(&self.uid, Some(GuestEnd::Crash));
        self.write_status(|s| {
            set_phase(s, "Failed");
            sync_ready_condition(s, pod);
        })
        .await?;
        Ok(Action::await_change())
    }

    /// Pending: wait for the volumes, then create the launcher pod (→ Scheduling).
    async fn pending(&self, pod: Option<&Value>) -> Result<Action, Error> {
        if let Some(p) = pod {
            self.write_status(|s| {
                set_phase(s, "Scheduling");
                remove_condition(s, "conditions", "Synchronized");
                remove_condition(s, "conditions", "PodScheduled");
                sync_ready_condition(s, Some(p));
            })
            .await?;
            return Ok(Action::await_change());
        }
        // KubeVirt's admission adds this finalizer to every VMI it admits.
        let vmi_uid = self.uid.clone();
        self.ctx
            .rest
            .update(Kind::Vmi, self.ns, self.name, Part::Main, |cur| {
                (uid(cur) == vmi_uid && !deleting(cur) && !has_finalizer(cur, VMI_FINALIZER))
                    .then(|| with_finalizer(cur, VMI_FINALIZER, true))
            })
            .await?;
        // A new VMI is first seen without its pod: Pending.
        let Some(vmi) = self
            .write_status(|s| {
                set_phase(s, "Pending");
                sync_ready_condition(s, None);
            })
            .await?
        else {
            return Ok(Action::await_change());
        };
        if self.ctx.holds("Pending") {
            return Ok(Action::requeue(crate::PAUSED_RECHECK));
        }
        if let Some(message) = self.missing_claim(&vmi).await? {
            let message = format!("failed to render launch manifest: {message}");
            self.write_status(|s| {
                set_phase(s, "Pending");
                set_condition(
                    s,
                    "conditions",
                    Cond::new("Synchronized", false).because("FailedPvcNotFound", &message),
                    true,
                );
                set_condition(
                    s,
                    "conditions",
                    Cond::new("PodScheduled", false).because("Unschedulable", &message),
                    true,
                );
                sync_ready_condition(s, None);
            })
            .await?;
            return Ok(Action::requeue(PVC_RETRY));
        }
        let pod = launcher_pod(&vmi, &self.ctx.settings.launcher_image);
        match self.ctx.rest.create(Kind::Pod, self.ns, &pod).await {
            Ok(created) => {
                tracing::info!(
                    ns = self.ns,
                    vmi = self.name,
                    pod = name(&created),
                    "launcher pod created"
                );
                self.write_status(|s| {
                    set_phase(s, "Scheduling");
                    remove_condition(s, "conditions", "Synchronized");
                    remove_condition(s, "conditions", "PodScheduled");
                    sync_ready_condition(s, Some(&created));
                })
                .await?;
                Ok(Action::await_change())
            }
            Err(e) => {
                let message = format!("failed to create virtual machine pod: {e}");
                tracing::warn!(ns = self.ns, vmi = self.name, error = %message, "launcher pod not created");
                self.write_status(|s| {
                    set_phase(s, "Pending");
                    set_condition(
                        s,
                        "conditions",
                        Cond::new("Synchronized", false).because("FailedCreate", &message),
                        true,
                    );
                    sync_ready_condition(s, None);
                })
                .await?;
                Err(e)
            }
        }
    }

    /// The first claim a volume of the VMI needs that is missing or being deleted.
    async fn missing_claim(&self, vmi: &Value) -> Result<Option<String>, Error> {
        for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
            let claim = v["ephemeral"]["persistentVolumeClaim"]["claimName"]
                .as_str()
                .or_else(|| v["persistentVolumeClaim"]["claimName"].as_str())
                .or_else(|| v["dataVolume"]["name"].as_str());
            let Some(c) = claim else { continue };
            match self.ctx.rest.get(Kind::Pvc, self.ns, c).await? {
                None => {
                    return Ok(Some(format!(
                        "PVC {}/{c} does not exist, waiting for it to appear",
                        self.ns
                    )));
                }
                Some(p) if deleting(&p) => {
                    return Ok(Some(format!("PVC {}/{c} is being deleted", self.ns)));
                }
                Some(_) => {}
            }
        }
        Ok(None)
    }

    /// Scheduling: the pod runs and is ready → Scheduled on its node.
    async fn scheduling(&self, pod: Option<&Value>) -> Result<Action, Error> {
        let Some(p) = pod else {
            return self.fail(None, "launcher pod does not exist").await;
        };
        if pod_down(p) {
            return self
                .fail(Some(p), "launcher pod went down while scheduling")
                .await;
        }
        if !pod_ready(p) {
            // Mirror the pod's scheduling state until it runs.
            self.write_status(|s| {
                sync_ready_condition(s, Some(p));
            })
            .await?;
            return Ok(Action::await_change());
        }
        let node = p["spec"]["nodeName"].as_str().unwrap_or("").to_owned();
        let vmi_uid = self.uid.clone();
        self.ctx
            .rest
            .update(Kind::Vmi, self.ns, self.name, Part::Main, |cur| {
                if uid(cur) != vmi_uid || cur["metadata"]["labels"][NODE_LABEL] == node.as_str() {
                    return None;
                }
                let mut new = cur.clone();
                if !new["metadata"]["labels"].is_object() {
                    new["metadata"]["labels"] = json!({});
                }
                new["metadata"]["labels"][NODE_LABEL] = Value::from(node.as_str());
                Some(new)
            })
            .await?;
        let qos = p["status"]["qosClass"].clone();
        let image = p["spec"]["containers"][0]["image"].clone();
        self.write_status(|s| {
            set_phase(s, "Scheduled");
            s["nodeName"] = Value::from(node.as_str());
            if qos.is_string() {
                s["qosClass"] = qos.clone();
            }
            if image.is_string() {
                s["launcherContainerImageVersion"] = image.clone();
            }
            s["activePods"] = json!({ uid(p): node.as_str() });
            sync_ready_condition(s, Some(p));
        })
        .await?;
        tracing::info!(ns = self.ns, vmi = self.name, node, "VMI scheduled");
        Ok(Action::await_change())
    }

    /// Scheduled: the guest boots on the node; after the boot delay its cloud-init is applied
    /// and the VMI turns Running, then the agent starts.
    async fn scheduled(&self, vmi: &Value, pod: Option<&Value>) -> Result<Action, Error> {
        let Some(p) = pod.filter(|p| !pod_down(p)) else {
            return self
                .fail(pod, "launcher pod went down before the guest ran")
                .await;
        };
        let Some(published) = p["status"]["podIP"]
            .as_str()
            .and_then(|s| s.parse::<Ipv4Addr>().ok())
        else {
            return self.fail(Some(p), "launcher pod has no IPv4 address").await;
        };
        // The guest listens where the pod really is (its published address may be one
        // nothing routes: `SimSettings::unroutable_pod_ips`).
        let ip = self.ctx.kubelet.real_ip(uid(p)).unwrap_or(published);
        let settings = &self.ctx.settings;
        let dir = settings.guest_root.join(self.ns).join(format!(
            "{}-{}",
            self.name,
            &self.uid[..self.uid.len().min(8)]
        ));
        let Some(since) =
            self.ctx
                .guests
                .begin_boot(&self.uid, self.ns, self.name, ip, dir.clone())
        else {
            // Booted already (the Running write is being retried) or shut down meanwhile.
            return match self.ctx.guests.state(&self.uid) {
                Some(GuestState::Running) => self.set_running(vmi, p, ip).await,
                _ => Ok(Action::await_change()),
            };
        };
        if settings.qemu.is_some() {
            return self.boot_qemu(vmi, p, ip, dir).await;
        }
        let elapsed = since.elapsed();
        if elapsed < settings.boot {
            return Ok(Action::requeue(settings.boot - elapsed));
        }
        if !self.ctx.guests.cloud_init_done(&self.uid) {
            let hostname = self.cloud_init(vmi, &dir).await?;
            let hostname = hostname.or_else(|| vmi["spec"]["hostname"].as_str().map(str::to_owned));
            self.ctx.guests.set_cloud_init_done(&self.uid, hostname);
        }
        self.set_running(vmi, p, ip).await
    }

    /// A qemu guest: started once (in a task of its own, which wakes the controllers when
    /// qemu runs), and the VMI turns Running once it does.
    async fn boot_qemu(
        &self,
        vmi: &Value,
        pod: &Value,
        ip: Ipv4Addr,
        dir: std::path::PathBuf,
    ) -> Result<Action, Error> {
        let Some(settings) = self.ctx.settings.qemu.clone() else {
            return Ok(Action::await_change());
        };
        if self.ctx.guests.qemu_up(&self.uid) {
            return self.set_running(vmi, pod, ip).await;
        }
        if self.ctx.guests.qemu_claimed(&self.uid) {
            // Starting: its task wakes the controllers when qemu runs.
            return Ok(Action::await_change());
        }
        // Read before the start is claimed: a failed read is retried by the next pass.
        let config_disks = self.qemu_config_disks(vmi).await?;
        let user_data = self.user_data(vmi).await?.unwrap_or_default();
        if !self.ctx.guests.claim_qemu(&self.uid) {
            return Ok(Action::await_change());
        }
        let (memory_mib, cpus, golden) = crate::qemu::Boot::resources(vmi);
        crate::qemu::spawn(
            settings,
            self.ctx.accel.clone(),
            self.ctx.guests.clone(),
            self.ctx.triggers.clone(),
            crate::qemu::Boot {
                uid: self.uid.clone(),
                ns: self.ns.to_owned(),
                name: self.name.to_owned(),
                dir,
                ip,
                agent_port: self.ctx.settings.agent_port,
                config_disks,
                user_data,
                grace: vmi_grace(vmi),
                memory_mib,
                cpus,
                golden,
            },
        );
        tracing::info!(ns = self.ns, vmi = self.name, "starting the qemu guest");
        Ok(Action::await_change())
    }

    /// The VMI's `configMap` volumes as the disks qemu attaches, as KubeVirt presents them
    /// (absent ConfigMaps are skipped: the launcher pod would not have started).
    async fn qemu_config_disks(
        &self,
        vmi: &Value,
    ) -> Result<Vec<ttlab_qemu_guest::ConfigDisk>, Error> {
        let mut disks = Vec::new();
        for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
            let Some(cm_name) = v["configMap"]["name"].as_str() else {
                continue;
            };
            if let Some(cm) = self.ctx.rest.get(Kind::ConfigMap, self.ns, cm_name).await? {
                let disk = ttlab_sim_guest::ConfigDisk::from_config_map(
                    v["configMap"]["volumeLabel"].as_str().unwrap_or(""),
                    &cm,
                );
                disks.push(ttlab_qemu_guest::ConfigDisk {
                    name: v["name"].as_str().unwrap_or(cm_name).to_owned(),
                    label: disk.label,
                    files: disk.files.into_iter().collect(),
                });
            }
        }
        Ok(disks)
    }

    /// Reads the VMI's cloud-init user-data and applies it in the guest directory; installs
    /// the configured agent when the payload carries none. Returns the hostname it set.
    async fn cloud_init(
        &self,
        vmi: &Value,
        dir: &std::path::Path,
    ) -> Result<Option<String>, Error> {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut hostname = None;
        match self.user_data(vmi).await? {
            Some(ud) => match ttlab_sim_guest::apply_cloud_config(dir, &ud) {
                Ok(applied) => {
                    tracing::info!(
                        ns = self.ns,
                        vmi = self.name,
                        files = applied.files,
                        dir = %dir.display(),
                        "cloud-init applied in the guest"
                    );
                    hostname = applied.hostname;
                }
                Err(e) => {
                    tracing::warn!(ns = self.ns, vmi = self.name, error = %e, "cloud-init failed in the guest")
                }
            },
            None => tracing::info!(
                ns = self.ns,
                vmi = self.name,
                "guest without cloud-init user-data"
            ),
        }
        // ttlab's first boot installs its agent from the agent disk (a `configMap` volume)
        // when the user-data pins one; another guest gets the configured binary, if any.
        let pinned = ttlab_sim_guest::guest_path(dir, ttlab_sim_guest::AGENT_DIGEST_PATH)
            .is_ok_and(|p| p.exists());
        if pinned {
            let disks = self.config_disks(vmi).await?;
            if let Err(reason) = ttlab_sim_guest::install_agent(dir, &disks) {
                tracing::warn!(ns = self.ns, vmi = self.name, %reason, "the guest's first boot failed");
                ttlab_sim_guest::write_marker(dir, Some(&reason)).map_err(Error::Guest)?;
            }
        } else if let Some(bin) = &self.ctx.settings.agent_binary {
            install_agent(dir, bin)?;
        }
        Ok(hostname)
    }

    /// The disks KubeVirt builds from the VMI's `configMap` volumes: the ConfigMap's keys as
    /// files, its `volumeLabel` as the label (absent ConfigMaps are skipped: the launcher pod
    /// would not have started).
    async fn config_disks(&self, vmi: &Value) -> Result<Vec<ttlab_sim_guest::ConfigDisk>, Error> {
        let mut disks = Vec::new();
        for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
            let Some(name) = v["configMap"]["name"].as_str() else {
                continue;
            };
            if let Some(cm) = self.ctx.rest.get(Kind::ConfigMap, self.ns, name).await? {
                disks.push(ttlab_sim_guest::ConfigDisk::from_config_map(
                    v["configMap"]["volumeLabel"].as_str().unwrap_or(""),
                    &cm,
                ));
            }
        }
        Ok(disks)
    }

    /// The user-data of the VMI's cloud-init volume (NoCloud or ConfigDrive): from the Secret
    /// it names (key `userdata`, then `userData`) or given inline.
    async fn user_data(&self, vmi: &Value) -> Result<Option<Vec<u8>>, Error> {
        for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
            let src = if v["cloudInitNoCloud"].is_object() {
                &v["cloudInitNoCloud"]
            } else if v["cloudInitConfigDrive"].is_object() {
                &v["cloudInitConfigDrive"]
            } else {
                continue;
            };
            if let Some(secret) = src["secretRef"]["name"].as_str() {
                let Some(s) = self.ctx.rest.get(Kind::Secret, self.ns, secret).await? else {
                    tracing::warn!(
                        ns = self.ns,
                        vmi = self.name,
                        secret,
                        "cloud-init Secret is gone"
                    );
                    return Ok(None);
                };
                let data = s["data"]["userdata"]
                    .as_str()
                    .or_else(|| s["data"]["userData"].as_str());
                return Ok(
                    data.and_then(|d| base64::engine::general_purpose::STANDARD.decode(d).ok())
                );
            }
            if let Some(ud) = src["userData"].as_str() {
                return Ok(Some(ud.as_bytes().to_vec()));
            }
            if let Some(b) = src["userDataBase64"].as_str() {
                return Ok(base64::engine::general_purpose::STANDARD.decode(b).ok());
            }
        }
        Ok(None)
    }

    /// Writes Running (the guest's address in `interfaces`), then starts the guest's agent
    /// and setup.
    async fn set_running(&self, vmi: &Value, pod: &Value, ip: Ipv4Addr) -> Result<Action, Error> {
        let published = crate::kubelet::published_ip(&self.ctx.settings, ip);
        let iface = vmi["spec"]["networks"][0]["name"]
            .as_str()
            .unwrap_or("default")
            .to_owned();
        let spec = vmi["spec"].clone();
        let overhead = launcher_spec(vmi).resources().overhead_quantity();
        if !self.ctx.guests.mark_running(&self.uid) {
            // Stopped meanwhile; the next pass reports it.
            return Ok(Action::await_change());
        }
        let written = self
            .write_status(|s| {
                set_phase(s, "Running");
                s["interfaces"] = json!([{
                    "name": iface,
                    "ipAddress": published.to_string(),
                    "ipAddresses": [published.to_string()],
                    "mac": mac_for(ip),
                    "interfaceName": "eth0",
                    "infoSource": "domain, guest-agent",
                    "linkState": "up",
                    "queueCount": 1,
                    "podInterfaceName": "eth0",
                }]);
                s["guestOSInfo"] = json!({
                    "id": "ubuntu", "name": "Ubuntu", "prettyName": "Ubuntu 22.04 LTS (simulated)",
                    "version": "22.04", "versionId": "22.04", "kernelRelease": "5.15.0-sim",
                    "machine": "x86_64",
                });
                s["machine"] = json!({"type": "q35"});
                let cores = spec["domain"]["cpu"]["cores"].as_i64().unwrap_or(1);
                s["currentCPUTopology"] = json!({"cores": cores, "sockets": 1, "threads": 1});
                if let Some(mem) = spec["domain"]["memory"]["guest"]
                    .as_str()
                    .or_else(|| spec["domain"]["resources"]["requests"]["memory"].as_str())
                {
                    s["memory"] = json!({
                        "guestAtBoot": mem, "guestCurrent": mem, "guestRequested": mem,
                        "memoryOverhead": overhead,
                    });
                }
                s["volumeStatus"] = volume_status(&spec);
                sync_ready_condition(s, Some(pod));
            })
            .await?;
        if written.is_none() {
            return Ok(Action::await_change());
        }
        tracing::info!(ns = self.ns, vmi = self.name, %ip, "VMI running");
        if let Some(tasks) = self.ctx.guests.take_tasks(&self.uid) {
            self.start_guest_tasks(vmi, tasks);
        }
        Ok(Action::await_change())
    }

    /// After Running: the agent starts (after `agent_start`), and the setup writes its marker
    /// (after `setup`), unless the guest stops first.
    fn start_guest_tasks(&self, vmi: &Value, tasks: tokio_util::sync::CancellationToken) {
        let settings = &self.ctx.settings;
        let Some(info) = self.ctx.guests.info(self.ns, self.name) else {
            return;
        };
        if settings.qemu.is_some() {
            // The agent and the setup run inside the guest.
            crate::qemu::probe_agent(
                self.ctx.guests.clone(),
                self.ctx.triggers.clone(),
                self.uid.clone(),
                std::net::SocketAddr::from((info.ip, settings.agent_port)),
                tasks,
            );
            return;
        }
        let dir = info.dir.clone();
        let ip = info.ip;
        let port = settings.agent_port;
        let agent_delay = settings.agent_start;
        let setup = settings.setup;
        let lesson = vmi["metadata"]["labels"][ttlab_model::labels::LESSON]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let outcome = self.ctx.setup_outcome(&lesson);
        let guests = self.ctx.guests.clone();
        let triggers = self.ctx.triggers.clone();
        let vmi_uid = self.uid.clone();
        let (ns, name) = (self.ns.to_owned(), self.name.to_owned());
        let t = tasks.clone();
        let d = dir.clone();
        // A first boot that failed (its failure marker written) starts no agent and no setup.
        if ttlab_sim_guest::guest_path(&dir, ttlab_agent::protocol::FAILED_MARKER_PATH)
            .is_ok_and(|p| p.exists())
        {
            tracing::info!(ns, vmi = name, "first boot failed: no agent, no setup");
            return;
        }
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(agent_delay) => {}
                () = t.cancelled() => return,
            }
            let Some(started) = ttlab_sim_guest::start_agent(&d, ip, port) else {
                tracing::info!(ns, vmi = name, "no agent in this guest");
                return;
            };
            let log = ttlab_sim_guest::agent_log(&d);
            guests.set_agent(&vmi_uid, started.child);
            tokio::select! {
                r = tokio::time::timeout(ttlab_sim_guest::AGENT_START_TIMEOUT, started.listening) => match r {
                    Ok(Ok(addr)) => {
                        tracing::info!(ns, vmi = name, %addr, "guest agent listening");
                        guests.set_agent_connected(&vmi_uid);
                        triggers.fire();
                    }
                    Ok(Err(_)) => tracing::warn!(ns, vmi = name, log = %log.display(), "guest agent exited before listening"),
                    Err(_) => tracing::warn!(ns, vmi = name, log = %log.display(), "guest agent not listening yet"),
                },
                () = t.cancelled() => {}
            }
        });
        if matches!(outcome, ttlab_sim_guest::SetupOutcome::Never) {
            return;
        }
        tokio::spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(setup) => {}
                () = tasks.cancelled() => return,
            }
            let failed = match &outcome {
                ttlab_sim_guest::SetupOutcome::Fail { reason } => Some(reason.as_str()),
                _ => None,
            };
            if let Err(e) = ttlab_sim_guest::write_marker(&dir, failed) {
                tracing::warn!(dir = %dir.display(), error = %e, "setup marker not written");
            }
        });
    }

    /// Running: until the guest stops or its pod goes.
    async fn running(&self, pod: Option<&Value>) -> Result<Action, Error> {
        match self.ctx.guests.state(&self.uid) {
            Some(GuestState::Off(Some(end))) => {
                let phase = match end {
                    GuestEnd::PowerOff => "Succeeded",
                    GuestEnd::Crash => "Failed",
                };
                tracing::info!(
                    ns = self.ns,
                    vmi = self.name,
                    phase,
                    "guest stopped by itself"
                );
                self.write_status(|s| {
                    set_phase(s, phase);
                    sync_ready_condition(s, pod);
                })
                .await?;
                return Ok(Action::await_change());
            }
            None => return self.fail(pod, "no guest runs for this VMI").await,
            _ => {}
        }
        match pod {
            None => self.fail(None, "launcher pod does not exist").await,
            Some(p) if matches!(pod_phase(p), "Succeeded" | "Failed") => {
                self.fail(Some(p), "launcher pod ended").await
            }
            Some(p) => {
                let connected = self.ctx.guests.agent_connected(&self.uid);
                self.write_status(|s| {
                    sync_ready_condition(s, Some(p));
                    if connected {
                        agent_connected(s);
                    }
                })
                .await?;
                Ok(Action::await_change())
            }
        }
    }

    /// Deleted: the launcher pod is deleted, the guest shuts down within its grace, the VMI
    /// ends, and once the pod is gone the finalizer goes.
    async fn deleting(&self, vmi: &Value, pods: &[Value]) -> Result<Action, Error> {
        for p in pods.iter().filter(|p| !deleting(p)) {
            self.ctx
                .rest
                .delete(Kind::Pod, self.ns, name(p), None, Some(uid(p)))
                .await?;
            tracing::info!(
                ns = self.ns,
                vmi = self.name,
                pod = name(p),
                "VMI deleted: deleting its launcher pod"
            );
        }
        let pod = pods.first();
        let mut phase = vmi["status"]["phase"].as_str().unwrap_or("").to_owned();
        let mut wait = None;
        match phase.as_str() {
            "Succeeded" | "Failed" => self.ctx.guests.power_down(&self.uid, None),
            "Scheduled" | "Running" => {
                let grace = guest_grace(vmi, self.ctx.settings.shutdown_grace);
                match self.ctx.guests.shutdown(&self.uid, grace) {
                    Shutdown::Pending(d) => wait = Some(d),
                    Shutdown::Done => {
                        tracing::info!(ns = self.ns, vmi = self.name, "guest shut down");
                        self.write_status(|s| {
                            set_phase(s, "Succeeded");
                            sync_ready_condition(s, pod);
                        })
                        .await?;
                        phase = "Succeeded".into();
                    }
                }
            }
            _ => {
                self.ctx.guests.power_down(&self.uid, None);
                self.write_status(|s| {
                    set_phase(s, "Failed");
                    sync_ready_condition(s, pod);
                })
                .await?;
                phase = "Failed".into();
            }
        }
        if let Some(d) = wait {
            return Ok(Action::requeue(d));
        }
        let final_ = matches!(phase.as_str(), "Succeeded" | "Failed");
        if final_ && pods.is_empty() && has_finalizer(vmi, VMI_FINALIZER) {
            let vmi_uid = self.uid.clone();
            self.ctx
                .rest
                .update(Kind::Vmi, self.ns, self.name, Part::Main, |cur| {
                    (uid(cur) == vmi_uid && has_finalizer(cur, VMI_FINALIZER))
                        .then(|| with_finalizer(cur, VMI_FINALIZER, false))
                })
                .await?;
            self.ctx.guests.remove(&self.uid);
            tracing::info!(ns = self.ns, vmi = self.name, "VMI finalizer released");
        }
        // The pods' deletion (confirmed by the kubelet) brings this VMI back here.
        Ok(Action::await_change())
    }
}

/// How long the guest takes to shut down: the simulator's grace, at most the VMI's
/// `terminationGracePeriodSeconds`.
fn guest_grace(vmi: &Value, configured: Duration) -> Duration {
    configured.min(vmi_grace(vmi))
}

/// The VMI's `terminationGracePeriodSeconds` (KubeVirt's default when absent): how long a
/// real guest gets to power off after the ACPI button.
fn vmi_grace(vmi: &Value) -> Duration {
    let secs = vmi["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap_or(DEFAULT_GRACE_SECONDS)
        .max(0);
    Duration::from_secs(secs.unsigned_abs())
}

/// A locally administered MAC address derived from the guest's address.
fn mac_for(ip: Ipv4Addr) -> String {
    let o = ip.octets();
    format!("02:00:{:02x}:{:02x}:{:02x}:{:02x}", o[0], o[1], o[2], o[3])
}

/// `status.volumeStatus`: each volume with the disk target it got (vda, vdb, …).
fn volume_status(spec: &Value) -> Value {
    let mut out = Vec::new();
    for (i, v) in spec["volumes"].as_array().into_iter().flatten().enumerate() {
        let Some(n) = v["name"].as_str() else {
            continue;
        };
        let letter = char::from(b'a' + u8::try_from(i % 26).unwrap_or(0));
        out.push(json!({"name": n, "target": format!("vd{letter}")}));
    }
    Value::Array(out)
}

/// Copies `bin` to the guest's agent path when the guest has no agent there.
fn install_agent(dir: &std::path::Path, bin: &std::path::Path) -> Result<(), Error> {
    let target = ttlab_sim_guest::guest_path(dir, ttlab_agent::protocol::BINARY_PATH)
        .map_err(Error::Guest)?;
    if target.exists() {
        return Ok(());
    }
    let io = |path: PathBuf| move |source| Error::Io { path, source };
    if let Some(parent) = target.parent() {
        std::fs::create_dir_all(parent).map_err(io(parent.to_path_buf()))?;
    }
    std::fs::copy(bin, &target).map_err(io(bin.to_path_buf()))?;
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755))
        .map_err(io(target.clone()))?;
    Ok(())
}

/// The virt-launcher pod of `vmi`, after KubeVirt's `RenderLaunchManifest`: the VMI's labels
/// plus KubeVirt's, owned by the VMI, the VMI's claims, its cloud-init Secrets and its
/// ConfigMaps as volumes (so the pod waits for them, as on a real node), and the resources
/// the quota and the nodes count, as KubeVirt v1.9 requests them (`ttlab_vm_manifest::launcher`):
/// a `compute` container requesting the guest's memory plus KubeVirt's overhead (also the
/// `kubevirt.io/memory-overhead-bytes` annotation), a tenth of a core per vCPU, 50M of
/// ephemeral storage and one of each KubeVirt device; the serial console's log as a sidecar;
/// an init container per container disk.
pub(crate) fn launcher_pod(vmi: &Value, image: &str) -> Value {
    let vmi_name = name(vmi);
    let mut labels = vmi["metadata"]["labels"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    labels.insert(APP_LABEL.into(), Value::from("virt-launcher"));
    labels.insert(CREATED_BY.into(), Value::from(uid(vmi)));
    let host = vmi["spec"]["hostname"].as_str().unwrap_or(vmi_name);
    labels.insert("vm.kubevirt.io/name".into(), Value::from(host));
    if vmi_name.len() <= 63 {
        labels.insert("vmi.kubevirt.io/id".into(), Value::from(vmi_name));
    }
    let domain = &vmi["spec"]["domain"];
    let spec = launcher_spec(vmi);
    let cost = spec.resources();
    let mut requests = serde_json::Map::new();
    let mut limits = serde_json::Map::new();
    requests.insert("memory".into(), Value::from(cost.compute_memory_quantity()));
    requests.insert(
        "cpu".into(),
        domain["resources"]["requests"]
            .get("cpu")
            .cloned()
            .unwrap_or_else(|| Value::from(cost.compute_cpu_quantity())),
    );
    requests.insert(
        "ephemeral-storage".into(),
        Value::from(launcher::EPHEMERAL_STORAGE_REQUEST),
    );
    for device in launcher::DEVICE_RESOURCES {
        requests.insert(device.into(), Value::from("1"));
        limits.insert(device.into(), Value::from("1"));
    }
    let mut init_containers = Vec::new();
    if spec.console_log {
        let c = launcher::CONSOLE_LOG_CONTAINER;
        init_containers.push(json!({
            "name": c.name,
            "image": image,
            "command": ["/usr/bin/virt-tail"],
            "args": ["--logfile", format!("/var/run/kubevirt-private/{}/virt-serial0-log", uid(vmi))],
            "resources": {"requests": quantities(c.requests), "limits": quantities(c.limits)},
            "restartPolicy": "Always",
        }));
    }
    let mut volumes = Vec::new();
    for v in vmi["spec"]["volumes"].as_array().into_iter().flatten() {
        let Some(vname) = v["name"].as_str() else {
            continue;
        };
        if let Some(claim) = v["ephemeral"]["persistentVolumeClaim"]["claimName"].as_str() {
            volumes.push(json!({"name": vname, "persistentVolumeClaim": {"claimName": claim, "readOnly": true}}));
        } else if let Some(claim) = v["persistentVolumeClaim"]["claimName"]
            .as_str()
            .or_else(|| v["dataVolume"]["name"].as_str())
        {
            volumes.push(json!({"name": vname, "persistentVolumeClaim": {"claimName": claim}}));
        }
        if let Some(disk_image) = v["containerDisk"]["image"].as_str() {
            // Started and done before the compute container: its small request changes
            // none of the pod's sums.
            init_containers.push(json!({
                "name": format!("volume{vname}"),
                "image": disk_image,
                "command": ["/container-disk-binary/usr/bin/container-disk"],
                "args": ["--no-op"],
                "resources": {
                    "requests": {"cpu": "1m", "memory": "1M", "ephemeral-storage": "50M"},
                    "limits": {"cpu": "10m", "memory": "40M"},
                },
            }));
        }
        if let Some(c) = v["configMap"]["name"].as_str() {
            let mut source = json!({"name": c});
            if let Some(optional) = v["configMap"]["optional"].as_bool() {
                source["optional"] = Value::from(optional);
            }
            volumes.push(json!({"name": vname, "configMap": source}));
        }
        for key in ["cloudInitNoCloud", "cloudInitConfigDrive"] {
            let src = &v[key];
            if let Some(s) = src["secretRef"]["name"].as_str() {
                volumes
                    .push(json!({"name": format!("{vname}-udata"), "secret": {"secretName": s}}));
            }
            if let Some(s) = src["networkDataSecretRef"]["name"].as_str() {
                volumes
                    .push(json!({"name": format!("{vname}-ndata"), "secret": {"secretName": s}}));
            }
        }
    }
    let grace = vmi["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap_or(DEFAULT_GRACE_SECONDS);
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": format!("virt-launcher-{vmi_name}-"),
            "namespace": meta(vmi, "namespace"),
            "labels": labels,
            "annotations": {
                launcher::MEMORY_OVERHEAD_ANNOTATION: cost.overhead.to_string(),
                "kubevirt.io/domain": vmi_name,
                "kubectl.kubernetes.io/default-container": "compute",
            },
            "ownerReferences": [controller_ref("kubevirt.io/v1", "VirtualMachineInstance", vmi)],
        },
        "spec": {
            "containers": [{
                "name": "compute",
                "image": image,
                "command": ["/usr/bin/virt-launcher-monitor"],
                "resources": {"requests": requests, "limits": limits},
            }],
            "initContainers": init_containers,
            "nodeSelector": {
                "kubernetes.io/arch": vmi["spec"]["architecture"].as_str().filter(|a| !a.is_empty()).unwrap_or("amd64"),
                "kubevirt.io/schedulable": "true",
                "machine-type.node.kubevirt.io/q35": "true",
            },
            "restartPolicy": "Never",
            // KubeVirt pads the guest's grace twice (15 s each) for the launcher.
            "terminationGracePeriodSeconds": grace.saturating_add(30),
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
        },
    });
    if !volumes.is_empty() {
        pod["spec"]["volumes"] = Value::Array(volumes);
    }
    if let Some(h) = vmi["spec"]["hostname"].as_str() {
        pod["spec"]["hostname"] = Value::from(h);
    }
    if let Some(s) = vmi["spec"]["subdomain"].as_str() {
        pod["spec"]["subdomain"] = Value::from(s);
    }
    pod
}

/// What KubeVirt's launcher-pod rendering reads of `vmi`: its memory request (or guest
/// memory), vCPUs (cores × sockets × threads), graphics device, console log and architecture.
pub(crate) fn launcher_spec(vmi: &Value) -> launcher::LauncherSpec {
    let spec = &vmi["spec"];
    let domain = &spec["domain"];
    // The memory KubeVirt adds its overhead to.
    let memory_request = domain["resources"]["requests"]["memory"]
        .as_str()
        .or_else(|| domain["memory"]["guest"].as_str())
        .and_then(|q| q.parse::<ttlab_model::Quantity>().ok())
        .and_then(|q| u64::try_from(q.whole_units()?).ok())
        .unwrap_or(0);
    let cpu = &domain["cpu"];
    let vcpus: u64 = ["cores", "sockets", "threads"]
        .iter()
        .map(|k| cpu[*k].as_u64().unwrap_or(1).clamp(1, 1024))
        .product();
    let devices = &domain["devices"];
    let off = |key: &str| devices[key].as_bool() == Some(false);
    launcher::LauncherSpec {
        memory_request,
        vcpus: u32::try_from(vcpus).unwrap_or(u32::MAX),
        graphics: !off("autoattachGraphicsDevice"),
        console_log: !off("autoattachSerialConsole") && !off("logSerialConsole"),
        arch: launcher::Arch::from_spec(spec["architecture"].as_str()),
    }
}

/// A support container's requests or limits as a JSON object.
fn quantities(list: &[(&str, &str)]) -> Value {
    Value::Object(
        list.iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
            .collect(),
    )
}

/// What KubeVirt reports once the guest agent is connected: the guest's OS, the interfaces
/// as seen by the domain and the agent, and the `AgentConnected` condition.
fn agent_connected(status: &mut Value) {
    status["guestOSInfo"] = json!({
        "id": "debian",
        "name": "Debian GNU/Linux",
        "prettyName": "Debian GNU/Linux 12 (bookworm) (kubevirt-sim)",
        "version": "12",
    });
    if let Some(interfaces) = status["interfaces"].as_array_mut() {
        for i in interfaces {
            i["infoSource"] = Value::from("domain, guest-agent");
        }
    }
    set_condition(
        status,
        "conditions",
        Cond::new("AgentConnected", true),
        true,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vmi() -> Value {
        json!({
            "metadata": {"name": "lab-1", "namespace": "ns", "uid": "vmi-uid", "labels": {"ttlab.io/session": "s"}},
            "spec": {
                "hostname": "node-a",
                "terminationGracePeriodSeconds": 30,
                "domain": {"resources": {"requests": {"memory": "1Gi"}}, "devices": {}},
                "volumes": [
                    {"name": "rootdisk", "ephemeral": {"persistentVolumeClaim": {"claimName": "golden", "readOnly": true}}},
                    {"name": "cloudinitdisk", "cloudInitNoCloud": {"secretRef": {"name": "ci"}}}
                ]
            }
        })
    }

    #[test]
    fn the_launcher_pod_carries_the_vmi_labels_owner_and_volumes() {
        let p = launcher_pod(&vmi(), "img");
        assert_eq!(p["metadata"]["generateName"], "virt-launcher-lab-1-");
        let l = &p["metadata"]["labels"];
        assert_eq!(l["kubevirt.io"], "virt-launcher");
        assert_eq!(l["kubevirt.io/created-by"], "vmi-uid");
        assert_eq!(l["vm.kubevirt.io/name"], "node-a");
        assert_eq!(l["ttlab.io/session"], "s");
        assert!(controlled_by(&p, "vmi-uid"));
        assert_eq!(
            p["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"],
            "golden"
        );
        assert_eq!(p["spec"]["volumes"][1]["secret"]["secretName"], "ci");
        // 1Gi and KubeVirt's overhead for one vCPU: 2Mi of page tables, 240Mi for its
        // processes, 8Mi for the vCPU, 8Mi for the IOThread, 32Mi of video RAM.
        assert_eq!(
            p["spec"]["containers"][0]["resources"]["requests"]["memory"],
            "1314Mi"
        );
        assert_eq!(
            p["metadata"]["annotations"]["kubevirt.io/memory-overhead-bytes"],
            (290u64 << 20).to_string()
        );
        assert_eq!(p["spec"]["terminationGracePeriodSeconds"], 60);
    }

    /// A recorded file of what KubeVirt v1.9 made of ttlab's rendered VMs.
    fn recorded(name: &str) -> Vec<Value> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../reference/kubevirt/launcher")
            .join(name);
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
    }

    #[test]
    fn the_launcher_pod_of_a_recorded_vmi_requests_what_kubevirt_requested() {
        for case in [
            "systemd-basics-golden-missing",
            "kubeadm-cluster-golden-missing",
        ] {
            let vmis = recorded(&format!("{case}.vmis.json"));
            let pods = recorded(&format!("{case}.launcher-pods.json"));
            for (vmi, real) in vmis.iter().zip(&pods) {
                let mut vmi = vmi.clone();
                vmi["metadata"]["uid"] = real["metadata"]["labels"][CREATED_BY].clone();
                let ours = launcher_pod(&vmi, "quay.io/kubevirt/virt-launcher:v1.9.0");
                let container = |pod: &Value, list: &str, name: &str| -> Value {
                    pod["spec"][list]
                        .as_array()
                        .and_then(|cs| cs.iter().find(|c| c["name"] == name))
                        .cloned()
                        .unwrap_or_else(|| panic!("{case}: no {list} {name}"))
                };
                assert_eq!(
                    container(&ours, "containers", "compute")["resources"],
                    container(real, "containers", "compute")["resources"],
                    "{case}"
                );
                for init in ["guest-console-log", "volumerootdisk"] {
                    let (o, r) = (
                        container(&ours, "initContainers", init),
                        container(real, "initContainers", init),
                    );
                    assert_eq!(o["resources"], r["resources"], "{case} {init}");
                    assert_eq!(o["restartPolicy"], r["restartPolicy"], "{case} {init}");
                }
                assert_eq!(
                    ours["metadata"]["labels"], real["metadata"]["labels"],
                    "{case}"
                );
                for key in [
                    "kubevirt.io/memory-overhead-bytes",
                    "kubevirt.io/domain",
                    "kubectl.kubernetes.io/default-container",
                ] {
                    assert_eq!(
                        ours["metadata"]["annotations"][key], real["metadata"]["annotations"][key],
                        "{case} {key}"
                    );
                }
                assert_eq!(ours["spec"]["nodeSelector"], real["spec"]["nodeSelector"]);
                assert_eq!(ours["spec"]["hostname"], real["spec"]["hostname"]);
                assert_eq!(ours["spec"]["subdomain"], real["spec"]["subdomain"]);
                assert_eq!(
                    ours["spec"]["terminationGracePeriodSeconds"],
                    real["spec"]["terminationGracePeriodSeconds"]
                );
            }
        }
    }

    #[test]
    fn the_guest_grace_is_the_shorter_one() {
        let v = vmi();
        assert_eq!(
            guest_grace(&v, Duration::from_secs(1)),
            Duration::from_secs(1)
        );
        let mut short = v.clone();
        short["spec"]["terminationGracePeriodSeconds"] = json!(0);
        assert_eq!(guest_grace(&short, Duration::from_secs(1)), Duration::ZERO);
    }

    #[test]
    fn phases_are_recorded_once() {
        let mut s = json!({});
        set_phase(&mut s, "Pending");
        set_phase(&mut s, "Pending");
        set_phase(&mut s, "Scheduling");
        assert_eq!(s["phaseTransitionTimestamps"].as_array().unwrap().len(), 2);
        assert_eq!(s["phase"], "Scheduling");
    }

    #[test]
    fn ready_follows_the_pod() {
        let mut s = json!({"phase": "Scheduling"});
        sync_ready_condition(&mut s, None);
        assert_eq!(s["conditions"][0]["reason"], "PodNotExists");
        let pod = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
        s["phase"] = json!("Running");
        sync_ready_condition(&mut s, Some(&pod));
        assert_eq!(s["conditions"][0]["status"], "True");
    }
}
