"""The front end's side of the job processes: their table and their channels.

A job process (the watchdog's "worker") is forked warm by its device's zygote, takes exactly
one job and exits. The watchdog announces it with WorkerStarted and hands over the front end's
end of its channel (a socketpair; the process holds the other end as descriptor 3), so there is
no socket anyone could connect to and no token to steal. The process speaks first: a Hello when
it is warm. Then it is ready; it gets one AssignJob, sends phases, progress and logs for that
job and one JobOutcome, and exits. It never gets a second job.

Whatever else it sends breaks the protocol: a frame over framing.MAX_FRAME, bytes that are not
a JobProcessMessage, anything before its Hello or a second Hello, a frame naming a job it was
not given, anything after its outcome. The channel stops reading and tells the handler
(on_protocol_violation), which has the process killed and ends its job with a verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_pb2

from kerneleval_server.framing import MAX_FRAME, FrameError, encode, read_frame

log = logging.getLogger("kerneleval.job_processes")

# What one job process may send over its channel in all: its logs (of which the store keeps
# max_log_bytes), progress, and an outcome of at most one frame. A flood past it is hostile.
CHANNEL_BUDGET = 64 << 20


@dataclass
class JobProcess:
    """One job process, from WorkerStarted to WorkerExited."""

    worker_id: str
    pid: int
    device_index: int
    spare: bool
    start_time_ms: int
    writer: asyncio.StreamWriter | None = None
    job_id: str = ""  # the job it runs now ("" before it has one and after its outcome)
    assigned_job_id: str = ""  # the job it was given last
    build_job: bool = False  # that job is a build job (AssignJob.build_only)
    # A launch process: every job it was given came prebuilt, and each outcome said it may take
    # another (JobOutcome.reusable). `reusable` holds between such an outcome and the next job.
    launches: int = 0
    reusable: bool = False
    # A standing judge: it judged a job and said it may judge another, only of a job with
    # the same reference (jobs/judging.py `reference_key`). It takes no other job.
    judge_key: str = ""
    # A standing judge given its job ahead (JudgeRequest.ahead): that job, until its next.
    # Until the JudgeGo its frames are not its job's (jobs/judging.py, judge ahead).
    ahead_job: str = ""
    prepared_job: str = ""  # the job it said JudgePrepared for: it waits for that JudgeGo
    # Its next check was asked for before it says so (GpuUse.ask_early; a judge ahead's, with
    # its job): its PHASE_VALIDATING asks nothing more. The process's, not a job's: a judge's
    # frame ahead read after its go is the job's, and must not ask a second time.
    check_asked: bool = False
    idle_since: float = 0.0  # loop time it last became reusable
    completed: int = 0
    # Its job was let use the GPU (a check or timing): it holds GPU memory until it exits (a
    # launch process: until it cleaned up). A job still compiling holds next to none.
    used_gpu: bool = False
    gone: bool = False  # finished its job, killed, disconnected or exited: takes no job
    hello: job_channel_pb2.Hello | None = None
    outcome_seen: bool = False
    has_channel: bool = False  # its channel's descriptor arrived and is being read
    # Its WorkerExited, held until its channel is read to the end (the outcome it sent just
    # before exiting may still be in there): the control channel and the job channel race.
    pending_exit: watchdog_pb2.WorkerExited | None = None
    pending_exit_timer: asyncio.TimerHandle | None = None
    exit_watch: asyncio.TimerHandle | None = None  # kills it if it outstays its end (jobs.py)

    @property
    def connected(self) -> bool:
        """Warm (said hello), channel open, not on its way out."""
        return self.hello is not None and self.writer is not None and not self.gone

    @property
    def ready(self) -> bool:
        """Takes a job now: warm, not a spare, never given one (or a launch process between
        jobs)."""
        return (
            self.connected
            and not self.spare
            and not self.job_id
            and (not self.assigned_job_id or self.reusable)
        )

    def send(self, msg: job_channel_pb2.FrontendMessage) -> bool:
        """Queues a frame; False when the channel is closed. FrameError when it is too big."""
        frame = encode(msg.SerializeToString())
        if self.writer is None or self.writer.is_closing():
            return False
        self.writer.write(frame)
        return True

    def assign(
        self,
        job_id: str,
        spec: kernel_pb2.JobSpec,
        attempt: int,
        compile_cache: Sequence[job_channel_pb2.CacheFile] = (),
        *,
        build_arch: str = "",
        prebuilt: Sequence[job_channel_pb2.KernelArtifact] = (),
        extension: job_channel_pb2.ExtensionCall | None = None,
        record_fd: int = -1,
        record_max_bytes: int = 0,
        judge: job_channel_pb2.JudgeRequest | None = None,
        share_fd: int = -1,
        share_max_bytes: int = 0,
        timed_by_judge: bool = False,
    ) -> bool:
        """Sends the process a job: its one job, a build job (`build_arch`: build for it), or
        a job of prebuilt kernels. FrameError (nothing sent, nothing changed) when the job does
        not fit in a frame; False when the channel is closed. The compile cache's files go
        with it only where the frame has room for them. A judged job's record (`record_fd`)
        and the record's socket (`share_fd`, with `share_max_bytes`) ride on the frame."""
        if self.assigned_job_id and not self.reusable:
            raise RuntimeError(f"job process {self.worker_id} already ran {self.assigned_job_id}")
        if self.hello is None:  # not warm yet: a window may still let it run (--freeze-warming)
            raise RuntimeError(f"job process {self.worker_id} has not said it is warm")
        assign = job_channel_pb2.AssignJob(
            job_id=job_id,
            spec=spec,
            attempt=attempt,
            build_only=bool(build_arch) or extension is not None,
            build_arch=build_arch,
            prebuilt=prebuilt,
            extension=extension,
            record_max_bytes=record_max_bytes,
            judge=judge,
        )
        fds = [fd for fd in (record_fd, share_fd) if fd >= 0] if record_fd >= 0 else []
        assign.fd_count = len(fds)
        if share_fd >= 0 and record_fd >= 0:
            assign.share_max_bytes = share_max_bytes
            assign.timed_by_judge = timed_by_judge
        msg = job_channel_pb2.FrontendMessage(assign=assign)
        if compile_cache:
            with_cache = job_channel_pb2.FrontendMessage()
            with_cache.CopyFrom(msg)
            with_cache.assign.compile_cache.extend(compile_cache)
            if with_cache.ByteSize() <= MAX_FRAME:
                msg = with_cache
        frame = encode(msg.SerializeToString())
        self.assigned_job_id = self.job_id = job_id
        self.ahead_job = job_id if judge is not None and judge.ahead else ""
        self.prepared_job = ""  # an attempt before may have had the same job id
        self.check_asked = False
        self.build_job = assign.build_only
        self.reusable = self.outcome_seen = False
        if self.writer is None or self.writer.is_closing():
            return False
        if fds:
            return self._send_with_fds(frame, fds)
        self.writer.write(frame)
        return True

    def _send_with_fds(self, frame: bytes, fds: list[int]) -> bool:
        """The frame with `fds` on its first bytes (SCM_RIGHTS), which asyncio's writer cannot
        send: straight on the socket, when nothing written before is still buffered (a fresh
        process has had only its Welcome); the rest of the frame through the writer. False
        when it cannot go now: the process is then given up, and its job runs again."""
        assert self.writer is not None
        transport = self.writer.transport
        if transport.get_write_buffer_size():
            return False
        raw = transport.get_extra_info("socket")
        dup = socket.socket(fileno=os.dup(raw.fileno()))
        try:
            sent = socket.send_fds(dup, [frame], fds)
        except OSError:  # BlockingIOError: the socket's buffer is full
            return False
        finally:
            dup.close()
        if sent < len(frame):
            self.writer.write(frame[sent:])
        return True


