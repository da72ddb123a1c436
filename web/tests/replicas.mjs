// A crashed server replica's consoles, in headless Chromium against a running demo stack and
// a second `ttlab-server` process this test starts beside it (same database, same cluster,
// same secret): a student's console is relayed by the second replica; that process is killed
// with SIGKILL (it records nothing on the way out); the admin page, served by the demo's own
// server, shows the console open on the second replica and then closed, "server replica
// gone", once the surviving replica notices that the dead one no longer marks it (30 s
// unmarked, looked at every 10 s).
// Started by web/tests/run.sh after student.mjs, with TTLAB_STUDENT_URL and TTLAB_ADMIN_URL
// (the demo's login links), TTLAB_DATABASE_URL, TTLAB_KUBECONFIG, TTLAB_AUTH_SECRET (the
// demo's), TTLAB_ROOT (the checkout: its target/debug binaries, lessons and web pages),
// TTLAB_ARTIFACTS and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import net from 'node:net';
import path from 'node:path';
import { launch, required, screenshots, stepper, waitForScreen } from './lib.mjs';

const studentUrl = new URL(required('TTLAB_STUDENT_URL'));
const adminUrl = required('TTLAB_ADMIN_URL');
const root = required('TTLAB_ROOT');
const LESSON = 'systemd-basics';
const shot = screenshots('replicas');
const { step, results } = stepper();

/** A free loopback port. */
function freePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

/** Starts a second `ttlab-server` beside the demo's; resolves once it answers /readyz. */
async function startReplica(port) {
  const env = {
    ...process.env,
    DATABASE_URL: required('TTLAB_DATABASE_URL'),
    KUBECONFIG: required('TTLAB_KUBECONFIG'),
    TTLAB_ENV: process.env.TTLAB_ENV || 'demo',
    TTLAB_NAMESPACE: process.env.TTLAB_SIM_NAMESPACE || 'ttlab-vms',
    TTLAB_LISTEN: `127.0.0.1:${port}`,
    TTLAB_AUTH_SECRET: required('TTLAB_AUTH_SECRET'),
    TTLAB_LESSONS: path.join(root, 'lessons'),
    TTLAB_AGENT_BINARY: path.join(root, 'target/debug/ttlab-agent'),
    TTLAB_WEB_DIR: path.join(root, 'web'),
    RUST_LOG: 'warn',
    NO_COLOR: '1',
  };
  const child = spawn(path.join(root, 'target/debug/ttlab-server'), [], { env, stdio: ['ignore', 'ignore', 'pipe'] });
  let log = '';
  child.stderr.on('data', (d) => { log = (log + d).slice(-4000); });
  const until = Date.now() + 60000;
  while (Date.now() < until) {
    if (child.exitCode !== null) throw new Error(`the second replica exited (${child.exitCode}):\n${log}`);
    try {
      const r = await fetch(`http://127.0.0.1:${port}/readyz`);
      if (r.ok) return child;
    } catch {
      // Not listening yet.
    }
    await new Promise((resolve) => setTimeout(resolve, 200));
  }
  child.kill('SIGKILL');
  throw new Error(`the second replica was not ready within 60 s:\n${log}`);
}

const browser = await launch();
let failed = false;
let replica = null;
try {
  const port = await freePort();
  replica = await startReplica(port);
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const admin = await context.newPage();
  const errors = [];
  for (const p of [page, admin]) p.on('pageerror', (e) => errors.push(String(e)));
  page.on('dialog', (d) => d.accept());
  // The student's page comes from the second replica (the same login link, its address).
  const viaReplica = new URL(studentUrl);
  viaReplica.host = `127.0.0.1:${port}`;
  let sessionId = '';

  await step('a student\'s console is relayed by the second replica', async () => {
    await page.goto(viaReplica.href);
    const lessons = page.locator('#view-lessons');
    const lab = page.locator('#view-lab');
    await lessons.or(lab).first().waitFor({ state: 'visible', timeout: 30000 });
    if (!(await lab.isVisible())) {
      await page.locator(`button[data-lesson="${LESSON}"]`).click();
      await lab.waitFor({ state: 'visible', timeout: 120000 });
    }
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await waitForScreen(page, (t) => /root@[\w.-]+:~# /.test(t), 'a root prompt');
    sessionId = await page.evaluate(async () => {
      const token = sessionStorage.getItem('ttlab.token');
      const r = await fetch('/api/sessions/current', { headers: { authorization: `Bearer ${token}` } });
      return (await r.json()).id;
    });
  });

  /** The console line of the admin page's detail of the student's session, read afresh. */
  const consoleLine = async () => {
    await admin.locator(`#sessions button[data-session="${sessionId}"]`).click();
    const line = admin.locator('#detail-facts li.console-owner').first();
    await line.waitFor({ timeout: 10000 });
    return line.innerText();
  };

  let openLine = '';
  await step('the admin page, from the demo\'s own server, shows it open on that replica', async () => {
    await admin.goto(adminUrl);
    await admin.locator(`#sessions button[data-session="${sessionId}"]`).waitFor({ timeout: 30000 });
    openLine = await consoleLine();
    assert.match(openLine, /^Console of vm: open since .+ on replica .+/);
    await shot(admin, 'open');
  });

  await step('the second replica is killed; the survivor closes its console: "server replica gone"', async () => {
    const killed = Date.now();
    replica.kill('SIGKILL');
    await new Promise((resolve) => replica.once('exit', resolve));
    replica = null;
    let line = openLine;
    while (!/closed at/.test(line)) {
      assert.ok(Date.now() - killed < 70000, `still "${line}" 70 s after its replica was killed`);
      await admin.waitForTimeout(1000);
      line = await consoleLine();
    }
    await shot(admin, 'replica-gone');
    assert.match(line, /^Console of vm: closed at .+ \(server replica gone\), opened by .+ on replica .+/);
    const replicaName = openLine.match(/on replica (.+)$/)[1];
    assert.ok(line.endsWith(`on replica ${replicaName}`), `${line} names ${replicaName}`);
    assert.ok(Date.now() - killed >= 15000, `closed ${Date.now() - killed} ms after the kill: too soon to know`);
  });

  await step('the student, back through the demo\'s server, finishes the lab', async () => {
    await page.goto(studentUrl.href);
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 30000 });
    await page.locator('#conn.ok').waitFor({ timeout: 30000 });
    await page.locator('#finish').click();
    await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 30000 });
  });

  await step('the pages logged no errors', async () => {
    assert.deepEqual(errors, []);
  });
  await context.close();
} catch (e) {
  if (!results.length || !results[results.length - 1].startsWith('FAIL')) console.log(`FAIL ${e.stack}`);
  failed = true;
} finally {
  if (replica) replica.kill('SIGKILL');
  await browser.close();
}
console.log(`\nreplica tests:\n${results.join('\n')}`);
process.exit(failed ? 1 : 0);
