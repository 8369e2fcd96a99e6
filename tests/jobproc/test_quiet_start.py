"""Quiet logs (issue 41): no warning per job process that the operator can do nothing about.

Every job process logged torch's "Can't initialize NVML" twice (the sandbox hides NVML on
purpose) and the zygote Python 3.12's DeprecationWarning for a fork in a multi-threaded
process. The zygote silences both at its start (zygote.quiet_warnings), for itself and the job
processes it forks; the service says once at start what the sandbox hides (main.SANDBOX_HIDES,
tests/frontend/test_job_memory.py reads a real service's log for it).

torch's own NVML probe runs here against a stand-in libnvidia-ml.so.1 whose nvmlInit fails, as
NVML fails in the sandbox."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(REPO / "server"), str(REPO / "clients" / "python" / "src"),
         os.environ.get("PYTHONPATH", "")]
    ),  # fmt: skip
}


def run(code: str, env: dict[str, str] | None = None) -> str:
    """stderr of a fresh Python running `code` as __main__ (as the zygote runs: -m)."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, env=env or ENV,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stderr


@pytest.fixture(scope="module")
def failing_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler for the stand-in NVML")
    folder = tmp_path_factory.mktemp("nvml")
    src = folder / "nvml.c"
    src.write_text(
        "int nvmlInit(void) { return 999; }\nint nvmlInit_v2(void) { return 999; }\n"
        "int nvmlDeviceGetCount_v2(int *n) { *n = 0; return 999; }\n"
    )
    subprocess.run(
        [cc, "-shared", "-fPIC", str(src), "-o", str(folder / "libnvidia-ml.so.1")], check=True
    )
    return folder


NVML_PROBE = """
import torch
torch.cuda._raw_device_count_nvml()
torch.cuda._raw_device_uuid_nvml()
"""


def test_torchs_nvml_warnings_are_silenced_in_job_processes(failing_nvml: Path) -> None:
    env = {**ENV, "LD_LIBRARY_PATH": str(failing_nvml)}
    loud = run(NVML_PROBE, env)
    assert loud.count("Can't initialize NVML") == 2, loud  # what every job process logged
    quiet = run("from kerneleval_server.jobproc import zygote\nzygote.quiet_warnings()\n"
                + NVML_PROBE, env)  # fmt: skip
    assert "NVML" not in quiet, quiet


def test_and_in_what_the_zygote_forks(failing_nvml: Path) -> None:
    env = {**ENV, "LD_LIBRARY_PATH": str(failing_nvml)}
    quiet = run(
        """
        import os
        from kerneleval_server.jobproc import zygote
        zygote.quiet_warnings()
        import torch
        pid = os.fork()
        if pid == 0:
            torch.cuda._raw_device_count_nvml()
            os._exit(0)
        os.waitpid(pid, 0)
        """,
        env,
    )
    assert "NVML" not in quiet, quiet


FORK_WARNING = (
    "This process (pid=123) is multi-threaded, use of fork() may lead to deadlocks in the child."
)


def test_the_fork_deprecation_warning_is_silenced() -> None:
    """Python 3.12 warns at every fork of a process with threads (the zygote, after torch);
    the exact text is checked with warnings.warn where this Python does not warn itself."""
    code = f"""
    import warnings
    {{quiet}}
    warnings.warn({FORK_WARNING!r}, DeprecationWarning)
    """
    assert "multi-threaded" in run(code.format(quiet=""))  # __main__: shown by default
    silenced = "from kerneleval_server.jobproc import zygote; zygote.quiet_warnings()"
    assert run(code.format(quiet=silenced)) == ""


@pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12 warns at such a fork")
def test_a_real_fork_with_threads_is_quiet() -> None:
    code = """
    import os, threading, time
    from kerneleval_server.jobproc import zygote
    zygote.quiet_warnings()
    threading.Thread(target=time.sleep, args=(1,)).start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    """
    assert "multi-threaded" not in run(code)


def test_other_warnings_still_show() -> None:
    code = """
    import warnings
    from kerneleval_server.jobproc import zygote
    zygote.quiet_warnings()
    warnings.warn("something else", UserWarning)
    """
    assert "something else" in run(code)


def test_job_processes_go_first_under_the_hosts_oom_killer() -> None:
    out = run(
        """
        import sys
        from kerneleval_server.jobproc import zygote
        zygote.first_for_the_oom_killer()
        print(open("/proc/self/oom_score_adj").read().strip(), file=sys.stderr)
        """
    )
    assert out.strip() == str(1000)
