// The admin page: capacity, the reaper's last cycles with "Collect now", and every live session.
// Refreshes every 5 seconds.

import {
  ApiError, api, clockText, dropToken, el, notice, show, takeToken, timeText, tokenUser,
} from './common.js';

const token = takeToken();
const REFRESH_MS = 5000;

async function main() {
  if (!token) {
    show('view-signin');
    return;
  }
  const who = tokenUser(token);
  document.getElementById('who').textContent = who.user;
  document.getElementById('collect').addEventListener('click', collect);
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
    const [capacity, cycles, sessions] = await Promise.all([
      api(token, 'GET', '/api/admin/capacity'),
      api(token, 'GET', '/api/admin/reaper?limit=10'),
      api(token, 'GET', '/api/admin/sessions?scope=live'),
    ]);
    renderCapacity(capacity);
    renderCycles(cycles);
    renderSessions(sessions);
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

function renderCapacity(c) {
  const box = document.getElementById('capacity');
  const live = c.live_vms === null || c.live_vms === undefined ? '?' : String(c.live_vms);
  box.replaceChildren(
    stat('VMs running / limit', `${live} / ${c.limit}`, 'counted in the cluster, not the database'),
    stat('Free places', c.available === null || c.available === undefined ? '?' : String(c.available)),
    stat('Sessions starting', String(c.starting_sessions)),
    stat('Namespace', c.namespace),
    stat('Quota', c.quota ? JSON.stringify(c.quota) : 'none reported'),
  );
  if (c.error) box.append(el('p', { class: 'error small' }, `Cannot count the VMs: ${c.error}`));
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
    body.append(el('tr', {}, el('td', { colspan: 8, class: 'muted' },
      'No reaper cycle recorded yet for this environment. Is ttlab-reaper running?')));
  }
  for (const c of cycles) {
    const failed = failures(c);
    body.append(el('tr', { class: failed ? 'has-failures' : '' },
      el('td', {}, timeText(c.started_at)),
      el('td', {}, c.trigger + (c.dry_run ? ' (dry run)' : '')),
      el('td', {}, `${c.duration_ms} ms`),
      el('td', {}, counts(c.expired)),
      el('td', {}, counts(c.orphans)),
      el('td', {}, counts(c.ghosts)),
      el('td', {}, counts(c.stuck)),
      el('td', {}, failed ? `${failed}: ${c.errors.map((e) => `${e.subject}: ${e.message}`).join('; ')}` : '0')));
  }
}

function renderSessions(sessions) {
  document.getElementById('live-count').textContent = `(${sessions.length})`;
  const body = document.querySelector('#sessions tbody');
  body.replaceChildren();
  if (!sessions.length) {
    body.append(el('tr', {}, el('td', { colspan: 7, class: 'muted' }, 'No live sessions.')));
  }
  for (const s of sessions) {
    const status = s.status === 'starting' ? `starting (${s.stage.replace('_', ' ')})`
      : s.status === 'finishing' ? `finishing → ${s.finishing_to}` : s.status;
    const disk = s.disk ? `${s.disk.kind}${s.disk.reason && s.disk.reason !== 'ready' ? ` — ${s.disk.reason}` : ''}` : '';
    body.append(el('tr', {},
      el('td', {}, s.user),
      el('td', {}, s.lesson),
      el('td', {}, status),
      el('td', { class: s.remaining_seconds <= 300 ? 'warn' : '' }, clockText(s.remaining_seconds)),
      el('td', {}, s.nodes.map((n) => (s.nodes.length > 1 ? `${n.node}: ${n.vm}` : n.vm)).join(', ')),
      el('td', {}, disk),
      el('td', {}, timeText(s.started_at))));
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
