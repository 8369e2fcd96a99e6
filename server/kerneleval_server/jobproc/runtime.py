"""The job process's runtime: jobs through the engine, over the channel on descriptor 3.

`main(channel_fd)` is the default KERNELEVAL_JOB_MAIN. It runs after the zygote's child has
sandboxed the process (docs/INTERNALS.md, "Processes"; docs/TRUST.md, "The sandbox"):

    Hello (device info, pid) -> AssignJob -> phases / progress / logs -> JobOutcome -> exit
    a build process:            AssignJob(build_only) -> BuildOutcome -> exit
    a launch process:           AssignJob(prebuilt) -> ... -> JobOutcome(reusable) -> AssignJob ...
    a judge:                    AssignJob(judge) -> ... -> JobOutcome(reusable) -> AssignJob ...

A job whose code runs on the host (a Model, a Triton module's top level, an extension) is the
process's only one. A job whose every kernel came prebuilt from a build process runs none of
its code here, so the process may take another such job once it has cleaned up (`reusable`).
A judge ran only a job's reference: it may judge another job once it has cleaned up, and the
front end gives it only jobs with that same reference (jobs/judging.py, a standing judge).
It never waits for a Welcome (one is ignored), reads the next AssignJob only once the job before
is over and the process clean, waits for a grant after sending PHASE_VALIDATING or
PHASE_PROFILING, and returns POISONED_EXIT when the
engine says the CUDA context is poisoned, 0 otherwise. If the channel closes before a job, or
while one runs, the front end is gone: it exits 0.

`load_engine()` and `warm_up()` are the steps before that: the zygote calls `load_engine()` once
(the environment is configured before torch and triton are imported, and no CUDA context is
made: the zygote forks), and each job process calls `warm_up()` before its privileges drop
(CUDA context, a cuBLAS matmul, one tiny Triton kernel; only when a GPU is visible).

Standalone (tests, debugging): python -m kerneleval_server.jobproc.runtime [FD]
"""

# No `from __future__ import annotations`: the Triton warm-up kernel's `tl.constexpr`
# annotation must be a real object when Triton reads it.

import collections
import contextlib
import functools
import gc
import importlib
import itertools
import json
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2

from kerneleval_server.framing import FdFrameReader, FrameError, encode

from . import (
    BUILD_DEVICE,
    DEFAULT_ENGINE,
    DEVICE_INDEX_ENV,
    ENGINE_ENV,
    GATED_PHASES,
    MAX_JOBS_PER_LAUNCH_PROCESS,
    MAX_LOG_LINE_BYTES,
    OK_EXIT,
    PCH_DIR_ENV,
    POISONED_EXIT,
    TRITON_BINARY_ONLY_ENV,
    TRITON_CACHE_ENV,
    WORKER_ID_ENV,
    drain,
    warm_job,
)
from . import MAX_CACHE_ENTRY_BYTES as MAX_ENTRY_BYTES
from . import MAX_CACHE_FILES as MAX_FILES

NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"
MAX_LIBRARY_BYTES = 12 << 20  # a built extension travels in one frame (framing.MAX_FRAME)
MAX_BUILD_LOG = 64 << 10


# ---- before the fork: the zygote's side ---------------------------------------------------------


