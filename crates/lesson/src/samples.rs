//! The sample lessons shipped in the repository's `lessons/` directory, compiled in so tests
//! and the demo can use them without knowing where the checkout is.
//!
//! ```
//! let set = ttlab_lesson::samples::sample_set();
//! assert_eq!(set.len(), 2);
//! assert_eq!(ttlab_lesson::samples::kubeadm_cluster().nodes.len(), 3);
//! ```

use std::path::PathBuf;

use crate::{Lesson, LessonSet, parse_lesson};

/// `lessons/systemd-basics.yaml`: one VM; write, repair and schedule systemd units.
pub const SYSTEMD_BASICS_YAML: &str = include_str!("../../../lessons/systemd-basics.yaml");
/// `lessons/kubeadm-cluster.yaml`: three VMs; bootstrap a cluster with kubeadm.
pub const KUBEADM_CLUSTER_YAML: &str = include_str!("../../../lessons/kubeadm-cluster.yaml");

/// The single-VM systemd lesson.
pub fn systemd_basics() -> Lesson {
    parse_lesson(SYSTEMD_BASICS_YAML).expect("the shipped systemd-basics lesson is valid")
}

/// The three-node kubeadm lesson (control-plane, worker-1, worker-2).
pub fn kubeadm_cluster() -> Lesson {
    parse_lesson(KUBEADM_CLUSTER_YAML).expect("the shipped kubeadm-cluster lesson is valid")
}

/// Both sample lessons as a set, as if loaded from `lessons/`.
pub fn sample_set() -> LessonSet {
    LessonSet::from_sources([
        (
            PathBuf::from("lessons/kubeadm-cluster.yaml"),
            KUBEADM_CLUSTER_YAML.to_owned(),
        ),
        (
            PathBuf::from("lessons/systemd-basics.yaml"),
            SYSTEMD_BASICS_YAML.to_owned(),
        ),
    ])
    .expect("the shipped lessons are valid and distinct")
}
