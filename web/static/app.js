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
  termSession: null,   // the session whose console the terminal shows
  warnedFor: null,     // the expires_at the 5-minute warning was shown for
  alerted: loadAlerted(), // "session/expires_at/minutes" of the notifications given (kept for the tab)
  ticking: null,
  startTimer: null,    // redraws the progress's elapsed times while starting
  offerCheckedFor: null, // the opens_at the view was re-read for once the extend window opened
  offerReadAt: 0,      // when (this browser's clock) the extend offer was last read
  waiting: null,       // AbortController of the waitlist's event stream
  waitView: null,      // the latest waitlist view
  holdTimer: null,     // the held place's countdown
  takingPlace: false,  // the held place is being taken in this tab
  classCode: '',       // the class code given with the last start (kept for a held place)
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
  setUpNotifyButton();
  setUpInstructions();
  document.getElementById('cancel-start').addEventListener('click', finish);
  document.getElementById('take-place').addEventListener('click', takePlace);
  document.getElementById('leave-waitlist').addEventListener('click', leaveWaitlist);
  document.getElementById('join-again').addEventListener('click', joinAgain);
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
        if (await resumeWaiting()) return;
        await showLessons();
        tellIfDropped();
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

/**
 * The body of a start: the lesson, and the class code the student entered, if any (a class's
 * students take the labs prepared for it).
 */
function startBody(lessonId) {
  const body = { lesson: lessonId };
  if (state.classCode) body.class_code = state.classCode;
  return body;
}

async function start(lessonId, button) {
  button.disabled = true;
  button.textContent = 'Starting…';
  state.classCode = document.getElementById('class-code').value.trim();
  try {
    const view = await api(token, 'POST', '/api/sessions', startBody(lessonId));
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
    if (e.code === 'capacity') {
      // Full: the click puts the student in line rather than leaving them to retry.
      await joinWaitlist(lessonId);
      return;
    }
    if (e.code === 'waiting') {
      // In line for another lab: show that place, and why.
      if (await resumeWaiting()) notice(e.message, 'warn');
      else handleError(e);
      return;
    }
    if (e.code === 'unknown_class_code') {
      notice(`${e.message}: check the class code, or clear it to start on your own.`, 'error');
      document.getElementById('class-code').focus();
      return;
    }
    handleError(e);
  }
}

// ---------------------------------------------------------------------------------------------
// The waitlist: when every place is taken, the student waits in line (the server's order,
// the same on every replica); a freed place is held for the first in line for a short time.

/** Joins the waitlist for `lessonId` (or finds the place already had) and shows it. */
async function joinWaitlist(lessonId) {
  try {
    const view = await api(token, 'POST', '/api/waitlist', { lesson: lessonId });
    notice(null);
    enterWaiting(view);
  } catch (e) {
    if (e.code === 'already_waiting') {
      if (!(await resumeWaiting())) await showLessons();
      return;
    }
    if (e.code === 'session_exists') {
      await loadHome();
      return;
    }
    handleError(e);
  }
}

/** If the student is on the waitlist, shows their place; whether they were. */
async function resumeWaiting() {
  try {
    const view = await api(token, 'GET', '/api/waitlist');
    if (!view.waiting) return false;
    enterWaiting(view);
    return true;
  } catch {
    return false;
  }
}

function enterWaiting(view) {
  hideDropped();
  stopSession();
  state.takingPlace = false;
  onWaiting(view);
  followWaiting();
}

function stopWaiting() {
  if (state.waiting) state.waiting.abort();
  state.waiting = null;
  if (state.holdTimer) clearInterval(state.holdTimer);
  state.holdTimer = null;
  if (document.title !== PAGE_TITLE) document.title = PAGE_TITLE;
}

