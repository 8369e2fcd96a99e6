"""The job life cycle (jobs/manager.py) and the parts beside it, with no service: XIDs,
GPU grants, judges, launches, jobs run alone, builds answered late."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server import config as config_mod
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.store import SqliteStore


def test_xid_goes_to_the_poisoned_job_not_the_next_one(tmp_path: Path) -> None:
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobs.manager import JobManager
    from kerneleval_server.jobs.running import Running, xid_suspects
    from kerneleval_server.metrics import Metrics

    store = SqliteStore(tmp_path / "db.sqlite")
    m = JobManager(config_mod.Config(), store, EventHub(store), OpsLog(), Metrics(), 600.0)

    def run(job_id: str, worker_id: str, pid: int) -> Running:
        w = JobProcess(worker_id, pid, 0, False, 0)
        r = Running(job=job_pb2.Job(job_id=job_id), proc=w, timeout_s=60)
        m.running[job_id] = r
        return r

    bad, nxt = run("bad", "d0-w0", 100), run("next", "d0-w1", 101)
    bad.outcome = job_channel_pb2.JobOutcome(job_id="bad", context_poisoned=True)
    # NVML is late: the watchdog names the worker now running on the GPU (no pid known).
    guess = watchdog_pb2.XidObserved(device_index=0, xid=31, worker_ids=["d0-w1"])

    def suspects(x: watchdog_pb2.XidObserved) -> list[tuple[str, bool]]:
        return [(r.job.job_id, sure) for r, sure in xid_suspects(m.running.values(), x)]

    assert suspects(guess) == [("bad", True)]
    by_pid = watchdog_pb2.XidObserved(device_index=0, xid=31, pid=101)
    assert suspects(by_pid) == [("next", True)]
    del m.running["bad"]
    assert suspects(guess) == [("next", False)]
    other = watchdog_pb2.XidObserved(device_index=1, xid=31)
    assert suspects(other) == []
    assert nxt.xid is None


def test_a_gateways_result_cache_key_names_its_nodes_gpus() -> None:
    """A gateway has no GPU: what a cached result depends on is the GPUs of the nodes the job
    may run on (their models and drivers), so a fleet that gains another model, or a job
    pinned to an index only one model has, never takes a result from another GPU."""
    from types import SimpleNamespace

    from kerneleval.v1 import kernel_pb2
    from kerneleval.v1 import operations_service_pb2 as ops
    from kerneleval_server.jobs.admission import Admission
    from kerneleval_server.jobs.intake import Intake

    def target(devices: list[ops.Device], pinned: int | None = None) -> str:
        shared = SimpleNamespace(node_devices=lambda: devices)
        intake = Intake(SimpleNamespace(shared=shared, fleet=None))  # type: ignore[arg-type]
        admission = Admission(
            SimpleNamespace(engine=""),  # type: ignore[arg-type]
            None,  # type: ignore[arg-type]
            intake.devices,
        )
        spec = kernel_pb2.JobSpec()
        if pinned is not None:
            spec.options.device_index = pinned
        return admission.target(spec)

    h100 = ops.Device(index=0, name="H100", driver_version="580", node="a:1")
    h200 = ops.Device(index=1, name="H200", driver_version="580", node="b:1")
    assert "H100/580" in target([h100]) and "H200" not in target([h100])
    assert target([h100]) != target([h100, h200])
    assert target([h100, h200], pinned=1).endswith(";H200/580")


def _one_running_job(tmp_path: Path) -> tuple[Any, SqliteStore, job_pb2.Job]:
    """A JobManager whose store holds one RUNNING job, "j1", with its queued event."""
    from kerneleval_server.jobs.manager import JobManager
    from kerneleval_server.metrics import Metrics

    store = SqliteStore(tmp_path / "db.sqlite")
    hub = EventHub(store)
    m = JobManager(config_mod.Config(), store, hub, OpsLog(), Metrics(), 600.0)
    job = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_RUNNING)
    queued = hub.next_event("j1")
    queued.queued.position = 0
    store.insert(job, queued)
    return m, store, job


def test_a_check_is_granted_before_its_phase_event_is_stored(tmp_path: Path) -> None:
    """PHASE_VALIDATING: the job process waits for its grant, which goes out before the event
    is written to the store (one store write less on the way to every result); the event is
    stored, with the next sequence, right after."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobs.running import Running

    m, store, job = _one_running_job(tmp_path)
    stored_at_grant: list[list[str]] = []

    class Writer:
        def is_closing(self) -> bool:
            return False

        def write(self, frame: bytes) -> None:
            msg = job_channel_pb2.FrontendMessage.FromString(frame[4:])
            if msg.WhichOneof("kind") == "grant":
                kinds = [e.WhichOneof("kind") or "" for e in store.events_after("j1", 0)]
                stored_at_grant.append(kinds)

    worker = JobProcess("d0-w0", 100, 0, False, 0, writer=Writer(), job_id="j1")  # type: ignore[arg-type]
    m.job_processes.by_id[worker.worker_id] = worker
    m.running["j1"] = Running(job=job, proc=worker, timeout_s=60)
    validating = job_channel_pb2.PhaseUpdate(job_id="j1", phase=job_pb2.PHASE_VALIDATING)

    async def main() -> None:
        m.messages.on_process_message(worker, job_channel_pb2.JobProcessMessage(phase=validating))

    asyncio.run(main())
    assert stored_at_grant == [["queued"]]
    after = store.events_after("j1", 0)
    assert [e.WhichOneof("kind") for e in after] == ["queued", "phase"]
    assert after[1].phase.phase == job_pb2.PHASE_VALIDATING and after[1].sequence == 2
    store.close()


