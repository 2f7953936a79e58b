"""The guard: the whole exactly-once pattern around one business step.

Consume; when this attempt won, run the step; record its output as the
result, or release the token (key) when the step failed *before any side
effect*. The safe answer is the default: an exception the step does not mark
counts as *after* side effects, so the token stays consumed and nothing runs
twice. Mark an exception as before side effects by raising
:class:`BeforeSideEffects` (or a subclass), by raising inside
``with before_side_effects():``, or with :func:`mark_before_side_effects`.

As a context manager::

    with client.guard_key("order", key, fingerprint=fp) as g:
        if g.completed:           # an earlier attempt ran it
            return g.result       # its recorded result
        receipt = charge_card()   # runs only when this attempt won
        g.record(receipt)

As a call (``guard.run(step)``) or a decorator (:func:`guarded`), the step's
return value is recorded and returned; a duplicate returns the recorded one.

Entering raises :class:`InProgressError` when another attempt holds the token
without a result (answer "in progress" and ask again later),
:class:`UncertainError` when its processing lease ran out with no result, and
the client's errors when the consume itself fails (the step did not run; a
:class:`~idempotency_ledger.TransportError` or 503 may be retried by entering
the same guard again: it keeps its ``request_id``).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Awaitable,
    Callable,
    Iterator,
    Optional,
    ParamSpec,
    Type,
    TypeVar,
    Union,
    cast,
)



from .errors import LedgerError
from .models import Consumed, ConsumeOutcome, Duplicate, DuplicateStatus, Released

if TYPE_CHECKING:
    from .client import AsyncClient, Client

__all__ = [
    "BeforeSideEffects",
    "before_side_effects",
    "mark_before_side_effects",
    "is_before_side_effects",
    "GuardError",
    "InProgressError",
    "UncertainError",
    "RecordError",
    "ReleaseError",
    "NotRecordedError",
    "TokenTarget",
    "KeyTarget",
    "Guard",
    "AsyncGuard",
    "guarded",
    "async_guarded",
]

P = ParamSpec("P")
R = TypeVar("R")
E = TypeVar("E", bound=BaseException)

_MARK = "__idempotency_before_side_effects__"


class BeforeSideEffects(Exception):
    """A step failure before any side effect: the guard releases the token
    so the same token (key) can be tried again. Raise it (or a subclass)."""


def mark_before_side_effects(exc: E) -> E:
    """Marks ``exc`` as a failure before any side effect; returns it."""
    setattr(exc, _MARK, True)
    return exc


def is_before_side_effects(exc: BaseException) -> bool:
    return isinstance(exc, BeforeSideEffects) or getattr(exc, _MARK, False) is True


@contextmanager
def before_side_effects() -> Iterator[None]:
    """Every exception raised inside is marked as before side effects
    (validation, a precondition, a call refused before it did anything)."""
    try:
        yield
    except Exception as e:
        mark_before_side_effects(e)
        raise


class GuardError(LedgerError):
    """Base of the guard's own errors."""


class InProgressError(GuardError):
    """Another attempt consumed it and has recorded nothing yet (it is
    running, or it died and an operator must release it). The step did not
    run; ask again later."""

    def __init__(self, outcome: Duplicate) -> None:
        super().__init__("another attempt holds this token (key) and has no result yet")
        self.outcome = outcome


class UncertainError(GuardError):
    """Another attempt consumed it and its processing lease ran out with no
    result: its outcome is unknown until someone checks. The step did not run."""

    def __init__(self, outcome: Duplicate) -> None:
        super().__init__("the attempt holding this token (key) has an uncertain outcome")
        self.outcome = outcome


class RecordError(GuardError):
    """The step succeeded (its side effects happened) but its output could
    not be recorded: record ``output`` yourself when the ledger is back.
    Until then duplicates raise InProgressError. ``__cause__`` is why."""

    def __init__(self, output: Any, error: LedgerError) -> None:
        super().__init__(f"step succeeded, recording its result failed: {error}")
        self.output = output
        self.error = error


