"""Issue 12 through the real service and the real watchdog: what the host refuses the sandbox
is said in GetStats and in `kerneleval doctor`, never silently.

The watchdog is made to warn by configuration: a job user that does not exist (a sandbox
feature: no job process starts), and a kernel log it cannot read (a warning that is no part
of the sandbox).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import fe_kernels as k
import pytest
from ke_service import ServiceProcess
from kerneleval import cli, doctor
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import kernel_eval_service_pb2_grpc
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc

NO_USER = "kerneleval-no-such-user"
NO_KMSG = "/nonexistent/kmsg"
Capture = pytest.CaptureFixture[str]
FAKE_GPU = (
    "device 0 name=FakeGPU-H200 uuid=GPU-fake-0000 memory_total=150000000000\n"
    "health 0 memory_used=1000000 temperature=41 utilization=3 ok=1\n"
)


def _service(root: Path, *args: str) -> ServiceProcess:
    nvml = root / "fake_nvml"
    nvml.write_text(FAKE_GPU)
    # The watchdog reads the kernel log only where it has NVML: the fake one here.
    return ServiceProcess(
        root / "state",
        ["--nvml", "fake", "--fake-nvml-path", str(nvml), "--kmsg-path", NO_KMSG, *args],
    )


@pytest.fixture(scope="module")
def no_user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = _service(tmp_path_factory.mktemp("sandbox-no-user"), "--job-user", NO_USER)
    try:
        svc.start(wait_serving=False)  # no job process can start: never SERVING
        yield svc
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def with_user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    svc = _service(tmp_path_factory.mktemp("sandbox-kmsg"))
    try:
        svc.start()
        yield svc
    finally:
        svc.stop()


def stats_when(
    svc: ServiceProcess, done: Callable[[ops.GetStatsResponse], bool], timeout: float = 30.0
) -> ops.GetStatsResponse:
    with svc.channel() as ch:
        stub = ops_grpc.OperationsServiceStub(ch)
        deadline = time.monotonic() + timeout
        while True:
            st = stub.GetStats(ops.GetStatsRequest(), metadata=svc.auth(), timeout=5)
            if done(st) or time.monotonic() > deadline:
                return st
            time.sleep(0.1)


def doctor_report(
    svc: ServiceProcess, capsys: Capture, monkeypatch: pytest.MonkeyPatch, *extra: str
) -> str:
    # The host's torch and tools are no concern here: the service section is.
    monkeypatch.setattr(doctor, "check_python_stack", lambda r: r.section("torch").add("x", "y"))
    capsys.readouterr()
    code = cli.main(["--address", svc.address, "--admin-token", svc.admin_token, "doctor", *extra])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_a_missing_job_user_is_in_get_stats(no_user: ServiceProcess) -> None:
    st = stats_when(
        no_user, lambda s: {"unprivileged_user", "kmsg"} <= {w.feature for w in s.sandbox_warnings}
    )
    by_feature = {w.feature: w for w in st.sandbox_warnings}
    assert set(by_feature) >= {"unprivileged_user", "kmsg"}, st
    user = by_feature["unprivileged_user"]
    assert user.sandbox_feature and NO_USER in user.message
    assert "no job processes start" in user.message
    assert user.first_seen.seconds > 0 and user.first_seen.ToNanoseconds() <= time.time_ns()
    kmsg = by_feature["kmsg"]
    assert not kmsg.sandbox_feature and NO_KMSG in kmsg.message
    assert st.sandbox_state == ops.SANDBOX_STATE_INCOMPLETE
    # Each feature once in the list, and once at WARNING in the service's log.
    assert len(st.sandbox_warnings) == len(by_feature)
    warned = [
        json.loads(line)["message"]
        for line in no_user.log_path.read_text().splitlines()
        if line.startswith("{") and json.loads(line)["level"] == "WARNING"
    ]
    assert [m for m in warned if m.startswith("sandbox incomplete (unprivileged_user)")] == [
        f"sandbox incomplete (unprivileged_user): {user.message}"
    ]
    assert [m for m in warned if m.startswith("watchdog warning: kmsg")] == [
        f"watchdog warning: kmsg: {kmsg.message}"
    ]


def test_doctor_flags_the_missing_feature(
    no_user: ServiceProcess, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    stats_when(no_user, lambda s: s.sandbox_state == ops.SANDBOX_STATE_INCOMPLETE)
    out = doctor_report(no_user, capsys, monkeypatch)
    section = out.split(f"## service at {no_user.address}", 1)[1]
    assert "sandbox: INCOMPLETE: job processes run without unprivileged_user" in section
    assert f"  MISSING unprivileged_user: no user '{NO_USER}'" in section
    assert f"watchdog warning (kmsg): cannot read {NO_KMSG}" in section
    assert "sandbox: complete" not in section
    report = json.loads(doctor_report(no_user, capsys, monkeypatch, "--json"))
    lines = report[f"service at {no_user.address}"]
    assert "sandbox: INCOMPLETE: job processes run without unprivileged_user" in lines
    assert any(line.startswith("  MISSING unprivileged_user: ") for line in lines), lines


def test_stats_command_shows_the_sandbox(no_user: ServiceProcess, capsys: Capture) -> None:
    stats_when(no_user, lambda s: s.sandbox_state == ops.SANDBOX_STATE_INCOMPLETE)
    capsys.readouterr()
    args = ["--address", no_user.address, "--admin-token", no_user.admin_token, "stats"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "INCOMPLETE: job processes run without unprivileged_user" in out
    assert f"  MISSING unprivileged_user: no user '{NO_USER}'" in out
    assert f"watchdog warning (kmsg): cannot read {NO_KMSG}" in out
    assert cli.main([*args, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["sandboxState"] == "SANDBOX_STATE_INCOMPLETE"
    assert {w["feature"] for w in got["sandboxWarnings"]} >= {"unprivileged_user", "kmsg"}


def test_a_warning_outside_the_sandbox_leaves_it_complete(
    with_user: ServiceProcess, capsys: Capture, monkeypatch: pytest.MonkeyPatch
) -> None:
    with with_user.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=180)  # a job process ran
    st = stats_when(with_user, lambda s: s.sandbox_state != ops.SANDBOX_STATE_UNSPECIFIED)
    by_feature = {w.feature: w for w in st.sandbox_warnings}
    assert "kmsg" in by_feature and not by_feature["kmsg"].sandbox_feature
    missing = sorted(w.feature for w in st.sandbox_warnings if w.sandbox_feature)
    # This host may refuse a feature (a container without cgroups...): then it is named.
    expected = ops.SANDBOX_STATE_INCOMPLETE if missing else ops.SANDBOX_STATE_COMPLETE
    assert st.sandbox_state == expected, st
    section = doctor_report(with_user, capsys, monkeypatch).split("## service at", 1)[1]
    if missing:
        assert "sandbox: INCOMPLETE: job processes run without " + ", ".join(missing) in section
    else:
        assert "sandbox: complete" in section and "MISSING" not in section
    assert f"watchdog warning (kmsg): cannot read {NO_KMSG}" in section
