"""validate_spec: every kind of bad input gives a violation naming the exact field."""

from __future__ import annotations

from engine_helpers import ADD_MODEL, CUDA, INOUT, OUT, TORCH, TRITON, job, scalar, source, tensor
from google.protobuf.duration_pb2 import Duration
from kerneleval.v1 import dtype_pb2, kernel_pb2
from kerneleval_server.spec.validation import Limits, validate_spec


def fields(spec: kernel_pb2.JobSpec, **kw: object) -> dict[str, str]:
    return {v.field: v.description for v in validate_spec(spec, **kw)}  # type: ignore[arg-type]


def test_valid_specs_have_no_violations() -> None:
    assert validate_spec(job(source(TORCH, ADD_MODEL))) == []
    io = [tensor("x", [4]), tensor("y", [4], role=OUT), scalar("n", 4), scalar("B", 4, meta=True)]
    triton = source(TRITON, "@triton.jit\ndef k(): pass", io, grid=(1, 1, 1))
    assert validate_spec(job(triton, source(TORCH, ADD_MODEL)), require_reference=True) == []


def test_kernel_and_reference_are_required_where_needed() -> None:
    assert fields(kernel_pb2.JobSpec())["spec.kernel"] == "required"
    f = fields(job(source(TORCH, ADD_MODEL)), require_reference=True)
    assert f == {"spec.reference": "required by Compare"}
    f = fields(job(kernel_pb2.KernelSource(source_code="x")))
    assert f["spec.kernel.type"] == "required"
    f = fields(job(kernel_pb2.KernelSource(type=TORCH)))
    assert f["spec.kernel.source_code"] == "required"
    f = fields(job(kernel_pb2.KernelSource(type=77, source_code="x")))
    assert "unknown kernel type 77" in f["spec.kernel.type"]


def test_shapes_dtypes_and_data() -> None:
    args = [
        tensor("a", [4, -2]),
        kernel_pb2.ArgSpec(name="b", tensor=kernel_pb2.TensorSpec(shape=[2])),  # no dtype
        tensor("c", [3], dtype=dtype_pb2.DTYPE_FLOAT16, data=b"\x00" * 4),  # needs 6 bytes
        tensor("d", [1] * 9),
        kernel_pb2.ArgSpec(name="e", tensor=kernel_pb2.TensorSpec(shape=[1], dtype=99)),
    ]
    f = fields(job(source(TORCH, ADD_MODEL, args)))
    assert f["spec.kernel.io.args[0].tensor.shape[1]"] == "-2 is negative"
    assert f["spec.kernel.io.args[1].tensor.dtype"] == "required"
    assert f["spec.kernel.io.args[2].tensor.data"] == (
        "4 bytes, but shape [3] of DTYPE_FLOAT16 needs 6 bytes"
    )
    assert "rank 9" in f["spec.kernel.io.args[3].tensor.shape"]
    assert "unknown dtype 99" in f["spec.kernel.io.args[4].tensor.dtype"]


def test_element_and_byte_limits() -> None:
    limits = Limits(max_tensor_elements=1_000_000, max_total_tensor_bytes=6_000_000)
    big = job(source(TORCH, ADD_MODEL, [tensor("x", [10_000, 1_000])]))
    f = fields(big, limits=limits)
    assert f["spec.kernel.io.args[0].tensor.shape"] == (
        "10000000 elements is over the limit of 1000000"
    )
    two = job(source(TORCH, ADD_MODEL, [tensor("x", [1_000_000]), tensor("y", [1_000_000])]))
    assert "over the limit of 6000000 bytes" in fields(two, limits=limits)["spec.kernel.io.args"]


