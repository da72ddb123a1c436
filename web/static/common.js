// Shared by the student and admin pages: the sign-in token, JSON calls with readable errors,
// server-sent events over fetch (so the token travels in a header), and small formatting helpers.

const TOKEN_KEY = 'ttlab.token';

/**
 * The bearer token: a `?token=` in the address is moved to this tab's sessionStorage and
 * removed from the address (so it is not bookmarked, shared or kept in history).
 */
export function takeToken() {
  const url = new URL(window.location.href);
  const fromLink = url.searchParams.get('token');
  if (fromLink) {
    sessionStorage.setItem(TOKEN_KEY, fromLink);
    url.searchParams.delete('token');
    history.replaceState(null, '', url.pathname + url.search + url.hash);
  }
  return sessionStorage.getItem(TOKEN_KEY);
}

/** Forgets the token (after the server refused it). */
export function dropToken() {
  sessionStorage.removeItem(TOKEN_KEY);
}

/** The user id inside the token, for display only (the server checks the token). */
export function tokenUser(token) {
  try {
    const payload = token.split('.')[1].replace(/-/g, '+').replace(/_/g, '/');
    const claims = JSON.parse(atob(payload));
    return { user: claims.sub, role: claims.role };
  } catch {
    return { user: '', role: '' };
  }
}

/** An error answer of the API: HTTP status, stable code and a sentence for humans. */
export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Calls the API; resolves to the JSON body, rejects with an ApiError. */
export async function api(token, method, path, body) {
  const headers = { Authorization: `Bearer ${token}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: 'no-store',
    });
  } catch (e) {
    throw new ApiError(0, 'network', 'The server cannot be reached. Check your connection; the page keeps trying.');
  }
  const text = await response.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = null;
  }
  if (!response.ok) {
    const code = json && json.error ? json.error : `http_${response.status}`;
    const message = json && json.message ? json.message : `The server answered ${response.status}.`;
    throw new ApiError(response.status, code, message);
  }
  return json;
}

/**
 * Follows a server-sent event stream with the token in a header (EventSource cannot send one).
 * Calls `onEvent(name, data)` for each event; resolves when the stream ends, rejects on a
 * network error or a refusal (ApiError). Stops when `signal` aborts.
 */
export async function followEvents(token, path, onEvent, signal) {
  let response;
  try {
    response = await fetch(path, {
      headers: { Authorization: `Bearer ${token}`, Accept: 'text/event-stream' },
      cache: 'no-store',
      signal,
    });
  } catch (e) {
    if (signal && signal.aborted) return;
    throw new ApiError(0, 'network', 'The server cannot be reached.');
  }
  if (!response.ok) {
    let json = null;
    try { json = await response.json(); } catch { json = null; }
    throw new ApiError(response.status, json ? json.error : `http_${response.status}`,
      json ? json.message : `The server answered ${response.status}.`);
  }
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    let chunk;
    try {
      chunk = await reader.read();
    } catch (e) {
      if (signal && signal.aborted) return;
      throw new ApiError(0, 'network', 'The connection to the server was interrupted.');
    }
    if (chunk.done) return;
    buffer += chunk.value.replace(/\r\n/g, '\n');
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = 'message';
      const data = [];
      for (const line of block.split('\n')) {
        if (line.startsWith(':')) continue;
        const colon = line.indexOf(':');
        const field = colon < 0 ? line : line.slice(0, colon);
        let value = colon < 0 ? '' : line.slice(colon + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'event') name = value;
        if (field === 'data') data.push(value);
      }
      if (data.length) {
        let parsed;
        try { parsed = JSON.parse(data.join('\n')); } catch { parsed = data.join('\n'); }
        onEvent(name, parsed);
      }
    }
  }
}

/** `h:mm:ss` or `m:ss` for a number of seconds (never negative). */
export function clockText(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const r = String(s % 60).padStart(2, '0');
  return h > 0 ? `${h}:${String(m).padStart(2, '0')}:${r}` : `${m}:${r}`;
}

/** A short local time for an ISO timestamp. */
export function timeText(iso) {
  if (!iso) return '';
  const d = new Date(iso);
  return d.toLocaleTimeString([], { hour: '2-digit', minute: '2-digit', second: '2-digit' });
}

/** Creates an element with attributes and children (strings become text, never HTML). */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    // Through the CSSOM, which the Content-Security-Policy allows: a `style` attribute is
    // inline style.
    else if (k === 'style') node.style.cssText = v;
    else node.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

let noticeTimer = null;

/**
 * Shows (or with `null`, hides) the page-wide notice line. Confirmations (`ok`) go away by
 * themselves after a few seconds; warnings and errors stay until replaced.
 */
export function notice(text, kind = 'info') {
  const box = document.getElementById('notice');
  clearTimeout(noticeTimer);
  if (!text) {
    box.hidden = true;
    return;
  }
  box.textContent = text;
  box.className = `notice ${kind}`;
  box.hidden = false;
  if (kind === 'ok') noticeTimer = setTimeout(() => { box.hidden = true; }, 6000);
}

/** Shows exactly one of the page's `<main>` views. */
export function show(id) {
  for (const main of document.querySelectorAll('main')) main.hidden = main.id !== id;
}

/** Waits `ms` milliseconds. */
export function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}
