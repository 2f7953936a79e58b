// Retry mechanics against a tiny local HTTP stub (503s, Retry-After, hangs,
// refused connections): what the real ledger cannot be made to do on demand.

import assert from "node:assert/strict";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { after, before, describe, it } from "node:test";

import { LedgerClient, LedgerError, backoffMs, canonicalJson, fingerprint, fingerprintJson, parseRetryAfter, requestFingerprint, retryPolicy, shortDigest } from "../src/index.js";
import { freePort } from "./ledger.js";

interface Seen {
  method: string;
  url: string;
  body: string;
  auth: string | undefined;
}

type Script = (n: number, req: IncomingMessage, res: ServerResponse) => void;

let server: Server;
let base: string;
let script: Script = () => {};
let seen: Seen[] = [];

before(async () => {
  server = createServer((req, res) => {
    let body = "";
    req.setEncoding("utf8");
    req.on("data", (c: string) => (body += c));
    req.on("end", () => {
      seen.push({ method: req.method ?? "", url: req.url ?? "", body, auth: req.headers.authorization });
      script(seen.length, req, res);
    });
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const addr = server.address();
  assert.ok(addr !== null && typeof addr === "object");
  base = `http://127.0.0.1:${addr.port}`;
});

after(async () => {
  server.closeAllConnections();
  await new Promise<void>((resolve) => server.close(() => resolve()));
});

function reset(s: Script): void {
  seen = [];
  script = s;
}

function json(res: ServerResponse, status: number, body: unknown, headers: Record<string, string> = {}): void {
  res.writeHead(status, { "content-type": "application/json", ...headers });
  res.end(JSON.stringify(body));
}

const consumed = { outcome: "consumed", token: "order_x", consumed_at: "2026-01-01T00:00:00Z" };
const fast = { minDelayMs: 5, maxDelayMs: 20, jitter: false };

describe("retries", () => {
  it("retries a 503, honours Retry-After, and sends the same request_id on every try", async () => {
    reset((n, _req, res) => {
      if (n < 3) json(res, 503, { error: "unavailable", message: "down" }, { "retry-after": "1" });
      else json(res, 200, consumed);
    });
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
    const started = performance.now();
    const out = await client.consume("order_x", { subject: "u1" });
    const took = performance.now() - started;
    assert.equal(out.outcome, "consumed");
    assert.equal(seen.length, 3);
    assert.ok(took >= 1900, `two Retry-After: 1 waits took ${took} ms`);
    const ids = seen.map((s) => (JSON.parse(s.body) as { request_id: string }).request_id);
    assert.equal(new Set(ids).size, 1, "one request_id across tries");
    assert.equal(out.request_id, ids[0]);
    assert.equal(seen[0]?.url, "/v1/tokens/order_x/consume");
    assert.equal(seen[0]?.auth, "Bearer k");
  });

  it("draws a new request_id per logical call and keeps a given one", async () => {
    reset((_n, _req, res) => json(res, 200, consumed));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
    const a = await client.consume("order_x", { subject: "u1" });
    const b = await client.consume("order_x", { subject: "u1" });
    const c = await client.consume("order_x", { subject: "u1", request_id: "mine-1" });
    assert.notEqual(a.request_id, b.request_id);
    assert.equal(c.request_id, "mine-1");
    assert.equal((JSON.parse(seen[2]?.body ?? "{}") as { request_id: string }).request_id, "mine-1");
  });

  it("never retries a 4xx, 429 included, and keeps its code, status, Retry-After and body", async () => {
    for (const [status, code] of [
      [400, "token_invalid"],
      [409, "illegal_transition"],
      [429, "rate_limited"],
    ] as const) {
      reset((_n, _req, res) => json(res, status, { error: code, message: "no", state: "PAID" }, { "retry-after": "2" }));
      const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
      const err = await client.consume("order_x", { subject: "u" }).then(
        () => assert.fail("no error"),
        (e: unknown) => e,
      );
      assert.ok(err instanceof LedgerError);
      assert.equal(err.code, code);
      assert.equal(err.status, status);
      assert.equal(err.retryAfterSeconds, 2);
      assert.equal(err.body["state"], "PAID");
      assert.equal(err.retryable, false);
      assert.equal(seen.length, 1, `${status} was sent once`);
    }
  });

  it("gives up after maxAttempts tries of a 503 and throws the last one", async () => {
    reset((_n, _req, res) => json(res, 503, { error: "unavailable", message: "down" }));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: { ...fast, maxAttempts: 3 } });
    await assert.rejects(client.releaseKey("order", "k1"), (e: unknown) => e instanceof LedgerError && e.code === "unavailable" && e.status === 503);
    assert.equal(seen.length, 3);
  });

  it("does not take a wait that would cross the deadline", async () => {
    reset((_n, _req, res) => json(res, 503, { error: "unavailable", message: "down" }, { "retry-after": "30" }));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: { ...fast, deadlineMs: 2000 } });
    const started = performance.now();
    await assert.rejects(client.keyState("order", "k1"), (e: unknown) => e instanceof LedgerError && e.code === "unavailable");
    assert.equal(seen.length, 1);
    assert.ok(performance.now() - started < 1000);
  });

  it("a non-JSON 503 (a proxy's page) is unavailable and retried", async () => {
    reset((n, _req, res) => {
      if (n === 1) {
        res.writeHead(503, { "content-type": "text/html" });
        res.end("<html>busy</html>");
      } else json(res, 200, { outcome: "released" });
    });
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
    await client.releaseKey("order", "k1");
    assert.equal(seen.length, 2);
  });

  it("retries a try that times out (AbortSignal.timeout), with the same body", async () => {
    reset((n, _req, res) => {
      if (n === 1) setTimeout(() => json(res, 200, consumed), 1500);
      else json(res, 200, consumed);
    });
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: { ...fast, attemptTimeoutMs: 200 } });
    const out = await client.consumeKey({ biz_type: "order", key: "k1" });
    assert.equal(out.outcome, "consumed");
    assert.equal(seen.length, 2);
    assert.equal(seen[0]?.body, seen[1]?.body);
  });

  it("a try that times out every time ends as `timeout`", async () => {
    reset((_n, _req, res) => setTimeout(() => json(res, 200, consumed), 1000));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: { ...fast, attemptTimeoutMs: 100, maxAttempts: 2 } });
    await assert.rejects(client.consumeKey({ biz_type: "order", key: "k1" }), (e: unknown) => e instanceof LedgerError && e.code === "timeout" && e.retryable);
    assert.equal(seen.length, 2);
  });

  it("retries a refused connection and ends as `network_error`", async () => {
    const port = await freePort();
    let calls = 0;
    const counting: typeof fetch = (input, init) => {
      calls++;
      return fetch(input, init);
    };
    const client = new LedgerClient({ baseUrl: `http://127.0.0.1:${port}`, apiKey: "k", retry: { ...fast, maxAttempts: 3 }, fetch: counting });
    await assert.rejects(client.issue({ biz_type: "order", subject: "u" }), (e: unknown) => e instanceof LedgerError && e.code === "network_error" && e.status === undefined);
    assert.equal(calls, 3);
  });

  it("the caller's AbortSignal stops the call and is not retried", async () => {
    reset((_n, _req, res) => setTimeout(() => json(res, 200, consumed), 1000));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
    await assert.rejects(
      client.consumeKey({ biz_type: "order", key: "k1" }, { signal: AbortSignal.timeout(100) }),
      (e: unknown) => e instanceof LedgerError && e.code === "aborted",
    );
    assert.equal(seen.length, 1);
  });

  it("an undecodable success answer is invalid_response, not retried", async () => {
    reset((_n, _req, res) => json(res, 200, { outcome: "something-else" }));
    const client = new LedgerClient({ baseUrl: base, apiKey: "k", retry: fast });
    await assert.rejects(client.consumeKey({ biz_type: "order", key: "k1" }), (e: unknown) => e instanceof LedgerError && e.code === "invalid_response");
    assert.equal(seen.length, 1);
  });

  it("keeps a base path and encodes path segments and the query", async () => {
    reset((_n, _req, res) => json(res, 200, { key: "a b/c", biz_type: "order", state: "consumed", consumed_at: null, result: null }));
    const client = new LedgerClient({ baseUrl: `${base}/ledger`, apiKey: "k", retry: fast });
    await client.keyState("order", "a b/c");
    await client.tokenState("order_a/b", "u 1");
    assert.equal(seen[0]?.url, "/ledger/v1/keys?biz_type=order&key=a+b%2Fc");
    assert.equal(seen[1]?.url, "/ledger/v1/tokens/order_a%2Fb?subject=u+1");
  });
});

