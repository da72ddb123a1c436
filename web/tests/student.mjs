// What the student sees is right, in headless Chromium against a running demo stack:
// "Connected" shows only once the server reaches the VM's console (not when the page's
// WebSocket opens), a new lab's terminal shows nothing of the previous lab, and the expiry
// warning written into the terminal is not written again after a reload or a reconnect.
// Started by web/tests/run.sh after terminal.mjs, with TTLAB_STUDENT_URL, TTLAB_SIM_URL (the
// demo's kube-sim), TTLAB_SIM_NAMESPACE, TTLAB_ARTIFACTS and TTLAB_CHROMIUM. The demo's
// lifespan is 5 minutes, so the 5-minute warning is due as soon as a lab starts.

import assert from 'node:assert/strict';
import { launch, required, screenText, screenshots, stepper, waitForScreen } from './lib.mjs';

const studentUrl = required('TTLAB_STUDENT_URL');
const simUrl = required('TTLAB_SIM_URL');
const namespace = process.env.TTLAB_SIM_NAMESPACE || 'ttlab-vms';
const LESSON = 'systemd-basics';
const PROMPT = /root@[\w.-]+:~# /;
const WARNING = 'minutes left in this lab';
const shot = screenshots('student');
const { step, results } = stepper();
let failed = false;
/** A step whose failure is recorded and does not stop the next ones (each shows one fix). */
async function attempt(name, fn) {
  try {
    await step(name, fn);
  } catch {
    failed = true;
  }
}

/** A kube-sim fault rule: returns its id. */
async function addFault(rule) {
  const r = await fetch(`${simUrl}/sim/faults`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify(rule),
  });
  const body = await r.text();
  assert.ok(r.ok, `adding a fault: ${r.status} ${body}`);
  return JSON.parse(body).id;
}

async function removeFault(id) {
  const r = await fetch(`${simUrl}/sim/faults/${id}`, { method: 'DELETE' });
  const body = await r.text();
  assert.ok(r.ok, `removing fault ${id}: ${r.status} ${body}`);
}

/** From whatever the page shows (a lab left open, its end, the lessons) to a new lab of
 *  `LESSON` whose console is connected and shows a prompt. */
async function startLab(page) {
  const lessons = page.locator('#view-lessons');
  const lab = page.locator('#view-lab');
  const ended = page.locator('#view-ended');
  await Promise.race([
    lessons.waitFor({ state: 'visible', timeout: 30000 }),
    lab.waitFor({ state: 'visible', timeout: 30000 }),
    ended.waitFor({ state: 'visible', timeout: 30000 }),
  ]);
  if (await lab.isVisible()) await finishLab(page);
  if (await ended.isVisible()) await page.locator('#back-to-lessons').click();
  await lessons.waitFor({ state: 'visible', timeout: 30000 });
  await page.locator(`button[data-lesson="${LESSON}"]`).click();
  await lab.waitFor({ state: 'visible', timeout: 120000 });
  await page.locator('#conn.ok').waitFor({ timeout: 30000 });
  await waitForScreen(page, (t) => PROMPT.test(t), 'a root prompt');
}

async function finishLab(page) {
  await page.locator('#finish').click();
  await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 30000 });
}

async function typeLine(page, line) {
  await page.locator('#terminal').click();
  await page.keyboard.type(line);
  await page.keyboard.press('Enter');
}

/** Reloads the lab while KubeVirt holds the console: the page must not say Connected. */
async function consoleHeld(page) {
  await page.reload();
  await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 30000 });
  // The server's waiting line proves the WebSocket is open, and the console held.
  await waitForScreen(page, (t) => t.includes('Waiting for'), 'the server\'s waiting line', 15000);
  await page.waitForTimeout(1500);
  const conn = page.locator('#conn');
  const held = { text: await conn.innerText(), ok: await conn.evaluate((e) => e.classList.contains('ok')) };
  await shot(page, 'console-held');
  assert.ok(!held.ok && !/Connected/.test(held.text),
    `the page says ${JSON.stringify(held.text)} (ok: ${held.ok}) while the VM's console is not reached`);
  assert.match(held.text, /Connecting to the VM/);
}

