"""The process started for one job with debug aids (isolated.py starts it):

    python -m kerneleval_server.engine.isolated_child --spec S --out R --work-dir D

reads a JobSpec, runs run_job, writes the EvalResult. Its own module, so that run_job's side
(runner.py, which starts it through isolated.py) and this one import each other nowhere.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kerneleval.v1 import kernel_pb2

from .types import EngineConfig, NullReporter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--work-dir", required=True)
    a = p.parse_args()
    from . import configure_process_environment

    configure_process_environment()
    from .runner import run_job
    from .tamper import arm

    arm()  # the job's code runs here from now on (tamper.py)

    spec = kernel_pb2.JobSpec()
    spec.ParseFromString(Path(a.spec).read_bytes())
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    outcome = run_job(spec, NullReporter(), EngineConfig(work_dir=work))
    Path(a.out).write_bytes(outcome.result.SerializeToString())
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: a dead CUDA context can hang it


if __name__ == "__main__":
    main()
