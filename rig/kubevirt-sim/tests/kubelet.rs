//! Pods (pod labs) against a real kube-apiserver with the simulator as the node: bound,
//! started once their volumes exist, Running and Ready with a loopback address, failed at
//! their deadline, and deleted gracefully.

#[macro_use]
mod support;

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod, Secret};
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::{Value, json};
use support::*;

fn pod(name: &str, extra_spec: Value) -> Pod {
    let mut spec = json!({
        "containers": [{"name": "lab", "image": "docker.io/library/debian:12", "command": ["sleep", "infinity"]}],
    });
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra_spec.as_object()) {
        for (k, v) in e {
            s.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

async fn pod_json(api: &Api<Pod>, name: &str) -> Option<Value> {
    api.get_opt(name)
        .await
        .unwrap()
        .map(|p| serde_json::to_value(p).unwrap())
}

fn condition(p: &Value, type_: &str) -> Value {
    p["status"]["conditions"]
        .as_array()
        .and_then(|l| l.iter().find(|c| c["type"] == type_))
        .cloned()
        .unwrap_or(Value::Null)
}

on_both!(pods_start_once_their_volumes_exist_run_ready_and_are_deleted_gracefully);
async fn pods_start_once_their_volumes_exist_run_ready_and_are_deleted_gracefully(on: On) {
    let Some((plane, client)) = plane(on).await else {
        return;
    };
    let ns = plane.namespace(&client, "pods").await;
    let guests = tempfile::tempdir().unwrap();
    let sim = start_sim(&plane.controller_client(&client).await, &ns, guests.path()).await;
    let node_name = sim.settings().node_name.clone();

    // The node registered itself, Ready.
    let nodes: Api<Node> = Api::all(client.clone());
    let node = serde_json::to_value(nodes.get(&node_name).await.unwrap()).unwrap();
    let ready = node["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap()
        .clone();
    assert_eq!(ready["status"], "True");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let pp = PostParams::default();
    let t0 = Instant::now();
    pods.create(&pp, &pod("web", json!({}))).await.unwrap();
    pods.create(
        &pp,
        &pod(
            "needs-secret",
            json!({"volumes": [{"name": "creds", "secret": {"secretName": "later"}}]}),
        ),
    )
    .await
    .unwrap();
    pods.create(&pp, &pod("deadline", json!({"activeDeadlineSeconds": 2})))
        .await
        .unwrap();

    // Running and Ready, on the node, at a loopback address.
    let web = eventually("web Running", 30, || async {
        pod_json(&pods, "web")
            .await
            .filter(|p| p["status"]["phase"] == "Running")
    })
    .await;
    let t_running = t0.elapsed();
    assert_eq!(web["spec"]["nodeName"], node_name.as_str());
    let ip: Ipv4Addr = web["status"]["podIP"].as_str().unwrap().parse().unwrap();
    assert!(ip.is_loopback() && ip != Ipv4Addr::LOCALHOST, "{ip}");
    assert_eq!(web["status"]["podIPs"][0]["ip"], ip.to_string());
    for c in ["PodScheduled", "Initialized", "Ready", "ContainersReady"] {
        assert_eq!(condition(&web, c)["status"], "True", "{c}: {web:#}");
    }
    let cs = &web["status"]["containerStatuses"][0];
    assert_eq!(cs["name"], "lab");
    assert_eq!(cs["ready"], true);
    assert!(cs["state"]["running"]["startedAt"].is_string());
    assert!(web["status"]["startTime"].is_string());

    // Waiting for its Secret: ContainerCreating until it exists.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let waiting = pod_json(&pods, "needs-secret").await.unwrap();
    assert_eq!(waiting["status"]["phase"], "Pending");
    assert_eq!(
        waiting["status"]["containerStatuses"][0]["state"]["waiting"]["reason"],
        "ContainerCreating"
    );
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    secrets
        .create(
            &pp,
            &serde_json::from_value(
                json!({"metadata": {"name": "later"}, "stringData": {"k": "v"}}),
            )
            .unwrap(),
        )
        .await
        .unwrap();
    let started = eventually("needs-secret Running", 30, || async {
        pod_json(&pods, "needs-secret")
            .await
            .filter(|p| p["status"]["phase"] == "Running")
    })
    .await;
    assert_ne!(started["status"]["podIP"], web["status"]["podIP"]);

    // Past its activeDeadlineSeconds: Failed, DeadlineExceeded.
    let failed = eventually("deadline Failed", 30, || async {
        pod_json(&pods, "deadline")
            .await
            .filter(|p| p["status"]["phase"] == "Failed")
    })
    .await;
    assert_eq!(failed["status"]["reason"], "DeadlineExceeded");
    assert!(failed["status"]["containerStatuses"][0]["state"]["terminated"].is_object());

    // Deleted with its 30 s grace: the containers stop within the simulator's grace, and the
    // kubelet confirms the deletion.
    let t_delete = Instant::now();
    pods.delete("web", &DeleteParams::default()).await.unwrap();
    let terminating = pod_json(&pods, "web")
        .await
        .expect("still there, terminating");
    assert!(terminating["metadata"]["deletionTimestamp"].is_string());
    eventually("web gone", 30, || async {
        pod_json(&pods, "web").await.is_none().then_some(())
    })
    .await;
    let t_gone = t_delete.elapsed();
    assert!(t_gone >= sim.settings().shutdown_grace, "{t_gone:?}");
    assert!(t_gone < Duration::from_secs(10), "{t_gone:?}");
    eprintln!("TIMINGS: pod created → Running {t_running:?}; deleted → gone {t_gone:?}");

    assert_nothing_refused(&sim);
    sim.stop().await;
}
