//! ResourceQuota as a real cluster enforces it: admission judges by the status the quota
//! controller writes (after `SimConfig::quota_sync`), so a new quota covers nothing until then,
//! a freed object is free only once the controller has recounted, a changed limit applies only
//! then, and a covered resource the controller has not counted refuses creates with `403
//! status unknown for quota`. Admission comes before storage: a create of a taken name is
//! charged (then refused `409`) or refused by a full quota (`403`), and what it charged stays
//! counted until the controller recounts.

/// Test bodies shared with the real control plane's suites.
use crate::parity;
use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::*;
use ttlab_kube_sim::{KubeSim, SimConfig};

const QUOTAS: &str = "/api/v1/namespaces/ttlab/resourcequotas";

/// A sim whose quota controller takes a second: long enough for a window a test can act in.
async fn slow_quota_controller() -> KubeSim {
    let mut config = SimConfig::for_tests();
    config.quota_sync = Duration::from_secs(1);
    let sim = KubeSim::start(config).await.expect("sim starts");
    sim.pause_kubevirt(true);
    sim
}

fn quota(hard: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "lab-quota"}, "spec": {"hard": hard}})
}

async fn create_vm(h: &Http, name: &str) -> (u16, Value) {
    h.post(VMS, &vm(name, json!({}), "Halted", container_disk()))
        .await
}

async fn used(h: &Http, resource: &str) -> Value {
    let (_, q) = h.get(&format!("{QUOTAS}/lab-quota")).await;
    q["status"]["used"][resource].clone()
}

const VM_COUNT: &str = "count/virtualmachines.kubevirt.io";

#[tokio::test]
async fn a_new_quota_covers_nothing_until_its_controller_has_counted() {
    let sim = slow_quota_controller().await;
    let h = Http::new(&sim);
    let (code, body) = h.post(QUOTAS, &quota(json!({VM_COUNT: "1"}))).await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(
        body["status"],
        json!({}),
        "the API server clears a new quota's status"
    );
    // Before the controller's first sync the quota covers nothing: both are admitted.
    assert_eq!(create_vm(&h, "a").await.0, 201);
    assert_eq!(create_vm(&h, "b").await.0, 201);
    // The controller then counts both, above the limit, and the next create is refused.
    let q = wait_for(&h, QUOTAS, "lab-quota", |q| q["status"]["used"].is_object()).await;
    assert_eq!(
        q["status"],
        json!({"hard": {VM_COUNT: "1"}, "used": {VM_COUNT: "2"}})
    );
    let (code, body) = create_vm(&h, "c").await;
    assert_eq!((code, body["reason"].as_str()), (403, Some("Forbidden")));
    assert_eq!(
        body["message"],
        "virtualmachines.kubevirt.io \"c\" is forbidden: exceeded quota: lab-quota, requested: count/virtualmachines.kubevirt.io=1, used: count/virtualmachines.kubevirt.io=2, limited: count/virtualmachines.kubevirt.io=1"
    );
}

