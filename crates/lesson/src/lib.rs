//! Lessons: the YAML format lesson authors write, its validation, and the typed [`Lesson`]
//! every other crate reads.
//!
//! This crate owns the lesson format and nothing else: it loads a file or a directory of
//! `*.yaml`/`*.yml` files into a [`LessonSet`] (the one file read it performs), and refuses a
//! bad lesson at load with the file, the line and what is wrong — an unknown field, a missing
//! image, a relative lab-file path or one with `..`, a duplicate node name, a memory quantity
//! that does not parse, pool sizes out of order, a lesson id defined twice. It does not render cloud-init or manifests
//! (`ttlab-cloudinit`, `ttlab-vm-manifest`), decide the disk (`ttlab-disk-select`), plan a
//! warm pool (`ttlab-pool`; a [`PoolSpec`] converts into its settings) or run grading
//! (`ttlab-agent`). Sample lessons used by tests and the demo are in [`samples`].
//!
//! ```
//! use ttlab_lesson::{parse_lesson, VmDisk};
//!
//! let lesson = parse_lesson(r#"
//! id: hello
//! title: Hello
//! runtime: vm
//! image: quay.io/containerdisks/debian:12
//! files:
//!   - path: /opt/lab/hello.txt
//!     content: "hi\n"
//! grading:
//!   - name: the file is there
//!     command: test -f /opt/lab/hello.txt
//! "#).unwrap();
//! assert_eq!(lesson.memory.as_str(), "4Gi");
//! assert_eq!(lesson.nodes.first().as_str(), "vm");
//! assert_eq!(lesson.vm_disk, VmDisk::Container);
//! assert_eq!(lesson.files[0].mode.to_octal_string(), "0644");
//!
//! let err = parse_lesson("id: hello\ntitle: Hello\nruntime: vm\nimage: x\ncolour: red\n")
//!     .unwrap_err();
//! assert!(err.to_string().starts_with("<inline>:5:1: unknown field `colour`"), "{err}");
//! ```
//!
//! ## Format
//!
//! | field | meaning | default |
//! |---|---|---|
//! | `id` | lesson id (DNS label, ≤ 40) | required |
//! | `title` | shown to students | required |
//! | `runtime` | `vm` or `pod` | required |
//! | `image` | container disk (VM) or pod image | required |
//! | `vm_disk` | `golden` or `container` | `golden` when `golden` is given, else `container` |
//! | `golden` | `pvc: NAME` or `data_source: NAME`, optional `expected_image` | none |
//! | `memory` | Kubernetes quantity (`4Gi`), at least `128Mi` | `4Gi` |
//! | `cores` | vCPUs per node, 1–64 | 1 |
//! | `nodes` | node names (DNS labels, ≤ 20, distinct) | `[vm]` |
//! | `files` | `path` (absolute, no `..`), `mode` (quoted octal, default `"0644"`), `content` (text) or `content_base64` (bytes) | none |
//! | `setup` | script run as root on every node (`$TTLAB_NODE` names the node) | none |
//! | `readiness_timeout_seconds` | wait for the VMI to run | 150 |
//! | `setup_timeout_seconds` | the setup script is killed after this | 600 |
//! | `grading` | `name`, `command`, `expect_exit` (0), `timeout_seconds` (30), `node` (first node) | none |
//! | `instructions` | Markdown shown beside the terminal ([`instructions`]: CommonMark with tables, strikethrough and task lists; HTML in it shown as text; links `http:`, `https:`, `mailto:`; images `https:`), ≤ 64 KiB | none |
//! | `site_labels` | VM lessons only: labels a site must carry to run it (`[kvm-large]`; see the sites file) | none: any site |
//! | `pool` | VM lessons only: prepared labs kept ready ([`PoolSpec`]): `size` (required), `min` (0), `max` (`size`), `max_age_minutes` (240, 10–1440), `demand` (false), `paused` (false); `min <= size <= max <= 50` | none |
//!
//! Every mapping refuses unknown fields.

mod error;
mod file;
pub mod instructions;
mod lesson;
mod memory;
mod pool;
pub mod samples;
mod set;

pub use error::{LessonError, SourceLocation};
pub use file::{FileMode, LabFile, LabPath, RESERVED_DIRS, RESERVED_NAME_DIRS, is_reserved_path};
pub use instructions::Instructions;
pub use lesson::{
    DEFAULT_GRADING_TIMEOUT, DEFAULT_NODE, DEFAULT_READINESS_TIMEOUT, DEFAULT_SETUP_TIMEOUT,
    GoldenDisk, GoldenSource, GradingStep, Lesson, MAX_CORES, MAX_TIMEOUT, Nodes, VmDisk,
};
pub use memory::{MIN_MEMORY_BYTES, Memory};
pub use pool::{DEFAULT_POOL_MAX_AGE, MAX_POOL_MAX_AGE, MAX_POOL_SIZE, MIN_POOL_MAX_AGE, PoolSpec};
pub use set::{LessonSet, parse_lesson};

/// Deserializes `Raw` from a mapping and validates it into `T` inside the mapping's visitor,
/// so that a validation error carries the line and column of the mapping.
fn validated_map<'de, D, Raw, T>(d: D, expecting: &'static str) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    Raw: serde::Deserialize<'de>,
    T: TryFrom<Raw, Error = String>,
{
    struct V<Raw, T>(&'static str, std::marker::PhantomData<fn() -> (Raw, T)>);
    impl<'de, Raw, T> serde::de::Visitor<'de> for V<Raw, T>
    where
        Raw: serde::Deserialize<'de>,
        T: TryFrom<Raw, Error = String>,
    {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = Raw::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
            T::try_from(raw).map_err(serde::de::Error::custom)
        }
    }
    d.deserialize_map(V(expecting, std::marker::PhantomData))
}
