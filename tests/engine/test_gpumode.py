"""GPU MODE's format (KERNEL_TYPE_GPU_MODE): the client's JobSpec from a task directory, the
service's checks of it, and the engine running it as GPU MODE's harness does, on the CPU.

The example task (tests/gpumode_tasks/softmax_py) is this repository's own: a row-wise softmax
with a correct, a wrong and a raising submission."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from engine_helpers import HAS_GPU, V
from kerneleval import gpumode
from kerneleval.v1 import kernel_pb2
from kerneleval_server.spec.validation import validate_spec

TASK = Path(__file__).resolve().parents[1] / "gpumode_tasks" / "softmax_py"
LIST_TASK = TASK.parent / "grouped_matmul_py"  # cases that hold lists
GPU_MODE = kernel_pb2.KERNEL_TYPE_GPU_MODE
FAST = kernel_pb2.EvalOptions(perf_trial_count=3, warmup_count=1)


def task_spec(submission: str = "submission.py", **options: object) -> kernel_pb2.JobSpec:
    opts = kernel_pb2.EvalOptions()
    opts.CopyFrom(FAST)
    for k, v in options.items():
        setattr(opts, k, v)
    return gpumode.spec_from_directory(TASK, TASK / submission, options=opts)


def inline_spec(reference: str, submission: str, tests: int = 2) -> kernel_pb2.JobSpec:
    """A task written in the test: cases {"n": 4..., "seed": ...}, no shared modules."""
    spec = kernel_pb2.JobSpec(
        kernel=kernel_pb2.KernelSource(type=GPU_MODE, source_code=submission),
        reference=kernel_pb2.KernelSource(type=GPU_MODE, source_code=reference),
        options=FAST,
    )
    for i in range(tests):
        spec.gpu_mode.tests.append(gpumode.task_case({"n": 4 + i, "seed": 10 + i}, f"tests[{i}]"))
    return spec


def spec_with_tests(tests: list[kernel_pb2.TaskCase]) -> kernel_pb2.JobSpec:
    spec = inline_spec(DOUBLE_REFERENCE, DOUBLE, tests=0)
    spec.gpu_mode.tests.extend(tests)
    return spec


DOUBLE_REFERENCE = """
import torch

def generate_input(n, seed):
    torch.manual_seed(seed)
    return torch.randn(n)

def ref_kernel(data):
    return data * 2

def check_implementation(data, output):
    ok = torch.allclose(output, ref_kernel(data))
    return ok, "" if ok else "values differ"