describe("policy", () => {
  it("backoff doubles within bounds; Retry-After reads whole seconds only", () => {
    const p = retryPolicy({ minDelayMs: 10, maxDelayMs: 25, jitter: false, maxAttempts: 4 });
    assert.deepEqual([1, 2, 3].map((a) => backoffMs(p, a)), [10, 20, 25]);
    const j = retryPolicy({ minDelayMs: 10, maxDelayMs: 25 });
    assert.equal(backoffMs(j, 1, () => 0.5), 15);
    assert.equal(parseRetryAfter("3"), 3);
    assert.equal(parseRetryAfter(" 3 "), 3);
    assert.equal(parseRetryAfter("Wed, 21 Oct 2015 07:28:00 GMT"), undefined);
    assert.equal(parseRetryAfter(null), undefined);
    assert.equal(retryPolicy({ maxAttempts: 0 }).maxAttempts, 1);
    assert.throws(() => retryPolicy({ deadlineMs: -1 }), TypeError);
  });

  it("refuses a bad base URL or API key", () => {
    assert.throws(() => new LedgerClient({ baseUrl: "ftp://x", apiKey: "k" }), TypeError);
    assert.throws(() => new LedgerClient({ baseUrl: "not a url", apiKey: "k" }), TypeError);
    assert.throws(() => new LedgerClient({ baseUrl: "http://x", apiKey: "" }), TypeError);
    assert.throws(() => new LedgerClient({ baseUrl: "http://x", apiKey: "a\nb" }), TypeError);
  });
});

describe("fingerprints", () => {
  it("are the Rust client's: sha256 hex, length-prefixed request parts, 16-byte scope digests", () => {
    assert.equal(fingerprint("abc"), "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    // Computed independently: sha256 over (u64 BE length, bytes) of each part.
    assert.equal(
      requestFingerprint("POST", "/charge?x=1", Buffer.from('{"a":1}')),
      "sha256:52f2fbfcbaa0fc8580854b37e4d20b32804ce1a0111f1a4e46272247b0b47f70",
    );
    assert.notEqual(requestFingerprint("POST", "/a", Buffer.from("b")), requestFingerprint("POST", "/ab", Buffer.alloc(0)));
    assert.equal(shortDigest("user-1"), "c6c289e49e9c05b2145860387b73bcb1");
    assert.equal(canonicalJson({ b: [{ y: 1, x: 2 }], a: null }), '{"a":null,"b":[{"x":2,"y":1}]}');
    assert.equal(fingerprintJson({ b: 1, a: 2 }), fingerprintJson({ a: 2, b: 1 }));
  });
});
