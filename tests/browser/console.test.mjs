// The web console (GET /console) in a real headless Chromium.
//
// Starts the ledger binary (LEDGER_BIN, else <repo>/target/debug/idempotency-ledger)
// against a fresh database `ledger_t_<hex>` and a fresh Redis key prefix,
// makes a known history over HTTP (a token consumed once and once more as a
// duplicate, a token released by an operator, a client key, an order paid
// and its payment presented again),
// then drives the console: log in, look the token, key and order up, filter
// (by subject, client and several kinds), page and export the audit trail,
// read the dashboard's duplicate rate and its last sealed checkpoint.
//
// Run: npm ci && node --test console.test.mjs   (in tests/browser)
// Needs Debian's chromium (/usr/bin/chromium, or CHROMIUM=path), Postgres
// on 127.0.0.1:5432 and Redis on 127.0.0.1:6379.
// UPDATE_SCREENSHOTS=1 writes docs/console/*.png.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn, execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync } from 'node:fs';
import { copyFile, mkdir, mkdtemp, readFile, rm, writeFile, chmod } from 'node:fs/promises';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { chromium } from 'playwright-core';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const REPO = path.resolve(HERE, '..', '..');
const SHOTS = path.join(REPO, 'docs', 'console');
const UPDATE_SCREENSHOTS = process.env.UPDATE_SCREENSHOTS === '1';
const CHROMIUM = process.env.CHROMIUM ?? '/usr/bin/chromium';
const CHROMIUM_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync'];

// The key of the test's own setup (an operator's release, a reconcile run)
// and API reads, and the key it logs into the console with: CONSOLE_TEST_KEY,
// else the development auditor key where the server has one (a read-only
// role), else the admin key.
const ADMIN_KEY = 'dev-admin-key';
const AUDITOR_KEY = 'dev-auditor-key';
let CONSOLE_KEY;
const SERVICE_KEY = 'dev-payments-key';
const SUBJECT = 'user-42';

const run = randomBytes(6).toString('hex');
const DB = `ledger_t_console_${run}`;
const PREFIX = `ledger-t-console-${run}:`;

let tmp;
let ledger;
let ledgerLog = '';
let base;
let browser;
let page;
const pageErrors = [];
/** What the test made: tokens, order, key. */
const made = {};

// ---------------------------------------------------------------- the ledger

function ledgerBinary() {
  const candidates = [process.env.LEDGER_BIN, path.join(REPO, 'target', 'debug', 'idempotency-ledger'),
    '/work/main/target/debug/idempotency-ledger'].filter(Boolean);
  const found = candidates.find((c) => existsSync(c));
  if (!found) throw new Error(`no ledger binary: set LEDGER_BIN (tried ${candidates.join(', ')})`);
  return found;
}

