"""The zygote: the per-device fork server of job processes.

    python -m kerneleval_server.jobproc.zygote        (descriptor 3: the socket to the watchdog)

Started by the watchdog inside the device's sandbox, as root. It configures the environment and
imports the engine (KERNELEVAL_ENGINE, default kerneleval_server.engine: torch and triton) and
the job main (KERNELEVAL_JOB_MAIN, "module:function", default
kerneleval_server.jobproc.runtime:main) without creating a CUDA context and without loading any
candidate's code, reads ZygoteConfig, answers ZygoteReady, then serves SpawnJobProcess frames
(zygote.proto) one at a time, single-threaded, until its socket closes.

For each SpawnJobProcess (attached: the job end of the channel, then the cgroup.procs fds):

    zygote --fork--> C (root): join the cgroups; unshare(NEWPID|NEWNS|NEWIPC|NEWNET);
                     mounts private; tmpfs /tmp and /dev/shm; fork G; report G's pid over
                     a pipe; _exit
    G (PID 1 of the new PID namespace, reparented to the watchdog, a subreaper):
                     mount /proc; only the channel left, as descriptor 3; environment =
                     job_env + KERNELEVAL_WORKER_ID; warm up (the job main module's warm_up(),
                     with TRITON_CACHE_DIR on the zygote's root-only warm cache by descriptor);
                     hand the private /tmp to the job user; setgroups/setresgid/setresuid;
                     no_new_privs; RLIMIT_CORE 0, RLIMIT_NOFILE; seccomp; stderr to /dev/null;
                     os._exit(job_main(3))

The zygote reaps C and answers JobProcessSpawned{pid=G} (pid 0 and the error when it failed).
With ZygoteConfig.new_namespaces false (the host refused them; the watchdog warned) the
namespace and mount steps are skipped.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import resource
import select
import shutil
import signal
import socket
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import NoReturn

from kerneleval.internal.v1 import zygote_pb2

from kerneleval_server.framing import FdFrameReader, FrameError, send_frame

from . import (
    BUILD_DEVICE,
    BUILD_NICE_ENV,
    CONFIG_EXIT,
    DEFAULT_JOB_MAIN,
    DEVICE_INDEX_ENV,
    JOB_MAIN_ENV,
    SETUP_FAILED_EXIT,
    TRITON_CACHE_ENV,
    WORKER_ID_ENV,
    sandbox,
    startup,
)

CHANNEL_FD = 3
SPAWN_TIMEOUT_S = 30.0

JobMain = Callable[[int], int]

# Warnings that every zygote or job process would print to the service's log, about what the
# operator can do nothing about: the sandbox hides NVML on purpose (the watchdog reads it; the
# service says so once at start, main.SANDBOX_HIDES), which torch's device count warns about
# twice in every job process; and the zygote forks after torch has started its threads, as
# designed (a fork of a warm process: 0.35 s against 3 s for a fresh one, DESIGN.md), which
# Python 3.12 warns about at every fork.
QUIET_WARNINGS = (
    (UserWarning, r"Can't initialize NVML"),
    (UserWarning, r"Can't get nvml device count"),
    (DeprecationWarning, r"This process \(pid=\d+\) is multi-threaded, use of fork\(\)"),
)
# What the zygote and its job processes are to the host's OOM killer: the first to go when
# the host runs out of memory (their limits, --job-memory-mib, may add up to more than the
# host has), never the front end or the watchdog; the largest of them goes first.
OOM_SCORE_ADJ = 1000


def quiet_warnings() -> None:
    """Silences QUIET_WARNINGS in this process and in what it forks (job processes)."""
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def first_for_the_oom_killer() -> None:
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(OOM_SCORE_ADJ))
    except OSError:
        pass  # a /proc that refuses it: the host's OOM killer chooses as it would


def resolve_job_main(spec: str) -> tuple[JobMain, Callable[[], None] | None]:
    """`module:function` -> the function, and the module's warm_up() if it has one."""
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ValueError(f"{JOB_MAIN_ENV} must be 'module:function', not {spec!r}")
    module = importlib.import_module(module_name)
    function = getattr(module, function_name)
    warm_up = getattr(module, "warm_up", None)
    return function, warm_up if callable(warm_up) else None


def in_initial_user_namespace() -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


def check_config(config: zygote_pb2.ZygoteConfig) -> str:
    """Why the zygote refuses this config ("" when it takes it)."""
    if config.uid < 0 or config.gid < 0:
        return f"uid {config.uid} / gid {config.gid}"
    if os.geteuid() == 0 and in_initial_user_namespace() and (config.uid == 0 or config.gid == 0):
        return "job processes never run as root (uid or gid 0)"
    if config.tmp_bytes < 0 or config.shm_bytes < 0 or config.max_open_files < 0:
        return "negative sizes"
    return ""


