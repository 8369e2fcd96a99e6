"""The Python client against the fake server: every call, typed errors, re-attach, batches."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_server import ADMIN_TOKEN, FakeServer, FakeState
from kerneleval import contracts, errors
from kerneleval.client import AsyncClient, Client, is_terminal
from kerneleval.kernelbench import kernel_source
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2, kernel_pb2

TRITON_SRC = "import triton\n@triton.jit\ndef k(x_ptr):\n    pass\n"


def spec(source: str = TRITON_SRC, tag: str = "") -> kernel_pb2.JobSpec:
    io = contracts.io(contracts.tensor("x", (16,), "float32"), grid=(1,))
    return kernel_pb2.JobSpec(kernel=kernel_source(source, io=io), client_tag=tag)


def assert_contiguous(events: list[job_pb2.JobEvent], start: int = 1) -> None:
    assert [e.sequence for e in events] == list(range(start, start + len(events)))
    assert is_terminal(events[-1])
    assert sum(is_terminal(e) for e in events) == 1


@pytest.fixture
def client(fake: FakeServer):
    with Client(fake.address, timeout=20, admin_token=ADMIN_TOKEN) as c:
        yield c


def test_evaluate_returns_finished_job_and_sends_the_spec(client: Client, fake: FakeServer):
    s = spec(tag="eval-test")
    opts = kernel_pb2.EvalOptions(perf_trial_count=7)
    job = client.evaluate(s, options=opts)
    assert job.state == job_pb2.JOB_STATE_DONE
    assert job.result.verdict == job_pb2.VERDICT_OK
    assert job.result.runtime.median_ms == pytest.approx(1.25)
    sent = fake.state.received[-1]
    assert isinstance(sent, kernel_eval_service_pb2.EvaluateRequest)
    assert sent.spec.kernel.type == kernel_pb2.KERNEL_TYPE_TRITON
    assert sent.spec.options.perf_trial_count == 7
    assert sent.spec.client_tag == "eval-test"
    assert list(sent.spec.kernel.io.args[0].tensor.shape) == [16]
    assert not s.HasField("options"), "the caller's spec must not be modified"


def test_compare_without_reference_raises_invalid_argument_with_violations(client: Client):
    with pytest.raises(errors.InvalidArgument) as info:
        client.compare(spec())
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert [v.field for v in info.value.field_violations] == ["spec.reference"]
    assert "spec.reference" in str(info.value)


def test_several_violations_are_decoded(client: Client):
    bad = kernel_pb2.JobSpec(kernel=kernel_pb2.KernelSource())
    bad.kernel.io.args.add(name="x").tensor.shape.extend([4, -1])
    with pytest.raises(errors.InvalidArgument) as info:
        client.evaluate(bad)
    fields = {v.field for v in info.value.field_violations}
    assert fields == {
        "spec.kernel.source_code",
        "spec.kernel.type",
        "spec.kernel.io.args[0].tensor.shape[1]",
    }


def test_run_yields_every_event_in_order(client: Client):
    events = list(client.run(spec()))
    assert_contiguous(events)
    kinds = [e.WhichOneof("kind") for e in events]
    assert kinds[:2] == ["queued", "started"]
    assert kinds.count("phase") == 3 and kinds.count("progress") == 6
    assert events[-1].finished.result.verdict == job_pb2.VERDICT_OK


def test_run_reattaches_after_a_dropped_stream(client: Client, fake: FakeServer):
    fake.state.drop_after = 3
    events = list(client.run(spec()))
    assert_contiguous(events)
    watches = [
        r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.WatchRequest)
    ]
    assert watches[-1].after_sequence == 3
    assert watches[-1].job_id == events[0].job_id


def test_run_without_reconnect_raises_unavailable(client: Client, fake: FakeServer):
    fake.state.drop_after = 2
    got = []
    with pytest.raises(errors.Unavailable):
        for ev in client.run(spec(), reconnect=False):
            got.append(ev)
    assert len(got) == 2


def test_watch_survives_a_server_restart():
    state = FakeState(event_delay=0.05)
    server = FakeServer(state)
    try:
        with Client(server.address, reconnect_timeout=20) as c:
            job = c.submit(spec())
            assert job.state == job_pb2.JOB_STATE_QUEUED
            seen: list[job_pb2.JobEvent] = []
            restarted = threading.Event()

            def bounce() -> None:
                while len(seen) < 3:
                    time.sleep(0.01)
                server.stop()
                time.sleep(0.5)  # the job keeps running in the (shared) state meanwhile
                server.start()
                restarted.set()

            t = threading.Thread(target=bounce)
            t.start()
            for ev in c.watch(job.job_id):
                seen.append(ev)
            t.join()
            assert restarted.is_set()
            assert_contiguous(seen)
            assert seen[-1].finished.state == job_pb2.JOB_STATE_DONE
    finally:
        server.stop()


def test_watch_after_sequence_replays_only_later_events(client: Client):
    job = client.evaluate(spec())
    events = list(client.watch(job.job_id, after_sequence=4))
    assert events[0].sequence == 5
    assert_contiguous(events, start=5)


def test_watch_gives_up_when_the_server_stays_away():
    state = FakeState(event_delay=0.2)
    server = FakeServer(state)
    c = Client(server.address, reconnect_timeout=1.0)
    job = c.submit(spec())
    it = c.watch(job.job_id)
    next(it)
    server.stop()
    started = time.monotonic()
    with pytest.raises(errors.Unavailable, match="re-attach|could not reach"):
        list(it)
    assert time.monotonic() - started < 10
    c.close()


def test_get_job_not_found(client: Client):
    with pytest.raises(errors.NotFound):
        client.get_job("no-such-job")


def test_list_jobs_pages_through_everything(client: Client, fake: FakeServer):
    for _ in range(5):
        client.evaluate(spec(tag="paged"))
    jobs = list(client.list_jobs(client_tag="paged", page_size=2))
    assert len(jobs) == 5
    ids = [j.job_id for j in jobs]
    assert ids == sorted(ids, reverse=True)
    pages = [r for r in fake.state.received if r.__class__.__name__ == "ListJobsRequest"]
    assert [p.page_token for p in pages[-3:]] == ["", "2", "4"]
    assert len(list(client.list_jobs(client_tag="paged", page_size=2, limit=3))) == 3
    assert all(not j.HasField("spec") for j in jobs)
    done = list(client.list_jobs(state=job_pb2.JOB_STATE_DONE, client_tag="paged"))
    assert len(done) == 5


def test_cancel_job(fake: FakeServer):
    state = FakeState(event_delay=0.3)
    server = FakeServer(state)
    try:
        with Client(server.address) as c:
            job = c.submit(spec())
            cancelled = c.cancel_job(job.job_id)
            assert cancelled.state == job_pb2.JOB_STATE_CANCELLED
            events = list(c.watch(job.job_id))
            assert events[-1].finished.state == job_pb2.JOB_STATE_CANCELLED
    finally:
        server.stop()


def test_run_batch_tags_every_event_and_reports_refusals(client: Client):
    bad = kernel_pb2.JobSpec()
    items = [(f"t{i}", spec()) for i in range(6)] + [("bad", bad)]
    by_tag: dict[str, list] = {}
    for out in client.run_batch(items, max_in_flight=2):
        by_tag.setdefault(out.request_tag, []).append(out)
    assert set(by_tag) == {f"t{i}" for i in range(6)} | {"bad"}
    for i in range(6):
        evs = [o.event for o in by_tag[f"t{i}"]]
        assert_contiguous(evs)
        assert len({e.job_id for e in evs}) == 1
    (refusal,) = by_tag["bad"]
    assert refusal.done and refusal.event is None
    with pytest.raises(errors.InvalidArgument) as info:
        refusal.raise_for_error()
    assert "spec.kernel.source_code" in {v.field for v in info.value.field_violations}


def test_run_batch_default_tags_are_positions(client: Client):
    outs = list(client.run_batch([spec(), spec()]))
    assert {o.request_tag for o in outs} == {"0", "1"}
    assert sum(o.done for o in outs) == 2


def test_operations_need_the_admin_token(fake: FakeServer):
    with Client(fake.address, timeout=10, admin_token="") as c:
        c.admin_token = None
        with pytest.raises(errors.Unauthenticated):
            c.list_devices()  # refused locally: no token to send
    with Client(fake.address, timeout=10, admin_token="wrong") as c:
        with pytest.raises(errors.Unauthenticated):
            c.list_devices()
    assert fake.state.metadata[-1]["authorization"] == "Bearer wrong"


def test_operations_calls(client: Client, fake: FakeServer):
    devices = client.list_devices()
    assert [d.index for d in devices] == [0, 1]
    assert devices[0].recent_xids[0].xid == 31
    events = list(client.watch_events(replay_count=2))
    assert [e.WhichOneof("kind") for e in events] == ["xid", "worker_exited"]
    resp = client.reset_gpu(0, grace_period=1.5)
    assert resp.success and resp.steps[0].step == "drain"
    assert fake.state.reset_calls[-1] == 0
    assert client.restart_workers(0) == 2
    assert client.cleanup(older_than=3600).deleted_job_count == 3600
    assert client.get_stats().fault_count == 1
    assert client.health() == "SERVING"


def test_unreachable_server_is_unavailable():
    with Client("127.0.0.1:1", timeout=2) as c, pytest.raises(errors.Unavailable):
        c.get_job("x")


def test_async_client(fake: FakeServer):
    async def scenario() -> None:
        async with AsyncClient(fake.address, timeout=20, admin_token=ADMIN_TOKEN) as c:
            job = await c.evaluate(spec())
            assert job.result.verdict == job_pb2.VERDICT_OK
            fake.state.drop_after = 4
            events = [e async for e in c.run(spec())]
            assert_contiguous(events)
            watched = [e async for e in c.watch(job.job_id, after_sequence=2)]
            assert_contiguous(watched, start=3)
            with pytest.raises(errors.InvalidArgument) as info:
                await c.compare(spec())
            assert info.value.field_violations[0].field == "spec.reference"
            with pytest.raises(errors.NotFound):
                await c.get_job("nope")
            outs = [o async for o in c.run_batch([("a", spec()), ("b", spec())], max_in_flight=1)]
            assert {o.request_tag for o in outs if o.done} == {"a", "b"}
            listed = [j async for j in c.list_jobs(page_size=2, limit=3)]
            assert len(listed) == 3
            assert (await c.list_devices())[0].name == "NVIDIA H200"
            assert (await c.get_stats()).xid_count == 1
            ops = [e async for e in c.watch_events(1)]
            assert len(ops) == 1

    asyncio.run(scenario())


def test_async_watch_survives_a_server_restart():
    state = FakeState(event_delay=0.05)
    server = FakeServer(state)

    async def scenario() -> list[job_pb2.JobEvent]:
        async with AsyncClient(server.address, reconnect_timeout=20) as c:
            job = await c.submit(spec())
            seen: list[job_pb2.JobEvent] = []
            async for ev in c.watch(job.job_id):
                seen.append(ev)
                if len(seen) == 3:
                    # Blocking on purpose: the stream breaks under the client's feet.
                    server.stop()
                    time.sleep(0.3)
                    server.start()
            return seen

    try:
        seen = asyncio.run(scenario())
        assert_contiguous(seen)
        assert seen[-1].finished.state == job_pb2.JOB_STATE_DONE
        watches = [r for r in state.received if isinstance(r, kernel_eval_service_pb2.WatchRequest)]
        assert [w.after_sequence for w in watches][:1] == [0] and len(watches) >= 2
        assert watches[1].after_sequence >= 3
    finally:
        server.stop()


def test_watch_of_an_unreachable_server_gives_up_after_its_budget():
    with Client("127.0.0.1:1", reconnect_timeout=0.5) as c:
        started = time.monotonic()
        with pytest.raises(errors.Unavailable, match="could not reach the server"):
            list(c.watch("job-x"))
        assert time.monotonic() - started < 5