def test_a_check_asked_for_ahead_is_granted_once_and_its_phase_comes_after(
    tmp_path: Path,
) -> None:
    """PhaseUpdate.ahead (a whole job's process, its kernel built): the grant goes out at once,
    with no event; the PHASE_VALIDATING that follows is stored and asks nothing more. An ahead
    for another phase, or a second one, asks nothing."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.jobs.running import Running

    m, store, job = _one_running_job(tmp_path)
    worker = _process("d0-w0")
    worker.job_id = "j1"
    m.job_processes.by_id[worker.worker_id] = worker
    m.running["j1"] = Running(job=job, proc=worker, timeout_s=60)

    def phase(p: int, ahead: bool = False) -> job_channel_pb2.JobProcessMessage:
        return job_channel_pb2.JobProcessMessage(
            phase=job_channel_pb2.PhaseUpdate(job_id="j1", phase=p, ahead=ahead)  # type: ignore[arg-type]
        )

    def events() -> list[str]:
        return [e.WhichOneof("kind") or "" for e in store.events_after("j1", 0)]

    async def main() -> None:
        m.messages.on_process_message(worker, phase(job_pb2.PHASE_PROFILING, ahead=True))
        assert worker.writer.sent == [] and events() == ["queued"]
        m.messages.on_process_message(worker, phase(job_pb2.PHASE_VALIDATING, ahead=True))
        assert worker.writer.sent == ["grant"] and events() == ["queued"]
        m.messages.on_process_message(worker, phase(job_pb2.PHASE_VALIDATING, ahead=True))
        m.messages.on_process_message(worker, phase(job_pb2.PHASE_VALIDATING))
        assert worker.writer.sent == ["grant"]
        assert events() == ["queued", "phase"]

    asyncio.run(main())
    store.close()


def _judging_manager(tmp_path: Path) -> Any:
    """A JobManager with no job processes (dispatch off), for the judge's front-end steps."""
    from kerneleval_server.jobs.manager import JobManager
    from kerneleval_server.metrics import Metrics

    store = SqliteStore(tmp_path / "db.sqlite")
    m = JobManager(config_mod.Config(), store, EventHub(store), OpsLog(), Metrics(), 600.0)
    m.dispatch = lambda: None  # type: ignore[method-assign]
    return m


class _Channel:
    """A job process's channel as the front end writes it: the kinds of what it was sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.frames: list[Any] = []
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def write(self, frame: bytes) -> None:
        from kerneleval.internal.v1 import job_channel_pb2

        msg = job_channel_pb2.FrontendMessage.FromString(frame[4:])
        self.sent.append(msg.WhichOneof("kind") or "")
        self.frames.append(msg)

    def close(self) -> None:
        self.closed = True


def _process(worker_id: str, device: int = 0, *, judge_key: str = "") -> Any:
    """A warm job process: fresh, or a standing judge of `judge_key` between jobs."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.fleet.job_processes import JobProcess

    w = JobProcess(worker_id, 100, device, False, 0, writer=_Channel())  # type: ignore[arg-type]
    w.hello = job_channel_pb2.Hello(worker_id=worker_id, judges=True)
    if judge_key:
        w.assigned_job_id, w.reusable, w.judge_key = "earlier", True, judge_key
    return w