def gpu_visible() -> bool:
    """A GPU may be used: CUDA_VISIBLE_DEVICES is not "" and the driver's node exists. Decided
    without CUDA, so that nothing initialises it in the zygote."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset") == "":
        return False
    return os.path.exists("/dev/nvidiactl")


def configure_environment(engine_name: str) -> dict[str, str]:
    """Settings that must be in place before torch and triton are imported, then the engine's
    own `configure_process_environment()`. Returns the variables this set (the zygote hands
    them on to its job processes, whose environment is otherwise job_env)."""
    before = dict(os.environ)
    # Decided here, from the device nodes, so that the engine's configuration does not ask
    # torch.cuda.is_available(): that initialises the CUDA driver (even NVML-based), and the
    # zygote forks. "0" is Triton's "off".
    # Build processes compile for a GPU they do not have: never Triton's interpreter there.
    compiles = gpu_visible() or os.environ.get(DEVICE_INDEX_ENV) == str(BUILD_DEVICE)
    os.environ.setdefault("TRITON_INTERPRET", "0" if compiles else "1")
    # Triton keeps a kernel's binary and metadata only, not its IRs (ttir, ttgir, llir, ptx):
    # a later job with the same code gets fewer files written into its compile cache, and its
    # first call reads fewer (Triton reads every file of a cached kernel; H100: seeding 0.5
    # ms, that read 0.9 ms of a ModelNew's first call). Entries fit MAX_ENTRY_BYTES sooner.
    os.environ.setdefault(TRITON_BINARY_ONLY_ENV, "1")
    # Should anything still ask, NVML answers instead of CUDA. Only the zygote's setting.
    os.environ.setdefault(NVML_CHECK_ENV, "1")
    engine = importlib.import_module(engine_name)
    configure = getattr(engine, "configure_process_environment", None)
    if configure is not None:
        configure()
    configured = {k: v for k, v in os.environ.items() if before.get(k) != v}
    configured.pop(NVML_CHECK_ENV, None)
    return configured


def library_versions() -> dict[str, str]:
    """torch and triton versions; "" for one that is missing (or not loaded by a light engine)."""
    versions = {}
    for name in ("torch", "triton"):
        module = sys.modules.get(name)
        versions[name] = str(getattr(module, "__version__", "")) if module is not None else ""
    return versions


# triton (the warm-up runs a kernel); torch's extension builder (load_inline, and the engine's
# extension folder for every ModelNew); what Triton's compiler imports on its first compile.
PREIMPORTED = (
    "triton",
    "torch.utils.cpp_extension",
    "triton.compiler.compiler",
    "triton.experimental.gluon.nvidia.hopper",
    "torch.utils._device",  # `with torch.device(...)`, around every get_inputs() call
)


def _hash_triton_once() -> None:
    """Triton keys its cache with a hash of its own files, libtriton included (about 1 s),
    computed once a process on its first kernel: computed here, every job process inherits
    it instead of paying it in its warm-up."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):  # newer, older Triton
        key = getattr(sys.modules.get(module) or _try_import(module), "triton_key", None)
        if callable(key):
            try:
                key()
            except Exception:  # noqa: BLE001 - only a head start; the warm-up computes it too
                pass
            return


def _try_import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def load_engine(engine_name: str | None = None) -> tuple[ModuleType, dict[str, str]]:
    """Configures the environment and imports the engine (KERNELEVAL_ENGINE, default
    kerneleval_server.engine, which imports torch and triton) without making a CUDA context.
    Returns the engine and the variables the configuration set."""
    name = engine_name or os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE
    configured = configure_environment(name)
    engine = importlib.import_module(name)
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        # Modules jobs import on first use (measured: ~70 ms a job on the CPU machine), imported
        # once here so that every job process finds them loaded.
        # The service's engine imports its debug aids' module on a job's first call (not from
        # the package: `python -m ...engine.isolated` runs it as a script).
        extra = (f"{DEFAULT_ENGINE}.isolated",) if name == DEFAULT_ENGINE else ()
        for module in (*PREIMPORTED, *extra):
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        _hash_triton_once()
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"importing {name} created a CUDA context; the zygote cannot fork")
    if cuda_driver_threads():
        print(
            f"kerneleval zygote: importing {name} initialised the CUDA driver before the fork",
            file=sys.stderr,
        )
    return engine, configured


def cuda_driver_threads() -> list[str]:
    """Names of the CUDA driver's threads in this process (there are some once cuInit ran)."""
    names = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            if name.startswith("cuda"):
                names.append(name)
    except OSError:
        pass
    return names


