//! The Kubernetes a soak runs on. **kube-sim**, in process: faults and latency can be injected,
//! its call record is exact and its peak of VMs sees every instant. **The real control
//! plane** (`--backend real`): etcd, kube-apiserver and kube-controller-manager from
//! `KUBEBUILDER_ASSETS` (`ttlab-envtest`), the shipped `deploy/overlays/dev` and `prod`
//! installed, each server and reaper under its own ServiceAccount and Role, KubeVirt and the
//! kubelet simulated by `ttlab-kubevirt-sim` as a controller, and its console as an aggregated
//! API server. There quota and garbage collection are asynchronous as on any cluster; the
//! calls come from the API server's audit log, and the VMs at once from a poll of the VM list
//! (every 100 ms: a peak shorter than that can be missed). No refusals can be injected into a
//! real API server; the network faults of the fault proxies in front of it (blackholes, stalls,
//! lost replies), process kills and PostgreSQL outages are the chaos there.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Context as _;
use k8s_openapi::api::core::v1::ResourceQuota;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use serde_json::json;
use ttlab_kube_sim::{CallRecord, FaultAction, FaultRule, KubeSim, Timings, Verb};

use super::rig::{NAMESPACE, kube_user};
use super::{ENVS, Settings};
use crate::dev::demo::client::{self, HttpClient, Method};

/// Which Kubernetes (`--backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// kube-sim, in process, with injected faults and latency.
    KubeSim,
    /// A real kube-apiserver, kube-controller-manager and etcd from `KUBEBUILDER_ASSETS`, with
    /// the shipped Roles and KubeVirt simulated as a controller.
    Real,
}

/// A kind of object: how the table names it, and its (group, version, kind, plural).
type KindOf = (
    &'static str,
    (&'static str, &'static str, &'static str, &'static str),
);

/// The kinds that must be gone after the drain.
const KINDS: [KindOf; 6] = [
    (
        "VirtualMachines",
        ("kubevirt.io", "v1", "VirtualMachine", "virtualmachines"),
    ),
    (
        "VirtualMachineInstances",
        (
            "kubevirt.io",
            "v1",
            "VirtualMachineInstance",
            "virtualmachineinstances",
        ),
    ),
    ("Secrets", ("", "v1", "Secret", "secrets")),
    ("Services", ("", "v1", "Service", "services")),
    (
        "NetworkPolicies",
        (
            "networking.k8s.io",
            "v1",
            "NetworkPolicy",
            "networkpolicies",
        ),
    ),
    ("Pods", ("", "v1", "Pod", "pods")),
];

/// The Kubernetes of one soak: on kube-sim one instance per site (in [`Settings::sites`]
/// order); the real control plane is the one site.
pub(crate) enum Kube {
    Sim(Vec<KubeSim>),
    Real(Box<Real>),
}

/// The real control plane and what runs beside it.
pub(crate) struct Real {
    plane: ttlab_envtest::ControlPlane,
    installed: ttlab_envtest::Installed,
    kubevirt: ttlab_kubevirt_sim::KubevirtSim,
    console: ttlab_kubevirt_sim::ConsoleServer,
    admin: kube::Client,
    vms_now: Arc<AtomicUsize>,
    vms_peak: Arc<AtomicUsize>,
    counter: tokio::task::JoinHandle<()>,
}

impl Kube {
    /// A kube-sim per site (in [`Settings::sites`] order).
    pub(crate) async fn start_sim(settings: &Settings, guests: &Path) -> anyhow::Result<Self> {
        let mut sims = Vec::new();
        for (i, name) in settings.sites.iter().enumerate() {
            let guests = if settings.sites.len() == 1 {
                guests.to_path_buf()
            } else {
                guests.join(name)
            };
            let seed = settings.seed.wrapping_add(i as u64);
            match start_one_sim(settings, &guests, seed).await {
                Ok(sim) => sims.push(sim),
                Err(e) => {
                    for sim in sims {
                        sim.shutdown().await;
                    }
                    return Err(e.context(format!("starting the kube-sim of site {name}")));
                }
            }
        }
        Ok(Self::Sim(sims))
    }

