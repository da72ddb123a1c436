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
use ttlab_model::{EnvName, Runtime, SessionStatus};
use ttlab_store::{Session, Store};

use super::linger::Held;
use super::rig::{Disrupted, Disturbance, Journal, Shared, Target, kube_user, lock, nodes_of};
use super::{ENVS, Settings};

/// The row of the VM limit over all sites (both environments).
const VM_LIMIT_ROW: &str = "VMs at once <= limit (both envs)";
/// How often the continuous checks run.
const WATCH_EVERY: Duration = Duration::from_millis(500);
/// After a PostgreSQL outage, how long the servers may still answer 503 while they reconnect.
const OUTAGE_TAIL: TimeDelta = TimeDelta::seconds(5);
/// Examples printed per violated invariant.
const EXAMPLES: usize = 5;
/// After a fault on one process's connection ends, how long its answers may still show it
/// (a request that was waiting on the cut connection, a reconnect).
const LINK_TAIL: TimeDelta = TimeDelta::seconds(5);
/// After a site returns, how long a server may still answer about its sessions as about a lost
/// site's: until its next probe of the site (every 10 s) finds it back.
const SITE_TAIL: TimeDelta = TimeDelta::seconds(12);
/// After a site is lost, by when every server has found it so (and places no start there):
/// its next probe of the site starts within one probe interval and, the site hanging, fails
/// after the probe's budget; with 2 s for the scheduling of both.
fn site_found_lost() -> TimeDelta {
    use ttlab_api::tasks::cluster_probe::{CLUSTER_PROBE_INTERVAL, CLUSTER_PROBE_TIMEOUT};
    TimeDelta::from_std(CLUSTER_PROBE_INTERVAL + CLUSTER_PROBE_TIMEOUT).unwrap_or(TimeDelta::MAX)
        + TimeDelta::seconds(2)
}
/// The share of sessions (in percent) that must reach running when every fault injected was
/// transient.
const RUNNING_PERCENT: u32 = 99;

/// One row of the table.
#[derive(Debug, Default)]
pub(crate) struct Row {
    pub name: String,
    pub checks: u64,
    pub violations: u64,
    pub examples: Vec<String>,
    /// A share of checks that must pass (the row passes with some violations); none: every
    /// check must pass.
    pub min_share: Option<f64>,
}

