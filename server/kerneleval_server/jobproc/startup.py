"""A job process's start, before its first job: the environment, the engine, the warm-up.

The zygote calls `load_engine()` once (the environment is configured before torch and triton
are imported, and no CUDA context is made: the zygote forks), and each job process calls
`warm_up()` before its privileges drop (CUDA context, a cuBLAS matmul, one tiny Triton kernel;
only when a GPU is visible). `device_info()` is what a job process's Hello says of its device.
Apart from the job loop (runtime.py): most of this runs in the zygote, which runs no job.
"""

# No `from __future__ import annotations`: the Triton warm-up kernel's `tl.constexpr`
# annotation must be a real object when Triton reads it.

import importlib
import os
import sys
import warnings
from types import ModuleType
from typing import Any

from kerneleval.v1 import job_pb2

from . import (
    BUILD_DEVICE,
    DEFAULT_ENGINE,
    DEVICE_INDEX_ENV,
    ENGINE_ENV,
    TRITON_BINARY_ONLY_ENV,
    warm_job,
)

NVML_CHECK_ENV = "PYTORCH_NVML_BASED_CUDA_CHECK"


def gpu_visible() -> bool:
    """A GPU may be used: CUDA_VISIBLE_DEVICES is not "" and the driver's node exists. Decided
    without CUDA, so that nothing initialises it in the zygote."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset") == "":
        return False
    return os.path.exists("/dev/nvidiactl")


def configure_environment(engine_name: str) -> dict[str, str]:
    """Settings that must be in place before torch and triton are imported, then the engine's
    own `configure_process_environment()`. Returns the variables this set (the zygote hands
    them on to its job processes, whose environment is otherwise job_env)."""
    before = dict(os.environ)
    # Decided here, from the device nodes, so that the engine's configuration does not ask
    # torch.cuda.is_available(): that initialises the CUDA driver (even NVML-based), and the
    # zygote forks. "0" is Triton's "off".
    # Build processes compile for a GPU they do not have: never Triton's interpreter there.
    compiles = gpu_visible() or os.environ.get(DEVICE_INDEX_ENV) == str(BUILD_DEVICE)
    os.environ.setdefault("TRITON_INTERPRET", "0" if compiles else "1")
    # Triton keeps a kernel's binary and metadata only, not its IRs (ttir, ttgir, llir, ptx):
    # a later job with the same code gets fewer files written into its compile cache, and its
    # first call reads fewer (Triton reads every file of a cached kernel; H100: seeding 0.5
    # ms, that read 0.9 ms of a ModelNew's first call). Entries fit MAX_ENTRY_BYTES sooner.
    os.environ.setdefault(TRITON_BINARY_ONLY_ENV, "1")
    # Should anything still ask, NVML answers instead of CUDA. Only the zygote's setting.
    os.environ.setdefault(NVML_CHECK_ENV, "1")
    engine = importlib.import_module(engine_name)
    configure = getattr(engine, "configure_process_environment", None)
    if configure is not None:
        configure()
    configured = {k: v for k, v in os.environ.items() if before.get(k) != v}
    configured.pop(NVML_CHECK_ENV, None)
    return configured


def library_versions() -> dict[str, str]:
    """torch and triton versions; "" for one that is missing (or not loaded by a light engine)."""
    versions = {}
    for name in ("torch", "triton"):
        module = sys.modules.get(name)
        versions[name] = str(getattr(module, "__version__", "")) if module is not None else ""
    return versions


# triton (the warm-up runs a kernel); torch's extension builder (load_inline, and the engine's
# extension folder for every ModelNew); what Triton's compiler imports on its first compile.
PREIMPORTED = (
    "triton",
    "torch.utils.cpp_extension",
    "triton.compiler.compiler",
    "triton.experimental.gluon.nvidia.hopper",
    "torch.utils._device",  # `with torch.device(...)`, around every get_inputs() call
)


def _hash_triton_once() -> None:
    """Triton keys its cache with a hash of its own files, libtriton included (about 1 s),
    computed once a process on its first kernel: computed here, every job process inherits
    it instead of paying it in its warm-up."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):  # newer, older Triton
        key = getattr(sys.modules.get(module) or _try_import(module), "triton_key", None)
        if callable(key):
            try:
                key()
            except Exception:  # noqa: BLE001 - only a head start; the warm-up computes it too
                pass
            return