    /// The real control plane with `deploy/overlays/dev` and `prod` installed, the soak's VM
    /// quota in place of the shipped one, KubeVirt and its console.
    pub(crate) async fn start_real(
        settings: &Settings,
        guests: &Path,
        agent: &Path,
    ) -> anyhow::Result<Self> {
        let plane = tokio::task::spawn_blocking(ttlab_envtest::ControlPlane::start)
            .await
            .context("starting the control plane")?
            .context(
                "starting etcd, kube-apiserver and kube-controller-manager from \
                 KUBEBUILDER_ASSETS",
            )?;
        let installed = plane
            .install_shipped(&ENVS)
            .await
            .context("installing deploy/overlays/dev and prod")?;
        let ns = installed.vm_namespace.clone();
        let admin = plane.admin_client().await?;
        // The soak's quota replaces the shipped one (8 VMs, 48 GiB), as an operator sizes it.
        let quotas: Api<ResourceQuota> = Api::namespaced(admin.clone(), &ns);
        for shipped in installed.objects.iter().filter(|o| {
            o["kind"] == "ResourceQuota" && o["metadata"]["namespace"].as_str() == Some(&ns)
        }) {
            let name = shipped["metadata"]["name"].as_str().unwrap_or_default();
            quotas
                .delete(name, &DeleteParams::default())
                .await
                .with_context(|| format!("deleting the shipped quota {name}"))?;
        }
        plane
            .create(&[vm_quota(&ns, settings.vm_limit)])
            .await
            .context("creating the soak's VM quota")?;
        let mut sim_settings = ttlab_kubevirt_sim::SimSettings::for_tests([ns.clone()], guests);
        sim_settings.agent_binary = Some(agent.to_path_buf());
        let kubevirt = ttlab_kubevirt_sim::KubevirtSim::start(admin.clone(), sim_settings)
            .await
            .context("starting the simulated KubeVirt")?;
        let console_ns = plane.create_namespace("kubevirt").await?;
        let (cert, key) = plane.serving_certificate(&format!("virt-api.{console_ns}.svc"))?;
        let mut console_settings =
            ttlab_kubevirt_sim::ConsoleSettings::new(cert, key, plane.front_proxy_ca_file());
        console_settings.allowed_names = vec!["front-proxy-client".into()];
        let console = kubevirt
            .serve_console(console_settings)
            .await
            .context("serving the console")?;
        console
            .register(
                &admin,
                &console_ns,
                "virt-api",
                plane.ca_pem(),
                Duration::from_secs(60),
            )
            .await
            .context("registering the console's APIService")?;
        let (vms_now, vms_peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let counter = tokio::spawn(count_vms(
            Api::namespaced_with(admin.clone(), &ns, &resource(KINDS[0])),
            vms_now.clone(),
            vms_peak.clone(),
        ));
        Ok(Self::Real(Box::new(Real {
            plane,
            installed,
            kubevirt,
            console,
            admin,
            vms_now,
            vms_peak,
            counter,
        })))
    }

    /// The namespace of the VMs.
    pub(crate) fn namespace(&self) -> String {
        match self {
            Self::Sim(_) => NAMESPACE.to_owned(),
            Self::Real(r) => r.installed.vm_namespace.clone(),
        }
    }

    /// Each site's kube-sim address (none on the real control plane).
    pub(crate) fn sim_addrs(&self) -> Vec<SocketAddr> {
        match self {
            Self::Sim(sims) => sims.iter().map(KubeSim::addr).collect(),
            Self::Real(_) => Vec::new(),
        }
    }

    /// Where site `site`'s API server listens (its kube-sim's address, or kube-apiserver's),
    /// for the fault proxies in front of it.
    pub(crate) fn api_addr(&self, site: usize) -> anyhow::Result<SocketAddr> {
        match self {
            Self::Sim(sims) => sims
                .get(site)
                .map(KubeSim::addr)
                .with_context(|| format!("no site #{site}")),
            Self::Real(r) => {
                let server = r.plane.server();
                server
                    .strip_prefix("https://")
                    .and_then(|a| a.parse().ok())
                    .with_context(|| {
                        format!("the API server's URL {server} is not https://<ip>:<port>")
                    })
            }
        }
    }

    /// A kubeconfig of site `site` for environment `e`'s server or reaper, written under
    /// `dir`; through the proxy at `via` when given.
    pub(crate) fn kubeconfig(
        &self,
        e: usize,
        reaper: bool,
        site: usize,
        dir: &Path,
        via: Option<SocketAddr>,
    ) -> anyhow::Result<PathBuf> {
        match self {
            Self::Sim(sims) => {
                let sim = sims.get(site).with_context(|| format!("no site #{site}"))?;
                let user = kube_user(e, reaper);
                let path = if sims.len() == 1 {
                    dir.join(format!("kubeconfig-{user}"))
                } else {
                    dir.join(format!("kubeconfig-{user}-{site}"))
                };
                match via {
                    Some(addr) => {
                        let yaml = ttlab_kube_sim::kubeconfig_yaml_as(
                            &format!("http://{addr}"),
                            NAMESPACE,
                            Some(&user),
                        );
                        std::fs::write(&path, yaml)
                            .with_context(|| format!("writing {}", path.display()))?;
                    }
                    None => sim.write_kubeconfig_as(&path, NAMESPACE, Some(&user))?,
                }
                Ok(path)
            }
            Self::Real(r) => {
                let env = r.installed.env(ENVS[e]);
                let shipped = if reaper {
                    &env.reaper_kubeconfig
                } else {
                    &env.server_kubeconfig
                };
                let Some(addr) = via else {
                    return Ok(shipped.clone());
                };
                // The ServiceAccount's kubeconfig with the proxy as its server. The serving
                // certificate names 127.0.0.1, which the proxy's address is too.
                let text = std::fs::read_to_string(shipped)
                    .with_context(|| format!("reading {}", shipped.display()))?;
                let mut config: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("{} is not JSON", shipped.display()))?;
                for cluster in config["clusters"].as_array_mut().into_iter().flatten() {
                    cluster["cluster"]["server"] = json!(format!("https://{addr}"));
                }
                let path = dir.join(format!("kubeconfig-{}", kube_user(e, reaper)));
                std::fs::write(&path, serde_json::to_string_pretty(&config)?)
                    .with_context(|| format!("writing {}", path.display()))?;
                Ok(path)
            }
        }
    }

