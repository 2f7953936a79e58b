// The conformance fixture (conformance/fixture.mjs) as the shared runner
// starts it: environment, readiness, routes, counter, X-User scoping. It
// imports the built dist/, which `npm test` builds first.

import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { fileURLToPath } from "node:url";
import { setTimeout as sleep } from "node:timers/promises";
import { after, before, describe, it } from "node:test";

import { SERVICE_KEY, freePort, startLedger, unique, type Ledger } from "./ledger.js";

const FIXTURE = fileURLToPath(new URL("../../conformance/fixture.mjs", import.meta.url));

let ledger: Ledger;
let fixture: ChildProcess;
let base: string;
let stderr = "";

before(async () => {
  ledger = await startLedger();
  const port = await freePort();
  base = `http://127.0.0.1:${port}`;
  fixture = spawn(process.execPath, [FIXTURE], {
    env: { ...process.env, LEDGER_URL: ledger.url, LEDGER_API_KEY: SERVICE_KEY, LEDGER_BIZ_TYPE: "order", PORT: String(port) },
    stdio: ["ignore", "inherit", "pipe"],
  });
  fixture.stderr?.setEncoding("utf8").on("data", (c: string) => (stderr += c));
  const deadline = Date.now() + 20_000;
  for (;;) {
    if (fixture.exitCode !== null) assert.fail(`the fixture exited: ${stderr}`);
    try {
      if ((await fetch(`${base}/__health`)).status === 200) break;
    } catch {
      // not yet
    }
    if (Date.now() > deadline) assert.fail(`the fixture was not healthy within 20 s: ${stderr}`);
    await sleep(50);
  }
});

after(async () => {
  if (fixture !== undefined && fixture.exitCode === null) {
    const gone = new Promise((r) => fixture.once("exit", r));
    fixture.kill("SIGTERM");
    await gone;
  }
  await ledger?.stop();
});

async function invocations(): Promise<number> {
  const r = await fetch(`${base}/__invocations`);
  return ((await r.json()) as { count: number }).count;
}

async function charge(method: string, key: string | undefined, body: unknown, user?: string): Promise<Response> {
  const headers: Record<string, string> = { "content-type": "application/json" };
  if (key !== undefined) headers["Idempotency-Key"] = key;
  if (user !== undefined) headers["X-User"] = user;
  return fetch(`${base}/charge`, { method, headers, body: body === undefined ? null : JSON.stringify(body) });
}

describe("conformance fixture", () => {
  it("implements the contract's routes", async () => {
    assert.equal(await invocations(), 0);
    const missing = await charge("POST", undefined, {});
    assert.equal(missing.status, 400);
    assert.equal(((await missing.json()) as { code: string }).code, "idempotency_key_missing");
    assert.equal(await invocations(), 0);

    const k = unique("k");
    const first = await charge("POST", k, { amount: 3 });
    assert.equal(first.status, 201);
    assert.equal(first.headers.get("x-fixture"), "yes");
    assert.match(first.headers.get("content-type") ?? "", /^application\/json/);
    assert.deepEqual(await first.json(), { n: 1, echo: { amount: 3 } });
    const replay = await charge("POST", k, { amount: 3 });
    assert.equal(replay.headers.get("idempotent-replayed"), "true");
    assert.deepEqual(await replay.json(), { n: 1, echo: { amount: 3 } });
    assert.equal(await invocations(), 1);

    const empty = await fetch(`${base}/charge`, { method: "PATCH", headers: { "Idempotency-Key": unique("k") } });
    assert.equal(empty.status, 201);
    assert.deepEqual(await empty.json(), { n: 2, echo: {} });

    const status = await charge("POST", unique("k"), { status: 200, size: 10 });
    assert.equal(status.status, 200);
    assert.deepEqual(await status.json(), { n: 3, pad: "x".repeat(10) });

    const get = await fetch(`${base}/charge`);
    assert.deepEqual(await get.json(), { n: 4 });
    assert.equal(await invocations(), 4);

    const notJson = await fetch(`${base}/charge`, {
      method: "POST",
      headers: { "Idempotency-Key": unique("k"), "content-type": "application/json" },
      body: "{not json",
    });
    assert.equal(notJson.status, 201);
    assert.deepEqual(await notJson.json(), { n: 5, echo: {} });
  });

  it("scopes keys by X-User", async () => {
    const k = unique("k");
    const before = await invocations();
    assert.equal((await charge("POST", k, {}, "alice")).headers.get("idempotent-replayed"), null);
    assert.equal((await charge("POST", k, {}, "bob")).headers.get("idempotent-replayed"), null);
    assert.equal((await charge("POST", k, {}, "alice")).headers.get("idempotent-replayed"), "true");
    assert.equal(await invocations(), before + 2);
  });

  it("answers 409 at once for a retry during the first request", async () => {
    const k = unique("k");
    const first = charge("POST", k, { delay_ms: 500 });
    await sleep(150);
    const during = await charge("POST", k, { delay_ms: 500 });
    assert.equal(during.status, 409);
    assert.ok(during.headers.get("retry-after"));
    assert.equal((await first).status, 201);
  });
});
