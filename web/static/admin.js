// The admin page: capacity, the warm pools (resize, pause, resume, reset), the scheduled classes
// (add, cancel), the reaper's last cycles with "Collect now", the replica's background tasks,
// every live session
// (open one to see its stages, console owner, objects and actions, and to end or extend it),
// the operators' recent actions and readiness histograms per lesson and stage. Refreshes every
// 5 seconds.

import {
  ApiError, api, clockText, dropToken, el, notice, show, takeToken, timeText, tokenUser,
} from './common.js';

const token = takeToken();
const REFRESH_MS = 5000;
let openSession = null; // the id of the session shown in detail

async function main() {
  if (!token) {
    show('view-signin');
    return;
  }
  const who = tokenUser(token);
  document.getElementById('who').textContent = who.user;
  document.getElementById('collect').addEventListener('click', collect);
  document.getElementById('detail-close').addEventListener('click', () => {
    openSession = null;
    document.getElementById('detail').hidden = true;
  });
  document.getElementById('end-form').addEventListener('submit', endSession);
  document.getElementById('extend-form').addEventListener('submit', extendSession);
  document.getElementById('class-form').addEventListener('submit', addClass);
  show('view-admin');
  await refresh();
  setInterval(refresh, REFRESH_MS);
}

function handleError(e) {
  if (e instanceof ApiError && e.status === 401) {
    dropToken();
    show('view-signin');
    notice(`You are signed out: ${e.message}. Open your admin login link again.`, 'error');
    return;
  }
  if (e instanceof ApiError && e.status === 403) {
    show('view-signin');
    notice('This page needs an admin login link; the one used is a student\'s.', 'error');
    return;
  }
  notice(e.message || String(e), 'error');
}

async function refresh() {
  try {
    const [capacity, pools, classes, cycles, tasks, sessions, actions, stats] = await Promise.all([
      api(token, 'GET', '/api/admin/capacity'),
      api(token, 'GET', '/api/admin/pools'),
      api(token, 'GET', '/api/admin/classes'),
      api(token, 'GET', '/api/admin/reaper?limit=10'),
      api(token, 'GET', '/api/admin/tasks'),
      api(token, 'GET', '/api/admin/sessions?scope=live'),
      api(token, 'GET', '/api/admin/actions?limit=20'),
      api(token, 'GET', '/api/admin/stats'),
    ]);
    renderCapacity(capacity);
    renderPools(pools.pools || []);
    renderClasses(classes.classes || [], pools.pools || []);
    renderCycles(cycles);
    renderTasks(tasks);
    renderSessions(sessions);
    renderActions(actions);
    renderReadiness(stats.readiness || []);
    if (openSession) await showDetail(openSession);
    document.getElementById('refreshed').textContent = `updated ${timeText(new Date().toISOString())}`;
    const box = document.getElementById('notice');
    if (box.classList.contains('error')) notice(null);
  } catch (e) {
    handleError(e);
  }
}

function stat(label, value, hint) {
  return el('div', { class: 'stat' },
    el('div', { class: 'stat-value' }, value),
    el('div', { class: 'stat-label' }, label),
    hint ? el('div', { class: 'muted small' }, hint) : null);
}

/**
 * One site's card: its VMs against its limit, and whether the cluster probe reached it; with
 * several sites, also its quota, its memory, its sessions starting and the lessons whose
 * golden disk is ready there.
 */
function siteStat(site, several) {
  const used = site.in_use === null || site.in_use === undefined ? '?' : String(site.in_use);
  const card = stat(`Site ${site.name}`, `${used} / ${site.vm_limit}`,
    site.reachable ? `${site.namespace}, reachable` : `${site.namespace}, unreachable: ${site.why || 'no answer'}`);
  card.dataset.site = site.name;
  if (several) {
    card.append(el('div', { class: 'small', 'data-field': 'site-quota' }, `Quota: ${quotaText(site)}`));
    const m = site.memory || {};
    if (m.quota !== null && m.quota !== undefined) {
      card.append(el('div', { class: 'small', 'data-field': 'site-memory' },
        `Memory requested / limit: ${gib(m.used_bytes)} / ${gib(m.hard_bytes)}`));
    }
    card.append(el('div', { class: 'small', 'data-field': 'site-starting' }, `Sessions starting: ${site.starting_sessions}`));
    const golden = site.golden_disks_ready || [];
    card.append(el('div', { class: 'small', 'data-field': 'site-golden' },
      `Golden disks ready: ${golden.length ? golden.join(', ') : 'none'}`));
  }
  if (!site.reachable) card.classList.add('error');
  return card;
}

