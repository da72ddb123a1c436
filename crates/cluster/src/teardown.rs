//! Deleting everything of one session: the one teardown the server (finish, failed
//! provisioning) and the reaper (expiry, stuck sessions) share.
//!
//! The order follows the operators' write-up: the VirtualMachine(s) first (KubeVirt stops the
//! guest, and the garbage collector and storage-in-use protection take the launcher pod and
//! volumes after it), then each cloud-init Secret explicitly by name — its owner link to the
//! VM can fail, and a stale Secret would revive old cloud-init if the name were reused — then
//! the session's Service and NetworkPolicy, the Pod of a pod lab, and finally anything still
//! labelled with the session and environment. A missing object is already deleted: success.
//!
//! Every deletion is attempted even when an earlier one failed, and the report says, object by
//! object, what happened. An accepted deletion is not the end: real KubeVirt keeps a VM through
//! its guest's shutdown grace (and for ever on a dead node), and finalizers hold any object. So
//! an object the API server did not remove at once ([`Deleted::Removed`]: its answer is the
//! confirmation) is then looked for once more ([`ReaperCluster::find`]): absent, it is
//! confirmed gone; still there, it is [`Outcome::Terminating`]. A [`GoneWitness`] (a watch-fed
//! listing that reports deletions as they happen) confirms it instead, without a request per
//! object per look. Objects found already terminating by the label sweep are deleted
//! again (an accepted no-op that retries them) and looked for like the others. The caller
//! marks the session final only when [`TeardownReport::all_gone`] holds; until then the
//! session stays live (and its VMs, still listed, count against capacity).

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ttlab_background::Backoff;
use ttlab_model::labels::session_selector;
use ttlab_model::{EnvName, NodeName, Runtime, SessionId};

use crate::{ClusterError, Deleted, Kind, Propagation, ReaperCluster};

/// When the teardown also lists, kind by kind, what is still labelled with the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LabelSweep {
    /// Always (one list call per kind): catches objects whose names were never recorded.
    #[default]
    Always,
    /// Only when the session's nodes are unknown (nothing recorded yet). The reaper's orphan
    /// direction still finds any other labelled leftover on a later cycle; this keeps a
    /// session's teardown to two calls (VM and Secret) in the common case.
    IfNodesUnknown,
}

/// What to tear down: one session of one environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionTarget<'a> {
    /// The environment of the backend that created it (the label sweep selects on it).
    pub env: &'a EnvName,
    /// The session.
    pub session: SessionId,
    /// What it runs on: VMs and their Secrets, or a Pod.
    pub runtime: Runtime,
    /// Its lab nodes (one VM or pod each). Empty when none were recorded yet.
    pub nodes: &'a [NodeName],
}

/// What happened to one object.
#[derive(Debug)]
pub enum Outcome {
    /// The deletion was accepted and the object is confirmed gone (the API server removed it
    /// at once, a look after found nothing, or a [`GoneWitness`] saw it go).
    Deleted,
    /// It did not exist: someone already deleted it, or it was never created.
    AlreadyGone,
    /// The deletion was accepted, but the object is still there, being deleted (a guest
    /// shutting down, a finalizer not yet removed). Deleted again on the next attempt.
    Terminating,
    /// The deletion (or the list that looks for labelled leftovers, or the look that confirms
    /// an object gone) failed.
    Failed(ClusterError),
}

impl Outcome {
    /// Whether the deletion was accepted or the object is gone (it may still be terminating).
    pub fn is_success(&self) -> bool {
        !matches!(self, Outcome::Failed(_))
    }

    /// Whether the object is confirmed gone.
    pub fn is_gone(&self) -> bool {
        matches!(self, Outcome::Deleted | Outcome::AlreadyGone)
    }
}

/// One object of the teardown and its outcome.
#[derive(Debug)]
pub struct ObjectOutcome {
    /// Its kind.
    pub kind: Kind,
    /// Its name (for a failed label sweep: the selector).
    pub name: String,
    /// What happened.
    pub outcome: Outcome,
}

