//! What an operator or a lesson author says about a pool: its sizes, the members' age limit,
//! whether the size follows demand, whether it is paused.

use chrono::TimeDelta;

use crate::PoolError;

/// The default age limit of a member: 240 minutes. An older member is retired and replaced,
/// so a golden-image update or a drifting guest clock reaches the pool within four hours.
pub const DEFAULT_MAX_AGE: TimeDelta = TimeDelta::minutes(240);

/// A pool's settings, validated: `min <= size <= max` and a positive age limit.
///
/// - `size`: the members kept (ready or preparing) when the pool is not demand-driven, and the
///   starting point of a demand-driven pool while there is no start history yet.
/// - `min`, `max`: the bounds of a demand-driven size (`max` also bounds the report's target).
/// - `max_age`: a member whose `created_at` is at least this long ago is retired.
/// - `demand_driven`: the size follows recent starts ([`Demand`](crate::Demand)).
/// - `paused`: nothing is created and nothing is retired for size; members still leave when
///   they are too old, stuck, or when capacity is short.
///
/// ```
/// use chrono::TimeDelta;
/// use ttlab_pool::{PoolError, PoolSettings};
///
/// let s = PoolSettings::new(0, 4, 8, TimeDelta::minutes(240)).unwrap().with_demand(true);
/// assert_eq!((s.min(), s.size(), s.max()), (0, 4, 8));
/// assert!(s.demand_driven() && !s.paused());
/// assert!(matches!(
///     PoolSettings::new(5, 4, 8, TimeDelta::minutes(240)),
///     Err(PoolError::SizeOrder { .. })
/// ));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSettings {
    min: u32,
    size: u32,
    max: u32,
    max_age: TimeDelta,
    demand_driven: bool,
    paused: bool,
}

impl PoolSettings {
    /// A fixed-size, running (not paused) pool. Fails unless `min <= size <= max` and
    /// `max_age` is at least one second.
    pub fn new(min: u32, size: u32, max: u32, max_age: TimeDelta) -> Result<Self, PoolError> {
        if !(min <= size && size <= max) {
            return Err(PoolError::SizeOrder { min, size, max });
        }
        if max_age < TimeDelta::seconds(1) {
            return Err(PoolError::MaxAge {
                seconds: max_age.num_seconds(),
            });
        }
        Ok(Self {
            min,
            size,
            max,
            max_age,
            demand_driven: false,
            paused: false,
        })
    }

    /// The same settings, with the size following demand (`true`) or fixed (`false`).
    pub fn with_demand(self, demand_driven: bool) -> Self {
        Self {
            demand_driven,
            ..self
        }
    }

    /// The same settings, paused (`true`) or running (`false`).
    pub fn with_paused(self, paused: bool) -> Self {
        Self { paused, ..self }
    }

    /// The demand-driven lower bound.
    pub fn min(&self) -> u32 {
        self.min
    }

    /// The fixed size, or a demand-driven pool's starting point.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// The upper bound.
    pub fn max(&self) -> u32 {
        self.max
    }

    /// The age limit of a member (from its `created_at`).
    pub fn max_age(&self) -> TimeDelta {
        self.max_age
    }

    /// Whether the size follows recent starts.
    pub fn demand_driven(&self) -> bool {
        self.demand_driven
    }

    /// Whether the pool is paused.
    pub fn paused(&self) -> bool {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_must_be_ordered_and_the_age_positive() {
        let age = DEFAULT_MAX_AGE;
        assert!(PoolSettings::new(0, 0, 0, age).is_ok());
        assert!(PoolSettings::new(2, 2, 2, age).is_ok());
        assert_eq!(
            PoolSettings::new(3, 2, 4, age),
            Err(PoolError::SizeOrder {
                min: 3,
                size: 2,
                max: 4
            })
        );
        assert_eq!(
            PoolSettings::new(0, 5, 4, age).unwrap_err().to_string(),
            "pool sizes must satisfy min <= size <= max; got min 0, size 5, max 4"
        );
        assert_eq!(
            PoolSettings::new(0, 1, 1, TimeDelta::zero()),
            Err(PoolError::MaxAge { seconds: 0 })
        );
        assert!(PoolSettings::new(0, 1, 1, TimeDelta::milliseconds(999)).is_err());
        let s = PoolSettings::new(0, 1, 1, age).unwrap();
        assert!(!s.demand_driven() && !s.paused());
        assert!(s.with_paused(true).paused());
        assert!(!s.with_paused(true).with_paused(false).paused());
    }
}
