"""lower_precision (engine/precision.py): a candidate that computes a float32 problem in float16
or bfloat16 and passes the tolerances is flagged; honest candidates (the reference itself on
KernelBench level-1 problems, float32 code that sums in another order) are not; a reference
that cannot run in float64 is skipped with a note, and the check never fails a job."""

from __future__ import annotations

import time

import pytest
import torch
from engine_helpers import KERNELBENCH, TORCH, V, job, needs_kernelbench, source, tensor
from kerneleval_server.engine import compare, integrity, precision
from kerneleval_server.spec.validation import Limits

LEVEL1 = KERNELBENCH / "level1"
KB_TOL = {"atol": 1e-2, "rtol": 1e-2}  # KernelBench's tolerances for float32

# KernelBench's matmuls take torch.rand inputs: positive, so every output is large and the
# relative tolerance passes a float16 or bfloat16 result.
MATMUL = """
import torch
class Model(torch.nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)
def get_inputs():
    return [torch.rand(128, 512), torch.rand(512, 96)]
def get_init_inputs():
    return []
"""


def candidate(body: str, ref: str = MATMUL) -> str:
    """A ModelNew whose forward(a, b) returns `body`, beside the reference's get_inputs()."""
    return ref.replace("class Model(", "class ModelNew(").replace("torch.matmul(a, b)", body)


def rules(r: V.EvalResult) -> list[str]:
    return [f.rule_id for f in r.flags]


def precision_notes(r: V.EvalResult) -> list[str]:
    return [n for n in r.notes if "lower-precision" in n]


@pytest.mark.parametrize(
    ("body", "dtype"),
    [
        ("torch.matmul(a.half(), b.half()).float()", "float16"),
        ("torch.matmul(a.bfloat16(), b.bfloat16()).float()", "bfloat16"),
    ],
)
def test_a_matmul_in_half_precision_passes_but_is_flagged(run, body: str, dtype: str) -> None:
    out, _ = run(job(source(TORCH, candidate(body)), source(TORCH, MATMUL), **KB_TOL))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.correctness  # advisory: the verdict stands
    assert rules(r) == [integrity.LOWER_PRECISION], (dtype, list(r.notes))
    flag = r.flags[0]
    assert flag.source == V.FLAG_SOURCE_RUNTIME
    assert (
        "output[0]" in flag.message and "lower precision than the problem's float32" in flag.message
    )
    assert precision_notes(r) == []


def test_float16_inputs_summed_in_float32_are_flagged(run) -> None:
    """What a tensor-core kernel does with float16 operands: rounded inputs, a float32 sum
    and a float32 result (no rounding of the output to hide behind)."""
    body = "torch.matmul(a.half().float(), b.half().float())"
    ref = MATMUL.replace("torch.rand(", "torch.randn(")
    out, _ = run(job(source(TORCH, candidate(body, ref)), source(TORCH, ref), atol=5e-2, rtol=5e-2))
    assert out.result.verdict == V.VERDICT_OK and rules(out.result) == [integrity.LOWER_PRECISION]


HONEST = [
    "torch.matmul(a, b)",
    "(a.unsqueeze(2) * b.unsqueeze(0)).sum(1)",  # float32, summed in another order
    "torch.stack([a[:, k] for k in range(a.shape[1])], 1).mm(b)",  # a copy first
]


@pytest.mark.parametrize("body", HONEST)
def test_honest_float32_matmuls_are_not_flagged(run, body: str) -> None:
    out, _ = run(job(source(TORCH, candidate(body)), source(TORCH, MATMUL), **KB_TOL))
    r = out.result
    assert r.verdict == V.VERDICT_OK and list(r.flags) == [] and precision_notes(r) == []


SEQUENTIAL = """
import torch
class ModelNew(torch.nn.Module):
    def forward(self, a, b):
        acc = torch.zeros(a.shape[0], b.shape[1], device=a.device)
        for k in range(a.shape[1]):  # one long float32 sum per output, in order
            acc += a[:, k : k + 1] * b[k : k + 1, :]
        return acc
"""


