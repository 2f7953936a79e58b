/**
 * @idempotency-ledger/client: a typed, fetch-based client of the
 * idempotency-ledger service, and the consume-run-record guard.
 *
 * Layout: `client` (every route, the retry loop), `errors` (`LedgerError`),
 * `retry` (the policy), `types` (the API's shapes), `guard`, `fingerprint`.
 * The Express `Idempotency-Key` middleware is the `./express` entry point.
 */

export { LedgerClient, REPLAYED, type CallOptions, type ClientOptions, type SettleOptions } from "./client.js";
export { LedgerError, type ApiErrorCode, type LedgerErrorInit, type TransportCode } from "./errors.js";
export { DEFAULT_RETRY, NO_RETRY, backoffMs, parseRetryAfter, retryPolicy, type RetryPolicy } from "./retry.js";
export {
  BeforeSideEffectsError,
  GuardError,
  beforeSideEffects,
  guardKey,
  guardToken,
  type GuardOptions,
  type GuardOutcome,
  type Step,
} from "./guard.js";
export { canonicalJson, fingerprint, fingerprintJson, requestFingerprint, shortDigest } from "./fingerprint.js";
export { newRequestId } from "./ids.js";
export type * from "./types.js";
