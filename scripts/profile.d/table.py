"""Markdown tables from scripts/profile's JSON: instructions per request by
component (a --callgrind run) and CPU µs per request by process (a run
without it).

    python3 scripts/profile.d/table.py CALLGRIND_JSON [NATIVE_JSON]
"""

import json
import sys

ORDER = [
    ("http (actix, httparse)", "HTTP (actix)"),
    ("tokio (runtime, sockets)", "tokio"),
    ("redis (client)", "redis client"),
    ("sqlx (Postgres client)", "sqlx"),
    ("serde (JSON)", "serde"),
    ("crypto (HMAC, SHA-256)", "SHA-256/HMAC"),
    ("token text (base64)", None),
    ("logging, metrics", "tracing, prometheus"),
    ("time, ids, limits (chrono, uuid, governor)", "chrono, uuid, governor, hashbrown"),
    ("allocator (mimalloc)", "mimalloc"),
    ("std (collections, fmt, sync)", "std"),
    ("libc (memcpy, syscall wrappers)", "libc (mem*, syscalls)"),
]


def per_request(r, idle):
    idle = r.get("idle", idle)  # a scenario measured in another run brings its own
    n = r["requests"]
    secs = r["seconds"]
    rate = {k: v / idle["seconds"] for k, v in idle["instructions"]["components"].items()}
    return {k: max(0.0, v - rate.get(k, 0) * secs) / n for k, v in r["instructions"]["components"].items()}


def main():
    cg = json.load(open(sys.argv[1]))
    idle = cg["idle"]
    names = list(cg["scenarios"])
    comps = {s: per_request(cg["scenarios"][s], idle) for s in names}
    head = ["component"] + names
    print("| " + " | ".join(head) + " |")
    print("|---" + "|---:" * len(names) + "|")
    total = {s: sum(comps[s].values()) for s in names}
    print("| **service, instructions per request** | " + " | ".join(f"**{total[s] / 1000:.0f}k**" for s in names) + " |")
    ours = {s: sum(v for k, v in comps[s].items() if k.startswith("ours: ")) for s in names}
    print("| ours (src/) | " + " | ".join(f"{ours[s] / 1000:.1f}k" for s in names) + " |")
    for key, label in ORDER:
        if label is None:
            continue
        vals = []
        for s in names:
            v = comps[s].get(key, 0)
            if key == "crypto (HMAC, SHA-256)":
                v += comps[s].get("token text (base64)", 0)
            vals.append(f"{v / 1000:.1f}k")
        print(f"| {label} | " + " | ".join(vals) + " |")
    other = {s: total[s] - ours[s] - sum(comps[s].get(k, 0) for k, _ in ORDER) for s in names}
    print("| other crates | " + " | ".join(f"{other[s] / 1000:.1f}k" for s in names) + " |")
    if len(sys.argv) > 2:
        nat = json.load(open(sys.argv[2]))
        ni = nat["idle"]
        for proc, label in [("service", "service"), ("postgres", "Postgres"), ("redis", "Redis")]:
            vals = []
            for s in names:
                r = nat["scenarios"].get(s)
                if not r:
                    vals.append("-")
                    continue
                ri = r.get("idle", ni)
                rate = ri["cpu"][proc]["ns"] / ri["seconds"]
                us = max(0.0, r["cpu"][proc]["ns"] - rate * r["seconds"]) / r["requests"] / 1000
                k = r["cpu"][proc]["kernel_share"]
                vals.append(f"{us:.0f} ({100 * k:.0f} % kernel)" if proc != "postgres" else f"{us:.0f}")
            print(f"| **{label}, µs of CPU per request** | " + " | ".join(vals) + " |")
        b = []
        for s in names:
            r = nat["scenarios"].get(s)
            b.append(f"{r['pg_batched_items'] / r['pg_batches']:.1f}" if r and r["pg_batches"] else "-")
        print("| consumes per Postgres statement | " + " | ".join(b) + " |")


if __name__ == "__main__":
    main()
