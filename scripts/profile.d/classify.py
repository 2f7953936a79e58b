"""Reads a callgrind dump and says whose code executed its instructions.

    load(path) -> {"total", "periodic", "components", "crates", "ours", "functions"}
    callers(path, name) -> {caller: instructions (or calls) of its calls to name}

Each cost line of a dump names the source file of its instructions (with the
inlined file, `fi=`/`fe=`, where code was inlined), so an instruction is
charged to the crate whose source it is: ours by module (`src/<module>`),
a dependency by its registry directory. Code of the standard library (and
of C libraries without line tables) is charged by the function it was
compiled into, which for generic collections is still the standard
library; the allocator (mimalloc) and libc (memcpy and the syscall wrappers)
are their own components.
"""

import os
import re
from collections import defaultdict

COMPONENTS = [
    ("http (actix, httparse)", {"actix-http", "actix-web", "actix-server", "actix-service", "actix-router",
                                "actix-codec", "actix-rt", "actix-utils", "actix-macros", "httparse", "http",
                                "bytes", "bytestring", "mime", "percent-encoding", "language-tags",
                                "local-channel", "local-waker", "url", "form_urlencoded", "idna",
                                "encoding_rs", "flate2", "zstd", "brotli", "h2", "httpdate", "time",
                                "derive_more", "foldhash", "ahash", "smallvec", "impl-more", "regex",
                                "regex-automata", "regex-syntax", "aho-corasick", "cookie"}),
    ("sqlx (Postgres client)", {"sqlx-core", "sqlx-postgres", "sqlx", "crossbeam-queue", "crossbeam-utils",
                                "event-listener", "event-listener-strategy", "concurrent-queue", "atoi",
                                "hashlink", "stringprep", "md-5", "whoami", "home", "dotenvy",
                                "byteorder", "hkdf"}),
    ("redis (client)", {"redis", "combine", "arcstr", "backon", "crc16", "rand", "rand_core", "rand_chacha",
                        "ppv-lite86", "sha1_smol"}),
    ("tokio (runtime, sockets)", {"tokio", "mio", "tokio-util", "futures-util", "futures-core", "futures-task",
                                  "futures-channel", "futures-sink", "futures-io", "futures-executor",
                                  "pin-project-lite", "pin-project", "parking_lot", "parking_lot_core",
                                  "slab", "socket2", "lock_api", "signal-hook-registry", "async-trait",
                                  "futures", "tokio-stream"}),
    ("serde (JSON)", {"serde", "serde_json", "itoa", "ryu", "memchr", "serde_core"}),
    ("crypto (HMAC, SHA-256)", {"hmac", "sha2", "digest", "block-buffer", "crypto-common", "subtle", "ring",
                                "cpufeatures", "generic-array", "typenum"}),
    ("token text (base64)", {"base64"}),
    ("logging, metrics", {"tracing", "tracing-core", "tracing-subscriber", "prometheus", "sharded-slab",
                          "thread_local", "tracing-log", "log", "nu-ansi-term", "matchers", "once_cell",
                          "protobuf", "lazy_static"}),
    ("time, ids, limits (chrono, uuid, governor)", {"chrono", "uuid", "governor", "quanta", "moka",
                                                     "nonzero_ext", "spinning_top", "portable-atomic",
                                                     "getrandom", "hashbrown", "indexmap", "equivalent",
                                                     "bloomfilter", "siphasher", "bit-vec", "dashmap"}),
    ("allocator (mimalloc)", {"mimalloc", "libmimalloc-sys"}),
]
CRATE_COMPONENT = {c: name for name, crates in COMPONENTS for c in crates}
STD = "std (collections, fmt, sync)"
# Timer work whose cost follows the clock and the filter's size, not the
# requests (the bloom filter's fill ratio, every 5 s): kept apart.
PERIODIC = ("IssuedFilter::maintain",)
LIBC = "libc (memcpy, syscall wrappers)"

_crate_dir = re.compile(r"/(?:registry/src/[^/]+|git/checkouts/[^/]+/[^/]+|vendor)/([A-Za-z0-9_.+-]+?)-\d+\.\d+[^/]*/")
_sym_crate = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)::")


def crate_of_file(path, repo_src):
    """('ours', module) | ('crate', name) | ('std', None) | (None, None).
    Ours: a file of `repo_src` (this checkout's src/), wherever the binary
    was built."""
    if not path or path == "???":
        return None, None
    if repo_src and "/src/" in path and "/registry/" not in path and not path.startswith("/rust"):
        rest = path.split("/src/", 1)[1]
        if os.path.exists(os.path.join(repo_src, rest)):
            mod = rest.split("/")[0]
            return "ours", mod[:-3] if mod.endswith(".rs") else mod
    if path.startswith("/rustc/") or path.startswith("/rust/deps/") or "/library/" in path and "/rustc/" in path:
        return "std", None
    m = _crate_dir.search(path)
    if m:
        return "crate", m.group(1)
    if "mimalloc" in path:
        return "crate", "mimalloc"
    return None, None


