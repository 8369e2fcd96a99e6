"""GPU memory admission's rules (fleet/gpu_memory.py); the service's use of them is tested
with the fake engine in test_frontend_gpu_fakes.py."""

from __future__ import annotations

from kerneleval.v1 import kernel_pb2
from kerneleval_server.fleet.gpu_memory import GpuMemory, problem_key

GB = 10**9


def memory(total: int = 80 * GB) -> GpuMemory:
    m = GpuMemory(0.85)
    m.set_total(0, total)
    return m


def test_a_problem_is_the_reference_and_the_inputs_not_the_candidate() -> None:
    a = kernel_pb2.JobSpec()
    a.kernel.source_code = "candidate 1"
    a.reference.source_code = "problem"
    b = kernel_pb2.JobSpec()
    b.CopyFrom(a)
    b.kernel.source_code = "candidate 2"
    assert problem_key(a) == problem_key(b)
    b.reference.source_code = "another problem"
    assert problem_key(a) != problem_key(b)
    b.CopyFrom(a)
    b.kernel.io.args.add(name="x").tensor.shape.append(4096)
    assert problem_key(a) != problem_key(b)


def test_jobs_that_fill_the_gpu_wait_for_each_other_and_go_when_memory_is_released() -> None:
    m = memory()
    m.learn("act", 20 * GB)
    budget = int(80 * GB * 0.85)  # 68 GB: three of 20 GB
    assert [m.admit(0, f"w{i}", "act") for i in range(4)] == [True, True, True, False]
    assert m.usage(0) == (60 * GB, budget, 3)
    assert m.admit(0, "w0", "act")  # a holder asking again (its timing) holds it already
    m.learn("tiny", GB)
    assert m.admit(0, "small", "tiny")  # 61 of 68 GB
    assert not m.admit(0, "w3", "act")
    assert m.release(0, "w1") and not m.release(0, "w1")
    assert m.admit(0, "w3", "act")


def test_one_report_cannot_move_what_a_problem_needs() -> None:
    m = memory()
    for _ in range(5):
        m.learn("p", 2 * GB)
    m.learn("p", 10**15)  # a candidate's claim: its process reports its own peak
    m.learn("p", 1)
    assert m.footprint("p") == 2 * GB


def test_not_learned_runs_as_before_until_it_ran_out_of_memory_beside_others() -> None:
    m = memory()
    # Unknown problems: admitted with nothing reserved, however many (a KernelBench run).
    assert all(m.admit(0, f"w{i}", f"problem {i}") for i in range(8))
    for i in range(8):
        m.release(0, f"w{i}")
    m.ran_out("huge")
    assert m.admit(0, "other", "problem 0")
    assert not m.admit(0, "h1", "huge")  # the GPU to itself: waits for "other"
    m.release(0, "other")
    assert m.admit(0, "h1", "huge")
    assert not m.admit(0, "other", "problem 0")  # nothing joins it
    m.learn("huge", 30 * GB)
    m.release(0, "h1")
    assert m.admit(0, "h1", "huge") and m.admit(0, "h2", "huge")  # learned: two fit


def test_more_than_the_gpu_or_alone_means_an_otherwise_empty_gpu() -> None:
    m = memory()
    m.learn("over", 200 * GB)
    assert m.admit(0, "a", "over")
    assert not m.admit(0, "b", "over")
    m.release(0, "a")
    m.learn("small", GB)
    assert m.admit(0, "s", "small")
    assert not m.admit(0, "alone", "small", alone=True)
    m.release(0, "s")
    assert m.admit(0, "alone", "small", alone=True)
    assert not m.admit(0, "s", "small")


def test_no_admission_without_a_known_gpu_memory_or_with_a_share_of_0() -> None:
    m = GpuMemory(0.85)
    m.learn("p", 100 * GB)
    assert not m.admits_on(0) and m.admit(0, "a", "p") and m.admit(0, "b", "p")
    off = GpuMemory(0.0)
    off.set_total(0, 80 * GB)
    assert not off.admits_on(0)
    assert memory(0).admits_on(0) is False


def test_outputs_handed_to_a_judge_hold_their_memory_until_released() -> None:
    """A judged kernel's shares (device memory its process made, alive after it exits until
    its judge has read them) count against the GPU like a job's needs."""
    m = memory()
    m.learn("act", 20 * GB)
    m.hold(0, "shares:job-1", 40 * GB)  # 40 of 68 GB
    assert m.admit(0, "w0", "act")  # 60
    assert not m.admit(0, "w1", "act")  # 80 would not fit
    assert m.release(0, "shares:job-1")
    assert m.admit(0, "w1", "act")
    m.hold(1, "shares:job-2", GB)  # an unknown GPU: no admission, nothing held
    assert m.usage(1)[2] == 0


def test_holders_that_are_gone_are_swept() -> None:
    """A holder whose exit went unheard would keep a job that waits for the GPU to itself
    waiting for ever: the sweep gives back what every holder not alive holds."""
    m = memory()
    m.learn("act", 20 * GB)
    assert m.admit(0, "w0", "act") and m.admit(0, "w1", "act")
    m.hold(0, "shares:job-1", GB)
    assert sorted(m.sweep(0, {"w1", "shares:job-1"})) == ["w0"]
    assert m.usage(0)[2] == 2
    assert not m.admit(0, "alone", "act", alone=True)  # two hold memory
    assert sorted(m.sweep(0, set())) == ["shares:job-1", "w1"]
    assert m.admit(0, "alone", "act", alone=True)  # nothing held any more
