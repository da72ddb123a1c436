//! kubevirt-sim: KubeVirt and a kubelet, simulated as a controller that talks to any
//! Kubernetes API server through kube-rs — for tests against a real kube-apiserver (which has
//! no KubeVirt, no scheduler and no kubelet), the way kwok plays nodes.
//!
//! It owns, for the namespaces it is given (or every namespace, [`SimSettings::every_namespace`]):
//! - the **VirtualMachine controller**: run strategies (Always, RerunOnFailure, Once, Manual,
//!   Halted) create and delete the VirtualMachineInstance named like the VM and controlled by
//!   it; the VM's finalizer `kubevirt.io/virtualMachineControllerFinalize` holds a deleted VM
//!   until its VMI is gone; the VM's status (`printableStatus`, `ready`, `created`, `Ready`
//!   condition, `runStrategy`, `stateChangeRequests`) follows KubeVirt's rules;
//! - the **VirtualMachineInstance controller** (virt-controller and virt-handler): Pending →
//!   Scheduling (a `virt-launcher-<vmi>-xxxxx` pod controlled by the VMI, requesting what
//!   KubeVirt v1.9 requests — the guest's memory plus KubeVirt's overhead, the console log's
//!   sidecar, the devices — as `ttlab_vm_manifest::launcher` computes it, so a namespace quota
//!   and the node are charged what a real cluster charges) → Scheduled (the pod
//!   runs on the node) → Running, `status.interfaces[0].ipAddress` being the launcher pod's
//!   loopback address; the finalizer `kubevirt.io/foregroundDeleteVirtualMachine` released
//!   once the guest is off and the pod gone; new VMIs can be held in one of the starting
//!   phases ([`Controls::hold_starting_vmis`]), to look at a VM while its next VMI starts;
//! - the **guests**: at boot the cloud-init user-data (from the Secret the VMI's
//!   `cloudInitNoCloud` / `cloudInitConfigDrive` volume names, or inline) is applied in a
//!   directory per guest; the VMI's `configMap` volumes are its launcher pod's volumes (the
//!   pod waits for them, `FailedMount`, as kubelet does) and disks of the guest found by
//!   their `volumeLabel`, from which ttlab's first boot installs the agent the user-data pins
//!   (sha256 checked; else the failure marker and no agent); *after* the VMI turns Running
//!   the real `ttlab-agent` is started on the guest's address; the setup's readiness marker
//!   follows. A guest shuts
//!   down within [`SimSettings::shutdown_grace`] when its VMI or pod is deleted, and can power
//!   itself off or crash ([`KubevirtSim::power_off`], [`KubevirtSim::crash`]). With
//!   [`SimSettings::qemu`] every guest is a real qemu guest of a Debian image instead
//!   (`ttlab-qemu-guest`): cloud-init and the agent run inside it, the agent port is forwarded
//!   from the launcher pod's address, the VMI turns Running once qemu runs, the guest's own
//!   power-off ends it `Succeeded`, and a deleted VMI presses the ACPI button and waits its
//!   `terminationGracePeriodSeconds` before qemu is killed;
//! - **one node**: its registration, the scheduler's binding of every pod to it, and its
//!   kubelet (pods Running and Ready with a loopback IP, `activeDeadlineSeconds`, graceful
//!   deletion confirmed with a delete of grace period 0);
//! - on request, the **serial console** (a qemu guest's serial port, or a simulated line) as
//!   KubeVirt's aggregated API
//!   (`subresources.kubevirt.io/v1`, [`KubevirtSim::serve_console`]): kube-apiserver proxies
//!   to it after its own authentication and RBAC, given the front-proxy flags
//!   (`--requestheader-client-ca-file`, `--requestheader-allowed-names`,
//!   `--requestheader-{username,group}-headers`, `--requestheader-extra-headers-prefix`,
//!   `--proxy-client-cert-file`, `--proxy-client-key-file`); the same server serves the
//!   **port forward** (`…/portforward/{port}`: one TCP connection to the guest's port, where
//!   the agent listens), which reaches the guests also when their published pod addresses
//!   are unroutable ([`SimSettings::unroutable_pod_ips`]).
//!
//! Every write goes through the API with `fieldValidation=Strict`, statuses through the
//! `/status` subresources, updates as merge patches guarded by the resourceVersion they were
//! computed from (a 409 is re-read and recomputed); the watchers of `kube::runtime` restart
//! after `410 Gone`. Owned objects (a Secret owned by its VM, a pod owned by its VMI) are
//! left to the API server's garbage collector.
//!
//! It refuses to own anything production runs: it is a test double, and nothing outside
//! tests depends on it.
//!
//! ```no_run
//! # async fn demo(client: kube::Client) -> Result<(), ttlab_kubevirt_sim::Error> {
//! use ttlab_kubevirt_sim::{KubevirtSim, SimSettings};
//!
//! let guests = tempfile::tempdir().unwrap();
//! let sim = KubevirtSim::start(client, SimSettings::for_tests(["ttlab"], guests.path())).await?;
//! // … create VirtualMachines in namespace "ttlab" …
//! if let Some(g) = sim.guest("ttlab", "lab-vm") {
//!     println!("agent of lab-vm on {}", g.ip);
//! }
//! sim.stop().await;
//! # Ok(()) }
//! ```

