// The warm pool with real qemu guests (run by web/tests/run.sh beside the other browser tests,
// against a `ttlabctl demo --guest qemu` of its own): the operator gives systemd-basics a pool
// of one, and three times in a row a student clicks "Start lab", is handed the pool's member
// (a claim, never a miss: the lab is running at the click) and reaches a root prompt in the
// browser's terminal; each finishes before the next, and the pool prepares the next member
// meanwhile.
//
// Environment: TTLAB_STUDENT_URL, TTLAB_ADMIN_URL (login links), TTLAB_QEMU_READY_TIMEOUT
// (seconds a member may take to be ready, default 600), TTLAB_ARTIFACTS, TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import { launch, required, screenshots, waitForScreen } from './lib.mjs';

const studentUrl = required('TTLAB_STUDENT_URL');
const adminUrl = required('TTLAB_ADMIN_URL');
const readyTimeout = Number(process.env.TTLAB_QEMU_READY_TIMEOUT || 600) * 1000;
const LESSON = 'systemd-basics';
const CLAIMS = 3;
const PROMPT = /root@[\w.-]+:[^\n#]*# /;
const base = new URL(studentUrl).origin;
const adminToken = new URL(adminUrl).searchParams.get('token');
const studentToken = new URL(studentUrl).searchParams.get('token');
const shot = screenshots('qemu-claims');
const started = Date.now();
const at = () => `${((Date.now() - started) / 1000).toFixed(0)} s`;

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

const pool = async () => {
  const r = await call(adminToken, 'GET', `/api/admin/pools/${LESSON}`);
  assert.equal(r.status, 200, r.text);
  return r.json;
};

const browser = await launch();
try {
  const page = await (await browser.newContext({ viewport: { width: 1280, height: 800 } })).newPage();
  const r = await call(adminToken, 'PUT', `/api/admin/pools/${LESSON}`, { size: 1 });
  assert.equal(r.status, 200, r.text);
  for (let i = 1; i <= CLAIMS; i += 1) {
    await until(`member ${i} ready`, readyTimeout, async () => (await pool()).ready >= 1);
    console.log(`qemu claims: member ${i} ready at ${at()}`);
    await page.goto(studentUrl);
    await page.getByRole('heading', { name: 'Choose a lab' }).waitFor({ timeout: 30000 });
    const clicked = Date.now();
    await page.locator(`button[data-lesson="${LESSON}"]`).click();
    // Handed a ready member: the lab is shown without a start to wait for.
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 30000 });
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
    assert.ok(PROMPT.test(text));
    console.log(`qemu claims: claim ${i}: click → root prompt ${((Date.now() - clicked) / 1000).toFixed(1)} s`);
    await shot(page, `claim-${i}`);
    const p = await pool();
    assert.equal(p.claims_24h, i, `claim ${i} was served by the pool: ${JSON.stringify(p)}`);
    assert.equal(p.misses_24h, 0, `no click missed: ${JSON.stringify(p)}`);
    assert.equal(p.handover_failures_24h, 0, JSON.stringify(p));
    const session = (await call(studentToken, 'GET', '/api/sessions/current')).json;
    assert.ok(session && session.status === 'running', JSON.stringify(session));
    const done = await call(studentToken, 'DELETE', `/api/sessions/${session.id}`);
    assert.equal(done.status, 200, done.text);
    await until(`session ${i} gone`, 180000,
      async () => (await call(studentToken, 'GET', '/api/sessions/current')).status === 404);
  }
  console.log(`qemu claims: ${CLAIMS} claims reached a root prompt in ${at()}`);
} finally {
  await browser.close();
}
