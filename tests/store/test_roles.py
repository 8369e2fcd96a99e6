"""Roles on one PostgreSQL store: a gateway and nodes (issue 18's proof, on the CPU).

One gateway (the API, no devices) and three nodes (each a real watchdog, CPU "device", the
fake engine of tests/frontend) share a real PostgreSQL server. 300 jobs go through RunBatch on
the gateway; one node is killed with SIGKILL while it runs a job, and another node starts.
Every job ends exactly once with its verdict, the dead node's running job runs again
(attempt 2) elsewhere, and Watch on the gateway replays every phase of jobs run on every node.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import psycopg
import pytest
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval.v1 import operations_service_pb2 as ops
from kerneleval.v1 import operations_service_pb2_grpc as ops_grpc
from pg_server import PostgresServer

FRONTEND = Path(__file__).resolve().parents[1] / "frontend"
TOKEN = "ket_roles-test-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
JOBS = 300
LEASE_S = 2.0
PHASES = {job_pb2.PHASE_COMPILING, job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING}


def _spec(i: int) -> object:
    import sys

    sys.path.insert(0, str(FRONTEND))
    import fe_kernels as k

    return k.spec(json.dumps({"do": "time", "seconds": 0.05, "n": i}), client_tag=f"c{i % 3}")


def k_spec(cmd: dict[str, object]) -> object:
    import sys

    sys.path.insert(0, str(FRONTEND))
    import fe_kernels as k

    return k.spec(json.dumps(cmd))


class Cluster:
    def __init__(self, root: Path, url: str) -> None:
        self.root, self.url = root, url
        self.nodes: list[ServiceProcess] = []
        self.gateway = ServiceProcess(
            root / "gateway",
            ["--role", "gateway", "--store", url, "--admin-token", TOKEN, "--nvml", "none"],
        )

    def add_node(self) -> ServiceProcess:
        node = ServiceProcess(
            self.root / f"node{len(self.nodes)}",
            [
                "--role", "node", "--store", url_of(self), "--admin-token", TOKEN,
                "--nvml", "none", "--engine", "fe_fake_engine",
                "--lease-seconds", str(LEASE_S), "--workers-per-device", "2",
                "--spare-count", "2",
            ],
            env={"PYTHONPATH": os.pathsep.join([str(FRONTEND), os.environ.get("PYTHONPATH", "")])},
        )  # fmt: skip
        self.nodes.append(node)
        return node

    def stop(self) -> None:
        for service in [self.gateway, *self.nodes]:
            service.stop(timeout=20)


def url_of(cluster: Cluster) -> str:
    return cluster.url


@pytest.fixture
def cluster(tmp_path: Path, postgres: PostgresServer) -> Iterator[Cluster]:
    c = Cluster(tmp_path, postgres.new_database())
    try:
        yield c
    finally:
        c.stop()


def _started_on(node: ServiceProcess) -> set[str]:
    """Jobs the node's log says it started."""
    text = node.log_path.read_text(errors="replace")
    return {
        m.group(1)
        for line in text.splitlines()
        if "job started" in line
        for m in [re.search(r'"job_id": "([0-9a-f]+)"', line)]
        if m
    }