mod console;
mod guests;
mod kubelet;
mod object;
mod qemu;
mod rest;
mod vm;
mod vmi;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use ttlab_background::{Backoff, Pauses};

pub use console::{ConsoleServer, ConsoleSettings, Front};
pub use guests::{GuestEnd, GuestInfo, GuestState};
pub use ttlab_sim_guest::SetupOutcome;

/// A phase in which a starting VMI can be held ([`Controls::hold_starting_vmis`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartingPhase {
    /// Admitted, with no launcher pod yet.
    Pending,
    /// Its launcher pod created, not yet running.
    Scheduling,
    /// Its launcher pod running on the node, the guest not booted.
    Scheduled,
}

impl StartingPhase {
    /// The phase as the VMI's `status.phase` names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Scheduling => "Scheduling",
            Self::Scheduled => "Scheduled",
        }
    }
}

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server answered a call with an error status.
    #[error("{verb} {path}: {code} {reason}: {message}")]
    Api {
        /// The HTTP method.
        verb: String,
        /// The request path.
        path: String,
        /// The HTTP status code.
        code: u16,
        /// The API's machine-readable reason (`Conflict`, `Invalid`, …).
        reason: String,
        /// The API's message (long ones shortened in the middle).
        message: String,
    },
    /// The API server could not be reached or its answer not read.
    #[error("{verb} {path}: {source}")]
    Transport {
        /// The HTTP method.
        verb: String,
        /// The request path.
        path: String,
        /// Why.
        #[source]
        source: kube::Error,
    },
    /// A request could not be built.
    #[error("cannot encode a request: {0}")]
    Encode(String),
    /// A file of a guest could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A guest path was refused.
    #[error("guest: {0}")]
    Guest(String),
    /// A reconcile could not reach the state it wanted; it is retried.
    #[error("{0}")]
    Sync(String),
    /// The settings cannot work.
    #[error("invalid settings: {0}")]
    Settings(String),
    /// No guest is known for this VirtualMachineInstance.
    #[error("no simulated guest for VirtualMachineInstance {namespace}/{name}")]
    NoSuchGuest {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
    /// The guest is not running (a power-off needs a running guest).
    #[error("the guest of VirtualMachineInstance {namespace}/{name} is not running")]
    NotRunning {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

impl Error {
    pub(crate) fn from_kube(verb: &str, path: &str, source: kube::Error) -> Self {
        match source {
            kube::Error::Api(s) => Error::Api {
                verb: verb.to_owned(),
                path: path.to_owned(),
                code: s.code,
                reason: s.reason.clone(),
                message: object::clip(&s.message),
            },
            source => Error::Transport {
                verb: verb.to_owned(),
                path: path.to_owned(),
                source,
            },
        }
    }

    /// The HTTP status of an API error.
    pub fn code(&self) -> Option<u16> {
        match self {
            Error::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn is_not_found(&self) -> bool {
        self.code() == Some(404)
    }

    pub(crate) fn is_conflict(&self) -> bool {
        self.code() == Some(409) && !self.is_already_exists()
    }

    /// The API server refused the request itself (invalid, unknown field, forbidden),
    /// rather than its timing (not found, conflict, a quota not yet counted, throttling).
    pub fn is_refusal(&self) -> bool {
        match self {
            Error::Api { code, message, .. } => match code {
                404 | 409 | 429 => false,
                403 => !message.contains("status unknown for quota"),
                c => (400..500).contains(c),
            },
            _ => false,
        }
    }

    pub(crate) fn is_already_exists(&self) -> bool {
        matches!(self, Error::Api { code: 409, reason, .. } if reason == "AlreadyExists")
    }
}

/// Settings of a simulator.
#[derive(Debug, Clone)]
pub struct SimSettings {
    /// The namespaces whose VirtualMachines, VMIs and pods it runs (each must exist).
    pub namespaces: Vec<String>,
    /// Run the VirtualMachines, VMIs and pods of every namespace instead, those created later
    /// too, through cluster-wide watches: for a cluster of its own (kube-sim's), not for a
    /// control plane that tests share. `namespaces` may then be empty.
    pub every_namespace: bool,
    /// The simulated node's name (pods are bound to it; VMIs report it).
    pub node_name: String,
    /// Create the Node object at start and report it Ready (needs rights on nodes).
    pub register_node: bool,
    /// Pod bound → Running (the kubelet starting its containers); also a launcher pod's.
    pub pod_start: Duration,
    /// VMI Scheduled → Running (the guest boots; cloud-init is applied at its end).
    pub boot: Duration,
    /// VMI Running → the agent process started (the rest of cloud-init).
    pub agent_start: Duration,
    /// VMI Running → the readiness (or failure) marker written.
    pub setup: Duration,
    /// How long a guest takes to shut down after its VMI or pod is deleted (bounded by the
    /// VMI's `terminationGracePeriodSeconds`), and a plain pod's containers to stop (bounded
    /// by its grace period). Real KubeVirt's default grace is 30 s.
    pub shutdown_grace: Duration,
    /// Setup outcome by the value of the VMI's `ttlab.io/lesson` label; others are
    /// [`SetupOutcome::Ready`].
    pub setup_outcomes: BTreeMap<String, SetupOutcome>,
    /// An agent binary installed at the guest's agent path when its cloud-init wrote none
    /// there (`None`: such a guest has no agent).
    pub agent_binary: Option<PathBuf>,
    /// The port the guest agent listens on.
    pub agent_port: u16,
    /// Where the per-guest directories go (`<root>/<namespace>/<vmi>-<uid prefix>`).
    pub guest_root: PathBuf,
    /// Pod addresses are `127.<this>.x.y`.
    pub ip_second_octet: u8,
    /// The image of the launcher pod's `compute` container.
    pub launcher_image: String,
    /// Boot every guest as a real qemu guest of this image instead of simulating it (`None`:
    /// simulated guests). The agent and its setup then run inside the guest: `agent_start`,
    /// `setup`, `setup_outcomes` and `agent_binary` do not apply.
    pub qemu: Option<ttlab_qemu_guest::QemuSettings>,
    /// Publish every pod address (the launcher pod's `status.podIP`, the VMI's
    /// `status.interfaces`) in `192.0.2.0/24` (TEST-NET-1, routed nowhere) while the guests
    /// still listen on their loopback addresses: a cluster whose pod network its API's
    /// clients cannot reach. The `portforward` subresource still reaches the guests, as
    /// virt-api does from inside the cluster.
    pub unroutable_pod_ips: bool,
}

impl SimSettings {
    /// Delays close to a small real cluster (seconds), guests under `guest_root`.
    pub fn new<I, S>(namespaces: I, guest_root: impl AsRef<Path>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            namespaces: namespaces.into_iter().map(Into::into).collect(),
            every_namespace: false,
            node_name: "kubevirt-sim-node".to_owned(),
            register_node: true,
            pod_start: Duration::from_secs(2),
            boot: Duration::from_secs(15),
            agent_start: Duration::from_secs(5),
            setup: Duration::from_secs(20),
            shutdown_grace: Duration::from_secs(3),
            setup_outcomes: BTreeMap::new(),
            agent_binary: None,
            agent_port: ttlab_agent::protocol::PORT,
            guest_root: guest_root.as_ref().to_path_buf(),
            ip_second_octet: 101,
            launcher_image: "quay.io/kubevirt/virt-launcher:v1.9.0".to_owned(),
            qemu: None,
            unroutable_pod_ips: false,
        }
    }

    /// Short delays for tests (tens to hundreds of milliseconds; a 1 s shutdown grace).
    pub fn for_tests<I, S>(namespaces: I, guest_root: impl AsRef<Path>) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            pod_start: Duration::from_millis(100),
            boot: Duration::from_millis(200),
            agent_start: Duration::from_millis(100),
            setup: Duration::from_millis(300),
            shutdown_grace: Duration::from_secs(1),
            ..Self::new(namespaces, guest_root)
        }
    }
}

/// Wakes every controller (a guest changed outside the API).
#[derive(Default)]
struct Triggers {
    senders: Mutex<Vec<mpsc::UnboundedSender<()>>>,
}

impl Triggers {
    fn stream(&self) -> tokio_stream::wrappers::UnboundedReceiverStream<()> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(tx);
        tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
    }

    fn fire(&self) {
        for tx in self
            .senders
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
        {
            let _ = tx.send(());
        }
    }
}

