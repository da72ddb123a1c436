//! Fault injection (fail or hang chosen calls, add latency) and the call record (what was
//! called, when, with what answer; the most VMs that ever existed at once).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The verb of an API call, as the API server's audit log names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    /// GET of one object (and the console connection).
    Get,
    /// GET of a collection.
    List,
    /// GET with `watch=true`.
    Watch,
    /// POST.
    Create,
    /// PUT.
    Update,
    /// PATCH.
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE of a collection.
    Deletecollection,
}

impl Verb {
    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Watch => "watch",
            Self::Create => "create",
            Self::Update => "update",
            Self::Patch => "patch",
            Self::Delete => "delete",
            Self::Deletecollection => "deletecollection",
        }
    }
}

/// What an injected fault does to a matching call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum FaultAction {
    /// Answer with this HTTP status and a Kubernetes `Status` body; the call has no effect.
    Fail {
        /// HTTP status code (e.g. 500, 503, 429, 403, 409).
        status: u16,
        /// Message in the `Status` body (a default one if absent).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        message: Option<String>,
    },
    /// Never answer (the connection stays open until the client gives up or the sim stops).
    Hang,
    /// Wait this long, then serve the call normally.
    Delay {
        /// Milliseconds to wait.
        millis: u64,
    },
    /// Serve the call (a create, update or delete takes effect), then lose the reply: the
    /// status line goes out and the connection breaks before the body, so the client learns
    /// nothing of the outcome (a reply lost on the way back after the change was applied). API
    /// calls only: a console or exec connection it matches is served normally.
    LoseReply,
}

/// A fault rule: which calls it matches and what it does to them.
///
/// JSON form (for `POST /sim/faults`):
/// `{"verb": "delete", "resource": "virtualmachines", "name": "lab-1", "action": {"kind": "fail", "status": 500}, "times": 2}`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRule {
    /// Only calls with this verb (any verb if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verb: Option<Verb>,
    /// Only calls on this resource: plural (`virtualmachines`), optionally group-qualified
    /// (`virtualmachines.kubevirt.io`), or a subresource (`virtualmachineinstances/console`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<String>,
    /// Only calls in this namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Only calls naming this object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// What happens to a matching call.
    pub action: FaultAction,
    /// Apply to the next N matching calls only, then the rule is spent (all calls if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub times: Option<u32>,
    /// Apply to this fraction (0.0–1.0) of matching calls, chosen with the sim's seeded
    /// generator (all if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
}

impl FaultRule {
    /// A rule failing every matching call with `status`.
    pub fn fail(verb: Option<Verb>, resource: Option<&str>, status: u16) -> Self {
        Self {
            verb,
            resource: resource.map(str::to_owned),
            namespace: None,
            name: None,
            action: FaultAction::Fail {
                status,
                message: None,
            },
            times: None,
            fraction: None,
        }
    }

    /// A rule hanging every matching call.
    pub fn hang(verb: Option<Verb>, resource: Option<&str>) -> Self {
        Self {
            action: FaultAction::Hang,
            ..Self::fail(verb, resource, 500)
        }
    }

    /// A rule serving every matching call and then losing its reply
    /// ([`FaultAction::LoseReply`]).
    pub fn lose_reply(verb: Option<Verb>, resource: Option<&str>) -> Self {
        Self {
            action: FaultAction::LoseReply,
            ..Self::fail(verb, resource, 500)
        }
    }

    /// Restricts the rule to one object name.
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.to_owned());
        self
    }

    /// Restricts the rule to the next `n` matching calls.
    pub fn times(mut self, n: u32) -> Self {
        self.times = Some(n);
        self
    }

    /// Restricts the rule to a fraction of matching calls.
    pub fn fraction(mut self, f: f64) -> Self {
        self.fraction = Some(f);
        self
    }

    fn matches(&self, call: &CallKey<'_>) -> bool {
        let resource_ok = self.resource.as_deref().is_none_or(|r| {
            r == call.resource
                || call
                    .group
                    .is_some_and(|g| !g.is_empty() && r == format!("{}.{g}", call.resource))
        });
        self.verb.is_none_or(|v| v == call.verb)
            && resource_ok
            && self
                .namespace
                .as_deref()
                .is_none_or(|n| Some(n) == call.namespace)
            && self.name.as_deref().is_none_or(|n| Some(n) == call.name)
    }
}

