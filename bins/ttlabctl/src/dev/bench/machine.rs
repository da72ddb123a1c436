//! What the machine itself did while a benchmark phase ran, from `/proc/stat`: how busy its
//! CPUs were, and how much time the hypervisor took from them (steal). A latency figure
//! measured on a virtual machine whose CPUs were stolen from is the host's as much as the
//! program's; printing the two side by side tells them apart.
//!
//! The steal share is read from the hypervisor's clock and is exact. User, system and idle
//! are as the kernel's periodic tick sampled them (tick accounting: whatever ran at each
//! tick is charged the whole tick): a load paced on a fixed period that sleeps between its
//! requests can fall between ticks and read as idle, so those three are a rough guide only,
//! and the line says so.

use std::fmt;

/// The aggregate `cpu` line of `/proc/stat`, in clock ticks since boot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CpuTimes {
    /// user + nice.
    user: u64,
    /// system + irq + softirq.
    system: u64,
    /// idle + iowait.
    idle: u64,
    /// Time the hypervisor ran something else while this machine's CPUs were runnable.
    steal: u64,
}

impl CpuTimes {
    /// Reads `/proc/stat` now (`None` where there is none, e.g. not Linux).
    pub(crate) fn now() -> Option<Self> {
        Self::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The aggregate `cpu` line of a `/proc/stat` text.
    pub(crate) fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let f: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        if f.len() < 4 {
            return None;
        }
        // Older kernels end the line before iowait, irq, softirq or steal: those read as 0.
        let at = |i: usize| f.get(i).copied().unwrap_or(0);
        Some(Self {
            user: at(0) + at(1),
            system: at(2) + at(5) + at(6),
            idle: at(3) + at(4),
            steal: at(7),
        })
    }

    /// What happened between `self` (earlier) and `later`.
    pub(crate) fn until(self, later: Self) -> Load {
        Load {
            user: later.user.saturating_sub(self.user),
            system: later.system.saturating_sub(self.system),
            idle: later.idle.saturating_sub(self.idle),
            steal: later.steal.saturating_sub(self.steal),
        }
    }
}

/// The machine's CPU time over an interval, by what it went to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Load {
    user: u64,
    system: u64,
    idle: u64,
    steal: u64,
}

impl Load {
    fn total(&self) -> u64 {
        self.user + self.system + self.idle + self.steal
    }

    /// Percent of all CPU time taken by the hypervisor.
    pub(crate) fn steal_percent(&self) -> f64 {
        percent(self.steal, self.total())
    }
}

fn percent(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

impl fmt::Display for Load {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.total();
        write!(
            f,
            "machine meanwhile: stolen by the hypervisor {:.0} %; as the kernel tick sampled it, user {:.0} %, system {:.0} %, idle {:.0} %",
            percent(self.steal, t),
            percent(self.user, t),
            percent(self.system, t),
            percent(self.idle, t)
        )
    }
}

/// Measures the machine's load over `phase`, returning its output and the load (`None` where
/// `/proc/stat` cannot be read).
pub(crate) async fn during<T>(phase: impl Future<Output = T>) -> (T, Option<Load>) {
    let before = CpuTimes::now();
    let out = phase.await;
    let load = before.zip(CpuTimes::now()).map(|(a, b)| a.until(b));
    (out, load)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EARLIER: &str =
        "cpu  100 10 50 800 5 1 4 30 0 0\ncpu0 50 5 25 400 2 0 2 15 0 0\nintr 1\n";
    const LATER: &str = "cpu  160 10 80 900 5 3 6 90 0 0\ncpu0 80 5 40 450 2 1 3 45 0 0\nintr 2\n";

    #[test]
    fn the_aggregate_line_is_read_and_split_by_what_the_time_went_to() {
        let a = CpuTimes::parse(EARLIER).unwrap();
        assert_eq!(
            a,
            CpuTimes {
                user: 110,
                system: 55,
                idle: 805,
                steal: 30
            }
        );
        let load = a.until(CpuTimes::parse(LATER).unwrap());
        // 60 user, 34 system, 100 idle, 60 stolen: 254 ticks.
        assert!((load.steal_percent() - 100.0 * 60.0 / 254.0).abs() < 1e-9);
        assert_eq!(
            load.to_string(),
            "machine meanwhile: stolen by the hypervisor 24 %; as the kernel tick sampled it, user 24 %, system 13 %, idle 39 %"
        );
    }

    #[test]
    fn a_text_without_the_cpu_line_reads_as_nothing() {
        assert_eq!(CpuTimes::parse("cpu0 1 2 3 4\n"), None);
        assert_eq!(CpuTimes::parse("cpu  1 2\n"), None);
        assert_eq!(CpuTimes::parse("cpu  a b c d\n"), None);
    }

    #[test]
    fn an_interval_with_no_ticks_is_zero_percent_not_a_division_by_zero() {
        let a = CpuTimes::parse(EARLIER).unwrap();
        assert_eq!(a.until(a).steal_percent(), 0.0);
    }
}
