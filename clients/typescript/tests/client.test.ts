// The client against a real ledger: tokens, client keys, orders, errors.

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { LedgerClient, LedgerError } from "../src/index.js";
import { SERVICE_KEY, startLedger, unique, type Ledger } from "./ledger.js";

let ledger: Ledger;
let client: LedgerClient;
let sent = 0;

before(async () => {
  ledger = await startLedger();
  const counting: typeof fetch = (input, init) => {
    sent++;
    return fetch(input, init);
  };
  client = new LedgerClient({ baseUrl: ledger.url, apiKey: SERVICE_KEY, fetch: counting });
});

after(async () => {
  await ledger?.stop();
});

async function rejection(p: Promise<unknown>): Promise<LedgerError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof LedgerError, `a LedgerError, got ${String(e)}`);
    return e;
  }
  assert.fail("expected an error");
}

describe("tokens", () => {
  it("issue, consume, replay the winner, duplicate processing, result, duplicate completed, read", async () => {
    const subject = unique("user");
    const issued = await client.issue({ biz_type: "order", subject, ttl_seconds: 30 });
    assert.match(issued.token, /^order_[A-Za-z0-9_-]+$/);
    assert.equal(issued.subject, subject);
    assert.equal(issued.expire_time, 30);

    const won = await client.consume(issued.token, { subject, fingerprint: "sha256:aa" });
    assert.equal(won.outcome, "consumed");
    assert.equal(won.outcome === "consumed" && won.replayed, false);

    const again = await client.consume(issued.token, { subject, fingerprint: "sha256:aa", request_id: won.request_id });
    assert.equal(again.outcome, "consumed");
    assert.equal(again.outcome === "consumed" && again.replayed, true, "the same request_id is the winner again");

    const other = await client.consume(issued.token, { subject, fingerprint: "sha256:aa" });
    assert.equal(other.outcome, "duplicate");
    assert.equal(other.outcome === "duplicate" && other.status, "processing");

    const mismatch = await rejection(client.consume(issued.token, { subject, fingerprint: "sha256:bb" }));
    assert.equal(mismatch.code, "fingerprint_mismatch");
    assert.equal(mismatch.status, 422);

    const rec = await client.recordResult(issued.token, subject, { charge: "ch_1", amount: 1000 });
    assert.equal(rec.replayed, false);
    const rec2 = await client.recordResult(issued.token, subject, { charge: "ch_1", amount: 1000 });
    assert.equal(rec2.replayed, true);
    const conflict = await rejection(client.recordResult(issued.token, subject, { charge: "ch_2" }));
    assert.equal(conflict.code, "result_already_set");
    assert.equal(conflict.status, 409);

    const done = await client.consume(issued.token, { subject });
    assert.deepEqual(done.outcome === "duplicate" && [done.status, done.result], ["completed", { charge: "ch_1", amount: 1000 }]);

    const state = await client.tokenState(issued.token, subject);
    assert.equal(state.state, "consumed");
    assert.deepEqual(state.result, { charge: "ch_1", amount: 1000 });
    assert.equal(typeof state.consumed_at, "string");
  });

  it("release gives the token back; a second release is not_releasable", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    const first = await client.consume(token, { subject });
    assert.equal(first.outcome, "consumed");
    await client.release(token, subject);
    assert.equal((await client.tokenState(token, subject)).state, "issued");
    const second = await client.consume(token, { subject });
    assert.equal(second.outcome, "consumed");
    await client.recordResult(token, subject, null);
    const err = await rejection(client.release(token, subject));
    assert.equal(err.code, "not_releasable");
  });

  it("a late result or release naming an earlier consume never lands on another attempt's", async () => {
    for (const biz_type of ["order", "like"]) {
      const subject = unique("user");
      const { token } = await client.issue({ biz_type, subject });
      assert.equal((await client.consume(token, { subject, request_id: "r-1" })).outcome, "consumed");
      await client.release(token, subject, { requestId: "r-1" });
      assert.equal((await client.consume(token, { subject, request_id: "r-2" })).outcome, "consumed");
      assert.equal((await rejection(client.recordResult(token, subject, 1, { requestId: "r-1" }))).code, "not_consumed");
      assert.equal((await rejection(client.release(token, subject, { requestId: "r-1" }))).code, "not_releasable");
      await client.recordResult(token, subject, { from: "r-2" }, { requestId: "r-2" });
      assert.deepEqual((await client.tokenState(token, subject)).result, { from: "r-2" });
    }
  });

  it("errors carry the API's code and status and are sent once", async () => {
    const before = sent;
    const invalid = await rejection(client.consume("order_not-a-real-token", { subject: "u" }));
    assert.equal(invalid.code, "token_invalid");
    assert.equal(invalid.status, 400);
    assert.equal(sent - before, 1, "a 4xx is never retried");

    const { token } = await client.issue({ biz_type: "order", subject: "alice" });
    const mismatch = await rejection(client.consume(token, { subject: "bob" }));
    assert.equal(mismatch.code, "token_mismatch");
    assert.equal(mismatch.status, 403);

    const bad = await rejection(client.issue({ biz_type: "order", subject: "u", ttl_seconds: 100000 }));
    assert.equal(bad.code, "invalid_request");

    const unknown = await rejection(client.issue({ biz_type: "nope", subject: "u" }));
    assert.equal(unknown.code, "unknown_biz_type");

    const unauth = new LedgerClient({ baseUrl: ledger.url, apiKey: "wrong-key" });
    const e401 = await rejection(unauth.issue({ biz_type: "order", subject: "u" }));
    assert.equal(e401.code, "unauthorized");
    assert.equal(e401.status, 401);
  });
});

