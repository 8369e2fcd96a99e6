"""Issue 13: times a candidate cannot forge from inside its own process (engine/tamper.py).

Each case is a ModelNew run through the engine in a fresh Python process that does what a job
process does: imports the engine, binds `tamper.check_timers`, `tamper.prepare()` (the snapshot,
as the process starts), `tamper.arm()`, then `run_job`.
The hostile ones rewrite the timing from the candidate's module body or forward (the clocks,
timing.measure, a function's __code__, gc's view of the heap, a tracer, the timing's locals)
and must end refused with a "tampering" message, reported by check_timers, or timed as if
nothing had been rewritten. The honest ones (torch, Triton under its interpreter, a
KernelBench-style model) must end VERDICT_OK with nothing reported. A candidate that computes
a + b like its reference times at about 1x; the forgeries aim at 10x.

Run standalone, this file is the child: `python test_timing_tamper.py CASE OUT.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FORGED = 3.0  # a speedup over this for a + b against a + b was forged (the forgeries aim at 10)

REFERENCE = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return a + b
def get_inputs():
    return [torch.randn(512, 2048), torch.randn(512, 2048)]
def get_init_inputs():
    return []
"""

HONEST = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b
"""

# The end of a timed call of ours reads a tenth of the time since its start.
CLOCKS = """
import time
import torch
_real_ns = time.perf_counter_ns
_state = {"ran": False, "last": 0}
def _fake_ns():
    now = _real_ns()
    if _state["ran"]:
        _state["ran"] = False
        now = _state["last"] + (now - _state["last"]) // 10
    _state["last"] = now
    return now
time.perf_counter_ns = _fake_ns
time.perf_counter = lambda: _fake_ns() / 1e9
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        out = a + b
        _state["ran"] = True
        return out
"""

# timing.measure replaced: the first call (the kernel's) answers a tenth of its times.
MEASURE = """
import torch
from kerneleval_server.engine import timing
_real = timing.measure
_calls = []
def _fast(fn, **kw):
    t = _real(fn, **kw)
    if not _calls:
        for f in ("mean_ms", "median_ms", "min_ms", "max_ms", "p95_ms", "p99_ms"):
            setattr(t.stats, f, getattr(t.stats, f) / 10)
    _calls.append(1)
    RESTORE
    return t
timing.measure = _fast
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        return a + b
"""


def after(head: str) -> str:
    """`head` at the top of the honest candidate's module."""
    return head + HONEST


CODE_OF_MEASURE = after("""
import torch
from kerneleval_server.engine import timing
def _fast(fn, *, trials, warmup, flush_l2, device, progress=None, check=None):
    return None
timing.measure.__code__ = _fast.__code__
""")

CODE_OF_EVENT = after("""
import torch
def _fast(self, end_event):
    return 0.001
torch.cuda.Event.elapsed_time.__code__ = _fast.__code__
""")

GC_REFERRERS = after("""
import gc, time
for d in gc.get_referrers(time.perf_counter_ns):
    if isinstance(d, dict) and "_perf_counter_ns" in d:
        d["_perf_counter_ns"] = lambda: 0
""")

GC_OBJECTS = after("""
import gc
ENGINE = [o for o in gc.get_objects() if type(o).__name__ == "_Job"]
""")

SETTRACE = after("""
import sys
sys.settrace(lambda frame, event, arg: None)
""")

SETPROFILE_IN_FORWARD = HONEST.replace(
    "        return a + b", "        import sys\n        sys.setprofile(None)\n        return a + b"
)

# Walks up to the timing loop's frame and zeroes every time taken so far (a list in the old
# timing.py); the forward itself is honest.
FRAMES = """
import sys
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        f = sys._getframe(1)
        while f is not None:
            for value in f.f_locals.values():
                if type(value) is list and value and all(type(v) is float for v in value):
                    value[:] = [1e-6] * len(value)
            f = f.f_back
        return a + b
"""

