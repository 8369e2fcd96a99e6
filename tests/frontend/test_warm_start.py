"""A warm start (issue 41): what the build side needs is kept across restarts in the state
folder and made again only when torch, the compiler or the flags change; the service says
when it is ready for each kind of job (the health names "kerneleval.ready.<kind>" and
ListDevices' `readiness`); and the first load_inline job after a restart builds as fast as
later ones.

The real-restart test makes the precompiled headers once (about two minutes of CPU on the
2-core CPU machine), restarts the service on the same state folder and times a distinct
load_inline build before and after. The CPU build of torch builds C++ extensions only: these
are C++ (`cpp_sources` with torch/extension.h, as KernelBench's); CUDA sources take the same
path on a GPU host."""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ke_service import ServiceProcess, real_watchdog_available
from kerneleval import Client
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval_server.fast_build import pch

# ---- kept or made again (fast_build/pch.py) ----------------------------------------------------


@pytest.fixture
def fake_make(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """pch.make records its calls and leaves a file, as if it had made the headers."""
    calls: list[Path] = []

    def make(folder: Path) -> list[tuple[bool, str]]:
        calls.append(folder)
        (folder / "abc").mkdir(parents=True, exist_ok=True)
        (folder / "abc" / "pch.h.gch").write_text("made")
        return [(True, "flags []: ok")]

    monkeypatch.setattr(pch, "make", make)
    return calls


def run_main(folder: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr("sys.argv", ["pch", str(folder)])
    return pch.main()


def test_made_once_then_kept(
    tmp_path: Path, fake_make: list[Path], monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / "pch"
    assert run_main(folder, monkeypatch) == 0
    assert fake_make == [folder]
    assert json.loads((folder / pch.MADE_FOR).read_text()) == pch.made_for()
    assert capsys.readouterr().out.splitlines()[-1].startswith("kerneleval pch: ready (made in ")
    assert run_main(folder, monkeypatch) == 0  # the next start
    assert fake_make == [folder]  # nothing made again
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("kerneleval pch: ready (kept from an earlier start: torch ")


@pytest.mark.parametrize("changed", ["torch", "cxx", "variants", "recipe", "arch"])
def test_another_torch_compiler_or_flags_clears_and_makes_them_again(
    tmp_path: Path, fake_make: list[Path], monkeypatch: pytest.MonkeyPatch, changed: str
) -> None:
    folder = tmp_path / "pch"
    assert run_main(folder, monkeypatch) == 0
    stale = folder / "made-for-the-old-one"
    stale.mkdir()
    made = json.loads((folder / pch.MADE_FOR).read_text())
    made[changed] = "something else"
    (folder / pch.MADE_FOR).write_text(json.dumps(made))
    assert run_main(folder, monkeypatch) == 0
    assert len(fake_make) == 2
    assert not stale.exists()  # cleared: a build process never reads what was made for another
    assert json.loads((folder / pch.MADE_FOR).read_text()) == pch.made_for()


def test_a_failed_make_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(pch, "make", lambda folder: [(False, "flags []: g++ failed")])
    folder = tmp_path / "pch"
    folder.mkdir()
    assert run_main(folder, monkeypatch) == 1
    assert not (folder / pch.MADE_FOR).exists()  # tried again at the next start
    assert capsys.readouterr().out.splitlines()[-1].startswith("kerneleval pch: failed after ")


def test_a_cpu_torch_makes_cpp_headers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvcc on the PATH but torch without CUDA: CUDA sources are not tried (they failed the
    whole make on the CPU machine: CUDA_HOME)."""
    import torch

    if torch.version.cuda:
        pytest.skip("a CUDA build of torch")
    monkeypatch.setattr(pch.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    assert pch._with_cuda() is False


# ---- a real restart ---------------------------------------------------------------------------

CANDIDATE = """
import torch
from torch.utils.cpp_extension import load_inline
cpp = '''
#include <torch/extension.h>
// SALT
torch::Tensor twice_plus_one(torch::Tensor x) { return x * 2 + 1; }
'''
ext = load_inline(name="NAME", cpp_sources=[cpp], functions=["twice_plus_one"])
class ModelNew(torch.nn.Module):
    def forward(self, x):
        return ext.twice_plus_one(x)
"""

REFERENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1
def get_inputs():
    return [torch.randn(256)]
def get_init_inputs():
    return []
"""

LOAD_INLINE = "kerneleval.ready.load_inline"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    if not real_watchdog_available():
        pytest.skip("needs the watchdog")
    service = ServiceProcess(
        tmp_path_factory.mktemp("warm") / "state",
        ["--build-processes", "1", "--workers-per-device", "1", "--spare-count", "1",
         "--log-level", "INFO"],
    )  # fmt: skip
    try:
        service.start(timeout=180)
        yield service
    finally:
        service.stop()


def readiness(svc: ServiceProcess) -> dict[str, ops.JobKindReadiness]:
    """ListDevices' readiness, through the Python client's Client.readiness."""
    with Client(svc.address, admin_token=svc.admin_token, timeout=30) as client:
        return {k.kind: k for k in client.readiness()}


def health(svc: ServiceProcess, name: str) -> int:
    with svc.channel() as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status)


def wait_load_inline_ready(svc: ServiceProcess, timeout: float) -> float:
    start = time.monotonic()
    while health(svc, LOAD_INLINE) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() - start < timeout, readiness(svc)
        time.sleep(0.5)
    return time.monotonic() - start


def build_seconds(svc: ServiceProcess) -> float:
    """A distinct load_inline job, compared; its build's time, as its log says it."""
    spec = kernel_pb2.JobSpec()
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH_CUDA
    spec.kernel.source_code = CANDIDATE.replace("SALT", uuid.uuid4().hex).replace(
        "NAME", f"ext_{uuid.uuid4().hex[:8]}"
    )
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    spec.reference.source_code = REFERENCE
    spec.options.perf_trial_count = 0
    said, verdict = [], None
    with svc.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        for response in stub.Run(pb.RunRequest(spec=spec), timeout=600):
            event = response.event
            if event.WhichOneof("kind") == "log":
                said.append(event.log.text)
            elif event.WhichOneof("kind") == "finished":
                verdict = event.finished.result.verdict
    assert verdict == job_pb2.VERDICT_OK, said
    built = [m for line in said if (m := re.search(r"load_inline: built in ([\d.]+) s", line))]
    assert len(built) == 1, said
    return float(built[0].group(1))


def made_files(state: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in (state / "pch").rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_build_state_is_kept_across_a_real_restart(svc: ServiceProcess) -> None:
    # At the first start the headers are made: load_inline is not ready meanwhile, the rest is.
    first = readiness(svc)
    assert set(first) == {"jobs", "load_inline", "built_ahead"}, first
    assert first["jobs"].ready, first
    assert not first["load_inline"].ready and "making them" in first["load_inline"].detail
    assert health(svc, LOAD_INLINE) == health_pb2.HealthCheckResponse.NOT_SERVING
    wait_load_inline_ready(svc, timeout=1200)
    made = readiness(svc)["load_inline"]
    assert made.ready and "precompiled headers (made in " in made.detail, made
    before = build_seconds(svc)
    files = made_files(svc.state_dir)
    assert any(name.endswith(".gch") for name in files), files

    svc.stop()
    svc.start(timeout=180)  # the same state folder
    waited = wait_load_inline_ready(svc, timeout=60)
    kept = readiness(svc)["load_inline"]
    assert "kept from an earlier start" in kept.detail, kept
    after = build_seconds(svc)
    assert made_files(svc.state_dir) == files  # nothing made again
    log = svc.log_path.read_text(errors="replace")
    assert "kerneleval pch: ready (kept from an earlier start" in log
    # The first build after the restart is as fast as one before it (8.3 s against 7.5-9.6 s
    # on the shared 2-core CPU machine; 38 s without the headers).
    assert after <= max(1.5 * before, before + 5), (before, after, waited)
