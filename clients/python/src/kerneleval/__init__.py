"""kerneleval: client library for the kerneleval gRPC service.

    from kerneleval import Client, job_from_files
    with Client() as c:
        job = c.evaluate(job_from_files("model_new.py", "model.py"))

The names below load on first use, so that `import kerneleval.v1` (the generated code, which
the server and its workers import too) does not pull in the client and grpc.aio. For RL loops,
`kerneleval.rl` has `reward` and `spec_from_completion`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Client": "kerneleval.client",
    "AsyncClient": "kerneleval.client",
    "BatchEvent": "kerneleval.client",
    "job_from_files": "kerneleval.kernelbench",
    "load_kernel": "kerneleval.kernelbench",
    "kernel_source": "kerneleval.kernelbench",
    "KernelEvalError": "kerneleval.errors",
    "InvalidArgument": "kerneleval.errors",
    "ResourceExhausted": "kerneleval.errors",
    "Unavailable": "kerneleval.errors",
}
_SUBMODULES = {"rl"}

if TYPE_CHECKING:
    from kerneleval import rl
    from kerneleval.client import AsyncClient, BatchEvent, Client
    from kerneleval.errors import InvalidArgument, KernelEvalError, ResourceExhausted, Unavailable
    from kerneleval.kernelbench import job_from_files, kernel_source, load_kernel

__all__ = [
    "AsyncClient",
    "BatchEvent",
    "Client",
    "InvalidArgument",
    "KernelEvalError",
    "ResourceExhausted",
    "Unavailable",
    "job_from_files",
    "kernel_source",
    "load_kernel",
    "rl",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"kerneleval.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kerneleval' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
