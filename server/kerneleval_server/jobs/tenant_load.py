"""What a tenant's quotas are checked against (the job life cycle's, manager.py): its jobs
queued and its submissions of the last minute (admission.decide), and its jobs running
(FairQueue.lane_open). A gateway's or a node's queue is the shared store's: counted there,
whichever front end took the jobs."""

from __future__ import annotations

import time
from typing import Protocol

from kerneleval_server.config import Config
from kerneleval_server.jobs.admission import RATE_WINDOW_S
from kerneleval_server.jobs.running import Running
from kerneleval_server.jobs.scheduler import FairQueue
from kerneleval_server.jobs.shared_queue import SharedQueue
from kerneleval_server.jobs.store import JobStore


class TenantLoadHost(Protocol):
    """What it reads of the job life cycle (JobManager)."""

    @property
    def config(self) -> Config: ...
    @property
    def queue(self) -> FairQueue: ...
    @property
    def store(self) -> JobStore: ...
    @property
    def shared(self) -> SharedQueue | None: ...
    @property
    def running(self) -> dict[str, Running]: ...


class TenantLoad:
    def __init__(self, m: TenantLoadHost) -> None:
        self.m = m

    def of(self, tenant: str) -> tuple[int, list[float] | None]:
        """The tenant's jobs queued (--tenant-max-queued) and how long ago each of its
        submissions of the last minute was (--tenant-max-per-minute; None: the admission's own
        count, a single service's)."""
        if not tenant:
            return 0, None
        if self.m.shared is None:
            return self.m.queue.queued_in(("tenant", tenant)), None
        cfg = self.m.config
        queued = self.m.store.tenant_queued(tenant) if cfg.tenant_max_queued > 0 else 0
        if cfg.tenant_max_per_minute <= 0:
            return queued, None
        now = time.time()
        created = self.m.store.tenant_created(tenant, cfg.tenant_max_per_minute)
        return queued, [now - t for t in created if now - t < RATE_WINDOW_S]

    def running(self, tenant: str) -> int:
        """The tenant's jobs running here now (started, not ended: built ahead and waiting for
        a launch, or for their judge, too)."""
        return sum(1 for run in self.m.running.values() if run.job.tenant == tenant)

    def has_room(self, lane: tuple[str, str]) -> bool:
        """FairQueue.lane_open under --tenant-max-running: a tenant's lane starts a job only
        while it runs fewer than its share (a client_tag's lane, no tenant's, always)."""
        kind, tenant = lane
        return kind != "tenant" or self.running(tenant) < self.m.config.tenant_max_running
