"""The ASGI middleware on a Starlette app, against the real ledger (the
whole conformance suite runs too: test_conformance.py)."""

from __future__ import annotations

import json
import logging
import socket
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from starlette.applications import Starlette
from starlette.authentication import AuthCredentials, AuthenticationBackend, BaseUser, SimpleUser, UnauthenticatedUser
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import HTTPConnection
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from idempotency_ledger import AsyncClient, RetryPolicy
from idempotency_ledger.asgi import (
    PROBLEM_BASE,
    IdempotencyMiddleware,
    InvalidKey,
    RequestInfo,
    default_scope,
    parse_idempotency_key,
    replay,
)

from conftest import unique


def make_app(ledger_url: str, api_key: str, runs: List[Dict[str, Any]], **options: Any) -> Starlette:
    async def charge(request: Request) -> Response:
        body = await request.json() if await request.body() else {}
        runs.append(body)
        if body.get("raise"):
            raise RuntimeError("handler failed")
        return JSONResponse(
            {"n": len(runs), "echo": body},
            status_code=body.get("status", 201),
            headers={"X-Charge-Id": f"ch_{len(runs)}", "X-Other": "o"},
        )

    client = options.pop("client", None) or AsyncClient(ledger_url, api_key)
    # Starlette's authentication outside the middleware (first in the list).
    auth = [Middleware(AuthenticationMiddleware, backend=HeaderAuth())] if options.pop("auth", False) else []
    return Starlette(
        routes=[Route("/charge", charge, methods=["POST", "PUT"])],
        middleware=auth + [Middleware(IdempotencyMiddleware, client=client, biz_type="order", **options)],
    )


class HeaderAuth(AuthenticationBackend):
    """Authenticates the user named by ``X-User`` (none: anonymous)."""

    async def authenticate(self, conn: HTTPConnection) -> Optional[Tuple[AuthCredentials, BaseUser]]:
        name = conn.headers.get("x-user")
        return (AuthCredentials(["authenticated"]), SimpleUser(name)) if name else None


@pytest.fixture
def runs() -> List[Dict[str, Any]]:
    return []


def tc(app: Starlette) -> TestClient:
    return TestClient(app, raise_server_exceptions=False)


def test_replay_and_stored_headers(ledger: Any, runs: List[Dict[str, Any]]) -> None:
    app = make_app(ledger.url, ledger.api_key, runs, stored_headers=["content-type", "x-charge-id"])
    key = unique("k")
    with tc(app) as c:
        first = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key})
        second = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key})
    assert first.status_code == second.status_code == 201
    assert "idempotent-replayed" not in first.headers
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json() == first.json() == {"n": 1, "echo": {"a": 1}}
    assert second.headers["x-charge-id"] == "ch_1" and "x-other" not in second.headers
    assert len(runs) == 1


def test_store_status_is_configurable(ledger: Any, runs: List[Dict[str, Any]]) -> None:
    app = make_app(ledger.url, ledger.api_key, runs, store_status=lambda s: 200 <= s < 300)
    key = unique("k")
    with tc(app) as c:
        for _ in range(2):
            r = c.post("/charge", json={"status": 404}, headers={"Idempotency-Key": key})
            assert r.status_code == 404 and "idempotent-replayed" not in r.headers
    assert len(runs) == 2
    # A collection of statuses works too; 500 is then stored.
    app = make_app(ledger.url, ledger.api_key, runs, store_status={201, 500})
    key = unique("k")
    with tc(app) as c:
        c.post("/charge", json={"status": 500}, headers={"Idempotency-Key": key})
        r = c.post("/charge", json={"status": 500}, headers={"Idempotency-Key": key})
    assert r.status_code == 500 and r.headers["idempotent-replayed"] == "true" and len(runs) == 3


def test_optional_key_passes_through(ledger: Any, runs: List[Dict[str, Any]]) -> None:
    with tc(make_app(ledger.url, ledger.api_key, runs, required=False)) as c:
        assert c.post("/charge", json={}).status_code == 201
        assert c.post("/charge", json={}).status_code == 201
    assert len(runs) == 2


