// The idempotency-ledger console: a read-only view over the admin API.
// Plain ES module, no dependencies. Every value from the API is put into the
// page as text (never as HTML); the page's Content-Security-Policy allows
// nothing but this origin.

const KEY_STORAGE = 'idempotency-ledger.console.key';
const ALERT_RATE = 0.05; // the seed's alert: duplicate rate above 5 %
const KINDS = [
  'token.issued', 'token.consumed', 'token.result', 'token.released', 'token.uncertain',
  'token.conflict', 'key.consumed', 'key.result', 'key.released', 'key.uncertain',
  'order.created', 'order.paid', 'order.refunded', 'order.closed', 'reconcile.repaired',
  'fleet.forgotten', 'audit.retired',
];
const SVG_NS = 'http://www.w3.org/2000/svg';

// ---------------------------------------------------------------- helpers

const $ = (sel) => document.querySelector(sel);

/** An element with attributes and children (strings become text nodes). */
function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function s(tag, attrs = {}, ...children) {
  const el = document.createElementNS(SVG_NS, tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') el.setAttribute('class', v);
    else if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'text') el.textContent = v;
    else el.setAttribute(k, v === true ? '' : String(v));
  }
}

function append(el, children) {
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
}

function clear(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

function json(v) {
  return JSON.stringify(v);
}

function fmtTime(t) {
  if (!t) return '';
  const d = new Date(t);
  if (Number.isNaN(d.getTime())) return String(t);
  return d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z').replace(/Z$/, ' UTC');
}

function fmtPct(rate) {
  return `${(rate * 100).toFixed(1)} %`;
}

function fmtInt(n) {
  return Number(n ?? 0).toLocaleString('en-US');
}

function errorText(res) {
  const b = res.body;
  if (b && typeof b === 'object' && b.error) return `${res.status} ${b.error}: ${b.message ?? ''}`;
  if (res.status === 0) return `the service could not be reached (${b?.message ?? 'network error'})`;
  return `HTTP ${res.status}`;
}

function notice(text, cls = 'muted') {
  return h('p', { class: cls }, text);
}

/** What a section shows when its endpoint is missing or refused. */
function unavailable(res, what) {
  if (res.status === 404) {
    return notice(`Not available: this server has no ${what} (404).`, 'unavailable');
  }
  if (res.status === 403) {
    return notice(`Not available to this key (403 ${res.body?.error ?? 'forbidden'}).`, 'unavailable');
  }
  return notice(`Could not load ${what}: ${errorText(res)}`, 'error');
}

// ---------------------------------------------------------------- the API

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

/** GET a path of this origin; resolves to {status, ok, body}, never throws. */
async function api(path, { auth = true } = {}) {
  const headers = { Accept: 'application/json' };
  if (auth) headers.Authorization = `Bearer ${apiKey() ?? ''}`;
  let resp;
  try {
    resp = await fetch(path, { headers, cache: 'no-store', credentials: 'omit' });
  } catch (e) {
    return { status: 0, ok: false, body: { message: String(e) } };
  }
  let body = null;
  const text = await resp.text();
  if (text) {
    try {
      body = JSON.parse(text);
    } catch {
      body = { message: text.slice(0, 200) };
    }
  }
  if (auth && resp.status === 401 && apiKey() !== null) {
    forgetKey('The service no longer accepts this key (401). Enter a key again.');
  }
  return { status: resp.status, ok: resp.ok, body };
}

/** A query string; a list repeats its key (`kind=a&kind=b`), empty values are left out. */
export function query(params) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    for (const one of Array.isArray(v) ? v : [v]) {
      if (one !== undefined && one !== null && String(one) !== '') q.append(k, String(one));
    }
  }
  const t = q.toString();
  return t ? `?${t}` : '';
}

// ---------------------------------------------------------------- session and routing

function forgetKey(message) {
  sessionStorage.removeItem(KEY_STORAGE);
  showLogin(message);
}

function showLogin(message) {
  for (const v of document.querySelectorAll('.view')) v.hidden = true;
  $('#nav').hidden = true;
  $('#who').hidden = true;
  $('#view-login').hidden = false;
  const err = $('#login-error');
  err.hidden = !message;
  err.textContent = message ?? '';
  $('#api-key').focus();
}

async function login(ev) {
  ev.preventDefault();
  const input = $('#api-key');
  const key = input.value.trim();
  const err = $('#login-error');
  if (!key) return;
  sessionStorage.setItem(KEY_STORAGE, key);
  // A read every auditor and admin may make: tells a wrong key (401) from a
  // key without an admin role (403).
  const res = await api('/v1/admin/audit?limit=1');
  if (res.ok) {
    input.value = '';
    err.hidden = true;
    if (!location.hash || location.hash === '#/login') location.hash = '#/lookup';
    route();
    return;
  }
  sessionStorage.removeItem(KEY_STORAGE);
  let text;
  if (res.status === 401) text = 'This key is not accepted (401 unauthorized).';
  else if (res.status === 403) text = 'This key cannot read the admin API: it needs the auditor or admin role (403 forbidden).';
  else text = `Could not check the key: ${errorText(res)}`;
  showLogin(text);
}

