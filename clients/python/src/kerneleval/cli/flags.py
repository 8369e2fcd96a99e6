"""The options: those every command takes (before or after its name), the job's, and what the
connection's ones give (credentials, admin token)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

from kerneleval.client import ADDRESS_ENV, ADMIN_TOKEN_ENV, TENANT_TOKEN_ENV
from kerneleval.kernelbench import TYPE_NAMES

# What options are added to: a parser or one of its argument groups.
_Options = argparse._ActionsContainer


def parse_label(value: str) -> tuple[str, str]:
    """A `--label KEY=VALUE` argument (the server checks keys and values further)."""
    key, sep, val = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. --label problem=19_ReLU), got {value!r}"
        )
    return key.strip(), val


def add_label_option(p: _Options, helptext: str) -> None:
    p.add_argument(
        "--label",
        dest="labels",
        action="append",
        type=parse_label,
        default=[],
        metavar="KEY=VALUE",
        help=helptext,
    )


def add_global_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """The options every command takes, before or after its name. On the commands they
    default to SUPPRESS, so that a value given before the command is not overwritten."""

    def d(value: object) -> object:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("global options (before or after the command)")
    g.add_argument(
        "--server",
        "--address",
        dest="address",
        default=d(None),
        metavar="ADDRESS",
        help=f"server: host:port, a host alone (port 50051) or unix:PATH (env {ADDRESS_ENV}; "
        "default 127.0.0.1:50051)",
    )
    g.add_argument(
        "--admin-token",
        default=d(None),
        metavar="TOKEN",
        help=f"token of the operations commands (env {ADMIN_TOKEN_ENV}); never printed",
    )
    g.add_argument(
        "--admin-token-file",
        default=d(None),
        metavar="FILE",
        help="read the admin token from FILE (e.g. state/admin_token)",
    )
    g.add_argument(
        "--tenant-token",
        default=d(None),
        metavar="TOKEN",
        help=f"your tenant's token, for a service with tenants (env {TENANT_TOKEN_ENV}); "
        "never printed",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=d(None),
        metavar="S",
        help="deadline of each call in seconds (default: none)",
    )
    g.add_argument(
        "--reconnect-timeout",
        type=float,
        default=d(60.0),
        metavar="S",
        help="how long to wait for a server that is down before giving up on a job's stream "
        "(default 60)",
    )
    g.add_argument(
        "--tls-ca",
        default=d(os.environ.get("KERNELEVAL_TLS_CA") or None),
        metavar="PEM",
        help="use TLS, trusting this CA certificate (env KERNELEVAL_TLS_CA)",
    )
    g.add_argument("--tls", action="store_true", default=d(False), help="TLS with system roots")
    g.add_argument(
        "--json",
        action="store_true",
        default=d(False),
        help="print JSON (every field, defaults included); see each command's help for its shape",
    )
    g.add_argument(
        "--jsonl",
        action="store_true",
        default=d(False),
        help="evaluate, compare, gpumode, kernelbench, watch, events: one JSON object per event "
        "and line, as they come",
    )
    g.add_argument(
        "--no-progress",
        action="store_true",
        default=d(False),
        help="no progress bars on stderr (messages about the connection still come)",
    )
    g.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default=d("auto"),
        help="colour: auto (a terminal, without NO_COLOR) by default",
    )


def add_job_options(p: argparse.ArgumentParser, *, gpu_mode: bool = False) -> None:
    """The job's options; a GPU MODE task leaves out what it does not use (its type is fixed,
    generate_input makes the data, each case runs once, check_implementation judges)."""
    g = p.add_argument_group("job")
    if gpu_mode:
        g.add_argument("--entry-point", default="", help="function to run (custom_kernel)")
    else:
        _add_source_options(g)
    g.add_argument(
        "--perf-trials", type=int, metavar="N", help="timed trials (100; 0 skips timing)"
    )
    g.add_argument("--warmup", type=int, metavar="N", help="warm-up runs before timing (10)")
    if gpu_mode:
        g.add_argument(
            "--seed",
            type=int,
            metavar="N",
            help="mixed into each case's seed, as GPU MODE's secret seed (default: the task's)",
        )
    else:
        _add_check_options(g)
    _add_run_options(g)
    o = p.add_argument_group("output")
    o.add_argument("--detach", action="store_true", help="submit, print the job id(s), exit")
    o.add_argument(
        "--max-in-flight",
        type=int,
        default=16,
        metavar="N",
        help="with several files: jobs in flight at once (default 16)",
    )


def _add_source_options(g: _Options) -> None:
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
    g.add_argument(
        "--preset",
        choices=["service", "kernelbench"],
        default="service",
        help="option defaults: the service's (5 correctness trials, 100 timed, 10 warm-up, "
        "seed 42), or KernelBench's eval_kernel_against_ref (1, 10, 3, seed 42, atol=rtol=1e-4); "
        "the options below override either",
    )


def _add_check_options(g: _Options) -> None:
    g.add_argument("--correct-trials", type=int, metavar="N", help="correctness trials (5)")
    g.add_argument(
        "--atol",
        type=float,
        metavar="X",
        help="absolute tolerance of the output check (default by dtype: 1e-4 float32, "
        "1e-2 float16/bfloat16, 0 integers)",
    )
    g.add_argument("--rtol", type=float, metavar="X", help="relative tolerance (default: as atol)")
    g.add_argument("--seed", type=int, metavar="N", help="seed of inputs and weights (default 42)")
    g.add_argument(
        "--no-check-precision",
        action="store_true",
        help="skip the float64 run of the reference that flags lower_precision",
    )
    g.add_argument(
        "--compile-baseline",
        action="store_true",
        help="also time torch.compile of the reference (a Model), as KernelBench's "
        "run_and_check.py: the result gives the speedup over eager and over torch.compile "
        "(compile time untimed)",
    )


def _add_run_options(g: _Options) -> None:
    g.add_argument("--device", type=int, help="GPU index (default: the scheduler picks)")
    g.add_argument(
        "--device-model",
        default="",
        help="run only on a GPU whose name contains this, any case (e.g. H100; "
        "`kerneleval devices` lists the names)",
    )
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
    add_label_option(g, "a label of the job, for your bookkeeping and `jobs --label` (repeatable)")


def credentials(a: argparse.Namespace) -> grpc.ChannelCredentials | None:
    if a.tls_ca:
        return grpc.ssl_channel_credentials(Path(a.tls_ca).read_bytes())
    if a.tls:
        return grpc.ssl_channel_credentials()
    return None


def admin_token(a: argparse.Namespace) -> str | None:
    if a.admin_token:
        return str(a.admin_token)
    if a.admin_token_file:
        return Path(a.admin_token_file).read_text(encoding="utf-8").strip() or None
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def tenant_token(a: argparse.Namespace) -> str | None:
    return str(a.tenant_token) if a.tenant_token else os.environ.get(TENANT_TOKEN_ENV) or None
