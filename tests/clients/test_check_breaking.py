"""scripts/check_breaking.sh in a scratch git repository: passes with nothing to compare,
passes additions, fails committed and uncommitted breaking changes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_breaking.sh"
BUF = REPO / ".venv" / "bin" / "buf"

PROTO_V1 = """syntax = "proto3";

package demo.v1;

// A thing.
message Thing {
  // Its name.
  string name = 1;
  // Its size.
  int64 size = 2;
}
"""


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def _check(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BUF": str(BUF)}
    return subprocess.run(
        [str(repo / "scripts" / "check_breaking.sh"), *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    if not BUF.exists():
        pytest.skip("buf is not installed in .venv")
    r = tmp_path / "repo"
    (r / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, r / "scripts" / "check_breaking.sh")
    _git(r, "init", "-q", "-b", "main")
    _git(r, "config", "user.email", "t@example.com")
    _git(r, "config", "user.name", "t")
    _git(r, "add", "scripts")
    _git(r, "commit", "-qm", "scripts only")
    return r


def _write_proto(repo: Path, text: str) -> None:
    d = repo / "proto" / "demo" / "v1"
    d.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "proto" / "buf.yaml", repo / "proto" / "buf.yaml")
    (d / "thing.proto").write_text(text)


def _commit(repo: Path, msg: str) -> None:
    _git(repo, "add", "proto")
    _git(repo, "commit", "-qm", msg)


def test_history_of_compatible_and_breaking_changes(repo: Path):
    _write_proto(repo, PROTO_V1)
    p = _check(repo)  # uncommitted, and HEAD has no proto/
    assert p.returncode == 0 and "has no proto/" in p.stdout, p.stdout + p.stderr
    _commit(repo, "first proto")
    p = _check(repo)  # clean: HEAD against HEAD~1, which has no proto/
    assert p.returncode == 0 and "nothing to compare with" in p.stdout

    added = PROTO_V1.replace(
        "  int64 size = 2;\n", "  int64 size = 2;\n  // New.\n  bool new = 3;\n"
    )
    _write_proto(repo, added)
    p = _check(repo)  # uncommitted addition against HEAD
    assert p.returncode == 0, p.stdout + p.stderr
    assert "against HEAD " in p.stdout and "no breaking change" in p.stdout
    _commit(repo, "add a field")
    assert _check(repo).returncode == 0

    removed = added.replace("  // Its size.\n  int64 size = 2;\n", "")
    _write_proto(repo, removed)
    p = _check(repo)  # uncommitted removal
    assert p.returncode != 0
    assert "size" in p.stdout + p.stderr
    _commit(repo, "remove a field")
    p = _check(repo)  # committed removal: HEAD against HEAD~1
    assert p.returncode != 0 and "against HEAD~1" in p.stdout
    first = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert _check(repo, first).returncode == 0  # scripts-only root commit: nothing to compare
    assert _check(repo, "HEAD~2").returncode != 0  # the first proto commit had the field
    assert _check(repo, "no-such-ref").returncode == 2


def test_a_single_commit_passes(repo: Path):
    _write_proto(repo, PROTO_V1)
    _git(repo, "add", "proto")
    _git(repo, "commit", "-q", "--amend", "-m", "everything at once")
    p = _check(repo)
    assert p.returncode == 0 and "no commit before HEAD" in p.stdout, p.stdout + p.stderr


def test_the_real_api_has_no_breaking_change():
    if not BUF.exists():
        pytest.skip("buf is not installed in .venv")
    p = subprocess.run(
        [str(SCRIPT)],
        cwd=REPO,
        env={**os.environ, "BUF": str(BUF)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
