//! The report of one cycle: counts and failures per direction, what was done (or, in a dry
//! run, would be done) item by item.

use std::time::Duration;

use chrono::{DateTime, Utc};
use ttlab_model::{EnvName, SiteName};
use ttlab_store::{
    CollectRequestId, CycleError, CycleTrigger, Direction, DirectionCount, NewCycle,
};

/// One thing a cycle did or, in a dry run, would do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    /// The direction.
    pub direction: Direction,
    /// A session id, or `Kind/name` of an object.
    pub subject: String,
    /// What (`expire: VirtualMachine/tt-…, Secret/tt-…-ci`, `delete orphan`, `mark ghost`).
    pub what: String,
}

/// An object whose deletion was accepted but that was still there when looked for again (a
/// VM whose guest is shutting down, an object held by a finalizer). Its session stays
/// `finishing`, and the object is deleted and looked for again on every cycle until it is gone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminatingObject {
    /// The session it belongs to.
    pub session: String,
    /// Its kind.
    pub kind: ttlab_cluster::Kind,
    /// Its name.
    pub name: String,
}

/// What one cycle did. Counts are per item: a session reclaimed, an orphan object deleted, a
/// ghost marked. In a dry run, `done` counts what would have been done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CycleReport {
    /// The reaper's environment.
    pub env: EnvName,
    /// The site the cycle ran on.
    pub site: SiteName,
    /// Live sessions of the environment on sites the reaper is not configured with, by site
    /// (a full cycle reads them; a deadline cycle does not). They are left alone, never
    /// marked final, until their site is configured again; each is also in `errors` as a
    /// note (not counted as a failure).
    pub unknown_sites: Vec<(SiteName, u64)>,
    /// When the cycle started (database clock; the reaper's own clock if the database could
    /// not be read at all).
    pub started_at: DateTime<Utc>,
    /// How long it took.
    pub duration: Duration,
    /// Whether it only reported.
    pub dry_run: bool,
    /// Expired sessions.
    pub expired: DirectionCount,
    /// Orphan objects.
    pub orphans: DirectionCount,
    /// Ghost sessions.
    pub ghosts: DirectionCount,
    /// Stuck starting sessions and finishing sessions retried.
    pub stuck: DirectionCount,
    /// Every failure of the cycle, in order.
    pub errors: Vec<CycleError>,
    /// What was done (or, in a dry run, would be done), in order.
    pub actions: Vec<Action>,
    /// Objects still terminating after their deletion was accepted, in order; each is also in
    /// `errors` as a note (not counted as a failure), so the recorded report names it.
    pub terminating: Vec<TerminatingObject>,
    /// Whether the cluster could be listed (orphans and ghosts need it).
    pub cluster_listed: bool,
    /// Whether only the database-driven directions ran ([`crate::reap_sessions`]: a deadline
    /// came due), so the cluster was not meant to be listed.
    pub sessions_only: bool,
    /// Why the cycle could not run at all (the database could not be read), if so.
    pub fatal: Option<String>,
}

impl CycleReport {
    pub(crate) fn new(
        env: EnvName,
        site: SiteName,
        started_at: DateTime<Utc>,
        dry_run: bool,
    ) -> Self {
        Self {
            env,
            site,
            unknown_sites: Vec::new(),
            started_at,
            duration: Duration::ZERO,
            dry_run,
            expired: DirectionCount::default(),
            orphans: DirectionCount::default(),
            ghosts: DirectionCount::default(),
            stuck: DirectionCount::default(),
            errors: Vec::new(),
            actions: Vec::new(),
            terminating: Vec::new(),
            cluster_listed: false,
            sessions_only: false,
            fatal: None,
        }
    }

    /// Whether the cycle ran (per-item failures included); false when it could not start.
    pub fn ran(&self) -> bool {
        self.fatal.is_none()
    }

    /// The counts of one direction.
    pub fn count(&self, direction: Direction) -> DirectionCount {
        match direction {
            Direction::Expired => self.expired,
            Direction::Orphans => self.orphans,
            Direction::Ghosts => self.ghosts,
            Direction::Stuck => self.stuck,
        }
    }

    pub(crate) fn count_mut(&mut self, direction: Direction) -> &mut DirectionCount {
        match direction {
            Direction::Expired => &mut self.expired,
            Direction::Orphans => &mut self.orphans,
            Direction::Ghosts => &mut self.ghosts,
            Direction::Stuck => &mut self.stuck,
        }
    }

    /// Items that failed, all directions together.
    pub fn failures(&self) -> u32 {
        self.expired.failed + self.orphans.failed + self.ghosts.failed + self.stuck.failed
    }

    pub(crate) fn done(&mut self, direction: Direction, subject: String, what: String) {
        self.count_mut(direction).done += 1;
        self.actions.push(Action {
            direction,
            subject,
            what,
        });
    }

    pub(crate) fn failed(&mut self, direction: Direction, subject: String, message: String) {
        self.count_mut(direction).failed += 1;
        self.errors.push(CycleError {
            direction,
            subject,
            message,
        });
    }

    /// A failure that is not one item's (a list that failed): kept in the errors, not counted.
    pub(crate) fn note(&mut self, direction: Direction, subject: String, message: String) {
        self.errors.push(CycleError {
            direction,
            subject,
            message,
        });
    }

    /// An object of `session` still terminating: kept, and noted in the errors (not counted).
    pub(crate) fn still_terminating(
        &mut self,
        direction: Direction,
        session: String,
        kind: ttlab_cluster::Kind,
        name: String,
    ) {
        self.note(
            direction,
            format!("{kind}/{name}"),
            format!(
                "still terminating after its deletion was accepted (session {session} stays \
                 finishing; deleted and looked for again next cycle)"
            ),
        );
        self.terminating.push(TerminatingObject {
            session,
            kind,
            name,
        });
    }

