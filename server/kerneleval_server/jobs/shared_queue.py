"""The shared queue of `--role gateway` and `--role node` front ends on one PostgreSQL store.

One place for what front ends sharing a store do beyond `--role all`:
- **Leases (nodes).** A node takes QUEUED jobs with `store.claim` (`SELECT ... FOR UPDATE SKIP
  LOCKED`): each gets a lease, the node's id and an expiry, which the node's heartbeat renews
  every third of `--lease-seconds`. It takes only what it can start soon (its idle job
  processes plus one job per device), so a job waits in the store, where any node can take
  it, rather than behind a busy node. A job that names a device index goes only to a node with
  that device. The node's store writes only jobs it holds (`SqlStore.node_id`: fenced). With
  `--tenant-max-running`, a tenant's jobs are taken only while fewer than that many of them are
  leased on all nodes together (claims one at a time under an advisory lock): the rest wait in
  the store while other tenants' jobs are taken. A gateway checks a tenant's other quotas
  (queued, per minute) against the store's counts (`store.tenant_queued`, `tenant_created`).
- **Expired leases (every front end).** A node that dies (SIGKILL, a lost machine) stops
  renewing; once its leases expire any front end's heartbeat requeues its jobs (`store.reap`):
  a job that was RUNNING was an attempt and runs again while `--max-attempts` allows, else ends
  FAILED, as after a restart of `--role all`; a job it held QUEUED goes back as it was.
- **Events across front ends.** Every event is a row of the store; each insert NOTIFYs
  `kerneleval_events` with the job's id. This module LISTENs and wakes the job's followers on
  this front end (`EventHub.wake`), which read what is new from the store: Watch and RunBatch
  from any gateway follow jobs on any node, replayable from any sequence as before.
- **Cancels.** A front end that does not run a job records the request (`store.request_cancel`;
  a QUEUED job nobody holds ends there and then); the node that holds it hears it
  (`kerneleval_cancel`, and at each heartbeat) and cancels as `--role all` does.
- **Nodes.** Each node registers its gRPC address and its devices (ListDevices' answer) with
  the heartbeat; gateways list them (ListDevices) and name the node of a device.
- **More on the same loops.** A node's shared artifact store (jobs/builds/artifact_store.py) hears
  its channel through this LISTEN connection (`on_note`) and refreshes its list of builders
  with the heartbeat (`on_beat`); a builder runs the same two loops (`listen_forever`,
  `beat_forever`) for its own channel and leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from kerneleval.v1 import job_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server.config import NODE
from kerneleval_server.fleet.devices import Devices
from kerneleval_server.fleet.job_processes import JobProcessTable
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.jobs.events import EventHub, now_event
from kerneleval_server.jobs.running import Running
from kerneleval_server.jobs.scheduler import FairQueue
from kerneleval_server.jobs.store import JobStore
from kerneleval_server.jobs.store.base import CANCEL_CHANNEL, EVENTS_CHANNEL, QUEUED_CHANNEL


class SharedQueueHost(Protocol):
    """What the shared queue asks of the node's job life cycle (manager.py JobManager): its
    jobs, queue and devices to read; the jobs it leased or lost, and cancels, to hand over."""

    @property
    def store(self) -> JobStore: ...
    @property
    def hub(self) -> EventHub: ...
    @property
    def queue(self) -> FairQueue: ...
    @property
    def running(self) -> dict[str, Running]: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def fleet(self) -> Devices: ...
    @property
    def draining(self) -> bool: ...
    def take(self, job: job_pb2.Job) -> None: ...
    def abandon(self, job_id: str) -> None: ...
    def cancel_soon(self, job_id: str) -> None: ...
    def dispatch(self) -> None: ...


log = logging.getLogger("kerneleval.shared")

LISTEN_RETRY_S = 1.0
IDLE_CLAIM_S = 1.0  # a node looks at the queue this often even when nobody NOTIFYs


async def listen_forever(
    url: str,
    handlers: Mapping[str, Callable[[str], None]],
    on_up: Callable[[], None],
    listening: asyncio.Event | None = None,
) -> None:
    """LISTENs on `handlers`' channels over one connection of its own and hands each
    notification's payload to its channel's handler; `on_up` runs each time the connection
    is (again) up, for what was NOTIFYed while none listened. Reconnects for ever."""
    import psycopg

    while True:
        try:
            conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
            async with conn:
                for channel in handlers:
                    await conn.execute(f"LISTEN {channel}")
                if listening is not None:
                    listening.set()
                on_up()
                async for note in conn.notifies():
                    handler = handlers.get(note.channel)
                    if handler is not None:
                        handler(note.payload)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - listen again; the callers poll meanwhile
            log.warning("LISTEN connection to the store lost: %s", exc)
        if listening is not None:
            listening.clear()
        await asyncio.sleep(LISTEN_RETRY_S)


async def beat_forever(period: float, beat: Callable[[], None]) -> None:
    """`beat()` every `period` seconds; a beat that fails (the store is away) is logged and
    tried again at the next."""
    while True:
        try:
            beat()
        except Exception as exc:  # noqa: BLE001 - the store is away: try again next beat
            log.warning("heartbeat: %s", exc)
        await asyncio.sleep(period)


async def claim_forever(wake: asyncio.Event, claim: Callable[[], object], what: str) -> None:
    """Claims when woken, and every IDLE_CLAIM_S anyway; a store that is away is tried again."""
    while True:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(wake.wait(), IDLE_CLAIM_S)
        wake.clear()
        try:
            claim()
        except Exception as exc:  # noqa: BLE001 - the store is away: try again
            log.warning("%s: %s", what, exc)


class SharedQueue:
    def __init__(
        self,
        manager: SharedQueueHost,
        url: str,
        role: str,
        lease_s: float,
        max_attempts: int,
        tenant_max_running: int = 0,
    ) -> None:
        self.m = manager
        # A node takes a tenant's jobs only while fewer than this many of them are leased on
        # all nodes together (store.claim); 0: no limit.
        self.tenant_max_running = tenant_max_running
        self.store: JobStore = manager.store
        self.url = url
        self.role = role
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        self.node_id = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}" if role == NODE else ""
        self.address = ""  # the node's gRPC address, as gateways reach it
        if role == NODE:
            self.store.node_id = self.node_id
        # What a node registers (ListDevices' answer, serialized); set by main.
        self.devices_blob: Callable[[], bytes] = lambda: b""
        self.nodes: list[tuple[str, str, ops_pb2.ListDevicesResponse]] = []
        self._claim = asyncio.Event()
        self._cancels = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.listening = asyncio.Event()  # the LISTEN connection is up
        # More channels to LISTEN on (channel -> handler of a payload), more work for each
        # heartbeat: the shared artifact store's (jobs/builds/artifact_store.py).
        self.on_note: dict[str, Callable[[str], None]] = {}
        self.on_beat: list[Callable[[], None]] = []

    # ---- life -----------------------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._listen()))
        self._tasks.append(loop.create_task(self._heartbeat()))
        if self.role == NODE:
            self._tasks.append(loop.create_task(self._claim_loop()))
            self._tasks.append(loop.create_task(self._cancel_loop()))

    async def stop(self) -> None:
        """A node gives back the leases of jobs it took and did not start (others take them
        at once) and leaves the node list; its running jobs keep their leases until they
        expire (then they run elsewhere)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.role != NODE:
            return
        try:
            queued = [j for j in self.store.renew(self.node_id, self.lease_s)
                      if j not in self.m.running]  # fmt: skip
            self.store.release(self.node_id, queued)
            self.store.forget_node(self.node_id)
        except Exception as exc:  # noqa: BLE001 - stopping anyway: the leases expire
            log.warning("could not give back leases: %s", exc)

    # ---- notifications --------------------------------------------------------------------

    async def _listen(self) -> None:
        def up() -> None:
            # What was NOTIFYed while no connection listened: followers read again.
            self.m.hub.wake_all()
            self._claim.set()

        handlers: dict[str, Callable[[str], None]] = {
            EVENTS_CHANNEL: self.m.hub.wake,
            QUEUED_CHANNEL: lambda _: self._claim.set(),
            CANCEL_CHANNEL: lambda _: self._cancels.set(),
            **self.on_note,
        }
        await listen_forever(self.url, handlers, up, self.listening)

    # ---- heartbeat: leases, expired leases, nodes -----------------------------------------

    async def _heartbeat(self) -> None:
        await beat_forever(max(0.2, self.lease_s / 3), self.beat)

    def beat(self) -> None:
        if self.role == NODE:
            held = self.store.renew(self.node_id, self.lease_s)
            self._drop_lost(held)
            self.store.register_node(self.node_id, self.address, self.devices_blob(), self.lease_s)
            self._cancels.set()
        reaped = self.store.reap(time.time(), self._expired)
        if reaped:
            log.warning("requeued %d jobs of lost nodes", len(reaped))
        self.nodes = [
            (node_id, address, ops_pb2.ListDevicesResponse.FromString(blob))
            for node_id, address, blob in self.store.nodes()
        ]
        for more in self.on_beat:
            more()

    def _expired(self, job: job_pb2.Job, last: int) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:
        """reap's decision for a job whose node's lease expired."""
        if job.state == job_pb2.JOB_STATE_QUEUED:
            return job, []  # taken, never started: back as it was
        fault = job_pb2.FaultInfo(
            description=f"the node running the job on {job.worker_id} was lost (its lease expired)"
        )
        if job.attempt_count < self.max_attempts:
            fault.description += f"; re-queued (attempt {job.attempt_count + 1})"
            told = now_event(job.job_id, last + 1)
            told.fault.CopyFrom(fault)
            job.state = job_pb2.JOB_STATE_QUEUED
            job.ClearField("start_time")
            queued = now_event(job.job_id, last + 2)
            queued.queued.position = 0
            _labelled(job, told, queued)
            return job, [told, queued]
        fault.description += f"; not retried after {job.attempt_count} attempts"
        job.state = job_pb2.JOB_STATE_FAILED
        job.result.fault.CopyFrom(fault)
        job.state_reason = fault.description
        job.end_time.FromNanoseconds(time.time_ns())
        return job, [_finished_event(job, last + 1)]

    def _drop_lost(self, held: set[str]) -> None:
        """Jobs this node took whose lease it lost (it did not renew in time, and another
        front end requeued them): not its to run or finish any more."""
        for job_id in [j for j in list(self.m.running) if j not in held]:
            log.warning("lease lost: stopping the job here", extra={"job_id": job_id})
            self.m.abandon(job_id)
        for job_id in [j for j in self.m.queue.job_ids() if j not in held]:
            self.m.queue.remove(job_id)
            self.m.hub.forget(job_id)

    # ---- a node takes jobs ----------------------------------------------------------------

    def claim_soon(self) -> None:
        self._claim.set()

    def _room(self) -> int:
        """Jobs the node can start soon: its idle job processes and one more per device."""
        if self.m.draining:
            return 0
        fleet = self.m.fleet
        idle = sum(
            1
            for w in self.m.job_processes.by_id.values()
            if w.ready and w.device_index != BUILD_DEVICE
            and fleet.device_takes_jobs(w.device_index)
        )  # fmt: skip
        devices = [d for d in fleet.device_indices() if fleet.device_takes_jobs(d)]
        if not devices:
            return 0
        return idle + len(devices) - len(self.m.queue)

    async def _claim_loop(self) -> None:
        await claim_forever(self._claim, self.claim, "claim")

    def claim(self) -> int:
        room = self._room()
        if room <= 0:
            return 0
        fleet = self.m.fleet
        devices = {i: n for i, n in fleet.device_names() if fleet.device_takes_jobs(i)}
        jobs = self.store.claim(self.node_id, devices, room, self.lease_s, self.tenant_max_running)
        for job in jobs:
            self.m.hub.forget(job.job_id)  # its events may have grown elsewhere
            self.m.hub.set_labels(job.job_id, job.spec.labels)
            self.m.take(job)
        if jobs:
            log.debug("took %d jobs", len(jobs))
            self.m.dispatch()
        return len(jobs)

    async def _cancel_loop(self) -> None:
        while True:
            await self._cancels.wait()
            self._cancels.clear()
            try:
                wanted = self.store.cancel_requests(self.node_id)
            except Exception as exc:  # noqa: BLE001 - next heartbeat asks again
                log.warning("cancel requests: %s", exc)
                continue
            for job_id in wanted:
                run = self.m.running.get(job_id)
                if run is not None and run.kill is not None:
                    continue  # being killed already
                self.m.cancel_soon(job_id)

    # ---- what a front end that does not run a job does ------------------------------------

    def is_local(self, job_id: str) -> bool:
        return job_id in self.m.running or job_id in self.m.queue

    async def cancel_elsewhere(self, job_id: str, timeout: float) -> None:
        """Cancels a job this front end does not run; waits (up to `timeout`) for it to end."""

        def cancelled(job: job_pb2.Job, last: int) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:
            job.state = job_pb2.JOB_STATE_CANCELLED
            job.state_reason = "cancelled by a client"
            job.end_time.FromNanoseconds(time.time_ns())
            return job, [_finished_event(job, last + 1)]

        if self.store.request_cancel(job_id, cancelled):
            await self.wait_finished(job_id, timeout)

    async def wait_finished(self, job_id: str, timeout: float | None) -> None:
        """Until the job's finished event is in the store (wherever it ran)."""

        async def follow() -> None:
            async for event in self.m.hub.watch(job_id, self.store.last_sequence(job_id) - 1):
                if event.HasField("finished"):
                    return

        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(follow(), timeout)

    # ---- the nodes, as a gateway sees them ------------------------------------------------

    def node_devices(self) -> list[ops_pb2.Device]:
        out = []
        for _, address, listed in self.nodes:
            for device in listed.devices:
                device.node = address
                out.append(device)
        return out

    def device_indices(self) -> list[int]:
        return sorted({d.index for d in self.node_devices() if d.index != BUILD_DEVICE})


def _labelled(job: job_pb2.Job, *events: job_pb2.JobEvent) -> None:
    for event in events:
        event.labels.update(job.spec.labels)


def _finished_event(job: job_pb2.Job, sequence: int) -> job_pb2.JobEvent:
    event = now_event(job.job_id, sequence)
    event.finished.CopyFrom(job)
    event.finished.ClearField("spec")
    event.labels.update(job.spec.labels)
    return event
