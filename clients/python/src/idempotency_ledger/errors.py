"""Errors: one exception class per API error code, plus failures on the way.

Every error of the ledger is an :class:`ApiError` carrying the API's ``error``
code, the HTTP ``status``, the ``message`` (for humans; never match on it),
the whole JSON ``body`` and ``retry_after`` (seconds, when the answer had a
``Retry-After``). Match on the subclass (``except TokenExpiredError``) or on
``code``.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Mapping, Optional, Type

__all__ = [
    "LedgerError",
    "ApiError",
    "TransportError",
    "DecodeError",
    "ConfigError",
    "error_from_answer",
    "ERRORS",
]


class LedgerError(Exception):
    """Base class of everything this package raises about a ledger call."""

    code: Optional[str] = None
    status: Optional[int] = None
    retry_after: Optional[float] = None

    @property
    def retryable(self) -> bool:
        """Whether the client retries it: no answer, or a 503."""
        return False


class ApiError(LedgerError):
    """An error answer of the ledger (``{"error": code, "message": ...}``)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        body: Optional[Mapping[str, Any]] = None,
        retry_after: Optional[float] = None,
    ) -> None:
        super().__init__(f"{code} ({status}): {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body: Dict[str, Any] = dict(body or {})
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.status == 503


class TransportError(LedgerError):
    """No answer: connecting failed, the connection broke or a try timed out,
    on every try the retry policy allowed. The ledger may or may not have
    acted: call again with the same ``request_id`` to learn what happened."""

    @property
    def retryable(self) -> bool:
        return True


class DecodeError(LedgerError):
    """A success answer this client could not read."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"undecodable {status} answer: {detail}")
        self.status = status


class ConfigError(LedgerError):
    """A bad base URL, API key or argument given to the client."""




class InvalidRequestError(ApiError):
    """400 ``invalid_request``: the body or query does not fit the API."""


class TokenInvalidError(ApiError):
    """400 ``token_invalid``: malformed token, bad tag, unknown signing key."""


class TokenExpiredError(ApiError):
    """400 ``token_expired``: never consumed and past its expiry; issue a new one."""


class TokenMismatchError(ApiError):
    """403 ``token_mismatch``: another subject, client or biz type."""


class FingerprintMismatchError(ApiError):
    """422 ``fingerprint_mismatch``: consumed earlier for another request."""


class ResultAlreadySetError(ApiError):
    """409 ``result_already_set``: a different result is already recorded."""


class NotConsumedError(ApiError):
    """409 ``not_consumed``: a result for a token (key) that is not consumed."""


class NotReleasableError(ApiError):
    """409 ``not_releasable``: it has a result or an order event, or is not consumed."""


class UnavailableError(ApiError):
    """503 ``unavailable``: the deciding tier is unreachable; nothing changed.
    Retried by the client until its policy gives up."""


class RateLimitedError(ApiError):
    """429 ``rate_limited``: over a rate limit; ``retry_after`` says when to
    try again. Not retried by the client (a 4xx)."""


class UnauthorizedError(ApiError):
    """401 ``unauthorized``: missing or wrong API key."""


class ForbiddenError(ApiError):
    """403 ``forbidden``: a biz type not granted, or an admin route."""


class UnknownBizTypeError(ApiError):
    """422 ``unknown_biz_type``."""


class NotFoundError(ApiError):
    """404 ``not_found``: no such route."""


class MethodNotAllowedError(ApiError):
    """405 ``method_not_allowed``."""


class PayloadTooLargeError(ApiError):
    """413 ``payload_too_large``: over 8 KiB (64 KiB for results)."""


class UnsupportedMediaTypeError(ApiError):
    """415 ``unsupported_media_type``."""


class UriTooLongError(ApiError):
    """414 ``uri_too_long``."""


class HeadersTooLargeError(ApiError):
    """431 ``headers_too_large``."""


class KeyNotFoundError(ApiError):
    """404 ``key_not_found``: reading a key nobody consumed."""


class TokenNotFoundError(ApiError):
    """404 ``token_not_found`` (admin)."""


class InvalidCursorError(ApiError):
    """400 ``invalid_cursor`` (admin)."""


class ReconcileRunningError(ApiError):
    """409 ``reconcile_running`` (admin)."""


class OrderNotFoundError(ApiError):
    """404 ``order_not_found``."""


class OrderConflictError(ApiError):
    """409 ``order_conflict``: the id is taken with another body or by another client."""


class IllegalTransitionError(ApiError):
    """409 ``illegal_transition``: ``body["state"]`` is the order's state."""


class RefundExceedsPaidError(ApiError):
    """409 ``refund_exceeds_paid``."""


class DurableTokenRequiredError(ApiError):
    """422 ``durable_token_required``."""


class TokenAlreadyUsedError(ApiError):
    """409 ``token_already_used``: consumed for something else."""


class InternalError(ApiError):
    """500 ``internal``: the ledger failed and logged the cause."""


ERRORS: Dict[str, Type[ApiError]] = {
    "invalid_request": InvalidRequestError,
    "token_invalid": TokenInvalidError,
    "token_expired": TokenExpiredError,
    "token_mismatch": TokenMismatchError,
    "fingerprint_mismatch": FingerprintMismatchError,
    "result_already_set": ResultAlreadySetError,
    "not_consumed": NotConsumedError,
    "not_releasable": NotReleasableError,
    "unavailable": UnavailableError,
    "rate_limited": RateLimitedError,
    "unauthorized": UnauthorizedError,
    "forbidden": ForbiddenError,
    "unknown_biz_type": UnknownBizTypeError,
    "not_found": NotFoundError,
    "method_not_allowed": MethodNotAllowedError,
    "payload_too_large": PayloadTooLargeError,
    "unsupported_media_type": UnsupportedMediaTypeError,
    "uri_too_long": UriTooLongError,
    "headers_too_large": HeadersTooLargeError,
    "key_not_found": KeyNotFoundError,
    "token_not_found": TokenNotFoundError,
    "invalid_cursor": InvalidCursorError,
    "reconcile_running": ReconcileRunningError,
    "order_not_found": OrderNotFoundError,
    "order_conflict": OrderConflictError,
    "illegal_transition": IllegalTransitionError,
    "refund_exceeds_paid": RefundExceedsPaidError,
    "durable_token_required": DurableTokenRequiredError,
    "token_already_used": TokenAlreadyUsedError,
    "internal": InternalError,
}

__all__ += [cls.__name__ for cls in ERRORS.values()]


def parse_retry_after(value: Optional[str]) -> Optional[float]:
    """``Retry-After`` in whole seconds (the form the ledger sends); an HTTP
    date or garbage counts as absent."""
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit():
        return None
    return float(int(value))


def error_from_answer(status: int, body: bytes, retry_after: Optional[float]) -> ApiError:
    """The exception for an error answer. A body that is not the ledger's
    error shape (a proxy's HTML page) still becomes one, its code derived
    from the status: a 503 from a load balancer is ``unavailable``."""
    parsed: Any = None
    try:
        parsed = json.loads(body)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), str):
        code = parsed["error"]
        message = parsed.get("message")
        cls = ERRORS.get(code, ApiError)
        return cls(status, code, message if isinstance(message, str) else "", parsed, retry_after)
    fallback = {503: "unavailable", 429: "rate_limited"}.get(status, f"http_{status}")
    text = body[:512].decode("utf-8", errors="replace")
    return ERRORS.get(fallback, ApiError)(status, fallback, text, {}, retry_after)
