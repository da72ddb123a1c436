//! The serial console through kube-apiserver: the simulator's aggregated API server for
//! `subresources.kubevirt.io/v1`, registered with an APIService, reached through the API
//! server's proxy (authentication and RBAC there, the front proxy's certificate and a
//! SubjectAccessReview here), speaking `plain.kubevirt.io`.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::{SinkExt as _, StreamExt as _};
use http::header::{
    CONNECTION, SEC_WEBSOCKET_ACCEPT, SEC_WEBSOCKET_KEY, SEC_WEBSOCKET_PROTOCOL,
    SEC_WEBSOCKET_VERSION, UPGRADE,
};
use http::{Request, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use serde_json::json;
use support::*;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use ttlab_kubevirt_sim::ConsoleSettings;

const SERVICE: &str = "kubevirt-sim-console";

/// Whether this process registered the console API. The APIService `v1.subresources.kubevirt.io`
/// is cluster-scoped and routes to one console server (of one simulator): one test per control
/// plane, so per test process, may register it.
static CONSOLE_REGISTERED: AtomicBool = AtomicBool::new(false);

type Socket = WebSocketStream<TokioIo<hyper::upgrade::Upgraded>>;

/// Opens the console of VMI `ns/vmi` through the API server; the HTTP status if it is refused.
async fn open_console(client: &kube::Client, ns: &str, vmi: &str) -> Result<Socket, StatusCode> {
    let key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
    let req = Request::get(format!(
        "/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/{vmi}/console"
    ))
    .header(CONNECTION, "Upgrade")
    .header(UPGRADE, "websocket")
    .header(SEC_WEBSOCKET_VERSION, "13")
    .header(SEC_WEBSOCKET_KEY, &key)
    .header(SEC_WEBSOCKET_PROTOCOL, "plain.kubevirt.io")
    .body(kube::client::Body::from(Vec::new()))
    .unwrap();
    let res = client.send(req).await.expect("the API server answers");
    if res.status() != StatusCode::SWITCHING_PROTOCOLS {
        return Err(res.status());
    }
    assert_eq!(
        res.headers()[SEC_WEBSOCKET_ACCEPT].as_bytes(),
        derive_accept_key(key.as_bytes()).as_bytes()
    );
    assert_eq!(res.headers()[SEC_WEBSOCKET_PROTOCOL], "plain.kubevirt.io");
    let upgraded = hyper::upgrade::on(res).await.expect("upgraded");
    Ok(WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Client, None).await)
}

/// Reads binary frames until their text contains `needle`.
async fn read_until(ws: &mut Socket, needle: &str) -> String {
    let mut seen = String::new();
    tokio::time::timeout(Duration::from_secs(20), async {
        while !seen.contains(needle) {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(Message::Close(_))) | None => panic!("closed before {needle:?}: {seen:?}"),
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("console error before {needle:?}: {e}; {seen:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {needle:?} in {seen:?}"));
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_goes_through_the_api_servers_proxy_and_rbac() {
    let Some((plane, client)) = shared_plane().await else {
        return;
    };
    let ns = namespace(plane, &client, "consoles").await;
    let service_ns = namespace(plane, &client, "kubevirt").await;
    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&client, &ns, guests.path()).await;

    assert!(
        !CONSOLE_REGISTERED.swap(true, Ordering::SeqCst),
        "the console API is registered once per control plane"
    );
    // Served with a certificate of the plane's CA (the APIService's caBundle), trusting the
    // front proxy's client certificate kube-apiserver presents.
    let (cert, key) = plane
        .serving_certificate(&format!("{SERVICE}.{service_ns}.svc"))
        .expect("serving certificate");
    let mut settings = ConsoleSettings::new(cert, key, plane.front_proxy_ca_file());
    settings.allowed_names = vec!["front-proxy-client".into()];
    let console = sim.serve_console(settings).await.expect("console server");
    console
        .register(
            &client,
            &service_ns,
            SERVICE,
            plane.ca_pem(),
            Duration::from_secs(60),
        )
        .await
        .expect("APIService available");

    create_vm(&client, &ns, &plain_vm("lab", "Always")).await;
    let vmis = vmi_api(&client, &ns);
    eventually("VMI Running", 60, || async {
        get_json(&vmis, "lab")
            .await
            .filter(|v| v["status"]["phase"] == "Running")
    })
    .await;

    // The administrator's console: a shell on the guest's serial line.
    let mut ws = open_console(&client, &ns, "lab")
        .await
        .expect("console opens");
    read_until(&mut ws, "root@lab:~# ").await;
    ws.send(Message::binary(b"echo console-$((40+2))\r".to_vec()))
        .await
        .unwrap();
    let out = read_until(&mut ws, "console-42\r\n").await;
    assert!(out.contains("echo console-$((40+2))"), "echoed: {out:?}");
    read_until(&mut ws, "root@lab:~# ").await;
    // Text frames are dropped.
    ws.send(Message::text("echo dropped\r")).await.unwrap();

    // One console per VMI: a second one closes the first.
    let mut second = open_console(&client, &ns, "lab")
        .await
        .expect("second console");
    read_until(&mut second, "root@lab:~# ").await;
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(Message::Binary(b))) => {
                    assert!(!String::from_utf8_lossy(&b).contains("dropped"));
                }
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the first console was closed");

    // Not running: 404 for a VMI that does not exist.
    assert_eq!(
        open_console(&client, &ns, "absent").await.err(),
        Some(StatusCode::NOT_FOUND)
    );

    // RBAC: a ServiceAccount without the right is refused by the API server; with a Role for
    // `virtualmachineinstances/console` it gets in.
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), &ns);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "student"}})).unwrap(),
    )
    .await
    .unwrap();
    let student_kc = plane
        .service_account_kubeconfig(&ns, "student", &ns)
        .await
        .expect("the student's kubeconfig");
    let kc = kube::config::Kubeconfig::read_from(&student_kc).unwrap();
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .unwrap();
    let student = kube::Client::try_from(config).unwrap();
    assert_eq!(
        open_console(&student, &ns, "lab").await.err(),
        Some(StatusCode::FORBIDDEN)
    );
    let rbac = |path: &str, body: serde_json::Value| {
        Request::post(path.to_owned())
            .header("content-type", "application/json")
            .body(serde_json::to_vec(&body).unwrap())
            .unwrap()
    };
    let _: serde_json::Value = client
        .request(rbac(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "console"},
                   "rules": [{"apiGroups": ["subresources.kubevirt.io"],
                              "resources": ["virtualmachineinstances/console"], "verbs": ["get"]}]}),
        ))
        .await
        .unwrap();
    let _: serde_json::Value = client
        .request(rbac(
            &format!("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings"),
            json!({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "console"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "console"},
                   "subjects": [{"kind": "ServiceAccount", "name": "student", "namespace": ns}]}),
        ))
        .await
        .unwrap();
    let mut ws = eventually("the student's console", 20, || async {
        open_console(&student, &ns, "lab").await.ok()
    })
    .await;
    read_until(&mut ws, "root@lab:~# ").await;

    // The guest stops: its console closes.
    sim.power_off(&ns, "lab").unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the console closed with the guest");

    assert_nothing_refused(&sim);
    console.stop().await;
    sim.stop().await;
}
