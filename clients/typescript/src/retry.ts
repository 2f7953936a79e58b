/**
 * The retry policy: which failures are tried again (503, no answer, a try
 * that timed out; never a 4xx), how long to wait between tries (jittered
 * exponential backoff, never less than `Retry-After`), and when to give up
 * (a number of tries and a total deadline).
 *
 * Retrying is safe because a logical call is serialized once and sent as the
 * same bytes on every try: a consume carries the same `request_id` each time,
 * so a try whose answer was lost after the ledger committed it is answered
 * `consumed` again on the next try (with `Idempotent-Replayed: true`), never
 * `duplicate`.
 */

export interface RetryPolicy {
  /** Tries in all, the first included (at least 1). Default 5. */
  maxAttempts: number;
  /** The first wait; each next one doubles up to `maxDelayMs`. Default 50. */
  minDelayMs: number;
  /** Default 2000. */
  maxDelayMs: number;
  /** Lengthen each wait by a random part of up to itself. Default true. */
  jitter: boolean;
  /**
   * The whole logical call, tries and waits, ends by then: a wait that would
   * cross it (a long `Retry-After` included) is not taken, and the last error
   * is thrown. Default 10000.
   */
  deadlineMs: number;
  /** One try may take this long (capped by what is left of the deadline). Default 5000. */
  attemptTimeoutMs: number;
}

export const DEFAULT_RETRY: Readonly<RetryPolicy> = Object.freeze({
  maxAttempts: 5,
  minDelayMs: 50,
  maxDelayMs: 2000,
  jitter: true,
  deadlineMs: 10_000,
  attemptTimeoutMs: 5000,
});

/** One try, no retries (the deadline and per-try timeout still apply). */
export const NO_RETRY: Readonly<RetryPolicy> = Object.freeze({ ...DEFAULT_RETRY, maxAttempts: 1 });

/** A complete policy from the defaults and what the caller set; refuses nonsense. */
export function retryPolicy(partial: Partial<RetryPolicy> = {}): RetryPolicy {
  const p: RetryPolicy = { ...DEFAULT_RETRY, ...dropUndefined(partial) };
  for (const [name, value] of Object.entries(p)) {
    if (name === "jitter") {
      if (typeof value !== "boolean") throw new TypeError(`retry.jitter must be a boolean`);
    } else if (typeof value !== "number" || !Number.isFinite(value) || value < 0) {
      throw new TypeError(`retry.${name} must be a finite number >= 0, got ${String(value)}`);
    }
  }
  p.maxAttempts = Math.max(1, Math.floor(p.maxAttempts));
  p.maxDelayMs = Math.max(p.maxDelayMs, p.minDelayMs);
  return p;
}

function dropUndefined<T extends object>(o: T): Partial<T> {
  return Object.fromEntries(Object.entries(o).filter(([, v]) => v !== undefined)) as Partial<T>;
}

/** The wait before try number `attempt + 1` (attempt counts from 1), before `Retry-After`. */
export function backoffMs(policy: RetryPolicy, attempt: number, random: () => number = Math.random): number {
  const base = Math.min(policy.maxDelayMs, policy.minDelayMs * 2 ** (attempt - 1));
  return policy.jitter ? base + random() * base : base;
}

/**
 * `Retry-After` in whole seconds (the form the ledger sends). An HTTP date or
 * garbage counts as absent: the backoff alone decides then.
 */
export function parseRetryAfter(value: string | null | undefined): number | undefined {
  if (value == null) return undefined;
  const t = value.trim();
  return /^\d{1,9}$/.test(t) ? Number(t) : undefined;
}
