"""Asyncio client of the watchdog's control channel (see docs/INTERNALS.md).

The front end starts the C++ watchdog (watchdog/) as its child with one end of a socketpair
as ``--control-fd``, sends ``Configure`` first, then commands; every command gets one ``Ack``
with its ``command_id``. Frames are framing.py's: a 4-byte big-endian length, then the message.

A ``WorkerStarted`` frame with ``channel_attached`` carries one descriptor as SCM_RIGHTS on its
first bytes: the front end's end of that job process's channel. The socket is read with
``recvmsg`` so that those descriptors are not lost; they wait in a FIFO until the frame that
declares them is decoded, and are handed to the channel handler (`on_channel`) with it, just
before the event handler sees the event. A descriptor nobody takes is closed.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from kerneleval.internal.v1 import watchdog_pb2

from kerneleval_server import logs
from kerneleval_server.framing import MAX_FRAME, FrameError, encode, read_frame

ALL_DEVICES = -2
RECV_BYTES = 256 * 1024
MAX_FDS_PER_MESSAGE = 16  # one a frame today; room for more
log = logging.getLogger(__name__)


class WatchdogError(RuntimeError):
    """The watchdog refused a command (Ack.ok false) or the channel is closed."""


class AttachedFd:
    """A descriptor that came with an event; `take()` it to own it, else it is closed."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def take(self) -> int:
        fd, self._fd = self._fd, -1
        if fd < 0:
            raise ValueError("the descriptor was taken already")
        return fd

    @property
    def taken(self) -> bool:
        return self._fd < 0

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


EventHandler = Callable[[watchdog_pb2.WatchdogEvent], None]
ChannelHandler = Callable[[watchdog_pb2.WatchdogEvent, AttachedFd], None]


class ProcessLike(Protocol):
    @property
    def pid(self) -> int: ...
    async def wait(self) -> int: ...
    def kill(self) -> None: ...


def find_watchdog_binary() -> str:
    """$KERNELEVAL_WATCHDOG, else <repo>/build/watchdog/kerneleval-watchdog."""
    env = os.environ.get("KERNELEVAL_WATCHDOG")
    if env:
        return env
    repo = Path(__file__).resolve().parents[3]
    return str(repo / "build" / "watchdog" / "kerneleval-watchdog")  # `make watchdog`


def encode_frame(message: watchdog_pb2.WatchdogCommand) -> bytes:
    """framing.encode of a command (FrameError over MAX_FRAME)."""
    return encode(message.SerializeToString())


def declared_fds(event: watchdog_pb2.WatchdogEvent) -> int:
    """How many descriptors ride on this event's frame."""
    if event.WhichOneof("kind") == "worker_started" and event.worker_started.channel_attached:
        return 1
    return 0


class WatchdogLike(Protocol):
    """The watchdog as the job life cycle and its helpers command it (Watchdog, or a fake)."""

    async def kill_worker(self, worker_id: str, reason: str) -> None: ...
    async def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None: ...
    async def job_process_warm(self, worker_id: str) -> None: ...
    async def restart_workers(self, device_index: int = -2) -> None: ...
    async def reset_gpu(
        self, device_index: int, grace_ms: int
    ) -> tuple[bool, list[watchdog_pb2.ResetStepReport]]: ...
    async def status(self) -> watchdog_pb2.StatusReport: ...
    async def shutdown(self, grace_ms: int = 2000) -> None: ...
    async def open_window(
        self,
        device_index: int,
        holder_worker_id: str,
        freeze_others: bool,
        partner_worker_ids: Sequence[str] = (),
    ) -> watchdog_pb2.WindowReport: ...
    async def close_window(self, device_index: int) -> watchdog_pb2.WindowReport: ...
    async def stop_gpu_users(self, device_index: int) -> watchdog_pb2.GpuUsersReport: ...


