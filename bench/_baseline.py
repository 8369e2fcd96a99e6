"""The baselines, each run in a process of its own: what users do today without the service.

python bench/_baseline.py eval KERNEL.py REFERENCE.py [--perf N]
    import torch (and triton), build ModelNew/Model from the files, check against the
    reference on one set of inputs, optionally time N runs; prints one JSON line.
python bench/_baseline.py fork-server COUNT KERNEL.py REFERENCE.py [--perf N]
    import torch once (no CUDA in this parent), then fork one child per evaluation;
    prints the wall time of each child (fork to reaped) as JSON.
python bench/_baseline.py cuda-init
    time `import torch` and the creation of a CUDA context; prints JSON.
python bench/_baseline.py eager PROBLEM.py [--trials N] [--scale S]
    a KernelBench problem's eager time: CUDA events (L2 flushed) and do_bench medians.
python bench/_baseline.py eager-many PROBLEM.py... [--trials N] [--no-do-bench]
    the same for many problems in this one process (inputs made on the device).
python bench/_baseline.py launch PROBLEM.py [--forwards N]
    run forward N times and nothing else on the GPU (for ncu).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

T0 = time.perf_counter()


def load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def interpret_without_gpu() -> None:
    """As the engine does: without a GPU, Triton runs under its interpreter."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def evaluate(kernel: str, reference: str, perf: int) -> dict[str, Any]:
    """Build, check and (optionally) time, as a one-off evaluation script does."""
    import torch

    interpret_without_gpu()
    dev = device()
    ref_mod = load(reference, "ref_mod")
    new_mod = load(kernel, "new_mod")
    init = ref_mod.get_init_inputs() if hasattr(ref_mod, "get_init_inputs") else []
    torch.manual_seed(42)
    ref = ref_mod.Model(*init).to(dev)
    torch.manual_seed(42)
    cls = getattr(new_mod, "ModelNew", None) or new_mod.Model
    new = cls(*init).to(dev)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in ref_mod.get_inputs()]
    with torch.no_grad():
        want = ref(*inputs)
        got = new(*inputs)
        sync()
        ok = bool(torch.allclose(got, want, atol=1e-4, rtol=1e-4))
        times: list[float] = []
        if perf > 0:
            for _ in range(3):
                new(*inputs)
            sync()
            for _ in range(perf):
                t = time.perf_counter()
                new(*inputs)
                sync()
                times.append((time.perf_counter() - t) * 1e3)
    return {"ok": ok, "median_ms": statistics.median(times) if times else 0.0}


def fork_server(count: int, kernel: str, reference: str, perf: int) -> dict[str, Any]:
    import torch  # noqa: F401 - the point: imported once, before any fork

    # No CUDA call in the parent, not even torch.cuda.is_available(): it initialises the
    # driver, and a forked child could then not use CUDA at all.
    if not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        import triton  # noqa: F401
    except ImportError:
        pass
    walls: list[float] = []
    oks = 0
    for _ in range(count):
        r, w = os.pipe()
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                res = evaluate(kernel, reference, perf)
                os.write(w, b"1" if res["ok"] else b"0")
            except BaseException:  # noqa: BLE001 - a child reports by its exit code
                import traceback

                traceback.print_exc()
                code = 1
            os._exit(code)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        walls.append(time.perf_counter() - t)
        oks += got == b"1"
    return {"walls_s": walls, "ok_count": oks}


def cuda_init() -> dict[str, Any]:
    t = time.perf_counter()
    import torch

    imported = time.perf_counter()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    ctx = time.perf_counter()
    return {
        "import_torch_s": imported - t,
        "cuda_context_s": ctx - imported,
        "since_interpreter_start_s": ctx - T0,
        "cuda": torch.cuda.is_available(),
    }


def _problem(path: str, scale: float) -> tuple[Any, list[Any]]:
    import torch

    mod = load(path, "problem")
    if scale != 1.0:
        for name, value in list(vars(mod).items()):
            if isinstance(value, int) and not isinstance(value, bool) and value > 64:
                setattr(mod, name, max(1, int(value * scale)))
    init = mod.get_init_inputs() if hasattr(mod, "get_init_inputs") else []
    torch.manual_seed(42)
    dev = device()
    model = mod.Model(*init).to(dev)
    torch.manual_seed(42)
    inputs = [x.to(dev) if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]
    return model, inputs