/** `n` as text, `?` when unknown. */
function known(n) {
  return n === null || n === undefined ? '?' : String(n);
}

function renderCapacity(c) {
  const box = document.getElementById('capacity');
  const sites = c.sites || [];
  if (sites.length > 1) {
    // Several sites: the totals over the sites whose VMs could be counted, then a card each
    // (its quota with it: every site has its own namespace and quota).
    const counted = sites.filter((s) => s.in_use !== null && s.in_use !== undefined);
    const sum = (xs, f) => xs.reduce((n, x) => n + f(x), 0);
    const lost = sites.length - counted.length;
    box.replaceChildren(
      stat('VMs running / limit', `${sum(counted, (s) => s.in_use)} / ${sum(counted, (s) => s.vm_limit)}`,
        lost ? `over the ${counted.length} of ${sites.length} sites that answered` : `over all ${sites.length} sites`),
      stat('Free places', String(sum(counted, (s) => s.available || 0))),
      stat('Sessions starting', String(c.starting_sessions)),
      ...sites.map((s) => siteStat(s, true)),
    );
  } else {
    box.replaceChildren(
      stat('VMs running / limit', `${known(c.live_vms)} / ${c.limit}`, 'counted in the cluster, not the database'),
      stat('Free places', known(c.available)),
      stat('Sessions starting', String(c.starting_sessions)),
      stat('Namespace', c.namespace),
      stat('Quota', quotaText(c)),
      memoryStat(c),
      ...sites.map((s) => siteStat(s, false)),
    );
  }
  // What one session of each VM lesson costs, KubeVirt's overhead included, and how many more
  // the quota's memory allows.
  const costs = (c.memory && c.memory.lessons) || [];
  if (costs.length) {
    box.append(el('ul', { class: 'costs small' }, ...costs.map((l) => el('li', { 'data-lesson-cost': l.lesson },
      `${l.lesson}: ${gib(l.session_bytes)} a session (${l.vms} VM${l.vms === 1 ? '' : 's'} × `
      + `${gib(l.guest_bytes)} guest + ${mib(l.overhead_bytes)} KubeVirt overhead + `
      + `${mib(l.vm_bytes - l.launcher_request_bytes)} console log)`
      + (l.more_sessions === null || l.more_sessions === undefined ? '' : ` — memory for ${l.more_sessions} more`)))));
  }
  if (c.error) box.append(el('p', { class: 'error small' }, `Cannot count the VMs: ${c.error}`));
  // Ended sessions whose objects are still going (a guest shutting down, a finalizer): they
  // still hold their places.
  for (const t of c.terminating || []) {
    box.append(el('p', { class: 'small terminating' },
      `Still shutting down since ${timeText(t.since)} (${t.lesson}, ${t.env}): ${(t.objects || []).join(', ')}`));
  }
}

/** Changes a lesson's pool (`PUT`), or hands it back to the lesson file (`DELETE`). */
async function changePool(lesson, method, body) {
  try {
    await api(token, method, `/api/admin/pools/${encodeURIComponent(lesson)}`, body);
    notice(method === 'DELETE' ? `The pool of ${lesson} follows its lesson file again.`
      : `The pool of ${lesson} is changed.`, 'info');
    await refresh();
  } catch (e) {
    handleError(e);
  }
}

