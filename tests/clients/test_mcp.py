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
from kerneleval.v1 import kernel_eval_service_pb2, kernel_eval_service_pb2_grpc  # noqa: E402
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


TRITON_ADD = """import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask),
             mask=mask)
"""
IO = {
    "args": [
        {"name": "x_ptr", "tensor": {"shape": [1000], "dtype": "DTYPE_FLOAT32"}},
        {"name": "y_ptr", "tensor": {"shape": [1000], "dtype": "DTYPE_FLOAT32"}},
        {"name": "out_ptr", "role": "ARG_ROLE_OUTPUT",
         "tensor": {"shape": [1000], "dtype": "DTYPE_FLOAT32"}},
        {"name": "n", "intValue": 1000},
        {"name": "BLOCK", "intValue": 256, "meta": True},
    ],
    "launch": {"grid": {"x": 4}},
}  # fmt: skip


def test_the_tools_and_their_schemas(svc) -> None:  # type: ignore[no-untyped-def]
    """What an agent has to go on: every parameter described, with its bounds and default;
    a typed answer; annotations; no operations tool without a token."""

    async def body(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert set(tools) == {"evaluate_kernel", "compare_kernels", "get_job", "cancel_job"}
        for tool in tools.values():
            assert tool.description and tool.output_schema is not None, tool.name
            for name, prop in tool.input_schema["properties"].items():
                assert prop.get("description"), (tool.name, name)
        schema = tools["evaluate_kernel"].input_schema
        props = schema["properties"]
        assert schema["required"] == ["source"] and "ctx" not in props
        assert set(props["kernel_type"]["enum"]) >= {"torch", "triton", "cuda"}
        assert (props["correct_trials"]["minimum"], props["correct_trials"]["maximum"],
                props["correct_trials"]["default"]) == (1, 10_000, 5)  # fmt: skip
        assert (props["perf_trials"]["minimum"], props["perf_trials"]["default"]) == (0, 100)
        assert (props["timeout_s"]["minimum"], props["timeout_s"]["maximum"]) == (1, 600)
        assert {"atol", "rtol", "seed", "warmup", "io", "reference_io", "entry_point"} <= set(props)
        baseline = tools["compare_kernels"].input_schema["properties"]["compile_baseline"]
        assert baseline["default"] is False and "torch.compile" in baseline["description"]
        io = props["io"]["anyOf"][0]
        arg = io["properties"]["args"]["items"]["properties"]
        assert "DTYPE_BFLOAT16" in arg["tensor"]["properties"]["dtype"]["enum"]
        assert arg["role"]["enum"] == ["ARG_ROLE_INPUT", "ARG_ROLE_OUTPUT", "ARG_ROLE_INOUT"]
        assert "speedup" in (tools["evaluate_kernel"].description or "")
        out = tools["evaluate_kernel"].output_schema["properties"]
        sources = ["cuda_events", "cpu_wall_clock", "outside_bound"]
        assert out["timing_source"]["anyOf"][0]["enum"] == sources
        assert {"verdict", "notes", "flags", "speedup", "summary"} <= set(out)
        annotations = {n: t.annotations for n, t in tools.items()}
        assert annotations["get_job"].read_only_hint is True
        assert annotations["cancel_job"].destructive_hint is True
        assert annotations["evaluate_kernel"].read_only_hint is False
        assert annotations["evaluate_kernel"].destructive_hint is False

    with_tools(svc, body)


def test_every_field_of_an_io_contract_is_described() -> None:
    """The IOContract's schema comes from the proto's descriptor; the .proto's comments do not
    travel with the generated code, so each field's note is kept by hand: one for each."""
    from kerneleval import mcp_server
    from kerneleval.v1 import kernel_pb2

    def fields(desc, seen):  # type: ignore[no-untyped-def]
        for f in desc.fields:
            yield f"{desc.full_name}.{f.json_name}"
            if f.message_type is not None and f.message_type.full_name not in seen:
                seen.add(f.message_type.full_name)
                yield from fields(f.message_type, seen)

    names = set(fields(kernel_pb2.IOContract.DESCRIPTOR, set()))
    assert names == set(mcp_server.FIELD_NOTES)
    # The example in the parameter's description is an IOContract.
    assert mcp_server._io(mcp_server.IO_EXAMPLE, "io").args[4].meta is True


def test_compare_reports_progress_and_a_readable_result(svc) -> None:  # type: ignore[no-untyped-def]
    progress: list[tuple[float, str]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, message or ""))

    async def body(client: Client) -> None:
        args = {"source": CANDIDATE, "reference_source": REFERENCE, "correct_trials": 2,
                "perf_trials": 3}  # fmt: skip
        result = await client.call_tool("compare_kernels", args, progress_callback=on_progress)
        assert not result.is_error, result
        s = result.structured_content
        assert s is not None and s["verdict"] == "OK" and s["correct"] is True
        assert s["trials_passed"] == "2/2" and s["speedup"] > 0
        assert s["timing_source"] == "cpu_wall_clock" and s["timed_trials"] == 3
        assert s["timed_from_outside"] is True  # a compared ModelNew: its judge drove its calls
        assert s["flags"] == [] and s["speedup_suspicious"] in (True, False)
        assert s["summary"].startswith(f"OK (DONE), job {s['job_id']}")
        assert "(host clock, no GPU)" in s["summary"]
        again = await client.call_tool("get_job", {"job_id": s["job_id"]})
        assert again.structured_content["verdict"] == "OK"
        wrong = await client.call_tool(
            "evaluate_kernel", {"source": WRONG, "reference_source": REFERENCE, "perf_trials": 0}
        )
        w = wrong.structured_content
        assert w["verdict"] == "INCORRECT" and w["correct"] is False and "error" in w

    with_tools(svc, body)
    steps = [done for done, _ in progress]
    assert steps == sorted(set(steps)), progress  # MCP's progress only grows
    messages = [m for _, m in progress]
    assert messages[:2] == ["waiting in the queue", "compiling"], messages
    # One bar per phase, whichever process (the kernel's, its judge) reported it.
    for done in ("checking correctness 2/2", "timing the kernel 3/3", "timing the reference 3/3"):
        assert messages.count(done) == 1, messages
    assert messages.count("compiling") == 1, messages


