"""The engine's pieces on their own: CUDA error parsing, statistics, CPU timing, kernel names,
ncu output, pre-flight."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server.engine import errors, preflight, timing
from kerneleval_server.engine.backends.cuda import _static_shared, base_name, pick_kernel
from kerneleval_server.engine.device import DeviceLimits
from kerneleval_server.engine.isolated import parse_ncu_csv
from kerneleval_server.engine.loader import CompileError


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("CUDA error: an illegal memory access was encountered", 700),
        ("RuntimeError: CUDA error: misaligned address", 716),
        ("cudaErrorLaunchFailure", 719),
        ("CUDA driver error: CUDA_ERROR_MISALIGNED_ADDRESS", 716),
        ("CUDA error: unknown error code 700", 700),
        ("CUDA error: too many resources requested for launch", 701),
    ],
)
def test_find_cuda_error(message: str, code: int) -> None:
    e = errors.find_cuda_error(message)
    assert e is not None and e.code == code


def test_plain_python_errors_are_not_cuda_errors() -> None:
    assert errors.find_cuda_error("invalid argument to foo()") is None
    assert errors.find_cuda_error("error code 700 in my parser") is None
    f = errors.classify(ValueError("bad"))
    assert f.verdict == job_pb2.VERDICT_RUNTIME_ERROR and not f.context_poisoned


def test_launch_out_of_resources_is_a_resource_limit() -> None:
    f = errors.classify(RuntimeError("CUDA error: too many resources requested for launch"))
    assert f.verdict == job_pb2.VERDICT_RESOURCE_LIMIT and f.error.cuda_error_code == 701


def test_statistics() -> None:
    s = timing.stats([1.0, 2.0, 3.0, 4.0, 100.0], job_pb2.TIMING_SOURCE_CUDA_EVENTS, flushed=True)
    assert s.median_ms == 3.0 and s.mean_ms == 22.0 and s.min_ms == 1.0 and s.max_ms == 100.0
    assert s.std_ms == pytest.approx(statistics.stdev([1.0, 2.0, 3.0, 4.0, 100.0]))
    assert s.p95_ms == pytest.approx(80.8) and s.p99_ms == pytest.approx(96.16)
    assert s.trial_count == 5 and s.l2_flushed and s.source == job_pb2.TIMING_SOURCE_CUDA_EVENTS


def test_cpu_timing_measures_the_call() -> None:
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)
        time.sleep(0.002)

    seen: list[tuple[int, int]] = []
    t = timing.measure(
        fn,
        trials=10,
        warmup=3,
        flush_l2=True,
        device=torch.device("cpu"),
        progress=lambda d, n: seen.append((d, n)),
    )
    assert len(calls) == 13 and t.stats.trial_count == 10
    assert 2.0 <= t.stats.median_ms < 20 and not t.stats.l2_flushed
    assert t.stats.source == job_pb2.TIMING_SOURCE_CPU_WALL_CLOCK
    assert seen[-1] == (10, 10)


def test_kernel_names() -> None:
    assert base_name("_Z3fooPfi") == "foo"
    assert base_name("_ZN2ns6kernelEPKfPfi") == "kernel"
    assert base_name("bar") == "bar"
    assert pick_kernel(["_Z3fooPfi", "bar"], "foo") == "_Z3fooPfi"
    assert pick_kernel(["bar"], "") == "bar"
    with pytest.raises(CompileError, match="no __global__ function baz"):
        pick_kernel(["_Z3fooPfi", "bar"], "baz")


def test_static_shared_from_ptxas() -> None:
    log = (
        "ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90'\n"
        "ptxas info    : Used 10 registers, used 1 barriers, 8192 bytes smem\n"
        "ptxas info    : Compiling entry function 'bar' for 'sm_90'\n"
        "ptxas info    : Used 4 registers, used 0 barriers\n"
    )
    assert _static_shared(log) == {"_Z3fooPf": 8192}


def test_preflight_limits() -> None:
    limits = DeviceLimits(max_shared_memory_per_block_optin=232448)
    ok = kernel_pb2.LaunchConfig(grid=kernel_pb2.Dim3(x=1 << 20), block=kernel_pb2.Dim3(x=1024))
    preflight.check_cuda_launch(ok, limits)
    with pytest.raises(preflight.ResourceLimitError, match="grid.y = 70000"):
        preflight.check_cuda_launch(kernel_pb2.LaunchConfig(grid=kernel_pb2.Dim3(y=70000)), limits)
    with pytest.raises(preflight.ResourceLimitError, match="block.z = 128"):
        preflight.check_cuda_launch(kernel_pb2.LaunchConfig(block=kernel_pb2.Dim3(z=128)), limits)
    with pytest.raises(preflight.ResourceLimitError, match="limit of 512 threads"):
        preflight.check_cuda_launch(ok, limits, kernel_max_threads=512)
    with pytest.raises(preflight.ResourceLimitError, match="required: 232449"):
        preflight.check_cuda_launch(
            kernel_pb2.LaunchConfig(shared_memory_bytes=232000), limits, static_shared_bytes=449
        )
    with pytest.raises(preflight.ResourceLimitError, match="Required|required: 1049600"):
        preflight.check_triton_shared(1049600, limits)


HEADER = (
    "ID,Process ID,Process Name,Host Name,Kernel Name,Context,Stream,Block Size,Grid Size,"
    "Device,CC,Section Name,Metric Name,Metric Unit,Metric Value"
)


def ncu_row(kernel_id: str, metric: str, unit: str, value: str) -> str:
    cells = [
        kernel_id,
        "1234",
        "python",
        "host",
        "add_kernel",
        "1",
        "7",
        "(128, 1, 1)",
        "(8, 1, 1)",
        "0",
        "9.0",
        "Command line profiler metrics",
        metric,
        unit,
        value,
    ]
    return ",".join(f'"{c}"' for c in cells)


NCU_CSV = "\n".join(
    [
        "==PROF== Connected to process 1234",
        ",".join(f'"{h}"' for h in HEADER.split(",")),
        ncu_row("0", "dram__throughput.avg.pct_of_peak_sustained_elapsed", "%", "12.5"),
        ncu_row("0", "gpu__time_duration.sum", "usecond", "3.20"),
        ncu_row("1", "gpu__time_duration.sum", "nsecond", "1,800"),
        "==PROF== Disconnected from process 1234",
    ]
)


def test_parse_ncu_csv() -> None:
    m = parse_ncu_csv(NCU_CSV)
    assert m is not None and m.kernel_name == "add_kernel"
    assert m.values["dram__throughput.avg.pct_of_peak_sustained_elapsed"] == 12.5
    assert m.values["gpu__time_duration.sum"] == pytest.approx(5000.0)  # ns, both launches
    assert parse_ncu_csv("==PROF== no kernels were profiled") is None


class SimGpu:
    """A device timeline: the launching stream, one side stream, host sync latency (ms)."""

    def __init__(self, kernel_ms: float, side_ms: float = 0.0) -> None:
        self.now = 0.0
        self.side_end = 0.0
        self.kernel_ms, self.side_ms = kernel_ms, side_ms
        self.flushes = 0

    def event(self) -> SimGpu.Event:
        return SimGpu.Event(self)

    class Event:
        def __init__(self, gpu: SimGpu) -> None:
            self.gpu, self.t = gpu, 0.0

        def record(self) -> None:
            self.t = self.gpu.now

        def elapsed_time(self, other: SimGpu.Event) -> float:
            return other.t - self.t

    def run_kernel(self) -> None:
        launched = self.now
        self.now += self.kernel_ms
        if self.side_ms:
            self.side_end = launched + self.side_ms

    late_syncs: list[int] = []  # indices of synchronizes after which the host is 1 ms late
    syncs = 0

    def synchronize(self) -> None:
        self.now = max(self.now, self.side_end) + 0.004
        self.syncs += 1
        if self.syncs in self.late_syncs:
            self.now += 1.0

    def flush_buffer(self) -> object:
        return object()

    def flush(self, buffer: object) -> None:
        self.flushes += 1
        self.now += 0.08

    def idle(self) -> None:
        self.now += 0.05


def test_cuda_timing_counts_the_launching_stream() -> None:
    gpu = SimGpu(kernel_ms=0.25)
    t = timing._measure_cuda(gpu.run_kernel, 50, 5, True, lambda d: None, ops=gpu)
    assert t.stats.median_ms == pytest.approx(0.25) and t.side_stream_trials == 0
    assert t.stats.source == job_pb2.TIMING_SOURCE_CUDA_EVENTS and t.stats.l2_flushed
    assert gpu.flushes == 50  # the L2 flush before every timed trial


def test_hidden_work_needs_most_probe_runs_late() -> None:
    gpu = SimGpu(kernel_ms=0.25)
    first = gpu.syncs + 1  # each probe run synchronizes twice; the first one makes it late
    gpu.late_syncs = [first, first + 2]  # a late host thread in two of five runs: noise
    assert not timing._hides_work(gpu.run_kernel, gpu, baseline=0.004)
    first = gpu.syncs + 1
    gpu.late_syncs = [first, first + 2, first + 4]  # three of five: work outlasts the stream
    assert timing._hides_work(gpu.run_kernel, gpu, baseline=0.004)


def test_warm_up_lasts_at_least_as_long_as_do_bench_s() -> None:
    calls = []
    gpu = SimGpu(kernel_ms=0.25)

    def kernel() -> None:
        calls.append(1)
        gpu.run_kernel()

    timing._warm_up(kernel, 10, gpu)
    assert len(calls) == 100  # 10 runs took 2.5 ms: 90 more make 25 ms
    calls.clear()
    timing._warm_up(kernel, 0, gpu)
    assert calls == []  # warmup_count 0 means none


def test_cuda_timing_counts_work_hidden_on_another_stream() -> None:
    gpu = SimGpu(kernel_ms=0.01, side_ms=0.5)  # returns at once, the work runs elsewhere
    t = timing._measure_cuda(gpu.run_kernel, 20, 2, False, lambda d: None, ops=gpu)
    assert t.side_stream_trials == 20
    assert t.stats.median_ms == pytest.approx(0.5, abs=0.01) and not t.stats.l2_flushed


class FakeL2:
    """timing.PersistingL2 over a simulated limit: records every reset into `events`."""

    note = ""

    def __init__(self, events: list[str]) -> None:
        self.events, self.limit = events, 0

    def reset(self) -> int:
        self.events.append("reset")
        found, self.limit = self.limit, 0
        return found


def _l2_timeline(monkeypatch: pytest.MonkeyPatch, side_ms: float = 0.0):
    events: list[str] = []
    l2 = FakeL2(events)
    monkeypatch.setattr(timing, "persisting_l2", lambda: l2)
    gpu = SimGpu(kernel_ms=0.25, side_ms=side_ms)
    flush = gpu.flush
    gpu.flush = lambda buffer: (events.append("flush"), flush(buffer))  # type: ignore[method-assign]
    return events, l2, gpu


@pytest.mark.parametrize("side_ms", [0.0, 0.5])  # queued trials; synchronized ones
def test_persisting_l2_is_reset_before_every_timed_trial(
    monkeypatch: pytest.MonkeyPatch, side_ms: float
) -> None:
    events, l2, gpu = _l2_timeline(monkeypatch, side_ms)

    def kernel() -> None:
        events.append("run")
        gpu.run_kernel()

    t = timing._measure_cuda(kernel, 20, 2, True, lambda d: None, ops=gpu)
    assert (t.side_stream_trials > 0) == (side_ms > 0)
    assert events[0] == "reset"  # before the warm-ups
    # each timed trial: demoted, then flushed (lines still persisting would survive the
    # flush), then run; once more after the last
    assert events[-61:] == ["reset", "flush", "run"] * 20 + ["reset"]
    assert events.count("reset") == 22 and t.persisting_l2_bytes == 0 and t.note == ""

    events.clear()
    l2.limit = 8 << 20  # set aside before the timing (a constructor, or the driver's default)
    t = timing._measure_cuda(kernel, 20, 2, True, lambda d: None, ops=gpu)
    assert t.persisting_l2_bytes == 0 and l2.limit == 0  # reset, but not the kernel's doing

    def persisting_kernel() -> None:
        kernel()
        l2.limit = 8 << 20  # cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, 8 MiB)

    t = timing._measure_cuda(persisting_kernel, 20, 2, True, lambda d: None, ops=gpu)
    assert t.persisting_l2_bytes == 8 << 20
    assert t.persisting_l2_resets == 21  # before every trial and after the last
    assert l2.limit == 0  # nothing left to the next code timed


def test_persisting_l2_control_fails_soft() -> None:
    class Runtime:
        """A libcudart whose persisting-L2 calls fail (a GPU without the limit)."""

        def __init__(self) -> None:
            self.cleared = 0

        def cudaDeviceGetLimit(self, size, limit) -> int:  # noqa: N802 - CUDA's names
            return 0

        def cudaCtxResetPersistingL2Cache(self) -> int:  # noqa: N802
            return 801  # cudaErrorNotSupported

        def cudaDeviceSetLimit(self, limit, size) -> int:  # noqa: N802
            return 0

        def cudaGetLastError(self) -> int:  # noqa: N802
            self.cleared += 1
            return 801

    lib = Runtime()
    control = timing.PersistingL2(lib)
    assert control.reset() is None and lib.cleared == 1  # torch's next check sees no error
    assert "cudaCtxResetPersistingL2Cache failed (cudaError 801)" in control.note
    assert control.reset() is None and lib.cleared == 1  # it stops trying
    absent = timing._load_cudart() if not torch.cuda.is_available() else None
    if absent is not None and absent.lib is None:  # a CPU build of torch loads no libcudart
        assert "libcudart" in absent.note and absent.reset() is None


def test_documented_defaults() -> None:
    from kerneleval_server.engine import Options

    o = Options.of(kernel_pb2.EvalOptions())
    assert (o.correct_trials, o.perf_trials, o.warmup, o.seed, o.flush_l2) == (5, 100, 10, 42, True)
    assert o.atol is None and o.rtol is None  # by output dtype, see compare.DEFAULT_TOLERANCE
    z = Options.of(kernel_pb2.EvalOptions(perf_trial_count=0, flush_l2=False, atol=0.0, seed=0))
    assert (z.perf_trials, z.flush_l2, z.atol, z.seed) == (0, False, 0.0, 0)
    from kerneleval_server.engine.compare import tolerances

    assert tolerances(torch.float32, None, None) == (1e-4, 1e-4)
    assert tolerances(torch.bfloat16, None, 0.5) == (1e-2, 0.5)
    assert tolerances(torch.int32, None, None) == (0.0, 0.0)
