/**
 * The request and answer shapes of the ledger's API (docs/api.md), in the
 * API's own snake_case: what you read here is what goes over the wire.
 * Times are RFC 3339 UTC strings.
 */

/** Any JSON value. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

// ---- tokens ----------------------------------------------------------------

/** `POST /v1/tokens`. */
export interface IssueRequest {
  biz_type: string;
  /** Your user: 1 to 128 characters, no control characters. */
  subject: string;
  /** 1 to the biz type's ttl; default the biz type's ttl. */
  ttl_seconds?: number;
}

export interface Issued {
  token: string;
  biz_type: string;
  subject: string;
  expires_at: string;
  /** Seconds the token lives. */
  expire_time: number;
}

/**
 * The body of `POST /v1/tokens/{token}/consume`: one logical attempt. Without
 * a `request_id` the client draws one (a random UUID) for this call and sends
 * it on every try; the outcome tells you which it was.
 */
export interface ConsumeRequest {
  subject: string;
  /** Checked against the token's own biz type (another: `token_mismatch`). */
  biz_type?: string;
  /** A hash of the business request (see `fingerprint`): another one later is `fingerprint_mismatch`. */
  fingerprint?: string;
  /** 1 to 128 printable ASCII characters; keep it to continue an attempt. */
  request_id?: string;
  /**
   * 0 to 10000: wait this long for a running winner to finish instead of
   * answering `processing` (a ledger without it answers `invalid_request`).
   */
  wait_ms?: number;
}

/** `POST /v1/keys/consume`: as {@link ConsumeRequest}, for a client-supplied key. */
export interface KeyConsumeRequest {
  biz_type: string;
  /** 1 to 255 printable ASCII characters. */
  key: string;
  /** Recorded for audit; every call for this key must then name the same one. */
  subject?: string;
  fingerprint?: string;
  request_id?: string;
  wait_ms?: number;
}

/**
 * What a consume answered. Only `consumed` lets you run the business step.
 *
 * - `consumed`: this logical attempt won. `replayed` is true when an earlier
 *   try of this same attempt (same `request_id`) won and its answer was lost:
 *   you are still the winner.
 * - `duplicate` / `processing`: another attempt holds it and has recorded
 *   nothing yet (running, or dead: then an operator releases it).
 * - `duplicate` / `completed`: another attempt ran it; `result` is what it recorded.
 * - `duplicate` / `uncertain`: the holder's processing lease ran out without a
 *   result: the step's outcome is unknown, a retry is not safe until someone knows.
 */
export type ConsumeOutcome =
  | {
      outcome: "consumed";
      /** The `request_id` this attempt was sent with. */
      request_id: string;
      replayed: boolean;
      consumed_at: string;
    }
  | {
      outcome: "duplicate";
      request_id: string;
      status: DuplicateStatus;
      consumed_at: string | null;
      /** The recorded result (`completed`); null otherwise. */
      result: Json;
    };

export type DuplicateStatus = "processing" | "completed" | "uncertain";

/** The state of a token or key (`issued` for a released key). */
export type State = "issued" | "consumed" | "uncertain" | "expired" | (string & {});

/** `GET /v1/tokens/{token}?subject=`. */
export interface TokenState {
  token: string;
  biz_type: string;
  state: State;
  expires_at: string;
  consumed_at: string | null;
  result: Json;
}

/** `GET /v1/keys?biz_type=&key=`. */
export interface KeyState {
  key: string;
  biz_type: string;
  state: State;
  consumed_at: string | null;
  result: Json;
}

/** A result was recorded. `replayed`: this very result was already recorded. */
export interface Recorded {
  replayed: boolean;
}

// ---- orders ------------------------------------------------------------------

/** `POST /v1/orders`. */
export interface CreateOrder {
  /** 1 to 64 characters of `[A-Za-z0-9_-]`, unique across all clients. */
  order_id: string;
  subject: string;
  /** 1 to 10^15, in minor units. */
  amount_minor: number;
  /** ISO 4217, `[A-Z]{3}`. */
  currency: string;
}

export type OrderState = "CREATED" | "PAID" | "PARTIALLY_REFUNDED" | "REFUNDED" | "CLOSED";

export interface OrderEvent {
  /** `order.created`, `order.paid`, `order.refunded` or `order.closed`. */
  kind: string;
  /** The token the event consumed (none for `order.created`). */
  token?: string | null;
  amount_minor: number;
  at: string;
}

export interface Order {
  order_id: string;
  subject: string;
  state: OrderState;
  amount_minor: number;
  refunded_minor: number;
  currency: string;
  created_at: string;
  updated_at: string;
  /** Oldest first, starting with `order.created`. */
  events: OrderEvent[];
}

export interface OrderCreated {
  order: Order;
  /** False when this identical order already existed (a retry). */
  created: boolean;
}

/** `POST /v1/orders/{id}/pay`; without `request_id` the client draws one. */
export interface Pay {
  token: string;
  fingerprint?: string;
  request_id?: string;
}

/** `POST /v1/orders/{id}/refund`. */
export interface Refund {
  token: string;
  amount_minor: number;
  /** Up to 256 characters. */
  reason?: string;
  request_id?: string;
}

/** `POST /v1/orders/{id}/close`. */
export interface Close {
  token: string;
  request_id?: string;
}

/**
 * What an order event answered: `applied` by this request (`replayed`: an
 * earlier try of it, same `request_id`, did and its answer was lost), or a
 * `duplicate` of the same event applied earlier by another request.
 */
export interface EventOutcome {
  outcome: "applied" | "duplicate";
  request_id: string;
  replayed: boolean;
  order: Order;
}
