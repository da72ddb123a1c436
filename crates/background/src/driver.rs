//! The driver: runs each registered task on its own tokio task, one activation per period or
//! per trigger (or, for a listener, one after another), times it, records its status and
//! metrics, waits out the shared backoff after a failure or a panic, and stops them all.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::FutureExt as _;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use tokio::sync::{Notify, broadcast};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::{
    BackgroundError, Backoff, Pauses, Reason, TaskMetrics, TaskName, TaskRecord, TaskStatus,
};

/// How long [`Driver::shutdown`] lets an activation in progress finish, by default.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(2);

/// A background task: a type whose [`activate`](BackgroundTask::activate) makes one pass of
/// its work. The driver decides when (see [`Schedule`]); the task keeps whatever it needs
/// between passes in its own fields.
pub trait BackgroundTask: Send + 'static {
    /// One pass. `Err` (or a panic) is recorded as the task's last error, and the next
    /// activation waits for the driver's backoff first. A listener's activation runs until its
    /// connection ends (an `Err`), or until [`Activation::stopping`].
    fn activate(&mut self, cx: &Activation) -> impl Future<Output = Result<(), Failure>> + Send;
}

/// Why an activation failed, in a sentence for operators (it is the task's `last_error`).
/// Any error converts into one with `?`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure(String);

impl Failure {
    /// A failure saying `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }

    /// What it says.
    pub fn message(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Failure {
    fn from(e: E) -> Self {
        Self(e.to_string())
    }
}

/// When a task is activated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    period: Option<Duration>,
    /// The period counts from the end of the last activation, not its start.
    from_end: bool,
    continuous: bool,
    first_at_start: bool,
    debounce: Duration,
    min_pause: Duration,
}

impl Schedule {
    /// At once, then `period` after the start of each activation (an activation that takes
    /// longer is followed at once), and whenever a trigger fires.
    pub const fn every(period: Duration) -> Self {
        Self {
            period: Some(period),
            from_end: false,
            continuous: false,
            first_at_start: true,
            debounce: Duration::ZERO,
            min_pause: Duration::ZERO,
        }
    }

    /// At once, then `pause` after the end of each activation, and whenever a trigger fires.
    pub const fn after(pause: Duration) -> Self {
        Self {
            from_end: true,
            ..Self::every(pause)
        }
    }

    /// One activation after another: a listener, whose activation runs until its connection
    /// ends. Again at once after an end without failure, after the backoff after a failure.
    pub const fn continuous() -> Self {
        Self {
            period: None,
            from_end: false,
            continuous: true,
            first_at_start: true,
            debounce: Duration::ZERO,
            min_pause: Duration::ZERO,
        }
    }

    /// The first activation comes one period after the start (or at a trigger), not at once.
    pub const fn first_after_period(self) -> Self {
        Self {
            first_at_start: false,
            ..self
        }
    }

    /// After a trigger fires, wait this long before activating: triggers arriving meanwhile
    /// join the same activation.
    pub const fn with_debounce(self, debounce: Duration) -> Self {
        Self { debounce, ..self }
    }

    /// The shortest pause between the end of one activation and the start of the next,
    /// however many triggers fire.
    pub const fn with_min_pause(self, min_pause: Duration) -> Self {
        Self { min_pause, ..self }
    }

    /// The period (or, for [`Schedule::after`], the pause), for a task that runs on one.
    pub const fn period(&self) -> Option<Duration> {
        self.period
    }
}

/// Something a task follows: each time it fires, the task is activated (after the schedule's
/// debounce). Hints that queued up before an activation begins are covered by it and drained.
pub trait Trigger: Send + 'static {
    /// Waits for the next hint; `false` when the source is gone and will never fire again.
    /// Must be cancel-safe.
    fn fired(&mut self) -> BoxFuture<'_, bool>;

    /// Takes every hint already queued.
    fn drain(&mut self);
}

impl<T: Clone + Send + 'static> Trigger for broadcast::Receiver<T> {
    fn fired(&mut self) -> BoxFuture<'_, bool> {
        Box::pin(
            async move { !matches!(self.recv().await, Err(broadcast::error::RecvError::Closed)) },
        )
    }

    fn drain(&mut self) {
        while !matches!(
            self.try_recv(),
            Err(broadcast::error::TryRecvError::Empty | broadcast::error::TryRecvError::Closed)
        ) {}
    }
}

