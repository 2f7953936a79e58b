#!/usr/bin/env python3
"""Conformance runner for the Idempotency-Key middlewares.

Starts a ledger (see ledger.py), then each fixture app named by --fixture
(python, express, rust; default: every one available here), drives every
vector of vectors/*.json against it, prints one line per vector per fixture
and a last line `N passed, M failed`; exits 1 when anything failed.
Standard library only; importable (load_vectors, run_vector) by pytest.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from ledger import Ledger, free_port, wait_http  # noqa: E402

BIZ_TYPE = "order"
STEP_TIMEOUT = 30.0


# ---------------------------------------------------------------- fixtures


@dataclass
class Fixture:
    name: str
    command: List[str]
    cwd: Path
    startup_timeout: float
    why_unavailable: Optional[str] = None


def fixtures() -> Dict[str, Fixture]:
    """Every fixture the runner knows, with why it cannot run here (if so)."""
    out: Dict[str, Fixture] = {}

    py = Fixture("python", [sys.executable, str(HERE / "fixtures" / "python_app.py")], REPO, 30)
    try:
        import idempotency_ledger  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        py.why_unavailable = f"{e} (pip install -e 'clients/python[dev]')"
    out["python"] = py

    mjs = REPO / "clients" / "typescript" / "conformance" / "fixture.mjs"
    ex = Fixture("express", ["node", str(mjs)], REPO / "clients" / "typescript", 30)
    if not mjs.is_file():
        ex.why_unavailable = f"{mjs.relative_to(REPO)} does not exist"
    elif shutil.which("node") is None:
        ex.why_unavailable = "node is not installed"
    out["express"] = ex

    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    binary = target / "debug" / "examples" / "conformance_fixture"
    example = REPO / "clients" / "rust" / "examples" / "conformance_fixture.rs"
    if binary.is_file() and os.access(binary, os.X_OK):
        rs = Fixture("rust", [str(binary)], REPO, 30)
    else:
        rs = Fixture(
            "rust",
            ["cargo", "run", "-q", "-p", "idempotency-ledger-client", "--example", "conformance_fixture"],
            REPO,
            900,
        )
        if not example.is_file():
            rs.why_unavailable = f"{example.relative_to(REPO)} does not exist"
        elif shutil.which("cargo") is None:
            rs.why_unavailable = "cargo is not installed"
    out["rust"] = rs
    return out


class RunningFixture:
    def __init__(self, fx: Fixture, ledger_url: str, api_key: str) -> None:
        self.fx = fx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix=f"fixture-{fx.name}-", suffix=".log")[1])
        env = dict(os.environ)
        env.update(
            LEDGER_URL=ledger_url,
            LEDGER_API_KEY=api_key,
            LEDGER_BIZ_TYPE=BIZ_TYPE,
            PORT=str(self.port),
        )
        self._log = open(self.log, "wb")
        # A session of its own: stop() ends the whole group (cargo run's child too).
        self.proc = subprocess.Popen(
            fx.command, cwd=fx.cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )

    def wait_ready(self) -> None:
        wait_http(self.url + "/__health", self.fx.startup_timeout, self.proc)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(5)
        self._log.close()


# ---------------------------------------------------------------- vectors


def load_vectors(directory: Path = HERE / "vectors") -> List[Dict[str, Any]]:
    vectors = []
    for path in sorted(directory.glob("*.json")):
        v = json.loads(path.read_text())
        for k in ("name", "description", "steps"):
            if k not in v:
                raise ValueError(f"{path.name}: missing {k!r}")
        v["_file"] = path.name
        vectors.append(v)
    names = [v["name"] for v in vectors]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"duplicate vector names: {sorted(dupes)}")
    return vectors


def substitute(value: Any, run: str) -> Any:
    if isinstance(value, str):
        return value.replace("{run}", run)
    if isinstance(value, list):
        return [substitute(v, run) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, run) for k, v in value.items()}
    return value


@dataclass
class Reply:
    status: int
    headers: Dict[str, str]
    body: bytes
    error: Optional[str] = None

    def json(self) -> Any:
        return json.loads(self.body)


def send(base: str, request: Dict[str, Any]) -> Reply:
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=STEP_TIMEOUT)
    try:
        headers = dict(request.get("headers") or {})
        body: Optional[bytes] = None
        if "raw_body" in request:
            body = str(request["raw_body"]).encode("utf-8")
        elif request.get("body") is not None:
            body = json.dumps(request["body"], separators=(",", ":")).encode("utf-8")
            if not any(k.lower() == "content-type" for k in headers):
                headers["Content-Type"] = "application/json"
        conn.putrequest(request["method"], request["path"], skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None or request["method"] not in ("GET", "HEAD"):
            conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        resp = conn.getresponse()
        merged: Dict[str, str] = {}
        for k, v in resp.getheaders():
            k = k.lower()
            merged[k] = f"{merged[k]}, {v}" if k in merged else v
        return Reply(resp.status, merged, resp.read())
    except OSError as e:
        return Reply(0, {}, b"", error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def subset(expected: Any, actual: Any) -> bool:
    if isinstance(expected, dict):
        return isinstance(actual, dict) and all(k in actual and subset(v, actual[k]) for k, v in expected.items())
    return bool(expected == actual)


def check(step_no: int, expect: Dict[str, Any], reply: Reply) -> List[str]:
    where = f"step {step_no}"
    if reply.error:
        return [f"{where}: no answer ({reply.error})"]
    errs = []
    if "status" in expect and reply.status != expect["status"]:
        errs.append(f"{where}: status {reply.status}, expected {expect['status']} (body {reply.body[:200]!r})")
    for name, want in (expect.get("headers") or {}).items():
        got = reply.headers.get(name.lower())
        if want is None and got is not None:
            errs.append(f"{where}: header {name} should be absent, got {got!r}")
        elif want is None:
            continue
        elif got is None:
            errs.append(f"{where}: header {name} missing (expected {want!r})")
        elif want.endswith("*"):
            if not got.strip().lower().startswith(want[:-1].lower()):
                errs.append(f"{where}: header {name} = {got!r}, expected {want!r}")
        elif got.strip() != want:
            errs.append(f"{where}: header {name} = {got!r}, expected {want!r}")
    parsed: Any = None
    needs_json = "body_contains" in expect or "problem_code" in expect
    if needs_json:
        try:
            parsed = reply.json()
        except ValueError:
            errs.append(f"{where}: body is not JSON: {reply.body[:200]!r}")
            return errs
    if "body_contains" in expect and not subset(expect["body_contains"], parsed):
        errs.append(f"{where}: body {reply.body[:300]!r} does not contain {expect['body_contains']!r}")
    if "body_empty" in expect and (len(reply.body) == 0) != bool(expect["body_empty"]):
        errs.append(f"{where}: body length {len(reply.body)}, expected {'empty' if expect['body_empty'] else 'non-empty'}")
    code = expect.get("problem_code")
    if code is not None:
        ctype = reply.headers.get("content-type", "")
        if not ctype.startswith("application/problem+json"):
            errs.append(f"{where}: content-type {ctype!r}, expected application/problem+json")
        if not isinstance(parsed, dict):
            errs.append(f"{where}: problem body is not an object")
        else:
            if parsed.get("code") != code:
                errs.append(f"{where}: problem code {parsed.get('code')!r}, expected {code!r}")
            if parsed.get("status") != reply.status:
                errs.append(f"{where}: problem status {parsed.get('status')!r} != {reply.status}")
            t = parsed.get("type")
            if not (isinstance(t, str) and t.startswith(("http://", "https://")) and t.endswith("#" + code)):
                errs.append(f"{where}: problem type {t!r} is not a URI ending in #{code}")
            for member in ("title", "detail"):
                if not isinstance(parsed.get(member), str):
                    errs.append(f"{where}: problem {member} missing")
    return errs


def invocations(base: str) -> int:
    reply = send(base, {"method": "GET", "path": "/__invocations"})
    if reply.status != 200:
        raise RuntimeError(f"GET /__invocations answered {reply.status} {reply.error or ''}")
    return int(reply.json()["count"])


def run_vector(base: str, vector: Dict[str, Any], run: str) -> List[str]:
    """Runs one vector against the fixture at `base`; returns the failures."""
    steps = substitute(vector["steps"], run)
    baseline = invocations(base)
    groups: List[List[Tuple[int, Dict[str, Any]]]] = []
    current: List[Tuple[int, Dict[str, Any]]] = []
    for i, step in enumerate(steps, 1):
        current.append((i, step))
        if not step.get("parallel_with_next"):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    errors: List[str] = []
    for group in groups:
        replies: Dict[int, Reply] = {}

        def go(i: int, step: Dict[str, Any], started: float) -> None:
            delay = step.get("after_ms", 0) / 1000 - (time.monotonic() - started)
            if delay > 0:
                time.sleep(delay)
            replies[i] = send(base, step["request"])

        started = time.monotonic()
        threads = [threading.Thread(target=go, args=(i, s, started)) for i, s in group]
        for t in threads:
            t.start()
        for t in threads:
            t.join(STEP_TIMEOUT + 5)
        count = invocations(base) - baseline
        for i, step in group:
            reply = replies.get(i, Reply(0, {}, b"", error="no reply"))
            expect = step.get("expect", {})
            errors += check(i, expect, reply)
            if "invocations" in expect and count != expect["invocations"]:
                errors.append(f"step {i}: {count} handler invocations, expected {expect['invocations']}")
        if errors:
            break
    return errors


# ---------------------------------------------------------------- main


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", action="append", choices=["python", "express", "rust"],
                    help="a fixture to run (repeatable); default: every available one")
    ap.add_argument("--vector", action="append", help="run only this vector (by name; repeatable)")
    ap.add_argument("--ledger-url", help="use this running ledger instead of starting one")
    ap.add_argument("--api-key", default="dev-payments-key")
    args = ap.parse_args(argv)

    vectors = load_vectors()
    if args.vector:
        unknown = set(args.vector) - {v["name"] for v in vectors}
        if unknown:
            ap.error(f"unknown vectors: {sorted(unknown)}")
        vectors = [v for v in vectors if v["name"] in args.vector]

    known = fixtures()
    if args.fixture:
        chosen = [known[n] for n in dict.fromkeys(args.fixture)]
    else:
        chosen = [f for f in known.values() if f.why_unavailable is None]
        for f in known.values():
            if f.why_unavailable:
                print(f"SKIP {f.name}: {f.why_unavailable}", flush=True)

    passed = failed = 0
    ledger: Optional[Ledger] = None
    try:
        if args.ledger_url:
            ledger_url = args.ledger_url.rstrip("/")
        else:
            ledger = Ledger().start()
            ledger_url = ledger.url
        run_id = f"{int(time.time())}-{secrets.token_hex(4)}"
        for fx in chosen:
            if fx.why_unavailable:
                for v in vectors:
                    print(f"FAIL {fx.name} {v['name']}: fixture unavailable: {fx.why_unavailable}", flush=True)
                failed += len(vectors)
                continue
            running = RunningFixture(fx, ledger_url, args.api_key)
            try:
                try:
                    running.wait_ready()
                except Exception as e:  # noqa: BLE001 - reported as failures
                    for v in vectors:
                        print(f"FAIL {fx.name} {v['name']}: fixture did not start: {e}", flush=True)
                    print(running.log_tail(), file=sys.stderr)
                    failed += len(vectors)
                    continue
                for v in vectors:
                    t0 = time.monotonic()
                    try:
                        errs = run_vector(running.url, v, f"{run_id}.{fx.name}.{v['name']}")
                    except Exception as e:  # noqa: BLE001
                        errs = [f"runner error: {type(e).__name__}: {e}"]
                    ms = int((time.monotonic() - t0) * 1000)
                    if errs:
                        failed += 1
                        print(f"FAIL {fx.name} {v['name']} ({ms} ms): " + "; ".join(errs), flush=True)
                    else:
                        passed += 1
                        print(f"PASS {fx.name} {v['name']} ({ms} ms)", flush=True)
                if failed:
                    tail = running.log_tail()
                    if tail:
                        print(f"--- {fx.name} fixture log (tail) ---\n{tail}", file=sys.stderr)
            finally:
                running.stop()
    finally:
        if ledger is not None:
            ledger.stop()
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