def test_a_long_sequential_float32_sum_is_not_flagged(run) -> None:
    """The worst order an honest float32 kernel sums in (a naive loop over K): its error grows
    with K, and at K = 4096 it is still far below the floor."""
    ref = MATMUL.replace(
        "torch.rand(128, 512), torch.rand(512, 96)", "torch.rand(64, 4096), torch.rand(4096, 32)"
    )
    out, _ = run(job(source(TORCH, SEQUENTIAL), source(TORCH, ref), **KB_TOL))
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []


# Level-1 problems against themselves, scaled down through the IOContract (as
# test_kernelbench.py): every kind of op (matmul, activation, reduction, normalization,
# convolution, pooling, scan, loss, attention) with float32 outputs.
LEVEL1_SHAPES = [
    ("1_Square_matrix_multiplication_.py", [[64, 64], [64, 64]]),
    ("4_Matrix_vector_multiplication_.py", [[64, 2048], [2048, 1]]),
    ("6_Matmul_with_large_K_dimension_.py", [[16, 8192], [8192, 16]]),
    ("19_ReLU.py", [[32, 256]]),
    ("23_Softmax.py", [[16, 512]]),
    ("26_GELU_.py", [[16, 512]]),
    ("33_BatchNorm.py", [[2, 64, 8, 8]]),
    ("36_RMSNorm_.py", [[2, 64, 8, 8]]),
    ("47_Sum_reduction_over_a_dimension.py", [[4, 256, 32]]),
    ("67_conv_standard_1D.py", [[2, 64, 128]]),
    ("42_Max_Pooling_2D.py", [[2, 4, 32, 32]]),
    ("89_cumsum.py", [[8, 4096]]),
    ("94_MSELoss.py", [[64, 256], [64, 256]]),
    ("97_ScaledDotProductAttention.py", [[2, 2, 64, 32], [2, 2, 64, 32], [2, 2, 64, 32]]),
]


@needs_kernelbench
@pytest.mark.parametrize(("problem", "shapes"), LEVEL1_SHAPES)
def test_level1_problems_against_themselves_raise_no_flag(
    run, problem: str, shapes: list[list[int]]
) -> None:
    args = [tensor(f"x{i}", s) for i, s in enumerate(shapes)]
    ref = source(TORCH, (LEVEL1 / problem).read_text(), args)
    cand = source(TORCH, ref.source_code + "\n\nclass ModelNew(Model):\n    pass\n", args)
    out, _ = run(job(cand, ref, correct_trial_count=2, perf_trial_count=1, **KB_TOL))
    r = out.result
    assert r.verdict == V.VERDICT_OK, r
    assert list(r.flags) == [] and precision_notes(r) == [], list(r.notes)


@needs_kernelbench
def test_integer_outputs_are_skipped_with_a_note(run) -> None:
    args = [tensor("x", [4, 64, 32])]
    ref = source(TORCH, (LEVEL1 / "51_Argmax_over_a_dimension.py").read_text(), args)
    cand = source(TORCH, ref.source_code + "\n\nclass ModelNew(Model):\n    pass\n", args)
    out, _ = run(job(cand, ref))
    assert out.result.verdict == V.VERDICT_OK and list(out.result.flags) == []
    assert precision_notes(out.result) == [
        "lower-precision check skipped: the reference returns torch.int64"
    ]


FLOAT32_ONLY = MATMUL.replace(
    "        return torch.matmul(a, b)",
    "        assert a.dtype == torch.float32, 'float32 only'\n        return torch.matmul(a, b)",
)


def test_a_reference_that_cannot_run_in_float64_is_skipped_and_the_job_stands(run) -> None:
    body = "torch.matmul(a.half(), b.half()).float()"
    out, _ = run(
        job(source(TORCH, candidate(body, FLOAT32_ONLY)), source(TORCH, FLOAT32_ONLY), **KB_TOL)
    )
    r = out.result
    assert r.verdict == V.VERDICT_OK and list(r.flags) == []
    assert precision_notes(r) == [
        "lower-precision check skipped: the reference raised AssertionError in float64: "
        "float32 only"
    ]


