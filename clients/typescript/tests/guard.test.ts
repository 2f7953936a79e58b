// The guard against a real ledger: run once, replay, in progress, release
// before side effects, keep after them.

import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";

import { GuardError, LedgerClient, LedgerError, beforeSideEffects, type Json } from "../src/index.js";
import { SERVICE_KEY, startLedger, unique, type Ledger } from "./ledger.js";

let ledger: Ledger;
let client: LedgerClient;

before(async () => {
  ledger = await startLedger();
  client = new LedgerClient({ baseUrl: ledger.url, apiKey: SERVICE_KEY });
});

after(async () => {
  await ledger?.stop();
});

async function guardError(p: Promise<unknown>): Promise<GuardError> {
  try {
    await p;
  } catch (e) {
    assert.ok(e instanceof GuardError, `a GuardError, got ${String(e)}`);
    return e;
  }
  assert.fail("expected a GuardError");
}

describe("guardToken", () => {
  it("runs the step once, records its output, and replays it to a later attempt", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    let runs = 0;
    const step = async (): Promise<Json> => {
      runs++;
      return { charge: `ch_${runs}` };
    };
    const first = await client.guardToken(token, { subject }, step);
    assert.deepEqual(first.status === "ran" && first.output, { charge: "ch_1" });
    assert.deepEqual((await client.tokenState(token, subject)).result, { charge: "ch_1" });
    const second = await client.guardToken(token, { subject }, step);
    assert.deepEqual(second.status === "completed" && second.output, { charge: "ch_1" });
    assert.equal(runs, 1);
  });

  it("answers in_progress without running while the first attempt runs", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    let runs = 0;
    const first = client.guardToken(token, { subject }, async () => {
      runs++;
      await gate;
      return "done";
    });
    // Wait until the first attempt holds the token.
    while (runs === 0) await new Promise((r) => setTimeout(r, 10));
    const second = await client.guardToken(token, { subject }, () => {
      runs++;
      return "second";
    });
    assert.equal(second.status, "in_progress");
    release();
    assert.equal((await first).status, "ran");
    assert.equal(runs, 1);
  });

  it("a step failing before side effects releases the token: the same token runs again", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    const err = await guardError(
      client.guardToken(token, { subject }, () => {
        throw beforeSideEffects(new Error("card declined by validation"));
      }),
    );
    assert.equal(err.kind, "before_side_effects");
    assert.equal(err.released, true);
    assert.equal((err.cause as Error).message, "card declined by validation");
    assert.equal((await client.tokenState(token, subject)).state, "issued");
    const retry = await client.guardToken(token, { subject }, () => 42);
    assert.deepEqual(retry.status === "ran" && retry.output, 42);
  });

  it("any other failure keeps the token consumed (after side effects, the safe default)", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    const boom = new Error("provider timed out after charging");
    const err = await guardError(
      client.guardToken(token, { subject }, () => {
        throw boom;
      }),
    );
    assert.equal(err.kind, "after_side_effects");
    assert.equal(err.cause, boom);
    assert.equal((await client.tokenState(token, subject)).state, "consumed");
    let ran = false;
    const again = await client.guardToken(token, { subject }, () => {
      ran = true;
      return 1;
    });
    assert.equal(again.status, "in_progress");
    assert.equal(ran, false);
  });

  it("a consume error does not run the step", async () => {
    let ran = false;
    const err = await guardError(
      client.guardToken("order_forged", { subject: "u" }, () => {
        ran = true;
        return 1;
      }),
    );
    assert.equal(err.kind, "consume");
    assert.ok(err.cause instanceof LedgerError);
    assert.equal(err.cause.code, "token_invalid");
    assert.equal(ran, false);
  });

  it("parse checks a stored result; a refusal is stored_result", async () => {
    const subject = unique("user");
    const { token } = await client.issue({ biz_type: "order", subject });
    await client.guardToken(token, { subject }, () => "text");
    const err = await guardError(
      client.guardToken(token, { subject }, () => 1, {
        parse: (v) => {
          if (typeof v !== "number") throw new TypeError("not a number");
          return v;
        },
      }),
    );
    assert.equal(err.kind, "stored_result");
    assert.equal(err.result, "text");
  });
});

interface Charge {
  id: string;
  amount: number;
}

describe("guard outputs", () => {
  it("take your own interfaces (any JSON-serializable value)", async () => {
    const key = unique("typed");
    const ran = await client.guardKey<Charge>({ biz_type: "order", key }, () => ({ id: "ch_1", amount: 5 }));
    const replayed = await client.guardKey<Charge>({ biz_type: "order", key }, () => ({ id: "ch_2", amount: 6 }));
    assert.equal(ran.status === "ran" && ran.output.id, "ch_1");
    assert.equal(replayed.status === "completed" && replayed.output.amount, 5);
  });
});

describe("guardKey", () => {
  it("runs once per key; undefined output is recorded as null; a fingerprint clash is a consume error", async () => {
    const key = unique("msg");
    let runs = 0;
    const first = await client.guardKey({ biz_type: "order", key, fingerprint: "sha256:1" }, () => {
      runs++;
      return null;
    });
    assert.equal(first.status, "ran");
    const second = await client.guardKey({ biz_type: "order", key, fingerprint: "sha256:1" }, () => {
      runs++;
      return null;
    });
    assert.deepEqual(second.status === "completed" && second.output, null);
    assert.equal(runs, 1);
    const err = await guardError(client.guardKey({ biz_type: "order", key, fingerprint: "sha256:2" }, () => 1));
    assert.equal(err.kind, "consume");
    assert.equal((err.cause as LedgerError).code, "fingerprint_mismatch");
  });

  it("before side effects releases the key", async () => {
    const key = unique("msg");
    const err = await guardError(
      client.guardKey({ biz_type: "order", key }, () => {
        throw beforeSideEffects("out of stock");
      }),
    );
    assert.equal(err.released, true);
    const retry = await client.guardKey({ biz_type: "order", key }, () => "ok");
    assert.equal(retry.status, "ran");
  });
});
