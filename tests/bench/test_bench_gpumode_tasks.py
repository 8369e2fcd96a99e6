"""bench/bench_gpumode_tasks.py's decisions without a service: which task folders it runs,
which it skips and why, its order, and that the specs it sends pass the service's validation."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import bench_gpumode_tasks as B  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402

FIXTURES = REPO / "tests" / "gpumode_tasks"
REFERENCE = (FIXTURES / "softmax_py" / "reference.py").read_text()


def _task(
    root: Path, name: str, yml: str, files: dict[str, str], reference: str = REFERENCE
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "task.yml").write_text(yml)
    (folder / "reference.py").write_text(reference)
    (folder / "task.py").write_text((FIXTURES / "softmax_py" / "task.py").read_text())
    (folder / "utils.py").write_text((FIXTURES / "utils.py").read_text())
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    return folder


TESTS = 'tests:\n  - {"rows": 2, "cols": 8, "seed": 1}\n'
SUBMISSION = (FIXTURES / "softmax_py" / "submission.py").read_text()


def test_folders_are_skipped_for_what_this_machine_lacks(tmp_path: Path) -> None:
    plain = {"submission.py": SUBMISSION}
    _task(tmp_path, "ok", TESTS, {**plain, "solutions/correct/b.py": SUBMISSION,
                                  "solutions/wrong/c.py": SUBMISSION})  # fmt: skip
    _task(tmp_path, "dist", TESTS.replace('"seed": 1', '"seed": 1, "world_size": 8'), plain)
    _task(tmp_path, "own", TESTS, plain, reference="def reference_forward(x):\n    return x\n")
    _task(tmp_path, "amd", TESTS, plain, reference="import aiter_not_here\n" + REFERENCE)
    optional = "try:\n    import helion_not_here\nexcept ImportError:\n    pass\n"
    _task(tmp_path, "sub", TESTS, {"submission.py": "import helion_not_here\n" + SUBMISSION,
                                   "submissions/x.py": optional + SUBMISSION})  # fmt: skip
    _task(tmp_path, "bad", "tests: 3\n", plain)
    found = {d.name: B.examine(tmp_path, d, 1, False) for d in B.find_tasks(tmp_path)}
    ok = found["ok"]
    assert not (ok.skip or ok.error)
    assert [s.label for s in ok.submissions] == ["submission.py", "solutions/correct/b.py"]
    assert [s.expected for s in B.examine(tmp_path, tmp_path / "ok", 1, True).submissions] == [
        "VERDICT_OK", "VERDICT_OK", "VERDICT_INCORRECT"
    ]  # fmt: skip
    assert found["dist"].skip.startswith("multi-GPU task (multi_gpu: False, world_size 8")
    assert "reference.py defines no generate_input, ref_kernel, check_implementation" in (
        found["own"].skip
    )
    assert found["amd"].skip == "its reference needs aiter_not_here, not installed here"
    sub = found["sub"]
    assert not sub.skip and [s.missing for s in sub.submissions] == [["helion_not_here"], []]
    assert found["bad"].error.startswith("kerneleval cannot read the task: ")
    # The specs it sends pass the service's validation: the probe, a submission, the smoke's.
    assert ok.task is not None
    assert validate_spec(B.probe_spec(ok, False)) == []
    for smoke in (False, True):
        spec = B.submission_spec(ok, ok.submissions[0], smoke)
        assert validate_spec(spec) == [] and len(spec.gpu_mode.tests) == 1


def test_cheapest_first_by_the_tasks_own_timeouts_then_size() -> None:
    small = {"tests": [{"size": 8, "seed": 1}], "test_timeout": 60}
    big = {"tests": [{"size": 8 << 20, "seed": 1}], "test_timeout": 60}
    slow = {"tests": [{"size": 8, "seed": 1}], "test_timeout": 900}
    lists = {"tests": [{"m": [96, 128], "g": 2, "seed": 1}]}
    assert B.task_cost(small) < B.task_cost(big) < B.task_cost(slow)
    assert B.case_size(lists["tests"][0]) == 224 * 2


def test_a_probe_that_fails_says_why_in_one_sentence() -> None:
    row = {
        "verdict": "VERDICT_CANNOT_RUN_HERE",
        "message": "reference: generate_input(): Cannot get CUDA generator. PyTorch splits",
    }
    assert B.probe_reason(row) == (
        "its reference cannot run here (VERDICT_CANNOT_RUN_HERE): "
        "reference: generate_input(): Cannot get CUDA generator"
    )
    assert B.probe_reason({"verdict": "VERDICT_OK"}) == ""  # fmt: skip


def test_the_reference_kernels_tree_when_it_is_there() -> None:
    """With the snapshot exported (.carry/reference-kernels/problems), every folder is read:
    none is a failure of kerneleval's to read its task."""
    root = REPO / B.DEFAULT_TASKS
    if not root.is_dir():
        return
    tasks = [B.examine(root, d, 1, False) for d in B.find_tasks(root)]
    assert len(tasks) > 30 and not [t.name for t in tasks if t.error]
