//! A throwaway PostgreSQL database and a cluster per test — kube-sim, or the real control
//! plane of `ttlab-envtest` with the shipped `deploy/` objects installed — with the real
//! `KubeCluster` pointed at it over HTTP, and helpers to open sessions and create their objects
//! the way the server does (VMs rendered by ttlab-vm-manifest, then each cloud-init Secret).
//!
//! On the real control plane each environment's reaper runs as that environment's
//! `ttlab-reaper` ServiceAccount with the shipped Role, and fixtures are created by the
//! administrator, so a call the Role does not grant fails the test.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ttlab_cluster::{
    ClusterError, ClusterSettings, Kind, KubeCluster, ProvisionCluster as _, ReaperCluster as _,
};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_kube_sim::{KubeSim, SimConfig, Verb};
use ttlab_model::labels::{COMPONENT, ObjectLabels};
use ttlab_model::{EnvName, NodeName, Runtime, SessionId, SessionStatus, UserId};
use ttlab_reaper::{ReaperContext, ReaperSettings};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, Session, SessionTimes, SessionVm, Store};
use ttlab_vm_manifest::{SessionVms, render, secret_name, vm_name};

/// The namespace tests on kube-sim work in (`SimConfig::for_tests` creates it).
pub const NS: &str = "ttlab";
pub const LESSON: &str = "systemd-basics";

/// Where the objects live.
pub enum Backend {
    /// kube-sim, in process.
    Sim(KubeSim),
    /// The real control plane shared by this test process, with `deploy/` installed.
    Real {
        plane: &'static ttlab_envtest::ControlPlane,
        installed: ttlab_envtest::Installed,
    },
}

pub struct Harness {
    pub db: TestDb,
    pub store: Store,
    pub backend: Backend,
    /// The namespace of the session objects.
    pub ns: String,
    /// Each environment's reaper client (on kube-sim, one client for all).
    reapers: BTreeMap<String, Arc<KubeCluster>>,
    /// The client that creates and inspects fixtures (the administrator on the real plane).
    pub fixtures: Arc<KubeCluster>,
    pub dir: tempfile::TempDir,
}

/// A call a reaper made, as either backend records it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenCall {
    /// The RBAC verb (`get`, `list`, `watch`, `delete`, ...).
    pub verb: String,
    /// The resource (plural, `""` when the call named none).
    pub resource: String,
    /// The object's name, for calls on one object.
    pub name: Option<String>,
}

impl SeenCall {
    /// Whether the call only reads.
    pub fn is_read(&self) -> bool {
        matches!(self.verb.as_str(), "get" | "list" | "watch")
    }
}

pub fn env(name: &str) -> EnvName {
    name.parse().expect("env name")
}

pub fn node(name: &str) -> NodeName {
    name.parse().expect("node name")
}

async fn client(path: &std::path::Path, ns: &str) -> Arc<KubeCluster> {
    Arc::new(
        KubeCluster::from_kubeconfig(path, ClusterSettings::in_namespace(ns))
            .await
            .expect("cluster client"),
    )
}

impl Harness {
    pub async fn start() -> Self {
        Self::start_with(SimConfig::for_tests()).await
    }

    pub async fn start_with(config: SimConfig) -> Self {
        let db = TestDb::new().await.expect("test database");
        let store = db.store().await.expect("store");
        let sim = KubeSim::start(config).await.expect("kube-sim starts");
        let dir = tempfile::tempdir().expect("temporary directory");
        sim.write_kubeconfig(&dir.path().join("kubeconfig"), NS)
            .expect("kubeconfig");
        let cluster = client(&dir.path().join("kubeconfig"), NS).await;
        let reapers = ["dev", "prod"]
            .into_iter()
            .map(|e| (e.to_owned(), cluster.clone()))
            .collect();
        Self {
            db,
            store,
            backend: Backend::Sim(sim),
            ns: NS.to_owned(),
            reapers,
            fixtures: cluster,
            dir,
        }
    }

