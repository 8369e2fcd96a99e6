"""The worker process: `python -m kerneleval_server.worker`, started by the watchdog.

It configures the process before torch and triton load (TRITON_INTERPRET=1 without a GPU),
imports them so that a job starts warm, connects to the front end's unix socket, says hello
with its token, then runs jobs one at a time: phases, progress and logs stream out as they
happen, the result goes out at the end. If the engine says the CUDA context is poisoned, the
worker exits with POISONED_EXIT after the result so that the watchdog replaces it.
"""

from __future__ import annotations

import importlib
import os
import queue
import shutil
import socket
import sys
import threading
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

POISONED_EXIT = 3
PROTOCOL_EXIT = 4


def _configure_environment(engine_name: str) -> None:
    """Settings that must be in place before torch/triton are imported."""
    try:
        engine = importlib.import_module(engine_name)
        configure = getattr(engine, "configure_process_environment", None)
    except ImportError:
        configure = None
    if configure is not None:
        configure()
        return
    if not os.environ.get("CUDA_VISIBLE_DEVICES") or not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _preimport() -> dict[str, str]:
    versions = {}
    for name in ("torch", "triton"):
        try:
            mod = importlib.import_module(name)
            versions[name] = str(getattr(mod, "__version__", ""))
        except Exception:  # noqa: BLE001 - a missing backend only limits what can run
            versions[name] = ""
    return versions


def _warm_cuda() -> None:
    """Create the CUDA context now (~0.4 s), so that a promoted spare starts its first job warm."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return
    try:
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the first job reports what is wrong
        print(f"kerneleval worker: CUDA warm-up failed: {exc}", file=sys.stderr)


class _Channel:
    """The socket to the front end: one writer lock, one reader thread."""

    def __init__(self, sock: socket.socket) -> None:
        from kerneleval.internal.v1 import worker_pb2

        self._pb = worker_pb2
        self._sock = sock
        self._lock = threading.Lock()
        self.jobs: queue.Queue[Any] = queue.Queue()
        self._grants: dict[str, threading.Event] = {}
        self._grants_lock = threading.Lock()
        self.closed = threading.Event()

    def send(self, msg: Any) -> None:
        from .framing import encode

        data = encode(msg.SerializeToString())
        with self._lock:
            self._sock.sendall(data)

    def grant_event(self, job_id: str) -> threading.Event:
        with self._grants_lock:
            return self._grants.setdefault(job_id, threading.Event())

    def drop_grant(self, job_id: str) -> None:
        with self._grants_lock:
            self._grants.pop(job_id, None)

    def read_loop(self) -> None:
        from .framing import FrameError, recv_frame

        try:
            while True:
                frame = recv_frame(self._sock)
                if frame is None:
                    break
                msg = self._pb.FrontendMessage.FromString(frame)
                kind = msg.WhichOneof("kind")
                if kind == "assign":
                    self.jobs.put(msg.assign)
                elif kind == "grant":
                    self.grant_event(msg.grant.job_id).set()
        except (OSError, FrameError):
            pass
        self.closed.set()
        self.jobs.put(None)
        with self._grants_lock:
            for event in self._grants.values():
                event.set()


class _Reporter:
    """The engine's Reporter: frames to the front end; phase(PROFILING) waits for the grant."""

    def __init__(self, channel: _Channel, job_id: str) -> None:
        from kerneleval.internal.v1 import worker_pb2
        from kerneleval.v1 import job_pb2

        self._pb = worker_pb2
        self._profiling = job_pb2.PHASE_PROFILING
        self._channel = channel
        self._job_id = job_id
        self._granted = False

    def phase(self, phase: int) -> None:
        wait = phase == self._profiling and not self._granted
        event = self._channel.grant_event(self._job_id) if wait else None
        self._channel.send(
            self._pb.WorkerMessage(
                phase=self._pb.PhaseUpdate(
                    job_id=self._job_id,
                    phase=phase,  # type: ignore[arg-type]
                )
            )
        )
        if event is not None:
            event.wait()
            self._granted = True

    def progress(self, phase: int, done: int, total: int) -> None:
        self._channel.send(
            self._pb.WorkerMessage(
                progress=self._pb.ProgressUpdate(
                    job_id=self._job_id,
                    phase=phase,  # type: ignore[arg-type]
                    done_count=done,
                    total_count=total,
                )
            )
        )

    def log(self, text: str) -> None:
        self._channel.send(
            self._pb.WorkerMessage(log=self._pb.LogLine(job_id=self._job_id, text=text[:65536]))
        )


