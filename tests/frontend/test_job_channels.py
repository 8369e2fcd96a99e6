"""The front end's side of the sealed job processes, without a watchdog or a job process:
descriptors passed on the control channel (watchdog.py), and the job channel's protocol
(job_processes.py + jobs.py) against a fake job process on a socketpair."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server import config as config_mod
from kerneleval_server.fleet.watchdog import AttachedFd, Watchdog
from kerneleval_server.framing import MAX_FRAME, encode, read_frame
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.manager import JobManager
from kerneleval_server.jobs.store import SqliteStore
from kerneleval_server.metrics import Metrics

pytestmark = pytest.mark.timeout(60)


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ---- descriptors on the control channel ---------------------------------------------------


class FakeProc:
    pid = 4242

    def __init__(self) -> None:
        self.exited = asyncio.Event()

    async def wait(self) -> int:
        await self.exited.wait()
        return 0

    def kill(self) -> None:
        self.exited.set()


def started(worker_id: str, attached: bool) -> bytes:
    ev = watchdog_pb2.WatchdogEvent()
    ev.worker_started.worker.worker_id = worker_id
    ev.worker_started.channel_attached = attached
    return encode(ev.SerializeToString())


def test_watchdog_hands_over_the_descriptor_of_each_worker_started() -> None:
    async def scenario() -> None:
        ours, theirs = socket.socketpair()
        got: list[tuple[str, int]] = []

        events: list[str] = []

        def on_channel(ev: watchdog_pb2.WatchdogEvent, fd: AttachedFd) -> None:
            wid = ev.worker_started.worker.worker_id
            assert wid not in events  # the descriptor comes before the event
            if wid == "d0-w1":
                got.append((wid, fd.take()))
            else:
                got.append((wid, -1))  # not taken: the client closes it

        def on_event(ev: watchdog_pb2.WatchdogEvent) -> None:
            events.append(ev.worker_started.worker.worker_id)

        wd = Watchdog(FakeProc(), ours, on_event, on_channel)
        job1_front, job1_proc = socket.socketpair()
        job2_front, job2_proc = socket.socketpair()
        frame1, frame2 = started("d0-w1", True), started("d0-w2", True)
        # The descriptor rides on the first bytes of its frame; the frame may come in pieces.
        socket.send_fds(theirs, [frame1[:3]], [job1_front.fileno()])
        job1_front.close()
        await asyncio.sleep(0.05)
        theirs.sendall(frame1[3:] + started("d0-w9", False))
        socket.send_fds(theirs, [frame2], [job2_front.fileno()])
        job2_front.close()
        await until(lambda: len(got) == 2 and len(events) == 3)
        assert got[0][0] == "d0-w1" and got[1] == ("d0-w2", -1)
        assert events == ["d0-w1", "d0-w9", "d0-w2"]
        # The descriptor is the front end's end of that job's channel.
        with socket.socket(fileno=got[0][1]) as front:
            front.sendall(b"ping")
            assert job1_proc.recv(4) == b"ping"
        # The one nobody took was closed: the job process's end sees the end of the stream.
        job2_proc.settimeout(5)
        assert job2_proc.recv(4) == b""

        # Commands still get their replies over the same socket.
        theirs.setblocking(False)
        call = asyncio.create_task(wd.set_job("d0-w1", "job"))
        loop = asyncio.get_running_loop()
        header = await loop.sock_recv(theirs, 4)
        body = await loop.sock_recv(theirs, struct.unpack(">I", header)[0])
        cmd = watchdog_pb2.WatchdogCommand.FromString(body)
        assert cmd.set_job.job_id == "job"
        ack = watchdog_pb2.WatchdogEvent(command_id=cmd.command_id)
        ack.ack.ok = True
        await loop.sock_sendall(theirs, encode(ack.SerializeToString()))
        await asyncio.wait_for(call, 5)
        theirs.close()
        await until(lambda: wd.closed)
        await wd.close()
        job1_proc.close()
        job2_proc.close()

    asyncio.run(scenario())


# ---- the job channel's protocol -----------------------------------------------------------


class FakeWatchdog:
    def __init__(self) -> None:
        self.kills: list[tuple[str, str]] = []
        self.jobs: list[tuple[str, str]] = []
        self.warm: list[str] = []  # JobProcessWarm asked for
        self.frozen = asyncio.Event()  # ... and acknowledged

    async def kill_worker(self, worker_id: str, reason: str) -> None:
        self.kills.append((worker_id, reason))

    async def set_job(self, worker_id: str, job_id: str, finished: bool = False) -> None:
        self.jobs.append((worker_id, job_id + (" finished" if finished else "")))

    async def restart_workers(self, device_index: int = -2) -> None:
        pass

    async def reset_gpu(self, device_index: int, grace_ms: int) -> tuple[bool, list[Any]]:
        return True, []

    async def status(self) -> watchdog_pb2.StatusReport:
        return watchdog_pb2.StatusReport()

    async def shutdown(self, grace_ms: int = 2000) -> None:
        pass

    async def job_process_warm(self, worker_id: str) -> None:
        self.warm.append(worker_id)
        await self.frozen.wait()  # the watchdog's freeze, where a window is open


class FakeJobProcess:
    """The job process's end of a channel the front end got through WorkerStarted."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send(self, **kind: Any) -> None:
        self.send_raw(encode(job_channel_pb2.JobProcessMessage(**kind).SerializeToString()))
        await self.writer.drain()

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    async def receive(self) -> job_channel_pb2.FrontendMessage:
        frame = await asyncio.wait_for(read_frame(self.reader), 5)
        assert frame is not None
        return job_channel_pb2.FrontendMessage.FromString(frame)


