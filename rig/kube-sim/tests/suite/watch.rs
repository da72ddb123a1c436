//! Watches and deletion as a real cluster serves them where clients depend on it: a watch
//! from a resourceVersion older than the retained history ends with a `410 Expired` ERROR
//! event (after a compaction, or once the watch cache has moved on), and an object with
//! finalizers lingers with a `deletionTimestamp` until the last one is removed.

use crate::support;

use std::time::Duration;

use futures::{StreamExt as _, TryStreamExt as _};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use support::*;
use ttlab_kube_sim::{KubeSim, SimConfig};

fn rv(obj: &Value) -> String {
    obj["metadata"]["resourceVersion"]
        .as_str()
        .expect("resourceVersion")
        .to_owned()
}

/// Every event of a watch until the server ends it.
async fn all_events(h: &Http, path: &str) -> Vec<Value> {
    let mut rx = h.watch(path).await;
    let mut events = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(ev) = rx.recv().await {
            events.push(ev);
        }
    })
    .await
    .expect("the watch ends");
    events
}

#[tokio::test]
async fn a_watch_from_before_a_compaction_ends_with_410_expired() {
    let sim = start().await;
    let h = Http::new(&sim);
    let (_, a) = h.post(SECRETS, &secret("a", json!({}), json!({}))).await;
    let old = rv(&a);
    // A change after `old`, then the compaction that forgets it.
    h.post(SECRETS, &secret("a2", json!({}), json!({}))).await;
    sim.compact_history();
    let (_, b) = h.post(SECRETS, &secret("b", json!({}), json!({}))).await;

    let events = all_events(&h, &format!("{SECRETS}?watch=true&resourceVersion={old}")).await;
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["type"], "ERROR");
    let status = &events[0]["object"];
    assert_eq!(
        (
            status["kind"].as_str(),
            status["status"].as_str(),
            status["reason"].as_str(),
            status["code"].as_u64()
        ),
        (Some("Status"), Some("Failure"), Some("Expired"), Some(410))
    );
    let message = status["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!("too old resource version: {old} (")),
        "{message}"
    );

    // kube-rs sees the same: an error event with 410, which its watcher answers by listing.
    let secrets: Api<Secret> = Api::namespaced(kube_client(&sim).await, "ttlab");
    let first = secrets
        .watch(&WatchParams::default().timeout(5), &old)
        .await
        .expect("the watch is answered")
        .boxed()
        .try_next()
        .await
        .expect("an event");
    match first {
        Some(WatchEvent::Error(e)) => assert_eq!((e.code, e.reason.as_str()), (410, "Expired")),
        other => panic!("not a 410: {other:?}"),
    }

    // From a resourceVersion after the compaction the watch works.
    let mut rx = h
        .watch(&format!(
            "{SECRETS}?watch=true&resourceVersion={}&timeoutSeconds=10",
            rv(&b)
        ))
        .await;
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(secret("c", json!({}), json!({}))).unwrap(),
        )
        .await
        .unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("ADDED"), Some("c"))
    );
}

#[tokio::test]
async fn old_changes_leave_the_history_per_type_keeping_the_last_hundred() {
    let mut config = SimConfig::for_tests();
    config.watch_history = Duration::ZERO;
    let sim = KubeSim::start(config).await.unwrap();
    let h = Http::new(&sim);
    let mut rvs = Vec::new();
    for i in 0..150 {
        let (code, s) = h
            .post(SECRETS, &secret(&format!("s{i:03}"), json!({}), json!({})))
            .await;
        assert_eq!(code, 201, "{s}");
        rvs.push(rv(&s));
    }
    // The first 50 changes of secrets are gone: a watch from there expires.
    let events = all_events(
        &h,
        &format!("{SECRETS}?watch=true&resourceVersion={}", rvs[10]),
    )
    .await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["object"]["reason"], "Expired", "{events:?}");
    // The last hundred are kept, whatever their age.
    let events = all_events(
        &h,
        &format!(
            "{SECRETS}?watch=true&resourceVersion={}&timeoutSeconds=1",
            rvs[139]
        ),
    )
    .await;
    let names: Vec<&str> = events
        .iter()
        .map(|e| e["object"]["metadata"]["name"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        names,
        (140..150).map(|i| format!("s{i:03}")).collect::<Vec<_>>()
    );
    // Another type's few changes are its own: namespaces from before all the secrets still
    // replay.
    let events = all_events(
        &h,
        &format!(
            "/api/v1/namespaces?watch=true&resourceVersion={}&timeoutSeconds=1",
            rvs[0]
        ),
    )
    .await;
    assert!(events.iter().all(|e| e["type"] != "ERROR"), "{events:?}");
}

