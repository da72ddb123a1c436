// The student page: lessons → Start lab → progress (server-sent events) → terminal with a
// countdown, Extend, Check my work and Finish → the end of the lab.

import {
  ApiError, api, clockText, dropToken, el, followEvents, notice, show, sleep, takeToken,
  timeText, tokenUser,
} from './common.js';

/** Provisioning stages, in order, as the API names them, with what the student reads. */
const STAGES = [
  ['requested', 'Request accepted'],
  ['vm_created', 'Virtual machine created'],
  ['vmi_running', 'Virtual machine started'],
  ['agent_up', 'Lab agent answering'],
  ['ready', 'Lab set up — ready'],
];

/**
 * Console close codes (see the console relay) after which reconnecting would be wrong, with
 * what the student reads when the server gave no reason: a pod lab has a container, not a VM.
 */
const CLOSED_FOR_GOOD = {
  4001: () => 'Your lab session has expired.',
  4002: () => 'This lab session was finished.',
  4004: () => (isPodLab() ? 'The lab\'s container has stopped.' : 'The VM has stopped.'),
};
const REPLACED = 4003;

const token = takeToken();
const state = {
  view: null,          // the latest session view
  offsetMs: 0,         // server clock − this browser's clock
  titles: {},          // lesson id → title
  lessons: [],         // the lessons offered
  events: null,        // AbortController of the event stream
  term: null,
  fit: null,
  link: null,          // the console connection
  node: null,          // the node whose console is shown
  warnedFor: null,     // the expires_at the 5-minute warning was shown for
  ticking: null,
};

// ---------------------------------------------------------------------------------------------
// Start-up and errors

async function main() {
  if (!token) {
    show('view-signin');
    return;
  }
  document.getElementById('who').textContent = tokenUser(token).user;
  document.getElementById('back-to-lessons').addEventListener('click', () => showLessons());
  document.getElementById('extend').addEventListener('click', extend);
  document.getElementById('finish').addEventListener('click', finish);
  document.getElementById('grade').addEventListener('click', grade);
  document.getElementById('cancel-start').addEventListener('click', finish);
  window.addEventListener('online', () => {
    if (state.link) state.link.retryNow();
  });
  await loadHome();
}

/** Shows the open session if there is one, else the lessons. Retries while offline. */
async function loadHome() {
  for (let attempt = 0; ; attempt++) {
    try {
      await loadTitles();
      const current = await api(token, 'GET', '/api/sessions/current');
      notice(null);
      enterSession(current);
      return;
    } catch (e) {
      if (e.status === 404) {
        notice(null);
        await showLessons();
        return;
      }
      if (!handleError(e)) return;
      await sleep(Math.min(10000, 1000 * 2 ** attempt));
    }
  }
}

/** Shows an error; returns whether trying again later makes sense. */
function handleError(e) {
  if (e instanceof ApiError && e.status === 401) {
    dropToken();
    show('view-signin');
    notice(`You are signed out: ${e.message}. Open your login link again.`, 'error');
    return false;
  }
  notice(e.message || String(e), 'error');
  return !(e instanceof ApiError) || e.status === 0 || e.status >= 500;
}

async function loadTitles() {
  if (Object.keys(state.titles).length) return;
  const lessons = await api(token, 'GET', '/api/lessons');
  for (const l of lessons) state.titles[l.id] = l.title;
  state.lessons = lessons;
}

function title(lessonId) {
  return state.titles[lessonId] || lessonId;
}

// ---------------------------------------------------------------------------------------------
// Lessons

async function showLessons() {
  stopSession();
  document.getElementById('subtitle').textContent = 'Lab environments';
  try {
    await loadTitles();
  } catch (e) {
    handleError(e);
    return;
  }
  const box = document.getElementById('lessons');
  box.replaceChildren();
  if (!state.lessons.length) {
    box.append(el('p', { class: 'muted' }, 'No labs are offered right now.'));
  }
  for (const lesson of state.lessons) {
    const kind = lesson.runtime === 'vm' ? 'Virtual machine with root access' : 'Container';
    const nodes = lesson.nodes.length > 1 ? `${lesson.nodes.length} machines: ${lesson.nodes.join(', ')}` : '';
    const checks = lesson.grading_steps ? `${lesson.grading_steps} automatic checks` : '';
    const button = el('button', { 'data-lesson': lesson.id }, 'Start lab');
    button.addEventListener('click', () => start(lesson.id, button));
    box.append(el('div', { class: 'card' },
      el('h3', {}, lesson.title),
      el('p', { class: 'muted' }, [kind, nodes, checks].filter(Boolean).join(' · ')),
      button));
  }
  show('view-lessons');
}

