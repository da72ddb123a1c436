//! The labels ttlab puts on every object it creates, and the selectors built from them.
//!
//! Every VirtualMachine (and its template, so the launcher pod carries them too), Secret,
//! Service, NetworkPolicy and Pod gets [`ObjectLabels`]. The reaper's orphan direction only
//! ever lists with [`env_selector`], so an object of another environment — or one with no
//! labels at all — is never considered (Incident 1).
//!
//! ```
//! use ttlab_model::labels::{self, ObjectLabels};
//! use ttlab_model::{EnvName, SessionId};
//!
//! let env: EnvName = "dev".parse().unwrap();
//! let id: SessionId = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap();
//! let l = ObjectLabels::new(id, env.clone(), "systemd-basics".parse().unwrap(), None);
//! let map = l.to_map();
//! assert_eq!(map[labels::MANAGED_BY], labels::MANAGED_BY_VALUE);
//! assert_eq!(ObjectLabels::from_map(&map).unwrap(), l);
//! assert_eq!(
//!     labels::env_selector(&env),
//!     "app.kubernetes.io/managed-by=ttlab,ttlab.io/env=dev"
//! );
//! ```

use std::collections::BTreeMap;

use crate::{EnvName, LessonId, NodeName, SessionId};

/// `app.kubernetes.io/managed-by`: always [`MANAGED_BY_VALUE`] on ttlab's objects.
pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
/// The value of [`MANAGED_BY`].
pub const MANAGED_BY_VALUE: &str = "ttlab";
/// The session id (hyphenated UUID).
pub const SESSION: &str = "ttlab.io/session";
/// The environment of the backend that created the object.
pub const ENV: &str = "ttlab.io/env";
/// The lesson id.
pub const LESSON: &str = "ttlab.io/lesson";
/// The node of a (possibly multi-VM) lab; absent on session-wide objects.
pub const NODE: &str = "ttlab.io/node";
/// What the object is for: one of the values in [`component`].
pub const COMPONENT: &str = "ttlab.io/component";

/// The values of the [`COMPONENT`] label.
pub mod component {
    /// A lab VirtualMachine (and, through its template, its launcher pod).
    pub const VM: &str = "vm";
    /// A node's cloud-init Secret.
    pub const CLOUD_INIT: &str = "cloud-init";
    /// A multi-VM session's Service and NetworkPolicy.
    pub const SESSION_NETWORK: &str = "session-network";
    /// A pod lab's Pod.
    pub const POD: &str = "pod";
    /// The ConfigMap that carries one version of the grading agent, shared by every VM of
    /// the environment that runs that version.
    pub const AGENT: &str = "agent";
}

/// `app.kubernetes.io/part-of`: [`MANAGED_BY_VALUE`] on the objects ttlab shares between
/// sessions (the agent ConfigMaps). They carry no session label, so nothing that reads
/// [`ObjectLabels`] ever takes them for a session's object.
pub const PART_OF: &str = "app.kubernetes.io/part-of";
/// On a VirtualMachine: the name of the agent ConfigMap it mounts, so the reaper can tell,
/// from a metadata-only list, which agent versions are still in use.
pub const AGENT_CONFIG_MAP: &str = "ttlab.io/agent";
/// The annotation on an agent ConfigMap holding the full sha256 (hex) of the agent binary.
pub const AGENT_SHA256: &str = "ttlab.io/agent-sha256";

/// The labels of the agent ConfigMap of environment `env`: part-of ttlab, component agent,
/// the environment.
pub fn agent_labels(env: &EnvName) -> BTreeMap<String, String> {
    BTreeMap::from([
        (PART_OF.to_owned(), MANAGED_BY_VALUE.to_owned()),
        (COMPONENT.to_owned(), component::AGENT.to_owned()),
        (ENV.to_owned(), env.to_string()),
    ])
}

/// Selects the agent ConfigMaps of environment `env` (and of no other).
pub fn agent_selector(env: &EnvName) -> String {
    format!(
        "{PART_OF}={MANAGED_BY_VALUE},{COMPONENT}={},{ENV}={env}",
        component::AGENT
    )
}

/// The label set of one object ttlab created.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ObjectLabels {
    /// The session the object belongs to.
    pub session: SessionId,
    /// The environment of the backend that created it.
    pub env: EnvName,
    /// The lesson of the session.
    pub lesson: LessonId,
    /// The node, for per-node objects (VMs, their Secrets, pods).
    pub node: Option<NodeName>,
}

