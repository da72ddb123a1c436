//! The demand-driven size: how many starts of a lesson to expect during one refill time.

use chrono::{DateTime, TimeDelta, Utc};

use crate::PoolError;

/// The refill time assumed until one is measured: 3 minutes (a real guest boots and runs a
/// short setup in about 90 to 180 seconds).
pub const DEFAULT_REFILL_TIME: TimeDelta = TimeDelta::minutes(3);
/// The recent window whose rate of starts is extrapolated: 15 minutes.
pub const DEFAULT_RECENT_WINDOW: TimeDelta = TimeDelta::minutes(15);
/// How far back the "same time yesterday" window lies.
pub const DAY: TimeDelta = TimeDelta::days(1);
/// How far back the "same time last week" window lies.
pub const WEEK: TimeDelta = TimeDelta::days(7);
/// The longest refill time and recent window a forecast takes: 12 hours. Within it the three
/// [windows](Forecast::windows) never overlap, so each start is counted in one window at most
/// and a caller may fetch the starts of each window and concatenate them.
pub const MAX_FORECAST_DURATION: TimeDelta = TimeDelta::hours(12);

/// The two durations a forecast needs, validated (each from one second to
/// [`MAX_FORECAST_DURATION`]).
///
/// - `refill_time`: how long a new member takes from creation to ready (the measured median,
///   or [`DEFAULT_REFILL_TIME`]). It is the look-ahead: a member planned now serves starts from
///   `now + refill_time` on, so the pool must hold what one refill time of starts consumes.
/// - `recent_window`: the window of recent starts whose rate is extrapolated
///   ([`DEFAULT_RECENT_WINDOW`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forecast {
    refill_time: TimeDelta,
    recent_window: TimeDelta,
}

impl Forecast {
    /// Validates the two durations.
    pub fn new(refill_time: TimeDelta, recent_window: TimeDelta) -> Result<Self, PoolError> {
        let ok = |d: TimeDelta| d >= TimeDelta::seconds(1) && d <= MAX_FORECAST_DURATION;
        if !ok(refill_time) {
            return Err(PoolError::forecast("refill time", refill_time));
        }
        if !ok(recent_window) {
            return Err(PoolError::forecast("recent window", recent_window));
        }
        Ok(Self {
            refill_time,
            recent_window,
        })
    }

    /// The refill time (the look-ahead).
    pub fn refill_time(&self) -> TimeDelta {
        self.refill_time
    }

    /// The recent window.
    pub fn recent_window(&self) -> TimeDelta {
        self.recent_window
    }

    /// The windows whose starts the forecast at `now` counts, so a caller can fetch exactly
    /// those starts. They never overlap. A window that would fall outside the representable
    /// instants is `None`.
    ///
    /// ```
    /// use chrono::{TimeDelta, TimeZone, Utc};
    /// use ttlab_pool::Forecast;
    ///
    /// let f = Forecast::new(TimeDelta::minutes(3), TimeDelta::minutes(15)).unwrap();
    /// let now = Utc.with_ymd_and_hms(2026, 12, 2, 8, 58, 0).unwrap();
    /// let w = f.windows(now);
    /// let recent = w.recent.unwrap();
    /// assert_eq!((recent.start, recent.end), (now - TimeDelta::minutes(15), now));
    /// let day = w.day_before.unwrap();
    /// assert_eq!(day.start, Utc.with_ymd_and_hms(2026, 12, 1, 8, 58, 0).unwrap());
    /// assert_eq!(day.end, Utc.with_ymd_and_hms(2026, 12, 1, 9, 1, 0).unwrap());
    /// ```
    pub fn windows(&self, now: DateTime<Utc>) -> DemandWindows {
        let back = |period: TimeDelta| {
            let start = now.checked_sub_signed(period)?;
            let end = start.checked_add_signed(self.refill_time)?;
            Some(Window { start, end })
        };
        DemandWindows {
            recent: now
                .checked_sub_signed(self.recent_window)
                .map(|start| Window { start, end: now }),
            day_before: back(DAY),
            week_before: back(WEEK),
        }
    }
}

impl Default for Forecast {
    /// [`DEFAULT_REFILL_TIME`] and [`DEFAULT_RECENT_WINDOW`].
    fn default() -> Self {
        Self {
            refill_time: DEFAULT_REFILL_TIME,
            recent_window: DEFAULT_RECENT_WINDOW,
        }
    }
}

/// A half-open span of time, `start <= t < end`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The first instant inside.
    pub start: DateTime<Utc>,
    /// The first instant after.
    pub end: DateTime<Utc>,
}

