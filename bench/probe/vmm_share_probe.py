"""Probe (issue 13, large outputs): can a kernel's outputs reach its judge through GPU memory?

Today a compared kernel's outputs reach the judge process through a host record (a memfd,
--record-max-mib, 1 GiB): 47 of KernelBench's 100 level-1 problems have more and are judged in
the kernel's own process. GPU memory made with the CUDA driver's virtual memory API
(cuMemCreate) can be exported as a file descriptor (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
passed over a unix socket (SCM_RIGHTS, as the job channel passes descriptors) and imported by
another process. This probe answers, on the GPU machine, what such a design needs:
  1. export in one process, import in another, each in its own PID and IPC namespace (as job
     processes are): do the bytes arrive?
  2. the exporter exits first, its descriptor held only by a parent with no CUDA (as the front
     end would hold it): does the memory outlive the exporter?
  3. the cost: export, import and map, and a device-to-device copy of the imported memory.

    python3 bench/probe/vmm_share_probe.py [--mib 1024] [--out DIR]

Prints one JSON object (and writes <out>/vmm_share_probe_<isolation>.json). Needs `unshare`
(util-linux) and root or unprivileged user namespaces for the namespaces; without them it runs
the children in the parent's namespaces and says so.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
PATTERN = 0x5A17C0DE


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]  # fmt: skip


class AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", Location), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", AllocFlags)]  # fmt: skip


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


class Cuda:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", 0)
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), 0)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.prop = AllocationProp()
        self.prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.prop.location = Location(CU_MEM_LOCATION_TYPE_DEVICE, 0)

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(text))
            raise RuntimeError(f"{name}: {rc} {text.value.decode() if text.value else ''}")

    def granular(self, size: int) -> int:
        g = ctypes.c_size_t()
        self.call("cuMemGetAllocationGranularity", ctypes.byref(g), ctypes.byref(self.prop), 0)
        return (size + g.value - 1) // g.value * g.value

    def map(self, handle: ctypes.c_ulonglong, size: int) -> int:
        ptr = ctypes.c_ulonglong()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size),
                  ctypes.c_size_t(0), ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))  # fmt: skip
        self.call("cuMemMap", ptr, ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                  ctypes.c_ulonglong(0))  # fmt: skip
        desc = AccessDesc(
            Location(CU_MEM_LOCATION_TYPE_DEVICE, 0), CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        )
        self.call("cuMemSetAccess", ptr, ctypes.c_size_t(size), ctypes.byref(desc),
                  ctypes.c_size_t(1))  # fmt: skip
        return ptr.value


def exporter(sock_fd: int, size: int) -> dict[str, object]:
    """Makes `size` bytes of device memory, fills it with PATTERN, sends its descriptor."""
    t0 = time.perf_counter()
    cu = Cuda()
    size = cu.granular(size)
    handle = ctypes.c_ulonglong()
    cu.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(cu.prop),
            ctypes.c_ulonglong(0))  # fmt: skip
    ptr = cu.map(handle, size)
    cu.call("cuMemsetD32_v2", ctypes.c_ulonglong(ptr), ctypes.c_uint(PATTERN),
            ctypes.c_size_t(size // 4))  # fmt: skip
    cu.call("cuCtxSynchronize")
    t1 = time.perf_counter()
    fd = ctypes.c_int(-1)
    cu.call("cuMemExportToShareableHandle", ctypes.byref(fd), handle,
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_ulonglong(0))  # fmt: skip
    export_ms = (time.perf_counter() - t1) * 1e3
    sock = socket.socket(fileno=sock_fd)
    socket.send_fds(sock, [json.dumps({"size": size}).encode()], [fd.value])
    sock.recv(1)  # the parent has it: leave (the memory must now live on without us)
    return {"setup_ms": (t1 - t0) * 1e3, "export_ms": export_ms, "size": size}


def importer(fd: int, size: int) -> dict[str, object]:
    """Imports the descriptor, maps it, checks the pattern, copies it device to device."""
    cu = Cuda()
    t0 = time.perf_counter()
    handle = ctypes.c_ulonglong()
    cu.call("cuMemImportFromShareableHandle", ctypes.byref(handle), ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)  # fmt: skip
    ptr = cu.map(handle, size)
    import_ms = (time.perf_counter() - t0) * 1e3
    host = (ctypes.c_uint32 * 1024)()
    cu.call("cuMemcpyDtoH_v2", host, ctypes.c_ulonglong(ptr + size - 4096), ctypes.c_size_t(4096))
    ok = all(v == PATTERN for v in host)
    own = ctypes.c_ulonglong()
    cu.call("cuMemAlloc_v2", ctypes.byref(own), ctypes.c_size_t(size))
    cu.call("cuCtxSynchronize")
    t1 = time.perf_counter()
    cu.call("cuMemcpyDtoD_v2", own, ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
    cu.call("cuCtxSynchronize")
    copy_s = time.perf_counter() - t1
    return {"pattern_ok": ok, "import_map_ms": import_ms, "copy_ms": copy_s * 1e3,
            "copy_gb_s": size / copy_s / 1e9}  # fmt: skip


ISOLATION = ["--pid", "--ipc", "--mount", "--fork", "--mount-proc"]


def isolated(cmd: list[str]) -> tuple[list[str], str]:
    """`cmd` in PID, IPC and mount namespaces of its own (its own /proc, as a job process
    has) where this host allows it and --isolation says so."""
    if os.environ.get("VMM_PROBE_ISOLATION") == "none":
        return cmd, "the parent's namespaces (--isolation none)"
    unshare = shutil.which("unshare")
    if unshare is None:
        return cmd, "no unshare: the parent's namespaces"
    for extra in ([], ["--user", "--map-root-user"]):
        probe = subprocess.run([unshare, *extra, *ISOLATION, "true"], capture_output=True)
        if probe.returncode == 0:
            return [unshare, *extra, *ISOLATION, *cmd], "own " + " ".join(extra + ISOLATION)
    return cmd, f"unshare refused ({probe.stderr.decode()[-200:]}): the parent's namespaces"


def parent(mib: int) -> dict[str, object]:
    out: dict[str, object] = {}
    mine, theirs = socket.socketpair()
    cmd, where = isolated([sys.executable, __file__, "--role", "exporter",
                           "--fd", str(theirs.fileno()), "--mib", str(mib)])  # fmt: skip
    out["namespaces"] = where
    exp = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdout=subprocess.PIPE, text=True)
    theirs.close()
    msg, fds, _, _ = socket.recv_fds(mine, 4096, 1)
    if not fds:
        exp_out, _ = exp.communicate(timeout=60)
        out["error"] = f"no descriptor came; the exporter said: {exp_out.strip()[-800:]}"
        return out
    (fd,) = fds
    size = int(json.loads(msg)["size"])
    out["exporter_alive_import"] = run_importer(fd, size)
    mine.send(b"x")
    exp_out, _ = exp.communicate(timeout=60)
    out["exporter"] = json.loads(exp_out.strip().splitlines()[-1]) if exp_out.strip() else {}
    out["exporter_exit"] = exp.returncode
    time.sleep(0.5)
    out["after_exporter_exit_import"] = run_importer(fd, size)
    os.close(fd)
    return out


def run_importer(fd: int, size: int) -> dict[str, object]:
    cmd, _ = isolated([sys.executable, __file__, "--role", "importer", "--fd", str(fd),
                       "--size", str(size)])  # fmt: skip
    proc = subprocess.run(cmd, pass_fds=[fd], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-800:], "exit": proc.returncode}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--role", choices=("parent", "exporter", "importer"), default="parent")
    ap.add_argument("--fd", type=int, default=-1)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--size", type=int, default=0)
    ap.add_argument("--out", default="")
    ap.add_argument("--isolation", choices=("ns", "none"), default="ns")
    args = ap.parse_args()
    if args.isolation == "none":  # the children inherit it
        os.environ["VMM_PROBE_ISOLATION"] = "none"
    try:
        if args.role == "exporter":
            result = exporter(args.fd, args.mib << 20)
        elif args.role == "importer":
            result = importer(args.fd, args.size)
        else:
            result = parent(args.mib)
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        result = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result))
    if args.role == "parent" and args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        path = Path(args.out) / f"vmm_share_probe_{args.isolation}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
