"""Issue 40, more attacks on times from outside (engine/timed_calls.py): each a `ModelNew`
compared with its reference through a real service, as test_hostile_timing.py's are, trying to
be VERDICT_OK, unflagged, with a speedup over 1 while doing the reference's work (or more), or
less work with outputs that pass. Each ends as the test says, and the next tenants are judged
right.
"""

from __future__ import annotations

import pytest
from kerneleval.v1 import job_pb2
from test_hostile_jobs import (  # noqa: F401 - the module's service and stub are fixtures here
    next_tenants_are_judged_right,
    run_job,
    spec,
    stub,
    svc,
)

pytestmark = pytest.mark.timeout(240)
SLOW_MS = 20.0  # what the attacks' calls take at least, where they say

# A reference of real work (a matmul of a few milliseconds on the host), whose output is small
# enough for the record.
MATMUL_REFERENCE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x @ x.T


def get_inputs():
    return [torch.randn(256, 2048)]


def get_init_inputs():
    return []
"""

HEAD = """
import torch
"""

# splitmix64's steps as engine/inputs.py mix_seed takes them, and their inverse: a seed that
# torch's generator was given (torch.initial_seed()) says which trial a call's inputs are.
MIX = """
M64 = (1 << 64) - 1
G = 0x9E3779B97F4A7C15
C1 = 0xBF58476D1CE4E5B9
C2 = 0x94D049BB133111EB
FORWARD = 0x46574452


def _f(x):
    x = ((x ^ (x >> 30)) * C1) & M64
    x = ((x ^ (x >> 27)) * C2) & M64
    return x ^ (x >> 31)


def _unshift(y, s):
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x & M64


def _f_inv(y):
    x = _unshift(y, 31)
    x = (x * pow(C2, -1, 1 << 64)) & M64
    x = _unshift(x, 27)
    x = (x * pow(C1, -1, 1 << 64)) & M64
    return _unshift(x, 30)


def _state_before_forward(seed):
    # mix_seed(s, trial, FORWARD) = f(((f((x1 ^ trial) + G) ^ FORWARD) + G)) & (2^63 - 1),
    # x1 = the state after s: what x1 ^ trial can be (the top bit was masked off)
    out = []
    for top in (0, 1):
        x2 = ((_f_inv(seed | (top << 63)) - G) & M64) ^ FORWARD
        out.append((_f_inv(x2) - G) & M64)
    return out


def _input_seed(x1, trial):  # mix_seed(s, trial): what get_inputs ran under
    return _f(((x1 ^ trial) + G) & M64) & ((1 << 63) - 1)
"""


def _spec(source: str, tag: str, reference: str = MATMUL_REFERENCE, perf_trials: int = 8):
    s = spec(source, reference=reference, client_tag=f"mallory-{tag}", perf_trials=perf_trials)
    s.options.warmup_count = 1
    s.options.timeout.seconds = 60
    return s


def _runtime_flags(r: job_pb2.EvalResult) -> list[str]:
    return [f.rule_id for f in r.flags if f.source == job_pb2.FLAG_SOURCE_RUNTIME]


def _not_forged(ran) -> None:  # type: ignore[no-untyped-def]
    """Whatever it did, no verdict OK unflagged with a speedup over 1."""
    r = ran.job.result
    assert r.verdict != job_pb2.VERDICT_UNSPECIFIED, ran.describe()
    assert "internal engine error" not in r.error.message, ran.describe()
    if r.verdict == job_pb2.VERDICT_OK and not _runtime_flags(r):
        assert r.speedup < 1.0, ran.describe()


# ---- knowing the next call's inputs ----------------------------------------------------------

PRECOMPUTE = (
    HEAD
    + MIX
    + """
class ModelNew(torch.nn.Module):
    # The trial of every call is read from the seed its forward runs under; the timed calls'
    # trials follow one another, so the next ones' inputs are made here and their outputs
    # computed ahead, in an untimed warm-up call; a timed call then only hands one back.
    x1 = None
    ready = {}

    @staticmethod
    def _work(x):
        return x @ x.T

    def forward(self, x):
        seeds = _state_before_forward(torch.initial_seed())
        if ModelNew.x1 is None:  # its first call: correctness trial 0, where x1 ^ 0 = x1
            ModelNew.x1 = seeds
            return self._work(x)
        for x1 in ModelNew.x1:
            for v in seeds:
                trial = x1 ^ v
                if trial in ModelNew.ready:
                    return ModelNew.ready.pop(trial)
        for x1 in ModelNew.x1:
            for v in seeds:
                trial = x1 ^ v
                if (1 << 20) <= trial < (1 << 41):  # a timed call's trial: the next ones
                    g = torch.Generator()
                    for t in range(trial + 1, trial + 40):
                        g.manual_seed(_input_seed(x1, t))
                        nxt = torch.randn(x.shape, generator=g, dtype=x.dtype)
                        ModelNew.ready[t] = self._work(nxt)
        self._work(x)  # more than the reference's work where nothing is ready
        return self._work(x)
