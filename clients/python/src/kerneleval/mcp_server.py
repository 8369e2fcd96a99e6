"""`kerneleval mcp`: the service as tools for LLM agents (Model Context Protocol).

Built on the official `mcp` SDK (`pip install 'kerneleval-client[mcp]'`; the base client does
not need it). It forwards every tool call to a kerneleval server over gRPC, so it runs
wherever the agent does: over stdio (the agent starts it) or streamable HTTP.

Tools: `evaluate_kernel` (a kernel alone, or against a reference), `compare_kernels` (the
reference required), `get_job`, `cancel_job`, `list_devices` (needs the admin token). While
a job runs the tool sends progress notifications (phases, trials). Each answer is structured
content plus a short text an LLM reads well; bad input is a tool error that says what to fix.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from . import errors, kernelbench, render
from .client import AsyncClient
from .v1 import job_pb2, kernel_pb2

KernelType = Literal["auto", "torch", "torch_cuda", "triton", "cuda"]
T = TypeVar("T")
MAX_TEXT_LINES = 12  # of a compiler's or a traceback's output, in the text an LLM reads

INSTRUCTIONS = """Compile, check and time GPU kernels on a kerneleval server.
Sources use KernelBench's format: the candidate defines `class ModelNew` (PyTorch, Triton, or
CUDA through torch.utils.cpp_extension.load_inline), the reference `class Model` with
`get_inputs()` and `get_init_inputs()`. A verdict of OK with a speedup above 1 means the
candidate is correct and faster than the reference. CANNOT_RUN_HERE means the server's host
lacks the GPU the kernel needs: it was not evaluated, which is not a failure of the kernel."""

_PHASES = {
    job_pb2.PHASE_COMPILING: "compiling",
    job_pb2.PHASE_VALIDATING: "checking correctness",
    job_pb2.PHASE_PROFILING: "timing",
}


def summary(job: job_pb2.Job) -> dict[str, Any]:
    """What an agent acts on, as plain JSON values. `correct` is true only when outputs were
    compared and matched (correctness_status), not when nothing was checked; a kernel that
    could not run on the server's host has `evaluated` false: neither correct nor wrong."""
    r = job.result
    correctness = render.correctness_text(job)
    out: dict[str, Any] = {
        "job_id": job.job_id,
        "state": render.state_name(job.state),
        "verdict": render.verdict_name(r.verdict),
        "evaluated": r.verdict != job_pb2.VERDICT_CANNOT_RUN_HERE,
        "correct": correctness == "yes",
        "correctness": correctness,
        "compiled": bool(r.compiled),
    }
    if r.failed_side != job_pb2.SIDE_UNSPECIFIED:
        out["failed_side"] = render.enum_name(r.failed_side, job_pb2.Side, "SIDE_").lower()
    if r.runtime.median_ms:
        out["median_ms"] = r.runtime.median_ms
    if r.reference_runtime.median_ms:
        out["reference_median_ms"] = r.reference_runtime.median_ms
    if r.HasField("reference_runtime_age"):  # an earlier job's time of the same reference
        out["reference_time_age_s"] = r.reference_runtime_age.ToMilliseconds() / 1e3
    if r.speedup:
        out["speedup"] = r.speedup
    v = r.validation
    if v.trial_count:
        out["trials_passed"] = f"{v.trials_passed}/{v.trial_count}"
        out["max_abs_error"] = v.max_abs_error
        if v.output_name:
            out["worst_output"] = v.output_name
            out["first_mismatch_index"] = list(v.first_mismatch_index)
    if r.compilation_error:
        out["compile_errors"] = first_errors(r.compilation_error)
    message = r.validation_error or r.error.message or r.fault.description
    if message:
        out["error"] = _head(message)
    if r.flags:
        out["flags"] = [f"{f.rule_id}: {f.message}" for f in r.flags]
    if job.state_reason:
        out["state_reason"] = job.state_reason
    cases = [("test", c) for c in r.test_cases] + [("benchmark", c) for c in r.benchmark_cases]
    if cases:  # a GPU MODE task's
        out["cases"] = [_case(kind, c) for kind, c in cases]
    return out


