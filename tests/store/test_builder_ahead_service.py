"""`--role builder` building the kernels of jobs built ahead (prebuild.py), as services on a real
PostgreSQL server: builders and nodes are real `kerneleval serve` processes (the real engine,
build processes in the watchdog's sandbox, nvcc), except where a GPU is needed.

- A raw CUDA job built ahead: the builder's build process compiles it (nvcc, for the node's
  architecture: prebuild.cpu_arch() on this CPU-only node), the node's launch process loads
  what the builder built, and the node's own build process never gets it; the verdict is the
  one a build on the node gives (a CPU job process cannot launch a cubin: CANNOT_RUN_HERE, as
  tests/frontend/test_built_ahead.py's real-engine test has it); a compile error comes back
  from the builder as the job's result. An identical job on another node comes from the
  artifact store with no build anywhere. A builder killed mid-build: the node builds it.
- A builder of other versions (another compiler): not asked; the node builds.
- A Triton job: a CPU-only node never builds Triton ahead (no GPU said what it is: Triton
  runs in its interpreter), so the node here is the real JobManager in this process with one
  GPU job process acted out (it says it is an sm_90 GPU and records what it is sent); the
  builder is a real one, whose build process compiles the kernel for sm_90 with no GPU. The
  launch gets exactly the cubin the builder built, which is what a build on a node makes of
  the same source (engine/build.py run as a node's build process runs it)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from builder_services import common_args
from ke_service import ServiceProcess, real_watchdog_available
from kerneleval.internal.v1 import job_channel_pb2, watchdog_pb2
from kerneleval.v1 import job_pb2, kernel_eval_service_pb2_grpc, kernel_pb2
from kerneleval.v1 import kernel_eval_service_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _kernels as K  # noqa: E402

pytestmark = pytest.mark.skipif(not real_watchdog_available(), reason="needs the watchdog")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
FRONTEND = Path(__file__).resolve().parent.parent / "frontend"  # fe_fake_engine
FAKE_GPU = "device 0 name=FakeGPU uuid=GPU-fake-1 memory_total=1000000\n"

CUDA_ADD = r"""
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i] + VARIANT;
}
"""
# About 8 s of ptxas on the CPU machine: long enough to kill the builder while it builds.
CUDA_SLOW = r"""
#define S acc = acc * b[(i + (int)acc) % n] + __sinf(acc);
#define R4(x) x x x x
extern "C" __global__ void add(const float* a, const float* b, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float acc = a[i] + VARIANT;
  R4(R4(R4(R4(R4(S)))))
  out[i] = acc;
}
"""
TRITON_ADD = """
import triton
import triton.language as tl


