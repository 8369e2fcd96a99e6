"""OperationsService: devices, workers, faults, resets; behind the admin token."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeAlias, cast

import grpc
from kerneleval.v1 import job_pb2, operations_service_pb2_grpc
from kerneleval.v1 import operations_service_pb2 as pb

from kerneleval_server.config import GATEWAY
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.jobs.builds.builder_node import probe_versions
from kerneleval_server.jobs.service import JobService
from kerneleval_server.jobs.shared_queue import SharedQueue


def _pseudo_name(index: int) -> str:
    """-1 is the CPU (no GPU on the host), BUILD_DEVICE the build processes (no GPU)."""
    return "build" if index == BUILD_DEVICE else "cpu" if index < 0 else ""


ALL_DEVICES = -2  # RestartWorkers without a device (watchdog.ALL_DEVICES)

log = logging.getLogger("kerneleval.ops")
# A servicer method's context (grpc-stubs type it by the method's request and response).
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

DEFAULT_RESET_GRACE_S = 30.0
MAX_RESET_GRACE_S = 3600.0


def percentiles(samples: Sequence[float]) -> pb.LatencySummary:
    if not samples:
        return pb.LatencySummary()
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0

    return pb.LatencySummary(
        p50_ms=at(0.5), p90_ms=at(0.9), p99_ms=at(0.99), sample_count=len(ordered)
    )


class OperationsService(operations_service_pb2_grpc.OperationsServiceServicer):
    """Behind the admin token (auth.AdminAuth checks it before any of these runs)."""

    def __init__(
        self,
        jobs: JobService,
        shared: SharedQueue | None = None,
        readiness: Callable[[], list[pb.JobKindReadiness]] | None = None,
    ) -> None:
        self.jobs = jobs
        self.readiness = readiness  # per kind of job (fleet/readiness.py)
        # A gateway (--role gateway) owns no device: it lists its nodes' and names the node
        # that owns a device for ResetGpu and RestartWorkers.
        self.gateway = shared if shared is not None and shared.role == GATEWAY else None
        self._gateway_versions: list[str] | None = None  # probed at the first ListBuilders
        self._probing = asyncio.Lock()

    async def _forward(
        self, method: str, request: Any, device: int | None, context: Context
    ) -> Any:
        """A gateway owns no device: the call goes to the node that does (`request.node`, or
        the one node with that device), with the caller's own metadata (its admin token: the
        node checks it again), and the node's answer or error comes back as it is."""
        assert self.gateway is not None
        owners = sorted(
            {d.node for d in self.gateway.node_devices() if device is None or d.index == device}
        )
        node = request.node or (owners[0] if len(owners) == 1 else "")
        if not node or node not in owners:
            where = f"one of {', '.join(owners)}" if owners else "no node has it"
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION if owners else grpc.StatusCode.NOT_FOUND,
                f"{method} on a gateway (--role gateway), which owns no device: set node to "
                f"the node that owns it, {where} (ListDevices on a gateway names each "
                "device's node)",
            )
        metadata = context.invocation_metadata() or ()
        forwarded = [(k, v) for k, v in metadata if k == "authorization"]
        async with grpc.aio.insecure_channel(node) as channel:
            stub = operations_service_pb2_grpc.OperationsServiceStub(channel)
            try:
                return await getattr(stub, method)(request, metadata=forwarded, timeout=3600)
            except grpc.aio.AioRpcError as e:
                await context.abort(e.code(), f"node {node}: {e.details()}")
                raise

    def devices(self) -> list[pb.Device]:
        out: dict[int, pb.Device] = {}
        for index, dev in self.jobs.devices():
            s = dev.status
            out[index] = pb.Device(
                index=index,
                name=s.name or _pseudo_name(index),
                uuid=s.uuid,
                health=s.health or pb.DEVICE_HEALTH_HEALTHY,  # type: ignore[arg-type]
                health_reason=s.health_reason,
                memory_total_bytes=s.memory_total_bytes,
                memory_used_bytes=s.memory_used_bytes,
                temperature_celsius=s.temperature_celsius,
                utilization_percent=s.utilization_percent,
                remapped_row_count=s.remapped_row_count,
                remap_pending=s.remap_pending,
                recovery_action=s.recovery_action,
                recent_xids=list(dev.xids),
                driver_version=s.driver_version,
            )
        for w in self.jobs.job_processes():
            if w.gone:
                continue
            dev_pb = out.get(w.device_index)
            if dev_pb is None:
                dev_pb = out[w.device_index] = pb.Device(
                    index=w.device_index,
                    name=_pseudo_name(w.device_index),
                    health=pb.DEVICE_HEALTH_HEALTHY,
                )
            info = dev_pb.workers.add(
                worker_id=w.worker_id,
                pid=w.pid,
                device_index=w.device_index,
                spare=w.spare,
                job_id=w.job_id,
                completed_job_count=w.completed,
                standing_judge=bool(w.judge_key),
            )
            info.start_time.FromMilliseconds(w.start_time_ms)
        if not out:
            out[-1] = pb.Device(index=-1, name="cpu", health=pb.DEVICE_HEALTH_UNSPECIFIED)
        return [out[i] for i in sorted(out)]

    async def ListDevices(
        self, request: pb.ListDevicesRequest, context: Context
    ) -> pb.ListDevicesResponse:
        if self.gateway is not None:
            return pb.ListDevicesResponse(devices=self.gateway.node_devices())
        ready = self.readiness() if self.readiness is not None else []
        return pb.ListDevicesResponse(devices=self.devices(), readiness=ready)

    async def WatchEvents(
        self, request: pb.WatchEventsRequest, context: Context
    ) -> AsyncIterator[pb.WatchEventsResponse]:
        async for event in self.jobs.watch_operations(request.replay_count):
            yield pb.WatchEventsResponse(event=event)

    async def ResetGpu(self, request: pb.ResetGpuRequest, context: Context) -> pb.ResetGpuResponse:
        if self.gateway is not None:
            answer = await self._forward("ResetGpu", request, request.device_index, context)
            return cast(pb.ResetGpuResponse, answer)
        known = self.jobs.device_indices()
        if request.device_index < 0:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"device_index: {request.device_index} is not a GPU (GPU indices are >= 0; "
                f"devices: {known})",
            )
        if request.device_index not in known:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"device_index: no GPU {request.device_index} here (devices: {known})",
            )
        if not self.jobs.has_watchdog():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the watchdog is not running")
        grace = request.grace_period
        grace_s = (
            grace.seconds + grace.nanos / 1e9
            if request.HasField("grace_period")
            else (DEFAULT_RESET_GRACE_S)
        )
        if not 0 <= grace_s <= MAX_RESET_GRACE_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"grace_period: {grace_s:g} s is outside [0, {MAX_RESET_GRACE_S:g}] s",
            )
        log.warning("GPU reset requested", extra={"device_index": request.device_index})
        try:
            ok, reports = await self.jobs.reset_gpu(request.device_index, int(grace_s * 1000))
        except Exception as exc:  # noqa: BLE001 - the watchdog refused: tell the operator why
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"reset refused: {exc}")
            raise
        steps = []
        for r in reports:
            step = pb.ResetStep(step=r.step, ok=r.ok, message=r.message)
            step.time.FromNanoseconds(time.time_ns())
            steps.append(step)
        return pb.ResetGpuResponse(steps=steps, success=ok)

    async def RestartWorkers(
        self, request: pb.RestartWorkersRequest, context: Context
    ) -> pb.RestartWorkersResponse:
        device = request.device_index if request.HasField("device_index") else ALL_DEVICES
        if self.gateway is not None:
            on = request.device_index if request.HasField("device_index") else None
            answer = await self._forward("RestartWorkers", request, on, context)
            return cast(pb.RestartWorkersResponse, answer)
        known = self.jobs.device_indices()
        if request.HasField("device_index") and device not in known:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"device_index: no device {device} here (devices: {known})",
            )
        if not self.jobs.has_watchdog():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the watchdog is not running")
        count = sum(
            1
            for w in self.jobs.job_processes()
            if not w.gone and (device == ALL_DEVICES or w.device_index == device)
        )
        try:
            await self.jobs.restart_job_processes(device)
        except Exception as exc:  # noqa: BLE001 - the watchdog refused: tell the operator why
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"restart refused: {exc}")
            raise
        return pb.RestartWorkersResponse(restarted_count=count)

    def cleanup(self, older_than_s: float) -> int:
        """Deletes finished jobs; job processes leave no folders (their /tmp is a tmpfs that
        goes with them), so there is nothing else to sweep."""
        deleted = self.jobs.delete_finished_before(time.time() - older_than_s)
        if deleted:
            log.info("cleanup: %d jobs", deleted)
        return deleted

    async def Cleanup(self, request: pb.CleanupRequest, context: Context) -> pb.CleanupResponse:
        if request.HasField("older_than"):
            d = request.older_than
            older = d.seconds + d.nanos / 1e9
            if older < 0:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "older_than: must be >= 0")
        else:
            older = self.jobs.retention_hours * 3600.0
        return pb.CleanupResponse(deleted_job_count=self.cleanup(older))

    async def own_versions(self) -> list[str]:
        """This front end's versions in the builders' form (ExtensionBuilds.versions_of): a
        node's, or an all-in-one service's, are those its job processes reported, the ones its
        load_inline calls ask the builders for. A gateway has no job processes: its own Python's
        (probed once, as a builder probes its own) and its compilers'."""
        await asyncio.to_thread(self.jobs.probe_compilers)
        if self.gateway is None:
            return self.jobs.build_versions()
        async with self._probing:
            if self._gateway_versions is None:
                try:
                    torch_version, cuda_version = await asyncio.to_thread(
                        probe_versions, dict(os.environ)
                    )
                    self._gateway_versions = [self.jobs.versions_of(torch_version, cuda_version)]
                except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    log.warning("ListBuilders: this gateway's versions are not known: %s", exc)
                    self._gateway_versions = []
            return self._gateway_versions

    async def ListBuilders(
        self, request: pb.ListBuildersRequest, context: Context
    ) -> pb.ListBuildersResponse:
        # SQLite (--role all) has the table and never a builder: an empty list.
        rows = self.jobs.builders()
        own = await self.own_versions()
        now = time.time()
        resp = pb.ListBuildersResponse(versions=own)
        for row in rows:
            b = row.builder
            info = resp.builders.add(
                builder_id=b.builder_id,
                address=b.address,
                build_slots=b.slots,
                versions=b.versions,
                versions_match=b.versions in own,
                expired=b.expires < now,
                built_count=b.built,
                leased_request_count=row.leased,
                waiting_request_count=row.waiting,
            )
            if b.heartbeat:
                info.last_heartbeat_time.FromNanoseconds(int(b.heartbeat * 1e9))
            info.expire_time.FromNanoseconds(int(b.expires * 1e9))
        return resp

    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.GetStatsResponse:
        s = self.jobs.stats()
        resp = pb.GetStatsResponse(
            jobs_by_state={job_pb2.JobState.Name(k): v for k, v in s.by_state.items()},
            jobs_by_verdict={job_pb2.Verdict.Name(k): v for k, v in s.by_verdict.items()},
            queue_depth=s.queue_depth,
            queue_latency=percentiles(s.queue_latency),
            run_latency=percentiles(s.run_latency),
            fault_count=s.counters["faults"],
            worker_restart_count=s.counters["restarts"],
            gpu_reset_count=s.counters["resets"],
            xid_count=s.counters["xids"],
            sandbox_warnings=s.sandbox.to_proto(),
            sandbox_state=s.sandbox.state(),
        )
        for index, (seconds, count, wanted) in s.occupancy.items():
            occupancy = resp.device_occupancy.add(device_index=index, timing_window_count=count)
            occupancy.timing_window.FromNanoseconds(int(seconds * 1e9))
            occupancy.timing_wanted.FromNanoseconds(int(wanted * 1e9))
        resp.uptime.FromNanoseconds(int((time.time() - s.started_at) * 1e9))
        return resp
