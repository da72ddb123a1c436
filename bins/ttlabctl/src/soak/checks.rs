//! The invariants: checked continuously during the run ([`watch`]) and over the whole record
//! afterwards ([`analyse`]), printed as a table of checks made and violations found.
//!
//! Times compared across sources are all wall-clock instants of this machine: PostgreSQL's
//! `now()` in the rows, kube-sim's arrival time of each call, and the soak's own journal.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::watch;
use ttlab_kube_sim::{CallRecord, Verb};

use super::kube::Kube;
use ttlab_lesson::LessonSet;
use ttlab_model::{EnvName, SessionStatus};
use ttlab_store::{Session, Store};

use super::rig::{Disrupted, Journal, Shared, kube_user, lock, nodes_of};
use super::{ENVS, Settings};

/// How often the continuous checks run.
const WATCH_EVERY: Duration = Duration::from_millis(500);
/// After a PostgreSQL outage, how long the servers may still answer 503 while they reconnect.
const OUTAGE_TAIL: TimeDelta = TimeDelta::seconds(5);
/// Examples printed per violated invariant.
const EXAMPLES: usize = 5;

/// One row of the table.
#[derive(Debug, Default)]
pub(crate) struct Row {
    pub name: String,
    pub checks: u64,
    pub violations: u64,
    pub examples: Vec<String>,
}

impl Row {
    fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            ..Self::default()
        }
    }

    fn check(&mut self, ok: bool, example: impl FnOnce() -> String) {
        self.checks += 1;
        if !ok {
            self.violations += 1;
            if self.examples.len() < EXAMPLES {
                self.examples.push(example());
            }
        }
    }
}

/// The printed result.
#[derive(Debug, Default)]
pub(crate) struct Table {
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

impl Table {
    /// Rows with at least one violation.
    pub(crate) fn failed(&self) -> usize {
        self.rows.iter().filter(|r| r.violations > 0).count()
    }

    pub(crate) fn render(&self) -> String {
        let width = self
            .rows
            .iter()
            .map(|r| r.name.len())
            .max()
            .unwrap_or(9)
            .max(9);
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<width$}  {:>9}  {:>10}  result",
            "invariant", "checks", "violations"
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "{:<width$}  {:>9}  {:>10}  {}",
                r.name,
                r.checks,
                r.violations,
                if r.violations == 0 { "PASS" } else { "FAIL" }
            );
        }
        for r in self.rows.iter().filter(|r| r.violations > 0) {
            let _ = writeln!(
                out,
                "violations of \"{}\" (first {}):",
                r.name,
                r.examples.len()
            );
            for e in &r.examples {
                let _ = writeln!(out, "  - {e}");
            }
        }
        for n in &self.notes {
            let _ = writeln!(out, "{n}");
        }
        let _ = write!(
            out,
            "{}",
            if self.failed() == 0 {
                "soak: PASS".to_owned()
            } else {
                format!("soak: FAIL ({} invariant(s) violated)", self.failed())
            }
        );
        out
    }
}

/// What the continuous checks found.
#[derive(Debug, Default)]
pub(crate) struct Live {
    pub vm_limit: Row,
    pub one_per_user: Row,
    pub most_vms_seen: usize,
}

