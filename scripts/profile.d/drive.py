"""HTTP/1.1 keep-alive load of an exact number of requests, for scripts/profile.

    drive(host, port, requests, connections) -> list of (status, headers, body)

`requests` is a list of (method, path, body bytes or None); they are sent in
list order over `connections` connections, each connection taking the next
request when its previous one is answered (so consecutive requests go out on
different connections at about the same time, as wrk does). Every request
carries the bench's API key.
"""

import asyncio

KEY = "bench-key-not-secret"


def _head(method, path, body, host):
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {KEY}"]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def _read(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", "0"))
    body = await reader.readexactly(n) if n else b""
    return status, headers, body


async def _run(host, port, requests, connections):
    out = [None] * len(requests)
    it = iter(enumerate(requests))

    async def conn():
        reader, writer = await asyncio.open_connection(host, port)
        try:
            for i, (method, path, body) in it:
                writer.write(_head(method, path, body, f"{host}:{port}"))
                out[i] = await _read(reader)
        finally:
            writer.close()

    await asyncio.gather(*(conn() for _ in range(max(1, min(connections, len(requests))))))
    return out


def drive(host, port, requests, connections=64):
    return asyncio.run(_run(host, port, requests, connections))
