"""The Python client against the fake server: every call, typed errors, re-attach, batches."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from fake_server import ADMIN_TOKEN, Failure, FakeServer, FakeState
from kerneleval import cli, contracts, errors
from kerneleval.client import AsyncClient, Client, StreamNote, _SubmitRetry, is_terminal
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


def test_run_says_what_its_stream_went_through(client: Client, fake: FakeServer):
    """on_note hears one "lost" per drop and one "reattached" at the first new event (the CLI
    says them)."""
    fake.state.drop_after = 3
    notes: list[StreamNote] = []
    events = list(client.run(spec(), on_note=notes.append))
    assert_contiguous(events)
    assert [(n.kind, n.sequence) for n in notes] == [("lost", 3), ("reattached", 4)]
    assert {n.job_id for n in notes} == {events[0].job_id}
    assert notes[0].code is not None


def test_async_run_says_what_its_stream_went_through(fake: FakeServer):
    fake.state.drop_after = 3
    notes: list[StreamNote] = []

    async def scenario() -> list[job_pb2.JobEvent]:
        async with AsyncClient(fake.address, timeout=20) as c:
            return [e async for e in c.run(spec(), on_note=notes.append)]

    assert_contiguous(asyncio.run(scenario()))
    assert [(n.kind, n.sequence) for n in notes] == [("lost", 3), ("reattached", 4)]


def test_watch_says_it_waits_for_a_server_that_is_down():
    notes: list[StreamNote] = []
    with Client("127.0.0.1:1", reconnect_timeout=1.0) as c:
        with pytest.raises(errors.Unavailable):
            list(c.watch("job-x", on_note=notes.append))
    assert [n.kind for n in notes] == ["waiting"]
    assert 0 < notes[0].seconds <= 1.0


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
    builders = client.list_builders()
    assert [b.expired for b in builders.builders] == [False, True]
    assert builders.builders[0].versions in builders.versions
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
            assert (await c.list_builders()).builders[0].leased_request_count == 3
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


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch) -> list[BaseException | None]:
    """Exceptions raised in background threads (gRPC's connectivity polling among them)."""
    seen: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    return seen


def test_watch_leaves_no_channel_polling_behind(fake: FakeServer, thread_errors) -> None:
    """watch waits for the server without grpc.channel_ready_future, whose connectivity-polling
    thread outlived it and raised "Channel closed!" once the client was closed (the warning at
    exit), whether the wait ended ready or timed out."""
    for _ in range(5):  # a race before the fix: the polling thread's next 0.2 s tick
        with Client(fake.address, timeout=20) as c:
            job = c.evaluate(spec())
            for _ in range(2):  # the second wait asked the polling thread to connect again
                assert is_terminal(list(c.watch(job.job_id))[-1])
            assert c.wait_ready(5.0)
    with Client("127.0.0.1:1", reconnect_timeout=0.3) as c:
        with pytest.raises(errors.Unavailable):
            list(c.watch("job-x"))
        assert not c.wait_ready(0.2)
    time.sleep(0.5)  # past the polling thread's tick
    assert thread_errors == []


# --- labels ---------------------------------------------------------------------------------


def test_labels_reach_the_spec_and_are_added_to_its_own(client: Client, fake: FakeServer):
    s = spec()
    s.labels["problem"] = "old"
    s.labels["rollout"] = "7"
    job = client.evaluate(s, labels={"problem": "19_ReLU", "step": "420"})
    sent = fake.state.received[-1]
    assert dict(sent.spec.labels) == {"problem": "19_ReLU", "rollout": "7", "step": "420"}
    assert dict(job.spec.labels) == dict(sent.spec.labels)
    assert dict(s.labels) == {"problem": "old", "rollout": "7"}, "the caller's spec is kept"
    client.compare(with_reference(spec()), labels={"kind": "compare"})
    assert dict(fake.state.received[-1].spec.labels) == {"kind": "compare"}
    events = list(client.run(spec(), labels={"kind": "run"}))
    assert all(dict(e.labels) == {"kind": "run"} for e in events)
    client.submit(spec(), labels={"kind": "submit"})
    assert dict(fake.state.received[-1].spec.labels) == {"kind": "submit"}


def with_reference(s: kernel_pb2.JobSpec) -> kernel_pb2.JobSpec:
    s.reference.CopyFrom(kernel_source("class Model: pass\n", type="torch"))
    return s


def test_list_jobs_filters_by_labels(client: Client, fake: FakeServer):
    for step in ("1", "2", "2"):
        client.evaluate(spec(), labels={"suite": "labels-test", "step": step})
    jobs = list(client.list_jobs(labels={"suite": "labels-test", "step": "2"}, include_spec=True))
    assert len(jobs) == 2
    assert all(j.spec.labels["step"] == "2" for j in jobs)
    sent = fake.state.received[-1]
    assert dict(sent.labels) == {"suite": "labels-test", "step": "2"}
    page = client.list_jobs_page(labels={"suite": "labels-test"}, page_size=2)
    assert len(page.jobs) == 2 and page.next_page_token == "2"
    rest = client.list_jobs_page(labels={"suite": "labels-test"}, page_token=page.next_page_token)
    assert len(rest.jobs) == 1 and not rest.next_page_token
    # A request of your own, with keywords set on a copy of it.
    mine = kernel_eval_service_pb2.ListJobsRequest(page_size=1)
    one = client.list_jobs_page(mine, labels={"suite": "labels-test", "step": "1"})
    assert len(one.jobs) == 1 and not mine.labels


def test_async_labels_list_jobs_page_and_health(fake: FakeServer):
    async def scenario() -> None:
        async with AsyncClient(fake.address, timeout=20) as c:
            await c.evaluate(spec(), labels={"suite": "async-labels"})
            job = await c.submit(spec(), labels={"suite": "async-labels"})
            assert dict(job.spec.labels) == {"suite": "async-labels"}
            events = [e async for e in c.run(spec(), labels={"suite": "async-labels"})]
            assert events[-1].labels["suite"] == "async-labels"
            page = await c.list_jobs_page(labels={"suite": "async-labels"}, page_size=2)
            assert len(page.jobs) == 2 and page.next_page_token
            listed = [j async for j in c.list_jobs(labels={"suite": "async-labels"})]
            assert len(listed) == 3
            assert await c.health() == "SERVING"

    asyncio.run(scenario())


# --- retries --------------------------------------------------------------------------------


@pytest.fixture
def own() -> Iterator[FakeServer]:
    """A server of the test's own, so that attempts and jobs are counted from zero."""
    server = FakeServer(FakeState())
    yield server
    server.stop()


def submits(state: FakeState) -> list[kernel_eval_service_pb2.SubmitRequest]:
    return [r for r in state.received if isinstance(r, kernel_eval_service_pb2.SubmitRequest)]


def test_submit_honours_retry_info_and_sends_one_idempotency_key(own: FakeServer):
    full = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_delay=0.2)
    own.state.fail("Submit", full, full)
    with Client(own.address, timeout=10) as c:
        started = time.monotonic()
        job = c.submit(spec())
        took = time.monotonic() - started
    assert job.state == job_pb2.JOB_STATE_QUEUED
    assert own.state.attempts["Submit"] == 3
    keys = {r.idempotency_key for r in submits(own.state)}
    assert len(keys) == 1 and len(keys.pop()) == 36  # one uuid4 for every attempt
    assert took >= 0.4, "each retry waits the RetryInfo's delay"
    assert len(own.state.order) == 1


