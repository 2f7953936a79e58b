"""Retry mechanics against a tiny local HTTP stub (everything else runs
against the real ledger)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from idempotency_ledger import (
    AsyncClient,
    Client,
    Consumed,
    InvalidRequestError,
    RateLimitedError,
    RetryPolicy,
    TransportError,
    UnavailableError,
)

CONSUMED = {"outcome": "consumed", "key": "k", "consumed_at": "2030-01-01T00:00:00.123456789Z"}


class Stub:
    """Answers from a script of (status, headers, body, delay) per request;
    the last entry repeats. Records every request body."""

    def __init__(self) -> None:
        self.script: List[Tuple[int, Dict[str, str], Any, float]] = []
        self.bodies: List[Dict[str, Any]] = []
        self.times: List[float] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                n = len(self.headers.get("content-length") or "0") and int(self.headers["content-length"])
                stub.bodies.append(json.loads(self.rfile.read(n)))
                stub.times.append(time.monotonic())
                status, headers, body, delay = stub.script[min(len(stub.bodies) - 1, len(stub.script) - 1)]
                if delay:
                    time.sleep(delay)
                data = json.dumps(body).encode() if not isinstance(body, bytes) else body
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub() -> Iterator[Stub]:
    s = Stub()
    yield s
    s.close()


FAST = RetryPolicy(max_attempts=4, min_delay=0.01, max_delay=0.05, jitter=False, deadline=10, attempt_timeout=2)
UNAVAILABLE = (503, {}, {"error": "unavailable", "message": "down"}, 0.0)


def test_503_is_retried_with_the_same_request_id(stub: Stub) -> None:
    stub.script = [UNAVAILABLE, UNAVAILABLE, (200, {}, CONSUMED, 0.0)]
    with Client(stub.url, "k", retry=FAST) as c:
        out = c.consume_key("order", "k")
    assert isinstance(out, Consumed)
    assert len(stub.bodies) == 3
    ids = {b["request_id"] for b in stub.bodies}
    assert ids == {out.request_id}
    # A new logical call draws a new id; a given one is kept.
    with Client(stub.url, "k", retry=FAST) as c:
        again = c.consume_key("order", "k")
        mine = c.consume_key("order", "k", request_id="mine-1")
    assert again.request_id != out.request_id and mine.request_id == "mine-1"
    assert stub.bodies[-1]["request_id"] == "mine-1"


def test_retry_after_is_honoured(stub: Stub) -> None:
    stub.script = [(503, {"Retry-After": "1"}, {"error": "unavailable", "message": "x"}, 0.0), (200, {}, CONSUMED, 0.0)]
    with Client(stub.url, "k", retry=FAST) as c:
        c.consume_key("order", "k")
    assert len(stub.times) == 2 and stub.times[1] - stub.times[0] >= 0.95


def test_attempts_are_bounded(stub: Stub) -> None:
    stub.script = [(503, {"Retry-After": "0"}, b"<html>busy</html>", 0.0)]
    with Client(stub.url, "k", retry=FAST) as c:
        with pytest.raises(UnavailableError) as e:
            c.consume_key("order", "k")
    assert len(stub.bodies) == 4 and e.value.code == "unavailable" and e.value.status == 503


def test_a_retry_after_beyond_the_deadline_is_not_waited(stub: Stub) -> None:
    stub.script = [(503, {"Retry-After": "30"}, {"error": "unavailable", "message": "x"}, 0.0)]
    t0 = time.monotonic()
    with Client(stub.url, "k", retry=RetryPolicy(deadline=2)) as c:
        with pytest.raises(UnavailableError) as e:
            c.consume_key("order", "k")
    assert time.monotonic() - t0 < 1.5 and len(stub.bodies) == 1 and e.value.retry_after == 30


@pytest.mark.parametrize(
    "answer,error",
    [
        ((429, {"Retry-After": "1"}, {"error": "rate_limited", "message": "slow"}, 0.0), RateLimitedError),
        ((400, {}, {"error": "invalid_request", "message": "bad"}, 0.0), InvalidRequestError),
    ],
)
def test_4xx_is_never_retried(stub: Stub, answer: Tuple[int, Dict[str, str], Any, float], error: type) -> None:
    stub.script = [answer, (200, {}, CONSUMED, 0.0)]
    with Client(stub.url, "k", retry=FAST) as c:
        with pytest.raises(error) as e:
            c.consume_key("order", "k")
    assert len(stub.bodies) == 1
    assert e.value.status == answer[0]
    if answer[0] == 429:
        assert e.value.retry_after == 1.0


def test_other_5xx_is_not_retried(stub: Stub) -> None:
    stub.script = [(500, {}, {"error": "internal", "message": "boom"}, 0.0), (200, {}, CONSUMED, 0.0)]
    with Client(stub.url, "k", retry=FAST) as c:
        with pytest.raises(Exception) as e:
            c.consume_key("order", "k")
    assert getattr(e.value, "code") == "internal" and len(stub.bodies) == 1


def test_timeouts_are_retried_with_the_same_request_id(stub: Stub) -> None:
    policy = RetryPolicy(max_attempts=3, min_delay=0.01, max_delay=0.01, jitter=False, attempt_timeout=0.3)
    stub.script = [(200, {}, CONSUMED, 1.0), (200, {}, CONSUMED, 0.0)]
    with Client(stub.url, "k", retry=policy) as c:
        out = c.consume_key("order", "k")
    assert isinstance(out, Consumed) and len(stub.bodies) == 2
    assert stub.bodies[0]["request_id"] == stub.bodies[1]["request_id"] == out.request_id


def test_connection_errors_are_retried_then_raised() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    policy = RetryPolicy(max_attempts=3, min_delay=0.01, max_delay=0.01, jitter=False)
    with Client(f"http://127.0.0.1:{port}", "k", retry=policy) as c:
        with pytest.raises(TransportError) as e:
            c.consume_key("order", "k")
    assert e.value.retryable and e.value.__cause__ is not None


def test_async_client_retries_the_same_way(stub: Stub) -> None:
    stub.script = [UNAVAILABLE, (200, {}, CONSUMED, 0.0)]

    async def go() -> Consumed:
        async with AsyncClient(stub.url, "k", retry=FAST) as c:
            out = await c.consume_key("order", "k")
            assert isinstance(out, Consumed)
            return out

    out = asyncio.run(go())
    assert [b["request_id"] for b in stub.bodies] == [out.request_id] * 2


def test_backoff_doubles_within_bounds() -> None:
    p = RetryPolicy(max_attempts=4, min_delay=0.01, max_delay=0.025, jitter=False)
    assert list(p.backoff()) == [0.01, 0.02, 0.025]
    assert list(RetryPolicy.none().backoff()) == []
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
