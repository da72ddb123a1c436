//! The one error type of this crate, and the mapping from kube-rs errors onto it.

use std::time::Duration;

use kube::client::UpgradeConnectionError;

use crate::types::VmiState;

/// Why a call to the cluster failed, in the terms a caller decides on.
///
/// Mapped from the Kubernetes `Status` (its HTTP code and `reason`), not from message text,
/// except for quota rejections, which the API server reports as a plain 403 `Forbidden`: its
/// message says `exceeded quota` when the quota is used up, and `status unknown for quota`
/// while the quota controller has not counted the quota (or the resource) yet.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClusterError {
    /// The object does not exist (404).
    #[error("not found: {message}")]
    NotFound {
        /// The server's message, or what was looked for.
        message: String,
    },
    /// The service account may not do this (403, or 401: the credentials were refused).
    #[error("forbidden: {message}")]
    Forbidden {
        /// The server's message.
        message: String,
    },
    /// The object already exists, or was changed concurrently (409).
    #[error("conflict: {message}")]
    Conflict {
        /// The server's message.
        message: String,
    },
    /// A namespace ResourceQuota refused the object (403 whose message says `exceeded quota`).
    #[error("quota exceeded: {message}")]
    QuotaExceeded {
        /// The server's message (names the quota, what was requested, used and limited).
        message: String,
    },
    /// A namespace ResourceQuota refused the object only because the quota controller has not
    /// counted it yet (403 whose message says `status unknown for quota`): a quota or a
    /// resource type that appeared moments ago. Nothing was created; the same create succeeds
    /// once the controller has counted, usually within seconds.
    #[error("quota not counted yet: {message}")]
    QuotaPending {
        /// The server's message (names the quota and the resource).
        message: String,
    },
    /// The request or object is malformed (422 `Invalid`, 400 `BadRequest`), or was refused
    /// before it was sent because it could not be a valid object of the expected kind.
    #[error("invalid: {message}")]
    Invalid {
        /// The server's (or the client-side check's) message.
        message: String,
    },
    /// The VMI exists but its console cannot be opened yet (400 from the console subresource
    /// while the VMI is not running). Retry after a second, as `virtctl` does.
    #[error("console of VMI {name} not available yet: {message}")]
    ConsoleNotReady {
        /// The VMI.
        name: String,
        /// The server's message.
        message: String,
    },
    /// A port of the VMI's guest cannot be reached through the `portforward` subresource now:
    /// the VMI has no address yet (400: not running, or ended), is paused (409), or nothing
    /// answers on the port (500 `dialing VM: …`: the guest is off, or its program has not
    /// started). Retry later; a VMI that has ended will keep refusing.
    #[error("port {port} of VMI {name} unreachable: {message}")]
    PortUnreachable {
        /// The VMI.
        name: String,
        /// The guest's port.
        port: u16,
        /// The server's message.
        message: String,
    },
    /// The API server could not answer now: a timeout, a 5xx, 429 Too Many Requests, a
    /// connection error, or an expired list continuation. The same call may succeed later.
    #[error("transient: {message}")]
    Transient {
        /// What went wrong.
        message: String,
    },
    /// The VMI did not reach `Running` in time. Carries the last state seen (for instance
    /// `Pending` with a `FailedPvcNotFound` condition), or `None` if no VMI ever appeared, and
    /// what went wrong with the watch meanwhile, if anything did.
    #[error("VMI {name} not Running after {waited:?}; last seen: {}{}", describe_last(last.as_deref()), describe_faults(watch_faults.as_deref()))]
    WaitTimedOut {
        /// The VMI waited for.
        name: String,
        /// How long the wait lasted.
        waited: Duration,
        /// The last state observed.
        last: Option<Box<VmiState>>,
        /// How often listing or watching the VMI failed transiently during the wait, and the
        /// last such failure (`the watch failed 3 times (last: HTTP 500: …)`); `None` if it
        /// never did.
        watch_faults: Option<String>,
    },
    /// The VMI ended (`Succeeded` or `Failed`) while it was being waited for: it will not
    /// become `Running` by itself.
    #[error("VMI {name} ended before it was Running: {}", state.describe())]
    VmiEnded {
        /// The VMI.
        name: String,
        /// Its final state.
        state: Box<VmiState>,
    },
    /// The server answered something this client does not understand (an undecodable body,
    /// an unexpected status code, a failed WebSocket handshake).
    #[error("unexpected answer from the API server: {message}")]
    Unexpected {
        /// What was unexpected.
        message: String,
    },
    /// The client configuration (in-cluster environment or kubeconfig) could not be loaded.
    #[error("cannot configure the Kubernetes client: {message}")]
    Config {
        /// Why.
        message: String,
    },
}