    /// Injects the run's latency and faults (kube-sim only: a real API server takes none).
    pub(crate) fn inject(&self, settings: &Settings) {
        let Self::Sim(sims) = self else { return };
        for sim in sims {
            inject_into(sim, settings);
        }
    }

    /// Stops injecting faults.
    pub(crate) fn clear_faults(&self) {
        if let Self::Sim(sims) = self {
            for sim in sims {
                sim.faults().clear();
            }
        }
    }

    /// Where it is, for the log.
    pub(crate) fn describe(&self) -> String {
        match self {
            Self::Sim(sims) => sims
                .iter()
                .map(|sim| format!("kube-sim at {}", sim.url()))
                .collect::<Vec<_>>()
                .join(", "),
            Self::Real(r) => format!(
                "the real control plane at {} (namespace {})",
                r.plane.server(),
                r.installed.vm_namespace
            ),
        }
    }

    /// VMs now, and the most there were at once, by site.
    pub(crate) fn vms(&self) -> Vec<(usize, usize)> {
        match self {
            Self::Sim(sims) => sims
                .iter()
                .map(|sim| {
                    let stats = sim.stats();
                    (stats.vms, stats.peak_vms)
                })
                .collect(),
            Self::Real(r) => vec![(
                r.vms_now.load(Ordering::Relaxed),
                r.vms_peak.load(Ordering::Relaxed),
            )],
        }
    }

    /// Every call the processes made, users named as [`kube_user`] names them, each with the
    /// site it went to.
    pub(crate) fn calls(&self) -> anyhow::Result<Vec<(usize, CallRecord)>> {
        match self {
            Self::Sim(sims) => Ok(sims
                .iter()
                .enumerate()
                .flat_map(|(i, sim)| sim.calls().into_iter().map(move |c| (i, c)))
                .collect()),
            Self::Real(r) => Ok(r.calls()?.into_iter().map(|c| (0, c)).collect()),
        }
    }

    /// Objects of each kind still in the namespace of each site, but for what `deploy/`
    /// installed there: by site, (kind, names).
    pub(crate) async fn leftovers(
        &self,
        http: &HttpClient,
    ) -> anyhow::Result<Vec<Vec<(String, Vec<String>)>>> {
        match self {
            Self::Sim(sims) => {
                let mut out = Vec::new();
                for sim in sims {
                    let mut site = Vec::new();
                    for kind in KINDS {
                        site.push((kind.0.to_owned(), sim_names(http, sim.url(), kind).await?));
                    }
                    out.push(site);
                }
                Ok(out)
            }
            Self::Real(r) => Ok(vec![r.leftovers().await?]),
        }
    }

    /// Stops it.
    pub(crate) async fn stop(self) {
        match self {
            Self::Sim(sims) => {
                for sim in sims {
                    sim.shutdown().await;
                }
            }
            Self::Real(r) => {
                let Real {
                    plane,
                    kubevirt,
                    console,
                    counter,
                    ..
                } = *r;
                counter.abort();
                console.stop().await;
                kubevirt.stop().await;
                tokio::task::spawn_blocking(move || plane.stop()).await.ok();
            }
        }
    }
}

