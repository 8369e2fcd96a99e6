"""Timed calls driven from outside the candidate's process (engine/timed_calls.py): a driver
here, a server in a child process that imports nothing of the driver's state, a real socket
and shared memory between them (the CPU: memfds). Honest calls are timed as the server
claims; a server that lies about its time is timed by the driver's bound and flagged; what
the driver copies is what the server wrote for the inputs the driver wrote."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from kerneleval.v1 import kernel_pb2
from kerneleval_server.engine import time_bound as tb
from kerneleval_server.engine import timed_calls as tc
from kerneleval_server.engine.inputs import TrialArgs

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

SERVER = """
import os, sys, time, torch
from kerneleval_server.engine import timed_calls as tc
from kerneleval_server.engine.inputs import TrialArgs
torch.set_num_threads(1)
sock_fd = int(sys.argv[1])
state = {"calls": 0, "cached": None}

def make_args(values, layout):
    return TrialArgs(values, layout["names"], layout["roles"], layout["is_meta"],
                     layout["from_get_inputs"])

def honest(args):
    a, b = args.values
    time.sleep(0.004)
    return [a + b]

def fake_clock(args):
    # rewrites the clock the server reads, then works 4 ms
    time.perf_counter_ns = lambda: 1
    a, b = args.values
    time.sleep(0.004)
    return [a + b]

def cached(args):
    # the first call's result, for ever (a cache keyed on the input's pointer)
    a, b = args.values
    if state["cached"] is None:
        state["cached"] = a + b
    return [state["cached"]]

def sorter(args):
    # sorts its input in place (later calls would see sorted data, were inputs not rewritten)
    a, b = args.values
    a.copy_(a.sort().values)
    return [a + b]

def wrong_shape(args):
    return [args.values[0][:3]]

def raiser(args):
    raise ValueError("nope")

def dies(args):
    os._exit(3)

def oom_args(values, layout):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")

if sys.argv[2] == "setup_oom":
    try:
        tc.serve(sock_fd, honest, oom_args, torch.device("cpu"), idle_s=30)
    except torch.OutOfMemoryError:
        sys.exit(0)