#[tokio::test]
async fn freed_quota_and_raised_limits_count_only_once_the_controller_has_synced() {
    let sim = slow_quota_controller().await;
    let h = Http::new(&sim);
    assert_eq!(h.post(QUOTAS, &quota(json!({VM_COUNT: "1"}))).await.0, 201);
    wait_for(&h, QUOTAS, "lab-quota", |q| q["status"]["used"].is_object()).await;
    assert_eq!(create_vm(&h, "a").await.0, 201);
    // Admission charged the quota at once.
    assert_eq!(used(&h, VM_COUNT).await, "1");
    assert_eq!(h.delete(&format!("{VMS}/a")).await.0, 200);
    // The VM is gone, but the quota still counts it until the controller recounts.
    let (code, body) = create_vm(&h, "b").await;
    assert_eq!(code, 403, "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("exceeded quota: lab-quota"),
        "{body}"
    );
    wait_for(&h, QUOTAS, "lab-quota", |q| {
        q["status"]["used"][VM_COUNT] == "0"
    })
    .await;
    assert_eq!(create_vm(&h, "b").await.0, 201);

    // A raised limit applies once the controller has copied it into the status.
    let (_, mut q) = h.get(&format!("{QUOTAS}/lab-quota")).await;
    q["spec"]["hard"][VM_COUNT] = json!("2");
    let (code, body) = h
        .raw(
            "PUT",
            &format!("{QUOTAS}/lab-quota"),
            "application/json",
            serde_json::to_vec(&q).unwrap(),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(
        body["status"]["hard"][VM_COUNT], "1",
        "the status is the controller's"
    );
    assert_eq!(create_vm(&h, "c").await.0, 403);
    wait_for(&h, QUOTAS, "lab-quota", |q| {
        q["status"]["hard"][VM_COUNT] == "2"
    })
    .await;
    assert_eq!(create_vm(&h, "c").await.0, 201);
    assert_eq!(used(&h, VM_COUNT).await, "2");
}

#[tokio::test]
async fn a_resource_the_controller_has_not_counted_refuses_creates_with_status_unknown() {
    let sim = start().await;
    sim.pause_kubevirt(true);
    let h = Http::new(&sim);
    sim.set_quota_counting(VM_COUNT, false);
    let hard = json!({VM_COUNT: "5", "requests.memory": "4Gi"});
    assert_eq!(h.post(QUOTAS, &quota(hard)).await.0, 201);
    let q = wait_for(&h, QUOTAS, "lab-quota", |q| q["status"]["used"].is_object()).await;
    assert_eq!(q["status"]["used"], json!({"requests.memory": "0"}));

    let (code, body) = create_vm(&h, "a").await;
    assert_eq!(code, 403);
    assert_eq!(
        body,
        json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": "virtualmachines.kubevirt.io \"a\" is forbidden: status unknown for quota: lab-quota, resources: count/virtualmachines.kubevirt.io",
            "reason": "Forbidden",
            "details": {"name": "a", "group": "kubevirt.io", "kind": "virtualmachines"},
            "code": 403
        })
    );
    // kube-rs (as the product's cluster client) sees the same refusal.
    let vms: kube::Api<kube::api::DynamicObject> = kube::Api::namespaced_with(
        kube_client(&sim).await,
        "ttlab",
        &kube::discovery::ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk("kubevirt.io", "v1", "VirtualMachine"),
            "virtualmachines",
        ),
    );
    let object: kube::api::DynamicObject =
        serde_json::from_value(vm("b", json!({}), "Halted", container_disk())).unwrap();
    match vms.create(&Default::default(), &object).await {
        Err(kube::Error::Api(s)) => {
            assert_eq!((s.code, s.reason.as_str()), (403, "Forbidden"));
            assert!(
                s.message.contains("status unknown for quota: lab-quota"),
                "{}",
                s.message
            );
        }
        other => panic!("created despite the unknown quota status: {other:?}"),
    }
    // What the quota covers with known usage is admitted meanwhile.
    let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x", "resources": {"requests": {"memory": "1Gi"}}}]}});
    assert_eq!(h.post(PODS, &pod).await.0, 201);
    assert_eq!(used(&h, "requests.memory").await, "1Gi");

    // Once the controller counts VMs, creates go through.
    sim.set_quota_counting(VM_COUNT, true);
    wait_for(&h, QUOTAS, "lab-quota", |q| {
        q["status"]["used"][VM_COUNT] == "0"
    })
    .await;
    assert_eq!(create_vm(&h, "a").await.0, 201);
    assert_eq!(used(&h, VM_COUNT).await, "1");
}

#[tokio::test]
async fn a_create_of_a_taken_name_is_judged_and_charged_by_the_quota_before_storage_refuses_it() {
    let mut config = SimConfig::for_tests();
    config.quota_sync = Duration::from_millis(100);
    config.quota_resync = Duration::from_secs(3);
    let sim = KubeSim::start(config).await.expect("sim starts");
    sim.pause_kubevirt(true);
    let h = Http::new(&sim);
    assert_eq!(h.post(QUOTAS, &quota(json!({VM_COUNT: "2"}))).await.0, 201);
    wait_for(&h, QUOTAS, "lab-quota", |q| q["status"]["used"].is_object()).await;
    assert_eq!(create_vm(&h, "a").await.0, 201);
    // The same create again (a retried create whose first answer was lost): admitted and
    // charged by the quota, then refused by storage.
    let (code, body) = create_vm(&h, "a").await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (409, Some("AlreadyExists"))
    );
    assert_eq!(
        used(&h, VM_COUNT).await,
        "2",
        "the refused create stays charged"
    );
    // So the quota is full with one VM in the namespace.
    let (code, body) = create_vm(&h, "b").await;
    assert_eq!(code, 403, "{body}");
    // Creates do not make the controller recount.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(used(&h, VM_COUNT).await, "2");
    // A full quota refuses even a create of a name that is taken: 403, not 409.
    let (code, body) = create_vm(&h, "a").await;
    assert_eq!((code, body["reason"].as_str()), (403, Some("Forbidden")));
    assert!(
        body["message"].as_str().unwrap().starts_with(
            "virtualmachines.kubevirt.io \"a\" is forbidden: exceeded quota: lab-quota"
        ),
        "{body}"
    );
    // The controller's full resync counts what is really there.
    wait_for(&h, QUOTAS, "lab-quota", |q| {
        q["status"]["used"][VM_COUNT] == "1"
    })
    .await;
    assert_eq!(create_vm(&h, "b").await.0, 201);
}

/// The body the real control plane runs in `rig/envtest/tests/quota.rs`: the same
/// over-count after a refused repeat create, for as long, and the same recount after a
/// deletion.
#[tokio::test]
async fn a_refused_repeat_create_stays_charged_until_the_controller_recounts_as_on_the_real_server()
{
    let sim = start().await;
    let client = kube_client(&sim).await;
    parity::a_refused_repeat_create_stays_charged_until_the_controller_recounts(
        client,
        "ttlab",
        Duration::from_secs(3),
    )
    .await;
}
