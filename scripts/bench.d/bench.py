#!/usr/bin/env python3
"""Helpers for scripts/bench: parse the load generators' output into one JSON
record per measurement, manage the token pools, and write the report.

  bench.py wrk NAME KIND WRK_OUTPUT [key=value...]    -> one JSON line on stdout
  bench.py redisbench NAME CSV_OUTPUT [key=value...]  -> one JSON line
  bench.py pgbench NAME PGBENCH_OUTPUT LOGDIR [key=value...] -> one JSON line
  bench.py metric METRICS_FILE NAME [label=value...]   -> the sample's value (0 if absent)
  bench.py resp-set PREFIX FIRST COUNT TTL_S           -> RESP "SET <prefix><n> 1 EX ttl" (redis-cli --pipe)
  bench.py take POOL CURSOR_FILE COUNT THREADS OUT_PREFIX -> splits the next COUNT unused
                                                        lines of POOL into OUT_PREFIX<tid>, prints how many
  bench.py orders IN_PREFIX THREADS OUT_PREFIX CSV     -> adds an order id to each token line
  bench.py show RESULTS_JSONL N                         -> the last N records, one line each
  bench.py report RESULTS_JSONL MACHINE_JSON OUT_JSON OUT_MD -> prints the table

A record's `cpu=PATH` (the JSON of `cpu.py run`) becomes its "cpu_us": µs of
CPU per request of each group of processes, and the share of the cores left
idle.
"""
import glob
import json
import math
import os
import re
import sys


def kv(args):
    out = {}
    for a in args:
        k, _, v = a.partition("=")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    return out


# ---- parsers -----------------------------------------------------------------

def parse_wrk(name, kind, path, extra):
    text = open(path, encoding="utf-8", errors="replace").read()
    m = re.search(r"^BENCHJSON (\{.*\})\s*$", text, re.M)
    if not m:
        sys.exit(f"bench.py: no BENCHJSON line in {path}:\n{text[-2000:]}")
    j = json.loads(m.group(1))
    c = j["counters"]
    dur = j["duration_us"] / 1e6
    filler = c.get("filler", 0)
    done = j["requests"] - filler
    se = j["socket_errors"]
    socket_errors = se["connect"] + se["read"] + se["write"] + se["timeout"]
    lat = j["latency_us"]
    rec = {
        "name": name,
        "kind": kind,
        "tool": "wrk",
        "duration_s": round(dur, 2),
        "requests": done,
        "rps": round(done / dur, 1) if dur > 0 else 0,
        "p50_ms": lat["p50"] / 1000,
        "p90_ms": lat["p90"] / 1000,
        "p99_ms": lat["p99"] / 1000,
        "p999_ms": lat["p999"] / 1000,
        "max_ms": lat["max"] / 1000,
        "errors": socket_errors + c.get("unexpected", 0),
        "socket_errors": socket_errors,
        "counters": c,
    }
    rec.update(extra)
    return rec


def parse_redisbench(name, path, extra):
    rows = [l for l in open(path, encoding="utf-8") if l.startswith('"') and not l.startswith('"test"')]
    if not rows:
        sys.exit(f"bench.py: no CSV row in {path}")
    f = [x.strip().strip('"') for x in rows[-1].split(",")]
    rec = {
        "name": name,
        "kind": "ref",
        "tool": "redis-benchmark",
        "rps": float(f[1]),
        "p50_ms": float(f[4]),
        "p99_ms": float(f[6]),
        "p999_ms": None,
        "max_ms": float(f[7]),
        "errors": 0,
    }
    rec.update(extra)
    return rec


