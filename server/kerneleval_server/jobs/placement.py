"""Where a job may run: the GPU index and the GPU model its options name.

A model is matched against the GPU's name as NVML gives it (ListDevices' `name`), ignoring
case, as a substring: "H100" matches "NVIDIA H100 80GB HBM3". The same rule runs here (the
local queue, validation) and in SQL (store.claim: a node takes only jobs its GPUs match), so it
is kept to what both can say exactly: lower-cased text, no wildcard characters (validation
admits letters, digits, spaces, '.' and '-')."""

from __future__ import annotations

import re
from collections.abc import Mapping

from kerneleval.v1 import kernel_pb2

MAX_MODEL_CHARS = 64
MODEL_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9 .\-]*")


def wanted_device(spec: kernel_pb2.JobSpec) -> int | None:
    """The device index a job names (None: any device)."""
    return spec.options.device_index if spec.options.HasField("device_index") else None


def wanted_model(spec: kernel_pb2.JobSpec) -> str:
    """The GPU model a job names, lower-cased ("" for any)."""
    return spec.options.device_model.strip().lower()


def model_matches(device_name: str, model: str) -> bool:
    return not model or model.lower() in device_name.lower()


def allowed_devices(spec: kernel_pb2.JobSpec, names: Mapping[int, str]) -> list[int]:
    """The devices among `names` (index -> GPU name) the job may run on."""
    index, model = wanted_device(spec), wanted_model(spec)
    return sorted(
        i
        for i, name in names.items()
        if (index is None or i == index) and model_matches(name, model)
    )
