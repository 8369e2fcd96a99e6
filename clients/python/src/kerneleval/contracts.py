"""Helpers that build IOContract, ArgSpec and TensorSpec messages from shapes and dtypes.

    io(tensor("x", (1024,), "float32", init=randn()),
       output("y", (1024,), "float32"),
       scalar("n", 1024), constexpr("BLOCK", 128), grid=(8,))

torch is optional: `from_tensor` imports it only when called.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kerneleval.v1 import dtype_pb2, kernel_pb2

DTypeLike = Any  # "float32", "fp16", dtype_pb2.DType value, or a torch.dtype

_DTYPES: dict[str, int] = {
    "float16": dtype_pb2.DTYPE_FLOAT16,
    "half": dtype_pb2.DTYPE_FLOAT16,
    "fp16": dtype_pb2.DTYPE_FLOAT16,
    "bfloat16": dtype_pb2.DTYPE_BFLOAT16,
    "bf16": dtype_pb2.DTYPE_BFLOAT16,
    "float32": dtype_pb2.DTYPE_FLOAT32,
    "float": dtype_pb2.DTYPE_FLOAT32,
    "fp32": dtype_pb2.DTYPE_FLOAT32,
    "float64": dtype_pb2.DTYPE_FLOAT64,
    "double": dtype_pb2.DTYPE_FLOAT64,
    "fp64": dtype_pb2.DTYPE_FLOAT64,
    "int8": dtype_pb2.DTYPE_INT8,
    "int16": dtype_pb2.DTYPE_INT16,
    "int32": dtype_pb2.DTYPE_INT32,
    "int": dtype_pb2.DTYPE_INT32,
    "int64": dtype_pb2.DTYPE_INT64,
    "long": dtype_pb2.DTYPE_INT64,
    "uint8": dtype_pb2.DTYPE_UINT8,
    "bool": dtype_pb2.DTYPE_BOOL,
}

ITEMSIZE: dict[int, int] = {
    dtype_pb2.DTYPE_FLOAT16: 2,
    dtype_pb2.DTYPE_BFLOAT16: 2,
    dtype_pb2.DTYPE_FLOAT32: 4,
    dtype_pb2.DTYPE_FLOAT64: 8,
    dtype_pb2.DTYPE_INT8: 1,
    dtype_pb2.DTYPE_INT16: 2,
    dtype_pb2.DTYPE_INT32: 4,
    dtype_pb2.DTYPE_INT64: 8,
    dtype_pb2.DTYPE_UINT8: 1,
    dtype_pb2.DTYPE_BOOL: 1,
}


def dtype(value: DTypeLike) -> int:
    """A DType value from a name ("float32", "bf16", "DTYPE_INT8"), a DType, or a torch.dtype."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in ITEMSIZE:
            raise ValueError(f"unknown DType value {value}")
        return value
    name = str(value).lower()
    name = name.removeprefix("torch.").removeprefix("dtype_")
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {value!r}; one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def dtype_name(value: int) -> str:
    """ "float32" for DTYPE_FLOAT32."""
    return dtype_pb2.DType.Name(value).removeprefix("DTYPE_").lower()


# --- initialisers -------------------------------------------------------------------------


def randn(mean: float = 0.0, std: float = 1.0, *, seed: int = 0) -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(seed=seed, randn=kernel_pb2.RandnInit(mean=mean, std=std))


def uniform(low: float = 0.0, high: float = 1.0, *, seed: int = 0) -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(seed=seed, uniform=kernel_pb2.UniformInit(low=low, high=high))


def randint(low: int, high: int, *, seed: int = 0) -> kernel_pb2.TensorInit:
    if high <= low:
        raise ValueError("randint needs high > low")
    return kernel_pb2.TensorInit(seed=seed, randint=kernel_pb2.RandintInit(low=low, high=high))


def full(value: float) -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(full=kernel_pb2.FullInit(value=value))


def zeros() -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(zeros=kernel_pb2.ZerosInit())


def ones() -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(ones=kernel_pb2.OnesInit())


def arange(start: float = 0.0, step: float = 1.0) -> kernel_pb2.TensorInit:
    return kernel_pb2.TensorInit(arange=kernel_pb2.ArangeInit(start=start, step=step))


# --- arguments ----------------------------------------------------------------------------


def _shape(shape: Sequence[int] | int) -> list[int]:
    dims = [shape] if isinstance(shape, int) else list(shape)
    for d in dims:
        if int(d) < 0:
            raise ValueError(f"negative dimension in shape {dims}")
    return [int(d) for d in dims]


def tensor_spec(
    shape: Sequence[int] | int,
    dtype_: DTypeLike = "float32",
    *,
    init: kernel_pb2.TensorInit | None = None,
    data: bytes | None = None,
) -> kernel_pb2.TensorSpec:
    """A TensorSpec; `data` gives literal little-endian row-major contents instead of `init`."""
    if init is not None and data is not None:
        raise ValueError("give init or data, not both")
    spec = kernel_pb2.TensorSpec(shape=_shape(shape), dtype=dtype(dtype_))  # type: ignore[arg-type]
    if data is not None:
        count = 1
        for d in spec.shape:
            count *= d
        want = count * ITEMSIZE[spec.dtype]
        if len(data) != want:
            raise ValueError(f"data has {len(data)} bytes, shape and dtype need {want}")
        spec.data = data
    elif init is not None:
        spec.init.CopyFrom(init)
    return spec