function renderPools(pools) {
  const body = document.querySelector('#pools tbody');
  body.replaceChildren();
  if (!pools.length) {
    body.append(el('tr', {}, el('td', { colspan: 9, class: 'muted' }, 'No VM lesson is configured.')));
  }
  for (const p of pools) {
    const s = p.settings;
    const rate = p.hit_rate === null || p.hit_rate === undefined ? '—' : `${Math.round(p.hit_rate * 100)} %`;
    const refill = p.median_refill_seconds === null || p.median_refill_seconds === undefined
      ? '—' : `${p.median_refill_seconds.toFixed(0)} s`;
    const settings = s
      ? `size ${s.size}${s.demand ? ` (from demand, ${s.min}–${s.max})` : ''}, members renewed after ${s.max_age_minutes} min${s.paused ? ', paused' : ''} — ${p.source === 'admin' ? `set by ${p.updated_by}` : 'from the lesson file'}`
      : 'no pool';
    const size = el('input', {
      type: 'number', min: 0, max: 200, value: s ? s.size : 0, class: 'narrow', 'aria-label': `pool size of ${p.lesson}`,
    });
    const resize = el('button', { class: 'secondary small', 'data-pool-resize': p.lesson }, s ? 'Resize' : 'Start a pool');
    resize.addEventListener('click', () => changePool(p.lesson, 'PUT', { size: Number(size.value) }));
    const controls = [size, ' ', resize];
    if (s) {
      const pause = el('button', { class: 'secondary small', 'data-pool-pause': p.lesson }, s.paused ? 'Resume' : 'Pause');
      pause.addEventListener('click', () => changePool(p.lesson, 'PUT', { paused: !s.paused }));
      controls.push(' ', pause);
    }
    if (p.source === 'admin') {
      const reset = el('button', { class: 'secondary small', 'data-pool-reset': p.lesson }, 'Reset');
      reset.addEventListener('click', () => changePool(p.lesson, 'DELETE'));
      controls.push(' ', reset);
    }
    body.append(el('tr', { 'data-pool': p.lesson },
      el('td', {}, p.lesson, p.nodes > 1 ? el('span', { class: 'muted small' }, ` (${p.nodes} VMs each)`) : null),
      el('td', { 'data-field': 'ready' }, String(p.ready)),
      el('td', { 'data-field': 'preparing' }, String(p.preparing)),
      el('td', {}, p.target === null || p.target === undefined ? '—' : String(p.target),
        p.deferred ? el('div', { class: 'muted small' }, `${p.deferred} waiting for free places`) : null),
      el('td', { 'data-field': 'claims' }, `${p.claims_24h} (${p.misses_24h} missed)`,
        p.handover_failures_24h
          ? el('div', { class: 'muted small', 'data-field': 'handover-failures' },
            `${p.handover_failures_24h} hand-over${p.handover_failures_24h === 1 ? '' : 's'} failed`)
          : null),
      el('td', {}, rate),
      el('td', {}, refill),
      el('td', {}, settings, p.why ? el('div', { class: 'muted small' }, p.why) : null),
      el('td', {}, ...controls)));
  }
}

/** A short local date and time of day for an ISO timestamp. */
function whenText(iso) {
  const d = new Date(iso);
  return d.toLocaleString([], { month: 'short', day: 'numeric', hour: '2-digit', minute: '2-digit' });
}

const PHASES = {
  upcoming: 'upcoming', lead_in: 'labs being prepared', running: 'running', over: 'over', cancelled: 'cancelled',
};

function renderClasses(classes, pools) {
  // The lesson choice: every VM lesson (those have pools), filled once so a choice stays.
  const select = document.getElementById('class-lesson');
  if (!select.options.length) {
    for (const p of pools) select.append(el('option', { value: p.lesson }, p.title || p.lesson));
  }
  const body = document.querySelector('#classes tbody');
  body.replaceChildren();
  if (!classes.length) {
    body.append(el('tr', {}, el('td', { colspan: 9, class: 'muted' }, 'No class is scheduled.')));
  }
  for (const c of classes) {
    const cancel = el('button', { class: 'secondary small', 'data-class-cancel': c.id }, 'Cancel');
    cancel.addEventListener('click', () => cancelClass(c));
    const warm = c.warm ? `${c.warm.ready} ready, ${c.warm.preparing} preparing` : '—';
    const allows = c.seats_warm === null || c.seats_warm === undefined ? '—' : `${c.seats_warm} of ${c.seats}`;
    body.append(el('tr', { 'data-class': c.id },
      el('td', {}, c.title, c.join_code ? el('div', { class: 'muted small' }, `code ${c.join_code}`) : null),
      el('td', {}, c.lesson),
      el('td', {}, `${whenText(c.starts_at)} – ${timeText(c.ends_at)}`,
        el('div', { class: 'muted small' }, PHASES[c.phase] || c.phase)),
      el('td', { 'data-field': 'seats' }, String(c.seats),
        c.started ? el('div', { class: 'muted small' }, `${c.started} started`) : null),
      el('td', { 'data-field': 'warm' }, warm),
      el('td', { 'data-field': 'seats-warm' }, allows,
        c.capacity_note ? el('div', { class: 'muted small' }, c.capacity_note) : null),
      el('td', {}, c.lead_time ? c.lead_time.describe.replace(/^lead time /, '') : '—',
        el('div', { class: 'muted small' }, `from ${timeText(c.lead_in_at)}`)),
      el('td', {}, cancel)));
  }
}