/** `#/view/arg/arg`, arguments URL-encoded. */
function parseHash() {
  const parts = location.hash.replace(/^#\/?/, '').split('/').map((p) => {
    try {
      return decodeURIComponent(p);
    } catch {
      return p;
    }
  });
  return { view: parts[0] || 'lookup', args: parts.slice(1) };
}

function go(view, ...args) {
  const hash = `#/${[view, ...args].map(encodeURIComponent).join('/')}`;
  if (location.hash === hash) route(); // the same lookup again: no hashchange
  else location.hash = hash;
}

const loaded = { audit: false, dashboard: false };

function route() {
  if (!apiKey()) {
    showLogin();
    return;
  }
  const { view, args } = parseHash();
  const known = ['lookup', 'audit', 'dashboard'];
  const name = known.includes(view) ? view : 'lookup';
  for (const v of document.querySelectorAll('.view')) v.hidden = v.id !== `view-${name}`;
  $('#nav').hidden = false;
  $('#who').hidden = false;
  $('#who-text').textContent = 'key held for this tab';
  for (const a of document.querySelectorAll('#nav a')) {
    if (a.dataset.view === name) a.setAttribute('aria-current', 'page');
    else a.removeAttribute('aria-current');
  }
  if (name === 'lookup' && args.length) lookupFromHash(args);
  if (name === 'dashboard' && !loaded.dashboard) loadDashboard();
}

// ---------------------------------------------------------------- lookup

function lookupFromHash([what, ...rest]) {
  if (what === 'token' && rest[0]) {
    $('#q-token').value = rest[0];
    lookupToken(rest[0]);
  } else if (what === 'order' && rest[0]) {
    $('#q-order').value = rest[0];
    lookupOrder(rest[0]);
  } else if (what === 'key' && rest.length === 3) {
    [$('#q-key-client').value, $('#q-key-biz').value, $('#q-key').value] = rest;
    lookupKey(rest[0], rest[1], rest[2]);
  }
}

let lookupSeq = 0;

function lookupTarget(title) {
  const out = $('#lookup-result');
  clear(out, h('p', { class: 'muted' }, `Loading ${title}…`));
  const seq = ++lookupSeq;
  return (...children) => {
    if (seq !== lookupSeq) return;
    clear(out, ...children);
    // On a phone the forms fill the screen: bring the answer up.
    if (out.getBoundingClientRect().top > window.innerHeight * 0.6) out.scrollIntoView({ block: 'start' });
  };
}

function tokenLink(token) {
  if (!token) return '';
  return h('a', { href: `#/lookup/token/${encodeURIComponent(token)}`, class: 'mono token' }, token);
}

function orderLink(id) {
  if (!id) return '';
  return h('a', { href: `#/lookup/order/${encodeURIComponent(id)}`, class: 'mono' }, id);
}

function keyLink(client, biz, key) {
  if (!key) return '';
  if (!client || !biz) return h('span', { class: 'mono' }, key);
  const path = [client, biz, key].map(encodeURIComponent).join('/');
  return h('a', { href: `#/lookup/key/${path}`, class: 'mono' }, key);
}

function facts(rows) {
  return h('dl', { class: 'facts' },
    rows.filter(([, v]) => v !== undefined).map(([k, v]) => [
      h('dt', {}, k),
      h('dd', {}, v === null || v === '' ? h('span', { class: 'muted' }, '—') : v),
    ]));
}

function stateBadge(state) {
  return h('span', { class: `badge state-${state}` }, state);
}

function resultView(result) {
  if (result === null || result === undefined) return null;
  return h('code', { class: 'json' }, json(result));
}

async function lookupToken(token) {
  const show = lookupTarget('the token');
  const res = await api(`/v1/admin/tokens/${encodeURIComponent(token)}`);
  if (!res.ok) {
    show(h('p', { class: 'error', role: 'alert' }, `Token: ${errorText(res)}`));
    return;
  }
  const t = res.body;
  const durability = (t.events ?? []).find((e) => e.kind === 'token.issued')?.detail?.durability;
  show(h('article', { class: 'card story', 'data-story': 'token' },
    h('h3', {}, 'Token ', h('span', { class: 'mono token' }, t.token), ' ', stateBadge(t.state)),
    facts([
      ['biz type', t.biz_type],
      ['durability', durability],
      ['subject', t.subject],
      ['client', t.client],
      ['issued', fmtTime(t.issued_at)],
      ['expires', fmtTime(t.expires_at)],
      ['consumed', fmtTime(t.consumed_at)],
      ['by request', t.request_id ? h('span', { class: 'mono' }, t.request_id) : null],
      ['fingerprint', t.fingerprint ? h('span', { class: 'mono' }, t.fingerprint) : null],
      ['result', resultView(t.result)],
      ['duplicate attempts', fmtInt(t.duplicate_attempts)],
    ]),
    timeline(t.events ?? [])));
}

