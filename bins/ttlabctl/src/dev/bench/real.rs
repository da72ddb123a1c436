//! `ttlabctl bench real`: figures on a real Kubernetes API server. By default the real
//! control plane of `ttlab-envtest` (etcd, kube-apiserver, kube-controller-manager from
//! `KUBEBUILDER_ASSETS`) with the KubeVirt and CDI CRDs and the shipped `deploy/overlays/dev`
//! objects (the server and the reaper each under its own ServiceAccount and Role), KubeVirt
//! and the kubelet played by `ttlab-kubevirt-sim` as a controller; with `--target kubeconfig`,
//! any cluster's namespace (which must hold nothing but what this benchmark created). Every
//! object is rendered as the server renders it ([`super::objects::session_objects`]), so the
//! figures follow the renderer. A throwaway PostgreSQL holds the sessions.
//!
//! Phases, in this order (each can be skipped with `--skip`):
//! - `etcd`: etcd's database size (`etcd_mvcc_db_total_size_in_bytes` and
//!   `…_in_use_in_bytes`) before and after creating up to 1,000 live sessions, per 1,000
//!   (target ≤ 40 MB). Live sessions' VMs are `Halted` (one machine runs no 10,000 guests):
//!   their VMIs and launcher pods are not in the figure;
//! - `reclaim`: `--sessions` expired sessions (VMs Running under the simulated KubeVirt, their
//!   Secrets, Services, NetworkPolicies) reclaimed by the real reaper code under the reaper's
//!   identity, from expiry to every VM and Secret confirmed absent; then, in the same run, the
//!   same number of VMs alone, Running likewise, deleted raw 32 at a time until absent (the
//!   API server's own limit); both and their ratio (target ≤ 1.25×);
//! - `start`: `--clicks` "Start lab" requests at once to the real `ttlab-server` binary over
//!   HTTP, each until its session is running (`ready_at`, database clock): p50, p99, max;
//! - `noop`: the live sessions grown to `--live`; the reaper's cycle with nothing to do,
//!   `--runs` times in process, reading VMs and Secrets from watch-fed listings as the
//!   long-running `ttlab-reaper` does (their fill time printed first), every run printed with
//!   the median and worst (target median ≤ 1 s); then what the same cycle's parts cost alone
//!   when listed instead; then the real `ttlab-reaper` binary's first cycle (which reads its
//!   listings' first fill) and peak resident memory (target < 60 MB). If the API server
//!   (etcd) refuses a create, that is printed and the phase measures what was created.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use chrono::{DateTime, TimeDelta, Utc};
use clap::Args;
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ConfigMap, ResourceQuota};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use ttlab_api::auth::{AuthConfig, AuthSecret, Role};
use ttlab_cloudinit::AgentPayload;
use ttlab_cluster::{
    ClusterSettings, Kind, KubeCluster, ProvisionCluster as _, ReaperCluster as _,
};
use ttlab_lesson::{Lesson, LessonSet};
use ttlab_model::labels::ENV as ENV_LABEL;
use ttlab_model::{EnvName, Runtime, SessionId, SessionStatus, UserId};
use ttlab_reaper::{Metrics, ReaperContext, ReaperSettings, reap_once};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, SessionTimes, SessionVm, Store};

use super::objects::{SessionObjects, agent_config_map, session_objects};
use super::reaper::median_and_worst;
use super::{percentile, verdict};
use crate::dev::demo::client::{self, Method};
use crate::dev::demo::{ChildProcess, checkout_dir, random_secret, wait_ready};

/// Every environment of this benchmark starts so; objects labelled otherwise are not its own.
const ENV_PREFIX: &str = "bench-";
const ENV_LIVE: &str = "bench-live";
const ENV_RECLAIM: &str = "bench-reclaim";
const ENV_RAW: &str = "bench-raw";
const ENV_START: &str = "bench-start";
/// Objects created at once while setting up.
const SETUP_CONCURRENCY: usize = 32;
/// Raw deletes in flight in the API server's own limit.
const RAW_CONCURRENCY: usize = 32;

const RECLAIM_RATIO_TARGET: f64 = 1.25;
const ETCD_TARGET_MB: f64 = 40.0;
const NOOP_TARGET: f64 = 1.0;
const RSS_TARGET_MB: f64 = 60.0;
/// The whole run, set up to stopped.
const RUN_TARGET_SECS: f64 = 600.0;

/// Which cluster (`--target`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// The real control plane from `KUBEBUILDER_ASSETS`, started for the run, with the
    /// shipped Roles and KubeVirt simulated as a controller.
    Envtest,
    /// The cluster of `--kubeconfig` (or `KUBECONFIG`), in `--namespace`. Nothing is simulated
    /// there: the VMs are created `Halted` (no guest boots), and `start` and `etcd` are skipped.
    Kubeconfig,
}

/// The VMs of the reclaim phase (`--reclaim-guests`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReclaimGuests {
    /// Halted VMs: no guests.
    None,
    /// Running VMs with simulated guests (on `--target envtest`).
    Simulated,
}

