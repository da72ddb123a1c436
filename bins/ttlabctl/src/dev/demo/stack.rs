//! The parts of a one-machine ttlab that run inside ttlabctl: a throwaway PostgreSQL with the
//! schema applied, and kube-sim with the VM namespace and golden disks.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::Path;

use anyhow::Context as _;
use serde_json::json;
use ttlab_disk_select::{ANN_GOLDEN_IMAGE, ANN_IMPORT_POD_PHASE};
use ttlab_kube_sim::{KubeSim, SimConfig, Timings};
use ttlab_lesson::{GoldenSource, Lesson, LessonSet, VmDisk};
use ttlab_store::ephemeral::PgCluster;
use ttlab_store::{Store, StoreOptions};

/// The database the server and reaper share.
const DATABASE: &str = "ttlab";

/// A throwaway PostgreSQL cluster holding a migrated `ttlab` database.
pub(crate) struct Database {
    cluster: PgCluster,
    url: String,
}

impl Database {
    /// Starts the cluster (a fraction of a second once the machine's template exists),
    /// creates the database and applies the schema.
    pub(crate) async fn start() -> anyhow::Result<Self> {
        let cluster = tokio::task::spawn_blocking(PgCluster::start)
            .await
            .context("starting PostgreSQL")?
            .context("starting a throwaway PostgreSQL")?;
        let url = cluster
            .create_database(DATABASE)
            .await
            .context("creating the ttlab database")?;
        let store = Store::connect(&url, StoreOptions::default()).await?;
        store.migrate().await.context("applying the schema")?;
        store.close();
        Ok(Self { cluster, url })
    }

    /// `DATABASE_URL` for the children (a unix socket in a private directory).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// The private directory holding the socket, data and log (deleted by [`Database::stop`]).
    pub(crate) fn dir(&self) -> &Path {
        self.cluster.socket_dir()
    }

    /// Stops the server as a crash would (every connection cut), keeping its data, so that
    /// [`Database::resume`] starts it again at the same URL (outages of the soak test).
    pub(crate) async fn pause(&mut self) -> anyhow::Result<()> {
        tokio::task::block_in_place(|| self.cluster.pause()).context("stopping PostgreSQL")
    }

    /// Starts a paused server again and waits until it accepts connections.
    pub(crate) async fn resume(&mut self) -> anyhow::Result<()> {
        tokio::task::block_in_place(|| self.cluster.resume()).context("restarting PostgreSQL")
    }

    /// Stops the server (immediate shutdown) and deletes its directory.
    pub(crate) async fn stop(self) -> anyhow::Result<()> {
        tokio::task::spawn_blocking(move || self.cluster.stop())
            .await
            .context("stopping PostgreSQL")?
            .context("stopping PostgreSQL")
    }
}

/// Starts kube-sim on a free loopback port with namespaces `default` and `namespace`.
pub(crate) async fn start_sim(
    namespace: &str,
    timings: Timings,
    guest_root: &Path,
) -> anyhow::Result<KubeSim> {
    start_sim_with(
        namespace,
        timings,
        guest_root,
        ttlab_kube_sim::guest::GuestBackend::Simulated,
    )
    .await
}

/// [`start_sim`] with the given guest backend (real qemu guests for `demo --guest qemu`).
pub(crate) async fn start_sim_with(
    namespace: &str,
    timings: Timings,
    guest_root: &Path,
    guest: ttlab_kube_sim::guest::GuestBackend,
) -> anyhow::Result<KubeSim> {
    let mut config = SimConfig::new(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
    config.namespaces = if namespace == "default" {
        vec!["default".into()]
    } else {
        vec!["default".into(), namespace.to_owned()]
    };
    config.timings = timings;
    config.guest_root = Some(guest_root.to_path_buf());
    config.guest = guest;
    KubeSim::start(config).await.context("starting kube-sim")
}

/// How a lesson's root disk will be chosen in the simulated cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GoldenSetup {
    /// The golden PVC exists, usable: sessions get the golden disk.
    Present {
        /// The PVC's name.
        pvc: String,
    },
    /// The golden disk is absent: sessions fall back to the container disk.
    Absent {
        /// What the lesson names (`PVC x` or `DataSource y`).
        source: String,
    },
    /// The lesson always uses its container disk (or is not a VM lesson).
    NotUsed,
}

/// Creates the golden PVC of the first lesson (by id) that names a PVC, leaving every other
/// golden disk absent, so both branches of the disk decision can be seen. Returns what each
/// lesson will find.
pub(crate) fn create_golden_disks(
    sim: &KubeSim,
    namespace: &str,
    lessons: &LessonSet,
) -> anyhow::Result<BTreeMap<String, GoldenSetup>> {
    let mut out = BTreeMap::new();
    let mut created = false;
    let mut sorted: Vec<&Lesson> = lessons.iter().collect();
    sorted.sort_by(|a, b| a.id.as_str().cmp(b.id.as_str()));
    for lesson in sorted {
        let setup = match &lesson.vm_disk {
            VmDisk::Container => GoldenSetup::NotUsed,
            VmDisk::Golden(g) => match &g.source {
                GoldenSource::Pvc(pvc) if !created => {
                    let image = g.expected_image.as_deref().unwrap_or(&lesson.image);
                    create_golden_pvc(sim, namespace, pvc, image)?;
                    created = true;
                    GoldenSetup::Present { pvc: pvc.clone() }
                }
                GoldenSource::Pvc(pvc) => GoldenSetup::Absent {
                    source: format!("PVC {pvc}"),
                },
                GoldenSource::DataSource(ds) => GoldenSetup::Absent {
                    source: format!("DataSource {ds}"),
                },
            },
        };
        out.insert(lesson.id.as_str().to_owned(), setup);
    }
    Ok(out)
}

/// A golden PVC as an operator's CDI import leaves it: Bound, ReadOnlyMany, a raw disk image
/// (`contentType: kubevirt`), the import finished, and the image it holds recorded.
fn create_golden_pvc(
    sim: &KubeSim,
    namespace: &str,
    name: &str,
    image: &str,
) -> anyhow::Result<()> {
    sim.create(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {
                ANN_GOLDEN_IMAGE: image,
                ANN_IMPORT_POD_PHASE: "Succeeded",
                "cdi.kubevirt.io/storage.contentType": "kubevirt",
                "cdi.kubevirt.io/storage.import.endpoint": format!("docker://{image}"),
            },
        },
        "spec": {
            "accessModes": ["ReadOnlyMany"],
            "volumeMode": "Block",
            "resources": {"requests": {"storage": "10Gi"}},
        },
    }))
    .with_context(|| format!("creating the golden PVC {namespace}/{name}"))?;
    sim.set_status(
        "persistentvolumeclaims",
        namespace,
        name,
        json!({
            "phase": "Bound",
            "accessModes": ["ReadOnlyMany"],
            "capacity": {"storage": "10Gi"},
        }),
    )
    .with_context(|| format!("marking the golden PVC {namespace}/{name} Bound"))?;
    Ok(())
}

/// A free TCP port on 127.0.0.1 (bound, then released: another process could take it in
/// between, which the caller reports as a bind failure of its child).
pub(crate) fn free_loopback_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free port")?;
    Ok(l.local_addr()?.port())
}