class JobProcessHandler(Protocol):
    def on_process_ready(self, proc: JobProcess) -> None: ...
    def on_process_message(
        self, proc: JobProcess, msg: job_channel_pb2.JobProcessMessage
    ) -> None: ...
    def on_process_disconnected(self, proc: JobProcess) -> None: ...
    def on_protocol_violation(self, proc: JobProcess, what: str) -> None: ...


class JobProcessTable:
    """Job processes the watchdog announced and that have not exited, by id."""

    def __init__(self) -> None:
        self.by_id: dict[str, JobProcess] = {}

    def announce(self, w: watchdog_pb2.Worker) -> JobProcess:
        state = self.by_id.get(w.worker_id)
        if state is None:
            state = JobProcess(
                worker_id=w.worker_id,
                pid=w.pid,
                device_index=w.device_index,
                spare=w.spare,
                start_time_ms=w.start_time_ms,
            )
            self.by_id[w.worker_id] = state
        else:
            state.pid, state.spare = w.pid, w.spare
        return state

    def remove(self, worker_id: str) -> JobProcess | None:
        return self.by_id.pop(worker_id, None)

    def on_device(self, device_index: int) -> list[JobProcess]:
        return [w for w in self.by_id.values() if w.device_index == device_index]


def _short(text: str, limit: int = 64) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


_PHASES = frozenset(job_pb2.Phase.values())
_VERDICTS = frozenset(job_pb2.Verdict.values())
_TIMING_SOURCES = frozenset(job_pb2.TimingSource.values())