@triton.jit
def add(a, b, out, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out + offs, tl.load(a + offs, mask=mask) + tl.load(b + offs, mask=mask), mask=mask)
"""


def cuda_spec(source: str) -> kernel_pb2.JobSpec:
    """The raw CUDA `add(a, b, out, n)` from its IOContract: 256 floats, one block."""
    spec = kernel_pb2.JobSpec(client_tag="builders-ahead")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.kernel.source_code = source
    spec.kernel.io.CopyFrom(K.cuda_io(256))
    spec.options.timeout.seconds = 120
    return spec


def triton_spec() -> kernel_pb2.JobSpec:
    spec = cuda_spec(TRITON_ADD)
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
    spec.kernel.io.args.add(name="BLOCK", int_value=256, meta=True)
    spec.kernel.io.launch.ClearField("block")
    return spec


def start(
    started: list[ServiceProcess], state: Path, args: list[str], env: dict[str, str] | None = None
) -> ServiceProcess:
    service = ServiceProcess(state, args, env=env)
    started.append(service)
    service.start()
    return service


def node_args(url: str) -> list[str]:
    return ["--role", "node", "--nvml", "none", "--builder-wait-s", "1", *common_args(url)]


def builder_ids(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT builder_id FROM builders ORDER BY 1")]


def run(
    svc: ServiceProcess, spec: kernel_pb2.JobSpec
) -> tuple[job_pb2.Job, list[job_pb2.JobEvent]]:
    with svc.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        events = [r.event for r in stub.Run(pb.RunRequest(spec=spec), timeout=300)]
        job = stub.GetJob(pb.GetJobRequest(job_id=events[0].job_id), timeout=30).job
    return job, events


def started_on(events: list[job_pb2.JobEvent]) -> list[str]:
    return [e.started.worker_id for e in events if e.WhichOneof("kind") == "started"]


def logs_of(events: list[job_pb2.JobEvent]) -> list[str]:
    return [e.log.text for e in events if e.WhichOneof("kind") == "log"]


def artifacts(url: str) -> list[tuple[str, str, bytes]]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT key, built_by, data FROM artifacts ORDER BY created")
        return [(r[0], r[1], bytes(r[2])) for r in rows]


@needs_nvcc
def test_a_builder_builds_raw_cuda_jobs_ahead_and_nodes_only_launch_them(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    url, started = services
    builder = start(started, tmp_path / "builder", ["--role", "builder", *common_args(url)])
    (builder_id,) = builder_ids(url)
    node = start(started, tmp_path / "node", node_args(url))

    job, events = run(node, cuda_spec(CUDA_ADD.replace("VARIANT", "1.0f")))
    logs = logs_of(events)
    # The builder built it; the node's launch process ran what it built (the verdict a build
    # on this node gives too: a CPU job process cannot launch a cubin).
    assert job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, (job.result, logs)
    assert job.result.compiled and "no CUDA device" in job.result.error.message
    built_by, launched_by = started_on(events)  # no build process of the node's
    assert built_by == builder_id and launched_by.startswith("cpu-w"), started_on(events)
    assert "kerneleval: built ahead asked of the builders (1 live)" in logs, logs
    assert (
        f"kerneleval: built ahead: from the shared artifact store (built by {builder_id})" in logs
    ), logs
    assert f"built ahead by {builder_id}: waits for a launch process" in logs, logs
    ((key, owner, data),) = artifacts(url)
    assert owner == builder_id
    kept = job_channel_pb2.BuildOutcome.FromString(data)
    (artifact,) = kept.artifacts
    assert artifact.cubin.startswith(b"\x7fELF") and artifact.function == "add"
    assert artifact.arch == "sm_90" and "nvcc" in artifact.build_log

    # A compile error: the builder's build ends the job with nvcc's error, as a build on the
    # node would; nothing is kept for it.
    bad, bad_events = run(node, cuda_spec(CUDA_ADD.replace("VARIANT", "oops")))
    assert bad.result.verdict == job_pb2.VERDICT_COMPILE_ERROR, bad.result
    assert "oops" in bad.result.compilation_error, bad.result
    assert started_on(bad_events) == [builder_id]
    assert [a[0] for a in artifacts(url)] == [key]
    assert builder.log_path.read_text().count("for the shared store") == 2
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM build_requests").fetchone() == (0,)
        assert conn.execute("SELECT built FROM builders").fetchone() == (1,)

    # Another node (its own state: nothing built there): the identical job comes from the
    # artifact store; nobody builds it again.
    node.stop(timeout=20)
    other = start(started, tmp_path / "other-node", node_args(url))
    again, again_events = run(other, cuda_spec(CUDA_ADD.replace("VARIANT", "1.0f")))
    again_logs = logs_of(again_events)
    assert again.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, again.result
    assert [w[:5] for w in started_on(again_events)] == [builder_id[:5], "cpu-w"]
    assert (
        f"kerneleval: built ahead: from the shared artifact store (built by {builder_id})"
        in again_logs
    ), again_logs
    assert not any("asked of the builders" in t for t in again_logs), again_logs
    assert builder.log_path.read_text().count("for the shared store") == 2
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT built FROM builders").fetchone() == (1,)

    # The builder is killed (SIGKILL) while it builds: once its lease expires and no builder
    # holds the request for --builder-wait-s, the node's own build process builds it.
    with other.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        slow = cuda_spec(CUDA_SLOW.replace("VARIANT", "2.0f"))
        job_id = stub.Submit(pb.SubmitRequest(spec=slow), timeout=30).job.job_id
        deadline = time.monotonic() + 60
        with psycopg.connect(url, autocommit=True) as conn:
            while not conn.execute(
                "SELECT 1 FROM build_requests WHERE lease_builder = %s", (builder_id,)
            ).fetchall():
                assert time.monotonic() < deadline, "the builder never took the build"
                time.sleep(0.02)
        builder.kill()
        events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=180)]
    logs = logs_of(events)
    assert events[-1].finished.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, logs
    assert any("no builder held it for 1 s" in t for t in logs), logs
    build_worker, launch_worker = started_on(events)
    assert build_worker.startswith("build-w") and launch_worker.startswith("cpu-w")
    # Built here: into the store for the other nodes (written as the launch starts, so it may
    # land just after the job's end).
    deadline = time.monotonic() + 10
    while len(owners := [a[1] for a in artifacts(url)]) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(owners) == 2 and owners[0] == builder_id and "-builder-" not in owners[1]

    # The compile error the builder gave is the one a build on the node gives (nothing of a
    # failed build was kept: built again, here, with no builder left).
    here, here_events = run(other, cuda_spec(CUDA_ADD.replace("VARIANT", "oops")))
    assert [w[:7] for w in started_on(here_events)] == ["build-w"], logs_of(here_events)
    assert here.result.verdict == job_pb2.VERDICT_COMPILE_ERROR, here.result
    assert same_but_folders(here.result.compilation_error) == same_but_folders(
        bad.result.compilation_error
    ), (here.result.compilation_error, bad.result.compilation_error)


def same_but_folders(text: str) -> str:
    """A compiler's message with each build process's own work folder left out."""
    return re.sub(r"/tmp/job-[A-Za-z0-9_]+/", "<work>/", text)


@needs_nvcc
def test_a_builder_of_other_versions_is_not_used(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    url, started = services
    # Another compiler (g++ names itself so; the node's is c++): other versions.
    start(started, tmp_path / "builder", ["--role", "builder", *common_args(url)],
          env={"CXX": "g++"})  # fmt: skip
    (builder_id,) = builder_ids(url)
    node = start(started, tmp_path / "node", node_args(url))
    job, events = run(node, cuda_spec(CUDA_ADD.replace("VARIANT", "3.0f")))
    logs = logs_of(events)
    assert job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, (job.result, logs)
    build_worker, launch_worker = started_on(events)
    assert build_worker.startswith("build-w") and launch_worker.startswith("cpu-w")
    assert any("no live builder has this node's versions" in t for t in logs), logs
    assert f"builder {builder_id} does not build for this node" in node.log_path.read_text()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT built FROM builders").fetchone() == (0,)
    assert [a[1] for a in artifacts(url)] != [builder_id]


@needs_nvcc
def test_a_node_without_build_processes_leaves_building_to_the_builders(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    """GPU nodes may leave compiling to builders (`--build-processes 0`): a job that can be
    built ahead waits for them; with none to answer, it runs whole in a job process."""
    url, started = services
    node = start(started, tmp_path / "node", [*node_args(url), "--build-processes", "0"])
    alone, alone_events = run(node, cuda_spec(CUDA_ADD.replace("VARIANT", "4.0f")))
    assert alone.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, alone.result
    (only,) = started_on(alone_events)
    assert only.startswith("cpu-w")
    assert any("no builder built it ahead" in t for t in logs_of(alone_events))
    start(started, tmp_path / "builder", ["--role", "builder", *common_args(url)])
    (builder_id,) = builder_ids(url)
    time.sleep(3)  # the node reads the live builders at its heartbeat (every lease / 3: 1 s)
    job, events = run(node, cuda_spec(CUDA_ADD.replace("VARIANT", "5.0f")))
    assert job.result.verdict == job_pb2.VERDICT_CANNOT_RUN_HERE, job.result
    built_by, launched_by = started_on(events)
    assert built_by == builder_id and launched_by.startswith("cpu-w"), started_on(events)


class _Writer:
    """A GPU job process's channel, acted out: what the front end sends it."""

    def __init__(self) -> None:
        self.sent: list[job_channel_pb2.FrontendMessage] = []

    def is_closing(self) -> bool:
        return False

    def write(self, frame: bytes) -> None:
        self.sent.append(job_channel_pb2.FrontendMessage.FromString(frame[4:]))


