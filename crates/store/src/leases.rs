//! The `leases` table: who may act on what, until when (on the database clock).
//!
//! A lease names a kind ([`LeaseKind`]), a key (the environment, the session id) and a holder
//! (one acquisition by one process: [`LeaseHolder`]). [`Leases::acquire`] takes it if it is
//! free or expired, [`Leases::renew`] extends it (only by its holder, only before it expired),
//! [`Leases::release`] gives it up (only by its holder) — each one conditional statement that
//! says whether it applied. [`HeldLease`] renews a lease on a heartbeat and tells its holder,
//! from the local monotonic clock alone, whether it may still act: a holder whose renewals do
//! not get through stops acting before the lease expires on the database, and anyone may take
//! it from then on, whatever the holder's sockets do.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::{Store, StoreError};

/// What a lease is for.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    strum::Display,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumCount,
)]
#[strum(
    serialize_all = "kebab-case",
    parse_err_ty = String,
    parse_err_fn = unknown_lease_kind
)]
pub enum LeaseKind {
    /// Being the acting reaper of an environment (key: the environment).
    ReaperLeader,
    /// Provisioning one session (key: the session id).
    Provisioning,
}

impl LeaseKind {
    /// Every kind.
    pub const ALL: [Self; <LeaseKind as strum::EnumCount>::COUNT] =
        [Self::ReaperLeader, Self::Provisioning];

    /// The stored name: `reaper-leader` or `provisioning`.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

fn unknown_lease_kind(s: &str) -> String {
    format!("unknown lease kind {s:?}")
}

/// One acquisition by one process: `<process>/<acquisition>`, both random, so two
/// acquisitions by the same process never pass for each other.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LeaseHolder(String);

impl LeaseHolder {
    /// A fresh holder of this process.
    pub fn fresh() -> Self {
        Self(format!(
            "{}/{}",
            process_id(),
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// The stored text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for LeaseHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// This process, as holders name it: the host name (when the OS says) and the pid.
fn process_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default();
    if host.is_empty() {
        format!("pid{}", std::process::id())
    } else {
        format!("{host}:{}", std::process::id())
    }
}

/// A lease row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// What it is for.
    pub kind: LeaseKind,
    /// Which one.
    pub key: String,
    /// Who holds it.
    pub holder: String,
    /// When it ends unless renewed (database clock).
    pub expires_at: DateTime<Utc>,
}

impl Lease {
    fn from_row(row: &tokio_postgres::Row) -> Result<Self, StoreError> {
        let kind: String = row
            .try_get("kind")
            .map_err(StoreError::query("reading a lease"))?;
        Ok(Self {
            kind: kind
                .parse()
                .map_err(|_| StoreError::corrupt("leases.kind", &kind))?,
            key: row
                .try_get("key")
                .map_err(StoreError::query("reading a lease"))?,
            holder: row
                .try_get("holder")
                .map_err(StoreError::query("reading a lease"))?,
            expires_at: row
                .try_get("expires_at")
                .map_err(StoreError::query("reading a lease"))?,
        })
    }
}

/// Queries on the `leases` table.
#[derive(Debug, Clone, Copy)]
pub struct Leases<'a> {
    store: &'a Store,
}

/// The lease's duration in milliseconds, as the statements multiply `interval '1 ms'` by it.
fn ttl_millis(ttl: Duration) -> Result<f64, StoreError> {
    if ttl < Duration::from_millis(10) {
        return Err(StoreError::InvalidArgument(
            "a lease must last at least 10 ms",
        ));
    }
    if ttl > Duration::from_secs(24 * 60 * 60) {
        return Err(StoreError::InvalidArgument(
            "a lease must last at most a day",
        ));
    }
    Ok(ttl.as_secs_f64() * 1000.0)
}

impl<'a> Leases<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    /// Takes the lease `(kind, key)` for `holder` for `ttl` if it is free, expired or already
    /// `holder`'s. `None`: someone else holds it.
    pub async fn acquire(
        &self,
        kind: LeaseKind,
        key: &str,
        holder: &LeaseHolder,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        const WHAT: &str = "taking a lease";
        let ms = ttl_millis(ttl)?;
        let (client, statement) = self
            .store
            .lease_prepared(
                WHAT,
                "INSERT INTO leases (kind, key, holder, acquired_at, renewed_at, expires_at) \
                 VALUES ($1, $2, $3, now(), now(), now() + $4 * interval '1 millisecond') \
                 ON CONFLICT (kind, key) DO UPDATE SET holder = EXCLUDED.holder, \
                 acquired_at = now(), renewed_at = now(), expires_at = EXCLUDED.expires_at \
                 WHERE leases.expires_at <= now() OR leases.holder = EXCLUDED.holder \
                 RETURNING kind, key, holder, expires_at",
            )
            .await?;
        let row = client
            .query_opt(&statement, &[&kind.as_str(), &key, &holder.as_str(), &ms])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(Lease::from_row).transpose()
    }

