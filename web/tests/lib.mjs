// Helpers of the browser tests: Chromium's flags, screenshots, the terminal's text, waiting
// for it, and named steps with their times.

import assert from 'node:assert/strict';
import path from 'node:path';
import { chromium } from 'playwright-core';

/** Headless Chromium without anything that talks to the network by itself. */
export const FLAGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

/** Chromium at TTLAB_CHROMIUM (Debian's by default), headless. */
export async function launch() {
  const executablePath = process.env.TTLAB_CHROMIUM || '/usr/bin/chromium';
  return chromium.launch({ executablePath, args: FLAGS, headless: true });
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