/** Schedules the class of the form; the API's refusal is shown beside the form. */
async function addClass(event) {
  event.preventDefault();
  const error = document.getElementById('class-error');
  error.hidden = true;
  const start = new Date(document.getElementById('class-start').value);
  const minutes = Number(document.getElementById('class-minutes').value);
  const body = {
    lesson: document.getElementById('class-lesson').value,
    seats: Number(document.getElementById('class-seats').value),
    starts_at: Number.isNaN(start.getTime()) ? '' : start.toISOString(),
    ends_at: Number.isNaN(start.getTime()) ? '' : new Date(start.getTime() + minutes * 60000).toISOString(),
  };
  const title = document.getElementById('class-title').value.trim();
  if (title) body.title = title;
  const code = document.getElementById('class-code').value.trim();
  if (code) body.join_code = code;
  try {
    const c = await api(token, 'POST', '/api/admin/classes', body);
    notice(c.capacity_note ? `The class ${c.title} is scheduled; ${c.capacity_note}.`
      : `The class ${c.title} is scheduled.`, 'info');
    document.getElementById('class-form').reset();
    await refresh();
  } catch (e) {
    if (e instanceof ApiError && (e.status === 422 || e.status === 400)) {
      error.textContent = e.message;
      error.hidden = false;
      return;
    }
    handleError(e);
  }
}

async function cancelClass(c) {
  if (!window.confirm(`Cancel the class ${c.title}? Labs prepared for it become ordinary warm labs.`)) return;
  try {
    await api(token, 'DELETE', `/api/admin/classes/${encodeURIComponent(c.id)}`);
    notice(`The class ${c.title} is cancelled.`, 'info');
    await refresh();
  } catch (e) {
    handleError(e);
  }
}

/** Bytes as GiB with two decimals. */
function gib(bytes) {
  return `${(bytes / 2 ** 30).toFixed(2)} GiB`;
}

/** Bytes as whole MiB. */
function mib(bytes) {
  return `${Math.round(bytes / 2 ** 20)} MiB`;
}

/** The memory the pods of the namespace request against the quota's `requests.memory`. */
function memoryStat(c) {
  const m = c.memory || {};
  if (m.quota === null || m.quota === undefined) {
    return stat('Memory requested / limit', c.quota_error ? 'unknown' : 'no limit', 'nothing limits requests.memory');
  }
  return stat('Memory requested / limit', `${gib(m.used_bytes)} / ${gib(m.hard_bytes)}`,
    `requests.memory of ${m.quota}, KubeVirt's overhead included: ${gib(m.free_bytes)} free`);
}

/** The namespace's ResourceQuotas as `name: resource used / hard`, or `none`. */
function quotaText(c) {
  if (c.quota_error) return `unknown (${c.quota_error})`;
  if (!c.quota || !c.quota.length) return 'none';
  return c.quota.map((q) => {
    const keys = Object.keys(q.hard || {}).sort();
    const parts = keys.map((k) => `${k} ${(q.used || {})[k] ?? '0'} / ${q.hard[k]}`);
    return `${q.name}: ${parts.join(', ') || 'no limits'}`;
  }).join('; ');
}

function counts(d) {
  if (!d) return '';
  return d.failed ? `${d.done} (${d.failed} failed)` : String(d.done);
}

function failures(c) {
  return ['expired', 'orphans', 'ghosts', 'stuck'].reduce((n, k) => n + ((c[k] && c[k].failed) || 0), 0);
}