describe("client keys", () => {
  it("consume, duplicate, result, replay, read; unknown key is key_not_found", async () => {
    const key = unique("key");
    const won = await client.consumeKey({ biz_type: "order", key, fingerprint: "sha256:k" });
    assert.equal(won.outcome, "consumed");
    const replay = await client.consumeKey({ biz_type: "order", key, fingerprint: "sha256:k", request_id: won.request_id });
    assert.equal(replay.outcome === "consumed" && replay.replayed, true);
    const dup = await client.consumeKey({ biz_type: "order", key, fingerprint: "sha256:k" });
    assert.equal(dup.outcome === "duplicate" && dup.status, "processing");
    const reused = await rejection(client.consumeKey({ biz_type: "order", key, fingerprint: "sha256:other" }));
    assert.equal(reused.code, "fingerprint_mismatch");

    await client.recordKeyResult("order", key, { ok: true });
    const done = await client.consumeKey({ biz_type: "order", key });
    assert.deepEqual(done.outcome === "duplicate" && [done.status, done.result], ["completed", { ok: true }]);
    const state = await client.keyState("order", key);
    assert.equal(state.key, key);
    assert.equal(state.state, "consumed");
    assert.deepEqual(state.result, { ok: true });

    const missing = await rejection(client.keyState("order", unique("never")));
    assert.equal(missing.code, "key_not_found");
    assert.equal(missing.status, 404);
  });

  it("release makes a key consumable again", async () => {
    const key = unique("key");
    await client.consumeKey({ biz_type: "order", key });
    await client.releaseKey("order", key);
    const again = await client.consumeKey({ biz_type: "order", key });
    assert.equal(again.outcome, "consumed");
    const notConsumed = await rejection(client.recordKeyResult("order", unique("nobody"), 1));
    assert.equal(notConsumed.status, 409);
  });

  it("a biz type not granted is forbidden", async () => {
    // dev-payments-key is granted order, refund and like only.
    const admin = await rejection(client.consumeKey({ biz_type: "nope", key: "k" }));
    assert.ok(admin.code === "unknown_biz_type" || admin.code === "forbidden", admin.code);
  });
});

describe("orders", () => {
  it("create (again: created false), pay (replay, duplicate), refund, read; illegal transitions", async () => {
    const subject = unique("user");
    const order_id = unique("ord");
    const order = { order_id, subject, amount_minor: 1000, currency: "CNY" };
    const created = await client.createOrder(order);
    assert.equal(created.created, true);
    assert.equal(created.order.state, "CREATED");
    const again = await client.createOrder(order);
    assert.equal(again.created, false);
    const conflict = await rejection(client.createOrder({ ...order, amount_minor: 2000 }));
    assert.equal(conflict.code, "order_conflict");

    const { token } = await client.issue({ biz_type: "order", subject });
    const paid = await client.pay(order_id, { token, fingerprint: "sha256:p" });
    assert.equal(paid.outcome, "applied");
    assert.equal(paid.replayed, false);
    assert.equal(paid.order.state, "PAID");
    const replayed = await client.pay(order_id, { token, fingerprint: "sha256:p", request_id: paid.request_id });
    assert.equal(replayed.outcome, "applied");
    assert.equal(replayed.replayed, true);
    const dup = await client.pay(order_id, { token, fingerprint: "sha256:p" });
    assert.equal(dup.outcome, "duplicate");

    const { token: t2 } = await client.issue({ biz_type: "order", subject });
    const illegal = await rejection(client.pay(order_id, { token: t2 }));
    assert.equal(illegal.code, "illegal_transition");
    assert.equal(illegal.body["state"], "PAID");

    const { token: t3 } = await client.issue({ biz_type: "refund", subject });
    const refunded = await client.refund(order_id, { token: t3, amount_minor: 400, reason: "partial" });
    assert.equal(refunded.order.state, "PARTIALLY_REFUNDED");
    assert.equal(refunded.order.refunded_minor, 400);
    const { token: t4 } = await client.issue({ biz_type: "refund", subject });
    const tooMuch = await rejection(client.refund(order_id, { token: t4, amount_minor: 700 }));
    assert.equal(tooMuch.code, "refund_exceeds_paid");

    const read = await client.order(order_id);
    assert.deepEqual(
      read.events.map((e) => e.kind),
      ["order.created", "order.paid", "order.refunded"],
    );
    const missing = await rejection(client.order(unique("none")));
    assert.equal(missing.code, "order_not_found");
  });

  it("close a created order", async () => {
    const subject = unique("user");
    const order_id = unique("ord");
    await client.createOrder({ order_id, subject, amount_minor: 5, currency: "USD" });
    const { token } = await client.issue({ biz_type: "order", subject });
    const closed = await client.close(order_id, { token });
    assert.equal(closed.order.state, "CLOSED");
  });
});
