"""Tenants end to end, hostile (issue 45): a real service with --tenants-file (the stand-in
watchdog of test_frontend_fake_watchdog.py: CPU only, no C++ build), real gRPC clients. Tenant
B tries every KernelEvalService call on tenant A's jobs, by id and by guessing; calls without a
token, with a wrong one and with one revoked (taken out of the file, then SIGHUP) are
UNAUTHENTICATED; the admin sees every job; a service without the file behaves as before."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import fe_kernels as k
import grpc
import pytest
from ke_service import ServiceProcess, free_port
from kerneleval import Client, errors
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc
from kerneleval.v1 import kernel_eval_service_pb2 as pb
from kerneleval_server.api import tenants as t

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.timeout(120)


def fake_watchdog_service(root: Path, *args: str) -> ServiceProcess:
    binary = root / "fake-watchdog"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {HERE / "fe_fake_watchdog.py"} "$@"\n')
    binary.chmod(0o755)
    return ServiceProcess(
        root / "state",
        [
            "--nvml", "none", "--watchdog", str(binary), "--workers-per-device", "2",
            "--result-cache-hours", "24",  # on, as by default (tests/conftest.py turns it off)
            *args,
        ],  # fmt: skip
        env={"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])},
    )


class Tenancy:
    def __init__(self, svc: ServiceProcess, path: Path, tokens: dict[str, str]) -> None:
        self.svc, self.path, self.tokens = svc, path, tokens

    def client(self, name: str) -> Client:
        return Client(self.svc.address, tenant_token=self.tokens[name], retry_timeout=0)

    def stub(self) -> kernel_eval_service_pb2_grpc.KernelEvalServiceStub:
        return kernel_eval_service_pb2_grpc.KernelEvalServiceStub(self.svc.channel())


@pytest.fixture(scope="module")
def ten(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tenancy]:
    root = tmp_path_factory.mktemp("tenants")
    tokens, lines = {}, []
    for name in ("alice", "bob", "carol"):
        tokens[name], line = t.new_token(name)
        lines.append(line)
    path = root / "tenants"
    path.write_text("\n".join(lines) + "\n")
    svc = fake_watchdog_service(root, "--tenants-file", str(path))
    try:
        svc.start()
        yield Tenancy(svc, path, tokens)
    finally:
        svc.stop()


def test_every_call_without_a_valid_token_is_unauthenticated(ten: Tenancy) -> None:
    stub = ten.stub()
    no_token = (
        lambda md: stub.ListJobs(pb.ListJobsRequest(), metadata=md, timeout=10),
        lambda md: stub.GetJob(pb.GetJobRequest(job_id="x"), metadata=md, timeout=10),
        lambda md: stub.CancelJob(pb.CancelJobRequest(job_id="x"), metadata=md, timeout=10),
        lambda md: stub.Submit(pb.SubmitRequest(spec=k.spec()), metadata=md, timeout=10),
        lambda md: stub.Evaluate(pb.EvaluateRequest(spec=k.spec()), metadata=md, timeout=10),
        lambda md: list(stub.Watch(pb.WatchRequest(job_id="x"), metadata=md, timeout=10)),
        lambda md: list(stub.Run(pb.RunRequest(spec=k.spec()), metadata=md, timeout=10)),
        lambda md: list(
            stub.RunBatch(iter([pb.RunBatchRequest(spec=k.spec())]), metadata=md, timeout=10)
        ),
    )
    for md in ((), (("authorization", "Bearer ket_guessed"),),
               (("authorization", f"Bearer {t.hash_token(ten.tokens['alice'])}"),)):  # fmt: skip
        for call in no_token:
            try:
                call(md)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAUTHENTICATED, (md, e)
                assert (t.MISSING if not md else t.WRONG) == e.details()
            else:
                raise AssertionError(f"{md}: the call succeeded")
    # Nothing was queued by the refused calls: the admin sees no job.
    with Client(ten.svc.address, admin_token=ten.svc.admin_token) as admin:
        assert [j.job_id for j in admin.list_jobs()] == []
    # The Python client says what to send.
    with Client(ten.svc.address, retry_timeout=0) as anon:
        with pytest.raises(errors.Unauthenticated, match="tenant token"):
            anon.get_job("x")


def test_tenant_b_cannot_see_watch_or_cancel_tenant_as_jobs(ten: Tenancy) -> None:
    with ten.client("alice") as alice, ten.client("bob") as bob:
        done = alice.evaluate(k.spec(client_tag="shared-tag"), labels={"team": "a"})
        assert done.result.verdict == job_pb2.VERDICT_OK and done.tenant == "alice"
        hang = alice.submit(k.spec("FE_HANG", timeout_s=60, client_tag="shared-tag"))
        wait_running(alice, hang.job_id)
        b_job = bob.evaluate(k.spec(client_tag="shared-tag"))
        assert b_job.tenant == "bob"

        # By id: every call on A's jobs is NOT_FOUND, as for an id no job has (same message).
        guessed = uuid.uuid4().hex
        for job_id in (done.job_id, hang.job_id, guessed):
            for call in (
                bob.get_job,
                bob.cancel_job,
                lambda i: list(bob.watch(i, reconnect=False)),
            ):
                with pytest.raises(errors.NotFound) as err:
                    call(job_id)
                assert str(err.value).endswith(f"no job {job_id!r}"), err.value
        # Listing: by tag, label, state or none, B sees its own job only.
        assert [j.job_id for j in bob.list_jobs()] == [b_job.job_id]
        assert [j.job_id for j in bob.list_jobs(client_tag="shared-tag")] == [b_job.job_id]
        assert list(bob.list_jobs(labels={"team": "a"})) == []
        assert list(bob.list_jobs(state=job_pb2.JOB_STATE_RUNNING)) == []
        assert {j.job_id for j in alice.list_jobs()} == {done.job_id, hang.job_id}
        # A's running job is untouched by B's cancel; A may cancel it.
        assert alice.get_job(hang.job_id).state == job_pb2.JOB_STATE_RUNNING
        assert alice.cancel_job(hang.job_id).state == job_pb2.JOB_STATE_CANCELLED


def test_no_tenant_gets_anothers_cached_or_shared_result_or_idempotent_job(
    ten: Tenancy,
) -> None:
    spec = k.spec(client_tag="cache", perf_trials=2)
    with ten.client("alice") as alice, ten.client("bob") as bob:
        first = alice.evaluate(spec)
        again = alice.evaluate(spec)
        assert again.result_origin == job_pb2.RESULT_ORIGIN_CACHE
        assert again.result_job_id == first.job_id  # the same tenant's cache works
        theirs = bob.evaluate(spec)
        assert theirs.result_origin == job_pb2.RESULT_ORIGIN_RUN and not theirs.result_job_id
        # The same idempotency key and client_tag: two tenants, two jobs.
        a = alice.submit(spec, idempotency_key="same-key")
        b = bob.submit(spec, idempotency_key="same-key")
        assert a.job_id != b.job_id and (a.tenant, b.tenant) == ("alice", "bob")
        assert alice.submit(spec, idempotency_key="same-key").job_id == a.job_id
        # An identical job in flight is joined within a tenant only: bob's runs beside alice's.
        hang = k.spec("FE_HANG", timeout_s=60, client_tag="inflight")
        a_hang = alice.submit(hang)
        wait_running(alice, a_hang.job_id)
        b_hang = bob.submit(hang)
        wait_running(bob, b_hang.job_id)  # not waiting for alice's result
        for who, job in ((alice, a_hang), (bob, b_hang)):
            assert who.cancel_job(job.job_id).state == job_pb2.JOB_STATE_CANCELLED


def wait_running(c: Client, job_id: str) -> None:
    deadline = time.monotonic() + 30
    while c.get_job(job_id).state != job_pb2.JOB_STATE_RUNNING:
        assert time.monotonic() < deadline, c.get_job(job_id)
        time.sleep(0.05)


def test_run_batch_streams_only_the_callers_jobs(ten: Tenancy) -> None:
    with ten.client("bob") as bob, ten.client("carol") as carol:
        carols = carol.submit(k.spec(client_tag="batch"))
        events = list(bob.run_batch([("x", k.spec(client_tag="batch")), ("y", k.spec())]))
        ids = {e.job_id for e in events if e.event is not None}
        assert len(ids) == 2 and carols.job_id not in ids
        assert all(bob.get_job(i).tenant == "bob" for i in ids)


def test_the_admin_sees_every_tenants_jobs(ten: Tenancy) -> None:
    with ten.client("alice") as alice:
        mine = alice.submit(k.spec(client_tag="admin-view"))
    with Client(ten.svc.address, admin_token=ten.svc.admin_token, retry_timeout=0) as admin:
        tenants = {j.tenant for j in admin.list_jobs()}
        assert {"alice", "bob", "carol"} <= tenants
        assert admin.get_job(mine.job_id).tenant == "alice"
        own = admin.evaluate(k.spec(client_tag="admin-view"))
        assert own.tenant == ""  # the admin's own jobs: the default tenant's
    with ten.client("alice") as alice:
        with pytest.raises(errors.NotFound):
            alice.get_job(own.job_id)


def test_a_revoked_token_is_refused_after_sighup(ten: Tenancy) -> None:
    with ten.client("carol") as carol:
        job = carol.evaluate(k.spec(client_tag="revoked"))
        lines = [ln for ln in ten.path.read_text().splitlines() if not ln.startswith("carol:")]
        ten.path.write_text("\n".join(lines) + "\n")
        assert ten.svc.proc is not None
        ten.svc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while True:
            try:
                carol.get_job(job.job_id)
            except errors.Unauthenticated as e:
                assert "revoked" in str(e)
                break
            assert time.monotonic() < deadline, "carol's token still works after SIGHUP"
            time.sleep(0.05)
    with ten.client("alice") as alice:  # the others' tokens still work
        assert list(alice.list_jobs(client_tag="revoked")) == []
    assert ten.svc.proc.poll() is None  # SIGHUP reloads, never stops the service


def test_without_a_tenants_file_everything_is_as_before(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    svc = fake_watchdog_service(tmp_path_factory.mktemp("no-tenants"))
    try:
        svc.start()
        with Client(svc.address, retry_timeout=0) as one, Client(
            svc.address, tenant_token="ket_ignored", retry_timeout=0
        ) as two:
            job = one.evaluate(k.spec(client_tag="x"))
            assert job.tenant == "" and job.result.verdict == job_pb2.VERDICT_OK
            # Anyone reaching the port reads and lists every job, as before.
            assert two.get_job(job.job_id).job_id == job.job_id
            assert [j.job_id for j in two.list_jobs()] == [job.job_id]
            # One cache for all: another caller's identical job takes the result.
            same = two.evaluate(k.spec(client_tag="y"))
            assert same.result_origin == job_pb2.RESULT_ORIGIN_CACHE
            assert same.result_job_id == job.job_id
    finally:
        svc.stop()


def test_http_json_forwards_the_token_and_scopes_the_same(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    pytest.importorskip("connectrpc", reason="connectrpc (Python >= 3.11) serves --http-port")
    root = tmp_path_factory.mktemp("tenants-http")
    tokens, lines = {}, []
    for name in ("alice", "bob"):
        tokens[name], line = t.new_token(name)
        lines.append(line)
    (root / "tenants").write_text("\n".join(lines) + "\n")
    http_port = free_port()
    svc = fake_watchdog_service(
        root, "--tenants-file", str(root / "tenants"), "--http-port", str(http_port)
    )

    def post(method: str, body: dict[str, object], token: str | None) -> tuple[int, object]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{http_port}/kerneleval.v1.KernelEvalService/{method}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"}
            | ({"Authorization": f"Bearer {token}"} if token else {}),
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    try:
        svc.start()
        with Client(svc.address, tenant_token=tokens["alice"], retry_timeout=0) as alice:
            job = alice.evaluate(k.spec(client_tag="http"))
        status, got = post("GetJob", {"jobId": job.job_id}, tokens["alice"])
        assert status == 200 and got["job"]["tenant"] == "alice", got  # type: ignore[index]
        status, got = post("GetJob", {"jobId": job.job_id}, tokens["bob"])
        assert (status, got["code"]) == (404, "not_found"), got  # type: ignore[index]
        status, got = post("ListJobs", {}, tokens["bob"])
        assert status == 200 and got == {}, got
        status, got = post("GetJob", {"jobId": job.job_id}, None)
        assert (status, got["code"]) == (401, "unauthenticated"), got  # type: ignore[index]
    finally:
        svc.stop()


def test_a_tenant_over_its_queue_quota_is_refused_while_another_is_taken(
    tmp_path: Path,
) -> None:
    """--tenant-max-queued: a tenant with that many jobs queued is refused the next one
    (RESOURCE_EXHAUSTED with a RetryInfo, as a full queue), while another tenant's job is
    still taken; its own job is taken again once one of its queued jobs has left."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    tokens, lines = {}, []
    for name in ("alice", "bob"):
        tokens[name], line = t.new_token(name)
        lines.append(line)
    path = tmp_path / "tenants"
    path.write_text("\n".join(lines) + "\n")
    svc = fake_watchdog_service(
        tmp_path, "--tenants-file", str(path), "--tenant-max-queued", "1",
    )  # fmt: skip
    svc.start()
    try:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())

        def submit(name: str, n: int) -> pb.SubmitResponse:
            # distinct sources: an identical job in flight would be joined, not queued
            s = k.spec(f"FE_HANG {name} {n}", client_tag=name, timeout_s=60)
            md = [("authorization", f"Bearer {tokens[name]}")]
            return stub.Submit(pb.SubmitRequest(spec=s), metadata=md, timeout=30)

        alice = Client(svc.address, tenant_token=tokens["alice"], retry_timeout=0)
        # Alice's jobs take the job process slots there are (each runs, hanging), until one
        # stays in the queue.
        wait_running(alice, submit("alice", 0).job.job_id)
        n = 1
        while True:
            queued = submit("alice", n)
            n += 1
            time.sleep(1.0)
            if alice.get_job(queued.job.job_id).state == job_pb2.JOB_STATE_QUEUED:
                break
            assert n < 5, "every job of alice's ran: no queue"
        with pytest.raises(grpc.RpcError) as err:
            submit("alice", n)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "tenant 'alice' has 1 jobs queued" in (err.value.details() or "")
        status = rpc_status.from_call(err.value)
        assert status is not None
        assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
        submit("bob", 0)  # another tenant's job is still taken
        alice.cancel_job(queued.job.job_id)
        submit("alice", n + 1)  # room again in alice's share
        alice.close()
    finally:
        svc.stop()


