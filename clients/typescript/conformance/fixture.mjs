// The Express fixture app of the shared conformance runner (conformance/run.py):
// POST/PATCH /charge behind the `idempotency` middleware, GET /charge passed
// through by it, /__health and /__invocations beside it. The contract is in the
// repository's conformance notes; this file implements exactly that.
//
// Run from the repository root, after building the package:
//   (cd clients/typescript && npm ci && npm run build)
//   LEDGER_URL=http://127.0.0.1:8080 LEDGER_API_KEY=dev-payments-key \
//   LEDGER_BIZ_TYPE=order PORT=9101 node clients/typescript/conformance/fixture.mjs
//
// Middleware configuration: key required (missing: 400), the middleware's
// default stored statuses (below 500 except 408 and 429) and stored headers,
// a retry during the first request answers 409 with Retry-After at once
// (waitMs 0, the middleware's default), the end user is the X-User header
// (absent: unscoped). The handler reads the body from req.rawBody (parseJson
// off), so any raw body reaches it.

import { setTimeout as sleep } from "node:timers/promises";

import express from "express";

import { LedgerClient } from "../dist/index.js";
import { idempotency } from "../dist/express/index.js";

function env(name) {
  const v = process.env[name];
  if (v === undefined || v === "") {
    console.error(`fixture: environment variable ${name} is required`);
    process.exit(2);
  }
  return v;
}

const ledgerUrl = env("LEDGER_URL");
const apiKey = env("LEDGER_API_KEY");
const bizType = env("LEDGER_BIZ_TYPE");
const port = Number(env("PORT"));
if (!Number.isInteger(port) || port < 1 || port > 65535) {
  console.error(`fixture: PORT ${JSON.stringify(process.env.PORT)} is not a port`);
  process.exit(2);
}

const client = new LedgerClient({ baseUrl: ledgerUrl, apiKey });
let invocations = 0;

const app = express();
app.get("/__health", (_req, res) => {
  res.status(200).json({ ok: true });
});
app.get("/__invocations", (_req, res) => {
  res.status(200).json({ count: invocations });
});

app.use(
  "/charge",
  idempotency({
    client,
    bizType,
    required: true,
    waitMs: 0,
    // The handler parses the bytes itself (leniently, as the contract says), so
    // a vector's raw_body that is not JSON reaches it like in the other fixtures.
    parseJson: false,
    scope: (req) => req.get("x-user") || undefined,
    onLedgerError: (error, during) => console.error(`fixture: ledger error during ${during}:`, error?.message ?? error),
  }),
);

/** The request's JSON body (the bytes the middleware read): absent, empty or not JSON counts as {}. */
function requestJson(req) {
  const raw = req.rawBody;
  if (!Buffer.isBuffer(raw) || raw.length === 0) return {};
  try {
    return JSON.parse(raw.toString("utf8"));
  } catch {
    return {};
  }
}

async function charge(req, res) {
  invocations += 1;
  const n = invocations;
  const body = requestJson(req);
  const opts = typeof body === "object" && body !== null && !Array.isArray(body) ? body : {};
  if (Number.isInteger(opts.delay_ms) && opts.delay_ms > 0) await sleep(opts.delay_ms);
  const status = Number.isInteger(opts.status) ? opts.status : 201;
  const answer = Number.isInteger(opts.size) && opts.size >= 0 ? { n, pad: "x".repeat(opts.size) } : { n, echo: body };
  res.status(status).set("X-Fixture", "yes").type("application/json").send(JSON.stringify(answer));
}

app.post("/charge", charge);
app.patch("/charge", charge);
app.get("/charge", (_req, res) => {
  invocations += 1;
  res.status(200).set("X-Fixture", "yes").type("application/json").send(JSON.stringify({ n: invocations }));
});

const server = app.listen(port, "127.0.0.1", () => {
  console.error(`fixture: listening on 127.0.0.1:${port}, ledger ${ledgerUrl}, biz type ${bizType}`);
});
server.on("error", (e) => {
  console.error(`fixture: ${e.message}`);
  process.exit(1);
});
for (const signal of ["SIGTERM", "SIGINT"]) {
  process.on(signal, () => {
    server.close(() => process.exit(0));
    setTimeout(() => process.exit(0), 2000).unref();
  });
}
