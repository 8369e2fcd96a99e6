"""`kerneleval doctor`: the diagnostics people collect by hand, as one paste-able report.

Every check has a time limit and reports what is missing instead of failing; CUDA is only
touched in a child process, so a broken driver cannot hang or crash the report itself.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

CHILD_TIMEOUT_S = 90.0
TOOL_TIMEOUT_S = 20.0
CUDA_BIN_DIRS = ("/usr/local/cuda/bin", "/opt/cuda/bin")

# Run in a child: imports torch/triton and runs a tiny kernel on the GPU; prints one JSON line.
_CHILD = r"""
import json, sys
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    if out["cuda_available"]:
        out["device_count"] = torch.cuda.device_count()
        out["device_name"] = torch.cuda.get_device_name(0)
        out["capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        out["kernel_ok"] = float((x * 2).sum().item()) == 1024 * 1023.0
        torch.cuda.synchronize()
except Exception as e:
    out["torch_error"] = "%s: %s" % (type(e).__name__, e)
try:
    import triton
    out["triton"] = triton.__version__
except Exception as e:
    out["triton_error"] = "%s: %s" % (type(e).__name__, e)
print(json.dumps(out))
"""


@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)

    def add(self, key: str, value: str) -> None:
        self.lines.append(f"{key}: {value}")


@dataclass
class Report:
    sections: list[Section] = field(default_factory=list)

    def section(self, title: str) -> Section:
        s = Section(title)
        self.sections.append(s)
        return s

    def text(self) -> str:
        out = ["# kerneleval doctor", ""]
        for s in self.sections:
            out.append(f"## {s.title}")
            out.extend(s.lines or ["(nothing)"])
            out.append("")
        return "\n".join(out).rstrip() + "\n"

    def as_dict(self) -> dict[str, list[str]]:
        return {s.title: s.lines for s in self.sections}


def run_tool(argv: Sequence[str], timeout: float = TOOL_TIMEOUT_S) -> tuple[int | None, str]:
    """(exit code, combined output); exit code None when it could not run or timed out.

    The tool runs in its own session so that a timeout kills it with its children."""
    try:
        p = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError:
        return None, "not found"
    except OSError as e:
        return None, str(e)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return None, f"timed out after {timeout:g} s"
    return p.returncode, (out or "").strip()


def find_tool(name: str) -> str | None:
    path = shutil.which(name)
    if path:
        return path
    for d in CUDA_BIN_DIRS:
        candidate = os.path.join(d, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _version_line(text: str, needle: str = "") -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if needle.lower() in ln.lower():
            return ln
    return lines[-1] if lines else "?"


def _pkg_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_host(r: Report) -> None:
    s = r.section("host")
    s.add("kerneleval client", _pkg_version("kerneleval-client"))
    s.add("python", f"{platform.python_version()} ({sys.executable})")
    s.add("platform", platform.platform())
    s.add("grpcio", _pkg_version("grpcio"))
    s.add("protobuf", _pkg_version("protobuf"))
    s.add("kerneleval-server", _pkg_version("kerneleval-server"))
    try:
        with open("/proc/driver/nvidia/version", encoding="utf-8") as f:
            s.add("driver (proc)", f.readline().strip())
    except OSError:
        s.add("driver (proc)", "no /proc/driver/nvidia/version (no NVIDIA kernel module loaded)")


def check_nvidia_smi(r: Report) -> None:
    s = r.section("nvidia-smi")
    tool = find_tool("nvidia-smi")
    if tool is None:
        s.add("nvidia-smi", "not found (no NVIDIA driver on this machine?)")
        return
    code, out = run_tool(
        [
            tool,
            "--query-gpu=index,name,driver_version,memory.total,temperature.gpu,"
            "utilization.gpu,pci.bus_id",
            "--format=csv,noheader",
        ]
    )
    if code != 0:
        s.add("query", f"failed ({code}): {out}")
    else:
        for line in out.splitlines():
            s.add("gpu", line.strip())
    code, out = run_tool([tool])
    cuda = [ln for ln in out.splitlines() if "CUDA Version" in ln]
    if cuda:
        s.add("driver/CUDA", " ".join(cuda[0].strip("| ").split()))
    s.lines.append("```")
    s.lines.extend(out.splitlines()[:60])
    s.lines.append("```")


def check_nvml(r: Report) -> None:
    s = r.section("NVML")
    try:
        import pynvml
    except ImportError:
        s.add("pynvml", "not installed (skipped; pip install nvidia-ml-py)")
        return
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        s.add("nvmlInit", f"failed: {e}")
        return
    try:
        s.add("driver", str(pynvml.nvmlSystemGetDriverVersion()))
        s.add("CUDA driver API", str(pynvml.nvmlSystemGetCudaDriverVersion()))
        count = pynvml.nvmlDeviceGetCount()
        s.add("devices", str(count))
        for i in range(count):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            s.add(f"gpu {i}", f"{pynvml.nvmlDeviceGetName(h)}, {mem.total // 2**20} MiB")
    except Exception as e:
        s.add("query", f"failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def check_python_stack(r: Report, python: str = sys.executable) -> None:
    s = r.section("torch and triton (child process)")
    code, out = run_tool([python, "-c", _CHILD], timeout=CHILD_TIMEOUT_S)
    if code is None:
        s.add("child", out)
        return
    try:
        info = json.loads(out.splitlines()[-1])
    except (ValueError, IndexError):
        s.add("child", f"exit {code}: {out[-2000:]}")
        return
    if "torch" in info:
        s.add("torch", f"{info['torch']} (CUDA {info.get('torch_cuda') or 'none: CPU build'})")
        s.add("cuda available", str(info.get("cuda_available")))
        if info.get("cuda_available"):
            s.add(
                "device",
                f"{info.get('device_name')} (sm {info.get('capability')}), "
                f"{info.get('device_count')} visible",
            )
            s.add("tiny kernel", "ok" if info.get("kernel_ok") else "WRONG RESULT")
    if "torch_error" in info:
        s.add("torch", info["torch_error"])
    s.add("triton", info.get("triton") or info.get("triton_error", "?"))
    if code != 0:
        s.add("child exit", str(code))


def check_tools(r: Report) -> None:
    s = r.section("CUDA tools")
    for name, args, needle in (
        ("nvcc", ["--version"], "release"),
        ("compute-sanitizer", ["--version"], "version"),
        ("ncu", ["--version"], "version"),
    ):
        tool = find_tool(name)
        if tool is None:
            s.add(name, "not found")
            continue
        code, out = run_tool([tool, *args])
        s.add(name, f"{tool}: {_version_line(out, needle)}" if code == 0 else f"{tool}: {out}")


FAULT_VERDICTS = ("DEVICE_FAULT", "CRASHED", "TIMEOUT", "OUT_OF_MEMORY", "RESOURCE_LIMIT")
RECENT_JOBS = 200


def check_service(
    r: Report,
    address: str,
    admin_token: str | None,
    timeout: float,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    from kerneleval import errors
    from kerneleval.client import Client
    from kerneleval.render import devices_table, job_summary, sandbox_lines, verdict_name

    s = r.section(f"service at {address}")
    with Client(address, timeout=timeout, admin_token=admin_token, credentials=credentials) as c:
        try:
            s.add("health", c.health())
        except errors.KernelEvalError as e:
            s.add("health", f"unreachable ({e.code.name}: {e.details})")
            return
        # Recent faults need no token: the last jobs whose kernel took its worker or GPU down.
        try:
            faults = [
                j
                for j in c.list_jobs(limit=RECENT_JOBS, page_size=RECENT_JOBS)
                if verdict_name(j.result.verdict) in FAULT_VERDICTS
            ]
            s.add(f"faults in the last {RECENT_JOBS} jobs", str(len(faults)))
            for j in faults[:10]:
                s.add(f"  {j.job_id}", job_summary(j))
        except errors.KernelEvalError as e:
            s.add("jobs", f"{e.code.name}: {e.details}")
        if not c.admin_token:
            s.add("devices", "skipped (needs --admin-token or $KERNELEVAL_ADMIN_TOKEN)")
            s.add("sandbox", "skipped (needs --admin-token or $KERNELEVAL_ADMIN_TOKEN)")
            return
        try:
            devices = c.list_devices()
            s.lines.append("```")
            s.lines.extend(devices_table(devices).splitlines())
            s.lines.append("```")
            for d in devices:
                for x in d.recent_xids[-5:]:
                    s.add(
                        f"recent XID on {d.index}",
                        f"{x.xid} ({x.category}) -> {x.action} {x.message}".rstrip(),
                    )
            st = c.get_stats()
            s.add(
                "stats",
                f"queue {st.queue_depth}, faults {st.fault_count}, worker restarts "
                f"{st.worker_restart_count}, resets {st.gpu_reset_count}, XIDs {st.xid_count}",
            )
            # What the host refused the job processes' sandbox (issue 12): never silent.
            for key, value in sandbox_lines(st):
                s.add(key, value)
        except errors.KernelEvalError as e:
            s.add("operations", f"{e.code.name}: {e.details}")


def run_doctor(
    address: str | None,
    admin_token: str | None,
    timeout: float,
    *,
    checks: Sequence[Callable[[Report], None]] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Report:
    r = Report()
    for check in checks or (
        check_host,
        check_nvidia_smi,
        check_nvml,
        check_python_stack,
        check_tools,
    ):
        try:
            check(r)
        except Exception as e:  # a report with a hole beats no report
            r.section(getattr(check, "__name__", "check")).add("error", repr(e))
    if address:
        try:
            check_service(r, address, admin_token, timeout, credentials)
        except Exception as e:
            r.section(f"service at {address}").add("error", repr(e))
    return r
