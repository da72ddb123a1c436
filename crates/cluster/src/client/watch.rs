//! Following one object by name with kube-rs' runtime [`watcher`]: a list, then a watch from
//! its resourceVersion, re-opened where it stopped when the server ends it and re-listed when
//! that version has expired (410), as client-go's reflector does. Failures come out of the
//! stream as errors while it recovers by itself; [`WaitBackoff`] paces the recovery, and
//! [`watch_error`] says whether an error is one to ride out (transient) or to end the wait.
//!
//! The watcher's calls run outside the client's semaphore and request timeout: a wait is
//! bounded as a whole by its caller's timeout.

use std::fmt::Debug;
use std::time::Duration;

use futures::Stream;
use kube::Resource;
use kube::api::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use serde::de::DeserializeOwned;
use ttlab_background::{Backoff, Pauses};

use crate::ClusterError;

/// The first pause after a failure, and the longest.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long the server may hold one watch open before it is re-opened.
pub(super) const WATCH_SECONDS: u32 = 290;

/// Pauses between recoveries of a wait's watch: doubling from 100 ms to 5 s, each drawn
/// between half and all of the current pause (so many waits recovering at once spread out),
/// back to the start after any event.
const WAIT_BACKOFF: Backoff = Backoff::doubling(FIRST_BACKOFF, MAX_BACKOFF);

/// [`WAIT_BACKOFF`]'s pauses, as kube-rs' watcher takes them.
#[derive(Debug)]
pub(super) struct WaitBackoff(Pauses);

impl Default for WaitBackoff {
    fn default() -> Self {
        Self(WAIT_BACKOFF.pauses())
    }
}

impl Iterator for WaitBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.0.next()
    }
}

impl kube::runtime::utils::Backoff for WaitBackoff {
    fn reset(&mut self) {
        self.0.reset();
    }
}

/// The events of the object `name` of `api`, by watching it (a `metadata.name` field
/// selector), with [`WaitBackoff`] between recoveries.
pub(super) fn watch_named<K>(
    api: Api<K>,
    name: &str,
) -> impl Stream<Item = Result<Event<K>, watcher::Error>> + Send
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
{
    let config = watcher::Config::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(WATCH_SECONDS);
    watcher::watcher(api, config).backoff(WaitBackoff::default())
}

/// What a watcher's failure means to a wait: [`ClusterError::is_retryable`] ones (a 5xx, 429,
/// a lost connection, an expired resourceVersion) are ridden out, the watcher recovering by
/// itself; any other ends the wait.
pub(super) fn watch_error(what: &str, err: watcher::Error) -> ClusterError {
    match err {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => ClusterError::from_kube(e),
        watcher::Error::WatchError(status) => {
            ClusterError::from_status(status.code, &status.reason, &status.message)
        }
        watcher::Error::NoResourceVersion => ClusterError::Unexpected {
            message: format!("{what}: the list carried no resourceVersion to watch from"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_up_to_five_seconds_with_jitter_and_start_over_after_a_reset() {
        use kube::runtime::utils::Backoff as _;
        let mut b = WaitBackoff::default();
        let pauses: Vec<Duration> = b.by_ref().take(10).collect();
        let mut current = FIRST_BACKOFF;
        for p in &pauses {
            assert!(*p >= current / 2 && *p <= current, "{p:?} for {current:?}");
            current = (current * 2).min(MAX_BACKOFF);
        }
        assert!(pauses.iter().skip(7).all(|p| *p >= MAX_BACKOFF / 2));
        b.reset();
        assert!(b.next().unwrap() <= FIRST_BACKOFF);
    }

    #[test]
    fn an_expired_watch_is_ridden_out_and_a_refusal_is_not() {
        use kube::core::Status;
        let expired = watch_error(
            "watch",
            watcher::Error::WatchError(Box::new(
                Status::failure("too old", "Expired").with_code(410),
            )),
        );
        assert!(expired.is_retryable(), "{expired:?}");
        let refused = watch_error(
            "watch",
            watcher::Error::WatchError(Box::new(
                Status::failure("cannot watch", "Forbidden").with_code(403),
            )),
        );
        assert!(!refused.is_retryable(), "{refused:?}");
    }
}