/// Arguments of `ttlabctl bench real`.
#[derive(Debug, Clone, Args)]
pub struct RealBenchArgs {
    /// Where to measure.
    #[arg(long, value_enum, default_value_t = Target::Envtest)]
    pub target: Target,
    /// The kubeconfig of `--target kubeconfig`.
    #[arg(long, env = "KUBECONFIG", value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The namespace of `--target kubeconfig` (it must hold only this benchmark's objects).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Expired sessions of the reclaim phase (and VMs of its raw deletes).
    #[arg(long, default_value_t = 1000)]
    pub sessions: usize,
    /// "Start lab" clicks at once in the start phase.
    #[arg(long, default_value_t = 100)]
    pub clicks: usize,
    /// Live sessions of the no-op phase (the etcd phase creates the first 1,000 of them).
    #[arg(long, default_value_t = 10_000)]
    pub live: usize,
    /// No-op cycles run in process (each printed).
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// The agent binary the Secrets' user-data pins (default `target/agent/ttlab-agent`).
    #[arg(long, value_name = "PATH")]
    pub agent: Option<PathBuf>,
    /// The lesson of every session.
    #[arg(long, default_value = "systemd-basics")]
    pub lesson: String,
    /// Lesson file or directory (default: the checkout's `lessons/`).
    #[arg(long, env = "TTLAB_LESSONS", value_name = "PATH")]
    pub lessons: Option<PathBuf>,
    /// The `ttlab-server` binary of the start phase (default: next to ttlabctl).
    #[arg(long, value_name = "PATH")]
    pub server_binary: Option<PathBuf>,
    /// The `ttlab-reaper` binary of the no-op phase (default: next to ttlabctl).
    #[arg(long, value_name = "PATH")]
    pub reaper_binary: Option<PathBuf>,
    /// Longest wait for the clicked sessions to be running.
    #[arg(long, default_value = "300s", value_parser = humantime::parse_duration)]
    pub ready_timeout: Duration,
    /// The VMs of the reclaim phase: `none` (Halted: no guest boots or shuts down, the
    /// figures are the API server's and the reaper's) or `simulated` (Running, each with a
    /// simulated guest and its agent process; much slower to set up).
    #[arg(long, value_enum, default_value_t = ReclaimGuests::None)]
    pub reclaim_guests: ReclaimGuests,
    /// Phases to skip (etcd, reclaim, start, noop), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub skip: Vec<String>,
}

/// The real control plane and what runs beside it.
struct Envtest {
    plane: ttlab_envtest::ControlPlane,
    kubevirt: ttlab_kubevirt_sim::KubevirtSim,
}

/// Where the benchmark runs.
struct Rig {
    envtest: Option<Envtest>,
    namespace: String,
    admin: kube::Client,
    server_kubeconfig: PathBuf,
    reaper_kubeconfig: PathBuf,
    server_cluster: Arc<KubeCluster>,
    reaper_cluster: Arc<KubeCluster>,
    db: TestDb,
    store: Store,
    lessons_path: PathBuf,
    lesson: Lesson,
    agent_path: PathBuf,
    agent: AgentPayload,
    /// VMs are created `Halted` (nothing boots).
    halted: bool,
    _guests: tempfile::TempDir,
}

/// Runs the benchmark and prints its figures.
pub async fn run(args: RealBenchArgs) -> anyhow::Result<()> {
    let lessons_path = args
        .lessons
        .clone()
        .unwrap_or_else(|| checkout_dir().join("lessons"));
    let lessons = LessonSet::load(&lessons_path)
        .with_context(|| format!("loading the lessons from {}", lessons_path.display()))?;
    let lesson = lessons
        .iter()
        .find(|l| l.id.as_str() == args.lesson)
        .with_context(|| format!("no lesson {:?} in {}", args.lesson, lessons_path.display()))?
        .clone();
    anyhow::ensure!(
        lesson.runtime == Runtime::Vm,
        "lesson {} is not a VM lesson",
        lesson.id
    );
    let agent_path = args
        .agent
        .clone()
        .unwrap_or_else(|| checkout_dir().join("target/agent/ttlab-agent"));
    let binary = std::fs::read(&agent_path).with_context(|| {
        format!(
            "reading the agent {} (build it with cargo build --profile agent -p ttlab-agent-bin, or name one with --agent)",
            agent_path.display()
        )
    })?;
    let agent = AgentPayload::new(&binary)?;
    let began = Instant::now();
    let mut rig = Rig::start(&args, lessons_path, lesson, agent_path, agent).await?;
    let result = rig.measure(&args).await;
    rig.stop().await;
    let took = began.elapsed().as_secs_f64();
    println!(
        "bench real: {took:.0}s from start to everything stopped; target < {RUN_TARGET_SECS:.0}s: {}",
        verdict(took < RUN_TARGET_SECS)
    );
    result
}

impl Rig {
    async fn start(
        args: &RealBenchArgs,
        lessons_path: PathBuf,
        lesson: Lesson,
        agent_path: PathBuf,
        agent: AgentPayload,
    ) -> anyhow::Result<Self> {
        let guests = tempfile::Builder::new()
            .prefix("ttlab-bench-real-")
            .tempdir()?;
        let (envtest, namespace, admin, server_kubeconfig, reaper_kubeconfig) = match args.target {
            Target::Envtest => {
                let plane = tokio::task::spawn_blocking(ttlab_envtest::ControlPlane::start)
                    .await
                    .context("starting the control plane")?
                    .context(
                        "starting etcd, kube-apiserver and kube-controller-manager from \
                         KUBEBUILDER_ASSETS",
                    )?;
                let installed = plane
                    .install_shipped(&["dev"])
                    .await
                    .context("installing deploy/overlays/dev")?;
                let ns = installed.vm_namespace.clone();
                let admin = plane.admin_client().await?;
                // The shipped quota (a few VMs) would cap the benchmark: an operator sizes it.
                let quotas: Api<ResourceQuota> = Api::namespaced(admin.clone(), &ns);
                for q in quotas.list(&ListParams::default()).await?.items {
                    if let Some(name) = q.metadata.name {
                        quotas.delete(&name, &DeleteParams::default()).await?;
                    }
                }
                let mut settings =
                    ttlab_kubevirt_sim::SimSettings::for_tests([ns.clone()], guests.path());
                settings.agent_binary = Some(agent_path.clone());
                let kubevirt = ttlab_kubevirt_sim::KubevirtSim::start(admin.clone(), settings)
                    .await
                    .context("starting the simulated KubeVirt")?;
                let env = installed.env("dev");
                (
                    Some(Envtest { plane, kubevirt }),
                    ns,
                    admin,
                    env.server_kubeconfig.clone(),
                    env.reaper_kubeconfig.clone(),
                )
            }
            Target::Kubeconfig => {
                let path = args
                    .kubeconfig
                    .clone()
                    .context("--target kubeconfig needs --kubeconfig PATH (or KUBECONFIG)")?;
                let ns = args
                    .namespace
                    .clone()
                    .context("--target kubeconfig needs --namespace")?;
                let admin = client_of(&path).await?;
                (None, ns, admin, path.clone(), path)
            }
        };
        refuse_foreign_objects(&admin, &namespace).await?;
        let server_cluster = Arc::new(
            KubeCluster::from_kubeconfig(
                &server_kubeconfig,
                ClusterSettings::in_namespace(&namespace),
            )
            .await?,
        );
        let reaper_cluster = Arc::new(
            KubeCluster::from_kubeconfig(
                &reaper_kubeconfig,
                // As the reaper binary: as many calls in flight as sessions handled at once.
                ClusterSettings {
                    max_in_flight: ttlab_reaper::DEFAULT_CONCURRENCY,
                    ..ClusterSettings::in_namespace(&namespace)
                },
            )
            .await?,
        );
        let db = TestDb::new().await.context("starting PostgreSQL")?;
        let store = db.store().await?;
        let halted = envtest.is_none();
        Ok(Self {
            envtest,
            namespace,
            admin,
            server_kubeconfig,
            reaper_kubeconfig,
            server_cluster,
            reaper_cluster,
            db,
            store,
            lessons_path,
            lesson,
            agent_path,
            agent,
            halted,
            _guests: guests,
        })
    }

