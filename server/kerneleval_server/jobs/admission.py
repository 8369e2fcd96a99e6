"""Admission: what a Submit becomes before anything runs, decided here and returned.

- **Idempotency**: a Submit retried with its idempotency key within IDEMPOTENCY_S gets the
  job the first one made (`Decision.earlier`); the key with another spec is refused
  (KeyReused).
- **The result cache** (result_cache.py): a job identical to one that ended OK or INCORRECT
  within `--result-cache-hours` takes its result (`Decision.hit`).
- **The queue limit**: past `--max-queue` (queued jobs and those waiting for an identical one)
  a job is refused with a guess of when room will be made (QueueFull).
- **A tenant's quotas** (--tenants-file): past `--tenant-max-queued` of its jobs queued, or
  `--tenant-max-per-minute` of its submissions in the last RATE_WINDOW_S, its job is refused
  (QueueFull, `quota` naming which) while other tenants' jobs are taken; the per-minute refusal
  says when the oldest of those submissions leaves the window. (Its jobs running at once,
  `--tenant-max-running`, are no refusal: the fair queue holds them, scheduler.py.)
- **Joining a job in flight** (`join`): a job identical to one queued or running waits for
  it instead of queuing; when that one ends (`ended`), they take its result or queue.

The job manager acts on the decisions (manager.py `submit`): it stores, answers or queues.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.config import Config
from kerneleval_server.jobs import result_cache
from kerneleval_server.jobs.store import JobStore
from kerneleval_server.spec import placement

# A tenant's idempotency keys are stored as `tenant<TENANT_SEP>key` (stored_key): another
# tenant's key of the same text names another job (a tenant name holds no TENANT_SEP).
TENANT_SEP = "\x1f"
IDEMPOTENCY_S = 24 * 3600.0  # how long a Submit's idempotency key names its job
RATE_WINDOW_S = 60.0  # --tenant-max-per-minute counts a tenant's submissions this recent
# QueueFull.quota: which limit refused a Submit (the `quota` label of
# kerneleval_tenant_jobs_rejected_total).
QUOTA_QUEUE, QUOTA_QUEUED, QUOTA_PER_MINUTE = "queue", "queued", "per_minute"
QUOTAS = (QUOTA_QUEUE, QUOTA_QUEUED, QUOTA_PER_MINUTE)

# (index, name, driver version) of each GPU a job may run on: this node's, or a gateway's
# nodes'.
Devices = Callable[[], Sequence[tuple[int, str, str]]]
# What joining did: bypassed the cache, shared a job in flight, or leads (a miss).
Joined = Literal["bypass", "shared", "miss"]


class QueueFull(Exception):
    def __init__(self, message: str, retry_after_s: float, quota: str = QUOTA_QUEUE) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s  # a guess of when room will be made
        self.quota = quota  # which limit: one of QUOTAS


class KeyReused(Exception):
    """An idempotency key of a recent Submit came again with a different spec."""


@dataclass(frozen=True)
class Decision:
    """A Submit admitted: the job its idempotency key made earlier (the answer, nothing else
    to do), else its result cache key ("": not cached) and a finished job whose result it
    takes (None: it runs)."""

    earlier: job_pb2.Job | None = None
    cache_key: str = ""
    hit: job_pb2.Job | None = None


def stored_key(idempotency_key: str, tenant: str) -> str:
    """The idempotency key as stored: a tenant's is its own."""
    if not idempotency_key or not tenant:
        return idempotency_key
    return f"{tenant}{TENANT_SEP}{idempotency_key}"


