"""Start a real idempotency-ledger for tests (standard library only).

Used by `conformance/run.py` and by the Python client's pytest suite. The
binary is found in this order: `$LEDGER_BIN`, `<repo>/target/debug/idempotency-ledger`,
`/work/main/target/debug/idempotency-ledger`; it is copied to a temporary
path first, so a rebuild under a running test does not disturb it.

Each ledger gets its own Postgres database (`ledger_t_<hex>`, dropped at the
end) and its own Redis key prefix on database 3, with tiny pools
(`pool_size = 2`, `admin_pool_size = 1`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Optional

REPO = Path(__file__).resolve().parent.parent
FALLBACK_BIN = Path("/work/main/target/debug/idempotency-ledger")
PG_HOST = os.environ.get("LEDGER_TEST_PG_HOST", "127.0.0.1")


def find_binary() -> Path:
    """The ledger binary, or an error naming every place looked at."""
    candidates = []
    env = os.environ.get("LEDGER_BIN")
    if env:
        candidates.append(Path(env))
    candidates += [REPO / "target" / "debug" / "idempotency-ledger", FALLBACK_BIN]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(
        "no idempotency-ledger binary; looked at "
        + ", ".join(str(c) for c in candidates)
        + " (build it with `cargo build` or set LEDGER_BIN)"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float, proc: Optional[subprocess.Popen[bytes]] = None) -> None:
    """Polls `url` until it answers 200; fails early if `proc` exits."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s ({last})")


class Ledger:
    """One ledger process; use as a context manager or call start()/stop()."""

    def __init__(self, binary: Optional[Path] = None) -> None:
        self.source = binary or find_binary()
        self.tag = secrets.token_hex(6)
        self.db = f"ledger_t_{self.tag}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = "dev-payments-key"
        self.admin_key = "dev-admin-key"
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-t-"))
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.log_path = self.dir / "ledger.log"
        self._log: Optional[IO[bytes]] = None

    def start(self, timeout: float = 60.0) -> "Ledger":
        binary = self.dir / "idempotency-ledger"
        shutil.copy2(self.source, binary)
        config = self.dir / "ledger.toml"
        config.write_text(
            f"""[server]
listen = "127.0.0.1:{self.port}"
workers = 1
[postgres]
url = "postgres://postgres@{PG_HOST}:5432/{self.db}"
pool_size = 2
admin_pool_size = 1
[redis]
url = "redis://127.0.0.1:6379/3"
key_prefix = "ledger-t-{self.tag}:"
"""
        )
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(binary), "--config", str(config), "serve"],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            wait_http(self.url + "/readyz", timeout, self.proc)
        except Exception as e:
            self.stop()
            raise RuntimeError(f"ledger did not start: {e}; log:\n{self.log_tail()}") from e
        return self

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        subprocess.run(
            ["psql", "-h", PG_HOST, "-U", "postgres", "-d", "postgres", "-q", "-c",
             f'DROP DATABASE IF EXISTS "{self.db}" WITH (FORCE)'],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
        self._drop_redis_keys()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _drop_redis_keys(self) -> None:
        """Best effort: the run's keys under its own prefix in database 3."""
        if shutil.which("redis-cli") is None:
            return
        scan = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-n", "3", "--scan", "--pattern", f"ledger-t-{self.tag}:*"],
            capture_output=True, check=False, timeout=30,
        )
        keys = scan.stdout.decode(errors="replace").split()
        for i in range(0, len(keys), 500):
            subprocess.run(
                ["redis-cli", "-h", "127.0.0.1", "-n", "3", "UNLINK", *keys[i:i + 500]],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, timeout=30,
            )

    def __enter__(self) -> "Ledger":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
