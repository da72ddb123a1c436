//! Scheduled classes on the server: who is a class's student, what the refiller gives the
//! planner about classes, and how many of a class's seats the capacity allows warm.
//!
//! **A class's students.** A student starting a lesson during a class's window (or in the
//! [`JOIN_EARLY`] before it) is that class's student when they give its join code
//! (`POST /api/sessions` with `class_code`), or, for a class without a code, simply by
//! starting its lesson then. A wrong code is refused with one sentence that says nothing about
//! which classes exist ("no class with this code is open now"). Codes are compared in
//! constant time (HMAC tags of both, checked by `verify_slice`), never looked up by value.
//!
//! **The planner's inputs.** In each round of a pool, under the capacity lock, the refiller
//! reads the environment's current classes, their members and students, and each of their
//! lessons' lead time (the 90th percentile of the lesson's recent members' preparation,
//! [`LeadTime::from_prepare_times`]); the classes in their lead-in or running share the
//! headroom by seats ([`share_headroom`]), and the pool's plan gets its own classes and that
//! sharing.

use std::collections::BTreeMap;
use std::num::NonZeroU32;

use chrono::{DateTime, TimeDelta, Utc};
use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;
use ttlab_lesson::Lesson;
use ttlab_model::{ClassId, LessonId, Runtime};
use ttlab_pool::{Class, ClassAsk, LeadTime, Sharing, class_headroom, share_headroom};
use ttlab_store::ClassCounts;

use crate::{ApiError, AppState};

/// How long before a class's start its students are already its students (they arrive early).
pub(crate) const JOIN_EARLY: TimeDelta = TimeDelta::minutes(15);

/// The sentence for a join code that opens no class now.
pub(crate) const NO_SUCH_CODE: &str = "no class with this code is open now";

/// A join code as stored and compared: trimmed and upper-case.
pub(crate) fn normalize_code(code: &str) -> String {
    code.trim().to_uppercase()
}

/// Whether `given` and `stored` are the same code, in time that does not depend on where they
/// differ (or on their lengths): both are reduced to HMAC tags, compared in constant time.
fn same_code(given: &str, stored: &str) -> bool {
    const KEY: &[u8] = b"ttlab class join code";
    let tag = |code: &str| {
        // HMAC takes a key of any length: this never fails.
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(KEY).ok()?;
        mac.update(code.as_bytes());
        Some(mac)
    };
    match (tag(given), tag(stored)) {
        (Some(given), Some(stored)) => given.verify_slice(&stored.finalize().into_bytes()).is_ok(),
        _ => false,
    }
}

/// The class a student starting `lesson` now belongs to: the open class whose join code they
/// gave, or without a code an open class of the lesson that has none. A code that matches no
/// open class of the lesson is a 422 ([`NO_SUCH_CODE`]).
pub(crate) async fn student_class(
    state: &AppState,
    lesson: &Lesson,
    code: Option<&str>,
) -> Result<Option<ClassId>, ApiError> {
    if lesson.runtime != Runtime::Vm {
        if code.is_some() {
            return Err(no_such_code());
        }
        return Ok(None);
    }
    let now = state.store().db_now().await?;
    let open: Vec<ttlab_store::Class> = state
        .store()
        .classes()
        .current(&state.config().env, now)
        .await?
        .into_iter()
        .filter(|c| c.lesson == lesson.id && c.starts_at - JOIN_EARLY <= now)
        .collect();
    match code {
        Some(code) => {
            let given = normalize_code(code);
            // Every open class is compared, whichever matches.
            let mut found = None;
            for c in &open {
                if let Some(stored) = &c.join_code
                    && same_code(&given, stored)
                    && found.is_none()
                {
                    found = Some(c.id);
                }
            }
            found.map(Some).ok_or_else(no_such_code)
        }
        None => Ok(open.iter().find(|c| c.join_code.is_none()).map(|c| c.id)),
    }
}

fn no_such_code() -> ApiError {
    ApiError::Invalid {
        code: "unknown_class_code",
        field: "class_code",
        message: NO_SUCH_CODE.to_owned(),
    }
}

/// `lesson`'s lead time, from its recent members' preparation times.
pub(crate) async fn lead_time(state: &AppState, lesson: &LessonId) -> Result<LeadTime, ApiError> {
    let durations = state
        .store()
        .classes()
        .prepare_durations(&state.config().env, lesson)
        .await?;
    let times: Vec<TimeDelta> = durations
        .iter()
        .filter_map(|d| TimeDelta::from_std(*d).ok())
        .collect();
    Ok(LeadTime::from_prepare_times(&times))
}

/// The VMs one member of `lesson` takes; `None` for a lesson that is not offered or is not a
/// VM lesson (it has no pool).
pub(crate) fn member_nodes(state: &AppState, lesson: &LessonId) -> Option<NonZeroU32> {
    let l = state.config().lessons.get(lesson)?;
    (l.runtime == Runtime::Vm).then(|| {
        NonZeroU32::new(u32::try_from(l.nodes.len()).unwrap_or(u32::MAX)).unwrap_or(NonZeroU32::MIN)
    })
}

/// The environment's current classes with what the planner needs of each: its lesson's lead
/// time and its members and students.
pub(crate) struct CurrentClasses {
    /// Each current class (upcoming or running) of an offered VM lesson, by start.
    pub classes: Vec<CurrentClass>,
    /// The lead time of each lesson with a current class.
    pub leads: BTreeMap<LessonId, LeadTime>,
}