def _device_info(device_index: int, versions: dict[str, str]) -> Any:
    from kerneleval.v1 import job_pb2

    info = job_pb2.DeviceInfo(
        index=device_index,
        torch_version=versions.get("torch", ""),
        triton_version=versions.get("triton", ""),
    )
    info.name = "cpu"
    if device_index >= 0 and "torch" in sys.modules:
        torch: Any = sys.modules["torch"]
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                info.name = props.name
                info.compute_capability = f"{props.major}.{props.minor}"
                info.cuda_version = torch.version.cuda or ""
        except Exception:  # noqa: BLE001 - the engine reports device problems per job
            pass
    return info


def _run_one(engine: ModuleType, channel: _Channel, assign: Any, work_dir: Path) -> bool:
    """Runs one job; returns whether the context is poisoned."""
    from kerneleval.internal.v1 import worker_pb2
    from kerneleval.v1 import job_pb2

    reporter = _Reporter(channel, assign.job_id)
    job_dir = work_dir / assign.job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    try:
        config = engine.EngineConfig(work_dir=job_dir)
        outcome = engine.run_job(assign.spec, reporter, config)
        result, poisoned = outcome.result, bool(outcome.context_poisoned)
    except Exception as exc:  # noqa: BLE001 - the engine should not raise; report, not die
        result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
        result.error.message = f"engine error: {exc}"
        result.error.exception_type = type(exc).__name__
        result.error.traceback = traceback.format_exc()[-8000:]
        poisoned = False
    channel.drop_grant(assign.job_id)
    channel.send(
        worker_pb2.WorkerMessage(
            outcome=worker_pb2.JobOutcome(
                job_id=assign.job_id, result=result, context_poisoned=poisoned
            )
        )
    )
    if not poisoned:  # a poisoned worker exits now; the watchdog removes its folder
        shutil.rmtree(job_dir, ignore_errors=True)  # a long-lived worker runs thousands of jobs
    return poisoned


def main() -> int:
    engine_name = os.environ.get("KERNELEVAL_ENGINE") or "kerneleval_server.engine"
    _configure_environment(engine_name)
    versions = _preimport()
    engine = importlib.import_module(engine_name)
    _warm_cuda()

    from kerneleval.internal.v1 import worker_pb2

    from .framing import recv_frame

    worker_id = os.environ["KERNELEVAL_WORKER_ID"]
    device_index = int(os.environ.get("KERNELEVAL_DEVICE_INDEX", "-1"))
    work_dir = Path(os.environ.get("KERNELEVAL_WORKER_DIR") or os.environ.get("TMPDIR", "/tmp"))
    work_dir = work_dir / "jobs"
    work_dir.mkdir(parents=True, exist_ok=True)

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(os.environ["KERNELEVAL_FRONTEND_SOCKET"])
    channel = _Channel(sock)
    channel.send(
        worker_pb2.WorkerMessage(
            hello=worker_pb2.Hello(
                worker_id=worker_id,
                token=os.environ.get("KERNELEVAL_WORKER_TOKEN", ""),
                pid=os.getpid(),
                device_index=device_index,
                device=_device_info(device_index, versions),
            )
        )
    )
    welcome = recv_frame(sock)
    if welcome is None:
        print("kerneleval worker: the front end refused the hello", file=sys.stderr)
        return PROTOCOL_EXIT
    threading.Thread(target=channel.read_loop, name="frontend-reader", daemon=True).start()
    while True:
        assign = channel.jobs.get()
        if assign is None:  # the front end went away: nothing to report to
            return 0
        if _run_one(engine, channel, assign, work_dir):
            # A poisoned CUDA context can hang the normal teardown: leave at once.
            sock.close()
            sys.stderr.flush()
            os._exit(POISONED_EXIT)


if __name__ == "__main__":
    sys.exit(main())