async function start(lessonId, button) {
  button.disabled = true;
  button.textContent = 'Starting…';
  try {
    const view = await api(token, 'POST', '/api/sessions', { lesson: lessonId });
    notice(null);
    enterSession(view);
  } catch (e) {
    button.disabled = false;
    button.textContent = 'Start lab';
    if (e.code === 'session_exists') {
      notice(e.message, 'warn');
      await loadHome();
      return;
    }
    handleError(e);
  }
}

// ---------------------------------------------------------------------------------------------
// A session: its events, and which screen it shows

function enterSession(view) {
  stopSession();
  onView(view);
  followSession(view.id);
}

function stopSession() {
  if (state.events) state.events.abort();
  state.events = null;
  if (state.link) state.link.stop();
  state.link = null;
  if (state.ticking) clearInterval(state.ticking);
  state.ticking = null;
}

/** Follows the session's events until it is final, reconnecting after network drops. */
async function followSession(id) {
  const controller = new AbortController();
  state.events = controller;
  let failures = 0;
  while (!controller.signal.aborted) {
    try {
      await followEvents(token, `/api/sessions/${id}/events`, (name, data) => {
        if (name !== 'session' || controller.signal.aborted) return;
        if (failures) notice(null);
        failures = 0;
        onView(data);
      }, controller.signal);
      if (!state.view || isFinal(state.view.status)) return;
    } catch (e) {
      if (controller.signal.aborted) return;
      if (e.status === 404 || e.status === 401) {
        handleError(e);
        if (e.status === 404) await loadHome();
        return;
      }
      failures++;
      notice('Connection to the server lost — reconnecting…', 'warn');
    }
    await sleep(Math.min(10000, 500 * 2 ** Math.min(failures, 5)));
    // After a gap, re-read the session: the clock and status may have moved.
    try {
      onView(await api(token, 'GET', `/api/sessions/${id}`));
    } catch (e) {
      if (e.status === 404) {
        await loadHome();
        return;
      }
    }
  }
}

function isFinal(status) {
  return ['finished', 'expired', 'failed', 'ghost'].includes(status);
}

/** A new view of the session: re-sync the clock and show the screen for its status. */
function onView(view) {
  state.view = view;
  state.offsetMs = Date.parse(view.server_time) - Date.now();
  document.getElementById('subtitle').textContent = title(view.lesson);
  switch (view.status) {
    case 'starting':
      showStarting(view);
      break;
    case 'running':
      showLab(view);
      break;
    default:
      showEnded(view);
  }
}

// ---------------------------------------------------------------------------------------------
// Progress

function showStarting(view) {
  document.getElementById('starting-lesson').textContent = `— ${title(view.lesson)}`;
  const reached = STAGES.findIndex(([name]) => name === view.stage);
  const list = document.getElementById('stages');
  list.replaceChildren();
  const requested = Date.parse(view.stages.requested);
  STAGES.forEach(([name, label], i) => {
    const at = view.stages[name];
    const seconds = at ? Math.max(0, Math.round((Date.parse(at) - requested) / 1000)) : null;
    const status = i <= reached ? 'done' : i === reached + 1 ? 'active' : 'todo';
    list.append(el('li', { class: status, 'data-stage': name },
      el('span', { class: 'mark' }, status === 'done' ? '✓' : status === 'active' ? '…' : ''),
      label,
      seconds !== null && i > 0 ? el('span', { class: 'muted' }, ` after ${seconds} s`) : null));
  });
  const percent = Math.round((Math.max(0, reached) / (STAGES.length - 1)) * 100);
  const bar = document.getElementById('progress-bar');
  bar.style.width = `${Math.max(percent, 4)}%`;
  bar.dataset.stage = view.stage;
  show('view-starting');
}