/// Checks, every [`WATCH_EVERY`] until `stop`: the most VMs ever at once against the limit
/// (kube-sim's own peak, which sees every instant), two live sessions of one user (a database
/// query), and children that exited by themselves (started again).
pub(crate) async fn watch(
    shared: &Shared,
    store: &Store,
    kube: &Kube,
    mut stop: watch::Receiver<bool>,
) -> Live {
    let mut live = Live {
        vm_limit: Row::new("VMs at once <= limit (both envs)"),
        one_per_user: Row::new("one live session per user"),
        most_vms_seen: 0,
    };
    let limit = shared.settings.vm_limit;
    let envs: Vec<EnvName> = ENVS.iter().filter_map(|e| e.parse().ok()).collect();
    let mut reported_peak = 0;
    loop {
        let (vms, peak_vms) = kube.vms();
        live.most_vms_seen = live.most_vms_seen.max(vms);
        live.vm_limit
            .check(peak_vms <= limit || peak_vms <= reported_peak, || {
                format!("{peak_vms} VMs existed at once (limit {limit})")
            });
        reported_peak = reported_peak.max(peak_vms);

        let mut users: BTreeMap<String, u32> = BTreeMap::new();
        let mut read = true;
        for env in &envs {
            // One query per environment: a snapshot (pages read one after the other could see a
            // user's old session and their new one).
            match store.sessions().list_live(env, None, 1_000_000).await {
                Ok(rows) => {
                    for s in &rows {
                        *users.entry(s.user.to_string()).or_default() += 1;
                    }
                }
                // PostgreSQL is down (an injected outage): no check this time.
                Err(_) => read = false,
            }
        }
        if read {
            let twice: Vec<String> = users
                .iter()
                .filter(|(_, n)| **n > 1)
                .map(|(u, n)| format!("{u} ({n})"))
                .collect();
            live.one_per_user.check(twice.is_empty(), || {
                format!("users with several live sessions: {}", twice.join(", "))
            });
        }
        shared.revive().await;
        tokio::select! {
            () = tokio::time::sleep(WATCH_EVERY) => {}
            _ = stop.wait_for(|s| *s) => return live,
        }
    }
}

/// Everything the final analysis reads.
pub(crate) struct Input<'a> {
    pub settings: &'a Settings,
    pub sessions: &'a [Session],
    pub calls: &'a [CallRecord],
    pub journal: &'a Journal,
    pub lessons: &'a LessonSet,
    pub leftovers: &'a [(String, Vec<String>)],
    pub live: &'a Live,
    pub peak_vms: usize,
    pub run_started: DateTime<Utc>,
    pub drain_started: DateTime<Utc>,
}

/// A call as the analysis needs it.
struct Call<'a> {
    at: DateTime<Utc>,
    verb: Verb,
    resource: &'a str,
    name: &'a str,
    status: u16,
    user: Option<&'a str>,
}

/// Whether kube-sim's answer was an injected fault (the soak injects only 500 and 503).
fn injected(status: u16) -> bool {
    status == 500 || status == 503
}

