//! The two-site example, `deploy/examples/two-sites`: it renders; its sites file is one the
//! binaries accept, with the sites and agent paths the example describes; every pod that
//! reads it mounts it at `TTLAB_SITES` and its own identity's kubeconfig at the path the file
//! names; it is `deploy/overlays/prod` plus the sites and nothing else; and what campus-b's
//! cluster gets (`remote/`) grants each identity exactly the rules of its Role in the backend's
//! own cluster — compared as rendered, so the two cannot drift. On a real API server, each
//! identity of both clusters may do what its Role says and no more: the server may
//! port-forward to a guest's agent and open its console, the reaper neither. And there, the
//! real binaries with a sites file of both: a lab placed on each site, the remote one graded
//! and its console opened through its API server, reclaimed there by the reaper.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;
use ttlab_deploy_tests::{Rendered, deploy_dir, pod_spec};
use ttlab_site::{AgentPath, Connection, SitesConfig};

use common::{render_deploy_dir, render_example_with_components, render_overlay};

/// The example, and what its README applies in campus-b's cluster.
const EXAMPLE: &str = "examples/two-sites";
const REMOTE: &str = "examples/two-sites/remote";

fn sites_text() -> String {
    std::fs::read_to_string(deploy_dir(EXAMPLE).join("sites.yaml")).unwrap()
}

fn sites() -> SitesConfig {
    SitesConfig::parse(&sites_text()).unwrap_or_else(|e| panic!("sites.yaml: {e}"))
}

