// Loads the router's /dashboard in headless chromium and checks what it
// shows. Usage: node dashboard_test.mjs CHROMIUM URL ADMIN_KEY IDS_FILE
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { chromium } from 'playwright-core';

const [executablePath, url, key, idsFile] = process.argv.slice(2);
const ids = readFileSync(idsFile, 'utf8').trim().split('\n');
const browser = await chromium.launch({ executablePath, args: ['--no-sandbox'] });
let passed = 0;
async function check(name, fn) {
  await fn();
  passed += 1;
  console.log(`ok ${name}`);
}
try {
  const context = await browser.newContext({ extraHTTPHeaders: { Authorization: `Bearer ${key}` } });
  const page = await context.newPage();
  const elsewhere = [];
  page.on('request', (r) => { if (!r.url().startsWith(url)) elsewhere.push(r.url()); });
  const response = await page.goto(`${url}/dashboard`);

  await check('the page loads from the router alone', async () => {
    assert.equal(response.status(), 200);
    assert.match(response.headers()['content-type'], /^text\/html/);
    assert.deepEqual(elsewhere, []);
    assert.match(await page.title(), /^tandem router: /);
  });

  await check('both pools, every worker healthy, with its load', async () => {
    const pools = await page.$$eval('table.workers', (ts) => ts.map((t) => t.dataset.pool));
    assert.deepEqual(pools, ['prefill', 'decode']);
    for (const [pool, count] of [['prefill', 1], ['decode', 2]]) {
      const rows = await page.$$eval(`table.workers[data-pool="${pool}"] tr`, (trs) =>
        trs.slice(1).map((tr) => [...tr.cells].map((c) => c.textContent)));
      assert.equal(rows.length, count, `${pool}: ${JSON.stringify(rows)}`);
      for (const r of rows) {
        assert.match(r[0], /^127\.0\.0\.1:\d+$/);
        assert.equal(r[1], 'healthy');
        assert.match(r[5], /^\d+ \/ \d+$/, 'KV used / total from the load report');
      }
      const heading = await page.textContent(`h2:has-text("${pool} pool")`);
      assert.equal(heading, `${pool} pool: ${count} of ${count} workers healthy`);
    }
    assert.deepEqual(await page.$$eval('code.policy', (cs) => cs.map((c) => c.textContent)),
      ['kv_cache_aware', 'kv_cache_aware']);
    assert.equal(await page.textContent('#disaggregation'), 'always');
  });

  await check('the recent decisions are the requests sent, newest first', async () => {
    const rows = await page.$$eval('table.recent tr', (trs) =>
      trs.slice(1).map((tr) => [...tr.cells].map((c) => c.textContent)));
    assert.deepEqual(rows.slice(0, ids.length).map((r) => r[1]), [...ids].reverse());
    const decode = await page.$$eval('table.workers[data-pool="decode"] td.address', (tds) => tds.map((t) => t.textContent));
    const prefill = await page.$$eval('table.workers[data-pool="prefill"] td.address', (tds) => tds.map((t) => t.textContent));
    for (const r of rows.slice(0, ids.length)) {
      assert.ok(decode.includes(r[5]), `decode worker ${r[5]}`);
      assert.ok(prefill.includes(r[4]), `prefill worker ${r[4]}`);
      assert.ok(Number(r[2]) > 0, 'prompt tokens');
    }
  });

  await check('without the admin key: 401, no page', async () => {
    const anonymous = await browser.newContext();
    const r = await (await anonymous.newPage()).goto(`${url}/dashboard`);
    assert.equal(r.status(), 401);
    await anonymous.close();
  });
} finally {
  await browser.close();
}
console.log(`dashboard: ${passed} checks passed`);