// ---------------------------------------------------------------------------------------------
// The lab screen

function showLab(view) {
  document.getElementById('lab-lesson').textContent = title(view.lesson);
  renderNodes(view);
  renderExtend(view);
  document.getElementById('grade').hidden = view.runtime !== 'vm';
  const wasHidden = document.getElementById('view-lab').hidden;
  show('view-lab');
  if (!ensureTerminal()) return;
  if (wasHidden) state.fit.fit();
  if (!state.link) {
    state.node = state.node || (view.nodes[0] && view.nodes[0].node) || null;
    state.link = new ConsoleLink(view.id, state.node);
    state.link.connect();
  }
  if (!state.ticking) {
    state.ticking = setInterval(tick, 500);
  }
  tick();
}

function renderNodes(view) {
  const box = document.getElementById('nodes');
  box.replaceChildren();
  if (view.nodes.length < 2) return;
  for (const n of view.nodes) {
    const b = el('button', { class: n.node === state.node ? 'tab selected' : 'tab' }, n.node);
    b.addEventListener('click', () => {
      if (n.node === state.node) return;
      state.node = n.node;
      if (state.link) state.link.stop();
      state.term.reset();
      state.link = new ConsoleLink(view.id, n.node);
      state.link.connect();
      renderNodes(state.view);
    });
    box.append(b);
  }
}

function renderExtend(view) {
  const button = document.getElementById('extend');
  const reason = document.getElementById('extend-reason');
  let why = '';
  if (view.extensions_left === 0) {
    why = `No extensions left (${view.extensions_used} used)`;
  } else if (Date.parse(view.expires_at) >= Date.parse(view.max_expires_at)) {
    why = 'Maximum lab time reached';
  }
  button.disabled = Boolean(why) || button.dataset.busy === '1';
  button.title = why || 'Add time to this lab';
  reason.textContent = why || `${view.extensions_left} left`;
}

function remainingSeconds() {
  if (!state.view) return 0;
  return (Date.parse(state.view.expires_at) - (Date.now() + state.offsetMs)) / 1000;
}

function tick() {
  if (!state.view || state.view.status !== 'running') return;
  const left = remainingSeconds();
  const countdown = document.getElementById('countdown');
  countdown.textContent = clockText(left);
  countdown.className = `countdown${left <= 60 ? ' danger' : left <= 300 ? ' warn' : ''}`;
  const banner = document.getElementById('lab-banner');
  if (left <= 0) {
    showBanner('Time is up. The lab is being closed.', 'error');
    for (const id of ['extend', 'grade']) document.getElementById(id).disabled = true;
  } else if (left <= 300 && state.warnedFor !== state.view.expires_at) {
    state.warnedFor = state.view.expires_at;
    const canExtend = !document.getElementById('extend').disabled;
    showBanner(canExtend
      ? 'Only 5 minutes left. Extend the lab if you need more time.'
      : 'Only 5 minutes left, and the lab cannot be extended further. Finish what you are doing.',
    'warn', canExtend ? ['Extend now', extend] : null);
  } else if (left > 300 && banner.dataset.kind === 'warn') {
    hideBanner();
  }
}

function showBanner(text, kind, action) {
  const banner = document.getElementById('lab-banner');
  if (banner.dataset.text === text && !banner.hidden) return;
  banner.replaceChildren(el('span', {}, text));
  if (action) {
    const [label, handler] = action;
    banner.append(' ', el('button', { onclick: handler }, label));
  }
  banner.className = `banner ${kind}`;
  banner.dataset.kind = kind;
  banner.dataset.text = text;
  banner.hidden = false;
}

function hideBanner() {
  const banner = document.getElementById('lab-banner');
  banner.hidden = true;
  banner.dataset.kind = '';
  banner.dataset.text = '';
}

async function extend() {
  const button = document.getElementById('extend');
  button.dataset.busy = '1';
  button.disabled = true;
  try {
    const view = await api(token, 'POST', `/api/sessions/${state.view.id}/extend`);
    onView(view);
    hideBanner();
    notice(`Extended: the lab now ends at ${timeText(view.expires_at)}.`, 'ok');
  } catch (e) {
    handleError(e);
  } finally {
    button.dataset.busy = '';
    if (state.view) renderExtend(state.view);
  }
}