def _judged(m: Any, job_id: str, kernel: Any, reference: str = "ref") -> Any:
    """A compared job whose kernel's process (`kernel`, gone from now on) just answered OK."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import kernel_pb2
    from kerneleval_server.jobs import judge_record
    from kerneleval_server.jobs.deadline import Deadline
    from kerneleval_server.jobs.running import Running

    spec = kernel_pb2.JobSpec()
    spec.reference.source_code = reference
    job = job_pb2.Job(job_id=job_id, device_index=kernel.device_index, spec=spec)
    r = Running(job=job, proc=kernel, timeout_s=60)
    r.record = judge_record.Record.make(job_id, 1 << 20, spec)
    r.deadline = Deadline(asyncio.get_running_loop(), 60, lambda: None)
    m.running[job_id] = r
    m.job_processes.by_id[kernel.worker_id] = kernel
    kernel.gone = True
    m.judges.await_judge(r, job_channel_pb2.JobOutcome(job_id=job_id))
    return r


def test_a_judged_record_is_sealed_at_the_kernels_outcome_or_once_its_process_is_gone(
    tmp_path: Path,
) -> None:
    """Issue 13's judge, in the front end: a judged job waits for its judge as soon as its
    kernel answers OK, its record sealed (no write can change it); a kernel's process that
    still maps the record writable delays that until it has exited."""
    import fcntl
    import mmap

    m = _judging_manager(tmp_path)

    async def main() -> None:
        first = _judged(m, "first", _process("d0-w0"))
        assert list(m.judges.queue) == ["first"]
        assert fcntl.fcntl(first.record.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
        with pytest.raises(PermissionError):
            os.write(first.record.fd, b"x")

        # A kernel's process holding the record mapped for writing (a hostile one could).
        from kerneleval_server.jobs import judge_record

        record = judge_record.Record.make("mapped", 1 << 20, job_pb2.Job().spec)
        os.ftruncate(record.fd, 4096)
        mapping = mmap.mmap(record.fd, 4096, flags=mmap.MAP_SHARED)
        m_make = judge_record.Record.make
        judge_record.Record.make = lambda *a: record  # type: ignore[method-assign,assignment]
        try:
            held = _judged(m, "mapped", _process("d0-w1"))
        finally:
            judge_record.Record.make = m_make  # type: ignore[method-assign]
        assert list(m.judges.queue) == ["first"]  # not sealed: it may still change
        mapping.close()  # the process exits: its mappings go with it
        m.judges.kernel_exited(held)
        assert list(m.judges.queue) == ["first", "mapped"]
        assert fcntl.fcntl(record.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_WRITE
        for r in (first, held):
            r.record.close()

    asyncio.run(main())


def test_judges_go_to_a_standing_judge_of_their_reference_on_their_gpu(tmp_path: Path) -> None:
    """A judged job goes to a standing judge of its own reference before a fresh process,
    never to one of another reference, on the GPU its kernel ran on; a GPU held for a job
    re-run alone judges that job only (others waited for ever behind it on the H100)."""
    from kerneleval_server.jobs import judge_record

    m = _judging_manager(tmp_path)
    started: list[tuple[str, str]] = []
    m.judges._start = lambda job_id, w: started.append((job_id, w.worker_id))  # type: ignore[method-assign]

    async def main() -> None:
        a = _judged(m, "a", _process("d0-k0"), reference="ref A")
        b = _judged(m, "b", _process("d0-k1"), reference="ref B")
        on1 = _judged(m, "on1", _process("d1-k0", device=1), reference="ref A")
        key_a = a.record.reference_key
        assert key_a != b.record.reference_key
        assert key_a == judge_record.reference_key(on1.job.spec)  # the same reference
        other = _process("d0-j0", judge_key=b.record.reference_key + "x")
        mine = _process("d0-j1", judge_key=key_a)
        fresh = _process("d0-w0")
        m.judges.start([fresh], [other, mine], {})
        assert started == [("a", "d0-j1"), ("b", "d0-w0")]  # "on1" waits for a GPU-1 process
        assert list(m.judges.queue) == ["on1"]

        started.clear()
        held = _judged(m, "held", _process("d0-k2"))
        m.judges.start([_process("d0-w1"), _process("d0-w2")], [], {0: "held"})
        assert started == [("held", "d0-w1")]
        for r in (a, b, on1, held):
            r.record.close()

    asyncio.run(main())


def test_judged_jobs_wait_for_a_busy_standing_judge_of_their_reference_up_to_a_few_each(
    tmp_path: Path,
) -> None:
    """Fresh job processes are dear (about 5 a second a host): a judged job whose reference
    has a standing judge on its GPU, busy, waits for it rather than take a fresh process, up
    to JOBS_WAITING_PER_STANDING_JUDGE jobs a judge; the next take fresh processes. Jobs of a
    reference with no standing judge there do not wait (a ModelNew batch took 1.4 processes
    a job on an H100: a fresh judge for a third of its jobs)."""
    from kerneleval_server.jobs.judging import JOBS_WAITING_PER_STANDING_JUDGE

    m = _judging_manager(tmp_path)
    started: list[tuple[str, str]] = []

    def start(job_id: str, w: Any) -> None:
        started.append((job_id, w.worker_id))
        w.job_id = job_id

    m.judges._start = start  # type: ignore[method-assign]

    async def main() -> None:
        n = JOBS_WAITING_PER_STANDING_JUDGE
        runs = [_judged(m, f"a{i}", _process(f"d0-k{i}"), reference="ref A") for i in range(n + 1)]
        other = _judged(m, "b", _process("d0-kb"), reference="ref B")
        busy = _process("d0-j0", judge_key=runs[0].record.reference_key)
        busy.job_id = "judging"  # a standing judge of ref A, busy with an earlier job
        m.job_processes.by_id[busy.worker_id] = busy
        fresh = [_process("d0-w0"), _process("d0-w1")]
        m.judges.start(fresh, [], {})
        # The first n wait for it; the one after, and ref B's job, take fresh processes.
        assert started == [(f"a{n}", "d0-w0"), ("b", "d0-w1")]
        assert list(m.judges.queue) == [f"a{i}" for i in range(n)]

        started.clear()
        busy.job_id = ""  # it judged: the next waiting job is its
        m.judges.start([], [busy], {})
        assert started == [("a0", "d0-j0")]

        # A standing judge started ahead for a kernel still running is not waited for: that
        # kernel may run to its timeout.
        started.clear()
        runs[0].ahead = busy
        m.running["kernel-still-running"] = runs[0]
        m.judges.start([_process("d0-w2")], [], {})
        assert started == [("a1", "d0-w2")]
        for r in (*runs, other):
            r.record.close()

    asyncio.run(main())


class _FdChannel(_Channel):
    """A standing judge's channel whose frames may carry descriptors (a judged job's record):
    those go on a real socket, and `received` reads them back as the process would."""

    def __init__(self) -> None:
        import socket

        super().__init__()
        self._ours, self._theirs = socket.socketpair()
        ours = self._ours

        class Transport:
            def get_write_buffer_size(self) -> int:
                return 0

            def get_extra_info(self, name: str) -> Any:
                return ours

        self.transport = Transport()

    def received(self) -> Any:
        import socket

        from kerneleval.internal.v1 import job_channel_pb2

        data, fds, _flags, _addr = socket.recv_fds(self._theirs, 1 << 20, 4)
        for fd in fds:
            os.close(fd)
        return job_channel_pb2.FrontendMessage.FromString(data[4:]), len(fds)


def test_a_standing_judge_starts_ahead_with_its_kernel_and_leaves_a_job_that_ends_first(
    tmp_path: Path,
) -> None:
    """--judge-ahead: when a judged job's kernel starts, an idle standing judge of its
    reference on its GPU is given the job ahead, with its record, and its check's share of
    the GPU is asked for with it (its PHASE_VALIDATING then asks nothing more: the grant is in
    when it has built the reference); JudgePrepared gives it back, and its phases are not the
    job's.
    The kernel's outcome sends it the JudgeGo (not a second AssignJob), and it is the job's
    worker from then on: its check, next, is asked for with the go (GpuUse.ask_early), not by
    the judge a round trip later. A job that ends first (here: its kernel INCORRECT) sends it
    a JudgeGo that abandons; its answer frees it, standing again. A standing judge busy, of
    another reference, or on another GPU is never started ahead."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval_server.fleet.job_processes import check_frame
    from kerneleval_server.jobs import judge_record

    m = _judging_manager(tmp_path)
    gate: list[tuple[str, str]] = []
    m.gate.request = lambda device, worker_id, exclusive: gate.append(("ask", worker_id))  # type: ignore[method-assign]
    m.gate.release = lambda device, worker_id: gate.append(("release", worker_id))  # type: ignore[method-assign]

    def standing(worker_id: str, key: str, device: int = 0) -> Any:
        w = _process(worker_id, device, judge_key=key)
        w.writer = _FdChannel()
        m.job_processes.by_id[worker_id] = w
        return w

    def kernel_started(job_id: str, kernel_id: str) -> Any:
        from kerneleval.v1 import kernel_pb2
        from kerneleval_server.jobs.deadline import Deadline
        from kerneleval_server.jobs.running import Running

        kernel = _process(kernel_id)
        m.job_processes.by_id[kernel_id] = kernel
        spec = kernel_pb2.JobSpec()
        spec.reference.source_code = "ref A"
        r = Running(job=job_pb2.Job(job_id=job_id, device_index=0, spec=spec), proc=kernel,
                    timeout_s=60)  # fmt: skip
        r.record = judge_record.Record.make(job_id, 1 << 20, spec)
        r.deadline = Deadline(asyncio.get_running_loop(), 60, lambda: None)
        m.running[job_id] = r
        kernel.job_id = job_id
        m.judges.start_ahead(r)
        return r

    async def main() -> None:
        key = judge_record.reference_key(kernel_started("probe", "d0-kp").job.spec)
        m.running.pop("probe").record.close()
        other = standing("d0-jb", key + "x")
        elsewhere = standing("d1-ja", key, device=1)
        judge = standing("d0-ja", key)
        run = kernel_started("j", "d0-k0")
        assert run.ahead is judge and judge.ahead_job == judge.job_id == "j"
        assign, fds = judge.writer.received()
        assert assign.assign.judge.ahead and assign.assign.job_id == "j" and fds == 1
        assert other.ready and elsewhere.ready
        second = kernel_started("j2", "d0-k1")  # its judge is busy: none ahead
        assert second.ahead is None

        def frame(**kw: Any) -> Any:
            return job_channel_pb2.JobProcessMessage(**kw)

        checking = job_channel_pb2.PhaseUpdate(job_id="j", phase=job_pb2.PHASE_VALIDATING)
        assert gate == [("ask", "d0-ja")] and judge.check_asked  # asked with its job
        m.messages.on_process_message(judge, frame(phase=checking))
        assert gate == [("ask", "d0-ja")] and not judge.check_asked
        prepared = frame(judge_prepared=job_channel_pb2.JudgePrepared(job_id="j"))
        kernel = m.job_processes.by_id["d0-k0"]
        kernel.assigned_job_id = "j"
        assert check_frame(kernel, prepared) == "a JudgePrepared for a job it was not given ahead"
        assert check_frame(judge, prepared) == ""
        m.messages.on_process_message(judge, prepared)
        assert gate == [("ask", "d0-ja"), ("release", "d0-ja")]
        assert run.phase == 0  # the kernel's process reports the job's phases

        passed = job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK)
        ok = job_channel_pb2.JobOutcome(job_id="j", result=passed)
        m.judges.await_judge(run, ok)
        m.judges.kernel_exited(run)
        # Even on a GPU held for another job alone: that job waits for this judge.
        gate.clear()
        m.judges.start([], [], {0: "another"})
        assert run.proc is judge and run.ahead is None
        assert judge.writer.sent == ["judge_go"]
        go = judge.writer.frames[-1].judge_go
        assert go.job_id == "j" and not go.abandon
        assert gate == [("ask", "d0-ja")] and judge.check_asked
        # Its PHASE_VALIDATING then is the job's event, and asks nothing more.
        m.messages.on_process_message(judge, frame(phase=checking))
        assert gate == [("ask", "d0-ja")] and not judge.check_asked
        assert run.phase == job_pb2.PHASE_VALIDATING
        assert list(m.judges.queue) == []
        # A judge still preparing (no JudgePrepared yet: it holds its share) asks for its
        # check itself once prepared: its go asks nothing for it.
        judge4 = standing("d0-jd", key)
        fourth = kernel_started("j4", "d0-k3")
        assert fourth.ahead is judge4
        judge4.writer.received()
        m.judges.await_judge(fourth, job_channel_pb2.JobOutcome(job_id="j4", result=passed))
        m.judges.kernel_exited(fourth)
        gate.clear()
        m.judges.start([], [], {})
        assert fourth.proc is judge4 and judge4.writer.sent == ["judge_go"]
        assert gate == [] and judge4.check_asked  # only the ask made with its job
        # Its check ahead, read after its go (the job's frame now), asks nothing a second
        # time: a second grant, in after its JudgePrepared let the first go, would let its
        # next check run without a share of the GPU.
        m.messages.on_process_message(
            judge4,
            frame(phase=job_channel_pb2.PhaseUpdate(job_id="j4", phase=job_pb2.PHASE_VALIDATING)),
        )
        assert gate == [] and not judge4.check_asked
        fourth.record.close()

        # j2's kernel is wrong: the job ends; had it a judge ahead, that one would leave it.
        m.judges.drop_record(second)
        judge2 = standing("d0-jc", key)
        third = kernel_started("j3", "d0-k2")
        assert third.ahead is judge2
        judge2.writer.received()
        gate.clear()
        m.judges.drop_record(third)  # the job ended first
        m.running.pop("j3")
        assert judge2.writer.sent == ["judge_go"] and judge2.ahead_job and not judge2.ready
        assert judge2.writer.frames[-1].judge_go.abandon and gate == []  # nothing asked
        # Its check, asked for with its job, stays asked (not released) when it is left: it
        # is granted, else the judge waits for ever and never reads the abandon.
        late = job_channel_pb2.PhaseUpdate(job_id="j3", phase=job_pb2.PHASE_VALIDATING)
        m.messages.on_process_message(judge2, frame(phase=late))
        assert gate == [] and not judge2.check_asked
        left = job_channel_pb2.JobOutcome(job_id="j3", reusable=True)
        m.messages.on_process_message(judge2, frame(outcome=left))
        assert judge2.ready and not judge2.ahead_job and judge2.judge_key == key and not judge2.gone
        # Given the job's next attempt ahead (the same job id), what it said of the last one
        # counts no more: until its new JudgePrepared its go asks nothing for it.
        judge2.prepared_job = "j3"
        judge2.assign("j3", job_pb2.Job().spec, 2, judge=job_channel_pb2.JudgeRequest(ahead=True))
        assert judge2.ahead_job == "j3" and judge2.prepared_job == ""
        for r in (run, second, third):
            r.record.close()

    asyncio.run(main())