impl Row {
    fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            ..Self::default()
        }
    }

    /// Whether the row holds.
    pub(crate) fn passed(&self) -> bool {
        match self.min_share {
            None => self.violations == 0,
            Some(share) => {
                self.checks == 0
                    || (self.checks - self.violations) as f64 >= share * self.checks as f64
            }
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
        self.rows.iter().filter(|r| !r.passed()).count()
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
                if r.passed() { "PASS" } else { "FAIL" }
            );
        }
        for r in self.rows.iter().filter(|r| r.violations > 0) {
            let _ = writeln!(
                out,
                "violations of \"{}\" (first {}){}:",
                r.name,
                r.examples.len(),
                if r.passed() {
                    ", within the share allowed"
                } else {
                    ""
                }
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
    /// Over all sites.
    pub vm_limit: Row,
    /// By site (none with one site: the row over all is that site's).
    pub site_vm_limit: Vec<Row>,
    pub one_per_user: Row,
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
    let settings = &shared.settings;
    let multi = settings.sites.len() > 1;
    let mut live = Live {
        vm_limit: Row::new(VM_LIMIT_ROW),
        site_vm_limit: if multi {
            settings
                .sites
                .iter()
                .map(|site| Row::new(&format!("{site}: VMs at once <= its limit")))
                .collect()
        } else {
            Vec::new()
        },
        one_per_user: Row::new("one live session per user"),
    };
    let limit = settings.vm_limit;
    let site_limit = settings.site_vm_limit;
    let envs: Vec<EnvName> = ENVS.iter().filter_map(|e| e.parse().ok()).collect();
    let mut reported_peak = vec![0; settings.sites.len()];
    let mut reported_total = 0;
    loop {
        let vms = kube.vms();
        // Over all: the VMs of every site now (each site's own peak is checked by its row),
        // and with one site its peak, which sees every instant.
        let total = if multi {
            vms.iter().map(|(now, _)| now).sum()
        } else {
            vms.first().map_or(0, |(_, peak)| *peak)
        };
        live.vm_limit
            .check(total <= limit || total <= reported_total, || {
                format!("{total} VMs existed at once over all sites (limit {limit})")
            });
        reported_total = reported_total.max(total);
        for (i, row) in live.site_vm_limit.iter_mut().enumerate() {
            let peak = vms.get(i).map_or(0, |(_, peak)| *peak);
            row.check(peak <= site_limit || peak <= reported_peak[i], || {
                format!(
                    "{peak} VMs existed at once on {} (limit {site_limit})",
                    settings.sites[i]
                )
            });
            reported_peak[i] = reported_peak[i].max(peak);
        }

        let mut users: BTreeMap<String, u32> = BTreeMap::new();
        let mut read = true;
        for env in &envs {
            // One query per environment: a snapshot (pages read one after the other could see a
            // user's old session and their new one).
            match store.sessions().list_live(env, None, 1_000_000).await {
                Ok(rows) => {
                    // An unclaimed warm-pool member is nobody's session.
                    for user in rows.iter().filter_map(|s| s.user.as_ref()) {
                        *users.entry(user.to_string()).or_default() += 1;
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
    /// Each call with the index of the site it went to.
    pub calls: &'a [(usize, CallRecord)],
    pub journal: &'a Journal,
    pub lessons: &'a LessonSet,
    /// By site: (kind, names) of what is left.
    pub leftovers: &'a [Vec<(String, Vec<String>)>],
    pub live: &'a Live,
    /// By site: the most VMs at once.
    pub peak_vms: &'a [usize],
    pub run_started: DateTime<Utc>,
    pub drain_started: DateTime<Utc>,
    /// VMs whose deletion the soak held with a finalizer, by name.
    pub held: &'a BTreeMap<String, Held>,
}

/// A call as the analysis needs it.
struct Call<'a> {
    /// The index of the site it went to.
    site: usize,
    at: DateTime<Utc>,
    verb: Verb,
    resource: &'a str,
    name: &'a str,
    status: u16,
    user: Option<&'a str>,
}

/// A row of the continuous checks, for the table.
fn copy_row(row: &Row) -> Row {
    Row {
        name: row.name.clone(),
        checks: row.checks,
        violations: row.violations,
        examples: row.examples.clone(),
        min_share: row.min_share,
    }
}

/// The index of the site session `s` records (none for a name the soak did not configure).
fn site_of(settings: &Settings, s: &Session) -> Option<usize> {
    settings.sites.iter().position(|n| n == s.site.as_str())
}

/// The sites taken away: (site, from, to) of each loss.
fn site_losses(disturbances: &[Disturbance]) -> Vec<(usize, DateTime<Utc>, DateTime<Utc>)> {
    disturbances
        .iter()
        .filter_map(|d| match d.what {
            Disrupted::Site(x) => Some((x, d.start, d.end)),
            _ => None,
        })
        .collect()
}

/// Whether session `s` was being prepared (from its creation until it ran or ended) while its
/// own site was lost: a loss longer than the lessons' readiness timeout fails such a start
/// whatever ttlab does.
fn prepared_during_own_loss(
    settings: &Settings,
    s: &Session,
    losses: &[(usize, DateTime<Utc>, DateTime<Utc>)],
) -> bool {
    let Some(site) = site_of(settings, s) else {
        return false;
    };
    let from = s.created_at - TimeDelta::seconds(1);
    let to = s
        .ready_at
        .or(s.finished_at)
        .or(s.reclaimed_at)
        .unwrap_or_else(Utc::now);
    losses
        .iter()
        .any(|(x, a, b)| *x == site && *a <= to && *b >= from)
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

/// Whether the VM `name` existed at `at`: a create of it was answered 201 before, and no
/// deletion of it was accepted since.
fn existed_at(
    by_object: &HashMap<(&str, &str), Vec<&Call<'_>>>,
    name: &str,
    at: DateTime<Utc>,
) -> bool {
    let Some(calls) = by_object.get(&("virtualmachines", name)) else {
        return false;
    };
    let before = calls.iter().filter(|c| c.at < at);
    let created = before
        .clone()
        .filter(|c| c.verb == Verb::Create && c.status == 201)
        .map(|c| c.at)
        .max();
    let deleted = before
        .filter(|c| c.verb == Verb::Delete && accepted_delete(c.status))
        .map(|c| c.at)
        .max();
    created.is_some_and(|c| deleted.is_none_or(|d| d < c))
}

/// Checks the whole record after the drain.
pub(crate) fn analyse(input: &Input<'_>) -> Table {
    let calls: Vec<Call<'_>> = input
        .calls
        .iter()
        .filter_map(|(site, c)| {
            Some(Call {
                site: *site,
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
        if s.runtime == Runtime::Pod {
            for node in &nodes {
                objs.push(("pods", ttlab_vm_manifest::pod_name(s.id, node)));
            }
        } else {
            for node in &nodes {
                objs.push(("virtualmachines", ttlab_vm_manifest::vm_name(s.id, node)));
                objs.push(("secrets", ttlab_vm_manifest::secret_name(s.id, node)));
            }
        }
        if s.runtime != Runtime::Pod && nodes.len() > 1 {
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
    let losses = site_losses(&disturbances);

    let mut table = Table::default();
    let multi = input.settings.sites.len() > 1;
    let mut vm_limit = copy_row(&input.live.vm_limit);
    let peak_sum: usize = input.peak_vms.iter().sum();
    if !multi {
        vm_limit.check(peak_sum <= input.settings.vm_limit, || {
            format!(
                "kube-sim's peak: {peak_sum} VMs (limit {})",
                input.settings.vm_limit
            )
        });
    }
    table.rows.push(vm_limit);
    for (i, live_row) in input.live.site_vm_limit.iter().enumerate() {
        let mut row = copy_row(live_row);
        let peak = input.peak_vms.get(i).copied().unwrap_or(0);
        let limit = input.settings.site_vm_limit;
        row.check(peak <= limit, || {
            format!(
                "the kube-sim of {}: a peak of {peak} VMs (limit {limit})",
                input.settings.sites[i]
            )
        });
        table.rows.push(row);
    }
    table.rows.push(copy_row(&input.live.one_per_user));

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
    // The same delays split: expiries nothing disturbed (from 10 s before to the delete), and
    // the rest.
    let mut quiet_delays: Vec<i64> = Vec::new();
    let mut disturbed_delays: Vec<i64> = Vec::new();
    // Injected failures answered to each environment's reaper, in time order.
    let reaper_faults = injected_faults_by_env(&calls, true);
    // Expiries on a site in reach while another site was lost, nothing else disturbing their
    // reclamation: expiry -> VM delete accepted.
    let mut healthy_in_loss: Vec<(i64, String)> = Vec::new();
    let mut healthy_in_loss_disturbed = 0u64;
    for s in input
        .sessions
        .iter()
        .filter(|s| s.status == SessionStatus::Expired)
    {
        let Some(env) = ENVS.iter().position(|e| *e == s.env.as_str()) else {
            continue;
        };
        let site = site_of(input.settings, s);
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
        // What disturbed it between `from` and the delete: faults on its objects, its reaper
        // down, PostgreSQL down; disturbances count when they lasted until `until_from`.
        let latest_fault = |from: DateTime<Utc>, until_from: DateTime<Utc>| {
            let mut last: Option<DateTime<Utc>> = None;
            let mut seen = |t: DateTime<Utc>| last = Some(last.map_or(t, |l| l.max(t)));
            for (r, n) in objs {
                if let Some(cs) = by_object.get(&(*r, n.as_str())) {
                    for c in cs {
                        if c.at >= from && c.at <= done && injected(c.status) {
                            seen(c.at);
                        }
                    }
                }
            }
            // A failed call of its reaper's cycle (a list retried with backoff, say) holds
            // up the next cycle too.
            let faults = &reaper_faults[env];
            let upto = faults.partition_point(|t| *t <= done);
            if let Some(t) = upto.checked_sub(1).map(|i| faults[i])
                && t >= from
            {
                seen(t);
            }
            for d in &disturbances {
                let relevant = match d.what {
                    Disrupted::Reaper(x) => x == env,
                    Disrupted::Postgres => true,
                    Disrupted::Link(l, _) => l.reaper && l.env == env,
                    // Its own site taken away (a loss of another site excuses nothing).
                    Disrupted::Site(x) => site == Some(x),
                    Disrupted::Server(_) | Disrupted::Rolling(_) => false,
                };
                if relevant && d.start <= done && d.end >= until_from {
                    seen(d.end);
                }
            }
            last
        };
        let last_fault = latest_fault(e - cycle, e - cycle - lease);
        // Quiet: nothing disturbed it from 10 s before its expiry to its delete.
        let quiet_from = e - TimeDelta::seconds(QUIET_BEFORE_EXPIRY_SECS);
        let quiet = latest_fault(quiet_from, quiet_from).is_none();
        let bound = match last_fault {
            None => e + expiry_bound,
            Some(f) => f.max(e) + lease + cycle + expiry_bound,
        };
        // (A VM of the environment held terminating meanwhile is no excuse: the reaper's
        // deadline cycles run side by side, so the one waiting for that VM to go holds back
        // no other expiry.)
        let delay = (done - e).num_milliseconds();
        delays.push(delay);
        if quiet {
            quiet_delays.push(delay);
        } else {
            disturbed_delays.push(delay);
        }
        if losses
            .iter()
            .any(|(x, from, to)| site != Some(*x) && *from <= e && e <= *to)
        {
            if last_fault.is_none() {
                healthy_in_loss.push((delay, format!("{} ({}, {})", s.id, s.env, s.site)));
            } else {
                healthy_in_loss_disturbed += 1;
            }
        }
        expiry.check(done <= bound, || {
            format!(
                "{} ({}, {}): expired at {e}, VM delete accepted {} ms later{}",
                s.id,
                s.env,
                s.site,
                (done - e).num_milliseconds(),
                last_fault.map_or_else(String::new, |f| format!(
                    ", last disturbance {} ms after expiry",
                    (f - e).num_milliseconds()
                ))
            )
        });
    }
    table.rows.push(expiry);
    if input.settings.lose_site.is_some() {
        healthy_in_loss_rows(
            input.settings,
            &healthy_in_loss,
            healthy_in_loss_disturbed,
            &mut table,
        );
    }

    // The servers' own limit (the first layer): a VM create the quota refused means a server
    // admitted a session past the limit. By design a server does not limit when it cannot
    // count (its list of VMs failed): excused when that server's VM list failed just before,
    // when the same create succeeded moments later (the quota's recount lag), and when the
    // VM already existed (a create repeated by a server that took the session over: quota
    // admission runs before the API server looks at the name, so a quota this very VM fills
    // refuses the repeat with 403 rather than 409, and the server adopts the VM).
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
        // A list that never got its answer (the server's connection to the API blackholed,
        // stalled or losing replies) leaves it unable to count just as well.
        failed_lists.extend(
            link_windows(&disturbances, e, false, Some(Target::Kube))
                .into_iter()
                .chain(losses.iter().map(|(_, from, to)| (*from, *to)))
                .flat_map(|(start, end)| [start, end + LINK_TAIL]),
        );
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
            let existed = existed_at(&by_object, c.name, c.at);
            first_layer.check(!refused || uncounted || recounted || existed, || {
                format!("{user}: VM {} refused by the quota at {}", c.name, c.at)
            });
        }
    }
    table.rows.push(first_layer);

    // Deletes only by the object's own environment.
    let mut cross: Vec<Row> = input
        .settings
        .sites
        .iter()
        .map(|site| {
            Row::new(&if multi {
                format!("{site}: no object deleted by the other env")
            } else {
                "no object deleted by the other env".to_owned()
            })
        })
        .collect();
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
        let Some(cross) = cross.get_mut(c.site) else {
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
    table.rows.extend(cross);
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
    let mut leaks = Vec::new();
    for (i, site) in input.leftovers.iter().enumerate() {
        let name = input.settings.sites.get(i).map_or("?", String::as_str);
        let mut leak = Row::new(&format!("{name}: no leak (nothing left after the drain)"));
        for (kind, names) in site {
            let example = || {
                format!(
                    "{} {kind} left on {name}: {}",
                    names.len(),
                    names.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
                )
            };
            drained.check(names.is_empty(), example);
            leak.check(names.is_empty(), example);
        }
        leaks.push(leak);
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
    if multi {
        table.rows.extend(leaks);
    }
    site_rows(
        input,
        &calls,
        &owner,
        &objects_of,
        &by_object,
        &losses,
        &mut table,
    );

    // 5xx answers.
    let mut fivexx = Row::new("no 5xx but 503 in a database outage");
    let outages: Vec<(DateTime<Utc>, DateTime<Utc>)> = disturbances
        .iter()
        .filter(|d| d.what == Disrupted::Postgres)
        .map(|d| (d.start, d.end + OUTAGE_TAIL))
        .collect();
    let server_faults = injected_faults_by_env(&calls, false);
    let server_db_links: Vec<_> = (0..ENVS.len())
        .map(|e| link_windows(&disturbances, e, false, Some(Target::Postgres)))
        .collect();
    let server_kube_links: Vec<_> = (0..ENVS.len())
        .map(|e| link_windows(&disturbances, e, false, Some(Target::Kube)))
        .collect();
    let rolls: Vec<Vec<(DateTime<Utc>, DateTime<Utc>)>> = (0..ENVS.len())
        .map(|e| {
            disturbances
                .iter()
                .filter(|d| d.what == Disrupted::Rolling(e))
                .map(|d| (d.start - TimeDelta::seconds(1), d.end))
                .collect()
        })
        .collect();
    // A killed server from its kill until it is ready again: restarted, it answers the
    // requests that need the database 503 `database_unavailable` until it is prepared on it.
    let restarts: Vec<Vec<(DateTime<Utc>, DateTime<Utc>)>> = (0..ENVS.len())
        .map(|e| {
            disturbances
                .iter()
                .filter(|d| d.what == Disrupted::Server(e))
                .map(|d| (d.start, d.end))
                .collect()
        })
        .collect();
    let ended_at: HashMap<String, DateTime<Utc>> = input
        .sessions
        .iter()
        .filter_map(|s| s.finished_at.map(|t| (s.id.to_string(), t)))
        .collect();
    // The site of each session, for the answers about it while its site was lost.
    let site_by_id: HashMap<String, usize> = input
        .sessions
        .iter()
        .filter_map(|s| site_of(input.settings, s).map(|i| (s.id.to_string(), i)))
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
        let during = |w: &[(DateTime<Utc>, DateTime<Utc>)]| {
            w.iter()
                .any(|(a, b)| c.started <= *b + LINK_TAIL && c.ended >= *a)
        };
        let own_db = during(&server_db_links[c.env]);
        let own_kube = during(&server_kube_links[c.env]);
        // This server's connection to a site's API misbehaved: its probe may find the site
        // unreachable, and finds it back at the next probe.
        let own_kube_site = server_kube_links[c.env]
            .iter()
            .any(|(a, b)| c.started <= *b + SITE_TAIL && c.ended >= *a);
        let rolled = during(&rolls[c.env]);
        let restarting = during(&restarts[c.env]);
        // A site was lost during the request, and the request was about one of its sessions
        // (or about none: a start may have looked at every site).
        let site_lost = losses.iter().any(|(x, from, to)| {
            c.started <= *to + SITE_TAIL
                && c.ended >= *from
                && c.session
                    .as_deref()
                    .is_none_or(|id| site_by_id.get(id) == Some(x))
        });
        let ok = match (c.status, c.code.as_str()) {
            (503, "capacity") => true,
            (503, "database_unavailable") => in_outage || own_db || restarting,
            // The cluster answered with an injected failure during this request, or this
            // server's connection to it misbehaved.
            (503, "cluster_unavailable") => fault_during || own_kube || site_lost,
            // The session's site cannot be reached: it was taken away.
            (503, "site_unavailable") => site_lost || own_kube_site,
            // A store or cluster call, or the whole request, ran out of time while this
            // server's connection misbehaved.
            (_, "timeout" | "request_timeout") => own_db || own_kube || site_lost,
            // A rolled server refusing new starts while it hands over.
            (503, "shutting_down") => rolled,
            // Grading while the VM is being reclaimed (the session ended during the request).
            (502, "agent_unavailable") => {
                let raced = c
                    .session
                    .as_deref()
                    .and_then(|id| ended_at.get(id))
                    .is_some_and(|t| *t <= c.ended + TimeDelta::seconds(2));
                // (A pod lab's exec failed by the API server is a 503 cluster_unavailable,
                // not this: no excuse for it here.)
                // With several sites the server reaches the agents through each site's API
                // server (portforward): an injected failure or a misbehaving connection there
                // fails the agent's connection as it would any other call.
                raced || site_lost || (multi && (fault_during || own_kube))
            }
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

    // Children that exited by themselves. Neither the server nor the reaper exits for want of
    // its database (they wait for it, not ready): every exit is a violation, outage or not.
    let mut crashes = Row::new("no process exited by itself");
    crashes.checks = 1;
    for c in lock(&input.journal.crashes).iter() {
        crashes.violations += 1;
        if crashes.examples.len() < EXAMPLES {
            crashes.examples.push(format!(
                "{} exited ({}) at {}; last lines:\n{}",
                c.name, c.status, c.seen, c.tail
            ));
        }
    }
    table.rows.push(crashes);

    // A ghost is a running session whose VM vanished. The soak deletes no VM, crashes no guest
    // and powers none off, so every ghost was made by ttlab itself (its history is in the notes).
    let mut ghosts = Row::new("no running lab lost its VM (0 ghosts)");
    for s in input.sessions.iter().filter(|s| s.ready_at.is_some()) {
        ghosts.check(s.status != SessionStatus::Ghost, || {
            format!("{} ({}, {}) became a ghost", s.id, s.env, s.lesson)
        });
    }
    table.rows.push(ghosts);

    held_rows(input, &owner, &mut table);
    deploy_row(input, &disturbances, &mut table);
    running_rows(input, &disturbances, &server_faults, &mut table);

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
    // A ghost is a running session whose VM vanished: the soak never deletes one itself, so
    // each is shown with what was done to its objects, to tell who did it.
    for s in input
        .sessions
        .iter()
        .filter(|s| s.status == SessionStatus::Ghost)
        .take(EXAMPLES)
    {
        let mut lines = vec![format!(
            "ghost {} ({}, {}): created {}, running {}, ghost {}",
            s.id,
            s.env,
            s.lesson,
            s.created_at.format("%H:%M:%S%.3f"),
            s.ready_at
                .map_or_else(|| "never".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
            s.finished_at
                .map_or_else(|| "?".into(), |t| t.format("%H:%M:%S%.3f").to_string()),
        )];
        for (resource, name) in objects_of.get(&s.id).map(Vec::as_slice).unwrap_or_default() {
            for c in by_object
                .get(&(*resource, name.as_str()))
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .filter(|c| match c.verb {
                    Verb::List | Verb::Watch => false,
                    // A get that found nothing: how a ghost is confirmed.
                    Verb::Get => c.status == 404,
                    _ => true,
                })
            {
                lines.push(format!(
                    "    {} {:?} {resource}/{name} by {} -> {}",
                    c.at.format("%H:%M:%S%.3f"),
                    c.verb,
                    c.user.unwrap_or("?"),
                    c.status
                ));
            }
        }
        table.notes.push(lines.join("\n"));
    }
    let mut by_lesson: BTreeMap<&str, u64> = BTreeMap::new();
    for s in input.sessions {
        *by_lesson.entry(s.lesson.as_str()).or_default() += 1;
    }
    table.notes.push(format!(
        "sessions by lesson: {}",
        by_lesson
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    if let Some(all) = delay_figures(&mut delays) {
        table.notes.push(format!(
            "expiry -> VM delete accepted: {all} ({} expired sessions)",
            delays.len()
        ));
    }
    let quiet_p99 = percentile_of(&mut quiet_delays, 99);
    table.notes.push(format!(
        "  quiet (no fault from {QUIET_BEFORE_EXPIRY_SECS} s before expiry to the delete): {} ({} sessions){}",
        delay_figures(&mut quiet_delays).unwrap_or_else(|| "none".to_owned()),
        quiet_delays.len(),
        quiet_p99.map_or_else(String::new, |p| format!(
            "; p99 {p} ms vs target <= {QUIET_EXPIRY_P99_MS} ms: {}",
            if p <= QUIET_EXPIRY_P99_MS { "met" } else { "MISSED" }
        ))
    ));
    table.notes.push(format!(
        "  after faults: {} ({} sessions)",
        delay_figures(&mut disturbed_delays).unwrap_or_else(|| "none".to_owned()),
        disturbed_delays.len()
    ));
    table.notes.push(format!(
        "most VMs at once: {}{} (limit {}); VM creates refused by the quota: {}",
        input.peak_vms.iter().sum::<usize>(),
        if multi {
            " (the sum of the sites' peaks)"
        } else {
            ""
        },
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

/// When the connections of environment `env`'s server (or reaper) to `target` (or to either)
/// misbehaved: (start, end) of each network fault.
fn link_windows(
    disturbances: &[Disturbance],
    env: usize,
    reaper: bool,
    target: Option<Target>,
) -> Vec<(DateTime<Utc>, DateTime<Utc>)> {
    disturbances
        .iter()
        .filter_map(|d| match d.what {
            Disrupted::Link(l, _)
                if l.env == env && l.reaper == reaper && target.is_none_or(|t| t == l.target) =>
            {
                Some((d.start, d.end))
            }
            _ => None,
        })
        .collect()
}

/// VMs whose deletion hung on the soak's finalizer: each stayed (it is counted by kube-sim's
/// peak and the quota, which the VM-limit rows check) and its session's row went final only
/// once it was released.
fn held_rows(input: &Input<'_>, owner: &HashMap<String, (usize, &Session)>, table: &mut Table) {
    let mut row = Row::new("row final only after its held VM was gone");
    let mut released = 0u64;
    let mut terminating_ms: Vec<i64> = Vec::new();
    for (name, h) in input.held {
        let (Some(since), Some(gone)) = (h.deleting_since, h.released_at) else {
            continue;
        };
        released += 1;
        terminating_ms.push((gone - since).num_milliseconds());
        let Some((_, s)) = owner.get(name) else {
            continue;
        };
        if !matches!(
            s.status,
            SessionStatus::Expired | SessionStatus::Finished | SessionStatus::Failed
        ) {
            continue;
        }
        let final_at = s.reclaimed_at;
        row.check(final_at.is_some_and(|f| f >= gone), || {
            format!(
                "{} ({}) {} at {}; its VM {name} terminating since {since}, still held by its \
                 finalizer until {gone}",
                s.id,
                s.env,
                s.status,
                final_at.map_or_else(|| "?".to_owned(), |f| f.to_string())
            )
        });
    }
    table.rows.push(row);
    terminating_ms.sort_unstable();
    table.notes.push(format!(
        "VM deletions held by a finalizer: {} VMs held, {released} released after {}",
        input.held.len(),
        match (terminating_ms.first(), terminating_ms.last()) {
            (Some(lo), Some(hi)) => format!("{lo}–{hi} ms terminating"),
            _ => "none terminating".to_owned(),
        }
    ));
}

/// Sessions being prepared when their environment's server was rolled (SIGTERM with a
/// successor serving): none may fail.
fn deploy_row(input: &Input<'_>, disturbances: &[Disturbance], table: &mut Table) {
    let mut row = Row::new("0 sessions failed by a deploy");
    let mut handed = 0u64;
    let losses = site_losses(disturbances);
    let mut on_lost_site = 0u64;
    for d in disturbances {
        let Disrupted::Rolling(env) = d.what else {
            continue;
        };
        let t = d.start;
        for s in input.sessions.iter().filter(|s| {
            s.env.as_str() == ENVS[env]
                && s.created_at <= t
                && s.ready_at.is_none_or(|r| r > t)
                && s.finished_at.is_none_or(|f| f > t)
        }) {
            handed += 1;
            // Its site lost meanwhile: the loss, not the deploy, decides (the running row's
            // notes count those).
            if prepared_during_own_loss(input.settings, s, &losses) {
                on_lost_site += 1;
                continue;
            }
            row.check(s.status != SessionStatus::Failed, || {
                format!(
                    "{} ({}) being prepared at the deploy at {t}, failed at {}: {}",
                    s.id,
                    s.env,
                    s.finished_at
                        .map_or_else(|| "?".to_owned(), |f| f.to_string()),
                    s.failure_reason.as_deref().unwrap_or("(no reason)")
                )
            });
        }
    }
    table.rows.push(row);
    let stops: Vec<i64> = disturbances
        .iter()
        .filter(|d| matches!(d.what, Disrupted::Rolling(_)))
        .map(|d| (d.end - d.start).num_milliseconds())
        .collect();
    if !stops.is_empty() {
        table.notes.push(format!(
            "rolling restarts: {}, the old server gone {} ms after its SIGTERM (max {} ms); \
             sessions being prepared then (handed over): {handed}{}",
            stops.len(),
            stops
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            stops.iter().max().copied().unwrap_or(0),
            if on_lost_site > 0 {
                format!(" ({on_lost_site} of them on a site lost meanwhile, not checked)")
            } else {
                String::new()
            }
        ));
    }
}

/// Whether session `s`'s preparation (from its creation until it ran or ended) met an injected
/// fault: a failed call of its server, its server killed, rolled or cut off, PostgreSQL down.
fn met_faults(
    s: &Session,
    env: usize,
    site: Option<usize>,
    disturbances: &[Disturbance],
    server_faults: &[Vec<DateTime<Utc>>],
) -> bool {
    let from = s.created_at - TimeDelta::seconds(1);
    let to = s
        .ready_at
        .or(s.finished_at)
        .or(s.reclaimed_at)
        .unwrap_or_else(Utc::now);
    let v = &server_faults[env];
    let i = v.partition_point(|t| *t < from);
    if v.get(i).is_some_and(|t| *t <= to) {
        return true;
    }
    disturbances.iter().any(|d| {
        let relevant = match d.what {
            Disrupted::Server(x) | Disrupted::Rolling(x) => x == env,
            Disrupted::Postgres => true,
            Disrupted::Link(l, _) => l.env == env && !l.reaper,
            Disrupted::Site(x) => site == Some(x),
            Disrupted::Reaper(_) => false,
        };
        relevant && d.start <= to && d.end + LINK_TAIL >= from
    })
}

/// A failure reason with what varies taken out (object names, ids, numbers), so that equal
/// causes count together.
pub(crate) fn normalise_reason(reason: &str) -> String {
    let mut out = String::new();
    for word in reason.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        let core = word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-');
        if core.starts_with(ttlab_vm_manifest::NAME_PREFIX) {
            out.push_str(&word.replace(core, "<object>"));
            continue;
        }
        let mut digits = false;
        for ch in word.chars() {
            if ch.is_ascii_digit() {
                if !digits {
                    out.push('N');
                }
                digits = true;
            } else {
                digits = false;
                out.push(ch);
            }
        }
    }
    const MAX: usize = 110;
    if out.chars().count() > MAX {
        out = out.chars().take(MAX).collect::<String>() + "…";
    }
    out
}

/// The issue's figure: sessions reach running when every fault injected was transient (all the
/// soak injects are), with the failed ones tabulated by reason, those that met faults apart
/// from those that met none.
fn running_rows(
    input: &Input<'_>,
    disturbances: &[Disturbance],
    server_faults: &[Vec<DateTime<Utc>>],
    table: &mut Table,
) {
    let mut row = Row::new(&format!(
        "sessions reach running >= {RUNNING_PERCENT}% (faults all transient)"
    ));
    row.min_share = Some(f64::from(RUNNING_PERCENT) / 100.0);
    // (met faults, not) × (reached running, sessions)
    let mut tally = [[0u64; 2]; 2];
    let mut reasons: BTreeMap<String, [u64; 2]> = BTreeMap::new();
    // A start the quota refused at capacity puts its student back in the line: a wait, not a
    // failure, and only a refusal that outlasts free places may fail a session.
    let mut requeued = 0u64;
    let losses = site_losses(disturbances);
    // (sessions, reached running, failed) of those prepared while their site was lost
    let mut on_lost_site = [0u64; 3];
    let mut no_quota_failure = Row::new("no admitted session failed on quota");
    for s in input.sessions {
        let Some(env) = ENVS.iter().position(|e| *e == s.env.as_str()) else {
            continue;
        };
        no_quota_failure.check(
            !failed_on_quota(s.status, s.failure_reason.as_deref()),
            || {
                format!(
                    "{} ({} {}) failed: {}",
                    s.id,
                    s.env,
                    s.lesson,
                    s.failure_reason.as_deref().unwrap_or("(no reason)")
                )
            },
        );
        if s.status == SessionStatus::Requeued {
            requeued += 1;
            continue;
        }
        // Prepared while its own site was lost: counted apart (a loss longer than the
        // lessons' readiness timeout fails a start whatever ttlab does).
        if prepared_during_own_loss(input.settings, s, &losses) {
            on_lost_site[0] += 1;
            on_lost_site[1] += u64::from(s.ready_at.is_some());
            on_lost_site[2] += u64::from(s.status == SessionStatus::Failed);
            continue;
        }
        // Finished by its student before it ran: it never had to reach running.
        if s.status == SessionStatus::Finished && s.ready_at.is_none() {
            continue;
        }
        let met = met_faults(
            s,
            env,
            site_of(input.settings, s),
            disturbances,
            server_faults,
        );
        let ran = s.ready_at.is_some();
        let k = usize::from(!met);
        tally[k][1] += 1;
        if ran {
            tally[k][0] += 1;
        }
        if s.status == SessionStatus::Failed {
            let reason = s
                .failure_reason
                .as_deref()
                .map_or_else(|| "(no reason recorded)".to_owned(), normalise_reason);
            reasons.entry(reason).or_default()[k] += 1;
        }
        row.check(ran, || {
            format!(
                "{} ({} {}) {}{}: {}",
                s.id,
                s.env,
                s.lesson,
                s.status,
                if met {
                    " after faults"
                } else {
                    " with no fault"
                },
                s.failure_reason.as_deref().unwrap_or("(no reason)")
            )
        });
    }
    table.rows.push(row);
    table.rows.push(no_quota_failure);
    if input.settings.lose_site.is_some() {
        let [all, ran, failed] = on_lost_site;
        table.notes.push(format!(
            "sessions being prepared on a site while it was lost (not in the share above): \
             {all}, {ran} reached running, {failed} failed"
        ));
    }
    table.notes.push(format!(
        "starts the quota refused at capacity, back in the line (waits, not failures): {requeued}"
    ));
    let pct = |[ran, all]: [u64; 2]| {
        if all == 0 {
            "none".to_owned()
        } else {
            format!("{ran}/{all} ({:.1} %)", ran as f64 * 100.0 / all as f64)
        }
    };
    table.notes.push(format!(
        "reached running: {} of the sessions that met transient faults, {} of those that met none",
        pct(tally[0]),
        pct(tally[1])
    ));
    if reasons.is_empty() {
        table
            .notes
            .push("failed sessions by reason: none".to_owned());
    } else {
        let mut by_count: Vec<(&String, &[u64; 2])> = reasons.iter().collect();
        by_count.sort_by_key(|(r, n)| (std::cmp::Reverse(n[0] + n[1]), (*r).clone()));
        let mut text = String::from(
            "failed sessions by reason (after transient faults / with no fault injected):",
        );
        for (reason, [with, without]) in by_count {
            let _ = write!(text, "\n  {with:>5} / {without:<5} {reason}");
        }
        table.notes.push(text);
    }
}

/// The expiries on the sites in reach while another site was lost (nothing else disturbing
/// their reclamation): expiry -> VM delete accepted within the expiry bound, at p99.
fn healthy_in_loss_rows(
    settings: &Settings,
    delays: &[(i64, String)],
    disturbed: u64,
    table: &mut Table,
) {
    let bound_ms = i64::try_from(settings.expiry_bound.as_millis()).unwrap_or(i64::MAX);
    let mut row = Row::new(&format!(
        "expired VM deleted <= {}s on the sites in reach during a loss (p99)",
        settings.expiry_bound.as_secs()
    ));
    row.min_share = Some(0.99);
    for (delay, what) in delays {
        row.check(*delay <= bound_ms, || {
            format!(
                "{what}: expired while another site was lost, VM delete accepted {delay} ms later"
            )
        });
    }
    table.rows.push(row);
    let mut ms: Vec<i64> = delays.iter().map(|(d, _)| *d).collect();
    let p99 = percentile_of(&mut ms, 99);
    table.notes.push(format!(
        "expiry -> VM delete accepted on the sites in reach while a site was lost: {} ({} \
         sessions; {disturbed} more met other faults){}",
        delay_figures(&mut ms).unwrap_or_else(|| "none".to_owned()),
        ms.len(),
        p99.map_or_else(String::new, |p| format!(
            "; p99 {p} ms vs target <= {bound_ms} ms: {}",
            if p <= bound_ms { "met" } else { "MISSED" }
        ))
    ));
}

/// The sites: every session's objects on the site its row records, and what each site had
/// placed on it; with sites lost, that starts ran on the other sites meanwhile and that the
/// lost site's sessions that expired while it was away were reclaimed once it was back.
fn site_rows(
    input: &Input<'_>,
    calls: &[Call<'_>],
    owner: &HashMap<String, (usize, &Session)>,
    objects_of: &HashMap<ttlab_model::SessionId, Vec<(&'static str, String)>>,
    by_object: &HashMap<(&str, &str), Vec<&Call<'_>>>,
    losses: &[(usize, DateTime<Utc>, DateTime<Utc>)],
    table: &mut Table,
) {
    let settings = input.settings;
    let sites = &settings.sites;
    let mut placed = Row::new("objects only on their session's site");
    let mut by_site = vec![0u64; sites.len()];
    for s in input.sessions {
        let site = site_of(settings, s);
        if let Some(i) = site {
            by_site[i] += 1;
        }
        placed.check(site.is_some(), || {
            format!(
                "{} ({}) records the site {}, none of {}",
                s.id,
                s.env,
                s.site,
                sites.join(", ")
            )
        });
    }
    for c in calls
        .iter()
        .filter(|c| c.verb == Verb::Create && (200..300).contains(&c.status))
    {
        let Some((_, s)) = owner.get(c.name) else {
            continue;
        };
        let Some(site) = site_of(settings, s) else {
            continue;
        };
        placed.check(c.site == site, || {
            format!(
                "{} {} of {} ({}, placed on {}) created on {}",
                c.resource,
                c.name,
                s.id,
                s.env,
                s.site,
                sites.get(c.site).map_or("?", String::as_str)
            )
        });
    }
    table.rows.push(placed);
    for (i, name) in sites.iter().enumerate() {
        table.notes.push(format!(
            "{name}: {} sessions placed, most VMs at once {} (limit {})",
            by_site[i],
            input.peak_vms.get(i).copied().unwrap_or(0),
            settings.site_vm_limit
        ));
    }
    if settings.lose_site.is_none() {
        return;
    }

    let journal = lock(&input.journal.calls);
    let found = site_found_lost();
    let mut elsewhere = Row::new(&format!(
        "starts go to the sites in reach {}s into a loss",
        found.num_seconds()
    ));
    let (mut tried_all, mut other_all, mut ran_all, mut on_lost_all) = (0u64, 0u64, 0u64, 0u64);
    let mut capacity_all = 0u64;
    let mut on_lost_late = 0u64;
    for (x, whole_from, to) in losses {
        // The servers find a site lost at their next probe of it (every 10 s, failing after
        // 5 s when the site hangs; a start placed meanwhile may go to it): checked from then
        // on.
        let from = &(*whole_from + found);
        if from >= to {
            continue;
        }
        // Starts that a site in reach could have taken: placed, or failed on a cluster (not
        // refused at capacity, for a conflict, or by a database outage).
        let starts = || {
            journal.iter().filter(|c| {
                c.route == "POST /api/sessions" && c.started >= *from && c.started <= *to
            })
        };
        let tried = starts()
            .filter(|c| {
                (200..300).contains(&c.status)
                    || matches!(
                        c.code.as_str(),
                        "site_unavailable" | "cluster_unavailable" | "timeout" | "request_timeout"
                    )
            })
            .count() as u64;
        let at_capacity = starts()
            .filter(|c| c.status == 503 && c.code == "capacity")
            .count() as u64;
        let during = || {
            input
                .sessions
                .iter()
                .filter(|s| s.created_at >= *from && s.created_at <= *to)
        };
        let other = during()
            .filter(|s| site_of(settings, s).is_some_and(|i| i != *x))
            .count() as u64;
        let ran = during()
            .filter(|s| site_of(settings, s).is_some_and(|i| i != *x) && s.ready_at.is_some())
            .count() as u64;
        let on_lost = input
            .sessions
            .iter()
            .filter(|s| {
                s.created_at >= *whole_from
                    && s.created_at <= *to
                    && site_of(settings, s) == Some(*x)
            })
            .count() as u64;
        for s in during() {
            elsewhere.check(site_of(settings, s) != Some(*x), || {
                format!(
                    "{} ({}, {}) placed at {} on {}, lost since {whole_from}",
                    s.id, s.env, s.lesson, s.created_at, s.site
                )
            });
            on_lost_late += u64::from(site_of(settings, s) == Some(*x));
        }
        tried_all += tried;
        capacity_all += at_capacity;
        other_all += other;
        ran_all += ran;
        on_lost_all += on_lost;
        elsewhere.check(tried == 0 || ran > 0, || {
            format!(
                "{} lost from {from} to {to}: {tried} starts placed or failed on a cluster, \
                 {other} placed on the other sites, none ran",
                sites[*x]
            )
        });
    }
    drop(journal);
    table.rows.push(elsewhere);
    table.notes.push(format!(
        "while a site was lost ({} losses), from {}s into each loss: {tried_all} starts placed or \
         failed on a cluster, {capacity_all} refused at capacity; {other_all} sessions placed on \
         the other sites ({ran_all} ran), {on_lost_late} on the lost site ({on_lost_all} over the \
         whole losses)",
        losses.len(),
        found.num_seconds()
    ));

    let mut back = Row::new("lost site's expired sessions reclaimed after it returns");
    let mut after_return_ms: Vec<i64> = Vec::new();
    for (x, from, to) in losses {
        for s in input.sessions.iter().filter(|s| {
            site_of(settings, s) == Some(*x) && s.expires_at >= *from && s.expires_at <= *to
        }) {
            let objs = objects_of.get(&s.id).map(Vec::as_slice).unwrap_or_default();
            // Every VM it created got its deletion accepted after its creation.
            let undeleted: Vec<&str> = objs
                .iter()
                .filter(|(r, _)| *r == "virtualmachines")
                .filter(|(r, n)| {
                    let cs = by_object
                        .get(&(*r, n.as_str()))
                        .map(Vec::as_slice)
                        .unwrap_or_default();
                    let created = cs
                        .iter()
                        .filter(|c| c.verb == Verb::Create && c.status == 201)
                        .map(|c| c.at)
                        .max();
                    created.is_some_and(|t| {
                        !cs.iter().any(|c| {
                            c.verb == Verb::Delete && accepted_delete(c.status) && c.at >= t
                        })
                    })
                })
                .map(|(_, n)| n.as_str())
                .collect();
            let reclaimed = s.reclaimed_at.filter(|_| !s.status.is_live());
            if let Some(r) = reclaimed
                && r > *to
            {
                after_return_ms.push((r - *to).num_milliseconds());
            }
            back.check(reclaimed.is_some() && undeleted.is_empty(), || {
                format!(
                    "{} ({}) on {}, expired at {} while it was lost ({from} to {to}): {}{}",
                    s.id,
                    s.env,
                    s.site,
                    s.expires_at,
                    s.status,
                    if undeleted.is_empty() {
                        String::new()
                    } else {
                        format!(", VMs never deleted: {}", undeleted.join(", "))
                    }
                )
            });
        }
    }
    table.rows.push(back);
    let checked = back_checks(table);
    table.notes.push(format!(
        "sessions of a lost site that expired while it was away: {checked}, of which {} \
         reclaimed after its return: {}",
        after_return_ms.len(),
        delay_figures(&mut after_return_ms)
            .map_or_else(|| "none".to_owned(), |f| format!("{f} after the return"))
    ));
}

/// The checks of the last row (the one just pushed).
fn back_checks(table: &Table) -> u64 {
    table.rows.last().map_or(0, |r| r.checks)
}

/// How long before its expiry a session's reclamation must have met no fault to count as quiet.
const QUIET_BEFORE_EXPIRY_SECS: i64 = 10;
/// The target for quiet expiries: p99 of expiry -> VM delete accepted, in milliseconds.
const QUIET_EXPIRY_P99_MS: i64 = 1000;

/// `p`th percentile (nearest rank below) of `delays`, sorted in place; `None` when empty.
fn percentile_of(delays: &mut [i64], p: usize) -> Option<i64> {
    delays.sort_unstable();
    (!delays.is_empty()).then(|| delays[(delays.len() - 1) * p / 100])
}

/// `p50 N ms, p99 N ms, max N ms` of `delays` (sorted in place); `None` when empty.
fn delay_figures(delays: &mut [i64]) -> Option<String> {
    let p50 = percentile_of(delays, 50)?;
    let p99 = percentile_of(delays, 99)?;
    let max = delays[delays.len() - 1];
    Some(format!("p50 {p50} ms, p99 {p99} ms, max {max} ms"))
}

/// Whether a session ended failed because a namespace quota refused one of its objects (the
/// saga's reasons for a full namespace and for a refusal that outlasted free places).
fn failed_on_quota(status: SessionStatus, reason: Option<&str>) -> bool {
    status == SessionStatus::Failed && reason.is_some_and(|r| r.contains("quota"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delay_figures_are_nearest_rank_percentiles_of_the_sorted_delays() {
        let mut delays: Vec<i64> = (1..=100).rev().collect();
        assert_eq!(
            delay_figures(&mut delays).as_deref(),
            Some("p50 50 ms, p99 99 ms, max 100 ms")
        );
        assert_eq!(delay_figures(&mut []), None);
        assert_eq!(percentile_of(&mut [7], 99), Some(7));
    }

    #[test]
    fn only_a_failure_the_quota_caused_breaks_the_quota_invariant() {
        let full = "the lab namespace is full (its quota refused the VM); try again later";
        assert!(failed_on_quota(SessionStatus::Failed, Some(full)));
        assert!(!failed_on_quota(SessionStatus::Requeued, Some(full)));
        assert!(!failed_on_quota(
            SessionStatus::Failed,
            Some("setup script failed: exit 1")
        ));
        assert!(!failed_on_quota(SessionStatus::Failed, None));
    }

    #[test]
    fn reasons_that_differ_only_in_names_and_numbers_count_together() {
        let a = normalise_reason(
            "could not create the VM tt-0123456789abcdef0123456789abcdef-vm: the cluster failed 3 times in 12 s",
        );
        let b = normalise_reason(
            "could not create the VM tt-fedcba9876543210fedcba9876543210-vm: the cluster failed 7 times in 2 s",
        );
        assert_eq!(a, b);
        assert_eq!(
            a,
            "could not create the VM <object>: the cluster failed N times in N s"
        );
        assert_ne!(a, normalise_reason("setup script failed: exit 1"));
    }

    #[test]
    fn a_share_row_passes_with_few_violations_and_fails_with_more() {
        let mut row = Row::new("r");
        row.min_share = Some(0.99);
        for i in 0..200 {
            row.check(i != 0, String::new);
        }
        assert!(row.passed(), "1 of 200 failed: 99.5 %");
        for _ in 0..2 {
            row.check(false, String::new);
        }
        assert!(!row.passed(), "3 of 202 failed: under 99 %");
        let mut strict = Row::new("s");
        strict.check(false, String::new);
        assert!(!strict.passed());
    }
}