"""
DOUBLE = "def custom_kernel(data):\n    return data * 2\n"


# -- the client: task.yml and the directory ----------------------------------------------------


def test_spec_from_directory_reads_the_task_as_gpu_mode_lays_it_out() -> None:
    spec = task_spec()
    assert spec.kernel.type == spec.reference.type == GPU_MODE
    assert "def custom_kernel" in spec.kernel.source_code
    assert "def generate_input" in spec.reference.source_code
    tests = [[(a.name, a.int_value) for a in c.args] for c in spec.gpu_mode.tests]
    assert tests[0] == [("rows", 1), ("cols", 8), ("seed", 4242)] and len(tests) == 3
    assert len(spec.gpu_mode.benchmarks) == 2
    # task.py and ../utils.py travel; the submission, the reference and eval.py do not.
    assert [f.name for f in spec.gpu_mode.files] == ["task.py", "utils.py"]
    assert "def match_reference" in spec.gpu_mode.files[1].content
    assert validate_spec(spec) == []


def test_task_yml_is_yaml_block_style_comments_and_scalars() -> None:
    text = (
        "# name: x\n"
        "description: |\n"
        "  tests: not a key here\n"
        "  - nor an item\n"
        "config:\n"
        '  main: "eval.py"\n'
        "tests:\n"
        "  - size: 8   # a comment\n"
        "    dtype: 'float16'\n"
        "    scale: 0.5\n"
        "    causal: True\n"  # YAML 1.1, as GPU MODE's task files write it
        "  - {size: 16, dtype: \"bf16\", note: 'it''s # not a comment', \"seed\":402}\n"
        "ranking_by: geom\n"
    )
    parsed = gpumode.parse_task_yml(text)
    assert parsed["description"] == "tests: not a key here\n- nor an item\n"
    assert parsed["config"] == {"main": "eval.py"}
    assert parsed["tests"] == [
        {"size": 8, "dtype": "float16", "scale": 0.5, "causal": True},
        {"size": 16, "dtype": "bf16", "note": "it's # not a comment", "seed": 402},
    ]
    assert parsed["ranking_by"] == "geom"
    case = gpumode.task_case(parsed["tests"][0], "tests[0]")
    kinds = [a.WhichOneof("value") for a in case.args]
    assert kinds == ["int_value", "string_value", "float_value", "bool_value"]


def test_list_and_nested_values_of_a_case_travel_as_they_are_written() -> None:
    """nvfp4_group_gemm's shape: `{"m": [96, 128], ...}`; and a mapping, nested."""
    parsed = gpumode.parse_task_yml(
        'tests:\n  - {"m": [96, 128], "g": 2, "opts": {"scale": [0.5, 2], "tag": "a"},'
        ' "none": [], "seed": 1111}\n'
    )
    case = gpumode.task_case(parsed["tests"][0], "tests[0]")
    m, g, opts, none, _ = case.args
    assert [v.int_value for v in m.list_value.values] == [96, 128]
    assert g.int_value == 2
    scale, tag = opts.map_value.entries
    assert scale.key == "scale" and [v.WhichOneof("value") for v in scale.value.list_value.values] \
        == ["float_value", "int_value"]  # fmt: skip
    assert (tag.key, tag.value.string_value) == ("tag", "a")
    assert none.WhichOneof("value") == "list_value" and len(none.list_value.values) == 0
    # What the engine gives generate_input: lists as tuples (GPU MODE's harness does so).
    from kerneleval_server.engine.gpumode_cases import cases

    (c,) = cases("test", [case], None)
    assert c.kwargs == {"m": (96, 128), "g": 2, "opts": {"scale": (0.5, 2), "tag": "a"},
                        "none": (), "seed": 1111}  # fmt: skip
    assert c.spec == "m: [96, 128]; g: 2; opts: {scale: [0.5, 2], tag: a}; none: []; seed: 1111"
    assert validate_spec(spec_with_tests([case])) == []


def test_the_list_valued_fixture_reads_as_a_task() -> None:
    spec = gpumode.spec_from_directory(LIST_TASK, options=FAST)
    first = {a.name: a for a in spec.gpu_mode.tests[0].args}
    assert [v.int_value for v in first["m"].list_value.values] == [8, 16]
    block = {a.name: a for a in spec.gpu_mode.tests[2].args}  # the block-style case
    assert [v.int_value for v in block["k"].list_value.values] == [5]
    assert len(spec.gpu_mode.benchmarks) == 1
    assert validate_spec(spec) == []


def test_task_errors_name_the_place(tmp_path: Path) -> None:
    with pytest.raises(gpumode.TaskError, match=r"tests\[0\]: seed has no value"):
        parsed = gpumode.parse_task_yml('tests:\n  - {"B": 1, "seed":}\n')
        gpumode.task_case(parsed["tests"][0], "tests[0]")
    with pytest.raises(gpumode.TaskError, match=r"tests\[0\]: m\[1\] has no value"):
        parsed = gpumode.parse_task_yml('tests:\n  - {"m": [1, null]}\n')
        gpumode.task_case(parsed["tests"][0], "tests[0]")
    with pytest.raises(gpumode.TaskError, match=r"task.yml:3: not YAML"):
        gpumode.parse_task_yml('tests:\n  - {"B": 1,\n')
    with pytest.raises(gpumode.TaskError, match=r"task.yml: a task file is a mapping"):
        gpumode.parse_task_yml("- just\n- a list\n")
    with pytest.raises(gpumode.TaskError, match="task.yml: no such file"):
        gpumode.load_task(tmp_path)
    (tmp_path / "task.yml").write_text("tests:\n  - {n: 1}\n")
    with pytest.raises(gpumode.TaskError, match="reference.py: no such file"):
        gpumode.load_task(tmp_path)


