"""A job process's channel to the front end: descriptor 3 (docs/INTERNALS.md, "Job channel").

`_Channel` sends frames under one writer lock and reads the front end's in one thread:
AssignJobs queue for the job loop (runtime.py), a GpuGrant wakes the wait for that phase's
grant, a judge's JudgeGo and a load_inline call's ExtensionBuilt come back to the wait that
asked for them (`_Replies`). `_Reporter` is the engine's Reporter for one job on it: phases
(VALIDATING and PROFILING wait for their grant), progress, log lines. Apart from the job loop:
this is the protocol and its waits; runtime.py is what a job process does with them.
"""

from __future__ import annotations

import collections
import itertools
import os
import queue
import socket
import threading
from typing import Any

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.framing import FdFrameReader, FrameError, encode

from . import GATED_PHASES, MAX_LOG_LINE_BYTES, OK_EXIT, drain


def _truncate(text: str, limit: int = MAX_LOG_LINE_BYTES) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")


class _Replies:
    """Answers from the front end that the job waits for, by key (a load_inline call's
    ExtensionBuilt, a judge's JudgeGo): the reader thread puts each one, before or after its
    wait began; once the channel closed, every wait ends empty-handed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[object, tuple[threading.Event, list[Any]]] = {}
        self._closed = False

    def _slot(self, key: object) -> tuple[threading.Event, list[Any]]:
        with self._lock:
            slot = self._slots.setdefault(key, (threading.Event(), []))
            if self._closed:
                slot[0].set()
            return slot

    def put(self, key: object, answer: Any) -> None:
        event, got = self._slot(key)
        got.append(answer)
        event.set()

    def wait(self, key: object) -> Any:
        """The answer (None when the channel closed first)."""
        event, got = self._slot(key)
        event.wait()
        with self._lock:
            self._slots.pop(key, None)
        return got[0] if got else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for event, _ in self._slots.values():
                event.set()


def _grant_key(job_id: str, phase: int) -> str:
    """A grant's key in _Channel._grants (accept_next forgets a job's by the prefix)."""
    return f"{job_id}/{phase}"


class _Channel:
    """Descriptor 3: one writer lock, one reader thread. AssignJobs queue; the runtime takes
    a next one only when its process is reusable (the front end sends one only then)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._lock = threading.Lock()
        self.assigned: queue.Queue[job_channel_pb2.AssignJob | None] = queue.Queue()
        self._grants: dict[str, threading.Event] = {}  # "job id/phase" -> granted
        self._grants_lock = threading.Lock()
        # Jobs this process finished: a grant for one that comes late is dropped, not kept
        # for a job that never asks again (a process takes up to 500).
        self._ended: collections.deque[str] = collections.deque(maxlen=64)
        # load_inline calls the service builds (by ("extension", request id)) and a judge
        # started ahead's JudgeGo (by ("go", job id))
        self._replies = _Replies()
        self._requests = itertools.count(1)
        self.job_running = False
        self.finishing = False  # the outcome is on its way: a close now is not "gone"
        self.record_fds: dict[str, list[int]] = {}  # job id -> the descriptors its frame held

    def accept_next(self, done_job_id: str) -> None:
        """The job is over and the process stays: the next AssignJob is a new job. Only the
        finished job's grants are forgotten: the next job and its grant, asked for with it
        (GpuUse.ask_early), may have come in while this process cleaned up."""
        self.job_running = False
        self.finishing = False
        with self._grants_lock:
            self._ended.append(done_job_id)
            for key in [k for k in self._grants if k.startswith(done_job_id + "/")]:
                del self._grants[key]

    def send(self, msg: job_channel_pb2.JobProcessMessage) -> None:
        data = encode(msg.SerializeToString())
        with self._lock:
            self._sock.sendall(data)

    def grant_event(self, job_id: str, phase: int) -> threading.Event:
        with self._grants_lock:
            return self._grants.setdefault(_grant_key(job_id, phase), threading.Event())

    def _granted(self, job_id: str, phase: int) -> None:
        """A GpuGrant came in. One for a job this process has finished (it came late) is
        dropped: checked under the lock that accept_next ends a job under, so that it cannot
        slip in between and be kept."""
        with self._grants_lock:
            if job_id not in self._ended:
                self._grants.setdefault(_grant_key(job_id, phase), threading.Event()).set()

    def let_go(self, job_id: str, phase: int) -> None:
        """The phase's grant is used up: the next ask waits for a new one."""
        with self._grants_lock:
            self._grants.pop(_grant_key(job_id, phase), None)

    def wait_go(self, job_id: str) -> job_channel_pb2.JudgeGo | None:
        """A judge started ahead: its JudgeGo (None when the channel closed first)."""
        go: job_channel_pb2.JudgeGo | None = self._replies.wait(("go", job_id))
        return go

    def read_loop(self) -> None:
        reader = FdFrameReader(self._sock)
        try:
            while True:
                frame = reader.recv_frame()
                if frame is None:
                    break
                msg = job_channel_pb2.FrontendMessage.FromString(frame)
                kind = msg.WhichOneof("kind")
                if kind == "assign":  # the runtime takes the next once its job is over
                    # a judged job's record (and its socket) ride on its AssignJob (fd_count 0-2)
                    self.record_fds[msg.assign.job_id] = reader.take_fds(msg.assign.fd_count)
                    with self._grants_lock:  # the same job again (it runs again here)
                        if msg.assign.job_id in self._ended:
                            self._ended.remove(msg.assign.job_id)
                    self.assigned.put(msg.assign)
                elif kind == "grant":
                    self._granted(msg.grant.job_id, msg.grant.phase)
                elif kind == "judge_go":
                    self._replies.put(("go", msg.judge_go.job_id), msg.judge_go)
                elif kind == "extension":
                    self._replies.put(("extension", msg.extension.request_id), msg.extension)
                # A Welcome is ignored.
        except (OSError, FrameError, DecodeError):
            pass
        if self.job_running and not self.finishing:
            os._exit(OK_EXIT)  # the front end is gone mid-job: nobody to report to
        self.assigned.put(None)
        with self._grants_lock:
            for event in self._grants.values():
                event.set()
        self._replies.close()

    def build_extension(self, job_id: str, arguments_json: str) -> Any:
        """Asks the service to build a load_inline call; waits for its ExtensionBuilt (None
        when the channel closed)."""
        request_id = next(self._requests)
        call = job_channel_pb2.ExtensionCall(arguments_json=arguments_json)
        self.send(
            job_channel_pb2.JobProcessMessage(
                extension=job_channel_pb2.ExtensionRequest(
                    job_id=job_id, request_id=request_id, call=call
                )
            )
        )
        return self._replies.wait(("extension", request_id))