    /// Extends `holder`'s lease to `ttl` from now. `None`: it is no longer `holder`'s (it
    /// expired, or was taken over or released).
    pub async fn renew(
        &self,
        kind: LeaseKind,
        key: &str,
        holder: &LeaseHolder,
        ttl: Duration,
    ) -> Result<Option<Lease>, StoreError> {
        const WHAT: &str = "renewing a lease";
        let ms = ttl_millis(ttl)?;
        let (client, statement) = self
            .store
            .lease_prepared(
                WHAT,
                "UPDATE leases SET renewed_at = now(), \
                 expires_at = now() + $4 * interval '1 millisecond' \
                 WHERE kind = $1 AND key = $2 AND holder = $3 AND expires_at > now() \
                 RETURNING kind, key, holder, expires_at",
            )
            .await?;
        let row = client
            .query_opt(&statement, &[&kind.as_str(), &key, &holder.as_str(), &ms])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(Lease::from_row).transpose()
    }

    /// Gives up `holder`'s lease; `false` if it was not `holder`'s.
    pub async fn release(
        &self,
        kind: LeaseKind,
        key: &str,
        holder: &LeaseHolder,
    ) -> Result<bool, StoreError> {
        const WHAT: &str = "releasing a lease";
        let (client, statement) = self
            .store
            .lease_prepared(
                WHAT,
                "DELETE FROM leases WHERE kind = $1 AND key = $2 AND holder = $3",
            )
            .await?;
        let n = client
            .execute(&statement, &[&kind.as_str(), &key, &holder.as_str()])
            .await
            .map_err(StoreError::query(WHAT))?;
        Ok(n > 0)
    }

    /// The lease `(kind, key)` if someone holds it now (not expired).
    pub async fn current(&self, kind: LeaseKind, key: &str) -> Result<Option<Lease>, StoreError> {
        const WHAT: &str = "reading a lease";
        let (client, statement) = self
            .store
            .prepared(
                WHAT,
                "SELECT kind, key, holder, expires_at FROM leases \
                 WHERE kind = $1 AND key = $2 AND expires_at > now()",
            )
            .await?;
        let row = client
            .query_opt(&statement, &[&kind.as_str(), &key])
            .await
            .map_err(StoreError::query(WHAT))?;
        row.as_ref().map(Lease::from_row).transpose()
    }

    /// The `starting` sessions of `env` nobody holds the provisioning lease of (their
    /// provisioner stopped, or was cut off for longer than its lease), oldest first: the
    /// sessions a live server may adopt.
    pub async fn unleased_starting(
        &self,
        env: &ttlab_model::EnvName,
        limit: u32,
    ) -> Result<Vec<ttlab_model::SessionId>, StoreError> {
        const WHAT: &str = "listing sessions nobody provisions";
        let (client, statement) = self
            .store
            .prepared(
                WHAT,
                "SELECT s.id FROM sessions s WHERE s.env = $1 AND s.status = 'starting'                  AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.kind = $2                  AND l.key = s.id::text AND l.expires_at > now())                  ORDER BY s.created_at, s.id LIMIT $3",
            )
            .await?;
        let rows = client
            .query(
                &statement,
                &[
                    &env.as_str(),
                    &LeaseKind::Provisioning.as_str(),
                    &i64::from(limit.max(1)),
                ],
            )
            .await
            .map_err(StoreError::query(WHAT))?;
        rows.iter()
            .map(|r| {
                r.try_get::<_, uuid::Uuid>(0)
                    .map(ttlab_model::SessionId::from_uuid)
                    .map_err(StoreError::query(WHAT))
            })
            .collect()
    }

    /// Takes the lease and keeps it renewed on a heartbeat until the returned value is
    /// dropped or released. `None`: someone else holds it.
    pub async fn hold(
        &self,
        kind: LeaseKind,
        key: &str,
        ttl: Duration,
    ) -> Result<Option<HeldLease>, StoreError> {
        let holder = LeaseHolder::fresh();
        let sent = Instant::now();
        let Some(_) = self.acquire(kind, key, &holder, ttl).await? else {
            return Ok(None);
        };
        Ok(Some(HeldLease::start(
            self.store.clone(),
            kind,
            key.to_owned(),
            holder,
            ttl,
            sent,
        )))
    }
}

impl Store {
    /// Queries on the `leases` table.
    pub fn leases(&self) -> Leases<'_> {
        Leases::new(self)
    }
}