/// The per-object outcomes of a teardown, in the order they were attempted.
#[derive(Debug, Default)]
pub struct TeardownReport {
    /// Every object attempted.
    pub objects: Vec<ObjectOutcome>,
}

impl TeardownReport {
    /// Whether every deletion was accepted (or found the object gone); some objects may still
    /// be terminating ([`TeardownReport::all_gone`] says whether they are gone).
    pub fn all_deleted(&self) -> bool {
        self.objects.iter().all(|o| o.outcome.is_success())
    }

    /// Whether every object of the session is confirmed gone: only then may the session be
    /// marked final.
    pub fn all_gone(&self) -> bool {
        self.objects.iter().all(|o| o.outcome.is_gone())
    }

    /// The objects still terminating, in order.
    pub fn terminating(&self) -> impl Iterator<Item = &ObjectOutcome> {
        self.objects
            .iter()
            .filter(|o| matches!(o.outcome, Outcome::Terminating))
    }

    /// The failures, in order.
    pub fn failures(&self) -> impl Iterator<Item = (&ObjectOutcome, &ClusterError)> {
        self.objects.iter().filter_map(|o| match &o.outcome {
            Outcome::Failed(e) => Some((o, e)),
            _ => None,
        })
    }

    /// How many deletions were accepted (objects that existed, gone or still terminating).
    pub fn deleted(&self) -> usize {
        self.objects
            .iter()
            .filter(|o| matches!(o.outcome, Outcome::Deleted | Outcome::Terminating))
            .count()
    }

    fn push(&mut self, kind: Kind, name: String, result: Result<Deleted, ClusterError>) {
        let outcome = match result {
            // Accepted, and left in place for now: looked for again.
            Ok(Deleted::Deleted) => Outcome::Terminating,
            Ok(Deleted::Removed) => Outcome::Deleted,
            Ok(Deleted::AlreadyGone) => Outcome::AlreadyGone,
            Err(e) => Outcome::Failed(e),
        };
        self.objects.push(ObjectOutcome {
            kind,
            name,
            outcome,
        });
    }
}

/// The objects of a session that are deleted by name, in teardown order.
pub fn named_objects(target: &SessionTarget<'_>) -> Vec<(Kind, String)> {
    use ttlab_vm_manifest as names;
    let mut out = Vec::new();
    match target.runtime {
        Runtime::Vm => {
            for node in target.nodes {
                out.push((Kind::VirtualMachine, names::vm_name(target.session, node)));
            }
            for node in target.nodes {
                out.push((Kind::Secret, names::secret_name(target.session, node)));
            }
            // A single-VM session has neither; multi-VM sessions (and sessions whose nodes are
            // unknown, found by the label sweep) do.
            if target.nodes.len() > 1 {
                out.push((Kind::Service, names::service_name(target.session)));
                out.push((
                    Kind::NetworkPolicy,
                    names::network_policy_name(target.session),
                ));
            }
        }
        Runtime::Pod => {
            for node in target.nodes {
                out.push((Kind::Pod, names::pod_name(target.session, node)));
            }
        }
    }
    out
}

/// The pauses between looks at objects still terminating: 50 ms, doubling up to 250 ms.
const LOOK_AGAIN: Backoff =
    Backoff::doubling(Duration::from_millis(50), Duration::from_millis(250)).without_jitter();

/// Something that sees objects go without being asked: a watch-fed listing
/// ([`ObjectCache`](crate::ObjectCache)) reports each deletion as it happens. A teardown asks
/// it first, and the API server only for what it has not seen go.
pub trait GoneWitness: Sync {
    /// Whether the object `name` of `kind` was seen deleted at or after `since`.
    fn saw_gone(&self, kind: Kind, name: &str, since: Instant) -> bool;
}

/// How often a teardown asks its [`GoneWitness`] (in memory: no request).
const ASK_WITNESS_EVERY: Duration = Duration::from_millis(20);