def test_the_check_can_be_turned_off(run) -> None:
    body = "torch.matmul(a.half(), b.half()).float()"
    out, _ = run(
        job(source(TORCH, candidate(body)), source(TORCH, MATMUL), check_precision=False, **KB_TOL)
    )
    assert out.result.verdict == V.VERDICT_OK
    assert list(out.result.flags) == [] and precision_notes(out.result) == []


def test_a_problem_posed_in_half_precision_is_not_checked(run) -> None:
    ref = MATMUL.replace("torch.rand(128, 512), torch.rand(512, 96)",
                         "torch.rand(128, 512).half(), torch.rand(512, 96).half()")  # fmt: skip
    out, _ = run(job(source(TORCH, candidate("torch.matmul(a, b)", ref)), source(TORCH, ref)))
    assert out.result.verdict == V.VERDICT_OK
    assert list(out.result.flags) == [] and precision_notes(out.result) == []


def test_over_the_tensor_budget_it_is_skipped(run) -> None:
    # the inputs fit (448 KiB), a float64 run would not (float64 inputs and output: 992 KiB)
    limits = Limits(max_total_tensor_bytes=600_000)
    body = "torch.matmul(a.half(), b.half()).float()"
    out, _ = run(job(source(TORCH, candidate(body)), source(TORCH, MATMUL), **KB_TOL), limits)
    r = out.result
    assert r.verdict == V.VERDICT_OK and list(r.flags) == []
    (note,) = precision_notes(r)
    assert note == "lower-precision check skipped: a float64 run needs over 1 MiB (budget 1 MiB)"


IN_PLACE = """
import torch
class Model(torch.nn.Module):
    def forward(self, x):
        return x.mul_(3.0).sin()
def get_inputs():
    return [torch.randn(64, 64)]
def get_init_inputs():
    return []
"""


def test_the_float64_run_leaves_the_trial_inputs_alone(run) -> None:
    """A reference that writes its input: the float64 run gets copies, so the candidate is not
    taken for one that wrote its inputs, and the check raises nothing."""
    cand = IN_PLACE.replace("class Model(", "class ModelNew(").replace("x.mul_(3.0)", "(x * 3.0)")
    out, _ = run(job(source(TORCH, cand), source(TORCH, IN_PLACE), **KB_TOL))
    r = out.result
    assert r.verdict == V.VERDICT_OK and list(r.flags) == []
    assert not [n for n in r.notes if "modified its input" in n] and precision_notes(r) == []


def test_thresholds_on_the_errors_alone() -> None:
    g = torch.full((1000,), 100.0, dtype=torch.float64)
    ref = (g * (1 + 3e-7)).float()

    def judged(cand_rel: float, terms: int, reference: torch.Tensor = ref) -> bool:
        c = precision._judge([(g * (1 + cand_rel)).float()], [reference], [g], [], terms)
        assert c.terms == terms and c.note == ""
        return c.flag is not None and c.flag.rule_id == integrity.LOWER_PRECISION

    assert judged(5e-4, 64)  # a float16 result
    assert judged(4.9e-5, 4096)  # float16 operands summed in float32, K = 4096 (H100)
    assert not judged(6e-6, 4096)  # honest float32 at K = 4096 (cuBLAS, a naive loop)
    assert not judged(2e-4, 1 << 20)  # a naive loop over K = 1048576 (level 1's #4)
    assert judged(6e-4, 1 << 20)  # ... while a float16 result still shows
    # a reference no better than TF32 itself (cuDNN's default): flagged only when clearly
    # worse than the reference, never for matching it
    tf32_ref = (g * (1 + 3.5e-4)).float()
    assert not judged(5e-4, 64, tf32_ref) and judged(3.9e-3, 64, tf32_ref)
    assert precision.floor_of(torch.float32, 1) == precision.FLOOR
    assert precision.floor_of(torch.float64, 1) == pytest.approx(precision.FLOOR * 2.0**-29)


