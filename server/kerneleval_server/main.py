"""`kerneleval serve` (also `kerneleval-server serve`, `python -m kerneleval_server serve`): the
front end process.

Start-up: open the store, pick up unfinished jobs, start the watchdog (restarted if it dies),
then listen. The watchdog starts a zygote per device in the sandbox and hands the front end
one channel per job process (job_processes.py). SIGTERM/SIGINT: health flips to NOT_SERVING,
new jobs are refused, running jobs get --shutdown-grace-s to finish, then job processes stop;
queued jobs stay in the store for the next start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import gc
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kerneleval import __version__
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import (
    kernel_eval_service_pb2,
    kernel_eval_service_pb2_grpc,
    operations_service_pb2,
    operations_service_pb2_grpc,
)

from kerneleval_server import config as config_mod
from kerneleval_server import logs, reflection
from kerneleval_server.api import auth
from kerneleval_server.api.auth import AdminAuth
from kerneleval_server.api.errors import DecodeErrors
from kerneleval_server.api.kernel_eval_service import KernelEvalService
from kerneleval_server.api.operations_service import OperationsService
from kerneleval_server.api.tenants import TenantAuth, Tenants
from kerneleval_server.config import ALL, BUILDER, GATEWAY, NODE, Config
from kerneleval_server.fleet import readiness as readiness_mod
from kerneleval_server.jobproc import BUILD_DEVICE, BUILD_NICE_ENV, PCH_DIR_ENV, POISONED_EXIT
from kerneleval_server.jobs.builds.artifact_store import SharedArtifacts
from kerneleval_server.jobs.builds.builder_node import BuilderNode, probe_versions
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.manager import JobManager
from kerneleval_server.jobs.service import JobService
from kerneleval_server.jobs.shared_queue import SharedQueue
from kerneleval_server.jobs.store import StoreError, open_store
from kerneleval_server.jobs.store.base import ARTIFACTS_CHANNEL
from kerneleval_server.jobs.waits import unfinished
from kerneleval_server.metrics import Metrics, MetricsInterceptor
from kerneleval_server.spec import validation

if TYPE_CHECKING:
    from kerneleval_server.api.connect_gateway import HttpGateway

log = logging.getLogger("kerneleval.main")

WATCHDOG_RESTART_BACKOFF_S = (0.5, 1, 2, 5, 10)
# A shared store: followers read it this often even when no NOTIFY woke them.
SHARED_POLL_S = 5.0
SERVICES = (
    "kerneleval.v1.KernelEvalService",
    "kerneleval.v1.OperationsService",
)


def admin_token(cfg: Config, state: Path) -> str:
    """The configured token, or the one in <state>/admin_token (made on first start)."""
    if cfg.admin_token:
        return cfg.admin_token
    path = state / "admin_token"
    if path.exists():
        return path.read_text().strip()
    # A prefix: a bare token_urlsafe starts with "-" one time in 64, and then
    # `kerneleval --admin-token "$(cat state/admin_token)"` reads it as an option.
    token = "ket_" + secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    log.warning("generated an admin token; it is in %s", path)
    return token


SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# The sandbox's fresh root shows these anyway (watchdog/src/sandbox.*).
SYSTEM_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
ZYGOTE_MODULE = "kerneleval_server.jobproc.zygote"
# Said once at start: what job processes lack on purpose, whose own warnings about it are
# silenced in them (jobproc/zygote.py, quiet_warnings).
SANDBOX_HIDES = (
    "the sandbox hides from job processes, on purpose: NVML (the watchdog reads it for them; "
    "torch's \"Can't initialize NVML\" warnings are silenced), the network (only lo), the host's "
    "other processes and files, the state folder and other jobs"
)


def code_dirs() -> tuple[Path, Path]:
    """server/ and the generated code's folder (clients/python/src)."""
    src = Path(__file__).resolve().parents[1]
    return src, src.parent / "clients" / "python" / "src"