# -- the service's checks ----------------------------------------------------------------------


def fields(spec: kernel_pb2.JobSpec) -> dict[str, str]:
    return {v.field: v.description for v in validate_spec(spec)}


def test_validation_pairs_the_types_and_checks_the_task() -> None:
    spec = task_spec()
    spec.ClearField("reference")
    assert (
        "check_implementation (the judge) come from the reference" in fields(spec)["spec.reference"]
    )
    spec = task_spec()
    spec.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
    assert "KERNEL_TYPE_GPU_MODE goes with" in fields(spec)["spec.reference.type"]
    spec = task_spec()
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    assert "spec.gpu_mode" in fields(spec) and "spec.reference.type" in fields(spec)
    spec = task_spec()
    del spec.gpu_mode.tests[:]
    spec.gpu_mode.benchmarks[0].args[0].name = "2x"
    spec.gpu_mode.benchmarks[1].args[1].name = "rows"
    spec.gpu_mode.benchmarks[1].args[2].ClearField("int_value")
    spec.gpu_mode.files.add(name="eval.py", content="")
    spec.gpu_mode.files.add(name="../x.py", content="")
    spec.gpu_mode.files.add(name="task.py", content="")
    spec.kernel.io.args.add(name="x", int_value=1)
    got = fields(spec)
    assert got["spec.gpu_mode.tests"].startswith("required")
    assert "not an identifier" in got["spec.gpu_mode.benchmarks[0].args[0].name"]
    assert "duplicate" in got["spec.gpu_mode.benchmarks[1].args[1].name"]
    assert got["spec.gpu_mode.benchmarks[1].args[2].value"].startswith("required")
    assert "the harness's own" in got["spec.gpu_mode.files[2].name"]
    assert "module file name" in got["spec.gpu_mode.files[3].name"]
    assert "duplicate" in got["spec.gpu_mode.files[4].name"]
    assert "no IOContract" in got["spec.kernel.io"]


def test_validation_of_list_and_mapping_values() -> None:
    from kerneleval_server.spec.validation import Limits

    case = gpumode.task_case(
        {"m": [1.0, 2.0], "opts": {"a": [1, "x" * 300], "b": 2}, "seed": 1}, "tests[0]"
    )
    case.args[0].list_value.values[1].float_value = math.nan
    case.args[1].map_value.entries[1].key = "a"  # a duplicate key
    case.args.add(name="empty").list_value.values.add()  # a value without one
    got = {v.field: v.description for v in validate_spec(spec_with_tests([case]))}
    base = "spec.gpu_mode.tests[0].args"
    assert got == {
        f"{base}[0].list_value.values[1].float_value": "must be finite",
        f"{base}[1].map_value.entries[0].value.list_value.values[1].string_value":
            "300 bytes, the limit is 256 bytes",
        f"{base}[1].map_value.entries[1].key": "duplicate key 'a'",
        f"{base}[3].list_value.values[0].value":
            "required: an int, float, string, bool, list or map",
    }  # fmt: skip
    deep: object = 1
    for _ in range(4):
        deep = [deep]
    spec = spec_with_tests([gpumode.task_case({"d": deep, "wide": list(range(10))}, "t")])
    small = Limits(max_task_depth=3, max_task_values=14)
    got = {v.field: v.description for v in validate_spec(spec, small)}
    assert got == {f"{base}[0].list_value.values[0].list_value.values[0].list_value.values[0]"
                   ".list_value": "lists and mappings nested deeper than 3"}  # fmt: skip
    small = Limits(max_task_depth=8, max_task_values=13)
    assert {v.field: v.description for v in validate_spec(spec, small)} == {
        f"{base}": "14 values in lists and mappings; at most 13"
    }


# -- the engine --------------------------------------------------------------------------------


