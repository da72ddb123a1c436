// The student and admin pages in headless Chromium against a running demo stack.
// Started by web/tests/run.sh, which passes TTLAB_STUDENT_URL, TTLAB_ADMIN_URL (login links),
// TTLAB_SIM_URL and TTLAB_SIM_NAMESPACE (the demo's kube-sim and the VMs' namespace),
// TTLAB_ARTIFACTS (screenshot directory) and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import path from 'node:path';
import { launch } from './lib.mjs';

const studentUrl = process.env.TTLAB_STUDENT_URL;
const adminUrl = process.env.TTLAB_ADMIN_URL;
const simUrl = process.env.TTLAB_SIM_URL;
const simNamespace = process.env.TTLAB_SIM_NAMESPACE || 'ttlab-vms';
const artifacts = process.env.TTLAB_ARTIFACTS || 'artifacts/browser';
assert.ok(studentUrl && adminUrl && simUrl, 'TTLAB_STUDENT_URL, TTLAB_ADMIN_URL and TTLAB_SIM_URL are required');

let shots = 0;
async function shot(page, name, fullPage = false) {
  shots += 1;
  const file = path.join(artifacts, `${String(shots).padStart(2, '0')}-${name}.png`);
  await page.screenshot({ path: file, fullPage });
  return file;
}

