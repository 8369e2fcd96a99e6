"""Service settings: every one is a command-line flag and an environment variable.

A flag `--foo-bar` is also `KERNELEVAL_FOO_BAR`; the flag wins over the variable, the variable
over the default. `kerneleval serve --help` lists them all, each with its default as the README's
configuration table shows it (tests/test_conventions.py compares the two): the value, or for a
setting whose empty value means something worked out at start, metadata "default_text".
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from kerneleval_server import host_memory


def default_state_dir() -> Path:
    xdg = os.environ.get("XDG_STATE_HOME")
    return Path(xdg) / "kerneleval" if xdg else Path("state")


def default_watchdog_binary() -> str:
    """build/watchdog/kerneleval-watchdog of the checkout, else one on PATH."""
    here = Path(__file__).resolve().parents[2] / "build" / "watchdog" / "kerneleval-watchdog"
    if here.exists():
        return str(here)
    return shutil.which("kerneleval-watchdog") or str(here)


# --role: the whole service on one machine, or one part of a deployment on one PostgreSQL store.
ALL, GATEWAY, NODE, BUILDER = "all", "gateway", "node", "builder"

@dataclass
class Config:
    host: str = field(default="127.0.0.1", metadata={"help": "TCP address to listen on"})
    port: int = field(default=50051, metadata={"help": "TCP port; 0 picks a free one, -1 = none"})
    unix_socket: str = field(default="", metadata={"help": "also listen on this unix socket"})
    port_file: str = field(default="", metadata={"help": "write the bound TCP port here"})
    http_port: int = field(
        default=0, metadata={"help": "HTTP/JSON (Connect protocol) port beside gRPC; 0 = off"}
    )
    http_host: str = field(
        default="", metadata={"help": "HTTP/JSON address", "default_text": "--host"}
    )
    devices: str = field(
        default="", metadata={"help": "GPU indices, e.g. 0,1; empty = all", "default_text": "all"}
    )
    workers_per_device: int = field(default=1, metadata={"help": "job-taking workers per GPU"})
    warm_spare: bool = field(default=True, metadata={"help": "keep warm spare workers per GPU"})
    # Three: a fault costs the pool two processes (the poisoned one, and the spare the next
    # job takes); with two, ten faults back to back on an H100 saw the next job wait 100-250
    # ms for a warm-up about half the time (p50 95-128 ms), with three it started at once
    # (bench/README.md, latency-trims-2). A spare holds ~1-3 GiB of host memory.
    spare_count: int = field(default=3, metadata={"help": "warm spares per GPU (with warm-spare)"})
    build_processes: int = field(
        default=-1,
        metadata={
            "help": "build processes (no GPU) that compile IOContract kernels ahead of a reused "
            "launch process; 0 = off, -1 = auto",
            "default_text": "-1 (auto: CPUs - 2, from 2 to 32, on a host with a GPU, else 0)",
        },
    )
    build_nice: int = field(
        default=10,
        metadata={
            "help": "niceness of build processes (nvcc, ptxas, Triton's compiler: CPU work), so "
            "that the job processes that time, check and judge on the GPUs, and the front end, "
            "get a CPU first; 0: as the service's, at most 19"
        },
    )
    cuda_max_connections: int = field(
        default=1,
        metadata={
            "help": "CUDA_DEVICE_MAX_CONNECTIONS of job processes: 1 makes warm ones about twice "
            "as fast, but a job's streams share one hardware queue; 0 = CUDA's default (8)"
        },
    )
    state_dir: str = field(
        default="",
        metadata={
            "help": "state folder",
            "default_text": "./state ($XDG_STATE_HOME/kerneleval if set)",
        },
    )
    database: str = field(
        default="", metadata={"help": "SQLite file", "default_text": "<state>/jobs.db"}
    )
    store: str = field(
        default="",
        metadata={
            "help": "job store: a postgresql://user:pass@host/db URL (PostgreSQL), or empty for "
            "SQLite (--database)",
            "default_text": "empty (SQLite)",
        },
    )
    role: str = field(
        default=ALL,
        metadata={
            "help": "all: the whole service on this machine; gateway: the API only, on a "
            "shared --store; node: this machine's GPUs, taking jobs from a shared --store; "
            "builder: build processes only (no GPU), building nodes' load_inline calls into "
            "the shared --store"
        },
    )
    lease_seconds: float = field(
        default=10.0,
        metadata={
            "help": "--role node: a node's hold on the jobs it took, renewed every third of it; "
            "a dead node's jobs run elsewhere once it expires"
        },
    )
    builder_wait_s: float = field(
        default=5.0,
        metadata={
            "help": "--role node: how long a load_inline build asked of builders may go without "
            "a live builder holding it (none free, or the one that took it was lost) before the "
            "node builds it itself"
        },
    )
    advertise_address: str = field(
        default="",
        metadata={
            "help": "--role node: the gRPC address gateways are told to reach this node at",
            "default_text": "--host:<bound port>",
        },
    )
    admin_token: str = field(
        default="",
        metadata={
            "help": "OperationsService token",
            "default_text": "generated into <state>/admin_token (0600)",
        },
    )
    tenants_file: str = field(
        default="",
        metadata={
            "help": "tenants' tokens, lines 'name:sha256-hex-of-token' (re-read on SIGHUP); "
            "each tenant sees only its own jobs; empty = off",
            "default_text": "off",
        },
    )
    max_queue: int = field(default=10000, metadata={"help": "queued jobs before Submit is refused"})
    tenant_max_queued: int = field(
        default=0,
        metadata={
            "help": "with --tenants-file: jobs one tenant may have queued at once, past which "
            "its Submit is RESOURCE_EXHAUSTED with a RetryInfo while other tenants' jobs are "
            "still taken; 0: no limit of its own (--max-queue holds for all)"
        },
    )
    tenant_max_running: int = field(
        default=0,
        metadata={
            "help": "with --tenants-file: jobs of one tenant running at once (its share of the "
            "job slots), past which its queued jobs wait in the queue while other tenants' "
            "jobs take the free slots; 0: no limit of its own"
        },
    )
    tenant_max_per_minute: int = field(
        default=0,
        metadata={
            "help": "with --tenants-file: jobs one tenant may submit in any 60 s, past which "
            "its Submit is RESOURCE_EXHAUSTED with a RetryInfo saying when one is taken "
            "again; 0: no limit"
        },
    )
    max_attempts: int = field(
        default=2, metadata={"help": "attempts of one job at most (a re-run after a loss is one)"}
    )
    compile_cache_mib: int = field(
        default=256, metadata={"help": "compiled kernels kept for jobs with the same code; 0 = off"}
    )
    build_cache_mib: int = field(
        default=4096,
        metadata={
            "help": "what was built, kept on disk (<state>/builds) across restarts: load_inline "
            "extensions and the compile cache's kernels, for the same code; 0 = off"
        },
    )
    build_pch: bool = field(
        default=True,
        metadata={
            "help": "make precompiled torch headers (<state>/pch, ~3 GB) at start for build "
            "processes' load_inline builds (with --build-processes)"
        },
    )
    result_cache_hours: float = field(
        default=24.0,
        metadata={
            "help": "a job identical to one that finished OK or INCORRECT this recently (same "
            "kernel, reference, options and target) returns that result; 0 = off"
        },
    )
    retention_hours: float = field(default=168.0, metadata={"help": "keep finished jobs this long"})
    sweep_interval_s: float = field(default=600.0, metadata={"help": "retention sweep period"})
    shutdown_grace_s: float = field(default=30.0, metadata={"help": "running jobs' grace on stop"})
    max_wait_s: float = field(
        default=600.0,
        metadata={
            "help": "a started job that waits this long for one thing (a job process, a judge, "
            "GPU memory, the GPU) ends FAILED with VERDICT_SERVICE_ERROR; a queued job too, "
            "while no job has started for this long; 0 = no bound (jobs/waits.py)"
        },
    )
    xid_wait_s: float = field(
        default=-1.0,
        metadata={
            "help": "wait for an XID after a device fault; -1 = auto",
            "default_text": "auto (2.5 with NVML, else 0)",
        },
    )
    log_level: str = field(default="INFO", metadata={"help": "DEBUG, INFO, WARNING, ERROR"})
    log_file: str = field(
        default="", metadata={"help": "JSON-lines log file", "default_text": "stderr"}
    )
    metrics_port: int = field(default=0, metadata={"help": "Prometheus HTTP port; 0 = off"})
    metrics_host: str = field(default="127.0.0.1", metadata={"help": "Prometheus HTTP address"})
    tls_cert: str = field(default="", metadata={"help": "PEM certificate (TLS on TCP)"})
    tls_key: str = field(default="", metadata={"help": "PEM private key"})
    keepalive_time_s: float = field(default=30.0, metadata={"help": "HTTP/2 keepalive ping"})
    keepalive_timeout_s: float = field(default=10.0, metadata={"help": "keepalive ack timeout"})
    max_message_mb: int = field(default=64, metadata={"help": "largest gRPC message"})
    watchdog: str = field(
        default="",
        metadata={
            "help": "watchdog binary path",
            "default_text": "build/watchdog/kerneleval-watchdog of the checkout, else one on PATH",
        },
    )
    nvml: str = field(default="auto", metadata={"help": "auto, real, fake or none"})
    fake_nvml_path: str = field(default="", metadata={"help": "fake NVML input (tests)"})
    kmsg_path: str = field(default="/dev/kmsg", metadata={"help": "kernel log for XID pids"})
    reset_command: str = field(
        default="nvidia-smi --gpu-reset -i {index}",
        metadata={"help": "GPU reset command ({index}: the GPU's index)"},
    )
    auto_reset: bool = field(default=False, metadata={"help": "reset GPUs on reset-class XIDs"})
    health_interval_s: int = field(default=5, metadata={"help": "NVML reading period"})
    max_restarts: int = field(
        default=5, metadata={"help": "worker failures per window before a device is unhealthy"}
    )
    restart_window_s: int = field(
        default=30, metadata={"help": "restart intensity window, seconds"}
    )
    isolate_network: bool = field(
        default=True, metadata={"help": "job processes without network (always; false is refused)"}
    )
    freeze_during_timing: bool = field(
        default=True,
        metadata={
            "help": "freeze a GPU's other job processes while one times (false: benchmarks only)"
        },
    )
    freeze_warming: bool = field(
        default=True,
        metadata={
            "help": "freeze job processes still warming up (no job given yet) in other jobs' "
            "timing windows too; false: they make their CUDA context and warm up meanwhile "
            "(the service's code only: each is given a job once the watchdog froze it, where "
            "a window is open), so the pool refills while windows are held; measured slower "
            "on an H200 (contexts made in windows lengthen them: RunBatch 0.70x)"
        },
    )
    gpu_memory_share: float = field(
        default=0.85,
        metadata={
            "help": "share of a GPU's memory that checking jobs may hold together, by what "
            "their problem was seen to need (fleet/gpu_memory.py); 0 = no admission"
        },
    )
    job_user: str = field(
        default="",
        metadata={
            "help": "user of job processes when root",
            "default_text": "empty: kerneleval-job, else nobody",
            "aliases": ("worker_user",),
        },
    )
    job_memory_mib: int = field(
        default=0,
        metadata={
            "help": "memory of one job process's cgroup, its /tmp included; 0 = auto: the "
            "host's (its cgroup limit, else MemTotal) less a share for the service, over the "
            "job slots, at least 16 GiB (4 GiB for --role builder)",
            "default_text": "0 (auto: the host's memory over its job slots, at least 16 GiB)",
        },
    )
    job_tmp_mib: int = field(default=1024, metadata={"help": "size of a job process's /tmp"})
    record_max_mib: int = field(
        default=1024,
        metadata={
            "help": "a compared kernel's recorded outputs for its judge process, at most (the "
            "kernel's job process holds them in its memory); larger outputs are judged in the "
            "kernel's own process; 0 judges every job there (no judge process: for measuring "
            "what the judge costs, never for a service whose callers may cheat)"
        },
    )
    record_share_max_mib: int = field(
        default=20480,
        metadata={
            "help": "a compared kernel's outputs past --record-max-mib handed to its judge by "
            "descriptor (device memory on a GPU, held there until judged), at most; larger "
            "outputs are judged in the kernel's own process; 0: none"
        },
    )
    judge_launches: bool = field(
        default=True,
        metadata={
            "help": "compare a Triton or raw CUDA kernel built ahead with an eager reference by "
            "launching the kernel alone in a reused launch process and running the reference "
            "in its judge only (about 3x the RunBatch rate of such jobs on an H100); false: "
            "such a job runs whole in a job process of its own"
        },
    )
    judge_ahead: bool = field(
        default=True,
        metadata={
            "help": "a compared job whose reference has an idle standing judge on its GPU "
            "starts that judge with its kernel: the reference runs on the trials' inputs while "
            "the kernel does, and the verdict waits only for the comparison; false: the judge "
            "starts once the kernel's outputs are in"
        },
    )
    standing_judges_per_device: int = field(
        default=2,
        metadata={
            "help": "judges that stay on a GPU after a job, each for later jobs of its reference "
            "only (a CUDA context's memory each, ~0.5-0.7 GiB, outside the job slots); a judged "
            "job of another reference takes the place of the one idle longest. An RL loop over "
            "N problems wants N: each job of a problem without one starts a judge"
        },
    )
    reference_time_reuse_s: float = field(
        default=60.0,
        metadata={
            "help": "a reference's time, measured by a judge for one job, is given to the next "
            "jobs of the same reference, inputs and timing settings on the same GPU for this "
            "long, instead of a timing window each (KernelBench times a reference once); a job "
            "with bypass_cache times it again; 0: every job times its reference"
        },
    )
    job_max_pids: int = field(
        default=1024, metadata={"help": "processes and threads in one job process's cgroup"}
    )
    sandbox_path: str = field(
        default="",
        metadata={
            "help": "more host paths shown read-only to job processes (comma list, repeatable)",
            "repeat": True,
        },
    )
    engine: str = field(
        default="",
        metadata={"help": "engine module for workers", "default_text": "kerneleval_server.engine"},
    )

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else default_state_dir()

    def database_path(self) -> Path:
        return Path(self.database) if self.database else self.state_path() / "jobs.db"

    def effective_build_processes(self) -> int:
        if self.build_processes >= 0:
            return self.build_processes
        # Builds are CPU work (nvcc, ptxas) and bound distinct candidates' throughput: an H100
        # host with 16 CPUs ran 10.4 built jobs a second with 8 and 16.7 with 14.
        cpus = os.cpu_count() or 1
        if self.role == BUILDER:  # builds are all it does, on a host without a GPU
            return min(32, max(2, cpus - 2))
        return min(32, max(2, cpus - 2)) if os.path.exists("/dev/nvidiactl") else 0

    def effective_job_memory_mib(self) -> int:
        """--job-memory-mib, or when 0 the limit worked out from this host (host_memory.py),
        once: the watchdog's job processes and the results' messages name the same number."""
        return self.job_memory_mib if self.job_memory_mib > 0 else self._auto_job_memory_mib

    @functools.cached_property
    def _auto_job_memory_mib(self) -> int:
        return host_memory.auto_job_memory_mib(
            self._host_memory.bytes, self.job_slots(), self._job_memory_floor_mib()
        )

    def job_slots(self) -> int:
        devices = len(self.device_list()) or host_memory.gpu_count()
        workers = 0 if self.role == BUILDER else self.workers_per_device
        return host_memory.job_slots(workers, devices, self.effective_build_processes())

    def _job_memory_floor_mib(self) -> int:
        return host_memory.BUILD_FLOOR_MIB if self.role == BUILDER else host_memory.FLOOR_MIB

    def job_memory_source(self) -> str:
        """How the job memory limit was set, for the log and the results' messages."""
        if self.job_memory_mib > 0:
            return "--job-memory-mib"
        return (
            f"auto: this host's {self._host_memory.describe()}, {self.job_slots()} job slots, "
            f"at least {self._job_memory_floor_mib()} MiB"
        )

    @functools.cached_property
    def _host_memory(self) -> host_memory.HostMemory:
        return host_memory.host_memory()

    def device_list(self) -> list[int]:
        return [int(d) for d in self.devices.replace(" ", "").split(",") if d]

    def watchdog_binary(self) -> str:
        return self.watchdog or default_watchdog_binary()

    def sandbox_paths(self) -> list[str]:
        return [p for p in (x.strip() for x in self.sandbox_path.split(",")) if p]

    def problems(self) -> list[str]:
        """Settings that cannot work, as messages naming the flag."""
        out = []
        if self.nvml not in ("auto", "real", "fake", "none"):
            out.append(f"--nvml {self.nvml!r}: one of auto, real, fake, none")
        if self.nvml == "fake" and not self.fake_nvml_path:
            out.append("--nvml fake needs --fake-nvml-path")
        if bool(self.tls_cert) != bool(self.tls_key):
            out.append("--tls-cert and --tls-key go together")
        if not -1 <= self.port <= 65535:
            out.append(f"--port {self.port}: 0..65535, or -1 for no TCP listener")
        if not 0 <= self.http_port <= 65535:
            out.append(f"--http-port {self.http_port}: 0 (off) or a port up to 65535")
        if self.port < 0 and not self.unix_socket:
            out.append("--port -1 needs --unix-socket")
        for name in (
            "workers_per_device",
            "spare_count",
            "max_queue",
            "max_attempts",
            "job_tmp_mib",
            "job_max_pids",
            "max_restarts",
            "restart_window_s",
        ):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1")
        if not self.isolate_network:
            out.append(
                "--isolate-network false: job processes always run in a network namespace of "
                "their own, with only lo (the sandbox has no way back to the host's network)"
            )
        for name in ("tenant_max_queued", "tenant_max_running", "tenant_max_per_minute"):
            if getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be >= 0 (0: no limit)")
        if self.reference_time_reuse_s < 0:
            out.append("--reference-time-reuse-s must be >= 0 (0: every job times its reference)")
        if not 0 <= self.build_nice <= 19:
            out.append("--build-nice: 0 to 19")
        if not 0 <= self.cuda_max_connections <= 32:
            out.append("--cuda-max-connections: 0 (CUDA's default) to 32")
        if self.store and not self.store.startswith(("postgresql://", "postgres://")):
            out.append(f"--store {self.store[:40]!r}: a postgresql:// URL (SQLite: --database)")
        if self.role not in (ALL, GATEWAY, NODE, BUILDER):
            out.append(f"--role {self.role!r}: one of all, gateway, node, builder")
        elif self.role != ALL and not self.store:
            out.append(
                f"--role {self.role} needs --store postgresql://...: gateways, nodes and "
                "builders share one PostgreSQL job store (SQLite serves --role all only)"
            )
        if self.role == BUILDER and self.build_processes == 0:
            out.append("--role builder needs build processes: --build-processes >= 1 (or -1)")
        if self.builder_wait_s < 0:
            out.append("--builder-wait-s must be >= 0")
        if self.lease_seconds < 0.5:
            out.append("--lease-seconds must be >= 0.5")
        if self.max_wait_s < 0:
            out.append("--max-wait-s must be >= 0 (0: no bound)")
        if not 0 <= self.gpu_memory_share <= 1:
            out.append("--gpu-memory-share: from 0 (off) to 1")
        if self.job_memory_mib < 0:
            out.append("--job-memory-mib must be >= 0 (0: auto, from the host's memory)")
        if self.build_processes < -1:
            out.append("--build-processes must be >= 0, or -1 for auto")
        if self.compile_cache_mib < 0:
            out.append("--compile-cache-mib must be >= 0")
        if self.build_cache_mib < 0:
            out.append("--build-cache-mib must be >= 0")
        for name in ("record_max_mib", "record_share_max_mib"):
            if getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be >= 0")
        if self.job_user == "root":
            out.append("--job-user root: job processes never run as root")
        for path in self.sandbox_paths():
            if not os.path.isabs(path):
                out.append(f"--sandbox-path {path!r}: an absolute path")
        try:
            self.device_list()
        except ValueError:
            out.append(f"--devices {self.devices!r}: comma-separated GPU indices")
        return out

    def effective_xid_wait_s(self) -> float:
        if self.xid_wait_s >= 0:
            return self.xid_wait_s
        return 2.5 if self.nvml in ("auto", "real") else 0.0


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def default_text(f: Field[Any]) -> str:
    """A setting's default as --help and the README show it ("" for none)."""
    shown = f.metadata.get("default_text")
    if shown is not None:
        return str(shown)
    if isinstance(f.default, bool):
        return "true" if f.default else "false"
    if isinstance(f.default, float):
        return f"{f.default:g}"
    return str(f.default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        env = "KERNELEVAL_" + f.name.upper()
        kind: Any = {bool: _parse_bool, int: int, float: float}.get(type(f.default), str)
        shown = default_text(f)
        default = f"; default: {shown}" if shown else ""
        # argparse formats help with %: a literal one (none today) must be doubled.
        help_text = f"{f.metadata.get('help', '')} (env {env}{default})".replace("%", "%%")
        # Deprecated spellings (--worker-user) are accepted, not listed.
        flags = [flag] + ["--" + a.replace("_", "-") for a in f.metadata.get("aliases", ())]
        if f.metadata.get("repeat"):
            parser.add_argument(
                *flags, dest=f.name, type=kind, default=None, action="append", help=help_text
            )
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=None, help=help_text)


def from_args(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> Config:
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in fields(Config):
        given = getattr(ns, f.name, None)
        if isinstance(given, list):  # a repeatable flag: one comma list
            given = ",".join(given)
        if given is None:
            names = [f.name, *f.metadata.get("aliases", ())]
            raw = next(
                (env[v] for v in ("KERNELEVAL_" + n.upper() for n in names) if v in env), None
            )
            if raw is None:
                continue
            kind: Any = {bool: _parse_bool, int: int, float: float}.get(type(f.default), str)
            try:
                given = kind(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                sys.exit(f"KERNELEVAL_{f.name.upper()}: {exc}")
        values[f.name] = given
    return Config(**values)
