//! Authorization as a real API server's RBAC authorizer decides it, for the calls of an
//! identified user (a bearer token the sim issued, or an `Impersonate-User`): the Roles,
//! ClusterRoles, RoleBindings and ClusterRoleBindings given to [`crate::KubeSim::apply_rbac`]
//! (for instance the shipped `deploy/` objects) are the whole policy, and a call no rule
//! allows is refused with `403 Forbidden` and the real server's message. A ServiceAccount's
//! user (`system:serviceaccount:<ns>:<name>`) is in the groups `system:serviceaccounts`,
//! `system:serviceaccounts:<ns>` and `system:authenticated`; every other identified user in
//! `system:authenticated`. Calls without credentials are kube-sim's administrator's and are
//! always served (the kubeconfigs [`crate::KubeSim::kubeconfig_yaml`] writes carry none).
//! A `pods/exec` WebSocket upgrade (a GET) comes here twice (`crate::exec`), as Kubernetes 1.35
//! and later authorize it: as `get`, its own verb, then as `create`.

use std::sync::{PoisonError, RwLock};

use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, RoleRef, Subject,
};
use serde_json::Value;

use crate::faults::CallKey;
use crate::status::ApiError;

/// One binding: whose, and the rules it grants (resolved when the policy is read: a binding
/// to a role given later is resolved again on every apply).
#[derive(Debug, Clone)]
struct Binding {
    /// `None` for a ClusterRoleBinding (every namespace and the cluster scope).
    namespace: Option<String>,
    subjects: Vec<Subject>,
    role: RoleRef,
}

#[derive(Debug, Default)]
struct Policy {
    roles: Vec<Role>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<Binding>,
}

/// The policy of the sim (empty at start: an identified user may do nothing).
#[derive(Debug, Default)]
pub(crate) struct Rbac {
    policy: RwLock<Policy>,
}

/// Why [`crate::KubeSim::apply_rbac`] refused an object.
#[derive(Debug, thiserror::Error)]
#[error("not an RBAC object kube-sim can apply ({what}): {why}")]
pub struct RbacError {
    what: String,
    why: String,
}

/// The documents of a YAML stream, as JSON values (empty documents skipped).
pub(crate) fn parse_yaml_stream(yaml: &str) -> Result<Vec<Value>, RbacError> {
    let mut objects = Vec::new();
    for document in serde_norway::Deserializer::from_str(yaml) {
        let v: Value = serde::Deserialize::deserialize(document).map_err(|e| RbacError {
            what: "YAML".into(),
            why: e.to_string(),
        })?;
        if !v.is_null() {
            objects.push(v);
        }
    }
    Ok(objects)
}

impl Rbac {
    /// Adds Roles, ClusterRoles, RoleBindings and ClusterRoleBindings (an object of the same
    /// kind, namespace and name replaces the one before); objects of other kinds are ignored,
    /// so a whole rendered overlay can be given.
    pub(crate) fn apply(&self, objects: &[Value]) -> Result<usize, RbacError> {
        let mut policy = self.policy.write().unwrap_or_else(PoisonError::into_inner);
        let mut applied = 0;
        for o in objects {
            let kind = o["kind"].as_str().unwrap_or_default();
            let what = format!(
                "{kind} {}/{}",
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
                o["metadata"]["name"].as_str().unwrap_or_default()
            );
            let bad = |e: serde_json::Error| RbacError {
                what: what.clone(),
                why: e.to_string(),
            };
            match kind {
                "Role" => {
                    let r: Role = serde_json::from_value(o.clone()).map_err(bad)?;
                    policy.roles.retain(|x| {
                        (&x.metadata.namespace, &x.metadata.name)
                            != (&r.metadata.namespace, &r.metadata.name)
                    });
                    policy.roles.push(r);
                }
                "ClusterRole" => {
                    let r: ClusterRole = serde_json::from_value(o.clone()).map_err(bad)?;
                    policy
                        .cluster_roles
                        .retain(|x| x.metadata.name != r.metadata.name);
                    policy.cluster_roles.push(r);
                }
                "RoleBinding" => {
                    let b: RoleBinding = serde_json::from_value(o.clone()).map_err(bad)?;
                    let Some(ns) = b.metadata.namespace.clone() else {
                        return Err(RbacError {
                            what,
                            why: "a RoleBinding needs a namespace".into(),
                        });
                    };
                    policy.bindings.push(Binding {
                        namespace: Some(ns),
                        subjects: b.subjects.unwrap_or_default(),
                        role: b.role_ref,
                    });
                }
                "ClusterRoleBinding" => {
                    let b: ClusterRoleBinding = serde_json::from_value(o.clone()).map_err(bad)?;
                    policy.bindings.push(Binding {
                        namespace: None,
                        subjects: b.subjects.unwrap_or_default(),
                        role: b.role_ref,
                    });
                }
                _ => continue,
            }
            applied += 1;
        }
        Ok(applied)
    }

