//! Metadata-only answers (`PartialObjectMetadata`, `PartialObjectMetadataList`) as kube-rs asks
//! for them, and objects created with a backdated `creationTimestamp`.

use crate::support;

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use futures::StreamExt as _;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use serde_json::{Value, json};
use support::*;

const LIST_MIME: &str = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1";
const ONE_MIME: &str = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1";

/// A Secret of `size` bytes of data, labelled with `env`.
fn big_secret(name: &str, env: &str, size: usize) -> Value {
    let mut s = secret(
        name,
        json!({"app.kubernetes.io/managed-by": "ttlab", "ttlab.io/env": env}),
        json!({}),
    );
    s["metadata"]["namespace"] = json!("ttlab");
    s["stringData"] = json!({"userdata": "x".repeat(size)});
    s
}

async fn get_raw(client: &kube::Client, path: &str, accept: &str) -> Value {
    let req = http::Request::get(path)
        .header(http::header::ACCEPT, accept)
        .body(Vec::new())
        .expect("request");
    let text = client.request_text(req).await.expect("answer");
    serde_json::from_str(&text).expect("json")
}

#[tokio::test]
async fn metadata_lists_carry_names_labels_and_owners_but_never_the_data() {
    let sim = start().await;
    // 600 Secrets of 32 KiB each (a cloud-init Secret embeds a whole agent): in full, one page
    // of 500 would be 16 MiB.
    for i in 0..600 {
        let env = if i % 3 == 0 { "prod" } else { "dev" };
        sim.create(big_secret(&format!("ci-{i:03}"), env, 32 * 1024))
            .expect("created");
    }
    let client = kube_client(&sim).await;
    let secrets: Api<Secret> = Api::namespaced(client.clone(), "ttlab");

    // kube-rs' list_metadata, page by page.
    let mut names = Vec::new();
    let mut lp = ListParams::default().labels("ttlab.io/env=dev").limit(150);
    loop {
        let page = secrets.list_metadata(&lp).await.expect("metadata page");
        for item in &page.items {
            let meta = &item.metadata;
            assert!(meta.uid.is_some() && meta.creation_timestamp.is_some());
            assert_eq!(
                meta.labels.as_ref().and_then(|l| l.get("ttlab.io/env")),
                Some(&"dev".to_owned())
            );
            names.push(meta.name.clone().expect("name"));
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => break,
        }
    }
    assert_eq!(names.len(), 400);

    // On the wire: the partial kinds, and metadata alone.
    let path = "/api/v1/namespaces/ttlab/secrets?labelSelector=ttlab.io%2Fenv%3Ddev&limit=500";
    let body = get_raw(&client, path, LIST_MIME).await;
    assert_eq!(body["kind"], "PartialObjectMetadataList");
    assert_eq!(body["apiVersion"], "meta.k8s.io/v1");
    let items = body["items"].as_array().expect("items");
    assert_eq!(items.len(), 400);
    for item in items {
        assert_eq!(item["kind"], "PartialObjectMetadata");
        assert_eq!(item["apiVersion"], "meta.k8s.io/v1");
        let mut keys: Vec<&str> = item
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(keys, ["apiVersion", "kind", "metadata"]);
    }
    let bytes = serde_json::to_vec(&body).expect("json").len();
    assert!(bytes < 400 * 1024, "400 items in {bytes} bytes");
    // Asked plainly (or for a table first), the same list comes in full.
    for accept in [
        "application/json",
        "application/json;as=Table;v=v1;g=meta.k8s.io,application/json",
    ] {
        let full = get_raw(&client, path, accept).await;
        assert_eq!(full["kind"], "SecretList", "{accept}");
        assert!(full["items"][0]["data"]["userdata"].is_string(), "{accept}");
    }

    // One object: get_metadata_opt, found and missing.
    let one = secrets
        .get_metadata_opt("ci-001")
        .await
        .expect("get")
        .expect("found");
    assert_eq!(one.metadata.name.as_deref(), Some("ci-001"));
    assert!(
        secrets
            .get_metadata_opt("nope")
            .await
            .expect("get")
            .is_none()
    );
    let raw = get_raw(&client, "/api/v1/namespaces/ttlab/secrets/ci-001", ONE_MIME).await;
    assert_eq!(raw["kind"], "PartialObjectMetadata");
    assert!(raw.get("data").is_none(), "{raw}");
    sim.shutdown().await;
}

