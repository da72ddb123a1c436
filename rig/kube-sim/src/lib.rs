//! kube-sim: a Kubernetes-API-compatible HTTP server with a simulated KubeVirt, for tests,
//! benchmarks and the demo.
//!
//! It owns a faithful stand-in for the parts of the Kubernetes API the backend uses — the REST
//! paths, discovery and OpenAPI entries kubectl and kube-rs need, CRUD with `Status` errors,
//! label/field selectors, pagination over consistent snapshots, metadata-only answers
//! (`PartialObjectMetadata[List]`), watches from a resourceVersion (`410 Expired` once it has
//! left the retained history), finalizers, owner-reference garbage collection, ResourceQuota
//! admission judged by the status an asynchronous quota controller writes — with KubeVirt, the
//! scheduler and the kubelet played by `ttlab-kubevirt-sim` (below). Pod exec speaks the
//! Kubernetes channel protocols (`v5.channel.k8s.io` … `channel.k8s.io`) to a small simulated
//! shell, as kube-rs' `Api::<Pod>::exec` and `kubectl exec` expect. Faults (failed,
//! hanging or slow calls) can be injected and every call is recorded, in RBAC terms (user,
//! verb, group, resource, subresource, namespace): the user is the one a bearer token the sim
//! issued names ([`KubeSim::token_for`]) or the one a kubeconfig acts as (`as:`).
//!
//! Where clients depend on timing, it keeps the real server's: an exec's process starts a
//! while after the upgrade ([`SimConfig::exec_start`]), a quota's status lags its changes
//! ([`SimConfig::quota_sync`]), changes leave the watch history ([`SimConfig::watch_history`]),
//! and a VMI is Running before its guest's agent listens ([`Timings::boot`]). Dry runs
//! (`?dryRun=All`) of creates, updates and patches get the checks and refusals of the real
//! call (a create in a namespace that does not exist is `404`, even when the same dry run
//! "created" it) and store nothing.
//!
//! Identified users are authorized by RBAC, with the Roles and bindings given to
//! [`KubeSim::apply_rbac`] (the shipped `deploy/` objects, say): a call no rule allows gets
//! the real server's `403 Forbidden`. Calls without credentials are the administrator's.
//!
//! By default its KubeVirt, scheduler and kubelet are `ttlab-kubevirt-sim`
//! ([`Controllers::KubevirtSim`]), the controller that plays them on a real kube-apiserver too,
//! started beside it and talking to it through the API only: kube-sim then serves Nodes,
//! `pods/binding` and the graceful deletion of bound pods as a real API server does, relays
//! the console subresource to kubevirt-sim's console server, and the controller's identity
//! ([`CONTROLLER_USER`]) stays beside RBAC, injected faults and the call record. A
//! VirtualMachine with a run strategy gets a VirtualMachineInstance and a virt-launcher pod
//! that go through the real phases; its guest applies the cloud-init from the VM's Secret into
//! a per-VM directory and runs the real `ttlab-agent` on a loopback address of its own, or is
//! a real qemu guest ([`guest::GuestBackend::Qemu`]). [`Controllers::External`] leaves the
//! controllers to whoever runs them.
//!
//! It refuses to own anything production runs: no TLS, no persistence, no real scheduling or
//! networking; nothing outside tests and `ttlabctl` depends on it.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use ttlab_kube_sim::{KubeSim, SimConfig};
//!
//! let sim = KubeSim::start(SimConfig::for_tests()).await.unwrap();
//! assert!(sim.url().starts_with("http://127.0.0.1:"));
//! let kubeconfig = sim.kubeconfig_yaml("default");
//! assert!(kubeconfig.contains(sim.url()));
//! assert_eq!(sim.stats().peak_vms, 0);
//! sim.shutdown().await;
//! # });
//! ```

mod api;
mod auth;
mod console;
mod control;
mod controllers;
mod discovery;
mod exec;
pub mod faults;
pub mod guest;
mod metadata;
mod patch;
mod quota;
mod rbac;
pub mod resources;
pub mod selector;
pub mod status;
pub mod store;
mod terminal;
pub mod validate;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use faults::{CallRecord, FaultAction, FaultRule, Faults, Verb};
pub use rbac::RbacError;