    /// Whether `user` may make the call `key` (`None`: the sim's administrator, always).
    pub(crate) fn authorize(&self, user: Option<&str>, key: &CallKey<'_>) -> Result<(), ApiError> {
        let Some(user) = user else { return Ok(()) };
        let policy = self.policy.read().unwrap_or_else(PoisonError::into_inner);
        let request = Request::of(key);
        let groups = groups_of(user);
        let allowed = policy.bindings.iter().any(|b| {
            let in_scope = match (&b.namespace, key.namespace) {
                (None, _) => true,
                (Some(bns), Some(ns)) => bns == ns,
                (Some(_), None) => false,
            };
            in_scope
                && b.subjects
                    .iter()
                    .any(|s| subject_matches(s, user, &groups, b.namespace.as_deref()))
                && policy.rules_of(b).iter().any(|r| rule_allows(r, &request))
        });
        if allowed {
            Ok(())
        } else {
            Err(forbidden(user, &request, key))
        }
    }
}

impl Policy {
    fn rules_of(&self, b: &Binding) -> &[PolicyRule] {
        let rules = match b.role.kind.as_str() {
            "Role" => self
                .roles
                .iter()
                .find(|r| {
                    r.metadata.name.as_deref() == Some(&b.role.name)
                        && r.metadata.namespace == b.namespace
                })
                .and_then(|r| r.rules.as_deref()),
            "ClusterRole" => self
                .cluster_roles
                .iter()
                .find(|r| r.metadata.name.as_deref() == Some(&b.role.name))
                .and_then(|r| r.rules.as_deref()),
            _ => None,
        };
        rules.unwrap_or_default()
    }
}

/// A call as RBAC reads it.
struct Request<'a> {
    verb: &'static str,
    group: &'a str,
    /// `plural` or `plural/subresource`.
    resource: &'a str,
    name: Option<&'a str>,
}

impl<'a> Request<'a> {
    fn of(key: &CallKey<'a>) -> Self {
        Self {
            verb: key.verb.as_str(),
            group: key.group.unwrap_or_default(),
            resource: key.resource,
            name: key.name,
        }
    }
}

fn groups_of(user: &str) -> Vec<String> {
    let mut groups = vec!["system:authenticated".to_owned()];
    if let Some(rest) = user.strip_prefix("system:serviceaccount:")
        && let Some((ns, _)) = rest.split_once(':')
    {
        groups.push("system:serviceaccounts".to_owned());
        groups.push(format!("system:serviceaccounts:{ns}"));
    }
    groups
}

fn subject_matches(s: &Subject, user: &str, groups: &[String], binding_ns: Option<&str>) -> bool {
    match s.kind.as_str() {
        "User" => s.name == user,
        "Group" => groups.contains(&s.name),
        "ServiceAccount" => {
            let ns = s.namespace.as_deref().or(binding_ns).unwrap_or_default();
            user == format!("system:serviceaccount:{ns}:{}", s.name)
        }
        _ => false,
    }
}