#[tokio::test]
async fn a_metadata_watch_sends_partial_objects() {
    let sim = start().await;
    sim.create(big_secret("first", "dev", 1024))
        .expect("created");
    let client = kube_client(&sim).await;
    let secrets: Api<Secret> = Api::namespaced(client, "ttlab");
    let stream = secrets
        .watch_metadata(&WatchParams::default().labels("ttlab.io/env=dev"), "0")
        .await
        .expect("watch");
    let mut stream = std::pin::pin!(stream);
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("an event in time")
        .expect("an event")
        .expect("a good event");
    match first {
        WatchEvent::Added(meta) => {
            assert_eq!(meta.metadata.name.as_deref(), Some("first"));
            let types = meta.types.expect("types");
            assert_eq!(
                (types.kind.as_str(), types.api_version.as_str()),
                ("PartialObjectMetadata", "meta.k8s.io/v1")
            );
        }
        other => panic!("expected an ADDED event, got {other:?}"),
    }
    sim.shutdown().await;
}

fn created_at(object: &Value) -> DateTime<Utc> {
    let text = object["metadata"]["creationTimestamp"]
        .as_str()
        .expect("creationTimestamp");
    DateTime::parse_from_rfc3339(text)
        .expect("RFC 3339")
        .with_timezone(&Utc)
}

#[tokio::test]
async fn objects_can_be_created_backdated_in_process_and_over_sim_control() {
    let sim = start().await;
    let month_ago = Utc::now() - TimeDelta::days(32);
    let stored = sim
        .create_backdated(big_secret("stray", "dev", 16), month_ago)
        .expect("created");
    assert_eq!(created_at(&stored).timestamp(), month_ago.timestamp());
    // What clients read is the same instant.
    let client = kube_client(&sim).await;
    let secrets: Api<Secret> = Api::namespaced(client, "ttlab");
    let listed = secrets
        .list_metadata(&ListParams::default())
        .await
        .expect("list");
    let stray = listed
        .items
        .iter()
        .find(|s| s.metadata.name.as_deref() == Some("stray"))
        .expect("listed");
    let ts = stray
        .metadata
        .creation_timestamp
        .as_ref()
        .expect("creationTimestamp");
    assert_eq!(ts.0.as_second(), month_ago.timestamp());

    // The same through /sim/objects, for a standalone sim.
    let h = Http::new(&sim);
    let (code, body) = h
        .post(
            "/sim/objects",
            &json!({"object": big_secret("stray-2", "dev", 16), "creationTimestamp": "2026-01-02T03:04:05Z"}),
        )
        .await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(
        body["metadata"]["creationTimestamp"],
        "2026-01-02T03:04:05Z"
    );
    assert_eq!(
        sim.get("secrets", "ttlab", "stray-2").expect("stored")["metadata"]["creationTimestamp"],
        "2026-01-02T03:04:05Z"
    );
    // Without a time: now. With a bad one, or an object that already exists: refused.
    let (code, body) = h
        .post(
            "/sim/objects",
            &json!({"object": big_secret("fresh", "dev", 16)}),
        )
        .await;
    assert_eq!(code, 201, "{body}");
    assert!((Utc::now() - created_at(&body)).num_seconds().abs() < 60);
    let (code, body) = h
        .post(
            "/sim/objects",
            &json!({"object": big_secret("late", "dev", 16), "creationTimestamp": "last month"}),
        )
        .await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = h
        .post(
            "/sim/objects",
            &json!({"object": big_secret("stray", "dev", 16), "creationTimestamp": "2026-01-02T03:04:05Z"}),
        )
        .await;
    assert_eq!(
        (code, body["reason"].as_str()),
        (409, Some("AlreadyExists"))
    );
    sim.shutdown().await;
}