/// Deletes every object of one session, in the order described in the module docs, looks
/// once more for each the API server did not remove at once, and reports each outcome. Never
/// stops at a failure: every object is attempted.
pub async fn teardown_session(
    cluster: &dyn ReaperCluster,
    target: &SessionTarget<'_>,
    sweep: LabelSweep,
) -> TeardownReport {
    let mut report = delete_session_objects(cluster, target, sweep).await;
    look_again(cluster, &mut report, &[]).await;
    report
}

/// [`teardown_session`], then, while some object is still terminating, looks again with a
/// growing pause (50 ms, doubling up to 250 ms) for at most `gone_within`: a VM whose guest
/// stops quickly is confirmed gone in the same teardown. An object still there after that is
/// [`Outcome::Terminating`]. Objects of the kinds in `get_kinds` are looked for with
/// [`ReaperCluster::get`] (for a caller whose Role grants `get` on them: the reaper's, for
/// VirtualMachines and Pods), the others with [`ReaperCluster::find`]. With a `witness`, see
/// [`await_gone`].
pub async fn teardown_session_within(
    cluster: &dyn ReaperCluster,
    target: &SessionTarget<'_>,
    sweep: LabelSweep,
    gone_within: Duration,
    get_kinds: &[Kind],
    witness: Option<&dyn GoneWitness>,
) -> TeardownReport {
    let asked = Instant::now();
    let mut report = delete_session_objects(cluster, target, sweep).await;
    await_gone(cluster, &mut report, asked, gone_within, get_kinds, witness).await;
    report
}

/// The first half of a teardown: deletes every object of the session, in order, and reports
/// each outcome — [`Outcome::Deleted`] for what the API server removed at once,
/// [`Outcome::Terminating`] for what it accepted to delete but left in place for now.
/// [`await_gone`] is the second half.
pub async fn delete_session_objects(
    cluster: &dyn ReaperCluster,
    target: &SessionTarget<'_>,
    sweep: LabelSweep,
) -> TeardownReport {
    delete_all(cluster, target, sweep).await
}

/// The second half of a teardown: waits at most `gone_within` for the objects still
/// terminating in `report` (their deletions asked for at `asked`) to go.
///
/// Without a `witness`, each is looked for at once and then again with a growing pause (50 ms,
/// doubling up to 250 ms): a request per object per look. With one, the witness is asked every
/// 20 ms, which costs no request, and only what it has not seen go within `gone_within` is
/// looked for, once, at the end.
pub async fn await_gone(
    cluster: &dyn ReaperCluster,
    report: &mut TeardownReport,
    asked: Instant,
    gone_within: Duration,
    get_kinds: &[Kind],
    witness: Option<&dyn GoneWitness>,
) {
    let start = tokio::time::Instant::now();
    let Some(witness) = witness else {
        look_again(cluster, report, get_kinds).await;
        let mut pauses = LOOK_AGAIN.pauses();
        let mut pause = pauses.next_pause();
        while report.terminating().next().is_some() && start.elapsed() + pause <= gone_within {
            tokio::time::sleep(pause).await;
            pause = pauses.next_pause();
            look_again(cluster, report, get_kinds).await;
        }
        return;
    };
    loop {
        for object in &mut report.objects {
            if matches!(object.outcome, Outcome::Terminating)
                && witness.saw_gone(object.kind, &object.name, asked)
            {
                object.outcome = Outcome::Deleted;
            }
        }
        if report.terminating().next().is_none()
            || start.elapsed() + ASK_WITNESS_EVERY > gone_within
        {
            break;
        }
        tokio::time::sleep(ASK_WITNESS_EVERY).await;
    }
    if report.terminating().next().is_some() {
        look_again(cluster, report, get_kinds).await;
    }
}

