"""Jobs built ahead (prebuild.py) through the shared artifact store: what a node asks of the
`--role builder`s for a job whose every source is a Triton or raw CUDA kernel launched from its
IOContract, under which key, and what is kept.

It is the load_inline machinery of artifact_store.py and builder_node.py (one request
table, one lease, one artifact table, one wait), with another kind of request:
- **What is built**: the job's kernel and reference sources only (`build_spec`: no options, no
  client tag, no labels), for the architecture the node would build for (paths.py
  `BuildPaths.build_arch`: the job's GPU's, or the one all its GPUs share; prebuild.cpu_arch()
  for raw CUDA on a node without a GPU), by `engine.build_job` in a build process, exactly as
  a node's own build process builds it (Triton: `triton.compile` for that architecture, in a
  child with Triton in compiled mode where the build process has none; raw CUDA: nvcc).
- **The key** (`key`): the kernel and reference sources with their IOContracts and entry
  points, the architecture, and the versions (`ExtensionBuilds.versions_of`: torch and CUDA,
  triton, g++ and nvcc, the load_inline recipe and RECIPE_VERSION here). A builder takes only
  requests of exactly its versions and computes the key again from the request's sources, the
  request's architecture and its own versions: a request whose key differs is refused.
- **What is kept** (`kept`): what a build process answers that the node would keep or act on
  the same way for every job with that code: the artifacts (one cubin per source, as
  prebuild.check_artifacts wants them, each for the request's architecture: `fits`; a node
  reads back only such, `read_kept`) or `run_whole`, as a serialized BuildOutcome (no job
  id). A build that ends the job (a compile error, an exception at a module's top level) is
  that job's answer only, as on a node, where the compile cache keeps artifacts only: the
  builder ends the request as failed with the outcome in it (`failure`), the node answers the
  jobs waiting for it with that outcome and keeps nothing. A build process lost on the builder
  (killed, past its time) fails the request with a plain message: the node builds it itself.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from typing import Any, Protocol

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from . import prebuild

# Part of every builder's versions (and so of every key): bump when what build_job makes of
# the same sources for the same architecture would differ (engine/build.py and its backends).
RECIPE_VERSION = "1"
REQUEST_FIELD = "built_ahead"  # a build request's arguments: {"built_ahead": <the spec>}
FAILURE_PREFIX = "built-ahead outcome "  # a failed request's error that carries the outcome
_ARCH = re.compile(r"sm_[0-9]{2,3}[a-z]?")


class Host(Protocol):
    """The node's job builds, as the shared artifact store sees them (paths.BuildPaths)."""

    @property
    def queue(self) -> Any: ...  # `job_id in queue`: still waiting to start here
    @property
    def store(self) -> Any: ...
    @property
    def hub(self) -> Any: ...
    @property
    def job_processes(self) -> Any: ...
    @property
    def compile_cache(self) -> Any: ...
    @property
    def max_timeout_s(self) -> float: ...

    def built_elsewhere(
        self, job_id: str, arch: str, built_by: str, built: job_channel_pb2.BuildOutcome
    ) -> None: ...

    def dispatch(self) -> None: ...


def build_spec(spec: kernel_pb2.JobSpec) -> kernel_pb2.JobSpec:
    """What a build of the job is made of: its kernel and reference sources, nothing else."""
    out = kernel_pb2.JobSpec()
    out.kernel.CopyFrom(spec.kernel)
    if spec.HasField("reference"):
        out.reference.CopyFrom(spec.reference)
    return out


def key(spec: kernel_pb2.JobSpec, arch: str, versions: str) -> str:
    """The content key of the job's build for `arch` with `versions`."""
    h = hashlib.sha256(b"kerneleval built ahead\0")
    parts = [versions.encode(), arch.encode()]
    parts += [k.SerializeToString(deterministic=True) for k in (spec.kernel, spec.reference)]
    parts.append(b"1" if spec.HasField("reference") else b"0")
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def request_arguments(spec: kernel_pb2.JobSpec) -> str:
    """A build request's `arguments`: the build's spec (build_spec), base64 in JSON."""
    data = build_spec(spec).SerializeToString(deterministic=True)
    return json.dumps({REQUEST_FIELD: base64.b64encode(data).decode()})