    /// The same, on the real control plane with the shipped `dev` and `prod` overlays
    /// installed into namespaces of this test's own. `None` (after `skip_or_fail`: a failure
    /// under CI=true) when the control plane's binaries or kubectl are missing.
    pub async fn start_real() -> Option<Self> {
        let plane = ttlab_envtest::shared_or_skip()?;
        if ttlab_testkit::which("kubectl").is_none() {
            ttlab_testkit::skip_or_fail("kubectl is not on PATH (deploy/ is rendered with it)");
            return None;
        }
        let installed = plane
            .install_shipped(&["dev", "prod"])
            .await
            .expect("deploy/ installs");
        let db = TestDb::new().await.expect("test database");
        let store = db.store().await.expect("store");
        let ns = installed.vm_namespace.clone();
        let mut reapers = BTreeMap::new();
        for e in &installed.envs {
            reapers.insert(e.env.clone(), client(&e.reaper_kubeconfig, &ns).await);
        }
        let fixtures = client(&installed.admin_kubeconfig, &ns).await;
        Some(Self {
            db,
            store,
            backend: Backend::Real { plane, installed },
            ns,
            reapers,
            fixtures,
            dir: tempfile::tempdir().expect("temporary directory"),
        })
    }

    /// On the real control plane, raises the shipped VM namespace quota's VM count to `vms`
    /// and waits until admission enforces the new figure (kube-sim has no quota here).
    pub async fn raise_vm_quota(&self, vms: u32) {
        let Backend::Real { installed, .. } = &self.backend else {
            return;
        };
        use k8s_openapi::api::core::v1::ResourceQuota;
        let kubeconfig = kube::config::Kubeconfig::read_from(&installed.admin_kubeconfig).unwrap();
        let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
            .await
            .unwrap();
        let quotas: kube::Api<ResourceQuota> =
            kube::Api::namespaced(kube::Client::try_from(config).unwrap(), &self.ns);
        let name = quotas.list(&Default::default()).await.unwrap().items[0]
            .metadata
            .name
            .clone()
            .unwrap();
        let key = "count/virtualmachines.kubevirt.io";
        let patch = serde_json::json!({"spec": {"hard": {key: vms.to_string()}}});
        quotas
            .patch(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
            .unwrap();
        let until = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let q = quotas.get(&name).await.unwrap();
            let hard = q.status.and_then(|s| s.hard).unwrap_or_default();
            if hard.get(key).map(|q| q.0.as_str()) == Some(vms.to_string().as_str()) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "quota {name} not updated"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The simulator; panics on the real control plane (for tests of kube-sim's faults).
    pub fn sim(&self) -> &KubeSim {
        match &self.backend {
            Backend::Sim(sim) => sim,
            Backend::Real { .. } => panic!("this test needs kube-sim"),
        }
    }

    /// A marker in the record of calls: [`Harness::reaper_calls_since`] returns what came after.
    pub fn mark(&self) -> usize {
        match &self.backend {
            Backend::Sim(sim) => {
                sim.faults().clear_calls();
                0
            }
            Backend::Real { plane, .. } => plane.audit_events().expect("audit log").len(),
        }
    }

    /// The calls the reapers made since `mark` (on kube-sim: every call, since the tests make
    /// no others meanwhile; on the real plane: those of the reapers' ServiceAccounts).
    pub fn reaper_calls_since(&self, mark: usize) -> Vec<SeenCall> {
        match &self.backend {
            Backend::Sim(sim) => sim
                .calls()
                .into_iter()
                .map(|c| SeenCall {
                    verb: match c.verb {
                        Verb::Get => "get",
                        Verb::List => "list",
                        Verb::Watch => "watch",
                        Verb::Create => "create",
                        Verb::Delete => "delete",
                        _ => "other",
                    }
                    .to_owned(),
                    resource: c.resource,
                    name: c.name,
                })
                .collect(),
            Backend::Real { plane, installed } => {
                let users: Vec<String> = installed.envs.iter().map(|e| e.reaper_user()).collect();
                plane
                    .audit_events()
                    .expect("audit log")
                    .into_iter()
                    .skip(mark)
                    .filter(|e| users.contains(&e.user.username))
                    .filter(|e| e.stage == "ResponseComplete")
                    .map(|e| SeenCall {
                        verb: e.verb.clone(),
                        resource: e
                            .object_ref
                            .as_ref()
                            .and_then(|o| o.resource.clone())
                            .unwrap_or_default(),
                        name: e.object_ref.and_then(|o| o.name),
                    })
                    .collect()
            }
        }
    }

    pub fn kubeconfig(&self) -> std::path::PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// The reaper client of `env_name`.
    pub fn reaper(&self, env_name: &str) -> Arc<KubeCluster> {
        self.reapers
            .get(env_name)
            .unwrap_or_else(|| panic!("no reaper of {env_name}"))
            .clone()
    }

    /// A reaper of `env_name` with no minimum orphan age (objects in tests are seconds old).
    pub fn ctx(&self, env_name: &str) -> ReaperContext {
        ReaperContext::new(self.store.clone(), self.reaper(env_name), env(env_name)).with_settings(
            ReaperSettings {
                orphan_min_age: Duration::ZERO,
                ..ReaperSettings::default()
            },
        )
    }

    pub async fn now(&self) -> DateTime<Utc> {
        self.store.db_now().await.expect("database clock")
    }

    /// Opens a session of `env_name` on `nodes`, expiring `expires_in` from now (negative:
    /// already expired), in `status` (starting or running).
    pub async fn open(
        &self,
        env_name: &str,
        status: SessionStatus,
        expires_in: TimeDelta,
        nodes: &[&str],
    ) -> Session {
        self.open_with(env_name, Runtime::Vm, status, expires_in, nodes)
            .await
    }

    pub async fn open_with(
        &self,
        env_name: &str,
        runtime: Runtime,
        status: SessionStatus,
        expires_in: TimeDelta,
        nodes: &[&str],
    ) -> Session {
        self.open_on("default", env_name, runtime, status, expires_in, nodes)
            .await
    }

    /// [`Harness::open_with`], the session recorded on `site`.
    pub async fn open_on(
        &self,
        site: &str,
        env_name: &str,
        runtime: Runtime,
        status: SessionStatus,
        expires_in: TimeDelta,
        nodes: &[&str],
    ) -> Session {
        let now = self.now().await;
        let id = SessionId::new_random();
        let expires_at = now + expires_in;
        let started_at = expires_at - TimeDelta::minutes(60);
        let new = NewSession {
            id,
            user: UserId::new(format!("student-{}", id.simple())).expect("user"),
            lesson: LESSON.parse().expect("lesson"),
            runtime,
            env: env(env_name),
            site: site.parse().expect("site name"),
            times: SessionTimes {
                started_at,
                expires_at,
                max_expires_at: started_at + TimeDelta::minutes(180),
            },
            readiness_deadline: if status == SessionStatus::Starting {
                expires_at
            } else {
                now + TimeDelta::minutes(5)
            },
        };
        let sessions = self.store.sessions();
        sessions.insert(&new).await.expect("insert session");
        let vms: Vec<SessionVm> = nodes
            .iter()
            .map(|n| SessionVm {
                node: node(n),
                name: match runtime {
                    Runtime::Vm => vm_name(id, &node(n)),
                    Runtime::Pod => ttlab_vm_manifest::pod_name(id, &node(n)),
                },
            })
            .collect();
        assert!(sessions.record_vms(id, &vms).await.expect("record vms"));
        if status == SessionStatus::Running {
            sessions
                .mark_running(id, None)
                .await
                .expect("mark running")
                .expect("was starting");
        }
        sessions.get(id).await.expect("get").expect("exists")
    }

    /// Creates the session's VMs (rendered by ttlab-vm-manifest) and then each cloud-init
    /// Secret, with the VM as owner or (`owner_link: false`) without, as when linking failed.
    pub async fn create_vms(
        &self,
        env_name: &str,
        session: SessionId,
        nodes: &[&str],
        owner_link: bool,
    ) {
        self.create_vms_held(env_name, session, nodes, owner_link, None)
            .await;
    }

    /// [`Harness::create_vms`], each VM also carrying `finalizer` if given: a finalizer nobody
    /// but the test removes ([`Harness::release`]), so a deleted VM stays terminating, as on a
    /// dead node.
    pub async fn create_vms_held(
        &self,
        env_name: &str,
        session: SessionId,
        nodes: &[&str],
        owner_link: bool,
        finalizer: Option<&str>,
    ) {
        self.create_vms_via(
            &self.fixtures,
            env_name,
            session,
            nodes,
            owner_link,
            finalizer,
        )
        .await;
    }

    /// [`Harness::create_vms_held`] through `client` (another cluster: another site's).
    pub async fn create_vms_via(
        &self,
        client: &KubeCluster,
        env_name: &str,
        session: SessionId,
        nodes: &[&str],
        owner_link: bool,
        finalizer: Option<&str>,
    ) {
        let input = SessionVms {
            session,
            env: env(env_name),
            lesson: LESSON.parse().expect("lesson"),
            namespace: None,
            image: "quay.io/containerdisks/debian:12".into(),
            memory: "128Mi".into(),
            cores: 1,
            nodes: nodes.iter().map(|n| node(n)).collect(),
            disk: DiskDecision::ContainerDisk {
                reason: FallbackReason::NotRequested,
            },
            termination_grace_period_seconds: 0,
        };
        let manifests = render(&input).expect("render");
        for (vm, n) in manifests.vms.iter().zip(nodes) {
            let mut vm = serde_json::to_value(vm).expect("vm json");
            if let Some(f) = finalizer {
                vm["metadata"]["finalizers"] = serde_json::json!([f]);
            }
            let created = retry_quota(|| client.create_vm(vm.clone()))
                .await
                .expect("create vm");
            let owner = owner_link.then(|| created.owner_reference());
            self.create_secret_via(client, env_name, session, n, owner)
                .await;
        }
        if let Some(svc) = manifests.service {
            client.create_service(svc).await.expect("service");
        }
        if let Some(np) = manifests.network_policy {
            client
                .create_network_policy(np)
                .await
                .expect("network policy");
        }
    }

    /// A cloud-init Secret of `node` labelled like the server labels it.
    pub async fn create_secret(
        &self,
        env_name: &str,
        session: SessionId,
        n: &str,
        owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    ) {
        self.create_secret_via(&self.fixtures, env_name, session, n, owner)
            .await;
    }

    /// [`Harness::create_secret`] through `client` (another cluster: another site's).
    pub async fn create_secret_via(
        &self,
        client: &KubeCluster,
        env_name: &str,
        session: SessionId,
        n: &str,
        owner: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference>,
    ) {
        let mut labels = ObjectLabels::new(
            session,
            env(env_name),
            LESSON.parse().expect("lesson"),
            Some(node(n)),
        )
        .to_map();
        labels.insert(COMPONENT.to_owned(), "cloud-init".to_owned());
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(secret_name(session, &node(n))),
                labels: Some(labels),
                owner_references: owner.map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            string_data: Some(BTreeMap::from([(
                "userdata".to_owned(),
                "#cloud-config\n{}\n".to_owned(),
            )])),
            ..Secret::default()
        };
        client.create_secret(secret).await.expect("create secret");
    }

    /// A cloud-init Secret of `node` labelled like the server labels it, without an owner,
    /// created directly in the simulation with `created_at` as its `creationTimestamp`: a
    /// Secret left behind long ago.
    pub fn create_secret_backdated(
        &self,
        env_name: &str,
        session: SessionId,
        n: &str,
        created_at: DateTime<Utc>,
    ) {
        let mut labels = ObjectLabels::new(
            session,
            env(env_name),
            LESSON.parse().expect("lesson"),
            Some(node(n)),
        )
        .to_map();
        labels.insert(COMPONENT.to_owned(), "cloud-init".to_owned());
        let secret = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {
                "name": secret_name(session, &node(n)),
                "namespace": NS,
                "labels": labels,
            },
            "stringData": {"userdata": "#cloud-config\n{}\n"},
        });
        let stored = self
            .sim()
            .create_backdated(secret, created_at)
            .expect("create backdated secret");
        let written = stored["metadata"]["creationTimestamp"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .expect("creationTimestamp");
        assert_eq!(written.timestamp(), created_at.timestamp());
    }

    /// Removes `finalizer` from the VM `name` once it is the VM's last one (KubeVirt's own goes
    /// when the VMI is gone; a deleting object takes no new finalizers, so the list is written
    /// only when it holds `finalizer` alone), as the administrator. Bounded: 60 s.
    pub async fn release(&self, name: &str, finalizer: &str) {
        use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.fixtures.client().clone(),
            &self.ns,
            &ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
                "virtualmachines",
            ),
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let vm = api.get_opt(name).await.expect("get the held VM");
            let Some(vm) = vm else { return };
            let left = vm.metadata.finalizers.clone().unwrap_or_default();
            if left.iter().all(|f| f == finalizer) {
                let patch = serde_json::json!({"metadata": {"finalizers": null}});
                match api
                    .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => return,
                    Err(kube::Error::Api(s)) if s.code == 404 => return,
                    // Changed meanwhile: read it again.
                    Err(kube::Error::Api(s)) if s.code == 409 => {}
                    Err(e) => panic!("releasing {name}: {e}"),
                }
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name} kept finalizers {left:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Drops every finalizer of the VM `name` at once, with a patch alone (no read), as the
    /// administrator: a VM being deleted then goes.
    pub async fn drop_finalizers(&self, name: &str) {
        use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.fixtures.client().clone(),
            &self.ns,
            &ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
                "virtualmachines",
            ),
        );
        let patch = serde_json::json!({"metadata": {"finalizers": null}});
        match api
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => panic!("dropping the finalizers of {name}: {e}"),
        }
    }

    /// Waits (60 s at most) until the object is gone.
    pub async fn wait_gone(&self, kind: Kind, name: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while self.fixtures.get(kind, name).await.expect("get").is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{kind} {name} still there"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the object exists and is not being deleted.
    pub async fn alive(&self, kind: Kind, name: &str) -> bool {
        self.fixtures
            .get(kind, name)
            .await
            .expect("get")
            .is_some_and(|o| !o.deleting)
    }

    pub async fn vm_alive(&self, session: SessionId, n: &str) -> bool {
        self.alive(Kind::VirtualMachine, &vm_name(session, &node(n)))
            .await
    }

    pub async fn secret_alive(&self, session: SessionId, n: &str) -> bool {
        self.alive(Kind::Secret, &secret_name(session, &node(n)))
            .await
    }

    pub async fn status(&self, id: SessionId) -> SessionStatus {
        self.store
            .sessions()
            .get(id)
            .await
            .expect("get")
            .expect("exists")
            .status
    }

    /// Waits (up to 30 s) until a cycle with `trigger` has been recorded for `env_name`.
    pub async fn wait_for_cycle(&self, env_name: &str, trigger: ttlab_store::CycleTrigger) {
        let start = std::time::Instant::now();
        loop {
            let cycles = self
                .store
                .reaper_cycles()
                .recent(Some(&env(env_name)), 10)
                .await
                .expect("recent cycles");
            if cycles.iter().any(|c| c.cycle.trigger == trigger) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no {trigger:?} cycle recorded within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// `create` retried while the namespace quota is not yet counted (a real API server refuses
/// with 403 "status unknown for quota" for a moment after a quota appears).
pub async fn retry_quota<T, F, Fut>(mut create: F) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClusterError>>,
{
    let until = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        match create().await {
            Err(ClusterError::QuotaPending { .. }) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}
