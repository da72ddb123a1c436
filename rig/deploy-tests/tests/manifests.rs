//! `kubectl kustomize` of every overlay: each object parses as its Kubernetes type (and loses
//! nothing doing so: a misspelt field would), the workloads are locked down, and the overlays
//! differ where they should and only there.

mod common;

use std::collections::BTreeSet;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::CronJob;
use k8s_openapi::api::core::v1::{
    ConfigMap, LimitRange, Namespace, PodSpec, ResourceQuota, Service, ServiceAccount,
};
use k8s_openapi::api::networking::v1::{Ingress, NetworkPolicy};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use ttlab_deploy_tests::{Rendered, pod_spec};

use common::{ENVIRONMENTS, render_overlay, render_with_cronjob};

/// Parses `object` as `T` and checks that serializing it back gives the same JSON: k8s-openapi
/// ignores unknown fields, so a misspelt or misplaced field would be dropped here.
fn round_trip<T: DeserializeOwned + Serialize>(object: &Value) -> Result<(), String> {
    let typed: T = serde_json::from_value(object.clone()).map_err(|e| e.to_string())?;
    let back = serde_json::to_value(&typed).map_err(|e| e.to_string())?;
    if &back == object {
        Ok(())
    } else {
        Err(format!(
            "changed by a round trip through its type (unknown or misplaced field?):\n  rendered: {object}\n  typed:    {back}"
        ))
    }
}

fn check_typed(object: &Value) -> Result<(), String> {
    let kind = object["kind"].as_str().unwrap_or_default();
    match (object["apiVersion"].as_str().unwrap_or_default(), kind) {
        ("v1", "Namespace") => round_trip::<Namespace>(object),
        ("v1", "ServiceAccount") => round_trip::<ServiceAccount>(object),
        ("v1", "ConfigMap") => round_trip::<ConfigMap>(object),
        ("v1", "Service") => round_trip::<Service>(object),
        ("v1", "ResourceQuota") => round_trip::<ResourceQuota>(object),
        ("v1", "LimitRange") => round_trip::<LimitRange>(object),
        ("apps/v1", "Deployment") => round_trip::<Deployment>(object),
        ("batch/v1", "CronJob") => round_trip::<CronJob>(object),
        ("policy/v1", "PodDisruptionBudget") => round_trip::<PodDisruptionBudget>(object),
        ("networking.k8s.io/v1", "Ingress") => round_trip::<Ingress>(object),
        ("networking.k8s.io/v1", "NetworkPolicy") => round_trip::<NetworkPolicy>(object),
        ("rbac.authorization.k8s.io/v1", "Role") => round_trip::<Role>(object),
        ("rbac.authorization.k8s.io/v1", "RoleBinding") => round_trip::<RoleBinding>(object),
        (api_version, kind) => Err(format!(
            "unexpected {api_version} {kind}: add it to this test"
        )),
    }
}

fn assert_all_typed(rendered: &Rendered, what: &str) {
    let mut failures = Vec::new();
    for object in &rendered.objects {
        if let Err(e) = check_typed(object) {
            failures.push(format!(
                "{} {}: {e}",
                object["kind"], object["metadata"]["name"]
            ));
        }
    }
    assert!(failures.is_empty(), "{what}:\n{}", failures.join("\n"));
}

#[test]
fn every_rendered_object_parses_as_its_kubernetes_type() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        assert_all_typed(&rendered, env);
        let kinds: BTreeSet<_> = rendered
            .objects
            .iter()
            .map(|o| o["kind"].as_str().unwrap().to_owned())
            .collect();
        for expected in [
            "Namespace",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "ConfigMap",
            "Deployment",
            "Service",
            "Ingress",
            "ResourceQuota",
            "NetworkPolicy",
        ] {
            assert!(kinds.contains(expected), "{env} renders no {expected}");
        }
    }
    let Some(cron) = render_with_cronjob("prod") else {
        return;
    };
    assert_all_typed(&cron, "prod with the reaper-cronjob component");
}

