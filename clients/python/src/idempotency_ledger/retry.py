"""The retry policy: which failures are tried again, how long to wait, when
to give up.

Retried: a 503 answer, a timeout, a connection error. Never a 4xx (a 429
included: its ``retry_after`` is on the raised :class:`RateLimitedError`),
never another 5xx. Retrying is safe because one logical call sends the same
bytes on every try: a consume carries the same ``request_id``, so a try whose
answer was lost after the ledger committed it is answered ``consumed`` again
(``replayed``), never ``duplicate``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

__all__ = ["RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """How one logical call is retried. Defaults: at most 5 tries; waits of
    50 ms doubling up to 2 s, each lengthened by a random part of up to
    itself (jitter); everything within 10 s; each try at most 5 s. A
    ``Retry-After`` longer than the computed wait replaces it; a wait that
    would cross the deadline is not taken (the last error is raised)."""

    max_attempts: int = 5
    min_delay: float = 0.05
    max_delay: float = 2.0
    jitter: bool = True
    deadline: float = 10.0
    attempt_timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.min_delay < 0 or self.max_delay < self.min_delay:
            raise ValueError("need 0 <= min_delay <= max_delay")
        if self.deadline <= 0 or self.attempt_timeout <= 0:
            raise ValueError("deadline and attempt_timeout must be positive")

    @classmethod
    def none(cls) -> "RetryPolicy":
        """One try, no retries."""
        return cls(max_attempts=1)

    def backoff(self) -> Iterator[float]:
        """The waits before the second, third, ... tries (seconds)."""
        delay = self.min_delay
        for _ in range(self.max_attempts - 1):
            wait = min(delay, self.max_delay)
            if self.jitter:
                wait += random.uniform(0, wait)
            yield wait
            delay *= 2