async function lookupKey(client, biz, key) {
  const show = lookupTarget('the key');
  const res = await api(`/v1/admin/keys${query({ client, biz_type: biz, key })}`);
  if (!res.ok) {
    show(h('p', { class: 'error', role: 'alert' }, `Key: ${errorText(res)}`));
    return;
  }
  const k = res.body;
  show(h('article', { class: 'card story', 'data-story': 'key' },
    h('h3', {}, 'Client key ', h('span', { class: 'mono' }, k.key), ' ', stateBadge(k.state)),
    facts([
      ['client', k.client],
      ['biz type', k.biz_type],
      ['subject', k.subject],
      ['first consumed', fmtTime(k.issued_at)],
      ['consumed', fmtTime(k.consumed_at)],
      ['by request', k.request_id ? h('span', { class: 'mono' }, k.request_id) : null],
      ['fingerprint', k.fingerprint ? h('span', { class: 'mono' }, k.fingerprint) : null],
      ['result', resultView(k.result)],
      ['duplicate attempts', fmtInt(k.duplicate_attempts)],
    ]),
    timeline(k.events ?? [])));
}

async function lookupOrder(id) {
  const show = lookupTarget('the order');
  const [order, audit] = await Promise.all([
    api(`/v1/orders/${encodeURIComponent(id)}`),
    api(`/v1/admin/audit${query({ order_id: id, limit: 1000 })}`),
  ]);
  if (!order.ok && !audit.ok) {
    show(h('p', { class: 'error', role: 'alert' }, `Order: ${errorText(order)}`));
    return;
  }
  const o = order.ok ? order.body : null;
  const events = audit.ok ? [...audit.body.events].reverse() : [];
  show(h('article', { class: 'card story', 'data-story': 'order' },
    h('h3', {}, 'Order ', h('span', { class: 'mono' }, id), ' ', stateBadge(o ? o.state : orderStateFrom(events))),
    o ? facts([
      ['subject', o.subject],
      ['amount', `${fmtMinor(o.amount_minor)} ${o.currency}`],
      ['refunded', `${fmtMinor(o.refunded_minor)} ${o.currency}`],
      ['created', fmtTime(o.created_at)],
      ['updated', fmtTime(o.updated_at)],
    ]) : [
      notice(`The order record is not readable (${errorText(order)}); the summary is read from its audit events.`, 'unavailable'),
      orderFactsFrom(events),
    ],
    audit.ok
      ? [timeline(events),
        audit.body.next_cursor ? notice('More than 1000 events: the oldest are not shown; use the audit trail with this order id.') : null]
      : h('p', { class: 'error' }, `Its audit events: ${errorText(audit)}`)));
}

/** The state after the last order event that names one (`order.created` alone: CREATED). */
function orderStateFrom(events) {
  const withState = events.filter((e) => e.detail?.state);
  if (withState.length) return withState[withState.length - 1].detail.state;
  return events.some((e) => e.kind === 'order.created') ? 'CREATED' : 'unknown';
}

function orderFactsFrom(events) {
  const created = events.find((e) => e.kind === 'order.created');
  const last = events[events.length - 1];
  return facts([
    ['subject', created?.subject ?? last?.subject ?? null],
    ['amount', created?.detail?.amount_minor !== undefined ? `${fmtMinor(created.detail.amount_minor)} ${created.detail.currency ?? ''}` : null],
    ['created', fmtTime(created?.at)],
    ['updated', fmtTime(last?.at)],
  ]);
}

function fmtMinor(n) {
  return fmtInt(n);
}

// ---------------------------------------------------------------- the timeline

