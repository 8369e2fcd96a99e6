"""GPU smoke run of the real zygote, runtime and engine (not collected by pytest; run as root on
a GPU host): python tests/jobproc/jp_gpu_smoke.py [N]

Starts the zygote with the real engine, asks it for N job processes (no cgroups; the watchdog
makes those), each warms up (CUDA, cuBLAS, Triton) and drops to nobody, then runs one torch
Model on the GPU. Prints spawn -> Hello times and the verdicts.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jp_helpers import ADD_MODEL, REPO, FakeWatchdog, start_zygote, wait_pid  # noqa: E402
from kerneleval.internal.v1 import job_channel_pb2 as jc  # noqa: E402
from kerneleval.internal.v1 import zygote_pb2  # noqa: E402
from kerneleval.v1 import job_pb2, kernel_pb2  # noqa: E402
from kerneleval_server.framing import encode, recv_frame  # noqa: E402
from kerneleval_server.jobproc import GATED_PHASES, sandbox  # noqa: E402


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    sandbox.set_child_subreaper(True)
    pythonpath = os.pathsep.join([str(REPO / "server"), str(REPO / "clients" / "python" / "src")])
    device_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
        "CUDA_VISIBLE_DEVICES": "0",
        "KERNELEVAL_DEVICE_INDEX": "0",
    }
    job_env = dict(device_env)
    job_env.update(
        {
            "TMPDIR": "/tmp",
            "HOME": "/tmp",
            "TRITON_CACHE_DIR": "/tmp/triton",
            "TORCH_EXTENSIONS_DIR": "/tmp/torch_extensions",
        }
    )
    t0 = time.monotonic()
    proc, sock = start_zygote(device_env)
    watchdog = FakeWatchdog(sock)
    config = zygote_pb2.ZygoteConfig(
        uid=65534,
        gid=65534,
        tmp_bytes=1 << 30,
        shm_bytes=256 << 20,
        job_env=job_env,
        max_open_files=4096,
        new_namespaces=True,
    )
    ready = watchdog.configure(config)
    print(f"zygote ready in {time.monotonic() - t0:.2f}s: {ready}".replace("\n", " "))
    ok = True
    for i in range(count):
        t1 = time.monotonic()
        spawned, channel = watchdog.spawn(f"w-{i}", [])
        t2 = time.monotonic()
        frame = recv_frame(channel)
        if frame is None:
            print(f"job process {i}: no Hello ({spawned})")
            print(f"exit {wait_pid(spawned.pid)}")
            ok = False
            continue
        hello = jc.JobProcessMessage.FromString(frame).hello
        t3 = time.monotonic()
        print(
            f"job process {i}: pid {spawned.pid}, spawned {1000 * (t2 - t1):.0f} ms, "
            f"Hello after {1000 * (t3 - t1):.0f} ms, device {hello.device.name!r}"
        )
        kernel = kernel_pb2.KernelSource(type=kernel_pb2.KERNEL_TYPE_TORCH, source_code=ADD_MODEL)
        spec = kernel_pb2.JobSpec(kernel=kernel)
        assign = jc.FrontendMessage(assign=jc.AssignJob(job_id=f"job-{i}", spec=spec, attempt=1))
        channel.sendall(encode(assign.SerializeToString()))
        while True:
            frame = recv_frame(channel)
            if frame is None:
                print("  channel closed before the outcome")
                ok = False
                break
            msg = jc.JobProcessMessage.FromString(frame)
            kind = msg.WhichOneof("kind")
            if kind == "phase" and msg.phase.phase in GATED_PHASES:
                grant = jc.GpuGrant(job_id=f"job-{i}", phase=msg.phase.phase)
                channel.sendall(encode(jc.FrontendMessage(grant=grant).SerializeToString()))
            elif kind == "log":
                print(f"  log: {msg.log.text[:200]}")
            elif kind == "outcome":
                result = msg.outcome.result
                print(
                    f"  verdict {job_pb2.Verdict.Name(result.verdict)} after "
                    f"{1000 * (time.monotonic() - t3):.0f} ms {result.error.message[:300]}"
                )
                ok = ok and result.verdict == job_pb2.VERDICT_OK
                break
        channel.close()
        print(f"  exit code {wait_pid(spawned.pid)}")
    sock.close()
    print(f"zygote exit {proc.wait(timeout=30)}")
    if proc.stderr is not None:
        sys.stdout.write(proc.stderr.read().decode(errors="replace")[-4000:])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