def tensor(
    name: str,
    shape: Sequence[int] | int,
    dtype_: DTypeLike = "float32",
    *,
    init: kernel_pb2.TensorInit | None = None,
    data: bytes | None = None,
    role: int = kernel_pb2.ARG_ROLE_INPUT,
) -> kernel_pb2.ArgSpec:
    """A tensor argument; unset init means randn(0, 1) on the server."""
    return kernel_pb2.ArgSpec(
        name=name,
        role=role,  # type: ignore[arg-type]
        tensor=tensor_spec(shape, dtype_, init=init, data=data),
    )


def output(
    name: str, shape: Sequence[int] | int, dtype_: DTypeLike = "float32"
) -> kernel_pb2.ArgSpec:
    """A tensor the kernel writes: poisoned before each run and compared with the reference."""
    return tensor(name, shape, dtype_, role=kernel_pb2.ARG_ROLE_OUTPUT)


def inout(
    name: str,
    shape: Sequence[int] | int,
    dtype_: DTypeLike = "float32",
    *,
    init: kernel_pb2.TensorInit | None = None,
) -> kernel_pb2.ArgSpec:
    """A tensor the kernel reads and writes in place."""
    return tensor(name, shape, dtype_, init=init, role=kernel_pb2.ARG_ROLE_INOUT)


def scalar(name: str, value: bool | int | float, *, meta: bool = False) -> kernel_pb2.ArgSpec:
    """A scalar argument; bool, int and float map to bool_value, int_value, float_value."""
    arg = kernel_pb2.ArgSpec(name=name, meta=meta)
    if isinstance(value, bool):
        arg.bool_value = value
    elif isinstance(value, int):
        arg.int_value = value
    elif isinstance(value, float):
        arg.float_value = value
    else:
        raise TypeError(f"scalar {name!r} must be bool, int or float, not {type(value).__name__}")
    return arg


def constexpr(name: str, value: bool | int | float) -> kernel_pb2.ArgSpec:
    """A Triton `tl.constexpr` argument."""
    return scalar(name, value, meta=True)


def _dim3(value: Sequence[int] | int | None) -> kernel_pb2.Dim3:
    if value is None:
        return kernel_pb2.Dim3()
    dims = [value] if isinstance(value, int) else list(value)
    if not 1 <= len(dims) <= 3:
        raise ValueError(f"a grid or block has 1 to 3 dimensions, not {len(dims)}")
    dims += [1] * (3 - len(dims))
    return kernel_pb2.Dim3(x=dims[0], y=dims[1], z=dims[2])


def launch(
    grid: Sequence[int] | int | None = None,
    block: Sequence[int] | int | None = None,
    *,
    num_warps: int = 0,
    num_stages: int = 0,
    shared_memory_bytes: int = 0,
) -> kernel_pb2.LaunchConfig:
    cfg = kernel_pb2.LaunchConfig(
        num_warps=num_warps, num_stages=num_stages, shared_memory_bytes=shared_memory_bytes
    )
    if grid is not None:
        cfg.grid.CopyFrom(_dim3(grid))
    if block is not None:
        cfg.block.CopyFrom(_dim3(block))
    return cfg


def io(
    *args: kernel_pb2.ArgSpec,
    grid: Sequence[int] | int | None = None,
    block: Sequence[int] | int | None = None,
    num_warps: int = 0,
    num_stages: int = 0,
    shared_memory_bytes: int = 0,
) -> kernel_pb2.IOContract:
    """An IOContract: arguments in call order and the launch geometry."""
    contract = kernel_pb2.IOContract(args=list(args))
    cfg = launch(
        grid,
        block,
        num_warps=num_warps,
        num_stages=num_stages,
        shared_memory_bytes=shared_memory_bytes,
    )
    if cfg.ByteSize():
        contract.launch.CopyFrom(cfg)
    return contract


# --- from torch tensors -------------------------------------------------------------------


def from_tensor(
    name: str,
    value: Any,
    *,
    role: int = kernel_pb2.ARG_ROLE_INPUT,
    literal: bool = False,
    init: kernel_pb2.TensorInit | None = None,
) -> kernel_pb2.ArgSpec:
    """An ArgSpec with the shape and dtype of a torch tensor.

    literal=True sends the tensor's contents (`data`); otherwise the server generates them
    from `init` (randn by default). Python scalars become scalar arguments.
    """
    if isinstance(value, (bool, int, float)):
        return scalar(name, value)
    try:
        import torch
    except ImportError as e:  # pragma: no cover - only without torch
        raise RuntimeError("from_tensor needs torch") from e
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name!r}: expected a torch.Tensor, got {type(value).__name__}")
    data = None
    if literal:
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return tensor(name, tuple(value.shape), value.dtype, init=init, data=data, role=role)


def from_tensors(
    *values: Any,
    names: Sequence[str] | None = None,
    literal: bool = False,
) -> kernel_pb2.IOContract:
    """An IOContract whose args mirror example values (e.g. the list `get_inputs()` returns)."""
    if names is not None and len(names) != len(values):
        raise ValueError("names and values differ in length")
    arg_names = list(names) if names is not None else [f"arg{i}" for i in range(len(values))]
    return kernel_pb2.IOContract(
        args=[from_tensor(n, v, literal=literal) for n, v in zip(arg_names, values, strict=True)]
    )