def eager(path: str, trials: int, scale: float, use_do_bench: bool = True) -> dict[str, Any]:
    """The usual eager timing: CUDA events around each call, the L2 flushed before each."""
    import torch

    model, inputs = _problem(path, scale)
    out: dict[str, Any] = {"device": str(device())}
    with torch.no_grad():
        for _ in range(3):
            model(*inputs)
        sync()
        times = []
        if torch.cuda.is_available():
            flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
            for _ in range(trials):
                flush.zero_()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                model(*inputs)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            # As the judge times a reference (engine/judge.py _calls): the flush waited for,
            # then the call on an idle GPU. A launch-bound model reads slower so than with
            # the loop above or do_bench, whose flush, not waited for, lets the host queue
            # the call's first launches while it runs.
            synced = []
            for _ in range(trials):
                flush.zero_()
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                model(*inputs)
                end.record()
                end.synchronize()
                synced.append(start.elapsed_time(end))
            out["synced_median_ms"] = statistics.median(synced)
            if use_do_bench:
                import triton.testing

                out["do_bench_median_ms"] = float(
                    triton.testing.do_bench(lambda: model(*inputs), return_mode="median")
                )
        else:
            for _ in range(trials):
                t = time.perf_counter()
                model(*inputs)
                times.append((time.perf_counter() - t) * 1e3)
    out["events_median_ms"] = statistics.median(times)
    out["trials"] = trials
    return out


def eager_many(paths: list[str], trials: int, use_do_bench: bool) -> dict[str, Any]:
    """Each problem's eager time in this one process; a failing problem is reported."""
    import torch

    out: dict[str, Any] = {}
    for path in paths:
        t = time.perf_counter()
        try:
            with torch.device(device()):
                res = eager(path, trials, 1.0, use_do_bench)
        except Exception as e:  # noqa: BLE001 - reported per problem
            res = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["wall_s"] = time.perf_counter() - t
        out[path] = res
        # One line per problem, so that a caller that runs out of time keeps what is done.
        print("BASELINE_ITEM " + json.dumps({"path": path, **res}), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def launch(path: str, forwards: int, scale: float) -> dict[str, Any]:
    import torch

    model, inputs = _problem(path, scale)
    with torch.no_grad():
        for _ in range(forwards):
            model(*inputs)
    sync()
    return {"forwards": forwards}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("eval")
    e.add_argument("kernel")
    e.add_argument("reference")
    e.add_argument("--perf", type=int, default=0)
    f = sub.add_parser("fork-server")
    f.add_argument("count", type=int)
    f.add_argument("kernel")
    f.add_argument("reference")
    f.add_argument("--perf", type=int, default=0)
    sub.add_parser("cuda-init")
    g = sub.add_parser("eager")
    g.add_argument("problem")
    g.add_argument("--trials", type=int, default=20)
    g.add_argument("--scale", type=float, default=1.0)
    m = sub.add_parser("eager-many")
    m.add_argument("problems", nargs="+")
    m.add_argument("--trials", type=int, default=20)
    m.add_argument("--no-do-bench", action="store_true")
    la = sub.add_parser("launch")
    la.add_argument("problem")
    la.add_argument("--forwards", type=int, default=3)
    la.add_argument("--scale", type=float, default=1.0)
    a = ap.parse_args()
    if a.cmd == "eval":
        res = evaluate(a.kernel, a.reference, a.perf)
    elif a.cmd == "fork-server":
        res = fork_server(a.count, a.kernel, a.reference, a.perf)
    elif a.cmd == "cuda-init":
        res = cuda_init()
    elif a.cmd == "eager-many":
        res = eager_many(a.problems, a.trials, not a.no_do_bench)
    elif a.cmd == "eager":
        res = eager(a.problem, a.trials, a.scale)
    else:
        res = launch(a.problem, a.forwards, a.scale)
    print("BASELINE_JSON " + json.dumps(res), flush=True)


def parse_items(stdout: str) -> dict[str, dict[str, Any]]:
    """The per-problem lines of eager-many, by path."""
    out: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        if line.startswith("BASELINE_ITEM "):
            item = dict(json.loads(line[len("BASELINE_ITEM ") :]))
            out[str(item.pop("path"))] = item
    return out


def parse_output(stdout: str) -> dict[str, Any]:
    """The JSON line a baseline process printed."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("BASELINE_JSON "):
            return dict(json.loads(line[len("BASELINE_JSON ") :]))
    raise ValueError("no BASELINE_JSON line in:\n" + stdout[-2000:])


HERE = Path(__file__).resolve()

if __name__ == "__main__":
    main()
