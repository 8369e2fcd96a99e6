"""The front end's side of the worker channel: a unix socket server and the worker table.

The watchdog tells the front end about each worker (WorkerStarted, with its token); the worker
then connects, says hello with that token, and is ready for jobs. A wrong token, or an id the
watchdog never announced, closes the connection. The socket lives in a fresh folder that
others may traverse (mode 0711) and is itself 0666: workers run as an unprivileged user when
the service runs as root, and the per-worker token is what protects the channel.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kerneleval.internal.v1 import supervisor_pb2, worker_pb2

from .framing import FrameError, encode, read_frame

log = logging.getLogger("kerneleval.workers")

HELLO_TIMEOUT_S = 30.0  # a worker that connects but says nothing
ANNOUNCE_WAIT_S = 10.0  # a hello that beats the watchdog's WorkerStarted


@dataclass
class WorkerState:
    worker_id: str
    pid: int
    device_index: int
    token: str
    spare: bool
    start_time_ms: int
    writer: asyncio.StreamWriter | None = None
    job_id: str = ""
    completed: int = 0
    gone: bool = False  # exited, poisoned or disconnected: takes no more jobs
    hello: worker_pb2.Hello | None = None
    announced: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def connected(self) -> bool:
        return self.writer is not None and not self.gone

    @property
    def ready(self) -> bool:
        """Takes a job now."""
        return self.connected and not self.spare and not self.job_id

    def send(self, msg: worker_pb2.FrontendMessage) -> bool:
        if self.writer is None or self.writer.is_closing():
            return False
        self.writer.write(encode(msg.SerializeToString()))
        return True


class WorkerHandler(Protocol):
    def on_worker_ready(self, worker: WorkerState) -> None: ...
    def on_worker_message(self, worker: WorkerState, msg: worker_pb2.WorkerMessage) -> None: ...
    def on_worker_disconnected(self, worker: WorkerState) -> None: ...


class WorkerTable:
    """Workers the watchdog announced, by id."""

    def __init__(self) -> None:
        self.by_id: dict[str, WorkerState] = {}

    def announce(self, w: supervisor_pb2.Worker) -> WorkerState:
        state = self.by_id.get(w.worker_id)
        if state is None:
            state = WorkerState(
                worker_id=w.worker_id,
                pid=w.pid,
                device_index=w.device_index,
                token=w.token,
                spare=w.spare,
                start_time_ms=w.start_time_ms,
            )
            self.by_id[w.worker_id] = state
        else:
            state.pid, state.token, state.spare = w.pid, w.token, w.spare
        state.announced.set()
        return state

    def remove(self, worker_id: str) -> WorkerState | None:
        return self.by_id.pop(worker_id, None)

    def on_device(self, device_index: int) -> list[WorkerState]:
        return [w for w in self.by_id.values() if w.device_index == device_index]


class WorkerChannel:
    def __init__(self, table: WorkerTable, handler: WorkerHandler) -> None:
        self._table = table
        self._handler = handler
        self._dir = Path(tempfile.mkdtemp(prefix="kerneleval-"))
        os.chmod(self._dir, 0o711)
        self.socket_path = str(self._dir / "frontend.sock")
        self.runtime_dir = self._dir
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.socket_path)
        os.chmod(self.socket_path, 0o666)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        worker: WorkerState | None = None
        try:
            worker = await self._handshake(reader, writer)
            if worker is None:
                return
            self._handler.on_worker_ready(worker)
            while True:
                frame = await read_frame(reader)
                if frame is None:
                    break
                self._handler.on_worker_message(worker, worker_pb2.WorkerMessage.FromString(frame))
        except (FrameError, ConnectionError, asyncio.TimeoutError) as exc:
            log.warning("worker channel error: %s", exc)
        except asyncio.CancelledError:
            pass
        finally:
            if worker is not None and worker.writer is writer:
                worker.writer = None
                self._handler.on_worker_disconnected(worker)
            writer.close()
            if task is not None:
                self._tasks.discard(task)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> WorkerState | None:
        frame = await asyncio.wait_for(read_frame(reader), HELLO_TIMEOUT_S)
        if frame is None:
            return None
        msg = worker_pb2.WorkerMessage.FromString(frame)
        if msg.WhichOneof("kind") != "hello":
            log.warning("worker channel: first frame is not a hello")
            return None
        hello = msg.hello
        worker = self._table.by_id.get(hello.worker_id)
        if worker is None:
            # The worker may have finished importing before its WorkerStarted was handled.
            deadline = asyncio.get_running_loop().time() + ANNOUNCE_WAIT_S
            while worker is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
                worker = self._table.by_id.get(hello.worker_id)
        if (
            worker is None
            or not worker.token
            or not hmac.compare_digest(worker.token.encode(), hello.token.encode())
        ):
            log.warning(
                "worker channel: refused hello (unknown worker or wrong token)",
                extra={"worker_id": hello.worker_id},
            )
            return None
        if worker.gone:
            return None
        worker.hello = hello
        worker.writer = writer
        worker.send(
            worker_pb2.FrontendMessage(welcome=worker_pb2.Welcome(worker_id=worker.worker_id))
        )
        log.info("worker connected", extra={"worker_id": worker.worker_id})
        return worker
