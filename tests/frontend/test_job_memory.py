"""The job process memory limit that fits the workloads (issue 41) and what a job past it is
told.

Worked out from the host when --job-memory-mib is not given (host_memory.py): the cgroup limit
where one is set (the lent GPU machines' MemTotal starts small and grows), else MemTotal, less
the front end's share, over the job slots, at least 16 GiB: KernelBench level 3's
2_ShallowWideMLP builds 8 GiB of fp32 weights on the host. A job past its limit says so in
EvalResult.error.message (where clients and the CLI look first): which memory, how much against
what limit, the flag, and on a host without a GPU that smaller inputs would run.

The last test runs a real service inside a memory cgroup of its own (cgroup v1, as root): its
limit is the host's memory the service sees, the auto limit reaches the job process's real
cgroup, and a job past it is killed there and told so.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from ke_service import ServiceProcess, real_watchdog_available
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc
from kerneleval_server import host_memory
from kerneleval_server.config import BUILDER, Config
from kerneleval_server.fleet import faults

GIB = 1 << 30
MIB = 1 << 20
# 2_ShallowWideMLP's model built on the host (fp32 weights 8.0 GiB): its process's peak RSS,
# measured on the CPU machine (/usr/bin/time: 8.2 GiB), and room for the process itself.
SHALLOW_WIDE_MLP_PEAK_MIB = 8_420
PROCESS_ROOM_MIB = 2_048


# ---- the host's memory --------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_limit_of_the_services_own_cgroup_or_one_above_it(tmp_path: Path) -> None:
    """v1: the memory hierarchy, the service's folder and those above; the smallest set."""
    unlimited = "9223372036854771712\n"
    write(tmp_path / "memory" / "memory.limit_in_bytes", unlimited)
    write(tmp_path / "memory" / "pods" / "memory.limit_in_bytes", str(256 * GIB))
    write(tmp_path / "memory" / "pods" / "svc" / "memory.limit_in_bytes", unlimited)
    proc = "9:pids:/pods/svc\n4:memory:/pods/svc\n0::/\n"
    limit = host_memory.cgroup_limit(tmp_path, proc)
    assert limit is not None and limit[0] == 256 * GIB
    assert limit[1].endswith("pods/memory.limit_in_bytes")
    write(tmp_path / "memory" / "memory.limit_in_bytes", unlimited)
    write(tmp_path / "memory" / "pods" / "memory.limit_in_bytes", unlimited)
    assert host_memory.cgroup_limit(tmp_path, proc) is None  # none set: MemTotal then


def test_cgroup_v2_memory_max(tmp_path: Path) -> None:
    write(tmp_path / "cgroup.controllers", "cpu memory pids\n")
    write(tmp_path / "kubepods" / "memory.max", f"{64 * GIB}\n")
    write(tmp_path / "kubepods" / "pod1" / "memory.max", "max\n")
    limit = host_memory.cgroup_limit(tmp_path, "0::/kubepods/pod1\n")
    assert limit == (64 * GIB, str(tmp_path / "kubepods" / "memory.max"))
    # A container with its own cgroup namespace: its limit at the root of what it sees.
    write(tmp_path / "memory.max", f"{32 * GIB}\n")
    assert host_memory.cgroup_limit(tmp_path, "0::/\n") == (32 * GIB, str(tmp_path / "memory.max"))


