//! What a cycle works with: the store, one site's cluster, the environment, the site and the
//! settings.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use ttlab_cluster::{GoneWitness, Kind, LabelSweep, ObjectCache, ReaperCluster};
use ttlab_model::labels::env_selector;
use ttlab_model::{EnvName, SiteName};
use ttlab_store::Store;

use crate::ReaperError;

/// Default number of items (sessions, orphan groups) handled at once.
pub const DEFAULT_CONCURRENCY: usize = 32;
/// Default minimum age of an object before it may be judged an orphan.
pub const DEFAULT_ORPHAN_MIN_AGE: Duration = Duration::from_secs(120);
/// Default minimum age of an unused agent version (its ConfigMap's age, and the time since a
/// server last recorded it) before the reaper removes it.
pub const DEFAULT_AGENT_MIN_AGE: Duration = Duration::from_secs(60 * 60);
/// Default number of database rows read per page.
pub const DEFAULT_PAGE_SIZE: u32 = 500;
/// Default longest time a watch-fed listing is served before it is rebuilt from a full list
/// (see [`ReaperContext::with_cached_listings`]).
pub const DEFAULT_RELIST_EVERY: Duration = Duration::from_secs(5 * 60);
/// The longest a cycle waits for a watch-fed listing's first list instead of listing itself.
pub const FIRST_FILL_WAIT: Duration = Duration::from_secs(60);
/// The kinds whose listings may come from a watch-fed cache: the two with an object per
/// session (the others are few, and listed every cycle).
pub const CACHED_KINDS: [Kind; 2] = [Kind::VirtualMachine, Kind::Secret];

/// How a cycle behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReaperSettings {
    /// Items handled at once (sessions torn down, orphan groups deleted, ghosts confirmed).
    /// At least 1; default [`DEFAULT_CONCURRENCY`].
    pub concurrency: usize,
    /// Objects younger than this (by their `creationTimestamp`, against the database clock)
    /// are never judged orphans: the server may still be writing their session's row.
    pub orphan_min_age: Duration,
    /// An agent version's ConfigMap no VM uses is removed only once it is this old and no
    /// server has recorded the version as seen for this long. Default
    /// [`DEFAULT_AGENT_MIN_AGE`].
    pub agent_min_age: Duration,
    /// Report what would be deleted and marked, and change nothing.
    pub dry_run: bool,
    /// Database rows read per page.
    pub page_size: u32,
    /// Whether a session's teardown also lists what is still labelled with it. Default
    /// [`LabelSweep::IfNodesUnknown`]: the orphan direction catches any other labelled
    /// leftover, and a teardown stays at two API calls for a single-VM session.
    pub label_sweep: LabelSweep,
}

impl Default for ReaperSettings {
    fn default() -> Self {
        Self {
            concurrency: DEFAULT_CONCURRENCY,
            orphan_min_age: DEFAULT_ORPHAN_MIN_AGE,
            agent_min_age: DEFAULT_AGENT_MIN_AGE,
            dry_run: false,
            page_size: DEFAULT_PAGE_SIZE,
            label_sweep: LabelSweep::IfNodesUnknown,
        }
    }
}

