"""The conformance vectors (conformance/vectors) against the Python fixture
app (conformance/fixtures/python_app.py), through the runner's functions."""

from __future__ import annotations

import secrets
from typing import Any, Dict, Iterator

import pytest

import run  # conformance/run.py (conftest puts conformance/ on sys.path)

VECTORS = run.load_vectors()


@pytest.fixture(scope="module")
def fixture_app(ledger: Any) -> Iterator[run.RunningFixture]:
    fx = run.fixtures()["python"]
    assert fx.why_unavailable is None, fx.why_unavailable
    running = run.RunningFixture(fx, ledger.url, ledger.api_key)
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector(fixture_app: run.RunningFixture, vector: Dict[str, Any]) -> None:
    errors = run.run_vector(fixture_app.url, vector, f"pytest-{secrets.token_hex(6)}")
    assert not errors, "\n".join(errors) + "\n" + fixture_app.log_tail()


def test_the_checker_catches_a_wrong_expectation(fixture_app: run.RunningFixture) -> None:
    wrong = {
        "name": "wrong",
        "description": "expects a replay where there is none",
        "steps": [
            {
                "request": {"method": "POST", "path": "/charge", "headers": {"Idempotency-Key": "{run}"}, "body": {}},
                "expect": {"status": 201, "headers": {"Idempotent-Replayed": "true"}, "invocations": 2},
            }
        ],
    }
    errors = run.run_vector(fixture_app.url, wrong, f"pytest-{secrets.token_hex(6)}")
    assert len(errors) == 2, errors
