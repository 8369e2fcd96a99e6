"""The operations commands (admin token): `devices`, `events`, `reset-gpu`, `restart-workers`,
`cleanup`, `stats`, `builders`; and `doctor`."""

from __future__ import annotations

import argparse
import json
import sys
import time

from kerneleval import render
from kerneleval.cli.flags import credentials
from kerneleval.cli.output import EXIT_OK, EXIT_USAGE, EXIT_VERDICT, Output, as_dict, dump
from kerneleval.client import ADMIN_TOKEN_ENV, Client
from kerneleval.doctor import run_doctor
from kerneleval.v1 import operations_service_pb2


def cmd_devices(a: argparse.Namespace, c: Client, out: Output) -> int:
    devices = c.list_devices()
    if out.json:
        dump([as_dict(d) for d in devices])
        return EXIT_OK
    print(render.devices_table(devices, width=out.width, style=out.style))
    for d in devices:
        for x in d.recent_xids:
            who = f" job {x.job_id}" if x.job_id else ""
            print(
                render.printable(
                    f"  gpu {d.index}: XID {x.xid} ({x.category}) -> {x.action}{who} "
                    f"at {render.fmt_time(x.time)}  {x.message}".rstrip()
                )
            )
    return EXIT_OK


def cmd_builders(a: argparse.Namespace, c: Client, out: Output) -> int:
    resp = c.list_builders()
    if out.json:
        dump(as_dict(resp))
        return EXIT_OK
    mine = ", ".join(resp.versions) or "not known yet (no job process has reported them)"
    if not resp.builders:
        print("no builders (they register in a shared PostgreSQL store: --role builder)")
    else:
        print(render.builders_table(resp.builders, now=time.time(), width=out.width,
                                    style=out.style))  # fmt: skip
    print(render.printable(f"this server's versions: {mine}"))
    for b in resp.builders:  # a builder no job of this server can use: what it has instead
        if not b.versions_match:
            print(render.printable(f"  {b.builder_id} builds with: {b.versions}"))
    return EXIT_OK


def cmd_events(a: argparse.Namespace, c: Client, out: Output) -> int:
    for ev in c.watch_events(a.replay):
        if out.json or out.jsonl:
            dump(as_dict(ev), lines=True)
        else:
            print(render.printable(render.ops_event_line(ev)), flush=True)
    return EXIT_OK


def cmd_reset_gpu(a: argparse.Namespace, c: Client, out: Output) -> int:
    if not c.admin_token:
        print(f"error: reset-gpu needs --admin-token or ${ADMIN_TOKEN_ENV}", file=sys.stderr)
        return EXIT_USAGE
    if not a.yes:
        if not sys.stdin.isatty():
            print("error: not a terminal; pass --yes to reset without asking", file=sys.stderr)
            return EXIT_USAGE
        answer = input(
            f"Reset GPU {a.index} at {c.address}? Its jobs get {a.grace:g} s to finish, then its "
            "workers are stopped. Type 'yes': "
        )
        if answer.strip().lower() != "yes":
            print("not reset", file=sys.stderr)
            return EXIT_USAGE
    resp = c.reset_gpu(a.index, grace_period=a.grace, node=a.node)
    if out.json:
        dump(as_dict(resp))
    else:
        for s in resp.steps:
            state = out.style.outcome("OK") if s.ok else out.style.paint("FAILED", "red")
            print(f"{render.fmt_time(s.time)}  {s.step:<16} {state}  {s.message}".rstrip())
        print("GPU healthy again" if resp.success else "reset FAILED")
    return EXIT_OK if resp.success else EXIT_VERDICT


def cmd_restart_workers(a: argparse.Namespace, c: Client, out: Output) -> int:
    count = c.restart_workers(a.device, node=a.node)
    if out.json:
        dump({"restartedCount": count})
        return EXIT_OK
    where = "every device" if a.device is None else render.device_label(a.device)
    print(f"asked {count} worker(s) on {where} to restart")
    return EXIT_OK


def cmd_cleanup(a: argparse.Namespace, c: Client, out: Output) -> int:
    older = None if a.older_than_hours is None else a.older_than_hours * 3600
    resp = c.cleanup(older)
    if out.json:
        dump(as_dict(resp))
    else:
        print(f"deleted {resp.deleted_job_count} finished job(s)")
    return EXIT_OK


def cmd_stats(a: argparse.Namespace, c: Client, out: Output) -> int:
    st = c.get_stats()
    if out.json:
        dump(as_dict(st))
        return EXIT_OK
    rows = [
        ("uptime", render.fmt_duration(st.uptime.ToTimedelta().total_seconds())),
        ("queue depth", str(st.queue_depth)),
        (
            "jobs",
            ", ".join(
                f"{k.removeprefix('JOB_STATE_')} {v}" for k, v in sorted(st.jobs_by_state.items())
            )
            or "-",
        ),
        (
            "verdicts",
            ", ".join(
                f"{k.removeprefix('VERDICT_')} {v}" for k, v in sorted(st.jobs_by_verdict.items())
            )
            or "-",
        ),
        ("queue latency", _latency(st.queue_latency)),
        ("run latency", _latency(st.run_latency)),
        ("faults", str(st.fault_count)),
        ("worker restarts", str(st.worker_restart_count)),
        ("GPU resets", str(st.gpu_reset_count)),
        ("XIDs", str(st.xid_count)),
    ]
    rows.extend(
        (
            f"timing, {render.device_label(o.device_index)}",
            f"{o.timing_window_count} windows held {o.timing_window.ToNanoseconds() / 1e9:.1f} s "
            f"of {o.timing_wanted.ToNanoseconds() / 1e9:.1f} s wanted",
        )
        for o in st.device_occupancy
    )
    sandbox = render.sandbox_lines(st)
    rows.append(sandbox[0])
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in rows))
    for key, value in sandbox[1:]:  # what the host refused the sandbox, and other warnings
        print(f"{key}: {value}")
    return EXIT_OK


def _latency(s: operations_service_pb2.LatencySummary) -> str:
    if not s.sample_count:
        return "-"
    return f"p50 {s.p50_ms:.1f} ms, p90 {s.p90_ms:.1f} ms, p99 {s.p99_ms:.1f} ms ({s.sample_count})"


def cmd_doctor(a: argparse.Namespace, c: Client, out: Output) -> int:
    report = run_doctor(c.address, c.admin_token, a.service_timeout, credentials=credentials(a))
    print(json.dumps(report.as_dict(), indent=2) if out.json else report.text(), end="")
    return EXIT_OK
