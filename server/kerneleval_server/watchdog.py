"""Asyncio client of the watchdog's control channel (see docs/INTERNALS.md).

The front end starts the C++ watchdog (supervisor/) as its child with one end of a socketpair
as ``--control-fd``, sends ``Configure`` first, then commands; every command gets one ``Ack``
with its ``command_id``. Frames are a 4-byte big-endian length, then the message (<= 16 MiB).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path

from kerneleval.internal.v1 import supervisor_pb2

MAX_FRAME = 16 * 1024 * 1024
ALL_DEVICES = -2
_HEADER = struct.Struct(">I")
log = logging.getLogger(__name__)


class WatchdogError(RuntimeError):
    """The watchdog refused a command (Ack.ok false) or the channel is closed."""


def find_watchdog_binary() -> str:
    """$KERNELEVAL_WATCHDOG, else <repo>/build/supervisor/kerneleval-watchdog."""
    env = os.environ.get("KERNELEVAL_WATCHDOG")
    if env:
        return env
    repo = Path(__file__).resolve().parents[2]
    return str(repo / "build" / "supervisor" / "kerneleval-watchdog")  # `make supervisor`


def encode_frame(message: supervisor_pb2.SupervisorCommand) -> bytes:
    payload = message.SerializeToString()
    if len(payload) > MAX_FRAME:
        raise ValueError(f"frame of {len(payload)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(payload)) + payload


class _Call:
    """A command waiting for its reply: the Ack, and for some commands more events."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done: asyncio.Future[supervisor_pb2.SupervisorEvent] = (
            asyncio.get_running_loop().create_future()
        )
        self.steps: list[supervisor_pb2.ResetStepReport] = []
        self.acked = False


