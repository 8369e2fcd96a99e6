"""A job's folders: its private work folder and its own compile cache.

Both are made while the process waits for its job (`make_job_dirs`). The compile cache is
seeded with what earlier jobs with the same code compiled (the front end keeps it,
jobs/builds/compile_cache.py, and sends it with the AssignJob), and what the job added to it
goes back in its outcome (`compile_cache_added`). Apart from the job loop (runtime.py): plain
files, no channel and no CUDA.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kerneleval.internal.v1 import job_channel_pb2

from . import MAX_CACHE_ENTRY_BYTES as MAX_ENTRY_BYTES
from . import MAX_CACHE_FILES as MAX_FILES
from . import TRITON_CACHE_ENV


def _cache_parts(rel: str) -> list[str] | None:
    """The parts of a plain relative path (empty and "." parts dropped, as pathlib reads it);
    None for anything that could leave the folder, or name the folder itself."""
    if not rel or rel.startswith("/"):
        return None
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return parts


def seed_compile_cache(root: Path, files: Any) -> set[str]:
    """Writes the given files into the job's own (empty) compile cache; their paths. (On the
    way to the job's first phase: plain os calls, each folder made once.)"""
    base = str(root)
    made: set[str] = set()
    seeded: set[str] = set()
    for f in files:
        parts = _cache_parts(f.path)
        if parts is None:
            continue
        folder = os.path.join(base, *parts[:-1])
        if folder not in made:
            os.makedirs(folder, exist_ok=True)
            made.add(folder)
        name = parts[-1]
        data = f.data
        if name.startswith("__grp__") and name.endswith(".json"):
            data = _regroup(base, data)
        _write_new(os.path.join(folder, name), data)
        seeded.add(f.path)
    return seeded


def _write_new(path: str, data: bytes) -> None:
    """A file's bytes, written with bare descriptors (no file object: ~5 files a job)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _regroup(base: str, data: bytes) -> bytes:
    """A Triton group file names its members by absolute path, in the cache folder of the job
    that compiled them: point them into this folder (<base>/<key>/<file>), or Triton misses
    its own cache and compiles again. A member named outside a <key>/<file> shape is dropped."""
    try:
        group = json.loads(data)
        children = group["child_paths"]
        kept = {}
        for name, p in children.items():
            if not isinstance(p, str):
                continue
            parts = [q for q in p.split("/") if q not in ("", ".")]
            if len(parts) >= 2 and ".." not in parts[-2:]:
                kept[name] = os.path.join(base, parts[-2], parts[-1])
        group["child_paths"] = kept
        return json.dumps(group).encode()
    except (ValueError, KeyError, TypeError, AttributeError):
        return data  # not a group file Triton would read: left to Triton to refuse


def _files_under(root: str) -> list[tuple[tuple[str, ...], str]]:
    """(path parts relative to root, full path) of every regular file under root, in path
    order; symbolic links are neither followed nor listed. OSError when a folder cannot be
    read."""
    found: list[tuple[tuple[str, ...], str]] = []
    folders: list[tuple[str, tuple[str, ...]]] = [(root, ())]
    while folders:
        folder, rel = folders.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    continue
                if entry.is_dir(follow_symlinks=False):
                    folders.append((entry.path, (*rel, entry.name)))
                elif entry.is_file(follow_symlinks=False):
                    found.append(((*rel, entry.name), entry.path))
    found.sort()
    return found


def compile_cache_added(root: Path, seeded: set[str]) -> list[job_channel_pb2.CacheFile]:
    """Files the job added to its compile cache, if they are few and small enough to send;
    nothing when the folder cannot be read (the job's code may have made it so)."""
    out: list[job_channel_pb2.CacheFile] = []
    total = 0
    try:
        for parts, full in _files_under(str(root)):
            rel = "/".join(parts)
            if rel in seeded or rel.startswith("tmp.") or "/tmp." in rel:  # Triton's temporaries
                continue
            with open(full, "rb") as f:
                data = f.read()
            total += len(data)
            if total > MAX_ENTRY_BYTES or len(out) >= MAX_FILES:
                return []  # too big to keep: the next job compiles again
            out.append(job_channel_pb2.CacheFile(path=rel, data=data))
    except OSError:
        return []
    return out


_ready_dirs: tuple[Path, Path] | None = None  # the next job's, made while the process waits


def make_job_dirs() -> None:
    """The next job's private folder and (empty) compile cache, made before it comes."""
    global _ready_dirs
    base = os.environ.get("TMPDIR") or "/tmp"
    job_dir = Path(tempfile.mkdtemp(prefix="job-", dir=base))
    cache_dir = Path(tempfile.mkdtemp(prefix="compile-cache-", dir=base))
    os.environ[TRITON_CACHE_ENV] = str(cache_dir)  # read by Triton when it compiles
    _ready_dirs = (job_dir, cache_dir)


def _job_dirs(assign: job_channel_pb2.AssignJob) -> tuple[Path, Path, set[str]]:
    """The job's private folder and compile cache (seeded with what the front end sent)."""
    global _ready_dirs
    if _ready_dirs is None:
        make_job_dirs()
    assert _ready_dirs is not None
    (job_dir, cache_dir), _ready_dirs = _ready_dirs, None
    return job_dir, cache_dir, seed_compile_cache(cache_dir, assign.compile_cache)