def test_submit_backs_off_without_retry_info(own: FakeServer):
    own.state.fail("Submit", *[Failure(grpc.StatusCode.UNAVAILABLE, "draining")] * 3)
    with Client(own.address, timeout=10) as c:
        job = c.submit(spec())
    assert job.job_id and own.state.attempts["Submit"] == 4


def test_a_retried_submit_whose_answer_was_lost_makes_one_job(own: FakeServer):
    own.state.fail("Submit.after", Failure(grpc.StatusCode.UNAVAILABLE, "connection reset"))
    with Client(own.address, timeout=10) as c:
        job = c.submit(spec(), idempotency_key="rollout-17")
        again = c.submit(spec(), idempotency_key="rollout-17")
        other = c.submit(spec())
    assert own.state.attempts["Submit"] == 4
    assert job.job_id == again.job_id != other.job_id
    assert len(own.state.order) == 2
    assert [r.idempotency_key for r in submits(own.state)][:3] == ["rollout-17"] * 3
    assert len({r.idempotency_key for r in submits(own.state)}) == 2


def test_submit_gives_up_after_retry_timeout(own: FakeServer):
    own.state.fail("Submit", *[Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 0.3)] * 20)
    with Client(own.address, timeout=10, retry_timeout=1.0) as c:
        started = time.monotonic()
        with pytest.raises(errors.ResourceExhausted) as info:
            c.submit(spec())
        took = time.monotonic() - started
    assert info.value.retry_delay == pytest.approx(0.3)
    assert 2 <= own.state.attempts["Submit"] <= 4
    assert took < 1.5


