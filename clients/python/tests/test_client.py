from __future__ import annotations

import asyncio
from datetime import datetime

import pytest

from idempotency_ledger import (
    AsyncClient,
    Client,
    ConfigError,
    Consumed,
    Duplicate,
    DuplicateStatus,
    FingerprintMismatchError,
    KeyNotFoundError,
    NotReleasableError,
    OrderState,
    State,
    TokenInvalidError,
    TokenMismatchError,
    UnauthorizedError,
    fingerprint_json,
)
from idempotency_ledger.errors import IllegalTransitionError, NotConsumedError, ResultAlreadySetError

from conftest import unique


def test_issue_consume_record_and_duplicates(client: Client) -> None:
    subject = unique("user")
    issued = client.issue("order", subject, ttl_seconds=30)
    assert issued.token.startswith("order_")
    assert issued.subject == subject and issued.expire_time == 30
    assert isinstance(issued.expires_at, datetime) and issued.expires_at.tzinfo is not None

    won = client.consume(issued.token, subject, fingerprint=fingerprint_json({"amount": 1}))
    assert isinstance(won, Consumed) and not won.replayed and won.token == issued.token
    # The same attempt again (same request_id): still the winner, replayed.
    again = client.consume(issued.token, subject, fingerprint=fingerprint_json({"amount": 1}), request_id=won.request_id)
    assert isinstance(again, Consumed) and again.replayed
    # Another attempt: a duplicate, still processing.
    dup = client.consume(issued.token, subject)
    assert isinstance(dup, Duplicate) and dup.status is DuplicateStatus.PROCESSING and dup.result is None
    assert dup.request_id != won.request_id

    with pytest.raises(FingerprintMismatchError) as mismatch:
        client.consume(issued.token, subject, fingerprint=fingerprint_json({"amount": 2}))
    assert mismatch.value.status == 422 and mismatch.value.code == "fingerprint_mismatch"

    assert not client.record_result(issued.token, subject, {"paid": 1}).replayed
    assert client.record_result(issued.token, subject, {"paid": 1}) is not None
    with pytest.raises(ResultAlreadySetError):
        client.record_result(issued.token, subject, {"paid": 2})
    done = client.consume(issued.token, subject)
    assert isinstance(done, Duplicate) and done.status is DuplicateStatus.COMPLETED
    assert done.result == {"paid": 1}

    state = client.token_state(issued.token, subject)
    assert state.state is State.CONSUMED and state.result == {"paid": 1} and state.consumed_at is not None
    with pytest.raises(NotReleasableError) as nr:
        client.release(issued.token, subject)
    assert nr.value.status == 409


def test_release_gives_the_token_back(client: Client) -> None:
    subject = unique("user")
    token = client.issue("order", subject).token
    with pytest.raises(NotConsumedError):
        client.record_result(token, subject, 1)
    assert isinstance(client.consume(token, subject), Consumed)
    client.release(token, subject)
    assert client.token_state(token, subject).state is State.ISSUED
    assert isinstance(client.consume(token, subject), Consumed)


def test_a_late_result_or_release_never_lands_on_another_attempts_consume(client: Client) -> None:
    for biz in ("order", "like"):
        subject = unique("user")
        token = client.issue(biz, subject).token
        assert isinstance(client.consume(token, subject, request_id="r-1"), Consumed)
        client.release(token, subject, request_id="r-1")
        assert isinstance(client.consume(token, subject, request_id="r-2"), Consumed)
        with pytest.raises(NotConsumedError):
            client.record_result(token, subject, {"from": "r-1"}, request_id="r-1")
        with pytest.raises(NotReleasableError):
            client.release(token, subject, request_id="r-1")
        client.record_result(token, subject, {"from": "r-2"}, request_id="r-2")
        assert client.token_state(token, subject).result == {"from": "r-2"}

        key = unique("k")
        assert isinstance(client.consume_key(biz, key, request_id="r-1"), Consumed)
        client.release_key(biz, key, request_id="r-1")
        assert isinstance(client.consume_key(biz, key, request_id="r-2"), Consumed)
        with pytest.raises(NotConsumedError):
            client.record_key_result(biz, key, 1, request_id="r-1")
        with pytest.raises(NotReleasableError):
            client.release_key(biz, key, request_id="r-1")


