/**
 * The `Idempotency-Key` header read from a request, the key it becomes in the
 * ledger (scoped), and which methods pass through untouched.
 */

import type { IncomingHttpHeaders } from "node:http";

import { shortDigest } from "../fingerprint.js";

/** The request header carrying the key (matched case-insensitively). */
export const IDEMPOTENCY_KEY = "idempotency-key";
/** The ledger's limit on a key. */
export const MAX_KEY = 255;

const SAFE = new Set(["GET", "HEAD", "OPTIONS", "TRACE"]);

/** GET, HEAD, OPTIONS and TRACE pass through untouched. */
export function isSafe(method: string): boolean {
  return SAFE.has(method.toUpperCase());
}

export type KeyRead = { ok: true; key: string | undefined } | { ok: false; why: string };

/**
 * The key of a request: absent, or its value (an RFC 8941 string such as
 * `"8e03978e"` as the draft writes it, or the bare text as many clients send
 * it), or why it is unusable. `values` are the header's values, one per
 * header line (`req.headersDistinct`).
 */
export function readKey(values: string[] | undefined): KeyRead {
  if (values === undefined || values.length === 0) return { ok: true, key: undefined };
  if (values.length > 1) return { ok: false, why: "send one Idempotency-Key header, not several" };
  const text = (values[0] ?? "").replace(/^[ \t]+|[ \t]+$/g, "");
  let key: string;
  if (text.startsWith('"')) {
    if (text.length < 2 || !text.endsWith('"')) {
      return { ok: false, why: "the quoted Idempotency-Key has no closing quote" };
    }
    key = "";
    const inner = text.slice(1, -1);
    for (let i = 0; i < inner.length; i++) {
      const c = inner[i];
      if (c === "\\") {
        const e = inner[++i];
        if (e !== '"' && e !== "\\") return { ok: false, why: "a bad escape in the quoted Idempotency-Key" };
        key += e;
      } else if (c === '"') {
        return { ok: false, why: "a bare quote inside the quoted Idempotency-Key" };
      } else {
        key += c;
      }
    }
  } else {
    key = text;
  }
  if (key.length === 0 || key.length > MAX_KEY || !/^[\x20-\x7e]+$/.test(key)) {
    return { ok: false, why: `the Idempotency-Key must be 1 to ${MAX_KEY} printable ASCII characters` };
  }
  return { ok: true, key };
}

/** The header's values, one per header line. */
export function keyHeaderValues(headersDistinct: Record<string, string[] | undefined> | undefined, headers: IncomingHttpHeaders): string[] | undefined {
  if (headersDistinct !== undefined) return headersDistinct[IDEMPOTENCY_KEY];
  const v = headers[IDEMPOTENCY_KEY];
  return v === undefined ? undefined : Array.isArray(v) ? v : [v];
}

/**
 * The key in the ledger: the header's key, prefixed by its scope's digest
 * (`<32 hex>:<key>`, as the Rust layer), or why it cannot be one.
 */
export function ledgerKey(key: string, scope: string | undefined): { ok: true; key: string } | { ok: false; why: string } {
  const scoped = scope === undefined || scope === "" ? key : `${shortDigest(scope)}:${key}`;
  if (scoped.length > MAX_KEY) {
    return {
      ok: false,
      why: `the Idempotency-Key is too long (at most ${MAX_KEY - (scoped.length - key.length)} characters)`,
    };
  }
  return { ok: true, key: scoped };
}