class Zygote:
    def __init__(
        self,
        config: zygote_pb2.ZygoteConfig,
        configured_env: dict[str, str],
        job_main: JobMain,
        warm_up: Callable[[], None] | None,
    ) -> None:
        self.config = config
        self.configured_env = configured_env
        self.job_main = job_main
        self.warm_up = warm_up
        # The warm-up's own Triton cache (root's, 0700, in the zygote's /tmp): the job's /tmp is
        # a fresh tmpfs, and compiling Triton's driver module and the warm-up kernel again in
        # every job process costs a second. Job processes reach it only through a descriptor,
        # during the warm-up, as root; it is closed before the drop. No job writes to it.
        self.warm_cache = ""
        if warm_up is not None:
            base = os.environ.get("TMPDIR") or "/tmp"
            self.warm_cache = os.path.join(base, f"kerneleval-warm-cache-{os.getpid()}")
            os.makedirs(self.warm_cache, mode=0o700, exist_ok=True)

    # -- the zygote's side --

    def spawn(self, worker_id: str, channel_fd: int, cgroup_fds: list[int]) -> int:
        """Forks C (which forks the job process G); returns G's pid. Closes the given fds.
        Raises RuntimeError with what went wrong."""
        try:
            r, w = os.pipe()
            try:
                pid = os.fork()
            except OSError:
                os.close(r)
                os.close(w)
                raise
        except OSError as exc:
            _close_all([channel_fd, *cgroup_fds])
            raise RuntimeError(f"fork: {exc}") from exc
        if pid == 0:
            os.close(r)
            self._child(worker_id, channel_fd, cgroup_fds, w)
        os.close(w)
        _close_all([channel_fd, *cgroup_fds])
        report = ""
        try:
            report = _read_report(r, SPAWN_TIMEOUT_S)
        finally:
            os.close(r)
            if not report_complete(report):  # C hangs (or died): it goes now
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _, status = os.waitpid(pid, 0)
        if report.startswith("pid "):
            return int(report[4:])
        if report.startswith("error "):
            raise RuntimeError(report[6:])
        raise RuntimeError(
            f"the spawning child ended without a report ({_describe_status(status)})"
        )

    # -- C: the child that makes the namespaces --

    def _child(self, worker_id: str, channel_fd: int, cgroup_fds: list[int], w: int) -> NoReturn:
        try:
            sandbox.join_cgroups(cgroup_fds)
            cache_fd = -1
            if self.warm_cache:  # opened before /tmp is covered
                opened = os.open(self.warm_cache, os.O_RDONLY | os.O_DIRECTORY)
                cache_fd = fcntl.fcntl(opened, fcntl.F_DUPFD, 10)
                os.close(opened)
            if self.config.new_namespaces:
                # Its own IPC namespace (System V objects outlive their maker) and network
                # namespace (abstract sockets, loopback) too: nothing shared with the next job
                # or with one running beside it on the GPU.
                sandbox.unshare(
                    sandbox.CLONE_NEWPID
                    | sandbox.CLONE_NEWNS
                    | sandbox.CLONE_NEWIPC
                    | sandbox.CLONE_NEWNET
                )
                sandbox.make_mounts_private()
                sandbox.mount_private_tmpfs("/tmp", self.config.tmp_bytes)
                if os.path.isdir("/dev/shm"):
                    sandbox.mount_tmpfs("/dev/shm", self.config.shm_bytes)
            g = os.fork()
            if g == 0:
                os.close(w)
                self._job_process(worker_id, channel_fd, cache_fd)
            os.write(w, f"pid {g}".encode())
        except BaseException as exc:  # noqa: BLE001 - reported to the zygote
            try:
                os.write(w, f"error {exc}".encode()[:4000])
            except OSError:
                pass
            os._exit(1)
        os._exit(0)

    # -- G: the job process --

    def _job_process(self, worker_id: str, channel_fd: int, cache_fd: int) -> NoReturn:
        config = self.config
        try:
            if config.new_namespaces:
                sandbox.mount_proc("/proc")
            keep = [cache_fd] if cache_fd >= 0 else []
            sandbox.keep_only_fd(channel_fd, CHANNEL_FD, keep_stderr=True, also_keep=keep)
            env = dict(config.job_env) if config.job_env else dict(os.environ)
            for key, value in self.configured_env.items():
                env.setdefault(key, value)
            env[WORKER_ID_ENV] = worker_id
            os.environ.clear()
            os.environ.update(env)
            os.chdir("/")
            if self.warm_up is not None:
                job_cache = os.environ.get(TRITON_CACHE_ENV)
                if cache_fd >= 0:
                    os.environ[TRITON_CACHE_ENV] = f"/proc/self/fd/{cache_fd}"
                self.warm_up()
                os.environ.pop(TRITON_CACHE_ENV, None)
                if job_cache is not None:
                    os.environ[TRITON_CACHE_ENV] = job_cache
            if cache_fd >= 0:
                os.close(cache_fd)
            if config.new_namespaces:
                for private in ("/tmp", "/dev/shm"):
                    sandbox.chown_tree(private, config.uid, config.gid)
            sandbox.drop_privileges(config.uid, config.gid)
            sandbox.set_dumpable(True)
            sandbox.set_no_new_privs()
            limits = {resource.RLIMIT_CORE: 0}
            if config.max_open_files > 0:
                limits[resource.RLIMIT_NOFILE] = config.max_open_files
            sandbox.set_rlimits(limits)
            if config.seccomp_filter:
                sandbox.install_seccomp(config.seccomp_filter)
            sys.stderr.flush()
            os.dup2(0, 2)  # the job's output is not the service's log
        except BaseException as exc:  # noqa: BLE001 - nobody else can say why
            print(f"kerneleval job process {worker_id}: {exc}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(SETUP_FAILED_EXIT)
        code = 1
        try:
            result = self.job_main(CHANNEL_FD)
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        os._exit(code)


def report_complete(report: str) -> bool:
    return report.startswith("pid ") or report.startswith("error ")


def _read_report(fd: int, timeout_s: float) -> str:
    """What C wrote before it closed the pipe ("" on a timeout)."""
    chunks: list[bytes] = []
    while True:
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            return ""
        chunk = os.read(fd, 4096)
        if not chunk:
            return b"".join(chunks).decode(errors="replace")
        chunks.append(chunk)


def _describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by signal {os.WTERMSIG(status)}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _send(sock: socket.socket, event: zygote_pb2.ZygoteEvent) -> None:
    send_frame(sock, event.SerializeToString())


def serve(sock: socket.socket) -> int:
    """The zygote's loop on its socket to the watchdog; the exit code."""
    quiet_warnings()
    first_for_the_oom_killer()
    reader = FdFrameReader(sock)
    try:
        _, configured_env = startup.load_engine()
        job_main, warm_up = resolve_job_main(os.environ.get(JOB_MAIN_ENV) or DEFAULT_JOB_MAIN)
    except Exception:  # noqa: BLE001 - the watchdog sees the exit and logs stderr
        traceback.print_exc()
        return 1
    frame = reader.recv_frame()
    if frame is None:
        return 0
    request = zygote_pb2.ZygoteRequest.FromString(frame)
    if request.WhichOneof("kind") != "config":
        print("kerneleval zygote: the first frame is not a ZygoteConfig", file=sys.stderr)
        return CONFIG_EXIT
    refused = check_config(request.config)
    if refused:
        print(f"kerneleval zygote: config refused: {refused}", file=sys.stderr)
        return CONFIG_EXIT
    if os.environ.get(DEVICE_INDEX_ENV) == str(BUILD_DEVICE):
        # Builds are CPU work beside the GPUs' processes, whose timed trials wait on a CPU
        # after every synchronize: builds take what those leave.
        os.nice(int(os.environ.get(BUILD_NICE_ENV, "0") or 0))
    zygote = Zygote(request.config, configured_env, job_main, warm_up)
    versions = startup.library_versions()
    _send(
        sock,
        zygote_pb2.ZygoteEvent(
            ready=zygote_pb2.ZygoteReady(
                torch_version=versions["torch"], triton_version=versions["triton"]
            )
        ),
    )
    try:
        _serve_spawns(sock, reader, zygote)
    finally:
        if zygote.warm_cache:
            shutil.rmtree(zygote.warm_cache, ignore_errors=True)
    return 0


def _serve_spawns(sock: socket.socket, reader: FdFrameReader, zygote: Zygote) -> None:
    while True:
        frame = reader.recv_frame()
        if frame is None:
            return
        request = zygote_pb2.ZygoteRequest.FromString(frame)
        if request.WhichOneof("kind") != "spawn":
            print("kerneleval zygote: ignoring a second ZygoteConfig", file=sys.stderr)
            continue
        spawn = request.spawn
        fds = reader.take_fds(1 + max(0, spawn.cgroup_fd_count))
        reply = zygote_pb2.JobProcessSpawned(worker_id=spawn.worker_id)
        try:
            reply.pid = zygote.spawn(spawn.worker_id, fds[0], fds[1:])
        except RuntimeError as exc:
            reply.error = str(exc)
        _send(sock, zygote_pb2.ZygoteEvent(spawned=reply))


def main() -> int:
    try:
        sock = socket.socket(fileno=CHANNEL_FD)
    except OSError as exc:
        print(f"kerneleval zygote: no socket on descriptor {CHANNEL_FD}: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(sock)
    except (FrameError, OSError) as exc:
        print(f"kerneleval zygote: channel to the watchdog: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