def _unknown_enum(msg: job_channel_pb2.JobProcessMessage) -> str:
    """An enum value the front end has no name for (it would reach logs, the store and
    GetStats, which name every value)."""
    kind = msg.WhichOneof("kind")
    phase = msg.phase.phase if kind == "phase" else msg.progress.phase if kind == "progress" else 0
    if phase not in _PHASES:
        return f"a {kind} frame with the unknown phase {phase}"
    if kind in ("outcome", "build"):
        result = msg.outcome.result if kind == "outcome" else msg.build.result
        if result.verdict not in _VERDICTS:
            return f"an outcome with the unknown verdict {result.verdict}"
        if result.verdict == job_pb2.VERDICT_REJECTED:
            return "an outcome with VERDICT_REJECTED, which only the front end gives"
        for stats in (result.runtime, result.reference_runtime, result.compiled_reference_runtime):
            if stats.source not in _TIMING_SOURCES:
                return f"an outcome with the unknown timing source {stats.source}"
    return ""


def check_frame(proc: JobProcess, msg: job_channel_pb2.JobProcessMessage) -> str:
    """What is wrong with this frame from this process; "" when nothing is."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return "a frame with no message in it"
    if proc.outcome_seen:
        return f"a {kind} frame after its job's outcome"
    if kind == "hello":
        return "a second Hello" if proc.hello is not None else ""
    if proc.hello is None:
        return f"a {kind} frame before its Hello"
    job_id = getattr(msg, kind).job_id
    unknown = _unknown_enum(msg)
    if unknown:
        return unknown
    if not proc.assigned_job_id:
        return f"a {kind} frame for job {_short(job_id)} before it was given a job"
    if job_id != proc.assigned_job_id:
        return f"a {kind} frame for job {_short(job_id)}; it was given job {proc.assigned_job_id}"
    if kind == "build" and not proc.build_job:
        return "a build outcome for a job that was not a build job"
    if kind == "outcome" and proc.build_job:
        return "a job outcome for a build job"
    if kind == "extension" and proc.build_job:
        return "an extension request from a build process"
    if kind == "judge_prepared" and proc.ahead_job != job_id:
        return "a JudgePrepared for a job it was not given ahead"
    return ""


class JobChannels:
    """The channels of the live job processes, one reading task each."""

    def __init__(
        self,
        handler: JobProcessHandler,
        mark_warm: Callable[[JobProcess], Awaitable[bool]] | None = None,
    ) -> None:
        """`mark_warm`: awaited on a process's Hello before it counts as warm (takes jobs);
        False: it never does (the watchdog lost it)."""
        self._handler = handler
        self._mark_warm = mark_warm
        self._tasks: set[asyncio.Task[None]] = set()

    def attach(self, proc: JobProcess, fd: int) -> None:
        """Owns `fd` (the front end's end of the process's socketpair) from now on."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            raise
        proc.has_channel = True
        task = asyncio.get_running_loop().create_task(self._serve(proc, sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _serve(self, proc: JobProcess, sock: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock)
        except OSError as exc:
            sock.close()
            log.warning("job process channel: %s", exc, extra={"worker_id": proc.worker_id})
            proc.gone = True
            self._handler.on_process_disconnected(proc)
            return
        proc.writer = writer
        violation = ""
        try:
            violation = await self._read(proc, reader)
        except (ConnectionError, OSError) as exc:
            log.info("job process channel: %s", exc, extra={"worker_id": proc.worker_id})
        finally:
            proc.writer = None
            writer.close()
            if violation:
                log.warning(
                    "job process broke the protocol: %s",
                    violation,
                    extra={"worker_id": proc.worker_id},
                )
                proc.gone = True
                self._handler.on_protocol_violation(proc, f"the job process sent {violation}")
            self._handler.on_process_disconnected(proc)

    async def _read(self, proc: JobProcess, reader: asyncio.StreamReader) -> str:
        """Reads until the end of the channel; returns what broke the protocol, if anything."""
        total = 0
        while True:
            try:
                frame = await read_frame(reader)
            except FrameError as exc:
                text = str(exc)
                if reader.at_eof() and " over " not in text:
                    return ""  # it died in the middle of a frame: its exit says why
                return f"a bad frame ({text})"
            if frame is None:
                return ""
            total += len(frame)
            if total > CHANNEL_BUDGET:
                return f"more than {CHANNEL_BUDGET >> 20} MiB on its channel"
            try:
                msg = job_channel_pb2.JobProcessMessage.FromString(frame)
            except DecodeError:
                return f"{len(frame)} bytes that are not a JobProcessMessage"
            what = check_frame(proc, msg)
            if what:
                return what
            kind = msg.WhichOneof("kind")
            if kind == "hello":
                if self._mark_warm is not None and not await self._mark_warm(proc):
                    continue  # never warm: its exit, on its way, ends it
                proc.hello = msg.hello
                self._handler.on_process_ready(proc)
                continue
            if kind in ("outcome", "build"):
                proc.outcome_seen = True
            self._handler.on_process_message(proc, msg)
