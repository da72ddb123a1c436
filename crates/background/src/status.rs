//! What operators see of a background task: its name, its status record, and the handle that
//! keeps both the record and the task metrics up to date.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};
use tokio::time::Instant;

use crate::metrics::TaskMetrics;

/// A background task's name, as the status lists it and as the `task` label of its metrics:
/// 1 to 64 lowercase ASCII letters, digits and underscores (`cluster_probe`). Checked when it
/// is built: a `const` with a bad name does not compile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskName(&'static str);

impl TaskName {
    /// The name `name`.
    ///
    /// # Panics
    ///
    /// If `name` is empty, longer than 64 bytes, or holds anything but lowercase ASCII
    /// letters, digits and underscores (at compile time, for a `const`).
    pub const fn new(name: &'static str) -> Self {
        let bytes = name.as_bytes();
        assert!(
            !bytes.is_empty() && bytes.len() <= 64,
            "a task name is 1 to 64 characters"
        );
        let mut i = 0;
        while i < bytes.len() {
            let c = bytes[i];
            assert!(
                c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_',
                "a task name is lowercase ASCII letters, digits and underscores"
            );
            i += 1;
        }
        Self(name)
    }

    /// The name as text.
    pub const fn as_str(&self) -> &'static str {
        self.0
    }
}

impl std::fmt::Display for TaskName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl EncodeLabelValue for TaskName {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.0, encoder)
    }
}

/// Why an activation began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The task's first activation.
    Start,
    /// Its period came round.
    Period,
    /// Something it follows asked for it (a change hint, an explicit activation).
    Trigger,
    /// A task that runs continuously (a listener) began again after its last activation
    /// ended: at once after an end without failure, after the backoff after a failure.
    Again,
}

impl Reason {
    /// The reason as one word (`start`, `period`, `trigger`, `again`).
    pub const fn as_str(&self) -> &'static str {
        match self {
            Self::Start => "start",
            Self::Period => "period",
            Self::Trigger => "trigger",
            Self::Again => "again",
        }
    }
}

/// A background task's status, as it was when read.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskStatus {
    /// The task.
    pub name: TaskName,
    /// What it does, in one sentence (for operators).
    pub description: &'static str,
    /// How often it runs, if it runs on a period (a listener runs continuously).
    pub period: Option<Duration>,
    /// Whether an activation is running now.
    pub running: bool,
    /// Whether it has stopped for good: what it served is gone, or the process is stopping.
    pub finished: bool,
    /// Activations begun.
    pub activations: u64,
    /// Activations that failed (an error or a panic).
    pub failures: u64,
    /// Activations that failed since the last success.
    pub consecutive_failures: u32,
    /// When the last activation began (server clock).
    pub last_started_at: Option<DateTime<Utc>>,
    /// Why it began.
    pub last_reason: Option<Reason>,
    /// How long the last activation that ended took.
    pub last_duration: Option<Duration>,
    /// When it last succeeded: an activation that ended without failure, or a listener that
    /// (re)connected.
    pub last_success_at: Option<DateTime<Utc>>,
    /// Why the last activation failed, until the next success.
    pub last_error: Option<String>,
    /// When that failure happened.
    pub last_error_at: Option<DateTime<Utc>>,
}

impl TaskStatus {
    fn new(name: TaskName, description: &'static str, period: Option<Duration>) -> Self {
        Self {
            name,
            description,
            period,
            running: false,
            finished: false,
            activations: 0,
            failures: 0,
            consecutive_failures: 0,
            last_started_at: None,
            last_reason: None,
            last_duration: None,
            last_success_at: None,
            last_error: None,
            last_error_at: None,
        }
    }
}

/// One task's status record and its metrics, kept up to date by whoever runs the task (the
/// [`crate::Driver`], or a loop of its own such as the reaper's) and read by whoever reports
/// it. Cheap to clone: the clones share the record.
#[derive(Debug, Clone)]
pub struct TaskRecord {
    status: Arc<Mutex<TaskStatus>>,
    metrics: TaskMetrics,
}

/// An activation begun with [`TaskRecord::began`]; give it back to [`TaskRecord::ended`].
#[derive(Debug)]
#[must_use = "end the activation with TaskRecord::ended"]
pub struct Began {
    at: Instant,
}

impl TaskRecord {
    /// A record of the task `name` (`period`: how often it runs, if on a period), counted in
    /// `metrics`.
    pub fn new(
        name: TaskName,
        description: &'static str,
        period: Option<Duration>,
        metrics: &TaskMetrics,
    ) -> Self {
        metrics.touch(name);
        Self {
            status: Arc::new(Mutex::new(TaskStatus::new(name, description, period))),
            metrics: metrics.clone(),
        }
    }