async function finish() {
  const ok = window.confirm('Finish this lab? Its VM is deleted and your work in it cannot be recovered.');
  if (!ok) return;
  if (state.link) state.link.stop();
  state.link = null;
  try {
    onView(await api(token, 'DELETE', `/api/sessions/${state.view.id}`));
  } catch (e) {
    handleError(e);
  }
}

async function grade() {
  const button = document.getElementById('grade');
  button.disabled = true;
  button.textContent = 'Checking…';
  try {
    const result = await api(token, 'POST', `/api/sessions/${state.view.id}/grade`);
    const summary = document.getElementById('grade-summary');
    summary.textContent = `${result.passed} of ${result.total} checks passed.`;
    summary.className = result.passed === result.total ? 'ok' : 'warn';
    const steps = document.getElementById('grade-steps');
    steps.replaceChildren();
    for (const step of result.steps) {
      const detail = step.timed_out
        ? 'did not finish in time'
        : step.passed ? '' : `exit code ${step.exit_code}, expected ${step.expected_exit}`;
      const output = [step.stdout, step.stderr].filter((s) => s && s.trim()).join('\n');
      steps.append(el('div', { class: `step ${step.passed ? 'pass' : 'fail'}` },
        el('span', { class: 'mark' }, step.passed ? '✓' : '✗'),
        el('strong', {}, step.name),
        state.view.nodes.length > 1 ? el('span', { class: 'muted' }, ` on ${step.node}`) : null,
        detail ? el('span', { class: 'muted' }, ` — ${detail}`) : null,
        output ? el('details', {}, el('summary', {}, 'Output'), el('pre', {}, output)) : null));
    }
    document.getElementById('grade-dialog').showModal();
  } catch (e) {
    handleError(e);
  } finally {
    button.textContent = 'Check my work';
    button.disabled = false;
  }
}

// ---------------------------------------------------------------------------------------------
// The end

function showEnded(view) {
  notice(null);
  if (state.link) state.link.stop();
  state.link = null;
  if (state.ticking) clearInterval(state.ticking);
  state.ticking = null;
  const titleBox = document.getElementById('ended-title');
  const text = document.getElementById('ended-text');
  const back = document.getElementById('back-to-lessons');
  back.hidden = false;
  switch (view.status) {
    case 'finishing':
      titleBox.textContent = 'Closing your lab…';
      text.textContent = view.finishing_to === 'expired'
        ? 'The time is up. The VM is being deleted.'
        : 'The VM is being deleted. This takes a few seconds.';
      back.hidden = true;
      break;
    case 'finished':
      titleBox.textContent = 'Lab finished';
      text.textContent = 'You finished this lab and its VM was deleted. Thank you!';
      break;
    case 'expired':
      titleBox.textContent = 'Time is up';
      text.textContent = 'The lab reached the end of its time and its VM was reclaimed.';
      break;
    case 'failed':
      titleBox.textContent = 'The lab could not be started';
      text.textContent = `${view.failure_reason || 'Something went wrong while preparing it.'} ` +
        'Nothing of it is left running; you can start it again.';
      break;
    case 'ghost':
      titleBox.textContent = 'The lab stopped';
      text.textContent = 'Its VM is no longer running (it stopped or was removed). You can start a new lab.';
      break;
    default:
      titleBox.textContent = 'Lab closed';
      text.textContent = `Status: ${view.status}.`;
  }
  show('view-ended');
}

// ---------------------------------------------------------------------------------------------
// The terminal and its console connection

function ensureTerminal() {
  if (state.term) return true;
  if (typeof Terminal === 'undefined' || typeof FitAddon === 'undefined') {
    setConn('The terminal component is missing on the server (run `npm ci` in its web/ directory).', 'error');
    return false;
  }
  const term = new Terminal({
    cursorBlink: true,
    fontFamily: 'ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace',
    fontSize: 14,
    scrollback: 5000,
    theme: { background: '#101418', foreground: '#e6e6e6' },
  });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(document.getElementById('terminal'));
  fit.fit();
  window.addEventListener('resize', () => fit.fit());
  const encoder = new TextEncoder();
  term.onData((data) => state.link && state.link.send(encoder.encode(data)));
  term.onBinary((data) => {
    const bytes = Uint8Array.from(data, (c) => c.charCodeAt(0) & 0xff);
    if (state.link) state.link.send(bytes);
  });
  state.term = term;
  state.fit = fit;
  window.ttlabTerminal = term; // for the browser tests: read what the screen shows
  return true;
}