/// Errors of the in-process API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The listen address is not a loopback address.
    #[error("kube-sim listens on loopback addresses only, not {0}")]
    NotLoopback(SocketAddr),
    /// A file (kubeconfig, guest directory) could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No VirtualMachineInstance with this namespace and name exists.
    #[error("no VirtualMachineInstance {namespace}/{name}")]
    NoSuchVmi {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The VirtualMachineInstance is not running (a power-off needs a running guest).
    #[error("VirtualMachineInstance {namespace}/{name} is not running")]
    NotRunning {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The API refused an object given through the in-process API.
    #[error("the API refused the object: {0}")]
    Api(String),
}

/// A phase in which new VMIs can be held ([`KubeSim::hold_starting_vmis`]).
pub use ttlab_kubevirt_sim::StartingPhase;
/// What the simulated guest's setup does for a lesson: the readiness marker (or the failure
/// marker) is written [`Timings::setup`] after the guest's agent listens, or never.
pub use ttlab_sim_guest::SetupOutcome;

/// Delays of the simulation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timings {
    /// VMI created → Scheduling (and launcher pod created).
    pub pending: Duration,
    /// Scheduling → Scheduled.
    pub scheduling: Duration,
    /// Scheduled → the guest booted and its agent listening. The VMI is `Running` after the
    /// first half (the domain started, as KubeVirt reports it while the guest still boots);
    /// the agent listens after the second half, and refuses connections until then. A qemu
    /// guest reports Running after all of it, and boots for real from there.
    pub boot: Duration,
    /// Running → readiness (or failure) marker written (not before the agent listens).
    pub setup: Duration,
    /// Deleted VMI → gone (the guest's shutdown grace).
    pub stop: Duration,
    /// Owner gone → dependents deleted.
    pub gc: Duration,
    /// Pod created → Running, for pods that are not virt-launchers.
    pub pod_start: Duration,
    /// How often a watch that allows bookmarks gets one.
    pub bookmark: Duration,
}

impl Timings {
    /// Delays close to a real small cluster (seconds).
    pub fn realistic() -> Self {
        Self {
            pending: Duration::from_millis(500),
            scheduling: Duration::from_secs(2),
            boot: Duration::from_secs(15),
            setup: Duration::from_secs(20),
            stop: Duration::from_secs(3),
            gc: Duration::from_millis(200),
            pod_start: Duration::from_secs(2),
            bookmark: Duration::from_secs(60),
        }
    }

    /// Short delays for tests (tens of milliseconds).
    pub fn fast() -> Self {
        Self {
            pending: Duration::from_millis(10),
            scheduling: Duration::from_millis(10),
            boot: Duration::from_millis(20),
            setup: Duration::from_millis(30),
            stop: Duration::from_millis(10),
            gc: Duration::from_millis(1),
            pod_start: Duration::from_millis(10),
            bookmark: Duration::from_secs(1),
        }
    }
}