    async fn stop(self) {
        self.store.close();
        match self.envtest {
            Some(Envtest { plane, kubevirt }) => {
                kubevirt.stop().await;
                tokio::task::spawn_blocking(move || plane.stop()).await.ok();
            }
            None => {
                // Another's cluster: remove what the benchmark created.
                for env in [ENV_LIVE, ENV_RECLAIM, ENV_RAW, ENV_START] {
                    let selector = format!("{ENV_LABEL}={env}");
                    for kind in KINDS {
                        let api: Api<DynamicObject> =
                            Api::namespaced_with(self.admin.clone(), &self.namespace, &kind.1());
                        let _ = api
                            .delete_collection(
                                &DeleteParams::background(),
                                &ListParams::default().labels(&selector),
                            )
                            .await;
                    }
                }
            }
        }
    }

    async fn measure(&mut self, args: &RealBenchArgs) -> anyhow::Result<()> {
        let skip = |p: &str| args.skip.iter().any(|s| s == p);
        let probe = session_objects(
            &self.lesson,
            &self.agent,
            &ENV_LIVE.parse()?,
            SessionId::new_random(),
            Utc::now(),
        )?;
        let (vm_bytes, secret_bytes) = probe.sizes();
        println!(
            "ttlabctl bench real ({} build, {} CPUs; {}, namespace {})",
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            },
            std::thread::available_parallelism().map_or(0, usize::from),
            match &self.envtest {
                Some(e) => format!(
                    "the real control plane at {}, KubeVirt simulated",
                    e.plane.server()
                ),
                None => "the cluster of the kubeconfig, VMs Halted".to_owned(),
            },
            self.namespace
        );
        println!(
            "  lesson {}: per session {} VM(s) of {vm_bytes} B, cloud-init Secret(s) of {secret_bytes} B{}{}; agent {} ({} B, ConfigMap {} B, shared)",
            self.lesson.id,
            probe.vms.len(),
            if probe.service.is_some() {
                ", a Service"
            } else {
                ""
            },
            if probe.network_policy.is_some() {
                ", a NetworkPolicy"
            } else {
                ""
            },
            self.agent_path.display(),
            self.agent.binary_len(),
            self.agent.config_map_size_bytes(),
        );
        for env in [ENV_LIVE, ENV_RECLAIM, ENV_RAW, ENV_START] {
            self.ensure_agent_config_map(&env.parse()?).await?;
        }
        let mut live = 0usize;
        if !skip("etcd") {
            live = self.etcd(args).await?;
        }
        if !skip("reclaim") {
            self.reclaim(args).await?;
        }
        if !skip("start") {
            if self.envtest.is_some() {
                self.start_clicks(args).await?;
            } else {
                println!("start: skipped (only on --target envtest, where KubeVirt is simulated)");
            }
        }
        if !skip("noop") {
            self.noop(args, live).await?;
        }
        Ok(())
    }

    async fn ensure_agent_config_map(&self, env: &EnvName) -> anyhow::Result<()> {
        let api: Api<ConfigMap> = Api::namespaced(self.admin.clone(), &self.namespace);
        match api
            .create(&Default::default(), &agent_config_map(&self.agent, env))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
            Err(e) => Err(e).context("creating the agent's ConfigMap"),
        }
    }

    /// A session row in `env`, running, expiring at `expires_at`, for `objects`.
    async fn session_row(
        &self,
        env: &EnvName,
        id: SessionId,
        objects: &SessionObjects,
        expires_at: DateTime<Utc>,
    ) -> anyhow::Result<()> {
        let started_at = expires_at - TimeDelta::minutes(60);
        let sessions = self.store.sessions();
        sessions
            .insert(&NewSession {
                id,
                user: UserId::new(format!("u-{}", id.simple()))?,
                lesson: self.lesson.id.clone(),
                runtime: Runtime::Vm,
                env: env.clone(),
                site: "default".parse()?,
                times: SessionTimes {
                    started_at,
                    expires_at,
                    max_expires_at: started_at + TimeDelta::minutes(180),
                },
                readiness_deadline: started_at + TimeDelta::minutes(5),
            })
            .await?;
        let vms: Vec<SessionVm> = objects
            .vms
            .iter()
            .map(|v| SessionVm {
                node: v.node.clone(),
                name: v.name.clone(),
            })
            .collect();
        sessions.record_vms(id, &vms).await?;
        sessions.mark_running(id, None).await?;
        Ok(())
    }

    /// Creates a session's objects as the server does (under its identity): each VM, then its
    /// Secret owned by it; the first VM owns the Service and the NetworkPolicy. A `halted` VM
    /// is the same object, not started.
    async fn create_objects(&self, objects: &SessionObjects, halted: bool) -> anyhow::Result<()> {
        let mut owner = None;
        for v in &objects.vms {
            let mut vm = v.vm.clone();
            if halted || self.halted {
                vm["spec"]["runStrategy"] = "Halted".into();
            }
            let created = self.server_cluster.create_vm(vm).await?;
            self.server_cluster
                .create_secret(v.secret.to_secret(Some(created.owner_reference())))
                .await?;
            owner.get_or_insert(created.owner_reference());
        }
        let owner = owner.context("a session without VMs")?;
        if let Some(mut s) = objects.service.clone() {
            s.metadata.owner_references = Some(vec![owner.clone()]);
            self.server_cluster.create_service(s).await?;
        }
        if let Some(mut p) = objects.network_policy.clone() {
            p.metadata.owner_references = Some(vec![owner]);
            self.server_cluster.create_network_policy(p).await?;
        }
        Ok(())
    }

    /// `n` sessions of `env` with their objects and rows (live until `expires_at`), created
    /// `SETUP_CONCURRENCY` at a time; stops at the first refusal and returns how many were
    /// created, with the refusal.
    async fn sessions(
        &self,
        env: &EnvName,
        n: usize,
        expires_at: DateTime<Utc>,
        halted: bool,
    ) -> anyhow::Result<(Vec<SessionId>, Option<String>)> {
        let refused = std::sync::Mutex::new(None::<String>);
        let results: Vec<Option<SessionId>> = futures::stream::iter(0..n)
            .map(|_| async {
                if refused.lock().map(|r| r.is_some()).unwrap_or(true) {
                    return None;
                }
                let id = SessionId::new_random();
                let power_off_at = expires_at + TimeDelta::minutes(150);
                let made = async {
                    let objects =
                        session_objects(&self.lesson, &self.agent, env, id, power_off_at)?;
                    self.create_objects(&objects, halted).await?;
                    self.session_row(env, id, &objects, expires_at).await?;
                    anyhow::Ok(())
                }
                .await;
                match made {
                    Ok(()) => Some(id),
                    Err(e) => {
                        if let Ok(mut r) = refused.lock() {
                            r.get_or_insert_with(|| format!("{e:#}"));
                        }
                        None
                    }
                }
            })
            .buffer_unordered(SETUP_CONCURRENCY)
            .collect()
            .await;
        let ids = results.into_iter().flatten().collect();
        Ok((ids, refused.into_inner().unwrap_or(None)))
    }

    /// Names of `kind`'s objects labelled with `env`.
    async fn names(&self, kind: KindOf, env: &str) -> anyhow::Result<BTreeSet<String>> {
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.admin.clone(), &self.namespace, &kind.1());
        Ok(api
            .list_metadata(&ListParams::default().labels(&format!("{ENV_LABEL}={env}")))
            .await
            .with_context(|| format!("listing {}", kind.0))?
            .items
            .into_iter()
            .filter_map(|o| o.metadata.name)
            .collect())
    }

    /// Waits until every VM of `env` has its VMI Running (nothing to wait for when Halted).
    async fn wait_running(&self, env: &str, vms: usize) -> anyhow::Result<()> {
        if self.halted {
            return Ok(());
        }
        let until = Instant::now() + Duration::from_secs(600);
        let api: Api<DynamicObject> =
            Api::namespaced_with(self.admin.clone(), &self.namespace, &VMI.1());
        loop {
            let list = api
                .list(&ListParams::default().labels(&format!("{ENV_LABEL}={env}")))
                .await?;
            let running = list
                .items
                .iter()
                .filter(|v| v.data["status"]["phase"] == "Running")
                .count();
            if running >= vms {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < until,
                "only {running} of {vms} VMIs Running after 600 s"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn reaper_ctx(&self, env: &str) -> anyhow::Result<ReaperContext> {
        Ok(ReaperContext::new(
            self.store.clone(),
            self.reaper_cluster.clone(),
            env.parse()?,
        )
        .with_settings(ReaperSettings::default()))
    }

    async fn etcd(&self, args: &RealBenchArgs) -> anyhow::Result<usize> {
        let n = args.live.min(1000);
        let Some(e) = &self.envtest else {
            println!("etcd: skipped (etcd's metrics are read on --target envtest only)");
            return Ok(0);
        };
        let read = |name: &str| -> anyhow::Result<f64> {
            e.plane
                .etcd_metric(name)?
                .with_context(|| format!("etcd reports no {name}"))
        };
        let total = "etcd_mvcc_db_total_size_in_bytes";
        let in_use = "etcd_mvcc_db_total_size_in_use_in_bytes";
        let (t0, u0) = (read(total)?, read(in_use)?);
        let setup = Instant::now();
        let expires = self.store.db_now().await? + TimeDelta::hours(6);
        let (ids, refused) = self.sessions(&ENV_LIVE.parse()?, n, expires, true).await?;
        // etcd updates the gauges as it commits.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (t1, u1) = (read(total)?, read(in_use)?);
        let made = ids.len().max(1) as f64;
        let per = |a: f64, b: f64| (b - a) / made * 1000.0 / 1e6;
        println!(
            "etcd: {} live sessions created in {:.1}s (VMs Halted: no VMI or launcher pod objects)",
            ids.len(),
            setup.elapsed().as_secs_f64()
        );
        if let Some(r) = &refused {
            println!("  refused after {} sessions: {r}", ids.len());
        }
        println!(
            "  db total size {:.1} MB -> {:.1} MB, in use {:.1} MB -> {:.1} MB",
            t0 / 1e6,
            t1 / 1e6,
            u0 / 1e6,
            u1 / 1e6
        );
        let per_in_use = per(u0, u1);
        println!(
            "  per 1,000 live sessions: total +{:.1} MB, in use +{per_in_use:.1} MB; target in use <= {ETCD_TARGET_MB:.0} MB: {}",
            per(t0, t1),
            verdict(per_in_use <= ETCD_TARGET_MB && refused.is_none())
        );
        Ok(ids.len())
    }

    /// `n` sessions' objects in `env` as the server creates them, `SETUP_CONCURRENCY` at a
    /// time, their VMs Halted when `halted`; each session's id and objects.
    async fn session_objects_of(
        &self,
        env: &EnvName,
        n: usize,
        power_off_at: DateTime<Utc>,
        halted: bool,
    ) -> anyhow::Result<Vec<(SessionId, SessionObjects)>> {
        let made: Vec<anyhow::Result<(SessionId, SessionObjects)>> = futures::stream::iter(0..n)
            .map(|_| async {
                let id = SessionId::new_random();
                let objects = session_objects(&self.lesson, &self.agent, env, id, power_off_at)?;
                self.create_objects(&objects, halted).await?;
                Ok((id, objects))
            })
            .buffer_unordered(SETUP_CONCURRENCY)
            .collect()
            .await;
        made.into_iter().collect()
    }

    /// Polls (every 100 ms) until no VM and no Secret of `env` is left and, with `rows`, no
    /// session of `env` is live: when each happened, `None` if not within `within`.
    async fn wait_reclaimed(
        &self,
        env: &EnvName,
        rows: bool,
        within: Duration,
    ) -> anyhow::Result<(Option<Instant>, Option<Instant>)> {
        let until = Instant::now() + within;
        let (mut gone, mut last) = (None, None);
        while Instant::now() < until {
            if gone.is_none() {
                let mut left = 0;
                for kind in [VM, SECRET] {
                    left += self.names(kind, env.as_str()).await.map_or(1, |n| n.len());
                }
                if left == 0 {
                    gone = Some(Instant::now());
                }
            }
            if rows && last.is_none() && self.store.sessions().count_live(env).await? == 0 {
                last = Some(Instant::now());
            }
            if gone.is_some() && (last.is_some() || !rows) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok((gone, last))
    }

    async fn reclaim(&self, args: &RealBenchArgs) -> anyhow::Result<()> {
        let n = args.sessions.max(1);
        let env: EnvName = ENV_RECLAIM.parse()?;
        // Without guests, the VMs are Halted: the simulated KubeVirt still holds each by its
        // finalizer until it has seen the deletion, as real KubeVirt does, but no guest boots
        // or shuts down, so the figures are the API server's and the reaper's, not a
        // thousand simulated guests'.
        let halted = self.halted || args.reclaim_guests == ReclaimGuests::None;
        let what = if halted { "Halted" } else { "Running" };
        // Objects first; then the rows, expiring together a moment later.
        let setup = Instant::now();
        let far = self.store.db_now().await? + TimeDelta::hours(6);
        let made = self
            .session_objects_of(&env, n, far + TimeDelta::minutes(150), halted)
            .await?;
        let vm_count: usize = made.iter().map(|(_, o)| o.vms.len()).sum();
        let objects: usize = made.iter().map(|(_, o)| o.count()).sum();
        if !halted {
            self.wait_running(ENV_RECLAIM, vm_count).await?;
        }
        // The reaper as the long-running binary runs it: its watch-fed listings filled first.
        let ctx = self
            .reaper_ctx(ENV_RECLAIM)?
            .with_cached_listings(ttlab_reaper::DEFAULT_RELIST_EVERY);
        let fill = Instant::now();
        while !ctx.cached_listings_ready() {
            anyhow::ensure!(
                fill.elapsed() < Duration::from_secs(120),
                "the reaper's watch-fed listings did not fill within 2 minutes"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let lead = Duration::from_secs(2) + Duration::from_millis(5 * n as u64);
        let db_now = self.store.db_now().await?;
        let local_now = Instant::now();
        let expires_at = db_now + TimeDelta::from_std(lead)?;
        let expiry = local_now + lead;
        let rows: Vec<anyhow::Result<()>> = futures::stream::iter(&made)
            .map(|(id, objects)| self.session_row(&env, *id, objects, expires_at))
            .buffer_unordered(SETUP_CONCURRENCY)
            .collect()
            .await;
        rows.into_iter().collect::<anyhow::Result<()>>()?;
        anyhow::ensure!(
            Instant::now() < expiry,
            "the rows took longer than the {lead:?} lead to write"
        );
        println!(
            "reclaim: {n} expired sessions, {objects} objects ({vm_count} VMs {what}{}, their Secrets{}), set up in {:.1}s",
            if halted {
                ": no guests"
            } else {
                ", simulated guests"
            },
            if objects > 2 * vm_count {
                ", Services, NetworkPolicies"
            } else {
                ""
            },
            setup.elapsed().as_secs_f64()
        );
        let shutdown = ctx.shutdown.clone();
        let reaper = tokio::spawn(ttlab_reaper::run(
            ctx,
            Duration::from_secs(60),
            Arc::new(Metrics::new()),
        ));
        let within = Duration::from_secs(600);
        let (gone, last) = self.wait_reclaimed(&env, true, within + lead).await?;
        shutdown.cancel();
        let _ = reaper.await;
        let (Some(gone), Some(last)) = (gone, last) else {
            println!("  not all reclaimed within {within:?}; no figure");
            return Ok(());
        };
        let since = |t: Instant| t.saturating_duration_since(expiry).as_secs_f64();
        let reclaim = since(last.max(gone));
        println!(
            "  ttlab-reaper (concurrency {}, watch-fed listings), expiry -> every VM and Secret gone {:.2}s, every row final {:.2}s",
            ttlab_reaper::DEFAULT_CONCURRENCY,
            since(gone),
            since(last),
        );

        // The API server's own limit: the same objects, deleted raw.
        let setup = Instant::now();
        let raw_env: EnvName = ENV_RAW.parse()?;
        let raw_made = self.session_objects_of(&raw_env, n, far, halted).await?;
        if !halted {
            self.wait_running(ENV_RAW, vm_count).await?;
        }
        let targets: Vec<(KindOf, String)> = raw_made
            .iter()
            .flat_map(|(_, o)| o.names())
            .map(|(kind, name)| {
                let kind = match kind {
                    Kind::VirtualMachine => VM,
                    Kind::Secret => SECRET,
                    Kind::Service => SERVICE,
                    _ => NETWORK_POLICY,
                };
                (kind, name)
            })
            .collect();
        let started = Instant::now();
        let deleted: Vec<Result<(), kube::Error>> = futures::stream::iter(&targets)
            .map(|(kind, name)| {
                let api: Api<DynamicObject> =
                    Api::namespaced_with(self.admin.clone(), &self.namespace, &kind.1());
                async move {
                    match api.delete(name, &DeleteParams::background()).await {
                        Ok(_) => Ok(()),
                        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                        Err(e) => Err(e),
                    }
                }
            })
            .buffer_unordered(RAW_CONCURRENCY)
            .collect()
            .await;
        let accepted = started.elapsed().as_secs_f64();
        let failed = deleted.iter().filter(|r| r.is_err()).count();
        let (Some(raw_gone), _) = self.wait_reclaimed(&raw_env, false, within).await? else {
            println!("  raw deletes: not all gone within {within:?}; no figure");
            return Ok(());
        };
        let raw = raw_gone.saturating_duration_since(started).as_secs_f64();
        println!(
            "  {RAW_CONCURRENCY} parallel raw deletes of the same {} objects ({vm_count} VMs {what}; set up in {:.1}s): all accepted {accepted:.2}s, all gone {raw:.2}s{}",
            targets.len(),
            started.saturating_duration_since(setup).as_secs_f64(),
            if failed > 0 {
                format!(" ({failed} refused)")
            } else {
                String::new()
            }
        );
        let ratio = reclaim / raw;
        println!(
            "  reaper (rows final included) / raw deletes: {ratio:.2}x; target <= {RECLAIM_RATIO_TARGET}x: {}",
            verdict(ratio <= RECLAIM_RATIO_TARGET)
        );
        Ok(())
    }

    async fn start_clicks(&self, args: &RealBenchArgs) -> anyhow::Result<()> {
        let server_bin = match &args.server_binary {
            Some(p) => p.clone(),
            None => beside_me("ttlab-server")?,
        };
        let secret = random_secret()?;
        let listen = SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            crate::dev::demo::stack::free_loopback_port()?,
        ));
        let url = format!("http://{listen}");
        let mut env: Vec<(&str, OsString)> = vec![
            ("DATABASE_URL", self.db.url().into()),
            ("KUBECONFIG", self.server_kubeconfig.clone().into()),
            ("TTLAB_ENV", ENV_START.into()),
            ("TTLAB_NAMESPACE", self.namespace.clone().into()),
            ("TTLAB_LISTEN", listen.to_string().into()),
            ("TTLAB_AUTH_SECRET", secret.clone().into()),
            ("TTLAB_LESSONS", self.lessons_path.clone().into()),
            ("TTLAB_AGENT_BINARY", self.agent_path.clone().into()),
            // The limit counts every VM of the namespace (the live ones of the other phases too).
            (
                "TTLAB_VM_LIMIT",
                (args.live + 2 * args.sessions + 2 * args.clicks + 100)
                    .to_string()
                    .into(),
            ),
            ("TTLAB_SESSION_TTL", "60m".into()),
            ("NO_COLOR", "1".into()),
        ];
        if std::env::var_os("RUST_LOG").is_none() {
            env.push(("RUST_LOG", "error".into()));
        }
        let mut server = ChildProcess::spawn("server", &server_bin, &[], &env)?;
        let result = async {
            wait_ready(&mut server, &url).await?;
            self.clicks(args, &url, &secret).await
        }
        .await;
        if let Err(e) = server.stop(Duration::from_secs(15)).await {
            eprintln!("ttlabctl: stopping the server: {e:#}");
        }
        result
    }

    async fn clicks(&self, args: &RealBenchArgs, url: &str, secret: &str) -> anyhow::Result<()> {
        let auth = AuthConfig::new(AuthSecret::new(secret.as_bytes())?);
        let now = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let tokens: Vec<String> = (0..args.clicks)
            .map(|i| {
                let user =
                    UserId::new(format!("click-{i:05}")).map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(auth.mint(&user, Role::Student, now, Duration::from_secs(3 * 3600))?)
            })
            .collect::<anyhow::Result<_>>()?;
        let http = client::client(args.clicks.max(1));
        let post = format!("{url}/api/sessions");
        let body = serde_json::json!({ "lesson": self.lesson.id.as_str() });
        let clicked = self.store.db_now().await?;
        let answers = futures::future::join_all(
            tokens
                .iter()
                .map(|t| client::send(&http, Method::POST, &post, Some(t), Some(&body))),
        )
        .await;
        let mut ids = Vec::new();
        let mut refused = Vec::new();
        for a in answers {
            match a {
                Ok((status, body)) if status == http::StatusCode::ACCEPTED => {
                    let v: serde_json::Value = serde_json::from_slice(&body)?;
                    ids.push(
                        v["id"]
                            .as_str()
                            .and_then(|s| s.parse::<SessionId>().ok())
                            .context("the 202 answer has no session id")?,
                    );
                }
                Ok((status, body)) => {
                    refused.push(format!("{status}: {}", String::from_utf8_lossy(&body)))
                }
                Err(e) => refused.push(format!("{e:#}")),
            }
        }
        let deadline = Instant::now() + args.ready_timeout;
        let mut delays = Vec::new();
        let mut failed = Vec::new();
        for id in &ids {
            loop {
                let s = self
                    .store
                    .sessions()
                    .get(*id)
                    .await?
                    .with_context(|| format!("session {id} vanished"))?;
                if s.status == SessionStatus::Running {
                    if let Some(r) = s.ready_at {
                        delays.push((r - clicked).num_milliseconds() as f64 / 1000.0);
                    }
                    break;
                }
                if s.status != SessionStatus::Starting || Instant::now() > deadline {
                    failed.push(format!(
                        "{} {}{}",
                        s.id,
                        s.status.as_str(),
                        s.failure_reason
                            .map(|r| format!(" ({r})"))
                            .unwrap_or_default()
                    ));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        delays.sort_by(f64::total_cmp);
        println!(
            "start: {} \"Start lab\" clicks at once (real ttlab-server over HTTP), click -> running (ready_at, database clock):",
            args.clicks
        );
        println!(
            "  p50 {:.2}s  p99 {:.2}s  max {:.2}s  ({} running, {} refused, {} not running)",
            percentile(&delays, 50.0),
            percentile(&delays, 99.0),
            delays.last().copied().unwrap_or(f64::NAN),
            delays.len(),
            refused.len(),
            failed.len()
        );
        for r in refused.iter().chain(&failed).take(5) {
            println!("    {}", one_line(r));
        }
        Ok(())
    }

    async fn noop(&self, args: &RealBenchArgs, already: usize) -> anyhow::Result<()> {
        let setup = Instant::now();
        let want = args.live.saturating_sub(already);
        let expires = self.store.db_now().await? + TimeDelta::hours(6);
        let (ids, refused) = self
            .sessions(&ENV_LIVE.parse()?, want, expires, true)
            .await?;
        let live = already + ids.len();
        println!(
            "noop: {live} live sessions (VMs Halted, their real-size Secrets), {} created in {:.0}s",
            ids.len(),
            setup.elapsed().as_secs_f64()
        );
        if let Some(r) = &refused {
            println!(
                "  the API server refused a create after {live} live sessions: {}",
                one_line(r)
            );
        }
        // As the long-running ttlab-reaper does: VMs and Secrets from watch-fed listings.
        let fill = Instant::now();
        let ctx = self
            .reaper_ctx(ENV_LIVE)?
            .with_cached_listings(ttlab_reaper::DEFAULT_RELIST_EVERY);
        while !ctx.cached_listings_ready() {
            anyhow::ensure!(
                fill.elapsed() < Duration::from_secs(300),
                "the reaper's watch-fed listings did not fill within 5 minutes"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!(
            "  the reaper's watch-fed listings of VMs and Secrets filled in {:.3}s (rebuilt every {}s)",
            fill.elapsed().as_secs_f64(),
            ttlab_reaper::DEFAULT_RELIST_EVERY.as_secs()
        );
        let mut took = Vec::new();
        for run in 1..=args.runs.max(1) {
            let report = reap_once(&ctx).await;
            let acted =
                report.expired.done + report.orphans.done + report.ghosts.done + report.stuck.done;
            println!(
                "  run {run}: {:.3}s{}{}",
                report.duration.as_secs_f64(),
                if acted > 0 {
                    format!(" (acted: {})", report.summary())
                } else {
                    String::new()
                },
                if report.ran() && report.cluster_listed {
                    String::new()
                } else {
                    " (the cycle did not list the cluster)".to_owned()
                }
            );
            took.push(report.duration.as_secs_f64());
        }
        let (median, worst) = median_and_worst(&took);
        println!(
            "  no-op cycle in process, {} runs: median {median:.3}s, worst {worst:.3}s; target median <= {NOOP_TARGET}s: {}",
            took.len(),
            verdict(median <= NOOP_TARGET)
        );
        self.noop_breakdown().await?;
        self.reaper_binary(args).await
    }

    /// Where a no-op cycle's time would go without the watch-fed listings: the database read
    /// and each large listing alone, at the reaper's page size and at a larger one.
    async fn noop_breakdown(&self) -> anyhow::Result<()> {
        let env: EnvName = ENV_LIVE.parse()?;
        let page = ReaperSettings::default().page_size;
        let t = Instant::now();
        let (mut after, mut rows) = (None, 0usize);
        loop {
            let got = self.store.sessions().list_live(&env, after, page).await?;
            rows += got.len();
            after = got.last().map(|s| s.id);
            if got.len() < page as usize {
                break;
            }
        }
        println!(
            "  alone: database live sessions {:.3}s ({rows} rows, pages of {page})",
            t.elapsed().as_secs_f64()
        );
        let selector = ttlab_model::labels::env_selector(&env);
        for page_size in [ClusterSettings::default().page_size, 5000] {
            let cluster = KubeCluster::from_kubeconfig(
                &self.reaper_kubeconfig,
                ClusterSettings {
                    page_size,
                    ..ClusterSettings::in_namespace(&self.namespace)
                },
            )
            .await?;
            for kind in [Kind::VirtualMachine, Kind::Secret] {
                let t = Instant::now();
                let n = cluster.list_all(kind, &selector).await?.len();
                println!(
                    "  alone: list {kind} metadata, pages of {page_size}: {:.3}s ({n} objects)",
                    t.elapsed().as_secs_f64()
                );
            }
        }
        Ok(())
    }

    /// Runs the real `ttlab-reaper` over the live sessions until its first cycle is recorded,
    /// then reads its peak resident memory and stops it.
    async fn reaper_binary(&self, args: &RealBenchArgs) -> anyhow::Result<()> {
        let binary = match &args.reaper_binary {
            Some(p) => p.clone(),
            None => beside_me("ttlab-reaper")?,
        };
        let env: EnvName = ENV_LIVE.parse()?;
        let before = self
            .store
            .reaper_cycles()
            .recent(Some(&env), 1)
            .await?
            .first()
            .map(|c| c.id);
        let metrics = SocketAddr::from((
            Ipv4Addr::LOCALHOST,
            crate::dev::demo::stack::free_loopback_port()?,
        ));
        let mut child = tokio::process::Command::new(&binary)
            .env("DATABASE_URL", self.db.url())
            .env("KUBECONFIG", &self.reaper_kubeconfig)
            .env("TTLAB_ENV", ENV_LIVE)
            .env("TTLAB_NAMESPACE", &self.namespace)
            .env("TTLAB_METRICS_LISTEN", metrics.to_string())
            .env("TTLAB_REAP_INTERVAL", "1h")
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", binary.display()))?;
        let pid = child.id().context("reaper pid")?;
        let give_up = Instant::now() + Duration::from_secs(300);
        let cycle = loop {
            let latest = self.store.reaper_cycles().recent(Some(&env), 1).await?;
            if let Some(c) = latest.into_iter().next()
                && Some(c.id) != before
            {
                break Some(c);
            }
            if Instant::now() > give_up {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let hwm = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok());
        let _ = child.start_kill();
        let _ = child.wait().await;
        match (cycle, hwm) {
            (Some(c), Some(hwm)) => {
                let mb = hwm as f64 / 1024.0;
                println!(
                    "  ttlab-reaper binary ({}): first cycle {:.3}s, peak resident {mb:.1} MB; target < {RSS_TARGET_MB:.0} MB: {}",
                    binary.display(),
                    c.cycle.duration.as_secs_f64(),
                    verdict(mb < RSS_TARGET_MB)
                );
            }
            _ => println!(
                "  ttlab-reaper binary: no cycle recorded within 300 s; memory not measured"
            ),
        }
        Ok(())
    }
}

/// A kind: its name in messages and its API resource.
type KindOf = (&'static str, fn() -> ApiResource);

fn ar(group: &str, version: &str, kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

const VM: KindOf = ("VirtualMachines", || {
    ar("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")
});
const VMI: KindOf = ("VirtualMachineInstances", || {
    ar(
        "kubevirt.io",
        "v1",
        "VirtualMachineInstance",
        "virtualmachineinstances",
    )
});
const SECRET: KindOf = ("Secrets", || ar("", "v1", "Secret", "secrets"));
const SERVICE: KindOf = ("Services", || ar("", "v1", "Service", "services"));
const NETWORK_POLICY: KindOf = ("NetworkPolicies", || {
    ar(
        "networking.k8s.io",
        "v1",
        "NetworkPolicy",
        "networkpolicies",
    )
});

/// What the benchmark may create in a namespace, and so what it checks is its own.
const KINDS: [KindOf; 8] = [
    VM,
    VMI,
    SECRET,
    ("ConfigMaps", || ar("", "v1", "ConfigMap", "configmaps")),
    SERVICE,
    ("Pods", || ar("", "v1", "Pod", "pods")),
    NETWORK_POLICY,
    ("PersistentVolumeClaims", || {
        ar("", "v1", "PersistentVolumeClaim", "persistentvolumeclaims")
    }),
];

/// Refuses a namespace that holds objects this benchmark did not create (labelled with one
/// of its environments), but for what the cluster itself puts in every namespace
/// (`kube-root-ca.crt`) and, on the control plane started here, the shipped `deploy/`
/// objects.
async fn refuse_foreign_objects(admin: &kube::Client, namespace: &str) -> anyhow::Result<()> {
    let mut foreign = Vec::new();
    for (what, resource) in KINDS {
        let api: Api<DynamicObject> = Api::namespaced_with(admin.clone(), namespace, &resource());
        let list = match api.list_metadata(&ListParams::default()).await {
            Ok(l) => l,
            // A kind the cluster does not serve (no KubeVirt CRDs): nothing of it there.
            Err(kube::Error::Api(e)) if e.code == 404 => continue,
            Err(e) => return Err(e).with_context(|| format!("listing {what} in {namespace}")),
        };
        for o in list.items {
            let name = o.metadata.name.clone().unwrap_or_default();
            let ours = o
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get(ENV_LABEL))
                .is_some_and(|e| e.starts_with(ENV_PREFIX));
            let cluster_own = what == "ConfigMaps" && name == "kube-root-ca.crt";
            let shipped = o
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("app.kubernetes.io/part-of"))
                .is_some_and(|v| v == "ttlab")
                && what == "NetworkPolicies";
            if !ours && !cluster_own && !shipped {
                foreign.push(format!("{what} {name}"));
            }
        }
    }
    if !foreign.is_empty() {
        let shown: Vec<&str> = foreign.iter().take(5).map(String::as_str).collect();
        anyhow::bail!(
            "namespace {namespace} holds {} object(s) this benchmark did not create ({}{}): \
             it creates, deletes and reclaims objects there, so it runs only in a namespace of \
             its own",
            foreign.len(),
            shown.join(", "),
            if foreign.len() > shown.len() {
                ", …"
            } else {
                ""
            }
        );
    }
    Ok(())
}

async fn client_of(path: &Path) -> anyhow::Result<kube::Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(path)
        .with_context(|| format!("reading {}", path.display()))?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await
    .with_context(|| format!("using {}", path.display()))?;
    Ok(kube::Client::try_from(config)?)
}

pub(crate) fn beside_me(name: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::current_exe()?
        .parent()
        .context("the directory of ttlabctl")?
        .join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found (build it, or name it with --{}-binary)",
        path.display(),
        name.trim_start_matches("ttlab-")
    );
    Ok(path)
}

fn one_line(s: &str) -> String {
    let line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.len() > 300 {
        format!("{}…", &line[..line.floor_char_boundary(300)])
    } else {
        line
    }
}
