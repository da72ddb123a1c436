//! The pauses of a retry loop: the one place that decides how long ttlab waits before trying
//! again, over backon's exponential backoff.

use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBackoff, ExponentialBuilder};

/// How a retry loop paces itself.
///
/// - [`Backoff::doubling`]: the pause doubles from `first` up to `max`, and each pause is drawn
///   at random between half and all of the current one, so that the many clients that failed
///   together (replicas after a database restart, watches after an API server restart) do not
///   come back together. For reconnecting and restarting.
/// - [`Backoff::without_jitter`]: the same doubling, each pause exactly as long as the current
///   one. For polling an object of one's own (a VM being deleted, a guest's agent booting),
///   where nobody else retries in step.
/// - [`Backoff::constant`]: always the same pause.
///
/// A loop takes its pauses from [`Backoff::pauses`] and starts them over
/// ([`Pauses::reset`]) after a success.
///
/// ```
/// use std::time::Duration;
/// use ttlab_background::Backoff;
///
/// let ms = Duration::from_millis;
/// let poll = Backoff::doubling(ms(50), ms(250)).without_jitter();
/// let pauses: Vec<Duration> = poll.pauses().take(5).collect();
/// assert_eq!(pauses, [ms(50), ms(100), ms(200), ms(250), ms(250)]);
///
/// let mut reconnect = Backoff::doubling(ms(100), ms(2000)).pauses();
/// let first = reconnect.next_pause();
/// assert!(first >= ms(50) && first <= ms(100));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    max: Duration,
    jitter: bool,
}

impl Backoff {
    /// Pauses doubling from `first` up to `max` (`max` below `first` counts as `first`), each
    /// drawn between half and all of the current one.
    pub const fn doubling(first: Duration, max: Duration) -> Self {
        let max = if max.as_nanos() < first.as_nanos() {
            first
        } else {
            max
        };
        Self {
            first,
            max,
            jitter: true,
        }
    }

    /// Always `every`.
    pub const fn constant(every: Duration) -> Self {
        Self {
            first: every,
            max: every,
            jitter: false,
        }
    }

    /// The same pauses, each exactly as long as the current one (no random draw).
    pub const fn without_jitter(self) -> Self {
        Self {
            jitter: false,
            ..self
        }
    }

    /// The first pause (before any draw).
    pub const fn first(&self) -> Duration {
        self.first
    }

    /// The longest pause.
    pub const fn max(&self) -> Duration {
        self.max
    }

    /// Whether each pause is drawn between half and all of the current one.
    pub const fn jittered(&self) -> bool {
        self.jitter
    }

    /// backon's builder of these pauses. backon's jitter adds up to the whole pause, so a
    /// jittered policy starts it from half of ours: its draws fall between half and all of
    /// ours.
    pub fn builder(&self) -> ExponentialBuilder {
        let (first, max) = if self.jitter {
            (self.first / 2, self.max / 2)
        } else {
            (self.first, self.max)
        };
        let builder = ExponentialBuilder::new()
            .with_factor(2.0)
            .with_min_delay(first)
            .with_max_delay(max)
            .without_max_times();
        if self.jitter {
            builder.with_jitter()
        } else {
            builder
        }
    }

    /// The pauses of one retry loop, from the first.
    pub fn pauses(&self) -> Pauses {
        let builder = self.builder();
        Pauses {
            builder,
            inner: builder.build(),
            last: self.max,
        }
    }
}

/// The pauses of one retry loop: an endless iterator, started over by [`Pauses::reset`].
#[derive(Debug)]
pub struct Pauses {
    builder: ExponentialBuilder,
    inner: ExponentialBackoff,
    /// The pause given when backon gives none (it does not, without a limit of attempts).
    last: Duration,
}

impl Pauses {
    /// The next pause.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.inner.next().unwrap_or(self.last);
        self.last = pause;
        to_microseconds(pause)
    }

    /// Starts over from the first pause (after a success).
    pub fn reset(&mut self) {
        self.inner = self.builder.build();
    }
}

impl Iterator for Pauses {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_pause())
    }
}

/// backon doubles in `f32` seconds, which leaves nanoseconds of noise (50 ms doubled is
/// 100.000001 ms): pauses are whole microseconds.
fn to_microseconds(d: Duration) -> Duration {
    let micros = d.as_nanos().saturating_add(500) / 1000;
    Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn without_jitter_the_pauses_double_exactly_up_to_the_longest() {
        let pauses: Vec<Duration> = Backoff::doubling(ms(200), ms(2000))
            .without_jitter()
            .pauses()
            .take(7)
            .collect();
        assert_eq!(
            pauses,
            [
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000),
                ms(2000),
                ms(2000)
            ]
        );
        let pauses: Vec<Duration> = Backoff::doubling(ms(500), Duration::from_secs(30))
            .without_jitter()
            .pauses()
            .take(8)
            .collect();
        assert_eq!(
            pauses,
            [
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(16000),
                ms(30000),
                ms(30000)
            ]
        );
    }

    #[test]
    fn jittered_pauses_fall_between_half_and_all_of_the_doubling_pause_and_vary() {
        let policy = Backoff::doubling(ms(100), ms(5000));
        let mut draws = std::collections::BTreeSet::new();
        for _ in 0..50 {
            let mut current = ms(100);
            for p in policy.pauses().take(10) {
                assert!(p >= current / 2 && p <= current, "{p:?} for {current:?}");
                draws.insert(p);
                current = (current * 2).min(ms(5000));
            }
        }
        assert!(draws.len() > 100, "hardly any jitter: {draws:?}");
    }

    #[test]
    fn a_reset_starts_over_from_the_first_pause() {
        let mut pauses = Backoff::doubling(ms(100), ms(2000))
            .without_jitter()
            .pauses();
        let first: Vec<Duration> = pauses.by_ref().take(4).collect();
        assert_eq!(first, [ms(100), ms(200), ms(400), ms(800)]);
        pauses.reset();
        assert_eq!(pauses.next_pause(), ms(100));
        assert_eq!(pauses.next_pause(), ms(200));

        let mut jittered = Backoff::doubling(ms(100), ms(2000)).pauses();
        for _ in 0..10 {
            jittered.next_pause();
        }
        jittered.reset();
        assert!(jittered.next_pause() <= ms(100));
    }

    #[test]
    fn a_constant_pace_never_changes_and_a_longest_below_the_first_is_the_first() {
        let pauses: Vec<Duration> = Backoff::constant(ms(1000)).pauses().take(5).collect();
        assert_eq!(pauses, [ms(1000); 5]);
        let odd = Backoff::doubling(ms(300), ms(100)).without_jitter();
        assert_eq!(odd.max(), ms(300));
        assert_eq!(odd.pauses().take(3).collect::<Vec<_>>(), [ms(300); 3]);
    }
}