/** One event as a sentence (nodes), and the detail keys it used. */
function describe(ev) {
  const d = ev.detail && typeof ev.detail === 'object' ? ev.detail : {};
  const used = new Set();
  const take = (k) => {
    used.add(k);
    return d[k];
  };
  const by = () => {
    const who = take('by');
    return who ? ['by ', h('strong', { class: 'actor' }, who)] : (ev.client ? ['by ', h('strong', { class: 'actor' }, ev.client)] : []);
  };
  const reason = () => {
    const r = take('reason');
    return r ? [': “', h('span', { class: 'reason' }, r), '”'] : [];
  };
  const key = take('key');
  let parts;
  switch (ev.kind) {
    case 'token.issued':
      parts = ['issued to ', h('strong', {}, ev.subject ?? '?'), ' for client ', ev.client ?? '?',
        take('durability') ? [' (', d.durability, ')'] : [],
        take('expires_at') ? [', expires ', fmtTime(d.expires_at)] : []];
      break;
    case 'token.consumed':
    case 'key.consumed': {
      const rid = take('request_id');
      parts = ['consumed', ev.client ? [' by client ', ev.client] : [],
        rid ? [' in request ', h('strong', { class: 'mono request-id' }, rid)] : ' (no request_id sent)',
        take('fingerprint') ? [', fingerprint ', h('span', { class: 'mono' }, d.fingerprint)] : []];
      break;
    }
    case 'token.result':
    case 'key.result':
      parts = ['result recorded', d.by ? [' ', by()] : [], reason(), ': ', h('code', { class: 'json' }, json(take('result')))];
      break;
    case 'token.released':
    case 'key.released':
      parts = ['released', d.by || ev.client ? [' ', by()] : [], reason(), d.by === 'lease' ? ' (its processing lease ran out)' : ''];
      break;
    case 'token.uncertain':
    case 'key.uncertain':
      parts = ['processing lease ran out with no result: outcome ', h('strong', {}, 'uncertain')];
      break;
    case 'fleet.forgotten':
      parts = ['silent fleet member ', h('span', { class: 'mono' }, take('instance') ?? '?'), ' forgotten ', by(),
        ' (its Redis decisions not in Postgres accepted as lost)', reason()];
      break;
    case 'audit.retired':
      parts = ['audit partition ', h('span', { class: 'mono' }, take('partition') ?? '?'), ' dropped under audit retention (',
        String(take('events') ?? '?'), ' events, verified against their seals first) ', by()];
      break;
    case 'token.conflict':
      parts = [h('strong', {}, 'conflict'), ': a second decision for one generation of the token (two tiers or instances both decided)'];
      break;
    case 'order.created':
      parts = ['order created', take('amount_minor') !== undefined ? [': ', fmtMinor(d.amount_minor), ' ', take('currency') ?? ''] : []];
      break;
    case 'order.paid':
    case 'order.refunded':
    case 'order.closed': {
      const verb = ev.kind.slice('order.'.length);
      parts = [verb, take('amount_minor') !== undefined ? [' ', fmtMinor(d.amount_minor)] : [],
        ev.token ? [' with token ', tokenLink(ev.token)] : [],
        take('state') ? [' → ', h('strong', {}, d.state)] : []];
      break;
    }
    case 'reconcile.repaired':
      parts = ['reconcile repaired ', h('strong', {}, take('class') ?? '?'), take('action') ? [' (', d.action, ')'] : []];
      break;
    default:
      parts = [ev.kind];
  }
  if (key !== undefined && !ev.kind.startsWith('key.')) parts.push([' key ', h('span', { class: 'mono' }, key)]);
  return { parts, used };
}

function timeline(events) {
  if (!events.length) return notice('No audit events.');
  return h('ol', { class: 'timeline' }, events.map((ev) => {
    const { parts, used } = describe(ev);
    const rest = Object.entries(ev.detail && typeof ev.detail === 'object' ? ev.detail : {})
      .filter(([k]) => !used.has(k));
    return h('li', { class: `event kind-${ev.kind.replace('.', '-')}`, 'data-kind': ev.kind, 'data-id': ev.id },
      h('div', { class: 'when' }, h('time', { datetime: ev.at }, fmtTime(ev.at))),
      h('div', { class: 'what' },
        h('span', { class: 'badge kind' }, ev.kind), ' ', parts,
        rest.length
          ? h('div', { class: 'more' }, rest.map(([k, v]) => h('span', { class: 'chip' }, `${k}: `, typeof v === 'string' ? v : json(v))))
          : null));
  }));
}

// ---------------------------------------------------------------- audit search

const audit = { events: [], next: null, params: null, busy: false };

/** A duration back from now (`24h`, `30m`, `7d`, `45s`) or an RFC 3339 time, as RFC 3339. */
export function toRfc3339(text, field, now = Date.now()) {
  const t = text.trim();
  if (!t) return '';
  const m = /^(\d+)\s*([smhd])$/.exec(t);
  if (m) {
    const unit = { s: 1e3, m: 60e3, h: 3600e3, d: 86400e3 }[m[2]];
    return new Date(now - Number(m[1]) * unit).toISOString();
  }
  if (/^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}(:\d{2}(\.\d+)?)?(Z|[+-]\d{2}:\d{2})$/i.test(t) && !Number.isNaN(Date.parse(t))) {
    return new Date(t).toISOString();
  }
  throw new Error(`${field}: give a duration back from now (24h, 30m, 7d) or an RFC 3339 time such as 2026-12-01T00:00:00Z`);
}