/// What every reconcile shares.
pub(crate) struct Ctx {
    pub(crate) rest: rest::Rest,
    pub(crate) settings: SimSettings,
    pub(crate) guests: Arc<guests::Guests>,
    pub(crate) kubelet: kubelet::Kubelet,
    triggers: Arc<Triggers>,
    /// Writes the API server refused (see [`KubevirtSim::refused`]).
    refused: Mutex<Vec<String>>,
    /// Failed reconciles in a row, by object.
    retries: Mutex<std::collections::HashMap<String, (u32, Pauses)>>,
    /// Setup outcomes by lesson, from [`SimSettings::setup_outcomes`] and
    /// [`KubevirtSim::set_setup_outcome`].
    setup_outcomes: Mutex<BTreeMap<String, SetupOutcome>>,
    /// While set, the VirtualMachine and VirtualMachineInstance controllers do nothing
    /// ([`KubevirtSim::pause`]).
    paused: std::sync::atomic::AtomicBool,
    /// The starting phase new VMIs are kept in ([`Controls::hold_starting_vmis`]).
    held: Mutex<Option<StartingPhase>>,
    /// KVM or TCG for qemu guests, probed once (when [`SimSettings::qemu`] does not say).
    pub(crate) accel: Arc<tokio::sync::OnceCell<ttlab_qemu_guest::Accel>>,
}