impl ReaperSettings {
    /// Checks the settings are usable.
    pub fn validate(&self) -> Result<(), ReaperError> {
        if self.concurrency == 0 {
            return Err(ReaperError::Setting(
                "TTLAB_REAP_CONCURRENCY must be at least 1".into(),
            ));
        }
        if self.page_size == 0 {
            return Err(ReaperError::Setting(
                "the page size must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Everything [`reap_once`](crate::reap_once) needs. Cheap to clone.
#[derive(Clone)]
pub struct ReaperContext {
    /// The database (the only channel to the server).
    pub store: Store,
    /// The cluster, in the VM namespace: only what the reaper needs of it (objects by name and
    /// label: get, find, list, delete).
    pub cluster: Arc<dyn ReaperCluster>,
    /// This reaper's environment: it touches only sessions and objects of this environment.
    pub env: EnvName,
    /// The site `cluster` is: the cycle reads only this site's sessions (expired, stuck,
    /// finishing, the live ones that judge ghosts and orphans) and only this site's cluster.
    /// `default` unless [`ReaperContext::with_site`] says otherwise.
    pub site: SiteName,
    /// Every site the reaper is configured with: a full cycle reports the live sessions of any
    /// other site (a site no longer configured), which no cycle touches. `[default]` unless
    /// [`ReaperContext::with_site`] says otherwise.
    pub known_sites: Arc<[SiteName]>,
    /// How a cycle behaves.
    pub settings: ReaperSettings,
    /// Cancelled on shutdown: a cycle then starts no new item, finishes those in flight
    /// (never leaving a half-marked row) and returns.
    pub shutdown: CancellationToken,
    /// Watch-fed listings of [`CACHED_KINDS`], when [`ReaperContext::with_cached_listings`]
    /// made them: a cycle reads a kind from its cache while the cache is trustworthy and
    /// lists the cluster otherwise.
    pub listings: Option<Arc<BTreeMap<Kind, ObjectCache>>>,
}

impl std::fmt::Debug for ReaperContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReaperContext")
            .field("store", &self.store)
            .field("namespace", &self.cluster.namespace())
            .field("env", &self.env)
            .field("site", &self.site)
            .field("settings", &self.settings)
            .field("cached_listings", &self.listings.is_some())
            .finish()
    }
}

impl ReaperContext {
    /// A context with default settings and a fresh shutdown token, on the one site `default`
    /// (a deployment without a sites file).
    pub fn new(store: Store, cluster: Arc<dyn ReaperCluster>, env: EnvName) -> Self {
        let site = ttlab_site::default_site_name();
        Self {
            store,
            cluster,
            env,
            known_sites: Arc::from(vec![site.clone()]),
            site,
            settings: ReaperSettings::default(),
            shutdown: CancellationToken::new(),
            listings: None,
        }
    }

    /// The same context reading the environment's VMs and Secrets from watch-fed listings,
    /// each rebuilt from a full list at least every `max_age` (for a long-running reaper: the
    /// no-op cycle then lists only the few other kinds, instead of every object of the
    /// environment). Unchanged when the cluster offers no such listing. Call inside a tokio
    /// runtime; the watches stop when the last clone of the context is dropped.
    pub fn with_cached_listings(mut self, max_age: Duration) -> Self {
        let selector = env_selector(&self.env);
        let caches: BTreeMap<Kind, ObjectCache> = CACHED_KINDS
            .into_iter()
            .filter_map(|kind| {
                self.cluster
                    .cached_listing(kind, &selector, max_age)
                    .map(|c| (kind, c))
            })
            .collect();
        self.listings = (!caches.is_empty()).then(|| Arc::new(caches));
        self
    }

    /// Whether this context has watch-fed listings and every one is trustworthy now (filled,
    /// no failure since, not older than its maximum age).
    pub fn cached_listings_ready(&self) -> bool {
        self.listings
            .as_ref()
            .is_some_and(|l| l.values().all(|c| c.snapshot().is_some()))
    }

    /// `kind`'s objects from its cache, if it has one and it is trustworthy now. While its
    /// first list is still in progress (the reaper just started), waits for it, at most
    /// [`FIRST_FILL_WAIT`]: listing beside it would hold two full listings in memory at once
    /// for no gain.
    pub(crate) async fn cached(&self, kind: Kind) -> Option<ttlab_cluster::Snapshot> {
        let cache = self.listings.as_ref()?.get(&kind)?;
        match cache.snapshot() {
            Some(objects) => Some(objects),
            None => cache.first_fill(FIRST_FILL_WAIT).await,
        }
    }

    /// The witness of deletions its watch-fed listings offer, if it has them.
    pub(crate) fn witness(&self) -> Option<&dyn GoneWitness> {
        self.listings.is_some().then_some(self as &dyn GoneWitness)
    }

    /// The same context on `site` (its cluster must be that site's), of a reaper configured
    /// with the sites `known` (`site` is counted among them even if missing).
    pub fn with_site(mut self, site: SiteName, known: &[SiteName]) -> Self {
        let mut all: Vec<SiteName> = known.to_vec();
        if !all.contains(&site) {
            all.push(site.clone());
        }
        self.known_sites = Arc::from(all);
        self.site = site;
        self
    }

    /// The same context with other settings.
    pub fn with_settings(mut self, settings: ReaperSettings) -> Self {
        self.settings = settings;
        self
    }
}

impl GoneWitness for ReaperContext {
    fn saw_gone(&self, kind: Kind, name: &str, since: std::time::Instant) -> bool {
        self.listings
            .as_ref()
            .and_then(|l| l.get(&kind))
            .is_some_and(|c| c.saw_deleted_since(name, since))
    }
}
