"""The job runtime with the real engine on the CPU (a tiny torch Model), over a socketpair:
Hello first (no Welcome awaited), exactly one job, phases, the grant wait, VERDICT_OK, exit 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from jp_helpers import ADD_MODEL, REPO
from kerneleval.internal.v1 import job_channel_pb2 as jc
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server.framing import encode, recv_frame
from kerneleval_server.jobproc import GATED_PHASES, MAX_LOG_LINE_BYTES
from kerneleval_server.jobproc.channel import _truncate


def _spec(code: str) -> kernel_pb2.JobSpec:
    kernel = kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=code)
    options = kernel_pb2.EvalOptions(perf_trial_count=3, warmup_count=1)
    return kernel_pb2.JobSpec(kernel=kernel, options=options)


def _start(tmp_path: os.PathLike[str]) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    env = dict(os.environ)
    env.update(
        {
            "CUDA_VISIBLE_DEVICES": "",
            "KERNELEVAL_DEVICE_INDEX": "-1",
            "KERNELEVAL_WORKER_ID": "w-rt",
            "TMPDIR": str(tmp_path),
        }
    )
    env.pop("KERNELEVAL_ENGINE", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kerneleval_server.jobproc.runtime", str(theirs.fileno())],
        pass_fds=[theirs.fileno()],
        env=env,
        cwd=REPO,
    )
    theirs.close()
    ours.settimeout(120)
    return proc, ours


def _messages(sock: socket.socket) -> list[jc.JobProcessMessage]:
    out: list[jc.JobProcessMessage] = []
    while True:
        frame = recv_frame(sock)
        if frame is None:
            return out
        out.append(jc.JobProcessMessage.FromString(frame))


# Imported once: the job process writes no bytecode for it.
ONCE = ADD_MODEL + "\nimport sys\n\nassert sys.dont_write_bytecode\n"


def test_one_job_then_exit(tmp_path: os.PathLike[str]) -> None:
    proc, sock = _start(tmp_path)
    first = recv_frame(sock)
    assert first is not None
    hello = jc.JobProcessMessage.FromString(first)
    assert hello.WhichOneof("kind") == "hello"
    assert hello.hello.worker_id == "w-rt" and hello.hello.pid == proc.pid
    assert hello.hello.device_index == -1 and hello.hello.device.name == "cpu"
    assert hello.hello.device.torch_version  # the real engine imported torch

    # a Welcome is not needed and is ignored; the second AssignJob is never taken
    for request in (
        jc.FrontendMessage(welcome=jc.Welcome(worker_id="w-rt")),
        jc.FrontendMessage(assign=jc.AssignJob(job_id="job-1", spec=_spec(ONCE), attempt=1)),
        jc.FrontendMessage(assign=jc.AssignJob(job_id="job-2", spec=_spec(ADD_MODEL), attempt=1)),
    ):
        sock.sendall(encode(request.SerializeToString()))

    seen: list[jc.JobProcessMessage] = []
    while True:
        frame = recv_frame(sock)
        assert frame is not None, "the job process closed its channel before the outcome"
        msg = jc.JobProcessMessage.FromString(frame)
        seen.append(msg)
        kind = msg.WhichOneof("kind")
        if kind == "phase" and msg.phase.phase in GATED_PHASES:
            # it waits for that phase's grant: nothing but the phase came yet
            grant = jc.GpuGrant(job_id="job-1", phase=msg.phase.phase)
            sock.sendall(encode(jc.FrontendMessage(grant=grant).SerializeToString()))
        if kind == "outcome":
            break
    seen += _messages(sock)  # nothing after the outcome; then the channel closes
    assert proc.wait(timeout=60) == 0

    said = [m.phase for m in seen if m.WhichOneof("kind") == "phase"]
    phases = [p.phase for p in said if not p.ahead]
    assert phases == [job_pb2.PHASE_COMPILING, job_pb2.PHASE_VALIDATING, job_pb2.PHASE_PROFILING]
    # its check's grant asked for once its kernel was built, before the phase itself
    assert [(p.phase, p.ahead) for p in said[1:3]] == [
        (job_pb2.PHASE_VALIDATING, True),
        (job_pb2.PHASE_VALIDATING, False),
    ]
    outcomes = [m.outcome for m in seen if m.WhichOneof("kind") == "outcome"]
    assert len(outcomes) == 1 and seen[-1].WhichOneof("kind") == "outcome"
    assert outcomes[0].job_id == "job-1" and not outcomes[0].context_poisoned
    assert outcomes[0].result.verdict == job_pb2.VERDICT_OK, outcomes[0].result
    job_ids = {getattr(m, m.WhichOneof("kind") or "").job_id for m in seen}
    assert job_ids == {"job-1"}
    assert not any(os.scandir(tmp_path))  # its work dir is gone


def test_channel_closed_before_a_job(tmp_path: os.PathLike[str]) -> None:
    proc, sock = _start(tmp_path)
    assert recv_frame(sock) is not None  # Hello
    sock.close()
    assert proc.wait(timeout=60) == 0


def test_log_lines_are_capped() -> None:
    assert _truncate("short") == "short"
    long = "é" * MAX_LOG_LINE_BYTES  # two bytes each
    cut = _truncate(long)
    assert len(cut.encode()) <= MAX_LOG_LINE_BYTES and cut == "é" * (MAX_LOG_LINE_BYTES // 2)


def _python(code: str) -> str:
    """Runs code in a fresh interpreter with the service on its path; its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "server"), str(REPO / "clients" / "python" / "src")]
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_zygote_loads_what_every_job_would_pay_for_before_it_forks() -> None:
    """After load_engine (in the zygote, before any fork): the modules jobs import on first use
    are loaded and Triton's own hash is computed, so a forked job process pays neither."""
    probe = """
import json, os, sys
from kerneleval_server.jobproc.startup import PREIMPORTED, load_engine
load_engine()
from triton.runtime.cache import triton_key
pid = os.fork()
if pid == 0:
    loaded = [m for m in PREIMPORTED if m in sys.modules]
    loaded += [m for m in ("kerneleval_server.engine.isolated",) if m in sys.modules]
    print(json.dumps({"loaded": loaded, "cached": triton_key.cache_info().currsize}))
    sys.stdout.flush()
    os._exit(0)
os.waitpid(pid, 0)
"""
    report = json.loads(_python(probe).strip().splitlines()[-1])
    assert "torch.utils.cpp_extension" in report["loaded"] and "triton" in report["loaded"]
    assert "torch.utils._device" in report["loaded"]
    assert "kerneleval_server.engine.isolated" in report["loaded"]
    assert report["cached"] == 1