impl Ctx {
    /// What the setup of a guest of `lesson` does.
    pub(crate) fn setup_outcome(&self, lesson: &str) -> SetupOutcome {
        self.setup_outcomes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(lesson)
            .cloned()
            .unwrap_or(SetupOutcome::Ready)
    }

    fn paused(&self) -> bool {
        self.paused.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether a VMI in `phase` (its `status.phase`) is held there.
    pub(crate) fn holds(&self, phase: &str) -> bool {
        self.held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|held| held.as_str() == phase)
    }
}

/// How often a paused controller (or a held VMI) looks again.
pub(crate) const PAUSED_RECHECK: Duration = Duration::from_millis(100);

/// A running simulator. It stops (and kills every guest agent) on drop or [`KubevirtSim::stop`];
/// the objects it wrote stay in the API server.
///
/// It dereferences to its [`Controls`], the guest and controller controls, which
/// [`KubevirtSim::controls`] also hands out as a cloneable handle.
pub struct KubevirtSim {
    controls: Controls,
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// The controls of a running [`KubevirtSim`]: pause, setup outcomes, the guests and their
/// ends. A cloneable handle (for a server's control endpoints, say); once the simulator has
/// stopped, its guests are gone and these find none.
#[derive(Clone)]
pub struct Controls {
    ctx: Arc<Ctx>,
}

impl std::ops::Deref for KubevirtSim {
    type Target = Controls;