/// A task as it is registered: its name, what it does, when it runs, what triggers it.
pub struct TaskSpec {
    name: TaskName,
    description: &'static str,
    schedule: Schedule,
    triggers: Vec<Box<dyn Trigger>>,
}

impl std::fmt::Debug for TaskSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskSpec")
            .field("name", &self.name)
            .field("schedule", &self.schedule)
            .field("triggers", &self.triggers.len())
            .finish_non_exhaustive()
    }
}

impl TaskSpec {
    /// The task `name`, doing what `description` says (one sentence, for operators), on
    /// `schedule`.
    pub fn new(name: TaskName, description: &'static str, schedule: Schedule) -> Self {
        Self {
            name,
            description,
            schedule,
            triggers: Vec::new(),
        }
    }

    /// Also activated whenever `trigger` fires.
    pub fn triggered_by(mut self, trigger: impl Trigger) -> Self {
        self.triggers.push(Box::new(trigger));
        self
    }
}

/// What an activation knows and can say while it runs.
#[derive(Debug)]
pub struct Activation {
    reason: Reason,
    record: TaskRecord,
    stop: CancellationToken,
    succeeded: AtomicBool,
    finish: AtomicBool,
}

impl Activation {
    /// Why this activation began.
    pub fn reason(&self) -> Reason {
        self.reason
    }

    /// A success before the activation ends — a listener whose connection is open: the
    /// backoff starts over, the consecutive failures go back to 0 and the last error is
    /// cleared.
    pub fn succeeded(&self) {
        self.succeeded.store(true, Ordering::SeqCst);
        let before = self.record.consecutive_failures();
        self.record.succeeded();
        if before > 0 {
            tracing::info!(task = %self.record.name(), failures = before, "background task succeeded again");
        }
    }

    /// Resolves when the process is stopping: a long activation returns then. (One that does
    /// not is cut off after the driver's grace.)
    pub fn stopping(&self) -> WaitForCancellationFuture<'_> {
        self.stop.cancelled()
    }

    /// Whether the process is stopping.
    pub fn is_stopping(&self) -> bool {
        self.stop.is_cancelled()
    }

    /// Ends the task after this activation: what it served is gone, it has nothing more to
    /// do. Its status stays, marked finished.
    pub fn finish(&self) {
        self.finish.store(true, Ordering::SeqCst);
    }
}

/// Runs a process's background tasks (see the crate documentation). Cheap to clone: the
/// clones share the tasks.
#[derive(Clone)]
pub struct Driver {
    inner: Arc<Inner>,
}

struct Inner {
    backoff: Backoff,
    grace: Duration,
    metrics: TaskMetrics,
    stop: CancellationToken,
    tasks: Mutex<Vec<Entry>>,
}

struct Entry {
    record: TaskRecord,
    notify: Arc<Notify>,
    handle: Option<JoinHandle<()>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let tasks = self.tasks.get_mut().unwrap_or_else(PoisonError::into_inner);
        for entry in tasks.iter_mut() {
            if let Some(handle) = entry.handle.take() {
                handle.abort();
            }
        }
    }
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("backoff", &self.inner.backoff)
            .field("grace", &self.inner.grace)
            .field("tasks", &self.names())
            .finish_non_exhaustive()
    }
}

