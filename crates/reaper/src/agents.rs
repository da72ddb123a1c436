//! Agent versions no VM uses any more: the shared ConfigMaps `ttlab-agent-<digest prefix>` of
//! this reaper's environment (and of no other) that no VirtualMachine in the namespace
//! references (its `ttlab.io/agent` label, read from a metadata-only list of every VM ttlab
//! manages, whatever its environment: a ConfigMap name may serve environments sharing a
//! namespace), older than the minimum age, and that no server has recorded as seen within it.
//!
//! The last checks and the deletion happen under the version's lock in the database
//! (`ttlab_store::AgentVersions::lock_for_removal`), the same lock a server takes to record
//! its version right before each VM create, after which it makes sure of the ConfigMap:
//! either that server recorded first, and the version is kept, or it waits, finds the
//! ConfigMap gone and creates it again. A version a server recorded within [`IN_FLIGHT`] is
//! kept whatever the minimum age (its VM may be being created at this moment), and under the
//! lock the VMs referencing it are listed once more from the API server, so a VM created
//! since the first list keeps it too. Each removal counts in the orphan direction
//! (`ConfigMap/<name>`); a dry run names them and deletes nothing.

use std::collections::BTreeSet;
use std::time::Duration;

use ttlab_cluster::{Deleted, Kind, Propagation};
use ttlab_model::labels;
use ttlab_store::Direction;

use crate::context::ReaperContext;
use crate::error::{cluster_error_kind, store_error_kind};
use crate::report::CycleReport;

/// A version a server recorded as seen within this long is never removed, whatever the
/// minimum age: a server records it right before each VM create, so a VM mounting it may be
/// on its way.
pub(crate) const IN_FLIGHT: Duration = Duration::from_secs(120);

/// Removes the unused agent versions of the environment (see the module docs).
pub(crate) async fn remove_unused(
    ctx: &ReaperContext,
    report: &mut CycleReport,
    now: chrono::DateTime<chrono::Utc>,
) {
    let selector = labels::agent_selector(&ctx.env);
    let config_maps = match ctx.cluster.list_all(Kind::ConfigMap, &selector).await {
        Ok(c) => c,
        Err(e) => {
            report.note(
                Direction::Orphans,
                "agent ConfigMaps".into(),
                format!("list: {}: {e}", cluster_error_kind(&e)),
            );
            return;
        }
    };
    let min_age = ctx.settings.agent_min_age;
    let old_enough = |c: &ttlab_cluster::ObjectSummary| {
        !c.deleting
            && c.created_at
                .is_some_and(|at| (now - at).to_std().is_ok_and(|age| age >= min_age))
    };
    let candidates: Vec<_> = config_maps.into_iter().filter(old_enough).collect();
    if candidates.is_empty() {
        return;
    }
    let vms = match ctx
        .cluster
        .list_all(Kind::VirtualMachine, &labels::managed_selector())
        .await
    {
        Ok(v) => v,
        Err(e) => {
            report.note(
                Direction::Orphans,
                "agent ConfigMaps".into(),
                format!("list the VMs using them: {}: {e}", cluster_error_kind(&e)),
            );
            return;
        }
    };
    let used: BTreeSet<&str> = vms
        .iter()
        .filter_map(|v| v.labels.get(labels::AGENT_CONFIG_MAP).map(String::as_str))
        .collect();
    for config_map in candidates
        .iter()
        .filter(|c| !used.contains(c.name.as_str()))
    {
        if ctx.shutdown.is_cancelled() {
            return;
        }
        let subject = format!("{}/{}", Kind::ConfigMap, config_map.name);
        let guard = match ctx
            .store
            .agent_versions()
            .lock_for_removal(&config_map.name, min_age.max(IN_FLIGHT))
            .await
        {
            Ok(Some(guard)) => guard,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(config_map = %config_map.name, kind = store_error_kind(&e), error = %e, "cannot check an agent version");
                report.failed(Direction::Orphans, subject, format!("check: {e}"));
                continue;
            }
        };
        // Under the lock, from the API server again: a VM created since the first list.
        let referencing = format!("{}={}", labels::AGENT_CONFIG_MAP, config_map.name);
        match ctx
            .cluster
            .list_all(Kind::VirtualMachine, &referencing)
            .await
        {
            Ok(vms) if vms.is_empty() => {}
            Ok(_) => {
                drop(guard);
                continue;
            }
            Err(e) => {
                drop(guard);
                report.failed(
                    Direction::Orphans,
                    subject,
                    format!("list the VMs using it: {}: {e}", cluster_error_kind(&e)),
                );
                continue;
            }
        }
        let what = format!(
            "remove unused agent version (env {}, no VM uses it, not seen by a server for {} s)",
            ctx.env,
            min_age.as_secs()
        );
        if ctx.settings.dry_run {
            drop(guard);
            report.done(Direction::Orphans, subject, what);
            continue;
        }
        match ctx
            .cluster
            .delete(Kind::ConfigMap, &config_map.name, Propagation::Background)
            .await
        {
            Ok(Deleted::Deleted | Deleted::Removed | Deleted::AlreadyGone) => {
                if let Err(e) = guard.forget().await {
                    tracing::warn!(config_map = %config_map.name, error = %e, "deleted an agent version but could not forget it");
                }
                tracing::info!(config_map = %config_map.name, "removed an unused agent version");
                report.done(Direction::Orphans, subject, what);
            }
            Err(e) => {
                drop(guard);
                tracing::warn!(config_map = %config_map.name, kind = cluster_error_kind(&e), error = %e, "cannot delete an unused agent version");
                report.failed(
                    Direction::Orphans,
                    subject,
                    format!("delete: {}: {e}", cluster_error_kind(&e)),
                );
            }
        }
    }
}