def test_the_cgroup_limit_wins_over_memtotal(tmp_path: Path) -> None:
    """The lent GPU machines read 31 GiB of MemTotal at start under a 256 GiB limit."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {31 * GIB // 1024} kB\nMemFree: 1 kB\n")
    assert host_memory.mem_total(meminfo) == 31 * GIB
    cg = tmp_path / "cg"
    write(cg / "cgroup.controllers", "memory\n")
    write(cg / "memory.max", f"{256 * GIB}\n")
    seen = host_memory.host_memory(cg, meminfo, "0::/\n")
    assert seen.bytes == 256 * GIB and "cgroup limit" in seen.source
    assert host_memory.host_memory(tmp_path / "none", meminfo, "0::/\n").bytes == 31 * GIB


# ---- the limit worked out from it ---------------------------------------------------------


def test_the_default_lets_shallow_wide_mlp_run_on_a_128_gib_host() -> None:
    """The issue's host: 128 GiB, one GPU with 16 job processes, 14 build processes."""
    slots = host_memory.job_slots(16, 1, 14)
    limit = host_memory.auto_job_memory_mib(128 * GIB, slots)
    assert limit >= SHALLOW_WIDE_MLP_PEAK_MIB + PROCESS_ROOM_MIB, limit
    assert limit <= 128 * 1024 - 4 * 1024  # never the whole host: the front end keeps a share


def test_a_larger_host_gives_each_slot_its_share() -> None:
    two_tib = 2048 * GIB
    limit = host_memory.auto_job_memory_mib(two_tib, host_memory.job_slots(1, 8, 32))
    assert limit == (two_tib - 32 * GIB) // MIB // (2 * 8 + 32)  # past the floor: the share
    assert limit > host_memory.FLOOR_MIB


def test_a_small_host_gets_what_it_has_less_the_front_ends_share() -> None:
    assert host_memory.auto_job_memory_mib(8 * GIB, 2) == 4 * 1024
    assert host_memory.auto_job_memory_mib(2 * GIB, 2) == host_memory.MIN_MIB


def test_a_builders_processes_only_compile_and_fit_its_pod_together() -> None:
    """deploy/kubernetes builder: a 56 GiB limit, 6 build processes."""
    limit = host_memory.auto_job_memory_mib(56 * GIB, 6, host_memory.BUILD_FLOOR_MIB)
    assert host_memory.BUILD_FLOOR_MIB <= limit and 6 * limit * MIB < 56 * GIB


def test_config_auto_unless_given() -> None:
    cfg = Config()
    assert cfg.job_memory_mib == 0  # auto
    expected = host_memory.auto_job_memory_mib(
        host_memory.host_memory().bytes, cfg.job_slots(), host_memory.FLOOR_MIB
    )
    assert cfg.effective_job_memory_mib() == expected
    assert cfg.job_memory_source().startswith("auto: this host's ")
    given = Config(job_memory_mib=3000)
    assert given.effective_job_memory_mib() == 3000
    assert given.job_memory_source() == "--job-memory-mib"
    assert Config(job_memory_mib=-1).problems() == [
        "--job-memory-mib must be >= 0 (0: auto, from the host's memory)"
    ]
    builder = Config(role=BUILDER, store="postgresql://x/y", build_processes=6)
    assert builder.job_slots() == 6  # its build processes only


# ---- what the result says -------------------------------------------------------------------

LIMITS = faults.MemoryLimits(job_mib=16384, tmp_mib=1024, source="auto: this host's 128 GiB")


def cgroup_oom(device_index: int, phase: int = job_pb2.PHASE_VALIDATING) -> job_pb2.EvalResult:
    exited = job_pb2.EvalResult()
    worker_exit = watchdog_pb2.WorkerExited(signal=9, reason="oom", restarting=True)
    worker_exit.worker.worker_id = "gpu0-w7"
    worker_exit.worker.device_index = device_index
    decision = faults.classify_exit(worker_exit, pending="", xid=None, phase=phase, timeout_s=120)
    assert decision.verdict == job_pb2.VERDICT_OUT_OF_MEMORY and decision.error is not None
    exited.verdict = decision.verdict  # type: ignore[assignment]
    exited.fault.CopyFrom(decision.fault)
    exited.error.CopyFrom(decision.error)
    return exited


def test_a_job_killed_at_its_cgroups_limit_is_told_which_memory_how_much_and_the_flag() -> None:
    result = cgroup_oom(0)
    faults.explain_memory(result, 0, LIMITS)
    first = result.error.message.splitlines()[0]
    assert first.startswith("out of host memory: the job's processes used all 16384 MiB")
    assert "--job-memory-mib" in first and "auto: this host's 128 GiB" in first
    assert "PHASE_VALIDATING" in result.error.message  # the fault's description follows
    assert "smaller inputs" not in result.error.message  # a GPU host: its inputs are the GPU's


