"""Every wait of a job is named while it lasts and bounded (jobs/waits.py), and the GPU memory
admission's rules that kept jobs waiting for ever on a GPU (issue 44): a judge's shares held
until its own admission, and a judge started ahead that leaves a GPU held for a job alone."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server.fleet.gpu_memory import serving_bytes
from kerneleval_server.fleet.job_processes import JobProcess
from kerneleval_server.jobs import judge_record
from kerneleval_server.jobs import waits as waits_mod
from kerneleval_server.jobs.running import Running
from test_job_channels import job_spec, new_manager, run_async, start_process, until

pytestmark = pytest.mark.timeout(60)
GB = 10**9


def test_a_wait_that_never_ends_is_said_then_ends_the_job_failed_and_the_next_job_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose check waits for GPU memory that another process holds for good: its
    events and the log say what it waits for after SAY_AFTER_S; past --max-wait-s it ends
    FAILED with VERDICT_SERVICE_ERROR naming the wait, its process is killed, and the
    process that held the memory takes the next job."""
    monkeypatch.setattr(waits_mod, "SAY_AFTER_S", 0.05)

    async def scenario() -> None:
        m, wd = new_manager(tmp_path, max_wait_s=0.3)
        proc = await start_process(m, "c-w1")
        holder = await start_process(m, "c-w2")
        m.memory.set_total(-1, 100 * GB)
        job = m.submit(job_spec())
        assign = (await proc.receive()).assign
        assert assign.job_id == job.job_id
        run = m.running[job.job_id]
        m.memory.learn(m.gpu_use.memory_key(run), 50 * GB)
        m.memory.hold(-1, "c-w2", 60 * GB)  # what a live process holds, never given back
        await proc.send(phase=job_channel_pb2.PhaseUpdate(
            job_id=job.job_id, phase=job_pb2.PHASE_VALIDATING))  # fmt: skip
        await until(lambda: "c-w1" in m.gpu_use.waiting)
        m.waits.check()
        assert m.waits.now_waiting()[job.job_id][0].startswith("46.6 GiB of GPU -1's memory")
        time.sleep(0.1)
        m.waits.check()  # said: in the job's events
        said = [e.log.text for e in m.store.events_after(job.job_id, 0) if e.HasField("log")]
        assert any("has waited" in t and "GPU -1's memory" in t for t in said), said
        time.sleep(0.25)
        m.waits.check()  # past the bound
        await until(lambda: m.store.get(job.job_id).state == job_pb2.JOB_STATE_FAILED)
        ended = m.store.get(job.job_id)
        assert ended is not None
        assert ended.result.verdict == job_pb2.VERDICT_SERVICE_ERROR
        assert "GPU -1's memory" in ended.state_reason and "never came" in ended.state_reason
        assert ended.result.error.message == ended.state_reason
        await until(lambda: ("c-w1", "stalled") in wd.kills)
        # The next job runs on the process that held the memory.
        m.memory.release(-1, "c-w2")
        nxt = m.submit(job_spec())
        assert (await holder.receive()).assign.job_id == nxt.job_id
        outcome = job_channel_pb2.JobOutcome(job_id=nxt.job_id)
        outcome.result.verdict = job_pb2.VERDICT_OK
        await holder.send(outcome=outcome)
        await m.endings.wait_finished(nxt.job_id, 5)
        done = m.store.get(nxt.job_id)
        assert done is not None and done.result.verdict == job_pb2.VERDICT_OK
        for p in (proc, holder):
            p.writer.close()

    run_async(scenario)


def test_a_queued_job_is_bounded_only_while_no_job_starts(tmp_path: Path) -> None:
    """A queue that moves is not a stall: a queued job ends FAILED only once no job has
    started anywhere for --max-wait-s."""

    async def scenario() -> None:
        m, _ = new_manager(tmp_path, max_wait_s=0.2)
        job = m.submit(job_spec())  # no process at all: it waits in the queue
        m.waits.check()
        time.sleep(0.25)
        m.waits.started()  # a job started elsewhere just now: the queue moves
        m.waits.check()
        assert m.store.get(job.job_id).state == job_pb2.JOB_STATE_QUEUED  # type: ignore[union-attr]
        time.sleep(0.25)
        m.waits.check()
        await until(lambda: m.store.get(job.job_id).state == job_pb2.JOB_STATE_FAILED)
        ended = m.store.get(job.job_id)
        assert ended is not None and "a job process" in ended.state_reason
        assert ended.result.verdict == job_pb2.VERDICT_SERVICE_ERROR
        assert job.job_id not in m.queue

    run_async(scenario)


def test_a_job_process_that_answers_without_a_verdict_is_the_services_failure(
    tmp_path: Path,
) -> None:
    """No job leaves the service with VERDICT_UNSPECIFIED."""

    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        assert (await proc.receive()).assign.job_id == job.job_id
        await proc.send(outcome=job_channel_pb2.JobOutcome(job_id=job.job_id))
        await m.endings.wait_finished(job.job_id, 5)
        ended = m.store.get(job.job_id)
        assert ended is not None and ended.state == job_pb2.JOB_STATE_FAILED
        assert ended.result.verdict == job_pb2.VERDICT_SERVICE_ERROR
        assert "without a verdict" in ended.result.error.message
        proc.writer.close()

    run_async(scenario)


