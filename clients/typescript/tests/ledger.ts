/**
 * A real ledger for the tests: the service binary started on a free port with
 * a fresh Postgres database (`ledger_t_<hex>`, dropped at the end) and its own
 * Redis key prefix in database 3, as the project's test rules ask. Small
 * pools (2 + 1 connections): Postgres is shared with the Rust suite.
 *
 * The binary: `LEDGER_BIN`, else `<repo>/target/debug/idempotency-ledger`,
 * else `/work/main/target/debug/idempotency-ledger`; copied to a temporary
 * path first, so a rebuild under a running test changes nothing. `psql` and
 * `redis-cli` (when present) clean up afterwards.
 */

import { execFile, spawn, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { copyFileSync, existsSync, mkdtempSync, rmSync, writeFileSync, chmodSync, openSync, readFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { setTimeout as sleep } from "node:timers/promises";
import { fileURLToPath } from "node:url";
import { promisify } from "node:util";

export const SERVICE_KEY = "dev-payments-key";
export const ADMIN_KEY = "dev-admin-key";

export interface Ledger {
  url: string;
  stop(): Promise<void>;
}

function repoRoot(): string | undefined {
  let dir = dirname(fileURLToPath(import.meta.url));
  for (;;) {
    if (existsSync(join(dir, "Cargo.toml")) && existsSync(join(dir, "clients"))) return dir;
    const up = dirname(dir);
    if (up === dir) return undefined;
    dir = up;
  }
}

export function ledgerBinary(): string {
  const fromEnv = process.env["LEDGER_BIN"];
  if (fromEnv !== undefined && fromEnv !== "") {
    if (!existsSync(fromEnv)) throw new Error(`LEDGER_BIN=${fromEnv} does not exist`);
    return fromEnv;
  }
  const root = repoRoot();
  const candidates = [
    ...(root === undefined ? [] : [join(root, "target", "debug", "idempotency-ledger")]),
    "/work/main/target/debug/idempotency-ledger",
  ];
  const found = candidates.find((c) => existsSync(c));
  if (found === undefined) {
    throw new Error(`no ledger binary: set LEDGER_BIN or build it (cargo build); looked at ${candidates.join(", ")}`);
  }
  return found;
}

export async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      const port = typeof addr === "object" && addr !== null ? addr.port : 0;
      srv.close(() => resolve(port));
    });
  });
}

const run = promisify(execFile);

async function dropDatabase(name: string): Promise<void> {
  try {
    await run("psql", ["-h", "127.0.0.1", "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", `DROP DATABASE IF EXISTS ${name} WITH (FORCE)`]);
  } catch (e) {
    console.warn(`could not drop test database ${name}: ${(e as Error).message}`);
  }
}

/** Deletes the run's Redis keys (database 3, its own prefix). */
async function dropRedisKeys(prefix: string): Promise<void> {
  try {
    const { stdout } = await run("redis-cli", ["-h", "127.0.0.1", "-p", "6379", "-n", "3", "--scan", "--pattern", `${prefix}*`]);
    const keys = stdout.split("\n").filter((k) => k !== "");
    for (let i = 0; i < keys.length; i += 500) {
      await run("redis-cli", ["-h", "127.0.0.1", "-p", "6379", "-n", "3", "unlink", ...keys.slice(i, i + 500)]);
    }
  } catch (e) {
    console.warn(`could not delete the test's Redis keys ${prefix}*: ${(e as Error).message}`);
  }
}

function exited(child: ChildProcess): Promise<void> {
  return new Promise((resolve) => {
    if (child.exitCode !== null || child.signalCode !== null) resolve();
    else child.once("exit", () => resolve());
  });
}

/** A ledger of its own; `extra`: TOML lines appended to its configuration. */
export async function startLedger(extra: readonly string[] = []): Promise<Ledger> {
  const dir = mkdtempSync(join(tmpdir(), "ledger-ts-"));
  const bin = join(dir, "idempotency-ledger");
  copyFileSync(ledgerBinary(), bin);
  chmodSync(bin, 0o755);
  const port = await freePort();
  const hex = randomBytes(6).toString("hex");
  const db = `ledger_t_${hex}`;
  const config = join(dir, "ledger.toml");
  writeFileSync(
    config,
    [
      "[server]",
      `listen = "127.0.0.1:${port}"`,
      "workers = 1",
      "[postgres]",
      `url = "postgres://postgres@127.0.0.1:5432/${db}"`,
      "pool_size = 2",
      "admin_pool_size = 1",
      "[redis]",
      `url = "redis://127.0.0.1:6379/3"`,
      `key_prefix = "ledger-t-${hex}:"`,
      ...extra,
      "",
    ].join("\n"),
  );
  const logPath = join(dir, "ledger.log");
  const log = openSync(logPath, "a");
  const child = spawn(bin, ["--config", config, "serve"], { stdio: ["ignore", log, log] });
  const url = `http://127.0.0.1:${port}`;
  const stop = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill("SIGTERM");
      const killer = setTimeout(() => child.kill("SIGKILL"), 10_000);
      await exited(child);
      clearTimeout(killer);
    }
    await dropDatabase(db);
    await dropRedisKeys(`ledger-t-${hex}:`);
    rmSync(dir, { recursive: true, force: true });
  };
  const deadline = Date.now() + 90_000;
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) {
      const tail = readFileSync(logPath, "utf8").slice(-4000);
      await stop();
      throw new Error(`the ledger exited during start (${child.exitCode ?? child.signalCode}):\n${tail}`);
    }
    try {
      const r = await fetch(`${url}/readyz`, { signal: AbortSignal.timeout(1000) });
      if (r.status === 200) return { url, stop };
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) {
      const tail = readFileSync(logPath, "utf8").slice(-4000);
      await stop();
      throw new Error(`the ledger was not ready within 90 s:\n${tail}`);
    }
    await sleep(100);
  }
}

/** A unique string per call, for keys and order ids. */
export function unique(prefix: string): string {
  return `${prefix}-${randomBytes(8).toString("hex")}`;
}
