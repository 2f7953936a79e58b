"""Fingerprints: ``sha256:<hex>`` of a business request, so that a token or
key consumed for one request is refused (``fingerprint_mismatch``) for
another. The same functions as the Rust client's, byte for byte."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Union

__all__ = ["fingerprint", "fingerprint_json", "request_fingerprint", "short_digest"]


def fingerprint(data: bytes) -> str:
    """``sha256:<hex>`` of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def fingerprint_json(value: Any) -> str:
    """The fingerprint of a value's compact JSON with sorted keys (equal
    values give equal fingerprints)."""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
    return fingerprint(text.encode("utf-8"))


def request_fingerprint(method: str, path_and_query: Union[str, bytes], body: bytes) -> str:
    """An HTTP request's fingerprint: method, path with query, and body, each
    prefixed by its length (8 bytes, big-endian) so no two different requests
    hash the same input."""
    h = hashlib.sha256()
    path = path_and_query.encode("utf-8") if isinstance(path_and_query, str) else path_and_query
    for part in (method.encode("ascii"), path, body):
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return "sha256:" + h.hexdigest()


def short_digest(text: str) -> str:
    """A short stable hex digest (first 16 bytes of SHA-256): scopes in keys."""
    return hashlib.sha256(text.encode("utf-8")).digest()[:16].hex()