    fn deref(&self) -> &Controls {
        &self.controls
    }
}

fn vm_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    )
}

fn vmi_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachineInstance"),
        "virtualmachineinstances",
    )
}

/// The key of an object's retry count: its uid (unique across kinds).
fn retry_key(obj: &DynamicObject) -> String {
    match &obj.metadata.uid {
        Some(u) => u.clone(),
        None => format!(
            "{}/{}",
            obj.metadata.namespace.as_deref().unwrap_or(""),
            obj.metadata.name.as_deref().unwrap_or("")
        ),
    }
}

/// A reconcile that succeeded resets its object's retry count.
fn settled(ctx: &Ctx, obj: &DynamicObject, r: Result<Action, Error>) -> Result<Action, Error> {
    if r.is_ok() {
        ctx.retries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&retry_key(obj));
    }
    r
}

async fn reconcile_vm(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if ctx.paused() {
        return Ok(Action::requeue(PAUSED_RECHECK));
    }
    let r = vm::reconcile(obj.clone(), ctx.clone()).await;
    settled(&ctx, &obj, r)
}

async fn reconcile_vmi(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    if ctx.paused() {
        return Ok(Action::requeue(PAUSED_RECHECK));
    }
    let r = vmi::reconcile(obj.clone(), ctx.clone()).await;
    settled(&ctx, &obj, r)
}

async fn reconcile_pod(obj: Arc<DynamicObject>, ctx: Arc<Ctx>) -> Result<Action, Error> {
    let r = kubelet::reconcile(obj.clone(), ctx.clone()).await;
    settled(&ctx, &obj, r)
}

/// First and longest pause before a failed reconcile is retried.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);
/// The pauses before a failed reconcile is retried (after anything but a conflict).
const RETRY: Backoff = Backoff::doubling(RETRY_FIRST, RETRY_MAX).without_jitter();

/// Retries a failed reconcile: soon after a conflict, with a doubling pause otherwise; records
/// refusals.
fn error_policy(obj: Arc<DynamicObject>, e: &Error, ctx: Arc<Ctx>) -> Action {
    let name = obj.metadata.name.as_deref().unwrap_or("");
    let ns = obj.metadata.namespace.as_deref().unwrap_or("");
    let kind = obj.types.as_ref().map(|t| t.kind.as_str()).unwrap_or("");
    if e.is_refusal() {
        let mut refused = ctx
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let m = e.to_string();
        if !refused.contains(&m) {
            refused.push(m);
        }
    }
    if e.code() == Some(409) {
        tracing::debug!(kind, ns, name, error = %e, "reconcile conflict; retrying");
        return Action::requeue(RETRY_FIRST);
    }
    let (n, pause) = {
        let mut retries = ctx
            .retries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (n, pauses) = retries
            .entry(retry_key(&obj))
            .or_insert_with(|| (0, RETRY.pauses()));
        *n = n.saturating_add(1);
        (*n, pauses.next_pause())
    };
    tracing::warn!(kind, ns, name, error = %e, attempt = n, ?pause, "reconcile failed; retrying");
    Action::requeue(pause)
}

