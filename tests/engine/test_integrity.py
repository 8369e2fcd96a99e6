"""Runtime integrity flags (engine/integrity.py): outputs that alias inputs or the reference's
outputs, a time below the memory-bandwidth floor, a persisting-L2 set-aside found at timed
trials (lower precision: test_precision.py). Honest kernels raise none."""

from __future__ import annotations

import torch
from engine_helpers import ADD_MODEL, TORCH, V, gpu, job, needs_gpu, source
from kerneleval_server.engine import integrity, job_timing, tamper, timing

COPY_REF = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.clone()
def get_inputs():
    return [torch.randn(8, 32)]
def get_init_inputs():
    return []
"""
HANDS_BACK = COPY_REF.replace("class Model(", "class ModelNew(").replace("x.clone()", "x")


def rules(result: V.EvalResult) -> list[str]:
    return [f.rule_id for f in result.flags]


def test_an_output_that_is_its_input_is_flagged_but_correct(run) -> None:
    out, _ = run(job(source(TORCH, HANDS_BACK), source(TORCH, COPY_REF)))
    assert out.result.verdict == V.VERDICT_OK and out.result.correctness
    assert rules(out.result) == [integrity.ALIASES_INPUT]
    flag = out.result.flags[0]
    assert flag.source == V.FLAG_SOURCE_RUNTIME and "shares memory with an input" in flag.message
    evaluated, _ = run(job(source(TORCH, HANDS_BACK)))  # Evaluate: no reference to go by
    assert list(evaluated.result.flags) == []
    view_ref = COPY_REF.replace("x.clone()", "x.view(-1)")  # the reference returns a view
    view_cand = HANDS_BACK.replace("return x", "return x.view(-1)")
    out, _ = run(job(source(TORCH, view_cand), source(TORCH, view_ref)))
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []


def test_honest_kernels_raise_no_flag(run) -> None:
    honest = ADD_MODEL.replace("class Model(", "class ModelNew(")
    out, _ = run(job(source(TORCH, honest), source(TORCH, ADD_MODEL)))
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []
    out, _ = run(job(source(TORCH, COPY_REF.replace("class Model(", "class ModelNew(")),
                     source(TORCH, COPY_REF)))  # fmt: skip
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []


def test_aliasing_names_the_reference_first() -> None:
    inp = torch.randn(16)
    ref_out = torch.randn(4, 4)
    flags = integrity.aliasing([ref_out.view(16)[2:], inp[:4], torch.randn(3)], ["a", "b", "c"],
                               [inp], [ref_out])  # fmt: skip
    assert [(f.rule_id, f.message) for f in flags] == [
        (integrity.ALIASES_REFERENCE, "a shares memory with the reference's outputs"),
        (integrity.ALIASES_INPUT, "b shares memory with an input"),
    ]


def test_the_memory_bandwidth_floor() -> None:
    h100 = 2619e6 * 2 * 5120 / 8  # bytes a second: HBM3 at its highest clock
    gib = 1 << 30
    flag = integrity.memory_floor(0.05, gib, h100)  # 1 GiB written in 50 us: impossible
    assert flag is not None and flag.rule_id == integrity.FASTER_THAN_MEMORY
    assert "takes at least 320" in flag.message
    assert integrity.memory_floor(0.33, gib, h100) is None  # at the floor: honest
    assert integrity.memory_floor(0.05, gib, None) is None  # bandwidth unknown: no verdict
    assert integrity.memory_floor(0.0, gib, h100) is None
    l2 = 50 << 20  # H100: 50 MiB; 40 MiB written in 1 us may all still be in it
    assert integrity.memory_floor(0.001, 40 << 20, h100, l2) is None
    assert integrity.memory_floor(0.05, gib, h100, l2) is not None


def test_a_persisting_l2_found_at_timed_trials_is_flagged_once(run, monkeypatch) -> None:
    """The runner's side (timing's own is in test_units): the kernel's timing found the limit
    set, the reference's did too (a note: it is not the candidate's doing)."""
    real = timing.measure

    def measure(fn, **kw):
        t = real(fn, **kw)
        t.persisting_l2_bytes, t.persisting_l2_resets = 8 << 20, 4
        return t

    # The job's timing binds timing.measure at import (engine/tamper.py): replace its default.
    defaults = (None, measure, tamper.check_timers)
    monkeypatch.setattr(job_timing._JobTiming._measure, "__defaults__", defaults)
    honest = ADD_MODEL.replace("class Model(", "class ModelNew(")
    out, _ = run(job(source(TORCH, honest), source(TORCH, ADD_MODEL)))
    r = out.result
    assert r.verdict == V.VERDICT_OK and rules(r) == [integrity.PERSISTING_L2]
    assert r.flags[0].source == V.FLAG_SOURCE_RUNTIME
    assert (
        "8.0 MiB of persisting L2" in r.flags[0].message and "4 of the resets" in r.flags[0].message
    )
    assert "reference: set aside persisting L2; reset before its timed trials" in r.notes


def test_every_runtime_rule_reaches_the_result() -> None:
    """The front end keeps only runtime flags of the rules it knows (it does not import the
    engine): every rule of engine/integrity.py is one of them."""
    from kerneleval_server.jobs.endings import RUNTIME_RULES

    rules_here = {v for k, v in vars(integrity).items() if k.isupper() and isinstance(v, str)}
    assert len(rules_here) == 7 and rules_here <= set(RUNTIME_RULES)


PERSISTS = """
import ctypes
import torch
_cudart = ctypes.CDLL("libcudart.so." + torch.version.cuda.split(".")[0])

class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        # cudaLimitPersistingL2CacheSize: 8 MiB of the L2 set aside for persisting accesses
        assert _cudart.cudaDeviceSetLimit(6, ctypes.c_size_t(8 << 20)) == 0
        return a + b
"""


@gpu
@needs_gpu
def test_a_kernel_that_sets_aside_persisting_l2_is_flagged_and_reset(run) -> None:
    out, _ = run(job(source(TORCH, PERSISTS), source(TORCH, ADD_MODEL), perf_trial_count=10))
    r = out.result
    assert r.verdict == V.VERDICT_OK, r
    assert rules(r) == [integrity.PERSISTING_L2]
    # the driver rounds the set-aside up to its granularity (9.4 MiB on an H100)
    assert "MiB of persisting L2 cache" in r.flags[0].message
    assert timing.persisting_l2().reset() == 0  # reset after the last trial too
    honest = ADD_MODEL.replace("class Model(", "class ModelNew(")
    out, _ = run(job(source(TORCH, honest), source(TORCH, ADD_MODEL), perf_trial_count=10))
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []
    assert not [n for n in out.result.notes if "persisting L2" in n]  # reset, nothing found
