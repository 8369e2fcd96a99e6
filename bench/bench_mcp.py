"""MCP `evaluate_kernel` round trip over stdio against the gRPC call, for a tiny kernel.

Issue 16's number: an agent calling the `evaluate_kernel` tool of `kerneleval mcp` (the official
`mcp` SDK's client, over stdio, one session kept open) gets a tiny kernel's result within 20 ms
of what the Python gRPC client's Evaluate takes for the same job. Both go to one real service
(`python -m kerneleval_server serve`; the CPU engine where no GPU is visible, or --cpu).

The job, the same both ways: a PyTorch `ModelNew` `x + y` over 1000 float32 elements checked
against the eager `Model` (--correct-trials 1, --perf-trials 0: the service's and the
transport's cost, not the kernel's). The gRPC JobSpec is built by the MCP server's own
`build_spec` from the very arguments the tool gets. The tool has no `bypass_cache` option, so
every call of every arm sends a distinct source (a comment with a counter): no call takes a
cached or shared result (checked afterwards: every job's result_origin). Arms, interleaved
round by round in a rotating order after --warmup rounds, with --pace-s before each call (a
warm job process waits for it):
  - gRPC Evaluate (`kerneleval.Client.evaluate`, one channel kept open): the baseline;
  - gRPC Run (`Client.run`, the stream the MCP server itself follows): where the MCP
    server's share starts;
  - MCP `evaluate_kernel` over stdio (`mcp.Client.call_tool`; the server opens a channel per
    call, as it does for every tool call).

    PYTHONPATH=server:clients/python/src python3 bench/bench_mcp.py --out DIR [--calls 30]

Results: <out>/bench_mcp.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from kerneleval.mcp_server import build_spec  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402

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

ARMS = ("grpc_evaluate", "grpc_run", "mcp")
LABELS = {
    "grpc_evaluate": "gRPC Evaluate (Python client)",
    "grpc_run": "gRPC Run stream (what the MCP server follows)",
    "mcp": "MCP evaluate_kernel over stdio",
}
TARGET_MS = 20.0


def tool_args(call: int, correct: int, perf: int, timeout_s: int = 120) -> dict[str, Any]:
    """The `evaluate_kernel` arguments of one call: a source of its own (the counter), so the
    result cache never answers it."""
    return {
        "source": f"{CANDIDATE}\n# call {call}\n",
        "reference_source": REFERENCE,
        "correct_trials": correct,
        "perf_trials": perf,
        "timeout_s": timeout_s,
    }


def spec_of(args: dict[str, Any]) -> kernel_pb2.JobSpec:
    """The JobSpec the MCP tool sends for `args` (the MCP server's own build_spec)."""
    return build_spec(
        args["source"], "auto", args["reference_source"], "auto",
        args["correct_trials"], args["perf_trials"], args["timeout_s"],
    )  # fmt: skip


def rotation(round_index: int, arms: tuple[str, ...] = ARMS) -> list[str]:
    """The arms' order in one round: rotated each round, so none always goes first."""
    k = round_index % len(arms)
    return list(arms[k:] + arms[:k])


def p50_p90(values_s: list[float]) -> dict[str, float]:
    """Milliseconds: n, p50 (the median), p90 (nearest rank), min, max."""
    ms = [v * 1e3 for v in values_s]
    if not ms:
        return {"n": 0, "p50_ms": 0.0, "p90_ms": 0.0, "min_ms": 0.0, "max_ms": 0.0}
    return {
        "n": len(ms),
        "p50_ms": statistics.median(ms),
        "p90_ms": C.percentile(ms, 90),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


async def measure(svc: C.Service, args: argparse.Namespace) -> dict[str, Any]:
    from mcp import Client as McpClient
    from mcp import StdioServerParameters

    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "kerneleval.cli", "--address", svc.address, "mcp"],
        env=C.child_env(),
    )
    walls: dict[str, list[float]] = {a: [] for a in ARMS}
    jobs: dict[str, list[str]] = {a: [] for a in ARMS}
    verdicts: dict[str, dict[str, int]] = {a: {} for a in ARMS}
    counter = 0
    grpc = svc.client()
    load_before = os.getloadavg()[0]
    t_session = time.perf_counter()
    async with McpClient(params, read_timeout_seconds=300) as mcp:
        await mcp.list_tools()
        session_s = time.perf_counter() - t_session

        def grpc_evaluate(a: dict[str, Any]) -> tuple[str, str]:
            job = grpc.evaluate(spec_of(a))
            return job.job_id, job_pb2.Verdict.Name(job.result.verdict).removeprefix("VERDICT_")

        def grpc_run(a: dict[str, Any]) -> tuple[str, str]:
            job = None
            for ev in grpc.run(spec_of(a)):
                if ev.HasField("finished"):
                    job = ev.finished
            assert job is not None
            return job.job_id, job_pb2.Verdict.Name(job.result.verdict).removeprefix("VERDICT_")

        async def via_mcp(a: dict[str, Any]) -> tuple[str, str]:
            result = await mcp.call_tool("evaluate_kernel", a)
            s = result.structured_content or {}
            if result.is_error or not s:
                return "", "TOOL_ERROR"
            return str(s["job_id"]), str(s["verdict"])

        sync_arms: dict[str, Callable[[dict[str, Any]], tuple[str, str]]] = {
            "grpc_evaluate": grpc_evaluate,
            "grpc_run": grpc_run,
        }
        for r in range(args.warmup + args.calls):
            for arm in rotation(r):
                counter += 1
                a = tool_args(counter, args.correct_trials, args.perf_trials)
                await asyncio.sleep(args.pace_s)
                t = time.perf_counter()
                if arm == "mcp":
                    job_id, verdict = await via_mcp(a)
                else:
                    job_id, verdict = sync_arms[arm](a)
                wall = time.perf_counter() - t
                if r < args.warmup:
                    continue
                walls[arm].append(wall)
                jobs[arm].append(job_id)
                verdicts[arm][verdict] = verdicts[arm].get(verdict, 0) + 1
    load_after = os.getloadavg()[0]
    # After the calls: no job of any arm may have taken a cached or shared result.
    origins: dict[str, dict[str, int]] = {a: {} for a in ARMS}
    for arm in ARMS:
        for job_id in jobs[arm]:
            if not job_id:
                continue
            name = job_pb2.ResultOrigin.Name(grpc.get_job(job_id).result_origin)
            origins[arm][name] = origins[arm].get(name, 0) + 1
    grpc.close()
    return {
        "session_start_s": session_s,
        "walls_s": walls,
        "verdicts": verdicts,
        "result_origins": origins,
        "distinct_jobs": len({j for js in jobs.values() for j in js if j}),
        "load_avg_1min": [load_before, load_after],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    C.add_common_args(ap, smoke=False)
    ap.add_argument("--calls", type=int, default=30, help="measured calls per arm (30)")
    ap.add_argument("--warmup", type=int, default=5, help="rounds not counted (5)")
    ap.add_argument("--pace-s", type=float, default=0.3, help="pause before each call (0.3)")
    ap.add_argument("--correct-trials", type=int, default=1)
    ap.add_argument("--perf-trials", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="the CPU engine even where a GPU is")
    ap.add_argument("--device", default="0", help="GPU index the service uses (with a GPU)")
    args = ap.parse_args()
    info = C.machine_info()
    on_gpu = bool(info["gpu_count"]) and not args.cpu
    flags = ["--devices", args.device] if on_gpu else []
    svc = C.Service(flags, nvml="real" if on_gpu else "none").start()
    try:
        svc.wait_workers(1)
        data: dict[str, Any] = asyncio.run(measure(svc, args))
    finally:
        svc.stop()
    engine = f"GPU {args.device}" if on_gpu else "CPU engine"
    data.update(
        {"engine": engine, "calls": args.calls, "warmup_rounds": args.warmup,
         "pace_s": args.pace_s, "correct_trials": args.correct_trials,
         "perf_trials": args.perf_trials}
    )  # fmt: skip
    stats = {arm: p50_p90(data["walls_s"][arm]) for arm in ARMS}
    data["stats"] = stats
    base = stats["grpc_evaluate"]
    diff = stats["mcp"]["p50_ms"] - base["p50_ms"]
    data["mcp_minus_grpc_p50_ms"] = diff
    data["mcp_minus_run_p50_ms"] = stats["mcp"]["p50_ms"] - stats["grpc_run"]["p50_ms"]
    data["target_ms"] = TARGET_MS
    data["meets_target"] = diff <= TARGET_MS
    rows = [
        [LABELS[arm], s["n"], data["verdicts"][arm].get("OK", 0), s["p50_ms"], s["p90_ms"],
         s["min_ms"], s["max_ms"], s["p50_ms"] - base["p50_ms"]]
        for arm, s in stats.items()
    ]  # fmt: skip
    verdict = "meets" if data["meets_target"] else "misses"
    notes = [
        f"Engine: {engine}. The job: PyTorch ModelNew `x + y` over 1000 float32 elements "
        f"against the eager Model, {args.correct_trials} correctness trial(s), "
        f"{args.perf_trials} timed trials; the same JobSpec both ways (the MCP server's "
        "build_spec), a distinct source per call (a counter comment) in every arm.",
        f"{args.calls} calls per arm after {args.warmup} warm-up rounds, the arms interleaved "
        f"in a rotating order, {args.pace_s} s before each call.",
        f"MCP - gRPC Evaluate, difference of medians: {diff:.1f} ms ({verdict} the issue's "
        f"<= {TARGET_MS:.0f} ms); MCP - gRPC Run: {data['mcp_minus_run_p50_ms']:.1f} ms.",
        f"Result origins (GetJob after the calls): {data['result_origins']}: no call was "
        "answered from the cache.",
        f"MCP session start (spawn `kerneleval mcp`, initialize, list_tools), once: "
        f"{data['session_start_s'] * 1e3:.0f} ms, not in the round trips.",
        "No progress callback is passed: the server reports progress only to a client that "
        "asks for it. Host load average (1 min) before/after the calls: "
        + "/".join(f"{x:.1f}" for x in data["load_avg_1min"])
        + ".",
    ]
    C.write_results(
        args.out, "bench_mcp", "MCP evaluate_kernel over stdio vs the gRPC call", info, data,
        [("Round trip per call (ms)",
          ["arm", "n", "OK", "p50 ms", "p90 ms", "min ms", "max ms", "p50 - Evaluate ms"],
          rows)],
        notes,
    )  # fmt: skip
    ok = all(data["verdicts"][a].get("OK", 0) == args.calls for a in ARMS)
    cached = any(
        n for o in data["result_origins"].values() for k, n in o.items()
        if k in ("RESULT_ORIGIN_CACHE", "RESULT_ORIGIN_SHARED_RUN")
    )  # fmt: skip
    return 0 if ok and not cached else 1


if __name__ == "__main__":
    sys.exit(main())