const browser = await launch();
let fault = null;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  // The console WebSockets the page opens (without their tickets), for failure messages.
  const consoles = [];
  page.on('websocket', (ws) => consoles.push(ws.url().replace(/ticket=[^&]*/, 'ticket=…').replace(/^.*\/api\//, '/api/')));
  // "Finish lab" asks for confirmation.
  page.on('dialog', (d) => d.accept());
  await page.goto(studentUrl);

  await attempt('"Connected" shows only once the server reaches the VM\'s console', async () => {
    await startLab(page);
    // KubeVirt answers the console "not ready" from now on: the page's WebSocket to the
    // server opens, the server's connection to the VM's console does not.
    fault = await addFault({
      resource: 'virtualmachineinstances/console',
      action: { kind: 'fail', status: 400, message: 'VMI is not running' },
    });
    try {
      await consoleHeld(page);
    } finally {
      if (fault !== null) await removeFault(fault);
      fault = null;
    }
    // KubeVirt serves the console again: now the page says Connected, and the VM answers.
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    assert.match(await page.locator('#conn').innerText(), /^Connected/);
    await waitForScreen(page, (t) => PROMPT.test(t.slice(t.lastIndexOf('Waiting for'))), 'the prompt once connected');
    await shot(page, 'console-reached');
  });

  await attempt('a new lab\'s terminal shows nothing of the previous lab', async () => {
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => PROMPT.test(t), 'a root prompt');
    // Past the redraw after connecting (keys typed before the console opens are dropped).
    await page.waitForTimeout(2000);
    await typeLine(page, 'echo previous-lab-$((6*7))');
    await waitForScreen(page, (t) => t.includes('previous-lab-42'), 'the previous lab\'s output');
    await finishLab(page);
    await startLab(page);
    const text = await screenText(page);
    await shot(page, 'new-lab');
    assert.ok(!text.includes('previous-lab'), `the new lab's terminal shows the previous lab's output:\n${text.slice(-2000)}`);
    assert.ok(!text.includes('Waiting for'), `the new lab's terminal shows the previous lab's waiting line:\n${text.slice(-2000)}`);
  });

  await attempt('the expiry warning is written once, not again after a reload', async () => {
    // A new lab has under 5 minutes: the warning is written into its terminal.
    await startLab(page);
    await waitForScreen(page, (t) => t.includes(`5 ${WARNING}`), 'the 5-minute warning');
    await page.reload();
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => PROMPT.test(t), 'a prompt after the reload', 10000);
    // Past the redraw and its settling, after which a due warning would be written.
    await page.waitForTimeout(3000);
    await typeLine(page, 'echo reloaded-$((6*7))');
    const text = await waitForScreen(page, (t) => t.includes('reloaded-42'), 'the echo after the reload');
    await shot(page, 'reloaded');
    const remembered = await page.evaluate(() => Object.entries(sessionStorage)
      .filter(([k]) => k.startsWith('ttlab.warned.')));
    assert.ok(!text.includes(WARNING), `the warning was written again after the reload:\n${text.slice(-2000)}\n` +
      `(consoles opened: ${consoles.join(', ')}; remembered: ${JSON.stringify(remembered)})`);
  });

  await attempt('…nor after the console drops and the page reconnects by itself', async () => {
    const view = await page.evaluate(async () => {
      const token = sessionStorage.getItem('ttlab.token');
      const r = await fetch('/api/sessions/current', { headers: { authorization: `Bearer ${token}` } });
      return r.json();
    });
    const vm = view.nodes[0].vm;
    const droppedAt = (await screenText(page)).length;
    const crash = await fetch(`${simUrl}/sim/vmis/${namespace}/${vm}/crash`, { method: 'POST' });
    const answer = await crash.text();
    assert.ok(crash.ok, `crash: ${crash.status} ${answer}`);
    await page.locator('#conn.warn').waitFor({ timeout: 15000 });
    await page.locator('#conn.ok').waitFor({ timeout: 60000 });
    await waitForScreen(page, (t) => /Connected to the console[\s\S]*root@[\w.-]+:~# /.test(t.slice(droppedAt)),
      'the restarted guest\'s prompt', 60000);
    await page.waitForTimeout(3000);
    await typeLine(page, 'echo reconnected-$((6*7))');
    const text = await waitForScreen(page, (t) => t.slice(droppedAt).includes('reconnected-42'), 'the echo after reconnecting');
    await shot(page, 'reconnected');
    assert.ok(!text.slice(droppedAt).includes(WARNING),
      `the warning was written again after the reconnect:\n${text.slice(droppedAt).slice(-2000)}`);
    await finishLab(page);
  });

  await attempt('the page logged no errors', async () => {
    assert.deepEqual(errors, []);
  });
  await context.close();
} catch (e) {
  console.log(`FAIL ${e.stack}`);
  failed = true;
} finally {
  if (fault !== null) await removeFault(fault).catch(() => {});
  await browser.close();
}
console.log(`\nstudent view tests:\n${results.join('\n')}`);
process.exit(failed ? 1 : 0);
