/**
 * The guard: the whole exactly-once pattern in one call. Consume; when this
 * attempt won, run the caller's step; record its output as the result, or
 * release the token (key) when the step failed before any side effect.
 *
 * The safe answer is the default: an error the step throws counts as *after*
 * side effects, so the token stays consumed and nothing runs twice. Only an
 * error wrapped with {@link beforeSideEffects} (a {@link BeforeSideEffectsError})
 * gives the token back.
 *
 * | the step | the guard | you get |
 * |---|---|---|
 * | returns `output` | records `output` as the result | `{status: "ran", output}` |
 * | throws `beforeSideEffects(e)` | releases the token | throws `GuardError` kind `before_side_effects` (`released` says whether the release worked) |
 * | throws anything else | keeps it consumed | throws `GuardError` kind `after_side_effects` |
 *
 * When another attempt consumed it the step does not run: `{status:
 * "completed", output}` with the output it recorded, `{status: "in_progress"}`
 * while it has recorded nothing, `{status: "uncertain"}` when its processing
 * lease ran out without a result (its outcome is unknown).
 */

import type { CallOptions, LedgerClient } from "./client.js";
import type { LedgerError } from "./errors.js";
import { newRequestId } from "./ids.js";
import type { ConsumeOutcome, ConsumeRequest, Json, KeyConsumeRequest } from "./types.js";

/** The business step: runs at most once per token (key). Its output is recorded as JSON (`JSON.stringify`). */
export type Step<R> = () => R | Promise<R>;

export type GuardOutcome<R> =
  /** This attempt won, ran the step, and recorded its output. */
  | { status: "ran"; output: R; request_id: string }
  /** An earlier attempt ran it; this is the output it recorded. The step did not run. */
  | { status: "completed"; output: R; request_id: string }
  /** Another attempt holds it and recorded nothing yet (running, or dead: an operator releases it). Ask later. */
  | { status: "in_progress"; consumed_at: string | null; request_id: string }
  /** The holder's lease ran out without a result: the step's outcome is unknown; not safe to retry blindly. */
  | { status: "uncertain"; consumed_at: string | null; request_id: string };

export interface GuardOptions<R> {
  /** Checks an earlier attempt's recorded result before it is returned as `output` (throw to refuse it). */
  parse?: (stored: Json) => R;
  /** Passed to every ledger call of the guard. */
  call?: CallOptions;
}

/** A step's failure that happened before any side effect: the guard gives the token back. */
export class BeforeSideEffectsError extends Error {
  constructor(cause: unknown) {
    super(cause instanceof Error ? cause.message : String(cause), { cause });
    this.name = "BeforeSideEffectsError";
  }
}

/** Marks an error as thrown before any side effect: `throw beforeSideEffects(new Error("no stock"))`. */
export function beforeSideEffects(cause: unknown): BeforeSideEffectsError {
  return cause instanceof BeforeSideEffectsError ? cause : new BeforeSideEffectsError(cause);
}

/**
 * What went wrong in a guarded run (`kind`):
 * - `consume`: the consume failed and the step did not run (`cause` is the
 *   `LedgerError`: `token_expired` → issue a new token; `fingerprint_mismatch`
 *   → this token belongs to another request; `unavailable`/`network_error` →
 *   run the same guard again later).
 * - `before_side_effects`: the step failed before any side effect (`cause` is
 *   what it threw, unwrapped). `released` tells whether the token was given
 *   back (else `releaseError` says why; it stays consumed then).
 * - `after_side_effects`: the step failed and side effects may have happened:
 *   the token stays consumed until you record a result or an operator releases it.
 * - `record`: the step succeeded but its `output` could not be recorded:
 *   record it yourself when the ledger is back; until then duplicates answer `in_progress`.
 * - `stored_result`: `parse` refused an earlier attempt's recorded `result`.
 */
export class GuardError<R = unknown> extends Error {
  readonly kind: "consume" | "before_side_effects" | "after_side_effects" | "record" | "stored_result";
  readonly released: boolean;
  readonly releaseError: LedgerError | undefined;
  readonly output: R | undefined;
  readonly result: Json | undefined;