impl KubevirtSim {
    /// Registers the node (if asked to) and starts the controllers for every namespace of
    /// `settings`. Returns once they run; their first lists happen in the background.
    pub async fn start(client: kube::Client, mut settings: SimSettings) -> Result<Self, Error> {
        let mut seen = std::collections::BTreeSet::new();
        settings.namespaces.retain(|n| seen.insert(n.clone()));
        if settings.namespaces.is_empty() && !settings.every_namespace {
            return Err(Error::Settings("no namespace to simulate".into()));
        }
        std::fs::create_dir_all(&settings.guest_root).map_err(|source| Error::Io {
            path: settings.guest_root.clone(),
            source,
        })?;
        if let Some(bin) = &settings.agent_binary
            && !bin.is_file()
        {
            return Err(Error::Settings(format!(
                "agent binary {} is not a file",
                bin.display()
            )));
        }
        let ctx = Arc::new(Ctx {
            rest: rest::Rest::new(client.clone()),
            kubelet: kubelet::Kubelet::new(settings.ip_second_octet),
            guests: Arc::new(guests::Guests::default()),
            triggers: Arc::default(),
            refused: Mutex::new(Vec::new()),
            retries: Mutex::new(std::collections::HashMap::new()),
            setup_outcomes: Mutex::new(settings.setup_outcomes.clone()),
            paused: std::sync::atomic::AtomicBool::new(false),
            held: Mutex::new(None),
            accel: Arc::default(),
            settings,
        });
        if ctx.settings.register_node {
            kubelet::register_node(&ctx).await?;
        }
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        let wc = watcher::Config::default();
        let (vm_ar, vmi_ar) = (vm_resource(), vmi_resource());
        let pod_ar = ApiResource::erase::<Pod>(&());
        let scopes: Vec<Option<&String>> = if ctx.settings.every_namespace {
            vec![None]
        } else {
            ctx.settings.namespaces.iter().map(Some).collect()
        };
        for scope in scopes {
            let api = |ar: &ApiResource| match scope {
                Some(ns) => Api::<DynamicObject>::namespaced_with(client.clone(), ns, ar),
                None => Api::<DynamicObject>::all_with(client.clone(), ar),
            };
            let (vms, vmis, pods) = (api(&vm_ar), api(&vmi_ar), api(&pod_ar));
            let ns = scope.cloned().unwrap_or_else(|| "*".to_owned());

            let s = stop.clone();
            let vm_ctl = Controller::new_with(vms, wc.clone(), vm_ar.clone())
                .owns_with(vmis.clone(), vmi_ar.clone(), wc.clone())
                .reconcile_all_on(ctx.triggers.stream())
                .graceful_shutdown_on(async move { s.cancelled().await })
                .run(reconcile_vm, error_policy, ctx.clone());
            tasks.push(tokio::spawn(drain(vm_ctl, "VirtualMachine", ns.clone())));

            let s = stop.clone();
            let vmi_ctl = Controller::new_with(vmis, wc.clone(), vmi_ar.clone())
                .owns_with(pods.clone(), pod_ar.clone(), wc.clone())
                .reconcile_all_on(ctx.triggers.stream())
                .graceful_shutdown_on(async move { s.cancelled().await })
                .run(reconcile_vmi, error_policy, ctx.clone());
            tasks.push(tokio::spawn(drain(
                vmi_ctl,
                "VirtualMachineInstance",
                ns.clone(),
            )));

            let s = stop.clone();
            let pod_ctl = Controller::new_with(pods, wc.clone(), pod_ar.clone())
                .reconcile_all_on(ctx.triggers.stream())
                .graceful_shutdown_on(async move { s.cancelled().await })
                .run(reconcile_pod, error_policy, ctx.clone());
            tasks.push(tokio::spawn(drain(pod_ctl, "Pod", ns.clone())));
        }
        tracing::info!(namespaces = ?ctx.settings.namespaces, every_namespace = ctx.settings.every_namespace, node = ctx.settings.node_name, "kubevirt-sim started");
        Ok(Self {
            controls: Controls { ctx },
            stop,
            tasks,
        })
    }

    /// A cloneable handle on its controls.
    pub fn controls(&self) -> Controls {
        self.controls.clone()
    }

    /// Serves the guests' serial consoles as KubeVirt's `subresources.kubevirt.io/v1`
    /// aggregated API (see [`ConsoleServer::register`] to make kube-apiserver proxy to it).
    pub async fn serve_console(&self, settings: ConsoleSettings) -> Result<ConsoleServer, Error> {
        ConsoleServer::start(self.ctx.clone(), settings).await
    }

    /// Stops the controllers, kills every guest agent and waits for them.
    pub async fn stop(mut self) {
        self.stop.cancel();
        for t in std::mem::take(&mut self.tasks) {
            let abort = t.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .is_err()
            {
                abort.abort();
            }
        }
        self.ctx.guests.kill_all().await;
    }
}