def _case(kind: str, c: job_pb2.CaseResult) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": kind, "args": c.spec, "passed": c.passed}
    if c.message:
        out["message"] = _head(c.message, 3)
    if c.runtime.median_ms:
        out["median_ms"] = c.runtime.median_ms
    if c.speedup:
        out["speedup"] = c.speedup
    return out


def answer(job: job_pb2.Job) -> dict[str, Any]:
    """summary() with its text under "summary": what every tool about a job returns."""
    s = summary(job)
    s["summary"] = text_of(s)
    return s


def text_of(s: dict[str, Any]) -> str:
    """The same, as a few lines."""
    lines = [f"{s['verdict']} ({s['state']}), job {s['job_id']}"]
    if not s["evaluated"]:
        lines.append(
            f"{render.NOT_RUN_HERE}: the server's host lacks what the kernel needs; not a "
            "failure of the kernel, nothing was checked or timed"
        )
    if "speedup" in s:
        lines.append(
            f"speedup {s['speedup']:.3g}x: {s['median_ms']:.4f} ms vs the reference's "
            f"{s['reference_median_ms']:.4f} ms"
        )
    elif "median_ms" in s:
        lines.append(f"median {s['median_ms']:.4f} ms")
    if "trials_passed" in s:
        worst = f" (worst: {s['worst_output']})" if "worst_output" in s else ""
        lines.append(
            f"correctness: {s['trials_passed']} trials passed, max abs error "
            f"{s['max_abs_error']:.3g}{worst}"
        )
    if s["correctness"] not in ("yes", "no"):
        lines.append(f"correctness: {s['correctness']}")
    if "compile_errors" in s:
        lines.append("compile errors:\n" + s["compile_errors"])
    if "error" in s:
        lines.append("error: " + s["error"])
    for f in s.get("flags", []):
        lines.append("integrity flag " + f)
    failed = [c for c in s.get("cases", []) if not c["passed"]]
    if failed:
        c = failed[0]
        lines.append(
            f"{len(failed)} of {len(s['cases'])} cases failed; first: {c['kind']} "
            f"({c['args']}): {c.get('message', '')}".rstrip(": ")
        )
    return "\n".join(lines)


def _head(text: str, limit: int = MAX_TEXT_LINES) -> str:
    lines = render.printable(text.strip()).splitlines()
    more = f"\n... ({len(lines) - limit} more lines)" if len(lines) > limit else ""
    return "\n".join(lines[:limit]) + more


_ERROR_LINE = re.compile(r"(error|Error|ERROR)\b")


def first_errors(log: str) -> str:
    """The compiler's error lines (and the line after each: the source it points at), not the
    pages of header and build-tool noise around them."""
    lines = log.splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line) and line not in picked:
            picked.append(line)
            if i + 1 < len(lines) and not _ERROR_LINE.search(lines[i + 1]):
                picked.append(lines[i + 1])
        if len(picked) >= MAX_TEXT_LINES:
            break
    return _head("\n".join(picked) if picked else log)


def build_spec(
    source: str,
    kernel_type: str,
    reference_source: str,
    reference_type: str,
    correct_trials: int,
    perf_trials: int,
    timeout_s: int,
) -> kernel_pb2.JobSpec:
    if not source.strip():
        raise ToolError("source is empty: pass the candidate's code (a ModelNew or a kernel)")
    try:
        spec = kernel_pb2.JobSpec(client_tag="mcp")
        spec.kernel.CopyFrom(kernelbench.kernel_source(source, type=kernel_type))
        if reference_source.strip():
            spec.reference.CopyFrom(
                kernelbench.kernel_source(reference_source, type=reference_type)
            )
    except ValueError as e:
        raise ToolError(str(e)) from e
    spec.options.correct_trial_count = correct_trials
    spec.options.perf_trial_count = perf_trials
    spec.options.timeout.seconds = timeout_s
    return spec


def tool_error(e: errors.KernelEvalError) -> ToolError:
    """A service error as what the agent should change."""
    fields = "; ".join(f"{v.field}: {v.description}" for v in e.field_violations)
    return ToolError(f"{e}" + (f" ({fields})" if fields else ""))