def crate_of_symbol(name):
    if name.startswith(("mi_", "_mi_", "mi_malloc", "mi_free")):
        return "mimalloc"
    for m in _sym_crate.finditer(name):
        c = m.group(1)
        if c in ("core", "alloc", "std", "T", "F", "S", "impl"):
            continue
        return c.replace("_", "-") if c != "idempotency_ledger" else "idempotency_ledger"
    return None


def component(kind, what, fn_name, obj):
    if kind == "ours":
        return f"ours: {what}"
    if kind == "crate":
        return CRATE_COMPONENT.get(what, f"other: {what}")
    # std, or no line table: by the function it is in
    c = crate_of_symbol(fn_name)
    if c == "idempotency_ledger":
        m = re.search(r"idempotency_ledger::([a-z_]+)", fn_name)
        return f"ours: {m.group(1)}" if m else "ours: ?"
    if c:
        hit = CRATE_COMPONENT.get(c) or CRATE_COMPONENT.get(c.replace("-", "_"))
        if hit:
            return hit
        if kind == "std":
            return STD
        return f"other: {c}"
    if kind == "std":
        return STD
    if obj and ("libc" in obj or "ld-linux" in obj or "libpthread" in obj or "libm" in obj):
        return LIBC
    if fn_name.startswith(("mem", "__mem", "str", "__str")):
        return LIBC
    return f"other: {obj or fn_name}"


def name(table, s):
    """A compressed name of a dump: "(id) name" defines id, "(id)" uses it."""
    m = re.match(r"\((\d+)\)(?: (.*))?$", s)
    if not m:
        return s
    if m.group(2) is not None:
        table[m.group(1)] = m.group(2)
    return table.get(m.group(1), "?")


def load(path, repo_src=None):
    files, fns, objs = {}, {}, {}

    cost = defaultdict(int)          # (component) -> Ir
    crates = defaultdict(int)
    ours = defaultdict(int)
    fn_self = defaultdict(int)       # (fn, component) -> Ir
    ob = fl = fi = fn = None
    after_calls = False
    total = 0
    periodic = 0
    summary = None
    memo = {}
    with open(path, errors="replace") as f:
        for line in f:
            c0 = line[:1]
            if c0.isdigit() or c0 in "+-*":
                if after_calls:
                    after_calls = False
                    continue
                parts = line.split()
                if len(parts) < 2:
                    continue
                ir = int(parts[1])
                if fn and fn.endswith(PERIODIC):
                    periodic += ir
                    continue
                src = fi or fl
                key = (src, fn, ob)
                comp = memo.get(key)
                if comp is None:
                    kind, what = crate_of_file(src, repo_src)
                    comp = component(kind, what, fn or "", ob or "")
                    crate = what if kind in ("crate", "ours") else (kind or "none")
                    memo[key] = comp = (comp, crate)
                cost[comp[0]] += ir
                crates[comp[1]] += ir
                fn_self[(fn, comp[0])] += ir
                if comp[0].startswith("ours: "):
                    ours[comp[0][6:]] += ir
                total += ir
                continue
            if line.startswith("fn="):
                fn = name(fns, line[3:].rstrip("\n"))
                fi = None
            elif line.startswith(("fi=", "fe=")):
                fi = name(files, line[3:].rstrip("\n"))
            elif line.startswith("fl="):
                fl = name(files, line[3:].rstrip("\n"))
                fi = None
            elif line.startswith("ob="):
                ob = name(objs, line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                name(fns, line[4:].rstrip("\n"))
            elif line.startswith(("cfi=", "cfl=")):
                name(files, line[4:].rstrip("\n"))
            elif line.startswith("cob="):
                name(objs, line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                after_calls = True
            elif line.startswith("summary:") or line.startswith("totals:"):
                summary = int(line.split()[1])
    top = sorted(fn_self.items(), key=lambda kv: -kv[1])[:60]
    return {
        "total": total,
        "summary": summary,
        "periodic": periodic,
        "components": dict(sorted(cost.items(), key=lambda kv: -kv[1])),
        "crates": dict(sorted(crates.items(), key=lambda kv: -kv[1])[:60]),
        "ours": dict(sorted(ours.items(), key=lambda kv: -kv[1])),
        "functions": [{"fn": k[0], "component": k[1], "ir": v} for k, v in top],
    }


if __name__ == "__main__":
    import json
    import sys
    print(json.dumps(load(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None), indent=1))


def callers(path, target, counts=False):
    """{caller: inclusive Ir of its calls to functions whose name contains
    target} (with counts: the number of calls instead)."""
    fns, out = {}, defaultdict(int)
    fn = callee = None
    pending = False
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("fn="):
                fn = name(fns, line[3:].rstrip("\n"))
            elif line.startswith("cfn="):
                callee = name(fns, line[4:].rstrip("\n"))
            elif line.startswith("calls="):
                pending = True
                ncalls = int(line[6:].split()[0])
            elif pending and (line[:1].isdigit() or line[:1] in "+-*"):
                pending = False
                if callee and target in callee and target not in (fn or ""):
                    out[fn] += ncalls if counts else int(line.split()[1])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
