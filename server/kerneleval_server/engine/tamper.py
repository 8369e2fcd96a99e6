"""Tampering with the engine's timing from inside the job process: refused where Python lets
us refuse it, detected where it does not.

A job process that imports a candidate's Python runs it beside the engine, and the candidate's
module body can rewrite anything Python can reach: `time.perf_counter_ns`, `timing.measure`,
`torch.cuda.Event.elapsed_time`, a function's `__code__`. Two defences, both armed once per
process by `arm()` right before any job code is imported (the runtime does it; it stays armed
until the process exits; `prepare()`, at the process's start, takes the snapshot beforehand so
that arming costs nothing on the job's path):

1. An audit hook (`install_audit_hook`, PEP 578: it cannot be removed once added) that, once
   armed, raises RuntimeError("tampering: ...") for these events:
   - gc.get_objects, gc.get_referrers, gc.get_referents: the way to find the engine's objects
     (the hook itself, the timing's locals) from code that holds no reference to them;
   - sys.settrace, sys.setprofile, sys._settraceallthreads, sys._setprofileallthreads (3.12),
     sys._current_frames: a tracer sees and rewrites every frame's locals, and every thread's
     frames lead to the engine's;
   - object.__setattr__ of `__code__`, `__defaults__` or `__kwdefaults__` on a function of the
     engine (its files) or one the timing relies on (the watched names below, torch.cuda.Event's
     methods included); of `__class__` on a watched module or on an instance of a watched class;
     of `__bases__` on a watched class;
   - ctypes.dlsym, ctypes.dlsym/handle of a `Py*` name (the CPython C API through ctypes:
     PyFrame_LocalsToFast rewrites a running frame's locals), ctypes.PyObj_FromPtr.
   Measured on the CPU (torch eager models, a Triton kernel under the interpreter, a conv/bn/
   linear/softmax model, torch.compile): none of them raises any of these. ctypes.dlopen,
   ctypes.cdata (from_address), ctypes.addressof and ctypes.string_at are left alone: torch's
   inductor and NVML check use them, and so does timing.py (libcudart).
2. A snapshot, taken by `prepare()` (or `arm()`), of every name the timing relies on (time's
   and builtins' functions, the engine's timing, runner (with job_base, job_correctness and
   job_timing, the modules of its job's classes), integrity and tamper modules and their
   classes, the numpy and torch.cuda functions timing calls, job_pb2) and of those functions'
   code and defaults. `check_timers()` answers what differs now; the engine calls it right after
   the candidate's timed trials, and any difference means the time is not to be believed.

Not stopped (one process cannot stop it): code the candidate compiles (load_inline, a Triton or
CUDA kernel's host code, ctypes.memmove/ctypes.cast on addresses from id()) can rewrite any
byte of the process, this hook and snapshot included; and `sys._getframe`, which typing,
collections and torch call all the time, leads to the engine's frames and their locals.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import CodeType, FunctionType, ModuleType
from typing import Any

TIMER_TAMPERED = "timer_tampered"  # the IntegrityFlag rule of a job whose timing was rewritten
PREFIX = "tampering: "

# Modules whose every name is watched: the engine's own (nothing in them changes after import
# but timing._cudart, set on first use, and tamper._context, set by prepare() after its snapshot
# and read only by the arm() that turns the hook on: a later rebinding reaches nothing).
_ENGINE_MODULES = (
    "kerneleval_server.engine",
    "kerneleval_server.engine.timing",
    "kerneleval_server.engine.runner",
    # runner's _Job is built on a class of each (job_base.py says how)
    "kerneleval_server.engine.job_base",
    "kerneleval_server.engine.job_correctness",
    "kerneleval_server.engine.job_timing",
    "kerneleval_server.engine.integrity",
    "kerneleval_server.engine.tamper",
)
_CHANGING = frozenset(
    {
        ("kerneleval_server.engine.timing", "_cudart"),
        ("kerneleval_server.engine.tamper", "_context"),
    }
)
# Modules of which only the callables (and submodules) are watched, or only some names.
_LIBRARY_NAMES: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("time", None),
    ("builtins", None),
    ("kerneleval.v1.job_pb2", None),
    ("numpy", ("asarray", "median", "percentile", "float64")),
    ("torch", ("empty", "int8", "device")),
    ("torch.cuda", ("Event", "Stream", "synchronize", "current_stream", "_sleep", "_lazy_init")),
    ("torch._C", ("_cuda_synchronize", "_cuda_getCurrentStream", "_CudaEventBase")),
)
_LIBRARY_CLASSES = (("torch.cuda", "Event"),)

_Entry = tuple[str, dict[str, Any], str, Any]  # label, namespace, name, the value then
_Func = tuple[str, FunctionType, CodeType, Any, Any]  # label, function, code, defaults, kwdefaults
_Kind = tuple[str, Any, type, Any]  # label, module or class, its type then, a class's bases then
_Snapshot = tuple[tuple[_Entry, ...], tuple[_Func, ...], tuple[_Kind, ...]]
_MISSING = object()

_arm: Callable[[tuple[Any, ...]], None] | None = None
_context: tuple[Any, ...] = ()  # what the hook guards once armed (prepare)


def install_audit_hook() -> None:
    """Adds the hook, dormant until `arm()`. Idempotent. Its state lives only in its closure:
    once armed, no name in any module can turn it off."""
    global _arm
    if _arm is not None:
        return
    state: list[tuple[Any, ...]] = []  # the refusal context, once armed
    handle = [state]  # arm's only way to it, dropped once used

    def arm_once(context: tuple[Any, ...]) -> None:
        if handle:
            handle.pop().append(context)

    sys.addaudithook(_make_hook(state))
    _arm = arm_once


def _make_hook(state: list[tuple[Any, ...]]) -> Callable[[str, tuple[Any, ...]], None]:
    refused = frozenset(
        {
            "gc.get_objects",
            "gc.get_referrers",
            "gc.get_referents",
            "sys.settrace",
            "sys.setprofile",
            "sys._settraceallthreads",
            "sys._setprofileallthreads",
            "sys._current_frames",
            "ctypes.PyObj_FromPtr",
        }
    )
    inspected = frozenset({"object.__setattr__", "ctypes.dlsym", "ctypes.dlsym/handle"})
    function_attrs = frozenset({"__code__", "__defaults__", "__kwdefaults__"})

    # Everything the hook calls is bound here, not looked up in a module the candidate can
    # rewrite (builtins included), and it compares exact strs only: the hook must never run
    # the candidate's code (that code would find `state` in the hook's frame).
    def hook(
        event: str,
        args: tuple[Any, ...],
        *,
        _type: Any = type,
        _id: Any = id,
        _startswith: Any = str.startswith,
        _function: Any = FunctionType,
        _str: Any = str,
        _error: Any = RuntimeError,
        _prefix: str = PREFIX,
    ) -> None:
        if not state or _type(event) is not _str:
            return
        if event in refused:
            raise _error(_prefix + event + " is refused while job code runs")
        if event not in inspected:
            return
        roots, functions, classes, modules = state[0]
        if event != "object.__setattr__":  # ctypes.dlsym: (library or handle, name)
            for name in args[1:2]:
                if _type(name) is _str and _startswith(name, ("Py", "_Py")):
                    raise _error(_prefix + "the CPython C API through ctypes is refused")
            return
        obj, attr = args[0], args[1]
        if _type(attr) is not _str:
            return
        if _type(obj) is _function and attr in function_attrs:
            filename = obj.__code__.co_filename
            if _id(obj) in functions or (_type(filename) is _str and _startswith(filename, roots)):
                raise _error(_prefix + attr + " of an engine or timing function set")
        elif attr == "__class__" and (_id(obj) in modules or _id(_type(obj)) in classes):
            raise _error(_prefix + "__class__ of an engine or timing object set")
        elif attr == "__bases__" and _id(obj) in classes:
            raise _error(_prefix + "__bases__ of an engine or timing class set")

    return hook


def prepare() -> None:
    """Takes the snapshot `check_timers` compares with and what the hook will guard, with the
    hook still dormant: a job process does it as it starts, before it says it is ready, so that
    `arm()` on a job's path only turns the refusals on. Idempotent; only the engine's code may
    run between this and `arm()` (nothing it runs may rebind a watched name)."""
    global _context
    install_audit_hook()
    if _context:
        return
    snap = _snapshot()
    functions = frozenset(id(f[1]) for f in snap[1])
    classes = frozenset(id(k[1]) for k in snap[2] if k[3] is not None)
    modules = frozenset(id(m) for m in _watched_modules())
    # Set while not yet armed; once armed, the hook refuses a new __defaults__ here.
    check_timers.__defaults__ = (None, snap)
    _context = (_engine_roots(), functions, classes, modules)


def arm() -> None:
    """Turns the hook's refusals on (taking the snapshot first where `prepare()` did not): once
    a process, with no way back (a switch the engine could turn off, the candidate could too).
    Call it right before the first job code is imported, after everything the engine loads."""
    prepare()
    assert _arm is not None
    _arm(_context)  # a no-op once armed: the hook's state is set once


def check_timers(job: object = None, snapshot: _Snapshot | tuple[()] = (), /) -> list[str]:
    """What differs from the snapshot `arm()` took: names replaced or removed, functions whose
    code or defaults changed, modules or classes given another type or bases; with `job`, its
    instance attributes that hide its class's methods (those it inherits included). Empty when
    nothing changed (and when not armed). Bind it before job code runs (a default argument): a
    name looked up later is the candidate's to replace."""
    changed: list[str] = []
    if not snapshot:
        return changed
    entries, functions, types_ = snapshot
    for label, namespace, name, value in entries:
        now = namespace.get(name, _MISSING)
        if now is not value:
            changed.append(f"{label}.{name} was {'removed' if now is _MISSING else 'replaced'}")
    for label, fn, code, defaults, kwdefaults in functions:
        if fn.__code__ is not code:
            changed.append(f"{label}: its code was replaced")
        same = defaults is ... or fn.__defaults__ is defaults
        if not same or _kwdefaults(fn) != kwdefaults:
            changed.append(f"{label}: its default arguments were changed")
    for label, obj, kind, bases in types_:
        if type(obj) is not kind:
            changed.append(f"{label}: its type was changed")
        if bases is not None and obj.__bases__ != bases:
            changed.append(f"{label}: its base classes were changed")
    if job is not None:
        # runner._Job's methods are defined on the classes it is built on (job_base.py)
        methods = {name for kind in type(job).__mro__[:-1] for name in vars(kind)}
        hidden = sorted(k for k in getattr(job, "__dict__", {}) if k in methods)
        changed.extend(
            f"{type(job).__name__}.{k} is hidden by an instance attribute" for k in hidden
        )
    return changed