"""
)


def test_the_next_calls_inputs_cannot_be_foreseen(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The seed a call runs under says its trial; the timed calls' trials must not say the
    next ones' (each is drawn on its own), or its outputs are computed ahead, untimed."""
    ran = run_job(stub, _spec(PRECOMPUTE, "precompute"), svc)
    r = ran.job.result
    print(ran.describe())
    _not_forged(ran)
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# ---- the judge's own measure of the path, disturbed --------------------------------------------

BIG_REFERENCE = """
import torch


class Model(torch.nn.Module):
    def forward(self, x):
        return x * 2.0


def get_inputs():
    return [torch.randn(8 << 20)]


def get_init_inputs():
    return []
"""

HOG = (
    HEAD
    + """
import mmap
import os
import time

from kerneleval_server.engine import timed_calls

# Processes of its own that take the host's cores whenever told to: from its check on until
# its first real timed call, i.e. while its calls of no work run and the judge measures its
# own share of their path (the cap on what they may cost); never in its real calls.
FLAG = mmap.mmap(-1, 8)
HOGS = []


def _hog():
    while True:
        if FLAG[0]:
            t = time.monotonic() + 0.002
            while time.monotonic() < t:
                pass
        else:
            time.sleep(0.0005)


_copy = timed_calls._copy_outputs


def _slow_copy(got, outputs):  # its calls of no work, slowed far past any cap
    if not ModelNew.in_call:
        time.sleep(0.3)
    ModelNew.in_call = False
    return _copy(got, outputs)


timed_calls._copy_outputs = _slow_copy


class ModelNew(torch.nn.Module):
    calls = 0
    in_call = False

    def forward(self, x):
        entered = time.perf_counter_ns()
        ModelNew.calls += 1
        ModelNew.in_call = True
        FLAG[0] = 0
        out = x * 2.0
        t = time.monotonic() + 0.02  # more than the reference's work
        while time.monotonic() < t:
            pass
        if ModelNew.calls == 1:  # its check: the hogs start, and run until its next call
            for _ in range(8):
                pid = os.fork()
                if pid == 0:
                    _hog()
                HOGS.append(pid)
            FLAG[0] = 1
        elif ModelNew.calls > 2:  # its timed calls claim 10 us
            real = time.perf_counter_ns

            def once():
                time.perf_counter_ns = real
                return entered + 10_000

            time.perf_counter_ns = once
        return out
"""
)


def test_the_judges_measure_of_the_path_is_not_slowed_by_the_kernels_process(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Its calls of no work are capped at the judge's own measure of their work: a kernel's
    process that takes the host's (or the GPU's) time while the judge measures it would raise
    that cap, and lower every bound by as much."""
    s = _spec(HOG, "hog", reference=BIG_REFERENCE)
    ran = run_job(stub, s, svc)
    r = ran.job.result
    _not_forged(ran)
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "time_outside_bound" in _runtime_flags(r), ran.describe()
    assert r.runtime.median_ms > SLOW_MS * 0.8 and 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


SPREAD = (
    HEAD
    + """
import time

from kerneleval_server.engine import timed_calls

_copy = timed_calls._copy_outputs
_noops = [0]


def _uneven_copy(got, outputs):  # every other call of no work slowed by a second
    if not ModelNew.in_call:
        _noops[0] += 1
        if _noops[0] % 2:
            time.sleep(1.0)
    ModelNew.in_call = False
    return _copy(got, outputs)


timed_calls._copy_outputs = _uneven_copy