def _judged_run(m: object, job_id: str, worker: JobProcess, shared: int) -> Running:
    """A compared job whose kernel ran and handed `shared` bytes over by descriptor, held on
    GPU 0 for its judge, now `worker`."""
    spec = job_spec()
    spec.reference.source_code = "reference"
    run = Running(job=job_pb2.Job(job_id=job_id, spec=spec, device_index=0), proc=worker,
                  timeout_s=10.0)  # fmt: skip
    run.record = judge_record.Record.make(job_id, 1 << 20, spec, share_max_bytes=100 * GB)
    run.record.kernel_outcome = job_channel_pb2.JobOutcome(job_id=job_id, shared_bytes=shared)
    run.record.gpu_held_on = 0
    return run


def _worker(worker_id: str) -> JobProcess:
    return JobProcess(worker_id=worker_id, pid=1, device_index=0, spare=False, start_time_ms=0)


def test_a_judges_shares_stay_held_until_its_own_admission_which_goes_first(
    tmp_path: Path,
) -> None:
    """What a kernel handed its judge by descriptor is on the GPU until the judge has read it:
    it stays held when the judge starts (given back then, admission let other jobs into
    memory that was not free: an H200 RL step ran 43 jobs out of memory). The judge's own
    admission takes its place, even on a GPU held for a job re-run alone (which waits for
    these bytes); a job without shares there is not admitted."""
    m, _ = new_manager(tmp_path)
    m.memory.set_total(0, 100 * GB)  # budget 85 GB
    judge = _judged_run(m, "J", _worker("d0-j"), 6 * GB)
    key = m.gpu_use.memory_key(judge)
    m.memory.learn(key, 20 * GB)
    m.memory.hold(0, judge.record.holder, 6 * GB)  # type: ignore[union-attr]
    alone = Running(job=job_pb2.Job(job_id="X", spec=judge.job.spec, device_index=0),
                    proc=_worker("d0-x"), timeout_s=10.0)  # fmt: skip
    other = Running(job=job_pb2.Job(job_id="K", spec=judge.job.spec, device_index=0),
                    proc=_worker("d0-k"), timeout_s=10.0)  # fmt: skip
    for run in (judge, alone, other):
        m.running[run.job.job_id] = run
    m.crowding.alone.add("X")
    assert m.memory.usage(0)[0] == 6 * GB  # held while nobody admitted the judge
    assert not m.gpu_use.admit(other)  # the GPU is held for X
    assert not m.gpu_use.admit(alone)  # X waits for the shares
    assert m.gpu_use.admit(judge)  # the judge goes: its admission replaces its shares
    assert judge.record.gpu_held_on is None  # type: ignore[union-attr]
    assert m.memory.usage(0) == (20 * GB, int(100 * GB * 0.85), 1)
    m.memory.release(0, "d0-j")  # judged
    assert m.gpu_use.admit(alone)


def test_a_judge_is_admitted_when_only_shares_hold_the_gpu_even_past_its_footprint(
    tmp_path: Path,
) -> None:
    """Shares are given back only by their judges: when nothing else holds the GPU's memory,
    a judge whose footprint does not fit beside the others' shares goes all the same (else
    every judge would wait for ever); while a running job holds memory, it waits, its
    shares still held."""
    m, _ = new_manager(tmp_path)
    m.memory.set_total(0, 100 * GB)
    runs = [_judged_run(m, f"J{i}", _worker(f"d0-j{i}"), 18 * GB) for i in range(5)]
    m.memory.learn(m.gpu_use.memory_key(runs[0]), 20 * GB)
    for run in runs:
        m.running[run.job.job_id] = run
        m.memory.hold(0, run.record.holder, 18 * GB)  # type: ignore[union-attr]
    m.memory.hold(0, "d0-busy", 1)  # a running job's process holds some: the judges wait
    m.memory._devices[0].holders["d0-busy"].key = "a problem"
    assert not m.gpu_use.admit(runs[0])
    assert runs[0].record.gpu_held_on == 0  # type: ignore[union-attr]
    assert m.memory.usage(0)[2] == 6
    m.memory.release(0, "d0-busy")
    assert m.gpu_use.admit(runs[0])  # 72 GB of shares + 20 > 85: admitted all the same
    assert m.memory.holds(0, "d0-j0") and runs[0].record.gpu_held_on is None  # type: ignore[union-attr]


