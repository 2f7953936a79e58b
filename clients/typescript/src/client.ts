/**
 * The client: the base URL, the API key, the retry policy, and the one place
 * where a request is sent, retried and its answer read (`call`). Every route
 * of the payment path is a method: tokens, client keys, orders.
 */

import { setTimeout as sleep } from "node:timers/promises";

import { LedgerError, isRecord } from "./errors.js";
import { newRequestId } from "./ids.js";
import { guardKey, guardToken, type GuardOptions, type GuardOutcome, type Step } from "./guard.js";
import { backoffMs, parseRetryAfter, retryPolicy, type RetryPolicy } from "./retry.js";
import type {
  Close,
  ConsumeOutcome,
  ConsumeRequest,
  CreateOrder,
  EventOutcome,
  IssueRequest,
  Issued,
  Json,
  KeyConsumeRequest,
  KeyState,
  Order,
  OrderCreated,
  Pay,
  Recorded,
  Refund,
  TokenState,
} from "./types.js";

/** The header the ledger sets on every answer that repeats an earlier one. */
export const REPLAYED = "idempotent-replayed";

export interface ClientOptions {
  /** The ledger, e.g. `http://127.0.0.1:8080` (http or https; a path prefix is kept). */
  baseUrl: string;
  /** Sent as `Authorization: Bearer <apiKey>`; never logged or printed. */
  apiKey: string;
  /** The retry policy of every call (defaults: see {@link DEFAULT_RETRY}). */
  retry?: Partial<RetryPolicy>;
  /** A `fetch` to use instead of the global one (tests, instrumentation). */
  fetch?: typeof fetch;
}

/** Per call: another retry policy, or a signal that cancels the call (`aborted`). */
export interface CallOptions {
  retry?: Partial<RetryPolicy>;
  signal?: AbortSignal;
}

/**
 * A result or release call's options: `requestId` names the consume it
 * belongs to (the `request_id` that consume sent). With it, the call applies
 * only while that consume holds the token or key; after a release and
 * another attempt's consume it is refused (`not_consumed` / `not_releasable`)
 * instead of writing onto the other attempt's consume.
 */
export interface SettleOptions extends CallOptions {
  requestId?: string;
}

/** A success answer: its status, whether it repeats an earlier one, its JSON body. */
interface Answer {
  status: number;
  replayed: boolean;
  body: unknown;
}

type Query = Record<string, string>;

/**
 * A handle on one ledger. Make one per process and share it: it holds no
 * connection of its own (Node's `fetch` pools them).
 */
export class LedgerClient {
  readonly #base: URL;
  readonly #auth: string;
  readonly #retry: RetryPolicy;
  readonly #fetch: typeof fetch;

  constructor(options: ClientOptions) {
    let base: URL;
    try {
      base = new URL(options.baseUrl);
    } catch {
      throw new TypeError(`baseUrl ${JSON.stringify(options.baseUrl)} is not a URL`);
    }
    if (base.protocol !== "http:" && base.protocol !== "https:") {
      throw new TypeError(`baseUrl ${JSON.stringify(options.baseUrl)} must be http:// or https://`);
    }
    if (typeof options.apiKey !== "string" || options.apiKey === "" || !/^[\x21-\x7e]+$/.test(options.apiKey)) {
      throw new TypeError("apiKey must be a non-empty string of printable ASCII characters");
    }
    base.search = "";
    base.hash = "";
    if (!base.pathname.endsWith("/")) base.pathname += "/";
    this.#base = base;
    this.#auth = `Bearer ${options.apiKey}`;
    this.#retry = retryPolicy(options.retry);
    this.#fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
  }

  /** The ledger's base URL (never the API key). */
  get baseUrl(): string {
    return this.#base.href;
  }

  /** The effective retry policy. */
  get retryPolicy(): Readonly<RetryPolicy> {
    return this.#retry;
  }

  // ---- tokens ----------------------------------------------------------------

  /**
   * Issues a token (`POST /v1/tokens`). A try whose answer was lost costs an
   * unused token that simply expires.
   */
  async issue(request: IssueRequest, options?: CallOptions): Promise<Issued> {
    const a = await this.#call("POST", ["v1", "tokens"], undefined, request, options);
    return a.body as Issued;
  }

  /**
   * Consumes `token` for one attempt (`POST /v1/tokens/{token}/consume`).
   * Only `outcome: "consumed"` lets you run the business step.
   */
  async consume(token: string, request: ConsumeRequest, options?: CallOptions): Promise<ConsumeOutcome> {
    const body = { ...request, request_id: request.request_id ?? newRequestId() };
    const a = await this.#call("POST", ["v1", "tokens", token, "consume"], undefined, body, options);
    return consumeOutcome(a, body.request_id);
  }

  /**
   * Records the business result of a token this client consumed: any value
   * `JSON.stringify` takes, at most 64 KiB with the request.
   */
  async recordResult(token: string, subject: string, result: unknown, options?: SettleOptions): Promise<Recorded> {
    const body = { subject, result, request_id: options?.requestId };
    const a = await this.#call("POST", ["v1", "tokens", token, "result"], undefined, body, options);
    expectOutcome(a, "recorded");
    return { replayed: a.replayed };
  }

