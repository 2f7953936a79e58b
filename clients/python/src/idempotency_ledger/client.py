"""The clients: :class:`Client` (sync) and :class:`AsyncClient` (asyncio),
both over httpx, with the same methods and the same retry policy."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, Optional, TypeVar

import httpx

from . import _calls as calls
from .errors import ApiError, ConfigError, LedgerError, TransportError, error_from_answer, parse_retry_after
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
)
from .retry import RetryPolicy

__all__ = ["Client", "AsyncClient"]

if TYPE_CHECKING:
    from .guard import AsyncGuard, Guard

T = TypeVar("T")


def _check_config(base_url: str, api_key: str) -> str:
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, TypeError) as e:
        raise ConfigError(f"base URL {base_url!r}: {e}") from e
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"base URL {base_url!r} must be http:// or https:// with a host")
    if not api_key or any(ord(c) < 0x20 or ord(c) > 0x7E for c in api_key):
        raise ConfigError("the API key must be non-empty printable ASCII")
    return base_url.rstrip("/")


def _headers(api_key: str, call: calls.Call[Any]) -> Dict[str, str]:
    h = {"Authorization": f"Bearer {api_key}", "Accept": "application/json"}
    if call.body is not None:
        h["Content-Type"] = "application/json"
    return h


def _answer(call: calls.Call[T], resp: httpx.Response) -> T:
    if 200 <= resp.status_code < 300:
        replayed = resp.headers.get(calls.REPLAYED, "").strip().lower() == "true"
        return call.parse(calls.Answer(resp.status_code, replayed, resp.content))
    raise error_from_answer(
        resp.status_code, resp.content, parse_retry_after(resp.headers.get("retry-after"))
    )


def _transport(e: httpx.TransportError) -> TransportError:
    err = TransportError(f"{type(e).__name__}: {e}")
    err.__cause__ = e
    return err


class _Retrying:
    """The schedule of one logical call: yields the timeout of each try,
    then, after a retryable failure, decides whether and how long to wait."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.started = time.monotonic()
        self.waits: Iterator[float] = policy.backoff()

    def timeout(self) -> float:
        left = self.policy.deadline - (time.monotonic() - self.started)
        return max(0.001, min(self.policy.attempt_timeout, left))

    def wait_after(self, err: LedgerError) -> Optional[float]:
        """Seconds to wait before the next try, or None to give up."""
        if not err.retryable:
            return None
        backoff = next(self.waits, None)
        if backoff is None:
            return None
        wait = max(backoff, err.retry_after or 0.0)
        if time.monotonic() - self.started + wait >= self.policy.deadline:
            return None
        return wait


class _Methods:
    """The calls of the API, as `_run(call)`; the subclasses send them."""

    _retry: RetryPolicy

    def __init__(self, base_url: str, api_key: str, retry: Optional[RetryPolicy]) -> None:
        self.base_url = _check_config(base_url, api_key)
        self._api_key = api_key
        self._retry = retry or RetryPolicy()

    def __repr__(self) -> str:  # never the API key
        return f"{type(self).__name__}({self.base_url!r}, retry={self._retry!r})"


