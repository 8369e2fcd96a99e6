"""The devices as the front end knows them: their readings and health, their XIDs.

The watchdog reads NVML and the kernel log; its events (fleet/watchdog_events.py) land here:
each device's latest DeviceStatus (its health decides whether it takes jobs), its recent
XIDs, the fleet's counters, and the devices whose job processes have come up warm since the
watchdog started (`serving`). A gateway has no devices of its own: it answers with its
nodes' (jobs/shared_queue.py).

An XID is recorded here (the device's recent ones, the counters, the metrics, the operations
event); which running jobs it belongs to is the job manager's (`JobManager.attribute_xid`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import operations_service_pb2 as ops_pb2

from kerneleval_server.config import GATEWAY
from kerneleval_server.fleet.gpu_memory import GpuMemory
from kerneleval_server.fleet.job_processes import JobProcessTable
from kerneleval_server.jobproc import BUILD_DEVICE
from kerneleval_server.metrics import Metrics


class OpsEvents(Protocol):
    """The operations events (jobs/events.py OpsLog): WatchEvents' feed."""

    def emit(self, device_index: int, **kind: Any) -> ops_pb2.OpsEvent: ...


class Nodes(Protocol):
    """A front end's view of the shared store's nodes (jobs/shared_queue.py SharedQueue)."""

    @property
    def role(self) -> str: ...
    def node_devices(self) -> list[ops_pb2.Device]: ...
    def device_indices(self) -> list[int]: ...


class DevicesHost(Protocol):
    """What the devices ask of the job life cycle (jobs/manager.py JobManager)."""

    @property
    def ops(self) -> OpsEvents: ...
    @property
    def job_processes(self) -> JobProcessTable: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def memory(self) -> GpuMemory: ...
    @property
    def shared(self) -> Nodes | None: ...
    def on_health_change(self) -> None: ...
    def dispatch(self) -> None: ...
    def attribute_xid(self, x: watchdog_pb2.XidObserved) -> None: ...


log = logging.getLogger("kerneleval.jobs")
RECENT_XIDS = 32


@dataclass
class DeviceState:
    index: int
    status: watchdog_pb2.DeviceStatus
    xids: deque[ops_pb2.XidRecord] = field(default_factory=lambda: deque(maxlen=RECENT_XIDS))

    @property
    def takes_jobs(self) -> bool:
        return self.status.health in (
            watchdog_pb2.HEALTH_UNSPECIFIED,
            watchdog_pb2.HEALTH_HEALTHY,
        )


class Devices:
    """The job manager's (`m`) devices."""

    def __init__(self, m: DevicesHost) -> None:
        self.m = m
        self.devices: dict[int, DeviceState] = {}
        # Devices whose job processes have come up warm (a Hello) since the watchdog started;
        # BUILD_DEVICE once a build process has (fleet/readiness.py: builds are ready).
        self.warm_devices: set[int] = set()
        # GetStats' counts: jobs that ended with a fault (JobManager.finish), job process
        # restarts (not a process leaving after its one job), GPU resets, XIDs.
        self.counters = {"faults": 0, "restarts": 0, "resets": 0, "xids": 0}

    def _gateway(self) -> Nodes | None:
        shared = self.m.shared
        return shared if shared is not None and shared.role == GATEWAY else None

    # ---- what dispatch, the API and the health check ask -------------------------------

    def device_takes_jobs(self, index: int) -> bool:
        dev = self.devices.get(index)
        return dev is None or dev.takes_jobs

    def device_names(self) -> list[tuple[int, str]]:
        """(index, GPU name as NVML gives it) of the devices jobs run on; a gateway's: its
        nodes' (an index once for each node that has it)."""
        gateway = self._gateway()
        if gateway is not None:
            return [(d.index, d.name) for d in gateway.node_devices() if d.index != BUILD_DEVICE]
        return [(i, self.device_name(i)) for i in self.device_indices()]

    def device_name(self, index: int) -> str:
        dev = self.devices.get(index)
        return dev.status.name if dev is not None else ""

    def device_indices(self) -> list[int]:
        """The devices jobs run on (not the build processes' pseudo-device); a gateway's:
        those its nodes registered."""
        gateway = self._gateway()
        if gateway is not None:
            return gateway.device_indices()
        known = set(self.devices) | {w.device_index for w in self.m.job_processes.by_id.values()}
        return sorted(known - {BUILD_DEVICE})

    def serving(self) -> bool:
        """A device that takes jobs has had a warm job process since the watchdog started
        (JobManager.serving adds its drain).

        Job processes come and go with every job; between one's exit and the next one's
        Hello, jobs queue: that is no reason to flip the health check."""
        if self._gateway() is not None:
            return True  # no devices of its own: it serves while its store does
        return any(self.device_takes_jobs(d) for d in self.warm_devices if d != BUILD_DEVICE)

    # ---- the watchdog's readings ------------------------------------------------------

    def _device(self, index: int) -> DeviceState:
        dev = self.devices.get(index)
        if dev is None:
            dev = self.devices[index] = DeviceState(
                index, watchdog_pb2.DeviceStatus(device_index=index)
            )
        return dev

    def on_device(self, status: watchdog_pb2.DeviceStatus) -> None:
        """A device's reading (a DeviceUpdate, or the watchdog's status)."""
        m = self.m
        dev = self.devices.get(status.device_index)
        old = dev.status.health if dev is not None else None
        if dev is None:
            dev = self.devices[status.device_index] = DeviceState(status.device_index, status)
        else:
            dev.status = status
        if status.device_index >= 0:
            m.memory.set_total(status.device_index, status.memory_total_bytes)
        if old is not None and old != status.health:
            m.ops.emit(
                status.device_index,
                health_changed=ops_pb2.DeviceHealthChangedEvent(
                    health=status.health,  # type: ignore[arg-type]
                    reason=status.health_reason,
                ),
            )
        m.on_health_change()
        m.dispatch()

    def on_xid(self, x: watchdog_pb2.XidObserved) -> None:
        """An XID: recorded on its device, counted, told; then the jobs it belongs to."""
        m = self.m
        self.counters["xids"] += 1
        m.metrics.xids.labels(str(x.device_index), str(x.xid)).inc()
        record = ops_pb2.XidRecord(
            xid=x.xid,
            category=x.category,
            action=x.action,
            pid=x.pid,
            worker_id=x.worker_ids[0] if x.worker_ids else "",
            job_id=x.job_ids[0] if x.job_ids else "",
            message=x.message,
        )
        if x.time_ms:
            record.time.FromMilliseconds(x.time_ms)
        else:
            record.time.FromNanoseconds(time.time_ns())
        self._device(x.device_index).xids.append(record)
        m.ops.emit(x.device_index, xid=record)
        m.attribute_xid(x)
        log.warning("XID %d on device %d: %s", x.xid, x.device_index, x.message)
