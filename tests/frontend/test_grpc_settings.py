"""What the server sets for gRPC before gRPC loads (kerneleval_server/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import kerneleval_server

# Records GRPC_EXPERIMENTS as the first `import grpc` of the process starts (gRPC reads it
# then, once), then imports the server's entry points the way each command does.
PROBE = """
import importlib.abc, os, sys
seen = []
class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "grpc" and not seen:
            seen.append(os.environ.get("GRPC_EXPERIMENTS"))
        return None
sys.meta_path.insert(0, Finder())
import {module}
print(seen[0] if seen else "grpc not imported")
"""


def _as_grpc_loads(module: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    p = subprocess.run(
        [sys.executable, "-c", PROBE.format(module=module)],
        env={**clean, **env}, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return p.stdout.strip()


def test_grpc_loads_in_the_server_without_its_event_engine_listener() -> None:
    """`python -m kerneleval_server`, the `kerneleval-server` script and `kerneleval serve`
    (which runs the former in a fresh interpreter) all load gRPC with the setting."""
    for module in ("kerneleval_server.main", "kerneleval_server.__main__"):
        assert _as_grpc_loads(module) == kerneleval_server.GRPC_EXPERIMENTS == (
            "-event_engine_listener"
        )


def test_an_operators_grpc_experiments_win() -> None:
    assert _as_grpc_loads("kerneleval_server.main", GRPC_EXPERIMENTS="-foo") == "-foo"