# Cubin sections that name the source file, which differs from one build process to another.
NAMES_THE_SOURCE_FILE = {".debug_line", ".rela.debug_line", ".nv_debug_ptx_txt"}


def elf_sections(blob: bytes) -> dict[str, bytes]:
    """A 64-bit little-endian ELF's sections by name (NOBITS ones empty)."""
    (shoff,) = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize)
               for i in range(shnum)]  # fmt: skip
    names_at = headers[shstrndx][4]
    sections = {}
    for name_off, kind, _, _, offset, size, *_ in headers:
        start = names_at + name_off
        name = blob[start : blob.index(b"\0", start)].decode()
        sections[name] = b"" if kind == 8 else blob[offset : offset + size]
    return sections


def local_build(spec: kernel_pb2.JobSpec, arch: str, folder: Path) -> job_channel_pb2.BuildOutcome:
    """What a node's build process makes of the spec: engine/build.py, in a child with Triton
    in compiled mode and no GPU, as build_job runs it in a build process without one."""
    from kerneleval_server.engine.isolated import import_path

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.pb").write_bytes(spec.SerializeToString())
    env = {**os.environ, "KERNELEVAL_BUILD_CHILD": "1", "TRITON_INTERPRET": "0",
           "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": import_path(),
           "TRITON_CACHE_DIR": str(folder / "triton-cache")}  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "kerneleval_server.engine.build", "--spec", str(folder / "spec.pb"),
         "--out", str(folder / "out.pb"), "--log", str(folder / "log.json"),
         "--work-dir", str(folder / "work"), "--arch", arch],
        env=env, check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    return job_channel_pb2.BuildOutcome.FromString((folder / "out.pb").read_bytes())