def problem_of(r: Any, status: int, code: str) -> Dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    p: Dict[str, Any] = r.json()
    assert p["code"] == code and p["status"] == status and p["type"] == f"{PROBLEM_BASE}#{code}"
    assert p["title"] and p["detail"]
    return p


def test_problems(ledger: Any, runs: List[Dict[str, Any]]) -> None:
    app = make_app(ledger.url, ledger.api_key, runs, max_request_body=100, scope=lambda r: r.header("x-user"))
    with tc(app) as c:
        problem_of(c.post("/charge", json={}), 400, "idempotency_key_missing")
        problem_of(c.put("/charge", json={}), 400, "idempotency_key_missing")
        problem_of(c.post("/charge", json={}, headers={"Idempotency-Key": "é".encode()}), 400, "idempotency_key_invalid")
        problem_of(
            c.post("/charge", content=b"x" * 101, headers={"Idempotency-Key": unique()}), 413, "payload_too_large"
        )
        # A scoped key leaves 222 characters for the header's key.
        problem_of(
            c.post("/charge", json={}, headers={"Idempotency-Key": "k" * 223, "X-User": "u"}),
            400,
            "idempotency_key_invalid",
        )
        assert c.post("/charge", json={}, headers={"Idempotency-Key": unique() + "k" * 200, "X-User": "u"}).status_code == 201
        key = unique()
        c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key})
        problem_of(c.post("/charge", json={"a": 2}, headers={"Idempotency-Key": key}), 422, "idempotency_key_reused")
    assert len(runs) == 2


def test_ledger_unavailable_is_503_and_the_handler_does_not_run(runs: List[Dict[str, Any]]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = AsyncClient(f"http://127.0.0.1:{port}", "k", retry=RetryPolicy.none())
    with tc(make_app("unused", "unused", runs, client=dead)) as c:
        r = c.post("/charge", json={}, headers={"Idempotency-Key": unique()})
    problem_of(r, 503, "ledger_unavailable")
    assert r.headers["retry-after"] == "1" and runs == []


def test_a_refused_api_key_is_500_ledger_error_and_the_handler_does_not_run(
    ledger: Any, runs: List[Dict[str, Any]]
) -> None:
    # The ledger refusing the middleware's own API key: a misconfiguration,
    # answered with the code the Rust and Express middlewares answer too.
    with tc(make_app(ledger.url, "not-a-granted-key", runs, scope=lambda r: None)) as c:
        r = c.post("/charge", json={}, headers={"Idempotency-Key": unique()})
    problem_of(r, 500, "ledger_error")
    assert runs == []


def test_an_exception_releases_the_key(ledger: Any, runs: List[Dict[str, Any]]) -> None:
    key = unique()
    with tc(make_app(ledger.url, ledger.api_key, runs)) as c:
        assert c.post("/charge", json={"raise": True}, headers={"Idempotency-Key": key}).status_code == 500
        assert c.post("/charge", json={"raise": True}, headers={"Idempotency-Key": key}).status_code == 500
    assert len(runs) == 2


def test_parse_idempotency_key() -> None:
    assert parse_idempotency_key([]) is None
    assert parse_idempotency_key([b"abc"]) == "abc"
    assert parse_idempotency_key([b' "abc" ']) == "abc"
    assert parse_idempotency_key([b'"a\\"b\\\\c"']) == 'a"b\\c'
    assert parse_idempotency_key([b"k" * 255]) == "k" * 255
    for bad in ([b"a", b"b"], [b""], [b'""'], [b'"abc'], [b'"a"b"'], [b'"a\\b"'], [b"k" * 256], [b"\x01a"], [b"\xc3\xa9"]):
        with pytest.raises(InvalidKey):
            parse_idempotency_key(bad)


def test_replay_of_stored_forms() -> None:
    # The Rust layer's form of a body too large to store: no body at all.
    r = replay({"status": 201, "headers": [["content-type", "application/json"]]})
    assert r.status == 201 and r.body == b""
    assert (b"idempotent-body-omitted", b"true") in r.headers and (b"idempotent-replayed", b"true") in r.headers
    r = replay({"status": 200, "headers": [], "body_base64": "AAE="})
    assert r.body == b"\x00\x01" and (b"idempotent-body-omitted", b"true") not in r.headers
    r = replay({"status": 204, "headers": [], "body": ""})
    assert r.body == b"" and (b"idempotent-body-omitted", b"true") not in r.headers
    assert json.loads(replay("garbage").body)["code"] == "stored_response_unreadable"


def test_request_info_header() -> None:
    info = RequestInfo("POST", "/x?y=1", {"x-user": "alice"}, {})
    assert info.header("X-User") == "alice" and info.header("x-missing") is None


UNSCOPED = "has no scope and the request has no authenticated user"


def unscoped_warnings(caplog: pytest.LogCaptureFixture) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == "idempotency_ledger.asgi" and UNSCOPED in r.getMessage()]