def test_correct_submission_is_checked_on_every_case_then_timed_per_benchmark(run) -> None:
    out, rep = run(task_spec())
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.compiled and r.correctness, r
    assert r.correctness_status == V.CORRECTNESS_PASSED and r.failed_side == V.SIDE_UNSPECIFIED
    assert [c.spec for c in r.test_cases] == [
        "rows: 1; cols: 8; seed: 4242",
        "rows: 4; cols: 33; seed: 5236",
        "rows: 16; cols: 128; seed: 1001",
    ]
    assert all(c.passed for c in r.test_cases) and all(c.passed for c in r.benchmark_cases)
    assert r.validation.trial_count == r.validation.trials_passed == 5  # 3 tests, 2 benchmarks
    assert rep.phases() == [V.PHASE_COMPILING, V.PHASE_VALIDATING, V.PHASE_PROFILING]
    val = [e[2:] for e in rep.events if e[0] == "progress" and e[1] == V.PHASE_VALIDATING]
    assert val == [(i, 5) for i in range(1, 6)]
    prof = [e[2:] for e in rep.events if e[0] == "progress" and e[1] == V.PHASE_PROFILING]
    assert prof[-1] == (12, 12)  # 2 benchmarks x 3 trials x (kernel, reference)
    for c in r.benchmark_cases:
        assert c.runtime.trial_count == 3 and c.reference_runtime.trial_count == 3
        assert c.speedup == pytest.approx(c.reference_runtime.median_ms / c.runtime.median_ms)
    medians = [c.runtime.median_ms for c in r.benchmark_cases]
    assert r.runtime.median_ms == pytest.approx(math.sqrt(medians[0] * medians[1]))
    speedups = [c.speedup for c in r.benchmark_cases]
    assert r.speedup == pytest.approx(math.sqrt(speedups[0] * speedups[1]))


def test_wrong_submission_fails_the_cases_it_gets_wrong_and_is_not_timed(run) -> None:
    out, rep = run(task_spec("wrong_submission.py"))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT and r.compiled and not r.correctness
    assert r.failed_side == V.SIDE_KERNEL and r.correctness_status == V.CORRECTNESS_FAILED
    # Right for one row only: the first test passes, every other case is still run.
    assert [c.passed for c in r.test_cases] == [True, False, False]
    assert [c.passed for c in r.benchmark_cases] == [False, False]
    assert r.test_cases[1].message == "117 of 132 elements differ"
    assert r.validation_error == (
        "1 of 5 cases passed; test 1 (rows: 4; cols: 33; seed: 5236): 117 of 132 elements differ"
    )
    assert V.PHASE_PROFILING not in rep.phases() and r.runtime.trial_count == 0


def test_list_values_reach_generate_input_as_the_task_expects(run) -> None:
    """The fixture's generate_input raises unless m, n and k are tuples of g ints."""
    out, _ = run(gpumode.spec_from_directory(LIST_TASK, options=FAST))
    r = out.result
    assert r.verdict == V.VERDICT_OK and r.correctness_status == V.CORRECTNESS_PASSED, r
    assert [c.spec for c in r.test_cases] == [
        "m: [8, 16]; n: [16, 8]; k: [32, 16]; g: 2; seed: 1111",
        "m: [4, 12, 20]; n: [8, 8, 24]; k: [16, 8, 8]; g: 3; seed: 2222",
        "m: [1]; n: [3]; k: [5]; g: 1; seed: 3333",
    ]
    assert r.benchmark_cases[0].runtime.trial_count == 3
    out, _ = run(gpumode.spec_from_directory(LIST_TASK, LIST_TASK / "wrong_submission.py",
                                             options=FAST))  # fmt: skip
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT
    assert [c.passed for c in r.test_cases] == [False, False, True]
    assert r.test_cases[0].message == "group 1: values differ"


def test_raising_submission_is_a_runtime_error_of_the_kernel(run) -> None:
    out, _ = run(task_spec("raising_submission.py"))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.failed_side == V.SIDE_KERNEL
    assert r.error.exception_type == "NotImplementedError"
    assert r.error.message == "no kernel for (1, 8) yet"
    assert "raising_submission" not in r.error.traceback and "custom_kernel" in r.error.traceback
    assert [(c.spec, c.passed, c.message) for c in r.test_cases] == [
        ("rows: 1; cols: 8; seed: 4242", False, "no kernel for (1, 8) yet")
    ]


