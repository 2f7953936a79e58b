"""Typed answers of the ledger.

A consume answers :class:`Consumed` (this attempt won: run the step) or
:class:`Duplicate` (another attempt consumed it; ``status`` says whether it is
still ``processing``, ``completed`` with its ``result``, or ``uncertain``).
Match on the type: only ``Consumed`` lets you run the business step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from typing import Any, List, Mapping, Optional, Union

__all__ = [
    "parse_time",
    "DuplicateStatus",
    "State",
    "Issued",
    "Consumed",
    "Duplicate",
    "ConsumeOutcome",
    "Recorded",
    "Released",
    "TokenState",
    "KeyState",
    "OrderState",
    "OrderEvent",
    "Order",
    "OrderCreated",
    "EventOutcome",
]

_FRACTION = re.compile(r"\.(\d+)")


def parse_time(text: str) -> datetime:
    """An RFC 3339 time (``Z`` or an offset; any number of fraction digits,
    kept to microseconds) as an aware :class:`datetime`."""
    t = text.strip()
    if t.endswith(("Z", "z")):
        t = t[:-1] + "+00:00"
    t = _FRACTION.sub(lambda m: "." + (m.group(1) + "000000")[:6], t, count=1)
    dt = datetime.fromisoformat(t)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt


def _opt_time(value: Any) -> Optional[datetime]:
    return parse_time(value) if isinstance(value, str) else None


class DuplicateStatus(str, Enum):
    """What a duplicate consume learned about the attempt that won."""

    #: Consumed, no result yet: the winner is running (or died; an operator
    #: then releases it). Do not run the step; ask again later.
    PROCESSING = "processing"
    #: The winner recorded its result: answer with it.
    COMPLETED = "completed"
    #: Its processing lease ran out with no result: the outcome is unknown
    #: until someone checks (not a safe retry).
    UNCERTAIN = "uncertain"


class State(str, Enum):
    """The state of a token or key."""

    ISSUED = "issued"
    CONSUMED = "consumed"
    UNCERTAIN = "uncertain"
    EXPIRED = "expired"
    #: A state this version of the client does not know.
    OTHER = "other"

    @classmethod
    def _missing_(cls, value: object) -> "State":
        return cls.OTHER


@dataclass(frozen=True)
class Issued:
    token: str
    biz_type: str
    subject: str
    expires_at: datetime
    #: Seconds the token lives.
    expire_time: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Issued":
        return cls(
            token=d["token"],
            biz_type=d["biz_type"],
            subject=d["subject"],
            expires_at=parse_time(d["expires_at"]),
            expire_time=int(d["expire_time"]),
        )


@dataclass(frozen=True)
class Consumed:
    """This attempt consumed it: run the business step now, then record its
    result (or release it when the step failed before any side effect).
    ``replayed``: an earlier try of this same attempt (same ``request_id``)
    won and its answer was lost; you are still the winner."""

    consumed_at: datetime
    request_id: str
    replayed: bool = False
    token: Optional[str] = None
    key: Optional[str] = None

    @property
    def won(self) -> bool:
        return True


@dataclass(frozen=True)
class Duplicate:
    """Another attempt consumed it: do not run the step."""

    status: DuplicateStatus
    request_id: str
    consumed_at: Optional[datetime] = None
    #: The winner's recorded result (``status`` completed); ``None`` otherwise.
    result: Any = None

    @property
    def won(self) -> bool:
        return False


ConsumeOutcome = Union[Consumed, Duplicate]


def consume_outcome(d: Mapping[str, Any], replayed: bool, request_id: str) -> ConsumeOutcome:
    outcome = d.get("outcome")
    if outcome == "consumed":
        return Consumed(
            consumed_at=parse_time(d["consumed_at"]),
            request_id=request_id,
            replayed=replayed,
            token=d.get("token"),
            key=d.get("key"),
        )
    if outcome == "duplicate":
        return Duplicate(
            status=DuplicateStatus(d["status"]),
            request_id=request_id,
            consumed_at=_opt_time(d.get("consumed_at")),
            result=d.get("result"),
        )
    raise ValueError(f"unknown consume outcome {outcome!r}")


@dataclass(frozen=True)
class Recorded:
    """A result was recorded; ``replayed``: this very result already was."""

    replayed: bool = False


@dataclass(frozen=True)
class Released:
    """A consumed token (key) was given back: it can be consumed again."""


@dataclass(frozen=True)
class TokenState:
    token: str
    biz_type: str
    state: State
    expires_at: datetime
    consumed_at: Optional[datetime] = None
    result: Any = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "TokenState":
        return cls(
            token=d["token"],
            biz_type=d["biz_type"],
            state=State(d["state"]),
            expires_at=parse_time(d["expires_at"]),
            consumed_at=_opt_time(d.get("consumed_at")),
            result=d.get("result"),
        )


@dataclass(frozen=True)
class KeyState:
    key: str
    biz_type: str
    state: State
    consumed_at: Optional[datetime] = None
    result: Any = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "KeyState":
        return cls(
            key=d["key"],
            biz_type=d["biz_type"],
            state=State(d["state"]),
            consumed_at=_opt_time(d.get("consumed_at")),
            result=d.get("result"),
        )


class OrderState(str, Enum):
    CREATED = "CREATED"
    PAID = "PAID"
    PARTIALLY_REFUNDED = "PARTIALLY_REFUNDED"
    REFUNDED = "REFUNDED"
    CLOSED = "CLOSED"


@dataclass(frozen=True)
class OrderEvent:
    #: ``order.created``, ``order.paid``, ``order.refunded`` or ``order.closed``.
    kind: str
    amount_minor: int
    at: datetime
    #: The token the event consumed (none for ``order.created``).
    token: Optional[str] = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "OrderEvent":
        return cls(
            kind=d["kind"],
            amount_minor=int(d["amount_minor"]),
            at=parse_time(d["at"]),
            token=d.get("token"),
        )


@dataclass(frozen=True)
class Order:
    order_id: str
    subject: str
    state: OrderState
    amount_minor: int
    refunded_minor: int
    currency: str
    created_at: datetime
    updated_at: datetime
    events: List[OrderEvent] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Order":
        return cls(
            order_id=d["order_id"],
            subject=d["subject"],
            state=OrderState(d["state"]),
            amount_minor=int(d["amount_minor"]),
            refunded_minor=int(d["refunded_minor"]),
            currency=d["currency"],
            created_at=parse_time(d["created_at"]),
            updated_at=parse_time(d["updated_at"]),
            events=[OrderEvent.from_json(e) for e in d.get("events", [])],
        )


@dataclass(frozen=True)
class OrderCreated:
    order: Order
    #: False when this identical order already existed (a retry).
    created: bool


@dataclass(frozen=True)
class EventOutcome:
    """What an order event answered. ``applied``: this request applied it
    (``replayed``: an earlier try of it, same ``request_id``, did and its
    answer was lost). Not applied: the same token already applied this same
    event earlier; nothing changed now."""

    applied: bool
    order: Order
    replayed: bool = False
