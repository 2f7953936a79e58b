"""The API's calls as data: what to send and how to read the answer. Shared
by the sync and the async client, which differ only in how they send."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, Optional, TypeVar
from urllib.parse import quote

from .errors import ConfigError, DecodeError
from .models import (
    ConsumeOutcome,
    EventOutcome,
    Issued,
    KeyState,
    Order,
    OrderCreated,
    Recorded,
    Released,
    TokenState,
    consume_outcome,
)

T = TypeVar("T")

REPLAYED = "idempotent-replayed"


def new_request_id() -> str:
    """A new logical attempt's ``request_id``: a random UUID."""
    return str(uuid.uuid4())


@dataclass(frozen=True)
class Answer:
    """A success answer: its status, whether it repeats an earlier one, its body."""

    status: int
    replayed: bool
    body: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise DecodeError(self.status, str(e)) from e

    def obj(self) -> Dict[str, Any]:
        value = self.json()
        if not isinstance(value, dict):
            raise DecodeError(self.status, "expected a JSON object")
        return value


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    parse: Callable[[Answer], T]
    body: Optional[bytes] = None
    params: Optional[Dict[str, str]] = None


def _path(*segments: str) -> str:
    return "/" + "/".join(quote(s, safe="") for s in segments)


def _encode(body: Dict[str, Any]) -> bytes:
    clean = {k: v for k, v in body.items() if v is not None or k == "result"}
    try:
        return json.dumps(clean, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode(
            "utf-8"
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cannot encode the request as JSON: {e}") from e


def _decoding(status: int, f: Callable[[], T]) -> T:
    try:
        return f()
    except DecodeError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise DecodeError(status, f"{type(e).__name__}: {e}") from e


def _expect(outcome: str) -> Callable[[Answer], Dict[str, Any]]:
    def parse(a: Answer) -> Dict[str, Any]:
        d = a.obj()
        if d.get("outcome") != outcome:
            raise DecodeError(a.status, f"expected outcome {outcome!r}, got {d.get('outcome')!r}")
        return d

    return parse


def _nonempty(name: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name} must be a non-empty string")
    return value


# Tokens


def issue(biz_type: str, subject: str, ttl_seconds: Optional[int]) -> Call[Issued]:
    return Call(
        "POST",
        "/v1/tokens",
        lambda a: _decoding(a.status, lambda: Issued.from_json(a.obj())),
        _encode({"biz_type": biz_type, "subject": subject, "ttl_seconds": ttl_seconds}),
    )


def _consume_parse(request_id: str) -> Callable[[Answer], ConsumeOutcome]:
    return lambda a: _decoding(a.status, lambda: consume_outcome(a.obj(), a.replayed, request_id))


def consume(
    token: str,
    subject: str,
    biz_type: Optional[str],
    fingerprint: Optional[str],
    request_id: Optional[str],
    wait_ms: Optional[int],
) -> Call[ConsumeOutcome]:
    rid = request_id or new_request_id()
    return Call(
        "POST",
        _path("v1", "tokens", _nonempty("token", token), "consume"),
        _consume_parse(rid),
        _encode(
            {
                "subject": subject,
                "biz_type": biz_type,
                "fingerprint": fingerprint,
                "request_id": rid,
                "wait_ms": wait_ms,
            }
        ),
    )


def _recorded(a: Answer) -> Recorded:
    _expect("recorded")(a)
    return Recorded(replayed=a.replayed)


def _released(a: Answer) -> Released:
    _expect("released")(a)
    return Released()


def record_result(token: str, subject: str, result: Any, request_id: Optional[str] = None) -> Call[Recorded]:
    return Call(
        "POST",
        _path("v1", "tokens", _nonempty("token", token), "result"),
        _recorded,
        _encode({"subject": subject, "result": result, "request_id": request_id}),
    )


def release(token: str, subject: str, request_id: Optional[str] = None) -> Call[Released]:
    return Call(
        "POST",
        _path("v1", "tokens", _nonempty("token", token), "release"),
        _released,
        _encode({"subject": subject, "request_id": request_id}),
    )


def token_state(token: str, subject: str) -> Call[TokenState]:
    return Call(
        "GET",
        _path("v1", "tokens", _nonempty("token", token)),
        lambda a: _decoding(a.status, lambda: TokenState.from_json(a.obj())),
        params={"subject": subject},
    )


# Client-supplied keys


def consume_key(
    biz_type: str,
    key: str,
    subject: Optional[str],
    fingerprint: Optional[str],
    request_id: Optional[str],
    wait_ms: Optional[int],
) -> Call[ConsumeOutcome]:
    rid = request_id or new_request_id()
    return Call(
        "POST",
        "/v1/keys/consume",
        _consume_parse(rid),
        _encode(
            {
                "biz_type": biz_type,
                "key": key,
                "subject": subject,
                "fingerprint": fingerprint,
                "request_id": rid,
                "wait_ms": wait_ms,
            }
        ),
    )


def record_key_result(
    biz_type: str, key: str, result: Any, request_id: Optional[str] = None
) -> Call[Recorded]:
    return Call(
        "POST",
        "/v1/keys/result",
        _recorded,
        _encode({"biz_type": biz_type, "key": key, "result": result, "request_id": request_id}),
    )


def release_key(biz_type: str, key: str, request_id: Optional[str] = None) -> Call[Released]:
    return Call(
        "POST",
        "/v1/keys/release",
        _released,
        _encode({"biz_type": biz_type, "key": key, "request_id": request_id}),
    )


def key_state(biz_type: str, key: str) -> Call[KeyState]:
    return Call(
        "GET",
        "/v1/keys",
        lambda a: _decoding(a.status, lambda: KeyState.from_json(a.obj())),
        params={"biz_type": biz_type, "key": key},
    )


# Orders


def _order(a: Answer) -> Order:
    return _decoding(a.status, lambda: Order.from_json(a.obj()))


def create_order(order_id: str, subject: str, amount_minor: int, currency: str) -> Call[OrderCreated]:
    return Call(
        "POST",
        "/v1/orders",
        lambda a: OrderCreated(order=_order(a), created=a.status == 201),
        _encode(
            {
                "order_id": order_id,
                "subject": subject,
                "amount_minor": amount_minor,
                "currency": currency,
            }
        ),
    )


def get_order(order_id: str) -> Call[Order]:
    return Call("GET", _path("v1", "orders", _nonempty("order_id", order_id)), _order)


def _event_parse(a: Answer) -> EventOutcome:
    def parse() -> EventOutcome:
        d = a.obj()
        outcome = d.get("outcome")
        if outcome not in ("applied", "duplicate"):
            raise ValueError(f"unknown event outcome {outcome!r}")
        return EventOutcome(
            applied=outcome == "applied",
            order=Order.from_json(d["order"]),
            replayed=a.replayed and outcome == "applied",
        )

    return _decoding(a.status, parse)


def order_event(order_id: str, event: str, body: Dict[str, Any]) -> Call[EventOutcome]:
    body = dict(body)
    body["request_id"] = body.get("request_id") or new_request_id()
    return Call(
        "POST",
        _path("v1", "orders", _nonempty("order_id", order_id), event),
        _event_parse,
        _encode(body),
    )

