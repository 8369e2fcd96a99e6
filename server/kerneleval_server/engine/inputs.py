"""Turns an IOContract into the values of one trial: tensors (fresh and reproducible per trial),
scalars and meta (constexpr) arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from kerneleval.v1 import dtype_pb2, kernel_pb2

TORCH_DTYPE: dict[int, torch.dtype] = {
    dtype_pb2.DTYPE_FLOAT16: torch.float16,
    dtype_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    dtype_pb2.DTYPE_FLOAT32: torch.float32,
    dtype_pb2.DTYPE_FLOAT64: torch.float64,
    dtype_pb2.DTYPE_INT8: torch.int8,
    dtype_pb2.DTYPE_INT16: torch.int16,
    dtype_pb2.DTYPE_INT32: torch.int32,
    dtype_pb2.DTYPE_INT64: torch.int64,
    dtype_pb2.DTYPE_UINT8: torch.uint8,
    dtype_pb2.DTYPE_BOOL: torch.bool,
}

_MASK64 = (1 << 64) - 1


FORWARD = 0x46574452  # mixed into a trial's seed for the seed of its run (TrialArgs.seed)


def mix_seed(*parts: int) -> int:
    """A well-spread 63-bit seed from several integers (splitmix64 steps)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _MASK64)) & _MASK64
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    """torch.manual_seed(seed) for the devices a job has, the CPU and CUDA, with the same
    generator states; without what torch.manual_seed does besides on every call, formatting
    the call stack for each backend it seeds lazily (XPU, MTIA): ~0.3 ms a call, several
    calls a job."""
    seed = int(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)  # at once when CUDA is initialised, else when it is
    torch.default_generator.manual_seed(seed)


def is_output(arg: kernel_pb2.ArgSpec) -> bool:
    return arg.role in (kernel_pb2.ARG_ROLE_OUTPUT, kernel_pb2.ARG_ROLE_INOUT)


def arg_name(arg: kernel_pb2.ArgSpec, index: int) -> str:
    return arg.name or f"args[{index}]"


@dataclass
class TrialArgs:
    """The arguments of one run, in call order (meta/constexpr ones included, flagged)."""

    values: list[Any]
    names: list[str]
    roles: list[int]
    is_meta: list[bool]
    from_get_inputs: bool = False
    # The seed torch's generators get right before each run on these arguments (the
    # reference's in its judge, the kernel's in its process: job_base._JobBase._run and the
    # timed calls' server), so that a forward that draws random numbers (dropout in training mode)
    # draws the same ones on both sides. None: not seeded.
    seed: int | None = None

    def output_indices(self) -> list[int]:
        return [
            i
            for i, r in enumerate(self.roles)
            if r in (kernel_pb2.ARG_ROLE_OUTPUT, kernel_pb2.ARG_ROLE_INOUT)
        ]

    def model_inputs(self) -> list[Any]:
        """What a Model's forward receives: get_inputs()'s values as they are, or the INPUT and
        INOUT tensors of an IOContract in order (scalars and meta args are launch details)."""
        if self.from_get_inputs:
            return list(self.values)
        return [
            v
            for v, r in zip(self.values, self.roles, strict=False)
            if isinstance(v, torch.Tensor) and r != kernel_pb2.ARG_ROLE_OUTPUT
        ]

    def clone(self) -> TrialArgs:
        return TrialArgs(
            [v.clone() if isinstance(v, torch.Tensor) else v for v in self.values],
            list(self.names),
            list(self.roles),
            list(self.is_meta),
            self.from_get_inputs,
            self.seed,
        )


def scalar_value(arg: kernel_pb2.ArgSpec) -> Any:
    which = arg.WhichOneof("value")
    if which == "int_value":
        return int(arg.int_value)
    if which == "float_value":
        return float(arg.float_value)
    if which == "bool_value":
        return bool(arg.bool_value)
    raise ValueError(f"argument {arg.name!r} is not a scalar")


def build_args(
    io: kernel_pb2.IOContract, job_seed: int, trial: int, device: torch.device
) -> TrialArgs:
    """Fresh values for one trial: random tensors are seeded from (seed, position, trial)."""
    out = TrialArgs([], [], [], [])
    for i, arg in enumerate(io.args):
        name = arg_name(arg, i)
        if arg.WhichOneof("value") == "tensor":
            value: Any = make_tensor(arg.tensor, job_seed, i, trial, device)
        else:
            value = scalar_value(arg)
        out.values.append(value)
        out.names.append(name)
        out.roles.append(arg.role or kernel_pb2.ARG_ROLE_INPUT)
        out.is_meta.append(arg.meta)
    return out


def make_tensor(
    spec: kernel_pb2.TensorSpec, job_seed: int, position: int, trial: int, device: torch.device
) -> torch.Tensor:
    dtype = TORCH_DTYPE[spec.dtype]
    shape = tuple(int(d) for d in spec.shape)
    if spec.WhichOneof("source") == "data":
        flat = torch.frombuffer(bytearray(spec.data), dtype=dtype) if spec.data else None
        t = flat.reshape(shape) if flat is not None else torch.empty(shape, dtype=dtype)
        return t.to(device).clone()
    init = spec.init
    seed = mix_seed(init.seed, trial) if init.seed else mix_seed(job_seed, position, trial)
    return fill(init, shape, dtype, seed, device)


def fill(
    init: kernel_pb2.TensorInit,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    kind = init.WhichOneof("kind") or "randn"
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype, device=device)
    if kind == "full":
        return torch.full(shape, _cast_scalar(init.full.value, dtype), dtype=dtype, device=device)
    if kind == "arange":
        step = init.arange.step or 1.0
        n = math.prod(shape)
        ramp = torch.arange(n, dtype=torch.float64, device=device) * step + init.arange.start
        return ramp.reshape(shape).to(dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if kind == "randint":
        t = torch.randint(
            init.randint.low,
            init.randint.high,
            shape,
            generator=gen,
            device=device,
            dtype=torch.int64,
        )
        return t.to(dtype)
    if kind == "uniform":
        low, high = init.uniform.low, init.uniform.high
        if low == high:
            low, high = 0.0, 1.0
        t = _scaled(torch.rand(shape, generator=gen, device=device, dtype=work), high - low, low)
    else:
        std = init.randn.std or 1.0
        t = _scaled(
            torch.randn(shape, generator=gen, device=device, dtype=work), std, init.randn.mean
        )
    if dtype == torch.bool:
        return t > (init.randn.mean if kind == "randn" else (low + high) / 2)
    if not dtype.is_floating_point:
        return t.round().to(dtype) if kind == "randn" else t.floor().to(dtype)
    return t.to(dtype)


def _scaled(t: torch.Tensor, scale: float, shift: float) -> torch.Tensor:
    """t * scale + shift in place, skipping what changes nothing (the default distributions:
    two kernels and two allocations less a tensor, ~30 us each on an H100)."""
    if scale != 1.0:
        t.mul_(scale)
    if shift != 0.0:
        t.add_(shift)
    return t


def _cast_scalar(v: float, dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return bool(v)
    if not dtype.is_floating_point:
        return int(v)
    return v
