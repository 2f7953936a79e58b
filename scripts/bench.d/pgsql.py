#!/usr/bin/env python3
"""Print one of the service's SQL statements as a pgbench command.

usage: pgsql.py FILE FN PARAM...

Takes the first raw string literal (r#"..."#) in `fn FN(` of FILE (the
statement exactly as the service sends it) and replaces each `$N` by the N-th
PARAM, written `var:type`: `(:var::type)`, a pgbench variable cast to the type
sqlx binds for that parameter (pgbench prepares with untyped parameters;
the cast restores what sqlx's typed binding gives). `NULL:type` binds NULL
(an absent Option). The statement text is otherwise unchanged, so the
reference measures the service's own statement, with its own plan.
"""
import re
import sys


def statement(path, fn):
    src = open(path, encoding="utf-8").read()
    m = re.search(r"\bfn\s+" + re.escape(fn) + r"\s*[<(]", src)
    if not m:
        sys.exit(f"pgsql.py: fn {fn} not found in {path}")
    start = src.find('r#"', m.end())
    end = src.find('"#', start + 3)
    if start < 0 or end < 0:
        sys.exit(f"pgsql.py: no raw SQL string in fn {fn} of {path}")
    return src[start + 3:end]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path, fn, params = sys.argv[1], sys.argv[2], sys.argv[3:]
    sql = statement(path, fn)
    used = set()

    def sub(m):
        n = int(m.group(1))
        if n > len(params):
            sys.exit(f"pgsql.py: fn {fn} uses ${n} but only {len(params)} params were given")
        used.add(n)
        var, typ = params[n - 1].split(":", 1)
        if var == "NULL":
            return f"(NULL::{typ})"
        return f"(:{var}::{typ})"

    # $10 before $1: match whole numbers.
    out = re.sub(r"\$(\d+)", sub, sql)
    missing = set(range(1, len(params) + 1)) - used
    if missing:
        sys.exit(f"pgsql.py: fn {fn} does not use ${sorted(missing)}: the statement changed?")
    lines = [l.rstrip() for l in out.strip("\n").splitlines() if l.strip()]
    print("\n".join(lines) + ";")


if __name__ == "__main__":
    main()