  /**
   * Gives a consumed token back, for a step that failed before any side
   * effect: the same token can be consumed again. `not_releasable` when it has
   * a result or an order event, or is not consumed.
   */
  async release(token: string, subject: string, options?: SettleOptions): Promise<void> {
    const body = { subject, request_id: options?.requestId };
    const a = await this.#call("POST", ["v1", "tokens", token, "release"], undefined, body, options);
    expectOutcome(a, "released");
  }

  /** Reads a token's state without consuming it (`GET /v1/tokens/{token}`). */
  async tokenState(token: string, subject: string, options?: CallOptions): Promise<TokenState> {
    const a = await this.#call("GET", ["v1", "tokens", token], { subject }, undefined, options);
    return a.body as TokenState;
  }

  // ---- client-supplied keys ------------------------------------------------------

  /** Consumes a key (`POST /v1/keys/consume`); the first consume creates it. */
  async consumeKey(request: KeyConsumeRequest, options?: CallOptions): Promise<ConsumeOutcome> {
    const body = { ...request, request_id: request.request_id ?? newRequestId() };
    const a = await this.#call("POST", ["v1", "keys", "consume"], undefined, body, options);
    return consumeOutcome(a, body.request_id);
  }

  /** Records the result of a key this client consumed (`POST /v1/keys/result`). */
  async recordKeyResult(bizType: string, key: string, result: unknown, options?: SettleOptions): Promise<Recorded> {
    const body = { biz_type: bizType, key, result, request_id: options?.requestId };
    const a = await this.#call("POST", ["v1", "keys", "result"], undefined, body, options);
    expectOutcome(a, "recorded");
    return { replayed: a.replayed };
  }

  /** Gives a consumed key back (`POST /v1/keys/release`). */
  async releaseKey(bizType: string, key: string, options?: SettleOptions): Promise<void> {
    const body = { biz_type: bizType, key, request_id: options?.requestId };
    const a = await this.#call("POST", ["v1", "keys", "release"], undefined, body, options);
    expectOutcome(a, "released");
  }

  /** Reads a key's state (`GET /v1/keys`); a key nobody consumed throws `key_not_found`. */
  async keyState(bizType: string, key: string, options?: CallOptions): Promise<KeyState> {
    const a = await this.#call("GET", ["v1", "keys"], { biz_type: bizType, key }, undefined, options);
    return a.body as KeyState;
  }

  // ---- orders ------------------------------------------------------------------

  /** Creates an order; the identical order again answers it with `created: false`. */
  async createOrder(order: CreateOrder, options?: CallOptions): Promise<OrderCreated> {
    const a = await this.#call("POST", ["v1", "orders"], undefined, order, options);
    return { order: a.body as Order, created: a.status === 201 };
  }

  /** The order with its events (`GET /v1/orders/{id}`). */
  async order(orderId: string, options?: CallOptions): Promise<Order> {
    const a = await this.#call("GET", ["v1", "orders", orderId], undefined, undefined, options);
    return a.body as Order;
  }

  /** CREATED -> PAID. */
  pay(orderId: string, pay: Pay, options?: CallOptions): Promise<EventOutcome> {
    return this.#event(orderId, "pay", pay, options);
  }

  /** PAID / PARTIALLY_REFUNDED -> PARTIALLY_REFUNDED / REFUNDED. */
  refund(orderId: string, refund: Refund, options?: CallOptions): Promise<EventOutcome> {
    return this.#event(orderId, "refund", refund, options);
  }

  /** CREATED -> CLOSED. */
  close(orderId: string, close: Close, options?: CallOptions): Promise<EventOutcome> {
    return this.#event(orderId, "close", close, options);
  }