/// Configuration of a simulated cluster.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Where to listen (must be loopback; port 0 picks a free one).
    pub listen: SocketAddr,
    /// Namespaces that exist from the start.
    pub namespaces: Vec<String>,
    /// Delays of the simulation.
    pub timings: Timings,
    /// Setup outcome by lesson label value; lessons not listed get [`SetupOutcome::Ready`].
    pub lesson_setup: BTreeMap<String, SetupOutcome>,
    /// Where the per-VM guest directories go (a temporary directory, removed at shutdown,
    /// if `None`).
    pub guest_root: Option<PathBuf>,
    /// Guest addresses are allocated from `127.<second octet>.x.y`.
    pub guest_ip_second_octet: u8,
    /// Publish pod and VMI addresses that nothing routes (`192.0.2.0/24`) while the guests
    /// listen on their loopback addresses (kubevirt-sim's `unroutable_pod_ips`): the pod
    /// network is out of the clients' reach, the `portforward` subresource still gets there.
    pub unroutable_pod_ips: bool,
    /// An agent binary every simulated guest runs when its cloud-init installed none
    /// (kubevirt-sim's `agent_binary`; `None`: such a guest has no agent).
    pub agent_binary: Option<PathBuf>,
    /// The port the guest agent is started on.
    pub agent_port: u16,
    /// Memory the virt-launcher pod requests on top of the guest's request (counts in a
    /// `requests.memory` quota).
    pub launcher_memory_overhead_mib: u64,
    /// Seed of the generator behind `fraction` fault rules.
    pub seed: u64,
    /// Most calls kept in the record.
    pub max_call_records: usize,
    /// How long a pod exec's process takes to start after the WebSocket upgrade: on a real
    /// cluster the API server first reaches the kubelet and the container runtime starts the
    /// process, so no output (nor the exit status) can follow the `101` at once. Clients
    /// depend on that gap: kubectl before 1.34 registers its streams while its reader already
    /// runs, and drops frames that arrive before (see `exec.rs`).
    pub exec_start: Duration,
    /// How long the quota controller takes to react: to fill a new quota's status (until
    /// then the quota covers nothing), to apply a changed `spec.hard`, and to recount usage
    /// after a deletion (what it frees is free only then).
    pub quota_sync: Duration,
    /// How often the quota controller recounts every quota whatever happened
    /// (kube-controller-manager's `--resource-quota-sync-period`, 5 minutes): until then,
    /// usage admission charged for a create that failed in storage (a `409 AlreadyExists`)
    /// stays counted unless a deletion in the namespace makes it recount sooner.
    pub quota_resync: Duration,
    /// How long a change stays in the watch history (the API server's watch cache: 75 s, and
    /// at least the last 100 changes of each type). A watch from an older resourceVersion
    /// gets `410 Expired`, as does one from before [`KubeSim::compact_history`].
    pub watch_history: Duration,
    /// What a VMI's guest is: simulated (the default, a moment to boot) or a real qemu guest
    /// ([`guest::GuestBackend::Qemu`], a minute or more under TCG).
    pub guest: guest::GuestBackend,
    /// Who plays KubeVirt, the scheduler and the kubelet: `ttlab-kubevirt-sim` through the API,
    /// as on a real API server (the default), or a controller started by someone else.
    pub controllers: Controllers,
}

/// The identity of the controllers that play KubeVirt, the scheduler and the kubelet from
/// outside ([`Controllers::External`], through [`KubeSim::controller_kubeconfig_yaml`]): like
/// the control plane's own, their calls are always authorized, no fault or latency injected
/// for the clients under test touches them, and they are not in [`KubeSim::calls`].
pub const CONTROLLER_USER: &str = "system:kube-sim:controllers";

/// Who plays KubeVirt, the scheduler and the kubelet of a simulated cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Controllers {
    /// A controller outside does, through the API only (`ttlab-kubevirt-sim`, the way it does
    /// on a real kube-apiserver): kube-sim runs no KubeVirt, no scheduler and no kubelet; it
    /// serves Nodes and the `pods/binding` subresource, and, as a real API server does,
    /// deletes a pod bound to a node gracefully (marked, with its grace period) until its
    /// kubelet confirms with a delete of grace period 0.
    External,
    /// As [`Controllers::External`], with `ttlab-kubevirt-sim` started by [`KubeSim::start`]
    /// on every namespace (those created later too), its delays from [`SimConfig::timings`],
    /// as [`CONTROLLER_USER`]. [`KubeSim::power_off`], [`KubeSim::crash`],
    /// [`KubeSim::pause_kubevirt`], [`KubeSim::set_lesson_setup`] and the guest accessors go
    /// to it, and the serial console subresource is relayed to its console server (a qemu
    /// guest's serial port with [`guest::GuestBackend::Qemu`]). The default.
    #[default]
    KubevirtSim,
}

impl SimConfig {
    /// Realistic delays, listening on `listen`, with namespace `default`.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            namespaces: vec!["default".into()],
            timings: Timings::realistic(),
            lesson_setup: BTreeMap::new(),
            guest_root: None,
            guest_ip_second_octet: 100,
            unroutable_pod_ips: false,
            agent_binary: None,
            agent_port: ttlab_agent::protocol::PORT,
            launcher_memory_overhead_mib: 0,
            seed: 1,
            max_call_records: 1_000_000,
            exec_start: Duration::from_millis(150),
            quota_sync: Duration::from_secs(1),
            quota_resync: Duration::from_secs(5 * 60),
            watch_history: store::HISTORY_WINDOW,
            guest: guest::GuestBackend::Simulated,
            controllers: Controllers::KubevirtSim,
        }
    }

    /// Port 0 on 127.0.0.1, fast delays, namespaces `default` and `ttlab`.
    pub fn for_tests() -> Self {
        Self {
            namespaces: vec!["default".into(), "ttlab".into()],
            timings: Timings::fast(),
            // Short, but long enough that a client stalled by a loaded machine has set up its
            // streams before the first output.
            exec_start: Duration::from_millis(100),
            quota_sync: Duration::from_millis(20),
            ..Self::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))
        }
    }
}