class Admission:
    def __init__(self, config: Config, store: JobStore, devices: Devices) -> None:
        self.config = config
        self.store = store
        self.devices = devices
        self.inflight = result_cache.InFlight()
        self._software = result_cache.software()
        self.finish_times: deque[float] = deque(maxlen=512)  # monotonic, for retry hints
        # tenant -> when its recent submissions were taken (monotonic), for
        # --tenant-max-per-minute where this front end takes them all (not a gateway's).
        self._submitted: dict[str, deque[float]] = {}

    def decide(
        self,
        spec: kernel_pb2.JobSpec,
        idempotency_key: str,
        queued: int,
        tenant: str = "",
        tenant_queued: int = 0,
        tenant_ages: Sequence[float] | None = None,
    ) -> Decision:
        """Admits a Submit (`queued`: the jobs in the queue now, `tenant_queued` the tenant's
        of them; `idempotency_key` as stored, a tenant's with its prefix, stored_key;
        `tenant_ages`: how long ago each of the tenant's submissions of the last RATE_WINDOW_S
        was, as the shared store has them, None: as this front end counted them). Raises
        KeyReused, and QueueFull past the tenant's submissions a minute
        (--tenant-max-per-minute; every new job counts, one the cache answers too), the queue
        limit or the tenant's (--tenant-max-queued; a job the cache answers is never refused
        for these)."""
        if idempotency_key:
            earlier = self._submitted_with(spec, idempotency_key)
            if earlier is not None:
                return Decision(earlier=earlier)  # the same submission: not counted again
        per_minute = self.config.tenant_max_per_minute if tenant else 0
        if per_minute > 0:
            ages = list(tenant_ages) if tenant_ages is not None else self._ages(tenant)
            if len(ages) >= per_minute:
                # Taken again once all but per_minute - 1 of them have left the window.
                leaves = sorted(ages, reverse=True)[len(ages) - per_minute]
                wait = max(0.1, RATE_WINDOW_S - leaves)
                raise QueueFull(
                    f"tenant {tenant!r} submitted {len(ages)} jobs in the last "
                    f"{RATE_WINDOW_S:.0f} s (its limit: {per_minute}, --tenant-max-per-minute); "
                    f"the next is taken in {math.ceil(wait)} s; other tenants' jobs are still "
                    "taken",
                    wait,
                    QUOTA_PER_MINUTE,
                )
        key = self.cache_key(spec, tenant)
        hit = self._cached(key)
        waiting = queued + len(self.inflight)
        if hit is None and waiting >= self.config.max_queue:
            raise QueueFull(
                f"the queue holds {waiting} jobs (limit {self.config.max_queue})",
                self.retry_after_s(),
            )
        limit = self.config.tenant_max_queued
        if hit is None and tenant and 0 < limit <= tenant_queued:
            raise QueueFull(
                f"tenant {tenant!r} has {tenant_queued} jobs queued (its limit: {limit}, "
                "--tenant-max-queued); other tenants' jobs are still taken",
                self.retry_after_s(),
                QUOTA_QUEUED,
            )
        if per_minute > 0 and tenant_ages is None:
            self._submitted.setdefault(tenant, deque()).append(time.monotonic())
        return Decision(cache_key=key, hit=hit)

    def _ages(self, tenant: str) -> list[float]:
        """How long ago each of the tenant's submissions this front end took within
        RATE_WINDOW_S was (older ones forgotten)."""
        taken = self._submitted.get(tenant)
        if not taken:
            return []
        now = time.monotonic()
        while taken and now - taken[0] >= RATE_WINDOW_S:
            taken.popleft()
        return [now - t for t in taken]

    def join(self, job_id: str, key: str) -> Joined:
        """A job to run: it leads its key, or waits for the identical job that does ("shared":
        it does not queue)."""
        if not key:
            return "bypass"
        if self.inflight.leader(key):
            self.inflight.wait(key, job_id)
            return "shared"
        self.inflight.lead(key, job_id)
        return "miss"

    def lead_again(self, key: str, job_id: str) -> None:
        """A job that ran before a restart leads its key again, unless another does."""
        if key and not self.inflight.leader(key):
            self.inflight.lead(key, job_id)

    def ended(self, leader: job_pb2.Job) -> tuple[str, list[str], bool]:
        """A job ended (counted for the retry hints): (its key, the jobs that waited for it,
        whether they take its result); else they run themselves (it faulted, timed out, was
        cancelled...)."""
        self.finish_times.append(time.monotonic())
        key, followers = self.inflight.leader_ended(leader.job_id)
        shared = (
            leader.state == job_pb2.JOB_STATE_DONE
            and leader.result.verdict in result_cache.CACHEABLE
        )
        return key, followers, shared

    def cache_key(self, spec: kernel_pb2.JobSpec, tenant: str = "") -> str:
        if self.config.result_cache_hours <= 0:
            return ""
        return result_cache.cache_key(spec, self.target(spec), tenant)

    def target(self, spec: kernel_pb2.JobSpec) -> str:
        """What a result depends on besides the spec: the engine, the software, and the model
        and driver of the GPUs the job may run on."""
        gpus = sorted(
            {f"{n}/{d}" for i, n, d in self.devices() if placement.may_run_on(spec, i, n)}
        )
        return f"{self.config.engine or 'default'};{self._software};{','.join(gpus)}"

    def retry_after_s(self) -> float:
        """When a full queue will likely have room for a tenth of it again: from the rate at
        which jobs finished lately, between 1 and 60 s."""
        now = time.monotonic()
        recent = [t for t in self.finish_times if now - t <= 60.0]
        rate = len(recent) / max(1.0, now - recent[0]) if len(recent) > 1 else 0.0
        if rate <= 0:
            return 5.0
        return max(1.0, min(60.0, 0.1 * self.config.max_queue / rate))

    def _cached(self, key: str) -> job_pb2.Job | None:
        if not key:
            return None
        return self.store.cached(key, time.time() - self.config.result_cache_hours * 3600)

    def _submitted_with(self, spec: kernel_pb2.JobSpec, key: str) -> job_pb2.Job | None:
        """The job a Submit with this idempotency key made within IDEMPOTENCY_S, if any."""
        earlier = self.store.by_idempotency_key(spec.client_tag, key)
        if earlier is None:
            return None
        if earlier.create_time.ToNanoseconds() / 1e9 < time.time() - IDEMPOTENCY_S:
            self.store.forget_idempotency_key(earlier.job_id)
            return None
        if earlier.spec != spec:
            raise KeyReused(
                f"idempotency_key {key.rpartition(TENANT_SEP)[2]!r} made job {earlier.job_id} "
                "with another spec; a key names one submission"
            )
        return earlier
