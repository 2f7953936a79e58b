"""An ASGI middleware for the ``Idempotency-Key`` header
(draft-ietf-httpapi-idempotency-key-header) on top of the ledger's
client-supplied keys (``/v1/keys``). Works with any ASGI application:
Starlette, FastAPI, Django under ASGI (``get_asgi_application()``), Quart...

For a request with an unsafe method (anything but GET, HEAD, OPTIONS and
TRACE, which pass through untouched):

==========================================================  ===========================================
situation                                                   answer
==========================================================  ===========================================
first request with a key                                    the app runs; its response is stored and returned
a retry with the same key and payload, after it finished    the stored response, ``Idempotent-Replayed: true``; the app does not run
a retry while the first is still running                    409 ``idempotency_key_in_use`` with ``Retry-After``
the same key with another method, path with query or body   422 ``idempotency_key_reused``
no key, where one is required (the default)                 400 ``idempotency_key_missing``
a key not 1-255 printable ASCII (or a repeated header)      400 ``idempotency_key_invalid``
a body over ``max_request_body`` (default 1 MiB)            413 ``payload_too_large``
the ledger cannot be reached                                503 ``ledger_unavailable`` with ``Retry-After``; the app does not run
the first attempt's outcome is uncertain (lease ran out)    409 ``idempotency_key_uncertain``
==========================================================  ===========================================

The key may be sent bare (``abc``) or as an RFC 8941 string (``"abc"``): both
are the same key. Errors of the middleware itself are
``application/problem+json`` (RFC 9457) with ``type`` (a link into the
integration docs, ``PROBLEM_BASE#<code>``), ``title``, ``status``,
``detail`` and a stable ``code``.

Which responses are stored: by default every status below 500 except 408 and
429 (``store_status`` changes it). Stored are the status, the headers named
by ``stored_headers`` and the body. A response whose stored form would not
fit the ledger's 64 KiB results is stored without its body: its retries
replay the status and headers with an empty body and the header
``Idempotent-Body-Omitted: true``. A response that is not stored (a 5xx, 408,
429) or an exception of the app releases the key: the next retry runs the app
again. Answer 5xx only when the handler did nothing that must not happen twice.

The app runs in its own task: a client that disconnects does not cancel it
halfway, and its response is still stored. The whole response is buffered
before it is sent (streaming responses included).

Keys are per API key of the ledger client, not per user: the same key of
two scopes is two keys, so scope them by your end user. Without a ``scope``
callable the middleware uses :func:`default_scope`: the ASGI scope's
authenticated user (``scope["user"]``, set by Starlette's
``AuthenticationMiddleware`` installed outside this one), by its
``identity``, else its ``display_name``. When no ``scope`` is given and a
request has no user at all, the middleware logs a warning once: every caller
then shares one key space. Give ``scope`` (the account id), or
``scope=lambda request: None`` to share one key space on purpose and silence
it. Requires asyncio.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import (
    Any,
    Awaitable,
    Callable,
    Collection,
    Dict,
    Iterable,
    List,
    Mapping,
    MutableMapping,
    Optional,
    Tuple,
    Union,
)
from urllib.parse import quote

from .client import AsyncClient
from .errors import FingerprintMismatchError, LedgerError
from .fingerprint import request_fingerprint, short_digest
from .models import Consumed, DuplicateStatus

__all__ = [
    "IdempotencyMiddleware",
    "RequestInfo",
    "PROBLEM_BASE",
    "DEFAULT_STORED_HEADERS",
    "default_store_status",
    "default_scope",
    "parse_idempotency_key",
    "InvalidKey",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("idempotency_ledger.asgi")

#: The base of every problem ``type``: ``PROBLEM_BASE + "#" + code``.
PROBLEM_BASE = "https://github.com/idempotency-ledger/idempotency-ledger/blob/main/docs/integration.md"
#: Headers of a stored response that are replayed, by default.
DEFAULT_STORED_HEADERS = ("content-type", "content-language", "location", "etag", "last-modified")
REPLAYED = b"idempotent-replayed"
BODY_OMITTED = b"idempotent-body-omitted"
#: The ledger's limit on a key.
MAX_KEY = 255
#: A stored response larger than this (as JSON) is stored without its body:
#: the ledger takes results of at most 64 KiB with the request around them.
MAX_STORED = 60 * 1024
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
_BIZ_TYPE = re.compile(r"[a-z][a-z0-9-]{0,31}")


def default_store_status(status: int) -> bool:
    """The default: every status below 500 except 408 and 429."""
    return status < 500 and status not in (408, 429)


class InvalidKey(ValueError):
    """Why an ``Idempotency-Key`` is unusable."""


def parse_idempotency_key(values: List[bytes]) -> Optional[str]:
    """The key of a request from its ``Idempotency-Key`` header values:
    ``None`` when absent; the bare text, or the content of an RFC 8941
    string (``"abc"``, with ``\\"`` and ``\\\\`` escapes); else InvalidKey."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidKey("send one Idempotency-Key header, not several")
    raw = values[0]
    if any(b < 0x20 or b > 0x7E for b in raw.strip(b" \t")):
        raise InvalidKey("the Idempotency-Key must be printable ASCII")
    text = raw.decode("ascii").strip(" \t")
    if text.startswith('"'):
        if len(text) < 2 or not text.endswith('"'):
            raise InvalidKey("the quoted Idempotency-Key has no closing quote")
        inner, out, i = text[1:-1], [], 0
        while i < len(inner):
            c = inner[i]
            if c == "\\":
                if i + 1 < len(inner) and inner[i + 1] in '"\\':
                    out.append(inner[i + 1])
                    i += 2
                    continue
                raise InvalidKey("a bad escape in the quoted Idempotency-Key")
            if c == '"':
                raise InvalidKey("a bare quote inside the quoted Idempotency-Key")
            out.append(c)
            i += 1
        key = "".join(out)
    else:
        key = text
    if not key or len(key) > MAX_KEY:
        raise InvalidKey(f"the Idempotency-Key must be 1 to {MAX_KEY} printable ASCII characters")
    return key


@dataclass(frozen=True)
class RequestInfo:
    """What the ``scope`` callable sees of a request."""

    method: str
    #: The path with its query, as sent.
    path: str
    #: Lower-cased header names; repeated headers joined with ", ".
    headers: Mapping[str, str]
    #: The ASGI scope itself (``scope["user"]`` after Starlette's
    #: AuthenticationMiddleware, ``scope["state"]``, ...).
    asgi_scope: Mapping[str, Any]

    def header(self, name: str) -> Optional[str]:
        return self.headers.get(name.lower())


def default_scope(request: RequestInfo) -> Optional[str]:
    """The default ``scope``: the ASGI scope's authenticated user, or None.

    Duck-typed on Starlette's ``BaseUser`` (no dependency on Starlette):
    ``scope["user"]`` whose ``is_authenticated`` is true, identified by its
    ``identity``, else (an older Starlette's ``SimpleUser``, which has none)
    its ``display_name``. An anonymous user, or no user, is None: unscoped."""
    user = request.asgi_scope.get("user")
    if user is None or not _attr(user, "is_authenticated"):
        return None
    for name in ("identity", "display_name"):
        value = _attr(user, name)
        if value is not None and value != "":
            return str(value)
    return None


def _attr(obj: Any, name: str) -> Any:
    """``obj.name``, or None where it is missing or not implemented
    (Starlette's ``BaseUser`` raises NotImplementedError)."""
    try:
        return getattr(obj, name, None)
    except NotImplementedError:
        return None


@dataclass
class _Response:
    status: int
    headers: List[Tuple[bytes, bytes]]
    body: bytes


class IdempotencyMiddleware:
    """The ``Idempotency-Key`` middleware; see the module docs.

    ``client``: the ledger's :class:`AsyncClient`; ``biz_type``: the biz type
    keys are stored under (granted to the client's API key; durable ones
    decide in Postgres). Options: ``required`` (default True; False lets
    requests without a key through unguarded), ``store_status`` (a predicate
    or a collection of statuses to store; default
    :func:`default_store_status`), ``stored_headers``,
    ``in_progress_retry_after`` (whole seconds of the 409's ``Retry-After``,
    default 1), ``in_progress_wait_ms`` (how long a retry of a running
    request waits for it to finish before answering 409; default 0),
    ``max_request_body`` (default 1 MiB), ``scope`` (request -> scope or
    None; default :func:`default_scope`, the authenticated ASGI user, with a
    warning logged once when a request has no user; ``lambda request: None``
    shares one key space on purpose, without the warning).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        client: AsyncClient,
        biz_type: str,
        required: bool = True,
        store_status: Union[Callable[[int], bool], Collection[int], None] = None,
        stored_headers: Iterable[str] = DEFAULT_STORED_HEADERS,
        in_progress_retry_after: int = 1,
        in_progress_wait_ms: int = 0,
        max_request_body: int = 1024 * 1024,
        scope: Optional[Callable[[RequestInfo], Optional[str]]] = None,
    ) -> None:
        if not _BIZ_TYPE.fullmatch(biz_type):
            raise ValueError(f"biz_type {biz_type!r} does not match [a-z][a-z0-9-]{{0,31}}")
        if in_progress_retry_after < 1:
            raise ValueError("in_progress_retry_after is whole seconds, at least 1")
        if not 0 <= in_progress_wait_ms <= 10_000:
            raise ValueError("in_progress_wait_ms is 0 to 10000")
        if max_request_body < 0:
            raise ValueError("max_request_body must not be negative")
        self.app = app
        self.client = client
        self.biz_type = biz_type
        self.required = required
        if store_status is None:
            self.store_status: Callable[[int], bool] = default_store_status
        elif callable(store_status):
            self.store_status = store_status
        else:
            statuses = frozenset(store_status)
            self.store_status = statuses.__contains__
        self.stored_headers = tuple(h.lower().encode("latin-1") for h in stored_headers)
        self.in_progress_retry_after = in_progress_retry_after
        self.in_progress_wait_ms = in_progress_wait_ms
        self.max_request_body = max_request_body
        self.scope = scope
        #: Set once the missing-scope warning is logged.
        self._warned_unscoped = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        values = [v for k, v in scope["headers"] if k.lower() == b"idempotency-key"]
        try:
            key = parse_idempotency_key(values)
        except InvalidKey as e:
            await _send(send, problem(400, "idempotency_key_invalid", "Idempotency-Key is invalid", str(e)))
            return
        if key is None:
            if not self.required:
                await self.app(scope, receive, send)
                return
            await _send(
                send,
                problem(
                    400,
                    "idempotency_key_missing",
                    "Idempotency-Key is missing",
                    "This operation requires an Idempotency-Key header.",
                ),
            )
            return

        body = await self._read_body(receive)
        if body is None:
            return  # the client went away
        if isinstance(body, _Response):
            await _send(send, body)
            return

        path = _path_and_query(scope)
        info = RequestInfo(
            method=scope["method"].upper(),
            path=path.decode("latin-1"),
            headers=_header_map(scope["headers"]),
            asgi_scope=scope,
        )
        try:
            ledger_key = self._ledger_key(info, key)
        except InvalidKey as e:
            await _send(send, problem(400, "idempotency_key_invalid", "Idempotency-Key is invalid", str(e)))
            return

        fp = request_fingerprint(info.method, path, body)
        # This request's consume: its response is stored (or the key released)
        # only while this consume holds the key.
        request_id = str(uuid.uuid4())
        try:
            outcome = await self.client.consume_key(
                self.biz_type,
                ledger_key,
                fingerprint=fp,
                request_id=request_id,
                wait_ms=self.in_progress_wait_ms or None,
            )
        except FingerprintMismatchError:
            await _send(
                send,
                problem(
                    422,
                    "idempotency_key_reused",
                    "Idempotency-Key is already used",
                    "This key was used for a request with another method, path or body.",
                ),
            )
            return
        except LedgerError as e:
            if e.retryable:
                log.warning("idempotency ledger unreachable: request refused: %s", e)
                after = max(1, int(e.retry_after or 1))
                await _send(
                    send,
                    problem(
                        503,
                        "ledger_unavailable",
                        "Idempotency ledger unavailable",
                        "The request was not run; retry it with the same Idempotency-Key.",
                        retry_after=after,
                    ),
                )
            else:
                log.error("the idempotency ledger refused the key: %s", e)
                await _send(
                    send, problem(500, "ledger_error", "Idempotency check failed", "The request was not run.")
                )
            return

        if isinstance(outcome, Consumed):
            resp = await asyncio.shield(asyncio.ensure_future(self._run_once(scope, receive, body, ledger_key, request_id)))
            await _send(send, resp)
        elif outcome.status is DuplicateStatus.COMPLETED:
            await _send(send, replay(outcome.result))
        elif outcome.status is DuplicateStatus.UNCERTAIN:
            await _send(
                send,
                problem(
                    409,
                    "idempotency_key_uncertain",
                    "The outcome of this Idempotency-Key is uncertain",
                    "The first request with this key did not finish in time; its outcome is being checked.",
                ),
            )
        else:
            await _send(
                send,
                problem(
                    409,
                    "idempotency_key_in_use",
                    "A request is outstanding for this Idempotency-Key",
                    "The first request with this key has not finished yet; retry later.",
                    retry_after=self.in_progress_retry_after,
                ),
            )

    def _scope_of(self, info: RequestInfo) -> Optional[str]:
        if self.scope is not None:
            return self.scope(info)
        scope = default_scope(info)
        if scope is None and not self._warned_unscoped and not _anonymous(info.asgi_scope):
            self._warned_unscoped = True
            log.warning(
                "IdempotencyMiddleware (biz type %s) has no scope and the request has no authenticated "
                "user: Idempotency-Key values are shared across all end users of this service, and one "
                "user's key can replay another user's stored response. Install an authentication "
                "middleware that sets scope['user'] outside this one, pass scope=<the authenticated "
                "user's id>, or scope=lambda request: None to make the shared key space explicit.",
                self.biz_type,
            )
        return scope

    def _ledger_key(self, info: RequestInfo, key: str) -> str:
        scope = self._scope_of(info)
        scoped = f"{short_digest(scope)}:{key}" if scope is not None else key
        if len(scoped) > MAX_KEY:
            raise InvalidKey(
                f"the Idempotency-Key is too long (at most {MAX_KEY - (len(scoped) - len(key))} characters)"
            )
        return scoped

    async def _read_body(self, receive: Receive) -> Union[bytes, _Response, None]:
        chunks: List[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_request_body:
                return problem(
                    413,
                    "payload_too_large",
                    "Request body too large",
                    f"At most {self.max_request_body} bytes.",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _run_once(
        self, scope: Scope, receive: Receive, body: bytes, key: str, request_id: str
    ) -> _Response:
        """Runs the app once, then stores its response or releases the key."""
        sent_body = False

        async def replay_receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        start: Optional[Message] = None
        chunks: List[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(bytes(message.get("body", b"")))

        try:
            await self.app(scope, replay_receive, capture)
        except BaseException:
            await self._release(key, request_id, "the application raised")
            raise
        if start is None:
            await self._release(key, request_id, "the application sent no response")
            raise RuntimeError("the ASGI application returned without starting a response")
        resp = _Response(int(start["status"]), [(bytes(k), bytes(v)) for k, v in start.get("headers", [])], b"".join(chunks))
        if not self.store_status(resp.status):
            await self._release(key, request_id, "the application answered a status that is not stored")
            return resp
        stored = self._stored(resp)
        try:
            await self.client.record_key_result(self.biz_type, key, stored, request_id=request_id)
        except LedgerError as e:
            log.warning("could not store the response; retries answer 409 until it is stored: %s", e)
        return resp

    def _stored(self, resp: _Response) -> Dict[str, Any]:
        headers = [
            [k.decode("latin-1").lower(), v.decode("latin-1")]
            for k, v in resp.headers
            if k.lower() in self.stored_headers
        ]
        stored: Dict[str, Any] = {"status": resp.status, "headers": headers}
        try:
            text = resp.body.decode("utf-8")
            if "\0" in text:  # Postgres cannot hold U+0000 in JSON text
                raise ValueError
            stored["body"] = text
        except ValueError:
            stored["body_base64"] = base64.b64encode(resp.body).decode("ascii")
        if len(json.dumps(stored, separators=(",", ":"), ensure_ascii=False).encode("utf-8")) > MAX_STORED:
            stored.pop("body", None)
            stored.pop("body_base64", None)
            stored["body_omitted"] = True
        return stored

    async def _release(self, key: str, request_id: str, why: str) -> None:
        try:
            await self.client.release_key(self.biz_type, key, request_id=request_id)
        except LedgerError as e:
            log.warning("could not release an idempotency key (%s); retries answer 409 until it is released: %s", why, e)


def replay(result: Any) -> _Response:
    """The stored response again, with ``Idempotent-Replayed: true`` (and
    ``Idempotent-Body-Omitted: true`` when its body was too large to store)."""
    if not isinstance(result, dict) or not isinstance(result.get("status"), int):
        log.error("the key's result is not a stored response: %r", result)
        return problem(
            500,
            "stored_response_unreadable",
            "Stored response unreadable",
            "This Idempotency-Key was completed, but its response cannot be replayed.",
        )
    text, b64 = result.get("body"), result.get("body_base64")
    omitted = bool(result.get("body_omitted")) or (text is None and b64 is None)
    if isinstance(text, str):
        body = text.encode("utf-8")
    elif isinstance(b64, str):
        try:
            body = base64.b64decode(b64)
        except ValueError:
            body = b""
    else:
        body = b""
    headers: List[Tuple[bytes, bytes]] = []
    for pair in result.get("headers") or []:
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair):
            name = pair[0].lower().encode("latin-1", errors="replace")
            if name not in (b"content-length", REPLAYED, BODY_OMITTED):
                headers.append((name, pair[1].encode("latin-1", errors="replace")))
    headers.append((REPLAYED, b"true"))
    if omitted:
        headers.append((BODY_OMITTED, b"true"))
    return _Response(result["status"], headers, body)


def problem(
    status: int, code: str, title: str, detail: str, retry_after: Optional[int] = None
) -> _Response:
    """An ``application/problem+json`` answer of the middleware itself."""
    body = json.dumps(
        {"type": f"{PROBLEM_BASE}#{code}", "title": title, "status": status, "detail": detail, "code": code}
    ).encode("utf-8")
    headers = [(b"content-type", b"application/problem+json")]
    if retry_after is not None:
        headers.append((b"retry-after", str(retry_after).encode("ascii")))
    return _Response(status, headers, body)


async def _send(send: Send, resp: _Response) -> None:
    headers = [(k, v) for k, v in resp.headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(resp.body)).encode("ascii")))
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": resp.body, "more_body": False})


def _anonymous(asgi_scope: Mapping[str, Any]) -> bool:
    """Whether the request has a user that is known not to be authenticated
    (an anonymous caller of an app that does authenticate)."""
    user = asgi_scope.get("user")
    return user is not None and _attr(user, "is_authenticated") is False


def _path_and_query(scope: Scope) -> bytes:
    raw = scope.get("raw_path")
    path = bytes(raw) if raw else quote(scope.get("path", "/")).encode("ascii")
    query = scope.get("query_string", b"")
    return path + b"?" + bytes(query) if query else path


def _header_map(headers: Iterable[Tuple[bytes, bytes]]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for k, v in headers:
        name, value = k.decode("latin-1").lower(), v.decode("latin-1")
        out[name] = f"{out[name]}, {value}" if name in out else value
    return out