/// For each environment, when the injected faults answered to its reaper (`reaper`) or its
/// server, in time order.
fn injected_faults_by_env(calls: &[Call<'_>], reaper: bool) -> Vec<Vec<DateTime<Utc>>> {
    (0..ENVS.len())
        .map(|e| {
            let user = kube_user(e, reaper);
            let mut v: Vec<DateTime<Utc>> = calls
                .iter()
                .filter(|c| c.user == Some(user.as_str()) && injected(c.status))
                .map(|c| c.at)
                .collect();
            v.sort();
            v
        })
        .collect()
}

/// A deletion the API accepted, or found already done.
fn accepted_delete(status: u16) -> bool {
    matches!(status, 200 | 202 | 404)
}

/// Checks the whole record after the drain.
pub(crate) fn analyse(input: &Input<'_>) -> Table {
    let calls: Vec<Call<'_>> = input
        .calls
        .iter()
        .filter_map(|c| {
            Some(Call {
                at: DateTime::parse_from_rfc3339(&c.at)
                    .ok()?
                    .with_timezone(&Utc),
                verb: c.verb,
                resource: c.resource.as_str(),
                name: c.name.as_deref().unwrap_or(""),
                status: c.status,
                user: c.user.as_deref(),
            })
        })
        .collect();
    // Calls by (resource, name), in time order.
    let mut by_object: HashMap<(&str, &str), Vec<&Call<'_>>> = HashMap::new();
    for c in &calls {
        if !c.name.is_empty() {
            by_object.entry((c.resource, c.name)).or_default().push(c);
        }
    }
    for v in by_object.values_mut() {
        v.sort_by_key(|c| c.at);
    }
    // The objects of each session: (resource, name), and which env owns each name.
    let mut owner: HashMap<String, (usize, &Session)> = HashMap::new();
    let mut objects_of: HashMap<ttlab_model::SessionId, Vec<(&'static str, String)>> =
        HashMap::new();
    for s in input.sessions {
        let Some(env) = ENVS.iter().position(|e| *e == s.env.as_str()) else {
            continue;
        };
        let nodes = nodes_of(input.lessons, s.lesson.as_str());
        let mut objs = Vec::new();
        for node in &nodes {
            objs.push(("virtualmachines", ttlab_vm_manifest::vm_name(s.id, node)));
            objs.push(("secrets", ttlab_vm_manifest::secret_name(s.id, node)));
        }
        if nodes.len() > 1 {
            objs.push(("services", ttlab_vm_manifest::service_name(s.id)));
            objs.push((
                "networkpolicies",
                ttlab_vm_manifest::network_policy_name(s.id),
            ));
        }
        for (_, name) in &objs {
            owner.insert(name.clone(), (env, s));
        }
        objects_of.insert(s.id, objs);
    }
    let disturbances = lock(&input.journal.disturbances).clone();

    let mut table = Table::default();
    let mut vm_limit = Row::new("VMs at once <= limit (both envs)");
    vm_limit.checks = input.live.vm_limit.checks;
    vm_limit.violations = input.live.vm_limit.violations;
    vm_limit.examples = input.live.vm_limit.examples.clone();
    vm_limit.check(input.peak_vms <= input.settings.vm_limit, || {
        format!(
            "kube-sim's peak: {} VMs (limit {})",
            input.peak_vms, input.settings.vm_limit
        )
    });
    table.rows.push(vm_limit);
    let one = &input.live.one_per_user;
    table.rows.push(Row {
        name: one.name.clone(),
        checks: one.checks,
        violations: one.violations,
        examples: one.examples.clone(),
    });

    // Expired sessions: the VM delete requested in time.
    let expiry_bound =
        TimeDelta::from_std(input.settings.expiry_bound).unwrap_or(TimeDelta::seconds(2));
    let mut expiry = Row::new(&format!(
        "expired VM deleted <= {}s (or 1 cycle after a fault)",
        input.settings.expiry_bound.as_secs()
    ));
    let cycle = TimeDelta::from_std(input.settings.reap_interval).unwrap_or(TimeDelta::MAX);
    // After a disturbance the leader lease of a vanished leader runs out first.
    let lease = TimeDelta::from_std(super::rig::LEADER_LEASE).unwrap_or(TimeDelta::MAX);
    let mut delays: Vec<i64> = Vec::new();
    // Injected failures answered to each environment's reaper, in time order.
    let reaper_faults = injected_faults_by_env(&calls, true);
    for s in input
        .sessions
        .iter()
        .filter(|s| s.status == SessionStatus::Expired)
    {
        let Some(env) = ENVS.iter().position(|e| *e == s.env.as_str()) else {
            continue;
        };
        let objs = objects_of.get(&s.id).map(Vec::as_slice).unwrap_or_default();
        let vms: Vec<&str> = objs
            .iter()
            .filter(|(r, _)| *r == "virtualmachines")
            .map(|(_, n)| n.as_str())
            .collect();
        let e = s.expires_at;
        // The first accepted delete of each VM; the latest of them.
        let mut done: Option<DateTime<Utc>> = None;
        let mut missing = false;
        for vm in &vms {
            let first = by_object.get(&("virtualmachines", *vm)).and_then(|cs| {
                cs.iter()
                    .find(|c| c.verb == Verb::Delete && accepted_delete(c.status))
                    .map(|c| c.at)
            });
            match first {
                Some(t) => done = Some(done.map_or(t, |d| d.max(t))),
                None => {
                    // Never created: nothing to delete.
                    let created = by_object.get(&("virtualmachines", *vm)).is_some_and(|cs| {
                        cs.iter().any(|c| c.verb == Verb::Create && c.status == 201)
                    });
                    missing |= created;
                }
            }
        }
        if missing {
            expiry.check(false, || {
                format!("{} ({}): expired at {e}, a VM never deleted", s.id, s.env)
            });
            continue;
        }
        let Some(done) = done else { continue };
        // What disturbed it between its expiry and the delete: faults on its objects, its
        // reaper down, PostgreSQL down.
        let mut last_fault: Option<DateTime<Utc>> = None;
        for (r, n) in objs {
            if let Some(cs) = by_object.get(&(*r, n.as_str())) {
                for c in cs {
                    if c.at >= e - cycle && c.at <= done && injected(c.status) {
                        last_fault = Some(last_fault.map_or(c.at, |l| l.max(c.at)));
                    }
                }
            }
        }
        // A failed call of its reaper's cycle (a list retried with backoff, say) holds up
        // the next cycle too.
        let faults = &reaper_faults[env];
        let upto = faults.partition_point(|t| *t <= done);
        if let Some(t) = upto.checked_sub(1).map(|i| faults[i])
            && t >= e - cycle
        {
            last_fault = Some(last_fault.map_or(t, |l| l.max(t)));
        }
        for d in &disturbances {
            let relevant = match d.what {
                Disrupted::Reaper(x) => x == env,
                Disrupted::Postgres => true,
                Disrupted::Server(_) => false,
            };
            if relevant && d.start <= done && d.end >= e - cycle - lease {
                last_fault = Some(last_fault.map_or(d.end, |l| l.max(d.end)));
            }
        }
        let bound = match last_fault {
            None => e + expiry_bound,
            Some(f) => f.max(e) + lease + cycle + expiry_bound,
        };
        delays.push((done - e).num_milliseconds());
        expiry.check(done <= bound, || {
            format!(
                "{} ({}): expired at {e}, VM delete accepted {} ms later{}",
                s.id,
                s.env,
                (done - e).num_milliseconds(),
                last_fault.map_or_else(String::new, |f| format!(
                    ", last disturbance {} ms after expiry",
                    (f - e).num_milliseconds()
                ))
            )
        });
    }
    table.rows.push(expiry);

    // The servers' own limit (the first layer): a VM create the quota refused means a server
    // admitted a session past the limit. By design a server does not limit when it cannot
    // count (its list of VMs failed): excused when that server's VM list failed just before,
    // and when the same create succeeded moments later (the quota's recount lag).
    let mut first_layer = Row::new("server VM limit held (quota unused)");
    for (e, _) in ENVS.iter().enumerate() {
        let user = kube_user(e, false);
        let mine: Vec<&Call<'_>> = calls
            .iter()
            .filter(|c| c.user == Some(user.as_str()) && c.resource == "virtualmachines")
            .collect();
        let mut failed_lists: Vec<DateTime<Utc>> = mine
            .iter()
            .filter(|l| l.verb == Verb::List && injected(l.status))
            .map(|l| l.at)
            .collect();
        failed_lists.sort();
        // Created at last, by name: a refusal the same create got past moments later was the
        // quota recounting what a deletion freed (it lags the cluster by a second or several;
        // the server retries such a refusal for `quota_recount_wait`, 15 s), not the server
        // admitting too much.
        let mut created: HashMap<&str, Vec<DateTime<Utc>>> = HashMap::new();
        for c in mine
            .iter()
            .filter(|c| c.verb == Verb::Create && (200..300).contains(&c.status))
        {
            created.entry(c.name).or_default().push(c.at);
        }
        for c in mine.iter().filter(|c| c.verb == Verb::Create) {
            let refused = c.status == 403;
            let i = failed_lists.partition_point(|t| *t < c.at - TimeDelta::seconds(10));
            let uncounted = failed_lists.get(i).is_some_and(|t| *t <= c.at);
            let recounted = created.get(c.name).is_some_and(|ts| {
                ts.iter()
                    .any(|t| *t > c.at && *t <= c.at + TimeDelta::seconds(20))
            });
            first_layer.check(!refused || uncounted || recounted, || {
                format!("{user}: VM {} refused by the quota at {}", c.name, c.at)
            });
        }
    }
    table.rows.push(first_layer);

    // Deletes only by the object's own environment.
    let mut cross = Row::new("no object deleted by the other env");
    let mut creator: HashMap<(&str, &str), usize> = HashMap::new();
    // Attempted creates count too: a server rolls back (deletes) what it tried to create.
    for c in calls.iter().filter(|c| c.verb == Verb::Create) {
        let Some(user) = c.user else { continue };
        if let Some(e) = (0..ENVS.len()).find(|e| user == kube_user(*e, false)) {
            creator.insert((c.resource, c.name), e);
        }
    }
    let mut rowless = 0u64;
    for c in calls
        .iter()
        .filter(|c| matches!(c.verb, Verb::Delete | Verb::Deletecollection))
    {
        let Some(user) = c.user else { continue };
        let Some(by) =
            (0..ENVS.len()).find(|e| user == kube_user(*e, true) || user == kube_user(*e, false))
        else {
            continue;
        };
        if c.verb == Verb::Deletecollection {
            cross.check(false, || {
                format!("{user} deleted a whole collection of {}", c.resource)
            });
            continue;
        }
        // Whose object: its session's environment, else (a row lost with PostgreSQL's
        // unflushed commits) the environment of the process that created it.
        let whose = owner
            .get(c.name)
            .map(|(env, _)| *env)
            .or_else(|| creator.get(&(c.resource, c.name)).copied());
        if whose.is_some() && !owner.contains_key(c.name) {
            rowless += 1;
        }
        cross.check(whose == Some(by), || match whose {
            Some(env) => format!("{user} deleted {} {} of {}", c.resource, c.name, ENVS[env]),
            None => format!(
                "{user} deleted {} {}, of no known session",
                c.resource, c.name
            ),
        });
    }
    table.rows.push(cross);
    if rowless > 0 {
        table.notes.push(format!(
            "deletes of objects whose row PostgreSQL lost in a crash (the throwaway cluster \
             runs with synchronous_commit off): {rowless}"
        ));
    }

    // A final row only after its objects' deletion was accepted.
    let mut order = Row::new("row final only after its VMs/Secrets deleted");
    for s in input.sessions.iter().filter(|s| {
        matches!(
            s.status,
            SessionStatus::Expired | SessionStatus::Finished | SessionStatus::Failed
        )
    }) {
        let Some(reclaimed) = s.reclaimed_at else {
            order.check(false, || {
                format!("{} is {} without reclaimed_at", s.id, s.status)
            });
            continue;
        };
        for (r, n) in objects_of.get(&s.id).map(Vec::as_slice).unwrap_or_default() {
            let Some(cs) = by_object.get(&(*r, n.as_str())) else {
                continue;
            };
            let Some(created) = cs
                .iter()
                .filter(|c| c.verb == Verb::Create && c.status == 201)
                .map(|c| c.at)
                .max()
            else {
                continue;
            };
            let deleted = cs
                .iter()
                .filter(|c| c.verb == Verb::Delete && accepted_delete(c.status) && c.at >= created)
                .map(|c| c.at)
                .min();
            order.check(deleted.is_some_and(|d| d <= reclaimed), || match deleted {
                Some(d) => format!(
                    "{} ({}) {} at {reclaimed}; its {r} {n} deleted {} ms later",
                    s.id,
                    s.env,
                    s.status,
                    (d - reclaimed).num_milliseconds()
                ),
                None => format!(
                    "{} ({}) {} at {reclaimed}; its {r} {n} (created {created}) never deleted",
                    s.id, s.env, s.status
                ),
            });
        }
    }
    table.rows.push(order);

    // After the drain.
    let mut drained = Row::new("drained: namespace empty, rows final");
    for (kind, names) in input.leftovers {
        drained.check(names.is_empty(), || {
            format!(
                "{} {kind} left: {}",
                names.len(),
                names.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
            )
        });
    }
    let live: Vec<&Session> = input
        .sessions
        .iter()
        .filter(|s| s.status.is_live())
        .collect();
    drained.check(live.is_empty(), || {
        format!(
            "{} rows still live: {}",
            live.len(),
            live.iter()
                .take(5)
                .map(|s| format!("{} ({} {})", s.id, s.env, s.status))
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    table.rows.push(drained);

    // 5xx answers.
    let mut fivexx = Row::new("no 5xx but 503 in a database outage");
    let outages: Vec<(DateTime<Utc>, DateTime<Utc>)> = disturbances
        .iter()
        .filter(|d| d.what == Disrupted::Postgres)
        .map(|d| (d.start, d.end + OUTAGE_TAIL))
        .collect();
    let server_faults = injected_faults_by_env(&calls, false);
    let ended_at: HashMap<String, DateTime<Utc>> = input
        .sessions
        .iter()
        .filter_map(|s| s.finished_at.map(|t| (s.id.to_string(), t)))
        .collect();
    let calls_journal = lock(&input.journal.calls);
    let mut by_answer: BTreeMap<String, u64> = BTreeMap::new();
    for c in calls_journal.iter() {
        *by_answer
            .entry(if c.status == 0 {
                format!("no answer ({})", c.code)
            } else if c.code.is_empty() {
                c.status.to_string()
            } else {
                format!("{} {}", c.status, c.code)
            })
            .or_default() += 1;
        if c.status < 500 {
            fivexx.checks += 1;
            continue;
        }
        let in_outage = outages
            .iter()
            .any(|(a, b)| c.started <= *b && c.ended >= *a);
        let fault_during = {
            let v = &server_faults[c.env];
            let i = v.partition_point(|t| *t < c.started - TimeDelta::seconds(1));
            v.get(i).is_some_and(|t| *t <= c.ended)
        };
        let ok = match (c.status, c.code.as_str()) {
            (503, "capacity") => true,
            (503, "database_unavailable") => in_outage,
            // The cluster answered with an injected failure during this request.
            (503, "cluster_unavailable") => fault_during,
            // Grading while the VM is being reclaimed (the session ended during the request).
            (502, "agent_unavailable") => c
                .session
                .as_deref()
                .and_then(|id| ended_at.get(id))
                .is_some_and(|t| *t <= c.ended + TimeDelta::seconds(2)),
            _ => false,
        };
        fivexx.check(ok, || {
            format!(
                "{} {} answered {} {} at {}{}",
                ENVS[c.env],
                c.route,
                c.status,
                c.code,
                c.started,
                if in_outage {
                    " (during a database outage)"
                } else {
                    ""
                }
            )
        });
    }
    drop(calls_journal);
    table.rows.push(fivexx);

    // Children that exited by themselves. A process that cannot reach PostgreSQL while it
    // starts exits (its supervisor starts it again): excused during an outage.
    let mut crashes = Row::new("no process exited by itself");
    crashes.checks = 1;
    let mut excused = 0;
    for c in lock(&input.journal.crashes).iter() {
        let in_outage = outages
            .iter()
            .any(|(a, b)| c.seen >= *a && c.seen <= *b + TimeDelta::seconds(5));
        if in_outage {
            excused += 1;
            continue;
        }
        crashes.violations += 1;
        if crashes.examples.len() < EXAMPLES {
            crashes.examples.push(format!(
                "{} exited ({}) at {}; last lines:\n{}",
                c.name, c.status, c.seen, c.tail
            ));
        }
    }
    if excused > 0 {
        table.notes.push(format!(
            "processes that exited while PostgreSQL was down (started again): {excused}"
        ));
    }
    table.rows.push(crashes);

    // Notes: what happened.
    let sessions_by_status = {
        let mut m: BTreeMap<&str, u64> = BTreeMap::new();
        for s in input.sessions {
            *m.entry(s.status.as_str()).or_default() += 1;
        }
        m
    };
    table.notes.push(format!(
        "sessions: {} ({})",
        input.sessions.len(),
        sessions_by_status
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    delays.sort_unstable();
    if !delays.is_empty() {
        let pct = |p: usize| delays[(delays.len() - 1) * p / 100];
        table.notes.push(format!(
            "expiry -> VM delete accepted: p50 {} ms, p99 {} ms, max {} ms ({} expired sessions)",
            pct(50),
            pct(99),
            delays[delays.len() - 1],
            delays.len()
        ));
    }
    table.notes.push(format!(
        "most VMs at once: {} (limit {}); VM creates refused by the quota: {}",
        input.peak_vms,
        input.settings.vm_limit,
        calls
            .iter()
            .filter(|c| c.verb == Verb::Create
                && c.resource == "virtualmachines"
                && c.status == 403)
            .count()
    ));
    table.notes.push(format!(
        "kube API calls: {} ({} injected failures)",
        calls.len(),
        calls.iter().filter(|c| injected(c.status)).count()
    ));
    table.notes.push(format!(
        "answers: {}",
        by_answer
            .iter()
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    table.notes.push(format!(
        "activity: {}",
        lock(&input.journal.activity)
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    table.notes.push(format!(
        "run: {} s of load, then the drain ({} s)",
        (input.drain_started - input.run_started).num_seconds(),
        (Utc::now() - input.drain_started).num_seconds()
    ));
    table
}