    /// The task's name.
    pub fn name(&self) -> TaskName {
        self.lock().name
    }

    /// Activations failed since the last success.
    pub fn consecutive_failures(&self) -> u32 {
        self.lock().consecutive_failures
    }

    /// The status now.
    pub fn status(&self) -> TaskStatus {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TaskStatus> {
        self.status.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An activation begins, for `reason`.
    pub fn began(&self, reason: Reason) -> Began {
        let name = {
            let mut s = self.lock();
            s.running = true;
            s.activations += 1;
            s.last_started_at = Some(Utc::now());
            s.last_reason = Some(reason);
            s.name
        };
        self.metrics.activations(name).inc();
        Began { at: Instant::now() }
    }

    /// A success before the activation ends (a listener connected): the consecutive failures
    /// go back to 0 and the last error is cleared.
    pub fn succeeded(&self) {
        let name = {
            let mut s = self.lock();
            s.last_success_at = Some(Utc::now());
            s.consecutive_failures = 0;
            s.last_error = None;
            s.last_error_at = None;
            s.name
        };
        self.metrics.last_success(name).set(unix_now());
    }

    /// The activation `began` ended: without failure (`Ok`), or failing with the message.
    /// Returns how many activations have failed in a row (0 after a success).
    pub fn ended(&self, began: Began, outcome: Result<(), &str>) -> u32 {
        let took = began.at.elapsed();
        let name = {
            let mut s = self.lock();
            s.running = false;
            s.last_duration = Some(took);
            s.name
        };
        self.metrics.last_duration(name).set(took.as_secs_f64());
        match outcome {
            Ok(()) => {
                self.succeeded();
                0
            }
            Err(message) => self.failed(message),
        }
    }

    /// A failure outside an activation — the connection a listener holds was lost: counted
    /// and shown like a failed activation. Returns how many have failed in a row.
    pub fn failed(&self, message: &str) -> u32 {
        let (name, in_a_row) = {
            let mut s = self.lock();
            s.failures += 1;
            s.consecutive_failures = s.consecutive_failures.saturating_add(1);
            s.last_error = Some(message.to_owned());
            s.last_error_at = Some(Utc::now());
            (s.name, s.consecutive_failures)
        };
        self.metrics.failures(name).inc();
        in_a_row
    }

    /// The activation `began` was cut short because the process is stopping: neither a
    /// success nor a failure.
    pub fn interrupted(&self, began: Began) {
        let mut s = self.lock();
        s.running = false;
        s.last_duration = Some(began.at.elapsed());
    }

    /// The task stopped for good.
    pub fn finished(&self) {
        let mut s = self.lock();
        s.running = false;
        s.finished = true;
    }
}

/// Seconds since the Unix epoch, now.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_counts_activations_and_failures_and_a_success_clears_the_error() {
        let metrics = TaskMetrics::new();
        let record = TaskRecord::new(TaskName::new("probe"), "probes", None, &metrics);
        let began = record.began(Reason::Start);
        assert!(record.status().running);
        assert_eq!(record.ended(began, Err("no answer")), 1);
        let began = record.began(Reason::Period);
        assert_eq!(record.ended(began, Err("still no answer")), 2);
        let s = record.status();
        assert!(!s.running);
        assert_eq!(
            (s.activations, s.failures, s.consecutive_failures),
            (2, 2, 2)
        );
        assert_eq!(s.last_error.as_deref(), Some("still no answer"));
        assert!(s.last_error_at.is_some() && s.last_success_at.is_none());
        assert_eq!(s.last_reason, Some(Reason::Period));

        let began = record.began(Reason::Trigger);
        assert_eq!(record.ended(began, Ok(())), 0);
        let s = record.status();
        assert_eq!(
            (s.activations, s.failures, s.consecutive_failures),
            (3, 2, 0)
        );
        assert_eq!(s.last_error, None);
        assert!(s.last_success_at.is_some());

        // A listener's connection lost between activations counts as a failure too.
        assert_eq!(record.failed("connection lost"), 1);
        let s = record.status();
        assert_eq!(
            (s.activations, s.failures, s.consecutive_failures),
            (3, 3, 1)
        );
        assert_eq!(s.last_error.as_deref(), Some("connection lost"));
    }

    #[test]
    #[should_panic(expected = "lowercase")]
    fn a_task_name_is_lowercase_letters_digits_and_underscores() {
        assert_eq!(TaskName::new("pool_refill_2").as_str(), "pool_refill_2");
        let _ = TaskName::new("Pool refill");
    }
}
