"""The job service as the API sees it: one face for the servicers (api/), over the job life
cycle (manager.py) and what it keeps. A servicer asks here; it never reaches into the
manager's parts (its store, its event hub, its fleet).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server.fleet.devices import DeviceState
from kerneleval_server.fleet.job_processes import JobProcess
from kerneleval_server.fleet.sandbox_report import SandboxReport
from kerneleval_server.fleet.watchdog import WatchdogLike
from kerneleval_server.jobs.manager import JobManager
from kerneleval_server.jobs.store.base import BuilderStatus


class NoWatchdog(Exception):
    """The command needs the watchdog, and it is not running (yet, or any more)."""


@dataclass
class Stats:
    """GetStats' numbers, as the service keeps them."""

    by_state: dict[int, int]
    by_verdict: dict[int, int]
    queue_depth: int
    queue_latency: list[float]
    run_latency: list[float]
    counters: dict[str, int]
    sandbox: SandboxReport
    occupancy: dict[int, tuple[float, int, float]]
    started_at: float


class JobService:
    def __init__(self, manager: JobManager) -> None:
        self._m = manager

    # ---- jobs (KernelEvalService) -----------------------------------------------------

    @property
    def draining(self) -> bool:
        """The service is stopping: it takes no new job."""
        return self._m.draining

    def device_indices(self) -> list[int]:
        return self._m.fleet.device_indices()

    def device_names(self) -> list[tuple[int, str]]:
        return self._m.fleet.device_names()

    def submit(
        self,
        spec: kernel_pb2.JobSpec,
        flags: list[job_pb2.IntegrityFlag] | None = None,
        idempotency_key: str = "",
        tenant: str = "",
    ) -> job_pb2.Job:
        """A new job of `tenant` (JobManager.submit): raises admission.QueueFull,
        admission.KeyReused."""
        return self._m.submit(spec, flags, idempotency_key, tenant)

    async def finished(self, job_id: str) -> job_pb2.Job | None:
        return await self._m.endings.finished(job_id)

    def watch(self, job_id: str, after_sequence: int) -> AsyncIterator[job_pb2.JobEvent]:
        """The job's events after `after_sequence`, replayed then live, to its `finished`."""
        return self._m.hub.watch(job_id, after_sequence)

    def get(self, job_id: str, include_spec: bool = True) -> job_pb2.Job | None:
        return self._m.store.get(job_id, include_spec=include_spec)

    def list_jobs(
        self,
        *,
        limit: int,
        before_rowid: int | None,
        state: int,
        client_tag: str,
        labels: Mapping[str, str],
        include_spec: bool,
        tenant: str | None = None,
    ) -> list[tuple[int, job_pb2.Job]]:
        """(row id, job), newest first (tenant: that tenant's only; None: all)."""
        return self._m.store.list(
            limit=limit,
            before_rowid=before_rowid,
            state=state,
            client_tag=client_tag,
            labels=labels,
            include_spec=include_spec,
            tenant=tenant,
        )

    async def cancel(self, job_id: str) -> job_pb2.Job | None:
        return await self._m.cancel(job_id)

    def cancel_soon(self, job_id: str) -> None:
        self._m.cancel_soon(job_id)

    # ---- the fleet (OperationsService) ------------------------------------------------

    def devices(self) -> list[tuple[int, DeviceState]]:
        """The devices with a reading, by index."""
        return sorted(self._m.fleet.devices.items())

    def job_processes(self) -> Iterable[JobProcess]:
        """The job processes the watchdog announced and that have not exited."""
        return self._m.job_processes.by_id.values()

    def watch_operations(self, replay_count: int) -> AsyncIterator[ops_pb2.OpsEvent]:
        return self._m.ops.watch(replay_count)

    async def reset_gpu(
        self, device_index: int, grace_ms: int
    ) -> tuple[bool, list[watchdog_pb2.ResetStepReport]]:
        return await self._watchdog().reset_gpu(device_index, grace_ms)

    async def restart_job_processes(self, device_index: int) -> None:
        await self._watchdog().restart_workers(device_index)

    def has_watchdog(self) -> bool:
        return self._m.watchdog is not None

    def delete_finished_before(self, cutoff_unix: float) -> int:
        return self._m.store.delete_finished_before(cutoff_unix)

    @property
    def retention_hours(self) -> float:
        return self._m.config.retention_hours

    def build_versions(self) -> list[str]:
        """The versions this node's build processes build for (its job processes' Hellos)."""
        ext = self._m.builds.extensions
        return sorted(ext.versions_of_job_processes(self._m.job_processes.by_id.values()))

    def versions_of(self, torch_version: str, cuda_version: str) -> str:
        """Versions in the builders' form (ExtensionBuilds.versions_of)."""
        return self._m.builds.extensions.versions_of(torch_version, cuda_version)

    def probe_compilers(self) -> None:
        """`c++ --version`, `nvcc --version`: once (blocks: run it in a thread)."""
        self._m.builds.extensions.compilers()

    def builders(self) -> list[BuilderStatus]:
        return self._m.store.list_builders()

    def stats(self) -> Stats:
        m = self._m
        by_state, by_verdict = m.store.counts()
        return Stats(
            by_state=by_state,
            by_verdict=by_verdict,
            queue_depth=len(m.queue),
            queue_latency=list(m.queue_latency),
            run_latency=list(m.run_latency),
            counters=dict(m.fleet.counters),
            sandbox=m.watchdog_events.sandbox,
            occupancy=m.gate.occupancy(),
            started_at=m.started_at,
        )

    def _watchdog(self) -> WatchdogLike:
        watchdog = self._m.watchdog
        if watchdog is None:
            raise NoWatchdog("the watchdog is not running")
        return watchdog