def test_the_judge_is_the_references_and_the_shared_modules_are_copies(run) -> None:
    # The reference's judge looks `utils.close` up when it runs; the submission replaces it in
    # its own copy of utils, and defines a check_implementation of its own: neither counts.
    reference = DOUBLE_REFERENCE.replace(
        "ok = torch.allclose(output, ref_kernel(data))",
        "import utils\n    ok = utils.close(output, ref_kernel(data))",
    )
    cheat = (
        "import utils\n"
        "utils.close = lambda a, b: True\n"
        "def check_implementation(data, output):\n    return True, ''\n"
        "def custom_kernel(data):\n    return data * 3\n"
    )
    spec = inline_spec(reference, cheat)
    spec.gpu_mode.files.add(
        name="utils.py", content="import torch\ndef close(a, b):\n    return torch.allclose(a, b)\n"
    )
    out, _ = run(spec)
    assert out.result.verdict == V.VERDICT_INCORRECT, out.result
    spec.kernel.source_code = cheat.replace("data * 3", "data * 2")
    out, _ = run(spec)
    assert out.result.verdict == V.VERDICT_OK, out.result


# amd/mla-decode: the data holds a KVCache module and a Config dataclass, and a call writes into
# the cache (its eval.py copies both for the check); here a cache that counts its calls.
STATEFUL_REFERENCE = """
import torch

class Cache:
    def __init__(self, x):
        self.data = x
        self.calls = 0

    def step(self):
        self.calls += 1
        return self.data * self.calls

def generate_input(n, seed):
    torch.manual_seed(seed)
    return (Cache(torch.randn(n)), n)

def ref_kernel(data):
    return data[0].step()

def check_implementation(data, output):
    ok = torch.allclose(output, ref_kernel(data))
    return ok, "" if ok else "values differ"
"""


def test_objects_in_the_data_are_the_kernels_own_copies(run) -> None:
    """The kernel gets a copy of the data, its objects too (deepcopy), not only its tensors: a
    call that changes an object of its data leaves the judge's as generate_input made it."""
    submission = "def custom_kernel(data):\n    return data[0].step()\n"
    out, _ = run(inline_spec(STATEFUL_REFERENCE, submission))
    assert out.result.verdict == V.VERDICT_OK, out.result


def test_older_judges_return_an_error_string(run) -> None:
    reference = DOUBLE_REFERENCE.replace(
        'return ok, "" if ok else "values differ"', 'return "" if ok else "values differ"'
    )
    out, _ = run(inline_spec(reference, DOUBLE))
    assert out.result.verdict == V.VERDICT_OK
    out, _ = run(inline_spec(reference, DOUBLE.replace("* 2", "* 2 + 1")))
    assert out.result.verdict == V.VERDICT_INCORRECT
    assert out.result.test_cases[0].message == "values differ"


def test_failures_of_the_reference_are_blamed_on_it(run) -> None:
    out, _ = run(inline_spec(DOUBLE_REFERENCE.replace("def ref_kernel", "def other"), DOUBLE))
    r = out.result
    assert r.verdict == V.VERDICT_COMPILE_ERROR and r.failed_side == V.SIDE_REFERENCE
    assert r.compilation_error == "reference: no function ref_kernel() in the source"
    assert not r.compiled  # the kernel was never built

    broken = DOUBLE_REFERENCE.replace("torch.manual_seed(seed)", "raise KeyError(seed)")
    out, _ = run(inline_spec(broken, DOUBLE))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.failed_side == V.SIDE_REFERENCE
    assert r.compiled and r.error.message == "reference: generate_input(): 10"

    # A judge that fails on every output, the reference's own too, is the reference's fault.
    broken = DOUBLE_REFERENCE.replace("ok = torch", "ok = torch.nope")
    out, _ = run(inline_spec(broken, DOUBLE))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.failed_side == V.SIDE_REFERENCE
    assert r.error.message.startswith("reference: check_implementation(): ")

    # So is an answer that is neither of GPU MODE's forms.
    broken = DOUBLE_REFERENCE.replace('return ok, "" if ok else "values differ"', "return 42")
    out, _ = run(inline_spec(broken, DOUBLE))
    r = out.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.failed_side == V.SIDE_REFERENCE
    assert "check_implementation returned a int" in r.error.message