def new_manager(tmp_path: Path, **cfg: Any) -> tuple[JobManager, FakeWatchdog]:
    store = SqliteStore(tmp_path / "db.sqlite")
    config = config_mod.Config(nvml="none", result_cache_hours=0, **cfg)
    m = JobManager(config, store, EventHub(store), OpsLog(), Metrics(), 600.0)
    wd = FakeWatchdog()
    m.watchdog = wd
    return m, wd


async def start_process(m: JobManager, worker_id: str, hello: bool = True) -> FakeJobProcess:
    front, proc = socket.socketpair()
    ev = watchdog_pb2.WatchdogEvent()
    ev.worker_started.worker.worker_id = worker_id
    ev.worker_started.worker.pid = 1000 + len(m.job_processes.by_id)
    ev.worker_started.worker.device_index = -1
    ev.worker_started.channel_attached = True
    attached = AttachedFd(front.detach())
    m.watchdog_events.on_job_channel(ev, attached)
    m.watchdog_events.on_event(ev)
    assert attached.taken
    reader, writer = await asyncio.open_unix_connection(sock=proc)
    fake = FakeJobProcess(reader, writer)
    if hello:
        await fake.send(hello=job_channel_pb2.Hello(worker_id=worker_id, pid=1, device_index=-1))
        await until(lambda: m.job_processes.by_id[worker_id].ready)
    return fake


def job_spec() -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec(client_tag="t")
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    s.kernel.source_code = "x"
    return s


def exited(worker_id: str, code: int = 0, reason: str = "exited") -> watchdog_pb2.WatchdogEvent:
    ev = watchdog_pb2.WatchdogEvent()
    ev.worker_exited.worker.worker_id = worker_id
    ev.worker_exited.worker.device_index = -1
    ev.worker_exited.exit_code = code
    ev.worker_exited.reason = reason
    ev.worker_exited.restarting = True
    return ev