class ReleaseError(GuardError):
    """The step failed before side effects but the release failed: the token
    stays consumed (as after side effects). ``step_error`` is the step's
    exception (also ``__cause__``), ``error`` the release's."""

    def __init__(self, step_error: BaseException, error: LedgerError) -> None:
        super().__init__(f"step failed before side effects and the release failed ({error}): {step_error}")
        self.step_error = step_error
        self.error = error


class NotRecordedError(GuardError):
    """The ``with`` block of a winning attempt ended without ``record()``:
    the token stays consumed (the step may have had side effects)."""


@dataclass(frozen=True)
class TokenTarget:
    token: str
    subject: str
    biz_type: Optional[str]
    fingerprint: Optional[str]
    request_id: str


@dataclass(frozen=True)
class KeyTarget:
    biz_type: str
    key: str
    subject: Optional[str]
    fingerprint: Optional[str]
    request_id: str


Target = Union[TokenTarget, KeyTarget]


class _GuardState:
    def __init__(self, target: Target) -> None:
        self.target = target
        self.outcome: Optional[ConsumeOutcome] = None
        self.recorded = False
        self._result: Any = None

    @property
    def request_id(self) -> str:
        return self.target.request_id

    @property
    def won(self) -> bool:
        """This attempt consumed it: the step is to run here."""
        return isinstance(self.outcome, Consumed)

    @property
    def completed(self) -> bool:
        """An earlier attempt ran the step: ``result`` is what it recorded."""
        return isinstance(self.outcome, Duplicate) and self.outcome.status is DuplicateStatus.COMPLETED

    @property
    def result(self) -> Any:
        """The recorded result (an earlier attempt's, or the one this
        attempt recorded)."""
        if isinstance(self.outcome, Duplicate):
            return self.outcome.result
        return self._result

    def _accept(self, outcome: ConsumeOutcome) -> None:
        if isinstance(outcome, Duplicate):
            if outcome.status is DuplicateStatus.PROCESSING:
                raise InProgressError(outcome)
            if outcome.status is DuplicateStatus.UNCERTAIN:
                raise UncertainError(outcome)
        self.outcome = outcome

    def _check_enter(self) -> None:
        if self.outcome is not None:
            raise RuntimeError("a guard is one attempt: it was already entered")

    def _check_record(self) -> None:
        if not self.won:
            raise RuntimeError("record() only when this attempt won (check `completed` first)")
        if self.recorded:
            raise RuntimeError("record() once per attempt")


class Guard(_GuardState):
    """One guarded attempt with the sync :class:`Client`; see the module docs."""

    def __init__(self, client: "Client", target: Target) -> None:
        super().__init__(target)
        self.client = client

    def __enter__(self) -> "Guard":
        self._check_enter()
        t = self.target
        if isinstance(t, TokenTarget):
            outcome = self.client.consume(
                t.token, t.subject, biz_type=t.biz_type, fingerprint=t.fingerprint, request_id=t.request_id
            )
        else:
            outcome = self.client.consume_key(
                t.biz_type, t.key, subject=t.subject, fingerprint=t.fingerprint, request_id=t.request_id
            )
        self._accept(outcome)
        return self

    def record(self, result: Any) -> None:
        """Records the step's output as the result (once, when this attempt won)."""
        self._check_record()
        t = self.target
        try:
            if isinstance(t, TokenTarget):
                self.client.record_result(t.token, t.subject, result, request_id=t.request_id)
            else:
                self.client.record_key_result(t.biz_type, t.key, result, request_id=t.request_id)
        except LedgerError as e:
            raise RecordError(result, e) from e
        self.recorded = True
        self._result = result

    def release(self) -> Released:
        t = self.target
        if isinstance(t, TokenTarget):
            return self.client.release(t.token, t.subject, request_id=t.request_id)
        return self.client.release_key(t.biz_type, t.key, request_id=t.request_id)

    def __exit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if not self.won:
            return
        if exc is None:
            if not self.recorded:
                raise NotRecordedError("the guarded block ended without record(); the token stays consumed")
            return
        if is_before_side_effects(exc):
            try:
                self.release()
            except LedgerError as e:
                raise ReleaseError(exc, e) from exc
        # Any other exception: after side effects, the token stays consumed.

    def run(self, step: Callable[[], R], decode: Optional[Callable[[Any], R]] = None) -> R:
        """Consumes, runs ``step`` when this attempt won and records its
        output; returns the output, or a duplicate's recorded result
        (through ``decode`` when given)."""
        with self as g:
            if g.completed:
                return decode(g.result) if decode else cast(R, g.result)
            output = step()
            g.record(output)
            return output