function renderCycles(cycles) {
  const body = document.querySelector('#cycles tbody');
  body.replaceChildren();
  if (!cycles.length) {
    body.append(el('tr', {}, el('td', { colspan: 9, class: 'muted' },
      'No reaper cycle recorded yet for this environment. Is ttlab-reaper running?')));
  }
  for (const c of cycles) {
    const failed = failures(c);
    body.append(el('tr', { class: failed ? 'has-failures' : '' },
      el('td', {}, timeText(c.started_at)),
      el('td', { 'data-field': 'site' }, c.site || '—'),
      el('td', {}, c.trigger + (c.dry_run ? ' (dry run)' : '')),
      el('td', {}, `${c.duration_ms} ms`),
      el('td', {}, counts(c.expired)),
      el('td', {}, counts(c.orphans)),
      el('td', {}, counts(c.ghosts)),
      el('td', {}, counts(c.stuck)),
      el('td', {}, failed ? `${failed}: ${c.errors.map((e) => `${e.subject}: ${e.message}`).join('; ')}` : '0')));
  }
}

/** How long before `now` (both ISO timestamps of the server's clock) `iso` was. */
function agoText(iso, now) {
  if (!iso) return '—';
  const s = Math.max(0, Math.round((new Date(now) - new Date(iso)) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min ago`;
}

function durationText(ms) {
  if (ms === null || ms === undefined) return '—';
  return ms < 10000 ? `${ms} ms` : `${(ms / 1000).toFixed(0)} s`;
}

/** The replica's background tasks: when each last ran, how long it took, its last success
 *  and, until the next success, its last error. */
function renderTasks(listing) {
  document.getElementById('tasks-replica').textContent = `(replica ${listing.replica})`;
  const now = listing.server_time;
  const body = document.querySelector('#tasks tbody');
  body.replaceChildren();
  for (const t of listing.tasks) {
    let run = t.last_started_at ? agoText(t.last_started_at, now) : 'not yet';
    if (t.running) run = `running since ${agoText(t.last_started_at, now)}`;
    else if (t.finished) run += ' (stopped)';
    const error = t.last_error
      ? `${t.last_error} (${t.consecutive_failures} in a row, ${agoText(t.last_error_at, now)})`
      : '—';
    body.append(el('tr', { 'data-task': t.name, class: t.last_error ? 'has-failures' : '' },
      el('td', {}, t.name, el('div', { class: 'muted small' }, t.description)),
      el('td', { 'data-field': 'last-run' }, run),
      el('td', {}, t.running ? '—' : durationText(t.last_duration_ms)),
      el('td', { 'data-field': 'last-success' }, agoText(t.last_success_at, now)),
      el('td', { 'data-field': 'last-error', class: t.last_error ? 'error' : '' }, error)));
  }
}

function renderSessions(sessions) {
  document.getElementById('live-count').textContent = `(${sessions.length})`;
  const body = document.querySelector('#sessions tbody');
  body.replaceChildren();
  if (!sessions.length) {
    body.append(el('tr', {}, el('td', { colspan: 9, class: 'muted' }, 'No live sessions.')));
  }
  for (const s of sessions) {
    const status = s.status === 'starting' ? `starting (${s.stage.replace('_', ' ')})`
      : s.status === 'finishing' ? `finishing → ${s.finishing_to}` : s.status;
    const disk = s.disk ? `${s.disk.kind}${s.disk.reason && s.disk.reason !== 'ready' ? ` — ${s.disk.reason}` : ''}` : '';
    const open = el('button', { class: 'secondary small', 'data-session': s.id }, 'Open');
    open.addEventListener('click', () => { openSession = s.id; showDetail(s.id); });
    body.append(el('tr', {},
      el('td', {}, open, ' ', s.user || 'pool member (unclaimed)'),
      el('td', {}, s.lesson),
      el('td', { 'data-field': 'site' }, s.site),
      el('td', {}, status),
      el('td', { class: s.remaining_seconds <= 300 ? 'warn' : '' }, clockText(s.remaining_seconds)),
      el('td', {}, s.nodes.map((n) => (s.nodes.length > 1 ? `${n.node}: ${n.vm}` : n.vm)).join(', ')),
      el('td', {}, disk),
      el('td', {}, timeText(s.started_at))));
  }
}

function actionText(a) {
  if (a.action === 'extend') {
    return `extended by ${Math.round(a.added_seconds / 60)} min (to ${timeText(a.expires_after)})`;
  }
  return 'ended';
}

function renderActions(actions) {
  const body = document.querySelector('#actions tbody');
  body.replaceChildren();
  if (!actions.length) {
    body.append(el('tr', {}, el('td', { colspan: 5, class: 'muted' }, 'No operator action recorded yet.')));
  }
  for (const a of actions) {
    body.append(el('tr', {},
      el('td', {}, timeText(a.at)),
      el('td', {}, a.admin),
      el('td', {}, a.session.slice(0, 8)),
      el('td', {}, actionText(a)),
      el('td', {}, a.reason)));
  }
}

/** One histogram per lesson and stage: a bar per bucket, its count beside it. */
function renderReadiness(rows) {
  const box = document.getElementById('readiness');
  box.replaceChildren();
  if (!rows.length) {
    box.append(el('p', { class: 'muted' }, 'No session has become ready yet.'));
    return;
  }
  for (const r of rows) {
    const max = Math.max(1, ...r.buckets.map((b) => b.count));
    const bars = r.buckets.map((b) => el('div', { class: 'hist-row' },
      el('span', { class: 'hist-label' }, b.le === null || b.le === undefined ? '> 600 s' : `≤ ${b.le} s`),
      el('span', { class: 'hist-bar', style: `width: ${Math.round((b.count / max) * 100)}%` }),
      el('span', { class: 'hist-count' }, String(b.count))));
    const d = r.seconds;
    box.append(el('div', { class: 'hist', 'data-lesson': r.lesson, 'data-stage': r.stage },
      el('h4', {}, `${r.lesson} — ${r.stage.replace('_', ' ')}`),
      el('p', { class: 'muted small' }, `${d.count} ${d.count === 1 ? 'session' : 'sessions'} · p50 ${d.p50} s · p90 ${d.p90} s`),
      ...bars));
  }
}

/** The detail of one session: stages with times, the console's owner, objects with their
 *  state, actions, and the full failure detail. */
async function showDetail(id) {
  let d;
  try {
    d = await api(token, 'GET', `/api/admin/sessions/${id}`);
  } catch (e) {
    handleError(e);
    return;
  }
  const s = d.session;
  const box = document.getElementById('detail');
  box.hidden = false;
  box.dataset.session = s.id;
  document.getElementById('detail-title').textContent =
    `${s.user} — ${s.lesson} (${s.status}), reference ${d.reference}`;
  const facts = document.getElementById('detail-facts');
  facts.replaceChildren(
    el('li', {}, `Time left: ${clockText(s.remaining_seconds)} (expires ${timeText(s.expires_at)}, at most ${timeText(s.max_expires_at)})`),
    el('li', {}, `Student extensions: ${s.extensions_used} used, ${s.extensions_left} left`),
    el('li', {}, `Disk: ${s.disk ? `${s.disk.kind} — ${s.disk.reason}` : 'not chosen'}`),
    ...consoleFacts(d.console || []),
    ...(d.terminating ? [el('li', { class: 'terminating' },
      `Still shutting down since ${timeText(d.terminating.since)}: ${d.terminating.objects.join(', ')}`)] : []),
    ...(d.objects_gone_at ? [el('li', {}, `All objects gone at ${timeText(d.objects_gone_at)}`)] : []),
    ...(s.failure_reason ? [el('li', { class: 'error' }, `Failure: ${s.failure_reason}`)] : []));
  const stages = document.querySelector('#detail-stages tbody');
  stages.replaceChildren(...d.stages.map((st) => el('tr', {},
    el('td', {}, st.stage.replace('_', ' ')),
    el('td', {}, st.at ? timeText(st.at) : '—'),
    el('td', {}, st.after_seconds === null || st.after_seconds === undefined ? '' : `${st.after_seconds.toFixed(1)} s`))));
  const objects = document.querySelector('#detail-objects tbody');
  objects.replaceChildren(...(d.objects.length ? d.objects.map((o) => el('tr', {},
    el('td', {}, o.kind), el('td', {}, o.name), el('td', {}, o.state)))
    : [el('tr', {}, el('td', { colspan: 3, class: 'muted' }, d.objects_error || 'No object of it in the cluster.'))]));
  const grading = document.getElementById('detail-grading');
  grading.replaceChildren(...(d.grading.length
    ? d.grading.map((g) => el('li', {}, `${timeText(g.at)}: ${g.passed} of ${g.total} checks passed` +
      (g.failed.length ? ` — failed: ${g.failed.join(', ')}` : '')))
    : [el('li', { class: 'muted' }, 'Not checked yet.')]));
  const acts = document.getElementById('detail-actions');
  acts.replaceChildren(...(d.actions.length
    ? d.actions.map((a) => el('li', {}, `${timeText(a.at)} ${a.admin} ${actionText(a)}: ${a.reason}`))
    : [el('li', { class: 'muted' }, 'No operator action on this session.')]));
  const live = s.status === 'running' || s.status === 'starting';
  document.getElementById('end-form').hidden = !live;
  document.getElementById('extend-form').hidden = s.status !== 'running';
}

const CLOSED_WHY = {
  browser_closed: 'browser closed',
  taken_over: 'taken over by another tab',
  replica_gone: 'server replica gone',
  session_ended: 'session ended',
  lost: 'connection lost',
};

/** Who holds each node's console (or last held it), on which server replica. */
function consoleFacts(consoles) {
  if (!consoles.length) return [el('li', { class: 'console-owner' }, 'Console: never opened')];
  return consoles.map((c) => el('li', { class: 'console-owner' }, `Console of ${c.node}: ` + (c.closed_at
    ? `closed at ${timeText(c.closed_at)} (${CLOSED_WHY[c.closed_why] || 'reason unknown'}), opened by ${c.user} on replica ${c.replica}`
    : `open since ${timeText(c.opened_at)} by ${c.user} on replica ${c.replica}`)));
}

async function endSession(event) {
  event.preventDefault();
  const id = document.getElementById('detail').dataset.session;
  const reason = document.getElementById('end-reason').value;
  if (!window.confirm('End this session now? Its VM is deleted and the student\'s work in it is lost.')) return;
  try {
    await api(token, 'POST', `/api/admin/sessions/${id}/end`, { reason });
    notice('The session was ended; its objects are being reclaimed.', 'ok');
    document.getElementById('end-reason').value = '';
    await refresh();
  } catch (e) {
    handleError(e);
  }
}

async function extendSession(event) {
  event.preventDefault();
  const id = document.getElementById('detail').dataset.session;
  const minutes = Number(document.getElementById('extend-minutes').value);
  const reason = document.getElementById('extend-reason').value;
  try {
    const r = await api(token, 'POST', `/api/admin/sessions/${id}/extend`, { minutes, reason });
    notice(`Extended by ${Math.round(r.action.added_seconds / 60)} min: the session now ends at ${timeText(r.session.expires_at)}.`, 'ok');
    document.getElementById('extend-reason').value = '';
    await refresh();
  } catch (e) {
    handleError(e);
  }
}

async function collect() {
  const button = document.getElementById('collect');
  const report = document.getElementById('collect-report');
  button.disabled = true;
  button.textContent = 'Collecting…';
  report.hidden = false;
  report.className = 'report';
  report.replaceChildren(el('p', {}, 'Waiting for the reaper to run a cycle…'));
  try {
    const c = await api(token, 'POST', '/api/admin/reaper/collect');
    const failed = failures(c);
    report.className = failed ? 'report warn' : 'report ok';
    report.replaceChildren(
      el('h3', {}, `Cycle #${c.id} done in ${c.duration_ms} ms`),
      el('ul', {},
        el('li', {}, `Expired sessions reclaimed: ${counts(c.expired)}`),
        el('li', {}, `Orphan objects deleted: ${counts(c.orphans)}`),
        el('li', {}, `Ghost sessions marked: ${counts(c.ghosts)}`),
        el('li', {}, `Stuck sessions reclaimed: ${counts(c.stuck)}`)),
      c.errors.length
        ? el('div', {}, el('strong', {}, 'Failures (retried next cycle):'),
          el('ul', {}, c.errors.map((e) => el('li', {}, `${e.direction} ${e.subject}: ${e.message}`))))
        : el('p', { class: 'muted' }, 'No failures.'));
    await refresh();
  } catch (e) {
    report.className = 'report error';
    report.replaceChildren(el('p', {}, e.message || String(e)));
  } finally {
    button.disabled = false;
    button.textContent = 'Collect now';
  }
}

main();
