"""GPU check of the watchdog with real NVML: XID 31 from a planted out-of-bounds Triton store.

Starts build/watchdog/kerneleval-watchdog (NVML_SOURCE_REAL) with two workers on GPU 0. Each
worker (this file with --worker) imports torch and triton, creates a CUDA context and idles
until told, through a file, to run a CUDA op or a Triton kernel whose store is far out of
bounds. Checks: XidObserved (xid 31) arrives, with the faulting pid when /dev/kmsg is
readable; the faulting worker is killed and replaced; the other worker on the GPU keeps its pid
and can still run a CUDA op; a new worker on the GPU works without a reset; the time from the
fault to the XID event; and the reset procedure runs every step with a reset command that ONLY
RECORDS its call (never nvidia-smi). Prints a table, writes JSON and Markdown to --out.

    python bench/gpu_watchdog_check.py [--out bench/results] [--device 0] [--worker-user NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "server"), str(REPO / "clients" / "python" / "src")]

# ---------------------------------------------------------------- worker side


def worker_main(control_dir: Path) -> None:
    """Runs inside a sandboxed worker: CUDA context, then obeys <dir>/<worker id>.cmd."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def oob_store(ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK).to(tl.int64)
        tl.store(ptr + offs + (1 << 36), tl.zeros([BLOCK], tl.float32))  # 256 GiB past the end

    wid = os.environ["KERNELEVAL_WORKER_ID"]
    base = control_dir / wid
    dry = os.environ.get("KEW_DRY_RUN") == "1"  # CPU rehearsal of the script itself
    x = torch.ones(1024, device="cpu" if dry else "cuda")
    if not dry:
        torch.cuda.synchronize()

    def write(suffix: str, data: dict[str, Any]) -> None:
        tmp = base.with_suffix(suffix + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, base.with_suffix(suffix))

    write(".ready", {"pid": os.getpid(), "device": "cpu" if dry else torch.cuda.get_device_name(0)})
    while True:
        time.sleep(0.02)
        cmd_path = base.with_suffix(".cmd")
        try:
            cmd = cmd_path.read_text().strip()
            cmd_path.unlink()
        except FileNotFoundError:
            continue
        if cmd == "op":
            try:
                value = float((x * 2).sum().item())
                write(".result", {"cmd": cmd, "ok": value == 2048.0, "value": value})
            except Exception as exc:  # noqa: BLE001 - reported, the check decides
                write(".result", {"cmd": cmd, "ok": False, "error": str(exc)[:300]})
        elif cmd == "oob":
            launched_ms = time.time() * 1000
            if dry:
                write(".result", {"cmd": cmd, "faulted": True, "launched_ms": launched_ms,
                                  "fault_ms": time.time() * 1000, "error": "dry run"})
                continue
            try:
                oob_store[(1,)](x, BLOCK=128)
                torch.cuda.synchronize()
                write(".result", {"cmd": cmd, "faulted": False, "launched_ms": launched_ms})
            except Exception as exc:  # noqa: BLE001 - the expected illegal address
                write(".result", {"cmd": cmd, "faulted": True, "launched_ms": launched_ms,
                                  "fault_ms": time.time() * 1000, "error": str(exc)[:300]})
            # Stay up with a dead context: the watchdog must notice the XID and replace us.


# ---------------------------------------------------------------- check side


