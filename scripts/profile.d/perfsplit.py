"""Reads a `perf record` file of the service and says whose code the CPU ran.

    load(path) -> {"components", "ours", "functions", "samples"}

Each sample is charged to the function its instruction is in, by the
function's symbol (`perf report --sort dso,sym`): ours by module
(`idempotency_ledger::<module>`), a dependency by the crate its symbol
names, grouped into the components of classify.py; the kernel ([k]) and
libc are their own. Code inlined into a function counts for that function,
so a generic of std or a dependency inlined into one of ours counts as ours
here (callgrind's line tables tell those apart; sampling tells what the
real CPU spends, SHA-NI and all). Shares, in percent of the samples.
"""

import re
import subprocess
from collections import defaultdict

import classify

KERNEL = "kernel (syscalls, sockets, scheduling)"
_line = re.compile(r"^\s*([\d.]+)%\s+(\d+)\s+(\S+)\s+\[([.k])\]\s+(.*)$")


_path = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)::")
_STD_ROOTS = {"core", "alloc", "std"}


def crate_of(sym):
    """The first crate a symbol's paths name that is ours or a known
    dependency (`core::ptr::drop_in_place<actix_http::...>` is actix's);
    "std" when it names only the standard library; None otherwise."""
    roots = [m.group(1) for m in _path.finditer(sym)]
    for r in roots:
        if r == "idempotency_ledger" or r.replace("_", "-") in classify.CRATE_COMPONENT \
                or r in classify.CRATE_COMPONENT:
            return r if r == "idempotency_ledger" else r.replace("_", "-")
    if roots and roots[0] in _STD_ROOTS:
        return "std"
    return classify.crate_of_symbol(sym)


def component_of(dso, kind, sym):
    if kind == "k":
        return KERNEL
    if "libc" in dso or "ld-linux" in dso:
        return classify.LIBC
    c = crate_of(sym)
    if c == "idempotency_ledger":
        m = re.search(r"idempotency_ledger::([a-z_]+)", sym)
        return f"ours: {m.group(1)}" if m else "ours: ?"
    if c == "std":
        return classify.STD
    if c:
        hit = classify.CRATE_COMPONENT.get(c) or classify.CRATE_COMPONENT.get(c.replace("-", "_"))
        return hit or f"other: {c}"
    if sym.startswith(("_ZN4core", "_ZN5alloc", "_ZN3std", "core::", "alloc::", "std::", "<core::",
                       "<alloc::", "<std::")):
        return classify.STD
    if sym.startswith(("mi_", "_mi_")):
        return "allocator (mimalloc)"
    if sym.startswith(("mem", "__mem", "str", "__str")):
        return classify.LIBC
    return f"other: {sym[:40]}"


def load(path):
    out = subprocess.run(["perf", "report", "-i", path, "--stdio", "--no-children", "-q", "-n",
                          "--sort", "dso,sym", "--percent-limit", "0"],
                         capture_output=True, text=True, check=True).stdout
    samples = 0
    comps = defaultdict(float)
    ours = defaultdict(float)
    funcs = defaultdict(float)
    for line in out.splitlines():
        m = _line.match(line)
        if not m:
            continue
        pct, n, dso, kind, sym = (float(m.group(1)), int(m.group(2)), m.group(3), m.group(4),
                                  m.group(5).strip())
        samples += n
        comp = component_of(dso, kind, sym)
        comps[comp] += pct
        if comp.startswith("ours: "):
            ours[comp[6:]] += pct
        funcs[(sym[:120], comp)] += pct
    top = sorted(funcs.items(), key=lambda kv: -kv[1])[:60]
    return {
        "components": dict(sorted(comps.items(), key=lambda kv: -kv[1])),
        "ours": dict(sorted(ours.items(), key=lambda kv: -kv[1])),
        "functions": [{"function": f, "component": c, "percent": round(p, 3)} for (f, c), p in top],
        "samples": samples,
    }
