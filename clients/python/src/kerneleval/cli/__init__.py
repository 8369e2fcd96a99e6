"""The `kerneleval` command.

Exit codes: 0 success (verdict OK), 1 the job finished without verdict OK (or was cancelled
or failed), 2 usage error, 3 the service refused or could not be reached, 4 not evaluated:
VERDICT_CANNOT_RUN_HERE (the service's host lacks the GPU the kernel needs; not a failure of
the kernel, and not a pass either), 130 interrupted. Of several jobs, any failure gives 1, else
any not evaluated 4. Global options (--server, --admin-token, --json, ...) go before or after
the command.

The modules, from the entry point down (each imports only those below it):
    app          main(): parse, dispatch with a Client, errors to messages and exit codes;
                 `serve` and `mcp`
    parser       every command and its options, help texts, argparse's errors
    evaluate     evaluate, compare, gpumode (one Run stream, one RunBatch stream, --detach)
    kernelbench  kernelbench (a KernelBench run's kernels, results written as they end)
    jobs         watch, get, cancel, jobs
    operations   devices, events, reset-gpu, restart-workers, cleanup, stats, builders, doctor
    follow       one job followed to its end on the client's run/watch (which re-attach)
    specs        the command line to JobSpecs: options, source files, labels, GPU MODE tasks
    flags        the options' declarations; the connection's credentials and admin token
    output       progress and messages (stderr), tables or JSON (stdout), exit codes
"""

from __future__ import annotations

from kerneleval.cli.app import SERVE, main
from kerneleval.cli.output import (
    EXIT_INTERRUPTED,
    EXIT_NOT_RUN,
    EXIT_OK,
    EXIT_SERVICE,
    EXIT_USAGE,
    EXIT_VERDICT,
    exit_code,
)
from kerneleval.cli.parser import MAIN_EXAMPLES, build_parser

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_NOT_RUN",
    "EXIT_OK",
    "EXIT_SERVICE",
    "EXIT_USAGE",
    "EXIT_VERDICT",
    "MAIN_EXAMPLES",
    "SERVE",
    "build_parser",
    "exit_code",
    "main",
]
