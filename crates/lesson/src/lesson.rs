//! The typed lesson and the YAML shape it is read from.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use ttlab_model::{LessonId, NodeName, Runtime, SiteLabel};

use crate::file::LabFile;
use crate::instructions::Instructions;
use crate::memory::Memory;
use crate::pool::PoolSpec;

/// Default time the server waits for the VMI to be Running: 150 s.
pub const DEFAULT_READINESS_TIMEOUT: Duration = Duration::from_secs(150);
/// Default time the guest's setup script may run before it is killed and the session fails:
/// 600 s. Setup scripts install packages (a kubeadm node needs a few minutes on a slow
/// mirror); ten minutes leaves room for that while still failing a hung script honestly.
pub const DEFAULT_SETUP_TIMEOUT: Duration = Duration::from_secs(600);
/// Default time one grading command may run: 30 s.
pub const DEFAULT_GRADING_TIMEOUT: Duration = Duration::from_secs(30);
/// The node of a single-VM lesson that names none: `vm`.
pub const DEFAULT_NODE: &str = "vm";
/// The most CPU cores a lesson may ask for per node.
pub const MAX_CORES: u32 = 64;
/// The longest any lesson timeout may be: one day.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// One lesson, validated: every value here is well formed and consistent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lesson {
    /// Unique id (DNS label, at most 40 characters); used in labels and URLs.
    pub id: LessonId,
    /// Human title shown to students.
    pub title: String,
    /// VM or pod.
    pub runtime: Runtime,
    /// The container-disk image (VM) or the pod image. Always set: it is also the VM's
    /// fallback disk when the golden disk cannot be used.
    pub image: String,
    /// Which root disk a VM prefers.
    pub vm_disk: VmDisk,
    /// Guest memory (requests equal the guest memory: no overcommit).
    pub memory: Memory,
    /// vCPUs per node.
    pub cores: u32,
    /// The nodes of the lab: at least one, no duplicates, in the order written. The first is the
    /// session's representative (its VM owns the others).
    pub nodes: Nodes,
    /// Files written into every node before the setup script runs.
    pub files: Vec<LabFile>,
    /// Setup script run as root on every node after the files are written; `None` for none.
    /// The node's name is in `$TTLAB_NODE`, so one script can serve several nodes.
    pub setup: Option<String>,
    /// How long the server waits for the VMI to be Running.
    pub readiness_timeout: Duration,
    /// How long the setup script may run.
    pub setup_timeout: Duration,
    /// Grading steps, in order.
    pub grading: Vec<GradingStep>,
    /// What the student is asked to do, shown beside the terminal; `None` for none.
    pub instructions: Option<Instructions>,
    /// The warm pool of prepared labs kept for this lesson (VM lessons only); `None` for none.
    pub pool: Option<PoolSpec>,
    /// The labels a site must carry to run this lesson (`site_labels: [kvm-large]`, VM lessons
    /// only): a start is placed only on a site that has every one. Empty: any site.
    pub site_labels: BTreeSet<SiteLabel>,
}

/// Which root disk a VM lesson prefers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmDisk {
    /// Always the container disk ([`Lesson::image`]).
    Container,
    /// The golden disk when it is usable, else the container disk (never an error).
    Golden(GoldenDisk),
}

/// Where the golden disk comes from and what it must contain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoldenDisk {
    /// The PVC, or the CDI DataSource that points at the current PVC.
    pub source: GoldenSource,
    /// The image the golden disk must have been imported from. When set and the cluster
    /// reports another image, the golden disk is not used ("different image").
    pub expected_image: Option<String>,
}

/// The name of the golden disk's source object, in the VMs' namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GoldenSource {
    /// A PersistentVolumeClaim holding the raw image.
    Pvc(String),
    /// A CDI DataSource, resolved to its current PVC when the session is created.
    DataSource(String),
}

/// The nodes of a lab: one or more distinct names, in the order the lesson gives them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nodes(Vec<NodeName>);

impl Nodes {
    /// Validates a node list: not empty, no duplicates.
    pub fn new(nodes: Vec<NodeName>) -> Result<Self, String> {
        if nodes.is_empty() {
            return Err("`nodes` is empty: a lab needs at least one node".to_owned());
        }
        let mut seen = BTreeSet::new();
        for n in &nodes {
            if !seen.insert(n) {
                return Err(format!("duplicate node name `{n}`"));
            }
        }
        Ok(Self(nodes))
    }

    /// The single default node, `vm`.
    pub fn single_default() -> Self {
        Self(vec![
            NodeName::new(DEFAULT_NODE).expect("`vm` is a valid node name"),
        ])
    }

