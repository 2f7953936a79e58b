"""Every problem ``code`` any middleware (Python, Rust, Express) can answer
has its heading in docs/integration.md, which its ``type`` links to
(``PROBLEM_BASE#<code>``), and every code heading there is answered by
some middleware. Read from the sources: no ledger needed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Set

from idempotency_ledger.asgi import PROBLEM_BASE

REPO = Path(__file__).resolve().parents[3]
DOCS = REPO / "docs" / "integration.md"


def python_codes() -> Set[str]:
    source = (REPO / "clients/python/src/idempotency_ledger/asgi.py").read_text()
    found = re.findall(r'problem\(\s*\d+,\s*"([a-z_]+)"', source)
    calls = re.findall(r"(?<!def )\bproblem\(", source)
    assert len(found) == len(calls), "a problem() call whose code is not a literal: the check cannot see it"
    return set(found)


def rust_codes() -> Set[str]:
    codes = (REPO / "clients/rust/src/layer/codes.rs").read_text()
    found = set(re.findall(r'pub const [A-Z_]+: &str = "([a-z_]+)";', codes))
    # The layer answers through these constants only, never a literal code.
    for path in [REPO / "clients/rust/src/layer.rs", *(REPO / "clients/rust/src/layer").glob("*.rs")]:
        literal = re.findall(r'problem\(\s*StatusCode::\w+,\s*"', path.read_text())
        assert not literal, f"{path}: a problem code written as a literal; use layer::codes"
    return found


def express_codes() -> Set[str]:
    source = (REPO / "clients/typescript/src/express/problem.ts").read_text()
    union = re.search(r"export type ProblemCode =(.*?);", source, re.S)
    assert union, "no ProblemCode type in problem.ts"
    return set(re.findall(r'"([a-z_]+)"', union.group(1)))


def doc_code_headings() -> Set[str]:
    text = DOCS.read_text()
    section = re.search(r"^## Middleware problem codes\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "docs/integration.md has no 'Middleware problem codes' section"
    return set(re.findall(r"^### ([a-z_]+)\s*$", section.group(1), re.M))


def all_codes() -> Dict[str, Set[str]]:
    return {"python": python_codes(), "rust": rust_codes(), "express": express_codes()}


def test_every_middleware_code_has_a_heading_in_the_integration_docs() -> None:
    headings = doc_code_headings()
    for middleware, codes in all_codes().items():
        assert len(codes) >= 7, f"{middleware}: found only {sorted(codes)}: is the parser stale?"
        missing = codes - headings
        assert not missing, f"{middleware} answers {sorted(missing)} with no '### <code>' heading in {DOCS}"


def test_every_code_heading_is_answered_by_some_middleware() -> None:
    emitted = set().union(*all_codes().values())
    stale = doc_code_headings() - emitted
    assert not stale, f"{DOCS} documents codes no middleware answers: {sorted(stale)}"


def test_the_refused_middleware_code_is_the_same_everywhere() -> None:
    # The ledger refusing the middleware's own API key or biz type.
    for middleware, codes in all_codes().items():
        assert "ledger_error" in codes, middleware
        assert "ledger_refused" not in codes, middleware


def test_problem_types_link_into_the_integration_docs() -> None:
    assert PROBLEM_BASE.endswith("/docs/integration.md")