async function auditSearch(ev) {
  ev.preventDefault();
  const f = new FormData($('#audit-form'));
  const err = $('#audit-error');
  let params;
  try {
    const limit = String(f.get('limit') ?? '').trim();
    if (limit && !(/^\d+$/.test(limit) && Number(limit) >= 1 && Number(limit) <= 1000)) {
      throw new Error('Page size: a whole number from 1 to 1000');
    }
    params = {
      subject: String(f.get('subject') ?? '').trim(),
      biz_type: String(f.get('biz_type') ?? '').trim(),
      order_id: String(f.get('order_id') ?? '').trim(),
      client: String(f.get('client') ?? '').trim(),
      kind: f.getAll('kind').map(String),
      since: toRfc3339(String(f.get('since') ?? ''), 'Since'),
      until: toRfc3339(String(f.get('until') ?? ''), 'Until'),
      limit,
    };
  } catch (e) {
    err.textContent = e.message;
    err.hidden = false;
    return;
  }
  audit.events = [];
  audit.next = null;
  audit.params = params;
  await auditPage();
}

async function auditPage() {
  if (audit.busy) return;
  audit.busy = true;
  const err = $('#audit-error');
  $('#audit-more').disabled = true;
  try {
    const res = await api(`/v1/admin/audit${query({ ...audit.params, cursor: audit.next })}`);
    if (!res.ok) {
      err.textContent = `Audit search: ${errorText(res)}`;
      err.hidden = false;
      return;
    }
    err.hidden = true;
    audit.events.push(...res.body.events);
    audit.next = res.body.next_cursor;
    renderAudit();
  } finally {
    audit.busy = false;
    $('#audit-more').disabled = false;
  }
}

function renderAudit() {
  const table = $('#audit-table');
  const body = table.querySelector('tbody');
  clear(body, audit.events.map((ev) => {
    const key = ev.detail?.key;
    return h('tr', { 'data-id': ev.id, 'data-kind': ev.kind },
      h('td', { class: 'nowrap' }, h('time', { datetime: ev.at }, fmtTime(ev.at))),
      h('td', {}, h('span', { class: 'badge kind' }, ev.kind)),
      h('td', { class: 'subject' }, ev.subject ?? ''),
      h('td', { class: 'nowrap' }, ev.biz_type ?? ''),
      h('td', {}, ev.token ? tokenLink(ev.token) : keyLink(ev.client, ev.biz_type, key)),
      h('td', { class: 'nowrap' }, orderLink(ev.order_id)),
      h('td', { class: 'nowrap' }, ev.client ?? ''),
      h('td', {}, h('code', { class: 'json' }, json(ev.detail ?? {}))));
  }));
  table.hidden = false;
  const n = audit.events.length;
  $('#audit-count').textContent = `${n} event${n === 1 ? '' : 's'} shown${audit.next ? ', more on the next page' : ', no more'}`;
  $('#audit-more').hidden = !audit.next;
  $('#export-csv').disabled = n === 0;
  $('#export-ndjson').disabled = n === 0;
}

const COLUMNS = ['id', 'at', 'kind', 'token', 'subject', 'biz_type', 'order_id', 'client', 'detail'];

/** One CSV cell (RFC 4180), with a formula-looking cell escaped by a leading `'` as the CLI does. */
export function csvCell(v) {
  let t = v === null || v === undefined ? '' : (typeof v === 'string' ? v : json(v));
  if (/^[=+\-@\t\r]/.test(t)) t = `'${t}`;
  return /[",\r\n]/.test(t) ? `"${t.replaceAll('"', '""')}"` : t;
}

export function toCsv(events) {
  const lines = [COLUMNS.join(',')];
  for (const ev of events) lines.push(COLUMNS.map((c) => csvCell(ev[c])).join(','));
  return `${lines.join('\r\n')}\r\n`;
}

export function toNdjson(events) {
  return events.map((ev) => json(ev)).join('\n') + (events.length ? '\n' : '');
}

function download(text, type, ext) {
  const stamp = new Date().toISOString().replace(/[:.]/g, '-');
  const url = URL.createObjectURL(new Blob([text], { type }));
  const a = h('a', { href: url, download: `audit-${stamp}.${ext}` });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10000);
}

// ---------------------------------------------------------------- dashboard

async function loadDashboard(ev) {
  ev?.preventDefault();
  loaded.dashboard = true;
  const windowText = $('#d-window').value;
  const panels = ['rate', 'counts', 'fleet', 'seal', 'uncertain', 'runs'].map((p) => $(`#panel-${p} .body`));
  for (const p of panels) clear(p, notice('Loading…'));
  const [stats, ready, seal, uncertain, runs] = await Promise.all([
    api(`/v1/admin/stats${query({ window: windowText })}`),
    api('/readyz', { auth: false }),
    api('/v1/admin/audit/seal'),
    api('/v1/admin/uncertain?limit=50'),
    api('/v1/admin/reconcile/runs?limit=10'),
  ]);
  renderStats(stats);
  renderFleet(ready);
  renderSeal(seal);
  renderUncertain(uncertain);
  renderRuns(runs);
  $('#dash-updated').textContent = `updated ${fmtTime(new Date().toISOString())}`;
}