/// Counters of the simulated cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SimStats {
    /// VirtualMachines now.
    pub vms: usize,
    /// VirtualMachineInstances now.
    pub vmis: usize,
    /// Most VirtualMachines that ever existed at once.
    pub peak_vms: usize,
    /// Most VirtualMachineInstances that ever existed at once.
    pub peak_vmis: usize,
    /// Current resourceVersion.
    pub resource_version: u64,
    /// Whether the KubeVirt simulation is paused.
    pub kubevirt_paused: bool,
}

/// Shared state of a running sim.
pub(crate) struct Sim {
    pub(crate) store: Mutex<store::Store>,
    pub(crate) faults: Faults,
    pub(crate) config: SimConfig,
    pub(crate) paused: watch::Sender<bool>,
    /// The controls of ttlab-kubevirt-sim, when it is the controllers
    /// ([`Controllers::KubevirtSim`]): the guest controls go there instead.
    pub(crate) kubevirt_sim: std::sync::OnceLock<ttlab_kubevirt_sim::Controls>,
    /// Where kubevirt-sim serves its consoles then (plain, behind this server).
    pub(crate) kubevirt_console: std::sync::OnceLock<SocketAddr>,
    pub(crate) quota: quota::Controller,
    pub(crate) tokens: auth::Tokens,
    pub(crate) rbac: rbac::Rbac,
    pub(crate) guest_root: PathBuf,
    pub(crate) shutdown: CancellationToken,
}

impl Sim {
    /// Pauses or resumes KubeVirt, whichever simulator plays it.
    pub(crate) fn pause_kubevirt(&self, paused: bool) {
        if let Some(k) = self.kubevirt_sim.get() {
            k.pause(paused);
        }
        self.paused.send_replace(paused);
    }

    /// The guest of VMI `namespace/name` powers off or crashes.
    pub(crate) fn end_guest(
        &self,
        namespace: &str,
        name: &str,
        how: ttlab_kubevirt_sim::GuestEnd,
    ) -> Result<(), Error> {
        let refused = || {
            if self.store().get(resources::VMIS, namespace, name).is_none() {
                Error::NoSuchVmi {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                }
            } else {
                Error::NotRunning {
                    namespace: namespace.to_owned(),
                    name: name.to_owned(),
                }
            }
        };
        let Some(k) = self.kubevirt_sim.get() else {
            return Err(refused());
        };
        match how {
            ttlab_kubevirt_sim::GuestEnd::PowerOff => k.power_off(namespace, name),
            ttlab_kubevirt_sim::GuestEnd::Crash => k.crash(namespace, name),
        }
        .map_err(|e| {
            // 404 when the VMI is gone, 409 otherwise.
            tracing::debug!(namespace, name, error = %e, "kubevirt-sim refused a guest end");
            refused()
        })
    }

    /// What kubevirt-sim shows of a guest.
    pub(crate) fn guest_info(
        &self,
        namespace: &str,
        name: &str,
    ) -> Option<ttlab_kubevirt_sim::GuestInfo> {
        self.kubevirt_sim.get()?.guest(namespace, name)
    }

    /// Sets what the guest setup does for a lesson.
    pub(crate) fn set_lesson_setup(&self, lesson: &str, outcome: SetupOutcome) {
        if let Some(k) = self.kubevirt_sim.get() {
            k.set_setup_outcome(lesson, outcome);
        }
    }

    pub(crate) fn store(&self) -> std::sync::MutexGuard<'_, store::Store> {
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(crate) fn stats(&self) -> SimStats {
        let s = self.store();
        let (peak_vms, peak_vmis) = s.peaks();
        SimStats {
            vms: s.count(resources::VMS),
            vmis: s.count(resources::VMIS),
            peak_vms,
            peak_vmis,
            resource_version: s.resource_version(),
            kubevirt_paused: *self.paused.borrow(),
        }
    }
}