@needs_nvcc
def test_a_builder_compiles_a_triton_job_for_the_nodes_gpu_and_the_node_launches_it(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    from kerneleval_server import config as config_mod
    from kerneleval_server.fleet.job_processes import JobProcess
    from kerneleval_server.jobproc import BUILD_DEVICE
    from kerneleval_server.jobs.builds.artifact_store import SharedArtifacts
    from kerneleval_server.jobs.builds.builder_node import probe_versions
    from kerneleval_server.jobs.events import EventHub, OpsLog
    from kerneleval_server.jobs.manager import JobManager
    from kerneleval_server.jobs.store import PostgresStore, SqliteStore
    from kerneleval_server.main import job_env
    from kerneleval_server.metrics import Metrics

    url, started = services
    builder = start(started, tmp_path / "builder", ["--role", "builder", *common_args(url)])
    (builder_id,) = builder_ids(url)
    cfg = config_mod.Config(state_dir=str(tmp_path / "node"), result_cache_hours=0)
    torch_version, cuda_version = probe_versions(job_env(cfg))  # as the builder's

    Seen = tuple[job_pb2.Job, list[job_pb2.JobEvent], list[job_channel_pb2.FrontendMessage]]

    async def scenario() -> tuple[Seen, dict[str, int]]:
        jobs = SqliteStore(tmp_path / "jobs.db")
        shared = PostgresStore(url, shared=True)
        m = JobManager(cfg, jobs, EventHub(jobs), OpsLog(), Metrics(), 600.0)
        artifacts = SharedArtifacts(
            shared, m.builds.extensions, "node-in-process", wait_s=5.0, keep_s=0,
            answer=m.builds.answer_extensions, say=m.builds.publish_log, dispatch=m.dispatch,
            host=m.builds,
        )  # fmt: skip
        for index in (BUILD_DEVICE, 0):  # build processes configured (none is ever up)
            status = watchdog_pb2.DeviceStatus(
                device_index=index, health=watchdog_pb2.HEALTH_HEALTHY
            )
            m.watchdog_events.on_event(
                watchdog_pb2.WatchdogEvent(device=watchdog_pb2.DeviceUpdate(device=status))
            )
        gpu = JobProcess("d0-w0", 100, 0, False, 0, writer=_Writer())  # type: ignore[arg-type]
        gpu.has_channel = True
        gpu.hello = job_channel_pb2.Hello(worker_id="d0-w0", device_index=0)
        gpu.hello.device.CopyFrom(
            job_pb2.DeviceInfo(index=0, name="NVIDIA H100", compute_capability="9.0",
                               torch_version=torch_version, cuda_version=cuda_version)
        )  # fmt: skip
        m.job_processes.by_id[gpu.worker_id] = gpu
        m.messages.on_process_ready(gpu)
        assert m.builds.device_arch == {0: "sm_90"}
        artifacts.refresh()
        job = m.submit(triton_spec())
        writer = gpu.writer
        assert isinstance(writer, _Writer)
        deadline = time.monotonic() + 240
        while not writer.sent:
            assert time.monotonic() < deadline, "no launch"
            await asyncio.sleep(0.05)
        events = jobs.events_after(job.job_id, 0)
        counts = dict(artifacts.ahead_counts)
        await artifacts.stop()
        shared.close()
        return (job, events, writer.sent), counts

    (job, events, sent), counts = asyncio.run(scenario())
    (assign,) = [m.assign for m in sent if m.WhichOneof("kind") == "assign"]
    logs = logs_of(events)
    assert assign.job_id == job.job_id and not assign.build_only, assign
    (artifact,) = assign.prebuilt  # launched from what the builder built: no source
    assert artifact.type == kernel_pb2.KERNEL_TYPE_TRITON and artifact.arch == "sm_90"
    assert artifact.cubin.startswith(b"\x7fELF") and artifact.function == "add"
    assert started_on(events) == [builder_id, "d0-w0"], logs
    assert f"built ahead by {builder_id}: waits for a launch process" in logs, logs
    assert counts == {"store": 0, "builders": 1, "here": 0, "published": 0}
    ((_, owner, data),) = artifacts(url)
    assert owner == builder_id
    assert list(job_channel_pb2.BuildOutcome.FromString(data).artifacts) == [artifact]
    # What a build on a node makes of the same source for the same GPU.
    here = local_build(triton_spec(), "sm_90", tmp_path / "local")
    (mine,) = here.artifacts
    assert (mine.function, mine.arch, mine.num_warps, mine.shared_bytes) == (
        artifact.function, artifact.arch, artifact.num_warps, artifact.shared_bytes
    )  # fmt: skip
    assert mine.build_log == artifact.build_log and list(mine.notes) == list(artifact.notes)
    # Section by section the same cubin, but for the line info, which names the source file
    # as each build process wrote it (its own work folder and pid): the code, its launch
    # metadata, constants and symbols are byte for byte what a node's build makes.
    mine_sections, theirs_sections = elf_sections(mine.cubin), elf_sections(artifact.cubin)
    assert set(mine_sections) == set(theirs_sections)
    assert mine_sections[".text.add"] and mine_sections[".nv.info.add"]
    for name, data in mine_sections.items():
        if name not in NAMES_THE_SOURCE_FILE:
            assert data == theirs_sections[name], f"cubin section {name} differs"
    assert "for the shared store" in builder.log_path.read_text()


# ---- the fake engine (tests/frontend/fe_fake_engine.py): a node with a GPU, on the CPU -----


def fake_spec(cmd: dict[str, object], timeout_s: int = 60) -> kernel_pb2.JobSpec:
    """A raw CUDA kernel launched from its IOContract as the fake engine reads it (a JSON
    command; distinct code each time)."""
    spec = kernel_pb2.JobSpec(client_tag="builders-ahead-fake")
    spec.kernel.type = kernel_pb2.KERNEL_TYPE_CUDA
    spec.kernel.source_code = json.dumps({**cmd, "code": uuid.uuid4().hex})
    spec.kernel.io.args.add(name="n", int_value=4)
    spec.kernel.io.launch.grid.x = spec.kernel.io.launch.block.x = 1
    spec.options.timeout.seconds = timeout_s
    return spec


def fake_env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(FRONTEND), os.environ.get("PYTHONPATH", "")])}


