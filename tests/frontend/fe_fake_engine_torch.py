"""fe_fake_engine with torch imported, as the service's own engine has it: its job processes
say torch's version in their Hello, and a node's versions for the builders are made of that
(tests/store/test_builder_ahead_service.py: a node whose GPU is acted out, asking a builder of
its versions). Used with `serve --engine fe_fake_engine_torch`."""

from __future__ import annotations

import torch  # noqa: F401 - its version is what the job processes report
from fe_fake_engine import EngineConfig, Outcome, build_job, configure_process_environment, run_job

__all__ = ["EngineConfig", "Outcome", "build_job", "configure_process_environment", "run_job"]
