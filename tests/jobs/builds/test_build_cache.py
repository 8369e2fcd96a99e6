"""The build cache (jobs/builds/build_cache.py), the extension-build queue
(jobs/builds/extension_builds.py) and the flags the service passes on to a build process
(fast_build/extension.refusal)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import job_pb2, kernel_pb2
from kerneleval_server.fast_build import extension
from kerneleval_server.jobs.builds.build_cache import BuildCache
from kerneleval_server.jobs.builds.compile_cache import CompileCache, cache_key
from kerneleval_server.jobs.builds.extension_builds import (
    MAX_CALLS_PER_JOB,
    ExtensionBuilds,
    Waiter,
)

DEVICE = job_pb2.DeviceInfo(torch_version="2.11.0", cuda_version="13.0")


def built(library: bytes = b"\x7fELF lib", error: str = "") -> job_channel_pb2.ExtensionBuilt:
    out = job_channel_pb2.ExtensionBuilt(library=library, error=error, fast=True)
    out.build_time.FromNanoseconds(2_500_000_000)
    return out


def test_kept_across_restarts_and_bounded(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "builds", max_bytes=300)
    cache.put("a" * 64, b"x" * 120)
    cache.put("b" * 64, b"y" * 120)
    assert cache.get("a" * 64) is not None  # a is now the most recently used
    reopened = BuildCache(tmp_path / "builds", max_bytes=300)  # a restart
    assert len(reopened) == 2
    assert reopened.get("b" * 64) == b"y" * 120
    reopened.put("c" * 64, b"z" * 120)  # over the bound: the least recently used goes
    assert reopened.bytes <= 300
    assert reopened.get("c" * 64) is not None
    assert reopened.get("b" * 64) is not None
    assert reopened.get("a" * 64) is None
    assert not (tmp_path / "builds" / "aa" / f"{'a' * 64}.pb").exists()


def test_a_damaged_entry_is_built_again(tmp_path: Path) -> None:
    cache = BuildCache(tmp_path / "builds", max_bytes=1 << 20)
    builds = ExtensionBuilds(cache)
    assert builds.request(Waiter("j", object(), 1), request(CALL), DEVICE, "", True) is None
    build = builds.next_build()
    assert build is not None
    worker = SimpleNamespace(worker_id="build-0")
    builds.started(build, worker)
    builds.finished(worker, built())
    assert len(cache) == 1
    (path,) = (tmp_path / "builds").glob("??/*.pb")
    path.write_bytes(b"\xff\xff not a message")
    assert builds.request(Waiter("j2", object(), 1), request(CALL), DEVICE, "", True) is None
    assert len(cache) == 0


def test_compile_cache_entries_survive_a_restart(tmp_path: Path) -> None:
    """Raw CUDA and Triton: what a job compiled (or a build process built) is found by a
    later job with the same code after the service restarted; a damaged entry is not."""
    spec = kernel_pb2.JobSpec()
    spec.kernel.source_code = "__global__ void k() {}"
    files = [job_channel_pb2.CacheFile(path="ab/k.cubin", data=b"\x7fELF cubin")]
    first = CompileCache(1 << 20, BuildCache(tmp_path / "builds", 1 << 20))
    assert first.store(spec, 0, [], files) == ""
    again = CompileCache(1 << 20, BuildCache(tmp_path / "builds", 1 << 20))
    assert [f.data for f in again.files_for(spec, 0)] == [b"\x7fELF cubin"]
    other = kernel_pb2.JobSpec()
    other.kernel.source_code = "__global__ void k() { /* other */ }"
    assert again.files_for(other, 0) == [] and again.files_for(spec, 1) == []
    hostile = job_channel_pb2.CompileCacheEntry(
        files=[job_channel_pb2.CacheFile(path="../../etc/x", data=b"x")]
    )
    disk = BuildCache(tmp_path / "builds", 1 << 20)
    disk.put(cache_key(other, 0), hostile.SerializeToString())
    assert CompileCache(1 << 20, disk).files_for(other, 0) == []


def request(call: dict[str, object], request_id: int = 1) -> job_channel_pb2.ExtensionRequest:
    return job_channel_pb2.ExtensionRequest(
        job_id="j", request_id=request_id,
        call=job_channel_pb2.ExtensionCall(arguments_json=json.dumps(call)),
    )  # fmt: skip


CALL = {"name": "ext", "cpp_sources": ["int f();"], "functions": ["f"], "extra_cflags": ["-O3"]}


def test_one_build_for_jobs_that_ask_at_once_then_the_cache(tmp_path: Path) -> None:
    builds = ExtensionBuilds(BuildCache(tmp_path / "builds", 1 << 20))
    a = Waiter("job-a", object(), 1)
    b = Waiter("job-b", object(), 7)
    assert builds.request(a, request(CALL), DEVICE, "sm_90", builders=True) is None
    assert builds.request(b, request(CALL), DEVICE, "sm_90", builders=True) is None
    build = builds.next_build()
    assert build is not None and builds.next_build() is None  # one build for both
    worker = SimpleNamespace(worker_id="build-1")
    builds.started(build, worker)
    answers = builds.finished(worker, built(b"lib"))
    assert [(w.job_id, x.job_id, x.request_id, x.library) for w, x in answers] == [
        ("job-a", "job-a", 1, b"lib"),
        ("job-b", "job-b", 7, b"lib"),
    ]
    c = Waiter("job-c", object(), 1)
    hit = builds.request(c, request(CALL), DEVICE, "sm_90", builders=True)
    assert hit is not None and hit.cache_hit and hit.library == b"lib" and hit.job_id == "job-c"
    # Another architecture, another torch, other sources: another key, built again.
    other = {**CALL, "cpp_sources": ["int f(); // other"]}
    assert builds.request(c, request(other), DEVICE, "sm_90", builders=True) is None
    assert builds.request(c, request(CALL), DEVICE, "sm_80", builders=True) is None
    newer = job_pb2.DeviceInfo(torch_version="2.12.0", cuda_version="13.0")
    assert builds.request(c, request(CALL), newer, "sm_90", builders=True) is None


def test_a_lost_build_answers_every_waiter_and_is_not_kept(tmp_path: Path) -> None:
    builds = ExtensionBuilds(BuildCache(tmp_path / "builds", 1 << 20))
    assert builds.request(Waiter("j", object(), 1), request(CALL), DEVICE, "", True) is None
    build = builds.next_build()
    assert build is not None
    worker = SimpleNamespace(worker_id="build-2")
    builds.started(build, worker)
    (waiter, answer), = builds.lost(worker, "exited (killed)")  # fmt: skip
    assert "Error building extension 'ext'" in answer.error and not answer.library
    assert len(builds.cache) == 0
    assert builds.request(Waiter("j2", object(), 1), request(CALL), DEVICE, "", True) is None


def test_build_here_without_build_processes_or_for_refused_flags(tmp_path: Path) -> None:
    builds = ExtensionBuilds(BuildCache(tmp_path / "builds", 1 << 20))
    w = Waiter("j", object(), 3)
    assert builds.request(w, request(CALL), DEVICE, "", builders=False).build_here  # type: ignore[union-attr]
    hostile = {**CALL, "extra_cflags": ["-wrapper", "/bin/sh,-c,id"]}
    answer = builds.request(w, request(hostile), DEVICE, "", builders=True)
    assert answer is not None and answer.build_here and answer.request_id == 3
    assert builds.next_build() is None


def test_calls_per_job_are_bounded(tmp_path: Path) -> None:
    builds = ExtensionBuilds(BuildCache(tmp_path / "builds", 1 << 20))
    for i in range(MAX_CALLS_PER_JOB):
        builds.request(
            Waiter("j", object(), i), request({**CALL, "name": f"e{i}"}), DEVICE, "", True
        )
    answer = builds.request(Waiter("j", object(), 99), request(CALL), DEVICE, "", True)
    assert answer is not None and "more than" in answer.error


@pytest.mark.parametrize(
    "key,flags",
    [
        ("extra_cflags", ["-wrapper", "/bin/sh,-c,id"]),
        ("extra_cflags", ["-fplugin=/tmp/evil.so"]),
        ("extra_cflags", ["-B/tmp/evil"]),
        ("extra_cflags", ["-specs=/tmp/evil.specs"]),
        ("extra_cflags", ["@/tmp/more-flags"]),
        ("extra_cflags", ["-include/etc/shadow"]),
        ("extra_cflags", ["-O3; touch /tmp/pwned"]),
        ("extra_cflags", ["-Wl,--script=/tmp/x"]),
        ("extra_cuda_cflags", ["-Xcompiler", "-O3,-wrapper,/bin/sh"]),
        ("extra_cuda_cflags", ["--compiler-bindir=/tmp/evil"]),
        ("extra_cuda_cflags", ["-ccbin", "/tmp/evil"]),
        ("extra_ldflags", ["-Wl,-rpath,$ORIGIN"]),
        ("extra_ldflags", ["/tmp/evil.o"]),
        ("extra_include_paths", ["/tmp/$(id)"]),
    ],
)
def test_refused_flags(key: str, flags: list[str]) -> None:
    assert extension.refusal({"name": "ext", key: flags}), (key, flags)


def test_plain_code_generation_flags_pass() -> None:
    call = {
        "name": "ext",
        "extra_cflags": ["", "-O3", "-std=c++17", "-DNDEBUG", "-DTILE=32", "-ffast-math", "-w"],
        "extra_cuda_cflags": ["-O3", "--use_fast_math", "-Xptxas=-v", "-Xptxas", "-O3,-v",
                              "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo",
                              "--expt-relaxed-constexpr", "-maxrregcount=64", "-Xcompiler",
                              "-O3,-fopenmp"],
        "extra_ldflags": ["", "-lcublas", "-L/usr/local/cuda/lib64"],
        "extra_include_paths": ["/usr/local/cuda/include"],
    }  # fmt: skip
    assert extension.refusal(call) == ""
    assert extension.refusal({**call, "name": "bad name"})


def test_main_object_kept_for_calls_with_the_same_main_cpp(tmp_path: Path) -> None:
    """Candidates that change only their CUDA sources share main.o; other declarations,
    flags or names do not."""
    builds = ExtensionBuilds(BuildCache(tmp_path / "builds", 1 << 20))
    cuda = {**CALL, "cuda_sources": ["__global__ void k() {}"]}
    assert builds.request(Waiter("a", object(), 1), request(cuda), DEVICE, "sm_90", True) is None
    first = builds.next_build()
    assert first is not None and builds.main_object(first) == b""
    worker = SimpleNamespace(worker_id="build-3")
    builds.started(first, worker)
    done = built(b"lib")
    done.main_object = b"main.o bytes"
    ((_, answer),) = builds.finished(worker, done)
    assert answer.main_object == b""  # never sent to a job
    other_kernel = {**cuda, "cuda_sources": ["__global__ void k() { /* v2 */ }"]}
    assert (
        builds.request(Waiter("b", object(), 1), request(other_kernel), DEVICE, "sm_90", True)
        is None
    )
    second = builds.next_build()
    assert second is not None and builds.main_object(second) == b"main.o bytes"
    for changed in ({"cpp_sources": ["int g();"]}, {"extra_cflags": ["-O2"]}, {"name": "other"}):
        call = {**other_kernel, **changed}
        assert (
            builds.request(Waiter("c", object(), 1), request(call), DEVICE, "sm_90", True) is None
        )
        build = builds.next_build()
        assert build is not None and builds.main_object(build) == b"", changed