class AsyncGuard(_GuardState):
    """One guarded attempt with the :class:`AsyncClient` (``async with``)."""

    def __init__(self, client: "AsyncClient", target: Target) -> None:
        super().__init__(target)
        self.client = client

    async def __aenter__(self) -> "AsyncGuard":
        self._check_enter()
        t = self.target
        if isinstance(t, TokenTarget):
            outcome = await self.client.consume(
                t.token, t.subject, biz_type=t.biz_type, fingerprint=t.fingerprint, request_id=t.request_id
            )
        else:
            outcome = await self.client.consume_key(
                t.biz_type, t.key, subject=t.subject, fingerprint=t.fingerprint, request_id=t.request_id
            )
        self._accept(outcome)
        return self

    async def record(self, result: Any) -> None:
        self._check_record()
        t = self.target
        try:
            if isinstance(t, TokenTarget):
                await self.client.record_result(t.token, t.subject, result, request_id=t.request_id)
            else:
                await self.client.record_key_result(t.biz_type, t.key, result, request_id=t.request_id)
        except LedgerError as e:
            raise RecordError(result, e) from e
        self.recorded = True
        self._result = result

    async def release(self) -> Released:
        t = self.target
        if isinstance(t, TokenTarget):
            return await self.client.release(t.token, t.subject, request_id=t.request_id)
        return await self.client.release_key(t.biz_type, t.key, request_id=t.request_id)

    async def __aexit__(
        self,
        exc_type: Optional[Type[BaseException]],
        exc: Optional[BaseException],
        tb: Optional[TracebackType],
    ) -> None:
        if not self.won:
            return
        if exc is None:
            if not self.recorded:
                raise NotRecordedError("the guarded block ended without record(); the token stays consumed")
            return
        if is_before_side_effects(exc):
            try:
                await self.release()
            except LedgerError as e:
                raise ReleaseError(exc, e) from exc

    async def run(self, step: Callable[[], Awaitable[R]], decode: Optional[Callable[[Any], R]] = None) -> R:
        async with self as g:
            if g.completed:
                return decode(g.result) if decode else cast(R, g.result)
            output = await step()
            await g.record(output)
            return output


def guarded(
    make_guard: Callable[P, Guard], decode: Optional[Callable[[Any], Any]] = None
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: each call builds its guard from the call's arguments
    (``make_guard(*args, **kwargs)``) and runs the function under it. The
    return value must be JSON-serializable; a duplicate returns the recorded
    one (through ``decode`` when given)::

        @guarded(lambda order_id, amount: client.guard_key("order", f"pay-{order_id}"))
        def pay(order_id: str, amount: int) -> dict: ...
    """

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            return cast(R, make_guard(*args, **kwargs).run(lambda: fn(*args, **kwargs), decode))

        return inner

    return wrap


def async_guarded(
    make_guard: Callable[P, AsyncGuard], decode: Optional[Callable[[Any], Any]] = None
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """:func:`guarded` for coroutine functions and the :class:`AsyncClient`."""

    def wrap(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            return cast(R, await make_guard(*args, **kwargs).run(lambda: fn(*args, **kwargs), decode))

        return inner

    return wrap