def test_a_judge_that_raises_on_the_kernels_output_only_fails_the_kernel(run) -> None:
    out, _ = run(inline_spec(DOUBLE_REFERENCE, "def custom_kernel(data):\n    return None\n"))
    r = out.result
    assert r.verdict == V.VERDICT_INCORRECT and r.failed_side == V.SIDE_KERNEL
    assert r.test_cases[0].message.startswith("check_implementation raised TypeError on it: ")


def test_the_jobs_seed_is_mixed_into_the_cases_seeds_and_zero_trials_skip_benchmarks(
    run,
) -> None:
    out, rep = run(task_spec(seed=7, perf_trial_count=0))
    r = out.result
    assert r.verdict == V.VERDICT_OK
    seeds = [c.spec.rsplit("seed: ", 1)[1] for c in r.test_cases]
    assert seeds != ["4242", "5236", "1001"] and len(set(seeds)) == 3
    assert len(r.benchmark_cases) == 0 and V.PHASE_PROFILING not in rep.phases()
    assert "perf_trial_count is 0: not timed" in r.notes


@pytest.mark.skipif(HAS_GPU, reason="checks the answer of a host without a GPU")
def test_load_inline_submission_cannot_run_here_and_was_not_compiled(run) -> None:
    submission = (
        "from torch.utils.cpp_extension import load_inline\n"
        "ext = load_inline('double_ext', cpp_sources='torch::Tensor twice(torch::Tensor x);',\n"
        "                  cuda_sources='// the CUDA kernel', functions=['twice'])\n"
        "def custom_kernel(data):\n    return ext.twice(data)\n"
    )
    out, _ = run(inline_spec(DOUBLE_REFERENCE, submission))
    r = out.result
    assert r.verdict == V.VERDICT_CANNOT_RUN_HERE and not r.compiled, r
    assert r.failed_side == V.SIDE_KERNEL and r.error.exception_type == "NoDeviceError"
    assert any("load_inline('double_ext') needs a CUDA build of torch" in n for n in r.notes)


def test_run_job_forgets_the_shared_modules(run) -> None:
    import os
    import sys

    out, _ = run(task_spec(perf_trial_count=0))
    assert out.result.verdict == V.VERDICT_OK
    assert "task" not in sys.modules and "utils" not in sys.modules
    # The shared modules' folder (work_dir/gpumode/<pid>_<n>), not a checkout named so.
    assert not any(f"{os.sep}gpumode{os.sep}" in p for p in sys.path)


def test_walks_over_a_nest_hold_nothing_once_done() -> None:
    """share_layout, share_rebuild, flatten and rebuild leave no reference cycle behind: one
    would keep a call's data (gigabytes a call on a GPU) until the cyclic collector ran, and
    a judge timing 100 calls ran out of GPU memory that way."""
    import gc
    import weakref

    import torch
    from kerneleval_server.engine import gpumode_nest

    gc.collect()
    gc.disable()
    try:
        data = (torch.ones(4), [torch.ones(2), {"k": torch.ones(3)}], 7)
        gone = [weakref.ref(t) for t in (data[0], data[1][0], data[1][1]["k"])]
        leaves, tree = gpumode_nest.share_layout(data)
        rebuilt = gpumode_nest.share_rebuild(leaves, tree)
        out, structure = gpumode_nest.flatten(rebuilt)
        assert gpumode_nest.rebuild(out, structure) == rebuilt
        del data, leaves, tree, rebuilt, out, structure
        assert [r() for r in gone] == [None, None, None]
    finally:
        gc.enable()
