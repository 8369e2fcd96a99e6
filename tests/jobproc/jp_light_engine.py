"""A light engine for the zygote tests: imports nothing heavy, marks that it was configured."""

from __future__ import annotations

import os


def configure_process_environment() -> None:
    os.environ["JP_LIGHT_ENGINE_CONFIGURED"] = "1"


def run_job(spec: object, reporter: object, config: object) -> object:
    raise NotImplementedError("the probe job main does not run jobs")