impl Window {
    /// Whether `t` is inside.
    pub fn contains(&self, t: DateTime<Utc>) -> bool {
        self.start <= t && t < self.end
    }
}

/// The three windows of a forecast at `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DemandWindows {
    /// `now - recent_window .. now`: its rate of starts is scaled to one refill time.
    pub recent: Option<Window>,
    /// `now - 1 day .. now - 1 day + refill_time`: the starts of one refill time ahead, as they
    /// happened yesterday.
    pub day_before: Option<Window>,
    /// The same, one week earlier.
    pub week_before: Option<Window>,
}

/// What the demand-driven size is computed from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Demand {
    /// The forecast's durations.
    pub forecast: Forecast,
    /// The instants this lesson was started (cold starts and claims of members alike), in any
    /// order; instants outside the [windows](Forecast::windows) are ignored.
    pub starts: Vec<DateTime<Utc>>,
    /// Starts are fully recorded from this instant on (when recording began, or the oldest
    /// instant the history still holds). A window that begins earlier is not counted: an empty
    /// window must mean "nobody started", never "we do not know".
    pub recorded_since: DateTime<Utc>,
}

/// Which window gave the demand-driven estimate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WindowKind {
    /// The recent window, its rate scaled to one refill time.
    Recent,
    /// The upcoming refill time, one day earlier.
    DayBefore,
    /// The upcoming refill time, one week earlier.
    WeekBefore,
}

impl WindowKind {
    /// Words for the admin page and logs.
    pub fn describe(self) -> &'static str {
        match self {
            WindowKind::Recent => "the recent window",
            WindowKind::DayBefore => "the same time a day before",
            WindowKind::WeekBefore => "the same time a week before",
        }
    }
}

/// The figures of one counted window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCount {
    /// Which window.
    pub kind: WindowKind,
    /// Starts inside it.
    pub starts: u32,
    /// Starts expected during one refill time, from this window (rounded up).
    pub expected: u64,
}

/// The expected starts during one refill time at `now`: the largest expectation among the
/// windows the history covers (ties go to the earlier in [`WindowKind`] order), or `None` when
/// it covers none of them yet.
pub fn expected_starts(demand: &Demand, now: DateTime<Utc>) -> Option<WindowCount> {
    let windows = demand.forecast.windows(now);
    let refill_ms = i128::from(demand.forecast.refill_time.num_milliseconds());
    let window_ms = i128::from(demand.forecast.recent_window.num_milliseconds()).max(1);
    let candidates = [
        (WindowKind::Recent, windows.recent),
        (WindowKind::DayBefore, windows.day_before),
        (WindowKind::WeekBefore, windows.week_before),
    ];
    let mut best: Option<WindowCount> = None;
    for (kind, window) in candidates {
        let Some(window) = window else { continue };
        if window.start < demand.recorded_since {
            continue;
        }
        let starts = demand
            .starts
            .iter()
            .filter(|t| window.contains(**t))
            .count();
        let starts = u32::try_from(starts).unwrap_or(u32::MAX);
        let expected = match kind {
            // ceil(starts * refill / window), exactly, in integers.
            WindowKind::Recent => {
                let n = i128::from(starts) * refill_ms;
                u64::try_from((n + window_ms - 1) / window_ms).unwrap_or(u64::MAX)
            }
            WindowKind::DayBefore | WindowKind::WeekBefore => u64::from(starts),
        };
        if best.is_none_or(|b| expected > b.expected) {
            best = Some(WindowCount {
                kind,
                starts,
                expected,
            });
        }
    }
    best
}

/// The share of clicks a demand-driven pool is sized to serve from ready members while starts
/// arrive at random: 9 in 10.
pub const DEMAND_HIT_RATE_PERCENT: u32 = 90;