def _try_import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def load_engine(engine_name: str | None = None) -> tuple[ModuleType, dict[str, str]]:
    """Configures the environment and imports the engine (KERNELEVAL_ENGINE, default
    kerneleval_server.engine, which imports torch and triton) without making a CUDA context.
    Returns the engine and the variables the configuration set."""
    name = engine_name or os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE
    configured = configure_environment(name)
    engine = importlib.import_module(name)
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        # Modules jobs import on first use (measured: ~70 ms a job on the CPU machine), imported
        # once here so that every job process finds them loaded.
        # The service's engine imports its debug aids' module on a job's first call (not from
        # the package: `python -m ...engine.isolated` runs it as a script).
        extra = (f"{DEFAULT_ENGINE}.isolated",) if name == DEFAULT_ENGINE else ()
        for module in (*PREIMPORTED, *extra):
            try:
                importlib.import_module(module)
            except ImportError:
                pass
        _hash_triton_once()
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError(f"importing {name} created a CUDA context; the zygote cannot fork")
    if cuda_driver_threads():
        print(
            f"kerneleval zygote: importing {name} initialised the CUDA driver before the fork",
            file=sys.stderr,
        )
    return engine, configured


def cuda_driver_threads() -> list[str]:
    """Names of the CUDA driver's threads in this process (there are some once cuInit ran)."""
    names = []
    try:
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
            if name.startswith("cuda"):
                names.append(name)
    except OSError:
        pass
    return names


def warm_up() -> None:
    """As root, before the drop, in a fresh job process: CUDA context, a cuBLAS matmul, one
    tiny Triton kernel and a tiny evaluation through the engine (warm_job.py), so that the job
    starts warm. Nothing without a visible GPU. Failures are printed; the job reports what is
    wrong with the device."""
    torch: Any = sys.modules.get("torch")
    if torch is None or not gpu_visible():
        return
    try:
        with warnings.catch_warnings():  # "Can't initialize NVML" and the like: not the job's
            warnings.simplefilter("ignore")
            if not torch.cuda.is_available():
                return
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        if "triton" in sys.modules:
            _warm_triton(torch)
        engine = sys.modules.get(DEFAULT_ENGINE)
        if engine is not None and (os.environ.get(ENGINE_ENV) or DEFAULT_ENGINE) == DEFAULT_ENGINE:
            result = warm_job.run(engine)  # the real engine only: a test engine has its own
            if result.verdict != job_pb2.VERDICT_OK:
                print(f"kerneleval job process: warm-up job: {result}", file=sys.stderr)
            # NVML's peak memory bandwidth (the faster_than_memory floor), asked once here:
            # not inside a job's timing window.
            integrity = sys.modules.get(DEFAULT_ENGINE + ".integrity")
            if integrity is not None:
                integrity.peak_bandwidth(0)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the job reports what is wrong
        print(f"kerneleval job process: warm-up failed: {exc!r}", file=sys.stderr)


def _warm_triton(torch: Any) -> None:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def _kerneleval_warm_up(x_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offsets = tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)

    x = torch.zeros(16, device="cuda")
    _kerneleval_warm_up[(1,)](x, 16, BLOCK=16)


def device_info(device_index: int) -> job_pb2.DeviceInfo:
    versions = library_versions()
    info = job_pb2.DeviceInfo(
        index=device_index,
        torch_version=versions["torch"],
        triton_version=versions["triton"],
        name="cpu",
    )
    torch: Any = sys.modules.get("torch")
    if device_index >= 0 and torch is not None and gpu_visible():
        try:
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(0)
                info.name = props.name
                info.compute_capability = f"{props.major}.{props.minor}"
                info.cuda_version = torch.version.cuda or ""
        except Exception:  # noqa: BLE001 - the engine reports device problems per job
            pass
    return info
