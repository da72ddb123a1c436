// `ttlabctl demo --guest qemu --no-reaper` in headless Chromium: a real Debian 12 guest booted
// by qemu behind kube-sim's KubeVirt. "Start lab" for systemd-basics shows the progress until
// the guest's own readiness marker; the terminal gives root's shell, where `systemctl status`
// answers and the guest's power-off timer is armed at start + max + grace; "Check my work"
// fails before the task and passes once it is done by typing in the terminal; the session's
// expiry ends the lab on the page; and, with no reaper to delete it, the guest powers itself
// off at its hard deadline: the VMI ends Succeeded (the VM is not deleted) and the admin page
// shows the VM stopped. Screenshots: qemu-*.png.
//
// Started by web/tests/run.sh, beside the other browser tests, with TTLAB_STUDENT_URL,
// TTLAB_ADMIN_URL (login links), TTLAB_SIM_URL (the demo's kube-sim), TTLAB_SIM_NAMESPACE,
// TTLAB_SESSION_MAX and TTLAB_HARD_DEADLINE_GRACE (the demo's policy), TTLAB_QEMU_READY_TIMEOUT
// (seconds from "Start lab" to the lab, default 300), TTLAB_ARTIFACTS and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import {
  durationSeconds, launch, required, screenText, screenshots, stepper, waitForScreen,
} from './lib.mjs';

