"""The job store's pages, the event hub's replay and fan-out, the operations log."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kerneleval.v1 import job_pb2
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.store import SqliteStore


def _job(store: SqliteStore, hub: EventHub, job_id: str, tag: str = "") -> job_pb2.Job:
    job = job_pb2.Job(job_id=job_id, state=job_pb2.JOB_STATE_QUEUED)
    job.spec.client_tag = tag
    job.spec.kernel.source_code = "src"
    job.create_time.GetCurrentTime()
    event = hub.next_event(job_id)
    event.queued.position = 0
    store.insert(job, event)
    hub.publish(event, persisted=True)
    return job


def test_store_pages_filters_and_survives_reopen(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db.sqlite")
    hub = EventHub(store)
    for i in range(5):
        _job(store, hub, f"j{i}", "even" if i % 2 == 0 else "odd")
    page = store.list(limit=2)
    assert [j.job_id for _, j in page] == ["j4", "j3"]
    nxt = store.list(limit=2, before_rowid=page[-1][0])
    assert [j.job_id for _, j in nxt] == ["j2", "j1"]
    assert [j.job_id for _, j in store.list(limit=9, client_tag="odd")] == ["j3", "j1"]
    assert not store.list(limit=1)[0][1].HasField("spec")
    done = store.get("j0")
    assert done is not None and done.spec.kernel.source_code == "src"
    done.state = job_pb2.JOB_STATE_DONE
    done.end_time.FromSeconds(1000)
    store.update(done)
    store.close()

    store = SqliteStore(tmp_path / "db.sqlite")
    assert [j.job_id for j in store.unfinished()] == ["j1", "j2", "j3", "j4"]
    assert EventHub(store).next_event("j1").sequence == 2  # numbering continues
    assert store.delete_finished_before(2000) == 1
    assert store.get("j0") is None and store.events_after("j0", 0) == []
    by_state, _ = store.counts()
    assert by_state == {job_pb2.JOB_STATE_QUEUED: 4}


def test_event_hub_replay_then_live_without_gaps(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        store = SqliteStore(tmp_path / "db.sqlite")
        hub = EventHub(store)
        _job(store, hub, "j", "")
        for _ in range(3):
            ev = hub.next_event("j")
            ev.log.text = "x"
            hub.publish(ev)
        seen: list[int] = []

        async def watch() -> None:
            async for ev in hub.watch("j", 1):
                seen.append(ev.sequence)
                await asyncio.sleep(0)  # let the publisher run between replayed events

        task = asyncio.create_task(watch())
        for _ in range(5):
            await asyncio.sleep(0)
            ev = hub.next_event("j")
            ev.log.text = "y"
            hub.publish(ev)
        ev = hub.next_event("j")
        ev.finished.job_id = "j"
        hub.publish(ev)
        await asyncio.wait_for(task, 5)
        return seen

    assert asyncio.run(scenario()) == list(range(2, 11))

    async def after_the_end() -> list[int]:
        store = SqliteStore(tmp_path / "db.sqlite")
        hub = EventHub(store)
        job = store.get("j")
        assert job is not None
        job.state = job_pb2.JOB_STATE_DONE
        store.update(job)
        # Re-attaching after the last event ends at once instead of waiting forever.
        return [ev.sequence async for ev in hub.watch("j", 10)]

    assert asyncio.run(asyncio.wait_for(after_the_end(), 5)) == []


def test_ops_log_replay_and_live() -> None:
    async def scenario() -> list[int]:
        log = OpsLog(keep=3)
        for _ in range(5):
            log.emit(-1, warning="w")
        out: list[int] = []

        async def watch() -> None:
            async for ev in log.watch(2):
                out.append(ev.sequence)
                if ev.sequence == 6:
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0)
        log.emit(0, warning="live")
        await asyncio.wait_for(task, 5)
        return out

    assert asyncio.run(scenario()) == [4, 5, 6]
