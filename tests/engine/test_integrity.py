"""Runtime integrity flags (engine/integrity.py): outputs that alias inputs or the reference's
outputs, and a time below the memory-bandwidth floor. Honest kernels raise none."""

from __future__ import annotations

import torch
from engine_helpers import ADD_MODEL, TORCH, V, job, source
from kerneleval_server.engine import integrity

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
