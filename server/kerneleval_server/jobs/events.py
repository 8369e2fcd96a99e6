"""Per-job event logs: numbered, persisted, then fanned out to watchers.

Everything runs on the event loop thread. A watcher registers its queue and reads the
persisted events in the same synchronous step, so no event falls between the replay and the
live feed, and it skips anything at or below the last sequence it yielded, so none repeats.

A job's stored log output is capped (validation.Limits.max_log_bytes): the log event that
crosses the cap is cut to what fits and followed by one note saying where the output was cut;
later log events of the job are dropped (neither stored nor sent to watchers), and their
sequence numbers are given back, so that sequences stay without gaps.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import Any

from kerneleval.v1 import job_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server.jobs.store import TERMINAL, JobStore
from kerneleval_server.spec.validation import LOG_EVENT_OVERHEAD, Limits

# The note that ends a job's stored log output when it was cut.
LOG_CUT_PREFIX = "[kerneleval: log output cut"


def now_event(job_id: str, sequence: int) -> job_pb2.JobEvent:
    event = job_pb2.JobEvent(job_id=job_id, sequence=sequence)
    event.time.FromNanoseconds(time.time_ns())
    return event


def _cut_utf8(text: str, max_bytes: int) -> str:
    """The longest prefix of `text` that is at most `max_bytes` in UTF-8."""
    return text.encode("utf-8", "surrogatepass")[: max(0, max_bytes)].decode("utf-8", "ignore")


class _LogBudget:
    """How much of a job's log is stored: used counts text plus LOG_EVENT_OVERHEAD per event."""

    __slots__ = ("used", "text_bytes", "cut")

    def __init__(self) -> None:
        self.used = 0
        self.text_bytes = 0
        self.cut = False


