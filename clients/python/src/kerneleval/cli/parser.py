"""The parser: every command and its options, the help texts, and argparse's errors with a
suggestion and without secrets."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import kerneleval
from kerneleval.cli.evaluate import cmd_compare, cmd_evaluate, cmd_gpumode
from kerneleval.cli.flags import add_global_options, add_job_options, add_label_option
from kerneleval.cli.jobs import STATES, cmd_cancel, cmd_get, cmd_jobs, cmd_watch
from kerneleval.cli.kernelbench import cmd_kernelbench
from kerneleval.cli.operations import (
    cmd_builders,
    cmd_cleanup,
    cmd_devices,
    cmd_doctor,
    cmd_events,
    cmd_reset_gpu,
    cmd_restart_workers,
    cmd_stats,
)
from kerneleval.cli.output import EXIT_USAGE

_SECRET_OPTIONS = ("--admin-token", "--tenant-token")


class _Parser(argparse.ArgumentParser):
    """argparse that never prints a secret: its errors show the admin token as ***."""

    secrets: tuple[str, ...] = ()

    def error(self, message: str) -> NoReturn:
        message += _did_you_mean(self, message)
        for secret in _Parser.secrets:
            message = message.replace(secret, "***")
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def _did_you_mean(parser: argparse.ArgumentParser, message: str) -> str:
    """A suggestion to add to argparse's error: "; did you mean 'evaluate'?" for a mistyped
    command or choice, the closest options for mistyped ones ("--perf-trails: did you mean
    --perf-trials?"); "" when nothing is close."""
    if m := _INVALID_CHOICE.search(message):
        choices = re.findall(r"'([^']*)'", m.group(2)) or m.group(2).split(", ")
        near = difflib.get_close_matches(m.group(1), choices, n=1)
        return f"; did you mean '{near[0]}'?" if near else ""
    if m := _UNRECOGNIZED.search(message):
        known = _option_strings(parser)
        found = []
        for arg in m.group(1).split():
            flag = arg.split("=", 1)[0]
            if flag.startswith("-") and flag not in known:
                near = difflib.get_close_matches(flag, sorted(known), n=1)
                if near:
                    found.append(f"{flag}: did you mean {near[0]}?")
        return "".join(f"; {f}" for f in found)
    return ""


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option of the parser and its commands."""
    out: set[str] = set()
    for action in parser._actions:
        out.update(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def hide_secrets(argv: Sequence[str]) -> None:
    """The parser's errors show the values of secret options in argv as ***."""
    _Parser.secrets = _secrets(argv)


def _secrets(argv: Sequence[str]) -> tuple[str, ...]:
    """The values given to secret options in argv (`--admin-token X`, `--admin-token=X`)."""
    out = []
    for i, arg in enumerate(argv):
        for opt in _SECRET_OPTIONS:
            if arg == opt and i + 1 < len(argv):
                out.append(argv[i + 1])
            elif arg.startswith(opt + "="):
                out.append(arg.split("=", 1)[1])
    return tuple(s for s in out if s)


NODE_HELP = "through a gateway: the node that owns the device (as `devices` shows it)"


MAIN_EXAMPLES = """\
examples:
  kerneleval evaluate model_new.py --reference level1/19_ReLU.py
  kerneleval compare level1/19_ReLU.py a.py b.py c.py --json > results.json
  cat model_new.py | kerneleval compare level1/19_ReLU.py -
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/level1
  kerneleval gpumode reference-kernels/problems/pmpp_v2/vectoradd_py my_submission.py
  kerneleval watch JOB_ID --jsonl
  kerneleval devices --admin-token-file state/admin_token

Exit codes: 0 verdict OK, 1 another verdict, 2 usage error, 3 service error, 4 not evaluated
(CANNOT_RUN_HERE: the service's host lacks the GPU the kernel needs; not a failure of the
kernel), 130 interrupted. Of several jobs: 1 if any failed, else 4 if any was not evaluated.
Colour follows NO_COLOR and whether the output is a terminal; --color overrides.
"""


EPILOGS = {
    "evaluate": """\
examples:
  kerneleval evaluate model_new.py                       # runs it, nothing to compare with
  kerneleval evaluate model_new.py --reference problem.py --perf-trials 200
  kerneleval evaluate k1.py k2.py k3.py --reference problem.py --max-in-flight 8
  kerneleval evaluate add.py --type triton --io io.json --atol 1e-3

--json prints a list with an object {"file", "job"} per file (or {"file", "error"} for one
the service refused), one file or many; --jsonl prints {"file", "event"} per event as it comes.
""",
    "compare": """\
examples:
  kerneleval compare level1/19_ReLU.py model_new.py
  kerneleval compare level1/19_ReLU.py - < model_new.py           # the kernel from stdin
  kerneleval compare level1/19_ReLU.py a.py b.py --preset kernelbench --json | jq '.[].job.result'

--json and --jsonl: as for evaluate.
""",
    "gpumode": """\
examples:
  kerneleval gpumode problems/pmpp_v2/vectoradd_py                # the task's submission.py
  kerneleval gpumode problems/pmpp_v2/vectoradd_py mine.py other.py --perf-trials 50
  kerneleval gpumode vectoradd_py mine.py --json | jq '.[0].job.result.benchmarkCases'

Every test case of task.yml runs once (check_implementation judges the output), then every
benchmark case is checked and timed, the submission and ref_kernel on the same data. The
result shows a row per case (its arguments, pass or FAIL, message, median times, speedup);
the job's runtime and speedup are geometric means over the benchmarks, as GPU MODE ranks.
A submission that needs CUDA on a host without a GPU ends CANNOT_RUN_HERE ("not run here
(needs a GPU)"): not evaluated, exit code 4, not a failure of the submission.

--json and --jsonl: as for evaluate (a list of {"file", "job"}, the file being the
submission's path). A folder that is not a GPU MODE task is a usage error (exit code 2).
""",
    "watch": """\
examples:
  kerneleval watch 3f2a9c... ; kerneleval watch 3f2a9c... --after 12 --jsonl

It waits for a server that is down (up to --reconnect-timeout, saying so) and re-attaches
when the stream drops. --json prints the finished job; --jsonl each event as it comes.
Ctrl-C stops watching; the job goes on.
""",
    "kernelbench": """\
examples:
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/KernelBench
  kerneleval kernelbench runs/my_run --level 1 --problems KernelBench/KernelBench/level1 \\
      --subset 1-20 --correct-trials 5 --perf-trials 100      # eval_from_generations' settings

Kernels are RUN_DIR/level_{L}_problem_{P}_sample_{S}_kernel.py, problems PROBLEMS/{P}_{Name}.py
(or PROBLEMS/level{L}/...). Each result goes to RUN_DIR/kerneleval/ as its job ends; run the
same command again after an interruption and it goes on where it stopped. At the end
RUN_DIR/eval_results.json and RUN_DIR/analysis_results.json (fast_p, geometric mean speedup)
are written; --json prints the latter.
""",
}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kerneleval",
        description="Compile, check and time GPU kernels on a kerneleval server.",
        epilog=MAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--version", action="version", version=f"kerneleval {kerneleval.__version__} (client)"
    )
    add_global_options(p, suppress=False)
    common = _Parser(add_help=False, allow_abbrev=False)
    add_global_options(common, suppress=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, helptext: str, **kw: Any) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=helptext,
            description=helptext,
            parents=[common],
            epilog=EPILOGS.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
            **kw,
        )

    s: argparse.ArgumentParser = sub.add_parser(
        "serve", help="start the server (needs kerneleval-server)", add_help=False
    )
    s.add_argument("args", nargs=argparse.REMAINDER)

    s = command("evaluate", "evaluate kernel files (compare with --reference); several at once")
    s.add_argument("files", nargs="+", metavar="FILE", help="kernel source files; - is stdin")
    s.add_argument("--reference", help="reference file (e.g. a KernelBench problem); - is stdin")
    add_job_options(s)
    s.set_defaults(func=cmd_evaluate)

    s = command("compare", "compare kernel files with a reference file")
    s.add_argument("reference", help="reference file (e.g. a KernelBench problem); - is stdin")
    s.add_argument("files", nargs="+", metavar="FILE", help="kernel source files; - is stdin")
    add_job_options(s)
    s.set_defaults(func=cmd_compare)

    s = command("kernelbench", "evaluate a KernelBench run's generated kernels, KernelBench-style")
    s.add_argument("run_dir", metavar="RUN_DIR", help="folder of generated kernels")
    s.add_argument("--level", type=int, required=True, help="KernelBench level (1, 2, 3, 4)")
    s.add_argument(
        "--problems",
        required=True,
        metavar="PATH",
        help="the level's problem folder, or the folder that holds level{N}/",
    )
    s.add_argument("--subset", metavar="IDS", help="only these problems, e.g. 1-20 or 19,23,40")
    s.add_argument(
        "--inputs",
        metavar="FILE",
        help='JSON {"19": IOContract, ...} replacing those problems\' get_inputs() (e.g. '
        "smaller shapes on a host without a GPU)",
    )
    add_job_options(s)
    s.set_defaults(func=cmd_kernelbench, preset="kernelbench")

    s = command("gpumode", "evaluate GPU MODE submissions against a task folder, as its harness")
    s.add_argument(
        "task_dir",
        metavar="TASK_DIR",
        help="the task: reference.py and task.yml (tests, benchmarks, files), e.g. "
        "reference-kernels/problems/pmpp_v2/vectoradd_py",
    )
    s.add_argument(
        "submissions",
        nargs="*",
        metavar="SUBMISSION",
        help="files defining custom_kernel(data); - is stdin (default: TASK_DIR/submission.py)",
    )
    add_job_options(s, gpu_mode=True)
    s.set_defaults(func=cmd_gpumode, preset="service")

    s = command("watch", "follow a job's events to its result")
    s.add_argument("job")
    s.add_argument("--after", type=int, default=0, help="replay after this sequence")
    s.set_defaults(func=cmd_watch)

    s = command("get", "show a job (--json: the Job object)")
    s.add_argument("job")
    s.set_defaults(func=cmd_get)

    s = command("cancel", "cancel a job")
    s.add_argument("job")
    s.set_defaults(func=cmd_cancel)

    s = command("jobs", "list jobs, newest first (--json: a list of Job objects)")
    s.add_argument("--state", choices=list(STATES), default="unspecified")
    s.add_argument("--tag", default="", help="only jobs with this client tag")
    add_label_option(s, "only jobs with this label (repeatable: every one of them)")
    s.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    s.set_defaults(func=cmd_jobs)

    s = command("devices", "GPUs, their health and recent XIDs (admin token)")
    s.set_defaults(func=cmd_devices)

    s = command("events", "follow operations events (admin token; --json: one per line)")
    s.add_argument("--replay", type=int, default=0, help="replay this many recent events")
    s.set_defaults(func=cmd_events)

    s = command("reset-gpu", "drain and reset a GPU (admin token)")
    s.add_argument("index", type=int)
    s.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    s.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds running jobs get to finish (default 30)",
    )
    s.add_argument("--node", default="", help=NODE_HELP)
    s.set_defaults(func=cmd_reset_gpu)

    s = command("restart-workers", "replace the workers (admin token)")
    s.add_argument("--device", type=int, default=None, help="GPU index (default: every device)")
    s.add_argument("--node", default="", help=NODE_HELP)
    s.set_defaults(func=cmd_restart_workers)

    s = command("cleanup", "delete old finished jobs now (admin token)")
    s.add_argument(
        "--older-than-hours",
        type=float,
        default=None,
        metavar="H",
        help="cut-off (default: the server's retention period)",
    )
    s.set_defaults(func=cmd_cleanup)

    s = command("stats", "counters and latencies (admin token)")
    s.set_defaults(func=cmd_stats)

    s = command("builders", "the load_inline builders of a shared store (admin token)")
    s.set_defaults(func=cmd_builders)

    s = command(
        "tenant-token",
        "print a new tenant token and its line for the service's --tenants-file (offline)",
    )
    s.add_argument("name", help="the tenant: letters, digits, '_', '.', '-' (1-64)")

    s = command("mcp", "serve the tools for LLM agents over MCP (needs kerneleval-client[mcp])")
    s.add_argument("--http-port", type=int, default=0, help="streamable HTTP here; else stdio")
    s.add_argument("--http-host", default="127.0.0.1", help="address for --http-port")

    s = command("doctor", "print a diagnostics report to paste into an issue")
    s.add_argument(
        "--service-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="deadline of the calls to the service (default 5)",
    )
    s.set_defaults(func=cmd_doctor)
    return p