class Watchdog:
    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_event: Callable[[supervisor_pb2.SupervisorEvent], None],
    ) -> None:
        self._proc = proc
        self._reader = reader
        self._writer = writer
        self._on_event = on_event
        self._calls: dict[int, _Call] = {}
        self._next_id = 1
        self._closed: str | None = None
        self._read_task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def start(
        cls,
        binary: str,
        configure: supervisor_pb2.Configure,
        on_event: Callable[[supervisor_pb2.SupervisorEvent], None],
    ) -> Watchdog:
        """Spawns the watchdog and configures it; raises WatchdogError if it refuses."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                binary, "--control-fd", str(theirs.fileno()), pass_fds=(theirs.fileno(),)
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=MAX_FRAME + 8)
        wd = cls(proc, reader, writer, on_event)
        try:
            await wd._call(supervisor_pb2.SupervisorCommand(configure=configure), "configure")
        except BaseException:
            await wd.close()  # the watchdog exits when its channel closes
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 2)
            raise
        return wd

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def closed(self) -> bool:
        return self._closed is not None

    async def kill_worker(self, worker_id: str, reason: str) -> None:
        cmd = supervisor_pb2.SupervisorCommand(
            kill_worker=supervisor_pb2.KillWorker(worker_id=worker_id, reason=reason)
        )
        await self._call(cmd, "ack")

    async def set_job(self, worker_id: str, job_id: str) -> None:
        cmd = supervisor_pb2.SupervisorCommand(
            set_job=supervisor_pb2.SetJob(worker_id=worker_id, job_id=job_id)
        )
        await self._call(cmd, "ack")

    async def restart_workers(self, device_index: int = ALL_DEVICES) -> None:
        cmd = supervisor_pb2.SupervisorCommand(
            restart_workers=supervisor_pb2.RestartWorkers(device_index=device_index)
        )
        await self._call(cmd, "ack")

    async def start_workers(self, device_index: int = ALL_DEVICES) -> None:
        cmd = supervisor_pb2.SupervisorCommand(
            start_workers=supervisor_pb2.StartWorkers(device_index=device_index)
        )
        await self._call(cmd, "ack")

    async def stop_workers(self, device_index: int = ALL_DEVICES, grace_ms: int = 0) -> None:
        cmd = supervisor_pb2.SupervisorCommand(
            stop_workers=supervisor_pb2.StopWorkers(device_index=device_index, grace_ms=grace_ms)
        )
        await self._call(cmd, "ack")

    async def reset_gpu(
        self, device_index: int, grace_ms: int
    ) -> tuple[bool, list[supervisor_pb2.ResetStepReport]]:
        """Runs the reset procedure; returns (success, the steps) when it has finished."""
        cmd = supervisor_pb2.SupervisorCommand(
            reset_gpu=supervisor_pb2.ResetGpu(device_index=device_index, grace_ms=grace_ms)
        )
        call = self._send(cmd, "reset")
        event = await call.done
        return event.reset_finished.success, call.steps

    async def status(self) -> supervisor_pb2.StatusReport:
        event = await self._call(
            supervisor_pb2.SupervisorCommand(get_status=supervisor_pb2.GetStatus()), "status"
        )
        return event.status

    async def shutdown(self, grace_ms: int = 2000) -> None:
        """Stops every worker (SIGTERM, SIGKILL after grace_ms) and waits for the exit."""
        if self._closed is None:
            cmd = supervisor_pb2.SupervisorCommand(
                shutdown=supervisor_pb2.Shutdown(grace_ms=grace_ms)
            )
            with contextlib.suppress(WatchdogError):
                await self._call(cmd, "ack")
        try:
            await asyncio.wait_for(self._proc.wait(), timeout=grace_ms / 1000 + 5)
        except asyncio.TimeoutError:
            self._proc.kill()
        await self.close()

    async def wait(self) -> int:
        """Returns the watchdog's exit status when it exits."""
        return await self._proc.wait()

    async def close(self) -> None:
        """Closes the channel (the watchdog then kills every worker and exits)."""
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task

    # -- internals

    def _send(self, cmd: supervisor_pb2.SupervisorCommand, kind: str) -> _Call:
        if self._closed is not None:
            raise WatchdogError(f"watchdog channel closed: {self._closed}")
        cmd.command_id = self._next_id
        self._next_id += 1
        call = _Call(kind)
        self._calls[cmd.command_id] = call
        self._writer.write(encode_frame(cmd))
        return call

    async def _call(
        self, cmd: supervisor_pb2.SupervisorCommand, kind: str
    ) -> supervisor_pb2.SupervisorEvent:
        call = self._send(cmd, kind)
        await self._writer.drain()
        return await call.done

    async def _read_loop(self) -> None:
        reason = "watchdog closed the channel"
        try:
            while True:
                header = await self._reader.readexactly(4)
                (size,) = _HEADER.unpack(header)
                if size > MAX_FRAME:
                    reason = f"oversized frame ({size} bytes) from the watchdog"
                    break
                event = supervisor_pb2.SupervisorEvent()
                event.ParseFromString(await self._reader.readexactly(size))
                try:
                    self._on_event(event)
                except Exception:  # a bug in a handler must not cut the channel
                    log.exception("watchdog event handler failed on %s", event.WhichOneof("kind"))
                self._dispatch(event)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        finally:
            self._closed = reason
            for call in self._calls.values():
                if not call.done.done():
                    call.done.set_exception(WatchdogError(reason))
            self._calls.clear()

    def _dispatch(self, event: supervisor_pb2.SupervisorEvent) -> None:
        call = self._calls.get(event.command_id) if event.command_id else None
        if call is None:
            return
        kind = event.WhichOneof("kind")
        finished = False
        if kind == "ack":
            call.acked = True
            if not event.ack.ok:
                call.done.set_exception(WatchdogError(event.ack.message or "refused"))
                finished = True
            elif call.kind in ("ack", "configure"):
                call.done.set_result(event)
                finished = True
        elif kind == "status" and call.kind == "status":
            call.done.set_result(event)
            finished = True
        elif kind == "reset_step" and call.kind == "reset":
            call.steps.append(event.reset_step)
        elif kind == "reset_finished" and call.kind == "reset":
            call.done.set_result(event)
            finished = True
        if finished:
            del self._calls[event.command_id]
