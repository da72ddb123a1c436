//! The driver with paused tokio time: periods, triggers, the backoff after failures and its
//! reset after a success, a panicking task restarted and reported, shutdown.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio::time::Instant;
use ttlab_background::{
    Activation, BackgroundError, BackgroundTask, Backoff, Driver, Failure, Reason, Schedule,
    TaskMetrics, TaskName, TaskSpec,
};

const fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

/// When each activation began, shared with the test.
#[derive(Clone, Default)]
struct Starts(Arc<Mutex<Vec<Instant>>>);

impl Starts {
    fn push(&self) {
        self.0.lock().unwrap().push(Instant::now());
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// When each began, counted from `origin`.
    fn since(&self, origin: Instant) -> Vec<Duration> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|at| *at - origin)
            .collect()
    }
}

/// What one activation of a [`Scripted`] task does.
#[derive(Debug, Clone, Copy)]
enum Step {
    Ok,
    Fail,
    Panic,
    /// Takes this long, then succeeds.
    Busy(Duration),
    /// Says it succeeded (a listener connected), then fails (its connection dropped).
    ConnectThenFail,
    /// Runs until the process stops.
    Listen,
    /// Runs for an hour, paying no attention to the process stopping.
    Stubborn,
    /// Has nothing more to do.
    Finish,
}

/// A task that plays `script`, then `then` for ever.
struct Scripted {
    script: std::collections::VecDeque<Step>,
    then: Step,
    starts: Starts,
}

impl Scripted {
    fn new(script: &[Step], then: Step, starts: &Starts) -> Self {
        Self {
            script: script.iter().copied().collect(),
            then,
            starts: starts.clone(),
        }
    }
}

impl BackgroundTask for Scripted {
    async fn activate(&mut self, cx: &Activation) -> Result<(), Failure> {
        self.starts.push();
        match self.script.pop_front().unwrap_or(self.then) {
            Step::Ok => Ok(()),
            Step::Fail => Err(Failure::new("the database does not answer")),
            Step::Panic => panic!("boom"),
            Step::Busy(d) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            Step::ConnectThenFail => {
                cx.succeeded();
                Err(Failure::new("connection lost"))
            }
            Step::Listen => {
                cx.stopping().await;
                Ok(())
            }
            Step::Stubborn => {
                tokio::time::sleep(secs(3600)).await;
                Ok(())
            }
            Step::Finish => {
                cx.finish();
                Ok(())
            }
        }
    }
}

const A: TaskName = TaskName::new("a");
const B: TaskName = TaskName::new("b");
const C: TaskName = TaskName::new("c");

fn driver(backoff: Backoff) -> Driver {
    Driver::new(backoff, secs(1), &TaskMetrics::new())
}

fn quick_backoff() -> Backoff {
    Backoff::doubling(ms(100), ms(1000)).without_jitter()
}