/** Follows the student's place (server-sent events) until they no longer wait. */
async function followWaiting() {
  const controller = new AbortController();
  state.waiting = controller;
  let failures = 0;
  while (!controller.signal.aborted) {
    try {
      await followEvents(token, '/api/waitlist/events', (name, data) => {
        if (name !== 'waitlist' || controller.signal.aborted) return;
        if (failures) notice(null);
        failures = 0;
        onWaiting(data);
      }, controller.signal);
    } catch (e) {
      if (controller.signal.aborted) return;
      if (e.status === 401) {
        handleError(e);
        return;
      }
      failures++;
      notice('Connection to the server lost — reconnecting…', 'warn');
    }
    if (controller.signal.aborted || !state.waitView || !state.waitView.waiting) return;
    await sleep(Math.min(10000, 500 * 2 ** Math.min(failures, 5)));
  }
}

/** A new view of the student's place: position, and the held place with its countdown. */
function onWaiting(view) {
  const before = state.waitView;
  state.waitView = view;
  if (!view.waiting) {
    stopWaiting();
    // The place was taken in this tab (the session view follows), or it lapsed, or they left,
    // or they waited too long without a place freeing.
    if (state.takingPlace) return;
    const lapsed = before && before.held_until;
    showLessons();
    if (!lapsed && tellIfDropped()) return;
    notice(lapsed
      ? 'The place held for you was not taken in time and went to the next student. You can join the line again.'
      : 'You are no longer on the waitlist.', lapsed ? 'warn' : 'info');
    return;
  }
  rememberWaiting(view);
  document.getElementById('subtitle').textContent = title(view.lesson);
  document.getElementById('waiting-lesson').textContent = `— ${title(view.lesson)}`;
  document.getElementById('waiting-position').textContent = ordinal(view.position);
  const held = document.getElementById('waiting-held');
  if (view.held_until && view.hold_seconds_left > 0) {
    const deadline = Date.now() + view.hold_seconds_left * 1000;
    held.hidden = false;
    document.getElementById('waiting-hint').hidden = true;
    const render = () => {
      const left = Math.max(0, Math.round((deadline - Date.now()) / 1000));
      document.getElementById('held-left').textContent = clockText(left);
      document.title = `🔔 A place is free — ${clockText(left)} — ${PAGE_TITLE}`;
    };
    if (state.holdTimer) clearInterval(state.holdTimer);
    render();
    state.holdTimer = setInterval(render, 1000);
    if (!before || !before.held_until) {
      notice('A place is free for you: start your lab now.', 'ok');
      if (typeof Notification !== 'undefined' && Notification.permission === 'granted') {
        notifyStudent('A lab place is free for you. Start your lab now.');
      }
    }
  } else {
    held.hidden = true;
    document.getElementById('waiting-hint').hidden = false;
    if (state.holdTimer) clearInterval(state.holdTimer);
    state.holdTimer = null;
    if (document.title !== PAGE_TITLE) document.title = PAGE_TITLE;
  }
  show('view-waiting');
}

/**
 * The place in line as this tab last saw it (sessionStorage): the lesson, when it lapses
 * without a hold (this browser's clock) and the longest wait, so that a student taken off
 * the list is told why, even after a reload.
 */
function rememberWaiting(view) {
  if (typeof view.leaves_in_seconds !== 'number') {
    // A place is held (it no longer lapses by waiting): a drop now is the hold lapsing.
    forgetWaiting();
    return;
  }
  try {
    sessionStorage.setItem('ttlab.waiting', JSON.stringify({
      lesson: view.lesson,
      leaves_by: Date.now() + view.leaves_in_seconds * 1000,
      max_wait: view.max_wait_seconds,
    }));
  } catch {
    // Private mode: a reload after the drop does not say why.
  }
}

function forgetWaiting() {
  try { sessionStorage.removeItem('ttlab.waiting'); } catch { /* private mode */ }
}

/** A wait as the student reads it: `an hour`, `2 hours`, `30 minutes`, `45 seconds`. */
function waitText(seconds) {
  if (seconds === 3600) return 'an hour';
  if (seconds % 3600 === 0) return `${seconds / 3600} hours`;
  if (seconds % 60 === 0) return seconds === 60 ? 'a minute' : `${seconds / 60} minutes`;
  return `${seconds} seconds`;
}

/**
 * If the student's place in line lapsed because they waited the longest wait without a place
 * freeing, says so above the lessons with "Join again" (back in line, at the end); whether
 * it did. Told once.
 */
