"""A job's timeout: a timer that waiting does not use up.

Time a job spends waiting for the GPU (other jobs' checks and timing windows) is pushed onto
its deadline; time its job process spends frozen for another job's timing window (see
timing_windows.py) stops the clock: the job's timeout counts only the time it could run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kerneleval.v1 import kernel_pb2

DEFAULT_TIMEOUT_S = 120.0


def timeout_of(spec: kernel_pb2.JobSpec, max_timeout_s: float) -> float:
    """A job's timeout: its options' (DEFAULT_TIMEOUT_S when unset), at most the service's."""
    t = spec.options.timeout
    seconds = t.seconds + t.nanos / 1e9
    return min(seconds if seconds > 0 else DEFAULT_TIMEOUT_S, max_timeout_s)


class Deadline:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, seconds: float, on_expiry: Callable[[], None]
    ) -> None:
        self._loop = loop
        self._on_expiry = on_expiry
        self._when = loop.time() + seconds
        self._remaining: float | None = None  # set while paused
        self._timer: asyncio.TimerHandle | None = loop.call_at(self._when, on_expiry)

    @property
    def paused(self) -> bool:
        return self._remaining is not None

    def remaining(self) -> float:
        if self._remaining is not None:
            return self._remaining
        return self._when - self._loop.time()

    def push(self, seconds: float) -> None:
        """Moves the deadline `seconds` later."""
        if self._remaining is not None:
            self._remaining += seconds
            return
        self._arm(self._when + seconds)

    def pause(self) -> None:
        if self._remaining is None and self._timer is not None:
            self._remaining = self._when - self._loop.time()
            self._timer.cancel()

    def resume(self) -> None:
        if self._remaining is not None and self._timer is not None:
            remaining, self._remaining = self._remaining, None
            self._arm(self._loop.time() + remaining)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None

    def _arm(self, when: float) -> None:
        if self._timer is None:
            return  # cancelled
        self._timer.cancel()
        self._when = when
        self._timer = self._loop.call_at(when, self._on_expiry)