def test_a_job_process_imports_nothing_for_its_job() -> None:
    """A job forked from the zygote finds every module its evaluation needs loaded already
    (each first import compiles or reads files in the job's time: 1-4 ms apiece): a Compare of
    a Model with get_inputs(), and a Triton kernel launched from its IOContract and timed
    (np.median imported numpy.ma in the first timed job's window). On a GPU its warm-up
    loads Triton's launcher modules first, as in a job process."""
    probe = """
import json, os, sys, tempfile
from pathlib import Path
from kerneleval.v1 import kernel_pb2
from kerneleval_server.jobproc import warm_job
from kerneleval_server.jobproc.startup import load_engine, warm_up
engine, _ = load_engine()
model = kernel_pb2.JobSpec()
model.kernel.type = model.reference.type = kernel_pb2.KERNEL_TYPE_TORCH
model.kernel.source_code = warm_job.REFERENCE.replace("class Model", "class ModelNew")
model.reference.source_code = warm_job.REFERENCE
model.options.correct_trial_count = 1
model.options.perf_trial_count = 0
new = {}
for name, spec in (("model", model), ("triton", warm_job.spec())):
    pid = os.fork()
    if pid == 0:
        warm_up()  # as a job process does before its job (with a GPU; nothing without one)
        before = set(sys.modules)
        work = Path(tempfile.mkdtemp())
        out = engine.run_job(spec, engine.NullReporter(), engine.EngineConfig(work_dir=work))
        added = sorted(m for m in set(sys.modules) - before if not m.startswith("ke_"))
        print(json.dumps({"verdict": out.result.verdict, "imported": added}))
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""
    reports = [json.loads(line) for line in _python(probe).strip().splitlines()[-2:]]
    for report in reports:
        assert report == {"verdict": job_pb2.VERDICT_OK, "imported": []}


def test_warm_up_job_passes_through_the_real_engine() -> None:
    """The evaluation a job process runs in its warm-up (on a GPU) is a valid spec that the
    engine judges OK, timed (the timing's first calls are paid there, not in a job's window)
    with no warm-up runs (no 25 ms of GPU work); on this machine it runs on the CPU under
    Triton's interpreter."""
    probe = """
from kerneleval_server.jobproc import warm_job
from kerneleval_server.jobproc.startup import load_engine
from kerneleval_server.spec.validation import validate_spec
assert validate_spec(warm_job.spec()) == []
engine, _ = load_engine()
spec = warm_job.spec()
assert spec.options.warmup_count == 0 and spec.options.perf_trial_count > 0
result = warm_job.run(engine)
timed = result.runtime.trial_count == result.reference_runtime.trial_count == 2
print(result.verdict, result.correctness, timed)
"""
    out = _python(probe)
    verdict, correct, timed = out.split()[-3:]
    assert int(verdict) == job_pb2.VERDICT_OK and correct == timed == "True", out


