"""TensorSpec -> tensors: every init kind and dtype, literal data, seeds fresh per trial."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import IN, OUT, scalar, tensor
from kerneleval.v1 import dtype_pb2, kernel_pb2
from kerneleval_server.engine.inputs import TORCH_DTYPE, build_args, make_tensor

CPU = torch.device("cpu")
ALL_DTYPES = [d for d in dtype_pb2.DType.values() if d != dtype_pb2.DTYPE_UNSPECIFIED]
INITS = {
    "default": kernel_pb2.TensorInit(),
    "randn": kernel_pb2.TensorInit(randn=kernel_pb2.RandnInit(mean=2.0, std=0.5)),
    "uniform": kernel_pb2.TensorInit(uniform=kernel_pb2.UniformInit(low=1.0, high=5.0)),
    "randint": kernel_pb2.TensorInit(randint=kernel_pb2.RandintInit(low=1, high=7)),
    "full": kernel_pb2.TensorInit(full=kernel_pb2.FullInit(value=3.0)),
    "zeros": kernel_pb2.TensorInit(zeros=kernel_pb2.ZerosInit()),
    "ones": kernel_pb2.TensorInit(ones=kernel_pb2.OnesInit()),
    "arange": kernel_pb2.TensorInit(arange=kernel_pb2.ArangeInit(start=1.0, step=2.0)),
}


def spec(dtype: int, init: kernel_pb2.TensorInit, shape: tuple[int, ...] = (8, 16)):
    return kernel_pb2.TensorSpec(shape=list(shape), dtype=dtype, init=init)


def test_dtype_table_covers_every_dtype() -> None:
    assert set(TORCH_DTYPE) == set(ALL_DTYPES)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: dtype_pb2.DType.Name(d))
@pytest.mark.parametrize("kind", list(INITS))
def test_every_init_kind_and_dtype(dtype: int, kind: str) -> None:
    t = make_tensor(spec(dtype, INITS[kind]), 42, 0, 0, CPU)
    assert t.shape == (8, 16) and t.dtype == TORCH_DTYPE[dtype]
    v = t.to(torch.float64)
    is_bool = dtype == dtype_pb2.DTYPE_BOOL
    if kind == "zeros":
        assert (v == 0).all()
    elif kind == "ones":
        assert (v == 1).all()
    elif kind == "full":
        assert (v == (1 if is_bool else 3)).all()
    elif kind == "arange":
        want = torch.arange(128, dtype=torch.float64) * 2 + 1
        assert torch.equal(t.reshape(-1), want.to(t.dtype))
    elif kind == "randint":
        if is_bool:  # [1, 7) is never 0: all True
            assert v.all()
        else:
            assert ((v >= 1) & (v < 7)).all() and len(v.unique()) > 1
    elif kind == "uniform" and not is_bool:
        assert ((v >= 1) & (v <= 5)).all()
        assert len(v.unique()) > 1
    else:
        assert len(v.unique()) > 1  # random contents, not a constant


def test_randn_statistics_follow_mean_and_std() -> None:
    init = kernel_pb2.TensorInit(randn=kernel_pb2.RandnInit(mean=2.0, std=0.5))
    t = make_tensor(spec(dtype_pb2.DTYPE_FLOAT32, init, (100_000,)), 1, 0, 0, CPU)
    assert abs(float(t.mean()) - 2.0) < 0.02 and abs(float(t.std()) - 0.5) < 0.02


def test_seeds_are_reproducible_and_fresh_per_trial_and_position() -> None:
    s = spec(dtype_pb2.DTYPE_FLOAT32, kernel_pb2.TensorInit())
    a0 = make_tensor(s, 42, 0, 0, CPU)
    assert torch.equal(a0, make_tensor(s, 42, 0, 0, CPU))
    assert not torch.equal(a0, make_tensor(s, 42, 0, 1, CPU))  # next trial
    assert not torch.equal(a0, make_tensor(s, 42, 1, 0, CPU))  # next argument
    assert not torch.equal(a0, make_tensor(s, 43, 0, 0, CPU))  # another job seed
    own = spec(dtype_pb2.DTYPE_FLOAT32, kernel_pb2.TensorInit(seed=7))
    assert torch.equal(make_tensor(own, 1, 0, 0, CPU), make_tensor(own, 2, 5, 0, CPU))
    assert not torch.equal(make_tensor(own, 1, 0, 0, CPU), make_tensor(own, 1, 0, 1, CPU))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: dtype_pb2.DType.Name(d))
def test_literal_data_round_trips(dtype: int) -> None:
    ref = make_tensor(spec(dtype, INITS["randint"], (3, 5)), 9, 0, 0, CPU)
    raw = ref.contiguous().view(torch.uint8).numpy().tobytes()
    t = make_tensor(kernel_pb2.TensorSpec(shape=[3, 5], dtype=dtype, data=raw), 0, 0, 0, CPU)
    assert torch.equal(t, ref)
    t[0, 0] = 0  # a private copy, writable
    assert t.dtype == TORCH_DTYPE[dtype]


def test_literal_float_bytes_are_little_endian_row_major() -> None:
    raw = np.array([[1.5, -2.0], [3.25, 4.0]], dtype="<f4").tobytes()
    t = make_tensor(
        kernel_pb2.TensorSpec(shape=[2, 2], dtype=dtype_pb2.DTYPE_FLOAT32, data=raw), 0, 0, 0, CPU
    )
    assert t.tolist() == [[1.5, -2.0], [3.25, 4.0]]


def test_empty_and_scalar_shapes() -> None:
    assert (
        make_tensor(spec(dtype_pb2.DTYPE_FLOAT32, INITS["ones"], (0, 3)), 1, 0, 0, CPU).numel() == 0
    )
    assert make_tensor(spec(dtype_pb2.DTYPE_FLOAT32, INITS["ones"], ()), 1, 0, 0, CPU).shape == ()


def test_build_args_keeps_order_roles_and_meta() -> None:
    io = kernel_pb2.IOContract(
        args=[
            tensor("x", [4]),
            tensor("out", [4], role=OUT),
            scalar("n", 4),
            scalar("alpha", 0.5),
            scalar("BLOCK", 64, meta=True),
        ]
    )
    a = build_args(io, 42, 0, CPU)
    assert a.names == ["x", "out", "n", "alpha", "BLOCK"]
    assert a.roles == [IN, OUT, IN, IN, IN]
    assert a.is_meta == [False, False, False, False, True]
    assert a.values[2:] == [4, 0.5, 64]
    assert a.output_indices() == [1]
    assert [id(v) for v in a.model_inputs()] == [id(a.values[0])]  # tensors that are inputs
    c = a.clone()
    assert torch.equal(c.values[0], a.values[0]) and c.values[0] is not a.values[0]


def test_seed_all_leaves_the_generators_as_torch_manual_seed_does() -> None:
    """The engine seeds get_inputs() and a model's construction with seed_all: the same
    random streams as torch.manual_seed, at a fraction of its cost (which formats the call
    stack for every lazily seeded backend on each call)."""
    import time

    from kerneleval_server.engine.inputs import seed_all

    for seed in (0, 42, 2**62 + 5):
        torch.manual_seed(seed)
        expected = torch.get_rng_state()
        torch.rand(3)
        seed_all(seed)
        assert torch.equal(torch.get_rng_state(), expected)
        if torch.cuda.is_available():
            torch.manual_seed(seed)
            cuda_state = torch.cuda.get_rng_state_all()
            torch.rand(3, device="cuda")
            seed_all(seed)
            assert all(map(torch.equal, torch.cuda.get_rng_state_all(), cuda_state))

    def per_call(fn: object) -> float:
        began = time.perf_counter()
        for i in range(50):
            fn(i)  # type: ignore[operator]
        return (time.perf_counter() - began) / 50

    assert per_call(seed_all) < per_call(torch.manual_seed)
