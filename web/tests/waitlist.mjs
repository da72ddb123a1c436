// The waitlist in headless Chromium against a demo whose VM limit is 1: a second student who
// clicks Start lab while the only place is taken is put in line and sees position 1; the
// first student ends their lab; the place is held for the second, whose page (and tab title)
// says so; they take it and their lab starts. A student who waits the longest wait
// (TTLAB_WAITLIST_MAX_WAIT, a minute in the demo) without a place freeing is taken off the list,
// told why, and back in line with one click on "Join again".
// Started by web/tests/run.sh, which passes TTLAB_STUDENT_URL and TTLAB_SECOND_URL (login
// links of two students), TTLAB_WAITLIST_MAX_WAIT (the demo's), TTLAB_ARTIFACTS (screenshot
// directory) and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import path from 'node:path';
import { durationSeconds, launch, required } from './lib.mjs';

const firstUrl = process.env.TTLAB_STUDENT_URL;
const secondUrl = process.env.TTLAB_SECOND_URL;
const artifacts = process.env.TTLAB_ARTIFACTS || 'artifacts/browser';
assert.ok(firstUrl && secondUrl, 'TTLAB_STUDENT_URL and TTLAB_SECOND_URL are required');
const maxWait = durationSeconds(required('TTLAB_WAITLIST_MAX_WAIT'));

let shots = 0;
async function shot(page, name) {
  shots += 1;
  const file = path.join(artifacts, `w${String(shots).padStart(2, '0')}-${name}.png`);
  await page.screenshot({ path: file });
  return file;
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

const LESSON = 'button[data-lesson="systemd-basics"]';

const browser = await launch();
let failed = false;
try {
  // Two students, each in a browser context of their own.
  const first = await (await browser.newContext({ viewport: { width: 1280, height: 800 } })).newPage();
  const second = await (await browser.newContext({ viewport: { width: 1280, height: 800 } })).newPage();
  const errors = [];
  for (const p of [first, second]) {
    p.on('pageerror', (e) => errors.push(String(e)));
    p.on('console', (m) => { if (m.type() === 'error') errors.push(m.text()); });
  }

  await step('the first student takes the only place', async () => {
    await first.goto(firstUrl);
    await first.locator(LESSON).click();
    await first.locator('#view-lab').waitFor({ state: 'visible', timeout: 90000 });
  });

  await step('the second student clicks Start lab and is put in line, first', async () => {
    await second.goto(secondUrl);
    await second.locator(LESSON).click();
    await second.locator('#view-waiting').waitFor({ state: 'visible', timeout: 15000 });
    assert.equal(await second.locator('#waiting-position').innerText(), '1st');
    assert.ok(await second.locator('#waiting-held').isHidden(), 'no place held yet');
    assert.ok(await second.locator('#leave-waitlist').isVisible(), 'a way to leave the line');
    await shot(second, 'waiting');
  });

  await step('a reload keeps the place in line', async () => {
    await second.reload();
    await second.locator('#view-waiting').waitFor({ state: 'visible', timeout: 15000 });
    assert.equal(await second.locator('#waiting-position').innerText(), '1st');
  });

  await step('the first student ends their lab; the place is held for the second, with a notice', async () => {
    first.once('dialog', (d) => d.accept());
    await first.locator('#finish').click();
    await first.locator('#view-ended').waitFor({ state: 'visible', timeout: 15000 });
    // Live: no reload on the second page.
    await second.locator('#waiting-held').waitFor({ state: 'visible', timeout: 30000 });
    const left = await second.locator('#held-left').innerText();
    const [m, s] = left.split(':').map(Number);
    assert.ok(m * 60 + s > 60 && m * 60 + s <= 120, `held for about 2 minutes: ${left}`);
    assert.match(await second.title(), /A place is free/);
    assert.match(await second.locator('#notice').innerText(), /place is free for you/);
    await shot(second, 'place-held');
  });

  await step('the second student takes the held place and their lab starts', async () => {
    await second.locator('#take-place').click();
    await second.locator('#view-lab').waitFor({ state: 'visible', timeout: 90000 });
    assert.doesNotMatch(await second.title(), /A place is free/);
    await shot(second, 'lab-started');
  });

  await step('the first student, back at the labs, is the one in line now', async () => {
    await first.getByRole('button', { name: 'Back to the labs' }).click();
    await first.locator(LESSON).click();
    await first.locator('#view-waiting').waitFor({ state: 'visible', timeout: 15000 });
    assert.equal(await first.locator('#waiting-position').innerText(), '1st');
    await first.locator('#leave-waitlist').click();
    await first.locator('#view-lessons').waitFor({ state: 'visible', timeout: 15000 });
    assert.match(await first.locator('#notice').innerText(), /left the waitlist/);
    await shot(first, 'left-waitlist');
  });

  await step('the second student finishes', async () => {
    second.once('dialog', (d) => d.accept());
    await second.locator('#finish').click();
    await second.locator('#view-ended').waitFor({ state: 'visible', timeout: 15000 });
  });

  await step('a student who waited the longest wait is told why and joins again in one click', async () => {
    // The first student takes the only place again (held for them if the second's lab was
    // still being deleted).
    await first.locator(LESSON).click();
    await first.locator('#view-lab, #view-waiting').first().waitFor({ state: 'visible', timeout: 90000 });
    if (await first.locator('#view-waiting').isVisible()) {
      await first.locator('#take-place').click({ timeout: 60000 });
    }
    await first.locator('#view-lab').waitFor({ state: 'visible', timeout: 90000 });
    await second.getByRole('button', { name: 'Back to the labs' }).click();
    await second.locator(LESSON).click();
    await second.locator('#view-waiting').waitFor({ state: 'visible', timeout: 15000 });
    assert.equal(await second.locator('#waiting-position').innerText(), '1st');
    const joined = Date.now();
    // Nobody frees a place: after the longest wait the page says why, over the lessons.
    const dropped = second.locator('#waitlist-dropped');
    await dropped.waitFor({ state: 'visible', timeout: (maxWait + 30) * 1000 });
    assert.ok(Date.now() - joined >= (maxWait - 2) * 1000, `told after ${Date.now() - joined} ms`);
    assert.ok(await second.locator('#view-lessons').isVisible(), 'the lessons are shown');
    const why = await dropped.innerText();
    assert.match(why, /You waited (an hour|a minute|\d+ (hours|minutes|seconds)) for .+ without a place freeing up; you were taken off the list\./);
    await shot(second, 'dropped');
    // One click: back in line, at the end (first: nobody else waits).
    await second.getByRole('button', { name: 'Join again' }).click();
    await second.locator('#view-waiting').waitFor({ state: 'visible', timeout: 15000 });
    assert.equal(await second.locator('#waiting-position').innerText(), '1st');
    assert.ok(await dropped.isHidden(), 'the reason is gone once back in line');
    await second.locator('#leave-waitlist').click();
    await second.locator('#view-lessons').waitFor({ state: 'visible', timeout: 15000 });
    first.once('dialog', (d) => d.accept());
    await first.locator('#finish').click();
    await first.locator('#view-ended').waitFor({ state: 'visible', timeout: 15000 });
  });

  await step('the pages logged no errors', async () => {
    const thrown = errors.filter((e) => !/WebSocket|net::|Failed to load resource/.test(e));
    assert.deepEqual(thrown, []);
  });
} catch (e) {
  failed = true;
} finally {
  await browser.close();
}
console.log(`\n${results.join('\n')}\nscreenshots: ${shots} in ${artifacts}`);
process.exit(failed ? 1 : 0);
