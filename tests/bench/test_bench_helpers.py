"""The bench/ scripts' helpers and planted kernels, checked on the CPU.

The GPU benchmarks run once, on a lent machine; these tests make sure what they send is
accepted by the service's validation, that the planted faults get the verdicts the soak
expects (where the CPU can run them), and that the statistics and parsers are right.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import _baseline  # noqa: E402
import _common as C  # noqa: E402
import _kernels as K  # noqa: E402
import bench_interference  # noqa: E402
import bench_kernelbench  # noqa: E402
import bench_overhead  # noqa: E402
import bench_throughput  # noqa: E402
import bench_timing_fidelity  # noqa: E402
import fault_soak  # noqa: E402
from google.protobuf import timestamp_pb2  # noqa: E402
from kerneleval.v1 import job_pb2  # noqa: E402
from kerneleval_server.spec.validation import validate_spec  # noqa: E402

KERNELBENCH = REPO.parent / "shared" / "kernelbench"


def test_percentile_and_summary() -> None:
    values = [float(v) for v in range(1, 101)]
    assert C.percentile(values, 50) == 50.0
    assert C.percentile(values, 99) == 99.0
    assert C.percentile(values, 100) == 100.0
    assert C.percentile([], 50) == 0.0
    s = C.summary([3.0, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"], s["mean"]) == (3, 2.0, 1.0, 3.0, 2.0)


def test_tables_and_results(tmp_path: Path) -> None:
    info = C.machine_info()
    assert info["python"] and info["torch"] != "absent" and "date_utc" in info
    C.write_results(tmp_path, "x", "Title", info, {"k": 1}, [("cap", ["a", "b"], [["r", 0.5]])])
    data = json.loads((tmp_path / "x.json").read_text())
    assert data["k"] == 1 and data["machine"]["python"] == info["python"]
    md = (tmp_path / "x.md").read_text()
    assert "| a | b |" in md and "| r | 0.5 |" in md and "Machine:" in md


@pytest.fixture
def soak_gpu(tmp_path: Path) -> Iterator[fault_soak.Soak]:
    args = argparse.Namespace(cpu_smoke=False, fork_cap=4, memory_cap_gib=0.5, hang_timeout=5)
    soak = fault_soak.Soak(args, tmp_path)
    yield soak
    soak.listener.close()


def test_every_soak_spec_passes_validation(soak_gpu: fault_soak.Soak) -> None:
    for i, kind in enumerate(soak_gpu.good + soak_gpu.bad):
        spec = soak_gpu.spec(kind, i)
        assert validate_spec(spec) == [], kind
        assert soak_gpu.expected(kind), kind
    assert "good_cuda" in soak_gpu.good and "cuda_misaligned" in soak_gpu.bad
    assert soak_gpu.spec("hang", 0).options.timeout.seconds == 5


def test_bench_specs_pass_validation() -> None:
    for kind in ("io", "modelnew"):
        for spec in bench_throughput.candidates(6, 4096, cuda=True, kind=kind):
            assert validate_spec(spec) == [], kind
    for spec in (K.triton_oob_spec(), K.cuda_bad_spec(K.CUDA_OOB, "t")):
        assert validate_spec(spec) == []
    # Distinct candidates are distinct sources (no compile cache hit between them).
    a, b = bench_throughput.candidates(2, 4096, cuda=False, kind="io", offset=8)
    assert a.kernel.source_code != b.kernel.source_code


def test_planted_faults_get_their_verdicts_in_the_engine(
    soak_gpu: fault_soak.Soak, tmp_path: Path
) -> None:
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job

    for kind, verdict in (
        ("exception", job_pb2.VERDICT_RUNTIME_ERROR),
        ("memory_bomb", job_pb2.VERDICT_RUNTIME_ERROR),  # no limit here: reaches its own cap
        ("fork_bomb", job_pb2.VERDICT_RUNTIME_ERROR),
        ("network", job_pb2.VERDICT_RUNTIME_ERROR),
    ):
        spec = soak_gpu.spec(kind, 1)
        outcome = run_job(spec, NullReporter(), EngineConfig(work_dir=tmp_path / kind))
        assert outcome.result.verdict == verdict, (kind, outcome.result)
        if kind == "fork_bomb":
            assert "4 forks" in outcome.result.error.message
        if kind == "network":  # in this process nothing isolates the network
            time.sleep(0.6)
            assert soak_gpu.listener.accepted >= 1
            assert "network probe: connected" in outcome.result.error.message


def test_listener_counts_connections(soak_gpu: fault_soak.Soak) -> None:
    before = soak_gpu.listener.accepted
    socket.create_connection(("127.0.0.1", soak_gpu.listener.port), timeout=2).close()
    deadline = time.monotonic() + 5
    while soak_gpu.listener.accepted == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert soak_gpu.listener.accepted == before + 1


def test_probe_outside_reports_and_removes(soak_gpu: fault_soak.Soak, tmp_path: Path) -> None:
    assert soak_gpu.probe_outside().startswith("stopped")
    Path(soak_gpu.probe_paths[-1]).write_text("x")
    report = soak_gpu.probe_outside()
    assert report.startswith("written") and soak_gpu.probe_paths[-1] in report
    assert not Path(soak_gpu.probe_paths[-1]).exists()


def _event(kind: str, t: float, **fields: object) -> job_pb2.JobEvent:
    ev = job_pb2.JobEvent(time=timestamp_pb2.Timestamp(seconds=int(t), nanos=int(t % 1 * 1e9)))
    if kind == "started":
        ev.started.device_index = int(fields["device"])  # type: ignore[call-overload]
    elif kind == "phase":
        ev.phase.phase = int(fields["phase"])  # type: ignore[call-overload, assignment]
    elif kind == "finished":
        ev.finished.state = job_pb2.JOB_STATE_DONE
    return ev


def test_timing_window_fraction_is_per_device_and_at_most_one() -> None:
    before = {0: (10.0, 12.0)}
    after = {0: (14.0, 17.0), 1: (1.0, 1.0)}  # device 1 appeared during the batch
    assert bench_throughput.window_fraction(before, after, 8.0) == {"0": 0.5, "1": 0.125}
    assert bench_throughput.window_fraction({}, {0: (1.0, 1.0)}, 0.0) == {}
    # held 4 s of the 5 s a window was held or asked for on device 0
    assert bench_throughput.held_of_wanted(before, after) == {"0": 0.8, "1": 1.0}
    assert bench_throughput.held_of_wanted(after, after) == {}


def test_kernelbench_scaling() -> None:
    text = "N = 2048 * 2\ninput_shape = (32768,)\ndim = 1  # keep\n    x = 99999\nk = (3, 5)\n"
    out = bench_kernelbench.scaled(text, 64)
    assert "N = 64\n" in out and "input_shape = (64,)" in out and "dim = 1" in out
    assert "    x = 99999" in out and "k = (3, 5)" in out
    if KERNELBENCH.exists():
        problems = sorted((KERNELBENCH / "level1").glob("*.py"), key=bench_kernelbench.problem_key)
        assert problems[0].name.startswith("1_") and problems[-1].name.startswith("100_")


def test_baseline_output_parsers() -> None:
    out = 'noise\nBASELINE_ITEM {"path": "/a/p.py", "events_median_ms": 1.5}\n'
    out += 'BASELINE_JSON {"ok": true}\n'
    assert _baseline.parse_items(out) == {"/a/p.py": {"events_median_ms": 1.5}}
    assert _baseline.parse_output(out) == {"ok": True}
    with pytest.raises(ValueError):
        _baseline.parse_output("nothing")


def test_baseline_cuda_init_runs_as_a_process() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "_baseline.py"), "cuda-init"],
        capture_output=True, text=True, env=C.child_env(), timeout=120,
    )  # fmt: skip
    res = _baseline.parse_output(proc.stdout)
    assert res["import_torch_s"] > 0 and res["since_interpreter_start_s"] >= res["import_torch_s"]


NCU_CSV = """==PROF== Connected to process 4242 (/usr/bin/python3.12)
==PROF== Profiling "vectorized_elementwise_kernel" - 0: 0%....50%....100% - 1 pass
BASELINE_JSON {"forwards": 2}
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",\
"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","4242","python3.12","127.0.0.1","void k<float>(int)","1","7","(128, 1, 1)","(8, 1, 1)",\
"0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","5.50"
"1","4242","python3.12","127.0.0.1","void k<float>(int)","1","7","(128, 1, 1)","(8, 1, 1)",\
"0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","4,500"
"""  # a backslash at a line end continues the line: ncu writes one line per row


def test_parse_ncu_csv() -> None:
    total_ms, kernels = bench_timing_fidelity.parse_ncu_csv(NCU_CSV)
    assert kernels == 2
    assert total_ms == pytest.approx(0.0055 + 0.0045)
    assert bench_timing_fidelity.parse_ncu_csv("==PROF== ERR_NVGPUCTRPERM") == (0.0, 0)


def _has_nvcc() -> bool:
    import shutil

    return bool(shutil.which("nvcc")) or Path("/usr/local/cuda/bin/nvcc").exists()


@pytest.mark.skipif(not _has_nvcc(), reason="no nvcc: the CUDA sources cannot be compiled here")
def test_cuda_sources_compile(soak_gpu: fault_soak.Soak, tmp_path: Path) -> None:
    """The GPU-only kinds at least compile here (they report that they cannot run)."""
    from kerneleval_server.engine import EngineConfig, NullReporter, run_job

    specs = [(k, soak_gpu.spec(k, 1)) for k in ("good_cuda", "cuda_oob", "cuda_misaligned", "hang")]
    specs.append(("candidate", bench_throughput.candidates(2, 4096, cuda=True, kind="io")[1]))
    for name, spec in specs:
        result = run_job(spec, NullReporter(), EngineConfig(work_dir=tmp_path / name)).result
        assert result.compiled, (name, result.compilation_error)


def test_interference_specs_pass_validation() -> None:
    assert validate_spec(bench_interference.timed_spec(4096)) == []
    heavy = bench_interference.HEAVY.format(n=8192, loops=20)
    hostile = bench_interference.HOSTILE.format(n=8192, sleep=15)
    for source, trials in ((heavy, 8), (hostile, 1)):
        assert validate_spec(bench_interference.neighbour_spec(source, trials, "t")) == []


def test_a_judged_jobs_time_is_split_at_its_judge() -> None:
    """_segments.breakdown: the phases after the judge's hand-over (its log line) are the
    judge's; a job timed by its judge has the reference's timing as its last segment."""
    import _segments as S

    def event(at_ms: float, **kind: object) -> job_pb2.JobEvent:
        ev = job_pb2.JobEvent(**kind)  # type: ignore[arg-type]
        ev.time.FromNanoseconds(int((1000.0 + at_ms / 1e3) * 1e9))
        return ev

    events = [
        event(1, started=job_pb2.JobStarted()),
        event(2, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_COMPILING)),
        event(3, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_VALIDATING)),
        event(5, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_PROFILING)),
        event(9, log=job_pb2.JobLog(text=S.JUDGE_LOG + "d0-w3, ...")),
        event(10, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_COMPILING)),
        event(12, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_VALIDATING)),
        event(15, phase=job_pb2.JobPhase(phase=job_pb2.PHASE_PROFILING)),
        event(20, finished=job_pb2.Job()),
    ]
    ms = {k: round(v * 1e3, 3) for k, v in S.breakdown(events, 1000.0).items()}
    assert ms == {
        "accepted -> started": 1.0,
        "started -> compiling (job process got it)": 1.0,
        "compiling (import, build, load)": 1.0,
        "validating (inputs, reference, checks)": 2.0,
        "profiling (warm-up, timed trials)": 15.0,
        "judged: kernel checked -> judge given the job": 6.0,
        "judged: judge got it -> reference built, record read": 3.0,
        "judged: judge's checks (reference runs, compare)": 3.0,
        "judged: judge timing the reference": 5.0,
    }
    summary = S.medians_ms([S.breakdown(events, 1000.0)] * 3)
    assert summary["accepted -> started"]["n"] == 3


def test_the_slowest_calls_name_the_segments_that_grew() -> None:
    """bench_overhead's outliers: the slowest calls, slowest first, each with the segments
    longest past their medians (an outlier's p99 says nothing of where its time went)."""
    calls = [{"wall": 0.010, "a": 0.004, "b": 0.003} for _ in range(8)]
    calls.append({"wall": 0.050, "a": 0.004, "b": 0.043})
    calls.append({"wall": 0.020, "a": 0.013, "b": 0.003})
    worst = bench_overhead.slowest(calls, k=2)
    assert [w["wall"] for w in worst] == [0.050, 0.020]
    assert next(iter(worst[0]["over_median"])) == "b"
    assert worst[0]["over_median"]["b"] == pytest.approx(0.040)
    assert next(iter(worst[1]["over_median"])) == "a"