  constructor(
    kind: GuardError["kind"],
    cause: unknown,
    extra: { released?: boolean; releaseError?: LedgerError; output?: R; result?: Json } = {},
  ) {
    const why = cause instanceof Error ? cause.message : String(cause);
    super(`${MESSAGES[kind]}${kind === "before_side_effects" && extra.released !== true ? " (the release failed: the token stays consumed)" : ""}: ${why}`, {
      cause,
    });
    this.name = "GuardError";
    this.kind = kind;
    this.released = extra.released ?? false;
    this.releaseError = extra.releaseError;
    this.output = extra.output;
    this.result = extra.result;
  }
}

const MESSAGES: Record<GuardError["kind"], string> = {
  consume: "consume failed, the step did not run",
  before_side_effects: "the step failed before side effects",
  after_side_effects: "the step failed after side effects may have happened (token kept)",
  record: "the step succeeded, recording its result failed",
  stored_result: "the recorded result was refused by parse",
};

interface Target {
  consume(): Promise<ConsumeOutcome>;
  record(result: unknown): Promise<unknown>;
  release(): Promise<void>;
}

/** Guards `step` with a token the ledger issued. */
export function guardToken<R>(
  client: LedgerClient,
  token: string,
  request: ConsumeRequest,
  step: Step<R>,
  options: GuardOptions<R> = {},
): Promise<GuardOutcome<R>> {
  const req = { ...request, request_id: request.request_id ?? newRequestId() };
  return run(
    {
      consume: () => client.consume(token, req, options.call),
      record: (result) => client.recordResult(token, req.subject, result, { ...options.call, requestId: req.request_id }),
      release: () => client.release(token, req.subject, { ...options.call, requestId: req.request_id }),
    },
    step,
    options,
  );
}

/** Guards `step` with a client-supplied key. */
export function guardKey<R>(
  client: LedgerClient,
  request: KeyConsumeRequest,
  step: Step<R>,
  options: GuardOptions<R> = {},
): Promise<GuardOutcome<R>> {
  const req = { ...request, request_id: request.request_id ?? newRequestId() };
  return run(
    {
      consume: () => client.consumeKey(req, options.call),
      record: (result) => client.recordKeyResult(req.biz_type, req.key, result, { ...options.call, requestId: req.request_id }),
      release: () => client.releaseKey(req.biz_type, req.key, { ...options.call, requestId: req.request_id }),
    },
    step,
    options,
  );
}

async function run<R>(target: Target, step: Step<R>, options: GuardOptions<R>): Promise<GuardOutcome<R>> {
  let outcome: ConsumeOutcome;
  try {
    outcome = await target.consume();
  } catch (e) {
    throw new GuardError<R>("consume", e);
  }
  const request_id = outcome.request_id;
  if (outcome.outcome === "duplicate") {
    switch (outcome.status) {
      case "processing":
        return { status: "in_progress", consumed_at: outcome.consumed_at, request_id };
      case "uncertain":
        return { status: "uncertain", consumed_at: outcome.consumed_at, request_id };
      case "completed": {
        if (options.parse === undefined) return { status: "completed", output: outcome.result as R, request_id };
        try {
          return { status: "completed", output: options.parse(outcome.result), request_id };
        } catch (e) {
          throw new GuardError<R>("stored_result", e, { result: outcome.result });
        }
      }
    }
  }
  let output: R;
  try {
    output = await step();
  } catch (e) {
    if (e instanceof BeforeSideEffectsError) {
      try {
        await target.release();
      } catch (releaseError) {
        throw new GuardError<R>("before_side_effects", e.cause, { released: false, releaseError: releaseError as LedgerError });
      }
      throw new GuardError<R>("before_side_effects", e.cause, { released: true });
    }
    throw new GuardError<R>("after_side_effects", e);
  }
  try {
    await target.record(output === undefined ? null : output);
  } catch (e) {
    throw new GuardError<R>("record", e, { output });
  }
  return { status: "ran", output, request_id };
}