def test_on_a_host_without_a_gpu_it_says_smaller_inputs_would_run() -> None:
    result = cgroup_oom(-1)
    faults.explain_memory(result, -1, LIMITS)
    assert "this host has no GPU" in result.error.message
    assert "smaller inputs would run: --io" in result.error.message
    assert "get_inputs" in result.error.message


def test_while_its_model_is_built_it_is_the_limit_not_the_inputs() -> None:
    """KernelBench level 3's 2_ShallowWideMLP under the old 8 GiB: killed building its
    weights, on any host; smaller inputs would not help."""
    result = cgroup_oom(-1, phase=job_pb2.PHASE_COMPILING)
    faults.explain_memory(result, -1, LIMITS)
    assert result.error.message.startswith("out of host memory: the job's processes used all")
    assert "smaller inputs" not in result.error.message


def test_gpu_memory_is_named_with_torchs_numbers() -> None:
    said = (
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 "
        "GiB of which 3.20 GiB is free.\nallocator: 75.1 GiB allocated"
    )
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OUT_OF_MEMORY)
    result.error.message = said
    faults.explain_memory(result, 0, LIMITS)
    lines = result.error.message.splitlines()
    assert lines[0].startswith("out of GPU memory on GPU 0")
    assert "smaller inputs" in lines[0]
    assert "\n".join(lines[1:]) == said  # torch's numbers kept below


def test_a_host_allocation_refused_names_the_host_limit() -> None:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OUT_OF_MEMORY)
    result.error.message = "[enforce fail] DefaultCPUAllocator: can't allocate memory: 40 GB"
    faults.explain_memory(result, -1, LIMITS)
    assert result.error.message.startswith("out of host memory: an allocation was refused")
    assert "16384 MiB" in result.error.message and "--job-memory-mib" in result.error.message
    assert "smaller inputs would run" in result.error.message


def test_a_full_tmp_names_its_size_and_flag() -> None:
    result = job_pb2.EvalResult(verdict=job_pb2.VERDICT_RUNTIME_ERROR)
    result.error.message = "[Errno 28] No space left on device: '/tmp/x'"
    faults.explain_memory(result, 0, LIMITS)
    assert result.error.message.startswith("the job's /tmp or /dev/shm is full")
    assert "1024 MiB (--job-tmp-mib" in result.error.message


def test_said_once() -> None:
    result = cgroup_oom(0)
    faults.explain_memory(result, 0, LIMITS)
    once = result.error.message
    faults.explain_memory(result, 0, LIMITS)
    assert result.error.message == once


def test_other_results_are_left_as_they_are() -> None:
    for verdict in (job_pb2.VERDICT_OK, job_pb2.VERDICT_RUNTIME_ERROR):
        result = job_pb2.EvalResult(verdict=verdict)
        result.error.message = "ValueError: no"
        faults.explain_memory(result, -1, LIMITS)
        assert result.error.message == "ValueError: no"


# ---- a real job past the auto limit, in a real cgroup ---------------------------------------

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
SERVICE_CGROUP_BYTES = 6 * GIB  # the service's "host": 2 GiB a job once the front end's 4 kept
EXPECTED_JOB_MIB = 2048

# Inputs sized for a GPU, on the CPU machine: 3 GiB, past the job's 2 GiB.
HOG = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x[:8].float()
def get_inputs():
    return [torch.ones(3 << 30, dtype=torch.uint8)]  # touched: charged to the job's cgroup
def get_init_inputs():
    return []
"""

SMALL = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2
def get_inputs():
    return [torch.randn(64)]
def get_init_inputs():
    return []
"""


def cgroup_v1_writable() -> bool:
    return (
        os.geteuid() == 0
        and (CGROUP_V1_MEMORY / "cgroup.procs").exists()
        and os.access(CGROUP_V1_MEMORY, os.W_OK)
    )