/// The members a pool needs so that starts arriving at random, `expected` of them per refill
/// time on average, find one ready [`DEMAND_HIT_RATE_PERCENT`] of the time, at most `at_most`.
///
/// A claimed member is replaced within one refill time, so the members being refilled are the
/// busy servers of an Erlang loss system with an offered load of `expected`, and a click that
/// finds every member refilling is a miss: the answer is the smallest `n` whose Erlang B
/// blocking probability `B(n, expected)` is at most 1 − the rate. Sizing the pool to the mean
/// alone serves far fewer: 6 members for 5.8 expected starts serve 75 % of the clicks, 9 serve
/// 93 %.
///
/// ```
/// use ttlab_pool::members_for;
///
/// assert_eq!(members_for(0, 30), 0);
/// assert_eq!(members_for(1, 30), 3);
/// assert_eq!(members_for(6, 30), 9);
/// assert_eq!(members_for(6, 5), 5);
/// ```
pub fn members_for(expected: u64, at_most: u64) -> u64 {
    if expected == 0 {
        return 0;
    }
    #[allow(clippy::cast_precision_loss)]
    let load = expected as f64;
    let miss = f64::from(100 - DEMAND_HIT_RATE_PERCENT) / 100.0;
    // B(0) = 1; B(n) = load·B(n−1) / (n + load·B(n−1)).
    let (mut blocking, mut n) = (1.0f64, 0u64);
    while blocking > miss && n < at_most {
        n += 1;
        #[allow(clippy::cast_precision_loss)]
        let servers = n as f64;
        blocking = load * blocking / (servers + load * blocking);
    }
    n
}