def is_request(call: object) -> bool:
    """A build request's parsed arguments are a job's build (not a load_inline call)."""
    return isinstance(call, dict) and REQUEST_FIELD in call


def parse_request(call: dict[str, Any]) -> tuple[kernel_pb2.JobSpec | None, str]:
    """(the build's spec, "") from a request's parsed arguments, or (None, why not)."""
    try:
        data = base64.b64decode(str(call[REQUEST_FIELD]), validate=True)
        spec = kernel_pb2.JobSpec.FromString(data)
    except (binascii.Error, DecodeError, ValueError) as exc:
        return None, f"not a job's sources: {exc}"
    if set(call) != {REQUEST_FIELD} or spec != build_spec(spec):
        return None, "a build request of a job carries its kernel and reference sources only"
    return spec, ""


def refusal(spec: kernel_pb2.JobSpec, arch: str) -> str:
    """Why a builder does not build this job ("" when it does)."""
    if not _ARCH.fullmatch(arch):
        return f"{arch!r} is not a CUDA architecture (sm_90, ...)"
    if not prebuild.kind(spec, judged=True):  # a node that cannot judge never asks
        return "its sources are not kernels launched from their IOContract (it runs whole)"
    return ""


def fits(spec: kernel_pb2.JobSpec, arch: str, built: job_channel_pb2.BuildOutcome) -> bool:
    """The artifacts are what a build of the job for `arch` answers: one cubin per source, in
    order (prebuild.check_artifacts), each for that architecture."""
    artifacts = list(built.artifacts)
    if not artifacts or prebuild.check_artifacts(spec, artifacts):
        return False
    return all(a.arch == arch for a in artifacts)


def kept(spec: kernel_pb2.JobSpec, arch: str, built: job_channel_pb2.BuildOutcome) -> bytes | None:
    """What the shared store keeps of a build process's answer for `arch` (serialized), or
    None when it is not kept: a result (the job's own end), or artifacts that are not one cubin
    per source for that architecture."""
    if built.HasField("result"):
        return None
    if built.run_whole:
        return job_channel_pb2.BuildOutcome(run_whole=built.run_whole).SerializeToString()
    if not fits(spec, arch, built):
        return None
    return job_channel_pb2.BuildOutcome(artifacts=built.artifacts).SerializeToString()


def read_kept(
    spec: kernel_pb2.JobSpec, arch: str, data: bytes
) -> job_channel_pb2.BuildOutcome | None:
    """An artifact of the shared store as a build process's answer for this job and `arch`, or
    None when it is not one that `kept` writes."""
    try:
        built = job_channel_pb2.BuildOutcome.FromString(data)
    except DecodeError:
        return None
    if built.HasField("result") or built.HasField("extension") or built.job_id:
        return None
    if built.run_whole:
        return None if built.artifacts else built
    return built if fits(spec, arch, built) else None


def failure(built_by: str, built: job_channel_pb2.BuildOutcome) -> str:
    """A failed request's error for a build that ended the job (its result)."""
    outcome = job_channel_pb2.BuildOutcome(result=built.result).SerializeToString()
    body = {"built_by": built_by, "outcome": base64.b64encode(outcome).decode()}
    return FAILURE_PREFIX + json.dumps(body)


def read_failure(error: str) -> tuple[str, job_channel_pb2.BuildOutcome] | None:
    """(who built it, the outcome that ends the job) from a failed request's error; None for
    a failure without one (the build process was lost: the node builds it itself)."""
    if not error.startswith(FAILURE_PREFIX):
        return None
    try:
        body = json.loads(error[len(FAILURE_PREFIX) :])
        built = job_channel_pb2.BuildOutcome.FromString(base64.b64decode(body["outcome"]))
        built_by = str(body["built_by"])
    except (ValueError, KeyError, TypeError, binascii.Error, DecodeError):
        return None
    if not built.HasField("result") or built.artifacts or built.run_whole:
        return None
    return built_by, built