def start_fake_builder(
    started: list[ServiceProcess], root: Path, url: str, processes: int = 1
) -> ServiceProcess:
    args = ["--role", "builder", "--engine", "fe_fake_engine", *common_args(url)]
    args[args.index("--build-processes") + 1] = str(processes)
    return start(started, root / "builder", args, env=fake_env())


def start_fake_node(started: list[ServiceProcess], root: Path, url: str) -> ServiceProcess:
    """A node with one (fake NVML) GPU whose job processes run the fake engine (with torch
    imported, as the service's engine has it: the node's versions are the builder's)."""
    (root / "fake_nvml").write_text(FAKE_GPU)
    args = [*node_args(url), "--workers-per-device", "1", "--engine", "fe_fake_engine_torch",
            "--fake-nvml-path", str(root / "fake_nvml")]  # fmt: skip
    args[args.index("--nvml") + 1] = "fake"
    return start(started, root / "node", args, env=fake_env())


def finished_events(events: list[job_pb2.JobEvent]) -> list[job_pb2.JobEvent]:
    return [e for e in events if e.WhichOneof("kind") == "finished"]


def held_by(url: str, builder_id: str, count: int) -> None:
    """Waits until the builder holds `count` build requests."""
    deadline = time.monotonic() + 60
    with psycopg.connect(url, autocommit=True) as conn:
        while conn.execute(
            "SELECT COUNT(*) FROM build_requests WHERE lease_builder = %s", (builder_id,)
        ).fetchone() != (count,):
            assert time.monotonic() < deadline, "the builder never took the build"
            time.sleep(0.02)


