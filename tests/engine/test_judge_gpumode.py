"""A GPU MODE job judged outside its submission's process (issue 13): the submission's process
runs custom_kernel on every case and records its output (engine/gpumode_nest.py: flatten); the
judge, which imports the task's reference and shared modules only, makes each case's data again
from its seed, rebuilds the output and asks check_implementation, then times ref_kernel. What
the submission's process says of the cases does not count; a record no process of the service
writes is tampering."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import V
from kerneleval.gpumode import task_case
from kerneleval_server.engine import Recorder, gpumode_nest
from kerneleval_server.engine import record as rec
from test_gpumode import DOUBLE, DOUBLE_REFERENCE, inline_spec, task_spec
from test_judge import judged

LIMIT = 64 << 20

# The submission's module body makes every check in its own process pass, and it hands back
# zeros: believed where it ran, never by its judge.
FORGER = """
import torch
import kerneleval_server.engine.gpumode as gm
gm.judgement = lambda answer: (True, "")
gm._GpuModeRun._judge = lambda self, ref, data, output: (True, "")

def custom_kernel(data):
    return torch.zeros_like(data)
"""


def test_an_honest_submission_is_judged_and_the_reference_timed_in_the_judge(
    engine_dir: Path,
) -> None:
    own, final = judged(engine_dir, task_spec())
    assert final is not None
    # Its process recorded every case and timed the kernel only.
    assert len(own.result.test_cases) == 3 and len(own.result.benchmark_cases) == 2
    assert not own.result.HasField("reference_runtime")
    assert all(not c.HasField("reference_runtime") for c in own.result.benchmark_cases)
    r = final.result
    assert r.verdict == V.VERDICT_OK and r.correctness, r
    assert r.correctness_status == V.CORRECTNESS_PASSED
    assert r.validation.trials_passed == r.validation.trial_count == 5
    assert all(c.passed for c in [*r.test_cases, *r.benchmark_cases])
    for c, mine in zip(r.benchmark_cases, own.result.benchmark_cases, strict=True):
        assert c.runtime == mine.runtime  # the kernel's time is its process's
        assert c.reference_runtime.trial_count == 3 and c.speedup > 0
    assert r.runtime == own.result.runtime and r.speedup > 0


def test_a_forger_believed_in_its_own_process_is_incorrect_in_the_judge(
    engine_dir: Path,
) -> None:
    own, final = judged(engine_dir, inline_spec(DOUBLE_REFERENCE, FORGER))
    assert own.result.verdict == V.VERDICT_OK  # nothing it says counts
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_INCORRECT and not r.correctness, r
    assert [c.passed for c in r.test_cases] == [False, False]
    assert r.test_cases[0].message == "values differ" and not r.HasField("runtime")


def test_a_wrong_submission_fails_in_the_judge_case_by_case(engine_dir: Path) -> None:
    _, final = judged(engine_dir, task_spec("wrong_submission.py"))
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_INCORRECT and r.failed_side == V.SIDE_KERNEL
    assert [c.passed for c in r.test_cases] == [True, False, False]
    assert r.validation_error.startswith("1 of 5 cases passed; test 1 ")


TUPLE_REFERENCE = DOUBLE_REFERENCE.replace(
    "    return data * 2\n", "    return (data * 2, [data + 1, data])\n"
).replace(
    "ok = torch.allclose(output, ref_kernel(data))",
    "want = ref_kernel(data)\n    ok = isinstance(output, tuple) and isinstance(output[1], list) "
    "and all(torch.allclose(a, b) for a, b in zip([output[0], *output[1]], [want[0], *want[1]]))",
)


def test_an_output_nest_of_tuples_and_lists_comes_back_as_it_was(engine_dir: Path) -> None:
    submission = "def custom_kernel(data):\n    return (data * 2, [data + 1, data])\n"
    _, final = judged(engine_dir, inline_spec(TUPLE_REFERENCE, submission))
    assert final is not None and final.result.verdict == V.VERDICT_OK, final


def _recorded_once(fd: int) -> None:
    """A record of the first case only."""
    trials = rec.read(fd)
    os.ftruncate(fd, trials[1].at)


def _nest_of_three(fd: int) -> None:
    """The first case's nest says three values where one was recorded."""
    os.ftruncate(fd, len(rec.MAGIC))
    recorder = Recorder(fd, LIMIT)
    for i in range(2):
        recorder.record(i, [torch.zeros(4 + i)], structure="(t,t,t)" if i == 0 else "t")