def test_a_launch_has_its_shared_check_asked_for_as_it_is_sent(tmp_path: Path) -> None:
    """A kernel built ahead goes to a launch process, which loads it and then checks it: a
    check that shares the GPU is asked for with the launch (its grant is there when the
    process says PHASE_VALIDATING, which asks nothing more and is still the job's event).
    A timed launch's check asks for the GPU alone (its window): only once it is loaded."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import kernel_pb2
    from kerneleval_server.jobs.deadline import Deadline
    from kerneleval_server.jobs.running import Running, Stage

    m = _judging_manager(tmp_path)
    asked: list[tuple[str, bool]] = []
    m.gate.request = lambda device, worker_id, exclusive: asked.append((worker_id, exclusive))  # type: ignore[method-assign]

    def launch(job_id: str, worker_id: str, timed: bool) -> Any:
        spec = kernel_pb2.JobSpec()
        spec.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
        spec.options.perf_trial_count = 5 if timed else 0
        job = job_pb2.Job(job_id=job_id, state=job_pb2.JOB_STATE_RUNNING, spec=spec)
        m.store.insert(job, m.hub.next_event(job_id))
        worker = _process(worker_id)
        m.job_processes.by_id[worker_id] = worker
        waiting = Running(job=job, proc=worker, timeout_s=60)  # fmt: skip
        waiting.stage = Stage.AWAITING_LAUNCH
        waiting.built = [job_channel_pb2.KernelArtifact(role="kernel")]
        waiting.deadline = Deadline(asyncio.get_running_loop(), 60, lambda: None)
        m.running[job_id] = waiting
        m.builds.launched.add(job_id)
        m.start(job_id, worker)
        return waiting, worker

    def phase(worker: Any, job_id: str, p: int) -> None:
        update = job_channel_pb2.PhaseUpdate(job_id=job_id, phase=p)  # type: ignore[arg-type]
        m.messages.on_process_message(worker, job_channel_pb2.JobProcessMessage(phase=update))

    def phases(job_id: str) -> list[int]:
        return [e.phase.phase for e in m.store.events_after(job_id, 0) if e.HasField("phase")]

    async def main() -> None:
        run, worker = launch("j", "d0-w0", timed=False)
        assert worker.writer.sent == ["assign"] and asked == [("d0-w0", False)]
        assert worker.check_asked and worker.used_gpu
        phase(worker, "j", job_pb2.PHASE_COMPILING)
        phase(worker, "j", job_pb2.PHASE_VALIDATING)
        assert asked == [("d0-w0", False)] and not worker.check_asked  # not asked again
        assert run.phase == job_pb2.PHASE_VALIDATING
        assert phases("j") == [job_pb2.PHASE_COMPILING, job_pb2.PHASE_VALIDATING]

        asked.clear()
        timed, tw = launch("t", "d0-w1", timed=True)
        assert asked == [] and not tw.check_asked
        phase(tw, "t", job_pb2.PHASE_COMPILING)
        phase(tw, "t", job_pb2.PHASE_VALIDATING)
        assert asked == [("d0-w1", True)]  # its window, once the kernel is loaded

    asyncio.run(main())


def test_a_judge_times_the_reference_only_once_the_kernels_process_is_gone(
    tmp_path: Path,
) -> None:
    """The judge may start and check while the kernel's process exits, but its timing
    window (PHASE_PROFILING) is asked for only once that process has exited: nothing of the
    kernel may still run on the GPU while the reference is timed."""
    from kerneleval.internal.v1 import job_channel_pb2

    m = _judging_manager(tmp_path)
    asked: list[str] = []
    m.gate.request = lambda device, worker_id, exclusive: asked.append(worker_id)  # type: ignore[method-assign]

    async def main() -> None:
        kernel = _process("d0-k0")
        run = _judged(m, "j", kernel)
        judge = _process("d0-w0")
        run.proc, run.awaiting_judge, judge.job_id = judge, False, "j"
        m.job_processes.by_id[judge.worker_id] = judge
        for phase in (job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING):
            update = job_channel_pb2.PhaseUpdate(job_id="j", phase=phase)  # type: ignore[arg-type]
            m.messages.on_process_message(judge, job_channel_pb2.JobProcessMessage(phase=update))
            if phase == job_pb2.PHASE_VALIDATING:
                assert asked == ["d0-w0"]  # its check goes through memory admission at once
                m.gate.release(0, "d0-w0")
        assert asked == ["d0-w0"] and run.timing_waits_kernel
        exited = watchdog_pb2.WorkerExited(exit_code=0)
        exited.worker.worker_id = kernel.worker_id
        m.watchdog_events.on_process_exited(exited, drain=False)
        assert asked == ["d0-w0", "d0-w0"] and not run.timing_waits_kernel
        run.record.close()

    asyncio.run(main())


@pytest.mark.parametrize("standing", [2, 5])
def test_standing_judges_are_few_and_leave_when_idle(tmp_path: Path, standing: int) -> None:
    """Standing judges live outside their GPU's process slots, so they are capped: a judge
    beyond --standing-judges-per-device on its GPU takes the place of the one idle longest
    there (its channel closed), or leaves at once when all of them are busy; one idle for
    STANDING_JUDGE_IDLE_S leaves then, unless it judged again meanwhile."""
    m = _judging_manager(tmp_path)
    m.config.standing_judges_per_device = n = standing

    async def main() -> None:
        judges = [_process(f"d0-j{i}") for i in range(n + 2)]
        judges.append(_process("d1-j0", device=1))
        for w in [*judges[: n + 1], judges[-1]]:
            m.job_processes.by_id[w.worker_id] = w
            w.assigned_job_id, w.reusable = "earlier", True
            m.judges.stand(w, "k")
        oldest = judges[0]
        assert oldest.gone and oldest.writer.closed and not oldest.ready
        for w in [*judges[1 : n + 1], judges[-1]]:  # the cap is per GPU
            assert w.ready and w.judge_key == "k", w.worker_id
        for w in judges[1 : n + 1]:
            w.job_id = "judging"  # all busy: the next one leaves itself
        late = judges[n + 1]
        m.job_processes.by_id[late.worker_id] = late
        late.assigned_job_id, late.reusable = "earlier", True
        m.judges.stand(late, "k")
        assert late.gone and all(not w.gone for w in judges[1 : n + 1])
        for w in judges[1 : n + 1]:
            w.job_id = ""
        busy, idle = judges[1], judges[2]
        m.judges._retire_if_idle(busy, busy.idle_since - 1)  # it judged again since that timer
        assert busy.ready
        m.judges._retire_if_idle(idle, idle.idle_since)
        assert idle.gone and idle.writer.closed

    asyncio.run(main())


def test_a_check_refused_for_a_gpu_held_alone_does_not_hold_back_that_job(
    tmp_path: Path,
) -> None:
    """Checks wait for GPU memory in order, one that does not fit holding back the later
    ones of its GPU; but one refused because the GPU is held for a job re-run alone must not
    hold back that job (a judge that asked first kept it waiting for ever, on an H100). A
    holder that no longer exists is swept first."""
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobs.running import Running

    m = _judging_manager(tmp_path)
    m.memory.set_total(0, 80 * 10**9)
    used: list[str] = []
    m.gpu_use.use = lambda run: used.append(run.job.job_id)  # type: ignore[method-assign]

    def run(job_id: str, worker_id: str) -> Running:
        w = JobProcess(worker_id, 1, 0, False, 0, job_id=job_id)
        r = Running(job=job_pb2.Job(job_id=job_id), proc=w, timeout_s=60)
        m.running[job_id], m.job_processes.by_id[worker_id] = r, w
        return r

    judge, alone = run("judge", "d0-w1"), run("alone", "d0-w2")
    m.crowding.alone.add("alone")
    m.memory.hold(0, "d0-w9", 10**9)  # a job process whose exit went unheard
    m.gpu_use.waiting = {"d0-w1": judge, "d0-w2": alone}  # the judge asked first
    m.gpu_use.admit_waiting()
    assert used == ["alone"] and list(m.gpu_use.waiting) == ["d0-w1"]
    assert m.memory.holds(0, "d0-w2") and not m.memory.holds(0, "d0-w9")


def test_a_reference_is_kept_by_itself_only_from_a_build_no_candidate_code_ran_in(
    tmp_path: Path,
) -> None:
    """A raw CUDA reference built beside a raw CUDA kernel (nvcc for each: no candidate code
    runs in that build) is kept for every later job with that reference; one built beside a
    Triton kernel, whose module ran in the build process and could have rewritten it, is not;
    a build given the reference adds it back to the kernel it built."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import kernel_pb2
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobs.manager import JobManager
    from kerneleval_server.jobs.running import Running
    from kerneleval_server.metrics import Metrics

    store = SqliteStore(tmp_path / "db.sqlite")
    cfg = config_mod.Config(state_dir=str(tmp_path / "state"))  # its build cache on disk too
    m = JobManager(cfg, store, EventHub(store), OpsLog(), Metrics(), 600.0)

    def spec(kernel_type: int, code: str) -> kernel_pb2.JobSpec:
        s = kernel_pb2.JobSpec()
        s.kernel.type, s.kernel.source_code = kernel_type, code
        s.reference.type, s.reference.source_code = kernel_pb2.KERNEL_TYPE_CUDA, "reference"
        for k in (s.kernel, s.reference):
            k.io.args.add(name="n", int_value=4)
        return s

    def built(*roles: str) -> job_channel_pb2.BuildOutcome:
        out = job_channel_pb2.BuildOutcome()
        for role in roles:
            out.artifacts.add(role=role, cubin=b"\x7fELF " + role.encode(), function="f")
        return out

    def run(given: list[job_channel_pb2.KernelArtifact] | None = None) -> Running:
        worker = JobProcess("build-w0", 1, -3, False, 0)
        r = Running(job=job_pb2.Job(), proc=worker, timeout_s=60)
        r.build_arch, r.given_reference = "sm_90", list(given or [])
        return r

    triton = spec(kernel_pb2.KERNEL_TYPE_TRITON, "a triton candidate")
    m.builds.keep_reference(triton, run(), built("kernel", "reference"))
    assert m.builds.reference_built_before(triton, "sm_90") == []
    cuda = spec(kernel_pb2.KERNEL_TYPE_CUDA, "a cuda candidate")
    m.builds.keep_reference(cuda, run(), built("kernel", "reference"))
    given = m.builds.reference_built_before(triton, "sm_90")  # any later job with that reference
    assert [a.cubin for a in given] == [b"\x7fELF reference"]
    assert m.builds.reference_built_before(triton, "sm_100") == []  # built for one architecture
    later = run(given)
    kernel_only = built("kernel")
    m.builds._with_given_reference(later, kernel_only)
    assert [a.role for a in kernel_only.artifacts] == ["kernel", "reference"]
    # A build that was given it never keeps it again (what it answers holds the given one).
    m.builds.keep_reference(cuda, later, kernel_only)
    store.close()


