use chrono::TimeDelta;

/// Settings the planner refuses. The planner itself ([`plan`](crate::plan)) never fails: every
/// value it takes has been validated by one of the constructors that return this error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// The three sizes are out of order: the rule is `min <= size <= max`.
    #[error("pool sizes must satisfy min <= size <= max; got min {min}, size {size}, max {max}")]
    SizeOrder {
        /// The demand-driven lower bound.
        min: u32,
        /// The fixed size (or the starting point of a demand-driven pool).
        size: u32,
        /// The upper bound.
        max: u32,
    },
    /// The age limit of a member is zero or negative.
    #[error("the pool's max age must be at least one second, got {seconds} s")]
    MaxAge {
        /// The age limit given, in whole seconds.
        seconds: i64,
    },
    /// A forecast duration (refill time, recent window) is outside one second to 12 hours.
    #[error("the {what} must be from 1 second to 12 hours, got {seconds} s")]
    ForecastDuration {
        /// Which duration: `refill time` or `recent window`.
        what: &'static str,
        /// The duration given, in whole seconds.
        seconds: i64,
    },
}

impl PoolError {
    pub(crate) fn forecast(what: &'static str, d: TimeDelta) -> Self {
        Self::ForecastDuration {
            what,
            seconds: d.num_seconds(),
        }
    }
}