impl Controls {
    /// The settings it runs with.
    pub fn settings(&self) -> &SimSettings {
        &self.ctx.settings
    }

    /// Every write the API server refused as invalid or forbidden so far (each retried;
    /// recorded once per distinct message). Tests assert it stays empty: the simulator must
    /// write only what a real API server accepts.
    pub fn refused(&self) -> Vec<String> {
        self.ctx
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Pauses (true) or resumes (false) KubeVirt: while paused no VMI is created, advanced,
    /// stopped or released (a deleted VM keeps its finalizer, as while its guest shuts down
    /// or on a dead node); the kubelet goes on. Guests already booting go on booting.
    pub fn pause(&self, paused: bool) {
        self.ctx
            .paused
            .store(paused, std::sync::atomic::Ordering::SeqCst);
        if !paused {
            self.ctx.triggers.fire();
        }
    }

    /// Keeps every VMI that reaches `phase` in it (`None` lifts the hold): the VMI controller
    /// does not advance it further, while the VM controller, VMIs in other phases, deletions
    /// and the kubelet go on. A crashed guest's replacement can so be held with its next VMI
    /// starting, for as long as a test looks at it.
    pub fn hold_starting_vmis(&self, phase: Option<StartingPhase>) {
        *self
            .ctx
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = phase;
        if phase.is_none() {
            self.ctx.triggers.fire();
        }
    }

    /// Sets what the setup of guests of `lesson` does, for guests that boot from now on.
    pub fn set_setup_outcome(&self, lesson: &str, outcome: SetupOutcome) {
        self.ctx
            .setup_outcomes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(lesson.to_owned(), outcome);
    }

    /// The guest of VMI `namespace/name`, once it began booting (the newest incarnation).
    pub fn guest(&self, namespace: &str, name: &str) -> Option<GuestInfo> {
        self.ctx.guests.info(namespace, name)
    }

    /// The guest agent's log (its standard error and output), in the guest directory.
    pub fn agent_log(&self, namespace: &str, name: &str) -> Option<PathBuf> {
        self.guest(namespace, name)
            .map(|g| ttlab_sim_guest::agent_log(&g.dir))
    }

    /// The guest powers itself off: its VMI ends `Succeeded`, its launcher pod completes, and
    /// the VM's run strategy decides what follows (RerunOnFailure leaves it off).
    pub fn power_off(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.end(namespace, name, GuestEnd::PowerOff)
    }

    /// The guest crashes: its VMI ends `Failed` and the run strategy decides.
    pub fn crash(&self, namespace: &str, name: &str) -> Result<(), Error> {
        self.end(namespace, name, GuestEnd::Crash)
    }

    fn end(&self, namespace: &str, name: &str, how: GuestEnd) -> Result<(), Error> {
        let uid = self.ctx.guests.end(namespace, name, how)?;
        tracing::info!(
            namespace,
            name,
            vmi_uid = uid,
            ?how,
            "guest ended by itself"
        );
        self.ctx.triggers.fire();
        Ok(())
    }
}

impl Drop for KubevirtSim {
    fn drop(&mut self) {
        self.stop.cancel();
        for t in &self.tasks {
            t.abort();
        }
        self.ctx.guests.kill_all_now();
    }
}

type ControllerResult = Result<
    (kube::runtime::reflector::ObjectRef<DynamicObject>, Action),
    kube::runtime::controller::Error<Error, watcher::Error>,
>;

/// Runs a controller's stream to its end, logging what its watchers report.
async fn drain(
    stream: impl futures::Stream<Item = ControllerResult>,
    kind: &'static str,
    ns: String,
) {
    use kube::runtime::controller::Error as CtlError;
    futures::pin_mut!(stream);
    while let Some(r) = stream.next().await {
        match r {
            Ok(_) | Err(CtlError::ReconcilerFailed(..)) | Err(CtlError::ObjectNotFound(_)) => {}
            Err(e) => tracing::warn!(kind, ns, error = %e, "controller"),
        }
    }
    tracing::debug!(kind, ns, "controller stopped");
}
