/**
 * Express middleware implementing the `Idempotency-Key` header
 * (draft-ietf-httpapi-idempotency-key-header) on the ledger's client-supplied
 * keys (`/v1/keys`), with the rules of the Rust tower layer
 * (clients/rust/src/layer.rs).
 *
 * For a request with an unsafe method (anything but GET, HEAD, OPTIONS and
 * TRACE, which pass through untouched):
 *
 * | situation | answer |
 * |---|---|
 * | first request with a key | the handler runs; its response is stored (see below) and returned |
 * | a retry with the same key and payload, after the first finished | the stored response, with `Idempotent-Replayed: true`; the handler does not run |
 * | a retry while the first is still running | 409 `idempotency_key_in_use`, `Retry-After`; the handler does not run |
 * | a retry after the first ran past its biz type's processing lease with no stored response | 409 `idempotency_key_uncertain`; the handler does not run; an operator resolves it |
 * | a stored result that is not a response of this middleware | 500 `stored_response_unreadable` |
 * | the same key with another payload (method, path with query, or body) | 422 `idempotency_key_reused` |
 * | no key, where one is required (the default) | 400 `idempotency_key_missing` |
 * | a key that is not 1 to 255 printable ASCII characters, a bad quoted string, several headers | 400 `idempotency_key_invalid` |
 * | a body over `maxRequestBody` (default 1 MiB) | 413 `payload_too_large` |
 * | the ledger cannot be reached | 503 `ledger_unavailable` with `Retry-After`; the handler does not run |
 *
 * Which responses are stored: by default every status below 500 except 408
 * and 429 (`storeStatuses` changes it). A response that is not stored releases
 * the key: the next retry runs the handler again. Stored: the status, the
 * headers named by `storeHeaders`, and the body (as text, or base64 when it is
 * not UTF-8). A body too large for the ledger's 64 KiB results is not stored:
 * its retries replay status and headers with an empty body and
 * `Idempotent-Body-Omitted: true`.
 *
 * The handler's response is held back until it is stored (so that a retry
 * right after it is a replay, never a 409): the middleware buffers the body
 * of guarded requests in memory.
 */

import type { NextFunction, Request, RequestHandler, Response } from "express";

import type { CallOptions, LedgerClient } from "../client.js";
import { LedgerError } from "../errors.js";
import { newRequestId } from "../ids.js";
import { canonicalJson, requestFingerprint } from "../fingerprint.js";
import type { ConsumeOutcome } from "../types.js";
import { isSafe, keyHeaderValues, ledgerKey, readKey } from "./key.js";
import { sendProblem } from "./problem.js";
import { DEFAULT_STORED_HEADERS, parseStored, replay, storedOf } from "./stored.js";

export interface IdempotencyOptions {
  /** The ledger client (its API key must be granted `bizType`). */
  client: LedgerClient;
  /** The biz type keys are stored under (durable types decide in Postgres). */
  bizType: string;
  /**
   * The end user a key belongs to: part of the key in the ledger, so two
   * users sending the same key never share a stored response. `undefined`
   * (or "") leaves the key unscoped. DEFAULT: `req.user.id` when the request
   * has one (Passport and most auth middlewares set it), else unscoped:
   * every caller of the service shares one key space. Pass `() => undefined`
   * to opt out explicitly. A scoped key may be at most 222 characters.
   */
  scope?: (req: Request) => string | undefined;
  /** Requests without a key are refused with 400 (true, the default) or pass through unguarded. */
  required?: boolean;
  /** Which response statuses are stored and replayed (default: below 500, except 408 and 429). */
  storeStatuses?: (status: number) => boolean;
  /** Response headers stored and replayed besides content-type, content-language, location, etag, last-modified. */
  storeHeaders?: string[];
  /** The `Retry-After` (whole seconds, at least 1) of a 409 for a key in use. Default 1. */
  inProgressRetryAfterSeconds?: number;
  /**
   * How long a retry waits for the first request with its key to finish (the
   * ledger's `wait_ms`, 0 to 10000) before answering 409. Default 0: at once
   * (and `wait_ms` is not sent). Needs a ledger that takes `wait_ms`.
   */
  waitMs?: number;
  /** The largest request body read (bytes, default 1 MiB); larger is 413. */
  maxRequestBody?: number;
  /** Parse JSON bodies into `req.body` when the middleware reads the body itself (default true). */
  parseJson?: boolean;
  /** Options of the middleware's ledger calls (its retry policy, say). */
  call?: CallOptions;
  /** Told about ledger failures the middleware swallowed or answered for (default: console.warn). */
  onLedgerError?: (error: unknown, during: "consume" | "record" | "release") => void;
}