#[test]
fn objects_live_in_the_backend_or_the_vm_namespace() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let backend = format!("ttlab-{env}");
        assert_eq!(
            rendered.names_of("Namespace"),
            [backend.as_str(), "ttlab-vms"]
        );
        for object in &rendered.objects {
            let kind = object["kind"].as_str().unwrap();
            let ns = object["metadata"]["namespace"].as_str();
            let expected = match kind {
                "Namespace" => None,
                "Role" | "RoleBinding" | "ResourceQuota" | "LimitRange" | "NetworkPolicy" => {
                    Some("ttlab-vms")
                }
                _ => Some(backend.as_str()),
            };
            assert_eq!(ns, expected, "{env}: {kind} {}", object["metadata"]["name"]);
        }
        // The backend namespace is the one the agent-ingress policy admits.
        let ns = rendered.get("Namespace", &backend);
        assert_eq!(ns["metadata"]["labels"]["ttlab.io/backend"], "true");
        // Each binary's service account is bound to its own Role in the VM namespace.
        for binary in ["server", "reaper"] {
            let binding = rendered.get("RoleBinding", &format!("ttlab-{env}-{binary}"));
            assert_eq!(binding["roleRef"]["name"], format!("ttlab-{binary}"));
            assert_eq!(
                binding["subjects"],
                serde_json::json!([{"kind": "ServiceAccount", "name": format!("ttlab-{binary}"), "namespace": backend}])
            );
        }
    }
}

fn assert_locked_down(what: &str, spec: &Value) {
    let spec: PodSpec = serde_json::from_value(spec.clone()).unwrap();
    let pod_sc = spec.security_context.expect("a pod security context");
    assert_eq!(pod_sc.run_as_non_root, Some(true), "{what}");
    assert!(pod_sc.run_as_user.is_some_and(|u| u != 0), "{what}");
    assert_eq!(
        pod_sc.seccomp_profile.map(|p| p.type_),
        Some("RuntimeDefault".into()),
        "{what}"
    );
    // The server runs as ttlab-server; the reaper (Deployment or CronJob) as ttlab-reaper.
    let identity = if what.contains("server") {
        "ttlab-server"
    } else {
        "ttlab-reaper"
    };
    assert_eq!(
        spec.service_account_name.as_deref(),
        Some(identity),
        "{what}"
    );
    let containers = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten());
    for c in containers {
        let sc = c
            .security_context
            .clone()
            .expect("a container security context");
        let who = format!("{what}/{}", c.name);
        assert_eq!(sc.run_as_non_root, Some(true), "{who}");
        assert_eq!(sc.read_only_root_filesystem, Some(true), "{who}");
        assert_eq!(sc.allow_privilege_escalation, Some(false), "{who}");
        assert_eq!(
            sc.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_owned()]),
            "{who}"
        );
        assert_eq!(
            sc.seccomp_profile.map(|p| p.type_),
            Some("RuntimeDefault".into()),
            "{who}"
        );
        let requests = c
            .resources
            .as_ref()
            .and_then(|r| r.requests.clone())
            .unwrap_or_default();
        assert!(
            requests.contains_key("cpu") && requests.contains_key("memory"),
            "{who} requests cpu and memory"
        );
        assert!(
            c.image
                .as_deref()
                .is_some_and(|i| i.starts_with("ghcr.io/ttlab/ttlab:")),
            "{who}"
        );
    }
}

#[test]
fn workloads_run_locked_down_with_probes_and_requests() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        for name in ["ttlab-server", "ttlab-reaper"] {
            let d = rendered.get("Deployment", name);
            assert_locked_down(&format!("{env}/{name}"), pod_spec(d));
        }
        let server: Deployment =
            serde_json::from_value(rendered.get("Deployment", "ttlab-server").clone()).unwrap();
        let container = &server.spec.unwrap().template.spec.unwrap().containers[0];
        let path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
            p.as_ref()
                .and_then(|p| p.http_get.as_ref())
                .and_then(|h| h.path.clone())
        };
        assert_eq!(path(&container.liveness_probe).as_deref(), Some("/healthz"));
        assert_eq!(path(&container.readiness_probe).as_deref(), Some("/readyz"));
        assert_eq!(
            container.command.as_deref(),
            Some(&["/usr/local/bin/ttlab-server".to_owned()][..])
        );
    }
    let Some(cron) = render_with_cronjob("prod") else {
        return;
    };
    let job = cron.get("CronJob", "ttlab-reaper");
    assert_locked_down("prod/cronjob", pod_spec(job));
}

