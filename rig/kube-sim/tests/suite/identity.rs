//! Who called what, in RBAC terms: a kubeconfig with a bearer token the sim issued
//! (`KubeSim::write_kubeconfig_for`) makes kube-rs' and kubectl's calls recorded as its user,
//! with verb, API group, resource, subresource and namespace; a token the sim did not issue
//! is refused with `401 Unauthorized`, as a real cluster refuses it.

use crate::support;

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use serde_json::json;
use support::*;
use ttlab_kube_sim::{KubeSim, Verb};

const SERVER: &str = "system:serviceaccount:ttlab:ttlab-server";

async fn client_from(path: &std::path::Path) -> kube::Client {
    let kc = kube::config::Kubeconfig::read_from(path).expect("kubeconfig read");
    let cfg = kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .expect("kube config");
    kube::Client::try_from(cfg).expect("kube client")
}

/// A call as an RBAC rule sees it: (verb, group, resource, subresource, namespace), and the
/// answer's status.
type RbacCall = (Verb, String, String, Option<String>, Option<String>, u16);

/// `user`'s calls.
fn rbac_calls(sim: &KubeSim, user: Option<&str>) -> Vec<RbacCall> {
    sim.calls()
        .into_iter()
        .filter(|c| c.user.as_deref() == user)
        .map(|c| {
            (
                c.verb,
                c.group.clone(),
                c.plural().to_owned(),
                c.subresource.clone(),
                c.namespace.clone(),
                c.status,
            )
        })
        .collect()
}

#[tokio::test]
async fn calls_with_an_issued_token_are_recorded_as_its_user_in_rbac_terms() {
    let sim = start().await;
    grant_everything(&sim, &[SERVER]);
    let h = Http::new(&sim);
    let (code, _) = h
        .post(PODS, &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "lab"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}))
        .await;
    assert_eq!(code, 201);
    wait_for(&h, PODS, "lab", |p| p["status"]["phase"] == "Running").await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    sim.write_kubeconfig_for(&path, "ttlab", SERVER).unwrap();
    assert!(
        std::fs::read_to_string(&path)
            .unwrap()
            .contains(&sim.token_for(SERVER)),
        "the kubeconfig carries the user's token"
    );
    let client = client_from(&path).await;

    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let s: Secret = serde_json::from_value(json!({"metadata": {"name": "ci"}})).unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
    let vm_type = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
        "virtualmachines",
    );
    let vms: Api<DynamicObject> = Api::namespaced_with(client.clone(), "ttlab", &vm_type);
    vms.list(&ListParams::default()).await.unwrap();
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.patch_status(
        "lab",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"message": "seen"}})),
    )
    .await
    .unwrap();
    let mut p = pods
        .exec(
            "lab",
            ["hostname"],
            &kube::api::AttachParams::default().stderr(false),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(20), p.take_status().unwrap())
        .await
        .unwrap();
    secrets
        .delete("ci", &DeleteParams::default())
        .await
        .unwrap();

    let ns = || Some("ttlab".to_owned());
    let s = |v: &str| v.to_owned();
    assert_eq!(
        rbac_calls(&sim, Some(SERVER)),
        vec![
            (Verb::Create, s(""), s("secrets"), None, ns(), 201),
            (
                Verb::List,
                s("kubevirt.io"),
                s("virtualmachines"),
                None,
                ns(),
                200
            ),
            (Verb::Patch, s(""), s("pods"), Some(s("status")), ns(), 200),
            (Verb::Get, s(""), s("pods"), Some(s("exec")), ns(), 101),
            (Verb::Delete, s(""), s("secrets"), None, ns(), 200),
        ]
    );
    // The calls without credentials (the test's own) stay anonymous.
    assert!(
        rbac_calls(&sim, None)
            .iter()
            .all(|c| c.2 == "pods" && c.3.is_none())
    );
}

/// The controllers played from outside (`Controllers::External`) act as the control plane's
/// own: authorized whatever the RBAC objects say, untouched by the faults and latency
/// injected for the clients under test, and absent from the call record.
#[tokio::test]
async fn the_controllers_identity_is_beside_rbac_faults_and_the_call_record() {
    let sim = start().await;
    grant_everything(&sim, &[SERVER]);
    sim.faults().add(ttlab_kube_sim::FaultRule::fail(
        Some(Verb::Create),
        Some("secrets"),
        500,
    ));
    sim.faults().add(ttlab_kube_sim::FaultRule {
        action: ttlab_kube_sim::FaultAction::Delay { millis: 5_000 },
        ..ttlab_kube_sim::FaultRule::fail(Some(Verb::List), Some("secrets"), 500)
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("server");
    sim.write_kubeconfig_for(&path, "ttlab", SERVER).unwrap();
    let server: Api<Secret> = Api::default_namespaced(client_from(&path).await);
    let path = dir.path().join("controllers");
    std::fs::write(&path, sim.controller_kubeconfig_yaml()).unwrap();
    let controllers: Api<Secret> = Api::namespaced(client_from(&path).await, "ttlab");
    let path = dir.path().join("stranger");
    sim.write_kubeconfig_for(&path, "ttlab", "stranger")
        .unwrap();
    let stranger: Api<Secret> = Api::default_namespaced(client_from(&path).await);

    let s: Secret = serde_json::from_value(json!({"metadata": {"name": "made"}})).unwrap();
    match server.create(&PostParams::default(), &s).await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 500, "{e:?}"),
        other => panic!("the injected fault answers the server: {other:?}"),
    }
    match stranger.get_opt("made").await {
        Err(kube::Error::Api(e)) => assert_eq!(e.code, 403, "{e:?}"),
        other => panic!("RBAC is enforced: {other:?}"),
    }
    controllers
        .create(&PostParams::default(), &s)
        .await
        .expect("the controllers' create is not failed");
    let at = std::time::Instant::now();
    let listed = controllers.list(&ListParams::default()).await.unwrap();
    assert!(
        at.elapsed() < Duration::from_secs(2),
        "the controllers' list is not delayed: {:?}",
        at.elapsed()
    );
    assert_eq!(listed.items.len(), 1);
    let users: Vec<Option<String>> = sim.calls().into_iter().map(|c| c.user).collect();
    assert_eq!(
        users,
        [Some(SERVER.to_owned()), Some("stranger".to_owned())],
        "only the clients under test are recorded"
    );
}