def message(changed: list[str]) -> str:
    """The error message (and flag text) of a job whose timing was rewritten."""
    shown = "; ".join(changed[:5]) + (f"; and {len(changed) - 5} more" if len(changed) > 5 else "")
    return f"{PREFIX}the timing was rewritten while the job ran ({shown}): its time is not measured"


def _kwdefaults(fn: FunctionType) -> Any:
    kw = fn.__kwdefaults__
    return None if kw is None else tuple((k, id(v)) for k, v in kw.items())


def _watched_modules() -> list[ModuleType]:
    names = [*_ENGINE_MODULES, *(name for name, _ in _LIBRARY_NAMES)]
    return [m for m in (sys.modules.get(n) for n in names) if isinstance(m, ModuleType)]


def _engine_roots() -> tuple[str, ...]:
    roots = []
    for name in ("kerneleval_server", "kerneleval"):
        module = sys.modules.get(name)
        for path in getattr(module, "__path__", None) or ():
            roots.append(os.path.join(os.path.realpath(path), ""))
            roots.append(os.path.join(path, ""))
    return tuple(dict.fromkeys(roots))


def _snapshot() -> _Snapshot:
    entries: list[_Entry] = []
    functions: dict[int, _Func] = {}
    types_: list[_Kind] = []

    def watch(label: str, namespace: dict[str, Any], names: Any, everything: bool) -> None:
        for name, value in list(namespace.items()):
            if names is not None and name not in names:
                continue
            if not everything and not (callable(value) or isinstance(value, ModuleType)):
                continue
            entries.append((label, namespace, name, value))
            for fn in _functions_of(value):
                # check_timers's defaults are set after this (and the hook guards them): "..."
                defaults = ... if fn is check_timers else fn.__defaults__
                entry = (f"{label}.{name}", fn, fn.__code__, defaults, _kwdefaults(fn))
                functions.setdefault(id(fn), entry)

    classes: list[tuple[str, type]] = []
    for module_name in _ENGINE_MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        types_.append((module_name, module, type(module), None))
        ns = vars(module)
        keep = {k: v for k, v in ns.items() if (module_name, k) not in _CHANGING}
        watch(module_name, ns, keep, everything=True)
        classes += [
            (f"{module_name}.{k}", v)
            for k, v in keep.items()
            if isinstance(v, type) and v.__module__ == module_name
        ]
    for module_name, names in _LIBRARY_NAMES:
        module = sys.modules.get(module_name)
        if module is not None:
            types_.append((module_name, module, type(module), None))
            watch(module_name, vars(module), names, everything=False)
    for module_name, name in _LIBRARY_CLASSES:
        cls = getattr(sys.modules.get(module_name), name, None)
        if isinstance(cls, type):
            classes.append((f"{module_name}.{name}", cls))
    for label, cls in classes:
        types_.append((label, cls, type(cls), cls.__bases__))
        watch(label, cls.__dict__, None, everything=True)  # type: ignore[arg-type]
    return tuple(entries), tuple(functions.values()), tuple(types_)


def _functions_of(value: Any) -> list[FunctionType]:
    """The Python functions a namespace entry runs: itself, or what it wraps or holds."""
    found: list[FunctionType] = []
    for v in (
        value,
        getattr(value, "__func__", None),  # staticmethod, classmethod
        getattr(value, "fget", None),  # property
        getattr(value, "fset", None),
    ):
        while isinstance(v, FunctionType) and all(v is not f for f in found):
            found.append(v)
            v = v.__dict__.get("__wrapped__")  # contextmanager, functools.wraps
    return found
