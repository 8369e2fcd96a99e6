"""engine/tamper.py in this process, never armed (arming is for the rest of a process: the
armed suite runs in children, tests/security/test_timing_tamper.py): the snapshot and
check_timers, the hook's decisions called directly, and timing.py's primitives bound at import."""

from __future__ import annotations

import gc
import sys
import time

import pytest
import torch
from kerneleval_server.engine import runner, tamper, timing


@pytest.fixture(scope="module")
def snapshot():  # type: ignore[no-untyped-def]
    return tamper._snapshot()


def test_nothing_changed_reports_nothing(snapshot) -> None:
    assert tamper.check_timers(None, snapshot) == []
    assert tamper.check_timers() == []  # not armed: nothing to compare with


def test_replaced_clocks_and_engine_names_are_reported(snapshot, monkeypatch) -> None:
    monkeypatch.setattr(time, "perf_counter_ns", lambda: 0)
    monkeypatch.setattr(timing, "measure", lambda *a, **k: None)
    monkeypatch.setattr(timing, "L2_FLUSH_BYTES", 0)  # no flush: a warm L2 for the kernel
    monkeypatch.setattr(torch.cuda.Event, "elapsed_time", lambda self, end: 0.001)
    monkeypatch.delattr(timing.CudaOps, "flush")
    changed = tamper.check_timers(None, snapshot)
    assert "time.perf_counter_ns was replaced" in changed
    assert "kerneleval_server.engine.timing.measure was replaced" in changed
    assert "kerneleval_server.engine.timing.L2_FLUSH_BYTES was replaced" in changed
    assert "torch.cuda.Event.elapsed_time was replaced" in changed
    assert "kerneleval_server.engine.timing.CudaOps.flush was removed" in changed
    assert len(changed) == 5
    assert tamper.message(changed).startswith("tampering: the timing was rewritten")


def test_code_defaults_and_module_types_are_compared(snapshot, monkeypatch) -> None:
    def other(times_ms, source, *, flushed):  # type: ignore[no-untyped-def]
        return None

    monkeypatch.setattr(timing.stats, "__code__", other.__code__)
    monkeypatch.setattr(timing._warm_up, "__defaults__", (0,))
    monkeypatch.setattr(timing, "__class__", type("Sneaky", (type(timing),), {}))
    changed = tamper.check_timers(None, snapshot)
    assert "kerneleval_server.engine.timing.stats: its code was replaced" in changed
    assert "kerneleval_server.engine.timing._warm_up: its default arguments were changed" in (
        changed
    )
    assert "kerneleval_server.engine.timing: its type was changed" in changed


def test_an_instance_attribute_hiding_a_method_is_reported(snapshot) -> None:
    job = object.__new__(runner._Job)
    assert tamper.check_timers(job, snapshot) == []
    job._measure = lambda *a, **k: None  # type: ignore[method-assign]
    assert tamper.check_timers(job, snapshot) == [
        "_Job._measure is hidden by an instance attribute"
    ]


def _context(snapshot) -> tuple:  # type: ignore[no-untyped-def,type-arg]
    functions = frozenset(id(f[1]) for f in snapshot[1])
    classes = frozenset(id(k[1]) for k in snapshot[2] if k[3] is not None)
    return (tamper._engine_roots(), functions, classes, frozenset({id(timing)}))


def test_the_armed_hook_refuses_what_reaches_the_timing(snapshot) -> None:
    hook = tamper._make_hook([_context(snapshot)])

    def own() -> None:
        pass

    refused = [
        ("gc.get_objects", (None,)),
        ("gc.get_referrers", ()),
        ("gc.get_referents", ()),
        ("sys.settrace", ()),
        ("sys.setprofile", ()),
        ("sys._current_frames", ()),
        ("object.__setattr__", (timing.measure, "__code__", own.__code__)),
        ("object.__setattr__", (timing._warm_up, "__defaults__", (0,))),
        ("object.__setattr__", (tamper.check_timers, "__defaults__", (None, ()))),
        ("object.__setattr__", (torch.cuda.Event.elapsed_time, "__code__", own.__code__)),
        ("object.__setattr__", (timing, "__class__", type(timing))),
        ("object.__setattr__", (timing.Timing, "__bases__", (object,))),
        ("ctypes.dlsym", (None, "PyFrame_LocalsToFast")),
        ("ctypes.dlsym/handle", (0, "_PyObject_GetDictPtr")),
    ]
    for event, args in refused:
        with pytest.raises(RuntimeError, match="^tampering: "):
            hook(event, args)
    allowed = [
        ("object.__setattr__", (own, "__code__", own.__code__)),  # the candidate's own function
        ("object.__setattr__", (own, "__defaults__", ())),  # namedtuple does this
        ("object.__getattr__", (timing.measure, "__code__")),  # Triton reads code
        ("ctypes.dlsym", (None, "cudaDeviceGetLimit")),  # timing.py's libcudart calls
        ("ctypes.dlopen", ("libcudart.so.12",)),
        ("sys._getframe", (sys._getframe(),)),  # typing, collections, torch
        ("import", ("triton", None, [], [], ())),
    ]
    for event, args in allowed:
        hook(event, args)
    tamper._make_hook([])("gc.get_objects", ())  # dormant until armed


def test_timing_calls_what_it_bound_at_import(monkeypatch) -> None:
    event = torch.cuda.Event
    monkeypatch.setattr(time, "perf_counter_ns", lambda: 0)  # every span would read 0
    monkeypatch.setattr(event, "elapsed_time", lambda self, end: 0.001)
    monkeypatch.setattr(torch.cuda, "Event", object)
    t = timing.measure(
        lambda: time.sleep(0.002), trials=3, warmup=0, flush_l2=False, device=torch.device("cpu")
    )
    assert t.stats.min_ms >= 2.0
    assert timing._Event.elapsed_time is not event.elapsed_time  # torch's, as imported
    assert timing._Event.elapsed_time.__qualname__ == "Event.elapsed_time"
    assert issubclass(timing._Event, event)


def test_nothing_in_this_process_armed_it() -> None:
    gc.get_objects(0)  # the engine suite's own process must never be armed
