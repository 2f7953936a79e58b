#!/usr/bin/env python3
"""Waiting for the winner, measured: N consumes of one token wait (wait_ms)
while its winner runs; one result answers them all.

    waiters.py --url URL --key API_KEY --pid SERVICE_PID [--n 1000] [--biz order]

Issues a token, consumes it (the winner), then opens N connections that each
send a consume with another request_id and wait_ms=10000. Once the service
reports N waiting (ledger_consumes_waiting), it measures the service's CPU
over three quiet seconds (what waiting costs, beside three with none waiting), records the winner's result, and
times every waiter's answer from that moment. Prints one JSON object:
n, answered, completed (answers `completed` with the result), the CPU µs the
service used per second while they waited, and the latency of the answers
after the result (p50, p99, max, ms). Standard library only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.parse
import urllib.request
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of stat; after "pid (comm)" they
    # are the 12th and 13th.
    return (int(fields[11]) + int(fields[12])) / TICKS


def call(url: str, key: str, method: str, path: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    if path == "/metrics":
        return text
    return json.loads(text)


def waiting(url: str) -> int:
    req = urllib.request.Request(url + "/metrics")
    with urllib.request.urlopen(req, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("ledger_consumes_waiting "):
                return int(float(line.split()[1]))
    return 0


async def one_waiter(host: str, port: int, key: str, token: str, i: int) -> tuple[float, str]:
    """Sends one waiting consume; returns (the time its answer arrived, its status)."""
    body = json.dumps({"subject": "bench-waiter", "request_id": f"w-{i}", "wait_ms": 10000}).encode()
    path = f"/v1/tokens/{urllib.parse.quote(token, safe='')}/consume"
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        + body
    )
    await writer.drain()
    raw = await reader.read()
    at = time.monotonic()
    writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = ""
    try:
        status = str(json.loads(payload.decode()).get("status", ""))
    except ValueError:
        status = head.split(b"\r\n", 1)[0].decode(errors="replace")
    return at, status


def percentile(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--biz", default="order")
    a = ap.parse_args()
    parsed = urllib.parse.urlparse(a.url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80

    token = call(a.url, a.key, "POST", "/v1/tokens", {"biz_type": a.biz, "subject": "bench-waiter"})["token"]
    quoted = urllib.parse.quote(token, safe="")
    won = call(a.url, a.key, "POST", f"/v1/tokens/{quoted}/consume", {"subject": "bench-waiter", "request_id": "winner"})
    assert won["outcome"] == "consumed", won

    # The service's own background (fleet beats, sweeps) with nobody waiting.
    b0, bt = cpu_seconds(a.pid), time.monotonic()
    await asyncio.sleep(3.0)
    base_us_per_s = (cpu_seconds(a.pid) - b0) / (time.monotonic() - bt) * 1e6

    tasks = [asyncio.create_task(one_waiter(host, port, a.key, token, i)) for i in range(a.n)]
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and await asyncio.to_thread(waiting, a.url) < a.n:
        await asyncio.sleep(0.05)
    parked = await asyncio.to_thread(waiting, a.url)
    # Registered before its first look: let every first look finish.
    await asyncio.sleep(1.0)

    # What waiting costs: the service's CPU over a quiet second.
    c0, t0 = cpu_seconds(a.pid), time.monotonic()
    await asyncio.sleep(3.0)
    idle_us_per_s = (cpu_seconds(a.pid) - c0) / (time.monotonic() - t0) * 1e6

    c1 = cpu_seconds(a.pid)
    result_at = time.monotonic()
    await asyncio.to_thread(
        call, a.url, a.key, "POST", f"/v1/tokens/{quoted}/result", {"subject": "bench-waiter", "result": {"ok": True}}
    )
    answers = await asyncio.gather(*tasks)
    wake_cpu_ms = (cpu_seconds(a.pid) - c1) * 1e3
    after = [(at - result_at) * 1e3 for at, _ in answers]
    completed = sum(1 for _, status in answers if status == "completed")
    p50, p99, worst = percentile(after, 50), percentile(after, 99), max(after)
    summary = (
        f"{completed} of {a.n} waiters on one token answered completed by one result: "
        f"the last {worst:.1f} ms after it (p50 {p50:.1f}, p99 {p99:.1f}); service CPU "
        f"while they waited {idle_us_per_s:.0f} us/s ({base_us_per_s:.0f} us/s with none waiting), "
        f"to answer them all {wake_cpu_ms:.1f} ms"
    )
    print(
        json.dumps(
            {
                "summary": summary,
                "n": a.n,
                "parked": parked,
                "answered": len(answers),
                "completed": completed,
                "service_cpu_us_per_s_while_waiting": round(idle_us_per_s),
                "service_cpu_us_per_s_with_none_waiting": round(base_us_per_s),
                "service_cpu_ms_to_answer_all": round(wake_cpu_ms, 1),
                "after_result_ms": {
                    "p50": round(percentile(after, 50), 1),
                    "p99": round(percentile(after, 99), 1),
                    "max": round(max(after), 1),
                },
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
