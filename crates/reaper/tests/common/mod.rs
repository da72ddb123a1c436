//! A throwaway PostgreSQL database and a kube-sim per test, with the real `KubeCluster`
//! pointed at it over HTTP, and helpers to open sessions and create their objects the way the
//! server does (VMs rendered by ttlab-vm-manifest, then each cloud-init Secret).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use ttlab_cluster::{Cluster, ClusterSettings, KubeCluster};
use ttlab_disk_select::{DiskDecision, FallbackReason};
use ttlab_kube_sim::{KubeSim, SimConfig};
use ttlab_model::labels::{COMPONENT, ObjectLabels};
use ttlab_model::{EnvName, NodeName, Runtime, SessionId, SessionStatus, UserId};
use ttlab_reaper::{ReaperContext, ReaperSettings};
use ttlab_store::testing::TestDb;
use ttlab_store::{NewSession, Session, SessionTimes, SessionVm, Store};
use ttlab_vm_manifest::{SessionVms, render, secret_name, vm_name};

/// The namespace every test works in (`SimConfig::for_tests` creates it).
pub const NS: &str = "ttlab";
pub const LESSON: &str = "systemd-basics";

pub struct Harness {
    pub db: TestDb,
    pub store: Store,
    pub sim: KubeSim,
    pub cluster: Arc<KubeCluster>,
    pub dir: tempfile::TempDir,
}

pub fn env(name: &str) -> EnvName {
    name.parse().expect("env name")
}

pub fn node(name: &str) -> NodeName {
    name.parse().expect("node name")
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
        let cluster = KubeCluster::from_kubeconfig(
            &dir.path().join("kubeconfig"),
            ClusterSettings::in_namespace(NS),
        )
        .await
        .expect("cluster client");
        Self {
            db,
            store,
            sim,
            cluster: Arc::new(cluster),
            dir,
        }
    }

    pub fn kubeconfig(&self) -> std::path::PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// A reaper of `env_name` with no minimum orphan age (objects in tests are seconds old).
    pub fn ctx(&self, env_name: &str) -> ReaperContext {
        ReaperContext::new(self.store.clone(), self.cluster.clone(), env(env_name)).with_settings(
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
            let created = self
                .cluster
                .create_vm(serde_json::to_value(vm).expect("vm json"))
                .await
                .expect("create vm");
            let owner = owner_link.then(|| created.owner_reference());
            self.create_secret(env_name, session, n, owner).await;
        }
        if let Some(svc) = manifests.service {
            self.cluster.create_service(svc).await.expect("service");
        }
        if let Some(np) = manifests.network_policy {
            self.cluster
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
        self.cluster
            .create_secret(secret)
            .await
            .expect("create secret");
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
            .sim
            .create_backdated(secret, created_at)
            .expect("create backdated secret");
        let written = stored["metadata"]["creationTimestamp"]
            .as_str()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .expect("creationTimestamp");
        assert_eq!(written.timestamp(), created_at.timestamp());
    }

    /// Whether the object exists and is not being deleted.
    pub fn alive(&self, resource: &str, name: &str) -> bool {
        self.sim
            .get(resource, NS, name)
            .is_some_and(|o| o["metadata"].get("deletionTimestamp").is_none())
    }

    pub fn vm_alive(&self, session: SessionId, n: &str) -> bool {
        self.alive("virtualmachines", &vm_name(session, &node(n)))
    }

    pub fn secret_alive(&self, session: SessionId, n: &str) -> bool {
        self.alive("secrets", &secret_name(session, &node(n)))
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
}
