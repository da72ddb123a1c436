//! VMs whose deletion hangs on a finalizer (kube-sim only): a controller of the soak's own
//! that puts a finalizer of its own on a seeded fraction of the VMs as they appear, and
//! releases it only [`Settings::linger_for`] after the VM's deletion began — as a storage or
//! node finalizer holds a real VM whose node is slow or gone. Meanwhile the VM exists (with a
//! `deletionTimestamp`): it must stay counted against capacity, and its session's row must not
//! go final before it is gone. It records, per held VM, when its deletion began and when the
//! finalizer was released, for [`super::checks`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::{Method, Request, header};
use http_body_util::{BodyExt as _, Full};
use serde_json::{Value, json};

use super::Settings;
use super::rig::{NAMESPACE, lock};
use crate::dev::demo::client::{self, HttpClient};

/// The finalizer the soak holds VMs with.
pub(crate) const FINALIZER: &str = "soak.ttlab.dev/linger";
/// How often the VMs are looked at.
const EVERY: Duration = Duration::from_millis(100);

/// One VM the soak held.
#[derive(Debug, Clone, Default)]
pub(crate) struct Held {
    /// When its deletion was first seen (its `deletionTimestamp`).
    pub deleting_since: Option<DateTime<Utc>>,
    /// When the release was sent: the VM cannot have been gone before.
    pub released_at: Option<DateTime<Utc>>,
}

/// The VMs held so far, by name.
pub(crate) type HeldVms = Arc<Mutex<BTreeMap<String, Held>>>;

/// The running controller.
pub(crate) struct Linger {
    pub held: HeldVms,
    task: tokio::task::JoinHandle<()>,
}

impl Linger {
    /// Starts holding VMs of kube-sim at `url` (as its administrator).
    pub(crate) fn start(url: &str, settings: &Settings) -> Self {
        let held = HeldVms::default();
        let task = tokio::spawn(run(
            client::client(4),
            url.to_owned(),
            settings.seed,
            settings.linger_fraction,
            settings.linger_for,
            held.clone(),
        ));
        Self { held, task }
    }

    /// Stops the controller (a VM still held keeps its finalizer).
    pub(crate) fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for Linger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Whether the VM `name` is one of the fraction held (a hash of the name and the seed).
fn chosen(name: &str, seed: u64, fraction: f64) -> bool {
    // FNV-1a.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    ((h >> 11) as f64 / (1u64 << 53) as f64) < fraction
}

async fn run(
    http: HttpClient,
    url: String,
    seed: u64,
    fraction: f64,
    hold: Duration,
    held: HeldVms,
) {
    let list = format!("{url}/apis/kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachines");
    let hold = chrono::TimeDelta::from_std(hold).unwrap_or(chrono::TimeDelta::seconds(4));
    loop {
        tokio::time::sleep(EVERY).await;
        let Ok((status, body)) = client::send(&http, Method::GET, &list, None, None).await else {
            continue;
        };
        if !status.is_success() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(&body) else {
            continue;
        };
        for vm in v["items"].as_array().map(Vec::as_slice).unwrap_or_default() {
            let Some(name) = vm["metadata"]["name"].as_str() else {
                continue;
            };
            if !chosen(name, seed, fraction) {
                continue;
            }
            let fins: Vec<&str> = vm["metadata"]["finalizers"]
                .as_array()
                .map(|f| f.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let ours = fins.iter().position(|f| *f == FINALIZER);
            let deleting = vm["metadata"]["deletionTimestamp"]
                .as_str()
                .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                .map(|t| t.with_timezone(&Utc));
            let rv = vm["metadata"]["resourceVersion"].as_str().unwrap_or("");
            let object = format!("{list}/{name}");
            match (deleting, ours) {
                // A new VM: hold it (once: a VM of that name created again is not held twice).
                (None, None) if !lock(&held).contains_key(name) => {
                    let mut ops = vec![
                        json!({"op": "test", "path": "/metadata/resourceVersion", "value": rv}),
                    ];
                    if vm["metadata"]["finalizers"].is_array() {
                        ops.push(json!({"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}));
                    } else {
                        ops.push(json!({"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}));
                    }
                    if patch(&http, &object, &Value::Array(ops)).await {
                        lock(&held).insert(name.to_owned(), Held::default());
                    }
                }
                (Some(since), Some(i)) => {
                    {
                        let mut h = lock(&held);
                        let entry = h.entry(name.to_owned()).or_default();
                        entry.deleting_since.get_or_insert(since);
                    }
                    if Utc::now() < since + hold {
                        continue;
                    }
                    let ops = json!([
                        {"op": "test", "path": format!("/metadata/finalizers/{i}"), "value": FINALIZER},
                        {"op": "remove", "path": format!("/metadata/finalizers/{i}")},
                    ]);
                    let at = Utc::now();
                    if patch(&http, &object, &ops).await
                        && let Some(entry) = lock(&held).get_mut(name)
                    {
                        entry.released_at = Some(at);
                    }
                }
                _ => {}
            }
        }
    }
}

/// Sends a JSON patch; whether it applied.
async fn patch(http: &HttpClient, url: &str, ops: &Value) -> bool {
    let Ok(body) = serde_json::to_vec(ops) else {
        return false;
    };
    let Ok(req) = Request::builder()
        .method(Method::PATCH)
        .uri(url)
        .header(header::CONTENT_TYPE, "application/json-patch+json")
        .body(Full::new(Bytes::from(body)))
    else {
        return false;
    };
    match http.request(req).await {
        Ok(res) => {
            let ok = res.status().is_success();
            let _ = res.into_body().collect().await;
            ok
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fraction_chosen_is_about_the_fraction_asked_and_stable() {
        let names: Vec<String> = (0..10_000).map(|i| format!("tt-{i:032x}-vm")).collect();
        let n = names.iter().filter(|n| chosen(n, 1, 0.15)).count();
        assert!((1_200..1_800).contains(&n), "{n} of 10000");
        assert!(
            names
                .iter()
                .all(|n| chosen(n, 1, 0.15) == chosen(n, 1, 0.15))
        );
        assert!(!names.iter().any(|n| chosen(n, 1, 0.0)));
        assert!(names.iter().all(|n| chosen(n, 1, 1.0)));
    }
}
