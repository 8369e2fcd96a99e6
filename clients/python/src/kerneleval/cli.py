"""The `kerneleval` command.

Exit codes: 0 success (verdict OK), 1 the job finished without verdict OK (or was cancelled
or failed), 2 usage error, 3 the service refused or could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from kerneleval import errors, render
from kerneleval.client import ADDRESS_ENV, ADMIN_TOKEN_ENV, Client, resolve_address
from kerneleval.doctor import run_doctor
from kerneleval.kernelbench import TYPE_NAMES, job_from_files
from kerneleval.v1 import job_pb2, kernel_pb2

EXIT_OK, EXIT_VERDICT, EXIT_USAGE, EXIT_SERVICE = 0, 1, 2, 3
STATES = {n.removeprefix("JOB_STATE_").lower(): v for n, v in job_pb2.JobState.items()}


def _to_json(message: Any) -> str:
    return json_format.MessageToJson(message, indent=2)


def _label(value: str) -> tuple[str, str]:
    """A `--label KEY=VALUE` argument (the server checks keys and values further)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. --label problem=19_ReLU), got {value!r}"
        )
    return key.strip(), val


def _add_label_option(p: Any, helptext: str) -> None:  # a parser or an argument group
    p.add_argument(
        "--label",
        dest="labels",
        action="append",
        type=_label,
        default=[],
        metavar="KEY=VALUE",
        help=helptext,
    )


def _labels(a: argparse.Namespace) -> dict[str, str]:
    """The --label arguments as a dict; a key given twice with two values is a usage error."""
    out: dict[str, str] = {}
    for key, value in a.labels:
        if out.get(key, value) != value:
            raise ValueError(f"--label {key} given twice, as {out[key]!r} and {value!r}")
        out[key] = value
    return out