def warm_up() -> None:
    """As root, before the drop, in a fresh job process: CUDA context, a cuBLAS matmul, one
    tiny Triton kernel and a tiny evaluation through the engine (warm_job.py), so that the job
    starts warm. Nothing without a visible GPU. Failures are printed; the job reports what is
    wrong with the device."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not gpu_visible():
        return
    try:
        with warnings.catch_warnings():  # "Can't initialize NVML" and the like: not the job's
            warnings.simplefilter("ignore")
            if not torch.cuda.is_available():
                return
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        if "triton" in sys.modules:
            _warm_triton(torch)
        engine = sys.modules.get(DEFAULT_ENGINE)
        if engine is not None and (os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE) == DEFAULT_ENGINE:
            result = warm_job.run(engine)  # the real engine only: a test engine has its own
            if result.verdict != job_pb2.VERDICT_OK:
                print(f"kerneleval job process: warm-up job: {result}", file=sys.stderr)
            # NVML's peak memory bandwidth (the faster_than_memory floor), asked once here:
            # not inside a job's timing window.
            integrity = sys.modules.get(DEFAULT_ENGINE + ".integrity")
            if integrity is not None:
                integrity.peak_bandwidth(0)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the job reports what is wrong
        print(f"kerneleval job process: warm-up failed: {exc!r}", file=sys.stderr)


def _warm_triton(torch: Any) -> None:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _kerneleval_warm_up(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    x = torch.zeros(16, device="cuda")
    _kerneleval_warm_up[(1,)](x, 16, BLOCK=16)


# ---- after the fork: one job ------------------------------------------------------------------


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


def device_info(device_index: int) -> job_pb2.DeviceInfo:
    versions = library_versions()
    info = job_pb2.DeviceInfo(
        index=device_index,
        torch_version=versions["torch"],
        triton_version=versions["triton"],
        name="cpu",
    )
    torch: Any = sys.modules.get("torch")
    if device_index >= 0 and torch is not None and gpu_visible():
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                info.name = props.name
                info.compute_capability = f"{props.major}.{props.minor}"
                info.cuda_version = torch.version.cuda or ""
        except Exception:  # noqa: BLE001 - the engine reports device problems per job
            pass
    return info


# ---- the compile cache: what earlier jobs with this code compiled (compile_cache.py) ----------


def _cache_parts(rel: str) -> list[str] | None:
    """The parts of a plain relative path (empty and "." parts dropped, as pathlib reads it);
    None for anything that could leave the folder, or name the folder itself."""
    if not rel or rel.startswith("/"):
        return None
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return parts


def seed_compile_cache(root: Path, files: Any) -> set[str]:
    """Writes the given files into the job's own (empty) compile cache; their paths. (On the
    way to the job's first phase: plain os calls, each folder made once.)"""
    base = str(root)
    made: set[str] = set()
    seeded: set[str] = set()
    for f in files:
        parts = _cache_parts(f.path)
        if parts is None:
            continue
        folder = os.path.join(base, *parts[:-1])
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        name = parts[-1]
        data = f.data
        if name.startswith("__grp__") and name.endswith(".json"):
            data = _regroup(base, data)
        _write_new(os.path.join(folder, name), data)
        seeded.add(f.path)
    return seeded


