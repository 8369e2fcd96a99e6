"""Per-job event logs: numbered, persisted, then fanned out to watchers.

Everything runs on the event loop thread. A watcher registers its queue and reads the
persisted events in the same synchronous step, so no event falls between the replay and the
live feed, and it skips anything at or below the last sequence it yielded, so none repeats.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from kerneleval.v1 import job_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from .store import TERMINAL, Store


def now_event(job_id: str, sequence: int) -> job_pb2.JobEvent:
    event = job_pb2.JobEvent(job_id=job_id, sequence=sequence)
    event.time.FromNanoseconds(time.time_ns())
    return event


class EventHub:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._next: dict[str, int] = {}
        self._watchers: dict[str, set[asyncio.Queue[job_pb2.JobEvent]]] = {}

    def next_event(self, job_id: str) -> job_pb2.JobEvent:
        """A new event with the job's next sequence number (not yet published)."""
        seq = self._next.get(job_id)
        if seq is None:
            seq = self._store.last_sequence(job_id) + 1
        self._next[job_id] = seq + 1
        return now_event(job_id, seq)

    def publish(self, event: job_pb2.JobEvent, persisted: bool = False) -> None:
        """Persists the event (unless the caller did, in its own transaction) and fans it out."""
        if not persisted:
            self._store.add_event(event)
        for queue in self._watchers.get(event.job_id, ()):
            queue.put_nowait(event)
        if event.HasField("finished"):
            self._next.pop(event.job_id, None)

    async def watch(self, job_id: str, after_sequence: int) -> AsyncIterator[job_pb2.JobEvent]:
        """Events after `after_sequence`, replayed then live, up to and including `finished`."""
        queue: asyncio.Queue[job_pb2.JobEvent] = asyncio.Queue()
        self._watchers.setdefault(job_id, set()).add(queue)
        try:
            last = after_sequence
            replay = self._store.events_after(job_id, after_sequence)
            if not replay:
                job = self._store.get(job_id, include_spec=False)
                if job is None or job.state in TERMINAL:
                    return  # the caller has seen the end already
            for event in replay:
                last = event.sequence
                yield event
                if event.HasField("finished"):
                    return
            while True:
                event = await queue.get()
                if event.sequence <= last:
                    continue
                last = event.sequence
                yield event
                if event.HasField("finished"):
                    return
        finally:
            watchers = self._watchers.get(job_id)
            if watchers is not None:
                watchers.discard(queue)
                if not watchers:
                    del self._watchers[job_id]


class OpsLog:
    """The service's operations events: numbered from 1, the last `keep` kept for replay."""

    def __init__(self, keep: int = 1000) -> None:
        self._recent: deque[ops_pb2.OpsEvent] = deque(maxlen=keep)
        self._watchers: set[asyncio.Queue[ops_pb2.OpsEvent]] = set()
        self._sequence = 0

    def emit(self, device_index: int, **kind: Any) -> ops_pb2.OpsEvent:
        self._sequence += 1
        event = ops_pb2.OpsEvent(sequence=self._sequence, device_index=device_index, **kind)
        event.time.FromNanoseconds(time.time_ns())
        self._recent.append(event)
        for queue in self._watchers:
            queue.put_nowait(event)
        return event

    async def watch(self, replay_count: int) -> AsyncIterator[ops_pb2.OpsEvent]:
        queue: asyncio.Queue[ops_pb2.OpsEvent] = asyncio.Queue()
        self._watchers.add(queue)
        try:
            recent = list(self._recent)[-replay_count:] if replay_count > 0 else []
            last = recent[-1].sequence if recent else self._sequence
            for event in recent:
                yield event
            while True:
                item = await queue.get()
                if item.sequence > last:
                    last = item.sequence
                    yield item
        finally:
            self._watchers.discard(queue)
