/**
 * Errors: every call of the client either returns the answer it documents or
 * throws a {@link LedgerError}.
 *
 * An error answer of the ledger (`{"error": "<code>", "message": "..."}`)
 * keeps its code, status, `Retry-After` and whole body. Failures on the way
 * get codes of their own that the API never uses:
 *
 * | code | meaning |
 * |---|---|
 * | `network_error` | no answer: connecting failed or the connection broke |
 * | `timeout` | a try took longer than the retry policy's `attemptTimeoutMs` |
 * | `aborted` | the caller's `AbortSignal` fired |
 * | `invalid_response` | a success answer this client could not read |
 * | `http_<status>` | an error answer that is not the ledger's JSON shape (a proxy's page, say); a non-JSON 503 is `unavailable` |
 */

/** Codes of failures that are not an answer of the ledger. */
export type TransportCode = "network_error" | "timeout" | "aborted" | "invalid_response";

/** The API's error codes this version knows (others arrive as plain strings). */
export type ApiErrorCode =
  | "invalid_request"
  | "token_invalid"
  | "token_expired"
  | "token_mismatch"
  | "fingerprint_mismatch"
  | "result_already_set"
  | "not_consumed"
  | "not_releasable"
  | "unavailable"
  | "rate_limited"
  | "unauthorized"
  | "forbidden"
  | "unknown_biz_type"
  | "not_found"
  | "method_not_allowed"
  | "payload_too_large"
  | "unsupported_media_type"
  | "uri_too_long"
  | "headers_too_large"
  | "key_not_found"
  | "order_not_found"
  | "order_conflict"
  | "illegal_transition"
  | "refund_exceeds_paid"
  | "durable_token_required"
  | "token_already_used"
  | "internal";

export interface LedgerErrorInit {
  code: string;
  message: string;
  status?: number | undefined;
  retryAfterSeconds?: number | undefined;
  body?: Record<string, unknown> | undefined;
  cause?: unknown;
}

/** What a call of the ledger threw. Match on {@link LedgerError.code}, never on the message. */
export class LedgerError extends Error {
  /** The API's `error` code (`token_expired`, ...) or a {@link TransportCode}. */
  readonly code: ApiErrorCode | TransportCode | (string & {});
  /** The HTTP status of the ledger's answer; undefined when there was none. */
  readonly status: number | undefined;
  /** The answer's `Retry-After` in seconds (503, 429), when it had one. */
  readonly retryAfterSeconds: number | undefined;
  /**
   * The whole JSON body of the answer: some codes carry more keys (`state`
   * for `illegal_transition`, `refundable_minor` for `refund_exceeds_paid`).
   */
  readonly body: Record<string, unknown>;

  constructor(init: LedgerErrorInit) {
    super(
      init.status === undefined ? `${init.code}: ${init.message}` : `${init.code} (${init.status}): ${init.message}`,
      init.cause === undefined ? undefined : { cause: init.cause },
    );
    this.name = "LedgerError";
    this.code = init.code;
    this.status = init.status;
    this.retryAfterSeconds = init.retryAfterSeconds;
    this.body = init.body ?? {};
  }

  /**
   * Whether the client retries it: no answer (`network_error`, `timeout`) or
   * 503. Every 4xx is final, 429 included: repeating it changes nothing
   * until its `Retry-After` has passed, which is the caller's decision.
   */
  get retryable(): boolean {
    return this.code === "network_error" || this.code === "timeout" || this.status === 503;
  }

  /**
   * Reads an error answer. A body that is not the ledger's error shape still
   * becomes an error: its code is derived from the status, so a 503 from a
   * load balancer is `unavailable` and is retried like the ledger's own.
   */
  static fromAnswer(status: number, retryAfterSeconds: number | undefined, text: string): LedgerError {
    let parsed: unknown;
    try {
      parsed = JSON.parse(text);
    } catch {
      parsed = undefined;
    }
    if (isRecord(parsed) && typeof parsed["error"] === "string") {
      const message = typeof parsed["message"] === "string" ? parsed["message"] : "";
      return new LedgerError({ code: parsed["error"], message, status, retryAfterSeconds, body: parsed });
    }
    const code = status === 503 ? "unavailable" : status === 429 ? "rate_limited" : `http_${status}`;
    return new LedgerError({ code, message: text.slice(0, 512), status, retryAfterSeconds });
  }
}

export function isRecord(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}
