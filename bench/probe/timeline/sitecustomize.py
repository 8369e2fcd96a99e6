"""Timeline probe hooks (bench/probe/timeline_probe.py): on PYTHONPATH, named functions
of the front end and of job processes record when they start and end (time.time_ns, so that
processes line up). The front end appends to $KE_TIMELINE_FE; a job process prints
"KE_TL <ns> <pid> <label>" lines to stderr (the watchdog puts them in the service's log).
Installed by an import hook: each module is patched as it is first imported, before any
snapshot a job process takes of its own code (engine/tamper.py)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import os
import sys
import threading
import time

WRAP = {
    # the front end
    "kerneleval_server.api.kernel_eval_service": [
        "KernelEvalService.Evaluate",
        "KernelEvalService._submit",
        "KernelEvalService._run_to_end",
    ],
    "kerneleval_server.jobs.manager": [
        "JobManager.submit",
        "JobManager.dispatch",
        "JobManager.start",
        "JobManager.on_outcome",
        "JobManager.finish",
        "JobManager._finish_outcome",
        "JobManager.mark_started",
    ],
    "kerneleval_server.jobs.intake": ["Intake.flag_late", "Intake.enqueue_or_wait"],
    "kerneleval_server.jobs.messages": ["JobProcessMessages.on_process_message"],
    "kerneleval_server.jobs.builds.paths": ["BuildPaths.built_earlier"],
    "kerneleval_server.jobs.endings": ["Endings.wait_finished"],
    "kerneleval_server.jobs.admission": ["Admission.cache_key"],
    "kerneleval_server.jobs.judging": [
        "Judges.start_ahead",
        "Judges.await_judge",
        "Judges.judged",
        "Judges._start",
        "Judges.on_ahead_message",
        "Judges.ahead_answered",
        "Judges._seal_and_queue",
        "Judges.start",
    ],
    "kerneleval_server.jobs.judge_record": ["Record.seal", "Record.make"],
    "kerneleval_server.jobs.gpu_use": [
        "GpuUse.ask",
        "GpuUse.ask_early",
        "GpuUse._send_grant",
        "GpuUse.admit",
    ],
    "kerneleval_server.jobs.store.base": [
        "SqlStore.insert",
        "SqlStore.update",
        "SqlStore.add_event",
        "SqlStore.get",
    ],
    "kerneleval_server.jobs.events": ["EventHub.publish"],
    "kerneleval_server.jobs.static_checks": ["check"],
    "kerneleval_server.fleet.job_processes": [
        "JobProcess.send",
        "JobProcess.assign",
        "JobProcess._send_with_fds",
    ],
    # job processes
    "kerneleval_server.jobproc.runtime": ["_run_one", "_judge_go", "_launch_only"],
    "kerneleval_server.jobproc.channel": ["_Reporter.phase", "_Reporter.let_go"],
    "kerneleval_server.jobproc.job_dirs": ["_job_dirs", "compile_cache_added"],
    "kerneleval_server.jobproc.hygiene": [
        "_clean_for_next_job",
        "_reset_peak_memory",
        "_peak_memory",
    ],
    # _Job's methods, wrapped on _Job: most are inherited from the classes it is built on
    # (engine/job_base.py, job_correctness.py, job_timing.py), under the same labels.
    "kerneleval_server.engine.runner": [
        "run_job",
        "_Job.__init__",
        "_Job.run",
        "_Job._build",
        "_Job._validate",
        "_Job._run",
        "_Job._record",
        "_Job._preflight_triton",
        "_Job._check_precision",
        "_Job._float64_ahead",
        "_Job._input_source",
        "_Job._record_trials",
        "_Job._judged_trial",
        "_Job._written_inputs",
        "_Job._poison_outputs",
        "_Job._output_names",
    ],
    "kerneleval_server.engine.judge": [
        "judge_job",
        "_Judge.judge",
        "_Judge._prepare_ahead",
        "_Judge._await_go",
        "_Judge._read",
    ],
    "kerneleval_server.engine.compare": ["compare_outputs"],
    "kerneleval_server.engine.record": ["Recorder.__init__", "Recorder.record", "read"],
    "kerneleval_server.engine.loader": ["import_source"],
    "kerneleval_server.engine.inputs": ["build_args"],
    "kerneleval_server.engine.integrity": ["aliasing"],
    "kerneleval_server.engine.backends.prebuilt": ["build_prebuilt"],
    "kerneleval_server.engine.device": ["device_info"],
    # Triton's first call of a kernel (names of triton 3.6; a missing one is reported)
    "triton.runtime.jit": [
        "JITFunction.run",
        "JITFunction._do_compile",
        "JITFunction.create_binder",
        "JITFunction.cache_key",
        "JITCallable.cache_key",
        "JITFunction.__init__",
    ],
    "triton.runtime.cache": ["FileCacheManager.get_group", "get_cache_manager"],
    "triton.runtime.build": ["compile_module_from_src"],
    "triton.compiler.compiler": [
        "compile",
        "ASTSource.hash",
        "CompiledKernel.__init__",
        "CompiledKernel._init_handles",
        "CompiledKernel.launch_metadata",
    ],
    "triton.backends.nvidia.driver": ["CudaLauncher.__init__", "CudaLauncher.__call__"],
}
KEEP_FD_MODULE = "kerneleval_server.jobproc.sandbox"

_FE_PATH = os.environ.get("KE_TIMELINE_FE", "")
# A job process's stderr is /dev/null (zygote.py): its records go to a copy of the zygote's
# stderr (the watchdog's log pipe) kept open through sandbox.keep_only_fd.
_JOB_FD = 200
_lock = threading.Lock()


_records: list[str] = []
_flush_at = 0.0


def rec(label: str) -> None:
    """Kept in memory, written 0.3 s after the last record (the probe paces its calls 0.5 s
    apart): writing each one as it comes cost the front end more than the work it timed
    (a job process's lines reach the service's log through the front end)."""
    # Job processes are PID 1 of their own namespaces: named by their worker id.
    global _flush_at
    who = os.environ.get("KERNELEVAL_WORKER_ID") or str(os.getpid())
    with _lock:
        _records.append(f"KE_TL {time.time_ns()} {who} {label}\n")
        start = _flush_at == 0.0
        _flush_at = time.monotonic() + 0.3
    if start:
        threading.Thread(target=_flusher, daemon=True).start()


def _flusher() -> None:
    global _flush_at
    while True:
        with _lock:
            wait = _flush_at - time.monotonic()
            if wait <= 0:
                lines, _records[:] = list(_records), []
                _flush_at = 0.0
                break
        time.sleep(wait)
    _write("".join(lines))


def _flush_before_exit() -> None:
    """The records of a job process that exits after this job (_run_one said so, after its
    outcome and cleanup): it would exit before the flusher's 0.3 s are up. Written 30 ms
    later: the front end logs each line (~1.4 ms for a job's), which would otherwise hold
    its event loop while the judge's outcome comes in, and delay the call timed."""
    time.sleep(0.03)
    with _lock:
        lines, _records[:] = list(_records), []
    _write("".join(lines))


def _write(text: str) -> None:
    if not text:
        return
    try:
        if _FE_PATH:
            with open(_FE_PATH, "a") as out:
                out.write(text)
        else:
            os.write(_JOB_FD, text.encode())
    except OSError:
        pass


def _detail(name: str, args: tuple) -> str:
    """What the call is about, for the few whose argument says it (frames, phases)."""
    try:
        if name in ("JobProcess.send",):
            return ":" + args[1].WhichOneof("kind")
        if name == "JobManager.on_process_message":
            return ":" + args[2].WhichOneof("kind")
        if name == "_Reporter.phase":
            return f":{args[1]}"
        if name == "_run_one":
            return ":judge" if args[2].HasField("judge") else ":kernel"
    except Exception:  # noqa: BLE001 - a probe
        pass
    return ""


def _wrap(owner: object, attr: str, name: str) -> None:
    raw = inspect.getattr_static(owner, attr)
    if isinstance(raw, (staticmethod, classmethod)):
        return
    if isinstance(raw, property) and raw.fget is not None:  # timed through its getter
        get = raw.fget

        def getter(self):  # type: ignore[no-untyped-def]
            rec(name + " >")
            try:
                return get(self)
            finally:
                rec(name + " <")

        setattr(owner, attr, property(getter, raw.fset, raw.fdel))
        return
    if not callable(raw):  # a cached_property or other descriptor: not timed
        sys.stderr.write(f"KE_TL_MISSING {name}\n")
        return
    fn = getattr(owner, attr)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def awrapper(*a, **k):  # type: ignore[no-untyped-def]
            label = name + _detail(name, a)
            rec(label + " >")
            try:
                return await fn(*a, **k)
            finally:
                rec(label + " <")

        setattr(owner, attr, awrapper)
        return

    @functools.wraps(fn)
    def wrapper(*a, **k):  # type: ignore[no-untyped-def]
        label = name + _detail(name, a)
        rec(label + " >")
        reusable = True
        try:
            out = fn(*a, **k)
            if name == "_run_one":
                reusable = bool(out[1])
            return out
        finally:
            rec(label + " <")
            if name == "_run_one" and not reusable:
                _flush_before_exit()

    setattr(owner, attr, wrapper)


def _patch(module: object, names: list[str]) -> None:
    for name in names:
        owner: object = module
        parts = name.split(".")
        try:
            for p in parts[:-1]:
                owner = getattr(owner, p)
            _wrap(owner, parts[-1], name)
        except AttributeError:
            sys.stderr.write(f"KE_TL_MISSING {name}\n")


def _keep_our_fd(module: object) -> None:
    real = module.keep_only_fd  # type: ignore[attr-defined]

    def keep_only_fd(fd, target=3, keep_stderr=False, also_keep=()):  # type: ignore[no-untyped-def]
        return real(fd, target, keep_stderr, (*also_keep, _JOB_FD))

    module.keep_only_fd = keep_only_fd  # type: ignore[attr-defined]


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, names: list[str]) -> None:
        self.inner, self.names = inner, names

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        return self.inner.create_module(spec)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        self.inner.exec_module(module)
        if module.__name__ == KEEP_FD_MODULE:
            _keep_our_fd(module)
        else:
            _patch(module, self.names)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname not in WRAP and fullname != KEEP_FD_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, WRAP.get(fullname, []))
        return spec