const studentUrl = required('TTLAB_STUDENT_URL');
const adminUrl = required('TTLAB_ADMIN_URL');
const simUrl = required('TTLAB_SIM_URL');
const namespace = process.env.TTLAB_SIM_NAMESPACE || 'ttlab-vms';
const maxSeconds = durationSeconds(required('TTLAB_SESSION_MAX'));
const graceSeconds = durationSeconds(required('TTLAB_HARD_DEADLINE_GRACE'));
const readyTimeout = Number(process.env.TTLAB_QEMU_READY_TIMEOUT || 300) * 1000;
const LESSON = 'systemd-basics';
const PROMPT = /root@[\w.-]+:[^\n#]*# /g;

const shot = screenshots('qemu');
const { step, results } = stepper();
const timings = {};
const began = Date.now();

/** Seconds from `from` to `to` (ISO instants or epoch milliseconds), one decimal. */
function secs(from, to) {
  const ms = (typeof to === 'number' ? to : Date.parse(to)) - (typeof from === 'number' ? from : Date.parse(from));
  return Math.round(ms / 100) / 10;
}

/** The student's session as the API gives it (the page's own token). */
async function currentSession(page) {
  return page.evaluate(async () => {
    const token = sessionStorage.getItem('ttlab.token');
    const r = await fetch('/api/sessions/current', { headers: { authorization: `Bearer ${token}` } });
    return r.json();
  });
}

/** The VMI of `vm` in kube-sim (null when there is none). */
async function vmi(vm) {
  const r = await fetch(`${simUrl}/apis/kubevirt.io/v1/namespaces/${namespace}/virtualmachineinstances/${vm}`);
  if (r.status === 404) return null;
  if (!r.ok) assert.fail(`GET VMI ${vm}: ${r.status} ${await r.text()}`);
  return r.json();
}

/** The VirtualMachine `vm` in kube-sim (null when there is none). */
async function virtualMachine(vm) {
  const r = await fetch(`${simUrl}/apis/kubevirt.io/v1/namespaces/${namespace}/virtualmachines/${vm}`);
  if (r.status === 404) return null;
  if (!r.ok) assert.fail(`GET VM ${vm}: ${r.status} ${await r.text()}`);
  return r.json();
}

/**
 * Follows the VMIs of the namespace (a watch, watched again whenever it ends): `events` gets
 * `{ at, type, name, phase }` as they come, `at` in this machine's milliseconds.
 */
function watchVmis() {
  const events = [];
  const controller = new AbortController();
  const follow = async () => {
    while (!controller.signal.aborted) {
      try {
        const r = await fetch(`${simUrl}/apis/kubevirt.io/v1/namespaces/${namespace}/virtualmachineinstances?watch=true&timeoutSeconds=300`,
          { signal: controller.signal });
        const decoder = new TextDecoder();
        let buffer = '';
        for await (const chunk of r.body) {
          buffer += decoder.decode(chunk, { stream: true });
          let newline;
          while ((newline = buffer.indexOf('\n')) >= 0) {
            const line = buffer.slice(0, newline).trim();
            buffer = buffer.slice(newline + 1);
            if (!line) continue;
            const event = JSON.parse(line);
            const o = event.object || {};
            events.push({
              at: Date.now(), type: event.type, name: o.metadata && o.metadata.name, phase: o.status && o.status.phase,
            });
          }
        }
      } catch (e) {
        if (controller.signal.aborted) return;
        events.push({ at: Date.now(), type: 'WATCH_ERROR', name: String(e), phase: null });
        await new Promise((r) => setTimeout(r, 500));
      }
    }
  };
  const done = follow();
  return { events, stop: async () => { controller.abort(); await done; } };
}

const count = (text, re) => (text.match(re) || []).length;

let commands = 0;
/**
 * Types `line` and Enter in the terminal and waits until it has run: the line ends with an
 * `echo` of a number the shell works out, so only its output, never its echo, matches.
 */
async function typeLine(page, line, timeout = 60000) {
  commands += 1;
  const n = 100 + commands;
  await page.locator('#terminal').click();
  await page.keyboard.type(`${line}; echo ran-$((${n}))`);
  await page.keyboard.press('Enter');
  const ran = new RegExp(`^ran-${n}$`, 'm');
  return waitForScreen(page, (t) => ran.test(t), `the end of \`${line.slice(0, 60)}\``, timeout);
}

/** "Check my work": the summary's passed and total, after a screenshot named `name`. */
async function checkMyWork(page, name) {
  const started = Date.now();
  await page.locator('#grade').click();
  const dialog = page.locator('#grade-dialog');
  await dialog.waitFor({ state: 'visible', timeout: 120000 });
  const summary = await page.locator('#grade-summary').innerText();
  const m = summary.match(/^(\d+) of (\d+) checks passed/);
  assert.ok(m, `grading summary: ${summary}`);
  const failed = await dialog.locator('.step.fail strong').allInnerTexts();
  await shot(page, name);
  await dialog.getByRole('button', { name: 'Close' }).click();
  await dialog.waitFor({ state: 'hidden', timeout: 5000 });
  return { passed: Number(m[1]), total: Number(m[2]), failed, seconds: secs(started, Date.now()) };
}

// The task of systemd-basics (lessons/systemd-basics.yaml), typed line by line.
const THE_TASK = [
  "printf '[Unit]\\nDescription=Greeter\\n[Service]\\nUser=greeter\\nExecStart=/opt/lab/bin/greeter\\nRestart=on-failure\\n[Install]\\nWantedBy=multi-user.target\\n' > /etc/systemd/system/greeter.service",
  "sed -i 's#/usr/local/sbin/tar#/usr/bin/tar#' /etc/systemd/system/backup.service",
  "printf '[Unit]\\nDescription=Nightly backup\\n[Timer]\\nOnCalendar=*-*-* 02:00:00\\n[Install]\\nWantedBy=timers.target\\n' > /etc/systemd/system/backup.timer",
  'systemctl daemon-reload && systemctl enable --now greeter.service && systemctl enable backup.timer && echo task-$((40+2))-done',
];

const browser = await launch();
let failed = false;
let watcher = null;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  let session = null;
  let vm = '';

  await step('the login link signs in', async () => {
    await page.goto(studentUrl);
    await page.getByRole('heading', { name: 'Choose a lab' }).waitFor({ timeout: 30000 });
  });

  await step('Start lab shows the progress until the real guest is ready', async () => {
    const clicked = Date.now();
    await page.locator(`button[data-lesson="${LESSON}"]`).click();
    await page.locator('#view-starting').waitFor({ state: 'visible', timeout: 30000 });
    const seen = new Set();
    let booting = false;
    while (Date.now() - clicked < readyTimeout) {
      if (await page.locator('#view-lab').isVisible()) break;
      const stage = await page.locator('#progress-bar').getAttribute('data-stage').catch(() => null);
      if (stage) seen.add(stage);
      // The long wait of a real guest: the VM runs, its agent does not answer yet.
      if (!booting && stage === 'vmi_running') {
        booting = true;
        await page.waitForTimeout(5000);
        await shot(page, 'progress-booting');
      }
      await page.waitForTimeout(500);
    }
    assert.ok(await page.locator('#view-lab').isVisible(),
      `the lab was not ready ${readyTimeout / 1000} s after Start lab; stages seen: ${[...seen]}`);
    timings.ready = secs(clicked, Date.now());
    assert.ok(seen.has('vmi_running'), `the progress showed the VM running: ${[...seen]}`);
    session = await currentSession(page);
    assert.equal(session.status, 'running');
    assert.equal(session.stage, 'ready');
    vm = session.nodes[0].vm;
    const s = session.stages;
    timings.stages = `VM created → VMI running ${secs(s.vm_created, s.vmi_running)} s, → agent up ${secs(s.vm_created, s.agent_up)} s (boot), → ready ${secs(s.vm_created, s.ready)} s (setup ${secs(s.agent_up, s.ready)} s)`;
  });

  await step('the terminal gives root\'s shell on the guest\'s serial console', async () => {
    const opened = Date.now();
    await page.locator('#conn.ok').waitFor({ timeout: 60000 });
    let text;
    try {
      // The console replays what the guest printed: its boot and the autologin prompt.
      text = await waitForScreen(page, (t) => count(t, PROMPT) > 0, 'a root prompt', 20000);
    } catch {
      await page.locator('#terminal').click();
      await page.keyboard.press('Enter');
      text = await waitForScreen(page, (t) => count(t, PROMPT) > 0, 'a root prompt after Enter', 60000);
    }
    timings.shell = secs(opened, Date.now());
    assert.match(text, /Debian GNU\/Linux 12 vm ttyS0/, 'the guest\'s getty on its serial port');
    // Root, on a real kernel, not the simulated shell.
    const answer = await typeLine(page, 'echo "$(whoami) on $(uname -s) $(uname -r)"');
    assert.match(answer, /^root on Linux 6\.\d+\S*$/m);
    await shot(page, 'shell');
  });

  await step('systemctl status shows the running system', async () => {
    let state = '';
    // Right after the lab is ready cloud-init may still be finishing: systemd says "starting".
    for (let attempt = 0; attempt < 6 && ['', 'initializing', 'starting'].includes(state); attempt++) {
      if (attempt) await page.waitForTimeout(5000);
      const before = count(await screenText(page), /^\s*State: \w+/gm);
      const text = await typeLine(page, 'systemctl status --no-pager | head -n 12');
      assert.doesNotMatch(text, /systemctl: command not found/);
      const states = [...text.matchAll(/^\s*State: (\w+)/gm)].map((m) => m[1]);
      assert.ok(states.length > before, `systemctl status printed no State line:\n${text.slice(-1500)}`);
      state = states[states.length - 1];
      assert.match(text, /CGroup: \//);
    }
    await shot(page, 'systemctl-status');
    let failed = '';
    if (state !== 'running') {
      // A unit of the image failed: name it in the failure and keep a screenshot of it.
      const text = await typeLine(page, 'systemctl --failed --plain --no-legend --no-pager');
      const lines = text.slice(text.lastIndexOf('systemctl --failed')).split('\n').slice(1);
      failed = lines.slice(0, lines.findIndex((l) => /^ran-\d+$/.test(l))).join('; ');
      await shot(page, 'systemctl-failed');
    }
    timings.systemState = state;
    // The image boots with every unit up (cloud-config.service used to fail on its locale).
    assert.equal(state, 'running', `systemd's state is ${state}; failed units: ${failed}`);
  });

  await step('the guest\'s power-off timer is armed at start + max + grace', async () => {
    const want = new Date(Date.parse(session.started_at) + (maxSeconds + graceSeconds) * 1000);
    assert.equal(Date.parse(session.max_expires_at), Date.parse(session.started_at) + maxSeconds * 1000);
    const at = want.toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
    const text = await typeLine(page, 'grep -m1 ^OnCalendar= /etc/systemd/system/ttlab-poweroff.timer');
    const found = [...text.matchAll(/^OnCalendar=(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC)$/gm)].map((m) => m[1]);
    assert.deepEqual(found, [at], `the timer's deadline (the grace is ${graceSeconds} s)`);
    timings.hardDeadline = want.getTime() - (want.getTime() % 1000);
  });

  await step('Check my work fails before the task', async () => {
    const g = await checkMyWork(page, 'grade-before');
    assert.equal(g.total, 6);
    assert.equal(g.passed, 0, `failed: ${g.failed}`);
    timings.gradeBefore = g.seconds;
  });

  await step('the task done by typing in the terminal', async () => {
    const started = Date.now();
    for (const line of THE_TASK) await typeLine(page, line, 120000);
    await waitForScreen(page, (t) => /^task-42-done$/m.test(t), 'task-42-done', 60000);
    timings.task = secs(started, Date.now());
    await shot(page, 'task-done');
  });

  await step('Check my work passes after the task', async () => {
    const g = await checkMyWork(page, 'grade-after');
    assert.deepEqual({ passed: g.passed, total: g.total, failed: g.failed }, { passed: 6, total: 6, failed: [] });
    timings.gradeAfter = g.seconds;
  });

  await step('the expiry ends the lab on the page, and the guest still runs', async () => {
    const left = Date.parse(session.expires_at) - Date.now();
    assert.ok(left > 0, `the session expired ${-left / 1000} s before the task was graded`);
    watcher = watchVmis();
    await page.locator('#lab-banner', { hasText: 'Time is up. The lab is being closed.' })
      .waitFor({ timeout: left + 30000 });
    await page.locator('#conn', { hasText: 'Your lab session has expired.' }).waitFor({ timeout: 30000 });
    assert.ok(await page.locator('#grade').isDisabled(), 'Check my work is disabled once the time is up');
    await shot(page, 'expired');
    // No reaper: nothing deletes the VM; it runs until its own deadline.
    const instance = await vmi(vm);
    assert.equal(instance && instance.status.phase, 'Running', 'the guest runs past the expiry');
  });

  await step('the guest powers itself off at its hard deadline', async () => {
    const deadline = timings.hardDeadline;
    const ofVm = () => watcher.events.filter((e) => e.name === vm);
    const until = deadline + 150000;
    let end = null;
    while (!end && Date.now() < until) {
      end = ofVm().find((e) => e.type === 'DELETED' || (e.phase && e.phase !== 'Running'));
      if (!end) await new Promise((r) => setTimeout(r, 250));
    }
    await watcher.stop();
    const seen = ofVm().map((e) => `${e.type} ${e.phase} at ${secs(deadline, e.at)} s`).join('; ');
    assert.ok(end, `the guest was still running 150 s after its hard deadline (${seen})`);
    // Its own power-off: the VMI ends Succeeded (a deletion would end it otherwise), and not
    // before the deadline (a second of slack for the deadline's rounding and the watch).
    assert.equal(end.phase, 'Succeeded', `the VMI's end: ${seen}`);
    assert.ok(end.at >= deadline - 1000, `the guest went off ${secs(end.at, deadline)} s before its hard deadline`);
    timings.powerOff = secs(deadline, end.at);
    // The VM is not deleted; it is stopped and stays off.
    const machine = await virtualMachine(vm);
    assert.ok(machine && !machine.metadata.deletionTimestamp, 'the VM is still there, not being deleted');
    // The ended VMI is removed (the run strategy keeps the VM off): Stopping, then Stopped.
    let status = '';
    for (let i = 0; i < 120 && status !== 'Stopped'; i++) {
      if (i) await page.waitForTimeout(500);
      status = (await virtualMachine(vm)).status.printableStatus;
    }
    assert.equal(status, 'Stopped', 'the VM is stopped within 60 s of the power-off');
    await page.waitForTimeout(3000);
    const again = await vmi(vm);
    assert.ok(!again || again.status.phase === 'Succeeded', `no new guest was started: ${again && again.status.phase}`);
  });

  await step('the admin page shows the VM stopped, the student page the lab ended', async () => {
    const admin = await context.newPage();
    admin.on('pageerror', (e) => errors.push(String(e)));
    await admin.goto(adminUrl);
    const open = admin.locator('#sessions button[data-session]').first();
    await open.waitFor({ timeout: 30000 });
    await open.click();
    await admin.locator('#detail').waitFor({ state: 'visible', timeout: 15000 });
    await admin.locator('#detail-objects tbody tr', { hasText: 'VirtualMachine' })
      .filter({ hasText: 'Stopped' }).waitFor({ timeout: 30000 });
    await admin.locator('#detail-objects').scrollIntoViewIfNeeded();
    await shot(admin, 'admin-powered-off', true);
    await admin.close();
    await page.bringToFront();
    assert.ok(await page.locator('#lab-banner', { hasText: 'Time is up' }).isVisible());
    await shot(page, 'ended');
  });

  await step('the pages logged no errors', async () => {
    assert.deepEqual(errors, []);
  });
  await context.close();
} catch {
  failed = true;
  if (watcher) await watcher.stop();
} finally {
  await browser.close();
}
const t = timings;
console.log(`\nqemu demo tests:\n${results.join('\n')}`);
console.log(`qemu timings: Start lab → lab shown ${t.ready ?? '-'} s (${t.stages ?? '-'}); systemd ${t.systemState ?? '-'}; prompt ${t.shell ?? '-'} s after the console opened; ` +
  `grading ${t.gradeBefore ?? '-'} s before the task, ${t.gradeAfter ?? '-'} s after; task typed in ${t.task ?? '-'} s; ` +
  `guest off ${t.powerOff ?? '-'} s after its hard deadline (max ${maxSeconds} s + grace ${graceSeconds} s); whole test ${secs(began, Date.now())} s`);
process.exit(failed ? 1 : 0);
