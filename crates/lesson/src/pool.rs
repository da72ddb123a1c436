//! The `pool:` section of a VM lesson: prepared environments kept ready for students.

use std::time::Duration;

use serde::{Deserialize, Deserializer};
use ttlab_pool::{PoolError, PoolSettings};

/// The most members a lesson's pool may keep (`size` and `max`).
pub const MAX_POOL_SIZE: u32 = 50;
/// The default age limit of a pool member: 240 minutes.
pub const DEFAULT_POOL_MAX_AGE: Duration = Duration::from_secs(240 * 60);
/// The shortest age limit a lesson may give its members: 10 minutes.
pub const MIN_POOL_MAX_AGE: Duration = Duration::from_secs(10 * 60);
/// The longest age limit a lesson may give its members: 1440 minutes (one day).
pub const MAX_POOL_MAX_AGE: Duration = Duration::from_secs(1440 * 60);

/// A lesson's warm pool, validated: `min <= size <= max <= 50`, `max >= 1`, a fixed pool has a
/// `size` of at least 1, and the age limit is 10 to 1440 minutes.
///
/// A member is a whole lab (every node of the lesson), prepared and waiting for a click. The
/// planner (`ttlab-pool`) takes these settings through
/// [`PoolSettings::try_from`](ttlab_pool::PoolSettings); an operator can override them.
///
/// ```
/// use ttlab_lesson::parse_lesson;
///
/// let lesson = parse_lesson("
/// id: hello
/// title: Hello
/// runtime: vm
/// image: quay.io/containerdisks/debian:12
/// pool:
///   size: 4
///   demand: true
///   max: 8
/// ").unwrap();
/// let pool = lesson.pool.unwrap();
/// assert_eq!((pool.min, pool.size, pool.max), (0, 4, 8));
/// assert_eq!(pool.max_age.as_secs(), 240 * 60);
/// let settings = ttlab_pool::PoolSettings::try_from(&pool).unwrap();
/// assert!(settings.demand_driven() && !settings.paused());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSpec {
    /// Members kept (ready or preparing) by a fixed pool; the starting point of a
    /// demand-driven one while there is no start history.
    pub size: u32,
    /// The lower bound of a demand-driven size (default 0).
    pub min: u32,
    /// The upper bound of a demand-driven size (default `size`).
    pub max: u32,
    /// A member created this long ago is retired and replaced (default 240 minutes).
    pub max_age: Duration,
    /// Whether the size follows recent starts, within `min..=max` (default false).
    pub demand: bool,
    /// Whether the pool starts paused: nothing created, ready members still served (default
    /// false).
    pub paused: bool,
}

impl TryFrom<&PoolSpec> for PoolSettings {
    type Error = PoolError;

    /// The planner's settings. Fails only for a hand-built [`PoolSpec`] that breaks the rules a
    /// loaded one always keeps.
    fn try_from(spec: &PoolSpec) -> Result<Self, PoolError> {
        let max_age = chrono::TimeDelta::from_std(spec.max_age)
            .map_err(|_| PoolError::MaxAge { seconds: i64::MAX })?;
        Ok(PoolSettings::new(spec.min, spec.size, spec.max, max_age)?
            .with_demand(spec.demand)
            .with_paused(spec.paused))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    size: u32,
    min: Option<u32>,
    max: Option<u32>,
    max_age_minutes: Option<u64>,
    #[serde(default)]
    demand: bool,
    #[serde(default)]
    paused: bool,
}

impl TryFrom<RawPool> for PoolSpec {
    type Error = String;

    fn try_from(raw: RawPool) -> Result<Self, String> {
        let size = raw.size;
        let min = raw.min.unwrap_or(0);
        let max = raw.max.unwrap_or(size);
        if size > MAX_POOL_SIZE {
            return Err(format!(
                "`pool.size` is {size}; the most allowed is {MAX_POOL_SIZE}"
            ));
        }
        if max > MAX_POOL_SIZE {
            return Err(format!(
                "`pool.max` is {max}; the most allowed is {MAX_POOL_SIZE}"
            ));
        }
        if min > size {
            return Err(format!(
                "`pool.min` ({min}) is above `pool.size` ({size}): the rule is min <= size <= max"
            ));
        }
        if size > max {
            return Err(format!(
                "`pool.size` ({size}) is above `pool.max` ({max}): the rule is min <= size <= max"
            ));
        }
        if size == 0 && !raw.demand {
            return Err(
                "`pool.size` is 0 and `pool.demand` is false: a fixed pool of 0 never holds a \
                 member; give a `size`, set `demand: true`, or leave `pool` out"
                    .to_owned(),
            );
        }
        if max == 0 {
            return Err(
                "`pool.max` is 0: such a pool never holds a member; give a `size` (and a `max` \
                 for a demand-driven pool), or leave `pool` out"
                    .to_owned(),
            );
        }
        let max_age = match raw.max_age_minutes {
            None => DEFAULT_POOL_MAX_AGE,
            Some(m) => {
                let age = Duration::from_secs(m.saturating_mul(60));
                if !(MIN_POOL_MAX_AGE..=MAX_POOL_MAX_AGE).contains(&age) {
                    return Err(format!(
                        "`pool.max_age_minutes` is {m}; it must be from 10 to 1440 (one day)"
                    ));
                }
                age
            }
        };
        Ok(Self {
            size,
            min,
            max,
            max_age,
            demand: raw.demand,
            paused: raw.paused,
        })
    }
}

impl<'de> Deserialize<'de> for PoolSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::validated_map::<D, RawPool, PoolSpec>(d, "a pool (a mapping)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(yaml: &str) -> Result<PoolSpec, String> {
        serde_norway::from_str::<PoolSpec>(yaml).map_err(|e| e.to_string())
    }