/// A running simulated cluster. Dropping it stops the server, the simulation and every guest
/// agent process.
pub struct KubeSim {
    sim: Arc<Sim>,
    addr: SocketAddr,
    url: String,
    server: Option<tokio::task::JoinHandle<()>>,
    /// The simulator playing KubeVirt and the kubelet ([`Controllers::KubevirtSim`]).
    kubevirt_sim: Option<(
        ttlab_kubevirt_sim::KubevirtSim,
        ttlab_kubevirt_sim::ConsoleServer,
    )>,
    _guest_tmp: Option<tempfile::TempDir>,
}

impl KubeSim {
    /// Binds `config.listen`, starts serving and simulating.
    pub async fn start(config: SimConfig) -> Result<Self, Error> {
        if !config.listen.ip().is_loopback() {
            return Err(Error::NotLoopback(config.listen));
        }
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|source| Error::Bind {
                addr: config.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Bind {
            addr: config.listen,
            source,
        })?;
        let (guest_tmp, guest_root) = match &config.guest_root {
            Some(p) => {
                std::fs::create_dir_all(p).map_err(|source| Error::Write {
                    path: p.clone(),
                    source,
                })?;
                (None, p.clone())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("kube-sim-guests-")
                    .tempdir()
                    .map_err(|source| Error::Write {
                        path: std::env::temp_dir(),
                        source,
                    })?;
                let p = t.path().to_path_buf();
                (Some(t), p)
            }
        };
        let mut store = store::Store::new();
        store.set_history_window(config.watch_history);
        store.set_graceful_pods(true);
        for ns in &config.namespaces {
            store
                .create(
                    resources::NAMESPACES,
                    "",
                    serde_json::json!({"metadata": {"name": ns}}),
                )
                .map_err(|e| Error::Api(e.message))?;
        }
        let (paused, _) = watch::channel(false);
        let sim = Arc::new(Sim {
            store: Mutex::new(store),
            faults: Faults::new(config.seed, config.max_call_records),
            quota: quota::Controller::default(),
            tokens: auth::Tokens::default(),
            rbac: rbac::Rbac::default(),
            config,
            paused,
            kubevirt_sim: std::sync::OnceLock::new(),
            kubevirt_console: std::sync::OnceLock::new(),
            guest_root,
            shutdown: CancellationToken::new(),
        });
        controllers::spawn(sim.clone());
        quota::spawn(sim.clone());
        let app = api::router(sim.clone());
        let token = sim.shutdown.clone();
        let server = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(token.cancelled_owned());
            if let Err(e) = serve.await {
                tracing::warn!(error = %e, "kube-sim server stopped");
            }
        });
        let url = format!("http://{addr}");
        let kubevirt_sim = match sim.config.controllers {
            Controllers::KubevirtSim => {
                let k = start_kubevirt_sim(&sim, &url).await?;
                let console = k
                    .serve_console(ttlab_kubevirt_sim::ConsoleSettings::behind_a_local_front())
                    .await
                    .map_err(|e| Error::Api(format!("kubevirt-sim console: {e}")))?;
                let _ = sim.kubevirt_sim.set(k.controls());
                let _ = sim.kubevirt_console.set(console.addr());
                Some((k, console))
            }
            Controllers::External => None,
        };
        Ok(Self {
            url,
            addr,
            sim,
            server: Some(server),
            kubevirt_sim,
            _guest_tmp: guest_tmp,
        })
    }

    /// The base URL (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A kubeconfig (plain HTTP, no credentials) whose context defaults to `namespace`.
    pub fn kubeconfig_yaml(&self, namespace: &str) -> String {
        kubeconfig_yaml(&self.url, namespace)
    }

    /// A kubeconfig for the cluster's controllers played from outside, acting as
    /// [`CONTROLLER_USER`].
    pub fn controller_kubeconfig_yaml(&self) -> String {
        kubeconfig_yaml_as(&self.url, "default", Some(CONTROLLER_USER))
    }

    /// Writes [`KubeSim::kubeconfig_yaml`] to `path`.
    pub fn write_kubeconfig(&self, path: &Path, namespace: &str) -> Result<(), Error> {
        self.write_kubeconfig_as(path, namespace, None)
    }

    /// Writes a kubeconfig like [`KubeSim::write_kubeconfig`] whose calls act as `user` (the
    /// kubeconfig's `as:`, sent as `Impersonate-User`), so that the call record
    /// ([`CallRecord::user`]) tells apart the processes sharing this sim.
    pub fn write_kubeconfig_as(
        &self,
        path: &Path,
        namespace: &str,
        user: Option<&str>,
    ) -> Result<(), Error> {
        std::fs::write(path, kubeconfig_yaml_as(&self.url, namespace, user)).map_err(|source| {
            Error::Write {
                path: path.to_path_buf(),
                source,
            }
        })
    }

    /// The bearer token that identifies `user` to this sim (the same one every time): calls
    /// with it are recorded as `user` ([`CallRecord::user`]), as a real cluster names the
    /// owner of a token; a token the sim did not issue is refused with `401 Unauthorized`.
    pub fn token_for(&self, user: &str) -> String {
        self.sim.tokens.issue(user)
    }

    /// Adds RBAC objects (Roles, ClusterRoles, RoleBindings, ClusterRoleBindings; any other
    /// kind is ignored, so a whole rendered `deploy/` overlay can be given) to the policy that
    /// authorizes identified users' calls ([`KubeSim::token_for`], `as:`): a call no rule
    /// allows is refused with `403 Forbidden` as a real server refuses it. Calls without
    /// credentials are the administrator's and always served. Returns how many were added.
    pub fn apply_rbac(&self, objects: &[serde_json::Value]) -> Result<usize, RbacError> {
        self.sim.rbac.apply(objects)
    }

    /// [`KubeSim::apply_rbac`] for a YAML stream (documents separated by `---`), such as
    /// `deploy/base/vms/role.yaml`.
    pub fn apply_rbac_yaml(&self, yaml: &str) -> Result<usize, RbacError> {
        self.sim.rbac.apply(&rbac::parse_yaml_stream(yaml)?)
    }

    /// Writes a kubeconfig like [`KubeSim::write_kubeconfig`] that authenticates as `user`
    /// with its bearer token ([`KubeSim::token_for`]), as a ServiceAccount's kubeconfig does.
    /// kube-rs sends the token; kubectl (client-go) reads a kubeconfig's credentials only for
    /// a TLS server, so over kube-sim's plain HTTP its calls stay anonymous: name kubectl's
    /// user with [`KubeSim::write_kubeconfig_as`].
    pub fn write_kubeconfig_for(
        &self,
        path: &Path,
        namespace: &str,
        user: &str,
    ) -> Result<(), Error> {
        let token = self.token_for(user);
        std::fs::write(
            path,
            kubeconfig_yaml_with_token(&self.url, namespace, &token),
        )
        .map_err(|source| Error::Write {
            path: path.to_path_buf(),
            source,
        })
    }

    /// The fault table (add/remove rules, latency) and the call record.
    pub fn faults(&self) -> &Faults {
        &self.sim.faults
    }

    /// Every recorded API call.
    pub fn calls(&self) -> Vec<CallRecord> {
        self.sim.faults.calls()
    }

    /// Counters, including the most VMs that ever existed at once.
    pub fn stats(&self) -> SimStats {
        self.sim.stats()
    }

    /// Forgets the watch history, as after an etcd compaction the API server's watch cache
    /// holds nothing older than now: a watch from any earlier resourceVersion (an informer
    /// resuming after a long disconnection) ends with a `410 Expired` ERROR event and has to
    /// list again.
    pub fn compact_history(&self) {
        self.sim.store().compact_history();
    }

    /// Whether the quota controller counts `resource`, a quota resource name
    /// (`count/virtualmachines.kubevirt.io`, `requests.memory`); it counts every one unless
    /// told otherwise. One it does not count stays out of the quotas' `status.used` (or keeps
    /// its last count), as on a cluster whose kube-controller-manager has not yet discovered
    /// a resource type (a CRD installed within its discovery period): meanwhile creates such
    /// a quota covers are refused with `403 status unknown for quota`. Takes effect at the
    /// controller's next sync, [`SimConfig::quota_sync`] from now.
    pub fn set_quota_counting(&self, resource: &str, counting: bool) {
        self.sim.quota.set_counting(resource, counting);
    }

    /// Pauses (true) or resumes (false) the KubeVirt simulation: no VMI is created, advanced
    /// or stopped while paused.
    pub fn pause_kubevirt(&self, paused: bool) {
        self.sim.pause_kubevirt(paused);
    }

    /// Keeps every VMI that reaches `phase` in it, until called again with `None` (see
    /// [`ttlab_kubevirt_sim::Controls::hold_starting_vmis`]): a crashed guest's replacement
    /// held with its next VMI starting, say.
    pub fn hold_starting_vmis(&self, phase: Option<StartingPhase>) {
        if let Some(k) = self.sim.kubevirt_sim.get() {
            k.hold_starting_vmis(phase);
        }
    }

    /// The guest powers itself off: the VMI ends `Succeeded` and the run strategy decides.
    pub fn power_off(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.sim
            .end_guest(namespace, name, ttlab_kubevirt_sim::GuestEnd::PowerOff)
    }

    /// The guest crashes: the VMI ends `Failed` and the run strategy decides.
    pub fn crash(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.sim
            .end_guest(namespace, name, ttlab_kubevirt_sim::GuestEnd::Crash)
    }

    fn guest_info(&self, namespace: &str, name: &str) -> Option<ttlab_kubevirt_sim::GuestInfo> {
        self.sim.guest_info(namespace, name)
    }

    /// The directory holding the guest's files (cloud-init `write_files`, markers).
    pub fn guest_dir(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        self.guest_info(namespace, name).map(|g| g.dir)
    }

    /// The guest's loopback address.
    pub fn guest_ip(&self, namespace: &str, name: &str) -> Option<Ipv4Addr> {
        self.guest_info(namespace, name).map(|g| g.ip)
    }

    /// The process id of the guest's agent (the real `ttlab-agent` started from its
    /// cloud-init), if one was started. The process is killed (and reaped) when the VMI ends,
    /// and at [`KubeSim::shutdown`] or drop.
    pub fn agent_pid(&self, namespace: &str, name: &str) -> Option<u32> {
        self.guest_info(namespace, name).and_then(|g| g.agent_pid)
    }

    /// The guest agent's log: its standard error and output (`/var/log/ttlab-agent.log` in the
    /// guest directory). Look here when an agent does not answer.
    pub fn agent_log(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        self.sim.kubevirt_sim.get()?.agent_log(namespace, name)
    }

    /// Sets what the guest setup does for a lesson (for VMIs started from now on).
    pub fn set_lesson_setup(&self, lesson: &str, outcome: SetupOutcome) {
        self.sim.set_lesson_setup(lesson, outcome);
    }

    /// Creates an object directly (as an administrator would with kubectl): `apiVersion`,
    /// `kind` and `metadata.namespace` pick where it goes. Returns the stored object.
    pub fn create(&self, object: Value) -> Result<Value, Error> {
        api::create_direct(&self.sim, object).map_err(|e| Error::Api(e.message))
    }

    /// Creates an object directly, as [`KubeSim::create`] does, with `created_at` as its
    /// `creationTimestamp` (whole seconds): an object that has been lying around for a month,
    /// such as a stray cloud-init Secret, without waiting a month. Watchers see it added now.
    pub fn create_backdated(
        &self,
        object: Value,
        created_at: chrono::DateTime<chrono::Utc>,
    ) -> Result<Value, Error> {
        api::create_direct_at(&self.sim, object, Some(created_at))
            .map_err(|e| Error::Api(e.message))
    }

    /// Replaces the `status` of an object (as its controller would), e.g. a PVC's phase or a
    /// DataVolume's progress.
    pub fn set_status(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
        status: Value,
    ) -> Result<Value, Error> {
        let t = resources::find_by_resource(resource)
            .ok_or_else(|| Error::Api(format!("unknown resource {resource}")))?;
        self.sim
            .store()
            .set_status(t, namespace, name, status)
            .map(|v| (*v).clone())
            .ok_or_else(|| Error::Api(format!("{resource} {namespace}/{name} not found")))
    }

    /// Gets an object directly.
    pub fn get(&self, resource: &str, namespace: &str, name: &str) -> Option<Value> {
        let t = resources::find_by_resource(resource)?;
        self.sim
            .store()
            .get(t, namespace, name)
            .map(|v| (*v).clone())
    }

    /// Waits until the server is shut down (by a signal handler calling [`KubeSim::stop`]).
    pub async fn stopped(&self) {
        self.sim.shutdown.cancelled().await;
    }

    /// Asks everything to stop (without waiting).
    pub fn stop(&self) {
        self.sim.shutdown.cancel();
    }

    /// Stops the server and the simulation, kills every guest agent and waits for each to
    /// exit, and waits for the server to finish.
    pub async fn shutdown(mut self) {
        if let Some((k, console)) = self.kubevirt_sim.take() {
            console.stop().await;
            k.stop().await;
        }
        self.sim.shutdown.cancel();
        if let Some(s) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(5), s).await;
        }
    }
}

