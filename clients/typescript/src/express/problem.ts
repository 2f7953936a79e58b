/**
 * The middleware's own error answers: `application/problem+json` (RFC 9457)
 * with a stable machine-readable `code` and a `type` URI into the docs.
 */

import type { Response } from "express";

/** Every problem `type` is this URI plus `#<code>`. */
export const PROBLEM_TYPE_BASE =
  "https://github.com/idempotency-ledger/idempotency-ledger/blob/main/docs/integration.md";

/**
 * The middleware's problem codes (stable across versions):
 *
 * | code | status | when |
 * |---|---|---|
 * | `idempotency_key_missing` | 400 | no key on an unsafe request where one is required |
 * | `idempotency_key_invalid` | 400 | not 1 to 255 printable ASCII characters (or a bad quoted string, several headers, too long once scoped) |
 * | `idempotency_key_in_use` | 409 | the first request with this key has not finished (`Retry-After`) |
 * | `idempotency_key_uncertain` | 409 | the first request with this key ran past its biz type's processing lease without a stored response: an operator resolves it |
 * | `idempotency_key_reused` | 422 | the key was used for another method, path with query, or body |
 * | `payload_too_large` | 413 | the request body is over `maxRequestBody` |
 * | `ledger_unavailable` | 503 | the ledger could not be reached; the handler did not run (`Retry-After`) |
 * | `ledger_error` | 500 | the ledger refused the key for a reason that is not the request's (a misconfiguration: API key, biz type) |
 * | `stored_response_unreadable` | 500 | a stored response exists for this key but is not one this middleware wrote |
 */
export type ProblemCode =
  | "idempotency_key_missing"
  | "idempotency_key_invalid"
  | "idempotency_key_in_use"
  | "idempotency_key_uncertain"
  | "idempotency_key_reused"
  | "payload_too_large"
  | "ledger_unavailable"
  | "ledger_error"
  | "stored_response_unreadable";

export interface Problem {
  type: string;
  title: string;
  status: number;
  detail: string;
  code: ProblemCode;
}

const TITLES: Record<ProblemCode, [number, string]> = {
  idempotency_key_missing: [400, "Idempotency-Key is missing"],
  idempotency_key_invalid: [400, "Idempotency-Key is invalid"],
  idempotency_key_in_use: [409, "A request is outstanding for this Idempotency-Key"],
  idempotency_key_uncertain: [409, "The outcome of this Idempotency-Key is uncertain"],
  idempotency_key_reused: [422, "Idempotency-Key is already used"],
  payload_too_large: [413, "Request body too large"],
  ledger_unavailable: [503, "Idempotency ledger unavailable"],
  ledger_error: [500, "Idempotency check failed"],
  stored_response_unreadable: [500, "Stored response unreadable"],
};

/** The problem object of `code`. */
export function problem(code: ProblemCode, detail: string): Problem {
  const [status, title] = TITLES[code];
  return { type: `${PROBLEM_TYPE_BASE}#${code}`, title, status, detail, code };
}

/** Answers `code` (with `Retry-After` in whole seconds, at least 1, when given). */
export function sendProblem(res: Response, code: ProblemCode, detail: string, retryAfterSeconds?: number): void {
  const body = problem(code, detail);
  res.statusCode = body.status;
  res.setHeader("content-type", "application/problem+json");
  if (retryAfterSeconds !== undefined) res.setHeader("retry-after", String(Math.max(1, Math.ceil(retryAfterSeconds))));
  res.end(JSON.stringify(body));
}
