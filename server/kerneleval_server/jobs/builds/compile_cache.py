"""What jobs compiled (Triton's cache folder), kept for later jobs with exactly the same code.

A job process starts with an empty, private compile cache: with nothing shared between jobs, a
tiny Triton kernel would compile again in every job (0.5-0.8 s on an H100). After a job, its
process sends the files its compile cache gained (JobOutcome.compile_cache); the front end keeps
them under a key it computes itself from the job's code: the kernel and the reference sources
with their IOContracts and entry points, and the device. A later job whose key is the same gets
the files written into its own private cache before it runs (AssignJob.compile_cache).

Why this does not carry anything of one tenant's job into another's: the files come from a job
that ran exactly the code the receiving job runs, so they hold nothing that code could not have
made in its own process; a job with other code never sees them. The files are checked here
(relative paths, counts, sizes) and only ever written into a job process's private folder.

The same cache keeps what build processes built for jobs built ahead (prebuild.py): the
artifacts, one file per source, under the key of the code and the architecture (`built_key`):
a later job with exactly that code skips its build.

Bounded by bytes (least recently used out first) in memory, and kept on disk too when given
the build cache (build_cache.py, under the same key): a restart, or an entry pushed out of
memory, is found there again.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections import OrderedDict

from google.protobuf.message import DecodeError
from kerneleval.internal.v1 import job_channel_pb2
from kerneleval.v1 import kernel_pb2

from kerneleval_server.jobproc import MAX_CACHE_ENTRY_BYTES, MAX_CACHE_FILES

from .build_cache import BuildCache


def cache_key(spec: kernel_pb2.JobSpec, device_index: int | str) -> str:
    h = hashlib.sha256()
    for part in (spec.kernel, spec.reference):
        data = part.SerializeToString(deterministic=True)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    h.update(str(device_index).encode())
    return h.hexdigest()


def built_key(arch: str) -> str:
    """The scope of what build processes built for one GPU architecture."""
    return f"built:{arch}"


def built_reference(spec: kernel_pb2.JobSpec) -> kernel_pb2.JobSpec:
    """The spec under which a raw CUDA reference's artifact is kept by itself (with
    built_key), for every later job with that reference whatever its kernel: nvcc made it
    from the reference's source alone, in a build whose kernel was raw CUDA too, so no
    candidate's code ran where it was made (paths.py on_built)."""
    return kernel_pb2.JobSpec(reference=spec.reference)


def as_files(artifacts: list[job_channel_pb2.KernelArtifact]) -> list[job_channel_pb2.CacheFile]:
    return [job_channel_pb2.CacheFile(path=a.role, data=a.SerializeToString()) for a in artifacts]


def as_artifacts(files: list[job_channel_pb2.CacheFile]) -> list[job_channel_pb2.KernelArtifact]:
    return [job_channel_pb2.KernelArtifact.FromString(f.data) for f in files]


def check_files(files: list[job_channel_pb2.CacheFile]) -> str:
    """Why these files cannot be kept ("" when they can)."""
    if len(files) > MAX_CACHE_FILES:
        return f"{len(files)} files, more than {MAX_CACHE_FILES}"
    total = 0
    for f in files:
        path = f.path
        norm = posixpath.normpath(path)
        if (
            not path
            or len(path) > 512
            or path.startswith("/")
            or norm != path
            or norm == ".."
            or norm.startswith("../")
            or "\0" in path
        ):
            return f"the path {path[:80]!r} is not a plain relative path"
        total += len(f.data)
    if total > MAX_CACHE_ENTRY_BYTES:
        return f"{total} bytes, more than {MAX_CACHE_ENTRY_BYTES}"
    return ""


class CompileCache:
    def __init__(self, max_bytes: int, disk: BuildCache | None = None) -> None:
        self.max_bytes = max_bytes
        self.disk = disk
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, list[job_channel_pb2.CacheFile]] = OrderedDict()

    @staticmethod
    def _size(files: list[job_channel_pb2.CacheFile]) -> int:
        return sum(len(f.data) + len(f.path) for f in files)

    def files_for(
        self, spec: kernel_pb2.JobSpec, device_index: int | str
    ) -> list[job_channel_pb2.CacheFile]:
        if self.max_bytes <= 0:
            return []
        key = cache_key(spec, device_index)
        files = self._entries.get(key)
        if files is None:
            files = self._from_disk(key)
        if files is None:
            self.misses += 1
            return []
        self._entries.move_to_end(key)
        self.hits += 1
        return files

    def holds(self, spec: kernel_pb2.JobSpec, device_index: int | str) -> bool:
        """Whether files_for would find an entry (in memory or on disk), counting nothing."""
        if self.max_bytes <= 0:
            return False
        key = cache_key(spec, device_index)
        return key in self._entries or (self.disk is not None and key in self.disk)

    def _from_disk(self, key: str) -> list[job_channel_pb2.CacheFile] | None:
        data = self.disk.get(key) if self.disk is not None else None
        if data is None:
            return None
        try:
            files = list(job_channel_pb2.CompileCacheEntry.FromString(data).files)
        except DecodeError:
            files = []
        if not files or check_files(files):  # damaged: compiled again
            assert self.disk is not None
            self.disk.forget(key)
            return None
        self._keep(key, files)
        return files

    def _keep(self, key: str, files: list[job_channel_pb2.CacheFile]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= self._size(old)
        self._entries[key] = files
        self.bytes += self._size(files)
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= self._size(evicted)

    def store(
        self,
        spec: kernel_pb2.JobSpec,
        device_index: int | str,
        given: list[job_channel_pb2.CacheFile],
        added: list[job_channel_pb2.CacheFile],
    ) -> str:
        """Keeps what the job was given plus what it added. Returns why not ("" when kept or
        when there was nothing to keep)."""
        if self.max_bytes <= 0 or not added:
            return ""
        files = {f.path: f for f in given}
        files.update((f.path, f) for f in added)
        merged = list(files.values())
        why = check_files(merged)
        if why:
            return why
        size = self._size(merged)
        if size > self.max_bytes:
            return f"{size} bytes, more than the whole cache"
        key = cache_key(spec, device_index)
        self._keep(key, merged)
        if self.disk is not None:
            self.disk.put(key, job_channel_pb2.CompileCacheEntry(files=merged).SerializeToString())
        return ""

    def __len__(self) -> int:
        return len(self._entries)
