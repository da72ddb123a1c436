//! The warnings written into the terminal before the deadline: when each falls due (once,
//! re-armed when an extension moves the deadline back past it), and its words.

use std::time::Duration;

/// The warnings before a deadline: which were given, re-armed when an extension moves the
/// deadline back past them.
pub(super) struct Warnings {
    /// Lead time before the deadline, and whether its warning was given.
    leads: Vec<(Duration, bool)>,
}

impl Warnings {
    /// The warnings of `leads`, those of `given` already given (to an earlier connection).
    pub(super) fn new(leads: &[Duration], given: &[Duration]) -> Self {
        Self {
            leads: leads
                .iter()
                .filter(|l| !l.is_zero())
                .map(|&l| (l, given.contains(&l)))
                .collect(),
        }
    }

    /// With `remaining` before the deadline: the warnings due now (one line for all that fell
    /// due together; empty when none is). Marks them given.
    pub(super) fn due(&mut self, remaining: Duration) -> Vec<Duration> {
        let mut due = Vec::new();
        for (lead, given) in &mut self.leads {
            if remaining > *lead {
                *given = false;
            } else if !*given {
                *given = true;
                due.push(*lead);
            }
        }
        due
    }

    /// How long until the next warning falls due, with `remaining` before the deadline.
    pub(super) fn next_in(&self, remaining: Duration) -> Option<Duration> {
        self.leads
            .iter()
            .filter(|(lead, given)| !given && remaining > *lead)
            .map(|(lead, _)| remaining - *lead)
            .min()
    }
}

/// The warning line for `remaining` time left (whole minutes, rounded up).
pub(super) fn warning_text(remaining: Duration) -> String {
    let minutes = remaining.as_secs().div_ceil(60).max(1);
    if minutes == 1 {
        "1 minute left in this lab. Save your work now: the lab closes when the time is up."
            .to_owned()
    } else {
        format!(
            "{minutes} minutes left in this lab. Save your work, or extend the lab on the page."
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn warnings_fall_due_once_each_and_an_extension_re_arms_them() {
        let mut w = Warnings::new(&[5 * MIN, MIN], &[]);
        assert!(w.due(10 * MIN).is_empty());
        assert_eq!(w.next_in(10 * MIN), Some(5 * MIN));
        assert_eq!(w.due(5 * MIN), vec![5 * MIN]);
        assert!(w.due(5 * MIN - Duration::from_secs(1)).is_empty());
        assert_eq!(w.next_in(4 * MIN), Some(3 * MIN));
        assert_eq!(w.due(MIN), vec![MIN]);
        assert_eq!(w.next_in(MIN / 2), None);
        // Extended by ten minutes: both come again.
        assert!(w.due(10 * MIN).is_empty());
        assert_eq!(w.next_in(10 * MIN), Some(5 * MIN));
        // Opened with 3 minutes left: the 5-minute warning at once, then the last one.
        let mut w = Warnings::new(&[5 * MIN, MIN], &[]);
        assert_eq!(w.due(3 * MIN), vec![5 * MIN]);
        assert_eq!(w.next_in(3 * MIN), Some(2 * MIN));
        // Opened with 30 s left: one line for both.
        let mut w = Warnings::new(&[5 * MIN, MIN], &[]);
        assert_eq!(w.due(MIN / 2), vec![5 * MIN, MIN]);
    }

    #[test]
    fn warnings_already_given_are_not_given_again_until_an_extension_re_arms_them() {
        // Reconnected with 3 minutes left after the page was shown the 5-minute warning.
        let mut w = Warnings::new(&[5 * MIN, MIN], &[5 * MIN]);
        assert!(w.due(3 * MIN).is_empty());
        assert_eq!(w.next_in(3 * MIN), Some(2 * MIN));
        assert_eq!(w.due(MIN), vec![MIN]);
        // Extended: the 5-minute warning comes again.
        let mut w = Warnings::new(&[5 * MIN, MIN], &[5 * MIN]);
        assert!(w.due(10 * MIN).is_empty());
        assert_eq!(w.due(5 * MIN), vec![5 * MIN]);
    }

    #[test]
    fn warning_lines_say_whole_minutes_rounded_up() {
        assert!(warning_text(5 * MIN).starts_with("5 minutes left"));
        assert!(warning_text(4 * MIN + Duration::from_secs(1)).starts_with("5 minutes left"));
        assert!(warning_text(MIN).starts_with("1 minute left"));
        assert!(warning_text(Duration::from_secs(3)).starts_with("1 minute left"));
    }
}