def parse_pgbench(name, path, logdir, extra):
    text = open(path, encoding="utf-8", errors="replace").read()
    tps = re.search(r"^tps = ([\d.]+)", text, re.M)
    if not tps:
        sys.exit(f"bench.py: pgbench failed, see {path}:\n{text[-3000:]}")
    failed = re.search(r"number of failed transactions: (\d+)", text)
    done = re.search(r"number of transactions actually processed: (\d+)", text)
    lat = []
    for f in glob.glob(os.path.join(logdir, "*")):
        for line in open(f):
            p = line.split()
            if len(p) >= 6 and p[2].isdigit():
                lat.append(int(p[2]))
    lat.sort()

    def pct(q):
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1000.0 if lat else None

    rec = {
        "name": name,
        "kind": "ref",
        "tool": "pgbench",
        "rps": float(tps.group(1)),
        "requests": int(done.group(1)) if done else len(lat),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "p999_ms": pct(0.999),
        "max_ms": lat[-1] / 1000.0 if lat else None,
        "errors": int(failed.group(1)) if failed else 0,
    }
    rec.update(extra)
    return rec


CPU_GROUPS = ("service", "reference", "peer", "postgres", "redis", "load", "other")


def cpu_per_request(rec):
    """Replaces rec["cpu"] (a cpu.py file) by µs of CPU per request: each
    group's CPU over the measured window, divided by the requests the
    run's rate gives for that window."""
    path = rec.pop("cpu", None)
    if not isinstance(path, str) or not os.path.exists(path):
        return rec
    c = json.load(open(path))
    n = rec.get("rps", 0) * c["span_s"]
    if n <= 0:
        return rec
    g = c["groups_s"]
    us = {k: round(g.get(k, 0.0) * 1e6 / n, 1) for k in CPU_GROUPS if g.get(k, 0.0) > 0}
    us["total"] = round(c["busy_s"] * 1e6 / n, 1)
    cap = c["span_s"] * c["cpus"]
    rec["cpu_us"] = us
    # What `other` holds: the busiest processes outside every group; and
    # the time the hypervisor took (in no column).
    rec["other_us"] = [(name, round(secs * 1e6 / n, 1)) for name, secs in c.get("other_top_s", [])
                       if secs * 1e6 / n >= 1.0]
    steal = c.get("steal_s", 0.0) * 1e6 / n
    if steal >= 1.0:
        rec["other_us"].append(("(stolen by the hypervisor, in no column)", round(steal, 1)))
    rec["cpu_idle_pct"] = round(100.0 * c["idle_s"] / cap, 1) if cap > 0 else None
    return rec


def metric(path, name, labels):
    want = dict(labels)
    total = 0.0
    pat = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")
    for line in open(path, encoding="utf-8"):
        m = pat.match(line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
        if all(have.get(k) == v for k, v in want.items()):
            total += float(m.group(4))
    return total


# ---- token pools ---------------------------------------------------------------

def take(pool, cursor_file, count, threads, out_prefix):
    start = int(open(cursor_file).read().strip() or 0) if os.path.exists(cursor_file) else 0
    lines = open(pool).read().splitlines() if os.path.exists(pool) else []
    chunk = lines[start:start + count]
    outs = [open(f"{out_prefix}{t}", "w") for t in range(threads)]
    for i, l in enumerate(chunk):
        outs[i % threads].write(l + "\n")
    for o in outs:
        o.close()
    with open(cursor_file, "w") as f:
        f.write(str(start + len(chunk)))
    print(len(chunk))


def orders(in_prefix, threads, out_prefix, csv_path):
    with open(csv_path, "w") as csv:
        for t in range(threads):
            with open(f"{in_prefix}{t}") as src, open(f"{out_prefix}{t}", "w") as dst:
                for n, line in enumerate(src):
                    tok, subj = line.split()[:2]
                    oid = f"bp{t}-{n}"
                    dst.write(f"{tok} {subj} {oid}\n")
                    csv.write(f"{oid},{subj}\n")


def resp_set(prefix, first, count, ttl):
    out = sys.stdout.buffer
    ttl = str(ttl).encode()
    buf = []
    for n in range(first, first + count):
        k = f"{prefix}{n}".encode()
        buf.append(b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$1\r\n1\r\n$2\r\nEX\r\n$%d\r\n%s\r\n"
                   % (len(k), k, len(ttl), ttl))
        if len(buf) >= 10000:
            out.write(b"".join(buf))
            buf = []
    out.write(b"".join(buf))


# ---- report --------------------------------------------------------------------

# scenario -> (reference, minimum ratio, p99 ceiling ms)
TARGETS = {
    "issue": ("actix+SET NX EX", 0.8, None),
    "consume-fast": ("actix+EVALSHA", 0.8, 5.0),
    "consume-durable": ("pgbench consume", 0.8, 20.0),
    "double-click-storm": ("actix+EVALSHA", 0.8, None),
    "forged": ("actix empty", 0.7, None),
    "order-pay": ("pgbench order-pay", 0.8, None),
    "mixed": ("blend 20% SET NX EX + 80% pgbench consume", None, None),
    # against the peer (scripts/bench --peer): its start, start + complete
    # and start of a completed key, measured in the same run
    "key-claim": ("peer key-claim", 1.5, None),
    "key-cycle": ("peer key-cycle", 1.5, None),
    "key-replay": ("peer key-replay", 1.0, None),
}


def fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, float):
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        return f"{v:.{nd}f}"
    return str(v)


