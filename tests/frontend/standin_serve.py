"""`python standin_serve.py serve ...`: the front end with a Python stand-in for the watchdog.

Only for developing the front end before the C++ watchdog and its client land: it runs the
workers itself (no sandbox, no NVML) and speaks the Watchdog client's interface.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
import time
import types
from collections.abc import Callable
from typing import Any

from kerneleval.internal.v1 import supervisor_pb2 as sp


class StandinWatchdog:
    def __init__(self, configure: sp.Configure, on_event: Callable[[sp.SupervisorEvent], None]):
        self.cfg = configure
        self.on_event = on_event
        self.procs: dict[str, tuple[asyncio.subprocess.Process, sp.Worker]] = {}
        self.kill_reasons: dict[str, str] = {}
        self.n = 0
        self.done = asyncio.Event()
        self.stopping = False

    @classmethod
    async def start(cls, binary: str, configure: sp.Configure, on_event: Any) -> StandinWatchdog:
        wd = cls(configure, on_event)
        for _ in range(max(configure.workers_per_device, 1)):
            await wd._spawn(-1, spare=False)
        if configure.warm_spare:
            await wd._spawn(-1, spare=True)
        return wd

    async def _spawn(self, device: int, spare: bool) -> None:
        self.n += 1
        wid = f"d{device}-w{self.n}"
        wdir = os.path.join(self.cfg.state_dir, wid)
        os.makedirs(wdir, exist_ok=True)
        w = sp.Worker(
            worker_id=wid,
            device_index=device,
            token=secrets.token_hex(16),
            spare=spare,
            start_time_ms=int(time.time() * 1000),
        )
        env = dict(os.environ)
        env.update(self.cfg.worker_env)
        env.update(
            KERNELEVAL_WORKER_ID=wid,
            KERNELEVAL_WORKER_TOKEN=w.token,
            KERNELEVAL_DEVICE_INDEX=str(device),
            CUDA_VISIBLE_DEVICES="",
            KERNELEVAL_WORKER_DIR=wdir,
            TMPDIR=wdir,
        )
        proc = await asyncio.create_subprocess_exec(
            *self.cfg.worker_command, env=env, start_new_session=True
        )
        w.pid = proc.pid
        self.procs[wid] = (proc, w)
        self.on_event(sp.SupervisorEvent(worker_started=sp.WorkerStarted(worker=w)))
        asyncio.get_running_loop().create_task(self._reap(wid, proc))

    async def _reap(self, wid: str, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        _, w = self.procs.pop(wid)
        sig = -code if code < 0 else 0
        reason = self.kill_reasons.pop(wid, "")
        reason = f"killed:{reason}" if reason else ("crashed" if sig else "exited")
        if self.stopping:
            reason = "shutdown"
        ev = sp.WorkerExited(
            worker=w,
            exit_code=code if code >= 0 else -1,
            signal=sig,
            reason=reason,
            restarting=not self.stopping,
        )
        self.on_event(sp.SupervisorEvent(worker_exited=ev))
        if self.stopping:
            if not self.procs:
                self.done.set()
            return
        if not w.spare:
            spare = next((p[1] for p in self.procs.values() if p[1].spare), None)
            if spare is not None:
                spare.spare = False
                self.on_event(
                    sp.SupervisorEvent(worker_promoted=sp.WorkerPromoted(worker_id=spare.worker_id))
                )
                await self._spawn(w.device_index, spare=True)
            else:
                await self._spawn(w.device_index, spare=False)
        else:
            await self._spawn(w.device_index, spare=True)

    async def kill_worker(self, worker_id: str, reason: str) -> None:
        entry = self.procs.get(worker_id)
        if entry:
            self.kill_reasons[worker_id] = reason
            os.killpg(entry[0].pid, signal.SIGKILL)

    async def set_job(self, worker_id: str, job_id: str) -> None:
        if worker_id in self.procs:
            self.procs[worker_id][1].job_id = job_id

    async def restart_workers(self, device_index: int = -2) -> None:
        for wid in list(self.procs):
            await self.kill_worker(wid, "restart")

    async def reset_gpu(self, device_index: int, grace_ms: int) -> tuple[bool, list[Any]]:
        raise RuntimeError("no GPU in the stand-in")

    async def status(self) -> sp.StatusReport:
        return sp.StatusReport(
            devices=[sp.DeviceStatus(device_index=-1, name="cpu", health=sp.HEALTH_HEALTHY)],
            workers=[p[1] for p in self.procs.values()],
        )

    async def shutdown(self, grace_ms: int = 2000) -> None:
        self.stopping = True
        for proc, _ in list(self.procs.values()):
            os.killpg(proc.pid, signal.SIGKILL)
        if self.procs:
            await asyncio.wait_for(self.done.wait(), 10)

    async def wait(self) -> int:
        await asyncio.Event().wait()
        return 0


if __name__ == "__main__":
    mod = types.ModuleType("kerneleval_server.watchdog")
    mod.Watchdog = StandinWatchdog  # type: ignore[attr-defined]
    sys.modules["kerneleval_server.watchdog"] = mod
    from kerneleval_server.main import main

    sys.exit(main())
