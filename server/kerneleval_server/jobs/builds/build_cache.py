"""What was built, by content address, on disk: shared by every job on the node, kept across
restarts, bounded in bytes (least recently used out first). Two users, each with keys of its
own: load_inline extensions (extension_builds.py: the call's arguments and the target: torch,
CUDA, the architecture, the compilers, the builder's recipe) and the compile cache's entries
(compile_cache.py: a job's code and device; raw CUDA and Triton kernels, built ahead or not).

The keys are the front end's own, computed from what a job sent, so an entry holds what exactly
that code builds to: a job with other sources or flags cannot reach it. Only the front end
writes here (a job or build process has no path to the state folder); a write is a new file
renamed into place, so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("kerneleval.build_cache")


class BuildCache:
    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> bytes, oldest use first
        if max_bytes > 0 and folder.is_dir():
            self._load()

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.pb"

    def _load(self) -> None:
        found = []
        for path in self.folder.glob("??/*.pb"):
            try:
                st = path.stat()
            except OSError:
                continue
            found.append((st.st_mtime, path.stem, st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self.bytes += size
        self._evict()

    def get(self, key: str) -> bytes | None:
        if self.max_bytes <= 0 or key not in self._sizes:
            self.misses += 1
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError as e:  # gone: built again
            log.warning("build cache entry %s unreadable: %s", key[:16], e)
            self.forget(key)
            self.misses += 1
            return None
        self._sizes.move_to_end(key)
        self.hits += 1
        return data

    def put(self, key: str, data: bytes) -> None:
        if self.max_bytes <= 0:
            return
        if len(data) > self.max_bytes:
            return
        path = self._path(key)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            tmp.write_bytes(data)
            tmp.rename(path)
        except OSError as e:
            log.warning("build cache: %s not kept: %s", key[:16], e)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return
        self.bytes += len(data) - self._sizes.pop(key, 0)
        self._sizes[key] = len(data)
        self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._sizes:
            self.forget(next(iter(self._sizes)))

    def forget(self, key: str) -> None:
        """Drops an entry (one its user found damaged)."""
        self.bytes -= self._sizes.pop(key, 0)
        with contextlib.suppress(OSError):
            self._path(key).unlink()

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: str) -> bool:
        """An entry is kept for the key (not read: nothing counted)."""
        return self.max_bytes > 0 and key in self._sizes
