/** Request ids: one per logical attempt, kept across its tries. */

import { randomUUID } from "node:crypto";

/** A new logical attempt's `request_id`: a random UUID. */
export function newRequestId(): string {
  return randomUUID();
}
