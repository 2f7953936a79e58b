"""A real ledger for the whole session (conformance/ledger.py starts it)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Iterator

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "conformance"))

from ledger import Ledger  # noqa: E402

from idempotency_ledger import Client  # noqa: E402


@pytest.fixture(scope="session")
def ledger() -> Iterator[Ledger]:
    with Ledger() as running:
        yield running


@pytest.fixture
def client(ledger: Ledger) -> Iterator[Client]:
    with Client(ledger.url, ledger.api_key) as c:
        yield c


def unique(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