TRITON = """
import torch
import triton
import triton.language as tl

@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x + y, mask=mask)

class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        out = torch.empty_like(a)
        n = a.numel()
        add_kernel[(triton.cdiv(n, 256),)](a, b, out, n, BLOCK=256)
        return out
"""
SMALL_REFERENCE = REFERENCE.replace("512, 2048", "4, 300")

KB_REFERENCE = """
import torch
import torch.nn as nn
import torch.nn.functional as F
class Model(nn.Module):
    def __init__(self, c_in, c_out):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.bn = nn.BatchNorm2d(c_out)
        self.fc = nn.Linear(c_out * 8 * 8, 10)
    def forward(self, x):
        x = F.relu(self.bn(self.conv(x)))
        return torch.softmax(self.fc(x.flatten(1)), dim=-1)
def get_inputs():
    return [torch.randn(2, 3, 8, 8)]
def get_init_inputs():
    return [3, 4]
"""
KB_CANDIDATE = KB_REFERENCE.replace("class Model(", "class ModelNew(").replace(
    "torch.softmax(", "F.softmax("
)

CASES: dict[str, tuple[str, str]] = {
    "honest": (HONEST, REFERENCE),
    "triton": (TRITON, SMALL_REFERENCE),
    "kernelbench": (KB_CANDIDATE, KB_REFERENCE),
    "clocks": (CLOCKS, REFERENCE),
    "measure": (MEASURE.replace("RESTORE", "pass"), REFERENCE),
    "measure_restored": (MEASURE.replace("RESTORE", "timing.measure = _real"), REFERENCE),
    "code_of_measure": (CODE_OF_MEASURE, REFERENCE),
    "code_of_event": (CODE_OF_EVENT, REFERENCE),
    "gc_referrers": (GC_REFERRERS, REFERENCE),
    "gc_objects": (GC_OBJECTS, REFERENCE),
    "settrace": (SETTRACE, REFERENCE),
    "setprofile_in_forward": (SETPROFILE_IN_FORWARD, REFERENCE),
    "frames": (FRAMES, REFERENCE),
}


# ---- the child: one job, as a job process runs it ----------------------------------------------


def child(case: str, out: str) -> None:
    from kerneleval_server.engine import configure_process_environment

    configure_process_environment()
    import torch
    from kerneleval.v1 import job_pb2, kernel_pb2
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job, tamper

    torch.set_num_threads(1)
    check = tamper.check_timers  # bound before job code runs, as the runner binds it
    tamper.prepare()  # the runtime's call as the process starts, before it says it is ready
    tamper.arm()  # the runtime's call, right before the job's code is imported
    cand, ref = CASES[case]
    torch_type = kernel_pb2.KERNEL_TYPE_TORCH
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(type=torch_type, source_code=cand),
        reference=kernel_pb2.KernelSource(type=torch_type, source_code=ref),
        options=kernel_pb2.EvalOptions(perf_trial_count=20, warmup_count=2),
    )
    with tempfile.TemporaryDirectory() as work:
        r = run_job(spec, NullReporter(), EngineConfig(work_dir=Path(work))).result
    changed = check()
    try:
        import gc

        gc.get_objects()
        armed = False
    except RuntimeError:
        armed = True
    summary = {
        "verdict": job_pb2.Verdict.Name(r.verdict),
        "error": r.error.message or r.compilation_error,
        "speedup": r.speedup,
        "flags": [f.rule_id for f in r.flags],
        "changed": changed,
        "armed": armed,
    }
    Path(out).write_text(json.dumps(summary))


# ---- the tests -----------------------------------------------------------------------------


def _run_child(case: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{case}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, case, str(out)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Future[dict[str, Any]]]:
    """Every case's child, two at a time (each imports torch: seconds apiece)."""
    tmp = tmp_path_factory.mktemp("tamper")
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {case: pool.submit(_run_child, case, tmp) for case in CASES}
    pool.shutdown(wait=False)
    return futures


