// A lesson's instructions in the student's page, in headless Chromium: the showcase lesson
// (web/tests/lessons/instructions-showcase.yaml) holds a table, nested lists, code, links and
// an image beside every way its author might try to run script — a <script> block,
// <img onerror>, <iframe>, <svg onload>, inline handlers, javascript:, vbscript: and data:
// links, disguised ones. Its lab is started; the panel must show the table and the lists as
// elements, and nothing may run: no dialog, no `window.__pwned`, no element with an on…
// attribute, no script, frame or SVG in the panel, links only to http:, https: and mailto:,
// images only from https:, and an image no wider than the panel.
// Started by web/tests/run.sh against a demo serving web/tests/lessons/, with
// TTLAB_STUDENT_URL, TTLAB_ARTIFACTS and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import { launch, required, screenshots, stepper } from './lib.mjs';

const studentUrl = required('TTLAB_STUDENT_URL');
const LESSON = 'instructions-showcase';
const shot = screenshots('instructions');
const { step, results } = stepper();

const browser = await launch();
let failed = false;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  const dialogs = [];
  const errors = [];
  page.on('dialog', (d) => {
    dialogs.push(`${d.type()}: ${d.message()}`);
    // "Finish lab" asks for confirmation; anything else is a script the lesson ran.
    d.type() === 'confirm' ? d.accept() : d.dismiss();
  });
  page.on('pageerror', (e) => errors.push(String(e)));

  await step('the showcase lab starts', async () => {
    await page.goto(studentUrl);
    await page.locator(`button[data-lesson="${LESSON}"]`).click({ timeout: 30000 });
    await page.locator('#view-lab').waitFor({ state: 'visible', timeout: 120000 });
    await page.locator('#instructions-body h2').first().waitFor({ timeout: 10000 });
  });

  const panel = page.locator('#instructions-body');

  await step('the table renders as a table', async () => {
    const table = await panel.locator('table').evaluateAll((tables) => tables.map((t) => ({
      head: [...t.querySelectorAll('thead th')].map((th) => th.textContent.trim()),
      rows: [...t.querySelectorAll('tbody tr')].map((tr) => [...tr.querySelectorAll('td')].map((td) => td.textContent.trim())),
    })));
    assert.deepEqual(table, [{
      head: ['service', 'port', 'protocol'],
      rows: [['ssh', '22', 'TCP'], ['web', '8080', 'TCP']],
    }]);
    const border = await panel.locator('td').first().evaluate((td) => getComputedStyle(td).borderTopStyle);
    assert.equal(border, 'solid', 'table cells are drawn');
  });

  await step('nested lists render nested', async () => {
    const nested = await panel.evaluate((body) => ({
      ulInOl: body.querySelectorAll('ol > li > ul > li').length,
      olInUlInOl: [...body.querySelectorAll('ol > li > ul > li > ol > li')].map((li) => li.textContent.trim()),
      tasks: [...body.querySelectorAll('ul > li')].map((li) => li.textContent.trim()).filter((t) => /^[☐☑]/.test(t)),
    }));
    assert.equal(nested.ulInOl, 2, 'a bulleted list inside a numbered item');
    assert.deepEqual(nested.olInUlInOl, ['apt-get install -y nginx', 'systemctl enable --now nginx']);
    assert.deepEqual(nested.tasks, ['☑ read the task', '☐ press Check my work']);
    assert.equal(await panel.locator('pre code').count(), 1);
    assert.equal(await panel.locator('blockquote del').innerText(), 'a mistake');
  });

  await step('the lesson\'s HTML is shown as text and nothing of it runs', async () => {
    // Give anything that would run (an image's onerror fires once its load fails) the time to.
    await page.waitForTimeout(1500);
    assert.deepEqual(dialogs, [], 'no dialog opened');
    assert.equal(await page.evaluate(() => window.__pwned), undefined, 'no script of the lesson ran');
    const found = await page.evaluate(() => {
      const all = [...document.querySelectorAll('*')];
      return {
        handlers: all.flatMap((el) => [...el.attributes].filter((a) => a.name.startsWith('on'))
          .map((a) => `${el.tagName.toLowerCase()} ${a.name}`)),
        styled: [...document.querySelectorAll('#instructions-body [style]')].map((el) => el.tagName),
        active: [...document.querySelectorAll('#instructions-body :is(script, iframe, frame, object, embed, svg, math, style, link, meta, base, form, input, button, div)')]
          .map((el) => el.tagName),
        hrefs: [...document.querySelectorAll('#instructions-body a')].map((a) => a.href),
        rels: [...document.querySelectorAll('#instructions-body a')].map((a) => `${a.rel}|${a.target}`),
        images: [...document.querySelectorAll('#instructions-body img')].map((img) => img.src),
        text: document.getElementById('instructions-body').innerText,
      };
    });
    assert.deepEqual(found.handlers, [], 'no element has an on… attribute');
    assert.deepEqual(found.styled, [], 'no element in the panel has a style attribute');
    assert.deepEqual(found.active, [], 'no script, frame, SVG or form element in the panel');
    assert.deepEqual(found.hrefs, ['https://nginx.org/en/docs/', 'mailto:teacher@ttlab.example']);
    assert.ok(found.rels.every((r) => r === 'noopener noreferrer|_blank'), found.rels.join(', '));
    assert.deepEqual(found.images, ['https://ttlab.invalid/diagram.png']);
    for (const shown of ['<script>window.__pwned', '<img src=x onerror=', '<iframe src="javascript:',
      '<svg onload=', '<b onmouseover=', 'Links: javascript, case, entity, tab, vbscript, data, relative.']) {
      assert.ok(found.text.replace(/\s+/g, ' ').includes(shown), `the panel shows ${JSON.stringify(shown)} as text`);
    }
  });

  await step('an image is no wider than the panel', async () => {
    // The diagram's host does not resolve: give it a size as if it had loaded.
    const sizes = await panel.evaluate((body) => {
      const img = body.querySelector('img');
      img.setAttribute('width', '4000');
      img.setAttribute('height', '100');
      return { img: img.getBoundingClientRect().width, panel: body.getBoundingClientRect().width };
    });
    assert.ok(sizes.img > 0 && sizes.img <= sizes.panel, `image ${sizes.img}px in a panel of ${sizes.panel}px`);
    await shot(page, 'showcase');
    await page.evaluate(() => document.getElementById('instructions').scrollTo(0, 10000));
    await shot(page, 'showcase-end');
  });

  await step('the lab finishes', async () => {
    await page.locator('#finish').click();
    await page.locator('#view-ended').waitFor({ state: 'visible', timeout: 30000 });
    assert.deepEqual(dialogs.filter((d) => !d.startsWith('confirm')), [], 'only the finish confirmation');
    assert.deepEqual(errors, [], 'no page errors');
  });
} catch (e) {
  failed = true;
} finally {
  await browser.close();
}
console.log(`\ninstructions browser test:\n${results.join('\n')}`);
process.exit(failed ? 1 : 0);