fn describe_last(last: Option<&VmiState>) -> String {
    match last {
        Some(state) => state.describe(),
        None => "no VMI".to_owned(),
    }
}

fn describe_faults(faults: Option<&str>) -> String {
    faults.map(|f| format!("; {f}")).unwrap_or_default()
}

impl ClusterError {
    /// Whether the same call may succeed if simply tried again later: transient failures, a
    /// console or a guest's port that is not ready yet, and a quota not counted yet. A conflict, an exceeded
    /// quota, a missing permission or an invalid object will fail the same way again.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Self::Transient { .. }
                | Self::ConsoleNotReady { .. }
                | Self::PortUnreachable { .. }
                | Self::QuotaPending { .. }
        )
    }

    /// Whether this is [`ClusterError::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// Maps a Kubernetes `Status` (HTTP code, reason, message) onto a variant.
    pub(crate) fn from_status(code: u16, reason: &str, message: &str) -> Self {
        let message = if message.is_empty() {
            format!("HTTP {code} {reason}")
        } else {
            message.to_owned()
        };
        match (code, reason) {
            (404, _) | (_, "NotFound") => Self::NotFound { message },
            (403, _) | (_, "Forbidden") if message.contains("status unknown for quota") => {
                Self::QuotaPending { message }
            }
            (403, _) | (_, "Forbidden") if message.contains("exceeded quota") => {
                Self::QuotaExceeded { message }
            }
            (401 | 403, _) | (_, "Forbidden" | "Unauthorized") => Self::Forbidden { message },
            (409, _) | (_, "AlreadyExists" | "Conflict") => Self::Conflict { message },
            (410, _) | (_, "Expired" | "Gone") => Self::Transient {
                message: format!("expired, start again: {message}"),
            },
            (429, _)
            | (500..=599, _)
            | (
                _,
                "Timeout" | "ServerTimeout" | "TooManyRequests" | "ServiceUnavailable"
                | "InternalError",
            ) => Self::Transient {
                message: format!("HTTP {code}: {message}"),
            },
            (400 | 422, _) | (_, "Invalid" | "BadRequest") => Self::Invalid { message },
            _ => Self::Unexpected {
                message: format!("HTTP {code} {reason}: {message}"),
            },
        }
    }

    /// Maps an error of the kube-rs client.
    pub(crate) fn from_kube(err: kube::Error) -> Self {
        match err {
            kube::Error::Api(status) => {
                Self::from_status(status.code, &status.reason, &status.message)
            }
            kube::Error::HyperError(e) => Self::Transient {
                message: format!("connection: {e}"),
            },
            kube::Error::Service(e) => Self::Transient {
                message: format!("connection: {e}"),
            },
            kube::Error::ReadEvents(e) => Self::Transient {
                message: format!("reading the response: {e}"),
            },
            kube::Error::InferConfig(e) => Self::Config {
                message: e.to_string(),
            },
            kube::Error::InferKubeconfig(e) => Self::Config {
                message: e.to_string(),
            },
            kube::Error::Auth(e) => Self::Forbidden {
                message: format!("authentication: {e}"),
            },
            // A reply that ends before its JSON does was cut on the way (a dropped
            // connection, a proxy giving up): the call may work again. Any other decoding
            // failure is a reply this client does not understand, and stays unexpected.
            kube::Error::SerdeError(e) if e.is_eof() => Self::Transient {
                message: format!("the reply was cut short: {e}"),
            },
            // An upgrade refused with a status says what the status says (a 503 passes, a 403
            // does not); one whose connection broke on the way may work again.
            kube::Error::UpgradeConnection(UpgradeConnectionError::ProtocolSwitch(status)) => {
                let reason = status.canonical_reason().unwrap_or("");
                Self::from_status(
                    status.as_u16(),
                    reason,
                    &format!(
                        "WebSocket upgrade refused: HTTP {} {reason}",
                        status.as_u16()
                    ),
                )
            }
            kube::Error::UpgradeConnection(e @ UpgradeConnectionError::GetPendingUpgrade(_)) => {
                Self::Transient {
                    message: format!("WebSocket upgrade: {e}"),
                }
            }
            kube::Error::UpgradeConnection(e) => Self::Unexpected {
                message: format!("WebSocket upgrade: {e}"),
            },
            other => Self::Unexpected {
                message: other.to_string(),
            },
        }
    }

    /// A client-side timeout of one API call.
    pub(crate) fn timed_out(what: &str, after: Duration) -> Self {
        Self::Transient {
            message: format!("{what}: no answer within {after:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_the_variant_a_caller_decides_on() {
        type Check = fn(&ClusterError) -> bool;
        let cases: &[(u16, &str, &str, Check)] = &[
            (404, "NotFound", "x not found", |e| {
                matches!(e, ClusterError::NotFound { .. })
            }),
            (403, "Forbidden", "cannot get secrets", |e| {
                matches!(e, ClusterError::Forbidden { .. })
            }),
            (
                403,
                "Forbidden",
                "virtualmachines.kubevirt.io \"a\" is forbidden: exceeded quota: vms, requested: count/virtualmachines.kubevirt.io=1",
                |e| matches!(e, ClusterError::QuotaExceeded { .. }),
            ),
            (
                403,
                "Forbidden",
                "virtualmachines.kubevirt.io \"tt-1\" is forbidden: status unknown for quota: ttlab-vms, resources: count/virtualmachines.kubevirt.io",
                |e| matches!(e, ClusterError::QuotaPending { .. }),
            ),
            (
                403,
                "Forbidden",
                "secrets \"tt-1-ci\" is forbidden: status unknown for quota: ttlab-vms, resources: count/secrets",
                |e| matches!(e, ClusterError::QuotaPending { .. }),
            ),
            (401, "Unauthorized", "Unauthorized", |e| {
                matches!(e, ClusterError::Forbidden { .. })
            }),
            (409, "AlreadyExists", "exists", |e| {
                matches!(e, ClusterError::Conflict { .. })
            }),
            (409, "Conflict", "modified", |e| {
                matches!(e, ClusterError::Conflict { .. })
            }),
            (422, "Invalid", "bad name", |e| {
                matches!(e, ClusterError::Invalid { .. })
            }),
            (400, "BadRequest", "bad json", |e| {
                matches!(e, ClusterError::Invalid { .. })
            }),
            (500, "InternalError", "boom", |e| {
                matches!(e, ClusterError::Transient { .. })
            }),
            (503, "ServiceUnavailable", "", |e| {
                matches!(e, ClusterError::Transient { .. })
            }),
            (504, "Timeout", "", |e| {
                matches!(e, ClusterError::Transient { .. })
            }),
            (429, "TooManyRequests", "", |e| {
                matches!(e, ClusterError::Transient { .. })
            }),
            (410, "Expired", "continue expired", |e| {
                matches!(e, ClusterError::Transient { .. })
            }),
            (418, "Teapot", "", |e| {
                matches!(e, ClusterError::Unexpected { .. })
            }),
        ];
        for (code, reason, message, check) in cases {
            let err = ClusterError::from_status(*code, reason, message);
            assert!(check(&err), "{code} {reason}: got {err:?}");
        }
    }

    #[test]
    fn only_transient_failures_are_retryable() {
        assert!(ClusterError::from_status(500, "InternalError", "").is_retryable());
        assert!(ClusterError::from_status(429, "TooManyRequests", "").is_retryable());
        assert!(!ClusterError::from_status(404, "NotFound", "").is_retryable());
        assert!(!ClusterError::from_status(409, "AlreadyExists", "").is_retryable());
        assert!(!ClusterError::from_status(403, "Forbidden", "exceeded quota: q").is_retryable());
        assert!(!ClusterError::from_status(422, "Invalid", "").is_retryable());
    }

    #[test]
    fn a_websocket_upgrade_refused_for_now_is_retryable_and_one_refused_for_good_is_not() {
        let upgrade = |code: u16| {
            ClusterError::from_kube(kube::Error::UpgradeConnection(
                UpgradeConnectionError::ProtocolSwitch(http::StatusCode::from_u16(code).unwrap()),
            ))
        };
        for code in [500, 502, 503, 504, 429] {
            assert!(upgrade(code).is_retryable(), "{code}: {:?}", upgrade(code));
        }
        assert!(matches!(upgrade(403), ClusterError::Forbidden { .. }));
        assert!(matches!(upgrade(404), ClusterError::NotFound { .. }));
        assert!(
            upgrade(503)
                .to_string()
                .contains("WebSocket upgrade refused: HTTP 503")
        );
        let handshake = ClusterError::from_kube(kube::Error::UpgradeConnection(
            UpgradeConnectionError::SecWebSocketAcceptKeyMismatch,
        ));
        assert!(!handshake.is_retryable(), "{handshake:?}");
    }

    #[test]
    fn a_reply_cut_mid_json_is_retryable_and_a_reply_not_understood_is_not() {
        let cut = serde_json::from_str::<serde_json::Value>(r#"{"kind":"VirtualMachineInst"#)
            .unwrap_err();
        let cut = ClusterError::from_kube(kube::Error::SerdeError(cut));
        assert!(cut.is_retryable(), "{cut:?}");
        assert!(cut.to_string().contains("cut short"), "{cut}");
        let garbled = serde_json::from_str::<serde_json::Value>(r#"{"kind": nope}"#).unwrap_err();
        let garbled = ClusterError::from_kube(kube::Error::SerdeError(garbled));
        assert!(!garbled.is_retryable(), "{garbled:?}");
    }

    #[test]
    fn a_quota_not_counted_yet_is_retryable_and_an_exceeded_one_is_not() {
        // The API server's words (resourcequota admission of kube-apiserver 1.36) while
        // kube-controller-manager has not counted a new quota or a new resource type.
        let pending = ClusterError::from_status(
            403,
            "Forbidden",
            "virtualmachines.kubevirt.io \"tt-0d3c-vm\" is forbidden: status unknown for quota: \
             ttlab-vms, resource: count/virtualmachines.kubevirt.io",
        );
        assert!(
            matches!(pending, ClusterError::QuotaPending { .. }),
            "{pending:?}"
        );
        assert!(pending.is_retryable());
        assert!(pending.to_string().contains("ttlab-vms"), "{pending}");
        let exceeded = ClusterError::from_status(
            403,
            "Forbidden",
            "virtualmachines.kubevirt.io \"tt-0d3c-vm\" is forbidden: exceeded quota: ttlab-vms, \
             requested: count/virtualmachines.kubevirt.io=1, used: \
             count/virtualmachines.kubevirt.io=8, limited: count/virtualmachines.kubevirt.io=8",
        );
        assert!(
            matches!(exceeded, ClusterError::QuotaExceeded { .. }),
            "{exceeded:?}"
        );
        assert!(!exceeded.is_retryable());
        // Any other refusal stays a missing permission.
        let forbidden = ClusterError::from_status(
            403,
            "Forbidden",
            "virtualmachines.kubevirt.io is forbidden: User \"system:serviceaccount:ttlab:server\" \
             cannot create resource \"virtualmachines\"",
        );
        assert!(
            matches!(forbidden, ClusterError::Forbidden { .. }),
            "{forbidden:?}"
        );
        assert!(!forbidden.is_retryable());
    }

    #[test]
    fn an_empty_message_still_says_what_happened() {
        let err = ClusterError::from_status(503, "ServiceUnavailable", "");
        assert!(err.to_string().contains("503"), "{err}");
    }
}