@pytest.mark.parametrize("asked", ["cancel", "timeout"])
def test_a_build_that_answers_after_its_cancel_or_timeout_ends_so_and_never_launches(
    tmp_path: Path, asked: str
) -> None:
    """The build's answer was on its way when a client cancelled the job (CI saw it) or its
    deadline fired: the answer is dropped, the kill's exit ends the job as asked, and it never
    waits for a launch process (where it would have run after all)."""
    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import kernel_pb2
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobs.deadline import Deadline
    from kerneleval_server.jobs.running import Running

    m, store, job = _one_running_job(tmp_path)
    job.spec.kernel.type, job.spec.kernel.source_code = kernel_pb2.KERNEL_TYPE_CUDA, "kernel"
    job.spec.kernel.io.args.add(name="n", int_value=4)
    worker = JobProcess("build-w0", 100, -3, False, 0, job_id="j1")
    m.job_processes.by_id[worker.worker_id] = worker
    m.running["j1"] = Running(job=job, proc=worker, timeout_s=60)
    built = job_channel_pb2.BuildOutcome(job_id="j1")
    built.artifacts.add(role="kernel", cubin=b"\x7fELF kernel", function="f")

    async def main() -> job_pb2.Job | None:
        run = m.running["j1"]
        run.deadline = Deadline(asyncio.get_running_loop(), 60, lambda: None)
        if asked == "cancel":
            ask = asyncio.create_task(m.cancel("j1"))
            await asyncio.sleep(0)  # the kill is asked for
        else:
            m.on_deadline("j1")
        kill = m.running["j1"].kill
        assert kill is not None and kill.value == asked
        m.messages.on_process_message(worker, job_channel_pb2.JobProcessMessage(build=built))
        assert not m.running["j1"].awaiting_launch and "j1" not in m.builds.launch_queue
        exited = watchdog_pb2.WorkerExited(exit_code=-9, reason="killed")
        exited.worker.worker_id = worker.worker_id
        m.process_exited(worker, exited)
        if asked == "cancel":
            return await asyncio.wait_for(ask, 5)
        await m.endings.wait_finished("j1", 5)
        return store.get("j1")

    ended = asyncio.run(main())
    assert ended is not None, ended
    if asked == "cancel":
        assert ended.state == job_pb2.JOB_STATE_CANCELLED, ended
    else:
        assert ended.result.verdict == job_pb2.VERDICT_TIMEOUT, ended
    assert "j1" not in m.builds.launch_queue
    store.close()