async fn delete_all(
    cluster: &dyn ReaperCluster,
    target: &SessionTarget<'_>,
    sweep: LabelSweep,
) -> TeardownReport {
    let mut report = TeardownReport::default();
    let named = named_objects(target);
    for (kind, name) in &named {
        let result = cluster.delete(*kind, name, Propagation::Background).await;
        report.push(*kind, name.clone(), result);
    }
    let sweep_now = match sweep {
        LabelSweep::Always => true,
        LabelSweep::IfNodesUnknown => target.nodes.is_empty(),
    };
    if !sweep_now {
        return report;
    }
    let already: BTreeSet<(Kind, &str)> = named.iter().map(|(k, n)| (*k, n.as_str())).collect();
    let selector = session_selector(target.env, target.session);
    // VMs first, as above; VMIs and launcher pods are KubeVirt's to delete.
    for kind in [
        Kind::VirtualMachine,
        Kind::Secret,
        Kind::Service,
        Kind::NetworkPolicy,
        Kind::Pod,
    ] {
        match cluster.list_all(kind, &selector).await {
            Ok(items) => {
                for item in items {
                    // One being deleted already is deleted again: an accepted no-op that
                    // retries it, and the look after says whether it is gone by now.
                    if already.contains(&(kind, item.name.as_str())) {
                        continue;
                    }
                    // A VM's launcher pod carries the session labels too; KubeVirt owns it.
                    if kind == Kind::Pod && item.labels.contains_key("kubevirt.io") {
                        continue;
                    }
                    let result = cluster
                        .delete(kind, &item.name, Propagation::Background)
                        .await;
                    report.push(kind, item.name, result);
                }
            }
            Err(e) => report.objects.push(ObjectOutcome {
                kind,
                name: selector.clone(),
                outcome: Outcome::Failed(e),
            }),
        }
    }
    report
}

/// Looks for every object still terminating: absent, it is [`Outcome::Deleted`]; still
/// there, it stays [`Outcome::Terminating`]; a failed look is [`Outcome::Failed`] (nothing is
/// confirmed).
async fn look_again(cluster: &dyn ReaperCluster, report: &mut TeardownReport, get_kinds: &[Kind]) {
    for object in &mut report.objects {
        if !matches!(object.outcome, Outcome::Terminating) {
            continue;
        }
        let found = if get_kinds.contains(&object.kind) {
            cluster.get(object.kind, &object.name).await
        } else {
            cluster.find(object.kind, &object.name).await
        };
        object.outcome = match found {
            Ok(None) => Outcome::Deleted,
            Ok(Some(_)) => Outcome::Terminating,
            Err(e) => Outcome::Failed(e),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vms_come_before_their_secrets_and_session_objects_only_for_several_nodes() {
        let env: EnvName = "dev".parse().unwrap();
        let id: SessionId = "6f1c1d2e-0b7a-4c2b-9a55-1f0e2d3c4b5a".parse().unwrap();
        let nodes: Vec<NodeName> = vec!["a".parse().unwrap(), "b".parse().unwrap()];
        let kinds: Vec<Kind> = named_objects(&SessionTarget {
            env: &env,
            session: id,
            runtime: Runtime::Vm,
            nodes: &nodes,
        })
        .into_iter()
        .map(|(k, _)| k)
        .collect();
        assert_eq!(
            kinds,
            [
                Kind::VirtualMachine,
                Kind::VirtualMachine,
                Kind::Secret,
                Kind::Secret,
                Kind::Service,
                Kind::NetworkPolicy
            ]
        );
        let single = named_objects(&SessionTarget {
            env: &env,
            session: id,
            runtime: Runtime::Vm,
            nodes: &nodes[..1],
        });
        assert_eq!(
            single,
            [
                (
                    Kind::VirtualMachine,
                    "tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-a".to_owned()
                ),
                (
                    Kind::Secret,
                    "tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-a-ci".to_owned()
                ),
            ]
        );
        let pod = named_objects(&SessionTarget {
            env: &env,
            session: id,
            runtime: Runtime::Pod,
            nodes: &nodes[..1],
        });
        assert_eq!(
            pod,
            [(
                Kind::Pod,
                "tt-6f1c1d2e0b7a4c2b9a551f0e2d3c4b5a-a-pod".to_owned()
            )]
        );
    }
}