impl Real {
    /// Objects of each kind still in the VM namespace, but for what `deploy/` installed
    /// there: (kind, names).
    async fn leftovers(&self) -> anyhow::Result<Vec<(String, Vec<String>)>> {
        let r = self;
        let mut out = Vec::new();
        for kind in KINDS {
            let names: Vec<String> = {
                let api: Api<DynamicObject> = Api::namespaced_with(
                    r.admin.clone(),
                    &r.installed.vm_namespace,
                    &resource(kind),
                );
                api.list_metadata(&ListParams::default())
                    .await
                    .with_context(|| format!("listing {}", kind.0))?
                    .items
                    .into_iter()
                    .filter(|o| {
                        !o.metadata
                            .name
                            .as_deref()
                            .is_some_and(|name| r.installed_here(kind, name))
                    })
                    .map(|o| describe_object(&o.metadata))
                    .collect()
            };
            out.push((kind.0.to_owned(), names));
        }
        Ok(out)
    }

    /// Whether `name` of `kind` is one of the installed `deploy/` objects (the shipped
    /// NetworkPolicies of the VM namespace, say), which stay.
    fn installed_here(&self, (_, (_, _, kind, _)): KindOf, name: &str) -> bool {
        self.installed.objects.iter().any(|o| {
            o["kind"] == kind
                && o["metadata"]["name"] == name
                && o["metadata"]["namespace"].as_str() == Some(&self.installed.vm_namespace)
        })
    }

    /// The audit log as kube-sim's call record: the processes' calls in the VM namespace,
    /// each user renamed to its [`kube_user`].
    fn calls(&self) -> anyhow::Result<Vec<CallRecord>> {
        let mut users = BTreeMap::new();
        for (e, env) in ENVS.iter().enumerate() {
            let installed = self.installed.env(env);
            users.insert(installed.server_user(), kube_user(e, false));
            users.insert(installed.reaper_user(), kube_user(e, true));
        }
        let mut out = Vec::new();
        for event in self.plane.audit_events()? {
            let Some(user) = users.get(&event.user.username) else {
                continue;
            };
            let Some(object) = &event.object_ref else {
                continue;
            };
            if object.namespace.as_deref() != Some(&self.installed.vm_namespace) {
                continue;
            }
            // A call is recorded once: a watch when it started, anything else when answered.
            let recorded_at = if event.verb == "watch" {
                "ResponseStarted"
            } else {
                "ResponseComplete"
            };
            if event.stage != recorded_at {
                continue;
            }
            let Some(plural) = &object.resource else {
                continue;
            };
            let resource = match &object.subresource {
                Some(sub) => format!("{plural}/{sub}"),
                None => plural.clone(),
            };
            let record = json!({
                "seq": out.len(),
                "at": event.request_received_timestamp,
                "offset_ms": 0,
                "verb": event.verb,
                "resource": resource,
                "group": object.api_group.clone().unwrap_or_default(),
                "subresource": object.subresource,
                "namespace": object.namespace,
                "name": object.name,
                "status": event.response_status.as_ref().and_then(|s| s.code).unwrap_or(0),
                "user": user,
            });
            // Verbs kube-sim does not name (none of the shipped Roles grants one) are skipped.
            if let Ok(r) = serde_json::from_value::<CallRecord>(record) {
                out.push(r);
            }
        }
        Ok(out)
    }
}

/// The shipped Roles of the VM namespace (`ttlab-server`, `ttlab-reaper`).
const SHIPPED_ROLES: &str = include_str!("../../../../../deploy/base/vms/role.yaml");

/// RoleBindings of each environment's server and reaper identity ([`kube_user`]) to the
/// shipped Role of its kind, in kube-sim.
fn bindings() -> Vec<serde_json::Value> {
    let mut objects = Vec::new();
    for e in 0..ENVS.len() {
        for reaper in [false, true] {
            let user = kube_user(e, reaper);
            let role = if reaper {
                "ttlab-reaper"
            } else {
                "ttlab-server"
            };
            objects.push(json!({
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": {"name": user, "namespace": NAMESPACE},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                "subjects": [{"kind": "User", "name": user}],
            }));
        }
    }
    objects
}

/// The second layer, as deployed: a namespace quota on the number of VMs.
fn vm_quota(namespace: &str, vm_limit: usize) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "ttlab-soak-vms", "namespace": namespace},
        "spec": {"hard": {"count/virtualmachines.kubevirt.io": vm_limit.to_string()}},
    })
}