class Run:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.events: list[Any] = []

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.WhichOneof("kind") == kind]

    async def wait_for(self, pred: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            await asyncio.sleep(0.05)
        return None

    async def ask(self, worker_id: str, cmd: str, timeout: float = 60) -> dict[str, Any] | None:
        result = self.root / f"{worker_id}.result"
        result.unlink(missing_ok=True)
        (self.root / f"{worker_id}.cmd").write_text(cmd)
        if not await self.wait_for(result.exists, timeout):
            return None
        return dict(json.loads(result.read_text()))

    async def ready(self, worker_id: str, timeout: float) -> dict[str, Any] | None:
        path = self.root / f"{worker_id}.ready"
        exited = lambda: any(e.worker_exited.worker.worker_id == worker_id  # noqa: E731
                             for e in self.of("worker_exited"))
        if not await self.wait_for(lambda: path.exists() or exited(), timeout) or exited():
            return None
        return dict(json.loads(path.read_text()))


async def check(args: argparse.Namespace, user: str) -> dict[str, Any]:
    from kerneleval.internal.v1 import watchdog_pb2 as pb
    from kerneleval_server.watchdog import Watchdog, find_watchdog_binary

    root = Path(tempfile.mkdtemp(prefix="kew-gpu-"))
    os.chmod(root, 0o777)  # the worker may run as an unprivileged user
    recorder = root / "record_reset.sh"
    recorder.write_text('#!/bin/sh\necho "$@" >> "$0.calls"\necho "recorded: $@"\n')
    recorder.chmod(0o755)
    reset_command = f"{recorder} {{index}}"
    assert "nvidia-smi" not in reset_command  # never reset a real GPU here
    record = Path(str(recorder) + ".calls")
    run = Run(root)
    results: dict[str, Any] = {"worker_user": user or "(watchdog default)", "checks": {}}
    checks: dict[str, Any] = results["checks"]
    cfg = pb.Configure(
        worker_command=[sys.executable, str(Path(__file__).resolve()), "--worker", str(root)],
        worker_env={"PYTHONUNBUFFERED": "1", "KEW_DRY_RUN": "1" if args.dry_run else "0"},
        workers_per_device=2,
        warm_spare=False,
        device_indices=[args.device],
        state_dir=str(root / "state"),
        reset_command=reset_command,
        auto_reset=False,
        nvml_source=pb.NVML_SOURCE_REAL,
        health_interval_seconds=2,
        sandbox=pb.SandboxConfig(isolate_network=True, user=user),
    )
    fake = root / "fake_nvml"
    if args.dry_run:  # fake NVML and a fake kernel log stand in for the driver
        fake.write_text(f"device {args.device} name=dry-run\n")
        (root / "kmsg").write_text("")
        cfg.nvml_source, cfg.fake_nvml_path = pb.NVML_SOURCE_FAKE, str(fake)
        cfg.kmsg_path = str(root / "kmsg")
    binary = args.binary or find_watchdog_binary()
    wd = await Watchdog.start(binary, cfg, run.events.append)
    try:
        started = await run.wait_for(lambda: len(run.of("worker_started")) >= 2, 10)
        if not started:
            raise RuntimeError("workers not started")
        workers = [e.worker_started.worker for e in run.of("worker_started")]
        for w in workers:
            if not await run.ready(w.worker_id, 120):
                raise WorkerStartFailed(w.worker_id)
        warnings = {e.warning.feature: e.warning.message for e in run.of("warning")}
        results["warnings"] = warnings
        status = await wd.status()
        dev = status.devices[0]
        results["device"] = {"name": dev.name, "uuid": dev.uuid, "driver": dev.driver_version,
                             "memory_total_bytes": dev.memory_total_bytes,
                             "temperature_c": dev.temperature_celsius,
                             "recovery_action": dev.recovery_action}
        checks["kmsg_readable"] = "kmsg" not in warnings
        victim, survivor = workers[0], workers[1]
        for w in workers:
            r = await run.ask(w.worker_id, "op")
            role = "victim" if w is victim else "survivor"
            checks[f"cuda_op_before_{role}"] = bool(r and r["ok"])

        await wd.set_job(victim.worker_id, "job-oob")  # the no-pid fallback targets job runners
        fault = await run.ask(victim.worker_id, "oob", timeout=60)
        checks["oob_store_faulted"] = bool(fault and fault.get("faulted"))
        if args.dry_run:
            with open(root / "kmsg", "a") as f:
                f.write(f"NVRM: Xid (PCI:0000:00:06): 31, pid={victim.pid}, name=python3\n")
            with open(fake, "a") as f:
                f.write(f"xid {args.device} 31\n")
        results["fault_error"] = (fault or {}).get("error", "")
        xid_event = await run.wait_for(lambda: run.of("xid"), 30)
        if xid_event:
            x = xid_event[0].xid
            checks["xid_observed"] = x.xid == 31
            results["xid"] = {"xid": x.xid, "pid": x.pid, "category": x.category,
                              "action": x.action, "worker_ids": list(x.worker_ids),
                              "job_ids": list(x.job_ids), "time_ms": x.time_ms}
            checks["xid_pid_is_victim"] = x.pid == victim.pid if checks["kmsg_readable"] else (
                "n/a (kmsg not readable)")
            checks["xid_names_victim"] = list(x.worker_ids) == [victim.worker_id]
            if fault and fault.get("fault_ms"):
                results["fault_to_xid_ms"] = round(x.time_ms - fault["fault_ms"], 1)
        else:
            checks["xid_observed"] = False
            await wd.kill_worker(victim.worker_id, "no xid seen")  # go on with the other checks

        exited = await run.wait_for(
            lambda: [e.worker_exited for e in run.of("worker_exited")
                     if e.worker_exited.worker.worker_id == victim.worker_id], 15)
        checks["victim_killed_for_xid"] = bool(exited and exited[0].reason == "xid")
        replacement = await run.wait_for(
            lambda: [e.worker_started.worker for e in run.of("worker_started")][2:], 15)
        checks["victim_replaced"] = bool(replacement)
        if replacement:
            new = replacement[0]
            ready = await run.ready(new.worker_id, 120)
            r = await run.ask(new.worker_id, "op") if ready else None
            checks["replacement_cuda_op"] = bool(r and r["ok"])
        live = {w.worker_id: w.pid for w in (await wd.status()).workers}
        checks["survivor_same_pid"] = live.get(survivor.worker_id) == survivor.pid
        r = await run.ask(survivor.worker_id, "op")
        checks["survivor_cuda_op_after_fault"] = bool(r and r["ok"])
        checks["device_healthy_after_xid31"] = (
            (await wd.status()).devices[0].health == pb.HEALTH_HEALTHY)

        t0 = time.monotonic()
        ok, steps = await wd.reset_gpu(args.device, grace_ms=1000)
        results["reset_seconds"] = round(time.monotonic() - t0, 2)
        results["reset_steps"] = [{"step": s.step, "ok": s.ok, "message": s.message}
                                  for s in steps]
        checks["reset_all_steps_ok"] = ok and [s.step for s in steps] == [
            "drain", "stop_workers", "check_processes", "reset", "check_health", "start_workers"]
        checks["reset_command_recorded_only"] = (
            record.exists() and record.read_text().split() == [str(args.device)])
        await run.wait_for(lambda: len(run.of("worker_started")) >= 5, 15)
    finally:
        await wd.shutdown(grace_ms=2000)
    return results


class WorkerStartFailed(RuntimeError):
    pass


def passed(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.startswith("n/a"))


def write_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_watchdog_check.json").write_text(json.dumps(results, indent=2))
    lines = ["# Watchdog GPU check", "", f"- host: {results['host']}",
             f"- device: {results.get('device', {})}",
             f"- worker user: {results.get('worker_user')}",
             f"- fault to XID event: {results.get('fault_to_xid_ms', 'n/a')} ms",
             f"- reset procedure: {results.get('reset_seconds', 'n/a')} s", "",
             "| check | result |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in results["checks"].items()]
    lines += ["", "| reset step | ok | message |", "| --- | --- | --- |"]
    lines += [f"| {s['step']} | {s['ok']} | {s['message'][:120]} |"
              for s in results.get("reset_steps", [])]
    if results.get("xid"):
        lines += ["", f"XidObserved: `{json.dumps(results['xid'])}`"]
    if results.get("warnings"):
        lines += ["", f"Warnings: `{json.dumps(results['warnings'])}`"]
    (out / "gpu_watchdog_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--binary", default="", help="watchdog binary (default: the built one)")
    ap.add_argument("--dry-run", action="store_true",
                    help="rehearse on a CPU machine: fake NVML, no CUDA")
    ap.add_argument("--worker-user", default="",
                    help="SandboxConfig.user (default: the watchdog's, nobody under root)")
    args = ap.parse_args()
    if args.worker:
        worker_main(Path(args.worker))
        return 0
    t0 = time.monotonic()
    try:
        results = asyncio.run(check(args, args.worker_user))
    except WorkerStartFailed as exc:
        if args.worker_user or os.geteuid() != 0:
            raise
        # As nobody the worker could not start (e.g. torch unreadable): say so, go on as root.
        print(f"worker {exc} did not start as the unprivileged user; retrying as root")
        results = asyncio.run(check(args, "root"))
        results["note"] = "workers could not start as nobody; ran as root"
    results["host"] = platform.node()
    results["total_seconds"] = round(time.monotonic() - t0, 1)
    results["passed"] = all(passed(v) for v in results["checks"].values())
    write_outputs(results, Path(args.out))
    width = max(len(k) for k in results["checks"])
    print(f"{'check'.ljust(width)}  result")
    for k, v in results["checks"].items():
        print(f"{k.ljust(width)}  {v}")
    print(f"fault -> XID event: {results.get('fault_to_xid_ms', 'n/a')} ms; "
          f"reset: {results.get('reset_seconds', 'n/a')} s; total {results['total_seconds']} s")
    for s in results.get("reset_steps", []):
        print(f"  reset step {s['step']:<16} ok={s['ok']} {s['message'][:100]}")
    print(f"results in {args.out}/gpu_watchdog_check.{{json,md}}; passed={results['passed']}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