def test_the_longest_sum_is_counted_from_the_ops() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv1d(8, 4, 5)  # 8 * 5 = 40 terms an output

        def forward(self, x: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
            return [self.conv(x), torch.cumsum(x, dim=2), (x @ w).sum(dim=1)]

    x, w = torch.randn(2, 8, 300), torch.randn(300, 3)
    outs = Model()(x, w)
    c = precision.check(Model(), [x, w], outs, outs, [], max_bytes=1 << 30,
                        device=torch.device("cpu"))  # fmt: skip
    assert c.flag is None and c.note == "" and c.terms == 300  # the matmul's and the scan's
    c = precision.check(Model(), [x[:, :, :50], w[:50]], Model()(x[:, :, :50], w[:50]),
                        Model()(x[:, :, :50], w[:50]), [], max_bytes=1 << 30,
                        device=torch.device("cpu"))  # fmt: skip
    assert c.terms == 50


def test_a_float64_run_predicted_too_long_is_skipped(monkeypatch) -> None:
    class Model(torch.nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return a.cumsum(0)

    a = torch.rand(1000)
    out = Model()(a)

    def check(ref_seconds: float) -> precision.Check:
        return precision.check(Model(), [a], [out], [out], [], max_bytes=1 << 30,
                               device=torch.device("cpu"), ref_seconds=ref_seconds)  # fmt: skip

    # a slow first run (kernels loaded, algorithms chosen) is timed again, warm
    assert check(100.0) == precision.Check(terms=1000, seconds=pytest.approx(0, abs=5))
    monkeypatch.setitem(precision.SLOWDOWN, "cpu", 1e12)
    assert check(1e-9).note.startswith(
        "lower-precision check skipped: the reference's float32 run took 0.00 s: in float64 it "
        "could take 1e+12 times as long"
    )


def test_cost_on_a_large_level1_matmul_on_the_cpu() -> None:
    """One float64 run of a 2048^3 matmul and the comparison of its outputs: about as long as
    the reference's own float32 run, times the float64 rate (here about 2x)."""
    torch.manual_seed(0)
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)

    class Model(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.matmul(a, b)

    t0 = time.perf_counter()
    ref = Model()(a, b)
    ref_s = time.perf_counter() - t0
    c = precision.check(Model(), [a, b], [ref.clone()], [ref], [], max_bytes=1 << 34,
                        device=torch.device("cpu"))  # fmt: skip
    assert c.flag is None and c.note == ""
    assert c.seconds < 10 * ref_s + 1.0, (c.seconds, ref_s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_small_outputs_errors_on_the_host_are_those_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A small output's errors against its float64 run are measured on the host (as
    compare does): the same numbers as on the device."""
    torch.manual_seed(2)
    gold = torch.randn(4096, dtype=torch.float64, device="cuda")
    ref = gold.float()
    cand = ref.half().float()
    got = []
    for host_max in (compare.HOST_COMPARE_MAX, 0):
        monkeypatch.setattr(compare, "HOST_COMPARE_MAX", host_max)
        got.append(precision._errors(cand, ref, gold))
    assert got[0] is not None and got[0][0] > got[0][1] > 0
    assert got[0] == got[1]


def test_a_small_outputs_errors_in_numpy_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small output's errors against its float64 run are measured in numpy on the host
    (precision._errors_on_host), a large one's in torch: the same numbers, infinities and
    NaN left out, None where the float64 run has no finite magnitude."""
    torch.manual_seed(2)
    gold = torch.randn(4096, dtype=torch.float64)
    ref = gold.float()
    cand = ref.half().float()
    cand[7], ref[9], gold[11] = float("nan"), float("inf"), float("-inf")
    cases = [(cand, ref, gold), (cand, ref, torch.zeros_like(gold)), (cand[:0], ref[:0], gold[:0])]
    for c, r, g in cases:
        got = []
        for host_max in (compare.HOST_COMPARE_MAX, 0):
            monkeypatch.setattr(compare, "HOST_COMPARE_MAX", host_max)
            got.append(precision._errors(c, r, g))
        assert got[0] == got[1]
    assert precision._errors(cand, ref, gold) is not None
    assert precision._errors(cand, ref, torch.zeros_like(gold)) is None