#[tokio::test]
async fn a_token_the_sim_did_not_issue_is_refused_with_401() {
    let sim = start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        ttlab_kube_sim::kubeconfig_yaml_with_token(sim.url(), "ttlab", "stolen"),
    )
    .unwrap();
    let secrets: Api<Secret> = Api::default_namespaced(client_from(&path).await);
    match secrets.list(&ListParams::default()).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(
                (s.code, s.reason.as_str(), s.message.as_str()),
                (401, "Unauthorized", "Unauthorized")
            );
        }
        other => panic!("served with a token nobody issued: {other:?}"),
    }
    assert_eq!(
        rbac_calls(&sim, None),
        vec![(
            Verb::List,
            String::new(),
            "secrets".into(),
            None,
            Some("ttlab".into()),
            401
        )]
    );
}

/// kubectl (client-go) reads a kubeconfig's credentials only for a TLS server, so against
/// kube-sim's plain HTTP its token goes unsent and its calls are anonymous; `as:` names it.
#[tokio::test]
async fn kubectl_is_recorded_as_the_user_its_kubeconfig_acts_as_not_by_its_token() {
    let Some(kubectl) = ttlab_testkit::which("kubectl") else {
        return ttlab_testkit::skip_or_fail(
            "kubectl is not on PATH; kubectl's identity did not run",
        );
    };
    let sim = start().await;
    grant_everything(&sim, &["alice", "bob"]);
    let dir = tempfile::tempdir().unwrap();
    let get_secrets = |kubeconfig: std::path::PathBuf| {
        let mut cmd = tokio::process::Command::new(&kubectl);
        cmd.arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .args(["get", "secrets", "-o", "name"]);
        async move {
            let out = cmd.output().await.expect("kubectl runs");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let with_token = dir.path().join("token");
    sim.write_kubeconfig_for(&with_token, "ttlab", "alice")
        .unwrap();
    get_secrets(with_token).await;
    let acting = dir.path().join("as");
    sim.write_kubeconfig_as(&acting, "ttlab", Some("bob"))
        .unwrap();
    get_secrets(acting).await;
    let list = || {
        (
            Verb::List,
            String::new(),
            "secrets".to_owned(),
            None,
            Some("ttlab".to_owned()),
            200,
        )
    };
    assert_eq!(rbac_calls(&sim, Some("alice")), vec![]);
    assert_eq!(rbac_calls(&sim, None), vec![list()]);
    assert_eq!(rbac_calls(&sim, Some("bob")), vec![list()]);
}

/// With a Role bound to a ServiceAccount, its token may make exactly the Role's calls, in the
/// Role's namespace; anything else is refused with the real server's 403, through kube-rs and
/// kubectl alike. kube-sim is no kinder than a real API server here.
#[tokio::test]
async fn a_service_account_may_make_its_roles_calls_and_no_other() {
    let sim = start().await;
    let sa = "system:serviceaccount:backend:server";
    sim.apply_rbac(&[
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
               "metadata": {"name": "server", "namespace": "ttlab"},
               "rules": [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "list"]}]}),
        json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "server", "namespace": "ttlab"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "server"},
               "subjects": [{"kind": "ServiceAccount", "name": "server", "namespace": "backend"}]}),
    ])
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kubeconfig");
    sim.write_kubeconfig_for(&path, "ttlab", sa).unwrap();
    let client = client_from(&path).await;
    let secrets: Api<Secret> = Api::default_namespaced(client.clone());
    let s: Secret = serde_json::from_value(json!({"metadata": {"name": "ci"}})).unwrap();
    secrets.create(&PostParams::default(), &s).await.unwrap();
    assert_eq!(
        secrets
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        1
    );
    let refused = |r: Result<_, kube::Error>| match r {
        Err(kube::Error::Api(s)) => (s.code, s.reason, s.message),
        Ok(_) => panic!("served without a rule that allows it"),
        Err(e) => panic!("{e}"),
    };
    assert_eq!(
        refused(secrets.get("ci").await.map(|_| ())),
        (
            403,
            "Forbidden".to_owned(),
            format!(
                "secrets \"ci\" is forbidden: User \"{sa}\" cannot get resource \"secrets\" in API group \"\" in the namespace \"ttlab\""
            )
        )
    );
    let elsewhere: Api<Secret> = Api::namespaced(client.clone(), "default");
    assert_eq!(
        refused(elsewhere.list(&ListParams::default()).await.map(|_| ())).0,
        403
    );
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    assert_eq!(
        refused(pods.list(&ListParams::default()).await.map(|_| ())).0,
        403
    );
    // The refusals are in the call record, as a real server's audit log has them.
    let codes: Vec<u16> = rbac_calls(&sim, Some(sa)).iter().map(|c| c.5).collect();
    assert_eq!(codes, vec![201, 200, 403, 403, 403]);
    // The administrator (no credentials) still reads it all.
    let h = Http::new(&sim);
    let (code, _) = h.get("/api/v1/namespaces/ttlab/secrets/ci").await;
    assert_eq!(code, 200);
}