function tellIfDropped() {
  let saved = null;
  try { saved = JSON.parse(sessionStorage.getItem('ttlab.waiting') || 'null'); } catch { /* none */ }
  // A second of slack: the server takes the entry off at its next look after the instant.
  if (!saved || !saved.lesson || Date.now() < saved.leaves_by - 1000) return false;
  forgetWaiting();
  const box = document.getElementById('waitlist-dropped');
  const wait = typeof saved.max_wait === 'number' ? waitText(saved.max_wait) : 'too long';
  document.getElementById('waitlist-dropped-text').textContent =
    `You waited ${wait} for ${title(saved.lesson)} without a place freeing up; you were taken off the list.`;
  box.dataset.lesson = saved.lesson;
  box.hidden = false;
  return true;
}

function hideDropped() {
  document.getElementById('waitlist-dropped').hidden = true;
}

/** "Join again": back on the waitlist for the same lesson, at the end of the line. */
async function joinAgain() {
  const lesson = document.getElementById('waitlist-dropped').dataset.lesson;
  hideDropped();
  if (lesson) await joinWaitlist(lesson);
}

/**
 * The start could not be finished for the student (every place was taken in the same moment,
 * or the lab prepared for them could not be handed over): not a failure, the student is back
 * in the line at the front. Shows the server's reason and their place, or (if they no longer
 * wait) says so on the ended view.
 */
async function backInLine(view) {
  const reason = view && view.failure_reason
    ? view.failure_reason.charAt(0).toUpperCase() + view.failure_reason.slice(1)
    : 'Every lab machine was taken while your lab was being prepared';
  if (await resumeWaiting()) {
    notice(`${reason}. You are at position ${state.waitView.position}.`, 'info');
    return;
  }
  document.getElementById('ended-title').textContent = 'Your lab could not be finished for you';
  document.getElementById('ended-text').textContent =
    `${reason}. Nothing of it is left running; you can start it again.`;
  document.getElementById('back-to-lessons').hidden = false;
  show('view-ended');
}

/** `1st`, `2nd`, `3rd`, `4th`… */
function ordinal(n) {
  const tens = n % 100;
  if (tens >= 11 && tens <= 13) return `${n}th`;
  return `${n}${{ 1: 'st', 2: 'nd', 3: 'rd' }[n % 10] || 'th'}`;
}

/** Takes the held place: opens the lab. */
async function takePlace() {
  const view = state.waitView;
  if (!view) return;
  const button = document.getElementById('take-place');
  button.disabled = true;
  state.takingPlace = true;
  try {
    const session = await api(token, 'POST', '/api/sessions', startBody(view.lesson));
    notice(null);
    enterSession(session);
  } catch (e) {
    state.takingPlace = false;
    if (e.code === 'capacity') {
      notice('The place is no longer held for you; you are still in line if it was not your turn yet.', 'warn');
      if (!(await resumeWaiting())) await showLessons();
    } else {
      handleError(e);
    }
  } finally {
    button.disabled = false;
  }
}

async function leaveWaitlist() {
  try {
    await api(token, 'DELETE', '/api/waitlist');
  } catch (e) {
    if (e.code !== 'not_waiting') {
      handleError(e);
      return;
    }
  }
  stopWaiting();
  state.waitView = null;
  forgetWaiting();
  await showLessons();
  notice('You left the waitlist.', 'ok');
}

// ---------------------------------------------------------------------------------------------
// A session: its events, and which screen it shows

function enterSession(view) {
  hideDropped();
  forgetWaiting();
  stopSession();
  onView(view);
  followSession(view.id);
}