@pytest.mark.parametrize(
    "failure",
    [
        Failure(grpc.StatusCode.INVALID_ARGUMENT, "bad"),
        Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (9 vs 4)"),
        Failure(grpc.StatusCode.INTERNAL, "boom"),
    ],
)
def test_submit_does_not_retry_what_cannot_succeed(own: FakeServer, failure: Failure):
    own.state.fail("Submit", failure)
    with Client(own.address, timeout=10) as c, pytest.raises(errors.KernelEvalError) as info:
        c.submit(spec())
    assert info.value.code == failure.code
    assert own.state.attempts["Submit"] == 1


def test_retry_timeout_zero_turns_retries_off(own: FakeServer):
    own.state.fail("Submit", Failure(grpc.StatusCode.UNAVAILABLE, "draining"))
    own.state.fail("GetJob", Failure(grpc.StatusCode.UNAVAILABLE, "draining"))
    with Client(own.address, timeout=10, retry_timeout=0) as c:
        with pytest.raises(errors.Unavailable):
            c.submit(spec())
        job = c.submit(spec())
        with pytest.raises(errors.Unavailable):
            c.get_job(job.job_id)
    assert own.state.attempts["Submit"] == 2 and own.state.attempts["GetJob"] == 1


def test_the_channel_retries_idempotent_calls_on_unavailable(own: FakeServer):
    flaky = Failure(grpc.StatusCode.UNAVAILABLE, "connection reset")
    with Client(own.address, timeout=10, admin_token=ADMIN_TOKEN) as c:
        job = c.submit(spec())
        own.state.fail("GetJob", flaky, flaky)
        assert c.get_job(job.job_id).job_id == job.job_id
        assert own.state.attempts["GetJob"] == 3
        own.state.fail("ListJobs", flaky)
        assert len(list(c.list_jobs())) == 1
        own.state.fail("CancelJob", flaky)
        c.cancel_job(job.job_id)
        assert own.state.attempts["CancelJob"] == 2
        own.state.fail("ListDevices", flaky)
        assert len(c.list_devices()) == 2
        # Not idempotent: Evaluate makes a job; the channel does not send it again.
        own.state.fail("Evaluate", flaky)
        with pytest.raises(errors.Unavailable):
            c.evaluate(spec())
        assert own.state.attempts["Evaluate"] == 1
        # Not UNAVAILABLE: not retried.
        own.state.fail("GetJob", Failure(grpc.StatusCode.INTERNAL, "boom"))
        with pytest.raises(errors.Internal):
            c.get_job(job.job_id)