    /// The row to record in `reaper_cycles`.
    pub fn to_new_cycle(
        &self,
        trigger: CycleTrigger,
        collect_request: Option<CollectRequestId>,
    ) -> NewCycle {
        NewCycle {
            env: self.env.clone(),
            started_at: self.started_at,
            duration: self.duration,
            trigger,
            dry_run: self.dry_run,
            expired: self.expired,
            orphans: self.orphans,
            ghosts: self.ghosts,
            stuck: self.stuck,
            errors: self.errors.clone(),
            collect_request,
        }
    }

    /// Every item of the cycle by name, direction by direction: each session reclaimed (id,
    /// lesson, why, its objects), each orphan object (`Kind/name`, environment, session), each
    /// ghost (id, lesson, what is gone), then each failure. In a dry run, what would be done.
    /// Several lines, each ending with a newline; a direction with nothing says `none`.
    pub fn details(&self) -> String {
        let mut out = String::new();
        let verb = if self.dry_run {
            "would reclaim"
        } else {
            "reclaimed"
        };
        let sections = [
            (Direction::Expired, format!("expired sessions ({verb})")),
            (
                Direction::Stuck,
                format!("stuck starting and finishing sessions ({verb})"),
            ),
            (
                Direction::Orphans,
                format!(
                    "orphan objects ({})",
                    if self.dry_run {
                        "would delete"
                    } else {
                        "deleted"
                    }
                ),
            ),
            (
                Direction::Ghosts,
                format!(
                    "ghost sessions ({})",
                    if self.dry_run { "would mark" } else { "marked" }
                ),
            ),
        ];
        for (direction, title) in sections {
            let items: Vec<&Action> = self
                .actions
                .iter()
                .filter(|a| a.direction == direction)
                .collect();
            if items.is_empty() {
                out.push_str(&format!("{title}: none\n"));
                continue;
            }
            out.push_str(&format!("{title}: {}\n", items.len()));
            for a in items {
                out.push_str(&format!("  {}  {}\n", a.subject, a.what));
            }
        }
        if !self.terminating.is_empty() {
            out.push_str(&format!(
                "objects still terminating: {}\n",
                self.terminating.len()
            ));
            for t in &self.terminating {
                out.push_str(&format!("  {}/{}  session {}\n", t.kind, t.name, t.session));
            }
        }
        for (site, n) in &self.unknown_sites {
            out.push_str(&format!(
                "live sessions on site {site}, which is not configured: {n} (left alone)\n"
            ));
        }
        if self.errors.is_empty() {
            out.push_str("failures: none\n");
        } else {
            out.push_str(&format!("failures: {}\n", self.errors.len()));
            for e in &self.errors {
                out.push_str(&format!(
                    "  {:?} {}: {}\n",
                    e.direction, e.subject, e.message
                ));
            }
        }
        if let Some(why) = &self.fatal {
            out.push_str(&format!("the cycle could not run: {why}\n"));
        }
        out
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        format!(
            "{}cycle in {} ms: expired {}/{} failed, stuck {}/{} failed, orphans {}/{} failed, ghosts {}/{} failed{}{}{}",
            if self.dry_run { "dry-run " } else { "" },
            self.duration.as_millis(),
            self.expired.done,
            self.expired.failed,
            self.stuck.done,
            self.stuck.failed,
            self.orphans.done,
            self.orphans.failed,
            self.ghosts.done,
            self.ghosts.failed,
            match self.terminating.len() {
                0 => String::new(),
                n => format!(", {n} objects still terminating"),
            },
            match self.unknown_sites.iter().map(|(_, n)| n).sum::<u64>() {
                0 => String::new(),
                n => format!(", {n} live sessions on sites not configured"),
            },
            if self.sessions_only {
                " (sessions only)"
            } else if self.cluster_listed {
                ""
            } else {
                " (cluster not listed)"
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn details_name_every_item_of_every_direction() {
        let env: EnvName = "dev".parse().unwrap();
        let mut report = CycleReport::new(
            env,
            ttlab_site::default_site_name(),
            chrono::Utc::now(),
            true,
        );
        report.done(
            Direction::Expired,
            "0d3c0000-0000-4000-8000-000000000001".into(),
            "lesson quick, expired at 2026-01-01T10:00:00Z: would delete VirtualMachine/tt-a-vm"
                .into(),
        );
        report.done(
            Direction::Orphans,
            "Secret/tt-b-vm-ci".into(),
            "env dev, session b not live: would delete orphan".into(),
        );
        report.failed(
            Direction::Ghosts,
            "0d3c0000-0000-4000-8000-000000000002".into(),
            "get VirtualMachine/tt-c-vm: transient".into(),
        );
        let text = report.details();
        assert!(text.contains("expired sessions (would reclaim): 1\n  0d3c0000-0000-4000-8000-000000000001  lesson quick, expired at 2026-01-01T10:00:00Z: would delete VirtualMachine/tt-a-vm\n"), "{text}");
        assert!(
            text.contains("stuck starting and finishing sessions (would reclaim): none\n"),
            "{text}"
        );
        assert!(text.contains("orphan objects (would delete): 1\n  Secret/tt-b-vm-ci  env dev, session b not live: would delete orphan\n"), "{text}");
        assert!(
            text.contains("ghost sessions (would mark): none\n"),
            "{text}"
        );
        assert!(text.contains("failures: 1\n  Ghosts 0d3c0000-0000-4000-8000-000000000002: get VirtualMachine/tt-c-vm: transient\n"), "{text}");
    }
}