/// What a held lease's heartbeat shares with its holder.
#[derive(Debug)]
struct Shared {
    /// Until when (local monotonic clock) the holder may act: the send time of the last
    /// renewal that got through, plus nine tenths of the lease.
    valid_until: watch::Sender<Instant>,
    /// Set once the lease is known lost (a renewal refused, or `valid_until` passed).
    lost: AtomicBool,
    lost_notify: Notify,
}

impl Shared {
    fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.lost_notify.notify_waiters();
    }
}

/// A lease this process holds, renewed on a heartbeat (every third of its duration, each
/// renewal bounded by that third). See the module doc.
#[derive(Debug)]
pub struct HeldLease {
    store: Store,
    kind: LeaseKind,
    key: String,
    holder: LeaseHolder,
    shared: Arc<Shared>,
    heartbeat: Option<tokio::task::JoinHandle<()>>,
}

/// The share of a lease a holder acts within: a renewal sent at `t` makes the holder act
/// until `t + 0.9 × ttl`, while the database keeps it until at least `t + ttl`.
fn acting_window(ttl: Duration) -> Duration {
    ttl.mul_f64(0.9)
}

impl HeldLease {
    fn start(
        store: Store,
        kind: LeaseKind,
        key: String,
        holder: LeaseHolder,
        ttl: Duration,
        sent: Instant,
    ) -> Self {
        let (valid_until, _) = watch::channel(sent + acting_window(ttl));
        let shared = Arc::new(Shared {
            valid_until,
            lost: AtomicBool::new(false),
            lost_notify: Notify::new(),
        });
        let heartbeat = tokio::spawn(heartbeat(
            store.clone(),
            kind,
            key.clone(),
            holder.clone(),
            ttl,
            shared.clone(),
        ));
        Self {
            store,
            kind,
            key,
            holder,
            shared,
            heartbeat: Some(heartbeat),
        }
    }

    /// What the lease is for.
    pub fn kind(&self) -> LeaseKind {
        self.kind
    }

    /// Which one.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// Who holds it.
    pub fn holder(&self) -> &LeaseHolder {
        &self.holder
    }

    /// Whether the holder may still act: the last renewal that got through is recent enough
    /// and none was refused. Reads only the local clock.
    pub fn is_held(&self) -> bool {
        !self.shared.lost.load(Ordering::SeqCst)
            && Instant::now() < *self.shared.valid_until.borrow()
    }

    /// Resolves once the lease is lost (at once if it already is).
    pub async fn lost(&self) {
        loop {
            let notified = self.shared.lost_notify.notified();
            if !self.is_held() {
                return;
            }
            let until = *self.shared.valid_until.borrow();
            tokio::select! {
                () = notified => {}
                () = tokio::time::sleep_until(until) => {}
            }
        }
    }

    /// Stops the heartbeat and gives the lease up now.
    pub async fn release(mut self) -> Result<bool, StoreError> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        self.shared.mark_lost();
        let released = tokio::time::timeout(
            self.store.url().timeouts().call,
            self.store
                .leases()
                .release(self.kind, &self.key, &self.holder),
        )
        .await
        .map_err(|_| StoreError::Timeout {
            what: "releasing a lease",
            elapsed: self.store.url().timeouts().call,
        })??;
        Ok(released)
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        let Some(h) = self.heartbeat.take() else {
            return;
        };
        h.abort();
        self.shared.mark_lost();
        // Released in the background, so the next holder need not wait for the expiry.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, kind, key, holder) = (
                self.store.clone(),
                self.kind,
                self.key.clone(),
                self.holder.clone(),
            );
            let within = store.url().timeouts().call;
            rt.spawn(async move {
                let _ =
                    tokio::time::timeout(within, store.leases().release(kind, &key, &holder)).await;
            });
        }
    }
}

async fn heartbeat(
    store: Store,
    kind: LeaseKind,
    key: String,
    holder: LeaseHolder,
    ttl: Duration,
    shared: Arc<Shared>,
) {
    let beat = ttl / 3;
    loop {
        tokio::time::sleep(beat).await;
        if Instant::now() >= *shared.valid_until.borrow() {
            tracing::warn!(kind = kind.as_str(), key, "lease not renewed in time; lost");
            shared.mark_lost();
            return;
        }
        let sent = Instant::now();
        match tokio::time::timeout(beat, store.leases().renew(kind, &key, &holder, ttl)).await {
            Ok(Ok(Some(_))) => {
                shared.valid_until.send_replace(sent + acting_window(ttl));
            }
            Ok(Ok(None)) => {
                tracing::warn!(
                    kind = kind.as_str(),
                    key,
                    "lease taken over or expired; lost"
                );
                shared.mark_lost();
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(kind = kind.as_str(), key, error = %e, "cannot renew the lease");
            }
            Err(_) => {
                tracing::warn!(kind = kind.as_str(), key, "renewing the lease timed out");
            }
        }
    }
}