fn rule_allows(r: &PolicyRule, req: &Request<'_>) -> bool {
    let verbs = r.verbs.iter().any(|v| v == "*" || v == req.verb);
    let groups = r
        .api_groups
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|g| g == "*" || g == req.group);
    let resources = r.resources.as_deref().unwrap_or_default().iter().any(|x| {
        x == "*"
            || x == req.resource
            || match (x.strip_prefix("*/"), req.resource.split_once('/')) {
                (Some(sub), Some((_, rsub))) => sub == rsub,
                _ => false,
            }
    });
    let names = match r.resource_names.as_deref() {
        None | Some([]) => true,
        Some(names) => req.name.is_some_and(|n| names.iter().any(|x| x == n)),
    };
    verbs && groups && resources && names
}

/// The real server's refusal: `pods "x" is forbidden: User "u" cannot create resource
/// "pods/exec" in API group "" in the namespace "ns"`.
fn forbidden(user: &str, req: &Request<'_>, key: &CallKey<'_>) -> ApiError {
    let (plural, _) = req.resource.split_once('/').unwrap_or((req.resource, ""));
    let qualified = if req.group.is_empty() {
        plural.to_owned()
    } else {
        format!("{plural}.{}", req.group)
    };
    let object = match req.name {
        Some(n) => format!("{qualified} \"{n}\""),
        None => qualified,
    };
    let scope = match key.namespace {
        Some(ns) => format!("in the namespace \"{ns}\""),
        None => "at the cluster scope".to_owned(),
    };
    ApiError::new(
        403,
        "Forbidden",
        format!(
            "{object} is forbidden: User \"{user}\" cannot {} resource \"{}\" in API group \"{}\" {scope}",
            req.verb, req.resource, req.group
        ),
    )
    .with_details(req.group, plural, req.name.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::faults::Verb;

    const SA: &str = "system:serviceaccount:ttlab-dev:ttlab-server";

    fn key<'a>(
        verb: Verb,
        group: &'a str,
        resource: &'a str,
        ns: Option<&'a str>,
        name: Option<&'a str>,
    ) -> CallKey<'a> {
        CallKey {
            verb,
            resource,
            group: Some(group),
            namespace: ns,
            name,
        }
    }

    fn policy() -> Rbac {
        let rbac = Rbac::default();
        let n = rbac
            .apply(&[
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                       "metadata": {"name": "server", "namespace": "vms"},
                       "rules": [
                           {"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["create", "list"]},
                           {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
                           {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["one"]}
                       ]}),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                       "metadata": {"name": "server", "namespace": "vms"},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "server"},
                       "subjects": [{"kind": "ServiceAccount", "name": "ttlab-server", "namespace": "ttlab-dev"}]}),
                json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ignored"}}),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                       "metadata": {"name": "reader"},
                       "rules": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["get", "list"]}]}),
                json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                       "metadata": {"name": "readers"},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "reader"},
                       "subjects": [{"kind": "Group", "name": "readers-group"}, {"kind": "User", "name": "carol"}]}),
            ])
            .unwrap();
        assert_eq!(n, 4);
        rbac
    }

    #[test]
    fn a_bound_role_allows_exactly_its_rules_in_its_namespace() {
        let rbac = policy();
        let sa = Some(SA);
        let vms = Some("vms");
        assert!(
            rbac.authorize(
                sa,
                &key(Verb::Create, "kubevirt.io", "virtualmachines", vms, None)
            )
            .is_ok()
        );
        let e = rbac
            .authorize(
                sa,
                &key(Verb::Watch, "kubevirt.io", "virtualmachines", vms, None),
            )
            .unwrap_err();
        assert_eq!((e.code, e.reason), (403, "Forbidden"));
        assert_eq!(
            e.message,
            format!(
                "virtualmachines.kubevirt.io is forbidden: User \"{SA}\" cannot watch resource \"virtualmachines\" in API group \"kubevirt.io\" in the namespace \"vms\""
            )
        );
        // Another namespace, and the cluster scope, are not the Role's.
        assert!(
            rbac.authorize(
                sa,
                &key(
                    Verb::List,
                    "kubevirt.io",
                    "virtualmachines",
                    Some("other"),
                    None
                )
            )
            .is_err()
        );
        let e = rbac
            .authorize(sa, &key(Verb::List, "", "namespaces", None, None))
            .unwrap_err();
        assert!(e.message.ends_with("at the cluster scope"), "{}", e.message);
        // resourceNames: only the named object, never a list.
        assert!(
            rbac.authorize(sa, &key(Verb::Get, "", "secrets", vms, Some("one")))
                .is_ok()
        );
        assert!(
            rbac.authorize(sa, &key(Verb::Get, "", "secrets", vms, Some("two")))
                .is_err()
        );
        assert!(
            rbac.authorize(sa, &key(Verb::List, "", "secrets", vms, None))
                .is_err()
        );
        // Another ServiceAccount of the same name elsewhere is someone else.
        assert!(
            rbac.authorize(
                Some("system:serviceaccount:ttlab-prod:ttlab-server"),
                &key(Verb::Create, "kubevirt.io", "virtualmachines", vms, None)
            )
            .is_err()
        );
    }

    #[test]
    fn an_exec_upgrade_needs_get_and_the_create_it_stands_for() {
        let rbac = policy();
        let get = key(Verb::Get, "", "pods/exec", Some("vms"), Some("lab"));
        let refused = rbac.authorize(Some(SA), &get).unwrap_err();
        assert_eq!(
            refused.message,
            "pods \"lab\" is forbidden: User \"system:serviceaccount:ttlab-dev:ttlab-server\" cannot get resource \"pods/exec\" in API group \"\" in the namespace \"vms\""
        );
        let e = key(Verb::Create, "", "pods/exec", Some("vms"), Some("lab"));
        assert!(rbac.authorize(Some(SA), &e).is_ok());
        let refused = rbac.authorize(Some("dave"), &e).unwrap_err();
        assert_eq!(
            refused.message,
            "pods \"lab\" is forbidden: User \"dave\" cannot create resource \"pods/exec\" in API group \"\" in the namespace \"vms\""
        );
    }

    #[test]
    fn cluster_bindings_reach_users_and_groups_everywhere_and_the_administrator_is_never_refused() {
        let rbac = policy();
        let get = key(Verb::Get, "", "pods", Some("anywhere"), Some("p"));
        assert!(rbac.authorize(Some("carol"), &get).is_ok());
        assert!(rbac.authorize(Some("erin"), &get).is_err());
        assert!(
            rbac.authorize(
                Some("carol"),
                &key(Verb::Delete, "", "pods", Some("x"), Some("p"))
            )
            .is_err()
        );
        assert!(rbac.authorize(None, &get).is_ok());
        // A ServiceAccount is in its groups.
        assert!(groups_of(SA).contains(&"system:serviceaccounts:ttlab-dev".to_owned()));
    }

    #[test]
    fn the_shipped_roles_parse_from_their_yaml() {
        let roles = parse_yaml_stream(include_str!("../../../deploy/base/vms/role.yaml")).unwrap();
        let rbac = Rbac::default();
        assert_eq!(rbac.apply(&roles).unwrap(), 2);
        assert!(parse_yaml_stream("a: [").is_err());
    }

    #[test]
    fn a_malformed_object_is_refused_with_its_name() {
        let e = Rbac::default()
            .apply(&[
                json!({"kind": "Role", "metadata": {"name": "r", "namespace": "n"}, "rules": "no"}),
            ])
            .unwrap_err();
        assert!(e.to_string().contains("Role n/r"), "{e}");
    }
}