def run_async(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(fn())


def test_a_waiter_answers_from_the_finished_job_before_the_store_has_it(tmp_path: Path) -> None:
    """An Evaluate's wait (finished) gets the job as it ended, before its store write, which
    follows in the loop's next turn; wait_finished returns only once the store has it."""

    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        assert (await proc.receive()).assign.job_id == job.job_id
        stored_when_answered: list[int] = []

        async def evaluate() -> job_pb2.Job | None:
            got = await m.endings.finished(job.job_id)
            stored_when_answered.append(m.store.get(job.job_id).state)  # type: ignore[union-attr]
            return got

        waiter = asyncio.create_task(evaluate())
        stored = asyncio.create_task(m.endings.wait_finished(job.job_id, 5))
        await asyncio.sleep(0.05)
        outcome = job_channel_pb2.JobOutcome(job_id=job.job_id)
        outcome.result.verdict = job_pb2.VERDICT_OK
        await proc.send(outcome=outcome)
        got = await asyncio.wait_for(waiter, 5)
        assert got is not None and got.state == job_pb2.JOB_STATE_DONE
        assert got.result.verdict == job_pb2.VERDICT_OK and got.spec == job.spec
        assert stored_when_answered == [job_pb2.JOB_STATE_RUNNING]  # answered first
        await asyncio.wait_for(stored, 5)
        assert m.store.get(job.job_id) == got  # then stored, as it was answered
        assert await m.endings.finished(job.job_id) == got  # from the store, once it has it
        proc.writer.close()

    run_async(scenario)


def test_a_job_is_sent_to_its_process_before_it_is_stored(tmp_path: Path) -> None:
    """submit: a process ready for it gets the job first, then the store has it (queued, then
    started); one that waits is stored by submit, queued. Submit answers with it queued."""

    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        worker = m.job_processes.by_id["c-w1"]
        order: list[str] = []
        insert, assign = m.store.insert, worker.assign

        def stored(*a: Any, **k: Any) -> Any:
            order.append("stored")
            return insert(*a, **k)

        def sent(*a: Any, **k: Any) -> Any:
            order.append("sent")
            return assign(*a, **k)

        m.store.insert = stored  # type: ignore[method-assign]
        worker.assign = sent  # type: ignore[method-assign]
        job = m.submit(job_spec())
        assert order == ["sent", "stored"]
        assert job.state == job_pb2.JOB_STATE_QUEUED
        assert m.store.get(job.job_id).state == job_pb2.JOB_STATE_RUNNING  # type: ignore[union-attr]
        kinds = [e.WhichOneof("kind") for e in m.store.events_after(job.job_id, 0)]
        assert kinds == ["queued", "started"]
        assert (await proc.receive()).assign.job_id == job.job_id
        waits = m.submit(job_spec())  # no process is ready for it
        assert order == ["sent", "stored", "stored"]
        assert m.store.get(waits.job_id).state == job_pb2.JOB_STATE_QUEUED  # type: ignore[union-attr]
        proc.writer.close()

    run_async(scenario)


def test_a_warming_process_gets_no_job_before_the_watchdog_can_freeze_it(tmp_path: Path) -> None:
    """--freeze-warming false: a job process still warming up runs through other jobs' timing
    windows, so its Hello counts (it takes jobs) only once the watchdog acknowledged it warm
    (JobProcessWarm: frozen from then on, at once in an open window); a job waits for that."""

    async def scenario() -> None:
        m, wd = new_manager(tmp_path, freeze_warming=False)
        proc = await start_process(m, "c-w1", hello=False)
        await proc.send(hello=job_channel_pb2.Hello(worker_id="c-w1", pid=1, device_index=-1))
        await until(lambda: wd.warm == ["c-w1"])
        job = m.submit(job_spec())
        await asyncio.sleep(0.1)
        worker = m.job_processes.by_id["c-w1"]
        assert not worker.ready and worker.hello is None and worker.assigned_job_id == ""
        with pytest.raises(RuntimeError, match="not said it is warm"):
            worker.assign("j", job_spec(), 1)  # and nothing could send it one
        assert m.store.get(job.job_id).state == job_pb2.JOB_STATE_QUEUED  # type: ignore[union-attr]
        wd.frozen.set()
        assert (await proc.receive()).assign.job_id == job.job_id
        proc.writer.close()

    run_async(scenario)


def test_frozen_when_warming_no_watchdog_round_trip(tmp_path: Path) -> None:
    """By default (--freeze-warming) a window freezes warming processes too: a Hello counts
    at once, with no JobProcessWarm."""

    async def scenario() -> None:
        m, wd = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")  # ready on its Hello alone
        assert wd.warm == []
        proc.writer.close()

    run_async(scenario)


def test_one_job_per_process_and_its_exit_is_no_failure(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, wd = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        assign = (await proc.receive()).assign
        assert assign.job_id == job.job_id and assign.attempt == 1
        assert wd.jobs == [("c-w1", job.job_id)]
        await proc.send(phase=job_channel_pb2.PhaseUpdate(job_id=job.job_id, phase=2))
        outcome = job_channel_pb2.JobOutcome(job_id=job.job_id)
        outcome.result.verdict = job_pb2.VERDICT_OK
        await proc.send(outcome=outcome)
        await m.endings.wait_finished(job.job_id, 5)
        done = m.store.get(job.job_id)
        assert done is not None and done.result.verdict == job_pb2.VERDICT_OK
        # Its slot goes to a spare as soon as its outcome is in (it keeps the job for XIDs).
        await until(lambda: len(wd.jobs) == 2)
        assert wd.jobs[1] == ("c-w1", f"{job.job_id} finished")
        # Never a second job for it, though it is still alive.
        second = m.submit(job_spec())
        await asyncio.sleep(0.1)
        assert m.store.get(second.job_id).state == job_pb2.JOB_STATE_QUEUED  # type: ignore[union-attr]
        proc.writer.close()
        m.watchdog_events.on_event(exited("c-w1"))
        await until(lambda: "c-w1" not in m.job_processes.by_id)
        assert m.fleet.counters["restarts"] == 0 and wd.kills == []
        # The next process takes the queued job.
        nxt = await start_process(m, "c-w2", hello=False)
        await nxt.send(hello=job_channel_pb2.Hello(worker_id="c-w2"))
        assert (await nxt.receive()).assign.job_id == second.job_id
        assert m.serving()

    run_async(scenario)


def test_exit_reported_before_the_outcome_is_read(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        await proc.receive()
        outcome = job_channel_pb2.JobOutcome(job_id=job.job_id)
        outcome.result.verdict = job_pb2.VERDICT_INCORRECT
        proc.send_raw(
            encode(job_channel_pb2.JobProcessMessage(outcome=outcome).SerializeToString())
        )
        proc.writer.close()
        # The watchdog's WorkerExited is handled before the job channel is read.
        m.watchdog_events.on_event(exited("c-w1"))
        await m.endings.wait_finished(job.job_id, 5)
        done = m.store.get(job.job_id)
        assert done is not None and done.state == job_pb2.JOB_STATE_DONE
        assert done.result.verdict == job_pb2.VERDICT_INCORRECT and done.attempt_count == 1
        await until(lambda: "c-w1" not in m.job_processes.by_id)

    run_async(scenario)


def _garbage() -> bytes:
    return encode(b"\x0a\xff\x01garbage")  # field 1, a length past the end


@pytest.mark.parametrize(
    ("frames", "said"),
    [
        (lambda job_id: struct.pack(">I", MAX_FRAME + 1) + b"x" * 4096, str(MAX_FRAME + 1)),
        (lambda job_id: _garbage(), "not a JobProcessMessage"),
        (
            lambda job_id: encode(
                job_channel_pb2.JobProcessMessage(
                    log=job_channel_pb2.LogLine(job_id="someone-else", text="hi")
                ).SerializeToString()
            ),
            "someone-else",
        ),
        (
            lambda job_id: encode(
                job_channel_pb2.JobProcessMessage(
                    hello=job_channel_pb2.Hello(worker_id="c-w1")
                ).SerializeToString()
            ),
            "second Hello",
        ),
    ],
    ids=["oversized", "garbage", "other-job", "second-hello"],
)
def test_protocol_violation_kills_the_process_and_ends_the_job(
    tmp_path: Path, frames: Callable[[str], bytes], said: str
) -> None:
    async def scenario() -> None:
        m, wd = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        await proc.receive()
        proc.send_raw(frames(job.job_id))
        await m.endings.wait_finished(job.job_id, 5)
        done = m.store.get(job.job_id)
        assert done is not None and done.state == job_pb2.JOB_STATE_DONE
        assert done.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, done.result
        assert done.result.error.exception_type == "ProtocolViolation"
        assert said in done.result.error.message, done.result.error.message
        assert done.attempt_count == 1  # not retried
        await until(lambda: wd.kills == [("c-w1", "protocol")])
        # The front end closed its end.
        assert await asyncio.wait_for(proc.reader.read(), 5) == b""
        m.watchdog_events.on_event(exited("c-w1", code=-1, reason="killed:protocol"))
        assert m.store.get(job.job_id).result.verdict == job_pb2.VERDICT_RUNTIME_ERROR  # type: ignore[union-attr]

    run_async(scenario)


def test_frame_before_hello_kills_the_process(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, wd = new_manager(tmp_path)
        proc = await start_process(m, "c-w1", hello=False)
        await proc.send(log=job_channel_pb2.LogLine(job_id="", text="early"))
        await until(lambda: wd.kills == [("c-w1", "protocol")])
        assert not m.job_processes.by_id["c-w1"].ready
        job = m.submit(job_spec())
        await asyncio.sleep(0.05)
        assert m.store.get(job.job_id).state == job_pb2.JOB_STATE_QUEUED  # type: ignore[union-attr]

    run_async(scenario)


def test_second_outcome(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, wd = new_manager(tmp_path, xid_wait_s=30.0)
        # After the job ended: the process is killed; the first outcome stands.
        proc = await start_process(m, "c-w1")
        job = m.submit(job_spec())
        await proc.receive()
        outcome = job_channel_pb2.JobOutcome(job_id=job.job_id)
        outcome.result.verdict = job_pb2.VERDICT_OK
        frame = encode(job_channel_pb2.JobProcessMessage(outcome=outcome).SerializeToString())
        proc.send_raw(frame + frame)
        await m.endings.wait_finished(job.job_id, 5)
        await until(lambda: wd.kills == [("c-w1", "protocol")])
        assert m.store.get(job.job_id).result.verdict == job_pb2.VERDICT_OK  # type: ignore[union-attr]
        # While the job still waits (a poisoned context waits for its XID): it ends with
        # the violation.
        proc2 = await start_process(m, "c-w2")
        job2 = m.submit(job_spec())
        await proc2.receive()
        poisoned = job_channel_pb2.JobOutcome(job_id=job2.job_id, context_poisoned=True)
        poisoned.result.verdict = job_pb2.VERDICT_DEVICE_FAULT
        await proc2.send(outcome=poisoned)
        await asyncio.sleep(0.1)
        assert m.store.get(job2.job_id).state == job_pb2.JOB_STATE_RUNNING  # type: ignore[union-attr]
        await proc2.send(outcome=poisoned)
        await m.endings.wait_finished(job2.job_id, 5)
        done = m.store.get(job2.job_id)
        assert done is not None and done.result.error.exception_type == "ProtocolViolation"
        assert "after its job's outcome" in done.result.error.message
        await until(lambda: ("c-w2", "protocol") in wd.kills)

    run_async(scenario)


def test_a_job_too_big_for_a_frame_fails_and_the_process_stays_ready(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, wd = new_manager(tmp_path)
        proc = await start_process(m, "c-w1")
        big = job_spec()
        big.kernel.source_code = "x" * (MAX_FRAME + 10)
        job = m.submit(big)
        done = m.store.get(job.job_id)
        assert done is not None and done.state == job_pb2.JOB_STATE_FAILED
        assert "cannot be sent" in done.state_reason
        assert m.job_processes.by_id["c-w1"].ready and wd.kills == []
        small = m.submit(job_spec())
        assert (await proc.receive()).assign.job_id == small.job_id

    run_async(scenario)


def test_channel_is_closed_when_nobody_takes_it(tmp_path: Path) -> None:
    async def scenario() -> None:
        m, _ = new_manager(tmp_path)
        # A WorkerStarted that says a channel is attached but none came: stopped, not used.
        ev = watchdog_pb2.WatchdogEvent()
        ev.worker_started.worker.worker_id = "c-w1"
        ev.worker_started.channel_attached = True
        m.watchdog_events.on_event(ev)
        await asyncio.sleep(0.01)
        assert m.job_processes.by_id["c-w1"].gone
        assert m.watchdog is not None
        assert ("c-w1", "no_channel") in m.watchdog.kills  # type: ignore[attr-defined]

    run_async(scenario)


def test_read_only_paths_and_job_env() -> None:
    from kerneleval_server import main

    cfg = config_mod.Config(sandbox_path="/opt,/nonexistent-kerneleval", engine="x.y")
    env = main.job_env(cfg)
    assert set(env) >= {"PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "KERNELEVAL_ENGINE"}
    assert "KERNELEVAL_FRONTEND_SOCKET" not in env
    paths = main.read_only_paths(cfg, env)
    src, gen = main.code_dirs()
    for p in (str(src.resolve()), str(gen.resolve())):
        assert any(p == q or p.startswith(q + "/") for q in paths), (p, paths)
    assert "/nonexistent-kerneleval" not in paths and all(os.path.isabs(p) for p in paths)
    assert not any(p == "/usr" or p.startswith("/usr/") for p in paths)
    configure = main.build_configure(cfg, Path("/tmp/x"))
    assert list(configure.worker_command)[1:] == ["-m", "kerneleval_server.jobproc.zygote"]
    sb = configure.sandbox
    assert sb.memory_bytes == cfg.effective_job_memory_mib() << 20
    assert sb.tmp_bytes == 1024 << 20 and sb.max_pids == 1024
    assert configure.spare_count == 3 and list(configure.retire_exit_codes) == [3]