def test_async_submit_retries_with_one_key(own: FakeServer):
    full = Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", retry_delay=0.05)
    own.state.fail("Submit", full, Failure(grpc.StatusCode.UNAVAILABLE, "draining"))
    own.state.fail("GetJob", Failure(grpc.StatusCode.UNAVAILABLE, "reset"))

    async def scenario() -> job_pb2.Job:
        async with AsyncClient(own.address, timeout=10) as c:
            job = await c.submit(spec(), labels={"a": "b"})
            assert (await c.get_job(job.job_id)).job_id == job.job_id
            own.state.fail("Submit", *[full] * 50)
            async with AsyncClient(own.address, retry_timeout=0.2) as short:
                with pytest.raises(errors.ResourceExhausted):
                    await short.submit(spec())
            return job

    job = asyncio.run(scenario())
    assert job.spec.labels["a"] == "b"
    first = submits(own.state)[:3]
    assert len({r.idempotency_key for r in first}) == 1 and first[0].idempotency_key
    assert own.state.attempts["GetJob"] == 2


def test_submit_retry_schedule():
    retry = _SubmitRetry(budget=60)
    busy = errors.ResourceExhausted("queue full")
    delays = [retry.delay(busy) for _ in range(8)]
    bounds = [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]
    for delay, bound in zip(delays, bounds, strict=True):
        assert delay is not None and bound / 2 <= delay <= bound
    told = errors.ResourceExhausted("queue full", retry_delay=2.5)
    assert retry.delay(told) == 2.5
    assert _SubmitRetry(budget=1).delay(told) is None, "a wait past the budget gives up at once"
    assert _SubmitRetry(budget=0).delay(errors.Unavailable("x")) is None
    assert _SubmitRetry(budget=60).delay(errors.DeadlineExceeded("x")) is None


def test_resource_exhausted_carries_the_retry_delay(own: FakeServer):
    own.state.fail("GetJob", Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down", 1.5))
    with Client(own.address, timeout=10) as c, pytest.raises(errors.ResourceExhausted) as info:
        c.get_job("x")
    assert info.value.retry_delay == 1.5 and info.value.details == "slow down"


# --- the CLI's labels and result origins -----------------------------------------------------


def cli_run(fake: FakeServer, capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["--address", fake.address, "--timeout", "20", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_labels_and_result_origin(fake: FakeServer, capsys, tmp_path):
    kernel = tmp_path / "k.py"
    kernel.write_text(TRITON_SRC + "# CACHED\n")
    code, out, err = cli_run(
        fake, capsys, "evaluate", str(kernel), "--label", "suite=cli", "--label", "step=3",
        "--no-progress", "--perf-trials", "0",
    )  # fmt: skip
    assert code == 0, err
    assert "cached from job-cached-0001" in out
    assert "labels" in out and "step=3, suite=cli" in out
    sent = [r for r in fake.state.received if isinstance(r, kernel_eval_service_pb2.RunRequest)]
    assert dict(sent[-1].spec.labels) == {"suite": "cli", "step": "3"}
    code, out, err = cli_run(fake, capsys, "jobs", "--label", "suite=cli", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert len(listed) == 1 and listed[0]["resultOrigin"] == "RESULT_ORIGIN_CACHE"
    code, out, err = cli_run(fake, capsys, "jobs", "--label", "suite=cli")
    assert "OK (cached from job-cached-0001)" in out
    code, out, err = cli_run(fake, capsys, "jobs", "--label", "suite=none")
    assert code == 0 and len(out.strip().splitlines()) == 2  # headers only
    code, out, err = cli_run(fake, capsys, "evaluate", str(kernel), "--label", "step=1", "--detach")
    assert code == 0
    assert dict(submits(fake.state)[-1].spec.labels) == {"step": "1"}


@pytest.mark.parametrize("bad", ["nokey", "=value", ""])
def test_cli_malformed_label_is_a_usage_error(fake: FakeServer, capsys, tmp_path, bad: str):
    kernel = tmp_path / "k.py"
    kernel.write_text(TRITON_SRC)
    with pytest.raises(SystemExit) as info:
        cli.main(["--address", fake.address, "evaluate", str(kernel), "--label", bad])
    assert info.value.code == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_cli_label_given_twice_with_two_values(fake: FakeServer, capsys):
    code, _, err = cli_run(fake, capsys, "jobs", "--label", "a=1", "--label", "a=2")
    assert code == 2 and "--label a given twice" in err
