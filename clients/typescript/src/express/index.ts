/**
 * `@idempotency-ledger/client/express`: the `Idempotency-Key` middleware for
 * Express (and NestJS on Express). Needs `express` (4.18+ or 5) installed.
 */

export {
  defaultScope,
  defaultStoreStatuses,
  idempotency,
  type IdempotencyOptions,
} from "./middleware.js";
export { PROBLEM_TYPE_BASE, problem, type Problem, type ProblemCode } from "./problem.js";
export { IDEMPOTENCY_KEY, MAX_KEY, isSafe, ledgerKey, readKey, type KeyRead } from "./key.js";
export {
  BODY_OMITTED_HEADER,
  DEFAULT_STORED_HEADERS,
  MAX_STORED,
  REPLAYED_HEADER,
  parseStored,
  storedOf,
  type Stored,
} from "./stored.js";