class _Reporter:
    """The engine's Reporter: frames to the front end; phase(VALIDATING) and phase(PROFILING)
    wait for that phase's grant."""

    def __init__(self, channel: _Channel, job_id: str) -> None:
        self._channel = channel
        self._job_id = job_id
        self._granted: set[int] = set()
        self.window_drain: tuple[float, bool] = (0.0, False)  # (seconds, drained)

    def phase(self, phase: int) -> None:
        wait = phase in GATED_PHASES and phase not in self._granted
        event = self._channel.grant_event(self._job_id, phase) if wait else None
        self._channel.send(
            job_channel_pb2.JobProcessMessage(
                phase=job_channel_pb2.PhaseUpdate(job_id=self._job_id, phase=phase)  # type: ignore[arg-type]
            )
        )
        if event is not None:
            event.wait()
            self._granted.add(phase)
            if phase == job_pb2.PHASE_PROFILING:
                self.window_drain = drain.wait_for_idle_gpu(on_busy=self.drain_status)

    def ask_ahead(self, phase: int) -> None:
        """Asks for PHASE_VALIDATING's grant before entering it (PhaseUpdate.ahead: the
        front end takes no other phase ahead); phase() then waits for that grant."""
        if phase != job_pb2.PHASE_VALIDATING or phase in self._granted:
            return
        self._channel.grant_event(self._job_id, phase)
        self._channel.send(
            job_channel_pb2.JobProcessMessage(
                phase=job_channel_pb2.PhaseUpdate(job_id=self._job_id, phase=phase, ahead=True)  # type: ignore[arg-type]
            )
        )

    def drive_kernel(self) -> None:
        """A judge about to drive its kernel's timed calls: a new grant of its timing
        window, in which the kernel's process runs too (PhaseUpdate.drives_kernel). No drain:
        the work left on the GPU can only be that process's, and slows only its own calls."""
        phase = job_pb2.PHASE_PROFILING
        self._granted.discard(phase)
        self._channel.let_go(self._job_id, phase)
        event = self._channel.grant_event(self._job_id, phase)
        update = job_channel_pb2.PhaseUpdate(job_id=self._job_id, phase=phase, drives_kernel=True)
        self._channel.send(job_channel_pb2.JobProcessMessage(phase=update))
        event.wait()
        self._granted.add(phase)

    def let_go(self, phase: int) -> None:
        """The GPU's grant for the phase is given back (the front end was told): the next
        phase(phase) waits for a new one."""
        self._granted.discard(phase)
        self._channel.let_go(self._job_id, phase)

    def drain_status(self, busy: bool) -> None:
        """DrainStatus: the GPU stays busy at the start of the window (or no longer)."""
        self._channel.send(
            job_channel_pb2.JobProcessMessage(
                drain=job_channel_pb2.DrainStatus(job_id=self._job_id, busy=busy)
            )
        )

    def progress(self, phase: int, done: int, total: int) -> None:
        self._channel.send(
            job_channel_pb2.JobProcessMessage(
                progress=job_channel_pb2.ProgressUpdate(
                    job_id=self._job_id,
                    phase=phase,  # type: ignore[arg-type]
                    done_count=done,
                    total_count=total,
                )
            )
        )

    def log(self, text: str) -> None:
        self._channel.send(
            job_channel_pb2.JobProcessMessage(
                log=job_channel_pb2.LogLine(job_id=self._job_id, text=_truncate(text))
            )
        )