tc.serve(sock_fd, globals()[sys.argv[2]], make_args, torch.device("cpu"), idle_s=30)
"""


def _args(seed: int) -> TrialArgs:
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
    role = kernel_pb2.ARG_ROLE_INPUT
    return TrialArgs([a, b], ["a", "b"], [role, role], [False, False], True)


def _session(kind: str, tmp_path: Path) -> tuple[tc.Driver, subprocess.Popen[bytes]]:
    ours, theirs = socket.socketpair()
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(SERVER))
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'server'}:{REPO / 'clients/python/src'}"}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(theirs.fileno()), kind],
        pass_fds=[theirs.fileno()], env=env,
    )  # fmt: skip
    theirs.close()
    driver = tc.Driver(ours.fileno(), _args(0), [torch.empty(4096)], torch.device("cpu"), 30)
    ours.close()
    return driver, proc


def _run(driver: tc.Driver, calls: int) -> tuple[tb.Decision, list[bool]]:
    calib = tb.calibrate(driver, _args(1), 10)
    results, right = [], []
    for i in range(calls):
        args = _args(100 + i)
        r = driver.call(args)
        results.append(r)
        right.append(torch.equal(r.outputs[0], args.values[0] + args.values[1]))
    inside, outside = [r.inside_ns for r in results], [r.outside_ns for r in results]
    return tb.decide(inside, outside, calib, cpu=True), right


def _end(driver: tc.Driver, proc: subprocess.Popen[bytes]) -> None:
    driver.close()
    assert proc.wait(30) == 0


def test_honest_calls_are_timed_as_they_claim(tmp_path: Path) -> None:
    driver, proc = _session("honest", tmp_path)
    decision, right = _run(driver, 8)
    _end(driver, proc)
    assert all(right)
    assert not decision.flagged, decision
    assert all(3.9 < t < 30 for t in decision.times_ms), decision


def test_a_rewritten_clock_is_caught_by_the_bound_and_flagged(tmp_path: Path) -> None:
    driver, proc = _session("fake_clock", tmp_path)
    decision, right = _run(driver, 8)
    _end(driver, proc)
    assert all(right)
    assert decision.flagged and decision.gap_us > 3000, decision
    assert all(t > 3.9 for t in decision.times_ms), decision  # the driver's bound


@pytest.mark.parametrize("kind", ["cached", "sorter"])
def test_stale_or_rewritten_inputs_give_outputs_that_do_not_match(
    tmp_path: Path, kind: str
) -> None:
    """A cache on what it can see of its inputs returns the first call's result; a sort in
    place changes only the server's view: every call's inputs are the driver's, written anew,
    so the outputs the driver copies are wrong for the inputs it wrote."""
    driver, proc = _session(kind, tmp_path)
    _decision, right = _run(driver, 6)
    _end(driver, proc)
    if kind == "cached":
        assert right == [True] + [False] * 5
    else:
        assert not any(right)  # a + b on sorted a is not a + b


@pytest.mark.parametrize(("kind", "said"), [
    ("wrong_shape", r"output 0 has shape \(3,\)"), ("raiser", "ValueError: nope"),
])  # fmt: skip
def test_a_failed_call_is_the_candidates(tmp_path: Path, kind: str, said: str) -> None:
    driver, proc = _session(kind, tmp_path)
    with pytest.raises(tc.TimedCallError, match=said):
        driver.call(_args(5))
    _end(driver, proc)


def test_a_server_that_never_answers_is_an_error_not_a_hang(tmp_path: Path) -> None:
    ours, theirs = socket.socketpair()
    with pytest.raises(tc.TimedCallError, match="did not take"):
        tc.Driver(ours.fileno(), _args(0), [torch.empty(4096)], torch.device("cpu"), 0.5)
    ours.close()
    theirs.close()


def test_a_server_that_dies_in_a_call_is_told_at_once(tmp_path: Path) -> None:
    """The kernel's process exits in a timed call: its end of the socket closes, and the
    driver says so within milliseconds instead of waiting for its answer's deadline."""
    driver, proc = _session("dies", tmp_path)
    driver.answer_s = 60.0
    began = time.monotonic()
    with pytest.raises(tc.TimedCallError, match="ended during a timed call"):
        driver.call(_args(5))
    assert time.monotonic() - began < 5
    assert proc.wait(10) == 3
    driver.close()


def test_a_dear_calibration_is_capped_at_the_drivers_own_measure() -> None:
    """Calls of no work made 20 ms dearer by the server would lower the bound by as much, and
    a claim 20 ms short would agree with it: the path's cost is taken at most the driver's
    own measure of that work plus the slack, and the claim is then caught."""
    ms = 1_000_000
    calib = [20 * ms + k * 1000 for k in range(10)]  # slowed on purpose
    outside = [20 * ms + 100_000] * 8  # the real calls: 20 ms of work and the path
    inside = [100_000] * 8  # claims of 0.1 ms
    fooled = tb.decide(inside, outside, calib, cpu=True)
    assert not fooled.flagged  # without the cap, the lie agrees with the lowered bound
    caught = tb.decide(inside, outside, calib, cpu=True, own_path_ns=50_000)
    assert caught.flagged and caught.calibration_capped
    assert min(caught.times_ms) > 17.0
    honest = tb.decide([20 * ms] * 8, outside, [100_000 + k for k in range(10)], cpu=True,
                       own_path_ns=50_000)  # fmt: skip
    assert not honest.flagged and not honest.calibration_capped


def test_a_server_that_cannot_take_its_buffers_says_why(tmp_path: Path) -> None:
    """Its failure to map them (out of memory, most often, beside other jobs) reaches the
    driver as its message, so that the job's verdict is that failure, not a silence."""
    with pytest.raises(tc.TimedCallError, match="did not take .*CUDA out of memory"):
        _session("setup_oom", tmp_path)


