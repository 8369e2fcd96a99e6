"""GPU check of the watchdog with real NVML: XID 31 from a planted out-of-bounds Triton store.

Starts build/watchdog/kerneleval-watchdog (NVML_SOURCE_REAL) as the service does
(kerneleval_server.main.build_configure: the zygote, the job environment, the sandbox's
read-only paths, the job user), with two job processes on GPU 0 and this file's `job_main` as
their KERNELEVAL_JOB_MAIN. The file is copied into a code folder the sandbox shows read-only
(not the repository). In each job process the zygote runs `warm_up()` as root before the drop
to the job user: it imports torch and triton, creates the CUDA context and compiles (does not
launch) a Triton kernel whose store is 2^36 elements past the end of its tensor. Then
`job_main` speaks JSON lines on its channel (descriptor 3), which the watchdog hands to this
script (on_channel): first {"ready": ...}, then one reply a command: "op" (a small CUDA op),
"oob" (launches the planted store; the job process stays up with its dead context) and
"report".

Checks: the job processes start, as the unprivileged job user (a failure to start says why);
XidObserved (xid 31) arrives, with the faulting job process's host pid when /dev/kmsg is
readable; the faulting job process is killed and replaced; the other job process on the GPU
keeps its pid and can still run a CUDA op; the replacement works without a reset; the time from
the fault to the XID event; and the reset procedure runs every step with a reset command that
ONLY RECORDS its call (never nvidia-smi). Prints a table, writes JSON and Markdown to --out;
exit code 0 only when every check passed.

--dry-run rehearses all of it on a CPU machine (tests/watchdog/test_gpu_check.py): fake NVML
and a fake kernel log stand in for the driver, the job processes use CPU tensors and launch
nothing on a GPU.

    python bench/gpu_watchdog_check.py [--out bench/results] [--device 0] [--worker-user NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB_MODULE = "gpu_watchdog_check"
DRY_ENV = "KEW_DRY_RUN"
OOB_ELEMENTS = 128

# ---------------------------------------------------------------- job process side
# Imported by the zygote as the job main's module (stdlib only at the top: it forks from there).

_job: dict[str, Any] = {}  # what warm_up() made: torch, the tensor, the kernel; or its error


def warm_up() -> None:
    """Run by the zygote in each job process, as root, before the drop to the job user: torch and
    triton, the CUDA context, the out-of-bounds kernel compiled. Errors go to the ready line."""
    dry = os.environ.get(DRY_ENV) == "1"  # CPU rehearsal of the script itself
    _job["dry"] = dry
    try:
        import torch
        import triton
        import triton.language as tl

        x = torch.ones(1024, device="cpu" if dry else "cuda")
        if not dry:
            torch.cuda.synchronize()
        _job.update(
            torch=torch, x=x, device="cpu (dry run)" if dry else torch.cuda.get_device_name(0)
        )

        @triton.jit
        def oob_store(ptr):
            offs = tl.arange(0, 128).to(tl.int64)  # no constexpr argument: nothing depends on
            tl.store(ptr + offs + (1 << 36), tl.zeros([128], tl.float32))  # how Triton reads
            # annotations; the store is 2^36 floats (256 GiB) past the end of the tensor

        _job["kernel"] = oob_store
        if not dry:
            try:  # compiled now, as root into the warm cache; launched only on "oob"
                oob_store.warmup(x, grid=(1,))
                _job["precompiled"] = True
            except Exception as exc:  # noqa: BLE001 - it compiles at the launch instead
                _job["precompiled"] = f"no: {exc!r}"[:300]
    except Exception as exc:  # noqa: BLE001 - reported on the channel, the check decides
        _job["error"] = f"warm-up failed: {exc!r}"[:500]


def _about() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "euid": os.geteuid(),
        "gid": os.getgid(),
        "device": _job.get("device", ""),
        "precompiled": _job.get("precompiled", False),
        "error": _job.get("error", ""),
    }


def _op() -> dict[str, Any]:
    try:
        value = float((_job["x"] * 2).sum().item())
        return {"cmd": "op", "ok": value == 2048.0, "value": value}
    except Exception as exc:  # noqa: BLE001 - reported, the check decides
        return {"cmd": "op", "ok": False, "error": repr(exc)[:300]}


def _oob() -> dict[str, Any]:
    launched_ms = time.time() * 1000
    if "kernel" not in _job:
        return {
            "cmd": "oob",
            "faulted": False,
            "launched_ms": launched_ms,
            "error": f"nothing launched: {_job.get('error', 'no kernel')}",
        }
    if _job["dry"]:
        return {
            "cmd": "oob",
            "faulted": True,
            "launched_ms": launched_ms,
            "fault_ms": time.time() * 1000,
            "error": "dry run",
        }
    try:
        _job["kernel"][(1,)](_job["x"])
        _job["torch"].cuda.synchronize()
        return {"cmd": "oob", "faulted": False, "launched_ms": launched_ms}
    except Exception as exc:  # noqa: BLE001 - the expected illegal address
        return {
            "cmd": "oob",
            "faulted": True,
            "launched_ms": launched_ms,
            "fault_ms": time.time() * 1000,
            "error": str(exc)[:300],
        }
    # Either way it stays up (with a dead context): the watchdog must notice the XID.


def job_main(channel_fd: int) -> int:
    """KERNELEVAL_JOB_MAIN: {"ready": ...}, then one JSON line a command, until the channel
    closes. As PID 1 of its namespace it would ignore SIGTERM; it leaves at once instead."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    sock = socket.socket(fileno=channel_fd)
    f = sock.makefile("rwb", buffering=0)

    def send(obj: dict[str, Any]) -> None:
        f.write(json.dumps(obj).encode() + b"\n")

    send({"ready": _about()})
    for line in f:
        cmd = line.decode(errors="replace").strip()
        if cmd == "op":
            send(_op())
        elif cmd == "oob":
            send(_oob())
        elif cmd == "report":
            send({"cmd": "report", **_about()})
        elif cmd:
            send({"cmd": cmd, "error": "unknown command"})
    return 0  # the front end closed the channel