def report(results_path, machine_path, out_json, out_md):
    recs = [json.loads(l) for l in open(results_path) if l.strip()]
    machine = json.load(open(machine_path))
    refs = {r["name"]: r for r in recs if r["kind"] == "ref"}
    scen = [r for r in recs if r["kind"] == "scenario"]

    def ref_rps(name):
        if name.startswith("blend"):
            a, b = refs.get("actix+SET NX EX"), refs.get("pgbench consume")
            if not (a and b):
                return None
            return 1.0 / (0.2 / a["rps"] + 0.8 / b["rps"])
        r = refs.get(name)
        return r["rps"] if r else None

    for s in scen:
        ref, ratio_min, p99_max = TARGETS.get(s["name"], (None, None, None))
        s["reference"] = ref
        rr = ref_rps(ref) if ref else None
        s["reference_rps"] = round(rr, 1) if rr else None
        s["ratio"] = round(s["rps"] / rr, 3) if rr else None
        s["target_ratio"] = ratio_min
        s["target_p99_ms"] = p99_max
        ok = True
        if ratio_min is not None and s["ratio"] is not None and s["ratio"] < ratio_min:
            ok = False
        if p99_max is not None and s["p99_ms"] > p99_max:
            ok = False
        if any(not c["ok"] for c in s.get("checks", [])):
            ok = False
        if s.get("errors"):
            ok = False
        if ok and ratio_min is not None and s["ratio"] is None:
            ok = None  # its reference was not measured in this run
        s["meets_target"] = ok

    out = {"machine": machine, "references": list(refs.values()), "scenarios": scen}
    with open(out_json, "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")

    lines = []
    lines.append("| scenario | req/s | p50 ms | p99 ms | p99.9 ms | errors | reference | ref req/s | ratio | target | correctness |")
    lines.append("|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|")
    for s in scen:
        tgt = []
        if s["target_ratio"] is not None:
            tgt.append(f">= {s['target_ratio']}x")
        if s["target_p99_ms"] is not None:
            tgt.append(f"p99 <= {s['target_p99_ms']:g} ms")
        mark = {True: "met", False: "MISSED", None: "no reference in this run"}[s["meets_target"]]
        target = (", ".join(tgt) + f": {mark}") if tgt else "-"
        corr = "; ".join(c["what"] + (" ok" if c["ok"] else " FAILED") for c in s.get("checks", [])) or "-"
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            s["name"], fmt(s["rps"]), fmt(s["p50_ms"]), fmt(s["p99_ms"]), fmt(s["p999_ms"]),
            s["errors"], s["reference"] or "-", fmt(s["reference_rps"]),
            fmt(s["ratio"]) + "x" if s["ratio"] is not None else "-", target, corr))
    lines.append("")
    lines.append("| reference | tool | req/s | p50 ms | p99 ms | p99.9 ms | errors | note |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---|")
    for r in refs.values():
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["name"], r["tool"], fmt(r["rps"]), fmt(r["p50_ms"]), fmt(r["p99_ms"]),
            fmt(r.get("p999_ms")), r.get("errors", 0), r.get("note", "")))
    lines.append("")
    with_cpu = [r for r in list(refs.values()) + scen if r.get("cpu_us")]
    if with_cpu:
        lines.append("CPU per request while each ran (µs; `server`: the service, the reference's actix-web "
                     "server or the peer; `load`: wrk, pgbench or redis-benchmark; `other`: kernel threads, interrupts, "
                     "anything else; `total`: the machine's busy time; `idle`: the share of both cores left idle):")
        lines.append("")
        lines.append("| run | req/s | server | postgres | redis | load | other | total | idle |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in with_cpu:
            u = r["cpu_us"]
            server = u.get("service", 0.0) + u.get("reference", 0.0) + u.get("peer", 0.0)
            lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
                r["name"], fmt(r["rps"]), fmt(server or None, 1), fmt(u.get("postgres"), 1),
                fmt(u.get("redis"), 1), fmt(u.get("load"), 1), fmt(u.get("other"), 1),
                fmt(u.get("total"), 1),
                f"{r['cpu_idle_pct']:.0f} %" if r.get("cpu_idle_pct") is not None else "-"))
        lines.append("")
        named = [(r["name"], r["other_us"]) for r in with_cpu if r.get("other_us")]
        if named:
            lines.append("What `other` held (µs per request: the busiest processes outside every group, with the "
                         "children they reaped; the rest of `other` is interrupts and processes that came and went):")
            lines.append("")
            for name, parts in named:
                lines.append(f"- {name}: " + ", ".join(f"{p} {fmt(us, 1)}" for p, us in parts))
            lines.append("")
    for k in ("memory", "bloom", "cross_checks", "waiters"):
        if machine.get(k):
            lines.append(f"- {k}: {machine[k]}")
    m = machine
    lines.append(f"- machine: {m.get('nproc')} CPUs ({m.get('cpu')}), {m.get('mem')}, "
                 f"load average at start {m.get('load_start')}, at end {m.get('load_end')}; "
                 f"{m.get('connections')} connections, {m.get('duration')} s per scenario; commit {m.get('commit')}")
    md = "\n".join(lines) + "\n"
    with open(out_md, "w") as f:
        f.write(md)
    print(md)