impl Drop for KubeSim {
    fn drop(&mut self) {
        self.sim.shutdown.cancel();
    }
}

/// Starts `ttlab-kubevirt-sim` on the sim at `url` as [`CONTROLLER_USER`], on every
/// namespace, with the sim's delays, guest addresses, agent port and setup outcomes.
async fn start_kubevirt_sim(
    sim: &Arc<Sim>,
    url: &str,
) -> Result<ttlab_kubevirt_sim::KubevirtSim, Error> {
    let config = &sim.config;
    let yaml = kubeconfig_yaml_as(url, "default", Some(CONTROLLER_USER));
    let kubeconfig =
        kube::config::Kubeconfig::from_yaml(&yaml).map_err(|e| Error::Api(e.to_string()))?;
    let client_config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .map_err(|e| Error::Api(e.to_string()))?;
    let client = kube::Client::try_from(client_config).map_err(|e| Error::Api(e.to_string()))?;
    let mut settings =
        ttlab_kubevirt_sim::SimSettings::new(config.namespaces.clone(), &sim.guest_root);
    let t = &config.timings;
    // A cluster of its own: VMs in namespaces created later (`kubectl apply` of an overlay)
    // run too, as with kube-sim's own KubeVirt.
    settings.every_namespace = true;
    settings.node_name = "kube-sim-node-1".to_owned();
    settings.pod_start = t.pod_start;
    settings.boot = t.pending + t.scheduling + t.boot / 2;
    settings.agent_start = t.boot / 2;
    settings.setup = t.setup;
    settings.shutdown_grace = t.stop;
    settings.agent_port = config.agent_port;
    settings.ip_second_octet = config.guest_ip_second_octet;
    settings.unroutable_pod_ips = config.unroutable_pod_ips;
    settings.agent_binary.clone_from(&config.agent_binary);
    settings.setup_outcomes = config.lesson_setup.clone();
    if let guest::GuestBackend::Qemu(qemu) = &config.guest {
        settings.qemu = Some((**qemu).clone());
    }
    ttlab_kubevirt_sim::KubevirtSim::start(client, settings)
        .await
        .map_err(|e| Error::Api(format!("kubevirt-sim: {e}")))
}

