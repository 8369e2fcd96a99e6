"""TRITON launched from its IOContract, compiled ahead of time (no GPU needed): the signature,
constexprs and divisibility attributes Triton's JIT would derive from the IOContract's values,
then triton.compile for the target GPU. The cubin is launched later by a process that never
imports the source (backends/prebuilt.py).

Differences from the JIT, on purpose: an int argument equal to 1 stays a parameter (the JIT
folds it into a constant), so that the launch side passes every non-meta argument in order."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import dtype_pb2, kernel_pb2

from .. import loader
from ..inputs import scalar_value
from .base import BuildContext


class RunWhole(Exception):
    """The source cannot be built ahead of time; the message says why (one line)."""


# Triton's names for the IOContract's element types (pointer types are "*" + these).
TRITON_DTYPE: dict[int, str] = {
    dtype_pb2.DTYPE_FLOAT16: "fp16",
    dtype_pb2.DTYPE_BFLOAT16: "bf16",
    dtype_pb2.DTYPE_FLOAT32: "fp32",
    dtype_pb2.DTYPE_FLOAT64: "fp64",
    dtype_pb2.DTYPE_INT8: "i8",
    dtype_pb2.DTYPE_INT16: "i16",
    dtype_pb2.DTYPE_INT32: "i32",
    dtype_pb2.DTYPE_INT64: "i64",
    dtype_pb2.DTYPE_UINT8: "u8",
    dtype_pb2.DTYPE_BOOL: "u1",  # Triton canonicalises bool (i1) to u1
}
# Scalar annotations the launcher packs right from the parameter's size (cuFuncGetParamInfo).
_SCALAR_ANNOTATIONS = {"i32", "i64", "fp32", "fp64", "u1", "i1"}


def arch_number(arch: str) -> int:
    """90 from "sm_90" (or "sm_90a", "90")."""
    m = re.fullmatch(r"(?:sm_|compute_)?(\d+)[a-z]?", arch.strip())
    if m is None:
        raise ValueError(f"not a CUDA architecture: {arch!r} (expected e.g. sm_90)")
    return int(m.group(1))


@contextlib.contextmanager
def compiled_mode() -> Iterator[None]:
    """While inside, @triton.jit makes JITFunctions even where TRITON_INTERPRET=1 (a process
    without a GPU runs Triton under its interpreter; a build compiles for a real GPU)."""
    saved_env = os.environ.get("TRITON_INTERPRET")
    runtime: Any = None
    saved_knob: Any = None
    try:
        from triton import knobs

        runtime = knobs.runtime
        saved_knob = runtime.__dict__.pop("interpret", None)  # a value set in code wins
    except (ImportError, AttributeError):
        runtime = None
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved_env
        if runtime is not None and saved_knob is not None:
            runtime.__dict__["interpret"] = saved_knob


def triton_compiles_here() -> bool:
    """Whether Triton was imported in compiled mode here: its own @jit library functions
    (tl.cdiv, tl.sum...) are JITFunctions, not the interpreter's. Imports triton in compiled
    mode if nothing imported it yet."""
    with compiled_mode():
        import triton.language.standard as standard
        from triton.runtime.jit import JITFunction

    return isinstance(getattr(standard, "cdiv", None), JITFunction)


def import_kernel(k: kernel_pb2.KernelSource, role: str, ctx: BuildContext) -> Any:
    """Imports the source and finds its kernel: a plain @triton.jit function, else RunWhole."""
    from triton.runtime.jit import JITFunction

    module = loader.import_source(ctx.work_dir, role, k.source_code)
    ctx.source_files.append(str(module.__file__))
    kernel = loader.find_triton_kernel(module, k.entry_point)
    if type(kernel) is not JITFunction:
        raise RunWhole(
            f"the Triton kernel is a {type(kernel).__name__} (autotuned or heuristics), not a "
            "plain @triton.jit function"
        )
    params = loader.signature_names(kernel)
    if len(params) != len(k.io.args):
        raise loader.CompileError(
            f"the kernel takes {len(params)} arguments ({', '.join(params)}) but the IOContract "
            f"gives {len(k.io.args)}"
        )
    return kernel


def _int_type(v: int) -> str:
    return "i32" if -(2**31) <= v < 2**31 else "i64"


def signature(
    kernel: Any, args: Sequence[kernel_pb2.ArgSpec], parse_attr: Any
) -> tuple[dict[str, str], dict[tuple[int, ...], Any], dict[tuple[int, ...], Any]]:
    """(signature, constexprs, attrs) as Triton's JIT derives them when it is called with
    fresh tensors (16-byte aligned) of the IOContract's dtypes and its scalar values."""
    params = list(kernel.params)
    if len(params) != len(args):
        raise RunWhole(
            f"the kernel takes {len(params)} arguments but the inputs' IOContract gives {len(args)}"
        )
    sig: dict[str, str] = {}
    constexprs: dict[tuple[int, ...], Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for i, (kp, a) in enumerate(zip(params, args, strict=True)):
        name = kp.name
        which = a.WhichOneof("value")
        if which is None:
            raise RunWhole(f"argument {name} has no value")
        if bool(kp.is_constexpr) != bool(a.meta):
            raise RunWhole(
                f"argument {name} is {'' if kp.is_constexpr else 'not '}a tl.constexpr in the "
                f"kernel but {'' if a.meta else 'not '}meta in the IOContract"
            )
        if kp.is_constexpr:
            if which == "tensor":
                raise RunWhole(f"meta argument {name} is a tensor")
            sig[name] = "constexpr"
            constexprs[(i,)] = scalar_value(a)
            continue
        specialize = not getattr(kp, "do_not_specialize", False)
        align = not getattr(kp, "do_not_specialize_on_alignment", False)
        spec: str | None
        if which == "tensor":
            if a.tensor.dtype not in TRITON_DTYPE:
                raise RunWhole(f"argument {name} has an element type Triton cannot take")
            ty = ("*k" if getattr(kp, "is_const", False) else "*") + TRITON_DTYPE[a.tensor.dtype]
            spec = ("D" if align else "") if specialize else None
        else:
            v = scalar_value(a)
            if isinstance(v, bool):
                ty, spec = "u1", None
            elif isinstance(v, int):
                ty = _int_type(v)
                spec = ("D" if align and v % 16 == 0 else "") if specialize else None
            else:
                ty, spec = "fp32", None
        ann = getattr(kp, "annotation_type", "") or ""
        if ann:
            if ann.startswith("*") != ty.startswith("*"):
                raise RunWhole(f"argument {name} is annotated {ann} but given a {which}")
            if not ann.startswith("*") and ann not in _SCALAR_ANNOTATIONS:
                raise RunWhole(f"argument {name} is annotated {ann}")
            if ann == "u1" or ann[:2] in ("fp", "bf"):
                spec = None  # the JIT does not specialise non-constexpr floats and bools
            ty = ann
        sig[name] = ty
        if spec is not None:
            attrs[(i,)] = parse_attr(spec)
    return sig, constexprs, attrs


# Metadata of a compiled kernel the simple launcher (grid, 32 * num_warps threads, shared
# memory, scratch pointers) cannot honour, with the value it must have.
def _unsupported(md: Any) -> str:
    num_ctas = getattr(md, "num_ctas", 1)
    if num_ctas not in (None, 1):
        return f"num_ctas={num_ctas} (thread block clusters)"
    cluster = getattr(md, "cluster_dims", None)
    if cluster is not None and tuple(cluster) not in ((1, 1, 1), (1,), ()):
        return f"cluster_dims={tuple(cluster)}"
    for flag in ("launch_cooperative_grid", "launch_pdl", "clc"):
        if getattr(md, flag, False):
            return f"{flag}=True"
    if getattr(md, "tensordesc_meta", None):
        return "tensor descriptors (TMA)"
    if getattr(md, "tmem_size", 0):
        return f"tensor memory ({md.tmem_size} bytes)"
    if getattr(md, "instrumentation_mode", ""):
        return f"instrumentation_mode={md.instrumentation_mode!r}"
    if getattr(md, "warp_size", 32) != 32:
        return f"warp_size={md.warp_size}"
    return ""


def compile_kernel(
    kernel: Any,
    k: kernel_pb2.KernelSource,
    role: str,
    inputs: kernel_pb2.IOContract,
    arch: str,
) -> job_channel_pb2.KernelArtifact:
    """Compiles the kernel for `arch` as the JIT would for `inputs` (the IOContract the job's
    arguments come from) and k's own launch settings."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch_number(arch), 32)
    backend = make_backend(target)
    sig, constexprs, attrs = signature(kernel, list(inputs.args), backend.parse_attr)
    options: dict[str, Any] = {}
    launch = k.io.launch
    if launch.num_warps:
        options["num_warps"] = launch.num_warps
    if launch.num_stages:
        options["num_stages"] = launch.num_stages
    knobs: Any = getattr(triton, "knobs", None)
    debug = getattr(kernel, "debug", None)
    if knobs is not None:
        debug = debug or knobs.runtime.debug
        mode = getattr(knobs.compilation, "instrumentation_mode", None)
        if mode:
            options["instrumentation_mode"] = mode
    options["debug"] = bool(debug)
    compiled = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs), target=target, options=options
    )
    md = compiled.metadata
    if reason := _unsupported(md):
        raise RunWhole(f"the compiled Triton kernel needs {reason}: the launcher cannot do it")
    cubin = compiled.asm["cubin"]
    if not isinstance(cubin, bytes) or not cubin:
        raise RunWhole("Triton produced no cubin")
    shared = int(getattr(md, "shared", 0) or 0)
    num_warps = int(md.num_warps)
    num_stages = getattr(md, "num_stages", options.get("num_stages"))
    log = (
        f"triton {triton.__version__}: compiled {md.name} for {arch} "
        f"(num_warps={num_warps}, num_stages={num_stages}); "
        f"triton: {md.name} uses {shared} bytes of shared\n"
        "signature: "
        + ", ".join(
            f"{n}: {t}" + (" (divisible by 16)" if attrs.get((i,)) else "")
            for i, (n, t) in enumerate(sig.items())
        )
    )
    return job_channel_pb2.KernelArtifact(
        role=role,
        type=kernel_pb2.KERNEL_TYPE_TRITON,
        cubin=cubin,
        function=str(md.name),
        arch=arch,
        num_warps=num_warps,
        shared_bytes=shared,
        global_scratch_bytes=int(getattr(md, "global_scratch_size", 0) or 0),
        global_scratch_align=int(getattr(md, "global_scratch_align", 1) or 1),
        profile_scratch_bytes=int(getattr(md, "profile_scratch_size", 0) or 0),
        profile_scratch_align=int(getattr(md, "profile_scratch_align", 1) or 1),
        build_log=log,
        notes=[
            f"triton ({md.name}, {arch}): built ahead, {num_warps} warps, "
            f"{num_stages} stages, {shared} bytes of shared memory"
        ],
    )