class _Call:
    """A command waiting for its reply: the Ack, and for some commands more events."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.done: asyncio.Future[watchdog_pb2.WatchdogEvent] = (
            asyncio.get_running_loop().create_future()
        )
        self.steps: list[watchdog_pb2.ResetStepReport] = []
        self.acked = False


class Watchdog:
    def __init__(
        self,
        proc: ProcessLike,
        sock: socket.socket,
        on_event: EventHandler,
        on_channel: ChannelHandler | None = None,
    ) -> None:
        """Takes `sock` (our end of the control channel; made non-blocking here)."""
        self._proc = proc
        self._sock = sock
        sock.setblocking(False)
        self._on_event = on_event
        self._on_channel = on_channel
        self._calls: dict[int, _Call] = {}
        self._next_id = 1
        self._closed: str | None = None
        self._fds: deque[int] = deque()  # received, not yet claimed by a decoded frame
        self._reader = asyncio.StreamReader(limit=MAX_FRAME + 8)
        self._out: asyncio.Queue[bytes | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.fileno(), self._on_readable)
        self._reading = True
        self._read_task = loop.create_task(self._read_loop())
        self._write_task = loop.create_task(self._write_loop())

    @classmethod
    async def start(
        cls,
        binary: str,
        configure: watchdog_pb2.Configure,
        on_event: EventHandler,
        on_channel: ChannelHandler | None = None,
    ) -> Watchdog:
        """Spawns the watchdog and configures it; raises WatchdogError if it refuses.

        `on_event(event)` sees every event; `on_channel(event, fd)` gets, just before, the
        descriptor that came with a WorkerStarted (take() it to keep it)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stderr = await logs.child_stderr()  # its lines (and its children's) as JSON records
        try:
            proc = await asyncio.create_subprocess_exec(
                binary,
                "--control-fd",
                str(theirs.fileno()),
                pass_fds=(theirs.fileno(),),
                stderr=stderr,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            os.close(stderr)
        wd = cls(proc, ours, on_event, on_channel)
        try:
            await wd._call(watchdog_pb2.WatchdogCommand(configure=configure), "configure")
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
        cmd = watchdog_pb2.WatchdogCommand(
            kill_worker=watchdog_pb2.KillWorker(worker_id=worker_id, reason=reason)
        )
        await self._call(cmd, "ack")

    async def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None:
        cmd = watchdog_pb2.WatchdogCommand(
            set_job=watchdog_pb2.SetJob(worker_id=worker_id, job_id=job_id, finished=finished)
        )
        await self._call(cmd, "ack")

    async def job_process_warm(self, worker_id: str) -> None:
        """It said warm: frozen by windows from now on (at once in an open one); returns once
        the watchdog says so. WatchdogError when it knows no such process."""
        cmd = watchdog_pb2.WatchdogCommand(
            job_process_warm=watchdog_pb2.JobProcessWarm(worker_id=worker_id)
        )
        await self._call(cmd, "ack")

    async def restart_workers(self, device_index: int = ALL_DEVICES) -> None:
        cmd = watchdog_pb2.WatchdogCommand(
            restart_workers=watchdog_pb2.RestartWorkers(device_index=device_index)
        )
        await self._call(cmd, "ack")

    async def start_workers(self, device_index: int = ALL_DEVICES) -> None:
        cmd = watchdog_pb2.WatchdogCommand(
            start_workers=watchdog_pb2.StartWorkers(device_index=device_index)
        )
        await self._call(cmd, "ack")

    async def stop_workers(self, device_index: int = ALL_DEVICES, grace_ms: int = 0) -> None:
        cmd = watchdog_pb2.WatchdogCommand(
            stop_workers=watchdog_pb2.StopWorkers(device_index=device_index, grace_ms=grace_ms)
        )
        await self._call(cmd, "ack")

    async def reset_gpu(
        self, device_index: int, grace_ms: int
    ) -> tuple[bool, list[watchdog_pb2.ResetStepReport]]:
        """Runs the reset procedure; returns (success, the steps) when it has finished."""
        cmd = watchdog_pb2.WatchdogCommand(
            reset_gpu=watchdog_pb2.ResetGpu(device_index=device_index, grace_ms=grace_ms)
        )
        call = self._send(cmd, "reset")
        event = await call.done
        return event.reset_finished.success, call.steps

    async def status(self) -> watchdog_pb2.StatusReport:
        event = await self._call(
            watchdog_pb2.WatchdogCommand(get_status=watchdog_pb2.GetStatus()), "status"
        )
        return event.status

    async def open_window(
        self,
        device_index: int,
        holder_worker_id: str,
        freeze_others: bool,
        partner_worker_ids: Sequence[str] = (),
    ) -> watchdog_pb2.WindowReport:
        """Opens the device's timing window for `holder_worker_id`: with `freeze_others`, every
        other job process of the device is frozen (and any started before the window closes)
        but `partner_worker_ids`, which run beside the holder (the kernel's process its judge
        drives); one frozen for an earlier window thaws. The report says whether all froze
        (`ok`; false, changing nothing, when the holder or a partner is no job process of the
        device), which, and the GPU's conditions."""
        cmd = watchdog_pb2.WatchdogCommand(
            open_window=watchdog_pb2.OpenWindow(
                device_index=device_index,
                holder_worker_id=holder_worker_id,
                freeze_others=freeze_others,
                partner_worker_ids=partner_worker_ids,
            )
        )
        event = await self._call(cmd, "window")
        return event.window

    async def close_window(self, device_index: int) -> watchdog_pb2.WindowReport:
        """Closes the device's timing window: the GPU's conditions, then what it froze thaws."""
        cmd = watchdog_pb2.WatchdogCommand(
            close_window=watchdog_pb2.CloseWindow(device_index=device_index)
        )
        event = await self._call(cmd, "window")
        return event.window

    async def stop_gpu_users(self, device_index: int) -> watchdog_pb2.GpuUsersReport:
        """Kills the frozen job processes of the device's open timing window that NVML saw use
        the GPU since their freeze (their queued work runs into the holder's window); each exits
        with reason "killed:gpu_outside_phase". The report says whether NVML could tell
        (`known`), whom it killed (`killed_worker_ids`) and why (`message`)."""
        cmd = watchdog_pb2.WatchdogCommand(
            stop_gpu_users=watchdog_pb2.StopGpuUsers(device_index=device_index)
        )
        event = await self._call(cmd, "gpu_users")
        return event.gpu_users

    async def shutdown(self, grace_ms: int = 2000) -> None:
        """Stops every job process (SIGTERM, SIGKILL after grace_ms) and waits for the exit."""
        if self._closed is None:
            cmd = watchdog_pb2.WatchdogCommand(shutdown=watchdog_pb2.Shutdown(grace_ms=grace_ms))
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
        """Closes the channel (the watchdog then kills every job process and exits)."""
        self._stop_reading()
        self._out.put_nowait(None)
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self._write_task, 2)
        self._write_task.cancel()
        self._reader.feed_eof()
        with contextlib.suppress(asyncio.CancelledError):
            await self._read_task
        with contextlib.suppress(OSError):
            self._sock.close()
        self._close_fds()

    # -- internals

    def _send(self, cmd: watchdog_pb2.WatchdogCommand, kind: str) -> _Call:
        if self._closed is not None:
            raise WatchdogError(f"watchdog channel closed: {self._closed}")
        cmd.command_id = self._next_id
        self._next_id += 1
        frame = encode(cmd.SerializeToString())
        call = _Call(kind)
        self._calls[cmd.command_id] = call
        self._out.put_nowait(frame)
        return call

    async def _call(
        self, cmd: watchdog_pb2.WatchdogCommand, kind: str
    ) -> watchdog_pb2.WatchdogEvent:
        return await self._send(cmd, kind).done

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frame = await self._out.get()
            if frame is None:
                return
            try:
                await loop.sock_sendall(self._sock, frame)
            except OSError as exc:
                log.warning("watchdog channel: cannot write: %s", exc)
                self._fail_calls(f"cannot write to the watchdog: {exc}")
                return

    def _on_readable(self) -> None:
        """Bytes and descriptors in; descriptors queue up in arrival order."""
        try:
            data, ancdata, flags, _ = self._sock.recvmsg(
                RECV_BYTES,
                socket.CMSG_SPACE(MAX_FDS_PER_MESSAGE * 4),
                getattr(socket, "MSG_CMSG_CLOEXEC", 0),
            )
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("watchdog channel: %s", exc)
            data, ancdata, flags = b"", [], 0
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            log.error("watchdog channel: descriptors were cut off (MSG_CTRUNC)")
        if data:
            self._reader.feed_data(data)
        else:
            self._stop_reading()
            self._reader.feed_eof()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())

    def _close_fds(self) -> None:
        while self._fds:
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())

    async def _read_loop(self) -> None:
        reason = "watchdog closed the channel"
        try:
            while True:
                try:
                    frame = await read_frame(self._reader)
                except FrameError as exc:
                    reason = f"bad frame from the watchdog: {exc}"
                    break
                if frame is None:
                    break
                event = watchdog_pb2.WatchdogEvent()
                event.ParseFromString(frame)
                attached = self._claim_fds(event)
                try:
                    if attached is not None and self._on_channel is not None:
                        self._on_channel(event, attached)
                    self._on_event(event)
                except Exception:  # a bug in a handler must not cut the channel
                    log.exception("watchdog event handler failed on %s", event.WhichOneof("kind"))
                finally:
                    if attached is not None:
                        attached.close()  # nobody took it
                self._dispatch(event)
        except (ConnectionError, OSError) as exc:
            reason = f"watchdog channel: {exc}"
        except Exception as exc:  # noqa: BLE001 - an undecodable frame ends the channel
            reason = f"watchdog channel: {exc!r}"
        finally:
            self._closed = reason
            self._stop_reading()
            self._fail_calls(reason)
            self._close_fds()

    def _claim_fds(self, event: watchdog_pb2.WatchdogEvent) -> AttachedFd | None:
        want = declared_fds(event)
        if not want:
            return None
        if len(self._fds) < want:
            log.error(
                "watchdog channel: %s declares %d descriptor(s), %d received",
                event.WhichOneof("kind"),
                want,
                len(self._fds),
            )
            return None
        fds = [self._fds.popleft() for _ in range(want)]
        for extra in fds[1:]:
            os.close(extra)
        return AttachedFd(fds[0])

    def _fail_calls(self, reason: str) -> None:
        if self._closed is None:
            self._closed = reason
        for call in self._calls.values():
            if not call.done.done():
                call.done.set_exception(WatchdogError(reason))
        self._calls.clear()

    def _dispatch(self, event: watchdog_pb2.WatchdogEvent) -> None:
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
        elif kind == call.kind and kind in ("status", "window", "gpu_users"):
            call.done.set_result(event)
            finished = True
        elif kind == "reset_step" and call.kind == "reset":
            call.steps.append(event.reset_step)
        elif kind == "reset_finished" and call.kind == "reset":
            call.done.set_result(event)
            finished = True
        if finished:
            del self._calls[event.command_id]