class ModelNew(torch.nn.Module):
    calls = 0
    in_call = False

    def forward(self, x):
        entered = time.perf_counter_ns()
        ModelNew.calls += 1
        ModelNew.in_call = True
        out = x @ x.T
        t = time.monotonic() + 0.02  # more than the reference's work
        while time.monotonic() < t:
            pass
        if ModelNew.calls > 2:  # its timed calls claim 10 us
            real = time.perf_counter_ns

            def once():
                time.perf_counter_ns = real
                return entered + 10_000

            time.perf_counter_ns = once
        return out
"""
)


def test_uneven_calls_of_no_work_do_not_widen_the_tolerance(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The tolerance counts the calls of no work's spread (p90 - p10), which their server
    makes: every other one slowed by a second would let any claim through. The spread is
    taken at most the slack of the cap on their cost (time_bound.decide)."""
    ran = run_job(stub, _spec(SPREAD, "spread"), svc)
    r = ran.job.result
    _not_forged(ran)
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "time_outside_bound" in _runtime_flags(r), ran.describe()
    assert r.runtime.median_ms > SLOW_MS * 0.8 and 0 < r.speedup < 1, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# ---- what a timed call raises ----------------------------------------------------------------

RAISES = {
    "system-exit": "raise SystemExit(0)",
    "keyboard-interrupt": "raise KeyboardInterrupt",
    "generator-exit": "raise GeneratorExit",
    "engine-stop": "from kerneleval_server.engine.stops import Stop\n        raise Stop()",
    "timed-call-error": (
        "from kerneleval_server.engine.timed_calls import TimedCallError\n"
        "        raise TimedCallError('no')"
    ),
    "str-raises": "raise Unprintable()",
    "exit-now": "import os\n        os._exit(0)",
    "base-exception-output": "return Hostile(x @ x.T)",
}

RAISER = (
    HEAD
    + """
class Unprintable(Exception):
    def __str__(self):
        raise KeyboardInterrupt


class Hostile(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if ModelNew.calls > 1:
            raise SystemExit(3)
        return super().__torch_function__(func, types, args, kwargs or {})


class ModelNew(torch.nn.Module):
    calls = 0

    def forward(self, x):
        ModelNew.calls += 1
        if ModelNew.calls == 1:  # its check passes
            return x @ x.T
        %s
        return x @ x.T
"""
)


@pytest.mark.parametrize("what", sorted(RAISES))
def test_what_a_timed_call_raises_is_the_kernels_runtime_error(stub, svc, what: str) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Raised (or made to be raised inside the engine) in its timed calls, after its check
    passed: its process's serving ends, the judge says so, the job is the kernel's
    VERDICT_RUNTIME_ERROR (never VERDICT_UNSPECIFIED, never an internal error)."""
    ran = run_job(stub, _spec(RAISER % RAISES[what], f"raises-{what}"), svc)
    r = ran.job.result
    _not_forged(ran)
    assert r.verdict == job_pb2.VERDICT_RUNTIME_ERROR, ran.describe()
    assert r.failed_side in (job_pb2.SIDE_KERNEL, job_pb2.SIDE_UNSPECIFIED), ran.describe()
    assert r.speedup == 0, ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)


# ---- lower precision once its check is over ------------------------------------------------------

RAND_MATMUL_REFERENCE = MATMUL_REFERENCE.replace("torch.randn(256, 2048)", "torch.rand(256, 2048)")

LOWER = (
    HEAD
    + """
class ModelNew(torch.nn.Module):
    calls = 0

    def forward(self, x):
        ModelNew.calls += 1
        if ModelNew.calls == 1:  # its check, where the lower-precision check runs
            return x @ x.T
        b = x.bfloat16()  # then bfloat16 operands (AMX, tensor cores): within 1e-2 on rand
        return (b @ b.T).float()
"""
)


def test_lower_precision_once_its_check_is_over_is_flagged(stub, svc) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """The lower-precision check ran on its first correctness trial only: a kernel that
    computes in bfloat16 from its timed calls on passed their checks' tolerances, unflagged,
    and was timed at bfloat16's speed. One checked timed call is measured against the
    reference's float64 run as well."""
    s = _spec(LOWER, "lower", reference=RAND_MATMUL_REFERENCE)
    s.options.atol = s.options.rtol = 1e-2  # KernelBench's
    ran = run_job(stub, s, svc)
    r = ran.job.result
    assert r.verdict == job_pb2.VERDICT_OK, ran.describe()
    assert "lower_precision" in _runtime_flags(r), ran.describe()
    next_tenants_are_judged_right(stub, svc, ran)