def test_a_job_built_by_a_builder_runs_on_the_nodes_gpu(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    """Real builder and node processes with the fake engine (a GPU acted out): the builder's
    build process builds the job, the node's GPU launch process runs exactly that artifact
    (its notes) to the job's verdict; a compile error from the builder ends the job with the
    result a build on the node gives."""
    url, started = services
    builder = start_fake_builder(started, tmp_path, url)
    (builder_id,) = builder_ids(url)
    node = start_fake_node(started, tmp_path, url)

    job, events = run(node, fake_spec({"do": "build"}))
    logs = logs_of(events)
    assert job.result.verdict == job_pb2.VERDICT_OK, (job.result, logs)
    assert [f.finished.result.verdict for f in finished_events(events)] == [job_pb2.VERDICT_OK]
    built_by, launched_by = started_on(events)
    assert built_by == builder_id and launched_by.startswith("d0-w"), started_on(events)
    assert job.worker_id == launched_by and job.attempt_count == 1
    # The artifact the builder's build process made (no GPU there, for the node's
    # architecture: a fake GPU says none, so nvcc's default) is what the GPU launched.
    built = f"built for {prebuild_cpu_arch()}; build process sees a GPU: False, nice 10"
    assert built in job.result.notes, job.result.notes
    assert f"launched kernel_fn by {launched_by} job 1" in job.result.notes, job.result.notes
    assert "kerneleval: built ahead asked of the builders (1 live)" in logs, logs
    assert f"built ahead by {builder_id}: waits for a launch process" in logs, logs
    ((_, owner, _),) = artifacts(url)
    assert owner == builder_id

    # The builder computes the key itself: a request whose key is not what its sources build
    # to with the builder's versions, or whose sources are not built ahead, is refused and
    # nothing is written under that key.
    from kerneleval_server.jobs.builds import ahead_builds
    from kerneleval_server.jobs.store import PostgresStore
    from kerneleval_server.jobs.store.base import BUILD_REFUSED

    with psycopg.connect(url) as conn:
        (versions,) = conn.execute("SELECT versions FROM builders").fetchone()
    arch = prebuild_cpu_arch()
    whole = fake_spec({"do": "build"})
    whole.kernel.type = kernel_pb2.KERNEL_TYPE_TORCH
    forged = {
        "f" * 64: ahead_builds.request_arguments(fake_spec({"do": "build"})),
        ahead_builds.key(whole, arch, versions): ahead_builds.request_arguments(whole),
    }
    shared = PostgresStore(url, shared=True)
    try:
        for key, arguments in forged.items():
            shared.request_build(key, versions, arch, arguments, "forger")
        deadline = time.monotonic() + 30
        requests = [shared.build_request(k) for k in forged]
        while any(r is None or r.state != BUILD_REFUSED for r in requests):
            assert time.monotonic() < deadline, "not refused"
            time.sleep(0.05)
            requests = [shared.build_request(k) for k in forged]
        errors = [r.error for r in requests if r is not None]
        assert "the key is not what the sources build to" in errors[0], errors
        assert "not kernels launched from their IOContract" in errors[1], errors
        assert all(shared.artifact(k) is None for k in forged)
        for key in forged:
            shared.drop_build_request(key)
    finally:
        shared.close()
    # The next tenant after the forgeries: built by the same builder, launched, right.
    after, after_events = run(node, fake_spec({"do": "build"}))
    assert after.result.verdict == job_pb2.VERDICT_OK, after.result
    assert started_on(after_events)[0] == builder_id, started_on(after_events)

    # A compile error: the builder's build ends the job; the same job built on the node itself
    # (after the builder has gone: nothing of a failed build is kept) ends the same way.
    bad_spec = fake_spec({"do": "build_error"})
    bad, bad_events = run(node, bad_spec)
    assert bad.result.verdict == job_pb2.VERDICT_COMPILE_ERROR, bad.result
    assert started_on(bad_events) == [builder_id]
    assert len(finished_events(bad_events)) == 1
    assert [a[1] for a in artifacts(url)] == [builder_id] * 2  # nothing of the failed build
    builder.stop(timeout=20)  # SIGTERM: it leaves `builders`
    assert builder_ids(url) == []
    here, here_events = run(node, bad_spec)
    assert [w[:7] for w in started_on(here_events)] == ["build-w"]
    assert bad.result.error.message == "fake nvcc: error"
    assert bad.result == here.result, (bad.result, here.result)


def prebuild_cpu_arch() -> str:
    from kerneleval_server.jobs.builds import prebuild

    return prebuild.cpu_arch()


def test_a_job_waiting_for_a_builder_is_cancelled_or_times_out_once(
    tmp_path: Path, services: tuple[str, list[ServiceProcess]]
) -> None:
    """A builder whose builds hang: a job cancelled while it waits for the builder ends
    CANCELLED at once, never started; one whose timeout passes while the builder holds its
    build is built on the node (the builder is not waited for longer than the job would run)
    and ends as its build there ends (TIMEOUT): each exactly once."""
    url, started = services
    start_fake_builder(started, tmp_path, url, processes=2)
    (builder_id,) = builder_ids(url)
    node = start_fake_node(started, tmp_path, url)
    with node.channel() as ch:
        stub = kernel_eval_service_pb2_grpc.KernelEvalServiceStub(ch)
        waiting = stub.Submit(
            pb.SubmitRequest(spec=fake_spec({"do": "build", "build_hangs": True})), timeout=30
        ).job
        held_by(url, builder_id, 1)
        began = time.monotonic()
        cancelled = stub.CancelJob(pb.CancelJobRequest(job_id=waiting.job_id), timeout=30).job
        assert cancelled.state == job_pb2.JOB_STATE_CANCELLED, cancelled
        assert time.monotonic() - began < 5
        events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=waiting.job_id), timeout=30)]
        assert started_on(events) == [] and len(finished_events(events)) == 1, events

        slow = fake_spec({"do": "build", "build_hangs": True}, timeout_s=2)
        job_id = stub.Submit(pb.SubmitRequest(spec=slow), timeout=30).job.job_id
        held_by(url, builder_id, 2)  # the cancelled job's build still hangs there
        events = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=120)]
        logs = logs_of(events)
        (finished,) = finished_events(events)
        assert finished.finished.result.verdict == job_pb2.VERDICT_TIMEOUT, logs
        assert "kerneleval: built ahead: the builder did not build it within 3 s: built here" in (
            logs
        ), logs
        assert [w[:7] for w in started_on(events)] == ["build-w"], started_on(events)
        time.sleep(1)  # nothing comes after the end
        after = [r.event for r in stub.Watch(pb.WatchRequest(job_id=job_id), timeout=30)]
        assert len(finished_events(after)) == 1 and len(after) == len(events)
        assert stub.GetJob(pb.GetJobRequest(job_id=waiting.job_id), timeout=30).job.state == (
            job_pb2.JOB_STATE_CANCELLED
        )
    assert artifacts(url) == []