impl ObjectLabels {
    /// Builds the label set.
    pub fn new(session: SessionId, env: EnvName, lesson: LessonId, node: Option<NodeName>) -> Self {
        Self {
            session,
            env,
            lesson,
            node,
        }
    }

    /// The same labels for another node of the session (or none, for session-wide objects).
    pub fn for_node(&self, node: Option<NodeName>) -> Self {
        Self {
            node,
            ..self.clone()
        }
    }

    /// As Kubernetes labels, in a stable order.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        let mut m = BTreeMap::new();
        m.insert(MANAGED_BY.to_owned(), MANAGED_BY_VALUE.to_owned());
        m.insert(SESSION.to_owned(), self.session.to_string());
        m.insert(ENV.to_owned(), self.env.to_string());
        m.insert(LESSON.to_owned(), self.lesson.to_string());
        if let Some(node) = &self.node {
            m.insert(NODE.to_owned(), node.to_string());
        }
        m
    }

    /// Reads the label set back from an object's labels. `None` unless the object is marked as
    /// ttlab's and every required label is present and valid: such an object is never guessed at.
    pub fn from_map(map: &BTreeMap<String, String>) -> Option<Self> {
        if map.get(MANAGED_BY).map(String::as_str) != Some(MANAGED_BY_VALUE) {
            return None;
        }
        Some(Self {
            session: map.get(SESSION)?.parse().ok()?,
            env: map.get(ENV)?.parse().ok()?,
            lesson: map.get(LESSON)?.parse().ok()?,
            node: match map.get(NODE) {
                Some(n) => Some(n.parse().ok()?),
                None => None,
            },
        })
    }
}

/// Selects every object ttlab's backend of environment `env` created.
pub fn env_selector(env: &EnvName) -> String {
    format!("{MANAGED_BY}={MANAGED_BY_VALUE},{ENV}={env}")
}

/// Selects every object of one session of environment `env`.
pub fn session_selector(env: &EnvName, session: SessionId) -> String {
    format!("{},{SESSION}={session}", env_selector(env))
}

/// Selects every object ttlab created, whatever its environment (used for capacity, which
/// counts every live VM in the namespace).
pub fn managed_selector() -> String {
    format!("{MANAGED_BY}={MANAGED_BY_VALUE}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ObjectLabels {
        ObjectLabels::new(
            SessionId::new_random(),
            "prod".parse().unwrap(),
            "kubeadm".parse().unwrap(),
            Some("worker-1".parse().unwrap()),
        )
    }

    #[test]
    fn round_trips_through_a_map() {
        let l = sample();
        assert_eq!(ObjectLabels::from_map(&l.to_map()), Some(l.clone()));
        let no_node = l.for_node(None);
        assert!(!no_node.to_map().contains_key(NODE));
        assert_eq!(ObjectLabels::from_map(&no_node.to_map()), Some(no_node));
    }

    #[test]
    fn unlabelled_or_foreign_objects_are_not_ours() {
        let mut m = sample().to_map();
        m.insert(MANAGED_BY.into(), "someone-else".into());
        assert_eq!(ObjectLabels::from_map(&m), None);
        let mut m = sample().to_map();
        m.remove(ENV);
        assert_eq!(ObjectLabels::from_map(&m), None);
        let mut m = sample().to_map();
        m.insert(SESSION.into(), "not-a-uuid".into());
        assert_eq!(ObjectLabels::from_map(&m), None);
        assert_eq!(ObjectLabels::from_map(&BTreeMap::new()), None);
    }

    #[test]
    fn selectors_name_env_and_session() {
        let l = sample();
        let s = session_selector(&l.env, l.session);
        assert!(s.starts_with("app.kubernetes.io/managed-by=ttlab,ttlab.io/env=prod,"));
        assert!(s.ends_with(&l.session.to_string()));
        assert_eq!(managed_selector(), "app.kubernetes.io/managed-by=ttlab");
    }

    #[test]
    fn agent_labels_are_environment_scoped_and_never_a_session() {
        let env: EnvName = "prod".parse().unwrap();
        let labels = agent_labels(&env);
        assert_eq!(ObjectLabels::from_map(&labels), None);
        assert_eq!(labels[ENV], "prod");
        assert_eq!(
            agent_selector(&env),
            "app.kubernetes.io/part-of=ttlab,ttlab.io/component=agent,ttlab.io/env=prod"
        );
        assert!(!agent_selector(&"dev".parse().unwrap()).contains("prod"));
    }
}