def test_token_errors_carry_code_and_status(client: Client) -> None:
    subject = unique("user")
    with pytest.raises(TokenInvalidError) as bad:
        client.consume("order_not-a-real-token", subject)
    assert bad.value.status == 400 and bad.value.code == "token_invalid" and bad.value.message
    token = client.issue("order", subject).token
    with pytest.raises(TokenMismatchError) as other:
        client.consume(token, unique("someone-else"))
    assert other.value.status == 403


def test_unauthorized_is_not_retried(ledger: object) -> None:
    from ledger import Ledger

    assert isinstance(ledger, Ledger)
    with Client(ledger.url, "wrong-key") as c:
        with pytest.raises(UnauthorizedError) as e:
            c.issue("order", "u")
    assert e.value.status == 401 and not e.value.retryable


def test_client_keys(client: Client) -> None:
    key = unique("key")
    with pytest.raises(KeyNotFoundError) as nf:
        client.key_state("order", key)
    assert nf.value.status == 404
    won = client.consume_key("order", key, fingerprint="sha256:aa")
    assert isinstance(won, Consumed) and won.key == key
    dup = client.consume_key("order", key, fingerprint="sha256:aa")
    assert isinstance(dup, Duplicate) and dup.status is DuplicateStatus.PROCESSING
    with pytest.raises(FingerprintMismatchError):
        client.consume_key("order", key, fingerprint="sha256:bb")
    client.release_key("order", key)
    assert isinstance(client.consume_key("order", key, fingerprint="sha256:aa"), Consumed)
    client.record_key_result("order", key, {"ok": True})
    st = client.key_state("order", key)
    assert st.key == key and st.state is State.CONSUMED and st.result == {"ok": True}
    done = client.consume_key("order", key, fingerprint="sha256:aa")
    assert isinstance(done, Duplicate) and done.status is DuplicateStatus.COMPLETED and done.result == {"ok": True}
    with pytest.raises(NotReleasableError):
        client.release_key("order", key)


def test_orders(client: Client) -> None:
    subject = unique("user")
    oid = unique("ord")
    created = client.create_order(oid, subject, 1000, "EUR")
    assert created.created and created.order.state is OrderState.CREATED
    assert created.order.events[0].kind == "order.created"
    assert not client.create_order(oid, subject, 1000, "EUR").created
    token = client.issue("order", subject).token
    paid = client.pay_order(oid, token, request_id="pay-" + oid)
    assert paid.applied and not paid.replayed and paid.order.state is OrderState.PAID
    again = client.pay_order(oid, token, request_id="pay-" + oid)
    assert again.applied and again.replayed
    dup = client.pay_order(oid, token)
    assert not dup.applied and dup.order.state is OrderState.PAID
    refund = client.refund_order(oid, client.issue("order", subject).token, 400, reason="partial")
    assert refund.order.state is OrderState.PARTIALLY_REFUNDED and refund.order.refunded_minor == 400
    with pytest.raises(IllegalTransitionError) as ill:
        client.close_order(oid, client.issue("order", subject).token)
    assert ill.value.body.get("state") == "PARTIALLY_REFUNDED"
    assert client.get_order(oid).refunded_minor == 400


def test_async_client(ledger: object) -> None:
    from ledger import Ledger

    assert isinstance(ledger, Ledger)

    async def go() -> None:
        async with AsyncClient(ledger.url, ledger.api_key) as c:
            subject = unique("user")
            issued = await c.issue("order", subject)
            first, second = await asyncio.gather(c.consume(issued.token, subject), c.consume(issued.token, subject))
            winners = [o for o in (first, second) if isinstance(o, Consumed)]
            assert len(winners) == 1
            await c.record_result(issued.token, subject, [1, 2])
            dup = await c.consume(issued.token, subject)
            assert isinstance(dup, Duplicate) and dup.result == [1, 2]
            key = unique("key")
            assert isinstance(await c.consume_key("order", key), Consumed)
            await c.record_key_result("order", key, None)
            assert (await c.key_state("order", key)).state is State.CONSUMED

    asyncio.run(go())


def test_bad_configuration() -> None:
    with pytest.raises(ConfigError):
        Client("ftp://example", "k")
    with pytest.raises(ConfigError):
        Client("http://127.0.0.1:1", "")
    with pytest.raises(ConfigError):
        Client("http://127.0.0.1:1", "bad\nkey")
