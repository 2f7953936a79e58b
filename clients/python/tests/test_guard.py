from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest

from idempotency_ledger import (
    AsyncClient,
    BeforeSideEffects,
    Client,
    InProgressError,
    NotRecordedError,
    RecordError,
    State,
    async_guarded,
    before_side_effects,
    guarded,
    mark_before_side_effects,
)

from conftest import unique


class OutOfStock(Exception):
    pass


def test_run_runs_once_and_duplicates_get_the_recorded_result(client: Client) -> None:
    key = unique("g")
    calls: List[int] = []

    def step() -> Dict[str, Any]:
        calls.append(1)
        return {"charged": 100}

    assert client.guard_key("order", key).run(step) == {"charged": 100}
    assert client.guard_key("order", key).run(step) == {"charged": 100}
    assert len(calls) == 1
    assert client.key_state("order", key).result == {"charged": 100}


def test_a_failure_marked_before_side_effects_releases(client: Client) -> None:
    key = unique("g")
    with pytest.raises(OutOfStock):
        with client.guard_key("order", key) as g:
            assert g.won
            with before_side_effects():
                raise OutOfStock()
    assert client.key_state("order", key).state is State.ISSUED
    # The same key can be tried again, and this time it runs.
    assert client.guard_key("order", key).run(lambda: "ok") == "ok"

    key2 = unique("g")

    def refused() -> None:
        raise BeforeSideEffects("card declined before any charge")

    with pytest.raises(BeforeSideEffects):
        client.guard_key("order", key2).run(refused)
    assert client.key_state("order", key2).state is State.ISSUED

    key3 = unique("g")

    def marked() -> None:
        raise mark_before_side_effects(ValueError("bad amount"))

    with pytest.raises(ValueError):
        client.guard_key("order", key3).run(marked)
    assert client.key_state("order", key3).state is State.ISSUED


def test_an_unmarked_failure_keeps_it_consumed(client: Client) -> None:
    key = unique("g")

    def boom() -> None:
        raise RuntimeError("provider timed out after sending the charge")

    with pytest.raises(RuntimeError):
        client.guard_key("order", key).run(boom)
    assert client.key_state("order", key).state is State.CONSUMED
    with pytest.raises(InProgressError) as e:
        client.guard_key("order", key).run(lambda: "never")
    assert e.value.outcome.consumed_at is not None


def test_context_manager_paths(client: Client) -> None:
    subject = unique("user")
    token = client.issue("order", subject).token
    ran: List[int] = []

    def pay() -> Any:
        with client.guard_token(token, subject, biz_type="order") as g:
            if g.completed:
                return g.result
            ran.append(1)
            g.record({"receipt": "r1"})
            return g.result

    assert pay() == {"receipt": "r1"}
    assert pay() == {"receipt": "r1"}
    assert ran == [1]
    assert client.token_state(token, subject).result == {"receipt": "r1"}

    key = unique("g")
    with pytest.raises(NotRecordedError):
        with client.guard_key("order", key):
            pass
    assert client.key_state("order", key).state is State.CONSUMED

    g = client.guard_key("order", unique("g"))
    with g:
        g.record(1)
    with pytest.raises(RuntimeError):
        g.__enter__()


def test_a_record_that_fails_keeps_the_output(client: Client) -> None:
    key = unique("g")
    with pytest.raises(RecordError) as e:
        # A result the ledger refuses (U+0000 cannot reach Postgres).
        client.guard_key("order", key).run(lambda: "nul\u0000byte")
    assert e.value.output == "nul\u0000byte"
    assert client.key_state("order", key).state is State.CONSUMED


def test_decorators(client: Client, ledger: Any) -> None:
    runs: List[str] = []

    @guarded(lambda order_id, amount: client.guard_key("order", f"pay-{order_id}"))
    def pay(order_id: str, amount: int) -> Dict[str, Any]:
        runs.append(order_id)
        return {"order_id": order_id, "amount": amount}

    oid = unique("o")
    assert pay(oid, 5) == {"order_id": oid, "amount": 5}
    assert pay(oid, 5) == {"order_id": oid, "amount": 5}
    assert runs == [oid]

    async def go() -> None:
        async with AsyncClient(ledger.url, ledger.api_key) as ac:
            aruns: List[str] = []

            @async_guarded(lambda k: ac.guard_key("order", k))
            async def step(k: str) -> List[str]:
                aruns.append(k)
                return [k]

            k = unique("a")
            first, second = await step(k), await step(k)
            assert first == second == [k] and aruns == [k]

            k2 = unique("a")
            with pytest.raises(OutOfStock):
                async with ac.guard_key("order", k2) as g:
                    assert g.won
                    raise mark_before_side_effects(OutOfStock())
            assert (await ac.key_state("order", k2)).state is State.ISSUED

    asyncio.run(go())