def test_init_arguments() -> None:
    bad_randint = kernel_pb2.TensorInit(randint=kernel_pb2.RandintInit(low=5, high=5))
    bad_std = kernel_pb2.TensorInit(randn=kernel_pb2.RandnInit(std=-1))
    nan_start = kernel_pb2.TensorInit(arange=kernel_pb2.ArangeInit(start=float("nan")))
    args = [
        tensor("a", [2], init=bad_randint),
        tensor("b", [2], init=bad_std),
        tensor("c", [2], init=nan_start),
    ]
    f = fields(job(source(TORCH, ADD_MODEL, args)))
    assert "must be greater than low" in f["spec.kernel.io.args[0].tensor.init.randint.high"]
    assert f["spec.kernel.io.args[1].tensor.init.randn.std"] == "must be >= 0"
    assert f["spec.kernel.io.args[2].tensor.init.arange.start"] == "must be finite"


def test_arg_names_roles_and_meta() -> None:
    meta_tensor = tensor("t", [2])
    meta_tensor.meta = True
    out_scalar = scalar("n", 3)
    out_scalar.role = OUT
    args = [
        tensor("x", [2]),
        tensor("x", [2], role=INOUT),
        tensor("bad name", [2]),
        meta_tensor,
        out_scalar,
        kernel_pb2.ArgSpec(name="empty"),
    ]
    f = fields(job(source(TORCH, ADD_MODEL, args)))
    assert f["spec.kernel.io.args[1].name"] == "duplicate argument name 'x'"
    assert "not a valid identifier" in f["spec.kernel.io.args[2].name"]
    assert f["spec.kernel.io.args[3].meta"] == "only scalar arguments can be meta"
    assert f["spec.kernel.io.args[4].role"] == "a scalar can only be an input"
    assert "required" in f["spec.kernel.io.args[5].value"]


def test_contract_requirements_by_kernel_type() -> None:
    f = fields(job(source(CUDA, "__global__ void k() {}")))
    assert "launched from its IOContract" in f["spec.kernel.io.args"]
    f = fields(job(source(TRITON, "@triton.jit\ndef k(x): pass")))
    assert "without a ModelNew" in f["spec.kernel.io.args"]
    f = fields(job(source(CUDA, "__global__ void k(float* x) {}", [tensor("x", [2])])))
    assert f["spec.kernel.io.launch.grid"] == "required to launch the kernel"
    f = fields(job(source(TORCH, ADD_MODEL, entry="not valid!")))
    assert "not a valid identifier" in f["spec.kernel.entry_point"]


def test_source_size_and_options() -> None:
    spec = job(source(TORCH, "x" * 2000), correct_trial_count=0, perf_trial_count=-1)
    spec.options.timeout.CopyFrom(Duration(seconds=100_000))
    spec.options.atol = -1
    f = fields(spec, limits=Limits(max_source_bytes=1000))
    assert f["spec.kernel.source_code"] == "2000 bytes is over the limit of 1000 bytes"
    assert "must be in [1," in f["spec.options.correct_trial_count"]
    assert "must be in [0," in f["spec.options.perf_trial_count"]
    assert "100000 s is outside" in f["spec.options.timeout"]
    assert f["spec.options.atol"] == "must be a finite number >= 0"


def test_launch_config_checks() -> None:
    k = source(TRITON, "@triton.jit\ndef k(x): pass", [tensor("x", [2])], grid=(1, 1, 1))
    k.io.launch.num_warps = 3
    k.io.launch.shared_memory_bytes = -1
    f = fields(job(k))
    assert f["spec.kernel.io.launch.num_warps"] == "must be a power of two"
    assert f["spec.kernel.io.launch.shared_memory_bytes"] == "must be >= 0"


def test_limits_from_environment() -> None:
    limits = Limits.from_env({"KERNELEVAL_LIMIT_MAX_SOURCE_BYTES": "2048", "OTHER": "1"})
    assert limits.max_source_bytes == 2048 and limits.max_args == Limits().max_args
    assert Limits.from_env({"KERNELEVAL_LIMIT_MAX_TIMEOUT_SECONDS": "30"}).max_timeout_seconds == 30