class Client(_Methods):
    """A handle on one ledger (sync). One per process; thread-safe (httpx).

    ``Client("http://127.0.0.1:8080", "dev-payments-key")``; use it as a
    context manager or call :meth:`close` to close its connections.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        retry: Optional[RetryPolicy] = None,
        http: Optional[httpx.Client] = None,
    ) -> None:
        super().__init__(base_url, api_key, retry)
        self._owns_http = http is None
        self._http = http or httpx.Client(follow_redirects=False, timeout=self._retry.attempt_timeout)

    def close(self) -> None:
        """Closes the connection pool (when this client made it)."""
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: calls.Call[T], retry: Optional[RetryPolicy] = None) -> T:
        schedule = _Retrying(retry or self._retry)
        while True:
            try:
                resp = self._http.request(
                    call.method,
                    self.base_url + call.path,
                    params=call.params,
                    content=call.body,
                    headers=_headers(self._api_key, call),
                    timeout=schedule.timeout(),
                )
                return _answer(call, resp)
            except httpx.TransportError as e:
                err: LedgerError = _transport(e)
            except ApiError as e:
                err = e
            wait = schedule.wait_after(err)
            if wait is None:
                raise err
            time.sleep(wait)

    # Tokens

    def issue(self, biz_type: str, subject: str, *, ttl_seconds: Optional[int] = None) -> Issued:
        """Issues a token (``POST /v1/tokens``)."""
        return self._run(calls.issue(biz_type, subject, ttl_seconds))

    def consume(
        self,
        token: str,
        subject: str,
        *,
        biz_type: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
        wait_ms: Optional[int] = None,
    ) -> ConsumeOutcome:
        """Consumes ``token`` for one attempt. Every try of this call sends
        the same ``request_id`` (``request_id`` or a new UUID, returned on
        the outcome): keep it to ask again after a lost answer."""
        return self._run(calls.consume(token, subject, biz_type, fingerprint, request_id, wait_ms))

    def record_result(self, token: str, subject: str, result: Any, *, request_id: Optional[str] = None) -> Recorded:
        """Records the business result of a token this client consumed. With
        ``request_id`` (the one your consume sent), only while that consume
        holds the token: after a release and another attempt's consume,
        ``NotConsumed`` instead of writing onto the other attempt's."""
        return self._run(calls.record_result(token, subject, result, request_id))

    def release(self, token: str, subject: str, *, request_id: Optional[str] = None) -> Released:
        """Gives a consumed token back (the step failed before any side
        effect); with ``request_id``, only while that consume holds it."""
        return self._run(calls.release(token, subject, request_id))

    def token_state(self, token: str, subject: str) -> TokenState:
        """Reads a token's state without consuming it."""
        return self._run(calls.token_state(token, subject))

    # Client-supplied keys

    def consume_key(
        self,
        biz_type: str,
        key: str,
        *,
        subject: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
        wait_ms: Optional[int] = None,
    ) -> ConsumeOutcome:
        """Consumes a client-supplied key (``POST /v1/keys/consume``)."""
        return self._run(calls.consume_key(biz_type, key, subject, fingerprint, request_id, wait_ms))

    def record_key_result(
        self, biz_type: str, key: str, result: Any, *, request_id: Optional[str] = None
    ) -> Recorded:
        return self._run(calls.record_key_result(biz_type, key, result, request_id))

    def release_key(self, biz_type: str, key: str, *, request_id: Optional[str] = None) -> Released:
        return self._run(calls.release_key(biz_type, key, request_id))

    def key_state(self, biz_type: str, key: str) -> KeyState:
        """``GET /v1/keys``; a key nobody consumed raises KeyNotFoundError."""
        return self._run(calls.key_state(biz_type, key))

    # Orders

    def create_order(self, order_id: str, subject: str, amount_minor: int, currency: str) -> OrderCreated:
        return self._run(calls.create_order(order_id, subject, amount_minor, currency))

    def get_order(self, order_id: str) -> Order:
        return self._run(calls.get_order(order_id))

    def pay_order(
        self,
        order_id: str,
        token: str,
        *,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> EventOutcome:
        """CREATED -> PAID."""
        body = {"token": token, "fingerprint": fingerprint, "request_id": request_id}
        return self._run(calls.order_event(order_id, "pay", body))

    def refund_order(
        self,
        order_id: str,
        token: str,
        amount_minor: int,
        *,
        reason: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> EventOutcome:
        """PAID / PARTIALLY_REFUNDED -> PARTIALLY_REFUNDED / REFUNDED."""
        body = {"token": token, "amount_minor": amount_minor, "reason": reason, "request_id": request_id}
        return self._run(calls.order_event(order_id, "refund", body))

    def close_order(self, order_id: str, token: str, *, request_id: Optional[str] = None) -> EventOutcome:
        """CREATED -> CLOSED."""
        return self._run(calls.order_event(order_id, "close", {"token": token, "request_id": request_id}))

    # Guards

    def guard_token(
        self,
        token: str,
        subject: str,
        *,
        biz_type: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> "Guard":
        """A consume-run-record guard over a token; see :class:`Guard`."""
        from .guard import Guard, TokenTarget

        return Guard(self, TokenTarget(token, subject, biz_type, fingerprint, request_id or calls.new_request_id()))

    def guard_key(
        self,
        biz_type: str,
        key: str,
        *,
        subject: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> "Guard":
        """A consume-run-record guard over a client-supplied key; see :class:`Guard`."""
        from .guard import Guard, KeyTarget

        return Guard(self, KeyTarget(biz_type, key, subject, fingerprint, request_id or calls.new_request_id()))


class AsyncClient(_Methods):
    """A handle on one ledger (asyncio); the same methods as :class:`Client`,
    awaited. Use ``async with`` or call :meth:`aclose`."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        retry: Optional[RetryPolicy] = None,
        http: Optional[httpx.AsyncClient] = None,
    ) -> None:
        super().__init__(base_url, api_key, retry)
        self._owns_http = http is None
        self._http = http or httpx.AsyncClient(follow_redirects=False, timeout=self._retry.attempt_timeout)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _run(self, call: calls.Call[T], retry: Optional[RetryPolicy] = None) -> T:
        schedule = _Retrying(retry or self._retry)
        while True:
            try:
                resp = await self._http.request(
                    call.method,
                    self.base_url + call.path,
                    params=call.params,
                    content=call.body,
                    headers=_headers(self._api_key, call),
                    timeout=schedule.timeout(),
                )
                return _answer(call, resp)
            except httpx.TransportError as e:
                err: LedgerError = _transport(e)
            except ApiError as e:
                err = e
            wait = schedule.wait_after(err)
            if wait is None:
                raise err
            await asyncio.sleep(wait)

    async def issue(self, biz_type: str, subject: str, *, ttl_seconds: Optional[int] = None) -> Issued:
        return await self._run(calls.issue(biz_type, subject, ttl_seconds))

    async def consume(
        self,
        token: str,
        subject: str,
        *,
        biz_type: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
        wait_ms: Optional[int] = None,
    ) -> ConsumeOutcome:
        return await self._run(calls.consume(token, subject, biz_type, fingerprint, request_id, wait_ms))

    async def record_result(
        self, token: str, subject: str, result: Any, *, request_id: Optional[str] = None
    ) -> Recorded:
        return await self._run(calls.record_result(token, subject, result, request_id))

    async def release(self, token: str, subject: str, *, request_id: Optional[str] = None) -> Released:
        return await self._run(calls.release(token, subject, request_id))

    async def token_state(self, token: str, subject: str) -> TokenState:
        return await self._run(calls.token_state(token, subject))

    async def consume_key(
        self,
        biz_type: str,
        key: str,
        *,
        subject: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
        wait_ms: Optional[int] = None,
    ) -> ConsumeOutcome:
        return await self._run(calls.consume_key(biz_type, key, subject, fingerprint, request_id, wait_ms))

    async def record_key_result(
        self, biz_type: str, key: str, result: Any, *, request_id: Optional[str] = None
    ) -> Recorded:
        return await self._run(calls.record_key_result(biz_type, key, result, request_id))

    async def release_key(self, biz_type: str, key: str, *, request_id: Optional[str] = None) -> Released:
        return await self._run(calls.release_key(biz_type, key, request_id))

    async def key_state(self, biz_type: str, key: str) -> KeyState:
        return await self._run(calls.key_state(biz_type, key))

    async def create_order(self, order_id: str, subject: str, amount_minor: int, currency: str) -> OrderCreated:
        return await self._run(calls.create_order(order_id, subject, amount_minor, currency))

    async def get_order(self, order_id: str) -> Order:
        return await self._run(calls.get_order(order_id))

    async def pay_order(
        self,
        order_id: str,
        token: str,
        *,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> EventOutcome:
        body = {"token": token, "fingerprint": fingerprint, "request_id": request_id}
        return await self._run(calls.order_event(order_id, "pay", body))

    async def refund_order(
        self,
        order_id: str,
        token: str,
        amount_minor: int,
        *,
        reason: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> EventOutcome:
        body = {"token": token, "amount_minor": amount_minor, "reason": reason, "request_id": request_id}
        return await self._run(calls.order_event(order_id, "refund", body))

    async def close_order(self, order_id: str, token: str, *, request_id: Optional[str] = None) -> EventOutcome:
        return await self._run(calls.order_event(order_id, "close", {"token": token, "request_id": request_id}))

    def guard_token(
        self,
        token: str,
        subject: str,
        *,
        biz_type: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> "AsyncGuard":
        from .guard import AsyncGuard, TokenTarget

        return AsyncGuard(self, TokenTarget(token, subject, biz_type, fingerprint, request_id or calls.new_request_id()))

    def guard_key(
        self,
        biz_type: str,
        key: str,
        *,
        subject: Optional[str] = None,
        fingerprint: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> "AsyncGuard":
        from .guard import AsyncGuard, KeyTarget

        return AsyncGuard(self, KeyTarget(biz_type, key, subject, fingerprint, request_id or calls.new_request_id()))