def _running_on(url: str, node: ServiceProcess) -> set[str]:
    """Jobs RUNNING in the store under the node's lease (the node as it registered)."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT job_id FROM jobs WHERE state = %s AND lease_node IN"
            " (SELECT node_id FROM nodes WHERE address = %s)",
            (job_pb2.JOB_STATE_RUNNING, node.address),
        ).fetchall()
    return {str(r[0]) for r in rows}


def test_a_gateway_and_nodes_survive_a_node_killed_mid_batch(cluster: Cluster) -> None:
    began = time.monotonic()
    cluster.gateway.start()
    for _ in range(3):
        cluster.add_node().start()
    victim = cluster.nodes[0]

    requests: queue.Queue[pb.RunBatchRequest | None] = queue.Queue()
    for i in range(JOBS):
        requests.put(pb.RunBatchRequest(spec=_spec(i), request_tag=str(i)))  # type: ignore[arg-type]
    requests.put(None)
    events: dict[str, list[job_pb2.JobEvent]] = defaultdict(list)
    errors: list[object] = []
    finished_count = [0]

    def stream() -> Iterator[pb.RunBatchRequest]:
        while (item := requests.get()) is not None:
            yield item

    def run_batch() -> None:
        with cluster.gateway.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            try:
                for resp in stub.RunBatch(stream(), timeout=300):
                    if resp.HasField("error"):
                        errors.append(resp.error)
                        continue
                    events[resp.request_tag].append(resp.event)
                    if resp.event.HasField("finished"):
                        finished_count[0] += 1
            except grpc.RpcError as exc:
                errors.append(exc)

    batch = threading.Thread(target=run_batch)
    batch.start()
    # Kill the first node (SIGKILL: no shutdown, its watchdog and job processes go with it)
    # while one of its job processes runs a job, a third of the way in; a new node joins.
    deadline = time.monotonic() + 90
    while finished_count[0] < JOBS // 5 or not _running_on(cluster.url, victim):
        assert time.monotonic() < deadline, "the first node never ran a job"
        time.sleep(0.01)
    victim.kill()
    killed_at = time.monotonic()
    killed_jobs = _running_on(cluster.url, victim)  # what it ran when it died
    assert killed_jobs
    cluster.add_node().start()
    batch.join(240)
    assert not batch.is_alive(), "RunBatch did not end"
    assert not errors, errors[:3]

    # Every job: one finished event, DONE with VERDICT_OK, sequences without gaps or repeats.
    assert len(events) == JOBS
    job_ids: dict[str, str] = {}
    for tag, evs in events.items():
        ends = [e for e in evs if e.HasField("finished")]
        assert len(ends) == 1, (tag, evs)
        job = ends[0].finished
        assert job.state == job_pb2.JOB_STATE_DONE and job.result.verdict == job_pb2.VERDICT_OK, job
        job_ids[tag] = job.job_id
    assert len(set(job_ids.values())) == JOBS

    # The job the dead node ran ran again elsewhere: attempt 2, a fault saying why.
    with cluster.gateway.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        for killed_job in killed_jobs:
            retried = stub.GetJob(pb.GetJobRequest(job_id=killed_job), timeout=10).job
            assert retried.attempt_count == 2 and retried.result.verdict == job_pb2.VERDICT_OK
            replay = [r.event for r in stub.Watch(pb.WatchRequest(job_id=killed_job), timeout=30)]
            assert any("lease expired" in e.fault.description for e in replay), replay
            starts = [e for e in replay if e.HasField("started")]
            assert [e.started.attempt for e in starts] == [1, 2]
            # Picked up again within the lease and a heartbeat of the death.
            picked_up = starts[1].time.ToNanoseconds() / 1e9 - starts[0].time.ToNanoseconds() / 1e9
            assert picked_up < LEASE_S * 3 + 5, picked_up

        # Watch on the gateway replays every phase of jobs that ran on every node.
        per_node = [_started_on(n) for n in cluster.nodes]
        assert all(per_node), [len(s) for s in per_node]
        assert killed_jobs <= per_node[0]
        for ran_here in per_node:
            for job_id in sorted(ran_here)[:10]:
                replay = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=30)]
                assert [e.sequence for e in replay] == list(range(1, len(replay) + 1))
                assert replay[0].HasField("queued") and replay[-1].HasField("finished")
                assert {e.phase.phase for e in replay if e.HasField("phase")} >= PHASES, replay
        # ListJobs on the gateway sees them all, done.
        listed = stub.ListJobs(
            pb.ListJobsRequest(state=job_pb2.JOB_STATE_DONE, page_size=1000), timeout=10
        ).jobs
        assert {j.job_id for j in listed} >= set(job_ids.values())
        # The gateway lists the nodes' devices, each with its node.
        gw_ops = ops_grpc.OperationsServiceStub(ch)
        devices = gw_ops.ListDevices(ops.ListDevicesRequest(), metadata=AUTH)
        assert {d.node for d in devices.devices} >= {n.address for n in cluster.nodes[1:]}
        # ResetGpu and RestartWorkers go to the node that owns the device: which one, when
        # several have it, is the caller's to say (every node here has the CPU device, -1).
        with pytest.raises(grpc.RpcError) as err:
            gw_ops.RestartWorkers(ops.RestartWorkersRequest(device_index=-1), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert all(n.address in err.value.details() for n in cluster.nodes[1:])
        node = cluster.nodes[1].address
        restarted = gw_ops.RestartWorkers(
            ops.RestartWorkersRequest(device_index=-1, node=node), metadata=AUTH
        )
        assert restarted.restarted_count >= 1  # the node's own answer
        with pytest.raises(grpc.RpcError) as err:  # the node's own refusal, named
            gw_ops.ResetGpu(ops.ResetGpuRequest(device_index=-1, node=node), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"node {node}: device_index: -1 is not a GPU")
        with pytest.raises(grpc.RpcError) as err:  # hostile: only a node that owns it
            gw_ops.RestartWorkers(
                ops.RestartWorkersRequest(device_index=-1, node="127.0.0.1:1"), metadata=AUTH
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # never dialled
        assert "127.0.0.1:1" not in err.value.details().split("one of ", 1)[-1]
        with pytest.raises(grpc.RpcError) as err:  # a wrong token is refused at the gateway
            gw_ops.RestartWorkers(
                ops.RestartWorkersRequest(node=node),
                metadata=[("authorization", "Bearer wrong")],
            )
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            gw_ops.ResetGpu(ops.ResetGpuRequest(device_index=0), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND  # no node has a GPU 0
        # Evaluate answers from the gateway; CancelJob from the gateway stops a job a node
        # runs (the node hears the request through the store).
        done = stub.Evaluate(pb.EvaluateRequest(spec=_spec(JOBS)), timeout=60).job  # type: ignore[arg-type]
        assert done.result.verdict == job_pb2.VERDICT_OK
        slow = k_spec({"do": "time", "seconds": 60})
        long_job = stub.Submit(pb.SubmitRequest(spec=slow), timeout=10).job  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while stub.GetJob(pb.GetJobRequest(job_id=long_job.job_id)).job.state != (
            job_pb2.JOB_STATE_RUNNING
        ):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=long_job.job_id), timeout=30).job
        assert cancelled.state == job_pb2.JOB_STATE_CANCELLED, cancelled
    print(
        f"\n{JOBS} jobs on a gateway and 3+1 nodes in {time.monotonic() - began:.1f} s; "
        f"node killed at {killed_at - began:.1f} s"
    )


def test_gateway_and_node_need_a_postgresql_store(capsys: pytest.CaptureFixture[str]) -> None:
    from kerneleval_server import main

    for role in ("gateway", "node"):
        with pytest.raises(SystemExit) as stop:
            main.main(["serve", "--role", role, "--state-dir", "/nonexistent"])
        assert stop.value.code == 2
        assert f"--role {role} needs --store postgresql://" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main.main(["serve", "--role", "compiler"])
    assert "--role 'compiler': one of all, gateway, node, builder" in capsys.readouterr().err


def test_a_client_reattaches_with_watch_after_its_gateway_restarts(cluster: Cluster) -> None:
    """The gateway dies (SIGKILL) in the middle of a RunBatch whose jobs are kept on
    disconnect; the node runs them meanwhile; the restarted gateway's Watch, from the last
    sequence the client saw, gives each job's remaining events, without gaps, to its end."""
    cluster.gateway.start()
    cluster.add_node().start()
    seen: dict[str, list[job_pb2.JobEvent]] = defaultdict(list)
    count = 60

    def stream() -> Iterator[pb.RunBatchRequest]:
        for i in range(count):
            spec = k_spec({"do": "time", "seconds": 0.1, "n": i})
            yield pb.RunBatchRequest(spec=spec, request_tag=str(i), keep_on_disconnect=True)  # type: ignore[arg-type]

    with cluster.gateway.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        finished = 0
        with pytest.raises(grpc.RpcError):
            for resp in stub.RunBatch(stream(), timeout=120):
                seen[resp.event.job_id].append(resp.event)
                finished += resp.event.HasField("finished")
                if finished == 10:
                    cluster.gateway.kill()
    cluster.gateway.start()
    with cluster.gateway.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        listed = stub.ListJobs(pb.ListJobsRequest(page_size=1000), timeout=10).jobs
        # Every job the gateway took before it died is kept (all of them, unless it died
        # while still reading the stream), and every job the client heard of.
        assert {j.job_id for j in listed} >= set(seen) and len(listed) <= count
        for job in listed:
            before = seen.get(job.job_id, [])
            last = before[-1].sequence if before else 0
            if before and before[-1].HasField("finished"):
                continue
            rest = [
                r.event
                for r in stub.Watch(
                    pb.WatchRequest(job_id=job.job_id, after_sequence=last), timeout=60
                )
            ]
            whole = before + rest
            assert [e.sequence for e in whole] == list(range(1, len(whole) + 1))
            assert whole[-1].HasField("finished")
            assert whole[-1].finished.result.verdict == job_pb2.VERDICT_OK