#[test]
fn overlays_differ_in_environment_replicas_and_hosts_only() {
    let (Some(dev), Some(prod)) = (render_overlay("dev"), render_overlay("prod")) else {
        return;
    };
    let env_of = |r: &Rendered| {
        r.generated_config_map("ttlab-config")["data"]["TTLAB_ENV"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(env_of(&dev), "dev");
    assert_eq!(env_of(&prod), "prod");
    let replicas =
        |r: &Rendered, name: &str| r.get("Deployment", name)["spec"]["replicas"].as_i64();
    assert_eq!(replicas(&dev, "ttlab-server"), Some(1));
    assert_eq!(replicas(&prod, "ttlab-server"), Some(2));
    assert_eq!(replicas(&dev, "ttlab-reaper"), Some(1));
    assert_eq!(replicas(&prod, "ttlab-reaper"), Some(2));
    let host = |r: &Rendered| r.get("Ingress", "ttlab")["spec"]["rules"][0]["host"].clone();
    assert_eq!(host(&dev), "ttlab-dev.example.org");
    assert_eq!(host(&prod), "ttlab.example.org");
    for r in [&dev, &prod] {
        let ingress = r.get("Ingress", "ttlab");
        assert_eq!(
            ingress["spec"]["tls"][0]["hosts"][0],
            ingress["spec"]["rules"][0]["host"]
        );
    }

    // What lives in the shared VM namespace is byte-for-byte the same in both, so applying
    // one environment never rewrites the other's guard rails; only the RoleBindings differ
    // (one per environment, by name).
    let shared = |r: &Rendered| -> Vec<Value> {
        r.objects
            .iter()
            .filter(|o| o["metadata"]["namespace"] == "ttlab-vms" && o["kind"] != "RoleBinding")
            .cloned()
            .collect()
    };
    assert_eq!(shared(&dev), shared(&prod));
    assert!(!shared(&dev).is_empty());
}

#[test]
fn every_setting_the_binaries_share_is_in_one_config_map() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let (server_env, server_secrets) =
            rendered.container_env(rendered.get("Deployment", "ttlab-server"));
        let (reaper_env, reaper_secrets) =
            rendered.container_env(rendered.get("Deployment", "ttlab-reaper"));
        // The same ConfigMap: server and reaper cannot disagree on environment or namespace.
        assert_eq!(server_env, reaper_env);
        assert_eq!(server_secrets, ["ttlab-secrets"]);
        assert_eq!(reaper_secrets, ["ttlab-secrets"]);
        for key in [
            "TTLAB_ENV",
            "TTLAB_NAMESPACE",
            "TTLAB_SESSION_TTL",
            "TTLAB_SESSION_MAX",
            "TTLAB_MAX_EXTENSIONS",
            "TTLAB_KUBE_CONCURRENCY",
            "RUST_LOG",
            "TTLAB_LISTEN",
            "TTLAB_LESSONS",
            "TTLAB_VM_LIMIT",
            "TTLAB_AGENT_BINARY",
            "TTLAB_WEB_DIR",
            "TTLAB_REAP_INTERVAL",
            "TTLAB_REAP_CONCURRENCY",
            "TTLAB_ORPHAN_MIN_AGE",
            "TTLAB_METRICS_LISTEN",
        ] {
            assert!(server_env.contains_key(key), "{env}: {key} missing");
        }
        // Secrets never sit in a ConfigMap.
        for key in ["DATABASE_URL", "TTLAB_AUTH_SECRET"] {
            assert!(!server_env.contains_key(key), "{env}: {key} in a ConfigMap");
        }
        assert_eq!(server_env["TTLAB_NAMESPACE"], "ttlab-vms");
        // The lifespan settings parse as the policy the binaries will build from them.
        ttlab_lifespan::Policy::from_settings(
            Some(server_env["TTLAB_SESSION_TTL"].as_str()),
            Some(server_env["TTLAB_SESSION_MAX"].as_str()),
            Some(server_env["TTLAB_MAX_EXTENSIONS"].as_str()),
        )
        .unwrap_or_else(|e| panic!("{env}: lifespan settings: {e}"));
    }
}