def make_server(
    address: str, *, admin_token: str | None = None, credentials: Any = None
) -> MCPServer:
    server = MCPServer("kerneleval", instructions=INSTRUCTIONS)

    def client() -> AsyncClient:
        return AsyncClient(address, admin_token=admin_token, credentials=credentials)

    async def call(method: Callable[[AsyncClient], Awaitable[T]]) -> T:
        """One call to the server; its errors as tool errors."""
        async with client() as c:
            try:
                return await method(c)
            except errors.KernelEvalError as e:
                raise tool_error(e) from e

    async def run(spec: kernel_pb2.JobSpec, ctx: Context) -> dict[str, Any]:
        step = 0
        job: job_pb2.Job | None = None
        async with client() as c:
            try:
                async for event in c.run(spec):
                    kind = event.WhichOneof("kind")
                    if kind == "phase" and event.phase.phase in _PHASES:
                        step += 1
                        await ctx.report_progress(step, None, _PHASES[event.phase.phase])
                    elif kind == "progress" and event.progress.total_count:
                        p = event.progress
                        what = _PHASES.get(p.phase, "working")
                        await ctx.report_progress(
                            step, None, f"{what}: {p.done_count}/{p.total_count}"
                        )
                    elif kind == "finished":
                        job = event.finished
            except errors.KernelEvalError as e:
                raise tool_error(e) from e
        if job is None:
            raise ToolError("the server ended the job's stream without its result; get_job")
        return answer(job)

    @server.tool()
    async def evaluate_kernel(
        source: str,
        ctx: Context,
        kernel_type: KernelType = "auto",
        reference_source: str = "",
        reference_type: KernelType = "auto",
        correct_trials: int = 5,
        perf_trials: int = 100,
        timeout_s: int = 120,
    ) -> dict[str, Any]:
        """Compile, check and time a kernel on the server's GPU. `source`: the candidate (a
        KernelBench `ModelNew`; PyTorch, Triton or load_inline CUDA); with `reference_source`
        (a `Model` with get_inputs) it is checked against it and its speedup measured. Returns
        the verdict (OK, INCORRECT, COMPILE_ERROR, RUNTIME_ERROR, ...), the median time, the
        speedup, the worst mismatch and the first compiler errors."""
        spec = build_spec(source, kernel_type, reference_source, reference_type,
                          correct_trials, perf_trials, timeout_s)  # fmt: skip
        return await run(spec, ctx)

    @server.tool()
    async def compare_kernels(
        source: str,
        reference_source: str,
        ctx: Context,
        kernel_type: KernelType = "auto",
        reference_type: KernelType = "auto",
        correct_trials: int = 5,
        perf_trials: int = 100,
        timeout_s: int = 120,
    ) -> dict[str, Any]:
        """Check a candidate kernel against a reference and time both: correctness over
        `correct_trials` fresh inputs, then the speedup (reference median / candidate
        median)."""
        if not reference_source.strip():
            raise ToolError("reference_source is empty: compare_kernels needs the reference")
        spec = build_spec(source, kernel_type, reference_source, reference_type,
                          correct_trials, perf_trials, timeout_s)  # fmt: skip
        return await run(spec, ctx)

    @server.tool()
    async def get_job(job_id: str) -> dict[str, Any]:
        """A job's state and result, by the job_id an evaluation returned."""
        return answer(await call(lambda c: c.get_job(job_id)))

    @server.tool()
    async def cancel_job(job_id: str) -> dict[str, Any]:
        """Cancels a queued or running job; returns it as it ended."""
        return answer(await call(lambda c: c.cancel_job(job_id)))

    @server.tool()
    async def list_devices() -> dict[str, Any]:
        """The server's GPUs and their health (needs the server's admin token)."""
        devices = await call(lambda c: c.list_devices())
        rows = [
            {"index": d.index, "name": d.name, "health": render.health_name(d.health)}
            for d in devices
        ]
        return {"devices": rows, "summary": "\n".join(
            f"{r['index']}: {r['name']} {r['health']}" for r in rows)}  # fmt: skip

    return server


def serve(
    address: str,
    *,
    admin_token: str | None = None,
    credentials: Any = None,
    http_port: int = 0,
    http_host: str = "127.0.0.1",
) -> int:
    """Runs the MCP server: over stdio, or streamable HTTP on `http_port` (path /mcp)."""
    server = make_server(address, admin_token=admin_token, credentials=credentials)
    if http_port:
        server.run("streamable-http", host=http_host, port=http_port)
    else:
        server.run("stdio")
    return 0