function renderStats(res) {
  const rate = $('#panel-rate .body');
  const counts = $('#panel-counts .body');
  if (!res.ok) {
    clear(rate, unavailable(res, 'stats'));
    clear(counts);
    return;
  }
  const st = res.body;
  const rows = Object.entries(st.biz_types ?? {}).map(([biz, b]) => ({ biz, ...b }));
  const alerting = rows.filter((r) => r.duplicate_rate > ALERT_RATE).map((r) => r.biz);
  clear(rate,
    h('p', { class: alerting.length ? 'alert' : 'muted' },
      alerting.length
        ? `Above the 5 % alert line over ${st.window}: ${alerting.join(', ')}`
        : `No biz type above the 5 % alert line over ${st.window}. Mode: ${st.mode}.`),
    rateChart(rows));
  clear(counts, countChart(rows), statsTable(rows));
}

/** The rate axis: at least 10 %, room above the highest bar, 2 to 5 round steps. */
export function rateAxis(maxRate) {
  const want = Math.min(1, Math.max(0.1, maxRate * 1.1));
  const step = [0.02, 0.05, 0.1, 0.2, 0.25].find((st) => Math.ceil(want / st - 1e-9) <= 5) ?? 0.25;
  return { top: Math.min(1, Math.ceil(want / step - 1e-9) * step), step };
}

/** A count axis: whole round steps (1, 2, 5, 10, 20, 50, ...), at most 5 of them. */
export function countAxis(max) {
  let step = 1;
  for (let p = 1; ; p *= 10) {
    const st = [1, 2, 5].map((f) => f * p).find((c) => Math.ceil(max / c) <= 5);
    if (st) {
      step = st;
      break;
    }
  }
  return { top: Math.max(step, Math.ceil(max / step) * step), step };
}

/** Bars of the duplicate rate per biz type, with the 5 % alert line. */
function rateChart(rows) {
  const W = 640;
  const H = 240;
  const m = { l: 48, r: 12, t: 14, b: 36 };
  const { top, step } = rateAxis(Math.max(...rows.map((r) => r.duplicate_rate), 0));
  const y = (v) => m.t + (H - m.t - m.b) * (1 - v / top);
  const bw = (W - m.l - m.r) / Math.max(rows.length, 1);
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', 'data-chart': 'duplicate-rate',
    'aria-label': `Duplicate rate per biz type; alert line at 5 %` });
  for (let i = 0; i * step <= top + 1e-9; i++) {
    const v = i * step;
    svg.append(s('line', { x1: m.l, x2: W - m.r, y1: y(v), y2: y(v), class: 'gridline' }),
      s('text', { x: m.l - 6, y: y(v) + 4, 'text-anchor': 'end', class: 'axis' }, `${Math.round(v * 100)} %`));
  }
  rows.forEach((r, i) => {
    const x = m.l + i * bw + bw * 0.2;
    const w = bw * 0.6;
    const over = r.duplicate_rate > ALERT_RATE;
    const g = s('g', { class: `bar${over ? ' over' : ''}`, 'data-biz': r.biz, 'data-rate': r.duplicate_rate });
    g.append(
      s('rect', { x, y: y(r.duplicate_rate), width: w, height: Math.max(0, y(0) - y(r.duplicate_rate)) },
        s('title', {}, `${r.biz}: ${fmtPct(r.duplicate_rate)} (${r.duplicates} duplicates of ${r.consumed + r.duplicates} consume attempts)`)),
      s('text', { x: x + w / 2, y: y(r.duplicate_rate) - 4, 'text-anchor': 'middle', class: 'value' }, fmtPct(r.duplicate_rate)),
      s('text', { x: x + w / 2, y: H - m.b + 16, 'text-anchor': 'middle', class: 'label' }, r.biz));
    svg.append(g);
  });
  svg.append(
    s('line', { x1: m.l, x2: W - m.r, y1: y(ALERT_RATE), y2: y(ALERT_RATE), class: 'threshold', 'data-threshold': ALERT_RATE }),
    s('text', { x: W - m.r, y: y(ALERT_RATE) - 4, 'text-anchor': 'end', class: 'threshold-label' }, 'alert 5 %'));
  if (!rows.length) svg.append(s('text', { x: W / 2, y: H / 2, 'text-anchor': 'middle', class: 'axis' }, 'no biz types'));
  return svg;
}