def job_path() -> str:
    """PATH of the zygotes and job processes: the virtual environment's bin, CUDA's, the
    system's; nothing of the service's own PATH."""
    entries = [os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin")]
    cuda_home = os.environ.get("CUDA_HOME", "")
    for cuda in (os.path.join(cuda_home, "bin") if cuda_home else "", "/usr/local/cuda/bin"):
        if cuda and os.path.isdir(cuda):
            entries.append(cuda)
    entries += SYSTEM_PATH
    return os.pathsep.join(dict.fromkeys(entries))


def job_env(cfg: Config) -> dict[str, str]:
    """Environment of the zygotes and job processes (the watchdog adds the per-device part)."""
    src, gen = code_dirs()
    env = {
        "PATH": job_path(),
        "PYTHONPATH": os.pathsep.join(
            p
            for p in (str(src), str(gen), *os.environ.get("PYTHONPATH", "").split(os.pathsep))
            if p
        ),
        "PYTHONUNBUFFERED": "1",
    }
    if cfg.engine:
        env["KERNELEVAL_ENGINE"] = cfg.engine
    if cfg.cuda_max_connections > 0:
        # Hardware queues per CUDA context. With one, a context is made in a third of the time
        # when several start at once (CUDA serialises their creation; H100: 8 at once made 5.7
        # warm processes a second instead of 2.8); its cost: kernels a job puts on different
        # streams run one after the other.
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(cfg.cuda_max_connections)
    if cfg.build_nice > 0:
        env[BUILD_NICE_ENV] = str(cfg.build_nice)  # the build zygote's (jobproc/zygote.py)
    # Job processes check against the same limits (validation.Limits.from_env).
    env.update({k: v for k, v in os.environ.items() if k.startswith("KERNELEVAL_LIMIT_")})
    return env


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def read_only_paths(cfg: Config, env: dict[str, str]) -> list[str]:
    """Host paths the sandbox shows read-only at the same path: the Python installation, the
    virtual environment, the service's code, CUDA outside /usr, and --sandbox-path. Real paths,
    existing ones, none inside another or inside what the fresh root shows anyway."""
    src, gen = code_dirs()
    wanted = [
        sys.prefix,
        sys.base_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p),
        str(src),
        str(gen),
        env.get(PCH_DIR_ENV, ""),  # the service's precompiled headers (fast_build/pch.py)
    ]
    cuda_home = os.environ.get("CUDA_HOME", "")
    if cuda_home:
        wanted.append(cuda_home)
    wanted += cfg.sandbox_paths()
    real = [os.path.realpath(p) for p in wanted if os.path.isabs(p) and os.path.exists(p)]
    real = [p for p in dict.fromkeys(real) if not any(_under(p, r) for r in SYSTEM_ROOTS)]
    return [p for p in real if not any(o != p and _under(p, o) for o in real)]


def build_configure(
    cfg: Config, state_dir: Path, pch_dir: Path | None = None
) -> watchdog_pb2.Configure:
    env = job_env(cfg)
    if pch_dir is not None:
        env[PCH_DIR_ENV] = str(pch_dir)
    nvml = {
        "auto": watchdog_pb2.NVML_SOURCE_UNSPECIFIED,
        "real": watchdog_pb2.NVML_SOURCE_REAL,
        "fake": watchdog_pb2.NVML_SOURCE_FAKE,
        "none": watchdog_pb2.NVML_SOURCE_NONE,
    }[cfg.nvml]
    mib = 1024 * 1024
    devices = cfg.device_list()
    if cfg.role == BUILDER:  # build processes only: no GPU, no NVML
        devices, nvml = [BUILD_DEVICE], watchdog_pb2.NVML_SOURCE_NONE
    return watchdog_pb2.Configure(
        worker_command=[sys.executable, "-m", ZYGOTE_MODULE],
        worker_env=env,
        workers_per_device=cfg.workers_per_device,
        warm_spare=cfg.warm_spare,
        spare_count=cfg.spare_count,
        build_processes=cfg.effective_build_processes(),
        warming_runs_in_windows=not cfg.freeze_warming,
        device_indices=devices,
        state_dir=str(state_dir),
        reset_command=cfg.reset_command,
        auto_reset=cfg.auto_reset,
        nvml_source=nvml,
        fake_nvml_path=cfg.fake_nvml_path,
        kmsg_path=cfg.kmsg_path,
        sandbox=watchdog_pb2.SandboxConfig(
            isolate_network=cfg.isolate_network,
            user=cfg.job_user,
            read_only_paths=read_only_paths(cfg, env),
            memory_bytes=cfg.effective_job_memory_mib() * mib,
            tmp_bytes=cfg.job_tmp_mib * mib,
            max_pids=cfg.job_max_pids,
        ),
        health_interval_seconds=cfg.health_interval_s,
        max_restarts=cfg.max_restarts,
        restart_window_seconds=cfg.restart_window_s,
        # A job process leaving after its CUDA context was poisoned is the kernel's doing.
        retire_exit_codes=[POISONED_EXIT],
    )