def main():
    a = sys.argv[1:]
    if not a:
        sys.exit(__doc__)
    cmd = a[0]
    if cmd == "wrk":
        print(json.dumps(cpu_per_request(parse_wrk(a[1], a[2], a[3], kv(a[4:])))))
    elif cmd == "redisbench":
        print(json.dumps(cpu_per_request(parse_redisbench(a[1], a[2], kv(a[3:])))))
    elif cmd == "pgbench":
        print(json.dumps(cpu_per_request(parse_pgbench(a[1], a[2], a[3], kv(a[4:])))))
    elif cmd == "metric":
        v = metric(a[1], a[2], [x.split("=", 1) for x in a[3:]])
        print(int(v) if v == math.floor(v) else v)
    elif cmd == "resp-set":
        resp_set(a[1], int(a[2]), int(a[3]), int(a[4]))
    elif cmd == "take":
        take(a[1], a[2], int(a[3]), int(a[4]), a[5])
    elif cmd == "orders":
        orders(a[1], int(a[2]), a[3], a[4])
    elif cmd == "show":
        recs = [json.loads(l) for l in open(a[1]) if l.strip()][-int(a[2]):]
        for r in recs:
            print(f"  {r['name']}: {r['rps']:.0f}/s, p50 {fmt(r.get('p50_ms'))} ms, p99 {fmt(r.get('p99_ms'))} ms, "
                  f"p99.9 {fmt(r.get('p999_ms'))} ms, errors {r.get('errors', 0)}")
    elif cmd == "report":
        report(a[1], a[2], a[3], a[4])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