    #[test]
    fn defaults_fill_in_around_the_size() {
        let p = pool("size: 3").unwrap();
        assert_eq!(
            p,
            PoolSpec {
                size: 3,
                min: 0,
                max: 3,
                max_age: DEFAULT_POOL_MAX_AGE,
                demand: false,
                paused: false,
            }
        );
        let p = pool("{size: 4, min: 1, max: 8, max_age_minutes: 10, demand: true, paused: true}")
            .unwrap();
        assert_eq!((p.min, p.size, p.max), (1, 4, 8));
        assert_eq!(p.max_age, MIN_POOL_MAX_AGE);
        assert!(p.demand && p.paused);
        assert_eq!(pool("{size: 0, max: 50, demand: true}").unwrap().max, 50);
        assert_eq!(
            pool("{size: 1, max_age_minutes: 1440}").unwrap().max_age,
            MAX_POOL_MAX_AGE
        );
    }

    #[test]
    fn every_bound_is_refused_naming_its_field() {
        for (yaml, why) in [
            ("size: 51", "`pool.size` is 51; the most allowed is 50"),
            (
                "{size: 4, max: 51}",
                "`pool.max` is 51; the most allowed is 50",
            ),
            (
                "{size: 4, min: 5, max: 8}",
                "`pool.min` (5) is above `pool.size` (4)",
            ),
            (
                "{size: 4, max: 3}",
                "`pool.size` (4) is above `pool.max` (3)",
            ),
            ("{size: 0, demand: true}", "`pool.max` is 0"),
            ("size: 0", "`pool.size` is 0 and `pool.demand` is false"),
            (
                "{size: 1, max_age_minutes: 9}",
                "`pool.max_age_minutes` is 9; it must be from 10 to 1440",
            ),
            (
                "{size: 1, max_age_minutes: 1441}",
                "`pool.max_age_minutes` is 1441",
            ),
            (
                "{size: 1, max_age_minutes: 18446744073709551615}",
                "must be from 10 to 1440",
            ),
            ("{size: -1}", "expected u32"),
            ("{min: 1}", "missing field `size`"),
            ("{size: 1, colour: red}", "unknown field `colour`"),
            ("{size: 1, demand: maybe}", "invalid type"),
        ] {
            let err = pool(yaml).unwrap_err();
            assert!(err.contains(why), "{yaml}: {err}");
        }
    }

    #[test]
    fn a_spec_becomes_the_planners_settings() {
        let p = pool("{size: 2, min: 1, max: 5, max_age_minutes: 60, demand: true}").unwrap();
        let s = PoolSettings::try_from(&p).unwrap();
        assert_eq!((s.min(), s.size(), s.max()), (1, 2, 5));
        assert_eq!(s.max_age(), chrono::TimeDelta::minutes(60));
        assert!(s.demand_driven() && !s.paused());
        let bad = PoolSpec { min: 3, ..p };
        assert!(matches!(
            PoolSettings::try_from(&bad),
            Err(PoolError::SizeOrder { .. })
        ));
    }

    proptest::proptest! {
        /// A section loads exactly when its rules hold, and every loaded one is accepted by
        /// the planner.
        #[test]
        fn what_loads_is_what_the_rules_allow_and_the_planner_accepts(
            size in 0..=60u32,
            min in proptest::option::of(0..=60u32),
            max in proptest::option::of(0..=60u32),
            age in proptest::option::of(0..=2000u64),
            demand in proptest::bool::ANY,
        ) {
            let mut yaml = format!("{{size: {size}, demand: {demand}");
            if let Some(m) = min { yaml += &format!(", min: {m}"); }
            if let Some(m) = max { yaml += &format!(", max: {m}"); }
            if let Some(a) = age { yaml += &format!(", max_age_minutes: {a}"); }
            yaml += "}";
            let (lo, hi) = (min.unwrap_or(0), max.unwrap_or(size));
            let allowed = lo <= size
                && size <= hi
                && (1..=MAX_POOL_SIZE).contains(&hi)
                && (size >= 1 || demand)
                && age.is_none_or(|a| (10..=1440).contains(&a));
            match pool(&yaml) {
                Ok(spec) => {
                    proptest::prop_assert!(allowed, "{yaml} loaded");
                    let s = PoolSettings::try_from(&spec).unwrap();
                    proptest::prop_assert_eq!((s.min(), s.size(), s.max()), (lo, size, hi));
                    proptest::prop_assert_eq!(s.demand_driven(), demand);
                }
                Err(e) => proptest::prop_assert!(!allowed, "{yaml}: {e}"),
            }
        }
    }
}
