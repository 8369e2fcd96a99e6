"""`kerneleval mcp` through the official MCP SDK's own client, over stdio, against a real
server (the shared CPU service)."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

mcp = pytest.importorskip("mcp")  # the client's [mcp] extra (make installs it)
from mcp import Client, StdioServerParameters  # noqa: E402

KERNELEVAL = Path(sys.executable).parent / "kerneleval"

REFERENCE = """import torch


class Model(torch.nn.Module):
    def forward(self, x, y):
        return x + y


def get_inputs():
    return [torch.randn(1000), torch.randn(1000)]


def get_init_inputs():
    return []
"""
CANDIDATE = REFERENCE.replace("class Model(", "class ModelNew(")
WRONG = CANDIDATE.replace("return x + y", "return x - y")


@pytest.fixture(scope="module")
def svc(kerneleval_service):  # type: ignore[no-untyped-def]
    return kerneleval_service


def with_tools(svc: Any, body: Callable[[Client], Awaitable[None]], token: bool = False) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KERNELEVAL_ADMIN_TOKEN"}
    args = ["--address", svc.address, *(["--admin-token", svc.admin_token] if token else []),
            "mcp"]  # fmt: skip
    params = StdioServerParameters(command=str(KERNELEVAL), args=args, env=env)

    async def main() -> None:
        async with Client(params, read_timeout_seconds=240) as client:
            await body(client)

    asyncio.run(main())


def test_the_tools_and_their_schemas(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {
            "evaluate_kernel", "compare_kernels", "get_job", "cancel_job", "list_devices",
        }  # fmt: skip
        schema = tools["evaluate_kernel"].input_schema
        assert "source" in schema["required"] and "ctx" not in schema["properties"]
        assert set(schema["properties"]["kernel_type"]["enum"]) >= {"torch", "triton", "cuda"}
        assert "speedup" in (tools["evaluate_kernel"].description or "")

    with_tools(svc, body)


def test_compare_reports_progress_and_a_readable_result(svc) -> None:  # type: ignore[no-untyped-def]
    progress: list[str] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(message or "")

    async def body(client: Client) -> None:
        args = {"source": CANDIDATE, "reference_source": REFERENCE, "correct_trials": 2,
                "perf_trials": 3}  # fmt: skip
        result = await client.call_tool("compare_kernels", args, progress_callback=on_progress)
        assert not result.is_error, result
        s = result.structured_content
        assert s is not None and s["verdict"] == "OK" and s["correct"] is True
        assert s["trials_passed"] == "2/2" and s["speedup"] > 0
        assert s["summary"].startswith(f"OK (DONE), job {s['job_id']}")
        again = await client.call_tool("get_job", {"job_id": s["job_id"]})
        assert again.structured_content["verdict"] == "OK"
        wrong = await client.call_tool(
            "evaluate_kernel", {"source": WRONG, "reference_source": REFERENCE, "perf_trials": 0}
        )
        w = wrong.structured_content
        assert w["verdict"] == "INCORRECT" and w["correct"] is False and "error" in w

    with_tools(svc, body)
    assert "compiling" in progress and "checking correctness" in progress, progress


def test_bad_input_is_a_tool_error_that_says_what_to_fix(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        bad_type = await client.call_tool(
            "evaluate_kernel", {"source": CANDIDATE, "kernel_type": "fortran"}
        )
        assert bad_type.is_error
        empty = await client.call_tool("compare_kernels", {"source": CANDIDATE,
                                                             "reference_source": " "})  # fmt: skip
        assert empty.is_error and "reference_source is empty" in empty.content[0].text
        unknown = await client.call_tool("get_job", {"job_id": "no-such-job"})
        assert unknown.is_error and "no-such-job" in unknown.content[0].text
        syntax = await client.call_tool(
            "evaluate_kernel", {"source": "class ModelNew(:\n", "perf_trials": 0}
        )
        assert not syntax.is_error  # the kernel's error is a verdict, not a tool error
        assert syntax.structured_content["verdict"] == "COMPILE_ERROR"
        assert "compile_errors" in syntax.structured_content
        devices = await client.call_tool("list_devices", {})  # no admin token given
        assert devices.is_error and "admin token" in devices.content[0].text

    with_tools(svc, body)


def test_list_devices_with_the_admin_token(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        result = await client.call_tool("list_devices", {})
        assert not result.is_error, result
        assert [d["index"] for d in result.structured_content["devices"]] == [0]

    with_tools(svc, body, token=True)


def test_streamable_http(svc) -> None:  # type: ignore[no-untyped-def]
    import socket
    import subprocess
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(KERNELEVAL), "--address", svc.address, "mcp", "--http-port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until it listens
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)

        async def main() -> None:
            async with Client(f"http://127.0.0.1:{port}/mcp", read_timeout_seconds=120) as c:
                result = await c.call_tool(
                    "evaluate_kernel",
                    {"source": CANDIDATE, "reference_source": REFERENCE, "perf_trials": 0},
                )
                assert not result.is_error, result
                assert result.structured_content["verdict"] == "OK"

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_answers_judge_correctness_by_its_status_and_tell_not_run_from_failed() -> None:
    from kerneleval import mcp_server
    from kerneleval.v1 import job_pb2

    # Evaluate without a reference: the kernel ran (correctness true for old clients' sake),
    # but nothing was compared: not "correct".
    ran = job_pb2.Job(job_id="j1", state=job_pb2.JOB_STATE_DONE)
    ran.result.verdict = job_pb2.VERDICT_OK
    ran.result.correctness = True
    ran.result.correctness_status = job_pb2.CORRECTNESS_NOT_CHECKED
    s = mcp_server.answer(ran)
    assert s["correct"] is False and s["evaluated"] is True
    assert s["correctness"].startswith("not checked") and "correctness: not checked" in s["summary"]

    not_run = job_pb2.Job(job_id="j2", state=job_pb2.JOB_STATE_DONE)
    r = not_run.result
    r.verdict = job_pb2.VERDICT_CANNOT_RUN_HERE
    r.failed_side = job_pb2.SIDE_KERNEL
    r.error.message = "no CUDA on this worker: the kernel's CUDA sources were not compiled"
    s = mcp_server.answer(not_run)
    assert s["verdict"] == "CANNOT_RUN_HERE" and s["evaluated"] is False
    assert s["correct"] is False and s["failed_side"] == "kernel"
    assert "not run here (needs a GPU)" in s["summary"]
    assert "not a failure of the kernel" in s["summary"]

    # A GPU MODE job's cases.
    wrong = job_pb2.Job(job_id="j3", state=job_pb2.JOB_STATE_DONE)
    r = wrong.result
    r.verdict = job_pb2.VERDICT_INCORRECT
    r.correctness_status = job_pb2.CORRECTNESS_FAILED
    r.test_cases.add(spec="size: 8; seed: 1", passed=True)
    r.test_cases.add(spec="size: 33; seed: 2", passed=False, message="3 of 33 elements differ")
    s = mcp_server.answer(wrong)
    assert s["cases"][1] == {"kind": "test", "args": "size: 33; seed: 2", "passed": False,
                             "message": "3 of 33 elements differ"}  # fmt: skip
    assert "1 of 2 cases failed; first: test (size: 33; seed: 2): 3 of 33" in s["summary"]
