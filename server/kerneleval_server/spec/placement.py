"""Where a job may run: the GPU index and the GPU model its options name.

A model is matched against the GPU's name as NVML gives it (ListDevices' `name`), ignoring
case, as a substring: "H100" matches "NVIDIA H100 80GB HBM3". The same rule runs here (the
local queue, validation) and in SQL (store.claim: a node takes only jobs its GPUs match), so it
is kept to what both can say exactly: lower-cased text, no wildcard characters (validation
admits letters, digits, spaces, '.' and '-')."""

from __future__ import annotations

import re
from collections.abc import Sequence

from kerneleval.v1 import kernel_pb2

MAX_MODEL_CHARS = 64
MODEL_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 .\-]*")


def wanted_device(spec: kernel_pb2.JobSpec) -> int | None:
    """The device index a job names (None: any device)."""
    return spec.options.device_index if spec.options.HasField("device_index") else None


def wanted_model(spec: kernel_pb2.JobSpec) -> str:
    """The GPU model a job names, lower-cased ("" for any)."""
    return spec.options.device_model.strip().lower()


def fits(index: int | None, model: str, device_index: int, device_name: str) -> bool:
    """A job that names GPU `index` (None: any) and `model` ("": any) may run on this one."""
    return index in (None, device_index) and (not model or model.lower() in device_name.lower())


def may_run_on(spec: kernel_pb2.JobSpec, device_index: int, device_name: str) -> bool:
    return fits(wanted_device(spec), wanted_model(spec), device_index, device_name)


def refusal(spec: kernel_pb2.JobSpec, devices: Sequence[tuple[int, str]]) -> str:
    """Why no GPU of `devices` ((index, name), a gateway's from every node: indices repeat)
    can take a job that names a model ("" when one can, or when none is known yet)."""
    if not spec.options.device_model or not devices:
        return ""
    if any(may_run_on(spec, i, name) for i, name in devices):
        return ""
    which = (
        f"GPU {spec.options.device_index} here is not"
        if spec.options.HasField("device_index")
        else "no GPU here is"
    )
    listed = ", ".join(f"{i}: {name or 'unnamed'}" for i, name in sorted(devices))
    return f"{which} a {spec.options.device_model!r} (devices: {listed})"