def _small_args(seed: int, n: int) -> TrialArgs:
    g = torch.Generator().manual_seed(seed)
    role = kernel_pb2.ARG_ROLE_INPUT
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return TrialArgs([a, b], ["a", "b"], [role, role], [False, False], True)


@pytest.mark.parametrize("ending", ["stop", "end_sessions"])
def test_sessions_follow_one_another_each_with_its_own_shapes(tmp_path: Path, ending: str) -> None:
    """A GPU MODE task's benchmark cases: one session each (NEXT between them), the next
    one's layout on the same socket; the server returns at STOP, or when told no session
    follows (end_sessions), and exits cleanly."""
    driver, proc = _session("honest", tmp_path)
    first = driver.call(_args(7))
    assert torch.equal(first.outputs[0], _args(7).values[0] + _args(7).values[1])
    sock_fd = os.dup(driver.sock_fd)
    driver.close(more=True)
    for n in (128, 3):
        driver = tc.Driver(sock_fd, _small_args(0, n), [torch.empty(n)], torch.device("cpu"),
                           30)  # fmt: skip
        for seed in (1, 2):
            args = _small_args(seed, n)
            got = driver.call(args).outputs[0]
            assert got.shape == (n,) and torch.equal(got, args.values[0] + args.values[1])
        driver.close(more=n != 3 or ending == "end_sessions")
    if ending == "end_sessions":
        tc.end_sessions(sock_fd)
    assert proc.wait(30) == 0
    os.close(sock_fd)


def test_a_call_of_no_work_to_settle_reveals_none_of_the_next_calls_inputs(
    tmp_path: Path,
) -> None:
    # GPU MODE's judge settles the path after its generate_input's GPU work (Driver.settle):
    # on the last call's inputs, so that the kernel's process, told to do nothing, holds
    # nothing of the next call's yet.
    driver, proc = _session("honest", tmp_path)
    first, second = _args(1), _args(2)
    driver.call(first)
    driver.settle()
    held = [buf.tensor.clone() for buf in driver.args if buf is not None]
    assert all(torch.equal(h, v) for h, v in zip(held, first.values, strict=True))
    got = driver.call(second)
    assert torch.equal(got.outputs[0], second.values[0] + second.values[1])
    _end(driver, proc)


class _SpanDriver:
    """A driver whose every call of no work takes `span_ms`."""

    def __init__(self, span_ms: float) -> None:
        self.span_ns = int(span_ms * 1e6)
        self.calls = 0

    def call(self, inputs: object, noop: bool = False) -> tc.CallResult:
        assert noop
        self.calls += 1
        return tc.CallResult(self.span_ns, 0, [])


@pytest.mark.parametrize(
    ("span_ms", "calls"),
    [(0.4, tb.CALIBRATION_CALLS), (4.0, 5), (17.0, tb.CALIBRATION_LEAST)],
)
def test_a_costly_path_is_calibrated_with_fewer_calls_of_no_work(
    span_ms: float, calls: int
) -> None:
    # A path of gigabytes' copies (~17 ms a call) takes CALIBRATION_LEAST calls, a tiny one
    # CALIBRATION_CALLS: the calibration's share of a window stays small either way.
    driver = _SpanDriver(span_ms)
    spans = tb.calibrate(driver, None)  # type: ignore[arg-type]
    assert driver.calls == calls == len(spans)
    assert set(spans) == {driver.span_ns}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_judges_timed_call_buffers_count_in_its_peak_memory() -> None:
    """The judge's timed-call buffers are VMM memory, outside torch's allocator: they count in
    what it reports of its peak (judge.py), so that the front end's admission learns them."""
    tc.reset_made()
    dev = torch.device("cuda")
    out = torch.empty(1 << 20, device=dev)
    buf = tc._buffer_like(out)
    try:
        assert tc.made_peak_bytes() >= out.numel() * out.element_size()
    finally:
        buf.release()
        os.close(buf.fd)
    tc.reset_made()
    assert tc.made_peak_bytes() == 0  # released: a next job starts from nothing held