/// One current class and what it holds.
pub(crate) struct CurrentClass {
    /// The row.
    pub row: ttlab_store::Class,
    /// Its members and students now.
    pub counts: ClassCounts,
    /// The VMs one of its members takes.
    pub nodes: NonZeroU32,
}

impl CurrentClass {
    /// As the planner sees it.
    pub fn planned(&self) -> Class {
        Class {
            id: self.row.id,
            title: self.row.title.clone(),
            starts_at: self.row.starts_at,
            ends_at: self.row.ends_at,
            seats: self.row.seats,
            started: u32::try_from(self.counts.started).unwrap_or(u32::MAX),
        }
    }

    /// Its unclaimed members that are not being retired.
    pub fn held(&self) -> u32 {
        u32::try_from(self.counts.ready + self.counts.preparing).unwrap_or(u32::MAX)
    }
}

impl CurrentClasses {
    /// Reads them at `now` (the database clock): nothing but one query when there is none.
    pub async fn read(state: &AppState, now: DateTime<Utc>) -> Result<Self, ApiError> {
        let rows = state
            .store()
            .classes()
            .current(&state.config().env, now)
            .await?;
        let rows: Vec<(ttlab_store::Class, NonZeroU32)> = rows
            .into_iter()
            .filter_map(|c| member_nodes(state, &c.lesson).map(|n| (c, n)))
            .collect();
        let ids: Vec<ClassId> = rows.iter().map(|(c, _)| c.id).collect();
        let counts = if ids.is_empty() {
            Vec::new()
        } else {
            state.store().classes().counts(&ids).await?
        };
        let mut leads = BTreeMap::new();
        for (c, _) in &rows {
            if !leads.contains_key(&c.lesson) {
                leads.insert(c.lesson.clone(), lead_time(state, &c.lesson).await?);
            }
        }
        let classes = rows
            .into_iter()
            .zip(counts)
            .map(|((row, nodes), counts)| CurrentClass { row, counts, nodes })
            .collect();
        Ok(Self { classes, leads })
    }

    /// `lesson`'s lead time (the default for a lesson without a current class).
    pub fn lead_of(&self, lesson: &LessonId) -> LeadTime {
        self.leads.get(lesson).copied().unwrap_or_default()
    }

    /// The classes of `lesson`, as the planner sees them.
    pub fn of_lesson(&self, lesson: &LessonId) -> Vec<Class> {
        self.classes
            .iter()
            .filter(|c| &c.row.lesson == lesson)
            .map(CurrentClass::planned)
            .collect()
    }

    /// How the classes in their lead-in or running at `now` share the headroom, with `free`
    /// VM places now and `reserve` kept for a cold start.
    pub fn sharing(&self, now: DateTime<Utc>, free: i64, reserve: u32) -> Sharing {
        let active: Vec<&CurrentClass> = self
            .classes
            .iter()
            .filter(|c| {
                c.planned()
                    .phase(now, self.lead_of(&c.row.lesson))
                    .is_active()
            })
            .collect();
        let held_vms: u32 = active
            .iter()
            .map(|c| c.held().saturating_mul(c.nodes.get()))
            .fold(0, u32::saturating_add);
        let asks: Vec<ClassAsk> = active
            .iter()
            .map(|c| ClassAsk {
                id: c.row.id,
                title: c.row.title.clone(),
                seats: c.row.seats,
                wanted: c.planned().seats_left(),
                nodes: c.nodes,
                held: c.held(),
            })
            .collect();
        share_headroom(class_headroom(free, reserve, held_vms), &asks)
    }

    /// How many seats of each class can be warm at its start, if the places its lesson may
    /// use beyond the cold-start reserve (`headroom` of the lesson: with one site, its
    /// `limit - reserve`) held nothing but the classes in their lead-in or running then: each
    /// class's share of them at its start. Together with the sentence saying with whom it is
    /// shared, when it is.
    pub fn seats_warm(
        &self,
        headroom: impl Fn(&LessonId) -> u32,
    ) -> BTreeMap<ClassId, (u32, Option<String>)> {
        let mut out = BTreeMap::new();
        for c in &self.classes {
            let headroom = headroom(&c.row.lesson);
            let at = c.row.starts_at;
            let asks: Vec<ClassAsk> = self
                .classes
                .iter()
                .filter(|o| {
                    o.planned()
                        .phase(at, self.lead_of(&o.row.lesson))
                        .is_active()
                })
                .map(|o| ClassAsk {
                    id: o.row.id,
                    title: o.row.title.clone(),
                    seats: o.row.seats,
                    wanted: o.row.seats,
                    nodes: o.nodes,
                    held: 0,
                })
                .collect();
            let sharing = share_headroom(headroom, &asks);
            let warm = sharing.share_of(c.row.id).map_or(0, |s| s.warm);
            let note = (warm < c.row.seats).then(|| {
                format!(
                    "capacity allows {warm} of {} seats warm at {} ({})",
                    c.row.seats,
                    c.row.starts_at.format("%H:%M"),
                    sharing.describe_for(c.row.id)
                )
            });
            out.insert(c.row.id, (warm, note));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_compare_equal_only_when_equal() {
        assert!(same_code("ALPHA-7", "ALPHA-7"));
        assert!(!same_code("ALPHA-8", "ALPHA-7"));
        assert!(!same_code("ALPHA-7X", "ALPHA-7"));
        assert!(!same_code("", "ALPHA-7"));
        assert_eq!(normalize_code("  alpha-7 "), "ALPHA-7");
    }
}