class StateInUse(Exception):
    pass


def lock_state(state: Path) -> int:
    """One front end per state folder: two would both re-run the same jobs. The kernel drops
    the lock when the process dies, SIGKILL included."""
    fd = os.open(state / "frontend.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise StateInUse(f"another kerneleval front end uses {state}") from exc
    return fd


class Server:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.state = cfg.state_path()
        self.state.mkdir(parents=True, exist_ok=True)
        self._lock_fd = lock_state(self.state)
        # --role all holds its store alone; gateways and nodes share theirs.
        self.store = open_store(
            cfg.store or cfg.database_path(),
            exclusive=cfg.role == ALL,
            shared=cfg.role != ALL,
        )
        self.metrics = Metrics()
        self.limits = validation.Limits.from_env()
        self.manager = JobManager(
            cfg,
            self.store,
            EventHub(self.store),
            OpsLog(),
            self.metrics,
            max_timeout_s=float(self.limits.max_timeout_seconds),
        )
        self.shared: SharedQueue | None = None
        if cfg.role in (GATEWAY, NODE):
            self.shared = SharedQueue(
                self.manager, cfg.store, cfg.role, cfg.lease_seconds, cfg.max_attempts,
                tenant_max_running=cfg.tenant_max_running,
            )  # fmt: skip
            self.manager.shared = self.shared
            self.manager.hub.poll_s = SHARED_POLL_S
        # A node's load_inline builds: the shared artifact store and the builders first.
        self.artifacts: SharedArtifacts | None = None
        if self.shared is not None and cfg.role == NODE:
            self.artifacts = self._shared_artifacts(self.shared)
        self.builder: BuilderNode | None = None  # --role builder: made once versions are known
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self.manager.on_health_change = self._update_health
        # The watchdog's own folder (reset logs, the sandboxes' roots): the service's only.
        self.watchdog_dir = self.state / "watchdog"
        self.watchdog_dir.mkdir(mode=0o700, exist_ok=True)
        # Precompiled torch headers for build processes' load_inline builds (fast_build/pch.py).
        self.pch_dir: Path | None = None
        if cfg.build_pch and cfg.effective_build_processes() > 0 and cfg.role != GATEWAY:
            self.pch_dir = self.state / "pch"
            self.pch_dir.mkdir(mode=0o755, exist_ok=True)
        # Ready for each kind of job (health "kerneleval.ready.<kind>", ListDevices).
        self.readiness = readiness_mod.Readiness(
            self.manager,
            self._serving_now,
            cfg.effective_build_processes() if cfg.role != GATEWAY else 0,
            takes_jobs=cfg.role in (ALL, NODE),
        )
        if self.pch_dir is not None:
            self.readiness.pch.set(readiness_mod.MAKING)
        self._ready: dict[str, bool] = {}
        self.stopping = asyncio.Event()
        self._supervise_task: asyncio.Task[None] | None = None
        self._serving: bool | None = None
        self._http: HttpGateway | None = None

    def _shared_artifacts(self, shared: SharedQueue) -> SharedArtifacts:
        m = self.manager
        artifacts = SharedArtifacts(
            self.store, m.builds.extensions, shared.node_id,
            wait_s=self.cfg.builder_wait_s, keep_s=self.cfg.retention_hours * 3600.0,
            answer=m.builds.answer_extensions, say=m.builds.publish_log, dispatch=m.dispatch,
            host=m.builds,
        )  # fmt: skip
        shared.on_beat.append(artifacts.refresh)
        shared.on_note[ARTIFACTS_CHANNEL] = artifacts.wake
        return artifacts

    async def _start_builder(self, address: str) -> BuilderNode:
        """The builder's part: its versions, as its build processes' Python has them."""
        env = job_env(self.cfg)
        torch_version, cuda_version = await asyncio.to_thread(probe_versions, env)
        workers = self.manager.job_processes.by_id

        def idle() -> int:
            return sum(1 for w in workers.values() if w.ready and w.device_index == BUILD_DEVICE)

        builder = BuilderNode(
            self.store, self.manager.builds.extensions, url=self.cfg.store,
            lease_s=self.cfg.lease_seconds, torch_version=torch_version,
            cuda_version=cuda_version, slots=self.cfg.effective_build_processes(), idle=idle,
            dispatch=self.manager.dispatch, address=address,
        )  # fmt: skip
        builder.on_beat = self._update_health
        builder.start()
        return builder

    def _serving_now(self) -> bool:
        if self.cfg.role == BUILDER:
            return self.builder is not None and self.builder.serving() and not self.manager.draining
        return self.manager.serving()

    def _update_health(self) -> None:
        serving = self._serving_now()
        loop = asyncio.get_running_loop()
        if serving != self._serving:
            self._serving = serving
            log.info("health: %s", "SERVING" if serving else "NOT_SERVING")
            for name in ("", *SERVICES):
                loop.create_task(self.health.set(name, _health_status(serving)))
        # Each kind of job (fleet/readiness.py): "kerneleval.ready.<kind>".
        for row in self.readiness.kinds() if self.cfg.role != GATEWAY else ():
            name = readiness_mod.HEALTH_PREFIX + row.kind
            if self._ready.get(name) != row.ready:
                self._ready[name] = row.ready
                log.info("ready for %s jobs: %s (%s)", row.kind, row.ready, row.detail)
                loop.create_task(self.health.set(name, _health_status(row.ready)))

    async def _supervise_watchdog(self) -> None:
        from kerneleval_server.fleet.watchdog import Watchdog

        binary = self.cfg.watchdog_binary()
        events = self.manager.watchdog_events
        failures = 0
        while not self.stopping.is_set():
            configure = build_configure(self.cfg, self.watchdog_dir, self.pch_dir)
            try:
                wd = await Watchdog.start(binary, configure, events.on_event, events.on_job_channel)
            except Exception as exc:  # noqa: BLE001 - keep trying; health says NOT_SERVING
                log.error("cannot start the watchdog %s: %s", binary, exc)
                wd = None
            if wd is not None:
                self.manager.watchdog = wd
                try:
                    status = await wd.status()
                    events.on_event(watchdog_pb2.WatchdogEvent(status=status))
                except Exception as exc:  # noqa: BLE001 - readings come with events too
                    log.warning("watchdog status: %s", exc)
                started = time.monotonic()
                code = await wd.wait()
                self.manager.watchdog = None
                if self.stopping.is_set():
                    return
                log.error("the watchdog exited with %s; restarting it", code)
                events.watchdog_lost()
                if time.monotonic() - started > 60:
                    failures = 0
            delay = WATCHDOG_RESTART_BACKOFF_S[min(failures, len(WATCHDOG_RESTART_BACKOFF_S) - 1)]
            failures += 1
            try:
                await asyncio.wait_for(self.stopping.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _make_pch(self) -> None:
        """Makes the build processes' precompiled headers (a few minutes of CPU, once: they
        are kept in the state folder, and a start with the same torch, compilers and flags
        finds them ready); builds meanwhile go without them."""
        assert self.pch_dir is not None
        pch = self.readiness.pch
        pch.set(readiness_mod.MAKING)
        # The build processes' environment (their compiler: a PCH serves only the same
        # command), no GPU (no CUDA context for a header), any architecture (host headers).
        env = {**job_env(self.cfg), "CUDA_VISIBLE_DEVICES": "", "TORCH_CUDA_ARCH_LIST": "9.0"}
        proc = None
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "kerneleval_server.fast_build.pch", str(self.pch_dir),
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )  # fmt: skip
            out, _ = await proc.communicate()
        except asyncio.CancelledError:
            if proc is not None and proc.returncode is None:
                proc.kill()
            raise
        except OSError as exc:
            log.warning("precompiled headers not made: %s", exc)
            pch.set(readiness_mod.FAILED, str(exc))
            self._update_health()
            return
        lines = out.decode(errors="replace").splitlines()
        for line in lines[-10:]:
            log.info(line)
        last = lines[-1].removeprefix("kerneleval pch: ") if lines else ""
        if proc.returncode == 0 and last.startswith("ready"):
            pch.set(readiness_mod.READY, last.removeprefix("ready").strip())
        else:
            pch.set(readiness_mod.FAILED, last or f"exit code {proc.returncode}")
        self._update_health()

    async def _sweep(self, ops: OperationsService) -> None:
        while not self.stopping.is_set():
            try:
                ops.cleanup(self.cfg.retention_hours * 3600.0)
            except Exception:  # noqa: BLE001 - a failed sweep is retried next period
                log.exception("retention sweep failed")
            try:
                await asyncio.wait_for(self.stopping.wait(), self.cfg.sweep_interval_s)
            except asyncio.TimeoutError:
                pass

    def _grpc_server(self, token: str, tenants: Tenants) -> grpc.aio.Server:
        cfg = self.cfg
        size = cfg.max_message_mb * 1024 * 1024
        options = [
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            # One service per port: with gRPC's default (SO_REUSEPORT) a second service on the
            # same port started and the kernel spread connections over both.
            ("grpc.so_reuseport", 0),
        ]
        # Auth before decoding: a caller without the token learns nothing of its request.
        where = auth.CONFIGURED if cfg.admin_token else auth.IN_STATE_DIR
        interceptors = [
            MetricsInterceptor(self.metrics),
            AdminAuth(token, where),
            TenantAuth(tenants),
            DecodeErrors(),
        ]
        return grpc.aio.server(interceptors=interceptors, options=options)

    async def run(self) -> int:
        cfg = self.cfg
        token = admin_token(cfg, self.state)
        tenants = Tenants(cfg.tenants_file or None, token)  # off without --tenants-file
        server = self._grpc_server(token, tenants)
        jobs = JobService(self.manager)  # the servicers' one face of the job service
        ops = OperationsService(jobs, self.shared, self.readiness.kinds)
        names: tuple[str, ...] = (health.SERVICE_NAME,)
        if cfg.role != BUILDER:  # a builder serves its health only: it takes no jobs
            kernel_eval_service_pb2_grpc.add_KernelEvalServiceServicer_to_server(
                KernelEvalService(jobs, self.limits, tenants), server
            )
            operations_service_pb2_grpc.add_OperationsServiceServicer_to_server(ops, server)
            names = (
                kernel_eval_service_pb2.DESCRIPTOR.services_by_name["KernelEvalService"].full_name,
                operations_service_pb2.DESCRIPTOR.services_by_name["OperationsService"].full_name,
                *names,
            )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable(names, server)
        kinds = [k.kind for k in self.readiness.kinds()] if cfg.role != GATEWAY else []
        for name in ("", *SERVICES, *(readiness_mod.HEALTH_PREFIX + k for k in kinds)):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

        try:
            port = self._listen(server)
            with _port_named("--metrics-port", cfg.metrics_host, cfg.metrics_port):
                self.metrics.serve(cfg.metrics_host, cfg.metrics_port)
            with _port_named("--http-port", cfg.http_host or cfg.host, cfg.http_port):
                self._http = self._http_gateway(server)
        except (RuntimeError, OSError) as exc:  # port taken, bad address, unreadable TLS files
            log.error("cannot listen: %s", exc)
            await server.stop(None)  # not left to the garbage collector, after the loop
            self.store.close()
            return 2
        if cfg.role != BUILDER:  # a builder's store holds the nodes' jobs, not its own
            self.manager.recover()
            self.manager.start_watching_waits()
        await server.start()
        # What start-up made (modules, descriptors, the servicers) lives as long as the
        # service: frozen, a full collection no longer walks it. One took 9 ms of the event
        # loop every few hundred Evaluates on the CPU machine, 0.2 ms frozen.
        gc.collect()
        gc.freeze()
        if self._http is not None:
            self._http.start()
        if cfg.port_file:
            Path(cfg.port_file).write_text(f"{port}\n")
        log.info(
            "kerneleval %s serving on %s:%s%s",
            __version__,
            cfg.host,
            port,
            f" and unix:{cfg.unix_socket}" if cfg.unix_socket else "",
        )
        if cfg.role != GATEWAY:
            log.info(
                "job processes: %d MiB of memory each (%s), /tmp and /dev/shm %d MiB each",
                cfg.effective_job_memory_mib(),
                cfg.job_memory_source(),
                cfg.job_tmp_mib,
            )
            log.info("%s", SANDBOX_HIDES)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if tenants.on:  # SIGHUP reads the tenants file again (a revoked token is refused)
            loop.add_signal_handler(signal.SIGHUP, tenants.reload)
        if self.shared is not None:
            self.shared.address = cfg.advertise_address or f"{cfg.host}:{port}"
            self.shared.devices_blob = lambda: operations_service_pb2.ListDevicesResponse(
                devices=ops.devices()
            ).SerializeToString()
            self.shared.start()
        if cfg.role == GATEWAY:
            self._update_health()  # no GPUs, no watchdog: it serves from now on
        else:
            self._supervise_task = loop.create_task(self._supervise_watchdog())
        code = 0
        if cfg.role == BUILDER:
            try:
                self.builder = await self._start_builder(
                    cfg.advertise_address or f"{cfg.host}:{port}"
                )
            except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                log.error("--role builder: %s", exc)
                code = 2
                self.stopping.set()
        pch = loop.create_task(self._make_pch()) if self.pch_dir is not None else None
        # Finished jobs' retention: gateways and nodes sweep the store, builders need not.
        sweep = loop.create_task(self._sweep(ops)) if cfg.role != BUILDER else None
        await self.stopping.wait()
        await self._shutdown(server)
        if sweep is not None:
            sweep.cancel()
        if pch is not None:
            pch.cancel()
        return code

    def _listen(self, server: grpc.aio.Server) -> int:
        cfg = self.cfg
        port = 0
        if cfg.port >= 0:
            address = f"{cfg.host}:{cfg.port}"
            with _port_named("--port", cfg.host, cfg.port):
                if cfg.tls_cert:
                    creds = grpc.ssl_server_credentials(
                        [(Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())]
                    )
                    port = server.add_secure_port(address, creds)
                else:
                    port = server.add_insecure_port(address)
        if cfg.unix_socket:
            server.add_insecure_port(f"unix:{cfg.unix_socket}")
        return port

    def _http_gateway(self, server: grpc.aio.Server) -> HttpGateway | None:
        """The HTTP/JSON (Connect) listener of --http-port (bound now), which forwards every
        call to this gRPC server: over its unix socket, else over a loopback port of its own."""
        cfg = self.cfg
        if not cfg.http_port:
            return None
        try:
            from kerneleval_server.api.connect_gateway import HttpGateway
        except ImportError as exc:
            raise RuntimeError(
                f"--http-port needs connectrpc and hypercorn (Python >= 3.11; `make setup`) "
                f"and the generated Connect code (`make gen`): {exc}"
            ) from exc
        if cfg.unix_socket:
            target = f"unix:{cfg.unix_socket}"
        else:
            loopback = server.add_insecure_port("127.0.0.1:0")
            if not loopback:
                raise RuntimeError("no loopback port for the HTTP/JSON listener's gRPC calls")
            target = f"127.0.0.1:{loopback}"
        return HttpGateway(
            target,
            cfg.http_host or cfg.host,
            cfg.http_port,
            tls_cert=cfg.tls_cert,
            tls_key=cfg.tls_key,
            max_message_bytes=cfg.max_message_mb * 1024 * 1024,
        )

    async def _shutdown(self, server: grpc.aio.Server) -> None:
        """The drain: no new job starts; started jobs finish within --shutdown-grace-s
        (a compared job whose kernel ran is judged: JobManager.dispatch still starts judges),
        and the service stops as soon as none is left. What could not finish runs again at
        the next start, and the log says which and why; queued jobs stay queued."""
        m, grace = self.manager, self.cfg.shutdown_grace_s
        log.info(
            "shutting down: draining %d started job(s) for up to %.0f s (%d queued stay queued)",
            len(m.running), grace, len(m.queue),
        )  # fmt: skip
        m.draining = True
        m.waits.stop()
        self._update_health()
        began = time.monotonic()
        m.dispatch()  # judges of kernels that ran just now
        while m.running and time.monotonic() < began + grace:
            await asyncio.sleep(0.1)
        left = unfinished(m)
        m.cut_off.update(job_id for job_id, _ in left)  # a result while processes stop: not taken
        for job_id, why in left:
            log.warning(
                "job %s re-runs at the next start: the %.0f s grace ended while %s",
                job_id, grace, why, extra={"job_id": job_id},
            )  # fmt: skip
            m.hub.log(
                job_id,
                f"kerneleval: the service stopped ({grace:.0f} s grace) while {why}: "
                "the job runs again at its next start",
            )
        log.info(
            "drained in %.1f s: %d started job(s) left to re-run",
            time.monotonic() - began, len(left),
        )  # fmt: skip
        if self.shared is not None:
            await self.shared.stop()
        if self.artifacts is not None:
            await self.artifacts.stop()
        if self.builder is not None:
            await self.builder.stop()
        wd = self.manager.watchdog
        self.stopping.set()
        if wd is not None:
            try:
                await asyncio.wait_for(wd.shutdown(2000), 10)
            except Exception as exc:  # noqa: BLE001 - exiting anyway
                log.warning("watchdog shutdown: %s", exc)
        if self._supervise_task is not None:
            self._supervise_task.cancel()
        if self._http is not None:
            self._http.stop_accepting()  # its calls in flight end with the gRPC ones
        await server.stop(grace=2)
        if self._http is not None:
            await self._http.close()
        await self.manager.channels.close()
        self.store.close()
        log.info("stopped")


def _health_status(serving: bool) -> health_pb2.HealthCheckResponse.ServingStatus.ValueType:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on host:port already (a bind fails with EADDRINUSE)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the listeners do
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


@contextlib.contextmanager
def _port_named(flag: str, host: str, port: int) -> Iterator[None]:
    """A listener that cannot bind its port because another listens there: an error that
    says so and names the flag (gRPC says only "Failed to bind")."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        if port > 0 and (
            getattr(exc, "errno", None) == errno.EADDRINUSE or port_in_use(host, port)
        ):
            raise RuntimeError(
                f"{flag} {port}: address in use: something already listens on {host}:{port} "
                "(another kerneleval serve?); stop it, or choose another port"
            ) from None
        raise


def program_name() -> str:
    """The command the user typed, for --help: `kerneleval serve` hands its arguments here."""
    invoked = Path(sys.argv[0]).name
    if invoked == "kerneleval":
        return "kerneleval"
    if invoked == "__main__.py":
        return "python -m kerneleval_server"
    return "kerneleval-server"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=program_name(),
        description="The kerneleval service: compiles, checks and times GPU kernels.",
    )
    parser.add_argument("--version", action="version", version=f"kerneleval {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the gRPC service",
        description="Run the gRPC service. Every setting is a flag and an environment variable "
        "(the flag wins); defaults as in the README's configuration table.",
        usage="%(prog)s [--SETTING VALUE ...]",
    )
    config_mod.add_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    cfg = config_mod.from_args(ns)
    problems = cfg.problems()
    if cfg.tenants_file:  # read again at start; a bad file stops here, before anything starts
        try:
            Tenants(cfg.tenants_file)
        except (OSError, ValueError) as exc:
            problems.append(f"--tenants-file: {exc}")
    if problems:
        parser.error("; ".join(problems))
    logs.setup(cfg.log_level, cfg.log_file)
    try:
        server = Server(cfg)
    except (StateInUse, StoreError) as exc:
        log.error("%s", exc)
        return 2
    return asyncio.run(server.run())
