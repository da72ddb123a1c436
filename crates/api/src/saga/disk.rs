//! Step ④: what the cluster shows about the golden disk, through the decision table.

use ttlab_cluster::{GoldenFacts, GoldenRef, Lookup};
use ttlab_disk_select as ds;
use ttlab_lesson::{GoldenSource, Lesson, VmDisk};

use crate::sites::SiteRuntime;

/// The root disk decision for `lesson`, and the reason to record. A golden disk that cannot
/// be observed at all (the API did not answer) falls back to the container disk too.
pub(crate) async fn decide(site: &SiteRuntime, lesson: &Lesson) -> (ds::DiskDecision, String) {
    let golden = match &lesson.vm_disk {
        VmDisk::Container => {
            let d = ds::decide(&ds::GoldenObservation::NotRequested);
            let reason = d.reason_str().to_owned();
            return (d, reason);
        }
        VmDisk::Golden(g) => g,
    };
    let reference = match &golden.source {
        GoldenSource::Pvc(name) => GoldenRef::Pvc(name.clone()),
        GoldenSource::DataSource(name) => GoldenRef::DataSource(name.clone()),
    };
    match site.cluster().observe_golden(&reference).await {
        Ok(facts) => {
            let seen = observation(
                &facts,
                site.cluster().namespace(),
                golden.expected_image.as_deref(),
            );
            let d = ds::decide(&seen);
            let reason = d.reason_str().to_owned();
            (d, reason)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot observe the golden disk; using the container disk");
            (
                ds::DiskDecision::ContainerDisk {
                    reason: ds::FallbackReason::NotFound,
                },
                "unobservable".to_owned(),
            )
        }
    }
}

fn observation(
    facts: &GoldenFacts,
    namespace: &str,
    expected_image: Option<&str>,
) -> ds::GoldenObservation {
    if let Some(source) = &facts.data_source {
        let lookup = match source {
            Lookup::Found(f) => ds::Lookup::Found(ds::DataSourceFacts {
                pvc: f.pvc_name.as_ref().map(|name| ds::PvcRef {
                    namespace: f
                        .pvc_namespace
                        .clone()
                        .unwrap_or_else(|| namespace.to_owned()),
                    name: name.clone(),
                }),
            }),
            Lookup::NotFound => ds::Lookup::NotFound,
            Lookup::Forbidden => ds::Lookup::Forbidden,
        };
        if let Err(seen) = ds::resolve_data_source(&lookup, namespace) {
            return seen;
        }
    }
    let Some(pvc) = &facts.pvc else {
        return ds::GoldenObservation::UnresolvedSource;
    };
    let pvc = match pvc {
        Lookup::Found(p) => ds::Lookup::Found(ds::PvcFacts {
            name: p.name.clone(),
            phase: p.phase.clone(),
            access_modes: p.access_modes.clone(),
            being_deleted: p.deleting,
            annotations: p.annotations.clone(),
        }),
        Lookup::NotFound => ds::Lookup::NotFound,
        Lookup::Forbidden => ds::Lookup::Forbidden,
    };
    let dv = match &facts.data_volume {
        Some(Lookup::Found(d)) => ds::Lookup::Found(ds::DataVolumeFacts {
            phase: d.phase.clone(),
            progress: d.progress.clone(),
        }),
        Some(Lookup::Forbidden) => ds::Lookup::Forbidden,
        Some(Lookup::NotFound) | None => ds::Lookup::NotFound,
    };
    ds::observe(&pvc, &dv, expected_image)
}
