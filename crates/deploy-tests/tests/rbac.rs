//! The Role in the VM namespace, rule by rule, against an explicit table of what the code
//! calls. Any widening (a new verb, a new resource, a wildcard) fails here and has to be
//! made in this table too, where a reviewer sees it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::rbac::v1::Role;

use common::{ENVIRONMENTS, render_overlay};

/// (API group, resource) → verbs: exactly what `ttlab-cluster` does (see deploy/base/vms/role.yaml
/// for why each is there and why update/patch are not).
const EXPECTED: &[(&str, &str, &[&str])] = &[
    (
        "kubevirt.io",
        "virtualmachines",
        &["create", "get", "list", "delete"],
    ),
    (
        "kubevirt.io",
        "virtualmachineinstances",
        &["get", "list", "watch"],
    ),
    (
        "subresources.kubevirt.io",
        "virtualmachineinstances/console",
        &["get"],
    ),
    ("", "secrets", &["create", "get", "list", "delete"]),
    ("", "services", &["create", "list", "delete"]),
    (
        "networking.k8s.io",
        "networkpolicies",
        &["create", "list", "delete"],
    ),
    ("", "pods", &["create", "get", "list", "delete"]),
    ("", "pods/exec", &["get", "create"]),
    ("", "persistentvolumeclaims", &["get"]),
    ("cdi.kubevirt.io", "datavolumes", &["get"]),
    ("cdi.kubevirt.io", "datasources", &["get"]),
];

type Grants = BTreeMap<(String, String), BTreeSet<String>>;

fn grants(role: &Role) -> Grants {
    let mut out = Grants::new();
    for rule in role.rules.iter().flatten() {
        assert!(
            rule.resource_names.is_none() && rule.non_resource_urls.is_none(),
            "unexpected rule shape: {rule:?}"
        );
        for group in rule.api_groups.iter().flatten() {
            for resource in rule.resources.iter().flatten() {
                let verbs = out.entry((group.clone(), resource.clone())).or_default();
                verbs.extend(rule.verbs.iter().cloned());
            }
        }
    }
    out
}

fn expected() -> Grants {
    EXPECTED
        .iter()
        .map(|(g, r, verbs)| {
            (
                ((*g).to_owned(), (*r).to_owned()),
                verbs.iter().map(|v| (*v).to_owned()).collect(),
            )
        })
        .collect()
}

#[test]
fn the_role_grants_exactly_the_expected_table() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        assert_eq!(rendered.names_of("Role"), ["ttlab"], "{env}: one Role");
        assert!(
            rendered.names_of("ClusterRole").is_empty()
                && rendered.names_of("ClusterRoleBinding").is_empty(),
            "{env}: nothing cluster-wide"
        );
        let role: Role = serde_json::from_value(rendered.get("Role", "ttlab").clone()).unwrap();
        assert_eq!(role.metadata.namespace.as_deref(), Some("ttlab-vms"));
        let got = grants(&role);
        let want = expected();
        // Per resource, so a failure names the resource and both verb sets.
        for (key, verbs) in &want {
            assert_eq!(got.get(key), Some(verbs), "{env}: verbs on {key:?}");
        }
        for key in got.keys() {
            assert!(want.contains_key(key), "{env}: unexpected grant on {key:?}");
        }
    }
}

#[test]
fn nothing_may_modify_a_secret_or_use_wildcards() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let role: Role = serde_json::from_value(rendered.get("Role", "ttlab").clone()).unwrap();
        for ((group, resource), verbs) in grants(&role) {
            assert!(
                group != "*" && resource != "*" && !verbs.contains("*"),
                "{env}: wildcard"
            );
            for forbidden in [
                "update",
                "patch",
                "deletecollection",
                "escalate",
                "bind",
                "impersonate",
            ] {
                assert!(
                    !verbs.contains(forbidden),
                    "{env}: {forbidden} on {group}/{resource}"
                );
            }
        }
    }
}