/** The default of {@link IdempotencyOptions.storeStatuses}. */
export function defaultStoreStatuses(status: number): boolean {
  return status < 500 && status !== 408 && status !== 429;
}

/** The default of {@link IdempotencyOptions.scope}: `req.user.id`, when present. */
export function defaultScope(req: Request): string | undefined {
  const user = (req as Request & { user?: unknown }).user;
  if (typeof user !== "object" || user === null) return undefined;
  const id = (user as { id?: unknown }).id;
  return typeof id === "string" || typeof id === "number" || typeof id === "bigint" ? String(id) : undefined;
}

const BIZ_TYPE = /^[a-z][a-z0-9-]{0,31}$/;

interface Config {
  client: LedgerClient;
  bizType: string;
  scope: (req: Request) => string | undefined;
  required: boolean;
  storeStatuses: (status: number) => boolean;
  storeHeaders: string[];
  inProgressRetryAfterSeconds: number;
  waitMs: number;
  maxRequestBody: number;
  parseJson: boolean;
  call: CallOptions | undefined;
  onLedgerError: (error: unknown, during: "consume" | "record" | "release") => void;
}

/** The `Idempotency-Key` middleware; see the module docs. */
export function idempotency(options: IdempotencyOptions): RequestHandler {
  const config = configure(options);
  return (req, res, next) => {
    handle(config, req, res, next).catch(next);
  };
}

function configure(o: IdempotencyOptions): Config {
  if (o === null || typeof o !== "object") throw new TypeError("idempotency(options): options are required");
  if (o.client === undefined || typeof o.client.consumeKey !== "function") {
    throw new TypeError("idempotency: `client` must be a LedgerClient");
  }
  if (typeof o.bizType !== "string" || !BIZ_TYPE.test(o.bizType)) {
    throw new TypeError(`idempotency: bizType ${JSON.stringify(o.bizType)} must match [a-z][a-z0-9-]{0,31}`);
  }
  const retryAfter = o.inProgressRetryAfterSeconds ?? 1;
  if (!Number.isFinite(retryAfter) || retryAfter < 0) throw new TypeError("idempotency: inProgressRetryAfterSeconds must be >= 0");
  const waitMs = o.waitMs ?? 0;
  if (!Number.isInteger(waitMs) || waitMs < 0 || waitMs > 10_000) throw new TypeError("idempotency: waitMs must be an integer from 0 to 10000");
  const maxRequestBody = o.maxRequestBody ?? 1024 * 1024;
  if (!Number.isInteger(maxRequestBody) || maxRequestBody < 0) throw new TypeError("idempotency: maxRequestBody must be an integer >= 0");
  const storeHeaders = [...DEFAULT_STORED_HEADERS];
  for (const h of o.storeHeaders ?? []) {
    if (typeof h !== "string" || !/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(h)) {
      throw new TypeError(`idempotency: storeHeaders: ${JSON.stringify(h)} is not a header name`);
    }
    if (!storeHeaders.includes(h.toLowerCase())) storeHeaders.push(h.toLowerCase());
  }
  return {
    client: o.client,
    bizType: o.bizType,
    scope: o.scope ?? defaultScope,
    required: o.required ?? true,
    storeStatuses: o.storeStatuses ?? defaultStoreStatuses,
    storeHeaders,
    inProgressRetryAfterSeconds: retryAfter,
    waitMs,
    maxRequestBody,
    parseJson: o.parseJson ?? true,
    call: o.call,
    onLedgerError:
      o.onLedgerError ??
      ((error, during) => {
        console.warn(`idempotency: the ledger failed during ${during}:`, error instanceof Error ? error.message : error);
      }),
  };
}

