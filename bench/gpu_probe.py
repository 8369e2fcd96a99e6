"""Reads the facts of a GPU machine that the service depends on (run there once per session).

Prints versions, what the sandbox can use (kmsg, network namespaces, the nobody user), how
long torch takes to import and CUDA to start, and what an illegal-address fault looks like:
the exception text, the NVML XID event and the kernel log line.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time


def sh(cmd: str, timeout: float = 60) -> str:
    try:
        p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        return (p.stdout + p.stderr).strip()
    except subprocess.TimeoutExpired:
        return "timeout"


OOB = r"""
import time, torch, triton, triton.language as tl
@triton.jit
def k(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs + (1 << 34), tl.full((BLOCK,), 1.0, tl.float32))
x = torch.zeros(1024, device="cuda")
t0 = time.time()
try:
    k[(4,)](x, 1024, BLOCK=256); torch.cuda.synchronize()
    print("NO_ERROR")
except Exception as e:
    print("EXC", type(e).__name__, repr(str(e))[:600])
try:
    torch.manual_seed(0); torch.zeros(1, device="cuda") + 1; torch.cuda.synchronize()
    print("AFTER_OK")
except Exception as e:
    print("AFTER_EXC", repr(str(e))[:300])
print("FAULT_AT", t0)
"""

WATCH = r"""
import sys, time, pynvml as n
n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
s = n.nvmlEventSetCreate(); n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
print("READY", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        d = n.nvmlEventSetWait_v2(s, 500)
        print("XID", d.eventData, time.time(), flush=True)
    except n.NVMLError as e:
        if "Timeout" not in str(e) and "TIMEOUT" not in str(e).upper():
            print("WAITERR", e, flush=True); time.sleep(0.2)
"""


def main() -> None:
    facts: dict[str, object] = {}
    facts["python"] = sys.version
    names = "torch|triton|grpcio|protobuf|nvidia-ml-py|numpy|prometheus"
    facts["pip"] = sh(f"python3 -m pip list 2>/dev/null | grep -iE '^({names})'")
    query = "--query-gpu=driver_version,name,memory.total --format=csv"
    facts["nvidia_smi"] = sh(f"nvidia-smi -L; nvidia-smi {query}")
    facts["glibc"] = sh("ldd --version | head -1")
    facts["os"] = sh("head -2 /etc/os-release")
    facts["kmsg"] = sh("ls -l /dev/kmsg; timeout 2 head -3 /dev/kmsg; dmesg | tail -3")
    facts["nobody"] = sh("id nobody")
    facts["unshare_net"] = sh("unshare -n true && echo ok")
    facts["tools"] = {
        t: shutil.which(t) for t in ("nvcc", "ncu", "compute-sanitizer", "nvidia-smi")
    }
    facts["nvcc"] = sh("nvcc --version | tail -2")
    facts["libnvml"] = sh("ldconfig -p | grep -i nvidia-ml")
    t0 = time.time()
    sh("python3 -c 'import torch'")
    facts["import_torch_s"] = round(time.time() - t0, 2)
    t0 = time.time()
    sh("python3 -c 'import torch; torch.zeros(1, device=\"cuda\")'")
    facts["import_torch_cuda_s"] = round(time.time() - t0, 2)
    watcher = subprocess.Popen(
        [sys.executable, "-c", WATCH, "12"], stdout=subprocess.PIPE, text=True
    )
    assert watcher.stdout is not None
    facts["watcher"] = watcher.stdout.readline().strip()
    with open("/tmp/kerneleval_probe_oob.py", "w") as f:
        f.write(OOB)  # Triton needs its kernels in a file
    oob = subprocess.run(
        [sys.executable, "/tmp/kerneleval_probe_oob.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    facts["oob_stdout"] = oob.stdout[-1500:]
    facts["oob_stderr"] = oob.stderr[-800:]
    facts["oob_rc"] = oob.returncode
    out, _ = watcher.communicate(timeout=30)
    facts["xid_events"] = out
    facts["dmesg_after"] = sh("dmesg 2>&1 | grep -i xid | tail -3")
    print(json.dumps(facts, indent=1))
    outdir = os.environ.get("OUT")
    if outdir:
        with open(os.path.join(outdir, "probe.json"), "w") as f:
            json.dump(facts, f, indent=1)


if __name__ == "__main__":
    main()
