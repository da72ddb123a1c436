//! Feeding an [`ObjectCache`]: kube-rs' runtime `watcher` over metadata-only objects of one
//! kind and selector, started over from a fresh list every nine tenths of the cache's maximum
//! age (so a rebuild completes before the old contents stop being served) and after any
//! failure (after a pause that doubles up to half a minute).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher::{self, Event};
use tokio::time::Instant;
use ttlab_background::Backoff;

use super::watch::WATCH_SECONDS;
use super::{KubeCluster, api_resource, convert};
use crate::Kind;
use crate::cache::{CacheState, Change, FIRST_RESTART_PAUSE, MAX_RESTART_PAUSE, ObjectCache};

/// The pauses before a failed watch starts over.
const RESTART: Backoff = Backoff::doubling(FIRST_RESTART_PAUSE, MAX_RESTART_PAUSE).without_jitter();

impl KubeCluster {
    /// A cache of the objects of `kind` matching the label `selector`, kept by a watch and
    /// rebuilt from a full list at least every `max_age`. Must be called inside a tokio
    /// runtime; the watch runs until the cache is dropped. Its calls are `list` and `watch`
    /// on `kind`, outside the client's concurrency limit (a watch is held open for minutes).
    pub fn object_cache(&self, kind: Kind, selector: &str, max_age: Duration) -> ObjectCache {
        let api: Api<PartialObjectMeta<DynamicObject>> = Api::namespaced_with(
            self.inner.client.clone(),
            &self.inner.namespace,
            &api_resource(kind),
        );
        let mut config = watcher::Config::default().timeout(WATCH_SECONDS);
        if !selector.is_empty() {
            config = config.labels(selector);
        }
        config.page_size = Some(self.inner.settings.page_size.max(1));
        let state = Arc::new(Mutex::new(CacheState::new(max_age)));
        let feeding = Arc::clone(&state);
        let task = tokio::spawn(async move {
            let mut pauses = RESTART.pauses();
            loop {
                let started = Instant::now();
                let failed =
                    follow(kind, &api, &config, &feeding, started + max_age * 9 / 10).await;
                if failed {
                    tokio::time::sleep(pauses.next_pause()).await;
                } else {
                    pauses.reset();
                }
            }
        });
        ObjectCache::new(state, task.abort_handle())
    }
}

/// Follows one watcher from its initial list until `until` (false: time for a rebuild) or its
/// first failure (true).
async fn follow(
    kind: Kind,
    api: &Api<PartialObjectMeta<DynamicObject>>,
    config: &watcher::Config,
    state: &Mutex<CacheState>,
    until: Instant,
) -> bool {
    let stream = watcher::watcher(api.clone(), config.clone());
    futures::pin_mut!(stream);
    loop {
        let next = match tokio::time::timeout_at(until, stream.next()).await {
            Err(_rebuild) => return false,
            Ok(next) => next,
        };
        let change = match next {
            None => Change::Failed,
            Some(Err(e)) => {
                tracing::warn!(%kind, error = %e, "the cached listing's watch failed; starting over from a list");
                Change::Failed
            }
            Some(Ok(Event::Init)) => Change::ListStart,
            Some(Ok(Event::InitApply(o))) => Change::Listed(convert::summary(kind, &o.metadata)),
            Some(Ok(Event::InitDone)) => Change::ListDone,
            Some(Ok(Event::Apply(o))) => Change::Applied(convert::summary(kind, &o.metadata)),
            Some(Ok(Event::Delete(o))) => Change::Deleted(o.metadata.name.unwrap_or_default()),
        };
        let (failed, done) = (change == Change::Failed, change == Change::ListDone);
        let mut state = state.lock().unwrap_or_else(|e| e.into_inner());
        state.apply(change, Instant::now());
        if done {
            tracing::info!(%kind, objects = state.len(), "listing cached; a watch keeps it current");
        }
        if failed {
            return true;
        }
    }
}