async function handle(config: Config, req: Request, res: Response, next: NextFunction): Promise<void> {
  if (isSafe(req.method)) return next();
  const read = readKey(keyHeaderValues(req.headersDistinct, req.headers));
  if (!read.ok) return sendProblem(res, "idempotency_key_invalid", read.why);
  if (read.key === undefined) {
    if (!config.required) return next();
    return sendProblem(res, "idempotency_key_missing", "This operation requires an Idempotency-Key header.");
  }
  const body = await requestBody(config, req, res, next);
  if (body === undefined) return;
  const scope: unknown = config.scope(req);
  const scoped = ledgerKey(read.key, scope === undefined || scope === null ? undefined : String(scope));
  if (!scoped.ok) return sendProblem(res, "idempotency_key_invalid", scoped.why);
  const key = scoped.key;
  // This request's consume: its response is stored (or the key released) only
  // while this consume holds the key.
  const requestId = newRequestId();
  let outcome: ConsumeOutcome;
  try {
    outcome = await config.client.consumeKey(
      {
        biz_type: config.bizType,
        key,
        request_id: requestId,
        fingerprint: requestFingerprint(req.method, req.originalUrl, body),
        ...(config.waitMs > 0 ? { wait_ms: config.waitMs } : {}),
      },
      config.call,
    );
  } catch (e) {
    if (e instanceof LedgerError && e.code === "fingerprint_mismatch") {
      return sendProblem(res, "idempotency_key_reused", "This key was used for a request with another method, path or body.");
    }
    config.onLedgerError(e, "consume");
    if (e instanceof LedgerError && e.retryable) {
      return sendProblem(
        res,
        "ledger_unavailable",
        "The request was not run; retry it with the same Idempotency-Key.",
        e.retryAfterSeconds ?? 1,
      );
    }
    return sendProblem(res, "ledger_error", "The request was not run.");
  }
  if (outcome.outcome === "consumed") {
    capture(config, res, key, requestId);
    return next();
  }
  switch (outcome.status) {
    case "processing":
      return sendProblem(
        res,
        "idempotency_key_in_use",
        "The first request with this key has not finished yet; retry later.",
        config.inProgressRetryAfterSeconds,
      );
    case "uncertain":
      return sendProblem(
        res,
        "idempotency_key_uncertain",
        "The first request with this key never finished and its outcome is unknown; an operator must resolve it before this key can be used.",
      );
    case "completed": {
      const stored = parseStored(outcome.result);
      if (stored === undefined) {
        return sendProblem(res, "stored_response_unreadable", "This Idempotency-Key was completed, but its response cannot be replayed.");
      }
      return replay(res, stored);
    }
  }
}

/**
 * The request's body bytes for the fingerprint, or undefined when an answer
 * was already sent (413) or an error passed on (a body that is not JSON).
 *
 * - Read already by a body parser mounted before this middleware: its
 *   `req.rawBody` when it kept one (NestJS with `rawBody: true`, or
 *   `express.json({ verify })`), else the parsed `req.body` as canonical
 *   JSON (two bodies that parse equal are the same payload).
 * - Not read yet: the middleware reads it (up to `maxRequestBody`), keeps it
 *   as `req.rawBody`, and parses a JSON body into `req.body` as
 *   `express.json()` would (then a later body parser finds it done).
 */
async function requestBody(config: Config, req: Request, res: Response, next: NextFunction): Promise<Buffer | undefined> {
  const r = req as Request & { rawBody?: unknown; _body?: boolean };
  if (req.readableEnded || (req.complete && !req.readable)) {
    if (Buffer.isBuffer(r.rawBody)) return r.rawBody;
    if (Buffer.isBuffer(req.body)) return req.body;
    if (typeof req.body === "string") return Buffer.from(req.body, "utf8");
    if (req.body === undefined || req.body === null) return Buffer.alloc(0);
    return Buffer.from(canonicalJson(req.body), "utf8");
  }
  const declared = Number(req.headers["content-length"]);
  if (Number.isFinite(declared) && declared > config.maxRequestBody) {
    sendProblem(res, "payload_too_large", `At most ${config.maxRequestBody} bytes.`);
    req.resume();
    return undefined;
  }
  const chunks: Buffer[] = [];
  let size = 0;
  for await (const chunk of req as AsyncIterable<Buffer | string>) {
    const b = typeof chunk === "string" ? Buffer.from(chunk) : chunk;
    size += b.length;
    if (size > config.maxRequestBody) {
      sendProblem(res, "payload_too_large", `At most ${config.maxRequestBody} bytes.`);
      return undefined;
    }
    chunks.push(b);
  }
  const body = Buffer.concat(chunks);
  r.rawBody = body;
  const encoding = (req.headers["content-encoding"] ?? "identity").toLowerCase();
  if (config.parseJson && body.length > 0 && encoding === "identity" && isJson(req.headers["content-type"])) {
    try {
      req.body = JSON.parse(body.toString("utf8"));
      r._body = true;
    } catch (e) {
      const err = Object.assign(new SyntaxError(`the request body is not JSON: ${(e as Error).message}`), {
        status: 400,
        statusCode: 400,
        expose: true,
        type: "entity.parse.failed",
      });
      next(err);
      return undefined;
    }
  }
  return body;
}