/// The starts expected during one refill time from the history so far, while it is shorter
/// than the recent window ([`expected_starts`] then counts no window): the starts since
/// `recorded_since`, scaled to one refill time, once the history covers at least one refill
/// time. A new deployment's pool can then grow with its first students instead of waiting for
/// a whole window; the planner never lets it shrink a pool below its starting size.
pub fn expected_starts_so_far(demand: &Demand, now: DateTime<Utc>) -> Option<WindowCount> {
    let covered = now.signed_duration_since(demand.recorded_since);
    if covered < demand.forecast.refill_time || covered >= demand.forecast.recent_window {
        return None;
    }
    let window = Window {
        start: demand.recorded_since,
        end: now,
    };
    let starts = demand
        .starts
        .iter()
        .filter(|t| window.contains(**t))
        .count();
    let starts = u32::try_from(starts).unwrap_or(u32::MAX);
    let refill_ms = i128::from(demand.forecast.refill_time.num_milliseconds());
    let covered_ms = i128::from(covered.num_milliseconds()).max(1);
    let n = i128::from(starts) * refill_ms;
    Some(WindowCount {
        kind: WindowKind::Recent,
        starts,
        expected: u64::try_from((n + covered_ms - 1) / covered_ms).unwrap_or(u64::MAX),
    })
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;

    fn at(h: u32, m: u32, s: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 12, 2, h, m, s).unwrap()
    }

    fn demand(starts: Vec<DateTime<Utc>>) -> Demand {
        Demand {
            forecast: Forecast::default(),
            starts,
            recorded_since: DateTime::<Utc>::MIN_UTC,
        }
    }

    #[test]
    fn forecast_durations_are_bounded() {
        let most = MAX_FORECAST_DURATION;
        assert!(Forecast::new(TimeDelta::seconds(1), most).is_ok());
        assert_eq!(
            Forecast::new(TimeDelta::zero(), most)
                .unwrap_err()
                .to_string(),
            "the refill time must be from 1 second to 12 hours, got 0 s"
        );
        assert_eq!(
            Forecast::new(TimeDelta::minutes(3), most + TimeDelta::seconds(1)),
            Err(PoolError::ForecastDuration {
                what: "recent window",
                seconds: 43_201
            })
        );
        assert!(Forecast::new(TimeDelta::seconds(-5), most).is_err());
        // At the longest durations the windows still do not overlap.
        let now = at(12, 0, 0);
        let w = Forecast::new(most, most).unwrap().windows(now);
        let (recent, day, week) = (
            w.recent.unwrap(),
            w.day_before.unwrap(),
            w.week_before.unwrap(),
        );
        assert!(week.end <= day.start && day.end <= recent.start, "{w:?}");
    }

    #[test]
    fn the_recent_rate_is_scaled_to_one_refill_time_and_rounded_up() {
        let now = at(12, 0, 0);
        // 10 starts in the last 15 minutes, 3-minute refill: 10 * 3 / 15 = 2.
        let starts = (0..10)
            .map(|i| now - TimeDelta::seconds(1 + 80 * i))
            .collect();
        let got = expected_starts(&demand(starts), now).unwrap();
        assert_eq!(
            got,
            WindowCount {
                kind: WindowKind::Recent,
                starts: 10,
                expected: 2
            }
        );
        // One start is enough to keep one member.
        let got = expected_starts(&demand(vec![now - TimeDelta::minutes(14)]), now).unwrap();
        assert_eq!(got.expected, 1);
        // The window is half-open: exactly 15 minutes ago counts, `now` itself does not.
        let edge = vec![now - TimeDelta::minutes(15), now];
        assert_eq!(expected_starts(&demand(edge), now).unwrap().starts, 1);
        // Nothing recent, nothing yesterday: zero, from the recent window.
        let got = expected_starts(&demand(vec![now - TimeDelta::hours(2)]), now).unwrap();
        assert_eq!((got.kind, got.expected), (WindowKind::Recent, 0));
    }

    #[test]
    fn yesterdays_class_is_expected_one_refill_time_ahead() {
        // 30 students started yesterday from 9:00:00, one every 10 s.
        let starts: Vec<_> = (0..30)
            .map(|i| at(9, 0, 0) - DAY + TimeDelta::seconds(10 * i))
            .collect();
        let d = demand(starts);
        // Just over a refill time before 9:00 the window reaches 9:00:00 yesterday.
        let got = expected_starts(&d, at(8, 57, 1)).unwrap();
        assert_eq!(
            (got.kind, got.starts, got.expected),
            (WindowKind::DayBefore, 1, 1)
        );
        assert_eq!(expected_starts(&d, at(8, 57, 0)).unwrap().expected, 0);
        // At 9:00 the next three minutes of yesterday held 18 starts.
        assert_eq!(expected_starts(&d, at(9, 0, 0)).unwrap().expected, 18);
    }

    #[test]
    fn last_week_counts_and_the_largest_expectation_wins() {
        let now = at(9, 0, 0);
        let mut starts: Vec<_> = (0..5).map(|i| now - WEEK + TimeDelta::seconds(i)).collect();
        starts.extend((0..3).map(|i| now - DAY + TimeDelta::seconds(i)));
        let got = expected_starts(&demand(starts), now).unwrap();
        assert_eq!((got.kind, got.expected), (WindowKind::WeekBefore, 5));
    }

    #[test]
    fn windows_before_the_recorded_history_are_not_counted() {
        let now = at(9, 0, 0);
        let starts = vec![now - DAY + TimeDelta::seconds(5)];
        let mut d = demand(starts);
        // History from two days ago: yesterday counts, last week does not.
        d.recorded_since = now - TimeDelta::days(2);
        assert_eq!(
            expected_starts(&d, now).unwrap().kind,
            WindowKind::DayBefore
        );
        // History from five minutes ago: no window is covered.
        d.recorded_since = now - TimeDelta::minutes(5);
        assert_eq!(expected_starts(&d, now), None);
        // History from exactly the recent window's start: it counts.
        d.recorded_since = now - DEFAULT_RECENT_WINDOW;
        assert_eq!(expected_starts(&d, now).unwrap().kind, WindowKind::Recent);
    }

    #[test]
    fn instants_at_the_edge_of_time_do_not_panic() {
        let d = demand(vec![DateTime::<Utc>::MIN_UTC]);
        let got = expected_starts(&d, DateTime::<Utc>::MIN_UTC);
        assert_eq!(got, None);
        let got = expected_starts(&d, DateTime::<Utc>::MAX_UTC).unwrap();
        assert_eq!(got.expected, 0);
    }

    #[test]
    fn a_pool_sized_by_erlang_b_serves_nine_clicks_in_ten() {
        // The members for each offered load, against the table of Erlang B.
        for (expected, members) in [(1, 3), (2, 4), (4, 7), (6, 9), (10, 13), (20, 23)] {
            assert_eq!(members_for(expected, 1_000), members, "{expected}");
        }
        // Never more than asked, and nothing for no starts.
        assert_eq!(members_for(20, 12), 12);
        assert_eq!(members_for(0, 12), 0);
        // A huge load stops at the bound.
        assert_eq!(members_for(u64::MAX, 40), 40);
    }

    #[test]
    fn a_short_history_counts_once_it_covers_a_refill_time() {
        let now = at(9, 0, 0);
        // Six starts in the 4 minutes since the history began, 3-minute refill: 6 * 3 / 4 = 4.5.
        let starts = (0..6)
            .map(|i| now - TimeDelta::seconds(10 + 30 * i))
            .collect();
        let mut d = demand(starts);
        d.recorded_since = now - TimeDelta::minutes(4);
        assert_eq!(expected_starts(&d, now), None);
        assert_eq!(
            expected_starts_so_far(&d, now),
            Some(WindowCount {
                kind: WindowKind::Recent,
                starts: 6,
                expected: 5
            })
        );
        // Shorter than a refill time: too little to go by.
        d.recorded_since = now - TimeDelta::minutes(2);
        assert_eq!(expected_starts_so_far(&d, now), None);
        // A whole window: the ordinary forecast takes over.
        d.recorded_since = now - DEFAULT_RECENT_WINDOW;
        assert_eq!(expected_starts_so_far(&d, now), None);
    }
}