def _watch_the_loop() -> None:
    """The front end's event loop: when its waits for the selector end, and how many ready
    descriptors they returned (is it asleep, or busy, when a frame is late?)."""
    import selectors

    real = selectors.EpollSelector.select

    def select(self, timeout=None):  # type: ignore[no-untyped-def]
        rec(f"loop.wait > {timeout if timeout is None else round(timeout, 4)}")
        ready = real(self, timeout)
        rec(f"loop.wait < {len(ready)}")
        return ready

    selectors.EpollSelector.select = select  # type: ignore[method-assign]

    import asyncio.events

    run = asyncio.events.Handle._run

    def timed_run(self):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter_ns()
        run(self)
        took = time.perf_counter_ns() - t0
        if took > 100_000:  # a callback that held the loop for more than 0.1 ms
            owner = getattr(self._callback, "__self__", None)
            coro = owner.get_coro() if isinstance(owner, asyncio.Task) else None
            what = getattr(coro, "__qualname__", None) or str(self._callback)[:80]
            rec(f"loop.slow {took / 1e6:.3f} ms {what}")

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]


if _FE_PATH:
    _watch_the_loop()

# On PYTHONPATH only while probing: the front end (KE_TIMELINE_FE names its file) and every
# process of its job environment (main.job_env passes PYTHONPATH on, nothing else of ours).
sys.meta_path.insert(0, _Finder())
if not _FE_PATH:
    try:
        os.dup2(2, _JOB_FD, inheritable=True)
    except OSError:
        pass