/** Grouped bars: issued, consumes, duplicates per biz type. */
function countChart(rows) {
  const W = 640;
  const H = 220;
  const m = { l: 56, r: 12, t: 24, b: 36 };
  const series = [['issued', 'issued'], ['consumed', 'consumes'], ['duplicates', 'duplicates']];
  const { top, step } = countAxis(Math.max(1, ...rows.flatMap((r) => series.map(([k]) => r[k]))));
  const y = (v) => m.t + (H - m.t - m.b) * (1 - v / top);
  const gw = (W - m.l - m.r) / Math.max(rows.length, 1);
  const bw = (gw * 0.7) / series.length;
  const svg = s('svg', { viewBox: `0 0 ${W} ${H}`, class: 'chart', role: 'img', 'data-chart': 'counts',
    'aria-label': 'Issued, consumes and duplicates per biz type' });
  for (let v = 0; v <= top; v += step) {
    svg.append(s('line', { x1: m.l, x2: W - m.r, y1: y(v), y2: y(v), class: 'gridline' }),
      s('text', { x: m.l - 6, y: y(v) + 4, 'text-anchor': 'end', class: 'axis' }, fmtInt(v)));
  }
  rows.forEach((r, i) => {
    const x0 = m.l + i * gw + gw * 0.15;
    series.forEach(([k, label], j) => {
      const x = x0 + j * bw;
      svg.append(s('rect', { x, y: y(r[k]), width: bw - 2, height: Math.max(0, y(0) - y(r[k])), class: `series-${j}`, 'data-biz': r.biz, 'data-series': k },
        s('title', {}, `${r.biz} ${label}: ${fmtInt(r[k])}`)));
    });
    svg.append(s('text', { x: x0 + (bw * series.length) / 2, y: H - m.b + 16, 'text-anchor': 'middle', class: 'label' }, r.biz));
  });
  series.forEach(([, label], j) => {
    const x = m.l + j * 110;
    svg.append(s('rect', { x, y: 4, width: 10, height: 10, class: `series-${j}` }),
      s('text', { x: x + 14, y: 13, class: 'axis' }, label));
  });
  return svg;
}

function statsTable(rows) {
  return h('div', { class: 'scroll' }, h('table', { class: 'stats' },
    h('thead', {}, h('tr', {}, ['biz type', 'issued', 'consumes', 'duplicates', 'duplicate rate', 'expired', 'invalid'].map((c) => h('th', {}, c)))),
    h('tbody', {}, rows.map((r) => h('tr', { 'data-biz': r.biz, class: r.duplicate_rate > ALERT_RATE ? 'over' : '' },
      h('td', {}, r.biz), h('td', { class: 'num' }, fmtInt(r.issued)), h('td', { class: 'num' }, fmtInt(r.consumed)),
      h('td', { class: 'num' }, fmtInt(r.duplicates)), h('td', { class: 'num rate' }, fmtPct(r.duplicate_rate)),
      h('td', { class: 'num' }, fmtInt(r.expired)), h('td', { class: 'num' }, fmtInt(r.invalid)))))));
}

function renderFleet(res) {
  const el = $('#panel-fleet .body');
  const r = res.body;
  if (!r || typeof r !== 'object' || !('mode' in r)) {
    clear(el, notice(`Could not read /readyz: ${errorText(res)}`, 'error'));
    return;
  }
  const f = r.fleet ?? {};
  clear(el,
    h('p', {}, 'This instance: ', h('span', { class: `badge mode-${r.mode}`, 'data-mode': r.mode }, r.mode),
      res.status === 503 ? h('span', { class: 'badge state-down' }, 'not ready (503)') : ''),
    facts([
      ['Postgres', r.postgres],
      ['Redis', r.redis],
      ['worker id', r.worker_id !== undefined ? String(r.worker_id) : undefined],
      ['fleet state', f.state ? h('span', { class: `badge fleet-${f.state}`, 'data-fleet': f.state }, f.state) : undefined],
      ['fleet epoch', f.epoch !== undefined ? String(f.epoch) : undefined],
      ['members', f.members !== undefined ? `${f.members} (${f.redis_down_members ?? 0} report Redis down)` : undefined],
      ['Redis decides here', f.redis_decides_here !== undefined ? (f.redis_decides_here ? 'yes' : 'no') : undefined],
    ]));
}

function renderSeal(res) {
  const el = $('#panel-seal .body');
  if (!res.ok) {
    clear(el, unavailable(res, 'audit seal'));
    return;
  }
  const c = res.body;
  if (!c) {
    clear(el, notice('Nothing sealed yet.'));
    return;
  }
  clear(el,
    facts([
      ['checkpoint', h('span', { 'data-checkpoint': c.id }, `#${c.id}`)],
      ['sealed', fmtTime(c.sealed_at)],
      ['events', `${fmtInt(c.events)} (ids ${c.first_event_id} to ${c.last_event_id})`],
      ['digest', h('span', { class: 'mono', title: c.digest }, `${String(c.digest).slice(0, 16)}…`)],
    ]),
    h('p', { class: 'muted seal-note' }, 'The newest checkpoint sealed, as the service reports it: this page does not verify it. ',
      h('code', {}, 'idempotency-ledger audit verify'), ' recomputes every checkpoint and names the first that no longer matches. ',
      'Events after this checkpoint are sealed by the next one.'));
}