def test_a_bare_triton_kernel_with_its_io_tolerances_and_seed(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        args = {"source": TRITON_ADD, "reference_source": REFERENCE, "io": IO,
                "correct_trials": 2, "perf_trials": 0, "atol": 0.001, "rtol": 0.002,
                "seed": 7}  # fmt: skip
        result = await client.call_tool("compare_kernels", args)
        assert not result.is_error, result
        s = result.structured_content
        assert s["verdict"] == "OK" and s["correct"] is True, s
        with svc.channel() as ch:
            job = (
                kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
                .GetJob(kernel_eval_service_pb2.GetJobRequest(job_id=s["job_id"]), timeout=30)
                .job
            )
        o = job.spec.options
        assert (o.atol, o.rtol, o.seed) == (0.001, 0.002, 7)
        assert [a.name for a in job.spec.kernel.io.args][-1] == "BLOCK"
        bad = await client.call_tool(
            "evaluate_kernel", {"source": TRITON_ADD, "io": {"args": [{"nme": "x"}]}}
        )
        assert bad.is_error and "io is not an IOContract" in bad.content[0].text
        # Without io: the service's own words, once, naming what to pass.
        bare = await client.call_tool("evaluate_kernel", {"source": TRITON_ADD})
        assert bare.is_error and bare.content[0].text.count("IOContract") == 1, bare

    with_tools(svc, body)


def test_bad_input_is_a_tool_error_that_says_what_to_fix(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        bad_type = await client.call_tool(
            "evaluate_kernel", {"source": CANDIDATE, "kernel_type": "fortran"}
        )
        assert bad_type.is_error
        too_many = await client.call_tool(
            "evaluate_kernel", {"source": CANDIDATE, "perf_trials": 10_001}
        )
        assert too_many.is_error and "perf_trials" in too_many.content[0].text
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

    with_tools(svc, body)


def test_list_devices_only_with_the_admin_token(svc) -> None:  # type: ignore[no-untyped-def]
    async def body(client: Client) -> None:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert tools["list_devices"].annotations.read_only_hint is True
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


def test_answers_carry_notes_flags_and_where_the_time_came_from() -> None:
    from kerneleval import mcp_server
    from kerneleval.v1 import job_pb2

    job = job_pb2.Job(job_id="j4", state=job_pb2.JOB_STATE_DONE)
    r = job.result
    r.verdict = job_pb2.VERDICT_OK
    r.runtime.median_ms, r.runtime.trial_count = 0.5, 100
    r.runtime.source = job_pb2.TIMING_SOURCE_CUDA_EVENTS
    r.reference_runtime.median_ms = 7.0
    r.speedup, r.speedup_suspicious = 14.0, True
    r.notes.append("the reference's time is an earlier job's")
    r.flags.add(rule_id="timer_patch", message="line 3: replaces time.perf_counter",
                source=job_pb2.FLAG_SOURCE_STATIC)  # fmt: skip
    s = mcp_server.answer(job)
    assert s["timing_source"] == "cuda_events" and s["timed_trials"] == 100
    assert s["timed_from_outside"] is False
    assert s["flags"] == [{"rule_id": "timer_patch", "source": "static",
                           "message": "line 3: replaces time.perf_counter"}]  # fmt: skip
    assert s["notes"] == ["the reference's time is an earlier job's"]
    assert "suspicious" in s["summary"] and "note: the reference's time" in s["summary"]
    assert "integrity flag timer_patch: line 3" in s["summary"]
    mcp_server.JobAnswer.model_validate(s)  # the published output schema's model