def test_a_kernels_process_serving_its_judge_holds_memory_and_its_judge_still_goes(
    tmp_path: Path,
) -> None:
    """A kernel's process that stays to serve its judge's timed calls still holds the outputs
    it handed over and makes a call's outputs again in each call: that much stays held until
    it exits (given back at its outcome, the RL step's next jobs ran out of memory beside
    it on an H200). Its judge is admitted beside such processes when nothing else holds
    the GPU, as beside shares; then the next judge waits for it."""

    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        m.memory.set_total(0, 100 * GB)  # budget 85 GB
        judges = [_judged_run(m, f"J{i}", _worker(f"d0-j{i}"), 20 * GB) for i in range(3)]
        m.memory.learn(m.gpu_use.memory_key(judges[0]), 40 * GB)
        for i, run in enumerate(judges):
            kernel = _worker(f"d0-k{i}")
            m.job_processes.by_id[kernel.worker_id] = kernel
            run.kernel_proc, run.kernel_serves = kernel, True
            run.record.gpu_held_on = None  # type: ignore[union-attr]
            m.running[run.job.job_id] = run
            m.processes.after_outcome(
                kernel, run,
                job_channel_pb2.JobOutcome(job_id=run.job.job_id, serves_timed_calls=True,
                                           shared_bytes=20 * GB),
                judge=False,
            )  # fmt: skip
        serving = serving_bytes(20 * GB)
        assert m.memory.usage(0) == (3 * serving, int(100 * GB * 0.85), 3)
        assert m.memory.only_shares(0)
        other = Running(job=job_pb2.Job(job_id="N", spec=job_spec(), device_index=0),
                        proc=_worker("d0-n"), timeout_s=10.0)  # fmt: skip
        m.memory.learn(m.gpu_use.memory_key(other), 10 * GB)
        m.running["N"] = other
        assert not m.gpu_use.admit(other)  # 3 x 40.5 GB held: no room for a new job's 10 GB
        assert m.gpu_use.admit(judges[0])  # past the budget, but only serving processes hold it
        assert not m.gpu_use.admit(judges[1])  # now a judge holds memory that it gives back
        m.memory.release(0, "d0-j0")
        m.memory.release(0, "d0-k0")  # its kernel's process exited
        assert m.gpu_use.admit(judges[1])

    run_async(scenario)


async def _running_with_admission(tmp_path: Path) -> tuple[Any, Any, Running]:
    """A manager whose (CPU) GPU admits by memory, and a job running on its process "c-x":
    (the manager, that process's end of its channel, the job's Running)."""
    m, _ = new_manager(tmp_path)
    m.memory.set_total(-1, 100 * GB)
    job = m.submit(job_spec())
    xp = await start_process(m, "c-x", hello=False)
    await xp.send(hello=job_channel_pb2.Hello(worker_id="c-x", pid=1, device_index=-1))
    assert (await xp.receive()).assign.job_id == job.job_id
    return m, xp, m.running[job.job_id]


def test_a_judge_started_ahead_leaves_a_gpu_held_for_a_job_alone(tmp_path: Path) -> None:
    """A judge started ahead counts as using its GPU, so a job re-run alone waits for it; its
    kernel, not yet admitted, waits for that job: both for ever. When the GPU is held for a
    job alone, such a judge is told to leave (JudgeGo abandon); one whose kernel holds its
    memory already stays (that kernel finishes its check)."""

    async def scenario() -> None:
        m, xp, x = await _running_with_admission(tmp_path)
        procs = {}
        for name in ("c-j1", "c-j2"):
            procs[name] = await start_process(m, name)
            m.job_processes.by_id[name].judge_key = "a reference"  # standing: takes no other job
        kernels = []
        for i, name in enumerate(("c-j1", "c-j2")):
            run = Running(
                job=job_pb2.Job(job_id=f"K{i}", spec=job_spec(), device_index=-1),
                proc=JobProcess(f"c-k{i}", 1, -1, False, 0),
                timeout_s=10.0,
            )
            run.ahead = m.job_processes.by_id[name]  # fmt: skip
            m.running[run.job.job_id] = run
            kernels.append(run)
        m.memory.admit(-1, "c-k1", "a problem")  # K1's kernel is checking already
        x.crowded = True
        assert m._retry_alone(x, job_pb2.EvalResult(verdict=job_pb2.VERDICT_OUT_OF_MEMORY))
        go = (await procs["c-j1"].receive()).judge_go
        assert go.job_id == "K0" and go.abandon
        assert kernels[0].ahead is None and kernels[1].ahead is m.job_processes.by_id["c-j2"]
        for p in (xp, *procs.values()):
            p.writer.close()

    run_async(scenario)


def test_a_re_run_alone_is_logged_with_its_oom_and_what_the_gpu_held(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A job re-run alone holds its GPU from new jobs until it ends (a batch's stalls on an
    H200 RL step): the log says which allocation failed and what the GPU held then."""

    async def scenario() -> None:
        m, xp, x = await _running_with_admission(tmp_path)
        x.crowded = True
        oom = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OUT_OF_MEMORY)
        oom.error.message = "CUDA out of memory. Tried to allocate 6.00 GiB\nmore of it"
        with caplog.at_level("INFO", logger="kerneleval.jobs"):
            assert m._retry_alone(x, oom)
        (record,) = [r for r in caplog.records if r.getMessage().startswith("job re-run alone")]
        assert record.why == "CUDA out of memory. Tried to allocate 6.00 GiB"  # type: ignore[attr-defined]
        assert "memory" in record.gpus and "queue" in record.gpus  # type: ignore[attr-defined]
        xp.writer.close()

    run_async(scenario)
