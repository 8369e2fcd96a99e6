"""A job's way in (manager.py `submit`, `take`, `recover`) and back (`requeue`), once
admission (admission.py) has decided what it becomes:

- **Sent, then stored**: a job submit admitted to run here is held (`hold`) and stored as
  the dispatch sends it to a process, or right after it if none takes it (`store_new`): the
  process starts on it while the store is written. Until then it is `unstored`.
- **Queued**, or waiting for an identical job queued or running (`enqueue_or_wait`); when
  that one ends, its followers take its result or queue (`leader_ended`).
- **Answered without running**: with another job's result (`answer`: the result cache, a
  leader's run), or rejected by its static checks (`reject`).
- **Checked late**: the static checks of a job started before them (`flag_late`).
"""

from __future__ import annotations

import logging
from typing import Protocol

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.fleet.devices import Devices
from kerneleval_server.jobs import static_checks
from kerneleval_server.jobs.admission import Admission, Joined
from kerneleval_server.jobs.builds.paths import BuildPaths
from kerneleval_server.jobs.events import EventHub
from kerneleval_server.jobs.running import Running, Unstored
from kerneleval_server.jobs.scheduler import FairQueue, QueuedJob
from kerneleval_server.jobs.shared_queue import SharedQueue
from kerneleval_server.jobs.store import TERMINAL, JobStore
from kerneleval_server.metrics import Metrics
from kerneleval_server.spec import placement

log = logging.getLogger("kerneleval.jobs")


class IntakeHost(Protocol):
    """What a job's way in reads of the job life cycle (manager.py JobManager)."""

    @property
    def store(self) -> JobStore: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def queue(self) -> FairQueue: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def admission(self) -> Admission: ...
    @property
    def builds(self) -> BuildPaths: ...
    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def fleet(self) -> Devices: ...
    @property
    def shared(self) -> SharedQueue | None: ...
    def finish(
        self,
        job: job_pb2.Job,
        state: job_pb2.JobState,
        result: job_pb2.EvalResult,
        reason: str = "",
    ) -> None: ...


class Intake:
    def __init__(self, m: IntakeHost) -> None:
        self.m = m
        self._unstored: dict[str, Unstored] = {}  # submitted, stored once sent (store_new)

    def devices(self) -> list[tuple[int, str, str]]:
        """(index, name, driver) of the GPUs a job may run on (admission's result cache key):
        here, or a gateway's nodes' (ListDevices), where it may run as much as on any here."""
        shared = self.m.shared
        if shared is not None:
            return [(d.index, d.name, d.driver_version) for d in shared.node_devices()]
        return [
            (d.index, d.status.name, d.status.driver_version) for d in self.m.fleet.devices.values()
        ]

    # ---- sent, then stored ---------------------------------------------------------------

    def hold(self, job: job_pb2.Job, event: job_pb2.JobEvent, key: str, idem: str) -> None:
        """A job submitted to run here, with its queued event: stored once it is sent."""
        self._unstored[job.job_id] = Unstored(job, event, key, idem)

    def unstored(self, job_id: str) -> Unstored | None:
        """A job submit made and has not stored yet (store_new)."""
        return self._unstored.get(job_id)

    def store_new(self, job_id: str, as_it_is: bool = False) -> None:
        """A job submit has not stored yet: stored now, as submitted, with its queued event
        and the events made since. `as_it_is`: then as it is now (the dispatch is over: built
        earlier, it waits for a launch process, RUNNING)."""
        new = self._unstored.pop(job_id, None)
        if new is None:
            return
        store, hub = self.m.store, self.m.hub
        store.insert(
            new.job, new.event, cache_key=new.cache_key, idempotency_key=new.idempotency_key
        )
        hub.publish(new.event, persisted=True)
        run = self.m.running.get(job_id) if as_it_is else None
        if run is not None:
            store.update(run.job)
        for event in new.later:
            hub.publish(event)

    # ---- queued, or waiting for an identical job -------------------------------------------

    def enqueue_or_wait(self, job: job_pb2.Job, key: str) -> Joined:
        """Queues the job, unless an identical one is queued or running: then it waits for
        that one's result. Returns what the cache did ("bypass", "shared" or "miss"; the
        submission counts it, not a restart or a leader's end that moves the job on)."""
        joined = self.m.admission.join(job.job_id, key)
        if joined != "shared":
            self.enqueue(job)
        return joined

    def enqueue(self, job: job_pb2.Job) -> None:
        spec, queue = job.spec, self.m.queue
        kind = self.m.builds.kind(job)
        queue.push(
            QueuedJob(
                job.job_id, spec.client_tag, placement.wanted_device(spec), kind,
                placement.wanted_model(spec), job.tenant,
            )
        )  # fmt: skip
        self.m.metrics.queue_depth.set(len(queue))

    def requeue(self, job: job_pb2.Job) -> None:
        """Back to QUEUED (told, stored) and into the queue; its start is stamped again."""
        job.state = job_pb2.JOB_STATE_QUEUED
        job.ClearField("start_time")
        event = self.m.hub.next_event(job.job_id)
        event.queued.position = len(self.m.queue)
        self.m.store.update(job, event)
        self.m.hub.publish(event, persisted=True)
        self.enqueue(job)

    def leader_ended(self, leader: job_pb2.Job) -> None:
        """Identical jobs waiting for `leader` take its result, or run (it faulted, timed
        out, was cancelled...)."""
        key, followers, shared = self.m.admission.ended(leader)
        for job_id in followers:
            follower = self.m.store.get(job_id)
            if follower is None or follower.state in TERMINAL:
                continue
            if shared:
                self.answer(follower, leader, job_pb2.RESULT_ORIGIN_SHARED_RUN)
            else:
                self.enqueue_or_wait(follower, key)

    # ---- answered without running ----------------------------------------------------------

    def answer(self, job: job_pb2.Job, source: job_pb2.Job, origin: job_pb2.ResultOrigin) -> None:
        """Ends `job` with the result `source` computed."""
        job.result_origin = origin
        job.result_job_id = source.result_job_id or source.job_id
        self.m.finish(job, job_pb2.JOB_STATE_DONE, source.result, source.state_reason)

    def reject(self, job: job_pb2.Job) -> None:
        """reject_flagged and the candidate is flagged: it ends now, never run."""
        rules = static_checks.rule_names(job.result.flags)
        result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_REJECTED, correctness=False)
        log.info("job rejected", extra={"job_id": job.job_id, "rules": rules})
        reason = f"rejected: static checks flagged {rules}"
        self.m.finish(job, job_pb2.JOB_STATE_DONE, result, reason)

    # ---- checked late ---------------------------------------------------------------------

    def flag_late(self, job_id: str, spec: kernel_pb2.JobSpec) -> list[job_pb2.IntegrityFlag]:
        """The static checks of a job started before them (submit): their flags join the job
        where it is now, running (run.job, which finish ends from) or queued (the store)."""
        flags = static_checks.check(spec)
        if not flags:
            return flags  # the common case: nothing to write
        run = self.m.running.get(job_id)
        job = run.job if run is not None else self.m.store.get(job_id)
        if job is not None:
            job.result.flags.extend(flags)
            self.m.store.update(job)
        return flags
