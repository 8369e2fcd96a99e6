"""The result cache and in-flight dedupe: an identical job is answered, not run again.

Two jobs are identical when their kernel, reference and options (everything in the spec but
who asked and why: client_tag, labels), the target they run on (the GPU model and driver,
torch, triton and kerneleval, the engine) and their tenant (--tenants-file: one tenant's result
is never handed to another) are. A job identical to one that ended VERDICT_OK or
VERDICT_INCORRECT within the cache's age takes that result (RESULT_ORIGIN_CACHE); one identical
to a job queued or running waits for it and takes its result (RESULT_ORIGIN_SHARED_RUN), or, if
that job ends any other way (a fault, a timeout, a cancel), runs itself. Faults, timeouts and
cancels are never cached: the store hands out only OK and INCORRECT (store.cached). The cache
lives in the job store (the jobs themselves, keyed by `cache_key`), so it survives restarts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import metadata

from kerneleval.v1 import job_pb2, kernel_pb2

CACHEABLE = (job_pb2.VERDICT_OK, job_pb2.VERDICT_INCORRECT)


def software() -> str:
    """The versions a result depends on, as `name=version` pairs (the front end runs in the
    job processes' environment; no import needed)."""
    parts = []
    for dist in ("kerneleval-server", "torch", "triton"):
        try:
            parts.append(f"{dist}={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist}=-")
    return ";".join(parts)


def cache_key(spec: kernel_pb2.JobSpec, target: str, tenant: str = "") -> str:
    """The key identical jobs share (hex sha256); "" for a job that bypasses the cache. A
    tenant's keys are its own (tenant "": the keys are those from before tenants)."""
    if spec.options.bypass_cache:
        return ""
    what = kernel_pb2.JobSpec()
    what.CopyFrom(spec)
    what.ClearField("client_tag")
    what.ClearField("labels")
    digest = hashlib.sha256(what.SerializeToString(deterministic=True))
    digest.update(b"\0" + target.encode())
    if tenant:
        digest.update(b"\0tenant\0" + tenant.encode())
    return digest.hexdigest()


@dataclass
class InFlight:
    """Per cache key, the job that runs (the leader) and the identical jobs waiting for it."""

    leaders: dict[str, str] = field(default_factory=dict)  # key -> job id
    waiting: dict[str, list[str]] = field(default_factory=dict)  # key -> job ids, in order
    key_of: dict[str, str] = field(default_factory=dict)  # job id -> key, leaders and waiting

    def leader(self, key: str) -> str:
        return self.leaders.get(key, "")

    def lead(self, key: str, job_id: str) -> None:
        self.leaders[key] = job_id
        self.key_of[job_id] = key

    def wait(self, key: str, job_id: str) -> None:
        self.waiting.setdefault(key, []).append(job_id)
        self.key_of[job_id] = key

    def drop_waiting(self, job_id: str) -> bool:
        """Takes a waiting job out (cancelled); False if it was not waiting."""
        key = self.key_of.get(job_id, "")
        waiting = self.waiting.get(key, [])
        if job_id not in waiting:
            return False
        waiting.remove(job_id)
        if not waiting:
            self.waiting.pop(key, None)
        del self.key_of[job_id]
        return True

    def leader_ended(self, job_id: str) -> tuple[str, list[str]]:
        """The leader finished: its key and waiting jobs, in order (no jobs when it led none)."""
        key = self.key_of.get(job_id, "")
        if not key or self.leaders.get(key) != job_id:
            return key, []
        del self.leaders[key]
        del self.key_of[job_id]
        followers = self.waiting.pop(key, [])
        for follower in followers:
            del self.key_of[follower]
        return key, followers

    def __len__(self) -> int:
        return sum(len(w) for w in self.waiting.values())