@pytest.mark.parametrize(
    ("tamper", "why"),
    [
        (_recorded_once, "recorded 1 of the task's 2 cases"),
        (_nest_of_three, "more values than were recorded"),
    ],
)
def test_a_record_the_service_never_writes_is_tampering(
    engine_dir: Path, tamper: Callable[[int], None], why: str
) -> None:
    _, final = judged(engine_dir, inline_spec(DOUBLE_REFERENCE, DOUBLE), tamper)
    assert final is not None
    r = final.result
    assert r.verdict == V.VERDICT_RUNTIME_ERROR and r.error.exception_type == "Tampering", r
    assert why in r.error.message


@pytest.mark.parametrize(
    "nest", ["", "tt", "(t", "(t,)", "[t,(t)]]", "x", "(" * 40 + "t" + ")" * 40, "t" * 70000]
)
def test_rebuild_refuses_what_flatten_never_writes(nest: str) -> None:
    with pytest.raises(gpumode_nest.StructureError):
        gpumode_nest.rebuild([1, 2], nest)


def test_flatten_and_rebuild_round_trip() -> None:
    for output in [1, (1, 2), [1, (2, [3])], (), ([], 1), {"a": 1}]:
        leaves, nest = gpumode_nest.flatten(output)
        assert gpumode_nest.rebuild(leaves, nest) == output


def test_cases_past_a_full_record_are_judged_where_they_ran_as_the_result_says(
    engine_dir: Path,
) -> None:
    """A record with room for one case (each reserves 1 MiB for its header): the first is
    judged outside, the second in the submission's process, as for any kernel whose outputs
    are over the record's limits; the note says so. A forger is caught on the first."""
    room_for_one = 2 << 20
    _, final = judged(engine_dir, inline_spec(DOUBLE_REFERENCE, DOUBLE), limit=room_for_one)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final
    assert any(n.startswith("1 of 2 cases judged outside") for n in final.result.notes)
    _, final = judged(engine_dir, inline_spec(DOUBLE_REFERENCE, FORGER), limit=room_for_one)
    assert final is not None and final.result.verdict == V.VERDICT_INCORRECT, final


def test_an_fp8_output_and_its_nest_survive_the_record() -> None:
    """GPU MODE's fp8 tasks: such an output reaches the judge bit for bit."""
    fd = os.memfd_create("record")
    try:
        x = torch.randn(8).to(torch.float8_e4m3fn)
        leaves, nest = gpumode_nest.flatten((x, [x]))
        assert Recorder(fd, LIMIT).record(0, leaves, structure=nest)
        (trial,) = rec.read(fd)
        back = gpumode_nest.rebuild(trial.values, trial.structure)
        assert isinstance(back, tuple) and isinstance(back[1], list)
        assert torch.equal(back[1][0].view(torch.uint8), x.view(torch.uint8))
    finally:
        os.close(fd)


# bioml/trimul's "cauchy" cases: generate_input seeds its own generator, then draws from torch's
# global one (torch.distributions), which it never seeds; numpy's and Python's the same.
GLOBAL_DRAWS_REFERENCE = """
import random

import numpy as np
import torch

def generate_input(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    noise = torch.distributions.Cauchy(0.0, 2.0).sample((n,))
    return x + noise + float(np.random.rand()) + random.random()

def ref_kernel(data):
    return data * 2

def check_implementation(data, output):
    ok = torch.allclose(output, ref_kernel(data))
    return ok, "" if ok else "values differ"
"""


def test_data_drawn_from_the_global_generators_is_made_alike_in_the_judge(
    engine_dir: Path,
) -> None:
    """The judge makes each case's data again: the global generators (torch's, numpy's,
    Python's) are seeded from the case before generate_input on both sides, so that what the
    task leaves unseeded agrees too, whatever either process drew before."""
    spec = inline_spec(GLOBAL_DRAWS_REFERENCE, DOUBLE)
    spec.gpu_mode.benchmarks.append(task_case({"n": 16, "seed": 3}, "benchmarks[0]"))
    _, final = judged(engine_dir, spec)
    assert final is not None and final.result.verdict == V.VERDICT_OK, final
