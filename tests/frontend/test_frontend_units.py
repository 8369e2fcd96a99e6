"""The front end's parts alone: scheduler, store, event fan-out, fault mapping, config."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

import pytest
from kerneleval.internal.v1 import watchdog_pb2
from kerneleval.v1 import job_pb2
from kerneleval_server import config as config_mod
from kerneleval_server.fleet import faults
from kerneleval_server.jobs.events import EventHub, OpsLog
from kerneleval_server.jobs.scheduler import FairQueue, GpuGate, QueuedJob
from kerneleval_server.jobs.store import SqliteStore


def test_fair_queue_round_robin_and_devices() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(QueuedJob(f"a{i}", "alice", None))
    q.push(QueuedJob("b0", "bob", None))
    q.push(QueuedJob("b1", "bob", 1))
    q.push(QueuedJob("c0", "carol", None))
    order = []
    while (j := q.pop_for(0)) is not None:
        order.append(j.job_id)
    # Clients take turns; the job pinned to device 1 waits for that device.
    assert order == ["a0", "b0", "c0", "a1", "a2"]
    assert "b1" in q and len(q) == 1
    popped = q.pop_for(1)
    assert popped is not None and popped.job_id == "b1"
    q.push(QueuedJob("x", "t", None))
    assert q.remove("x") and not q.remove("x") and len(q) == 0


def test_gpu_gate_checks_share_a_window_is_alone_per_device() -> None:
    granted: list[tuple[str, bool]] = []
    gate = GpuGate(lambda w, x: granted.append((w, x)))
    gate.request(0, "c1", False)
    gate.request(0, "c2", False)  # checks share the GPU
    gate.request(1, "t9", True)  # another device: independent
    assert granted == [("c1", False), ("c2", False), ("t9", True)]
    gate.request(0, "t1", True)  # a window waits for the checks that hold the GPU
    gate.request(0, "c3", False)  # a check that asks after a waiting window waits behind it
    assert gate.holders(0) == (None, {"c1", "c2"}) and len(granted) == 3
    gate.release(0, "c1")
    assert len(granted) == 3  # c2 still checks
    gate.request(0, "c2", True)  # c2 goes on to time: gives its share back, queues after t1
    assert granted[3:] == [("t1", True)] and gate.holders(0) == ("t1", set())
    gate.release(0, "t1")
    # In order of request: c3 (asked before c2's window), then c2's window once c3 is done.
    assert granted[4:] == [("c3", False)]
    gate.release(0, "c3")
    assert granted[5:] == [("c2", True)]
    gate.request(0, "c4", False)
    gate.release(0, "c4")  # a waiter that leaves is dropped
    gate.release(0, "c2")
    assert gate.holders(0) == (None, set()) and granted[6:] == []


def test_gpu_gate_counts_the_time_windows_are_held() -> None:
    now = [100.0]
    ended: list[tuple[int, str, float]] = []
    gate = GpuGate(lambda w, x: None, on_window=lambda d, w, s: ended.append((d, w, s)),
                   clock=lambda: now[0])  # fmt: skip
    gate.request(0, "c", False)
    now[0] += 5.0  # checks are no window
    gate.request(0, "t1", True)  # waits for the check
    now[0] += 1.0
    gate.release(0, "c")  # t1's window opens at 106
    now[0] += 2.0
    gate.release(0, "t1")
    gate.request(0, "t2", True)
    gate.request(1, "u", True)
    now[0] += 0.5
    assert ended == [(0, "t1", 2.0)]
    # the windows held now count too: 2 + 0.5 on device 0, 0.5 on device 1; a window was
    # wanted on device 0 from t1's request at 105 (it waited 1 s for the check) on
    assert gate.occupancy() == {0: (2.5, 2, 3.5), 1: (0.5, 1, 0.5)}


def test_gpu_gate_devices_on_the_hosts_cpu_time_one_at_a_time() -> None:
    """Issue 41: devices whose job processes see no GPU (fake-NVML devices on a CPU host) time
    on the same cores: one window at a time on the host, its end told for its own device;
    a device with a GPU stays independent."""
    granted: list[tuple[str, bool]] = []
    ended: list[tuple[int, str]] = []
    gate = GpuGate(
        lambda w, x: granted.append((w, x)), on_window=lambda d, w, s: ended.append((d, w))
    )
    for device in (0, 1):
        gate.share_host(device)
    assert gate.on_host(0) and gate.on_host(1) and not gate.on_host(2)
    gate.request(0, "a", True)
    gate.request(1, "b", True)  # another device of the host: waits for a's window
    gate.request(2, "g", True)  # a device with a GPU: independent
    assert granted == [("a", True), ("g", True)]
    assert gate.holders(1) == ("a", set())
    gate.release(0, "a")
    assert granted[2:] == [("b", True)] and ended == [(0, "a")]
    gate.request(0, "c", False)  # a check on the host waits for the window too
    assert len(granted) == 3
    gate.release(1, "b")
    assert granted[3:] == [("c", False)] and ended[1:] == [(1, "b")]
    # A device whose own gate is in use joins the host's gate once it is idle.
    gate.request(3, "d", True)
    gate.share_host(3)
    assert not gate.on_host(3)
    gate.release(3, "d")
    gate.share_host(3)
    assert gate.on_host(3)


def test_gpu_gate_is_fair_to_windows_under_a_stream_of_checks() -> None:
    """Checks that keep coming never starve a window, and windows never starve checks."""
    granted: list[str] = []
    gate = GpuGate(lambda w, x: granted.append(w))
    gate.request(0, "c0", False)
    gate.request(0, "t0", True)
    for i in range(1, 4):
        gate.request(0, f"c{i}", False)
    gate.request(0, "t1", True)
    gate.request(0, "c4", False)
    for holder in ("c0", "t0", "c1", "c2", "c3", "t1", "c4"):
        gate.release(0, holder)
    assert granted == ["c0", "t0", "c1", "c2", "c3", "t1", "c4"]


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


def _exited(sig: int = 0, code: int = 0, reason: str = "crashed") -> watchdog_pb2.WorkerExited:
    ex = watchdog_pb2.WorkerExited(exit_code=code if not sig else -1, signal=sig, reason=reason)
    ex.worker.worker_id, ex.worker.pid, ex.restarting = "d0-w1", 1234, True
    return ex


@pytest.mark.parametrize(
    ("exited", "pending", "xid", "verdict"),
    [
        (_exited(sig=signal.SIGSEGV), "", None, job_pb2.VERDICT_CRASHED),
        (_exited(code=3, reason="exited"), "", None, job_pb2.VERDICT_CRASHED),
        (
            _exited(sig=signal.SIGKILL, reason="killed:timeout"),
            "timeout",
            None,
            job_pb2.VERDICT_TIMEOUT,
        ),
        (
            _exited(sig=signal.SIGKILL),
            "",
            faults.XidSeen(31, "application", ""),
            job_pb2.VERDICT_DEVICE_FAULT,
        ),
        (_exited(sig=signal.SIGKILL, reason="crashed"), "", None, job_pb2.VERDICT_UNSPECIFIED),
        (_exited(sig=signal.SIGTERM, reason="reset"), "", None, job_pb2.VERDICT_UNSPECIFIED),
        (_exited(sig=signal.SIGKILL, reason="xid"), "", None, job_pb2.VERDICT_DEVICE_FAULT),
    ],
)
def test_classify_exit(
    exited: watchdog_pb2.WorkerExited, pending: str, xid: faults.XidSeen | None, verdict: int
) -> None:
    d = faults.classify_exit(
        exited, pending=pending, xid=xid, phase=job_pb2.PHASE_VALIDATING, timeout_s=5
    )
    assert d.verdict == verdict
    assert d.fault.worker_pid == 1234 and d.fault.description
    if exited.signal:
        assert d.fault.signal == exited.signal and not d.fault.HasField("exit_code")
    else:
        assert d.fault.exit_code == exited.exit_code
    if xid is not None:
        assert d.fault.xid == 31 and d.fault.xid_category == "application"


def test_config_flags_over_env_over_defaults() -> None:
    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    env = {
        "KERNELEVAL_PORT": "6000",
        "KERNELEVAL_WARM_SPARE": "false",
        "KERNELEVAL_HOST": "0.0.0.0",
    }
    cfg = config_mod.from_args(parser.parse_args(["--port", "7000"]), env)
    assert cfg.port == 7000 and cfg.warm_spare is False and cfg.host == "0.0.0.0"
    assert cfg.workers_per_device == 1 and cfg.database_path().name == "jobs.db"
    cfg = config_mod.from_args(parser.parse_args([]), {"XDG_STATE_HOME": "/x"})
    assert cfg.port == 50051 and cfg.host == "127.0.0.1"
    assert cfg.device_list() == [] and cfg.effective_xid_wait_s() == 2.5


def test_config_problems_are_reported() -> None:
    assert config_mod.Config().problems() == []
    bad = config_mod.Config(
        nvml="fake", tls_cert="c", port=70000, workers_per_device=0, devices="a",
        isolate_network=False, compile_cache_mib=-1, build_nice=20, reference_time_reuse_s=-1,
    )  # fmt: skip
    text = " ".join(bad.problems())
    for flag in (
        "--fake-nvml-path", "--tls-key", "--port", "--workers-per-device", "--devices",
        "--isolate-network false", "--compile-cache-mib", "--build-nice",
        "--reference-time-reuse-s",
    ):  # fmt: skip
        assert flag in text


def test_job_sandbox_flags() -> None:
    parser = argparse.ArgumentParser()
    config_mod.add_arguments(parser)
    ns = parser.parse_args(
        ["--worker-user", "alice", "--sandbox-path", "/a,/b", "--sandbox-path", "/c"]
    )
    cfg = config_mod.from_args(ns, {})
    assert cfg.job_user == "alice"  # --worker-user is the old spelling of --job-user
    assert cfg.sandbox_paths() == ["/a", "/b", "/c"]
    cfg = config_mod.from_args(parser.parse_args([]), {"KERNELEVAL_WORKER_USER": "bob"})
    assert cfg.job_user == "bob" and cfg.spare_count == 3 and cfg.job_memory_mib == 0  # auto
    bad = config_mod.Config(job_user="root", sandbox_path="rel", job_max_pids=0).problems()
    text = " ".join(bad)
    assert "--job-user" in text and "--sandbox-path" in text and "--job-max-pids" in text


def test_interceptor_counts_codes_and_turns_bugs_into_internal() -> None:
    import types

    import grpc
    from kerneleval_server.metrics import Metrics, MetricsInterceptor

    class Context:
        def __init__(self) -> None:
            self.aborted: tuple[grpc.StatusCode, str] | None = None

        def code(self) -> None:
            return None

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            self.aborted = (code, details)
            raise grpc.aio.AbortError()

    async def ok(request: object, context: object) -> str:
        return "fine"

    async def buggy(request: object, context: object) -> str:
        raise ValueError("oops")

    async def scenario() -> Context:
        m = Metrics()
        icpt = MetricsInterceptor(m)
        results = []
        for fn, name in ((ok, "/svc.S/Ok"), (buggy, "/svc.S/Buggy")):
            details: Any = types.SimpleNamespace(method=name, invocation_metadata=())
            handler = grpc.unary_unary_rpc_method_handler(fn)

            async def cont(_: object, h: grpc.RpcMethodHandler = handler) -> grpc.RpcMethodHandler:
                return h

            wrapped = await icpt.intercept_service(cont, details)
            ctx = Context()
            try:
                results.append(await wrapped.unary_unary(None, ctx))
            except grpc.aio.AbortError:
                results.append(ctx)
        assert results[0] == "fine"
        text = m.handled.labels("svc.S", "Ok", "OK")._value.get()  # type: ignore[attr-defined]
        assert text == 1
        assert m.handled.labels("svc.S", "Buggy", "INTERNAL")._value.get() == 1  # type: ignore[attr-defined]
        assert isinstance(results[1], Context)
        return results[1]

    ctx = asyncio.run(scenario())
    assert ctx.aborted is not None and ctx.aborted[0] == grpc.StatusCode.INTERNAL
    assert "ValueError: oops" in ctx.aborted[1]


def test_a_generated_admin_token_never_reads_as_an_option(tmp_path: Path) -> None:
    # A bare token_urlsafe starts with "-" one time in 64: `--admin-token "$(cat ...)"` broke.
    from kerneleval_server.main import admin_token

    cfg = config_mod.Config()
    tokens = {admin_token(cfg, d) for d in (tmp_path / str(i) for i in range(8)) if not d.mkdir()}
    assert len(tokens) == 8 and all(t.startswith("ket_") and len(t) > 40 for t in tokens)
    assert admin_token(cfg, tmp_path / "0") in tokens  # read back, not made again