impl Driver {
    /// A driver with no task yet: a failed task waits out `backoff` before it is activated
    /// again, and [`Driver::shutdown`] gives an activation in progress `grace` to finish.
    /// Tasks are counted in `metrics`.
    pub fn new(backoff: Backoff, grace: Duration, metrics: &TaskMetrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                backoff,
                grace,
                metrics: metrics.clone(),
                stop: CancellationToken::new(),
                tasks: Mutex::new(Vec::new()),
            }),
        }
    }

    fn tasks(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.inner
            .tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts `task` as `spec` says, on the current tokio runtime.
    pub fn register<T: BackgroundTask>(
        &self,
        spec: TaskSpec,
        task: T,
    ) -> Result<(), BackgroundError> {
        let mut tasks = self.tasks();
        if self.inner.stop.is_cancelled() {
            return Err(BackgroundError::Stopped(spec.name));
        }
        if tasks.iter().any(|e| e.record.name() == spec.name) {
            return Err(BackgroundError::Duplicate(spec.name));
        }
        let record = TaskRecord::new(
            spec.name,
            spec.description,
            spec.schedule.period,
            &self.inner.metrics,
        );
        let notify = Arc::new(Notify::new());
        let runner = Runner {
            task,
            schedule: spec.schedule,
            sources: spec
                .triggers
                .into_iter()
                .map(|trigger| Source {
                    trigger,
                    open: true,
                })
                .collect(),
            notify: notify.clone(),
            record: record.clone(),
            stop: self.inner.stop.clone(),
            pauses: self.inner.backoff.pauses(),
            grace: self.inner.grace,
        };
        let handle = tokio::spawn(runner.run());
        tasks.push(Entry {
            record,
            notify,
            handle: Some(handle),
        });
        Ok(())
    }

    /// The names of the registered tasks, in the order they were registered.
    pub fn names(&self) -> Vec<TaskName> {
        self.tasks().iter().map(|e| e.record.name()).collect()
    }

    /// Activates the task `name` now (or, if it is running, once more right after); whether
    /// there is such a task.
    pub fn activate(&self, name: TaskName) -> bool {
        match self.tasks().iter().find(|e| e.record.name() == name) {
            Some(entry) => {
                entry.notify.notify_one();
                true
            }
            None => false,
        }
    }

    /// Every task's status, in the order they were registered.
    pub fn statuses(&self) -> Vec<TaskStatus> {
        self.tasks().iter().map(|e| e.record.status()).collect()
    }

    /// The status of the task `name`.
    pub fn status(&self, name: TaskName) -> Option<TaskStatus> {
        self.tasks()
            .iter()
            .find(|e| e.record.name() == name)
            .map(|e| e.record.status())
    }

    /// Stops every task: no activation begins any more, one in progress gets the grace to
    /// finish (a listener returns at once, see [`Activation::stopping`]) and is cut off after
    /// it. Returns when all have stopped. Nothing can be registered afterwards.
    pub async fn shutdown(&self) {
        self.inner.stop.cancel();
        let handles: Vec<JoinHandle<()>> = self
            .tasks()
            .iter_mut()
            .filter_map(|e| e.handle.take())
            .collect();
        // Each runner ends within the grace by itself; the margin is for the runtime.
        let deadline = Instant::now() + self.inner.grace + Duration::from_millis(500);
        for mut handle in handles {
            if tokio::time::timeout_at(deadline, &mut handle)
                .await
                .is_err()
            {
                handle.abort();
            }
        }
    }

    /// Stops every task at once, as a crash would: activations in progress are dropped where
    /// they stand.
    pub fn abort(&self) {
        self.inner.stop.cancel();
        for entry in self.tasks().iter_mut() {
            if let Some(handle) = entry.handle.take() {
                handle.abort();
                entry.record.finished();
            }
        }
    }
}

/// A trigger, until it says it will never fire again.
struct Source {
    trigger: Box<dyn Trigger>,
    open: bool,
}

/// One task on its tokio task.
struct Runner<T> {
    task: T,
    schedule: Schedule,
    sources: Vec<Source>,
    notify: Arc<Notify>,
    record: TaskRecord,
    stop: CancellationToken,
    pauses: Pauses,
    grace: Duration,
}