# ---------------------------------------------------------------- check side


class JobStartFailed(RuntimeError):
    """A job process did not get as far as its ready line; the message says why."""


class LogTee:
    """The watchdog's stderr (its log, and what its zygotes and job processes print before the
    job main runs): passed on to ours as it comes, and kept, so that a failure can say why."""

    def __init__(self) -> None:
        self.lines: collections.deque[str] = collections.deque(maxlen=500)
        self._out = os.dup(2)
        self._r, self._w = os.pipe()
        self._thread = threading.Thread(target=self._pump, name="watchdog-log", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def as_stderr(self) -> Iterator[None]:
        """While inside, descriptor 2 is the pipe: a child started here inherits it."""
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(self._w, 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)

    def _pump(self) -> None:
        with os.fdopen(self._r, "rb") as f:
            for line in f:
                with contextlib.suppress(OSError):
                    os.write(self._out, line)
                self.lines.append(line.decode(errors="replace").rstrip())

    def close(self, timeout: float = 3.0) -> None:
        """Our end of the pipe closes; the pump ends when the watchdog's side has too."""
        with contextlib.suppress(OSError):
            os.close(self._w)
        self._thread.join(timeout)

    def about(self, *words: str, last: int = 4) -> list[str]:
        return [line for line in self.lines if any(w in line for w in words)][-last:]

    def printed(self, last: int = 3) -> list[str]:
        """The last lines that are not the watchdog's own: its zygotes' and job processes'."""
        return [
            line
            for line in self.lines
            if line.strip() and not line.startswith("kerneleval-watchdog")
        ][-last:]


class Channel:
    """Our end of one job process's channel: JSON lines both ways."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.closed = False
        self.writer: asyncio.StreamWriter | None = None

    async def serve(self, fd: int) -> None:
        sock = socket.socket(fileno=fd)
        reader, self.writer = await asyncio.open_unix_connection(sock=sock)
        try:
            while line := await reader.readline():
                self.messages.append(json.loads(line))
        except (ConnectionError, ValueError):
            pass
        self.closed = True
        self.writer.close()

    def send(self, text: str) -> bool:
        if self.writer is None or self.closed:
            return False
        self.writer.write(text.encode() + b"\n")
        return True

    def ready(self) -> dict[str, Any] | None:
        return next((m["ready"] for m in self.messages if "ready" in m), None)


class Run:
    def __init__(self, log: LogTee) -> None:
        self.log = log
        self.events: list[Any] = []
        self.channels: dict[str, Channel] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def on_channel(self, event: Any, fd: Any) -> None:
        ch = self.channels.setdefault(event.worker_started.worker.worker_id, Channel())
        self.tasks.append(asyncio.get_running_loop().create_task(ch.serve(fd.take())))

    def of(self, kind: str) -> list[Any]:
        return [e for e in self.events if e.WhichOneof("kind") == kind]

    def started(self) -> list[Any]:
        return [e.worker_started.worker for e in self.of("worker_started")]

    def exit_of(self, worker_id: str) -> Any:
        return next(
            (
                e.worker_exited
                for e in self.of("worker_exited")
                if e.worker_exited.worker.worker_id == worker_id
            ),
            None,
        )

    async def wait_for(self, pred: Callable[[], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            await asyncio.sleep(0.05)
        return None

    async def ask(self, worker_id: str, cmd: str, timeout: float = 60) -> dict[str, Any] | None:
        """Sends a command; its reply, or None (no reply in time, or the channel closed)."""
        ch = self.channels.get(worker_id)
        if ch is None:
            return None
        seen = len(ch.messages)
        if not ch.send(cmd):
            return None
        reply = await self.wait_for(
            lambda: next((m for m in ch.messages[seen:] if m.get("cmd") == cmd), None) or ch.closed,
            timeout,
        )
        return reply if isinstance(reply, dict) else None

    def why(self, worker_id: str) -> str:
        lines = self.log.about(worker_id)
        return f"; watchdog log: {' | '.join(lines)}" if lines else ""

    async def ready(self, worker_id: str, timeout: float) -> dict[str, Any]:
        """The job process's ready line; JobStartFailed with the reason when there is none."""
        from kerneleval_server.jobproc import CONFIG_EXIT, SETUP_FAILED_EXIT

        def settled() -> bool:
            ch = self.channels.get(worker_id)
            return (
                ch is not None
                and (ch.ready() is not None or ch.closed)
                or self.exit_of(worker_id) is not None
            )

        await self.wait_for(settled, timeout)
        ch = self.channels.get(worker_id)
        ready = ch.ready() if ch is not None else None
        if ready is not None:
            if ready.get("error"):
                raise JobStartFailed(f"job process {worker_id}: {ready['error']}")
            return ready
        await self.wait_for(lambda: self.exit_of(worker_id), 3)
        ex = self.exit_of(worker_id)
        if ex is None:
            raise JobStartFailed(
                f"job process {worker_id} not ready after {timeout:.0f} s" + self.why(worker_id)
            )
        meaning = {
            SETUP_FAILED_EXIT: "a sandbox step, the drop to the job user or the warm-up failed "
            "before the job main ran",
            CONFIG_EXIT: "the zygote refused its config",
        }.get(ex.exit_code, "")
        how = (
            f"signal {ex.signal}"
            if ex.signal
            else f"exit code {ex.exit_code}" + (f": {meaning}" if meaning else "")
        )
        raise JobStartFailed(
            f"job process {worker_id} exited before it was ready "
            f"({how}; {ex.reason}){self.why(worker_id)}"
        )

    async def start_failure(self, wd: Any, warnings: dict[str, str]) -> str:
        """Why no job process started on the device."""
        parts = [("", warnings.get("unprivileged_user", ""))]
        with contextlib.suppress(Exception):
            parts += [
                (f"device {dev.device_index}: ", dev.health_reason)
                for dev in (await wd.status()).devices
            ]
        said: list[str] = []
        for label, text in parts:  # the same reason comes by several ways
            if text and not any(text in s for s in said):
                said.append(label + text)
        printed = self.log.printed()  # a zygote's traceback ends with the exception
        if printed:
            said.append("printed: " + " | ".join(printed))
        return "; ".join(["no job process started", *said])


def build_config(
    args: argparse.Namespace, root: Path, code_dir: Path, user: str, reset_command: str
) -> Any:
    """The service's own Configure (main.build_configure), with this file's job main."""
    from kerneleval_server.config import Config
    from kerneleval_server.jobproc import JOB_MAIN_ENV
    from kerneleval_server.main import build_configure

    fake, kmsg = root / "fake_nvml", root / "kmsg"
    cfg = Config(
        devices=str(args.device),
        workers_per_device=2,
        warm_spare=False,
        reset_command=reset_command,
        auto_reset=False,
        health_interval_s=2,
        job_user=user,
        sandbox_path=str(code_dir),  # shown read-only, like the service's code
        nvml="fake" if args.dry_run else "real",
    )
    if args.dry_run:  # fake NVML and a fake kernel log stand in for the driver
        fake.write_text(f"device {args.device} name=dry-run\n")
        kmsg.write_text("")
        cfg.fake_nvml_path, cfg.kmsg_path = str(fake), str(kmsg)
    problems = cfg.problems()
    if problems:
        raise JobStartFailed("; ".join(problems))
    configure = build_configure(cfg, root / "state")
    env = configure.worker_env
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_dir), env["PYTHONPATH"]) if p)
    env[JOB_MAIN_ENV] = f"{JOB_MODULE}:job_main"
    env[DRY_ENV] = "1" if args.dry_run else "0"
    return configure


