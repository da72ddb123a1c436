//! The shape of the two Roles in the VM namespace: one per binary, nothing cluster-wide, no
//! wildcard, nothing that modifies (update, patch) or escalates, and a reaper that never
//! creates. Which verbs each Role grants is not written down here: `real_cluster.rs` proves
//! it by calls, comparing every call each binary makes on a real API server with its Role.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::rbac::v1::Role;

use common::{ENVIRONMENTS, render_overlay};

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

/// The Roles, by name.
const ROLES: [&str; 2] = ["ttlab-server", "ttlab-reaper"];

#[test]
fn each_binary_has_its_own_role_in_the_vm_namespace_and_nothing_cluster_wide() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        assert_eq!(
            rendered.names_of("Role"),
            ["ttlab-reaper", "ttlab-server"],
            "{env}: one Role per binary"
        );
        assert!(
            rendered.names_of("ClusterRole").is_empty()
                && rendered.names_of("ClusterRoleBinding").is_empty(),
            "{env}: nothing cluster-wide"
        );
        for name in ROLES {
            let role: Role = serde_json::from_value(rendered.get("Role", name).clone()).unwrap();
            assert_eq!(role.metadata.namespace.as_deref(), Some("ttlab-vms"));
        }
    }
}

#[test]
fn the_reaper_lists_and_deletes_and_never_creates_reads_vmis_or_opens_consoles() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let role: Role =
            serde_json::from_value(rendered.get("Role", "ttlab-reaper").clone()).unwrap();
        for ((group, resource), verbs) in grants(&role) {
            assert!(
                !verbs.contains("create"),
                "{env}: create on {group}/{resource}"
            );
            assert!(
                !resource.contains('/') && !resource.starts_with("virtualmachineinstances"),
                "{env}: the reaper has {resource}"
            );
        }
    }
}

#[test]
fn nothing_may_modify_a_secret_or_use_wildcards() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        for name in ROLES {
            let role: Role = serde_json::from_value(rendered.get("Role", name).clone()).unwrap();
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
}

#[test]
fn the_server_reaches_consoles_and_agents_through_kubevirt_and_the_reaper_neither() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let subresources = |name: &str| -> Grants {
            let role: Role = serde_json::from_value(rendered.get("Role", name).clone()).unwrap();
            grants(&role)
                .into_iter()
                .filter(|((group, _), _)| group == "subresources.kubevirt.io")
                .collect()
        };
        let get = BTreeSet::from(["get".to_owned()]);
        let group = "subresources.kubevirt.io".to_owned();
        assert_eq!(
            subresources("ttlab-server"),
            Grants::from([
                (
                    (group.clone(), "virtualmachineinstances/console".to_owned()),
                    get.clone()
                ),
                (
                    (group, "virtualmachineinstances/portforward".to_owned()),
                    get
                ),
            ]),
            "{env}: the serial console and the port forward to the agent, read-only verbs"
        );
        assert!(subresources("ttlab-reaper").is_empty(), "{env}");
    }
}
