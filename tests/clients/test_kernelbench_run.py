"""`kerneleval kernelbench`: a KernelBench run directory evaluated against the shared level-1
problems through a real service, with planted wrong kernels; KernelBench's result JSON and
summary; resuming after an interruption. The problems are read from /work/shared/kernelbench
(scaled down with --inputs); only the generated kernels are written, into tmp_path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kerneleval import cli
from kerneleval import kernelbench_run as kb
from kerneleval.v1 import job_pb2

CORRECT_RELU = """import torch


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0.0)
"""
WRONG_LEAKY_RELU = """import torch


class ModelNew(torch.nn.Module):
    def __init__(self, negative_slope: float = 0.01):
        super().__init__()

    def forward(self, x):
        return x * 2.0  # planted: not a leaky ReLU
"""
BROKEN_SIGMOID = """import torch


class ModelNew(torch.nn.Module:
    def forward(self, x):
        return torch.sigmoid(x)
"""
# KernelBench's load_inline convention: on a host without CUDA its CUDA is never compiled, and
# the job ends VERDICT_CANNOT_RUN_HERE.
LOAD_INLINE_RELU = """import torch
from torch.utils.cpp_extension import load_inline

relu = load_inline("relu_ext_kb", cpp_sources="torch::Tensor relu(torch::Tensor x);",
                   cuda_sources="// a CUDA kernel", functions=["relu"])


class ModelNew(torch.nn.Module):
    def forward(self, x):
        return relu.relu(x)
"""
SMALL = {"args": [{"name": "x", "tensor": {"shape": ["16", "64"], "dtype": "DTYPE_FLOAT32"}}]}


def make_run(run_dir: Path) -> None:
    """Kernels for problems 19 (right), 20 (wrong), 21 (does not compile); none for 22."""
    run_dir.mkdir()
    for pid, source in ((19, CORRECT_RELU), (20, WRONG_LEAKY_RELU), (21, BROKEN_SIGMOID)):
        (run_dir / f"level_1_problem_{pid}_sample_0_kernel.py").write_text(source)
    (run_dir / "level_2_problem_19_sample_0_kernel.py").write_text(CORRECT_RELU)  # not level 1
    (run_dir / "notes.txt").write_text("not a kernel")


def test_problems_kernels_and_subsets(kernelbench: Path, tmp_path: Path) -> None:
    level1 = kb.find_problems(kernelbench, 1)  # the folder that holds level1/
    assert level1 == kb.find_problems(kernelbench / "level1", 1)
    assert len(level1) == 100 and level1[19].name == "19_ReLU.py"
    run_dir = tmp_path / "run"
    make_run(run_dir)
    (run_dir / "level_1_problem_999_sample_0_kernel.py").write_text(CORRECT_RELU)
    samples, notes = kb.find_samples(run_dir, 1, level1)
    assert [(s.problem_id, s.sample_id) for s in samples] == [(19, 0), (20, 0), (21, 0)]
    assert notes == ["level_1_problem_999_sample_0_kernel.py: no problem 999 in the problems "
                     "folder; skipped"]  # fmt: skip
    assert kb.parse_subset("19-21,40") == {19, 20, 21, 40}
    with pytest.raises(kb.RunError):
        kb.parse_subset("19-x")
    with pytest.raises(kb.RunError):
        kb.find_problems(tmp_path / "nowhere", 1)


def test_summary_follows_kernelbench_analysis() -> None:
    """fast_p over every problem (a missing one fails), speedups from mean runtimes, and the
    geometric mean over the correct ones, as benchmark_eval_analysis.py and score.py do."""

    def entry(correct: bool, runtime: float, ref: float) -> dict:
        return {"compiled": True, "correctness": correct, "runtime": runtime, "ref_runtime": ref}

    p = Path("x.py")
    results = {
        kb.Sample(1, 1, 0, p, p): entry(True, 1.0, 2.0),  # 2x
        kb.Sample(1, 2, 0, p, p): entry(True, 2.0, 1.0),  # 0.5x
        kb.Sample(1, 3, 0, p, p): entry(False, -1.0, -1.0),
        kb.Sample(1, 3, 1, p, p): entry(True, 1.0, 9.0),  # sample 1: not counted
    }
    s = kb.summary("run", 1, [1, 2, 3, 4], results)
    assert s["summary"]["total_problems"] == 4 and s["summary"]["total_evaluated"] == 3
    assert s["summary"]["correct_count"] == 2 and s["summary"]["compilation_rate"] == 0.75
    fast = s["speedup_metrics"]["fast_p"]
    assert fast["0.0"] == 0.5 and fast["1.0"] == 0.25 and fast["1.5"] == 0.25
    assert fast["2.0"] == 0.0  # strictly faster than p, as fastp's speed_up > p
    assert s["speedup_metrics"]["geometric_mean_speedup"] == pytest.approx(1.0)


def test_entry_in_kernelbench_shape() -> None:
    job = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict = job_pb2.VERDICT_COMPILE_ERROR
    r.compilation_error = "SyntaxError: '(' was never closed"
    r.device.index = -1
    e = kb.kernelbench_entry(0, job)
    assert {k: e[k] for k in ("compiled", "correctness", "runtime", "runtime_stats")} == {
        "compiled": False, "correctness": False, "runtime": -1.0, "runtime_stats": {},
    }  # fmt: skip
    assert e["metadata"]["compilation_error"].startswith("SyntaxError")
    assert e["metadata"]["kerneleval_verdict"] == "COMPILE_ERROR"


def test_a_kernel_that_cannot_run_here_is_not_evaluated() -> None:
    """VERDICT_CANNOT_RUN_HERE: "evaluated": false in its entry; the summary counts it as a
    problem without a result (KernelBench's analysis of an eval that returned None): neither
    compiled nor correct, in fast_p's denominator, and in not_evaluated_count."""
    job = job_pb2.Job(job_id="j2", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict = job_pb2.VERDICT_CANNOT_RUN_HERE
    r.failed_side = job_pb2.SIDE_KERNEL
    r.compiled = True  # compiled in a build process, but no GPU to run it on
    r.error.message = "no CUDA device: the kernel compiled but cannot run here"
    r.correctness_status = job_pb2.CORRECTNESS_UNSPECIFIED
    e = kb.kernelbench_entry(0, job)
    assert e["evaluated"] is False and e["correctness"] is False and e["runtime"] == -1.0
    assert e["metadata"]["not_evaluated"].startswith("not run here (needs a GPU): no CUDA")
    assert e["metadata"]["kerneleval_verdict"] == "CANNOT_RUN_HERE"
    assert "runtime_error" not in e["metadata"]  # not a failure of the kernel
    assert not kb.evaluated(e) and kb.evaluated({"compiled": True})  # older entries: judged
    ok = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_DONE)
    ok.result.verdict = job_pb2.VERDICT_OK
    ok.result.compiled = True
    ok.result.correctness_status = job_pb2.CORRECTNESS_PASSED
    ok.result.correctness = True
    ok.result.runtime.CopyFrom(job_pb2.RuntimeStats(mean_ms=1.0, trial_count=10))
    ok.result.reference_runtime.CopyFrom(job_pb2.RuntimeStats(mean_ms=3.0, trial_count=10))
    assert kb.kernelbench_entry(0, ok)["evaluated"] is True
    p = Path("x.py")
    results = {kb.Sample(1, 1, 0, p, p): kb.kernelbench_entry(0, ok),
               kb.Sample(1, 2, 0, p, p): e}  # fmt: skip
    s = kb.summary("run", 1, [1, 2], results)
    assert s["summary"]["total_problems"] == 2 and s["summary"]["total_evaluated"] == 1
    assert s["summary"]["not_evaluated_count"] == 1
    assert s["summary"]["compiled_count"] == 1 and s["summary"]["correct_count"] == 1
    assert s["speedup_metrics"]["fast_p"]["1.0"] == 0.5  # the denominator: every problem
    assert s["speedup_metrics"]["geometric_mean_speedup"] == pytest.approx(3.0)
    assert "not evaluated  1: not run here (needs a GPU)" in kb.summary_text(s)


def run_cli(capsys, address: str, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--server", address, "--timeout", "300", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_run_against_shared_problems_with_planted_wrong_kernels(
    kernelbench: Path, kerneleval_service, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    make_run(run_dir)
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({str(pid): SMALL for pid in (19, 20, 21, 22)}))
    args = ["kernelbench", str(run_dir), "--level", "1", "--problems", str(kernelbench),
            "--subset", "19-22", "--inputs", str(inputs)]  # fmt: skip
    code, out, err = run_cli(capsys, kerneleval_service.address, *args)
    assert code == 0, err + out
    assert "3 kernel(s) for 4 problem(s)" in err and "3 to evaluate" in err
    assert "1 problem(s) without a kernel" in err
    files = sorted(p.name for p in (run_dir / kb.RESULTS_DIR).iterdir())
    assert files == [f"level_1_problem_{i}_sample_0.json" for i in (19, 20, 21)]
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert sorted(results) == ["19", "20", "21"]
    right, wrong, broken = (results[k][0] for k in ("19", "20", "21"))
    for e in (right, wrong, broken):
        assert {"sample_id", "compiled", "correctness", "metadata", "runtime",
                "runtime_stats"} <= set(e)  # fmt: skip
    assert right["compiled"] and right["correctness"] and right["runtime"] > 0
    assert right["runtime_stats"]["num_trials"] == 10  # the KernelBench preset
    assert right["metadata"]["correctness_trials"] == "(1 / 1)"
    assert wrong["compiled"] and not wrong["correctness"] and wrong["runtime"] == -1.0
    assert wrong["metadata"]["kerneleval_verdict"] == "INCORRECT"
    assert not broken["compiled"] and not broken["correctness"]
    assert "compilation_error" in broken["metadata"]
    analysis = json.loads((run_dir / "analysis_results.json").read_text())
    assert analysis["summary"]["total_problems"] == 4
    assert analysis["summary"]["compiled_count"] == 2
    assert analysis["summary"]["correct_count"] == 1
    assert analysis["speedup_metrics"]["fast_p"]["0.0"] == 0.25
    speedup = right["ref_runtime"] / right["runtime"]
    assert analysis["speedup_metrics"]["geometric_mean_speedup"] == pytest.approx(speedup)
    assert "fast_p    p=0: 0.250" in out and "correct   1/4 (25.0%)" in out

    # Resumed: nothing left to do, nothing written again.
    before = {p: p.stat().st_mtime_ns for p in (run_dir / kb.RESULTS_DIR).iterdir()}
    code, out, err = run_cli(capsys, kerneleval_service.address, *args, "--json")
    assert code == 0 and "3 already have a result, 0 to evaluate" in err
    assert json.loads(out)["summary"]["correct_count"] == 1
    assert {p: p.stat().st_mtime_ns for p in before} == before
    # As after an interruption: the missing result (and only it) is evaluated again.
    (run_dir / kb.RESULTS_DIR / "level_1_problem_20_sample_0.json").unlink()
    (run_dir / "level_1_problem_20_sample_0_kernel.py").write_text(
        CORRECT_RELU.replace("torch.clamp(x, min=0.0)", "torch.nn.functional.leaky_relu(x)")
    )
    code, out, err = run_cli(capsys, kerneleval_service.address, *args)
    assert code == 0 and "2 already have a result, 1 to evaluate" in err, err
    assert "correct   2/4 (50.0%)" in out
    assert (run_dir / kb.RESULTS_DIR / "level_1_problem_19_sample_0.json").stat().st_mtime_ns == (
        before[run_dir / kb.RESULTS_DIR / "level_1_problem_19_sample_0.json"]
    )


def test_bad_input_is_a_usage_error(kernelbench: Path, tmp_path: Path, capsys) -> None:
    code = cli.main(["kernelbench", str(tmp_path / "nope"), "--level", "1", "--problems",
                     str(kernelbench)])  # fmt: skip
    assert code == cli.EXIT_USAGE and "not a folder" in capsys.readouterr().err
    bad = tmp_path / "inputs.json"
    bad.write_text("[1, 2]")
    (tmp_path / "run").mkdir()
    code = cli.main(["kernelbench", str(tmp_path / "run"), "--level", "1", "--problems",
                     str(kernelbench), "--inputs", str(bad)])  # fmt: skip
    assert code == cli.EXIT_USAGE and "--inputs" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer of a host without a GPU")
def test_a_run_whose_kernel_cannot_run_here(
    kernelbench: Path, kerneleval_service, tmp_path: Path, capsys
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "level_1_problem_19_sample_0_kernel.py").write_text(CORRECT_RELU)
    (run_dir / "level_1_problem_20_sample_0_kernel.py").write_text(LOAD_INLINE_RELU)
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps({"19": SMALL, "20": SMALL}))
    args = ["kernelbench", str(run_dir), "--level", "1", "--problems", str(kernelbench),
            "--subset", "19-20", "--inputs", str(inputs)]  # fmt: skip
    code, out, err = run_cli(capsys, kerneleval_service.address, *args)
    assert code == 0, err + out
    assert "CANNOT_RUN_HERE: not run here (needs a GPU)" in err  # its line as its job ends
    results = json.loads((run_dir / "eval_results.json").read_text())
    right, not_run = results["19"][0], results["20"][0]
    assert right["evaluated"] and right["correctness"]
    assert not_run["evaluated"] is False and not not_run["correctness"]
    assert not_run["metadata"]["kerneleval_verdict"] == "CANNOT_RUN_HERE"
    analysis = json.loads((run_dir / "analysis_results.json").read_text())["summary"]
    assert analysis["total_evaluated"] == 1 and analysis["not_evaluated_count"] == 1
    assert analysis["correct_count"] == 1 and analysis["total_problems"] == 2
    assert "not evaluated  1" in out
    # Not evaluated is not a result: the next run evaluates it again, and only it.
    code, out, err = run_cli(capsys, kerneleval_service.address, *args)
    assert code == 0 and "1 already have a result, 1 to evaluate" in err, err


def test_a_compile_baseline_gives_both_speedups_as_kernelbench_reports_them() -> None:
    """--compile-baseline (issue 43): each entry has the reference under torch.compile beside
    the eager one (mean ms, as KernelBench's times), and the summary the speedup metrics over
    each (run_and_check.py's "speedup over eager" and "over torch.compile")."""
    job = job_pb2.Job(job_id="j9", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict, r.compiled = job_pb2.VERDICT_OK, True
    r.correctness, r.correctness_status = True, job_pb2.CORRECTNESS_PASSED
    r.runtime.mean_ms, r.runtime.trial_count = 1.0, 10
    r.reference_runtime.mean_ms, r.reference_runtime.trial_count = 3.0, 10
    plain = kb.kernelbench_entry(0, job)
    assert "ref_runtime_compile" not in plain
    r.compiled_reference_runtime.mean_ms, r.compiled_reference_runtime.trial_count = 1.5, 10
    r.compile_time.FromMilliseconds(4200)
    e = kb.kernelbench_entry(0, job, compile_baseline=True)
    assert e["ref_runtime"] == 3.0 and e["ref_runtime_compile"] == 1.5
    assert e["ref_runtime_compile_stats"]["num_trials"] == 10
    assert e["metadata"]["torch_compile_time_s"] == 4.2
    failed = job_pb2.Job(job_id="j10", state=job_pb2.JOB_STATE_DONE)
    failed.result.CopyFrom(r)
    failed.result.ClearField("compiled_reference_runtime")  # it did not compile: a note
    f = kb.kernelbench_entry(0, failed, compile_baseline=True)
    assert f["ref_runtime_compile"] == -1.0 and f["ref_runtime_compile_stats"] == {}
    p = Path("x.py")
    s = kb.summary("run", 1, [1, 2], {kb.Sample(1, 1, 0, p, p): e, kb.Sample(1, 2, 0, p, p): f})
    eager, compiled = s["speedup_metrics"], s["speedup_metrics_torch_compile"]
    assert eager["geometric_mean_speedup"] == pytest.approx(3.0) and eager["fast_p"]["1.0"] == 1.0
    assert compiled["geometric_mean_speedup"] == pytest.approx(1.5)
    assert compiled["fast_p"]["1.0"] == 0.5  # the second has no compiled time: no result
    text = kb.summary_text(s)
    assert "speedup over eager of the correct ones: 3.0000" in text
    assert "speedup over torch.compile of the correct ones: 1.5000" in text
    assert "speedup_metrics_torch_compile" not in kb.summary("run", 1, [1], {
        kb.Sample(1, 1, 0, p, p): plain
    })  # fmt: skip