#[test]
fn the_cronjob_component_replaces_the_reaper_deployment() {
    let Some(rendered) = render_with_cronjob("prod") else {
        return;
    };
    assert!(
        !rendered
            .names_of("Deployment")
            .contains(&"ttlab-reaper".to_owned())
    );
    assert!(
        !rendered
            .names_of("Service")
            .contains(&"ttlab-reaper-metrics".to_owned())
    );
    let job = rendered.get("CronJob", "ttlab-reaper");
    assert_eq!(job["metadata"]["namespace"], "ttlab-prod");
    assert_eq!(job["spec"]["concurrencyPolicy"], "Forbid");
    let container = &pod_spec(job)["containers"][0];
    assert_eq!(
        container["command"],
        serde_json::json!(["/usr/local/bin/ttlab-reaper", "--once"])
    );
    assert_eq!(container["image"], "ghcr.io/ttlab/ttlab:0.1.0");
    // The overlay's settings reach the job too (the generated, hashed ConfigMap name).
    let (env, _) = rendered.container_env(job);
    assert_eq!(env["TTLAB_ENV"], "prod");
}

#[test]
fn the_ingress_keeps_idle_terminals_open() {
    for env in ENVIRONMENTS {
        let Some(rendered) = render_overlay(env) else {
            return;
        };
        let annotations = &rendered.get("Ingress", "ttlab")["metadata"]["annotations"];
        for key in ["proxy-read-timeout", "proxy-send-timeout"] {
            let seconds: u64 = annotations[format!("nginx.ingress.kubernetes.io/{key}")]
                .as_str()
                .and_then(|s| s.parse().ok())
                .unwrap_or_else(|| panic!("{env}: no {key}"));
            assert!(seconds >= 3600, "{env}: {key} {seconds}");
        }
    }
}

#[test]
fn the_ingress_reaches_the_public_port_only_and_the_probes_use_the_ops_port() {
    for env in ENVIRONMENTS {
        let Some(r) = render_overlay(env) else {
            return;
        };
        let server = r.get("Deployment", "ttlab-server");
        let c = &server["spec"]["template"]["spec"]["containers"][0];
        for probe in ["livenessProbe", "readinessProbe"] {
            assert_eq!(c[probe]["httpGet"]["port"], "ops", "{env}: {probe}");
        }
        let ops = c["ports"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == "ops")
            .unwrap_or_else(|| panic!("{env}: no ops port"));
        let config = r.generated_config_map("ttlab-config");
        let listen = config["data"]["TTLAB_OPS_LISTEN"].as_str().unwrap();
        assert_eq!(
            listen.rsplit(':').next().unwrap(),
            ops["containerPort"].to_string(),
            "{env}: TTLAB_OPS_LISTEN and the ops port agree"
        );
        // The Service the Ingress uses exposes the public port only; the ops port has a
        // Service of its own (for Prometheus) that no Ingress rule names.
        let service = r.get("Service", "ttlab-server");
        for port in service["spec"]["ports"].as_array().unwrap() {
            assert_eq!(port["targetPort"], "http", "{env}: {port}");
        }
        let ops_service = r.get("Service", "ttlab-server-ops");
        assert_eq!(ops_service["spec"]["ports"][0]["targetPort"], "ops");
        let ingress = r.get("Ingress", "ttlab");
        for rule in ingress["spec"]["rules"].as_array().unwrap() {
            for path in rule["http"]["paths"].as_array().unwrap() {
                let backend = &path["backend"]["service"];
                assert_eq!(backend["name"], "ttlab-server", "{env}: {path}");
                assert_eq!(backend["port"]["name"], "http", "{env}: {path}");
            }
        }
    }
}
