"""`kerneleval gpumode TASK_DIR [SUBMISSION ...]` against the shared CPU service, and how every
output shows VERDICT_CANNOT_RUN_HERE: not run here (needs a GPU), a warning and exit code 4,
never a failure of the kernel."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from kerneleval import cli, render
from kerneleval.cli import evaluate as cli_evaluate
from kerneleval.v1 import job_pb2, kernel_pb2

TASK = Path(__file__).resolve().parents[1] / "gpumode_tasks" / "softmax_py"
FAST = ["--perf-trials", "3", "--warmup", "1"]
# Asks for CUDA where the service has none: the job ends CANNOT_RUN_HERE in test 0.
NEEDS_CUDA = """import torch
from task import input_t, output_t


def custom_kernel(data: input_t) -> output_t:
    x, out = data
    return torch.softmax(x.to("cuda"), dim=-1).cpu()
"""
no_gpu_here = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the answer of a host without a GPU"
)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["--timeout", "300", "--no-progress", *args])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out, out.err


def test_a_task_folder_with_its_own_submission(kerneleval_service, capsys) -> None:  # type: ignore[no-untyped-def]
    code, out, err = run(capsys, "gpumode", str(TASK), "--server", kerneleval_service.address,
                         *FAST)  # fmt: skip
    assert code == cli.EXIT_OK, err + out
    assert "verdict      OK" in out or "verdict    OK" in out
    assert "correct    yes  (5/5 cases passed check_implementation)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("CASE"))
    assert lines[header].split() == ["CASE", "ARGS", "RESULT", "MEDIAN", "MS", "REF", "MS",
                                     "SPEEDUP", "MESSAGE"]  # fmt: skip
    rows = lines[header + 2 :]
    assert [r.split("  ")[0].strip() for r in rows] == [
        "test 0", "test 1", "test 2", "benchmark 0", "benchmark 1",
    ]  # fmt: skip
    assert "rows: 1; cols: 8; seed: 4242" in rows[0] and " pass " in rows[0]
    assert rows[0].split()[-3:] == ["-", "-", "-"]  # a test case is not timed
    assert rows[4].rstrip().endswith("x")  # a benchmark's speedup


def test_several_submissions_json_and_failures(kerneleval_service, capsys) -> None:  # type: ignore[no-untyped-def]
    subs = [TASK / "submission.py", TASK / "wrong_submission.py", TASK / "raising_submission.py"]
    code, out, err = run(capsys, "--server", kerneleval_service.address, "gpumode", str(TASK),
                         *map(str, subs), *FAST, "--json")  # fmt: skip
    assert code == cli.EXIT_VERDICT, err
    entries = json.loads(out)  # as evaluate and compare: a list of {file, job}
    assert [e["file"] for e in entries] == [str(s) for s in subs]
    ok, wrong, raising = (e["job"]["result"] for e in entries)
    assert ok["verdict"] == "VERDICT_OK" and ok["correctnessStatus"] == "CORRECTNESS_PASSED"
    assert [c["passed"] for c in ok["testCases"]] == [True, True, True]
    assert [c["spec"] for c in ok["benchmarkCases"]] == [
        "rows: 32; cols: 256; seed: 31232", "rows: 64; cols: 512; seed: 4052",
    ]  # fmt: skip
    assert all(c["runtime"]["trialCount"] == 3 for c in ok["benchmarkCases"])
    assert wrong["verdict"] == "VERDICT_INCORRECT" and wrong["failedSide"] == "SIDE_KERNEL"
    assert wrong["testCases"][1] == {
        "spec": "rows: 4; cols: 33; seed: 5236", "passed": False,
        "message": "117 of 132 elements differ", "speedup": 0.0,
    }  # fmt: skip
    assert raising["verdict"] == "VERDICT_RUNTIME_ERROR"
    assert len({e["job"]["jobId"] for e in entries}) == 3

    # The table of one INCORRECT job: a row per case, the failing ones FAIL with the message.
    code, out, _ = run(capsys, "--server", kerneleval_service.address, "gpumode", str(TASK),
                       str(subs[1]), *FAST)  # fmt: skip
    assert code == cli.EXIT_VERDICT
    row = next(line for line in out.splitlines() if line.startswith("test 1 "))
    assert " FAIL " in row and row.endswith("117 of 132 elements differ")


@no_gpu_here
def test_a_submission_that_needs_cuda_is_not_run_here(kerneleval_service, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    needs = tmp_path / "needs_cuda.py"
    needs.write_text(NEEDS_CUDA)
    address = ["--server", kerneleval_service.address]
    code, out, err = run(capsys, *address, "gpumode", str(TASK), str(needs), *FAST,
                         "--color", "always")  # fmt: skip
    assert code == cli.EXIT_NOT_RUN, err + out
    verdict = next(line for line in out.splitlines() if line.startswith("verdict"))
    assert "\x1b[33mCANNOT_RUN_HERE: not run here (needs a GPU)" in verdict  # yellow, not red
    assert "not a failure of the kernel" in verdict
    assert "correct      not checked (not run here)" in out
    row = next(line for line in out.splitlines() if line.startswith("test 0 "))
    assert "\x1b[33mCANNOT_RUN_HERE\x1b[0m" in row and "CUDA" in row

    # Beside an OK one: 4 (nothing failed, something was not evaluated); --json as it is.
    code, out, _ = run(capsys, *address, "gpumode", str(TASK), str(TASK / "submission.py"),
                       str(needs), *FAST, "--json")  # fmt: skip
    assert code == cli.EXIT_NOT_RUN
    verdicts = [e["job"]["result"]["verdict"] for e in json.loads(out)]
    assert verdicts == ["VERDICT_OK", "VERDICT_CANNOT_RUN_HERE"]
    code, out, _ = run(capsys, *address, "gpumode", str(TASK), str(needs), str(needs), *FAST)
    assert code == cli.EXIT_NOT_RUN
    rows = [line for line in out.splitlines() if "needs_cuda.py" in line]
    assert len(rows) == 2 and all(
        "CANNOT_RUN_HERE" in r and "not run here (needs a GPU)" in r for r in rows
    )


def test_a_bad_task_folder_is_a_usage_error(capsys, tmp_path: Path) -> None:
    # No server is asked: the folder is read first.
    address = ["--server", "127.0.0.1:1"]
    code, _, err = run(capsys, *address, "gpumode", str(tmp_path / "nowhere"))
    assert code == cli.EXIT_USAGE
    assert err.startswith("error: not a GPU MODE task: ") and "not a directory" in err
    task = tmp_path / "task"
    task.mkdir()
    code, _, err = run(capsys, *address, "gpumode", str(task))
    assert code == cli.EXIT_USAGE and "task.yml: no such file" in err
    (task / "task.yml").write_text("tests: 3\n")
    code, _, err = run(capsys, *address, "gpumode", str(task), "sub.py")
    assert code == cli.EXIT_USAGE and "tests is not a list" in err
    (task / "task.yml").write_text('benchmarks:\n  - {"n": 1}\n')
    code, _, err = run(capsys, *address, "gpumode", str(task), "sub.py")
    assert code == cli.EXIT_USAGE and "no tests" in err

    # A good task without a submission.py: says what is missing.
    copy = tmp_path / "softmax_py"
    shutil.copytree(TASK, copy)
    shutil.copy(TASK.parent / "utils.py", tmp_path / "utils.py")  # task.yml's ../utils.py
    (copy / "submission.py").unlink()
    code, _, err = run(capsys, *address, "gpumode", str(copy))
    assert code == cli.EXIT_USAGE
    assert f"no submission.py in {copy}: name the submission file(s)" in err
    code, _, err = run(capsys, *address, "gpumode", str(copy), str(copy / "missing.py"))
    assert code == cli.EXIT_USAGE and "missing.py" in err
    # Options a GPU MODE task does not use are not offered.
    with pytest.raises(SystemExit) as e:
        cli.main(["gpumode", str(copy), "--atol", "1e-3"])
    assert e.value.code == cli.EXIT_USAGE


def test_gpumode_options_reach_the_spec(capsys, monkeypatch, tmp_path: Path) -> None:
    sent: list[tuple[str, kernel_pb2.JobSpec]] = []

    def capture(a, c, out, specs):  # type: ignore[no-untyped-def]
        sent.extend(specs)
        return cli.EXIT_OK

    monkeypatch.setattr(cli_evaluate, "run_specs", capture)
    monkeypatch.setattr(sys, "stdin", io.StringIO(NEEDS_CUDA))
    code, _, _ = run(capsys, "--server", "127.0.0.1:1", "gpumode", str(TASK), "-", "--seed", "7",
                     "--perf-trials", "9", "--tag", "gm", "--label", "task=softmax")  # fmt: skip
    assert code == cli.EXIT_OK
    [(name, spec)] = sent
    assert name == "-" and spec.kernel.source_code == NEEDS_CUDA  # standard input
    assert spec.kernel.type == spec.reference.type == kernel_pb2.KERNEL_TYPE_GPU_MODE
    assert spec.options.seed == 7 and spec.options.perf_trial_count == 9
    assert not spec.options.HasField("correct_trial_count") and not spec.options.HasField("atol")
    assert spec.client_tag == "gm" and dict(spec.labels) == {"task": "softmax"}
    assert [len(spec.gpu_mode.tests), len(spec.gpu_mode.benchmarks)] == [3, 2]


# --- CANNOT_RUN_HERE wherever a result is shown (no service needed) ------------------------


def job(verdict: int, job_id: str = "j1", message: str = "") -> job_pb2.Job:
    j = job_pb2.Job(job_id=job_id, state=job_pb2.JOB_STATE_DONE)
    j.result.verdict = verdict
    j.result.error.message = message
    if verdict == job_pb2.VERDICT_CANNOT_RUN_HERE:
        j.result.failed_side = job_pb2.SIDE_KERNEL
    return j


def test_cannot_run_here_is_a_warning_in_every_table() -> None:
    not_run = job(job_pb2.VERDICT_CANNOT_RUN_HERE, message="no CUDA device: compiled, cannot run")
    colour = render.Style(True)
    assert colour.outcome("CANNOT_RUN_HERE") == "\x1b[33mCANNOT_RUN_HERE\x1b[0m"
    assert colour.outcome("RUNTIME_ERROR").startswith("\x1b[31m")
    table = render.result_table(not_run, colour)
    assert "\x1b[33mCANNOT_RUN_HERE: not run here (needs a GPU)" in table
    assert "correct      not checked (not run here)" in table
    assert render.job_summary(not_run).startswith(
        "DONE CANNOT_RUN_HERE: not run here (needs a GPU)  no CUDA device"
    )
    batch = render.batch_table([("k.py", not_run)], style=colour)
    assert "\x1b[33mCANNOT_RUN_HERE\x1b[0m" in batch
    assert "not run here (needs a GPU): no CUDA device" in batch
    jobs = render.jobs_table([not_run], style=colour)
    assert "\x1b[33mCANNOT_RUN_HERE\x1b[0m" in jobs


def test_the_exit_code_policy() -> None:
    ok, incorrect = job(job_pb2.VERDICT_OK), job(job_pb2.VERDICT_INCORRECT)
    not_run = job(job_pb2.VERDICT_CANNOT_RUN_HERE)
    assert cli.exit_code([ok]) == cli.EXIT_OK
    assert cli.exit_code([not_run]) == cli.EXIT_NOT_RUN == 4
    assert cli.exit_code([ok, not_run]) == cli.EXIT_NOT_RUN
    assert cli.exit_code([not_run, incorrect]) == cli.EXIT_VERDICT  # a failure comes first
    assert cli.exit_code([ok, "refused: bad spec"]) == cli.EXIT_VERDICT
    cancelled = job(job_pb2.VERDICT_CANNOT_RUN_HERE)
    cancelled.state = job_pb2.JOB_STATE_CANCELLED
    assert cli.exit_code([cancelled]) == cli.EXIT_VERDICT
    assert "4 not evaluated" in cli.MAIN_EXAMPLES