/** Whether the lab shown runs in a container (a pod lab) rather than a VM. */
function isPodLab() {
  return Boolean(state.view && state.view.runtime === 'pod');
}

function setConn(text, kind = '') {
  const conn = document.getElementById('conn');
  conn.textContent = text;
  conn.className = `conn ${kind}`;
}

/** One console: ticket, WebSocket, and reconnecting after a drop. */
class ConsoleLink {
  constructor(sessionId, node) {
    this.sessionId = sessionId;
    this.node = node;
    this.ws = null;
    this.stopped = false;
    this.failures = 0;
    this.timer = null;
  }

  async connect() {
    if (this.stopped) return;
    clearTimeout(this.timer);
    setConn('Connecting…');
    let ticket;
    try {
      ticket = await api(token, 'POST', `/api/sessions/${this.sessionId}/console-ticket`);
    } catch (e) {
      if (this.stopped) return;
      if (e.status === 409 || e.status === 404) {
        setConn(e.message, 'error');
        refresh();
        return;
      }
      if (e.status === 401 || e.status === 403) {
        setConn(e.message, 'error');
        handleError(e);
        return;
      }
      this.retryLater(e.message);
      return;
    }
    if (this.stopped) return;
    const url = new URL(ticket.url, window.location.href);
    url.protocol = window.location.protocol === 'https:' ? 'wss:' : 'ws:';
    if (this.node) url.searchParams.set('node', this.node);
    const ws = new WebSocket(url);
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    ws.onopen = () => {
      this.failures = 0;
      setConn(this.node ? `Connected to ${this.node}` : 'Connected', 'ok');
      hideReplaced();
      state.term.focus();
      refresh();
    };
    ws.onmessage = (event) => {
      state.term.write(typeof event.data === 'string' ? event.data : new Uint8Array(event.data));
    };
    ws.onclose = (event) => {
      if (this.ws === ws) this.closed(event.code, event.reason);
    };
  }

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(bytes);
  }

  closed(code, reason) {
    this.ws = null;
    if (this.stopped) return;
    if (CLOSED_FOR_GOOD[code]) {
      setConn(reason || CLOSED_FOR_GOOD[code](), 'error');
      this.stopped = true;
      refresh();
      return;
    }
    if (code === REPLACED) {
      setConn('Open in another tab', 'warn');
      showReplaced(() => this.connect());
      return;
    }
    this.retryLater(reason || 'the connection was interrupted');
  }

  retryLater(why) {
    this.failures++;
    const seconds = Math.min(10, 2 ** Math.min(this.failures - 1, 4));
    setConn(`Disconnected (${why}) — reconnecting in ${seconds} s…`, 'warn');
    this.timer = setTimeout(() => this.connect(), seconds * 1000);
  }

  retryNow() {
    if (!this.ws && !this.stopped) this.connect();
  }

  stop() {
    this.stopped = true;
    clearTimeout(this.timer);
    if (this.ws) this.ws.close(1000, 'closed by the page');
    this.ws = null;
  }
}

function showReplaced(reconnect) {
  const banner = document.getElementById('lab-banner');
  const one = isPodLab() ? 'A lab has one console at a time.' : 'A VM has one console at a time.';
  showBanner(`This console is open in another tab or window. ${one}`,
    'warn', ['Use it here', () => { hideReplaced(); reconnect(); }]);
  banner.dataset.kind = 'replaced';
}

function hideReplaced() {
  const banner = document.getElementById('lab-banner');
  if (banner.dataset.kind === 'replaced') hideBanner();
}

/** Re-reads the session now (after a console event that may mean it changed). */
async function refresh() {
  if (!state.view) return;
  try {
    onView(await api(token, 'GET', `/api/sessions/${state.view.id}`));
  } catch {
    // The event stream keeps trying.
  }
}

main();