/** Everything the terminal shows (its whole buffer), as text. */
async function screenText(page) {
  return page.evaluate(() => {
    const term = window.ttlabTerminal;
    if (!term) return '';
    const buffer = term.buffer.active;
    const lines = [];
    for (let i = 0; i < buffer.length; i++) lines.push(buffer.getLine(i).translateToString(true));
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
  throw new Error(`the terminal never showed ${what}; it shows:\n${text}`);
}

/** `m:ss` or `h:mm:ss` → seconds. */
function seconds(text) {
  return text.split(':').map(Number).reduce((acc, n) => acc * 60 + n, 0);
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
  const page = await context.newPage();
  const consoleErrors = [];
  page.on('pageerror', (e) => consoleErrors.push(String(e)));
  page.on('console', (m) => { if (m.type() === 'error') consoleErrors.push(m.text()); });

  await step('the login link signs in and leaves no token in the address', async () => {
    await page.goto(studentUrl);
    await page.getByRole('heading', { name: 'Choose a lab' }).waitFor({ timeout: 15000 });
    assert.ok(!page.url().includes('token='), `address still holds the token: ${page.url()}`);
    const stored = await page.evaluate(() => sessionStorage.getItem('ttlab.token'));
    assert.ok(stored && stored.length > 20, 'token kept in sessionStorage');
    await shot(page, 'lessons');
  });

  const stagesSeen = new Set();
  const progress = {};
  await step('Start lab shows the real stages until the lab is ready', async () => {
    const buttons = page.locator('button[data-lesson]');
    assert.ok(await buttons.count() > 0, 'at least one lesson');
    const vmLesson = page.locator('button[data-lesson="systemd-basics"]');
    await ((await vmLesson.count()) ? vmLesson : buttons.first()).click();
    await page.locator('#view-starting').waitFor({ state: 'visible', timeout: 15000 });
    let captured = false;
    const until = Date.now() + 90000;
    while (Date.now() < until) {
      if (await page.locator('#view-lab').isVisible()) break;
      const stage = await page.locator('#progress-bar').getAttribute('data-stage').catch(() => null);
      if (stage) stagesSeen.add(stage);
      if (!captured && stage && stage !== 'requested') {
        progress.elapsed = await page.locator('#starting-elapsed').innerText();
        progress.hint = await page.locator('#starting-hint').innerText();
        progress.disk = await page.locator('#starting-disk').innerText();
        progress.stageTimes = await page.locator('#stages .stage-time').allInnerTexts();
        await shot(page, 'progress');
        captured = true;
      }
      await page.waitForTimeout(100);
    }
    assert.ok(await page.locator('#view-lab').isVisible(), `never ready; stages seen: ${[...stagesSeen]}`);
    assert.ok(stagesSeen.size >= 2, `the bar moved through stages: ${[...stagesSeen]}`);
  });

  await step('progress shows elapsed time per stage, the disk decision, and no fixed promise', async () => {
    assert.match(progress.elapsed || '', /^Elapsed: \d+ s$/, `elapsed: ${progress.elapsed}`);
    assert.ok(progress.stageTimes.length > 0, 'stage times shown');
    assert.ok(progress.stageTimes.every((t) => /(took|so far)/.test(t) && /\d+ s/.test(t)), `${progress.stageTimes}`);
    // No start of this lesson was measured before: no invented estimate.
    assert.match(progress.hint, /No start of this lab has been measured yet/, progress.hint);
    assert.ok(!/usually under a minute/.test(progress.hint), progress.hint);
    // systemd-basics has its golden disk in the demo.
    assert.match(progress.disk, /^Disk: (a prepared copy|not chosen yet)/, progress.disk);
  });

  let host = '';
  await step('the terminal shows the autologin prompt', async () => {
    const text = await waitForScreen(page, (t) => /root@[\w.-]+:~# /.test(t), 'a root prompt');
    assert.match(text, /login: root \(automatic login\)/);
    host = text.match(/root@([\w.-]+):~# /)[1];
    await page.locator('#conn.ok').waitFor({ timeout: 5000 });
    await shot(page, 'terminal');
  });

  await step('typing hostname and Enter shows the answer', async () => {
    await page.locator('#terminal').click();
    await page.keyboard.type('hostname');
    await page.keyboard.press('Enter');
    await waitForScreen(page, (t) => t.includes(`hostname\n${host}\nroot@${host}:~# `), `the hostname ${host}`);
    await shot(page, 'hostname');
  });

  await step('the countdown moves and warns at 5 minutes left', async () => {
    const first = seconds(await page.locator('#countdown').innerText());
    await page.waitForTimeout(2200);
    const second = seconds(await page.locator('#countdown').innerText());
    assert.ok(first > 0 && second < first && first - second <= 3, `countdown ${first} → ${second}`);
    // The demo's lifespan is 5 minutes: the warning is up from the start.
    await page.locator('#lab-banner', { hasText: 'Only 5 minutes left' }).waitFor({ timeout: 5000 });
    await shot(page, 'warning');
  });

  await step('Extend is refused before its window, and says when it opens', async () => {
    // The demo's window is 4 min 20 s of a 5-minute lab: closed for the first 40 s.
    const button = page.locator('#extend');
    assert.ok(await button.isDisabled(), 'the button is disabled before the window');
    const reason = await page.locator('#extend-reason').innerText();
    assert.match(reason, /^Extending opens at \d{1,2}:\d{2}/, reason);
    await page.locator('#lab-banner', { hasText: 'You can extend the lab from' }).waitFor({ timeout: 5000 });
    const answer = await page.evaluate(async () => {
      const token = sessionStorage.getItem('ttlab.token');
      const current = await (await fetch('/api/sessions/current', { headers: { authorization: `Bearer ${token}` } })).json();
      const r = await fetch(`/api/sessions/${current.id}/extend`, { method: 'POST', headers: { authorization: `Bearer ${token}` } });
      return { status: r.status, body: await r.json(), opensAt: current.extend.opens_at };
    });
    assert.equal(answer.status, 409, JSON.stringify(answer));
    assert.equal(answer.body.error, 'not_yet');
    assert.equal(answer.body.opens_at, answer.opensAt);
    assert.match(answer.body.message, /opens at/);
    await shot(page, 'extend-not-yet');
  });

  await step('when the window opens the button says what extending gains', async () => {
    const button = page.locator('#extend');
    await page.waitForFunction(() => !document.getElementById('extend').disabled, null, { timeout: 60000 });
    const text = await button.innerText();
    assert.match(text, /^Extend \+\d+ (s|min)$/, text);
    await page.locator('#lab-banner', { hasText: 'Extend the lab if you need more time' }).waitFor({ timeout: 5000 });
    await shot(page, 'extend-offered');
  });

  await step('Extend moves the expiry and counts the extension', async () => {
    const before = seconds(await page.locator('#countdown').innerText());
    const leftBefore = await page.locator('#extend-reason').innerText();
    await page.waitForTimeout(3000);
    await page.locator('#extend').click();
    await page.locator('#notice', { hasText: 'Extended' }).waitFor({ timeout: 10000 });
    const after = seconds(await page.locator('#countdown').innerText());
    assert.ok(after > before - 3 && after >= 295, `countdown after extending: ${before} → ${after}`);
    const leftAfter = await page.locator('#extend-reason').innerText();
    assert.notEqual(leftAfter, leftBefore, 'extensions left went down');
    await shot(page, 'extended');
  });

  await step('a second tab takes the console; the first says so and can take it back', async () => {
    const other = await context.newPage();
    await other.goto(studentUrl);
    await other.locator('#view-lab').waitFor({ state: 'visible', timeout: 15000 });
    await other.locator('#conn.ok').waitFor({ timeout: 15000 });
    await page.locator('#lab-banner', { hasText: 'open in another tab' }).waitFor({ timeout: 10000 });
    await waitForScreen(page, (t) => t.includes('opened in another tab'), 'the replaced notice');
    await shot(page, 'replaced');
    await page.getByRole('button', { name: 'Use it here' }).click();
    await page.locator('#conn.ok').waitFor({ timeout: 10000 });
    await other.locator('#lab-banner', { hasText: 'open in another tab' }).waitFor({ timeout: 10000 });
    await other.close();
    await page.locator('#terminal').click();
    await page.keyboard.type('whoami');
    await page.keyboard.press('Enter');
    await waitForScreen(page, (t) => t.includes('whoami\nroot\n'), 'whoami → root');
  });

  await step('Check my work shows per-step results', async () => {
    await page.locator('#grade').click();
    const dialog = page.locator('#grade-dialog');
    await dialog.waitFor({ state: 'visible', timeout: 30000 });
    assert.match(await page.locator('#grade-summary').innerText(), /\d+ of \d+ checks passed/);
    assert.ok(await dialog.locator('.step').count() > 0, 'at least one step listed');
    await shot(page, 'grade');
    await dialog.getByRole('button', { name: 'Close' }).click();
  });

  await step('Finish ends the lab', async () => {
    page.once('dialog', (d) => d.accept());
    await page.locator('#finish').click();
    await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 15000 });
    await page.getByRole('heading', { name: 'Lab finished' }).waitFor({ timeout: 30000 });
    await shot(page, 'finished');
  });

  await step('a pod lab offers Check my work and grades in its container', async () => {
    await page.getByRole('button', { name: 'Back to the labs' }).click();
    await page.locator('button[data-lesson="shell-basics"]').click();
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 60000 });
    const grade = page.locator('#grade');
    assert.ok(await grade.isVisible(), 'Check my work is shown for a pod lab');
    await grade.click();
    const dialog = page.locator('#grade-dialog');
    await dialog.waitFor({ state: 'visible', timeout: 30000 });
    assert.match(await page.locator('#grade-summary').innerText(), /\d+ of \d+ checks passed/);
    assert.ok(await dialog.locator('.step').count() > 0, 'the pod lab\'s steps are listed');
    await shot(page, 'pod-grade');
    await dialog.getByRole('button', { name: 'Close' }).click();
    page.once('dialog', (d) => d.accept());
    await page.locator('#finish').click();
    await page.getByRole('heading', { name: 'Lab finished' }).waitFor({ timeout: 30000 });
  });

  await step('a second start of a lesson shows the time measured on the first', async () => {
    await page.getByRole('button', { name: 'Back to the labs' }).click();
    await page.locator('button[data-lesson="systemd-basics"]').click();
    await page.locator('#view-starting').waitFor({ state: 'visible', timeout: 15000 });
    const hint = await page.locator('#starting-hint').innerText();
    assert.match(hint, /Recent starts of this lab were ready in about \d+ s; 9 in 10 within \d+ s \(last 1\)/, hint);
    await shot(page, 'progress-expected');
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 60000 });
    // Checked once, for the operators' grading history below.
    await page.locator('#grade').click();
    await page.locator('#grade-dialog').waitFor({ state: 'visible', timeout: 30000 });
    await page.locator('#grade-dialog').getByRole('button', { name: 'Close' }).click();
  });

  await step('admin: opens the session, extends it with a reason, sees it recorded, then ends it', async () => {
    const admin = await context.newPage();
    await admin.goto(adminUrl);
    const open = admin.locator('#sessions button[data-session]').first();
    await open.waitFor({ timeout: 15000 });
    // Without a sites file every session is on the one site, `default`.
    assert.equal(await admin.locator('#sessions tbody tr').first().locator('[data-field="site"]').innerText(), 'default');
    await open.click();
    const detail = admin.locator('#detail');
    await detail.waitFor({ state: 'visible', timeout: 10000 });
    await admin.locator('#detail-stages tbody tr', { hasText: 'ready' }).waitFor({ timeout: 10000 });
    await admin.locator('#detail-objects tbody tr', { hasText: 'VirtualMachine' }).first().waitFor({ timeout: 10000 });
    assert.match(await admin.locator('#detail-title').innerText(), /reference [0-9a-f]{8}/);
    await admin.locator('#detail-grading li', { hasText: /\d+ of \d+ checks passed/ }).waitFor({ timeout: 10000 });
    // The student's page holds the VM's console: the operator sees whose it is and since when.
    await admin.locator('#detail-facts li.console-owner', { hasText: /^Console of vm: open since .+ by .+ on replica .+/ }).waitFor({ timeout: 10000 });
    const before = seconds(await page.locator('#countdown').innerText());
    await admin.locator('#extend-minutes').fill('5');
    await admin.locator('#extend-reason').fill('lost time to a slow start');
    await admin.locator('#extend-form button[type=submit]').click();
    await admin.locator('#notice', { hasText: 'Extended by 5 min' }).waitFor({ timeout: 10000 });
    await admin.locator('#detail-actions li', { hasText: 'lost time to a slow start' }).waitFor({ timeout: 10000 });
    await admin.locator('#actions tbody tr', { hasText: 'extended by 5 min' }).waitFor({ timeout: 10000 });
    await shot(admin, 'admin-session-extended', true);
    // The student's countdown follows by itself (the session's event stream), no reload.
    await page.waitForFunction((b) => {
      const [m, s] = document.getElementById('countdown').innerText.split(':').map(Number);
      return m * 60 + s > b + 200;
    }, before, { timeout: 15000 });
    admin.once('dialog', (d) => d.accept());
    await admin.locator('#end-reason').fill('end of class');
    await admin.locator('#end-form button[type=submit]').click();
    await admin.locator('#notice', { hasText: 'The session was ended' }).waitFor({ timeout: 15000 });
    await admin.locator('#actions tbody tr', { hasText: 'end of class' }).waitFor({ timeout: 10000 });
    await page.getByRole('heading', { name: 'Lab finished' }).waitFor({ timeout: 30000 });
    await shot(page, 'ended-by-admin');
    await shot(admin, 'admin-session-ended', true);
    await admin.close();
  });

  await step('admin: capacity, cycles, background tasks, sessions, and Collect now shows its report', async () => {
    const admin = await context.newPage();
    await admin.goto(adminUrl);
    await admin.locator('#capacity .stat').first().waitFor({ timeout: 15000 });
    assert.ok(!admin.url().includes('token='), 'admin token removed from the address');
    await admin.locator('#collect').click();
    await admin.locator('#collect-report h3', { hasText: 'Cycle #' }).waitFor({ timeout: 40000 });
    const report = await admin.locator('#collect-report').innerText();
    assert.match(report, /Expired sessions reclaimed: \d+/);
    await admin.locator('#cycles tbody tr td', { hasText: 'collect' }).first().waitFor({ timeout: 10000 });
    // The demo's namespace has no ResourceQuota: the card says so in words.
    const quota = await admin.locator('#capacity .stat', { hasText: 'Quota' }).locator('.stat-value').innerText();
    assert.equal(quota, 'none');
    // The one site's card: its VMs against its limit, reached by the cluster probe.
    const site = admin.locator('#capacity .stat[data-site="default"]');
    assert.match(await site.locator('.stat-value').innerText(), /^\d+ \/ \d+$/);
    assert.match(await site.locator('.muted').innerText(), /^[a-z0-9-]+, reachable$/);
    // The replica's background tasks, each with its last run; none failing. The console
    // watchers run too: the student's page opened a console above.
    for (const name of ['cluster_probe', 'hub', 'waitlist', 'pool_refill', 'adoption',
      'console_sessions', 'console_takeovers', 'agent_keeper']) {
      const row = admin.locator(`#tasks tbody tr[data-task="${name}"]`);
      await row.waitFor({ timeout: 10000 });
      assert.match(await row.locator('[data-field="last-run"]').innerText(), /ago/, name);
      assert.equal(await row.locator('[data-field="last-error"]').innerText(), '—', name);
    }
    assert.match(await admin.locator('#tasks-replica').innerText(), /replica .+/);
    const memory = admin.locator('#capacity .stat', { hasText: 'Memory requested / limit' }).locator('.stat-value');
    assert.equal(await memory.innerText(), 'no limit');
    // What a session of each VM lesson costs: KubeVirt's launcher pod requests the guest's
    // memory, its overhead and the console log's sidecar.
    const cost = admin.locator('#capacity [data-lesson-cost="systemd-basics"]');
    assert.equal(await cost.innerText(),
      'systemd-basics: 2.32 GiB a session (1 VM × 2.00 GiB guest + 292 MiB KubeVirt overhead + 33 MiB console log)');
    assert.match(await admin.locator('#capacity [data-lesson-cost="kubeadm-cluster"]').innerText(),
      /^kubeadm-cluster: 12\.99 GiB a session \(3 VMs × 4\.00 GiB guest \+ 304 MiB KubeVirt overhead/);
    // With the shipped quota in the namespace, the card shows memory against it, and how many
    // more sessions of each lesson its memory allows.
    const quotas = `${simUrl}/api/v1/namespaces/${simNamespace}/resourcequotas`;
    const created = await fetch(quotas, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({
        apiVersion: 'v1', kind: 'ResourceQuota', metadata: { name: 'ttlab-vms' },
        spec: { hard: { 'count/virtualmachines.kubevirt.io': '8', 'requests.memory': '48Gi' } },
      }),
    });
    assert.equal(created.status, 201, await created.text());
    try {
      await admin.locator('#capacity .stat', { hasText: /\d+\.\d\d GiB \/ 48\.00 GiB/ }).waitFor({ timeout: 20000 });
      assert.match(await memory.innerText(), /^\d+\.\d\d GiB \/ 48\.00 GiB$/);
      await cost.filter({ hasText: /— memory for \d+ more$/ }).waitFor({ timeout: 10000 });
      const more = Number((await cost.innerText()).match(/memory for (\d+) more$/)[1]);
      assert.ok(more >= 1 && more <= 20, `at most 48 GiB / 2.32 GiB = 20 sessions: ${more}`);
      await shot(admin, 'admin-capacity-memory', true);
    } finally {
      // The demo goes on without it (the terminal test runs next).
      await fetch(`${quotas}/ttlab-vms`, { method: 'DELETE' });
    }
    // Readiness histograms per lesson and stage, from the sessions above.
    const hist = admin.locator('.hist[data-lesson="systemd-basics"][data-stage="total"]');
    await hist.waitFor({ timeout: 10000 });
    assert.match(await hist.innerText(), /2 sessions · p50 [\d.]+ s/);
    assert.ok(await admin.locator('.hist[data-lesson="systemd-basics"][data-stage="vm_created"]').count() === 1);
    await admin.locator('#readiness').scrollIntoViewIfNeeded();
    await shot(admin, 'admin-collect', true);
    await admin.close();
  });

  await step('admin: adds a class through the page and sees it listed; a bad one shows why', async () => {
    const admin = await context.newPage();
    await admin.goto(adminUrl);
    await admin.locator('#class-lesson option').first().waitFor({ state: 'attached', timeout: 15000 });
    // A time for the form's datetime-local field, in the browser's own time zone.
    const local = (offsetMs) => admin.evaluate((ms) => {
      const d = new Date(Date.now() + ms);
      const p = (n) => String(n).padStart(2, '0');
      return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())}T${p(d.getHours())}:${p(d.getMinutes())}`;
    }, offsetMs);
    const day = 24 * 3600 * 1000;
    const submit = () => admin.locator('#class-form button[type=submit]').click();
    // A start in the past, then no seats: the server's refusal beside the form, nothing listed.
    await admin.locator('#class-title').fill('Intro tomorrow');
    await admin.locator('#class-lesson').selectOption('systemd-basics');
    await admin.locator('#class-seats').fill('12');
    await admin.locator('#class-start').fill(await local(-day));
    await submit();
    await admin.locator('#class-error', { hasText: 'is in the past' }).waitFor({ timeout: 10000 });
    await admin.locator('#class-start').fill(await local(day));
    await admin.locator('#class-seats').fill('0');
    await submit();
    await admin.locator('#class-error', { hasText: 'a class needs at least 1 seat, got 0' }).waitFor({ timeout: 10000 });
    await shot(admin, 'admin-class-refused', true);
    assert.equal(await admin.locator('#classes tbody tr[data-class]').count(), 0, 'nothing was scheduled');
    // A good one is listed with its seats, code and what the capacity allows.
    await admin.locator('#class-seats').fill('12');
    await admin.locator('#class-code').fill('demo-1');
    await submit();
    const row = admin.locator('#classes tbody tr[data-class]', { hasText: 'Intro tomorrow' });
    await row.waitFor({ timeout: 10000 });
    assert.ok(await admin.locator('#class-error').isHidden(), 'no error left beside the form');
    assert.match(await row.innerText(), /code DEMO-1/);
    assert.equal((await row.locator('[data-field="seats"]').innerText()).trim(), '12');
    assert.match(await row.locator('[data-field="seats-warm"]').innerText(), /^\d+ of 12/);
    await shot(admin, 'admin-classes', true);
    // Cancelled, it leaves the list.
    admin.once('dialog', (d) => d.accept());
    await row.locator('button[data-class-cancel]').click();
    await admin.locator('#classes tbody td', { hasText: 'No class is scheduled.' }).waitFor({ timeout: 10000 });
    await admin.close();
  });

  await step('a wrong class code is refused with a clear message, and nothing starts', async () => {
    await page.getByRole('button', { name: 'Back to the labs' }).click();
    await page.locator('#class-code').fill('nope-1');
    await page.locator('button[data-lesson="systemd-basics"]').click();
    await page.locator('#notice', { hasText: 'no class with this code is open now' }).waitFor({ timeout: 10000 });
    assert.ok(await page.locator('#view-lessons').isVisible(), 'still choosing a lab');
    await shot(page, 'class-code-refused');
    await page.locator('#class-code').fill('');
  });

  await step('the pages logged no errors', async () => {
    // A refused WebSocket or a closed stream is logged by Chromium as a network error; the
    // pages themselves must not throw.
    const thrown = consoleErrors.filter((e) => !/WebSocket|net::|Failed to load resource/.test(e));
    assert.deepEqual(thrown, []);
  });
} catch (e) {
  failed = true;
} finally {
  await browser.close();
}
console.log(`\n${results.join('\n')}\nscreenshots: ${shots} in ${artifacts}`);
process.exit(failed ? 1 : 0);