def test_spec_must_fit_a_job_channel_frame() -> None:
    from kerneleval_server.framing import MAX_FRAME

    limits = Limits()
    assert limits.max_spec_bytes == 12 << 20 and limits.max_spec_bytes <= MAX_FRAME - (1 << 20)
    u8 = dtype_pb2.DTYPE_UINT8
    # One literal over the limit is named (and not also reported as a shape mismatch).
    big = job(
        source(TORCH, ADD_MODEL, [tensor("x", [20 << 20], dtype=u8, data=b"\0" * (20 << 20))])
    )
    f = fields(big)
    assert f == {
        "spec.kernel.io.args[0].tensor.data": f"{20 << 20} bytes, the limit is {12 << 20} bytes "
        "for the whole JobSpec (use `init` to generate large inputs on the device)"
    }
    # Literals under it one by one, over it together (kernel and reference): "spec", naming
    # the biggest.
    small = Limits(max_spec_bytes=10_000)
    k = source(TORCH, ADD_MODEL, [tensor("x", [6000], dtype=u8, data=b"\0" * 6000)])
    r = source(TORCH, ADD_MODEL, [tensor("y", [5000], dtype=u8, data=b"\0" * 5000)])
    f = fields(job(k, r), limits=small)
    assert "the serialized JobSpec is" in f["spec"] and "the limit is 10000 bytes" in f["spec"]
    assert "spec.kernel.io.args[0].tensor.data has 6000 bytes" in f["spec"]
    assert "spec.reference.io.args[0].tensor.data has 5000 bytes" in f["spec"]
    assert fields(job(k), limits=small) == {}
    # Sources count too.
    f = fields(job(source(TORCH, ADD_MODEL + "#" * 20_000)), limits=small)
    assert "the serialized JobSpec is" in f["spec"]


def test_free_string_limits() -> None:
    spec = job(source(TORCH, ADD_MODEL))
    spec.client_tag = "é" * 200  # 400 bytes in UTF-8
    assert fields(spec) == {"spec.client_tag": "400 bytes, the limit is 256 bytes"}
    spec.client_tag = "t" * 256
    assert fields(spec) == {}
    f = fields(job(source(TORCH, ADD_MODEL, entry="E" * 257)))
    assert f["spec.kernel.entry_point"] == "257 characters, the limit is 256"
    assert fields(job(source(TORCH, ADD_MODEL, entry="E" * 256))) == {}
    f = fields(job(source(TORCH, ADD_MODEL, [tensor("n" * 300, [2])])))
    assert f["spec.kernel.io.args[0].name"] == "300 characters, the limit is 256"
    # A trailing newline is not part of an identifier (re's `$` would have let it through).
    f = fields(job(source(TORCH, ADD_MODEL, [tensor("x\n", [2])], entry="Model\n")))
    assert "not a valid identifier" in f["spec.kernel.io.args[0].name"]
    assert "not a valid identifier" in f["spec.kernel.entry_point"]


def test_api_limits_from_environment() -> None:
    limits = Limits.from_env(
        {"KERNELEVAL_LIMIT_MAX_SPEC_BYTES": "1000", "KERNELEVAL_LIMIT_MAX_LOG_BYTES": "4096"}
    )
    assert limits.max_spec_bytes == 1000 and limits.max_log_bytes == 4096
    assert Limits().max_log_bytes == 1 << 20 and Limits().max_client_tag_bytes == 256


def test_a_triton_source_without_model_new_or_io_says_what_to_give() -> None:
    bare = "import triton\n@triton.jit\ndef add(x_ptr, n):\n    pass\n"
    why = fields(job(source(TRITON, bare)))["spec.kernel.io.args"]
    assert why == (
        "a TRITON source without a ModelNew class is launched from its IOContract: give its "
        "args (the kernel's arguments) and launch.grid"
    )
    # A class named almost so is named: it is probably meant to be the ModelNew.
    for name in ("Modelnew", "Model_New", "ModelNEW", "ModeNew"):
        misnamed = bare + f"class {name}(torch.nn.Module):\n    pass\n"
        why = fields(job(source(TRITON, misnamed)))["spec.kernel.io.args"]
        assert why.endswith(f"; or, to run it through its class {name}, name that class ModelNew")
    unrelated = bare + "class Helper:\n    pass\n"
    assert "Helper" not in fields(job(source(TRITON, unrelated)))["spec.kernel.io.args"]