def _write_new(path: str, data: bytes) -> None:
    """A file's bytes, written with bare descriptors (no file object: ~5 files a job)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _regroup(base: str, data: bytes) -> bytes:
    """A Triton group file names its members by absolute path, in the cache folder of the job
    that compiled them: point them into this folder (<base>/<key>/<file>), or Triton misses
    its own cache and compiles again. A member named outside a <key>/<file> shape is dropped."""
    try:
        group = json.loads(data)
        children = group["child_paths"]
        kept = {}
        for name, p in children.items():
            if not isinstance(p, str):
                continue
            parts = [q for q in p.split("/") if q not in ("", ".")]
            if len(parts) >= 2 and ".." not in parts[-2:]:
                kept[name] = os.path.join(base, parts[-2], parts[-1])
        group["child_paths"] = kept
        return json.dumps(group).encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return data  # not a group file Triton would read: left to Triton to refuse


def _files_under(root: str) -> list[tuple[tuple[str, ...], str]]:
    """(path parts relative to root, full path) of every regular file under root, in path
    order; symbolic links are neither followed nor listed. OSError when a folder cannot be
    read."""
    found: list[tuple[tuple[str, ...], str]] = []
    folders: list[tuple[str, tuple[str, ...]]] = [(root, ())]
    while folders:
        folder, rel = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    continue
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, (*rel, entry.name)))
                elif entry.is_file(follow_symlinks=False):
                    found.append(((*rel, entry.name), entry.path))
    found.sort()
    return found


def compile_cache_added(root: Path, seeded: set[str]) -> list[job_channel_pb2.CacheFile]:
    """Files the job added to its compile cache, if they are few and small enough to send;
    nothing when the folder cannot be read (the job's code may have made it so)."""
    out: list[job_channel_pb2.CacheFile] = []
    total = 0
    try:
        for parts, full in _files_under(str(root)):
            rel = "/".join(parts)
            if rel in seeded or rel.startswith("tmp.") or "/tmp." in rel:  # Triton's temporaries
                continue
            with open(full, "rb") as f:
                data = f.read()
            total += len(data)
            if total > MAX_ENTRY_BYTES or len(out) >= MAX_FILES:
                return []  # too big to keep: the next job compiles again
            out.append(job_channel_pb2.CacheFile(path=rel, data=data))
    except OSError:
        return []
    return out


_ready_dirs: tuple[Path, Path] | None = None  # the next job's, made while the process waits


def make_job_dirs() -> None:
    """The next job's private folder and (empty) compile cache, made before it comes."""
    global _ready_dirs
    base = os.environ.get("TMPDIR") or "/tmp"
    job_dir = Path(tempfile.mkdtemp(prefix="job-", dir=base))
    cache_dir = Path(tempfile.mkdtemp(prefix="compile-cache-", dir=base))
    os.environ[TRITON_CACHE_ENV] = str(cache_dir)  # read by Triton when it compiles
    _ready_dirs = (job_dir, cache_dir)


def _job_dirs(assign: job_channel_pb2.AssignJob) -> tuple[Path, Path, set[str]]:
    """The job's private folder and compile cache (seeded with what the front end sent)."""
    global _ready_dirs
    if _ready_dirs is None:
        make_job_dirs()
    assert _ready_dirs is not None
    (job_dir, cache_dir), _ready_dirs = _ready_dirs, None
    return job_dir, cache_dir, seed_compile_cache(cache_dir, assign.compile_cache)


def _engine_error(exc: Exception) -> job_pb2.EvalResult:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.error.message = f"engine error: {exc}"
    result.error.exception_type = type(exc).__name__
    result.error.traceback = traceback.format_exc()[-8000:]
    return result


def _build_one(engine: ModuleType, channel: _Channel, assign: job_channel_pb2.AssignJob) -> None:
    """A build job: compile the spec's kernels for assign.build_arch, or the load_inline call
    in assign.extension; send BuildOutcome."""
    reporter = _Reporter(channel, assign.job_id)
    job_dir, cache_dir, _ = _job_dirs(assign)
    channel.job_running = True
    try:
        if assign.HasField("extension"):
            built = job_channel_pb2.BuildOutcome(
                extension=_build_extension(assign, job_dir, reporter)
            )
        else:
            # Sources the front end has built already (a raw CUDA reference): not built again.
            given = {"prebuilt": list(assign.prebuilt)} if assign.prebuilt else {}
            built = engine.build_job(
                assign.spec, reporter, engine.EngineConfig(work_dir=job_dir), assign.build_arch,
                **given,
            )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the engine should not raise; report, not die
        built = job_channel_pb2.BuildOutcome(result=_engine_error(exc))
    built.job_id = assign.job_id
    channel.finishing = True
    channel.send(job_channel_pb2.JobProcessMessage(build=built))


def _build_extension(
    assign: job_channel_pb2.AssignJob, job_dir: Path, reporter: "_Reporter"
) -> job_channel_pb2.ExtensionBuilt:
    """A load_inline call the service sent (fast_build/extension.py), with the service's
    precompiled headers (read-only here) when it made them."""
    from kerneleval_server.fast_build import extension

    pch = os.environ.get(PCH_DIR_ENV, "")
    started = time.monotonic()
    built = extension.build_answer(
        assign.extension.arguments_json,
        assign.build_arch,
        job_dir,
        Path(pch) if pch and os.path.isdir(pch) else None,
        lambda step: reporter.log(f"kerneleval build: {step} ({time.monotonic() - started:.1f} s)"),
        assign.extension.main_object,
    )
    answer = job_channel_pb2.ExtensionBuilt(
        job_id=assign.job_id,
        library=built.library,
        error=built.error,
        log=built.log[-MAX_BUILD_LOG:],
        fast=built.fast,
    )
    if len(built.main_object) <= MAX_LIBRARY_BYTES:
        answer.main_object = built.main_object
    if len(built.library) > MAX_LIBRARY_BYTES:
        answer.library = b""
        answer.error = f"the extension is {len(built.library)} bytes, over {MAX_LIBRARY_BYTES}"
    answer.build_time.FromNanoseconds(int(built.seconds * 1e9))
    return answer


def _launch_only(assign: job_channel_pb2.AssignJob, reference_judged: bool) -> bool:
    """Every source of the job that ran here came prebuilt: none of its code ran on this host
    (a reference not built ahead ran in its judge only)."""
    roles = {a.role for a in assign.prebuilt}
    spec = assign.spec
    return "kernel" in roles and (
        not spec.HasField("reference") or "reference" in roles or reference_judged
    )


def _clean_for_next_job() -> bool:
    """Hygiene before a launch process or a judge takes another job: nothing of the job left
    in Python, the GPU idle, every byte of device memory the job freed zeroed (a later kernel
    that reads out of its bounds must not find this job's inputs or outputs: with the same
    seed they are the next job's answers) and given back to the driver. Memory still
    allocated belongs to the process (cuBLAS's workspace, the engine's own buffers) and is
    left as it is. False when any of it fails: the process then exits."""
    gc.collect()
    torch = _cuda_in_use()
    if torch is None:
        return True
    try:
        torch.cuda.synchronize()
        zero = _device_memset()
        for segment in torch.cuda.memory_snapshot():
            address = segment["address"]
            for block in segment["blocks"]:  # in address order within the segment
                if block["state"] == "inactive" and zero(address, block["size"]) != 0:
                    return False
                address += block["size"]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - a GPU that fails here is not fit for the next job
        return False
    return True


def _cuda_in_use() -> Any:
    """torch, when this process has made its CUDA context; else None."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch


def _reset_peak_memory() -> None:
    torch = _cuda_in_use()
    if torch is not None:
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    """The most device memory torch's allocator held during the job (the front end learns
    from it what a problem's jobs need: fleet/gpu_memory.py)."""
    torch = _cuda_in_use()
    if torch is None:
        return 0
    try:
        # The nested form: max_memory_reserved() flattens every statistic first, ~0.5 ms of
        # each job's outcome on an H100.
        return int(torch.cuda.memory_stats_as_nested_dict()["reserved_bytes"]["all"]["peak"])
    except Exception:  # noqa: BLE001 - a failing context reports nothing
        return 0


@functools.cache
def _device_memset() -> Any:
    """cuMemsetD8 (the driver API: torch has no binding) on the current context; bound once
    a process."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuMemsetD8_v2
    fn.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
    return lambda address, size: fn(address, 0, size)


def _run_one(
    engine: ModuleType, channel: _Channel, assign: job_channel_pb2.AssignJob, last: bool
) -> tuple[bool, bool]:
    """Runs the job and sends its outcome. Returns (the CUDA context is poisoned, the process
    may take another job: it ran prebuilt kernels only, or judged, and cleaned up). `last`: it
    may not."""
    reporter = _Reporter(channel, assign.job_id)
    job_dir, cache_dir, seeded = _job_dirs(assign)
    channel.job_running = True
    prebuilt = list(assign.prebuilt)
    # The record (a memfd), and with share_max_bytes the record's socket (its outputs past the
    # record, by descriptor: engine/device_share.py).
    fds = channel.record_fds.pop(assign.job_id, [])
    record_fd = fds[0] if fds else -1
    share_fd = fds[1] if len(fds) > 1 and assign.share_max_bytes else -1
    judging = assign.HasField("judge") and record_fd >= 0
    recorder = None
    launch_only = False  # every source came prebuilt: the process may take another job
    outcome: Any = None
    try:
        config = engine.EngineConfig(work_dir=job_dir)
        if not prebuilt and hasattr(config, "extension_builder"):
            config.extension_builder = functools.partial(channel.build_extension, assign.job_id)
        if judging:
            # The reference is client code too, and its time must cost what the kernel's
            # does: the judge runs armed as well.
            _arm_tamper_checks()
            go = functools.partial(_judge_go, channel, reporter, assign.job_id)
            outcome = engine.judge_job(
                assign.spec, reporter, config, assign.judge.candidate, record_fd,
                assign.record_max_bytes, share_fd, assign.share_max_bytes,
                assign.judge.kernel_gone, _reference_time(assign.judge),
                go=go if assign.judge.ahead else None,
                **({"kernel_serves": True} if assign.judge.kernel_serves else {}),
                **({"kernel_must_serve": True} if assign.judge.kernel_timed_by_judge else {}),
                **({"path_measures": _path_measures(engine, assign.judge)}
                   if assign.judge.path_measures else {}),
            )  # fmt: skip
        else:
            if assign.record_max_bytes and record_fd >= 0:
                recorder = engine.Recorder(
                    record_fd, assign.record_max_bytes, share_fd, assign.share_max_bytes
                )
                config.recorder = recorder
                # A launch's reference, not built ahead (it has host code), runs only in
                # its judge: never in a process that takes job after job.
                config.reference_judged = bool(prebuilt)
                if hasattr(config, "timed_by_judge"):
                    config.timed_by_judge = assign.timed_by_judge and share_fd >= 0
            launch_only = _launch_only(assign, recorder is not None)
            if prebuilt and not launch_only:
                # Its reference's host code would run in a process that ran others' jobs.
                raise RuntimeError("a launch whose reference was not built came without a record")
            if prebuilt:
                outcome = engine.run_job(assign.spec, reporter, config, prebuilt=prebuilt)
            else:
                _arm_tamper_checks()  # job code is imported from here on
                outcome = engine.run_job(assign.spec, reporter, config)
        result, poisoned = outcome.result, bool(outcome.context_poisoned)
        peak = getattr(outcome, "peak_memory_bytes", 0) or (0 if poisoned else _peak_memory())
    except Exception as exc:  # noqa: BLE001 - the engine should not raise; report, not die
        result, poisoned, peak = _engine_error(exc), False, 0
    serve = getattr(outcome, "serve", None)
    serving = serve is not None and share_fd >= 0 and not poisoned and not judging
    for fd in fds:
        if not (serving and fd == share_fd):  # the record: closed, so that it can be sealed
            os.close(fd)
    shared = recorder.shared_bytes if recorder is not None else 0
    # Device memory outside torch's allocator: handed over (held until the process exits),
    # and a judge's timed-call buffers.
    peak += shared + getattr(outcome, "outside_allocator_bytes", 0)
    reusable = (
        not last
        and not poisoned
        and (judging or launch_only)
        and not result.HasField("error")  # a reference that failed or tampered: not again
    )
    channel.finishing = True
    added = compile_cache_added(cache_dir, seeded) if result.compiled and not poisoned else []
    outcome_msg = job_channel_pb2.JobOutcome(
        job_id=assign.job_id,
        result=result,
        context_poisoned=poisoned,
        compile_cache=added,
        window_drained=reporter.window_drain[1],
        reusable=reusable,
        peak_memory_bytes=peak,
        shared_bytes=shared,
        serves_timed_calls=serving,
        path_measures=[
            job_channel_pb2.PathMeasure(lead=m.lead, output_bytes=m.output_bytes, ns=m.ns)
            for m in getattr(outcome, "path_measures", ())
        ],
    )
    outcome_msg.window_drain.FromNanoseconds(int(reporter.window_drain[0] * 1e9))
    channel.send(job_channel_pb2.JobProcessMessage(outcome=outcome_msg))
    if serving:
        # Its judge drives the kernel's timed calls now (engine/timed_calls.py); then this
        # process exits as after any job.
        assert serve is not None
        try:
            serve(share_fd)
        except Exception:  # noqa: BLE001 - the judge sees the calls end, and says why
            pass
        finally:
            os.close(share_fd)
    # The result (and the GPU's timing window) does not wait for the cleanup; the next job
    # does: it is read only once the process is clean, and a failed cleanup ends the process
    # (a job given meanwhile runs again elsewhere: the exit is not its doing). The job's
    # folders go with a private /tmp, which goes with the process; without one, and before a
    # launch process's next job, they are removed here.
    if not poisoned:
        shutil.rmtree(job_dir, ignore_errors=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    if reusable and _clean_for_next_job():
        channel.accept_next(assign.job_id)
    else:
        reusable = False
    return poisoned, reusable


def _judge_go(
    channel: _Channel, reporter: _Reporter, job_id: str
) -> tuple[Any, bool, tuple[Any, float] | None, bool, bool] | None:
    """A judge started ahead has run the reference: it says so (the front end takes back its
    GPU grant: the kernel's timing must not wait for it) and waits for the kernel's report.
    Its grant is let go before it says so: the front end may ask for its next one as soon as
    it has read that (GpuUse.ask_early), and that grant may be in before this thread runs on."""
    reporter.let_go(job_pb2.PHASE_VALIDATING)
    channel.send(
        job_channel_pb2.JobProcessMessage(
            judge_prepared=job_channel_pb2.JudgePrepared(job_id=job_id)
        )
    )
    go = channel.wait_go(job_id)
    if go is None or go.abandon:
        return None
    r = go.request
    return r.candidate, r.kernel_gone, _reference_time(r), r.kernel_serves, r.kernel_timed_by_judge


def _path_measures(engine: ModuleType, judge: job_channel_pb2.JudgeRequest) -> list[Any]:
    """Earlier judges' measures of their own path, as the engine takes them."""
    make = engine.PathMeasure
    return [make(m.lead, tuple(m.output_bytes), m.ns) for m in judge.path_measures]


def _reference_time(judge: job_channel_pb2.JudgeRequest) -> tuple[Any, float] | None:
    """An earlier job's time of the reference, and its age, when the front end gave one."""
    if not judge.HasField("reference_runtime"):
        return None
    return judge.reference_runtime, judge.reference_runtime_age_s


def _arm_tamper_checks(prepare_only: bool = False) -> None:
    """Job code runs in this process from here on (engine/tamper.py): its refusals and the
    timing snapshot, for the rest of the process. Only the service's engine has them.
    `prepare_only`: the snapshot only, taken as the process starts (not on a job's path)."""
    tamper = sys.modules.get(f"{DEFAULT_ENGINE}.tamper")
    if tamper is not None and prepare_only:
        tamper.prepare()
    elif tamper is not None:
        tamper.arm()


def main(channel_fd: int) -> int:
    """The job process: Hello, then one job and its outcome; a build job's BuildOutcome; or,
    while it only launches prebuilt kernels, one job after another. The exit code to use."""
    # Everything made so far (modules, the warm-up's objects) is the process's own: a full
    # collection after each job (_clean_for_next_job) then scans only what the job made.
    gc.freeze()
    # A job's sources are imported once, from its private /tmp: writing their bytecode next
    # to them is work for nobody (everything else here is read-only).
    sys.dont_write_bytecode = True
    engine = importlib.import_module(os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE)
    _arm_tamper_checks(prepare_only=True)  # before Hello: ready means ready to arm at once
    sock = socket.socket(fileno=channel_fd)
    channel = _Channel(sock)
    device_index = int(os.environ.get("KERNELEVAL_DEVICE_INDEX", "-1"))
    try:
        channel.send(
            job_channel_pb2.JobProcessMessage(
                hello=job_channel_pb2.Hello(
                    worker_id=os.environ.get(WORKER_ID_ENV, ""),
                    pid=os.getpid(),
                    device_index=device_index,
                    device=device_info(device_index),
                    judges=hasattr(engine, "judge_job"),
                )
            )
        )
    except OSError:
        return OK_EXIT  # the front end is gone
    threading.Thread(target=channel.read_loop, name="job-channel", daemon=True).start()
    for done in range(MAX_JOBS_PER_LAUNCH_PROCESS):
        # Made while the process waits for its job, not on the job's way: its folders, and
        # its peak memory's start (nothing runs on the GPU in between: the warm-up, the last
        # job's cleanup are done).
        make_job_dirs()
        _reset_peak_memory()
        assign = channel.assigned.get()
        if assign is None:
            return OK_EXIT
        try:
            if assign.build_only:
                _build_one(engine, channel, assign)
                return OK_EXIT
            last = done + 1 == MAX_JOBS_PER_LAUNCH_PROCESS
            poisoned, reusable = _run_one(engine, channel, assign, last)
        except OSError:  # the channel broke while reporting
            return OK_EXIT
        if not reusable:
            return POISONED_EXIT if poisoned else OK_EXIT
    return OK_EXIT


def _standalone() -> None:
    fd = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    try:
        load_engine()
        warm_up()
        code = main(fd)
    except BaseException:  # noqa: BLE001 - say why, then leave without the normal teardown
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a poisoned CUDA context can hang the normal teardown


if __name__ == "__main__":
    _standalone()
