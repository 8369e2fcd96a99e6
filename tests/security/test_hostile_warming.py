"""A hostile job beside another job's timing window, where job processes still warming up run
through windows (--freeze-warming false, README's flags) and, for comparison, where they do not
(the default).

The hostile job's module body forks processes that take the host's cores and keeps a thread
that notes every stall of its process (a gap in its clock readings), then waits, in a phase
that asks for no GPU, for an honest tenant's timed job to hold its timing window and close it.
Its process warmed up like every other: with --freeze-warming false it ran through windows
until the watchdog acknowledged JobProcessWarm, and only then was given a job. So it must be
frozen for the whole of the honest job's window: each window the service log shows while it
spun lies within one of its stalls. A process left running in windows after it took a job
(never said warm to the watchdog, or the watchdog's warm mark not heeded) shows no stall there
(and the honest job's window lasts two to three times as long, its cores taken). The honest job
is timed OK, and the next tenants are judged right.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import hostile_sources as hs
import pytest
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from test_hostile_jobs import (
    assert_contained,
    assert_reported,
    hostile_service,
    next_tenants_are_judged_right,
    run_job,
    spec,
    wait_job,
)
from test_hostile_jobs import pytestmark as hostile_marks
from test_hostile_timing_more import MATMUL_REFERENCE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
from test_cpu_timing import windows_in_log  # noqa: E402

pytestmark = [*hostile_marks, pytest.mark.timeout(180)]

STALL_S = 0.05  # a gap in the spinner's clock readings this long is a stall
WINDOW_S = 0.2  # a stall at least this long is taken for a window, and the wait ends after it
AFTER_S = 1.0  # how long the hostile job still spins after such a stall (a later window)
WAIT_S = 12.0  # the longest it waits for one (no stall: it was never frozen)
TOLERANCE_S = 0.1  # the freeze's and thaw's round trips, the log's milliseconds

# The honest tenant's timed job: a matmul of a few milliseconds a call on the host, so that its
# window lasts a good part of a second.
REFERENCE = MATMUL_REFERENCE
HONEST = REFERENCE.replace("class Model(", "class ModelNew(")

SPINNER = """
import threading

STALLS = []


def _hog():
    while True:
        pass


def _watch(stop):
    last = time.time()
    while not stop.is_set():
        time.sleep(0.002)
        now = time.time()
        if now - last > CFG["stall_s"]:
            STALLS.append((last, now))
        last = now


def module_attack():
    for _ in range(2):  # the host's cores, whenever it is not frozen
        if os.fork() == 0:
            _hog()
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(stop,), daemon=True)
    began = time.time()
    watcher.start()
    rep = reporter()
    if rep is not None:
        rep.log("spinning\\n")
    while time.time() < began + CFG["wait_s"]:  # its load asks for no GPU: no window waits
        windows = [s for s in STALLS if s[1] - s[0] >= CFG["window_s"]]
        if windows and time.time() > windows[-1][1] + CFG["after_s"]:
            break
        time.sleep(0.01)
    stop.set()
    watcher.join()
    note("spun " + json.dumps({"from": began, "to": time.time(), "stalls": STALLS}))
    report()
"""


@pytest.fixture(scope="module", params=["false", "true"], ids=lambda v: f"freeze-warming-{v}")
def svc(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServiceProcess]:
    """The hostile suite's service with two job-taking processes a GPU (a job beside the one
    that times), warming processes frozen in windows or not."""
    args = ["--workers-per-device", "2", "--freeze-warming", request.param]
    yield from hostile_service(tmp_path_factory, args=args, name=f"-warming-{request.param}")


@pytest.fixture(scope="module")
def stub(svc: ServiceProcess) -> Iterator[kernel_eval_service_pb2_grpc.KernelEvalServiceStub]:
    with svc.channel() as ch:
        yield kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)


def wait_for_log(stub, job_id: str, text: str) -> None:  # type: ignore[no-untyped-def]
    stream = stub.Watch(pb.WatchRequest(job_id=job_id), timeout=60)
    try:
        for r in stream:
            assert not r.event.HasField("finished"), f"it ended before saying {text!r}"
            if r.event.HasField("log") and text in r.event.log.text:
                return
    finally:
        stream.cancel()
    raise AssertionError(f"no {text!r} in its log")


def test_a_hostile_job_is_frozen_in_another_jobs_window_however_it_warmed(stub, svc) -> None:  # type: ignore[no-untyped-def]
    """Its process frozen for the whole of the honest job's window, with or without
    --freeze-warming; the honest job judged right beside it, then the next tenants."""
    cfg = {"stall_s": STALL_S, "window_s": WINDOW_S, "after_s": AFTER_S, "wait_s": WAIT_S}
    s = spec(hs.hostile_source("warming", SPINNER, cfg), client_tag="mallory-warming")
    s.options.timeout.seconds = 40
    t0 = time.monotonic()
    try:
        hostile = stub.Submit(pb.SubmitRequest(spec=s), timeout=30).job
        wait_for_log(stub, hostile.job_id, "spinning")
    except grpc.RpcError as exc:
        raise AssertionError(f"{exc.code()} {exc.details()}; log:\n{svc.log_tail(40)}") from None
    honest = spec(HONEST, reference=REFERENCE, client_tag="alice-warming", perf_trials=20)
    timed = run_job(stub, honest, svc)
    ran = wait_job(stub, hostile, s, svc, t0=t0)
    print(f"hostile: {ran.describe()}\nhonest: {timed.describe()}")

    # The honest job: timed (by its judge, in a window of the judge's that its result does
    # not describe: the service log does, below).
    r = timed.job.result
    assert r.verdict == job_pb2.VERDICT_OK and r.correctness, timed.describe()
    assert r.runtime.trial_count == 20 and r.runtime.timed_from_outside, timed.describe()
    assert timed.job.worker_id != ran.job.worker_id
    assert timed.job.device_index == ran.job.device_index

    # The hostile job: ended as a job does, contained, and said what it saw.
    assert ran.job.state == job_pb2.JOB_STATE_DONE, ran.describe()
    assert_contained(ran)
    assert_reported(ran, "warming")
    said = ran.logs.split("hostile job warming: spun ")[1]
    spun = json.loads(said.splitlines()[0])
    life = (spun["from"], spun["to"])
    stalls = [tuple(x) for x in spun["stalls"]]

    # Every window of its GPU while it spun lies within one of its stalls: frozen throughout.
    windows = windows_in_log(svc.log_path).get(ran.job.device_index, [])
    during = [w for w in windows if w[0] < life[1] and w[1] > life[0]]
    print(f"spun {life}, stalls {stalls}, windows meanwhile {during}")
    assert during, f"no window while it spun {life}: {windows}"
    for w in during:
        lo, hi = max(w[0], life[0]), min(w[1], life[1])
        assert any(a <= lo + TOLERANCE_S and b >= hi - TOLERANCE_S for a, b in stalls), (
            f"it ran in the window {w} (spun {life}); its stalls: {stalls}"
        )
    next_tenants_are_judged_right(stub, svc, ran)
