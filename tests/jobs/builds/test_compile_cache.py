"""The front end's compile cache and the job process's side of it (no service needed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kerneleval.internal.v1 import job_channel_pb2 as jc
from kerneleval.v1 import kernel_pb2
from kerneleval_server.jobproc import MAX_CACHE_FILES
from kerneleval_server.jobproc.job_dirs import compile_cache_added, seed_compile_cache
from kerneleval_server.jobs.builds.compile_cache import CompileCache, cache_key, check_files


def spec(source: str, reference: str = "ref") -> kernel_pb2.JobSpec:
    s = kernel_pb2.JobSpec()
    s.kernel.type = kernel_pb2.KERNEL_TYPE_TRITON
    s.kernel.source_code = source
    s.reference.source_code = reference
    return s


def files(**contents: bytes) -> list[jc.CacheFile]:
    return [jc.CacheFile(path=p.replace("__", "/"), data=d) for p, d in contents.items()]


def test_key_covers_kernel_reference_and_device_not_options() -> None:
    a = spec("k")
    assert cache_key(a, 0) == cache_key(spec("k"), 0)
    assert cache_key(a, 0) != cache_key(spec("k2"), 0)
    assert cache_key(a, 0) != cache_key(spec("k", "other ref"), 0)
    assert cache_key(a, 0) != cache_key(a, 1)
    b = spec("k")
    b.options.perf_trial_count = 7
    assert cache_key(a, 0) == cache_key(b, 0)
    # Sources are length-prefixed: moving text between kernel and reference changes the key.
    assert cache_key(spec("ab", "c"), 0) != cache_key(spec("a", "bc"), 0)


def test_paths_that_could_leave_the_folder_are_refused() -> None:
    assert check_files(files(a__b=b"x")) == ""
    for bad in ("../x", "/etc/passwd", "a/../../x", "a//b", "./a", "", "a/\0"):
        assert check_files([jc.CacheFile(path=bad, data=b"")]) != "", bad
    many = [jc.CacheFile(path=f"f{i}", data=b"") for i in range(MAX_CACHE_FILES + 1)]
    assert "files" in check_files(many)


def test_store_merges_what_was_given_and_evicts_least_recently_used() -> None:
    cache = CompileCache(max_bytes=3000)
    a, b, c = spec("a"), spec("b"), spec("c")
    assert cache.files_for(a, 0) == [] and cache.misses == 1
    assert cache.store(a, 0, [], files(x=b"1" * 900)) == ""
    assert [f.path for f in cache.files_for(a, 0)] == ["x"] and cache.hits == 1
    # A later job given a's files that compiled one more thing: both kept.
    assert cache.store(a, 0, cache.files_for(a, 0), files(y=b"2" * 100)) == ""
    assert sorted(f.path for f in cache.files_for(a, 0)) == ["x", "y"]
    assert cache.store(b, 0, [], files(x=b"3" * 900)) == ""
    cache.files_for(a, 0)  # a is now the most recently used
    assert cache.store(c, 0, [], files(x=b"4" * 1200)) == ""  # over 3000: b goes
    assert cache.files_for(b, 0) == [] and cache.files_for(a, 0) and cache.files_for(c, 0)
    assert cache.bytes <= 3000
    assert "whole cache" in cache.store(spec("d"), 0, [], files(x=b"5" * 4000))
    assert "path" in cache.store(spec("e"), 0, [], [jc.CacheFile(path="../e", data=b"")])
    off = CompileCache(max_bytes=0)
    assert off.store(a, 0, [], files(x=b"1")) == "" and off.files_for(a, 0) == []


def test_job_process_seeds_its_cache_and_sends_back_only_what_it_added(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir()
    given = files(old__k_cubin=b"old") + [jc.CacheFile(path="../escape", data=b"no")]
    seeded = seed_compile_cache(root, given)
    assert seeded == {"old/k_cubin"} and (root / "old" / "k_cubin").read_bytes() == b"old"
    assert not (tmp_path / "escape").exists()
    (root / "new").mkdir()
    (root / "new" / "k.json").write_text("{}")
    (root / "new" / "tmp.123").write_text("half-written")
    (root / "link").symlink_to(tmp_path / "elsewhere")
    added = compile_cache_added(root, seeded)
    assert [(f.path, f.data) for f in added] == [("new/k.json", b"{}")]
    (root / "big").write_bytes(b"x" * (4 << 20))
    assert compile_cache_added(root, seeded) == []  # too big to send: nothing, not a part
    (root / "big").unlink()
    (root / "new" / "k.json").chmod(0)  # unreadable (as a user; root reads it anyway)
    (root / "sub").mkdir()
    (root / "sub" / "loop").symlink_to(root, target_is_directory=True)
    if os.geteuid() != 0:
        assert compile_cache_added(root, seeded) == []
    else:
        assert [f.path for f in compile_cache_added(root, seeded)] == ["new/k.json"]


def test_seeded_triton_group_files_name_the_members_in_the_new_folder(tmp_path: Path) -> None:
    """Triton's __grp__ files name their members by absolute path in the folder of the job
    that compiled them; seeded into another job's folder they must name that folder's."""
    root = tmp_path / "cache"
    root.mkdir()
    old = "/tmp/compile-cache-abc/KEY"
    group = {"child_paths": {"add.cubin": f"{old}/add.cubin", "add.json": f"{old}/add.json",
                             "evil": "/etc/passwd/.."}}  # fmt: skip
    given = [
        jc.CacheFile(path="KEY/__grp__add.json", data=json.dumps(group).encode()),
        jc.CacheFile(path="KEY/add.cubin", data=b"cubin"),
        jc.CacheFile(path="KEY/__grp__bad.json", data=b"not json"),
    ]
    seed_compile_cache(root, given)
    seeded = json.loads((root / "KEY" / "__grp__add.json").read_text())
    assert seeded["child_paths"] == {
        "add.cubin": str(root / "KEY" / "add.cubin"),
        "add.json": str(root / "KEY" / "add.json"),
    }
    assert (root / "KEY" / "__grp__bad.json").read_bytes() == b"not json"


def test_seeding_reads_paths_as_pathlib_and_never_writes_the_folder_itself(
    tmp_path: Path,
) -> None:
    """Paths are split by hand (the seeding is on the way to the job's first phase): empty and
    "." parts are dropped as pathlib drops them; a path that names the cache folder itself,
    leaves it or is absolute is skipped, not written (nor the job failed)."""
    root = tmp_path / "cache"
    root.mkdir()
    given = [
        jc.CacheFile(path=p, data=p.encode())
        for p in ("KEY//a.cubin", "KEY/./b.json", ".", "./", "", "/abs", "KEY/../../x")
    ]
    assert seed_compile_cache(root, given) == {"KEY//a.cubin", "KEY/./b.json"}
    assert sorted(p.name for p in (root / "KEY").iterdir()) == ["a.cubin", "b.json"]
    assert (root / "KEY" / "a.cubin").read_bytes() == b"KEY//a.cubin"
    assert sorted(p.name for p in root.iterdir()) == ["KEY"] and not (tmp_path / "x").exists()