def make_code_dir() -> Path:
    """A copy of this file, importable as JOB_MODULE. Not under /tmp: a job process's /tmp is
    its own tmpfs."""
    code_dir = Path(tempfile.mkdtemp(prefix="kew-gpu-code-", dir="/var/tmp"))
    os.chmod(code_dir, 0o755)
    shutil.copy(Path(__file__).resolve(), code_dir / f"{JOB_MODULE}.py")
    os.chmod(code_dir / f"{JOB_MODULE}.py", 0o644)
    return code_dir


async def check(args: argparse.Namespace, user: str, log: LogTee) -> dict[str, Any]:
    from kerneleval.internal.v1 import watchdog_pb2 as pb
    from kerneleval_server.fleet.watchdog import Watchdog, WatchdogError, find_watchdog_binary

    root = Path(tempfile.mkdtemp(prefix="kew-gpu-"))
    code_dir = make_code_dir()
    recorder = root / "record_reset.sh"
    recorder.write_text('#!/bin/sh\necho "$@" >> "$0.calls"\necho "recorded: $@"\n')
    recorder.chmod(0o755)
    reset_command = f"{recorder} {{index}}"
    assert "nvidia-smi" not in reset_command  # never reset a real GPU here
    record = Path(str(recorder) + ".calls")
    run = Run(log)
    results: dict[str, Any] = {"worker_user": user or "(watchdog default)", "checks": {}}
    checks: dict[str, Any] = results["checks"]
    wd = None
    try:
        cfg = build_config(args, root, code_dir, user, reset_command)
        binary = args.binary or find_watchdog_binary()
        with log.as_stderr():
            wd = await Watchdog.start(binary, cfg, run.events.append, run.on_channel)
        unhealthy = lambda: any(  # noqa: E731
            e.device.device.health == pb.HEALTH_UNHEALTHY for e in run.of("device")
        )
        await run.wait_for(
            lambda: len(run.started()) >= 2 or unhealthy() or run.of("worker_exited"),
            args.start_timeout,
        )
        warnings = {e.warning.feature: e.warning.message for e in run.of("warning")}
        results["warnings"] = warnings
        workers = run.started()[:2]
        readies = await asyncio.gather(
            *(run.ready(w.worker_id, args.ready_timeout) for w in workers)
        )  # JobStartFailed says why
        if len(workers) < 2:
            raise JobStartFailed(await run.start_failure(wd, warnings))
        results["job_processes"] = {
            w.worker_id: {"host_pid": w.pid, **r} for w, r in zip(workers, readies, strict=True)
        }
        checks["job_processes_started"] = True
        checks["job_user_not_root"] = all(r["uid"] != 0 and r["euid"] != 0 for r in readies)
        status = await wd.status()
        dev = status.devices[0]
        results["device"] = {
            "name": dev.name,
            "uuid": dev.uuid,
            "driver": dev.driver_version,
            "memory_total_bytes": dev.memory_total_bytes,
            "temperature_c": dev.temperature_celsius,
            "recovery_action": dev.recovery_action,
        }
        checks["kmsg_readable"] = "kmsg" not in warnings
        victim, survivor = workers[0], workers[1]
        for w in workers:
            r = await run.ask(w.worker_id, "op")
            role = "victim" if w is victim else "survivor"
            checks[f"cuda_op_before_{role}"] = bool(r and r["ok"])

        await wd.set_job(victim.worker_id, "job-oob")  # the no-pid fallback targets job runners
        fault = await run.ask(victim.worker_id, "oob", timeout=60)
        checks["oob_store_faulted"] = bool(fault and fault.get("faulted"))
        if args.dry_run:  # the kernel log names the host pid, which only the watchdog knows
            with open(root / "kmsg", "a") as f:
                f.write(f"NVRM: Xid (PCI:0000:00:06): 31, pid={victim.pid}, name=python3\n")
            with open(root / "fake_nvml", "a") as f:
                f.write(f"xid {args.device} 31\n")
        results["fault_error"] = (fault or {}).get("error", "")
        xid_event = await run.wait_for(lambda: run.of("xid"), 30)
        if xid_event:
            x = xid_event[0].xid
            checks["xid_observed"] = x.xid == 31
            results["xid"] = {
                "xid": x.xid,
                "pid": x.pid,
                "category": x.category,
                "action": x.action,
                "worker_ids": list(x.worker_ids),
                "job_ids": list(x.job_ids),
                "time_ms": x.time_ms,
            }
            checks["xid_pid_is_victim"] = (
                x.pid == victim.pid if checks["kmsg_readable"] else ("n/a (kmsg not readable)")
            )
            checks["xid_names_victim"] = list(x.worker_ids) == [victim.worker_id]
            if fault and fault.get("fault_ms"):
                results["fault_to_xid_ms"] = round(x.time_ms - fault["fault_ms"], 1)
        else:
            checks["xid_observed"] = False
            await wd.kill_worker(victim.worker_id, "no xid seen")  # go on with the other checks

        exited = await run.wait_for(lambda: run.exit_of(victim.worker_id), 15)
        checks["victim_killed_for_xid"] = bool(exited and exited.reason == "xid")
        replacement = await run.wait_for(lambda: run.started()[2:], 15)
        checks["victim_replaced"] = bool(replacement)
        if replacement:
            new = replacement[0]
            try:
                await run.ready(new.worker_id, args.ready_timeout)
                r = await run.ask(new.worker_id, "op")
                checks["replacement_cuda_op"] = bool(r and r["ok"])
            except JobStartFailed as exc:
                checks["replacement_cuda_op"] = f"no: {exc}"
        live = {w.worker_id: w.pid for w in (await wd.status()).workers}
        checks["survivor_same_pid"] = live.get(survivor.worker_id) == survivor.pid
        r = await run.ask(survivor.worker_id, "op")
        checks["survivor_cuda_op_after_fault"] = bool(r and r["ok"])
        checks["device_healthy_after_xid31"] = (await wd.status()).devices[
            0
        ].health == pb.HEALTH_HEALTHY

        t0 = time.monotonic()
        ok, steps = await wd.reset_gpu(args.device, grace_ms=1000)
        results["reset_seconds"] = round(time.monotonic() - t0, 2)
        results["reset_steps"] = [{"step": s.step, "ok": s.ok, "message": s.message} for s in steps]
        checks["reset_all_steps_ok"] = ok and [s.step for s in steps] == [
            "drain",
            "stop_workers",
            "check_processes",
            "reset",
            "check_health",
            "start_workers",
        ]
        checks["reset_command_recorded_only"] = record.exists() and record.read_text().split() == [
            str(args.device)
        ]
        await run.wait_for(lambda: len(run.started()) >= 5, 15)
    except JobStartFailed as exc:
        checks["job_processes_started"] = f"no: {exc}"
    except WatchdogError as exc:  # a refused command, or the watchdog went away
        started = checks.get("job_processes_started") is True
        checks["watchdog" if started else "job_processes_started"] = f"no: the watchdog: {exc}"
    finally:
        if wd is not None:
            await wd.shutdown(grace_ms=2000)
        for task in run.tasks:
            task.cancel()
        shutil.rmtree(code_dir, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
    return results


def passed(value: Any) -> bool:
    return value is True or (isinstance(value, str) and value.startswith("n/a"))


def write_outputs(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_watchdog_check.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# Watchdog GPU check",
        "",
        f"- host: {results['host']}",
        f"- device: {results.get('device', {})}",
        f"- worker user: {results.get('worker_user')}",
        f"- fault to XID event: {results.get('fault_to_xid_ms', 'n/a')} ms",
        f"- reset procedure: {results.get('reset_seconds', 'n/a')} s",
        "",
        "| check | result |",
        "| --- | --- |",
    ]
    lines += [f"| {k} | {v} |" for k, v in results["checks"].items()]
    lines += ["", "| reset step | ok | message |", "| --- | --- | --- |"]
    lines += [
        f"| {s['step']} | {s['ok']} | {s['message'][:120]} |"
        for s in results.get("reset_steps", [])
    ]
    if results.get("job_processes"):
        lines += ["", f"Job processes: `{json.dumps(results['job_processes'])}`"]
    if results.get("xid"):
        lines += ["", f"XidObserved: `{json.dumps(results['xid'])}`"]
    if results.get("warnings"):
        lines += ["", f"Warnings: `{json.dumps(results['warnings'])}`"]
    (out / "gpu_watchdog_check.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results"))
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--binary", default="", help="watchdog binary (default: the built one)")
    ap.add_argument(
        "--dry-run", action="store_true", help="rehearse on a CPU machine: fake NVML, no CUDA"
    )
    ap.add_argument(
        "--worker-user",
        default="",
        help="SandboxConfig.user: the job user (default: the watchdog's, "
        "kerneleval-job else nobody; never root)",
    )
    ap.add_argument(
        "--start-timeout",
        type=float,
        default=90,
        help="seconds for the zygote to start the first job processes",
    )
    ap.add_argument(
        "--ready-timeout", type=float, default=120, help="seconds for a job process's warm-up"
    )
    args = ap.parse_args()
    sys.path[:0] = [str(REPO / "server"), str(REPO / "clients" / "python" / "src")]
    t0 = time.monotonic()
    log = LogTee()
    try:
        results = asyncio.run(check(args, args.worker_user, log))
    finally:
        log.close()
    results["host"] = platform.node()
    results["total_seconds"] = round(time.monotonic() - t0, 1)
    results["passed"] = all(passed(v) for v in results["checks"].values())
    write_outputs(results, Path(args.out))
    width = max(len(k) for k in results["checks"])
    print(f"{'check'.ljust(width)}  result")
    for k, v in results["checks"].items():
        print(f"{k.ljust(width)}  {v}")
    print(
        f"fault -> XID event: {results.get('fault_to_xid_ms', 'n/a')} ms; "
        f"reset: {results.get('reset_seconds', 'n/a')} s; total {results['total_seconds']} s"
    )
    for s in results.get("reset_steps", []):
        print(f"  reset step {s['step']:<16} ok={s['ok']} {s['message'][:100]}")
    print(f"results in {args.out}/gpu_watchdog_check.{{json,md}}; passed={results['passed']}")
    return 0 if results["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
