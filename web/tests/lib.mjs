// Helpers of the browser tests: Chromium's flags and the Content-Security-Policy watch on
// every page, screenshots, the terminal's text, waiting for it, and named steps with their
// times.

import assert from 'node:assert/strict';
import path from 'node:path';
import { chromium } from 'playwright-core';

/** Headless Chromium without anything that talks to the network by itself. */
export const FLAGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

/**
 * Chromium at TTLAB_CHROMIUM (Debian's by default), headless, with every page it opens held
 * to the server's Content-Security-Policy (`watchCsp`): `browser.close()` throws when a page
 * reported a violation or a page arrived without the policy.
 */
export async function launch() {
  const executablePath = process.env.TTLAB_CHROMIUM || '/usr/bin/chromium';
  return watchCsp(await chromium.launch({ executablePath, args: FLAGS, headless: true }));
}

/** The prefix of the console line a page writes for each `securitypolicyviolation` event. */
const CSP_EVENT = '[csp-violation]';

/**
 * Watches every page of every context of `browser`: the `securitypolicyviolation` events
 * (written to the console by an init script), Chromium's own console reports of a refusal
 * ("… violates the following Content Security Policy directive …"), and the policy header
 * of each page loaded (it must forbid inline script). `browser.close()` then prints the
 * verdict and throws if anything was found, so every test that launches through here fails
 * on a violation whatever its own steps check.
 */
export function watchCsp(browser) {
  const violations = [];
  const documents = [];
  const watched = new WeakSet();
  // A page's address without its query: a login link's token stays out of the log.
  const where = (url) => {
    try {
      const u = new URL(url);
      return `${u.origin}${u.pathname}`;
    } catch {
      return url;
    }
  };
  const watchPage = (page) => {
    if (watched.has(page)) return;
    watched.add(page);
    page.on('console', (m) => {
      const text = m.text();
      if (text.startsWith(CSP_EVENT) || /Content Security Policy/i.test(text)) {
        violations.push(`${where(page.url())}: ${text}`);
      }
    });
    page.on('response', (r) => {
      if (r.request().resourceType() !== 'document' || r.request().frame() !== page.mainFrame()) return;
      const policy = r.headers()['content-security-policy'] || '';
      documents.push(where(r.url()));
      if (!/(^|;)\s*script-src 'self'\s*(;|$)/.test(policy) || !/frame-ancestors 'none'/.test(policy)) {
        violations.push(`${where(r.url())}: served without the Content-Security-Policy (got ${JSON.stringify(policy)})`);
      }
    });
  };
  const watchContext = async (context) => {
    await context.addInitScript((prefix) => {
      document.addEventListener('securitypolicyviolation', (e) => {
        console.error(`${prefix} ${e.effectiveDirective} refused ${e.blockedURI || 'inline'} ` +
          `at ${e.sourceFile || 'the page'}:${e.lineNumber} (${(e.sample || '').slice(0, 80)})`);
      });
    }, CSP_EVENT);
    context.on('page', watchPage);
    context.pages().forEach(watchPage);
    const newPage = context.newPage.bind(context);
    context.newPage = async (...args) => {
      const page = await newPage(...args);
      watchPage(page);
      return page;
    };
    return context;
  };
  const newContext = browser.newContext.bind(browser);
  browser.newContext = async (...args) => watchContext(await newContext(...args));
  const newPage = browser.newPage.bind(browser);
  browser.newPage = async (...args) => {
    const page = await newPage(...args);
    await watchContext(page.context());
    return page;
  };
  const close = browser.close.bind(browser);
  browser.close = async (...args) => {
    await close(...args);
    if (violations.length) {
      const list = violations.join('\n  ');
      console.log(`FAIL no Content-Security-Policy violation (${documents.length} pages loaded):\n  ${list}`);
      throw new Error(`Content-Security-Policy violations:\n  ${list}`);
    }
    console.log(`ok   no Content-Security-Policy violation (${documents.length} pages loaded, each under the policy)`);
  };
  return browser;
}

/** The screenshot directory (TTLAB_ARTIFACTS). */
export const artifacts = process.env.TTLAB_ARTIFACTS || 'artifacts/browser';

/** Screenshots named `<prefix>-<name>.png` in the artifacts directory. */
export function screenshots(prefix) {
  return async (page, name, fullPage = false) => {
    const file = path.join(artifacts, `${prefix}-${name}.png`);
    await page.screenshot({ path: file, fullPage });
    console.log(`screenshot ${file}`);
    return file;
  };
}

/** Everything the page's terminal holds (scrollback and screen), as text; wrapped lines joined. */
export async function screenText(page) {
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

/** Waits until `test(text)` holds for the terminal's text; returns the text. */
export async function waitForScreen(page, test, what, timeout = 30000) {
  const until = Date.now() + timeout;
  let text = '';
  while (Date.now() < until) {
    text = await screenText(page);
    if (test(text)) return text;
    await page.waitForTimeout(200);
  }
  throw new Error(`the terminal never showed ${what} within ${timeout / 1000} s; it shows:\n${text.slice(-3000)}`);
}

/**
 * Named steps: `step(name, fn)` runs `fn`, records `ok name (ms)` or `FAIL name: why`, and
 * rethrows a failure; `results` holds the lines.
 */
export function stepper() {
  const results = [];
  async function step(name, fn) {
    const started = Date.now();
    try {
      await fn();
      results.push(`ok   ${name} (${Date.now() - started} ms)`);
      console.log(`ok   ${name}`);
    } catch (e) {
      results.push(`FAIL ${name}: ${e.message.split('\n')[0]}`);
      console.log(`FAIL ${name}\n${e.stack}`);
      throw e;
    }
  }
  return { step, results };
}

/** A required environment variable. */
export function required(name) {
  const value = process.env[name];
  assert.ok(value, `${name} is required`);
  return value;
}

/** Seconds in a humantime duration of whole seconds, minutes and hours (`30s`, `5m`, `1h30m`). */
export function durationSeconds(text) {
  const units = { h: 3600, m: 60, s: 1 };
  let total = 0;
  const rest = text.trim().replace(/(\d+)\s*([hms])/g, (_, n, u) => {
    total += Number(n) * units[u];
    return '';
  });
  assert.ok(rest.trim() === '' && total > 0, `not a duration of h, m and s: ${text}`);
  return total;
}