def _tenants_file(root: Path, names: tuple[str, ...]) -> tuple[Path, dict[str, str]]:
    tokens, lines = {}, []
    for name in names:
        tokens[name], line = t.new_token(name)
        lines.append(line)
    path = root / "tenants"
    path.write_text("\n".join(lines) + "\n")
    return path, tokens


def test_a_tenant_at_its_running_share_waits_queued_while_another_takes_the_free_slot(
    tmp_path: Path,
) -> None:
    """--tenant-max-running 1 on two job slots: alice's second job is not refused, but stays
    QUEUED while a slot is free; bob's job takes that slot and runs beside alice's first;
    alice's second starts once her first ends."""
    path, tokens = _tenants_file(tmp_path, ("alice", "bob"))
    svc = fake_watchdog_service(tmp_path, "--tenants-file", str(path), "--tenant-max-running", "1")
    svc.start()
    try:
        with Client(svc.address, tenant_token=tokens["alice"], retry_timeout=0) as alice, Client(
            svc.address, tenant_token=tokens["bob"], retry_timeout=0
        ) as bob:
            first = alice.submit(k.spec("FE_HANG alice 0", timeout_s=60, client_tag="a"))
            wait_running(alice, first.job_id)
            # Another client tag of hers: the share is the tenant's, whatever the tag.
            second = alice.submit(k.spec("FE_HANG alice 1", timeout_s=60, client_tag="b"))
            assert second.state == job_pb2.JOB_STATE_QUEUED  # taken, not refused
            time.sleep(2.0)  # a job process would have taken it by now
            assert alice.get_job(second.job_id).state == job_pb2.JOB_STATE_QUEUED
            theirs = bob.submit(k.spec("FE_HANG bob 0", timeout_s=60))
            wait_running(bob, theirs.job_id)  # the free slot goes to the other tenant
            assert alice.get_job(second.job_id).state == job_pb2.JOB_STATE_QUEUED
            assert alice.get_job(first.job_id).state == job_pb2.JOB_STATE_RUNNING
            # Her first ends: her second starts (bob's still holds the other slot).
            assert alice.cancel_job(first.job_id).state == job_pb2.JOB_STATE_CANCELLED
            wait_running(alice, second.job_id)
            for who, job in ((alice, second), (bob, theirs)):
                assert who.cancel_job(job.job_id).state == job_pb2.JOB_STATE_CANCELLED
    finally:
        svc.stop()


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kerneleval_tenant_") and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            if not series.split("{")[0].endswith("_created"):
                out[series] = float(value)
    return out


def test_a_tenant_past_its_submissions_a_minute_is_refused_and_counted_per_tenant(
    tmp_path: Path,
) -> None:
    """--tenant-max-per-minute 2: alice's third job in a minute is RESOURCE_EXHAUSTED with a
    RetryInfo of at most a minute (Submit, and an entry of her RunBatch), while bob's jobs are
    still taken. The metrics count each tenant's jobs submitted, finished and refused, with
    the names of the tenants file as labels, never a value from the requests."""
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    path, tokens = _tenants_file(tmp_path, ("alice", "bob"))
    metrics_port = free_port()
    svc = fake_watchdog_service(
        tmp_path, "--tenants-file", str(path), "--tenant-max-per-minute", "2",
        "--metrics-port", str(metrics_port),
    )  # fmt: skip
    svc.start()
    try:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(svc.channel())

        def submit(name: str, n: int) -> pb.SubmitResponse:
            # distinct sources (no cache answers); a tag and a label a hostile client chose
            s = k.spec(k.GOOD + f"\n# {name} {n}\n", client_tag="evil-tag-as-label")
            s.labels["tenant"] = "mallory"
            md = [("authorization", f"Bearer {tokens[name]}")]
            return stub.Submit(pb.SubmitRequest(spec=s), metadata=md, timeout=30)

        with Client(svc.address, tenant_token=tokens["alice"], retry_timeout=0) as alice:
            taken = [submit("alice", 0).job.job_id, submit("alice", 1).job.job_id]
            with pytest.raises(grpc.RpcError) as err:
                submit("alice", 2)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "--tenant-max-per-minute" in (err.value.details() or "")
            status = rpc_status.from_call(err.value)
            assert status is not None
            delays = [
                info.retry_delay.ToNanoseconds() / 1e9
                for d in status.details
                if d.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
                for info in [error_details_pb2.RetryInfo()]
                if d.Unpack(info)
            ]
            assert len(delays) == 1 and 0 < delays[0] <= 60, delays
            # RunBatch's entry is refused the same way; the stream goes on.
            events = list(alice.run_batch([("x", k.spec(k.GOOD + "\n# batch\n"))]))
            assert [e.error.code for e in events if e.error is not None] == [
                grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
            ]
            for i in range(2):  # bob's own minute is untouched by alice's
                submit("bob", i)
            for job_id in taken:
                deadline = time.monotonic() + 30
                while alice.get_job(job_id).state != job_pb2.JOB_STATE_DONE:
                    assert time.monotonic() < deadline, alice.get_job(job_id)
                    time.sleep(0.05)
        # Unauthenticated calls name no tenant: nothing of them becomes a label.
        with pytest.raises(grpc.RpcError):
            stub.Submit(
                pb.SubmitRequest(spec=k.spec()),
                metadata=[("authorization", "Bearer ket_mallory")],
                timeout=10,
            )
        deadline = time.monotonic() + 10
        while True:
            got = _metrics(metrics_port)
            done = got.get(
                'kerneleval_tenant_jobs_finished_total{state="DONE",tenant="alice"}', 0
            )
            if done == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert got['kerneleval_tenant_jobs_submitted_total{tenant="alice"}'] == 2, got
        assert got['kerneleval_tenant_jobs_submitted_total{tenant="bob"}'] == 2, got
        assert got[
            'kerneleval_tenant_jobs_rejected_total{quota="per_minute",tenant="alice"}'
        ] == 2, got  # fmt: skip
        assert done == 2, got
        tenants = {s.split('tenant="')[1].split('"')[0] for s in got}
        assert tenants == {"alice", "bob"}, got
    finally:
        svc.stop()


def test_mcp_reaches_a_tenants_service_with_its_token_and_says_what_is_wrong_without(
    ten: Tenancy,
) -> None:
    """`kerneleval --tenant-token ... mcp` through the official MCP SDK's client, over stdio:
    its tools run as the tenant (an evaluation is alice's job; her job is hers to read, not
    bob's: NOT_FOUND); without a token, or with a wrong one, every tool call is a tool error
    that says what to send, and nothing was submitted."""
    pytest.importorskip("mcp")  # the client's [mcp] extra (make installs it)
    import asyncio

    from mcp import Client as McpClient
    from mcp import StdioServerParameters

    kerneleval = Path(sys.executable).parent / "kerneleval"
    if not kerneleval.exists():
        pytest.skip("no kerneleval command in this environment")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELEVAL_")}

    def tools(token: str | None, calls: list[tuple[str, dict[str, object]]]) -> list[object]:
        args = ["--address", ten.svc.address, *(["--tenant-token", token] if token else [])]
        params = StdioServerParameters(command=str(kerneleval), args=[*args, "mcp"], env=env)
        out: list[object] = []

        async def main() -> None:
            async with McpClient(params, read_timeout_seconds=120) as client:
                for name, arguments in calls:
                    out.append(await client.call_tool(name, arguments))

        asyncio.run(main())
        return out

    source = k.GOOD.replace("x * 2.0 + 1.0", "x * 2.0 + 1.5  # mcp")
    (ran,) = tools(ten.tokens["alice"], [("evaluate_kernel", {"source": source, "perf_trials": 0})])
    assert not ran.is_error, ran  # type: ignore[attr-defined]
    job_id = ran.structured_content["job_id"]  # type: ignore[attr-defined]
    with ten.client("alice") as alice:
        assert alice.get_job(job_id).tenant == "alice"
    (mine,) = tools(ten.tokens["alice"], [("get_job", {"job_id": job_id})])
    assert not mine.is_error and mine.structured_content["job_id"] == job_id  # type: ignore[attr-defined]
    (theirs,) = tools(ten.tokens["bob"], [("get_job", {"job_id": job_id})])
    assert theirs.is_error and f"no job {job_id!r}" in theirs.content[0].text  # type: ignore[attr-defined]
    calls: list[tuple[str, dict[str, object]]] = [
        ("evaluate_kernel", {"source": source + "# anon\n", "perf_trials": 0}),
        ("get_job", {"job_id": job_id}),
    ]
    for token, says in ((None, "tenant token"), ("ket_guessed", "revoked")):
        for result in tools(token, calls):
            assert result.is_error, (token, result)  # type: ignore[attr-defined]
            assert says in result.content[0].text, (token, result)  # type: ignore[attr-defined]
    with Client(ten.svc.address, admin_token=ten.svc.admin_token, retry_timeout=0) as admin:
        sources = [j.spec.kernel.source_code for j in admin.list_jobs(include_spec=True)]
        assert source in sources and source + "# anon\n" not in sources