fn resource((_, (group, version, kind, plural)): KindOf) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// The names of `kind`'s objects in kube-sim's namespace.
async fn sim_names(
    http: &HttpClient,
    url: &str,
    (kind, (group, version, _, plural)): KindOf,
) -> anyhow::Result<Vec<String>> {
    let prefix = if group.is_empty() {
        format!("/api/{version}")
    } else {
        format!("/apis/{group}/{version}")
    };
    let url = format!("{url}{prefix}/namespaces/{NAMESPACE}/{plural}");
    let (status, body) = client::send(http, Method::GET, &url, None, None).await?;
    if !status.is_success() {
        anyhow::bail!("listing {kind}: {status}");
    }
    let v: serde_json::Value = serde_json::from_slice(&body)?;
    Ok(v["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .filter_map(|i| i["metadata"]["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default())
}

/// An object left behind, with what holds it: `name (deleting since …, finalizers […],
/// owners […])`.
fn describe_object(m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    let mut held = Vec::new();
    if let Some(t) = &m.deletion_timestamp {
        held.push(format!("deleting since {}", t.0));
    }
    if let Some(f) = m.finalizers.as_ref().filter(|f| !f.is_empty()) {
        held.push(format!("finalizers {}", f.join(", ")));
    }
    if let Some(o) = m.owner_references.as_ref().filter(|o| !o.is_empty()) {
        let owners: Vec<String> = o.iter().map(|o| format!("{} {}", o.kind, o.name)).collect();
        held.push(format!("owners {}", owners.join(", ")));
    }
    let name = m.name.clone().unwrap_or_default();
    if held.is_empty() {
        name
    } else {
        format!("{name} ({})", held.join("; "))
    }
}

/// Counts the VMs every 100 ms, keeping the most seen.
async fn count_vms(api: Api<DynamicObject>, now: Arc<AtomicUsize>, peak: Arc<AtomicUsize>) {
    loop {
        if let Ok(list) = api.list_metadata(&ListParams::default()).await {
            now.store(list.items.len(), Ordering::Relaxed);
            peak.fetch_max(list.items.len(), Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One site's kube-sim with the soak's timings, the namespace quota (the site's VM limit) and
/// the shipped Roles bound to each process's identity.
async fn start_one_sim(settings: &Settings, guests: &Path, seed: u64) -> anyhow::Result<KubeSim> {
    let mut config = ttlab_kube_sim::SimConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    config.namespaces = vec!["default".into(), NAMESPACE.into()];
    config.timings = Timings {
        pending: Duration::from_millis(20),
        scheduling: Duration::from_millis(50),
        boot: Duration::from_millis(300),
        setup: Duration::from_millis(200),
        stop: Duration::from_millis(200),
        gc: Duration::from_millis(20),
        pod_start: Duration::from_millis(50),
        bookmark: Duration::from_secs(30),
    };
    config.guest_root = Some(guests.to_path_buf());
    config.seed = seed;
    // The quota is the second layer here, and "server VM limit held" is about the first:
    // with a real controller's recount lag (about 1 s) a VM just deleted still fills the
    // quota while the servers already see its place free, and a multi-VM lab may need
    // longer than the servers' recount retry. The lag itself is tested by kube-sim's and
    // the cluster crate's quota tests and the saga's recount retry (and by the soak on the
    // real control plane); on kube-sim the soak keeps it short.
    config.quota_sync = Duration::from_millis(50);
    let sim = KubeSim::start(config).await.context("starting kube-sim")?;
    sim.create(vm_quota(NAMESPACE, settings.site_vm_limit))
        .context("creating the namespace quota")?;
    // Each process acts as its own identity under the shipped Roles, as deployed: kube-sim
    // refuses what they do not grant.
    sim.apply_rbac_yaml(SHIPPED_ROLES)
        .context("applying deploy/base/vms/role.yaml")?;
    sim.apply_rbac(&bindings())
        .context("binding the shipped Roles")?;
    Ok(sim)
}

/// Injects the run's latency and faults into one kube-sim.
fn inject_into(sim: &KubeSim, settings: &Settings) {
    sim.faults().set_latency(settings.latency);
    if settings.fault_rate > 0.0 {
        for (verb, status) in [
            (Verb::Get, 500),
            (Verb::List, 503),
            (Verb::Create, 500),
            (Verb::Delete, 503),
        ] {
            sim.faults().add(FaultRule {
                action: FaultAction::Fail {
                    status,
                    message: None,
                },
                ..FaultRule::fail(Some(verb), None, status).fraction(settings.fault_rate)
            });
        }
    }
}
