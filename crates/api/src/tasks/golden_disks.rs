//! `golden_disks` (run by a server of several sites): every [`GOLDEN_DISKS_INTERVAL`], whether the golden
//! disk of each lesson that boots from one is ready on each site that answers and may run it
//! (it carries the lesson's site labels), within [`GOLDEN_DISKS_TIMEOUT`] per site; recorded
//! on the site, so that placement prefers a site where a start's golden disk is ready without
//! asking the sites at each start, and shown per site in the admin's capacity view. With one
//! site there is nothing to choose: the task does not run, and a start observes its golden
//! disk as it provisions, as it always has.

use std::time::Duration;

use ttlab_background::{Activation, BackgroundTask, Failure, Schedule, TaskName, TaskSpec};
use ttlab_disk_select::DiskDecision;
use ttlab_lesson::{Lesson, VmDisk};

use crate::AppState;
use crate::sites::SiteRuntime;

/// How often the golden disks are observed.
pub const GOLDEN_DISKS_INTERVAL: Duration = Duration::from_secs(30);
/// How long the observation of one site may take; the lessons not observed in time keep
/// what was last seen.
pub const GOLDEN_DISKS_TIMEOUT: Duration = Duration::from_secs(10);

/// The task's name.
pub const NAME: TaskName = TaskName::new("golden_disks");

pub(super) fn spec() -> TaskSpec {
    TaskSpec::new(
        NAME,
        "Observes every 30 s on which sites each lesson's golden disk is \
         ready, for placement and the capacity view",
        Schedule::every(GOLDEN_DISKS_INTERVAL),
    )
}

pub(super) struct GoldenDisks {
    pub(super) state: AppState,
}

impl BackgroundTask for GoldenDisks {
    async fn activate(&mut self, _cx: &Activation) -> Result<(), Failure> {
        let state = &self.state;
        let golden: Vec<&Lesson> = state
            .config()
            .lessons
            .iter()
            .filter(|l| matches!(l.vm_disk, VmDisk::Golden(_)))
            .collect();
        if golden.is_empty() {
            return Ok(());
        }
        let observed = state.sites().iter().map(|site| observe(site, &golden));
        let late: Vec<String> = futures::future::join_all(observed)
            .await
            .into_iter()
            .flatten()
            .collect();
        if late.is_empty() {
            Ok(())
        } else {
            Err(Failure::new(format!(
                "the golden disks were not observed within {} s on {}",
                GOLDEN_DISKS_TIMEOUT.as_secs(),
                late.join(", ")
            )))
        }
    }
}

/// Observes on `site` the golden disks of the `lessons` it may run and records them; the
/// site's name when it did not answer in time. A site that does not answer is skipped (it
/// takes no start anyway) and keeps what was last seen.
async fn observe(site: &SiteRuntime, lessons: &[&Lesson]) -> Option<String> {
    if site.reachability() != ttlab_site::Reachability::Reachable {
        return None;
    }
    let all = async {
        for lesson in lessons
            .iter()
            .filter(|l| l.site_labels.is_subset(&site.site().labels))
        {
            let (decision, _) = crate::saga::disk::decide(site, lesson).await;
            site.record_golden(&lesson.id, matches!(decision, DiskDecision::Golden { .. }));
        }
    };
    match tokio::time::timeout(GOLDEN_DISKS_TIMEOUT, all).await {
        Ok(()) => None,
        Err(_) => Some(site.name().to_string()),
    }
}
