// The admin page of a demo with two sites (`ttlabctl demo --sites 2`), in headless Chromium:
// the capacity card adds the sites up and gives each site a card of its own — its VMs against
// its limit, reachable, its quota, its sessions starting, its golden disks — and the reaper's
// cycles and the sessions list say on which site each ran.
// Started by web/tests/run.sh after instructions.mjs, against the same demo, with
// TTLAB_ADMIN_URL, TTLAB_SITE_VM_LIMIT, TTLAB_ARTIFACTS and TTLAB_CHROMIUM.

import assert from 'node:assert/strict';
import { launch, required, screenshots, stepper } from './lib.mjs';

const adminUrl = required('TTLAB_ADMIN_URL');
const limit = Number(required('TTLAB_SITE_VM_LIMIT'));
const shot = screenshots('sites');
const { step, results } = stepper();

const browser = await launch();
let failed = false;
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const admin = await context.newPage();

  await step('admin: every site has its card, and the totals are over all of them', async () => {
    await admin.goto(adminUrl);
    await admin.locator('#capacity .stat[data-site]').first().waitFor({ timeout: 15000 });
    const names = await admin.locator('#capacity .stat[data-site]').evaluateAll(
      (cards) => cards.map((c) => c.dataset.site));
    assert.deepEqual(names, ['site-a', 'site-b']);
    for (const name of names) {
      const card = admin.locator(`#capacity .stat[data-site="${name}"]`);
      assert.match(await card.locator('.stat-value').innerText(), new RegExp(`^\\d+ / ${limit}$`));
      assert.match(await card.locator('.muted').innerText(), /^[a-z0-9-]+, reachable$/);
      // The demo's namespaces have no ResourceQuota: each card says so in words.
      assert.equal(await card.locator('[data-field="site-quota"]').innerText(), 'Quota: none');
      assert.match(await card.locator('[data-field="site-starting"]').innerText(), /^Sessions starting: \d+$/);
      // The test lessons boot from container disks: no golden disk anywhere.
      assert.equal(await card.locator('[data-field="site-golden"]').innerText(), 'Golden disks ready: none');
    }
    const total = admin.locator('#capacity .stat', { hasText: 'VMs running / limit' });
    assert.match(await total.locator('.stat-value').innerText(), new RegExp(`^\\d+ / ${2 * limit}$`));
    assert.equal(await total.locator('.muted').innerText(), 'over all 2 sites');
    // One site's namespace and quota are not shown as if they were everyone's.
    assert.equal(await admin.locator('#capacity .stat', { hasText: 'Namespace' }).count(), 0);
    await shot(admin, 'admin-capacity', true);
  });

  await step('admin: each reaper cycle names its site', async () => {
    await admin.locator('#cycles tbody tr').first().waitFor({ timeout: 15000 });
    const sites = await admin.locator('#cycles tbody td[data-field="site"]').allInnerTexts();
    assert.ok(sites.length > 0 && sites.every((s) => /^site-[ab]$/.test(s)), `cycles' sites: ${sites}`);
    assert.deepEqual([...new Set(sites)].sort(), ['site-a', 'site-b'], 'each site has its cycles');
  });

  await step('admin: the sessions list names the site of each lab', async () => {
    const cell = admin.locator('#sessions tbody tr').first().locator('[data-field="site"]');
    await cell.waitFor({ timeout: 15000 });
    assert.match(await cell.innerText(), /^site-[ab]$/);
  });
} catch (e) {
  failed = true;
} finally {
  await browser.close();
}
console.log(`\nsites browser test:\n${results.join('\n')}`);
process.exit(failed ? 1 : 0);