    /// The first node: the session's representative.
    pub fn first(&self) -> &NodeName {
        &self.0[0]
    }

    /// Every node, in order.
    pub fn as_slice(&self) -> &[NodeName] {
        &self.0
    }

    /// Iterates the nodes in order.
    pub fn iter(&self) -> std::slice::Iter<'_, NodeName> {
        self.0.iter()
    }

    /// Number of nodes (at least one).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Always false: a lab has at least one node.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `node` is one of them.
    pub fn contains(&self, node: &NodeName) -> bool {
        self.0.contains(node)
    }
}

impl<'de> Deserialize<'de> for Nodes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Nodes;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of node names")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, seq: A) -> Result<Nodes, A::Error> {
                let names = Vec::<NodeName>::deserialize(
                    serde::de::value::SeqAccessDeserializer::new(seq),
                )?;
                Nodes::new(names).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_seq(V)
    }
}

/// One grading step: run `command` with `/bin/sh -c` as root on `node` through the agent and
/// compare its exit code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradingStep {
    /// Shown to the student (unique within the lesson).
    pub name: String,
    /// Shell command line.
    pub command: String,
    /// The exit code that means "passed" (0–255).
    pub expect_exit: i32,
    /// Killed (and failed) after this long.
    pub timeout: Duration,
    /// The node it runs on (the first node unless the lesson says otherwise).
    pub node: NodeName,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGradingStep {
    name: String,
    command: String,
    #[serde(default)]
    expect_exit: i32,
    timeout_seconds: Option<u64>,
    node: Option<NodeName>,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
enum RawVmDisk {
    Golden,
    Container,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGolden {
    pvc: Option<String>,
    data_source: Option<String>,
    expected_image: Option<String>,
}

/// The lesson exactly as the YAML says, before cross-field checks.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawLesson {
    id: LessonId,
    title: String,
    runtime: Runtime,
    image: String,
    vm_disk: Option<RawVmDisk>,
    golden: Option<RawGolden>,
    memory: Option<Memory>,
    cores: Option<u32>,
    nodes: Option<Nodes>,
    #[serde(default)]
    files: Vec<LabFile>,
    setup: Option<String>,
    readiness_timeout_seconds: Option<u64>,
    setup_timeout_seconds: Option<u64>,
    #[serde(default)]
    grading: Vec<RawGradingStep>,
    instructions: Option<String>,
    pool: Option<PoolSpec>,
    #[serde(default)]
    site_labels: BTreeSet<SiteLabel>,
}

fn timeout(field: &str, seconds: Option<u64>, default: Duration) -> Result<Duration, String> {
    match seconds {
        None => Ok(default),
        Some(0) => Err(format!("`{field}` must be at least 1")),
        Some(s) if Duration::from_secs(s) > MAX_TIMEOUT => Err(format!(
            "`{field}` is {s}; the most allowed is 86400 (one day)"
        )),
        Some(s) => Ok(Duration::from_secs(s)),
    }
}

/// Kubernetes object names (PVC, DataSource): DNS-1123 subdomains.
fn check_object_name(field: &str, name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{field}` {name:?} is not a valid Kubernetes object name \
             (lowercase letters, digits, '-' and '.', at most 253 characters)"
        ))
    }
}

fn check_image(image: &str) -> Result<(), String> {
    if image.trim().is_empty() {
        return Err("`image` is empty: give the container disk (VM) or pod image".to_owned());
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`image` {image:?} contains whitespace"));
    }
    Ok(())
}

impl TryFrom<RawLesson> for Lesson {
    type Error = String;

    fn try_from(raw: RawLesson) -> Result<Self, String> {
        let id = raw.id;
        let fail = |msg: String| Err(format!("lesson `{id}`: {msg}"));
        if raw.title.trim().is_empty() {
            return fail("`title` is empty".to_owned());
        }
        if let Err(e) = check_image(&raw.image) {
            return fail(e);
        }
        let vm_disk = match (raw.vm_disk, raw.golden) {
            (None | Some(RawVmDisk::Container), None) => VmDisk::Container,
            (Some(RawVmDisk::Container), Some(_)) => {
                return fail("`golden` is set but `vm_disk` is `container`".to_owned());
            }
            (None | Some(RawVmDisk::Golden), Some(g)) => {
                let source = match (g.pvc, g.data_source) {
                    (Some(pvc), None) => {
                        if let Err(e) = check_object_name("golden.pvc", &pvc) {
                            return fail(e);
                        }
                        GoldenSource::Pvc(pvc)
                    }
                    (None, Some(ds)) => {
                        if let Err(e) = check_object_name("golden.data_source", &ds) {
                            return fail(e);
                        }
                        GoldenSource::DataSource(ds)
                    }
                    _ => {
                        return fail(
                            "`golden` needs exactly one of `pvc` (a claim name) and \
                             `data_source` (a CDI DataSource name)"
                                .to_owned(),
                        );
                    }
                };
                if let Some(Err(e)) = g.expected_image.as_deref().map(check_image) {
                    return fail(format!("golden.expected_image: {e}"));
                }
                VmDisk::Golden(GoldenDisk {
                    source,
                    expected_image: g.expected_image,
                })
            }
            (Some(RawVmDisk::Golden), None) => {
                return fail(
                    "`vm_disk: golden` needs a `golden` section with `pvc` or `data_source`"
                        .to_owned(),
                );
            }
        };
        let nodes = raw.nodes.unwrap_or_else(Nodes::single_default);
        if raw.runtime == Runtime::Pod {
            if matches!(vm_disk, VmDisk::Golden(_)) {
                return fail("`vm_disk: golden` only applies to `runtime: vm`".to_owned());
            }
            if nodes.len() > 1 {
                return fail("a `runtime: pod` lesson has exactly one node".to_owned());
            }
            if raw.pool.is_some() {
                return fail(
                    "`pool` only applies to `runtime: vm` lessons (a pod lab starts in seconds)"
                        .to_owned(),
                );
            }
            if !raw.site_labels.is_empty() {
                return fail(
                    "`site_labels` only applies to `runtime: vm` lessons (a pod lab runs on the \
                     first site that answers)"
                        .to_owned(),
                );
            }
        }
        let cores = raw.cores.unwrap_or(1);
        if !(1..=MAX_CORES).contains(&cores) {
            return fail(format!(
                "`cores` is {cores}; it must be from 1 to {MAX_CORES}"
            ));
        }
        let mut paths = BTreeSet::new();
        for f in &raw.files {
            if !paths.insert(f.path.as_str()) {
                return fail(format!("file path {} appears twice", f.path));
            }
        }
        if raw.setup.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return fail("`setup` is empty: leave it out instead".to_owned());
        }
        let readiness_timeout = match timeout(
            "readiness_timeout_seconds",
            raw.readiness_timeout_seconds,
            DEFAULT_READINESS_TIMEOUT,
        ) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let setup_timeout = match timeout(
            "setup_timeout_seconds",
            raw.setup_timeout_seconds,
            DEFAULT_SETUP_TIMEOUT,
        ) {
            Ok(t) => t,
            Err(e) => return fail(e),
        };
        let mut names = BTreeSet::new();
        let mut grading = Vec::with_capacity(raw.grading.len());
        for (i, step) in raw.grading.into_iter().enumerate() {
            let at = format!("grading[{i}]");
            if step.name.trim().is_empty() {
                return fail(format!("{at}: `name` is empty"));
            }
            if !names.insert(step.name.clone()) {
                return fail(format!("{at}: duplicate step name {:?}", step.name));
            }
            if step.command.trim().is_empty() {
                return fail(format!("{at}: `command` is empty"));
            }
            if !(0..=255).contains(&step.expect_exit) {
                return fail(format!(
                    "{at}: `expect_exit` is {}; exit codes are 0 to 255",
                    step.expect_exit
                ));
            }
            let node = match step.node {
                Some(n) if nodes.contains(&n) => n,
                Some(n) => {
                    return fail(format!(
                        "{at}: `node` `{n}` is not one of the lesson's nodes"
                    ));
                }
                None => nodes.first().clone(),
            };
            let timeout = match timeout(
                &format!("{at}.timeout_seconds"),
                step.timeout_seconds,
                DEFAULT_GRADING_TIMEOUT,
            ) {
                Ok(t) => t,
                Err(e) => return fail(e),
            };
            grading.push(GradingStep {
                name: step.name,
                command: step.command,
                expect_exit: step.expect_exit,
                timeout,
                node,
            });
        }
        let instructions = match raw.instructions.map(Instructions::new).transpose() {
            Ok(i) => i,
            Err(e) => return fail(e),
        };
        Ok(Lesson {
            instructions,
            id,
            title: raw.title,
            runtime: raw.runtime,
            image: raw.image,
            vm_disk,
            memory: raw.memory.unwrap_or_else(Memory::default_for_lesson),
            cores,
            nodes,
            files: raw.files,
            setup: raw.setup,
            readiness_timeout,
            setup_timeout,
            grading,
            pool: raw.pool,
            site_labels: raw.site_labels,
        })
    }
}

impl<'de> Deserialize<'de> for Lesson {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::validated_map::<D, RawLesson, Lesson>(d, "a lesson (a mapping)")
    }
}
