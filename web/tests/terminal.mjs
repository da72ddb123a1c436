// The student's terminal in headless Chromium against a running demo stack: its size reaches
// the guest (`stty size`), the expiry warning is written into the terminal and the tab title
// (and a notification, asked for only on a click), the lesson's instructions sit beside the
// terminal, and a console that drops comes back by itself, without a reload.
// Started by web/tests/run.sh after browser.mjs, with TTLAB_STUDENT_URL, TTLAB_SIM_URL (the
// demo's kube-sim), TTLAB_SIM_NAMESPACE, TTLAB_ARTIFACTS and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import path from 'node:path';
import { launch } from './lib.mjs';

const studentUrl = process.env.TTLAB_STUDENT_URL;
const simUrl = process.env.TTLAB_SIM_URL;
const namespace = process.env.TTLAB_SIM_NAMESPACE || 'ttlab-vms';
const artifacts = process.env.TTLAB_ARTIFACTS || 'artifacts/browser';
assert.ok(studentUrl && simUrl, 'TTLAB_STUDENT_URL and TTLAB_SIM_URL are required');
const LESSON = 'systemd-basics';

async function shot(page, name) {
  const file = path.join(artifacts, `terminal-${name}.png`);
  await page.screenshot({ path: file });
  console.log(`screenshot ${file}`);
}

/** Everything the terminal holds (scrollback and screen), as text; wrapped lines joined. */
async function screenText(page) {
  return page.evaluate(() => {
    const term = window.ttlabTerminal;
    if (!term) return '';
    const buffer = term.buffer.active;
    const lines = [];
    for (let i = 0; i < buffer.length; i++) {
      const line = buffer.getLine(i);
      if (line.isWrapped && lines.length) {
        lines[lines.length - 1] = lines[lines.length - 1].padEnd(term.cols) + line.translateToString(true);
      } else {
        lines.push(line.translateToString(true));
      }
    }
    return lines.join('\n');
  });
}

async function waitForScreen(page, test, what, timeout = 30000) {
  const until = Date.now() + timeout;
  let text = '';
  while (Date.now() < until) {
    text = await screenText(page);
    if (test(text)) return text;
    await page.waitForTimeout(100);
  }
  throw new Error(`the terminal never showed ${what}; it shows:\n${text.slice(-3000)}\n(${JSON.stringify(text.slice(-400))})`);
}

async function termSize(page) {
  return page.evaluate(() => ({ cols: window.ttlabTerminal.cols, rows: window.ttlabTerminal.rows }));
}

/** Types `stty size` until the guest answers `rows cols` (the size travels through the agent). */
async function sttySizeBecomes(page, { rows, cols }) {
  const want = `${rows} ${cols}`;
  const answers = (t) => [...t.matchAll(/stty size\n(\d+ \d+)\n/g)].map((m) => m[1]);
  let seen = '';
  for (let attempt = 0; attempt < 10; attempt++) {
    const before = answers(await screenText(page)).length;
    await page.locator('#terminal').click();
    await page.keyboard.type('stty size');
    await page.keyboard.press('Enter');
    const text = await waitForScreen(page, (t) => answers(t).length > before, 'an answer to stty size', 10000);
    seen = answers(text)[before];
    if (seen === want) return seen;
    await page.waitForTimeout(300);
  }
  throw new Error(`stty size in the guest says ${seen}, the page's terminal is ${want}`);
}

const results = [];
async function step(name, fn) {
  const started = Date.now();
  try {
    await fn();
    results.push(`ok   ${name} (${Date.now() - started} ms)`);
    console.log(`ok   ${name}`);
  } catch (e) {
    results.push(`FAIL ${name}: ${e.message}`);
    console.log(`FAIL ${name}\n${e.stack}`);
    throw e;
  }
}