def _add_job_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument(
        "--type",
        choices=[*TYPE_NAMES, "auto"],
        default="auto",
        help="kernel type (default: detected from the source)",
    )
    g.add_argument("--entry-point", default="", help="class or kernel to run")
    g.add_argument(
        "--io",
        metavar="JSON|FILE",
        help="IOContract as JSON (proto3 JSON mapping), inline or in a file",
    )
    g.add_argument("--correct-trials", type=int, help="correctness trials (default 5)")
    g.add_argument("--perf-trials", type=int, help="timed trials (default 100; 0 skips timing)")
    g.add_argument("--warmup", type=int, help="warm-up runs before timing (default 10)")
    g.add_argument("--atol", type=float)
    g.add_argument("--rtol", type=float)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", type=int, help="GPU index (default: the scheduler picks)")
    g.add_argument("--job-timeout", type=float, metavar="S", help="job wall-clock limit")
    g.add_argument("--no-flush-l2", action="store_true", help="keep the L2 cache warm")
    g.add_argument("--launch-blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1")
    g.add_argument("--dsa", action="store_true", help="device-side assertions")
    g.add_argument("--sanitize", action="store_true", help="compute-sanitizer memcheck")
    g.add_argument("--device-metrics", action="store_true", help="Nsight Compute metrics")
    g.add_argument(
        "--reject-flagged",
        action="store_true",
        help="do not run a candidate that static checks flag (VERDICT_REJECTED)",
    )
    g.add_argument(
        "--no-cache",
        action="store_true",
        help="run even if an identical job has a result or is running (bypass_cache)",
    )
    g.add_argument("--tag", default="", help="client tag")
    _add_label_option(g, "a label of the job, for your bookkeeping and `jobs --label` (repeatable)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print the finished job as JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    o.add_argument("--detach", action="store_true", help="submit, print the job id, exit")
    o.add_argument(
        "--max-in-flight",
        type=int,
        default=16,
        metavar="N",
        help="with several files: jobs in flight at once (default 16)",
    )


def _options(a: argparse.Namespace) -> kernel_pb2.EvalOptions:
    o = kernel_pb2.EvalOptions()
    for attr, fld in (
        ("correct_trials", "correct_trial_count"),
        ("perf_trials", "perf_trial_count"),
        ("warmup", "warmup_count"),
        ("atol", "atol"),
        ("rtol", "rtol"),
        ("seed", "seed"),
        ("device", "device_index"),
    ):
        value = getattr(a, attr)
        if value is not None:
            setattr(o, fld, value)
    if a.job_timeout is not None:
        o.timeout.FromNanoseconds(int(a.job_timeout * 1e9))
    if a.no_flush_l2:
        o.flush_l2 = False
    o.launch_blocking = a.launch_blocking
    o.device_side_assertions = a.dsa
    o.sanitize = a.sanitize
    o.device_metrics = a.device_metrics
    o.reject_flagged = a.reject_flagged
    o.bypass_cache = a.no_cache
    return o


def _io(value: str | None) -> kernel_pb2.IOContract | None:
    if not value:
        return None
    text = value
    if not value.lstrip().startswith("{"):
        text = Path(value).read_text(encoding="utf-8")
    return json_format.Parse(text, kernel_pb2.IOContract())


def _spec(a: argparse.Namespace, kernel: str, reference: str | None) -> kernel_pb2.JobSpec:
    spec = job_from_files(
        kernel,
        reference,
        options=_options(a),
        client_tag=a.tag,
        kernel_type=a.type,
        io=_io(a.io),
        entry_point=a.entry_point,
    )
    spec.labels.update(_labels(a))
    return spec


def _follow(a: argparse.Namespace, events: Iterator[job_pb2.JobEvent]) -> int:
    """Shows the events, then the result; the exit code follows the verdict."""
    progress = None
    if not a.no_progress and not a.json:
        progress = render.Progress(sys.stderr, sys.stderr.isatty())
    job: job_pb2.Job | None = None
    for event in events:
        if progress is not None:
            progress.event(event)
        if event.HasField("finished"):
            job = event.finished
    if job is None:
        print("error: the stream ended without a result", file=sys.stderr)
        return EXIT_SERVICE
    return _show_job(a, job)


def _show_job(a: argparse.Namespace, job: job_pb2.Job) -> int:
    print(_to_json(job) if a.json else render.result_table(job))
    ok = job.state == job_pb2.JOB_STATE_DONE and job.result.verdict == job_pb2.VERDICT_OK
    return EXIT_OK if ok else EXIT_VERDICT


def _run_spec(a: argparse.Namespace, c: Client, spec: kernel_pb2.JobSpec) -> int:
    if a.detach:
        job = c.submit(spec)
        print(_to_json(job) if a.json else job.job_id)
        return EXIT_OK
    return _follow(a, c.run(spec))


def _run_files(a: argparse.Namespace, c: Client) -> int:
    specs = [(f, _spec(a, f, a.reference)) for f in a.files]
    if len(specs) == 1:
        return _run_spec(a, c, specs[0][1])
    if a.detach:
        for name, spec in specs:
            job = c.submit(spec)
            print(f"{job.job_id}  {name}")
        return EXIT_OK
    return _run_batch(a, c, specs)


def _run_batch(
    a: argparse.Namespace, c: Client, specs: list[tuple[str, kernel_pb2.JobSpec]]
) -> int:
    """Several files on one RunBatch stream: a line per finished job, then a summary."""
    results: dict[str, job_pb2.Job | str] = {}
    quiet = a.no_progress or a.json
    for out in c.run_batch(specs, max_in_flight=a.max_in_flight):
        if not out.done:
            continue
        if out.error is not None:
            results[out.request_tag] = f"refused: {out.error.message}" + "".join(
                f"; {v.field}: {v.description}" for v in out.error.field_violations
            )
        else:
            assert out.event is not None
            results[out.request_tag] = out.event.finished
        if not quiet:
            got = results[out.request_tag]
            what = got if isinstance(got, str) else render.job_summary(got)
            print(f"[{len(results)}/{len(specs)}] {out.request_tag}: {what}", file=sys.stderr)
    ordered = [(name, results.get(name, "no result")) for name, _ in specs]
    if a.json:
        print(
            json.dumps(
                [
                    {"file": n, "job": json_format.MessageToDict(r)}
                    if isinstance(r, job_pb2.Job)
                    else {"file": n, "error": r}
                    for n, r in ordered
                ],
                indent=2,
            )
        )
    else:
        print(render.batch_table(ordered))
    ok = all(
        isinstance(r, job_pb2.Job)
        and r.state == job_pb2.JOB_STATE_DONE
        and r.result.verdict == job_pb2.VERDICT_OK
        for _, r in ordered
    )
    return EXIT_OK if ok else EXIT_VERDICT


def cmd_evaluate(a: argparse.Namespace, c: Client) -> int:
    return _run_files(a, c)


def cmd_compare(a: argparse.Namespace, c: Client) -> int:
    return _run_files(a, c)


def cmd_watch(a: argparse.Namespace, c: Client) -> int:
    return _follow(a, c.watch(a.job, a.after))


def cmd_get(a: argparse.Namespace, c: Client) -> int:
    return _show_job(a, c.get_job(a.job))


def cmd_cancel(a: argparse.Namespace, c: Client) -> int:
    job = c.cancel_job(a.job)
    print(_to_json(job) if a.json else f"{job.job_id}: {render.state_name(job.state)}")
    return EXIT_OK


def cmd_jobs(a: argparse.Namespace, c: Client) -> int:
    jobs = list(
        c.list_jobs(
            state=STATES[a.state],
            client_tag=a.tag,
            labels=_labels(a),
            limit=a.limit,
            page_size=min(a.limit, 1000),
        )
    )
    if a.json:
        print(json.dumps([json_format.MessageToDict(j) for j in jobs], indent=2))
    else:
        print(render.jobs_table(jobs))
    return EXIT_OK


def cmd_devices(a: argparse.Namespace, c: Client) -> int:
    devices = c.list_devices()
    if a.json:
        print(json.dumps([json_format.MessageToDict(d) for d in devices], indent=2))
    else:
        print(render.devices_table(devices))
        for d in devices:
            for x in d.recent_xids:
                who = f" job {x.job_id}" if x.job_id else ""
                print(
                    f"  gpu {d.index}: XID {x.xid} ({x.category}) -> {x.action}{who} "
                    f"at {render.fmt_time(x.time)}  {x.message}".rstrip()
                )
    return EXIT_OK


def cmd_events(a: argparse.Namespace, c: Client) -> int:
    for ev in c.watch_events(a.replay):
        if a.json:
            print(json_format.MessageToJson(ev, indent=None), flush=True)
        else:
            print(render.ops_event_line(ev), flush=True)
    return EXIT_OK


def cmd_reset_gpu(a: argparse.Namespace, c: Client) -> int:
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
    resp = c.reset_gpu(a.index, grace_period=a.grace)
    if a.json:
        print(_to_json(resp))
    else:
        for s in resp.steps:
            print(
                f"{render.fmt_time(s.time)}  {s.step:<16} {'ok' if s.ok else 'FAILED'}  "
                f"{s.message}".rstrip()
            )
        print("GPU healthy again" if resp.success else "reset FAILED")
    return EXIT_OK if resp.success else EXIT_VERDICT


def cmd_restart_workers(a: argparse.Namespace, c: Client) -> int:
    count = c.restart_workers(a.device)
    where = "every device" if a.device is None else render.device_label(a.device)
    print(f"asked {count} worker(s) on {where} to restart")
    return EXIT_OK


def cmd_cleanup(a: argparse.Namespace, c: Client) -> int:
    older = None if a.older_than_hours is None else a.older_than_hours * 3600
    resp = c.cleanup(older)
    print(f"deleted {resp.deleted_job_count} finished job(s)")
    return EXIT_OK


def cmd_stats(a: argparse.Namespace, c: Client) -> int:
    st = c.get_stats()
    if a.json:
        print(_to_json(st))
        return EXIT_OK
    rows = [
        ("uptime", f"{st.uptime.ToTimedelta()}"),
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


def _latency(s: Any) -> str:
    if not s.sample_count:
        return "-"
    return f"p50 {s.p50_ms:.1f} ms, p90 {s.p90_ms:.1f} ms, p99 {s.p99_ms:.1f} ms ({s.sample_count})"


def cmd_doctor(a: argparse.Namespace, c: Client) -> int:
    report = run_doctor(c.address, c.admin_token, a.service_timeout, credentials=_credentials(a))
    print(json.dumps(report.as_dict(), indent=2) if a.json else report.text(), end="")
    return EXIT_OK


def cmd_serve(argv: Sequence[str]) -> int:
    try:
        from kerneleval_server.main import main as server_main  # type: ignore[import-not-found]
    except ImportError as e:
        print(
            "kerneleval serve needs the server package (kerneleval-server), which is not "
            f"installed here ({e}).\nInstall it from the repository root: pip install -e . "
            "(or run `make serve`).",
            file=sys.stderr,
        )
        return EXIT_USAGE
    result = server_main(["serve", *argv])  # the server's own `serve` subcommand
    return int(result or 0)


def _credentials(a: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if a.tls_ca:
        return grpc.ssl_channel_credentials(Path(a.tls_ca).read_bytes())
    if a.tls:
        return grpc.ssl_channel_credentials()
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kerneleval", description="Compile, check and time GPU kernels on a kerneleval server."
    )
    p.add_argument(
        "--address",
        default=None,
        help=f"server address, host:port or unix:PATH (env {ADDRESS_ENV}, default 127.0.0.1:50051)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="deadline of each call in seconds (default: none)",
    )
    p.add_argument(
        "--tls-ca",
        default=os.environ.get("KERNELEVAL_TLS_CA") or None,
        metavar="PEM",
        help="use TLS, trusting this CA certificate (env KERNELEVAL_TLS_CA)",
    )
    p.add_argument("--tls", action="store_true", help="use TLS with the system's CA roots")
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"token for the operations calls (env {ADMIN_TOKEN_ENV})",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="start the server (needs kerneleval-server)", add_help=False)
    s.add_argument("args", nargs=argparse.REMAINDER)

    s = sub.add_parser(
        "evaluate", help="evaluate kernel files (compare with --reference); several run at once"
    )
    s.add_argument("files", nargs="+", metavar="FILE")
    s.add_argument("--reference", help="reference file (e.g. a KernelBench problem)")
    _add_job_options(s)
    s.set_defaults(func=cmd_evaluate)

    s = sub.add_parser("compare", help="compare kernel files with a reference file")
    s.add_argument("reference")
    s.add_argument("files", nargs="+", metavar="FILE")
    _add_job_options(s)
    s.set_defaults(func=cmd_compare)

    for name, helptext, func in (
        ("watch", "follow a job's events to its result", cmd_watch),
        ("get", "show a job", cmd_get),
        ("cancel", "cancel a job", cmd_cancel),
    ):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("job")
        s.add_argument("--json", action="store_true")
        if name == "watch":
            s.add_argument("--after", type=int, default=0, help="replay after this sequence")
            s.add_argument("--no-progress", action="store_true")
        s.set_defaults(func=func)

    s = sub.add_parser("jobs", help="list jobs, newest first")
    s.add_argument("--state", choices=list(STATES), default="unspecified")
    s.add_argument("--tag", default="")
    _add_label_option(s, "only jobs with this label (repeatable: every one of them)")
    s.add_argument("--limit", type=int, default=20)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_jobs)

    s = sub.add_parser("devices", help="GPUs, their health and recent XIDs (admin token)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_devices)

    s = sub.add_parser("events", help="follow operations events (admin token)")
    s.add_argument("--replay", type=int, default=0, help="replay this many recent events")
    s.add_argument("--json", action="store_true", help="one JSON object per line")
    s.set_defaults(func=cmd_events)

    s = sub.add_parser("reset-gpu", help="drain and reset a GPU (admin token)")
    s.add_argument("index", type=int)
    s.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    s.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds running jobs get to finish (default 30)",
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_reset_gpu)

    s = sub.add_parser("restart-workers", help="replace the workers (admin token)")
    s.add_argument("--device", type=int, default=None, help="GPU index (default: every device)")
    s.set_defaults(func=cmd_restart_workers)

    s = sub.add_parser("cleanup", help="delete old finished jobs now (admin token)")
    s.add_argument(
        "--older-than-hours",
        type=float,
        default=None,
        metavar="H",
        help="cut-off (default: the server's retention period)",
    )
    s.set_defaults(func=cmd_cleanup)

    s = sub.add_parser("stats", help="counters and latencies (admin token)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_stats)

    s = sub.add_parser(
        "mcp", help="serve the tools for LLM agents over MCP (needs kerneleval-client[mcp])"
    )
    s.add_argument("--http-port", type=int, default=0, help="streamable HTTP here; else stdio")
    s.add_argument("--http-host", default="127.0.0.1", help="address for --http-port")

    s = sub.add_parser("doctor", help="print a diagnostics report to paste into an issue")
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--service-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="deadline of the calls to the service (default 5)",
    )
    s.set_defaults(func=cmd_doctor)
    return p


def cmd_mcp(a: argparse.Namespace) -> int:
    try:
        from .mcp_server import serve
    except ImportError as e:
        print(f"error: kerneleval mcp needs the mcp extra ({e}): "
              "pip install 'kerneleval-client[mcp]'", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    return serve(
        resolve_address(a.address),
        admin_token=a.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        credentials=_credentials(a),
        http_port=a.http_port,
        http_host=a.http_host,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # `serve` hands every argument after it to the server's own parser.
    if "serve" in args_list:
        i = args_list.index("serve")
        head = parser.parse_args([*args_list[:i], "serve"])
        if head.command == "serve":
            return cmd_serve(args_list[i + 1 :])
    a = parser.parse_args(args_list)
    if a.command == "mcp":
        return cmd_mcp(a)
    try:
        with Client(
            resolve_address(a.address),
            timeout=a.timeout,
            admin_token=a.admin_token,
            credentials=_credentials(a),
        ) as c:
            return int(a.func(a, c))
    except errors.KernelEvalError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_SERVICE
    except (OSError, ValueError, json_format.ParseError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
