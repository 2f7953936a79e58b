/**
 * A response as the key's result in the ledger (status, kept headers, body as
 * text or base64), and its replay to a retry. The same shape as the Rust
 * layer's, plus `body_omitted`.
 */

import type { OutgoingHttpHeaders } from "node:http";

import type { Response } from "express";

import { isRecord } from "../errors.js";
import type { Json } from "../types.js";

/** The header set on every replayed answer. */
export const REPLAYED_HEADER = "idempotent-replayed";
/** The header set on a replay whose body was too large to store. */
export const BODY_OMITTED_HEADER = "idempotent-body-omitted";

/**
 * A stored response larger than this (as JSON) is stored without its body:
 * the ledger takes results of at most 64 KiB with the request around them.
 */
export const MAX_STORED = 60 * 1024;

/** Kept and replayed by default (names lower case). */
export const DEFAULT_STORED_HEADERS: readonly string[] = Object.freeze([
  "content-type",
  "content-language",
  "location",
  "etag",
  "last-modified",
]);

export interface Stored {
  status: number;
  headers: [string, string][];
  body?: string;
  body_base64?: string;
  /** The body was over the ledger's limit: replays carry status and headers only. */
  body_omitted?: true;
}

const utf8 = new TextDecoder("utf-8", { fatal: true });

/** The response to store, from its status, headers, and body. */
export function storedOf(status: number, headers: OutgoingHttpHeaders, keep: readonly string[], body: Buffer): Stored {
  const kept: [string, string][] = [];
  for (const name of keep) {
    const v = headers[name];
    if (v === undefined) continue;
    for (const one of Array.isArray(v) ? v : [v]) kept.push([name, String(one)]);
  }
  const stored: Stored = { status, headers: kept };
  let text: string | undefined;
  try {
    text = utf8.decode(body);
  } catch {
    text = undefined;
  }
  // Postgres cannot hold U+0000 in JSON text: such bodies go as base64.
  if (text !== undefined && !text.includes("\u0000")) stored.body = text;
  else stored.body_base64 = body.toString("base64");
  if (Buffer.byteLength(JSON.stringify(stored)) > MAX_STORED) {
    delete stored.body;
    delete stored.body_base64;
    stored.body_omitted = true;
  }
  return stored;
}

/** Reads a stored response back; undefined when the result is not one. */
export function parseStored(result: Json): Stored | undefined {
  if (!isRecord(result)) return undefined;
  const { status, headers, body, body_base64, body_omitted } = result;
  if (typeof status !== "number" || !Number.isInteger(status) || status < 100 || status > 999) return undefined;
  if (!Array.isArray(headers)) return undefined;
  const pairs: [string, string][] = [];
  for (const h of headers) {
    if (!Array.isArray(h) || h.length !== 2 || typeof h[0] !== "string" || typeof h[1] !== "string") return undefined;
    pairs.push([h[0], h[1]]);
  }
  const stored: Stored = { status, headers: pairs };
  if (typeof body === "string") stored.body = body;
  else if (typeof body_base64 === "string") stored.body_base64 = body_base64;
  if (body_omitted === true) stored.body_omitted = true;
  return stored;
}

/** Sends the stored response again, with `Idempotent-Replayed: true`. */
export function replay(res: Response, stored: Stored): void {
  res.statusCode = stored.status;
  const byName = new Map<string, string[]>();
  for (const [name, value] of stored.headers) byName.set(name, [...(byName.get(name) ?? []), value]);
  for (const [name, values] of byName) {
    try {
      res.setHeader(name, values.length === 1 ? (values[0] as string) : values);
    } catch {
      // A header Node refuses (it cannot have come from a Node response): skipped.
    }
  }
  res.setHeader(REPLAYED_HEADER, "true");
  if (stored.body_omitted === true) res.setHeader(BODY_OMITTED_HEADER, "true");
  const body =
    stored.body !== undefined
      ? Buffer.from(stored.body, "utf8")
      : stored.body_base64 !== undefined
        ? Buffer.from(stored.body_base64, "base64")
        : Buffer.alloc(0);
  res.end(body);
}