impl<T: BackgroundTask> Runner<T> {
    async fn run(mut self) {
        let registered = Instant::now();
        let mut last_start: Option<Instant> = None;
        let mut last_end: Option<Instant> = None;
        let mut failed = false;
        while !self.stop.is_cancelled() {
            if failed {
                let pause = self.pauses.next_pause();
                if !sleep(&self.stop, pause).await {
                    break;
                }
            }
            let Some(reason) = self.wait(registered, last_start, last_end).await else {
                break;
            };
            if let Some(end) = last_end
                && !sleep_until(&self.stop, end + self.schedule.min_pause).await
            {
                break;
            }
            // What queued up so far is covered by this activation.
            self.drain();
            let cx = Activation {
                reason,
                record: self.record.clone(),
                stop: self.stop.clone(),
                succeeded: AtomicBool::new(false),
                finish: AtomicBool::new(false),
            };
            let began = self.record.began(reason);
            last_start = Some(Instant::now());
            let outcome = {
                let activation = AssertUnwindSafe(self.task.activate(&cx)).catch_unwind();
                let stop = &self.stop;
                let grace = self.grace;
                tokio::select! {
                    biased;
                    outcome = activation => Some(outcome),
                    () = async {
                        stop.cancelled().await;
                        tokio::time::sleep(grace).await;
                    } => None,
                }
            };
            last_end = Some(Instant::now());
            let name = self.record.name();
            if cx.succeeded.load(Ordering::SeqCst) {
                self.pauses.reset();
            }
            failed = match outcome {
                None => {
                    tracing::info!(task = %name, "background task cut off: the process is stopping");
                    self.record.interrupted(began);
                    break;
                }
                Some(Ok(Ok(()))) => {
                    let before = self.record.consecutive_failures();
                    self.record.ended(began, Ok(()));
                    if before > 0 {
                        tracing::info!(task = %name, failures = before, "background task succeeded again");
                    }
                    self.pauses.reset();
                    false
                }
                Some(Ok(Err(failure))) => {
                    let in_a_row = self.record.ended(began, Err(failure.message()));
                    if in_a_row == 1 {
                        tracing::warn!(task = %name, error = %failure, "background task failed; it is retried with backoff");
                    } else {
                        tracing::debug!(task = %name, error = %failure, failures = in_a_row, "background task failed again");
                    }
                    true
                }
                Some(Err(panic)) => {
                    let message = format!("panicked: {}", panic_message(panic.as_ref()));
                    let in_a_row = self.record.ended(began, Err(&message));
                    tracing::error!(task = %name, error = %message, failures = in_a_row, "background task panicked; it is restarted with backoff");
                    true
                }
            };
            if cx.finish.load(Ordering::SeqCst) {
                tracing::debug!(task = %name, "background task finished: nothing more to do");
                break;
            }
        }
        self.record.finished();
    }

    /// Waits for the next activation's reason; `None` once the process is stopping.
    async fn wait(
        &mut self,
        registered: Instant,
        last_start: Option<Instant>,
        last_end: Option<Instant>,
    ) -> Option<Reason> {
        let schedule = self.schedule;
        match last_start {
            None if schedule.first_at_start => return Some(Reason::Start),
            Some(_) if schedule.continuous => return Some(Reason::Again),
            _ => {}
        }
        let since = if schedule.from_end {
            last_end
        } else {
            last_start
        };
        let due = schedule
            .period
            .map(|period| since.unwrap_or(registered) + period);
        let stop = &self.stop;
        let notify = &self.notify;
        let sources = &mut self.sources;
        let reason = tokio::select! {
            biased;
            () = stop.cancelled() => return None,
            () = until(due) => Reason::Period,
            () = notify.notified() => Reason::Trigger,
            () = fired(sources) => Reason::Trigger,
        };
        if reason == Reason::Trigger && !sleep(&self.stop, schedule.debounce).await {
            return None;
        }
        Some(reason)
    }

    fn drain(&mut self) {
        for source in self.sources.iter_mut().filter(|s| s.open) {
            source.trigger.drain();
        }
        // A permit stored by `Driver::activate` is taken by the first poll.
        let _ = self.notify.notified().now_or_never();
    }
}

/// Sleeps `pause`; false if the process began stopping meanwhile.
async fn sleep(stop: &CancellationToken, pause: Duration) -> bool {
    sleep_until(stop, Instant::now() + pause).await
}

/// Sleeps until `at`; false if the process began stopping meanwhile.
async fn sleep_until(stop: &CancellationToken, at: Instant) -> bool {
    tokio::select! {
        biased;
        () = stop.cancelled() => false,
        () = tokio::time::sleep_until(at) => true,
    }
}

/// Resolves at `at`; never, without one.
async fn until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Resolves when one of the open sources fires; never, once all are closed.
async fn fired(sources: &mut [Source]) {
    let mut waiting: FuturesUnordered<_> = sources
        .iter_mut()
        .filter(|s| s.open)
        .map(|source| async move {
            let alive = source.trigger.fired().await;
            if !alive {
                source.open = false;
            }
            alive
        })
        .collect();
    while let Some(alive) = waiting.next().await {
        if alive {
            return;
        }
    }
    drop(waiting);
    std::future::pending().await
}

/// What a panic said, if it said it as text.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}