function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function http(method, p, { key = SERVICE_KEY, body } = {}) {
  const headers = {};
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const res = await fetch(base + p, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await res.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch {
    json = { raw: text };
  }
  return { status: res.status, headers: res.headers, body: json, text };
}

async function ok(method, p, opts, expected = [200, 201]) {
  const r = await http(method, p, opts);
  assert.ok(expected.includes(r.status), `${method} ${p}: ${r.status} ${r.text}`);
  return r.body;
}

async function startLedger() {
  tmp = await mkdtemp(path.join(os.tmpdir(), 'ledger-console-'));
  // A private copy: the shared target directory may be rebuilt while we run.
  const bin = path.join(tmp, 'idempotency-ledger');
  await copyFile(ledgerBinary(), bin);
  await chmod(bin, 0o755);
  const port = await freePort();
  const config = path.join(tmp, 'ledger.toml');
  await writeFile(config, `[server]
listen = "127.0.0.1:${port}"
workers = 1
[postgres]
url = "postgres://postgres@127.0.0.1:5432/${DB}"
pool_size = 2
admin_pool_size = 1
[redis]
url = "redis://127.0.0.1:6379/3"
key_prefix = "${PREFIX}"
[audit]
seal_every = "1s"
`);
  base = `http://127.0.0.1:${port}`;
  ledger = spawn(bin, ['--config', config, 'serve'], { stdio: ['ignore', 'pipe', 'pipe'] });
  const keep = (d) => {
    ledgerLog = (ledgerLog + d.toString()).slice(-20000);
  };
  ledger.stdout.on('data', keep);
  ledger.stderr.on('data', keep);
  const deadline = Date.now() + 60000;
  while (Date.now() < deadline) {
    if (ledger.exitCode !== null) throw new Error(`the ledger exited (${ledger.exitCode}):\n${ledgerLog}`);
    try {
      const r = await fetch(`${base}/readyz`);
      if (r.status === 200) return;
    } catch {
      // not listening yet
    }
    await sleep(200);
  }
  throw new Error(`the ledger was not ready within 60 s:\n${ledgerLog}`);
}

async function stopLedger() {
  if (ledger && ledger.exitCode === null) {
    const exited = new Promise((r) => ledger.once('exit', r));
    ledger.kill('SIGTERM');
    await Promise.race([exited, sleep(10000)]);
    if (ledger.exitCode === null && ledger.signalCode === null) ledger.kill('SIGKILL');
  }
  try {
    execFileSync('psql', ['-h', '127.0.0.1', '-U', 'postgres', '-d', 'postgres', '-qc',
      `DROP DATABASE IF EXISTS "${DB}" WITH (FORCE)`], { stdio: 'pipe' });
  } catch (e) {
    console.error(`could not drop ${DB}: ${e.stderr ?? e}`);
  }
  try {
    const keys = execFileSync('redis-cli', ['-n', '3', '--scan', '--pattern', `${PREFIX}*`], { encoding: 'utf8' })
      .split('\n').filter(Boolean);
    for (let i = 0; i < keys.length; i += 500) {
      execFileSync('redis-cli', ['-n', '3', 'DEL', ...keys.slice(i, i + 500)], { stdio: 'pipe' });
    }
  } catch {
    // redis-cli missing: the keys carry a unique prefix and TTLs
  }
  if (tmp) await rm(tmp, { recursive: true, force: true });
}

/** A known history: the order biz type's duplicate rate is 2 / (2 + 2) = 50 %. */
async function makeHistory() {
  const issue = (biz) => ok('POST', '/v1/tokens', { body: { biz_type: biz, subject: SUBJECT } });

  // Token A (order): consumed by req-7f3a, a duplicate attempt, a result.
  made.consumed = (await issue('order')).token;
  const first = await ok('POST', `/v1/tokens/${made.consumed}/consume`, {
    body: { subject: SUBJECT, request_id: 'req-7f3a', fingerprint: 'sha256:9f2c' } });
  assert.equal(first.outcome, 'consumed');
  const dup = await ok('POST', `/v1/tokens/${made.consumed}/consume`, {
    body: { subject: SUBJECT, request_id: 'req-8c21', fingerprint: 'sha256:9f2c' } });
  assert.equal(dup.outcome, 'duplicate');
  await ok('POST', `/v1/tokens/${made.consumed}/result`, {
    body: { subject: SUBJECT, result: { charge_id: 'ch_1001', status: 'paid' } } });

  // Token B (refund): consumed, its consumer "died", an operator released it.
  made.released = (await issue('refund')).token;
  await ok('POST', `/v1/tokens/${made.released}/consume`, { body: { subject: SUBJECT, request_id: 'req-r-55' } });
  made.reason = 'consumer crashed before recording a result; INC-1042';
  await ok('POST', `/v1/admin/tokens/${made.released}/release`, { key: ADMIN_KEY, body: { reason: made.reason } });

  // A client key (refund): consumed once.
  made.key = 'refund-msg-000731';
  await ok('POST', '/v1/keys/consume', { body: { biz_type: 'refund', key: made.key, subject: SUBJECT, request_id: 'req-k-1' } });

  // An order paid once, and the same payment presented again (a duplicate,
  // which stats count like a duplicate consume).
  made.order = 'ord-1001';
  await ok('POST', '/v1/orders', { body: { order_id: made.order, subject: SUBJECT, amount_minor: 1000, currency: 'CNY' } });
  made.payToken = (await issue('order')).token;
  const paid = await ok('POST', `/v1/orders/${made.order}/pay`, { body: { token: made.payToken, request_id: 'req-pay-1' } });
  assert.equal(paid.outcome, 'applied');
  assert.equal(paid.order.state, 'PAID');
  const again = await ok('POST', `/v1/orders/${made.order}/pay`, { body: { token: made.payToken, request_id: 'req-pay-2' } });
  assert.equal(again.outcome, 'duplicate');

  // A subject that is markup and a spreadsheet formula.
  made.hostile = '=1+1 <img src=x onerror="window.pwned=1">';
  made.hostileToken = (await ok('POST', '/v1/tokens', { body: { biz_type: 'like', subject: made.hostile } })).token;

  // A reconcile run (recorded where the server keeps the history).
  await ok('POST', '/v1/admin/reconcile', { key: ADMIN_KEY, body: {} });

  // The counters reach Postgres within a few seconds (and the audit seal,
  // every second here, covers the history by then).
  const deadline = Date.now() + 20000;
  for (;;) {
    const st = await ok('GET', '/v1/admin/stats?window=1h', { key: ADMIN_KEY });
    const o = st.biz_types.order;
    if (o.consumed === 2 && o.duplicates === 2) break;
    assert.ok(Date.now() < deadline, `stats never showed order 2 consumed + 2 duplicates: ${JSON.stringify(st)}`);
    await sleep(500);
  }
  for (;;) {
    const seal = await http('GET', '/v1/admin/audit/seal', { key: ADMIN_KEY });
    if (seal.status !== 200 || seal.body) break;
    assert.ok(Date.now() < deadline, 'no audit checkpoint sealed within 20 s');
    await sleep(300);
  }
}

// ---------------------------------------------------------------- the browser

async function newPage(options) {
  const context = await browser.newContext({ acceptDownloads: true, ...options });
  context.setDefaultTimeout(15000); // a missing element fails in 15 s, not 30
  const p = await context.newPage();
  p.on('pageerror', (e) => pageErrors.push(`pageerror: ${e.message}`));
  p.on('console', (m) => {
    // Chromium logs every 4xx answer (a refused key, a section "not
    // available"); the page handles those. Anything else (a CSP violation,
    // an exception) is a defect.
    if (m.type() === 'error' && !/^Failed to load resource: the server responded with a status of 4\d\d/.test(m.text())) {
      pageErrors.push(`console: ${m.text()}`);
    }
  });
  return p;
}

async function shot(p, name, options = {}) {
  if (!UPDATE_SCREENSHOTS) return;
  await mkdir(SHOTS, { recursive: true });
  await p.screenshot({ path: path.join(SHOTS, `${name}.png`), ...options });
}

async function login(p, key = CONSOLE_KEY) {
  await p.goto(`${base}/console`);
  await p.locator('#view-login').waitFor();
  await p.fill('#api-key', key);
  await p.click('#login-form button[type=submit]');
}

async function pickConsoleKey() {
  if (process.env.CONSOLE_TEST_KEY) return process.env.CONSOLE_TEST_KEY;
  const r = await http('GET', '/v1/admin/audit?limit=1', { key: AUDITOR_KEY });
  return r.status === 200 ? AUDITOR_KEY : ADMIN_KEY;
}

before(async () => {
  await startLedger();
  await makeHistory();
  CONSOLE_KEY = await pickConsoleKey();
  console.log(`the console is used with ${CONSOLE_KEY}`);
  browser = await chromium.launch({ executablePath: CHROMIUM, args: CHROMIUM_ARGS });
  page = await newPage({ viewport: { width: 1280, height: 800 } });
});

after(async () => {
  await browser?.close();
  await stopLedger();
});

// ---------------------------------------------------------------- tests

test('the assets are embedded and served with their types and a self-only CSP', async () => {
  for (const [p, type] of [['/console', 'text/html'], ['/console/', 'text/html'], ['/console/app.js', 'text/javascript'],
    ['/console/app.css', 'text/css'], ['/console/icon.svg', 'image/svg+xml']]) {
    const r = await http('GET', p, { key: null });
    assert.equal(r.status, 200, p);
    assert.ok(r.headers.get('content-type').startsWith(type), `${p}: ${r.headers.get('content-type')}`);
    const csp = r.headers.get('content-security-policy');
    assert.match(csp, /default-src 'none'/);
    assert.match(csp, /script-src 'self'/);
    assert.doesNotMatch(csp, /unsafe|https?:|\*/);
    assert.equal(r.headers.get('x-content-type-options'), 'nosniff');
  }
  const html = (await http('GET', '/console', { key: null })).text;
  assert.doesNotMatch(html, /https?:\/\//, 'the page names another host');
  const missing = await http('GET', '/console/nope.js', { key: null });
  assert.equal(missing.status, 404);
  assert.equal(missing.body.error, 'not_found');
  const post = await http('POST', '/console', { key: null });
  assert.equal(post.status, 405);
});

test('log in: a wrong key and a service key are refused, an admin key opens the console', async () => {
  await login(page, 'not-a-key');
  await assert.doesNotReject(page.locator('#login-error', { hasText: '401' }).waitFor());
  assert.equal(await page.evaluate(() => sessionStorage.length), 0, 'a refused key was kept');

  await page.fill('#api-key', SERVICE_KEY);
  await page.click('#login-form button[type=submit]');
  await page.locator('#login-error', { hasText: '403' }).waitFor();
  assert.ok(await page.locator('#nav').isHidden());
  await page.fill('#api-key', '');
  await shot(page, 'login');

  await page.fill('#api-key', CONSOLE_KEY);
  await page.click('#login-form button[type=submit]');
  await page.locator('#view-lookup').waitFor();
  assert.ok(await page.locator('#nav').isVisible());
  const stored = await page.evaluate(() => ({ session: Object.values(sessionStorage), local: localStorage.length }));
  assert.deepEqual(stored, { session: [CONSOLE_KEY], local: 0 });
});

test('a token: its state and its events, consumed by which request, with its result', async () => {
  await page.fill('#q-token', made.consumed);
  await page.click('#form-token button[type=submit]');
  const story = page.locator('[data-story=token]');
  await story.waitFor();
  await assert.doesNotReject(story.locator('h3 .badge', { hasText: 'consumed' }).waitFor());
  const api = await ok('GET', `/v1/admin/tokens/${made.consumed}`, { key: ADMIN_KEY });
  const kinds = await story.locator('.timeline .event').evaluateAll((els) => els.map((e) => e.dataset.kind));
  assert.deepEqual(kinds, api.events.map((e) => e.kind));
  assert.deepEqual(kinds, ['token.issued', 'token.consumed', 'token.result']);
  const consumed = story.locator('.event[data-kind="token.consumed"]');
  assert.equal(await consumed.locator('.request-id').textContent(), 'req-7f3a');
  assert.match(await story.locator('.event[data-kind="token.result"]').textContent(), /ch_1001/);
  assert.match(await story.locator('.facts').textContent(), /order.*durable.*user-42.*payments/s);
  await shot(page, 'lookup-token');
});

test('a release shows who acted and why', async () => {
  await page.fill('#q-token', made.released);
  await page.click('#form-token button[type=submit]');
  const story = page.locator('[data-story=token]', { hasText: made.released });
  await story.waitFor();
  const released = story.locator('.event[data-kind="token.released"]');
  await released.waitFor();
  assert.equal(await released.locator('.actor').textContent(), 'admin');
  assert.equal(await released.locator('.reason').textContent(), made.reason);
  assert.equal(await story.locator('h3 .badge').textContent(), 'issued');
});

test('a client key and an order, with a link from the order to its token', async () => {
  await page.fill('#q-key-client', 'payments');
  await page.fill('#q-key-biz', 'refund');
  await page.fill('#q-key', made.key);
  await page.click('#form-key button[type=submit]');
  const key = page.locator('[data-story=key]');
  await key.waitFor();
  assert.equal(await key.locator('.event[data-kind="key.consumed"] .request-id').textContent(), 'req-k-1');

  await page.fill('#q-order', made.order);
  await page.click('#form-order button[type=submit]');
  const order = page.locator('[data-story=order]');
  await order.waitFor();
  assert.equal(await order.locator('h3 .badge').textContent(), 'PAID');
  const kinds = await order.locator('.timeline .event').evaluateAll((els) => els.map((e) => e.dataset.kind));
  assert.deepEqual(kinds, ['order.created', 'order.paid']);
  await shot(page, 'lookup-order');
  await order.locator('.event[data-kind="order.paid"] a.token').click();
  await page.locator('[data-story=token]', { hasText: made.payToken }).waitFor();
  assert.match(page.url(), /#\/lookup\/token\//);
});

test('the audit trail: filters, pages, and exports what is shown as CSV and NDJSON', async () => {
  await page.click('#nav a[data-view=audit]');
  await page.locator('#view-audit').waitFor();

  // A bad time is refused in the page, before any request.
  await page.fill('#f-since', 'yesterday');
  await page.click('#audit-form button[type=submit]');
  await page.locator('#audit-error', { hasText: 'Since' }).waitFor();
  await page.fill('#f-since', '1h');

  // Filter: one subject, one kind.
  await page.fill('#f-subject', SUBJECT);
  await page.selectOption('#f-kind', 'token.consumed');
  await page.click('#audit-form button[type=submit]');
  await page.locator('#audit-table').waitFor();
  const filtered = await ok('GET', `/v1/admin/audit?subject=${SUBJECT}&kind=token.consumed`, { key: ADMIN_KEY });
  assert.equal(filtered.events.length, 2); // tokens A and B
  let rows = await page.locator('#audit-table tbody tr').evaluateAll((trs) => trs.map((t) => [t.dataset.id, t.dataset.kind]));
  assert.deepEqual(rows, filtered.events.map((e) => [e.id, 'token.consumed']));

  // Filter: one client and two kinds, sent as `client=` and a repeated `kind=`.
  await page.fill('#f-subject', '');
  await page.fill('#f-client', 'payments');
  await page.selectOption('#f-kind', ['token.consumed', 'key.consumed']);
  const [sent] = await Promise.all([
    page.waitForRequest((r) => new URL(r.url()).pathname === '/v1/admin/audit'),
    page.click('#audit-form button[type=submit]'),
  ]);
  const params = new URL(sent.url()).searchParams;
  assert.equal(params.get('client'), 'payments');
  assert.deepEqual(params.getAll('kind'), ['token.consumed', 'key.consumed']);
  const twoKinds = await ok('GET', '/v1/admin/audit?client=payments&kind=token.consumed&kind=key.consumed', { key: ADMIN_KEY });
  // Tokens A and B and the client key; the order's payment is an order.paid.
  assert.deepEqual(twoKinds.events.map((e) => e.kind).sort(), ['key.consumed', 'token.consumed', 'token.consumed']);
  assert.ok(twoKinds.events.every((e) => e.client === 'payments'));
  await page.waitForFunction((n) => document.querySelectorAll('#audit-table tbody tr').length === n
    && document.querySelector('#audit-table tbody tr[data-kind="key.consumed"]'), twoKinds.events.length);
  rows = await page.locator('#audit-table tbody tr').evaluateAll((trs) => trs.map((t) => [t.dataset.id, t.dataset.kind]));
  assert.deepEqual(rows, twoKinds.events.map((e) => [e.id, e.kind]));
  // No event of another client: an empty page.
  assert.deepEqual((await ok('GET', '/v1/admin/audit?client=refunds', { key: ADMIN_KEY })).events, []);
  await page.fill('#f-client', 'refunds');
  await page.click('#audit-form button[type=submit]');
  await page.locator('#audit-count', { hasText: '0 events shown' }).waitFor();
  await page.fill('#f-client', '');
  await page.fill('#f-subject', SUBJECT);

  // Paging: 3 a page, follow next_cursor.
  await page.selectOption('#f-kind', []);
  await page.fill('#f-limit', '3');
  await page.click('#audit-form button[type=submit]');
  await page.locator('#audit-more').waitFor();
  assert.equal(await page.locator('#audit-table tbody tr').count(), 3);
  const all = await ok('GET', `/v1/admin/audit?subject=${SUBJECT}&limit=1000`, { key: ADMIN_KEY });
  assert.ok(all.events.length > 6, `expected more than two pages, got ${all.events.length}`);
  await page.click('#audit-more');
  await page.waitForFunction(() => document.querySelectorAll('#audit-table tbody tr').length === 6);
  rows = await page.locator('#audit-table tbody tr').evaluateAll((trs) => trs.map((t) => t.dataset.id));
  assert.deepEqual(rows, all.events.slice(0, 6).map((e) => e.id));
  assert.match(await page.locator('#audit-count').textContent(), /6 events shown, more/);
  await shot(page, 'audit');

  // Export what is shown.
  const [csvDownload] = await Promise.all([page.waitForEvent('download'), page.click('#export-csv')]);
  assert.match(csvDownload.suggestedFilename(), /^audit-.*\.csv$/);
  const csv = await readFile(await csvDownload.path(), 'utf8');
  const lines = csv.trimEnd().split('\r\n');
  assert.equal(lines[0], 'id,at,kind,token,subject,biz_type,order_id,client,detail');
  assert.equal(lines.length, 7);
  for (const [i, e] of all.events.slice(0, 6).entries()) {
    assert.ok(lines[i + 1].startsWith(`${e.id},${e.at},${e.kind},${e.token ?? ''},${SUBJECT},`), lines[i + 1]);
  }
  assert.ok(csv.includes('"{""charge_id"":""ch_1001"",""status"":""paid""}"') || !all.events.slice(0, 6).some((e) => e.kind === 'token.result'));

  const [ndDownload] = await Promise.all([page.waitForEvent('download'), page.click('#export-ndjson')]);
  assert.match(ndDownload.suggestedFilename(), /^audit-.*\.ndjson$/);
  const nd = (await readFile(await ndDownload.path(), 'utf8')).trimEnd().split('\n').map((l) => JSON.parse(l));
  assert.deepEqual(nd, all.events.slice(0, 6));

  // Values are text: markup is shown, not run; a formula is escaped in CSV.
  await page.fill('#f-subject', made.hostile);
  await page.fill('#f-limit', '');
  await page.click('#audit-form button[type=submit]');
  await page.locator('#audit-table tbody tr[data-kind="token.issued"]').waitFor();
  await page.waitForFunction(() => document.querySelectorAll('#audit-table tbody tr').length === 1);
  assert.equal(await page.locator('#audit-table tbody tr td:nth-child(3)').textContent(), made.hostile);
  assert.equal(await page.locator('#audit-table img').count(), 0);
  assert.equal(await page.evaluate(() => window.pwned), undefined);
  const [hostileCsv] = await Promise.all([page.waitForEvent('download'), page.click('#export-csv')]);
  const row = (await readFile(await hostileCsv.path(), 'utf8')).split('\r\n')[1];
  assert.ok(row.includes(`,"'=1+1 <img src=x onerror=""window.pwned=1"">",`), row);
});

test('the dashboard: duplicate rate per biz type against the 5 % line, the fleet, the queues', async () => {
  await page.click('#nav a[data-view=dashboard]');
  const chart = page.locator('svg[data-chart=duplicate-rate]');
  await chart.waitFor();
  const order = chart.locator('g.bar[data-biz=order]');
  assert.equal(await order.locator('text.value').textContent(), '50.0 %');
  assert.equal(await order.getAttribute('class'), 'bar over');
  assert.equal(await chart.locator('g.bar[data-biz=refund] text.value').textContent(), '0.0 %');
  // The alert line is drawn at 5 % of the axis: between the 0 line and the 50 % bar top.
  const ys = await chart.evaluate((svg) => {
    const line = svg.querySelector('line.threshold');
    const bar = svg.querySelector('g.bar[data-biz=order] rect');
    return { line: Number(line.getAttribute('y1')), top: Number(bar.getAttribute('y')),
      bottom: Number(bar.getAttribute('y')) + Number(bar.getAttribute('height')), threshold: line.dataset.threshold };
  });
  assert.equal(ys.threshold, '0.05');
  assert.ok(ys.top < ys.line && ys.line < ys.bottom, JSON.stringify(ys));
  assert.ok(Math.abs((ys.bottom - ys.line) / (ys.bottom - ys.top) - 0.1) < 0.01, `5 % line not at a tenth of 50 %: ${JSON.stringify(ys)}`);
  assert.equal(await page.locator('table.stats tr[data-biz=order] td.rate').textContent(), '50.0 %');
  assert.equal(await page.locator('svg[data-chart=counts] rect[data-biz=order][data-series=duplicates]').count(), 1);
  assert.match(await page.locator('#panel-rate .alert').textContent(), /order/);

  // The audit seal: sealed within a second or two of the history.
  const seal = await http('GET', '/v1/admin/audit/seal', { key: ADMIN_KEY });
  if (seal.status === 200) {
    await page.locator('#panel-seal [data-checkpoint]').waitFor();
    // What is shown is the last sealed checkpoint; verifying is the CLI's.
    assert.equal(await page.locator('#panel-seal h3').textContent(), 'Last sealed checkpoint');
    assert.match(await page.locator('#panel-seal .seal-note').textContent(), /does not verify.*audit verify/s);
  } else {
    await page.locator('#panel-seal .unavailable').waitFor();
  }

  await page.locator('#panel-fleet [data-mode=normal]').waitFor();
  await page.locator('#panel-fleet [data-fleet=normal]').waitFor();
  // The uncertain queue and the reconcile history: shown, or "not available"
  // where this server has no such endpoint yet, never an error.
  for (const panel of ['#panel-uncertain', '#panel-runs']) {
    await page.waitForFunction((sel) => !document.querySelector(`${sel} .body`).textContent.includes('Loading'), panel);
    assert.equal(await page.locator(`${panel} .error`).count(), 0, await page.locator(panel).textContent());
  }
  const runs = await http('GET', '/v1/admin/reconcile/runs', { key: ADMIN_KEY });
  if (runs.status === 200) {
    // The run the setup made, found nothing to do on this fresh history.
    assert.equal(await page.locator('#panel-runs tbody tr').count(), runs.body.runs.length);
    assert.ok(runs.body.runs.length >= 1);
    if (runs.body.runs[0].by !== undefined) {
      // Asked for over HTTP with the admin key: the run names that client.
      assert.equal(runs.body.runs[0].by, 'admin');
      assert.equal(await page.locator('#panel-runs tbody tr .run-by').first().textContent(), 'admin');
    }
  }
  await shot(page, 'dashboard');
  await shot(page, 'dashboard-full', { fullPage: true });
});

test('the uncertain queue and the reconcile runs as API.md shapes them (stubbed answers)', async () => {
  const at = new Date().toISOString();
  await page.route('**/v1/admin/uncertain*', (r) => r.fulfill({ status: 200, contentType: 'application/json',
    body: JSON.stringify({ items: [{ token: made.consumed, client: 'payments', biz_type: 'order', subject: SUBJECT,
      consumed_at: at, request_id: 'req-lost-1', uncertain_since: at }], next_cursor: null }) }));
  const classes = { redis_live_but_consumed: 0, redis_missing_but_live: 0, stale_provisional: 0, journal_not_durable: 0,
    order_inconsistent: 1, expired_purgeable: 2, redis_consumed_but_live: 0, redis_ahead_of_postgres: 0 };
  await page.route('**/v1/admin/reconcile/runs*', (r) => r.fulfill({ status: 200, contentType: 'application/json',
    body: JSON.stringify({ runs: [{ id: '7', by: 'reconciler', started_at: at, finished_at: at, dry_run: false, scanned: { tokens: 12, orders: 3 },
      found: classes, repaired: { ...classes, order_inconsistent: 0 }, inconsistent_orders: [made.order],
      order_problems: [{ order_id: made.order, problems: ['paid without its token consumed'] }],
      redis_ahead_of_postgres: [], interrupted: false, errors: [] }], next_cursor: null }) }));
  await page.click('#dash-form button[type=submit]');
  const uncertain = page.locator('#panel-uncertain tbody tr');
  await uncertain.waitFor();
  assert.equal(await uncertain.locator('a.token').textContent(), made.consumed);
  assert.match(await uncertain.textContent(), /req-lost-1/);
  const run = page.locator('#panel-runs tbody tr');
  await run.waitFor();
  assert.equal(await run.getAttribute('class'), 'over');
  assert.match(await run.textContent(), /12 tokens, 3 orders.*order_inconsistent: 1.*expired_purgeable: 2/s);
  assert.equal(await run.locator('.run-by').textContent(), 'reconciler');
  assert.match(await run.locator('td:last-child').textContent(), /ord-1001: paid without its token consumed/);
  await page.unrouteAll();
});

test('a section whose endpoint answers 404 or 403 says "not available"', async () => {
  await page.route('**/v1/admin/uncertain*', (r) => r.fulfill({ status: 404, contentType: 'application/json',
    body: JSON.stringify({ error: 'not_found', message: 'no such route' }) }));
  await page.route('**/v1/admin/reconcile/runs*', (r) => r.fulfill({ status: 403, contentType: 'application/json',
    body: JSON.stringify({ error: 'forbidden', message: 'no' }) }));
  await page.click('#dash-form button[type=submit]');
  await page.locator('#panel-uncertain .unavailable', { hasText: 'Not available' }).waitFor();
  await page.locator('#panel-runs .unavailable', { hasText: 'Not available to this key' }).waitFor();
  assert.equal(await page.locator('svg[data-chart=duplicate-rate] g.bar[data-biz=order] text.value').textContent(), '50.0 %');

  // An order record the key may not read: the story comes from the audit trail.
  await page.route('**/v1/orders/**', (r) => r.fulfill({ status: 403, contentType: 'application/json',
    body: JSON.stringify({ error: 'forbidden', message: 'no' }) }));
  await page.goto(`${base}/console#/lookup/order/${made.order}`);
  const order = page.locator('[data-story=order]');
  await order.waitFor();
  assert.equal(await order.locator('h3 .badge').textContent(), 'PAID');
  assert.match(await order.locator('.unavailable').textContent(), /403 forbidden/);
  assert.match(await order.locator('.facts').textContent(), /1,000 CNY/);
  assert.equal(await order.locator('.timeline .event').count(), 2);
  await page.unrouteAll();
});

test('on a phone: the pages fit the width', async () => {
  const phone = await newPage({ viewport: { width: 390, height: 844 }, isMobile: true, hasTouch: true, deviceScaleFactor: 2 });
  try {
    await login(phone);
    await phone.locator('#view-lookup').waitFor();
    await phone.goto(`${base}/console#/lookup/token/${made.consumed}`);
    await phone.locator('[data-story=token] .timeline').waitFor();
    // Nothing but a table's own scroll box is wider than the phone.
    const fits = () => phone.evaluate((width) => document.documentElement.scrollWidth <= width
      && [...document.querySelectorAll('header, main, .view, .card, .chart')]
        .every((e) => e.getBoundingClientRect().right <= width + 0.5), 390);
    assert.ok(await fits(), 'the token page is wider than the phone');
    await shot(phone, 'phone-lookup-token');
    await phone.click('#nav a[data-view=dashboard]');
    await phone.locator('svg[data-chart=duplicate-rate] g.bar[data-biz=order]').waitFor();
    assert.ok(await fits(), 'the dashboard is wider than the phone');
    await shot(phone, 'phone-dashboard');
  } finally {
    await phone.context().close();
  }
});

test('forgetting the key returns to the login and clears the tab', async () => {
  await page.click('#logout');
  await page.locator('#view-login').waitFor();
  assert.equal(await page.evaluate(() => sessionStorage.length), 0);
  assert.ok(await page.locator('#nav').isHidden());
});

test('the Content-Security-Policy is enforced, and a violation would be caught', async () => {
  const seen = pageErrors.length;
  const refused = page.waitForEvent('console', (m) => /Content Security Policy/.test(m.text()));
  await page.evaluate(() => {
    const el = document.createElement('script');
    el.textContent = 'window.injected = true';
    document.body.append(el);
  });
  await refused;
  assert.equal(await page.evaluate(() => window.injected), undefined, 'an inline script ran');
  assert.ok(pageErrors.slice(seen).some((e) => /Content Security Policy/.test(e)), 'the violation was not recorded');
  pageErrors.splice(seen); // the one this test caused
});

test('no script error and no Content-Security-Policy violation on any page', () => {
  assert.deepEqual(pageErrors, []);
});