class EventHub:
    def __init__(self, store: JobStore, max_log_bytes: int | None = None) -> None:
        self._store = store
        self._next: dict[str, int] = {}
        # A follower's queue: events published here, or None: read the store (wake).
        self._watchers: dict[str, set[asyncio.Queue[job_pb2.JobEvent | None]]] = {}
        # A shared store (--role gateway, node): events of other front ends come by wake();
        # followers also read the store every `poll_s` in case a notification was missed.
        self.poll_s: float | None = None
        # Log text stored per job; None: validation.Limits (KERNELEVAL_LIMIT_MAX_LOG_BYTES).
        self.max_log_bytes = (
            Limits.from_env().max_log_bytes if max_log_bytes is None else max_log_bytes
        )
        self._logs: dict[str, _LogBudget] = {}
        self._labels: dict[str, dict[str, str]] = {}  # JobSpec.labels of unfinished jobs

    def forget(self, job_id: str) -> None:
        """Drops what this front end keeps of a job's events (its next sequence, its log
        budget, labels): another front end writes them meanwhile (a shared store)."""
        self._next.pop(job_id, None)
        self._logs.pop(job_id, None)
        self._labels.pop(job_id, None)

    def wake(self, job_id: str) -> None:
        """Another front end stored events of the job: its followers here read them."""
        for queue in self._watchers.get(job_id, ()):
            queue.put_nowait(None)

    def wake_all(self) -> None:
        for job_id in list(self._watchers):
            self.wake(job_id)

    def set_labels(self, job_id: str, labels: Mapping[str, str]) -> None:
        """Every later event of the job carries these (JobEvent.labels)."""
        if labels:
            self._labels[job_id] = dict(labels)

    def next_event(self, job_id: str) -> job_pb2.JobEvent:
        """A new event with the job's next sequence number (not yet published)."""
        seq = self._next.get(job_id)
        if seq is None:
            seq = self._store.last_sequence(job_id) + 1
        self._next[job_id] = seq + 1
        event = now_event(job_id, seq)
        if labels := self._labels.get(job_id):
            event.labels.update(labels)
        return event

    def log(self, job_id: str, text: str) -> None:
        """A log line of the service's own on the job's stream: stored, then sent to its
        watchers (one helper for "next event, store, publish")."""
        event = self.next_event(job_id)
        event.log.text = text
        self.publish(event)

    def publish(self, event: job_pb2.JobEvent, persisted: bool = False) -> None:
        """Persists the event (unless the caller did, in its own transaction) and fans it out.
        A log event past the job's log cap is dropped (see the module's docstring)."""
        if event.HasField("log") and not persisted:
            keep, note = self._limit_log(event)
            if keep:
                self._put(event, persisted)
            if note is not None:
                self._put(note, False)
            return
        self._put(event, persisted)
        if event.HasField("finished"):
            self._next.pop(event.job_id, None)
            self._logs.pop(event.job_id, None)
            self._labels.pop(event.job_id, None)

    def _put(self, event: job_pb2.JobEvent, persisted: bool) -> None:
        if not persisted:
            self._store.add_event(event)
        for queue in self._watchers.get(event.job_id, ()):
            queue.put_nowait(event)

    def _log_budget(self, job_id: str) -> _LogBudget:
        budget = self._logs.get(job_id)
        if budget is None:
            # First log event of this job in this process (the job may have logged before a
            # restart of the front end): count what the store holds already.
            budget = self._logs[job_id] = _LogBudget()
            for stored in self._store.events_after(job_id, 0):
                if stored.HasField("log"):
                    size = len(stored.log.text.encode("utf-8", "surrogatepass"))
                    budget.used += size + LOG_EVENT_OVERHEAD
                    budget.text_bytes += size
                    if stored.log.text.startswith(LOG_CUT_PREFIX):
                        budget.cut = True
        return budget

    def _limit_log(self, event: job_pb2.JobEvent) -> tuple[bool, job_pb2.JobEvent | None]:
        """(store this event?, a note to publish after it). May shorten the event's text."""
        budget = self._log_budget(event.job_id)
        if budget.cut:
            return not self._give_back(event), None
        size = len(event.log.text.encode("utf-8", "surrogatepass"))
        if budget.used + size + LOG_EVENT_OVERHEAD <= self.max_log_bytes:
            budget.used += size + LOG_EVENT_OVERHEAD
            budget.text_bytes += size
            return True, None
        budget.cut = True
        room = self.max_log_bytes - budget.used - LOG_EVENT_OVERHEAD
        if room > 0:
            event.log.text = _cut_utf8(event.log.text, room)
            budget.text_bytes += len(event.log.text.encode("utf-8", "surrogatepass"))
            keep = True
        else:
            keep = not self._give_back(event)
        note = self.next_event(event.job_id)
        note.log.text = (
            f"{LOG_CUT_PREFIX} after {budget.text_bytes} bytes: the limit of stored log per "
            f"job is {self.max_log_bytes} bytes (each line counts {LOG_EVENT_OVERHEAD} bytes "
            "more); later output of this job is not stored]"
        )
        return keep, note

    def _give_back(self, event: job_pb2.JobEvent) -> bool:
        """Gives a dropped event's sequence number back when it was the last one handed out
        (the callers take a sequence and publish it in one step). Else the event must still be
        stored, so that sequences have no gaps: as an empty line. True when given back."""
        if self._next.get(event.job_id) == event.sequence + 1:
            self._next[event.job_id] = event.sequence
            return True
        event.log.text = ""
        return False

    async def watch(self, job_id: str, after_sequence: int) -> AsyncIterator[job_pb2.JobEvent]:
        """Events after `after_sequence`, replayed then live, up to and including `finished`."""
        queue: asyncio.Queue[job_pb2.JobEvent | None] = asyncio.Queue()
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
                try:
                    item = await asyncio.wait_for(queue.get(), self.poll_s)
                except asyncio.TimeoutError:
                    item = None
                for event in self._store.events_after(job_id, last) if item is None else [item]:
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