/// The kubeconfig path of every site that has one.
fn kubeconfigs(config: &SitesConfig) -> Vec<PathBuf> {
    config
        .sites()
        .iter()
        .filter_map(|s| match &s.connection {
            Connection::Kubeconfig(path) => Some(path.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn the_shipped_sites_file_parses_into_two_sites_with_their_agent_paths() {
    let config = sites();
    let [a, b] = config.sites() else {
        panic!("two sites expected: {config:?}")
    };
    assert_eq!(a.name.as_str(), "campus-a");
    assert_eq!(a.connection, Connection::InCluster);
    assert_eq!(a.agent_path, AgentPath::PodIp);
    assert!(a.labels.is_empty());

    assert_eq!(b.name.as_str(), "campus-b");
    assert_eq!(
        b.connection,
        Connection::Kubeconfig("/etc/ttlab/kubeconfigs/campus-b.kubeconfig".into())
    );
    assert_eq!(b.agent_path, AgentPath::Portforward);
    let labels: Vec<&str> = b.labels.iter().map(|l| l.as_str()).collect();
    assert_eq!(labels, ["kvm-large"]);
}

/// What provides the file at `path` in the first container of `workload`: the volume's kind
/// (`configMap`, `secret`), the object's name, its key, and whether it is optional.
fn mounted_file(workload: &Value, path: &Path) -> (String, String, String, bool) {
    let spec = pod_spec(workload);
    let (dir, file) = (path.parent().unwrap(), path.file_name().unwrap());
    let mount = spec["containers"][0]["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| Path::new(m["mountPath"].as_str().unwrap()) == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {}", dir.display()));
    assert_eq!(mount["readOnly"], true, "{mount}");
    let volume = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("no volume {}", mount["name"]));
    for (kind, name_field) in [("configMap", "name"), ("secret", "secretName")] {
        let source = &volume[kind];
        if source.is_null() {
            continue;
        }
        let key = match source["items"].as_array() {
            Some(items) => items
                .iter()
                .find(|i| Path::new(i["path"].as_str().unwrap()) == Path::new(file))
                .map(|i| i["key"].as_str().unwrap().to_owned())
                .unwrap_or_else(|| panic!("{volume} does not hold {}", path.display())),
            None => file.to_str().unwrap().to_owned(),
        };
        return (
            kind.to_owned(),
            source[name_field].as_str().unwrap().to_owned(),
            key,
            source["optional"] == true,
        );
    }
    panic!("{volume} is neither a ConfigMap nor a Secret")
}

/// The Secrets `workload`'s pod mounts as volumes.
fn secret_volumes(workload: &Value) -> BTreeSet<String> {
    pod_spec(workload)["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["secret"]["secretName"].as_str().map(str::to_owned))
        .collect()
}

/// `workload` reads the example's sites file at `TTLAB_SITES`, and finds at each kubeconfig
/// path it names the key `kubeconfig` of the Secret `secret` (optional), and no other Secret.
fn assert_reads_the_sites(rendered: &Rendered, workload: &Value, secret: &str) {
    let what = format!(
        "{} {}",
        workload["kind"].as_str().unwrap(),
        workload["metadata"]["name"].as_str().unwrap()
    );
    let (env, _) = rendered.container_env(workload);
    let sites_path = env
        .get("TTLAB_SITES")
        .unwrap_or_else(|| panic!("{what}: no TTLAB_SITES"));
    let (kind, name, key, optional) = mounted_file(workload, Path::new(sites_path));
    assert_eq!((kind.as_str(), optional), ("configMap", false), "{what}");
    let config_map = rendered.get("ConfigMap", &name);
    assert_eq!(
        config_map["data"][&key].as_str(),
        Some(sites_text().as_str()),
        "{what}: {name} holds the shipped sites.yaml"
    );
    assert_eq!(
        config_map["metadata"]["namespace"], workload["metadata"]["namespace"],
        "{what}"
    );

    let kubeconfigs = kubeconfigs(&sites());
    assert!(!kubeconfigs.is_empty());
    for path in &kubeconfigs {
        assert_eq!(
            mounted_file(workload, path),
            ("secret".into(), secret.into(), "kubeconfig".into(), true),
            "{what}: {}",
            path.display()
        );
    }
    assert_eq!(
        secret_volumes(workload),
        BTreeSet::from([secret.to_owned()]),
        "{what}: only its own identity's kubeconfig"
    );
}

#[test]
fn every_pod_reads_the_sites_file_and_its_own_identitys_kubeconfig() {
    let Some(rendered) = render_deploy_dir(EXAMPLE) else {
        return;
    };
    assert_reads_the_sites(
        &rendered,
        rendered.get("Deployment", "ttlab-server"),
        "ttlab-site-campus-b-server",
    );
    assert_reads_the_sites(
        &rendered,
        rendered.get("Deployment", "ttlab-reaper"),
        "ttlab-site-campus-b-reaper",
    );
    assert!(rendered.names_of("CronJob").is_empty());
}

#[test]
fn with_the_reaper_as_a_cronjob_the_job_reads_them_too() {
    let Some(rendered) = render_example_with_components("two-sites", "prod", &["reaper-cronjob"])
    else {
        return;
    };
    assert_eq!(rendered.names_of("Deployment"), ["ttlab-server"]);
    assert_reads_the_sites(
        &rendered,
        rendered.get("Deployment", "ttlab-server"),
        "ttlab-site-campus-b-server",
    );
    assert_reads_the_sites(
        &rendered,
        rendered.get("CronJob", "ttlab-reaper"),
        "ttlab-site-campus-b-reaper",
    );
}

/// An object's kind, namespace and name, a generated name without its hash.
fn key(object: &Value) -> (String, String, String) {
    let mut name = object["metadata"]["name"].as_str().unwrap().to_owned();
    if object["kind"] == "ConfigMap"
        && let Some((base, _hash)) = name.rsplit_once('-')
        && (base == "ttlab-config" || base == "ttlab-sites")
    {
        name = base.to_owned();
    }
    (
        object["kind"].as_str().unwrap().to_owned(),
        object["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
        name,
    )
}

#[test]
fn the_example_is_the_prod_overlay_plus_the_sites_and_nothing_else() {
    let (Some(example), Some(prod)) = (render_deploy_dir(EXAMPLE), render_overlay("prod")) else {
        return;
    };
    let of = |r: &Rendered| -> BTreeMap<_, Value> {
        r.objects.iter().map(|o| (key(o), o.clone())).collect()
    };
    let (example, prod) = (of(&example), of(&prod));
    let added: Vec<_> = example.keys().filter(|k| !prod.contains_key(*k)).collect();
    let removed: Vec<_> = prod.keys().filter(|k| !example.contains_key(*k)).collect();
    assert_eq!(
        added,
        [&(
            "ConfigMap".to_owned(),
            "ttlab-prod".to_owned(),
            "ttlab-sites".to_owned()
        )]
    );
    assert!(removed.is_empty(), "{removed:?}");
    for (k, object) in &prod {
        let changed = ["Deployment", "ConfigMap"].contains(&k.0.as_str());
        if !changed {
            assert_eq!(&example[k], object, "{k:?} differs from the overlay's");
        }
    }
    // The only new setting is the sites file.
    let settings = |m: &BTreeMap<_, Value>| -> BTreeMap<String, Value> {
        let cm = &m[&(
            "ConfigMap".to_owned(),
            "ttlab-prod".to_owned(),
            "ttlab-config".to_owned(),
        )];
        cm["data"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let mut expected = settings(&prod);
    expected.insert(
        "TTLAB_SITES".into(),
        Value::from("/etc/ttlab/sites/sites.yaml"),
    );
    assert_eq!(settings(&example), expected);
}

/// The `count/virtualmachines.kubevirt.io` of the ResourceQuota `ttlab-vms`, and its namespace.
fn vm_quota(rendered: &Rendered) -> (u32, String) {
    let quota = rendered.get("ResourceQuota", "ttlab-vms");
    (
        quota["spec"]["hard"]["count/virtualmachines.kubevirt.io"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap(),
        quota["metadata"]["namespace"].as_str().unwrap().to_owned(),
    )
}

#[test]
fn each_sites_namespace_and_vm_limit_match_its_clusters_objects() {
    let (Some(home), Some(remote)) = (render_overlay("prod"), render_deploy_dir(REMOTE)) else {
        return;
    };
    let config = sites();
    let [a, b] = config.sites() else {
        panic!("{config:?}")
    };
    for (site, rendered) in [(a, &home), (b, &remote)] {
        let (count, namespace) = vm_quota(rendered);
        assert_eq!(site.namespace.as_str(), namespace, "{}", site.name);
        assert_eq!(
            site.vm_limit.get(),
            count,
            "{}: the quota's VM count",
            site.name
        );
        for role in ["ttlab-server", "ttlab-reaper"] {
            assert_eq!(
                rendered.get("Role", role)["metadata"]["namespace"],
                namespace,
                "{}: {role}",
                site.name
            );
        }
    }
}

#[test]
fn the_remote_site_grants_each_identity_the_rules_of_its_base_role() {
    let (Some(home), Some(remote)) = (render_overlay("prod"), render_deploy_dir(REMOTE)) else {
        return;
    };
    assert_eq!(remote.names_of("Role"), home.names_of("Role"));
    for role in ["ttlab-server", "ttlab-reaper"] {
        assert_eq!(
            remote.get("Role", role)["rules"],
            home.get("Role", role)["rules"],
            "{role}"
        );
    }
    // Nothing cluster-wide, nothing that runs: campus-b only hosts VMs.
    for kind in [
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
        "CronJob",
        "ConfigMap",
        "Ingress",
    ] {
        assert!(remote.names_of(kind).is_empty(), "{kind} in remote/");
    }
    // One binding per identity, to its own Role, of a ServiceAccount outside the VM namespace.
    let (_, vm_namespace) = vm_quota(&remote);
    let bindings: Vec<&Value> = remote.of_kind("RoleBinding").collect();
    assert_eq!(bindings.len(), 2);
    let mut bound = BTreeSet::new();
    for binding in bindings {
        assert_eq!(binding["metadata"]["namespace"], vm_namespace.as_str());
        assert_eq!(binding["roleRef"]["kind"], "Role");
        let role = binding["roleRef"]["name"].as_str().unwrap();
        let [subject] = binding["subjects"].as_array().unwrap().as_slice() else {
            panic!("{binding}")
        };
        assert_eq!(subject["kind"], "ServiceAccount");
        assert_eq!(
            subject["name"], role,
            "each identity is bound to its own Role"
        );
        let namespace = subject["namespace"].as_str().unwrap();
        assert_ne!(namespace, vm_namespace);
        let account = remote.get("ServiceAccount", role);
        assert_eq!(account["metadata"]["namespace"], namespace);
        assert!(remote.names_of("Namespace").contains(&namespace.to_owned()));
        bound.insert(role.to_owned());
    }
    assert_eq!(
        bound,
        BTreeSet::from(["ttlab-reaper".to_owned(), "ttlab-server".to_owned()])
    );
    // Token Secrets the API server fills: nothing secret in the repository.
    for secret in remote.of_kind("Secret") {
        assert_eq!(
            secret["type"], "kubernetes.io/service-account-token",
            "{secret}"
        );
        assert!(
            secret["data"].is_null() && secret["stringData"].is_null(),
            "{secret}"
        );
        let account = secret["metadata"]["annotations"]["kubernetes.io/service-account.name"]
            .as_str()
            .unwrap();
        assert_eq!(
            remote.get("ServiceAccount", account)["metadata"]["namespace"],
            secret["metadata"]["namespace"]
        );
    }
}

/// One right in the VM namespace: verb, API group, resource, subresource.
type Right = (&'static str, &'static str, &'static str, &'static str);

/// Whether the identity of `kubeconfig` may exercise `right` in `namespace`, as the API server
/// answers a SelfSubjectAccessReview (what `kubectl auth can-i` asks; asked directly here,
/// since kubectl maps a resource through discovery first, and this control plane serves no
/// `subresources.kubevirt.io`).
async fn can_i(kubeconfig: &Path, namespace: &str, right: Right) -> bool {
    use k8s_openapi::api::authorization::v1::{
        ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec,
    };
    let (verb, group, resource, subresource) = right;
    let kubeconfig = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(namespace.to_owned()),
                verb: Some(verb.to_owned()),
                group: Some(group.to_owned()),
                resource: Some(resource.to_owned()),
                subresource: (!subresource.is_empty()).then(|| subresource.to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = kube::Api::<SelfSubjectAccessReview>::all(client)
        .create(&Default::default(), &review)
        .await
        .unwrap();
    answer.status.is_some_and(|s| s.allowed)
}

/// Rights in the VM namespace, and whether the server and the reaper have each.
const RIGHTS: &[(Right, bool, bool)] = &[
    (
        (
            "get",
            "subresources.kubevirt.io",
            "virtualmachineinstances",
            "portforward",
        ),
        true,
        false,
    ),
    (
        (
            "get",
            "subresources.kubevirt.io",
            "virtualmachineinstances",
            "console",
        ),
        true,
        false,
    ),
    (
        ("create", "kubevirt.io", "virtualmachines", ""),
        true,
        false,
    ),
    (("delete", "kubevirt.io", "virtualmachines", ""), true, true),
    (("get", "kubevirt.io", "virtualmachines", ""), false, true),
    (("update", "", "secrets", ""), false, false),
    (
        (
            "update",
            "subresources.kubevirt.io",
            "virtualmachineinstances",
            "portforward",
        ),
        false,
        false,
    ),
];

/// campus-b's objects (`remote/`) on the real control plane, in namespaces of the test's own,
/// with a kubeconfig for each of its identities.
struct CampusB {
    /// Its VM namespace (`ttlab-vms`, renamed).
    vms: String,
    /// The namespace of its identities (`ttlab-prod`, renamed).
    identities: String,
    /// The server's kubeconfig, defaulting to the VM namespace.
    server: PathBuf,
    /// The reaper's.
    reaper: PathBuf,
}

impl CampusB {
    async fn install(plane: &ttlab_envtest::ControlPlane, remote: &Rendered) -> Self {
        let suffix = ttlab_envtest::unique_name("b");
        let (vms, identities) = (format!("vms-{suffix}"), format!("prod-{suffix}"));
        let names = BTreeMap::from([
            ("ttlab-vms".to_owned(), vms.clone()),
            ("ttlab-prod".to_owned(), identities.clone()),
        ]);
        plane
            .create(&ttlab_envtest::rename_namespaces(&remote.objects, &names))
            .await
            .unwrap();
        let server = plane
            .service_account_kubeconfig(&identities, "ttlab-server", &vms)
            .await
            .unwrap();
        let reaper = plane
            .service_account_kubeconfig(&identities, "ttlab-reaper", &vms)
            .await
            .unwrap();
        Self {
            vms,
            identities,
            server,
            reaper,
        }
    }

    fn server_user(&self) -> String {
        format!("system:serviceaccount:{}:ttlab-server", self.identities)
    }

    fn reaper_user(&self) -> String {
        format!("system:serviceaccount:{}:ttlab-reaper", self.identities)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_real_api_server_each_identity_of_each_cluster_may_do_what_its_role_says() {
    let (Some(remote), Some(plane)) = (render_deploy_dir(REMOTE), ttlab_envtest::shared_or_skip())
    else {
        return;
    };
    // The backend's own cluster, as the overlay installs it.
    let installed = plane.install_shipped(&["dev"]).await.unwrap();
    let dev = installed.env("dev");
    let campus_b = CampusB::install(plane, &remote).await;

    let mut wrong = Vec::new();
    for (cluster, namespace, server, reaper) in [
        (
            "home",
            installed.vm_namespace.as_str(),
            &dev.server_kubeconfig,
            &dev.reaper_kubeconfig,
        ),
        (
            "campus-b",
            campus_b.vms.as_str(),
            &campus_b.server,
            &campus_b.reaper,
        ),
    ] {
        for (right, server_may, reaper_may) in RIGHTS {
            for (who, kubeconfig, may) in [
                ("server", server, *server_may),
                ("reaper", reaper, *reaper_may),
            ] {
                if can_i(kubeconfig, namespace, *right).await != may {
                    wrong.push(format!("{cluster}: {who} {right:?}: expected {may}"));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The operator guide's "Sites" section quotes the errors of the sites file as the binaries
/// print them.
#[test]
fn the_guide_quotes_the_sites_files_errors_as_printed() {
    let guide =
        std::fs::read_to_string(ttlab_deploy_tests::repo_root().join("docs/operator-guide.md"))
            .unwrap();
    let line = |fields: &str| format!("  - {{{fields}}}\n");
    let a = line("name: campus-a, in_cluster: true, namespace: ttlab-vms, vm_limit: 8");
    let b = "name: campus-b, namespace: ttlab-vms, vm_limit: 4";
    let cases = [
        (
            format!(
                "sites:\n{}",
                line("name: campus-b, in_cluster: true, namespace: ttlab-vms, vm_limit: 0")
            ),
            "site `campus-b`, field `vm_limit`: must be at least 1",
        ),
        (
            format!("sites:\n{a}{}", line(b)),
            "site `campus-b`, field `kubeconfig`: neither `kubeconfig` nor `in_cluster: true` is set: give exactly one",
        ),
        (
            format!(
                "sites:\n{}",
                line(
                    "name: campus-a, in_cluster: true, kubeconfig: /k, namespace: ttlab-vms, vm_limit: 8"
                )
            ),
            "site `campus-a`, field `kubeconfig`: both `kubeconfig` and `in_cluster: true` are set: give exactly one",
        ),
        (
            format!("sites:\n{a}{}{a}", line(&format!("{b}, kubeconfig: /k"))),
            "site `campus-a`, field `name`: defined twice (sites #1 and #3); names must be unique",
        ),
        (
            format!(
                "sites:\n{}",
                line(&format!("{b}, kubeconfig: /k, labels: [KVM_Large]"))
            ),
            "site `campus-b`, field `labels`: invalid site label \"KVM_Large\": only lowercase letters, digits and '-' are allowed",
        ),
        (
            format!(
                "sites:\n{}",
                line(&format!("{b}, kubeconfig: /k, weight: 0"))
            ),
            "site `campus-b`, field `weight`: must be at least 1 (the default is 1)",
        ),
        (
            "sites: []\n".to_owned(),
            "the sites file lists no site: `sites` needs at least one",
        ),
    ];
    for (text, message) in cases {
        let err = SitesConfig::parse(&text).unwrap_err().to_string();
        assert_eq!(err, message, "{text}");
        assert!(
            guide.contains(message),
            "the guide should quote {message:?}"
        );
    }
    let typo = "sites:\n  - name: campus-a\n    in_cluster: true\n    namespace: ttlab-vms\n    vm_limit: 8\n    wieght: 2\n";
    let err = SitesConfig::parse(typo).unwrap_err().to_string();
    let quoted = err.split(", expected").next().unwrap();
    assert!(
        guide.contains(quoted),
        "the guide should quote {quoted:?} (of {err:?})"
    );
}

/// Both sites of the example on the real control plane, with the real binaries and each
/// identity's own kubeconfig: `home` (the dev overlay's VM namespace, agents by pod IP) and
/// `campus-b` (the remote example's objects in namespaces of their own, agents through
/// KubeVirt's `portforward` subresource). KubeVirt is played by `ttlab-kubevirt-sim`, its
/// console and port forward served as an aggregated API server behind kube-apiserver, as
/// virt-api is. Each site takes one lab (its limit), a third start is refused; the lab on
/// campus-b is graded and its console opened through campus-b's API server (the audit log
/// shows the server's port forward there, and none on home), then it expires and
/// `ttlab-reaper --once` reclaims it on its own site while home's lab is finished by its
/// student. No identity is refused a call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_real_api_server_the_binaries_place_grade_and_reclaim_a_lab_on_each_site() {
    use futures::StreamExt as _;
    use std::net::{Ipv4Addr, SocketAddr};
    use ttlab_api::auth::Role;

    let bins = ["ttlab-server", "ttlab-reaper", "ttlab-agent", "ttlabctl"].map(common::binary);
    let [
        Some(server_bin),
        Some(reaper_bin),
        Some(agent_bin),
        Some(ttlabctl),
    ] = bins
    else {
        ttlab_testkit::skip_or_fail(&format!(
            "the binaries are not built in {}: cargo build -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin -p ttlab-ttlabctl-bin",
            common::binaries_dir().display()
        ));
        return;
    };
    let (Some(remote), Some(dev_rendered), Some(plane)) = (
        render_deploy_dir(REMOTE),
        render_overlay("dev"),
        ttlab_envtest::shared_or_skip(),
    ) else {
        return;
    };
    let installed = plane.install_shipped(&["dev"]).await.unwrap();
    let dev = installed.env("dev").clone();
    let home_ns = installed.vm_namespace.clone();
    let campus_b = CampusB::install(plane, &remote).await;
    let vms = campus_b.vms.clone();

    // KubeVirt in both namespaces, and its console and port forward behind kube-apiserver.
    let guests = tempfile::tempdir().unwrap();
    let (kubevirt, console) = common::kubevirt_on(
        plane,
        vec![home_ns.clone(), campus_b.vms.clone()],
        &agent_bin,
        guests.path(),
    )
    .await;
    let admin = plane.admin_client().await.unwrap();

    // PostgreSQL, migrated as the initContainer does.
    let (pg, database_url) = common::migrated_database(&ttlabctl).await;

    // A sites file per identity: the same sites, each with that identity's kubeconfigs.
    let dir = tempfile::tempdir().unwrap();
    let sites_file = |who: &str, home: &Path, campus_b: &Path| {
        let path = dir.path().join(format!("sites-{who}.yaml"));
        let text = format!(
            "sites:\n  - name: home\n    kubeconfig: {}\n    namespace: {home_ns}\n    vm_limit: 1\n    agent_path: pod-ip\n  - name: campus-b\n    kubeconfig: {}\n    namespace: {vms}\n    vm_limit: 1\n    agent_path: portforward\n",
            home.display(),
            campus_b.display()
        );
        std::fs::write(&path, text).unwrap();
        path
    };
    let server_sites = sites_file("server", &dev.server_kubeconfig, &campus_b.server);
    let reaper_sites = sites_file("reaper", &dev.reaper_kubeconfig, &campus_b.reaper);

    let (mut env, _) = dev_rendered.container_env(dev_rendered.get("Deployment", "ttlab-server"));
    let root = ttlab_deploy_tests::repo_root();
    let path = |p: &Path| p.display().to_string();
    let server_addr = SocketAddr::from((Ipv4Addr::LOCALHOST, common::free_port()));
    for (k, v) in [
        ("DATABASE_URL", database_url.clone()),
        ("TTLAB_AUTH_SECRET", common::AUTH_SECRET.to_owned()),
        ("TTLAB_LISTEN", server_addr.to_string()),
        (
            "TTLAB_OPS_LISTEN",
            format!("127.0.0.1:{}", common::free_port()),
        ),
        (
            "TTLAB_METRICS_LISTEN",
            format!("127.0.0.1:{}", common::free_port()),
        ),
        ("TTLAB_LESSONS", path(&root.join("lessons"))),
        ("TTLAB_AGENT_BINARY", path(&agent_bin)),
        ("TTLAB_WEB_DIR", path(&root.join("web"))),
        ("RUST_LOG", "info".to_owned()),
    ] {
        env.insert(k.to_owned(), v);
    }
    env.remove("KUBECONFIG");
    let mut server_env = env.clone();
    server_env.insert("TTLAB_SITES".into(), path(&server_sites));
    let mut reaper_env = env;
    reaper_env.insert("TTLAB_SITES".into(), path(&reaper_sites));
    reaper_env.insert("TTLAB_ORPHAN_MIN_AGE".into(), "0s".into());

    let server = common::start(&server_bin, &[], &server_env, "ttlab-server listening").await;

    // One lab on each site (each site's limit is one), a third refused.
    let first = common::start_and_wait_running(server_addr, "student-1", "systemd-basics").await;
    let second = common::start_and_wait_running(server_addr, "student-2", "systemd-basics").await;
    let mut placed = BTreeMap::new();
    for (session, user) in [(&first, "student-1"), (&second, "student-2")] {
        let site = session["site"]
            .as_str()
            .expect("the session's site")
            .to_owned();
        placed.insert(site, (session["id"].as_str().unwrap().to_owned(), user));
    }
    assert_eq!(
        placed.keys().map(String::as_str).collect::<Vec<_>>(),
        ["campus-b", "home"],
        "one lab on each site: {first} {second}"
    );
    let (status, refused) = common::http_json(
        server_addr,
        "POST",
        "/api/sessions",
        Some(&common::token("student-3", Role::Student)),
        Some(serde_json::json!({"lesson": "systemd-basics"})),
    )
    .await;
    assert_eq!(
        (status, refused["error"].as_str()),
        (503, Some("capacity")),
        "{refused}"
    );

    // The lab on campus-b: graded through its API server's port forward, and its console.
    let (b_id, b_user) = placed["campus-b"].clone();
    let b_token = common::token(b_user, Role::Student);
    let (status, graded) = common::http_json(
        server_addr,
        "POST",
        &format!("/api/sessions/{b_id}/grade"),
        Some(&b_token),
        Some(serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 200, "{graded}");
    assert!(graded["total"].as_u64().is_some_and(|n| n > 0), "{graded}");
    let (status, ticket) = common::http_json(
        server_addr,
        "POST",
        &format!("/api/sessions/{b_id}/console-ticket"),
        Some(&b_token),
        Some(serde_json::json!({})),
    )
    .await;
    assert_eq!(status, 200, "{ticket}");
    let url = format!("ws://{server_addr}{}", ticket["url"].as_str().unwrap());
    let (mut ws, _) = tokio_tungstenite::connect_async(&url).await.unwrap();
    let mut seen = String::new();
    tokio::time::timeout(std::time::Duration::from_secs(30), async {
        while !seen.contains("# ") {
            match ws.next().await {
                Some(Ok(tokio_tungstenite::tungstenite::Message::Binary(b))) => {
                    seen.push_str(&String::from_utf8_lossy(&b));
                }
                Some(Ok(_)) => {}
                other => panic!("campus-b's console ended: {other:?}: {seen:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no prompt on campus-b's console: {seen:?}"));
    drop(ws);
    let portforward = |c: &ttlab_envtest::Call| {
        c.group == "subresources.kubevirt.io" && c.resource == "virtualmachineinstances/portforward"
    };
    let remote_calls = plane.calls_of(&campus_b.server_user(), &vms).unwrap();
    assert!(
        remote_calls.iter().any(|c| portforward(c) && c.code < 300),
        "no port forward by the server on campus-b: {remote_calls:?}"
    );
    let home_calls = plane.calls_of(&dev.server_user(), &home_ns).unwrap();
    assert!(
        !home_calls.iter().any(portforward),
        "home's agents are reached by pod IP: {home_calls:?}"
    );

    // Home's lab is finished by its student; campus-b's runs out and the reaper reclaims it
    // there.
    let (h_id, h_user) = placed["home"].clone();
    let (status, finished) = common::http_json(
        server_addr,
        "DELETE",
        &format!("/api/sessions/{h_id}"),
        Some(&common::token(h_user, Role::Student)),
        None,
    )
    .await;
    assert_eq!(status, 200, "{finished}");
    let (pg_client, connection) = tokio_postgres::connect(&database_url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    let b_uuid: uuid::Uuid = b_id.parse().unwrap();
    pg_client
        .execute(
            "UPDATE sessions SET started_at = now() - interval '61 minutes', \
             expires_at = now() - interval '1 minute' WHERE id = $1",
            &[&b_uuid],
        )
        .await
        .unwrap();
    let reaper = tokio::process::Command::new(&reaper_bin)
        .arg("--once")
        .env_clear()
        .envs(&reaper_env)
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(120), reaper)
        .await
        .expect("the reaper's one cycle ends within 2 minutes")
        .unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{printed}");
    let row = pg_client
        .query_one(
            "SELECT status, site FROM sessions WHERE id = $1",
            &[&b_uuid],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, String>(0), row.get::<_, String>(1)),
        ("expired".to_owned(), "campus-b".to_owned()),
        "{printed}"
    );

    // Nothing of either lab is left running on either site.
    let vms_api = |ns: &str| {
        kube::Api::<kube::api::DynamicObject>::namespaced_with(
            admin.clone(),
            ns,
            &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
                "kubevirt.io",
                "v1",
                "VirtualMachine",
            )),
        )
    };
    let until = tokio::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let mut left = Vec::new();
        for ns in [&home_ns, &vms] {
            let list = vms_api(ns).list(&Default::default()).await.unwrap();
            left.extend(list.items.into_iter().filter_map(|o| o.metadata.name));
        }
        if left.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "VMs still there a minute after both labs ended: {left:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }

    // No identity of either cluster was refused a call.
    let mut refused = Vec::new();
    for (user, ns) in [
        (dev.server_user(), &home_ns),
        (dev.reaper_user(), &home_ns),
        (campus_b.server_user(), &vms),
        (campus_b.reaper_user(), &vms),
    ] {
        refused.extend(
            plane
                .calls_of(&user, ns)
                .unwrap()
                .into_iter()
                .filter(|c| c.code == 403)
                .map(|c| format!("{user} in {ns}: {c:?}")),
        );
    }
    assert!(refused.is_empty(), "{}", refused.join("\n"));
    drop(server);
    console.stop().await;
    kubevirt.stop().await;
    tokio::task::spawn_blocking(move || pg.stop())
        .await
        .unwrap()
        .unwrap();
}