def test_the_authenticated_user_scopes_keys_by_default(
    ledger: Any, runs: List[Dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idempotency_ledger.asgi")
    key = unique("k")
    with tc(make_app(ledger.url, ledger.api_key, runs, auth=True)) as c:
        alice = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key, "X-User": "alice"})
        # Another user's same key and body is another key: the handler runs.
        bob = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key, "X-User": "bob"})
        again = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key, "X-User": "alice"})
        # An anonymous caller is unscoped, and not warned about: the app authenticates.
        anonymous = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key})
    assert alice.status_code == bob.status_code == anonymous.status_code == 201
    assert "idempotent-replayed" not in bob.headers and "idempotent-replayed" not in anonymous.headers
    assert again.headers["idempotent-replayed"] == "true" and again.json() == alice.json()
    assert len(runs) == 3
    assert unscoped_warnings(caplog) == []


def test_no_scope_and_no_user_warns_once(
    ledger: Any, runs: List[Dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idempotency_ledger.asgi")
    with tc(make_app(ledger.url, ledger.api_key, runs)) as c:
        for _ in range(3):
            assert c.post("/charge", json={}, headers={"Idempotency-Key": unique()}).status_code == 201
    warnings = unscoped_warnings(caplog)
    assert len(warnings) == 1 and "biz type order" in warnings[0], warnings
    # Safe methods and refused requests never reach the scope: no warning either.
    caplog.clear()
    with tc(make_app(ledger.url, ledger.api_key, runs)) as c:
        c.get("/charge")
        c.post("/charge", json={})
    assert unscoped_warnings(caplog) == []


def test_an_explicit_scope_never_warns(
    ledger: Any, runs: List[Dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="idempotency_ledger.asgi")
    key = unique("k")
    # scope=lambda r: None: one key space on purpose; the user is not used.
    with tc(make_app(ledger.url, ledger.api_key, runs, auth=True, scope=lambda r: None)) as c:
        c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key, "X-User": "alice"})
        shared = c.post("/charge", json={"a": 1}, headers={"Idempotency-Key": key, "X-User": "bob"})
    assert shared.headers["idempotent-replayed"] == "true" and len(runs) == 1
    with tc(make_app(ledger.url, ledger.api_key, runs, scope=lambda r: r.header("x-tenant"))) as c:
        c.post("/charge", json={}, headers={"Idempotency-Key": unique()})
    assert unscoped_warnings(caplog) == []


def test_default_scope_reads_the_asgi_user() -> None:
    def info(**scope: Any) -> RequestInfo:
        return RequestInfo("POST", "/", {}, scope)

    class NameOnly(BaseUser):  # an older Starlette's SimpleUser: no identity
        @property
        def is_authenticated(self) -> bool:
            return True

        @property
        def display_name(self) -> str:
            return "carol"

    class Duck:  # not Starlette at all
        is_authenticated = True
        identity = 42

    class Nameless:
        is_authenticated = True
        identity = ""

    assert default_scope(info(user=SimpleUser("alice"))) == "alice"
    assert default_scope(info(user=NameOnly())) == "carol"
    assert default_scope(info(user=Duck())) == "42"
    assert default_scope(info(user=UnauthenticatedUser())) is None
    assert default_scope(info(user=Nameless())) is None
    assert default_scope(info(user=None)) is None
    assert default_scope(info()) is None