#[tokio::test]
async fn an_object_with_finalizers_lingers_until_the_last_one_is_removed() {
    let sim = start().await;
    let h = Http::new(&sim);
    let mut s = secret("kept", json!({}), json!({}));
    s["metadata"]["finalizers"] = json!(["ttlab.io/a", "ttlab.io/b"]);
    let (code, created) = h.post(SECRETS, &s).await;
    assert_eq!(code, 201, "{created}");
    let mut rx = h
        .watch(&format!(
            "{SECRETS}?watch=true&resourceVersion={}&timeoutSeconds=10",
            rv(&created)
        ))
        .await;

    let (code, deleted) = h.delete(&format!("{SECRETS}/kept")).await;
    assert_eq!(code, 200, "{deleted}");
    assert!(
        deleted["metadata"]["deletionTimestamp"].is_string(),
        "{deleted}"
    );
    let ev = rx.recv().await.unwrap();
    assert_eq!(
        ev["type"], "MODIFIED",
        "marked for deletion, not gone: {ev}"
    );
    // Still readable and listed; deleting again changes nothing.
    let (code, got) = h.get(&format!("{SECRETS}/kept")).await;
    assert_eq!(code, 200);
    assert_eq!(
        got["metadata"]["finalizers"],
        json!(["ttlab.io/a", "ttlab.io/b"])
    );
    let (code, again) = h.delete(&format!("{SECRETS}/kept")).await;
    assert_eq!((code, rv(&again)), (200, rv(&got)));
    // No finalizer may be added to an object being deleted.
    let (code, body) = h
        .raw(
            "PATCH",
            &format!("{SECRETS}/kept"),
            "application/merge-patch+json",
            br#"{"metadata":{"finalizers":["ttlab.io/a","ttlab.io/b","ttlab.io/c"]}}"#.to_vec(),
        )
        .await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (422, Some("Invalid")),
        "{body}"
    );
    assert_eq!(
        body["message"],
        "Secret \"kept\" is invalid: metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers []string{\"ttlab.io/c\"}"
    );

    // Removing one leaves it terminating; removing the last one deletes it.
    let patch = |f: Value| serde_json::to_vec(&json!({"metadata": {"finalizers": f}})).unwrap();
    let (code, one_left) = h
        .raw(
            "PATCH",
            &format!("{SECRETS}/kept"),
            "application/merge-patch+json",
            patch(json!(["ttlab.io/b"])),
        )
        .await;
    assert_eq!(code, 200, "{one_left}");
    assert!(one_left["metadata"]["deletionTimestamp"].is_string());
    assert_eq!(rx.recv().await.unwrap()["type"], "MODIFIED");
    assert_eq!(h.get(&format!("{SECRETS}/kept")).await.0, 200);
    let (code, _) = h
        .raw(
            "PATCH",
            &format!("{SECRETS}/kept"),
            "application/merge-patch+json",
            patch(Value::Null),
        )
        .await;
    assert_eq!(code, 200);
    let ev = rx.recv().await.unwrap();
    assert_eq!(
        (
            ev["type"].as_str(),
            ev["object"]["metadata"]["name"].as_str()
        ),
        (Some("DELETED"), Some("kept"))
    );
    assert_eq!(h.get(&format!("{SECRETS}/kept")).await.0, 404);
}