  async #event(
    orderId: string,
    event: string,
    request: Pay | Refund | Close,
    options: CallOptions | undefined,
  ): Promise<EventOutcome> {
    const body = { ...request, request_id: request.request_id ?? newRequestId() };
    const a = await this.#call("POST", ["v1", "orders", orderId, event], undefined, body, options);
    const b = a.body;
    if (!isRecord(b) || (b["outcome"] !== "applied" && b["outcome"] !== "duplicate") || !isRecord(b["order"])) {
      throw invalidResponse(a.status, "expected an order event outcome");
    }
    return { outcome: b["outcome"], request_id: body.request_id, replayed: a.replayed, order: b["order"] as unknown as Order };
  }

  // ---- the guard ---------------------------------------------------------------

  /** Consume `token`, run `step` only if this attempt won, record its output; see {@link guardToken}. */
  guardToken<R>(token: string, request: ConsumeRequest, step: Step<R>, options?: GuardOptions<R>): Promise<GuardOutcome<R>> {
    return guardToken(this, token, request, step, options);
  }

  /** The same with a client-supplied key; see {@link guardKey}. */
  guardKey<R>(request: KeyConsumeRequest, step: Step<R>, options?: GuardOptions<R>): Promise<GuardOutcome<R>> {
    return guardKey(this, request, step, options);
  }

  // ---- the wire ------------------------------------------------------------------

  #url(segments: string[], query: Query | undefined): URL {
    const url = new URL(segments.map(encodeURIComponent).join("/"), this.#base);
    for (const [k, v] of Object.entries(query ?? {})) url.searchParams.append(k, v);
    return url;
  }

  /**
   * Sends one logical request, retried by the policy, and reads the answer.
   * The body is serialized once, so every try sends the same bytes (the same
   * `request_id`).
   */
  async #call(
    method: "GET" | "POST",
    segments: string[],
    query: Query | undefined,
    body: unknown,
    options: CallOptions | undefined,
  ): Promise<Answer> {
    const policy = options?.retry === undefined ? this.#retry : retryPolicy({ ...this.#retry, ...options.retry });
    const url = this.#url(segments, query);
    const bytes = body === undefined ? undefined : JSON.stringify(body);
    const signal = options?.signal;
    const started = performance.now();
    for (let attempt = 1; ; attempt++) {
      const left = policy.deadlineMs - (performance.now() - started);
      let err: LedgerError;
      try {
        return await this.#tryOnce(method, url, bytes, Math.max(1, Math.ceil(Math.min(policy.attemptTimeoutMs, left))), signal);
      } catch (e) {
        if (!(e instanceof LedgerError) || !e.retryable) throw e;
        err = e;
      }
      if (attempt >= policy.maxAttempts) throw err;
      const wait = Math.max(backoffMs(policy, attempt), (err.retryAfterSeconds ?? 0) * 1000);
      if (performance.now() - started + wait >= policy.deadlineMs) throw err;
      try {
        await sleep(Math.ceil(wait), undefined, signal === undefined ? undefined : { signal });
      } catch (e) {
        throw new LedgerError({ code: "aborted", message: "the call was aborted while waiting to retry", cause: e });
      }
    }
  }

  async #tryOnce(
    method: string,
    url: URL,
    body: string | undefined,
    timeoutMs: number,
    signal: AbortSignal | undefined,
  ): Promise<Answer> {
    if (signal?.aborted) {
      throw new LedgerError({ code: "aborted", message: "the call was aborted", cause: signal.reason });
    }
    const timeout = AbortSignal.timeout(timeoutMs);
    const headers: Record<string, string> = { authorization: this.#auth, accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    let status: number;
    let replayed: boolean;
    let retryAfter: number | undefined;
    let text: string;
    try {
      const resp = await this.#fetch(url, {
        method,
        headers,
        body: body ?? null,
        redirect: "manual",
        signal: signal === undefined ? timeout : AbortSignal.any([signal, timeout]),
      });
      status = resp.status;
      replayed = resp.headers.get(REPLAYED)?.toLowerCase() === "true";
      retryAfter = parseRetryAfter(resp.headers.get("retry-after"));
      text = await resp.text();
    } catch (e) {
      if (signal?.aborted) {
        throw new LedgerError({ code: "aborted", message: "the call was aborted", cause: e });
      }
      if (timeout.aborted) {
        throw new LedgerError({ code: "timeout", message: `no answer within ${Math.round(timeoutMs)} ms`, cause: e });
      }
      const why = e instanceof Error ? (e.cause instanceof Error ? e.cause.message : e.message) : String(e);
      throw new LedgerError({ code: "network_error", message: why, cause: e });
    }
    if (status < 200 || status > 299) throw LedgerError.fromAnswer(status, retryAfter, text);
    let parsed: unknown;
    try {
      parsed = text === "" ? undefined : JSON.parse(text);
    } catch (e) {
      throw invalidResponse(status, "the body is not JSON", e);
    }
    return { status, replayed, body: parsed };
  }
}

function invalidResponse(status: number, message: string, cause?: unknown): LedgerError {
  return new LedgerError({ code: "invalid_response", status, message, cause });
}

function expectOutcome(a: Answer, want: string): void {
  if (!isRecord(a.body) || a.body["outcome"] !== want) {
    throw invalidResponse(a.status, `expected outcome ${JSON.stringify(want)}`);
  }
}

const DUPLICATE_STATUSES = new Set(["processing", "completed", "uncertain"]);

function consumeOutcome(a: Answer, requestId: string): ConsumeOutcome {
  const b = a.body;
  if (isRecord(b) && b["outcome"] === "consumed" && typeof b["consumed_at"] === "string") {
    return { outcome: "consumed", request_id: requestId, replayed: a.replayed, consumed_at: b["consumed_at"] };
  }
  if (isRecord(b) && b["outcome"] === "duplicate" && typeof b["status"] === "string" && DUPLICATE_STATUSES.has(b["status"])) {
    return {
      outcome: "duplicate",
      request_id: requestId,
      status: b["status"] as "processing" | "completed" | "uncertain",
      consumed_at: typeof b["consumed_at"] === "string" ? b["consumed_at"] : null,
      result: (b["result"] ?? null) as Json,
    };
  }
  throw invalidResponse(a.status, "expected a consume outcome");
}