/// A kubeconfig for a kube-sim at `url` (plain HTTP, no credentials), context namespace
/// `namespace`.
pub fn kubeconfig_yaml(url: &str, namespace: &str) -> String {
    kubeconfig_yaml_as(url, namespace, None)
}

/// [`kubeconfig_yaml`] whose calls act as `user` (`as:`), when given.
pub fn kubeconfig_yaml_as(url: &str, namespace: &str, user: Option<&str>) -> String {
    // A JSON string is a valid YAML flow scalar: any user name is quoted safely.
    let user = match user {
        Some(u) => format!("{{as: {}}}", serde_json::Value::from(u)),
        None => "{}".to_owned(),
    };
    kubeconfig_with_user(url, namespace, &user)
}

/// [`kubeconfig_yaml`] that authenticates with the bearer token `token`.
pub fn kubeconfig_yaml_with_token(url: &str, namespace: &str, token: &str) -> String {
    kubeconfig_with_user(
        url,
        namespace,
        &format!("{{token: {}}}", serde_json::Value::from(token)),
    )
}

fn kubeconfig_with_user(url: &str, namespace: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kube-sim\n  cluster:\n    server: {url}\ncontexts:\n- name: kube-sim\n  context:\n    cluster: kube-sim\n    user: kube-sim\n    namespace: {namespace}\ncurrent-context: kube-sim\nusers:\n- name: kube-sim\n  user: {user}\npreferences: {{}}\n"
    )
}