#[tokio::test(start_paused = true)]
async fn a_task_runs_at_once_then_every_period_from_the_start_of_the_last() {
    let origin = Instant::now();
    let d = driver(quick_backoff());
    let starts = Starts::default();
    let spec = TaskSpec::new(A, "does a", Schedule::every(secs(10)));
    d.register(
        spec,
        Scripted::new(&[Step::Busy(secs(3))], Step::Ok, &starts),
    )
    .unwrap();
    tokio::time::sleep(secs(35)).await;
    // The first activation took 3 s; the period counts from its start.
    assert_eq!(
        starts.since(origin),
        [secs(0), secs(10), secs(20), secs(30)]
    );
    let s = d.status(A).unwrap();
    assert_eq!(s.description, "does a");
    assert_eq!(s.period, Some(secs(10)));
    assert_eq!(
        (s.activations, s.failures, s.consecutive_failures),
        (4, 0, 0)
    );
    assert!(!s.running && !s.finished);
    assert_eq!(s.last_reason, Some(Reason::Period));
    assert_eq!(s.last_duration, Some(Duration::ZERO));
    assert!(s.last_success_at.is_some() && s.last_error.is_none());

    // The first activation can wait one period instead.
    let late = Starts::default();
    let spec = TaskSpec::new(B, "does b", Schedule::every(secs(5)).first_after_period());
    let registered = Instant::now();
    d.register(spec, Scripted::new(&[], Step::Ok, &late))
        .unwrap();
    tokio::time::sleep(secs(12)).await;
    assert_eq!(late.since(registered), [secs(5), secs(10)]);
    d.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_task_paced_after_each_activation_waits_from_its_end() {
    let origin = Instant::now();
    let d = driver(quick_backoff());
    let starts = Starts::default();
    let spec = TaskSpec::new(A, "does a", Schedule::after(secs(10)));
    d.register(spec, Scripted::new(&[], Step::Busy(secs(3)), &starts))
        .unwrap();
    tokio::time::sleep(secs(30)).await;
    // Each takes 3 s; the next comes 10 s after its end.
    assert_eq!(starts.since(origin), [secs(0), secs(13), secs(26)]);
    assert_eq!(d.status(A).unwrap().period, Some(secs(10)));
    d.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_trigger_activates_it_and_hints_that_queued_up_join_one_activation() {
    let d = driver(quick_backoff());
    let (hints, rx) = broadcast::channel::<()>(16);
    let starts = Starts::default();
    let spec = TaskSpec::new(
        A,
        "follows hints",
        Schedule::every(secs(3600)).with_debounce(ms(100)),
    )
    .triggered_by(rx);
    d.register(
        spec,
        Scripted::new(&[Step::Ok], Step::Busy(secs(1)), &starts),
    )
    .unwrap();
    tokio::time::sleep(ms(10)).await;
    assert_eq!(starts.len(), 1, "the first activation, at once");

    // Five hints at once: one activation, 100 ms later.
    let before = Instant::now();
    for _ in 0..5 {
        hints.send(()).unwrap();
    }
    tokio::time::sleep(ms(50)).await;
    assert_eq!(starts.len(), 1, "still in the debounce");
    tokio::time::sleep(ms(60)).await;
    assert_eq!(starts.len(), 2);
    assert_eq!(starts.since(before)[1], ms(100));
    assert_eq!(d.status(A).unwrap().last_reason, Some(Reason::Trigger));
    // A hint during an activation (each now takes 1 s) is followed by one more.
    hints.send(()).unwrap();
    tokio::time::sleep(secs(3)).await;
    assert_eq!(starts.len(), 3);

    // An explicit activation; an unknown name is refused.
    assert!(d.activate(A));
    assert!(!d.activate(B));
    tokio::time::sleep(secs(2)).await;
    assert_eq!(starts.len(), 4);
    tokio::time::sleep(secs(60)).await;
    assert_eq!(starts.len(), 4, "nothing else activated it");
    d.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_failing_task_waits_a_doubling_backoff_that_starts_over_after_a_success() {
    let origin = Instant::now();
    // Pauses of 1, 2, 4 and 8 s after failures in a row, and a period of 1 s.
    let d = driver(Backoff::doubling(secs(1), secs(8)).without_jitter());
    let starts = Starts::default();
    let script = [
        Step::Fail,
        Step::Fail,
        Step::Fail,
        Step::Fail,
        Step::Fail,
        Step::Ok,
        Step::Fail,
    ];
    let spec = TaskSpec::new(A, "fails", Schedule::every(secs(1)));
    d.register(spec, Scripted::new(&script, Step::Ok, &starts))
        .unwrap();
    tokio::time::sleep(secs(20)).await;
    let s = d.status(A).unwrap();
    assert_eq!(s.consecutive_failures, 5);
    assert_eq!(
        s.last_error.as_deref(),
        Some("the database does not answer")
    );
    assert!(s.last_error_at.is_some() && s.last_success_at.is_none());
    // 0, then 1 s (the period, and the first pause), 2 s, 4 s, 8 s, 8 s (the longest) later:
    // the sixth succeeds. The seventh comes a period later and fails; the pause after it is
    // the first again (1 s, the period), not 8 s.
    tokio::time::sleep(ms(13_500)).await;
    assert_eq!(
        starts.since(origin),
        [
            secs(0),
            secs(1),
            secs(3),
            secs(7),
            secs(15),
            secs(23),
            secs(24),
            secs(25),
            secs(26),
            secs(27),
            secs(28),
            secs(29),
            secs(30),
            secs(31),
            secs(32),
            secs(33),
        ]
    );
    let s = d.status(A).unwrap();
    assert_eq!((s.failures, s.consecutive_failures), (6, 0));
    assert!(s.last_error.is_none() && s.last_success_at.is_some());
    d.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_listener_is_restarted_with_the_backoff_which_a_connection_starts_over() {
    let origin = Instant::now();
    let d = driver(quick_backoff());
    let starts = Starts::default();
    let script = [
        Step::Fail,
        Step::Fail,
        Step::Fail,
        Step::ConnectThenFail,
        Step::Fail,
        Step::Fail,
    ];
    let spec = TaskSpec::new(A, "listens", Schedule::continuous());
    d.register(spec, Scripted::new(&script, Step::Listen, &starts))
        .unwrap();
    tokio::time::sleep(secs(5)).await;
    // Pauses of 100, 200, 400 ms; then it connected, so 100 and 200 ms again; then it listens.
    assert_eq!(
        starts.since(origin),
        [
            ms(0),
            ms(100),
            ms(300),
            ms(700),
            ms(800),
            ms(1000),
            ms(1400)
        ]
    );
    let s = d.status(A).unwrap();
    assert!(s.running, "listening");
    assert_eq!(s.last_reason, Some(Reason::Again));
    assert_eq!(
        (s.activations, s.failures, s.consecutive_failures),
        (7, 6, 3)
    );
    d.shutdown().await;
    let s = d.status(A).unwrap();
    assert!(!s.running && s.finished);
    assert_eq!(s.failures, 6, "stopping is no failure");
}

#[tokio::test(start_paused = true)]
async fn a_panic_is_reported_and_the_task_restarted_while_the_others_run_on() {
    let d = driver(quick_backoff());
    let panics = Starts::default();
    let steady = Starts::default();
    d.register(
        TaskSpec::new(A, "panics once", Schedule::every(secs(1))),
        Scripted::new(&[Step::Panic], Step::Ok, &panics),
    )
    .unwrap();
    d.register(
        TaskSpec::new(B, "steady", Schedule::every(ms(100))),
        Scripted::new(&[], Step::Ok, &steady),
    )
    .unwrap();
    tokio::time::sleep(ms(50)).await;
    let s = d.status(A).unwrap();
    assert_eq!(s.last_error.as_deref(), Some("panicked: boom"));
    assert_eq!((s.failures, s.consecutive_failures), (1, 1));
    assert!(!s.running);
    tokio::time::sleep(secs(2)).await;
    assert_eq!(panics.len(), 3, "restarted, at 1 s and 2 s");
    let s = d.status(A).unwrap();
    assert_eq!(s.consecutive_failures, 0);
    assert!(s.last_error.is_none() && s.last_success_at.is_some());
    assert!(
        steady.len() >= 20,
        "the other task ran on: {}",
        steady.len()
    );
    d.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_every_task_and_gives_the_one_running_a_moment() {
    let d = driver(quick_backoff());
    let (listens, stubborn, ticks) = (Starts::default(), Starts::default(), Starts::default());
    d.register(
        TaskSpec::new(A, "listens", Schedule::continuous()),
        Scripted::new(&[], Step::Listen, &listens),
    )
    .unwrap();
    d.register(
        TaskSpec::new(B, "ignores the stop", Schedule::every(secs(7200))),
        Scripted::new(&[], Step::Stubborn, &stubborn),
    )
    .unwrap();
    d.register(
        TaskSpec::new(C, "ticks", Schedule::every(secs(1))),
        Scripted::new(&[], Step::Ok, &ticks),
    )
    .unwrap();
    tokio::time::sleep(ms(4500)).await;
    assert_eq!(ticks.len(), 5);
    let asked = Instant::now();
    d.shutdown().await;
    // The stubborn one was cut off after the grace (1 s); the listener returned at once.
    assert_eq!(asked.elapsed(), secs(1));
    for s in d.statuses() {
        assert!(s.finished && !s.running, "{s:?}");
        assert_eq!(s.failures, 0, "{s:?}");
    }
    assert_eq!(d.status(B).unwrap().last_duration, Some(ms(5500)));
    tokio::time::sleep(secs(60)).await;
    assert_eq!((listens.len(), stubborn.len(), ticks.len()), (1, 1, 5));
    let refused = d.register(
        TaskSpec::new(TaskName::new("late"), "too late", Schedule::every(secs(1))),
        Scripted::new(&[], Step::Ok, &ticks),
    );
    assert_eq!(
        refused,
        Err(BackgroundError::Stopped(TaskName::new("late")))
    );
}

#[tokio::test(start_paused = true)]
async fn names_are_unique_a_finished_task_stops_and_abort_stops_at_once() {
    let d = driver(quick_backoff());
    let starts = Starts::default();
    d.register(
        TaskSpec::new(A, "finishes", Schedule::every(secs(1))),
        Scripted::new(&[Step::Ok], Step::Finish, &starts),
    )
    .unwrap();
    let twice = d.register(
        TaskSpec::new(A, "again", Schedule::every(secs(1))),
        Scripted::new(&[], Step::Ok, &starts),
    );
    assert_eq!(twice, Err(BackgroundError::Duplicate(A)));
    tokio::time::sleep(secs(10)).await;
    assert_eq!(starts.len(), 2);
    assert!(d.status(A).unwrap().finished);

    let stubborn = Starts::default();
    d.register(
        TaskSpec::new(B, "ignores the stop", Schedule::every(secs(7200))),
        Scripted::new(&[], Step::Stubborn, &stubborn),
    )
    .unwrap();
    tokio::time::sleep(secs(1)).await;
    assert!(d.status(B).unwrap().running);
    let asked = Instant::now();
    d.abort();
    assert_eq!(asked.elapsed(), Duration::ZERO);
    let s = d.status(B).unwrap();
    assert!(s.finished && !s.running);
    assert_eq!(d.names(), [A, B]);
}