function renderUncertain(res) {
  const el = $('#panel-uncertain .body');
  if (!res.ok) {
    clear(el, unavailable(res, 'uncertain queue'));
    return;
  }
  const items = res.body.items ?? [];
  if (!items.length) {
    clear(el, notice('Empty: no token or key is waiting for a human.'));
    return;
  }
  clear(el, h('p', {}, `${items.length}${res.body.next_cursor ? '+' : ''} waiting, oldest first`),
    h('div', { class: 'scroll' }, h('table', {},
      h('thead', {}, h('tr', {}, ['since', 'token / key', 'biz type', 'client', 'subject', 'request'].map((c) => h('th', {}, c)))),
      h('tbody', {}, items.map((it) => h('tr', {},
        h('td', { class: 'nowrap' }, fmtTime(it.uncertain_since)),
        h('td', {}, it.token ? tokenLink(it.token) : keyLink(it.client, it.biz_type, it.key)),
        h('td', {}, it.biz_type ?? ''), h('td', {}, it.client ?? ''), h('td', {}, it.subject ?? ''),
        h('td', { class: 'mono' }, it.request_id ?? '')))))));
}

function nonZero(classes) {
  return Object.entries(classes ?? {}).filter(([, n]) => n);
}

function renderRuns(res) {
  const el = $('#panel-runs .body');
  if (!res.ok) {
    clear(el, unavailable(res, 'reconcile history'));
    return;
  }
  const runs = res.body.runs ?? [];
  if (!runs.length) {
    clear(el, notice('No reconcile run recorded yet.'));
    return;
  }
  clear(el, h('div', { class: 'scroll' }, h('table', { class: 'runs' },
    h('thead', {}, h('tr', {}, ['finished', 'kind', 'scanned', 'found', 'repaired', 'inconsistent orders'].map((c) => h('th', {}, c)))),
    h('tbody', {}, runs.map((r) => {
      const found = nonZero(r.found);
      const repaired = nonZero(r.repaired);
      // `inconsistent_orders`: ids, with their problems in `order_problems`
      // (a report straight from a run has objects with both).
      const problems = new Map((r.order_problems ?? []).map((o) => [o.order_id, o.problems ?? []]));
      const orders = (r.inconsistent_orders ?? []).map((o) => (typeof o === 'string'
        ? { order_id: o, problems: problems.get(o) ?? [] }
        : { order_id: o.order_id, problems: o.problems ?? [] }));
      const errors = r.errors ?? [];
      return h('tr', { class: r.found?.order_inconsistent || errors.length ? 'over' : '' },
        h('td', { class: 'nowrap' }, fmtTime(r.finished_at ?? r.started_at)),
        h('td', {}, r.dry_run ? 'dry run' : 'run', r.by ? [' by ', h('span', { class: 'run-by' }, r.by)] : null, r.interrupted ? [' ', h('span', { class: 'badge state-uncertain' }, 'interrupted')] : null,
          errors.map((e) => h('div', { class: 'error' }, e))),
        h('td', {}, r.scanned ? `${fmtInt(r.scanned.tokens)} tokens, ${fmtInt(r.scanned.orders)} orders` : '—'),
        h('td', {}, found.length ? found.map(([k, n]) => h('span', { class: 'chip' }, `${k}: ${n}`)) : 'nothing'),
        h('td', {}, repaired.length ? repaired.map(([k, n]) => h('span', { class: 'chip' }, `${k}: ${n}`)) : '—'),
        h('td', {}, orders.length
          ? orders.map((o) => h('div', {}, orderLink(o.order_id), o.problems.length ? [': ', o.problems.join(', ')] : null))
          : '—'));
    })))));
}

// ---------------------------------------------------------------- wiring

function init() {
  const kind = $('#f-kind');
  for (const k of KINDS) kind.append(h('option', { value: k }, k));
  $('#login-form').addEventListener('submit', login);
  $('#logout').addEventListener('click', () => forgetKey('The key is forgotten.'));
  $('#form-token').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const t = $('#q-token').value.trim();
    if (t) go('lookup', 'token', t);
  });
  $('#form-key').addEventListener('submit', (ev) => {
    ev.preventDefault();
    go('lookup', 'key', $('#q-key-client').value.trim(), $('#q-key-biz').value.trim(), $('#q-key').value);
  });
  $('#form-order').addEventListener('submit', (ev) => {
    ev.preventDefault();
    const o = $('#q-order').value.trim();
    if (o) go('lookup', 'order', o);
  });
  $('#audit-form').addEventListener('submit', auditSearch);
  $('#audit-more').addEventListener('click', auditPage);
  $('#export-csv').addEventListener('click', () => download(toCsv(audit.events), 'text/csv;charset=utf-8', 'csv'));
  $('#export-ndjson').addEventListener('click', () => download(toNdjson(audit.events), 'application/x-ndjson', 'ndjson'));
  $('#dash-form').addEventListener('submit', loadDashboard);
  window.addEventListener('hashchange', route);
  route();
}

init();