/// A call as seen by the fault table.
#[derive(Debug, Clone, Copy)]
pub struct CallKey<'a> {
    /// Verb.
    pub verb: Verb,
    /// Plural resource (or `plural/subresource`).
    pub resource: &'a str,
    /// API group of the resource.
    pub group: Option<&'a str>,
    /// Namespace, if any.
    pub namespace: Option<&'a str>,
    /// Object name, if any.
    pub name: Option<&'a str>,
}

/// What the fault table decided for one call.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Decision {
    /// Wait this long first.
    pub delay: Duration,
    /// Then fail with (status, message), hang instead of serving, or serve and lose the
    /// reply.
    pub outcome: Option<FaultAction>,
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallRecord {
    /// Sequence number (arrival order).
    pub seq: u64,
    /// Arrival time, RFC 3339 with milliseconds.
    pub at: String,
    /// Arrival time in milliseconds since the sim started.
    pub offset_ms: u64,
    /// Verb, as RBAC names it.
    pub verb: Verb,
    /// Plural resource (or `plural/subresource`).
    pub resource: String,
    /// API group of the resource (`""` for the core group).
    #[serde(default)]
    pub group: String,
    /// The subresource (`status`, `exec`, `console`), if any: with `group`, the plural
    /// before the `/` of `resource`, `verb` and `namespace`, what an RBAC rule matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subresource: Option<String>,
    /// Namespace, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Object name, if any (for creates: the requested name, empty with generateName).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// HTTP status of the answer (0 for a call left hanging).
    pub status: u16,
    /// Who made the call: the user its bearer token names ([`crate::KubeSim::token_for`]), or
    /// the one its `Impersonate-User` header (kubeconfig `as:`) acts as; `None` for a call
    /// without credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

impl CallRecord {
    /// The resource without its subresource (`pods` of `pods/exec`).
    pub fn plural(&self) -> &str {
        self.resource
            .split_once('/')
            .map_or(self.resource.as_str(), |(p, _)| p)
    }
}

struct State {
    rules: Vec<(u64, FaultRule)>,
    next_id: u64,
    latency: Duration,
    rng: u64,
    calls: Vec<CallRecord>,
    next_seq: u64,
}

/// The fault table and the call record.
pub struct Faults {
    started: Instant,
    max_records: usize,
    state: Mutex<State>,
}

impl Faults {
    /// A table with no rules, seeded for `fraction` rules.
    pub fn new(seed: u64, max_records: usize) -> Self {
        Self {
            started: Instant::now(),
            max_records,
            state: Mutex::new(State {
                rules: Vec::new(),
                next_id: 1,
                latency: Duration::ZERO,
                rng: seed ^ 0x9e37_79b9_7f4a_7c15,
                calls: Vec::new(),
                next_seq: 1,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds a rule; returns its id.
    pub fn add(&self, rule: FaultRule) -> u64 {
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        s.rules.push((id, rule));
        id
    }

    /// Removes a rule; false if there was none with this id.
    pub fn remove(&self, id: u64) -> bool {
        let mut s = self.lock();
        let before = s.rules.len();
        s.rules.retain(|(i, _)| *i != id);
        s.rules.len() != before
    }

    /// Removes every rule and the latency.
    pub fn clear(&self) {
        let mut s = self.lock();
        s.rules.clear();
        s.latency = Duration::ZERO;
    }

    /// The active rules with their ids (spent `times` rules are gone).
    pub fn rules(&self) -> Vec<(u64, FaultRule)> {
        self.lock().rules.clone()
    }

    /// Adds this latency to every API call.
    pub fn set_latency(&self, latency: Duration) {
        self.lock().latency = latency;
    }

    /// The current per-call latency.
    pub fn latency(&self) -> Duration {
        self.lock().latency
    }

    /// Decides the fate of one call (consuming `times` budgets).
    pub fn decide(&self, call: &CallKey<'_>) -> Decision {
        let mut s = self.lock();
        let mut d = Decision {
            delay: s.latency,
            outcome: None,
        };
        let mut spent = Vec::new();
        let mut rng = s.rng;
        for (id, rule) in s.rules.iter_mut() {
            if !rule.matches(call) {
                continue;
            }
            if let Some(f) = rule.fraction {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let x = (rng >> 11) as f64 / (1u64 << 53) as f64;
                if x >= f {
                    continue;
                }
            }
            if let Some(n) = rule.times.as_mut() {
                if *n == 0 {
                    continue;
                }
                *n -= 1;
                if *n == 0 {
                    spent.push(*id);
                }
            }
            match &rule.action {
                FaultAction::Delay { millis } => d.delay += Duration::from_millis(*millis),
                other => {
                    d.outcome = Some(other.clone());
                    break;
                }
            }
        }
        s.rng = rng;
        s.rules.retain(|(id, _)| !spent.contains(id));
        d
    }

    /// Records an answered call that arrived at `arrived`.
    pub fn record(&self, arrived: Instant, call: &CallKey<'_>, status: u16) {
        self.record_as(arrived, call, None, status);
    }

    /// Records an answered call that arrived at `arrived`, made as `user`.
    pub fn record_as(&self, arrived: Instant, call: &CallKey<'_>, user: Option<&str>, status: u16) {
        let offset = arrived.duration_since(self.started);
        let at =
            chrono::Utc::now() - chrono::Duration::from_std(arrived.elapsed()).unwrap_or_default();
        let mut s = self.lock();
        if s.calls.len() >= self.max_records {
            return;
        }
        let seq = s.next_seq;
        s.next_seq += 1;
        s.calls.push(CallRecord {
            seq,
            at: at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            offset_ms: u64::try_from(offset.as_millis()).unwrap_or(u64::MAX),
            verb: call.verb,
            resource: call.resource.to_owned(),
            group: call.group.unwrap_or_default().to_owned(),
            subresource: call.resource.split_once('/').map(|(_, sub)| sub.to_owned()),
            namespace: call.namespace.map(str::to_owned),
            name: call.name.map(str::to_owned),
            status,
            user: user.map(str::to_owned),
        });
    }

    /// Every recorded call, in arrival order of recording.
    pub fn calls(&self) -> Vec<CallRecord> {
        let mut v = self.lock().calls.clone();
        v.sort_by_key(|c| c.offset_ms);
        v
    }

    /// Forgets the recorded calls.
    pub fn clear_calls(&self) {
        self.lock().calls.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call<'a>(verb: Verb, resource: &'a str, name: Option<&'a str>) -> CallKey<'a> {
        CallKey {
            verb,
            resource,
            group: Some("kubevirt.io"),
            namespace: Some("ns"),
            name,
        }
    }

    #[test]
    fn next_n_rules_are_spent_after_n_calls() {
        let f = Faults::new(1, 100);
        f.add(
            FaultRule::fail(Some(Verb::Delete), Some("virtualmachines.kubevirt.io"), 503).times(2),
        );
        let c = call(Verb::Delete, "virtualmachines", Some("a"));
        assert!(f.decide(&c).outcome.is_some());
        assert!(
            f.decide(&call(Verb::Get, "virtualmachines", Some("a")))
                .outcome
                .is_none()
        );
        assert!(f.decide(&c).outcome.is_some());
        assert!(f.decide(&c).outcome.is_none());
        assert!(f.rules().is_empty());
    }

    #[test]
    fn fractions_fail_about_that_share() {
        let f = Faults::new(7, 100);
        f.add(FaultRule::fail(None, None, 500).fraction(0.25));
        let c = call(Verb::List, "virtualmachines", None);
        let hits = (0..4000).filter(|_| f.decide(&c).outcome.is_some()).count();
        assert!((800..1200).contains(&hits), "{hits}");
    }

    #[test]
    fn lost_replies_are_an_outcome_of_their_own() {
        let f = Faults::new(1, 100);
        f.add(FaultRule::lose_reply(Some(Verb::Create), Some("virtualmachines")).times(1));
        let c = call(Verb::Create, "virtualmachines", Some("a"));
        assert_eq!(f.decide(&c).outcome, Some(FaultAction::LoseReply));
        assert_eq!(f.decide(&c).outcome, None);
        let json: FaultRule =
            serde_json::from_str(r#"{"verb":"create","action":{"kind":"lose_reply"}}"#).unwrap();
        assert_eq!(json.action, FaultAction::LoseReply);
    }

    #[test]
    fn names_restrict_rules() {
        let f = Faults::new(1, 100);
        f.add(FaultRule::hang(None, Some("secrets")).named("x"));
        assert!(
            f.decide(&call(Verb::Get, "secrets", Some("y")))
                .outcome
                .is_none()
        );
        assert_eq!(
            f.decide(&call(Verb::Get, "secrets", Some("x"))).outcome,
            Some(FaultAction::Hang)
        );
    }
}