function stopSession() {
  stopWaiting();
  if (state.events) state.events.abort();
  state.events = null;
  if (state.link) state.link.stop();
  state.link = null;
  if (state.ticking) clearInterval(state.ticking);
  state.ticking = null;
  if (state.startTimer) clearInterval(state.startTimer);
  state.startTimer = null;
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
  return ['finished', 'expired', 'failed', 'ghost', 'requeued'].includes(status);
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

/** Seconds as the progress shows them: `42 s`, `2 min 5 s`. */
function durationText(seconds) {
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  return s % 60 ? `${Math.floor(s / 60)} min ${s % 60} s` : `${s / 60} min`;
}

/** The progress's elapsed times: each stage reached took (from the one before), the stage
 *  under way has been running for, and the whole start so far. */
function renderStages(view) {
  const reached = STAGES.findIndex(([name]) => name === view.stage);
  const list = document.getElementById('stages');
  list.replaceChildren();
  const now = Date.now() + state.offsetMs;
  let previous = Date.parse(view.stages.requested);
  STAGES.forEach(([name, label], i) => {
    const at = view.stages[name] ? Date.parse(view.stages[name]) : null;
    const status = i <= reached ? 'done' : i === reached + 1 ? 'active' : 'todo';
    let time = null;
    if (i > 0 && at !== null) {
      time = el('span', { class: 'muted stage-time' }, ` took ${durationText((at - previous) / 1000)}`);
      previous = at;
    } else if (status === 'active') {
      time = el('span', { class: 'muted stage-time' }, ` ${durationText((now - previous) / 1000)} so far`);
    }
    list.append(el('li', { class: status, 'data-stage': name },
      el('span', { class: 'mark' }, status === 'done' ? '✓' : status === 'active' ? '…' : ''),
      label, time));
  });
  const elapsed = (now - Date.parse(view.stages.requested)) / 1000;
  document.getElementById('starting-elapsed').textContent = `Elapsed: ${durationText(elapsed)}`;
  // The time left, from the lesson's measured starts: the elapsed time counts from when this
  // lab began (a lab prepared ahead for the pool began before the click).
  const e = view.expected_ready;
  const left = e ? Math.round(e.p50_seconds - elapsed) : null;
  document.getElementById('starting-left').textContent = left === null ? ''
    : left > 0 ? `About ${durationText(left)} left.` : 'Almost ready.';
}

/** The expected time, from the measured recent starts of this lesson, and the disk decision. */
function renderExpectation(view) {
  const hint = document.getElementById('starting-hint');
  const e = view.expected_ready;
  hint.textContent = e
    ? `Recent starts of this lab were ready in about ${durationText(e.p50_seconds)}; ` +
      `9 in 10 within ${durationText(e.p90_seconds)} (last ${e.count}). ` +
      'You can keep this page open; nothing else to do.'
    : 'No start of this lab has been measured yet. You can keep this page open; nothing else to do.';
  const disk = document.getElementById('starting-disk');
  if (!view.disk) {
    disk.textContent = 'Disk: not chosen yet.';
  } else if (view.disk.kind === 'golden') {
    disk.textContent = 'Disk: a prepared copy of the lab image (quicker to start).';
  } else {
    disk.textContent = `Disk: a fresh image, set up at boot — ${view.disk.reason}.`;
  }
  disk.dataset.kind = view.disk ? view.disk.kind : '';
}

function showStarting(view) {
  document.getElementById('starting-lesson').textContent = `— ${title(view.lesson)}`;
  const reached = STAGES.findIndex(([name]) => name === view.stage);
  renderStages(view);
  renderExpectation(view);
  if (!state.startTimer) {
    state.startTimer = setInterval(() => {
      if (state.view && state.view.status === 'starting') renderStages(state.view);
    }, 1000);
  }
  const percent = Math.round((Math.max(0, reached) / (STAGES.length - 1)) * 100);
  const bar = document.getElementById('progress-bar');
  bar.style.width = `${Math.max(percent, 4)}%`;
  bar.dataset.stage = view.stage;
  show('view-starting');
}

// ---------------------------------------------------------------------------------------------
// The lab screen

function showLab(view) {
  if (state.startTimer) clearInterval(state.startTimer);
  state.startTimer = null;
  if (state.termSession !== view.id) {
    // Another lab than the terminal last showed: nothing of the previous one stays on the
    // screen or in the scrollback, and its node choice goes with it.
    state.termSession = view.id;
    state.node = null;
    if (state.term) {
      state.term.reset();
      state.term.clear();
    }
  }
  document.getElementById('lab-lesson').textContent = title(view.lesson);
  renderNodes(view);
  renderExtend(view);
  // VM and pod labs alike are graded (the API runs a pod lab's checks in its container);
  // only a lesson without checks has nothing to check.
  const lesson = state.lessons.find((l) => l.id === view.lesson);
  document.getElementById('grade').hidden = Boolean(lesson) && lesson.grading_steps === 0;
  renderInstructions(lesson);
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

/** What extending gains, as the button says it: `+45 min`, `+30 s`. */
function gainText(seconds) {
  return seconds >= 60 ? `+${Math.floor(seconds / 60)} min` : `+${seconds} s`;
}

/** The extend button, from the server's offer (the lifespan rules): offered with what it
 *  gains, or disabled with why and, before the window, from when. */
function renderExtend(view) {
  state.offerReadAt = Date.now();
  const button = document.getElementById('extend');
  const reason = document.getElementById('extend-reason');
  const offer = view.extend || { available: false, refusal: null };
  const code = offer.refusal ? offer.refusal.code : null;
  let why = '';
  if (!offer.available) {
    if (code === 'extension_limit' || view.extensions_left === 0) {
      why = `No extensions left (${view.extensions_used} used)`;
    } else if (code === 'max_lifetime') {
      why = 'Maximum lab time reached';
    } else if (code === 'not_yet' || code === 'too_early') {
      why = `Extending opens at ${timeText(offer.opens_at)}`;
    } else {
      why = offer.refusal ? offer.refusal.message : 'Cannot be extended now';
    }
  }
  button.disabled = Boolean(why) || button.dataset.busy === '1';
  button.textContent = offer.available ? `Extend ${gainText(offer.gain_seconds)}` : 'Extend time';
  button.dataset.gain = offer.available ? String(offer.gain_seconds) : '';
  button.title = why || `Adds ${durationText(offer.gain_seconds)}; uses one of ${view.extensions_left} extensions left`;
  reason.textContent = why || `${view.extensions_left} left`;
}

/** Re-reads the offer when the extend window opens, and every 30 s while it is open (what
 *  extending gains grows as the expiry nears). */
function refreshOffer() {
  const offer = state.view && state.view.extend;
  if (!offer) return;
  const now = Date.now() + state.offsetMs;
  if (!offer.available && offer.opens_at && now >= Date.parse(offer.opens_at)
      && state.offerCheckedFor !== offer.opens_at) {
    state.offerCheckedFor = offer.opens_at;
    refresh();
  } else if (offer.available && Date.now() - state.offerReadAt > 30000) {
    state.offerReadAt = Date.now();
    refresh();
  }
}

function remainingSeconds() {
  if (!state.view) return 0;
  return (Date.parse(state.view.expires_at) - (Date.now() + state.offsetMs)) / 1000;
}

function tick() {
  if (!state.view || state.view.status !== 'running') return;
  const left = remainingSeconds();
  refreshOffer();
  const countdown = document.getElementById('countdown');
  countdown.textContent = clockText(left);
  countdown.className = `countdown${left <= 60 ? ' danger' : left <= 300 ? ' warn' : ''}`;
  alertStudent(left);
  const banner = document.getElementById('lab-banner');
  if (left <= 0) {
    showBanner('Time is up. The lab is being closed.', 'error');
    for (const id of ['extend', 'grade']) document.getElementById(id).disabled = true;
  } else if (left <= 300 && state.warnedFor !== warningKey()) {
    state.warnedFor = warningKey();
    const offer = state.view.extend || {};
    const code = offer.refusal ? offer.refusal.code : null;
    const canExtend = Boolean(offer.available);
    const later = !canExtend && (code === 'not_yet' || code === 'too_early');
    showBanner(canExtend
      ? `Only 5 minutes left. Extend the lab if you need more time (${gainText(offer.gain_seconds)}).`
      : later
        ? `Only 5 minutes left. You can extend the lab from ${timeText(offer.opens_at)}.`
        : 'Only 5 minutes left, and the lab cannot be extended further. Finish what you are doing.',
    'warn', canExtend ? ['Extend now', extend] : null);
  } else if (left > 300 && banner.dataset.kind === 'warn') {
    hideBanner();
  }
}

// ---------------------------------------------------------------------------------------------
// Warnings where the student looks: the tab title and, if allowed, a notification (the
// terminal gets its own line from the server at 5 minutes and 1 minute)

const PAGE_TITLE = document.title;
/** Minutes before the expiry at which the student is alerted. */
const ALERT_AT = [5, 1];

function alertStudent(left) {
  if (left > 0 && left <= 300) {
    document.title = `⏳ ${clockText(left)} left — ${PAGE_TITLE}`;
  } else if (document.title !== PAGE_TITLE) {
    document.title = PAGE_TITLE;
  }
  if (typeof Notification === 'undefined' || Notification.permission !== 'granted') return;
  const expires = state.view.expires_at;
  // The most urgent mark reached, once per deadline (an extension moves the deadline and
  // re-arms them); a student who allows notifications late gets the one due at once.
  const due = ALERT_AT.filter((m) => left > 0 && left <= m * 60);
  if (!due.length) return;
  const minutes = Math.min(...due);
  const key = (m) => `${state.view.id}/${expires}/${m}`;
  if (state.alerted.has(key(minutes))) return;
  for (const m of due) state.alerted.add(key(m));
  try {
    sessionStorage.setItem('ttlab.alerted', JSON.stringify([...state.alerted].slice(-50)));
  } catch {
    // Private mode: a reload may notify again.
  }
  notifyStudent(minutes === 1
    ? 'One minute left in your lab. Save your work now.'
    : `${minutes} minutes left in your lab. Save your work, or extend the lab.`);
}

/** The notifications given in this tab, across reloads (see `alertStudent`). */
function loadAlerted() {
  try {
    const saved = JSON.parse(sessionStorage.getItem('ttlab.alerted') || '[]');
    return new Set(Array.isArray(saved) ? saved : []);
  } catch {
    return new Set();
  }
}

function notifyStudent(text) {
  try {
    const n = new Notification('ttlab', { body: text, tag: 'ttlab-time' });
    n.onclick = () => { window.focus(); n.close(); };
  } catch {
    // A browser that only notifies from a service worker: the title and the terminal remain.
  }
}

/** The "Alert me" button: asks for permission only when clicked. */
function setUpNotifyButton() {
  const button = document.getElementById('notify');
  if (!button) return;
  const render = () => {
    const supported = typeof Notification !== 'undefined';
    button.hidden = !supported || Notification.permission !== 'default';
  };
  button.addEventListener('click', async () => {
    try {
      await Notification.requestPermission();
    } catch {
      // Refused or unsupported: nothing to do.
    }
    render();
  });
  render();
}

/** What the 5-minute warning depends on: the expiry and whether extending is offered. */
function warningKey() {
  const offer = state.view.extend || {};
  return `${state.view.expires_at}|${Boolean(offer.available)}`;
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
        'Nothing of it is left running; you can start it again.' +
        (view.reference ? ` Reference for your teacher: ${view.reference}.` : '');
      break;
    case 'requeued':
      backInLine(view);
      return;
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
  // The guest's console takes the terminal's size: every change (the window, the instructions
  // panel opening or closing) is sent to the console.
  term.onResize(() => { if (state.link) state.link.sendSize(); });
  if (typeof ResizeObserver !== 'undefined') {
    new ResizeObserver(() => fit.fit()).observe(document.getElementById('terminal'));
  }
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

// ---------------------------------------------------------------------------------------------
// The lesson's instructions beside the terminal

/** The panel's toggle; whether it is open is remembered for this browser. */
function setUpInstructions() {
  const panel = document.getElementById('instructions');
  const toggle = document.getElementById('instructions-toggle');
  if (!panel || !toggle) return;
  const apply = (open) => {
    panel.dataset.open = open ? '1' : '0';
    toggle.setAttribute('aria-expanded', String(open));
    toggle.textContent = open ? 'Hide instructions' : 'Show instructions';
    try { localStorage.setItem('ttlab.instructions', open ? 'open' : 'closed'); } catch { /* private mode */ }
    if (state.fit) state.fit.fit();
  };
  let open = true;
  try { open = localStorage.getItem('ttlab.instructions') !== 'closed'; } catch { /* private mode */ }
  toggle.addEventListener('click', () => apply(panel.dataset.open !== '1'));
  apply(open);
}

/**
 * Shows the lesson's instructions (HTML the server rendered from the lesson's Markdown, with
 * any HTML in it escaped) and the steps "Check my work" checks.
 */
function renderInstructions(lesson) {
  const panel = document.getElementById('instructions');
  if (!panel) return;
  const body = document.getElementById('instructions-body');
  const checks = document.getElementById('instructions-checks');
  const has = Boolean(lesson && (lesson.instructions_html || (lesson.checks && lesson.checks.length)));
  panel.hidden = !has;
  document.getElementById('instructions-toggle').hidden = !has;
  if (!has || panel.dataset.lesson === lesson.id) return;
  panel.dataset.lesson = lesson.id;
  body.innerHTML = lesson.instructions_html || '';
  checks.replaceChildren(...(lesson.checks || []).map((name) => el('li', {}, name)));
  document.getElementById('instructions-checks-box').hidden = !(lesson.checks && lesson.checks.length);
  if (state.fit) state.fit.fit();
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

/**
 * The warnings the server wrote into this session's terminal for its expiry `expiresAt`
 * (lead times in seconds), kept for this tab (sessionStorage) so that a reconnect or a reload
 * names them and they are not written again. An extension moves the expiry: the warnings
 * come again.
 */
function warnedLeads(sessionId, expiresAt) {
  try {
    const saved = JSON.parse(sessionStorage.getItem(`ttlab.warned.${sessionId}`) || 'null');
    return saved && saved.expires_at === expiresAt && Array.isArray(saved.leads) ? saved.leads : [];
  } catch {
    return [];
  }
}

function rememberWarned(sessionId, expiresAt, leads) {
  const all = [...new Set([...warnedLeads(sessionId, expiresAt), ...leads])]
    .filter((n) => Number.isInteger(n) && n >= 0);
  try {
    sessionStorage.setItem(`ttlab.warned.${sessionId}`, JSON.stringify({ expires_at: expiresAt, leads: all }));
  } catch {
    // Private mode: the warning may be written again after a reload.
  }
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
    const warned = state.view ? warnedLeads(this.sessionId, state.view.expires_at) : [];
    if (warned.length) url.searchParams.set('warned', warned.join(','));
    const ws = new WebSocket(url);
    ws.binaryType = 'arraybuffer';
    this.ws = ws;
    ws.onopen = () => {
      // The server's end is open; its console (the VM's, or the container's shell) is not
      // yet: the server says when it is.
      this.sendSize();
      setConn(isPodLab() ? 'Connecting to the container…' : 'Connecting to the VM…');
    };
    ws.onmessage = (event) => {
      if (typeof event.data === 'string' && event.data.startsWith('{"type":')) {
        this.status(event.data);
        return;
      }
      state.term.write(typeof event.data === 'string' ? event.data : new Uint8Array(event.data));
    };
    ws.onclose = (event) => {
      if (this.ws === ws) this.closed(event.code, event.reason);
    };
  }

  /** A status message of the server (a text frame): the console is open, a warning was
   *  written into the terminal. */
  status(text) {
    let message;
    try {
      message = JSON.parse(text);
    } catch {
      return;
    }
    if (message.type === 'connected') {
      this.failures = 0;
      setConn(this.node ? `Connected to ${this.node}` : 'Connected', 'ok');
      hideReplaced();
      state.term.focus();
      refresh();
    } else if (message.type === 'warned' && Array.isArray(message.leads) && state.view) {
      rememberWarned(this.sessionId, state.view.expires_at, message.leads);
    }
  }

  send(bytes) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(bytes);
  }

  /** Tells the console the terminal's size (a text control message; keystrokes are binary). */
  sendSize() {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN || !state.term) return;
    this.ws.send(JSON.stringify({ type: 'resize', cols: state.term.cols, rows: state.term.rows }));
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
