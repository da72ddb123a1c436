// A measurement, not a test: "Start lab" → a root prompt in the browser with a real qemu guest,
// for a click a warm pool serves and for one that goes the cold way, in the same run of
// `ttlabctl demo --guest qemu` (web/tests/qemu-pool.sh starts it and passes its links).
//
// 1. The operator gives systemd-basics a pool of one (PUT /api/admin/pools/systemd-basics);
//    the member boots and runs its setup.
// 2. The student clicks "Start lab": the member is claimed; printed: click → lab shown and
//    click → root prompt on the terminal (target ≤ 2 s).
// 3. The pool is set to size 0 (no refill), the student finishes, and clicks again: the cold
//    path, measured the same way.
//
// Environment: TTLAB_STUDENT_URL, TTLAB_ADMIN_URL (login links), TTLAB_QEMU_READY_TIMEOUT
// (seconds, default 600), TTLAB_ARTIFACTS, TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import { launch, required, screenshots, waitForScreen } from './lib.mjs';

const studentUrl = required('TTLAB_STUDENT_URL');
const adminUrl = required('TTLAB_ADMIN_URL');
const readyTimeout = Number(process.env.TTLAB_QEMU_READY_TIMEOUT || 600) * 1000;
const LESSON = 'systemd-basics';
const PROMPT = /root@[\w.-]+:[^\n#]*# /;
const base = new URL(studentUrl).origin;
const adminToken = new URL(adminUrl).searchParams.get('token');
const studentToken = new URL(studentUrl).searchParams.get('token');
const shot = screenshots('qemu-pool');

async function call(token, method, path, body) {
  const r = await fetch(`${base}${path}`, {
    method,
    headers: { authorization: `Bearer ${token}`, ...(body ? { 'content-type': 'application/json' } : {}) },
    body: body ? JSON.stringify(body) : undefined,
  });
  const text = await r.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: r.status, json, text };
}

async function until(what, timeout, probe) {
  const start = Date.now();
  for (;;) {
    const v = await probe();
    if (v) return v;
    if (Date.now() - start > timeout) assert.fail(`${what}: not within ${timeout / 1000} s`);
    await new Promise((r) => setTimeout(r, 500));
  }
}

/** Clicks "Start lab" and measures click → lab shown and click → a root prompt. */
async function startAndPrompt(page, name) {
  await page.goto(studentUrl);
  await page.getByRole('heading', { name: 'Choose a lab' }).waitFor({ timeout: 30000 });
  const clicked = Date.now();
  await page.locator(`button[data-lesson="${LESSON}"]`).click();
  await page.locator('#view-lab').waitFor({ state: 'visible', timeout: readyTimeout });
  const lab = Date.now() - clicked;
  await page.locator('#conn.ok').waitFor({ timeout: 60000 });
  let text;
  try {
    text = await waitForScreen(page, (t) => PROMPT.test(t), 'a root prompt', 3000);
  } catch {
    // Nothing replayed yet: ask the shell for a prompt.
    await page.locator('#terminal').click();
    await page.keyboard.press('Enter');
    text = await waitForScreen(page, (t) => PROMPT.test(t), 'a root prompt', 60000);
  }
  const prompt = Date.now() - clicked;
  assert.ok(PROMPT.test(text));
  await shot(page, name);
  return { lab, prompt };
}

const browser = await launch();
const figures = {};
try {
  const page = await (await browser.newContext({ viewport: { width: 1280, height: 800 } })).newPage();
  let r = await call(adminToken, 'PUT', `/api/admin/pools/${LESSON}`, { size: 1 });
  assert.equal(r.status, 200, r.text);
  const configured = Date.now();
  await until('the pool member ready', readyTimeout, async () => {
    const p = await call(adminToken, 'GET', `/api/admin/pools/${LESSON}`);
    return p.json && p.json.ready >= 1;
  });
  figures.member_ready_s = (Date.now() - configured) / 1000;

  figures.hit = await startAndPrompt(page, 'hit');
  const session = (await call(studentToken, 'GET', '/api/sessions/current')).json;
  assert.ok(session && session.status === 'running', JSON.stringify(session));

  // No refill: the next click is a miss. Then the student finishes and starts again.
  r = await call(adminToken, 'PUT', `/api/admin/pools/${LESSON}`, { size: 0 });
  assert.equal(r.status, 200, r.text);
  r = await call(studentToken, 'DELETE', `/api/sessions/${session.id}`);
  assert.equal(r.status, 200, r.text);
  await until('the finished session gone', 180000, async () => (await call(studentToken, 'GET', '/api/sessions/current')).status === 404);
  figures.cold = await startAndPrompt(page, 'cold');
  const pool = (await call(adminToken, 'GET', `/api/admin/pools/${LESSON}`)).json;
  figures.pool = { claims_24h: pool.claims_24h, misses_24h: pool.misses_24h, median_refill_seconds: pool.median_refill_seconds };
} finally {
  await browser.close();
}
const s = (ms) => `${(ms / 1000).toFixed(1)} s`;
console.log(`pool member ready ${figures.member_ready_s.toFixed(1)} s after the pool was configured`);
console.log(`hit (claimed from the pool): click → lab ${s(figures.hit.lab)}, click → root prompt ${s(figures.hit.prompt)} (target ≤ 2 s: ${figures.hit.prompt <= 2000 ? 'met' : 'MISSED'})`);
console.log(`cold path (same run):        click → lab ${s(figures.cold.lab)}, click → root prompt ${s(figures.cold.prompt)}`);
console.log(`pool as the server reports it: ${JSON.stringify(figures.pool)}`);