function isJson(contentType: string | undefined): boolean {
  if (contentType === undefined) return false;
  const type = (contentType.split(";")[0] ?? "").trim().toLowerCase();
  return type === "application/json" || (type.startsWith("application/") && type.endsWith("+json"));
}

type WriteCallback = (error?: Error | null) => void;

/**
 * Holds the handler's response back until it is settled: stored as the key's
 * result (then sent), or, for a status that is not stored, the key released
 * (then sent).
 */
function capture(config: Config, res: Response, key: string, requestId: string): void {
  const original = { writeHead: res.writeHead, write: res.write, end: res.end, flushHeaders: res.flushHeaders };
  const chunks: Buffer[] = [];
  let ended = false;
  const toBuffer = (chunk: unknown, encoding: unknown): Buffer | undefined => {
    if (chunk === undefined || chunk === null || typeof chunk === "function") return undefined;
    if (Buffer.isBuffer(chunk)) return chunk;
    if (chunk instanceof Uint8Array) return Buffer.from(chunk.buffer, chunk.byteOffset, chunk.byteLength);
    return Buffer.from(String(chunk), typeof encoding === "string" ? (encoding as BufferEncoding) : "utf8");
  };
  res.writeHead = function writeHead(this: Response, status: number, ...rest: unknown[]): Response {
    this.statusCode = status;
    let headers = rest[0];
    if (typeof headers === "string") {
      this.statusMessage = headers;
      headers = rest[1];
    }
    if (Array.isArray(headers)) {
      // Either [[name, value], ...] or a flat [name, value, name, value, ...].
      if (headers.every((h) => Array.isArray(h))) {
        for (const [n, v] of headers as [string, string][]) this.appendHeader(n, v);
      } else {
        for (let i = 0; i + 1 < headers.length; i += 2) this.appendHeader(String(headers[i]), String(headers[i + 1]));
      }
    } else if (typeof headers === "object" && headers !== null) {
      for (const [n, v] of Object.entries(headers)) {
        if (v !== undefined) this.setHeader(n, v as string | number | readonly string[]);
      }
    }
    return this;
  } as typeof res.writeHead;
  res.flushHeaders = function flushHeaders(): void {} as typeof res.flushHeaders;
  res.write = function write(this: Response, chunk: unknown, encoding?: unknown, cb?: unknown): boolean {
    const b = toBuffer(chunk, encoding);
    if (b !== undefined && !ended) chunks.push(b);
    const callback = (typeof encoding === "function" ? encoding : cb) as WriteCallback | undefined;
    if (callback !== undefined) process.nextTick(callback);
    return true;
  } as typeof res.write;
  res.end = function end(this: Response, chunk?: unknown, encoding?: unknown, cb?: unknown): Response {
    if (ended) return this;
    ended = true;
    const b = toBuffer(chunk, encoding);
    if (b !== undefined) chunks.push(b);
    const callback = [chunk, encoding, cb].find((x) => typeof x === "function") as (() => void) | undefined;
    const body = Buffer.concat(chunks);
    settle(config, this, key, requestId, body).finally(() => {
      this.writeHead = original.writeHead;
      this.write = original.write;
      this.flushHeaders = original.flushHeaders;
      this.end = original.end;
      if (callback === undefined) this.end(body);
      else this.end(body, callback);
    });
    return this;
  } as typeof res.end;
}

async function settle(config: Config, res: Response, key: string, requestId: string, body: Buffer): Promise<void> {
  const status = res.statusCode;
  if (!config.storeStatuses(status)) {
    try {
      await config.client.releaseKey(config.bizType, key, { ...config.call, requestId });
    } catch (e) {
      // Retries answer 409 until the key is released (by you, or an operator).
      config.onLedgerError(e, "release");
    }
    return;
  }
  const stored = storedOf(status, res.getHeaders(), config.storeHeaders, body);
  try {
    await config.client.recordKeyResult(config.bizType, key, stored, { ...config.call, requestId });
  } catch (e) {
    // The handler ran: the key stays consumed, and retries answer 409 until a response is recorded.
    config.onLedgerError(e, "record");
  }
}
