"""The service on a real PostgreSQL job store: jobs, their events and a restart."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from ke_service import ServiceProcess
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from pg_server import PostgresServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontend"))
import fe_kernels as k  # noqa: E402


def test_jobs_and_events_live_in_postgresql_across_a_restart(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    url = postgres.new_database()
    svc = ServiceProcess(tmp_path / "state", ["--nvml", "none", "--store", url])
    svc.start()
    try:
        with svc.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            job = stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), timeout=120).job
            queued = stub.Submit(pb.SubmitRequest(spec=k.spec(k.HANG, timeout_s=60)), timeout=30)
        assert job.result.verdict == job_pb2.VERDICT_OK, job
        # A second service on the same database is refused: it would re-run the first's jobs.
        second = ServiceProcess(tmp_path / "state2", ["--nvml", "none", "--store", url])
        with pytest.raises(RuntimeError, match="another kerneleval front end uses this database"):
            second.start(timeout=60)
        second.stop()
        svc.kill()  # SIGKILL: the hanging job is RUNNING in the store
        assert not (tmp_path / "state" / "jobs.db").exists()  # nothing went to SQLite
        svc.start()
        with svc.channel() as ch:
            stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
            again = stub.GetJob(pb.GetJobRequest(job_id=job.job_id)).job
            assert again.result == job.result and again.spec.kernel.source_code == k.GOOD
            events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job.job_id), timeout=30)]
            kinds = [e.WhichOneof("kind") for e in events]
            assert kinds[0] == "queued" and kinds[-1] == "finished" and "started" in kinds
            assert [e.sequence for e in events] == sorted(e.sequence for e in events)
            listed = stub.ListJobs(pb.ListJobsRequest(), timeout=10).jobs
            assert {j.job_id for j in listed} >= {job.job_id, queued.job.job_id}
            # The job that was running when the service died runs again (or is cancelled
            # here, so that the test does not wait for its hang): it is not lost.
            cancelled = stub.CancelJob(
                pb.CancelJobRequest(job_id=queued.job.job_id), timeout=60
            ).job
            assert cancelled.state == job_pb2.JOB_STATE_CANCELLED, cancelled
            assert cancelled.attempt_count >= 1
    finally:
        svc.stop()