def test_the_warm_up_job_compares_its_outputs_on_the_device() -> None:
    """The warm-up compares outputs over the size compared on the host, so that the device
    comparison's kernels load in the warm-up (CUDA loads kernels on first use): with them
    compared on the host, every fresh process loaded them in its first job's timing window
    (~7 ms a window on an H100, bench/results/gpu/h100-warm-compare). A small comparison on
    the host is made too. Each comparison's size, through the real engine."""
    probe = """
from kerneleval_server.jobproc import warm_job
from kerneleval_server.jobproc.startup import load_engine
engine, _ = load_engine()
compare = engine.compare
sizes = []
inner = compare._compare_tensor
def spy(check, name, c, r, atol, rtol):
    sizes.append(r.numel())
    return inner(check, name, c, r, atol, rtol)
compare._compare_tensor = spy
assert warm_job.run(engine).verdict == 1
print(compare.HOST_COMPARE_MAX, *sizes)
"""
    limit, *sizes = (int(n) for n in _python(probe).strip().splitlines()[-1].split())
    assert any(n > limit for n in sizes) and any(n <= limit for n in sizes), (limit, sizes)


def test_the_outcome_goes_out_before_the_job_folders_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result does not wait for the cleanup: the job's work and compile-cache folders are
    still there when its outcome is sent, and gone when the job is over."""
    from kerneleval_server.jobproc import runtime

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "unused"))
    # Armed, the tamper hook stays on in this process for good: later tests in it that patch
    # the engine (test_integrity) would be refused.
    monkeypatch.setattr(runtime, "_arm_tamper_checks", lambda prepare_only=False: None)
    sent: list[tuple[str, list[str]]] = []

    class Channel:
        job_running = finishing = False
        record_fds: dict[str, list[int]] = {}  # noqa: RUF012 - read only here

        def send(self, msg: jc.JobProcessMessage) -> None:
            folders = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
            sent.append((msg.WhichOneof("kind") or "", folders))

    def run_job(spec: object, reporter: object, config: object) -> object:
        return types.SimpleNamespace(result=job_pb2.EvalResult(verdict=job_pb2.VERDICT_OK),
                                     context_poisoned=False)  # fmt: skip

    engine = types.SimpleNamespace(EngineConfig=types.SimpleNamespace, run_job=run_job)
    assign = jc.AssignJob(job_id="j", spec=_spec(ADD_MODEL), attempt=1)
    assert runtime._run_one(engine, Channel(), assign, last=True) == (False, False)  # type: ignore[arg-type]
    assert ("outcome", ["compile", "job"]) in sent
    assert not any(tmp_path.iterdir())


def test_a_launch_without_its_references_artifact_or_a_record_runs_nothing(
    tmp_path: os.PathLike[str],
) -> None:
    """A job given as prebuilt whose reference (host code) was not built must come with a
    record for its judge (prebuild.reference_judged): without one, the runtime would have to
    import the reference in a process that launches other tenants' kernels. It refuses: an
    engine error, no reference imported, and the process does not stay for another job."""
    marker = Path(tmp_path) / "reference.imported"
    spec = _spec(ADD_MODEL)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.kernel.io.args.add(name="n", int_value=4)
    spec.reference.CopyFrom(_spec(f"open({str(marker)!r}, 'w')\n" + ADD_MODEL).kernel)
    kernel = jc.KernelArtifact(role="kernel", cubin=b"\x7fELF", function="add", arch="sm_90")
    proc, sock = _start(tmp_path)
    assert recv_frame(sock) is not None  # Hello
    assign = jc.AssignJob(job_id="job-1", spec=spec, attempt=1, prebuilt=[kernel])
    sock.sendall(encode(jc.FrontendMessage(assign=assign).SerializeToString()))
    seen = _messages(sock)
    assert proc.wait(timeout=60) == 0
    outcome = next(m.outcome for m in seen if m.WhichOneof("kind") == "outcome")
    assert outcome.result.verdict == job_pb2.VERDICT_RUNTIME_ERROR, outcome.result
    assert "without a record" in outcome.result.error.message and not outcome.reusable
    assert not marker.exists()


def test_a_judges_grant_asked_for_with_its_go_is_not_lost_to_its_let_go() -> None:
    """A judge started ahead says JudgePrepared and waits for its go; the front end may ask
    for its next check at once (GpuUse.ask_early), and go and grant may be read before the
    judge's thread runs on. Its old grant is let go before it speaks, so the new one is kept:
    its check then waits for nothing (it waited for ever, seen under CI's load)."""
    import threading

    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2
    from kerneleval_server.framing import encode
    from kerneleval_server.jobproc import runtime
    from kerneleval_server.jobproc.channel import _Channel, _Reporter

    ours, theirs = socket.socketpair()
    channel = _Channel(theirs)
    reporter = _Reporter(channel, "j")
    channel.grant_event("j", job_pb2.PHASE_VALIDATING).set()  # its check ahead, granted
    reporter._granted.add(job_pb2.PHASE_VALIDATING)
    real_send = channel.send

    def send_then_answer(msg: job_channel_pb2.JobProcessMessage) -> None:
        real_send(msg)
        if msg.HasField("judge_prepared"):  # the front end answers before this thread goes on
            for reply in (
                job_channel_pb2.FrontendMessage(judge_go=job_channel_pb2.JudgeGo(job_id="j")),
                job_channel_pb2.FrontendMessage(
                    grant=job_channel_pb2.GpuGrant(job_id="j", phase=job_pb2.PHASE_VALIDATING)
                ),
                job_channel_pb2.FrontendMessage(  # a marker: what came before it is read
                    extension=job_channel_pb2.ExtensionBuilt(request_id=99)
                ),
            ):
                ours.sendall(encode(reply.SerializeToString()))
            threading.Thread(target=channel.read_loop, daemon=True).start()
            assert channel._replies.wait(("extension", 99)) is not None

    channel.send = send_then_answer  # type: ignore[method-assign]
    assert runtime._judge_go(channel, reporter, "j") is not None
    checked = threading.Thread(target=reporter.phase, args=(job_pb2.PHASE_VALIDATING,), daemon=True)
    checked.start()
    checked.join(10)
    assert not checked.is_alive(), "the check waits for a grant that was let go"
    ours.close()


def test_a_grant_sent_with_the_next_job_is_kept_through_the_last_ones_cleanup() -> None:
    """A launch process (or a standing judge) sends its outcome, then cleans up; the front
    end may send the next job and that job's check's grant meanwhile (GpuUse.ask_early). The
    cleanup forgets the finished job's grants only: the next job's check waits for nothing
    (before, it waited for a grant that was never asked for again)."""
    import threading

    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2
    from kerneleval_server.framing import encode
    from kerneleval_server.jobproc.channel import _Channel, _Reporter

    ours, theirs = socket.socketpair()
    channel = _Channel(theirs)
    threading.Thread(target=channel.read_loop, daemon=True).start()
    channel.grant_event("done", job_pb2.PHASE_VALIDATING).set()  # the last job's, used
    for msg in (
        job_channel_pb2.FrontendMessage(assign=job_channel_pb2.AssignJob(job_id="next")),
        job_channel_pb2.FrontendMessage(
            grant=job_channel_pb2.GpuGrant(job_id="next", phase=job_pb2.PHASE_VALIDATING)
        ),
    ):
        ours.sendall(encode(msg.SerializeToString()))
    assert channel.assigned.get(timeout=10).job_id == "next"
    deadline = time.monotonic() + 10
    while not channel.grant_event("next", job_pb2.PHASE_VALIDATING).is_set():
        assert time.monotonic() < deadline, "the grant never came in"
        time.sleep(0.01)
    channel.accept_next("done")
    assert not channel.grant_event("done", job_pb2.PHASE_VALIDATING).is_set()
    checked = threading.Thread(
        target=_Reporter(channel, "next").phase,
        args=(job_pb2.PHASE_VALIDATING,),
        daemon=True,
    )
    checked.start()
    checked.join(10)
    assert not checked.is_alive(), "the next job's check waits for a grant it was sent"
    ours.close()


def test_a_grant_for_a_finished_job_that_comes_late_is_not_kept() -> None:
    """A process takes up to 500 jobs: a grant for one it finished (the front end granted it
    as the job ended) is dropped, not kept for ever; the same job assigned again (it runs
    again here) takes its grants again."""
    import threading

    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2
    from kerneleval_server.framing import encode
    from kerneleval_server.jobproc.channel import _Channel

    ours, theirs = socket.socketpair()
    channel = _Channel(theirs)
    threading.Thread(target=channel.read_loop, daemon=True).start()

    def send(msg: job_channel_pb2.FrontendMessage) -> None:
        ours.sendall(encode(msg.SerializeToString()))

    def grant(job_id: str) -> job_channel_pb2.FrontendMessage:
        return job_channel_pb2.FrontendMessage(
            grant=job_channel_pb2.GpuGrant(job_id=job_id, phase=job_pb2.PHASE_VALIDATING)
        )

    def assign(job_id: str) -> job_channel_pb2.FrontendMessage:
        return job_channel_pb2.FrontendMessage(assign=job_channel_pb2.AssignJob(job_id=job_id))

    channel.accept_next("done")
    send(grant("done"))  # late
    send(assign("next"))  # read after it: once "next" is in, the late grant was handled
    assert channel.assigned.get(timeout=10).job_id == "next"
    assert not [key for key in channel._grants if key.startswith("done/")]
    send(assign("done"))  # the same job, again
    send(grant("done"))
    assert channel.assigned.get(timeout=10).job_id == "done"
    deadline = time.monotonic() + 10
    while not channel._grants.get(f"done/{job_pb2.PHASE_VALIDATING}"):
        assert time.monotonic() < deadline, "the job assigned again lost its grant"
        time.sleep(0.01)
    ours.close()


def test_a_grant_asked_for_ahead_is_the_one_its_phase_waits_for() -> None:
    """_Reporter.ask_ahead sends PhaseUpdate(ahead) and does not wait; phase() then sends the
    phase and waits for that same grant (here in before it is called)."""
    import threading

    from kerneleval.internal.v1 import job_channel_pb2
    from kerneleval.v1 import job_pb2
    from kerneleval_server.framing import FdFrameReader, encode
    from kerneleval_server.jobproc.channel import _Channel, _Reporter

    ours, theirs = socket.socketpair()
    channel = _Channel(theirs)
    threading.Thread(target=channel.read_loop, daemon=True).start()
    reporter = _Reporter(channel, "j1")
    reporter.ask_ahead(job_pb2.PHASE_PROFILING)  # only VALIDATING is asked for ahead
    reporter.ask_ahead(job_pb2.PHASE_VALIDATING)
    reader = FdFrameReader(ours)
    frame = reader.recv_frame()
    assert frame is not None
    asked = job_channel_pb2.JobProcessMessage.FromString(frame).phase
    assert asked.ahead and asked.phase == job_pb2.PHASE_VALIDATING
    grant = job_channel_pb2.GpuGrant(job_id="j1", phase=job_pb2.PHASE_VALIDATING)
    ours.sendall(encode(job_channel_pb2.FrontendMessage(grant=grant).SerializeToString()))
    entered = threading.Thread(target=reporter.phase, args=(job_pb2.PHASE_VALIDATING,))
    entered.start()
    entered.join(timeout=10)
    assert not entered.is_alive(), "phase() did not take the grant asked for ahead"
    frame = reader.recv_frame()
    assert frame is not None
    said = job_channel_pb2.JobProcessMessage.FromString(frame).phase
    assert not said.ahead and said.phase == job_pb2.PHASE_VALIDATING
    ours.close()
