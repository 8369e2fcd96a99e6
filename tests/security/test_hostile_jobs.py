"""The hostile-job suite (issue 12): each attack a tenant made through the public API, as a job.

One real service (the C++ watchdog, the zygote, sealed job processes) with small limits. For
each attack: the hostile job (tests/security/hostile_sources.py) ends with its expected verdict,
"ESCAPED" appears nowhere in its result or log, nothing of it is left on the host, and then two
jobs of other tenants on the same device are judged right: a correct candidate is VERDICT_OK
with correctness, a wrong one (x + 1 where the reference returns x) is VERDICT_INCORRECT, which
catches a forged verdict. The bad-input cases go through the API only.

Runs as root on Linux with the watchdog built (`make watchdog`), as CI runs `make test`.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import hostile_sources as hs
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from ke_service import REPO, ServiceProcess, real_watchdog_available
from kerneleval.v1 import dtype_pb2, job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox is Linux only"),
    pytest.mark.skipif(
        sys.platform.startswith("linux") and os.geteuid() != 0,
        reason="runs as root, as CI does: the job user, cgroups and namespaces need it",
    ),
    pytest.mark.skipif(
        not real_watchdog_available(), reason="the watchdog is not built: run `make watchdog`"
    ),
    pytest.mark.timeout(180),
]

MIB = 1 << 20
MEMORY_MIB = 1024
TMP_MIB = 64
MAX_PIDS = 256
JOB_TIMEOUT_S = 20  # any job that should finish; the attacks that must time out use less
NONCE = secrets.token_hex(4)
V = job_pb2.Verdict
NOT_OK_KILLED = {
    job_pb2.VERDICT_OUT_OF_MEMORY,
    job_pb2.VERDICT_CRASHED,
    job_pb2.VERDICT_RESOURCE_LIMIT,
}


# ---- the service ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    yield from hostile_service(tmp_path_factory)


def hostile_service(
    tmp_path_factory: pytest.TempPathFactory,
    record_max_mib: int = 2,
    args: Sequence[str] = (),
    name: str = "",
) -> Iterator[ServiceProcess]:
    """The suite's service. `record_max_mib`: 2 here, so that outputs over 1 MiB of a trial
    go to the judge by descriptor (BIG_REFERENCE's); each recorded trial takes over 1 MiB of
    the record (its header's room), so a GPU MODE task's cases need more. `args`: more flags
    (the later ones win), `name`: what tells its state folder from the others'."""
    # The state folder is outside /tmp on purpose: a job's private /tmp would hide one under
    # /tmp anyway, and the point is that the sandbox hides it wherever it is.
    root = Path(f"/var/tmp/kerneleval-hostile-{NONCE}-{record_max_mib}{name}")
    root.mkdir(parents=True)
    nvml = root / "fake_nvml"
    nvml.write_text(
        "device 0 name=FakeGPU-H100 uuid=GPU-fake-0000 memory_total=80000000000\n"
        "health 0 memory_used=1000000 temperature=41 utilization=3 ok=1\n"
    )
    state = root / "state"
    service = ServiceProcess(
        state,
        [
            "--nvml",
            "fake",
            "--fake-nvml-path",
            str(nvml),
            "--unix-socket",
            str(state / "grpc.sock"),
            "--job-memory-mib",
            str(MEMORY_MIB),
            "--job-tmp-mib",
            str(TMP_MIB),
            "--job-max-pids",
            str(MAX_PIDS),
            "--workers-per-device",
            "1",
            "--spare-count",
            "2",
            "--health-interval-s",
            "1",
            "--log-level",
            "INFO",
            "--record-max-mib",
            str(record_max_mib),
            *args,
        ],
    )
    service.unix_socket = str(state / "grpc.sock")
    try:
        service.start()
        yield service
    finally:
        service.stop()
        remove_planted_files(state)
        if service.log_path.exists():  # kept with pytest's temporary folders
            shutil.copy(service.log_path, tmp_path_factory.mktemp("hostile") / "service.log")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


@pytest.fixture(autouse=True)
def service_up(svc: ServiceProcess) -> None:
    """An attack that killed the service failed its own test; the next test gets it back."""
    if svc.proc is not None and svc.proc.poll() is not None:
        svc.start()


def remove_planted_files(state: Path) -> None:
    """Files an attack could have planted if it escaped (unique names): never leave them."""
    tag = f"ke_hostile_{NONCE}"
    roots = {REPO, state, Path("/root"), Path("/tmp"), Path(sys.prefix), Path(sys.base_prefix)}
    roots |= {Path(p) for p in sys.path if p and os.path.isdir(p)}
    for root in roots:
        depth0 = str(root).rstrip("/").count("/")
        for base, dirs, files in os.walk(root):
            if base.count("/") - depth0 >= 5:
                dirs[:] = []
            dirs[:] = [d for d in dirs if d not in ("objects", "node_modules")]
            for name in files:
                if name.startswith(tag):
                    Path(base, name).unlink(missing_ok=True)


# ---- host processes ---------------------------------------------------------------------------


@dataclass
class Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    nspid: list[int]
    start: int  # clock ticks after boot: with pid, names one process for good


def host_processes() -> list[Proc]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            base = f"/proc/{entry}"
            with open(f"{base}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            with open(f"{base}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"{base}/status") as f:
                status = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        nspid = [
            int(x)
            for line in status.splitlines()
            if line.startswith("NSpid:")
            for x in line.split()[1:]
        ]
        out.append(Proc(int(entry), int(fields[1]), comm, cmdline, nspid, int(fields[19])))
    return out


def find(pred: Callable[[Proc], bool]) -> list[Proc]:
    return [p for p in host_processes() if pred(p)]


def service_pids(svc: ServiceProcess, timeout: float = 30.0) -> dict[str, Proc]:
    """The front end, its watchdog and the zygote (waits for the zygote to be up)."""
    assert svc.proc is not None
    deadline = time.monotonic() + timeout
    while True:
        procs = host_processes()
        out = {p_name: p for p_name, p in (("frontend", _by_pid(procs, svc.proc.pid)),) if p}
        wd = [p for p in procs if p.ppid == svc.proc.pid and "watchdog" in p.cmdline]
        if wd:
            out["watchdog"] = wd[0]
            zyg = [
                p
                for p in procs
                if "jobproc.zygote" in p.cmdline and len(p.nspid) == 1 and p.ppid == wd[0].pid
            ]
            if zyg:
                out["zygote"] = zyg[0]
        if len(out) == 3 or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def _by_pid(procs: list[Proc], pid: int) -> Proc | None:
    return next((p for p in procs if p.pid == pid), None)


def alive(p: Proc) -> bool:
    now = _by_pid(host_processes(), p.pid)
    return now is not None and now.start == p.start


def wait_none(pred: Callable[[Proc], bool], what: str, timeout: float = 6.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = find(pred)
        if not left:
            return
        if time.monotonic() > deadline:
            shown = [(p.pid, p.comm, p.cmdline[:80]) for p in left[:10]]
            raise AssertionError(f"{len(left)} {what} still running {timeout} s after: {shown}")
        time.sleep(0.2)


# ---- jobs -------------------------------------------------------------------------------------


def spec(
    source: str,
    *,
    reference: str | None = None,
    client_tag: str,
    timeout_s: int = JOB_TIMEOUT_S,
    perf_trials: int = 0,
) -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec(client_tag=client_tag)
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.kernel.source_code = source
    if reference is not None:
        s.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
        s.reference.source_code = reference
    s.options.correct_trial_count = 1
    s.options.perf_trial_count = perf_trials
    s.options.warmup_count = 1
    s.options.timeout.seconds = timeout_s
    return s


@dataclass
class Ran:
    job: job_pb2.Job
    logs: str
    seconds: float
    seen: int = 0
    log_events: list[str] | None = None

    @property
    def verdict(self) -> int:
        return self.job.result.verdict

    def text(self) -> str:
        r = self.job.result
        return "\n".join(
            [
                r.error.message,
                r.error.exception_type,
                r.error.traceback,
                r.compilation_error,
                r.validation_error,
                r.fault.description,
                self.job.state_reason,
                *r.notes,
                self.logs,
            ]
        )

    def describe(self) -> str:
        r = self.job.result
        return (
            f"verdict {V.Name(r.verdict)}, state {job_pb2.JobState.Name(self.job.state)} "
            f"({self.job.state_reason}), {self.seconds:.1f} s, error "
            f"{r.error.exception_type}: {r.error.message[:600]!r}, compile "
            f"{r.compilation_error[:600]!r}, fault {r.fault.description!r}, "
            f"log {self.logs[-600:]!r}"
        )


TERMINAL = (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_CANCELLED, job_pb2.JOB_STATE_FAILED)


def run_job(
    stub,  # type: ignore[no-untyped-def]
    s: kernel_pb2.JobSpec,
    svc: ServiceProcess,
    watch: Callable[[Proc], bool] | None = None,
) -> Ran:
    """Submits, waits for the end (counting the host processes `watch` matches meanwhile, the
    most at once in Ran.seen), then reads the stored log back."""
    t0 = time.monotonic()
    try:
        job = stub.Submit(pb.SubmitRequest(spec=s), timeout=30).job
    except grpc.RpcError as exc:
        raise AssertionError(
            f"{exc.code()} {exc.details()}; service log:\n{svc.log_tail(40)}"
        ) from None
    return wait_job(stub, job, s, svc, watch, t0)


def wait_job(
    stub,  # type: ignore[no-untyped-def]
    job: job_pb2.Job,
    s: kernel_pb2.JobSpec,
    svc: ServiceProcess,
    watch: Callable[[Proc], bool] | None = None,
    t0: float | None = None,
) -> Ran:
    """run_job's wait for the end of `job`, submitted (at monotonic `t0`) with `s`, and its
    log read back."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        deadline = t0 + s.options.timeout.seconds + 90
        seen = 0
        while job.state not in TERMINAL:
            assert time.monotonic() < deadline, f"no end in time; log:\n{svc.log_tail(40)}"
            if watch is not None:
                seen = max(seen, len(find(watch)))
            time.sleep(0.05)
            job = stub.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=30).job
        seconds = time.monotonic() - t0
        events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job.job_id), timeout=60)]
    except grpc.RpcError as exc:
        raise AssertionError(
            f"{exc.code()} {exc.details()}; service log:\n{svc.log_tail(40)}"
        ) from None
    logs = [e.log.text for e in events if e.HasField("log")]
    return Ran(job, "".join(logs), seconds, seen, logs)


def assert_contained(ran: Ran) -> None:
    assert "ESCAPED" not in ran.text(), ran.describe()


def attack(
    stub,  # type: ignore[no-untyped-def]
    svc: ServiceProcess,
    name: str,
    code: str,
    cfg: dict | None = None,
    timeout_s: int = JOB_TIMEOUT_S,
    watch: Callable[[Proc], bool] | None = None,
) -> Ran:
    source = hs.hostile_source(name, code, cfg)
    s = spec(source, client_tag=f"mallory-{name}", timeout_s=timeout_s)
    ran = run_job(stub, s, svc, watch)
    print(f"{name}: {ran.describe()}; {ran.seen} watched processes at most")
    assert ran.job.state in (job_pb2.JOB_STATE_DONE, job_pb2.JOB_STATE_FAILED), ran.describe()
    assert_contained(ran)
    return ran


def assert_reported(ran: Ran, name: str) -> None:
    """The attack ran to its end and said what stopped it (its notes, through its log)."""
    assert f"hostile job {name}:" in ran.logs, f"the attack did not report: {ran.describe()}"


def next_tenants_are_judged_right(stub, svc: ServiceProcess, after: Ran) -> None:  # type: ignore[no-untyped-def]
    """Two jobs of other tenants on the same device: the correct one OK, the wrong INCORRECT."""
    tag = after.job.spec.client_tag.replace("mallory", "")
    good = run_job(
        stub,
        spec(hs.victim_source(wrong=False), reference=hs.REFERENCE, client_tag=f"alice{tag}"),
        svc,
    )
    assert_contained(good)
    assert good.verdict == job_pb2.VERDICT_OK and good.job.result.correctness, good.describe()
    assert good.job.device_index == after.job.device_index
    bad = run_job(
        stub,
        spec(hs.victim_source(wrong=True), reference=hs.REFERENCE, client_tag=f"bob{tag}"),
        svc,
    )
    assert_contained(bad)
    assert bad.verdict == job_pb2.VERDICT_INCORRECT, bad.describe()
    assert not bad.job.result.correctness
    assert bad.job.device_index == after.job.device_index
    assert svc.proc is not None and svc.proc.poll() is None, svc.log_tail()


_FOUND: dict[str, bool] = {}


def base_cfg(svc: ServiceProcess) -> dict:
    # The first call waits for the zygote; later ones only look.
    pids = service_pids(svc, timeout=2.0 if _FOUND else 30.0)
    _FOUND["once"] = True
    return {
        "nonce": NONCE,
        "state": str(svc.state_dir),
        "repo": str(REPO),
        "port": svc.port,
        "sockets": [svc.unix_socket, str(svc.state_dir / "frontend.sock")],
        "pids": {k: p.pid for k, p in pids.items()},
        "host_pids": [p.pid for p in pids.values()],
        # Shown read-only to jobs at their own paths (the Python installation, the venv).
        "code_paths": [
            os.path.realpath(p) + "/"
            for p in (sys.prefix, sys.base_prefix, os.path.dirname(sys.executable))
        ],
    }


def comm_name(what: str) -> str:
    return f"keh{what[:4]}{NONCE}"[:15]


# ---- the attacks --------------------------------------------------------------------------


def test_engine_patch_from_the_module_body(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.1: run_job and compare_outputs replaced, sys.modules entries planted, files
    planted in import folders; none of it reaches the next tenant."""
    ran = attack(stub, svc, "engine-patch", hs.ENGINE_PATCH, base_cfg(svc))
    assert_reported(ran, "engine-patch")
    # The patch acts in the attacker's own process after its job started: its own verdict is
    # whatever its process reports; only the next jobs' verdicts matter.
    assert ran.job.state == job_pb2.JOB_STATE_DONE, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_daemon_dies_with_its_job_and_finds_no_way_in(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.2 and 12.3: double fork + setsid, SIGTERM ignored, renamed; no token in the
    environment, no socket it can connect to; gone when the job ends."""
    name = comm_name("daemon")
    cfg = {**base_cfg(svc), "comm": name}
    ran = attack(stub, svc, "daemon", hs.DAEMON, cfg, watch=lambda p: p.comm == name)
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "daemon")
    assert ran.seen >= 1, "the daemon was never seen running"
    wait_none(lambda p: p.comm == name, f"processes named {name}")
    next_tenants_are_judged_right(stub, svc, ran)


def test_job_ignoring_sigterm_times_out_and_leaves_nothing(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.3: SIGTERM ignored by the job and by a setsid child; sleeps past its timeout."""
    name = comm_name("sigterm")
    timeout = 3
    cfg = {**base_cfg(svc), "comm": name}
    ran = attack(
        stub, svc, "sigterm", hs.IGNORE_SIGTERM, cfg, timeout, watch=lambda p: p.comm == name
    )
    assert ran.verdict == job_pb2.VERDICT_TIMEOUT, ran.describe()
    assert ran.seen >= 2, f"the job and its child were not seen running ({ran.seen})"
    assert ran.seconds < timeout + 15, ran.describe()
    wait_none(lambda p: p.comm == name, f"processes named {name}")
    next_tenants_are_judged_right(stub, svc, ran)


def test_host_files_are_out_of_reach(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.4: the admin token, jobs.db, the repository, /root: not readable; the state
    folder and the repository: not writable. And what the job process is: not root, PID 1 of
    its own namespace, only lo, seccomp filter, no_new_privs, no capabilities."""
    token_before = svc.admin_token
    ran = attack(stub, svc, "host-files", hs.HOST_FILES, base_cfg(svc))
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "host-files")
    assert token_before not in ran.text()
    tag = f"ke_hostile_{NONCE}"
    planted = [
        p
        for p in (svc.state_dir / tag, REPO / tag, REPO / "server" / tag, REPO / "tests" / tag)
        if p.exists()
    ]
    assert not planted, planted
    next_tenants_are_judged_right(stub, svc, ran)


def test_killing_the_front_end_and_the_watchdog_fails(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.4: SIGKILL to the front end, the watchdog and the zygote by their host pids,
    then kill(-1): the service stays up, the same processes, later jobs correct."""
    before = service_pids(svc)
    assert {"frontend", "watchdog", "zygote"} <= set(before), (
        f"service processes not found: {before}"
    )
    cfg = base_cfg(svc)
    ran = attack(stub, svc, "kill", hs.KILL_SERVICE, cfg)
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "kill")
    assert svc.proc is not None and svc.proc.poll() is None, svc.log_tail()
    assert svc.proc.pid == before["frontend"].pid
    for what, p in before.items():
        assert alive(p), f"the {what} ({p.pid}) was killed"
    next_tenants_are_judged_right(stub, svc, ran)
    for what, p in before.items():
        assert alive(p), f"the {what} ({p.pid}) is gone after the next jobs"


def test_no_way_back_into_the_host_network(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.4: setns into the front end's network namespace, unshare(CLONE_NEWUSER),
    mount, the seccomp-refused syscalls, a connection to the service's port and socket."""
    ran = attack(stub, svc, "setns", hs.SETNS, base_cfg(svc))
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "setns")
    next_tenants_are_judged_right(stub, svc, ran)


def test_fork_bomb_ends_with_its_job(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.3 and the pids limit: a fork bomb until the timeout; nothing of it remains."""
    name = comm_name("forkbomb")
    timeout = 5
    cfg = {**base_cfg(svc), "comm": name}
    ran = attack(stub, svc, "fork-bomb", hs.FORK_BOMB, cfg, timeout, watch=lambda p: p.comm == name)
    assert ran.seen >= 20, f"the bomb was not seen forking ({ran.seen} processes)"
    assert ran.seen <= MAX_PIDS, f"{ran.seen} processes of the bomb at once"
    assert ran.verdict != job_pb2.VERDICT_OK, ran.describe()
    assert ran.verdict in (
        job_pb2.VERDICT_TIMEOUT,
        job_pb2.VERDICT_RESOURCE_LIMIT,
        job_pb2.VERDICT_CRASHED,
    ), ran.describe()
    assert ran.seconds < timeout + 15, ran.describe()
    wait_none(lambda p: p.comm == name, f"processes of the fork bomb ({name})", timeout=10)
    next_tenants_are_judged_right(stub, svc, ran)


def test_six_thousand_spawned_children(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.3: 6000 posix_spawn children: the pids limit stops them; none remains."""
    arg = f"{4000 + int(NONCE[:4], 16) % 1000}.{int(NONCE[4:], 16) % 1000:03d}"
    cfg = {**base_cfg(svc), "sleep_arg": arg, "max_pids": MAX_PIDS}
    sleeper = f"sleep {arg}"
    ran = attack(
        stub, svc, "spawn", hs.SPAWN_MANY, cfg, timeout_s=30, watch=lambda p: p.cmdline == sleeper
    )
    assert ran.verdict != job_pb2.VERDICT_OK, ran.describe()
    assert 0 < ran.seen <= MAX_PIDS, f"{ran.seen} children at once"
    assert "of 6000 children" in ran.text(), ran.describe()
    wait_none(lambda p: p.cmdline == sleeper, f"'{sleeper}' children")
    next_tenants_are_judged_right(stub, svc, ran)


def test_memory_bomb_is_killed(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.5: 4 GiB allocated and touched under a 1 GiB limit."""
    ran = attack(stub, svc, "memory-bomb", hs.MEMORY_BOMB, base_cfg(svc))
    assert ran.verdict == job_pb2.VERDICT_OUT_OF_MEMORY, ran.describe()
    assert ran.job.attempt_count == 1, ran.describe()  # its own doing: not run again
    next_tenants_are_judged_right(stub, svc, ran)


def test_filling_tmp_stops_at_its_size_and_nothing_carries_over(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.5: /tmp written until ENOSPC (near its 64 MiB); its marker is gone for the next
    job (the victims' module bodies look for it) and is not on the host either."""
    cfg = {**base_cfg(svc), "tmp_bytes": TMP_MIB * MIB}
    ran = attack(stub, svc, "fill-tmp", hs.FILL_TMP, cfg)
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "fill-tmp")
    assert not list(Path("/tmp").glob(f"ke_marker_{NONCE}")), "the marker is in the host's /tmp"
    next_tenants_are_judged_right(stub, svc, ran)


def test_system_v_ipc_objects_do_not_reach_the_next_job(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Shared memory, a message queue and semaphores made by one job are gone for the next job
    on the GPU (each job process has its own IPC namespace), and were never in the host's."""
    ran = attack(stub, svc, "ipc", hs.IPC_LEFTOVERS, base_cfg(svc))
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert_reported(ran, "ipc")
    assert "made System V objects" in ran.logs, ran.describe()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.shmget(0x4B450C01, 0, 0) < 0 and libc.msgget(0x4B450C01, 0) < 0
    next_tenants_are_judged_right(stub, svc, ran)


@pytest.mark.parametrize(
    "code, expect",
    [
        (hs.OVERSIZED_FRAME, ["20971520", "16777216"]),
        (hs.GARBAGE_FRAME, []),
        (hs.FORGED_FRAME, ["job"]),
        (hs.UNKNOWN_VERDICT_FRAME, ["unknown verdict 999"]),
    ],
    ids=["oversized", "garbage", "other-job", "unknown-verdict"],
)
def test_bad_frames_on_the_channel_end_the_job(
    stub,  # type: ignore[no-untyped-def]
    svc: ServiceProcess,
    code: str,
    expect: list[str],
) -> None:
    """Issue 12 (the channel): a frame over 16 MiB, garbage of a valid length, or a forged
    outcome for another job, on fd 3: the job process is killed and the job ends RUNTIME_ERROR
    naming a protocol violation."""
    ran = attack(stub, svc, "frame", code, base_cfg(svc))
    r = ran.job.result
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert r.error.exception_type == "ProtocolViolation", ran.describe()
    for word in expect:
        assert word in r.error.message, ran.describe()
    assert ran.seconds < JOB_TIMEOUT_S - 5, f"killed only by the timeout: {ran.describe()}"
    assert ran.job.attempt_count == 1, "a protocol violation is not retried"
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    opstub.GetStats(ops.GetStatsRequest(), metadata=svc.auth())  # names every stored verdict
    next_tenants_are_judged_right(stub, svc, ran)


def test_an_outcome_sent_by_the_candidate_neither_keeps_its_process_nor_poisons_the_cache(
    stub,  # type: ignore[no-untyped-def]
    svc: ServiceProcess,
) -> None:
    """A candidate writes its own job's outcome on fd 3, with compile-cache files (one path
    climbing out of the folder), and goes on running. The job ends with what it sent (a job
    reports itself: docs/INTERNALS.md), but its process is killed a few seconds later, the
    files are refused, and nothing reaches the next jobs, not even ones with the same code."""
    cfg = base_cfg(svc)
    first = attack(stub, svc, "cache", hs.CACHE_POISON, cfg)
    assert "compile cache held []" in first.logs, first.describe()
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    deadline = time.monotonic() + 20
    while True:
        live = {
            w.worker_id
            for d in opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
            for w in d.workers
        }
        if first.job.worker_id not in live:
            break
        assert time.monotonic() < deadline, f"{first.job.worker_id} still runs after its outcome"
        time.sleep(0.2)
    assert not Path(f"/tmp/ke_escaped_{NONCE}").exists()
    again = attack(stub, svc, "cache", hs.CACHE_POISON, cfg)  # the same code: same cache key
    assert "compile cache held []" in again.logs, again.describe()
    next_tenants_are_judged_right(stub, svc, again)


def test_grants_asked_ahead_give_no_window_and_no_second_check(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """PhaseUpdate.ahead sent by the candidate's module body: for a timing window, for its
    check again and again. No window is held for it (the GPU's timing-window time does not
    move) and its untimed job ends as any. One asked for another job too breaks the channel's
    protocol: killed. The next tenants are judged right."""

    def window_seconds() -> float:
        occupancy = (
            ops_grpc.OperationsServiceStub(svc.channel())
            .GetStats(ops.GetStatsRequest(), metadata=svc.auth(), timeout=10)
            .device_occupancy
        )
        return sum(o.timing_window.ToNanoseconds() / 1e9 for o in occupancy)

    before = window_seconds()
    ran = attack(stub, svc, "ahead", hs.AHEAD_ASKS, base_cfg(svc))
    assert_reported(ran, "ahead")
    assert "asked ahead 6 times" in ran.logs, ran.describe()
    assert ran.job.state == job_pb2.JOB_STATE_DONE, ran.describe()
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert window_seconds() == before
    other = attack(stub, svc, "ahead", hs.AHEAD_ASKS, {**base_cfg(svc), "other": True})
    assert other.verdict == job_pb2.VERDICT_RUNTIME_ERROR, other.describe()
    assert other.job.result.error.exception_type == "ProtocolViolation", other.describe()
    assert window_seconds() == before
    next_tenants_are_judged_right(stub, svc, other)


def test_a_candidate_that_closes_its_channel_and_stays_is_killed(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """It closes fd 3 after disarming os._exit: its job is lost (run again, then CRASHED), its
    process killed seconds later each time, and the device goes on judging the next jobs."""
    ran = attack(stub, svc, "close", hs.CHANNEL_CLOSED, base_cfg(svc), timeout_s=60)
    assert ran.verdict == job_pb2.VERDICT_CRASHED, ran.describe()
    assert ran.seconds < 50, ran.describe()  # lost and killed, not held to its 60 s timeout
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    deadline = time.monotonic() + 20
    while ran.job.worker_id in {
        w.worker_id
        for d in opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
        for w in d.workers
    }:
        assert time.monotonic() < deadline, f"{ran.job.worker_id} still runs"
        time.sleep(0.2)
    next_tenants_are_judged_right(stub, svc, ran)


def test_log_flood_is_capped_with_a_note(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.5: 300 MB printed and 300 MB of log lines on the channel: the job process is
    killed once it passed the channel's budget (64 MiB), the stored log is capped and says it
    was cut, and neither the store nor the service's own log took the flood."""
    db = svc.state_dir / "jobs.db"

    def db_bytes() -> int:
        return sum(p.stat().st_size for p in (db, db.with_name("jobs.db-wal")) if p.exists())

    db_before = db_bytes()
    svc_log_before = svc.log_path.stat().st_size
    ran = attack(stub, svc, "log-flood", hs.LOG_FLOOD, base_cfg(svc), timeout_s=60)
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert ran.job.result.error.exception_type == "ProtocolViolation", ran.describe()
    assert "64 MiB on its channel" in ran.job.result.error.message, ran.describe()
    stored = [
        r.event.log.text
        for r in stub.Watch(pb.WatchRequest(job_id=ran.job.job_id), timeout=60)
        if r.event.HasField("log")
    ]
    total = sum(len(t.encode()) for t in stored)
    assert total <= MIB + 64 * 1024, f"{total} bytes of log stored"
    assert stored and stored[-1].startswith("[kerneleval: log output cut"), (
        f"no note that the log was cut; {len(stored)} log events, {total} bytes, last "
        f"{stored[-1][:200] if stored else None!r}"
    )
    assert db_bytes() - db_before < 16 * MIB, "the job store took the flood"
    assert svc.log_path.stat().st_size - svc_log_before < 16 * MIB, "the service log took it"
    next_tenants_are_judged_right(stub, svc, ran)


# ---- bad input (issue 12.5-12.7) ------------------------------------------------------------


def violations(err: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "no google.rpc.Status in the trailers"
    fields = []
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad):
            fields += [v.field for v in bad.field_violations]
    return fields


def newest_job_id(stub) -> str:  # type: ignore[no-untyped-def]
    jobs = stub.ListJobs(pb.ListJobsRequest(page_size=1), timeout=10).jobs
    return jobs[0].job_id if jobs else ""


REPLAYER = """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        # honest while it is checked (fresh inputs each trial), then last result handed back
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls <= 3 or not hasattr(self, "last"):
            self.last = x + 0.0
        return self.last


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""


def test_results_handed_back_in_the_timed_trials(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: honest through its check, then replaying its last result for the timed
    trials (which pass the same tensors each time) to look fast: one timed trial runs on new
    inputs written in place, so it ends INCORRECT with the replayed_outputs flag, and the
    next tenants are judged right."""
    s = spec(REPLAYER, reference=hs.REFERENCE, client_tag="mallory-replay", perf_trials=20)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert [f.rule_id for f in ran.job.result.flags] == ["replayed_outputs"], ran.describe()
    assert ran.job.result.validation.trials_passed == 1  # it passed its correctness trial
    next_tenants_are_judged_right(stub, svc, ran)


# Every comparison in the process that imports it passes, whatever it is given.
FORGED_COMPARE = """
import kerneleval_server.engine.compare as cmp
import kerneleval_server.engine.runner as runner

_orig = cmp.compare_outputs


def _forged(*a, **k):
    c = _orig(*a, **k)
    c.ok, c.message = True, ""
    return c


cmp.compare_outputs = _forged
runner.compare.compare_outputs = _forged
"""
# Forges its own process's comparison (and so its replay check): every trial passes there,
# while its forward returns zeros where the reference returns x.
FORGER = (
    FORGED_COMPARE
    + """
import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""
)


def test_a_forged_verdict_is_judged_in_another_process(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: the kernel's process forges its comparison and comes back OK there; the judge
    process, which imports only the reference, finds it INCORRECT. The next tenants too are
    judged right."""
    s = spec(FORGER, reference=hs.REFERENCE, client_tag="mallory-forger", perf_trials=5)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert not ran.job.result.correctness and ran.job.result.speedup == 0, ran.describe()
    assert "judged by" in ran.logs, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# The same, with 4 MiB of outputs a trial: past the record (--record-max-mib 2), handed to the
# judge by descriptor (engine/device_share.py).
BIG_REFERENCE = hs.REFERENCE.replace("torch.randn(64)", "torch.randn(1 << 20)")
BIG_FORGER = FORGER.replace("torch.randn(64)", "torch.randn(1 << 20)")
# ... and from its module body it sends the judge a share of its own first (a pipe said to be
# the first output's memory), on the record's socket it finds in the runtime's frame.
SHARE_FORGER = BIG_FORGER.replace(
    "import torch\n",
    """import torch
import os, socket, struct, sys

_f, _recorder = sys._getframe(), None
while _f is not None and _recorder is None:
    _recorder = _f.f_locals.get("recorder")
    _f = _f.f_back
_r, _w = os.pipe()
_s = socket.socket(fileno=os.dup(_recorder._share_fd))
socket.send_fds(_s, [struct.pack(">BQQ", 2, 1, 4 << 20)], [_r])
""",
    1,
)


def test_a_forger_with_outputs_past_the_record_is_judged_from_its_shares(
    stub, svc: ServiceProcess
) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: outputs over the record's limit (47 of KernelBench's level-1 problems have
    outputs over its 1 GiB default) are handed to the judge by descriptor, not judged in the
    kernel's process: the forger is INCORRECT there as with small outputs; an honest kernel of
    the same size is OK, judged the same way. The next tenants are judged right."""
    s = spec(BIG_FORGER, reference=BIG_REFERENCE, client_tag="mallory-big-forger", perf_trials=5)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert "judged by" in ran.logs, ran.describe()
    honest = BIG_REFERENCE.replace("class Model(", "class ModelNew(")
    ok = run_job(
        stub, spec(honest, reference=BIG_REFERENCE, client_tag="alice-big", perf_trials=5), svc
    )
    assert ok.verdict == job_pb2.VERDICT_OK, ok.describe()
    assert "judged by" in ok.logs, ok.describe()
    assert not any("kernel's own process" in n for n in ok.job.result.notes), ok.describe()
    next_tenants_are_judged_right(stub, svc, ran)


def test_a_share_forged_on_the_record_socket_is_tampering(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: the candidate's module body sends the judge a share of its own (a pipe said to
    be its output's memory) before its outputs are handed over: the judge, which reads the
    socket only once the kernel's process is gone, refuses the record as tampering."""
    s = spec(SHARE_FORGER, reference=BIG_REFERENCE, client_tag="mallory-share", perf_trials=5)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert ran.job.result.error.message.startswith("tampering: "), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# Writes its own job's outcome on fd 3 (OK, correct, speedup 50, a 1 us kernel) from its module
# body, before anything ran, and leaves.
OUTCOME_FORGER = """
import os
import sys

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server.framing import encode

f, job_id = sys._getframe(), ""
while f is not None and not job_id:
    job_id = getattr(f.f_locals.get("assign"), "job_id", "")
    f = f.f_back
r = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK, compiled=True, correctness=True, speedup=50.0)
r.runtime.median_ms = 0.001
r.runtime.trial_count = 5
out = job_channel_pb2.JobOutcome(job_id=job_id, result=r)
os.write(3, encode(job_channel_pb2.JobProcessMessage(outcome=out).SerializeToString()))
os._exit(0)
"""


def test_a_forged_outcome_is_judged_in_another_process(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: a compared job's process writes its own OK outcome (speedup 50) and exits
    before its kernel ran: the judge finds no recorded outputs, and the job ends a tampering
    RUNTIME_ERROR, not OK. The next tenants are judged right."""
    s = spec(OUTCOME_FORGER, reference=hs.REFERENCE, client_tag="mallory-outcome", perf_trials=5)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert ran.job.result.error.message.startswith("tampering: "), ran.describe()
    assert ran.job.result.speedup == 0 and not ran.job.result.HasField("runtime"), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# The forger's outcome a failure that claims its outputs passed and a speedup: the failure
# keeps it from its judge, the claim would still read as correct.
FAILING_FORGER = OUTCOME_FORGER.replace(
    "verdict=job_pb2.VERDICT_OK, compiled=True, correctness=True,",
    "verdict=job_pb2.VERDICT_RUNTIME_ERROR, compiled=True, correctness=True,"
    " correctness_status=job_pb2.CORRECTNESS_PASSED,",
).replace(
    "r.runtime.trial_count = 5", "r.runtime.trial_count = 5\nr.reference_runtime.median_ms = 1.0"
)


def test_a_failing_outcome_claiming_correct_reads_unchecked(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: a compared job's process reports a failure of its own that claims its
    outputs passed (speedup 50): no judge saw them, so the job ends as it says, with
    correctness not reached and no speedup. The next tenants are judged right."""
    assert "CORRECTNESS_PASSED" in FAILING_FORGER and "reference_runtime" in FAILING_FORGER
    s = spec(FAILING_FORGER, reference=hs.REFERENCE, client_tag="mallory-fails", perf_trials=5)
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert not r.correctness, ran.describe()
    assert r.correctness_status == job_pb2.CORRECTNESS_UNSPECIFIED, ran.describe()
    assert r.speedup == 0 and not r.HasField("reference_runtime"), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# An honest kernel whose module body writes a reference time of 1e6 ms (an earlier job's, it
# says, and a speedup) into its own process's result: the judge's time of the reference is
# given to the next jobs of that reference (--reference-time-reuse-s), never such a claim.
FORGES_REFERENCE_TIME = (
    """
import sys

f = sys._getframe()
while f is not None:
    job = f.f_locals.get("self")
    if hasattr(job, "result") and hasattr(job.result, "reference_runtime"):
        job.result.reference_runtime.median_ms = 1e6
        job.result.reference_runtime_age.seconds = 1
        job.result.speedup = 1000.0
        break
    f = f.f_back
"""
    + hs.victim_source(wrong=False)
)


def test_a_forged_reference_time_is_not_given_to_the_next_tenant(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12: a reference's time is kept for the next jobs of that reference; a kernel's
    process that claims one (1e6 ms) has it replaced by its judge's, and the next tenant's
    job is given the judge's time, not the claim. Then the next tenants are judged right."""
    s = spec(FORGES_REFERENCE_TIME, reference=hs.REFERENCE, client_tag="mallory-reftime",
             perf_trials=5)  # fmt: skip
    s.options.seed = 1212  # a key of its own: no earlier test's time is given to it
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    measured = r.reference_runtime.median_ms
    assert 0 < measured < 1e3 and r.speedup < 1000, ran.describe()
    assert not any("an earlier job's" in n for n in r.notes), ran.describe()
    assert not r.HasField("reference_runtime_age"), ran.describe()
    alice = spec(hs.victim_source(wrong=False), reference=hs.REFERENCE,
                 client_tag="alice-reftime", perf_trials=5)  # fmt: skip
    alice.options.seed = 1212
    given = run_job(stub, alice, svc)
    a = given.job.result
    assert given.verdict == job_pb2.VERDICT_OK, given.describe()
    assert a.reference_runtime.median_ms == measured, given.describe()
    assert any("an earlier job's" in n for n in a.notes), given.describe()
    assert a.HasField("reference_runtime_age"), given.describe()
    # Unjudged (an Evaluate: nothing compared), its claim of an earlier time is dropped too.
    alone = run_job(stub, spec(FORGES_REFERENCE_TIME, client_tag="mallory-reftime-alone",
                               perf_trials=5), svc)  # fmt: skip
    assert alone.verdict == job_pb2.VERDICT_OK, alone.describe()
    assert not alone.job.result.HasField("reference_runtime_age"), alone.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# A GPU MODE task (ref_kernel doubles) and a submission that makes every check in its own
# process pass and hands back zeros (the engine's tests' own, tests/engine).
sys.path.insert(0, str(REPO / "tests" / "engine"))
from test_gpumode import DOUBLE_REFERENCE as GPU_MODE_REFERENCE  # noqa: E402
from test_judge_gpumode import FORGER as GPU_MODE_FORGER  # noqa: E402


def test_a_gpu_mode_forger_is_judged_in_another_process(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: a GPU MODE submission whose module body makes its own process's checks pass
    comes out INCORRECT from its judge, case by case; an honest one is OK there. The next
    tenants are judged right."""
    s = kernel_pb2.JobSpec(client_tag="mallory-gpumode")
    s.kernel.type = s.reference.type = kernel_pb2.KERNEL_TYPE_GPU_MODE
    s.kernel.source_code, s.reference.source_code = GPU_MODE_FORGER, GPU_MODE_REFERENCE
    # One case: the fixture's 2 MiB record holds one (each reserves 1 MiB for its header);
    # a case over the record's limits is judged in the kernel's process, as for any kernel.
    case = s.gpu_mode.tests.add()
    case.args.add(name="n", int_value=64)
    case.args.add(name="seed", int_value=10)
    s.options.timeout.seconds = JOB_TIMEOUT_S
    s.options.perf_trial_count = 0
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert ran.verdict == job_pb2.VERDICT_INCORRECT, ran.describe()
    assert [c.passed for c in r.test_cases] == [False], ran.describe()
    assert "judged by" in ran.logs, ran.describe()
    s.kernel.source_code = "def custom_kernel(data):\n    return data * 2\n"
    s.client_tag = "bob-gpumode"
    honest = run_job(stub, s, svc)
    assert honest.verdict == job_pb2.VERDICT_OK, honest.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# A kernel whose module body marks its process, and a reference that hangs where that mark is
# missing: only in the judge's process (which never imports the kernel).
MARKS_ITS_PROCESS = """
import builtins
import torch

builtins._ke_kernel_ran_here = True


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + 0.0
"""
HANGS_IN_THE_JUDGE = """
import builtins
import time
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        if not getattr(builtins, "_ke_kernel_ran_here", False):
            time.sleep(60)
        return x + 0.0


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""


def test_a_hanging_judge_times_out_and_a_cancel_ends_it(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """The judge's stage keeps the job's deadline and its cancel: a reference that hangs only
    in the judge's process ends VERDICT_TIMEOUT at the job's timeout, and a cancel while the
    judge runs ends the job CANCELLED at once; neither is lost, and the next tenants are
    judged right."""
    s = spec(MARKS_ITS_PROCESS, reference=HANGS_IN_THE_JUDGE, client_tag="judge-hang", timeout_s=6)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_TIMEOUT, ran.describe()
    assert "judged by" in ran.logs and ran.seconds < 30, ran.describe()
    s.options.timeout.seconds = JOB_TIMEOUT_S
    job = stub.Submit(pb.SubmitRequest(spec=s), timeout=30).job
    deadline = time.monotonic() + 60
    while not any("judged by" in r.event.log.text for r in _events(stub, job.job_id)):
        assert time.monotonic() < deadline, svc.log_tail(40)
        time.sleep(0.1)
    t0 = time.monotonic()
    stub.CancelJob(pb.CancelJobRequest(job_id=job.job_id), timeout=30)
    job = stub.GetJob(pb.GetJobRequest(job_id=job.job_id), timeout=30).job
    assert job.state == job_pb2.JOB_STATE_CANCELLED, job
    assert time.monotonic() - t0 < 15
    next_tenants_are_judged_right(stub, svc, ran)


def _events(stub, job_id: str) -> list[pb.WatchResponse]:  # type: ignore[no-untyped-def]
    """The job's events so far (Watch of a job still running streams on: read with a short
    deadline and keep what came)."""
    out: list[pb.WatchResponse] = []
    try:
        for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=0.5):
            out.append(r)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
    return out


# Patches the engine's timing from its module body (the clock, the measurement), so that its
# own process would report it fast; its forward is the reference's.
TIMER_PATCHER = """
import time
import torch
import kerneleval_server.engine.timing as timing

_real = time.perf_counter_ns
time.perf_counter_ns = lambda: _real() // 10
_measure = timing.measure
timing.measure = lambda *a, **k: _measure(*a, **k)


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return x + 0.0
"""


def test_a_patched_timer_ends_in_tampering(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 13: the module body patches the clock and timing.measure; the job process, armed
    before the job's code was imported, sees it after the timed trials: a tampering
    RUNTIME_ERROR with the timer_tampered flag, no time. The next tenants are judged right."""
    s = spec(TIMER_PATCHER, reference=hs.REFERENCE, client_tag="mallory-timer", perf_trials=5)
    ran = run_job(stub, s, svc)
    assert ran.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert ran.job.result.error.message.startswith("tampering: "), ran.describe()
    assert "timer_tampered" in [f.rule_id for f in ran.job.result.flags], ran.describe()
    assert not ran.job.result.HasField("runtime"), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# A reference whose module body makes the judge's comparison pass whatever it is given: in
# the judge's process, which stays for the next job with this same reference (a standing
# judge), the patch stays too.
REFERENCE_FORGING_ITS_JUDGE = FORGED_COMPARE + hs.REFERENCE


def _judge_of(ran: Ran) -> str:
    found = re.search(r"judged by (\S+?),", ran.logs)
    assert found, ran.describe()
    return found.group(1)


def test_a_standing_judge_takes_only_jobs_of_its_own_reference(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """A judge that judged cleanly stays for the next job with the same reference, byte for
    byte. A reference that forges its judge's comparison from its module body keeps that
    forgery for its own jobs only (the same code would forge a fresh judge just the same):
    the next jobs, with another reference, are judged by other processes, and right."""
    wrong = hs.victim_source(wrong=True)
    first = run_job(
        stub, spec(wrong, reference=REFERENCE_FORGING_ITS_JUDGE, client_tag="mallory-judge-1"), svc
    )
    second = run_job(
        stub, spec(wrong, reference=REFERENCE_FORGING_ITS_JUDGE, client_tag="mallory-judge-2"), svc
    )
    for ran in (first, second):  # what its own reference says
        assert ran.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert _judge_of(second) == _judge_of(first), second.describe()  # it stood
    assert "which judged 1 earlier job(s) of this reference only" in second.logs
    # Another reference, and a kernel that passes in its own process: judged elsewhere.
    forger = run_job(stub, spec(FORGER, reference=hs.REFERENCE, client_tag="mallory-judge-3"), svc)
    assert forger.verdict == job_pb2.VERDICT_INCORRECT, forger.describe()
    assert _judge_of(forger) != _judge_of(first), forger.describe()
    next_tenants_are_judged_right(stub, svc, second)


AHEAD = "the reference ran there on the trials' inputs while the kernel ran"


def _idle(svc: ServiceProcess, worker_id: str) -> None:
    """Until the job process has no job (a standing judge back from the one it left)."""
    opstub = ops_grpc.OperationsServiceStub(svc.channel())
    deadline = time.monotonic() + 20
    while True:
        workers = {
            w.worker_id: w
            for d in opstub.ListDevices(ops.ListDevicesRequest(), metadata=svc.auth()).devices
            for w in d.workers
        }
        if worker_id in workers and not workers[worker_id].job_id:
            return
        assert time.monotonic() < deadline, f"{worker_id}: {workers.get(worker_id)}"
        time.sleep(0.1)


def test_a_judge_started_ahead_trusts_nothing_of_the_kernel_and_is_left_by_a_failed_job(  # type: ignore[no-untyped-def]
    stub, svc: ServiceProcess
) -> None:
    """--judge-ahead: a standing judge of the reference runs it while the kernel runs. A
    forger whose own process passes it (a patched comparison, zeros out) is judged there:
    INCORRECT. A wrong kernel is judged there too (its judge times it: its own process
    compares nothing). A kernel that fails in its own process ends its job before its outputs
    are in: its judge, started ahead, leaves it, keeps nothing of it and stands. The next
    tenant of that reference is judged ahead by the same process, right, and so are the
    tenants after."""
    reference = hs.REFERENCE + "\n# a reference of this test's own: its own standing judge\n"
    honest, wrong_source = hs.victim_source(wrong=False), hs.victim_source(wrong=True)
    first = run_job(stub, spec(honest, reference=reference, client_tag="alice-ahead-1"), svc)
    assert first.verdict == job_pb2.VERDICT_OK, first.describe()
    judge = _judge_of(first)
    _idle(svc, judge)
    forger = run_job(stub, spec(FORGER, reference=reference, client_tag="mallory-ahead"), svc)
    assert forger.verdict == job_pb2.VERDICT_INCORRECT, forger.describe()
    assert AHEAD in forger.logs and _judge_of(forger) == judge, forger.describe()
    _idle(svc, judge)
    wrong_spec = spec(wrong_source, reference=reference, client_tag="eve-ahead", perf_trials=1)
    wrong = run_job(stub, wrong_spec, svc)
    assert wrong.verdict == job_pb2.VERDICT_INCORRECT, wrong.describe()
    assert AHEAD in wrong.logs and _judge_of(wrong) == judge, wrong.describe()
    _idle(svc, judge)
    failing = honest.replace("return x.clone()", "raise RuntimeError('eve fails here')")
    assert failing != honest
    failed = run_job(stub, spec(failing, reference=reference, client_tag="eve-fails"), svc)
    assert failed.verdict == job_pb2.VERDICT_RUNTIME_ERROR, failed.describe()
    assert "judged by" not in failed.logs, failed.describe()  # ended in its own process
    _idle(svc, judge)  # it left the job and stands
    after = run_job(stub, spec(honest, reference=reference, client_tag="alice-ahead-2"), svc)
    assert after.verdict == job_pb2.VERDICT_OK and after.job.result.correctness, after.describe()
    assert AHEAD in after.logs and _judge_of(after) == judge, after.describe()
    next_tenants_are_judged_right(stub, svc, after)


def test_oversized_input_is_refused_and_not_stored(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.5/12.6: a 20 MiB literal tensor and a 15 MB client_tag: INVALID_ARGUMENT naming
    the field; no job stored, no job process held."""
    before = newest_job_id(stub)
    big = spec(hs.victim_source(wrong=False), reference=hs.REFERENCE, client_tag="carol-big")
    arg = big.kernel.io.args.add(name="x", role=kernel_pb2.ARG_ROLE_INPUT)
    arg.tensor.shape.append(5 * MIB)
    arg.tensor.dtype = dtype_pb2.DTYPE_FLOAT32  # 4 bytes an element: 20 MiB of data
    arg.tensor.data = b"\0" * (20 * MIB)
    for call in (stub.Submit, stub.Evaluate):
        req = (pb.SubmitRequest if call is stub.Submit else pb.EvaluateRequest)(spec=big)
        with pytest.raises(grpc.RpcError) as info:
            call(req, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        fields = violations(info.value)
        assert any(f.startswith("spec.kernel.io.args[0]") or f == "spec" for f in fields), fields
    tagged = spec(hs.victim_source(wrong=False), client_tag="t" * (15 * 1000 * 1000))
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(pb.SubmitRequest(spec=tagged), timeout=60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert "spec.client_tag" in violations(info.value)
    assert newest_job_id(stub) == before, "a refused job was stored"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_malformed_requests_get_client_error_codes(stub, svc: ServiceProcess) -> None:  # type: ignore[no-untyped-def]
    """Issue 12.7: invalid UTF-8 and truncated bytes, a page token and an after_sequence past
    int64, RestartWorkers of a device the service lacks: a client error, never UNKNOWN or
    INTERNAL."""
    client_errors = {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.NOT_FOUND,
    }
    with svc.channel() as ch:
        submit_raw = ch.unary_unary(
            "/kerneleval.v1.KernelEvalService/Submit",
            request_serializer=None,
            response_deserializer=pb.SubmitResponse.FromString,
        )
        good = spec(hs.victim_source(wrong=False), client_tag="dave").SerializeToString()
        bad_utf8 = good + b"\x22\x02\xff\xfe"  # client_tag (field 4) = two invalid bytes
        requests = {
            "invalid UTF-8": b"\x0a" + _varint(len(bad_utf8)) + bad_utf8,
            "truncated": (b"\x0a" + _varint(len(good)) + good)[:-7],
        }
        wrong = []
        for what, raw in requests.items():
            with pytest.raises(grpc.RpcError) as info:
                submit_raw(raw, timeout=30)
            if info.value.code() != grpc.StatusCode.INVALID_ARGUMENT:
                wrong.append((what, info.value.code(), info.value.details()))
        import base64

        token = base64.urlsafe_b64encode(f"r{2**63 + 5}".encode()).decode().rstrip("=")
        with pytest.raises(grpc.RpcError) as info:
            stub.ListJobs(pb.ListJobsRequest(page_token=token), timeout=10)
        if info.value.code() not in client_errors - {grpc.StatusCode.NOT_FOUND}:
            wrong.append(("page token past int64", info.value.code(), info.value.details()))
        job_id = newest_job_id(stub)
        if job_id:
            with pytest.raises(grpc.RpcError) as info:
                list(
                    stub.Watch(pb.WatchRequest(job_id=job_id, after_sequence=2**64 - 1), timeout=10)
                )
            if info.value.code() not in client_errors - {grpc.StatusCode.NOT_FOUND}:
                wrong.append(("after_sequence past int64", info.value.code(), info.value.details()))
        opstub = ops_grpc.OperationsServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            opstub.RestartWorkers(
                ops.RestartWorkersRequest(device_index=7), metadata=svc.auth(), timeout=30
            )
        if info.value.code() != grpc.StatusCode.NOT_FOUND:
            wrong.append(("RestartWorkers device 7", info.value.code(), info.value.details()))
    assert not wrong, wrong


# Raises the engine's own stop exception from its forward: the engine fills in a verdict before
# each stop of its own, so one without a verdict is the candidate's.
STOP_RAISER = """
import torch
from kerneleval_server.engine import runner


class ModelNew(torch.nn.Module):
    def forward(self, x):
        raise runner._Stop()


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""
# Returns a tensor subclass whose every torch operation raises after the first few: the
# engine's own handling of the output (recording it for the judge, checking it) meets it.
RAISING_SUBCLASS = """
import torch


class Sly(torch.Tensor):
    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        Sly.calls += 1
        if Sly.calls > 2:
            raise RuntimeError("sly tensor says no")
        return super().__torch_function__(func, types, args, kwargs or {})


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return (x + 0).as_subclass(Sly)


def get_inputs():
    return [torch.randn(64)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (STOP_RAISER, "the kernel's code raised the engine's own stop exception"),
        (RAISING_SUBCLASS, "sly tensor says no"),
    ],
    ids=["stop-exception", "raising-tensor-subclass"],
)
def test_what_a_candidate_raises_inside_the_engine_is_a_verdict_on_it(  # type: ignore[no-untyped-def]
    stub, svc: ServiceProcess, source: str, said: str
) -> None:
    """Issue 40: a candidate that raises the engine's stop exception (it ended DONE with
    VERDICT_UNSPECIFIED) or returns an object whose methods raise in the engine's hands (an
    "internal engine error") ends VERDICT_RUNTIME_ERROR on the kernel's side, saying what
    it did; the next tenants are judged right."""
    s = spec(source, reference=hs.REFERENCE, client_tag="mallory-raiser", perf_trials=3)
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert ran.job.state == job_pb2.JOB_STATE_DONE, ran.describe()
    assert r.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert r.failed_side == job_pb2.SIDE_KERNEL, ran.describe()
    assert said in r.error.message and "internal engine error" not in r.error.message
    next_tenants_are_judged_right(stub, svc, ran)
