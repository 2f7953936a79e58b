/**
 * Fingerprints: `sha256:<hex>` of a business request, so that a token or key
 * consumed for one request is refused (`fingerprint_mismatch`) for another.
 * The same functions as the Rust client's `fingerprint` module: equal inputs
 * give equal fingerprints in every client.
 */

import { createHash } from "node:crypto";

/** `sha256:<hex>` of `bytes` (a string is hashed as UTF-8). */
export function fingerprint(bytes: Uint8Array | string): string {
  return `sha256:${createHash("sha256").update(bytes).digest("hex")}`;
}

/**
 * The fingerprint of a value's JSON, object keys sorted at every level (so
 * `{a, b}` and `{b, a}` hash the same, as in the Rust client's maps).
 */
export function fingerprintJson(value: unknown): string {
  return fingerprint(canonicalJson(value));
}

/** JSON with object keys sorted at every level. */
export function canonicalJson(value: unknown): string {
  const text = JSON.stringify(value, (_key, v: unknown) => {
    if (typeof v === "object" && v !== null && !Array.isArray(v)) {
      const o = v as Record<string, unknown>;
      return Object.fromEntries(Object.keys(o).sort().map((k) => [k, o[k]]));
    }
    return v;
  });
  if (text === undefined) throw new TypeError("the value has no JSON form");
  return text;
}

/**
 * An HTTP request's fingerprint: method, path with query, and body, each
 * prefixed by its length (8 bytes, big-endian), so that no two different
 * requests hash the same input.
 */
export function requestFingerprint(method: string, pathAndQuery: string, body: Uint8Array): string {
  const h = createHash("sha256");
  for (const part of [Buffer.from(method, "utf8"), Buffer.from(pathAndQuery, "utf8"), body]) {
    const len = Buffer.alloc(8);
    len.writeBigUInt64BE(BigInt(part.length));
    h.update(len);
    h.update(part);
  }
  return `sha256:${h.digest("hex")}`;
}

/** A short stable hex digest (first 16 bytes of SHA-256): scopes in keys. */
export function shortDigest(s: string): string {
  return createHash("sha256").update(s, "utf8").digest("hex").slice(0, 32);
}