def test_tenants_quotas_hold_on_a_gateway_and_a_node(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    """Issue 45's quotas where the queue is the store's: a gateway refuses a tenant's Submit
    past --tenant-max-queued and --tenant-max-per-minute counting the store's jobs (one alice
    submitted through the node itself counts on the gateway), and a node with two free job
    slots takes only one of a tenant's jobs at --tenant-max-running 1, while another tenant's
    job takes the other; the tenant's next job starts once its running one ends."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status
    from kerneleval_server.api import tenants as t

    url = postgres.new_database()
    tokens, lines = {}, []
    for name in ("alice", "bob"):
        tokens[name], line = t.new_token(name)
        lines.append(line)
    path = tmp_path / "tenants"
    path.write_text("\n".join(lines) + "\n")
    common = ["--store", url, "--admin-token", TOKEN, "--nvml", "none", "--tenants-file", str(path)]
    gateway = ServiceProcess(
        tmp_path / "gateway",
        ["--role", "gateway", *common, "--tenant-max-queued", "2", "--tenant-max-per-minute", "4"],
    )
    node = ServiceProcess(
        tmp_path / "node",
        [
            "--role", "node", *common, "--engine", "fe_fake_engine",
            "--lease-seconds", str(LEASE_S), "--workers-per-device", "2", "--spare-count", "2",
            "--tenant-max-running", "1",
        ],
        env={"PYTHONPATH": os.pathsep.join([str(FRONTEND), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    try:
        gateway.start()
        node.start()
        with gateway.channel() as gch, node.channel() as nch:
            via_gateway = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(gch)
            via_node = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(nch)

            def md(name: str) -> list[tuple[str, str]]:
                return [("authorization", f"Bearer {tokens[name]}")]

            def submit(name: str, n: str, stub: object = via_gateway) -> str:
                spec = k_spec({"do": "time", "seconds": 60, "n": n})
                reply = stub.Submit(pb.SubmitRequest(spec=spec), metadata=md(name), timeout=30)  # type: ignore[attr-defined]
                return str(reply.job.job_id)

            def state(name: str, job_id: str) -> int:
                req = pb.GetJobRequest(job_id=job_id)
                return int(via_gateway.GetJob(req, metadata=md(name), timeout=10).job.state)

            def wait_state(name: str, job_id: str, want: int) -> None:
                deadline = time.monotonic() + 60
                while state(name, job_id) != want:
                    assert time.monotonic() < deadline, (job_id, state(name, job_id))
                    time.sleep(0.05)

            def refused(name: str, n: str) -> grpc.RpcError:
                with pytest.raises(grpc.RpcError) as err:
                    submit(name, n)
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
                status = rpc_status.from_call(err.value)
                assert status is not None
                assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
                return err.value

            a0 = submit("alice", "a0", via_node)  # through the node: the store has it
            wait_state("alice", a0, job_pb2.JOB_STATE_RUNNING)
            a1 = submit("alice", "a1")
            time.sleep(2 * LEASE_S)  # the node has a free slot, and claims every second
            assert state("alice", a1) == job_pb2.JOB_STATE_QUEUED
            with psycopg.connect(url) as conn:
                row = conn.execute("SELECT lease_node FROM jobs WHERE job_id = %s", (a1,))
                assert row.fetchone() == (None,)  # left in the store, for any node
            b0 = submit("bob", "b0")
            wait_state("bob", b0, job_pb2.JOB_STATE_RUNNING)  # the free slot is bob's
            assert state("alice", a1) == job_pb2.JOB_STATE_QUEUED
            a2 = submit("alice", "a2")  # her second queued job: within --tenant-max-queued 2
            err = refused("alice", "a3")
            assert "tenant 'alice' has 2 jobs queued" in (err.details() or ""), err
            # Her running job ends: the node takes her next.
            via_gateway.CancelJob(pb.CancelJobRequest(job_id=a0), metadata=md("alice"), timeout=30)
            wait_state("alice", a1, job_pb2.JOB_STATE_RUNNING)
            assert state("alice", a2) == job_pb2.JOB_STATE_QUEUED
            a4 = submit("alice", "a4")  # room in her queue again; her fourth this minute
            # a0 (through the node), a1, a2, a4 in the last minute (a3, refused, is not one):
            # her fifth is refused; bob's minute is his own.
            err = refused("alice", "a5")
            assert "submitted 4 jobs in the last 60 s" in (err.details() or ""), err
            b1 = submit("bob", "b1")
            jobs = (("alice", a1), ("alice", a2), ("alice", a4), ("bob", b0), ("bob", b1))
            for name, job_id in jobs:
                req = pb.CancelJobRequest(job_id=job_id)
                via_gateway.CancelJob(req, metadata=md(name), timeout=30)
    finally:
        for service in (gateway, node):
            service.stop(timeout=20)