def tampered(r: dict[str, Any]) -> bool:
    """Refused while it ran, or reported by check_timers (the runner makes that a
    RUNTIME_ERROR with a "tampering" message)."""
    return bool(r["changed"]) or "tampering" in r["error"]


def timed_honestly_or_refused(r: dict[str, Any]) -> None:
    """OK at the time a + b takes, or ended by the runner's check (once it is wired)."""
    if r["verdict"] == "VERDICT_OK":
        assert 0 < r["speedup"] < FORGED, r
    else:
        assert r["verdict"] == "VERDICT_RUNTIME_ERROR", r
        assert r["error"].startswith("tampering: the timing was rewritten"), r
        assert "timer_tampered" in r["flags"], r


def _runner_binds_measure() -> bool:
    import inspect

    from kerneleval_server.engine import runner, timing

    parameters = inspect.signature(runner._Job._measure).parameters.values()
    return any(p.default is timing.measure for p in parameters)


@pytest.mark.parametrize("case", ["honest", "triton", "kernelbench"])
def test_honest_candidates_are_ok_and_untouched(results, case: str) -> None:
    r = results[case].result()
    assert r["verdict"] == "VERDICT_OK", r
    assert r["changed"] == [] and "tampering" not in r["error"] and r["speedup"] > 0, r
    assert r["armed"], "the hook was not armed: gc.get_objects() ran"
    if case == "honest":
        assert r["speedup"] < FORGED, r


def test_patched_clocks_do_not_change_the_time_and_are_reported(results) -> None:
    r = results["clocks"].result()
    timed_honestly_or_refused(r)
    assert "time.perf_counter_ns was replaced" in r["changed"], r
    assert "time.perf_counter was replaced" in r["changed"], r


def test_replaced_timing_measure_is_reported(results) -> None:
    r = results["measure"].result()
    assert "kerneleval_server.engine.timing.measure was replaced" in r["changed"], r
    if _runner_binds_measure():
        timed_honestly_or_refused(r)


def test_timing_measure_replaced_and_restored_does_not_change_the_time(results) -> None:
    """Replaced at import, put back by itself after the kernel's timing: no trace for the
    snapshot, so only a runner that calls measure through a reference bound at import (before
    the job's code ran) times it right."""
    r = results["measure_restored"].result()
    if not _runner_binds_measure():
        pytest.xfail("runner._Job._measure does not bind timing.measure as a default yet")
    timed_honestly_or_refused(r)


@pytest.mark.parametrize("case", ["code_of_measure", "code_of_event"])
def test_replacing_a_timing_functions_code_is_refused(results, case: str) -> None:
    r = results[case].result()
    assert r["verdict"] != "VERDICT_OK" and "tampering: __code__" in r["error"], r
    assert tampered(r)


@pytest.mark.parametrize("case", ["gc_referrers", "gc_objects"])
def test_searching_the_heap_with_gc_is_refused(results, case: str) -> None:
    r = results[case].result()
    event = "gc.get_referrers" if case == "gc_referrers" else "gc.get_objects"
    assert r["verdict"] != "VERDICT_OK" and f"tampering: {event} is refused" in r["error"], r


@pytest.mark.parametrize("case", ["settrace", "setprofile_in_forward"])
def test_tracers_are_refused(results, case: str) -> None:
    r = results[case].result()
    event = "sys.settrace" if case == "settrace" else "sys.setprofile"
    assert r["verdict"] != "VERDICT_OK" and f"tampering: {event} is refused" in r["error"], r


def test_the_timing_loops_locals_cannot_be_rewritten_from_the_forward(results) -> None:
    r = results["frames"].result()
    assert r["verdict"] == "VERDICT_OK" and 0 < r["speedup"] < FORGED, r
    assert r["changed"] == [], r  # nothing was replaced: only a list was searched for


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