class ServiceInCgroup(ServiceProcess):
    """The service started inside a memory cgroup of its own."""

    cgroup: Path

    def command(self) -> list[str]:
        join = f'echo $$ > {self.cgroup}/cgroup.procs && exec "$@"'
        return ["sh", "-c", join, "sh", *super().command()]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceInCgroup]:
    if not cgroup_v1_writable():
        pytest.skip("needs root and a writable cgroup v1 memory hierarchy")
    if not real_watchdog_available():
        pytest.skip("needs the watchdog")
    cgroup = CGROUP_V1_MEMORY / f"kerneleval-test-memory-{secrets.token_hex(4)}"
    cgroup.mkdir()
    (cgroup / "memory.limit_in_bytes").write_text(str(SERVICE_CGROUP_BYTES))
    service = ServiceInCgroup(
        tmp_path_factory.mktemp("memory") / "state",
        ["--workers-per-device", "1", "--spare-count", "1", "--log-level", "INFO"],
    )
    service.cgroup = cgroup
    try:
        service.start(timeout=180)
        yield service
    finally:
        service.stop()
        for sub in sorted(cgroup.rglob("*"), key=lambda p: -len(p.parts)):
            if sub.is_dir():
                sub.rmdir()
        cgroup.rmdir()


@pytest.fixture(scope="module")
def stub(svc: ServiceInCgroup) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def evaluate(stub, source: str) -> job_pb2.Job:  # type: ignore[no-untyped-def]
    spec = kernel_pb2.JobSpec()
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.kernel.source_code = source
    spec.options.perf_trial_count = 0
    spec.options.correct_trial_count = 1
    return stub.Evaluate(pb.EvaluateRequest(spec=spec), timeout=180).job


def test_the_auto_limit_is_the_job_cgroups_and_a_job_past_it_is_told(stub, svc) -> None:  # type: ignore[no-untyped-def]
    log = svc.log_path.read_text(errors="replace")
    assert f"job processes: {EXPECTED_JOB_MIB} MiB of memory each (auto: this host's 6.0 GiB " \
        f"(the cgroup limit, {svc.cgroup}/memory.limit_in_bytes)" in log, svc.log_tail()
    # The limit reached a job process's real cgroup (the watchdog makes it under its own).
    with svc.channel() as ch:
        devices = ops_grpc.OperationsServiceStub(ch).ListDevices(
            ops.ListDevicesRequest(), metadata=svc.auth(), timeout=30
        )
    pids = [w.pid for d in devices.devices for w in d.workers if w.pid]
    assert pids, devices
    limits = set()
    for pid in pids:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                limits.add(int((CGROUP_V1_MEMORY / path.lstrip("/") / "memory.limit_in_bytes")
                               .read_text()))  # fmt: skip
    assert EXPECTED_JOB_MIB * MIB in limits, limits

    job = evaluate(stub, HOG)
    result = job.result
    assert result.verdict == job_pb2.VERDICT_OUT_OF_MEMORY, result
    first = result.error.message.splitlines()[0]
    assert first.startswith(f"out of host memory: the job's processes used all {EXPECTED_JOB_MIB}")
    assert "--job-memory-mib" in first
    assert "this host has no GPU" in result.error.message  # the CPU machine
    assert "smaller inputs would run" in result.error.message
    assert job.attempt_count == 1  # its own doing: not run again

    # An honest job after it runs under the same limit.
    assert evaluate(stub, SMALL).result.verdict == job_pb2.VERDICT_OK


def test_what_the_sandbox_hides_is_said_once_at_start_and_not_per_job(svc) -> None:  # type: ignore[no-untyped-def]
    from kerneleval_server.main import SANDBOX_HIDES

    log = svc.log_path.read_text(errors="replace")
    assert log.count(SANDBOX_HIDES.replace('"', '\\"')) == 1, svc.log_tail()
    assert "Can't initialize NVML" not in log.replace(SANDBOX_HIDES.replace('"', '\\"'), "")
    assert "multi-threaded, use of fork()" not in log