const browser = await launch();
let failed = false;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  // Headless Chromium shows no notifications: the page's Notification is recorded instead,
  // with the browser's rule that permission is asked for, and given, only on request.
  await context.addInitScript(() => {
    window.__notifications = [];
    window.__permissionRequests = 0;
    let permission = 'default';
    class RecordedNotification {
      constructor(title, options) { window.__notifications.push((options && options.body) || title); }
      static get permission() { return permission; }
      static async requestPermission() {
        window.__permissionRequests += 1;
        permission = 'granted';
        return permission;
      }
      close() {}
    }
    window.Notification = RecordedNotification;
  });
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  // "Finish lab" asks for confirmation.
  page.on('dialog', (d) => d.accept());

  await step('a VM lab starts (after the other tests, from the lessons or the lab left open)', async () => {
    await page.goto(studentUrl);
    const lessons = page.locator('#view-lessons');
    const lab = page.locator('#view-lab');
    const ended = page.locator('#view-ended');
    await Promise.race([
      lessons.waitFor({ state: 'visible', timeout: 30000 }),
      lab.waitFor({ state: 'visible', timeout: 30000 }),
      ended.waitFor({ state: 'visible', timeout: 30000 }),
    ]);
    if (await lab.isVisible()) {
      await page.locator('#finish').click();
      await ended.waitFor({ state: 'visible', timeout: 30000 });
    }
    if (await ended.isVisible()) await page.locator('#back-to-lessons').click();
    await lessons.waitFor({ state: 'visible', timeout: 30000 });
    await page.locator(`button[data-lesson="${LESSON}"]`).click();
    await lab.waitFor({ state: 'visible', timeout: 120000 });
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => /root@[\w.-]+:~# /.test(t), 'a root prompt');
  });

  await step('the lesson\'s instructions are beside the terminal, with what is checked, and fold away', async () => {
    const panel = page.locator('#instructions');
    await panel.waitFor({ state: 'visible', timeout: 5000 });
    const lessons = await page.evaluate(async () => {
      const token = sessionStorage.getItem('ttlab.token');
      const r = await fetch('/api/lessons', { headers: { authorization: `Bearer ${token}` } });
      return r.ok ? r.json() : [];
    });
    const lesson = lessons.find((l) => l.id === LESSON);
    assert.ok(lesson && lesson.instructions_html, `${LESSON} carries instructions`);
    const checks = await page.locator('#instructions-checks li').allInnerTexts();
    assert.deepEqual(checks, lesson.checks);
    assert.ok(checks.length > 0);
    // The panel names the button as the page does.
    assert.match(await panel.innerText(), /Check my work/);
    assert.doesNotMatch(await panel.innerText(), /\bGrade\b/);
    await shot(page, 'instructions');
    const before = await termSize(page);
    await page.locator('#instructions-toggle').click();
    await panel.waitFor({ state: 'hidden', timeout: 5000 });
    await page.waitForFunction((cols) => window.ttlabTerminal.cols > cols, before.cols, { timeout: 5000 });
    await page.locator('#instructions-toggle').click();
    await panel.waitFor({ state: 'visible', timeout: 5000 });
  });

  await step('the terminal\'s size reaches the guest: stty size follows the window', async () => {
    const first = await termSize(page);
    assert.notDeepEqual(first, { cols: 80, rows: 24 }, 'the page is not the default 80x24');
    await sttySizeBecomes(page, first);
    await page.setViewportSize({ width: 900, height: 560 });
    await page.waitForFunction((c) => window.ttlabTerminal.cols !== c, first.cols, { timeout: 5000 });
    const second = await termSize(page);
    assert.ok(second.cols < first.cols && second.rows < first.rows, `${JSON.stringify(first)} → ${JSON.stringify(second)}`);
    await sttySizeBecomes(page, second);
    await shot(page, 'stty-size');
    await page.setViewportSize({ width: 1280, height: 800 });
    await page.waitForFunction((c) => window.ttlabTerminal.cols !== c, second.cols, { timeout: 5000 });
  });

  await step('the expiry warning is written into the terminal and the tab title', async () => {
    // The demo's lifespan is 5 minutes: the 5-minute warning is due from the start.
    const text = await waitForScreen(page, (t) => t.includes('[ttlab] 5 minutes left in this lab.'), 'the warning line');
    assert.match(text, /\[ttlab\] 5 minutes left in this lab\. Save your work/);
    await page.waitForFunction(() => document.title.startsWith('⏳'), null, { timeout: 5000 });
    assert.match(await page.title(), /^⏳ \d+:\d\d left — /);
    await shot(page, 'warning');
  });

  await step('a notification is asked for only on a click, and then tells the time left', async () => {
    const asked = await page.evaluate(() => window.__permissionRequests);
    assert.equal(asked, 0, 'permission was asked for without a click');
    assert.deepEqual(await page.evaluate(() => window.__notifications), []);
    const button = page.locator('#notify');
    await button.waitFor({ state: 'visible', timeout: 5000 });
    await button.click();
    await page.waitForFunction(() => window.__notifications.length > 0, null, { timeout: 5000 });
    const notes = await page.evaluate(() => window.__notifications);
    assert.match(notes[0], /minutes? left in your lab/);
    await button.waitFor({ state: 'hidden', timeout: 5000 });
  });

  await step('the console drops server-side and the page reconnects by itself, without a reload', async () => {
    await page.evaluate(() => { window.__sameDocument = true; });
    const view = await page.evaluate(async () => {
      const token = sessionStorage.getItem('ttlab.token');
      const r = await fetch('/api/sessions/current', { headers: { authorization: `Bearer ${token}` } });
      return r.json();
    });
    const vm = view.nodes[0].vm;
    const droppedAt = (await screenText(page)).length;
    // The guest crashes: KubeVirt's console connection ends, the VM restarts.
    const crash = await fetch(`${simUrl}/sim/vmis/${namespace}/${vm}/crash`, { method: 'POST' });
    assert.ok(crash.ok, `crash: ${crash.status} ${await crash.text()}`);
    await page.locator('#conn.warn').waitFor({ timeout: 15000 });
    const dropped = await page.locator('#conn').innerText();
    assert.match(dropped, /reconnecting|Disconnected|Connecting/i);
    await shot(page, 'dropped');
    await page.locator('#conn.ok').waitFor({ timeout: 60000 });
    // The restarted guest's console shows its prompt (keys typed before the console is open
    // again are dropped, as a student would see).
    await waitForScreen(page, (t) => /Connected to the console[\s\S]*root@[\w.-]+:~# /.test(t.slice(droppedAt)),
      'the restarted guest\'s prompt', 60000);
    assert.equal(await page.evaluate(() => window.__sameDocument), true, 'the page was reloaded');
    const before = (await screenText(page)).length;
    await page.locator('#terminal').click();
    await page.keyboard.type('whoami');
    await page.keyboard.press('Enter');
    await waitForScreen(page, (t) => t.length > before && t.slice(before - 100).includes('whoami\nroot\n'), 'whoami → root after reconnecting');
    // The new console has the page's size too.
    await sttySizeBecomes(page, await termSize(page));
    await shot(page, 'reconnected');
  });

  await step('a reload shows a prompt at once, without a key pressed', async () => {
    await page.reload();
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => /root@[\w.-]+:~# /.test(t), 'a prompt after the reload', 10000);
    await shot(page, 'reloaded');
  });

  await step('a pod lab\'s shell gets the size through the exec\'s resize channel', async () => {
    await page.locator('#finish').click();
    await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 30000 });
    await page.locator('#back-to-lessons').click();
    await page.locator('button[data-lesson="shell-basics"]').click();
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 120000 });
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => /Connected to [\s\S]*@[\w.-]+:[~/][#$] /.test(t), 'the shell\'s prompt');
    await sttySizeBecomes(page, await termSize(page));
    await page.setViewportSize({ width: 1000, height: 600 });
    await page.waitForFunction(() => window.ttlabTerminal.rows < 30, null, { timeout: 5000 });
    await sttySizeBecomes(page, await termSize(page));
    await shot(page, 'pod-stty-size');
    await page.locator('#finish').click();
    await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 30000 });
  });

  await step('the page logged no errors', async () => {
    assert.deepEqual(errors, []);
  });
  await context.close();
} catch {
  failed = true;
} finally {
  await browser.close();
}
console.log(`\nterminal tests:\n${results.join('\n')}`);
process.exit(failed ? 1 : 0);
